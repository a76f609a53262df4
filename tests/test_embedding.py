import numpy as np
import pytest

import cukernels as ck
from helpers import DTYPES, TOL, assert_close, device_copy, poisoned, randn, to_host


def dev0(v, dtype):
    """A 0-d device array (helpers.device_copy goes through np.ascontiguousarray, which makes 0-d arrays 1-d)."""
    import cupy

    return cupy.asarray(np.asarray(v, dtype=dtype))


def f64_backward(ids, dout, V):
    """Independent float64 formula: a plain loop over positions."""
    D = dout.shape[-1]
    g = np.zeros((V, D))
    for p, v in enumerate(ids.reshape(-1)):
        g[v] += dout.reshape(-1, D)[p].astype(np.float64)
    return g


# ---------------------------------------------------------------- CPU: the reference
@pytest.mark.parametrize("idt", [np.int32, np.int64])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (2, 5), (2, 3, 4)])
def test_reference_forward(rng, idt, shape):
    V, D = 11, 6
    table = randn(rng, (V, D), np.float32)
    ids = rng.integers(0, V, shape).astype(idt)
    y = ck.embedding(ids, table)
    assert y.shape == shape + (D,) and y.dtype == np.float32
    for idx in np.ndindex(shape):
        np.testing.assert_array_equal(y[idx], table[ids[idx]])


def test_reference_backward_matches_f64_and_finite_differences(rng):
    V, D = 5, 3
    ids = np.array([[0, 3, 3], [1, 3, 0]], np.int64)
    table = rng.standard_normal((V, D))
    dout = rng.standard_normal((2, 3, D))
    g = ck.embedding_backward(ids, dout.astype(np.float32), V)
    assert g.dtype == np.float32 and g.shape == (V, D)
    np.testing.assert_allclose(g, f64_backward(ids, dout, V), rtol=1e-6, atol=1e-6)
    # d/dtable of sum(embedding(ids, table) * dout), by central differences
    h = 1e-6
    fd = np.zeros_like(table)
    for i in np.ndindex(table.shape):
        tp, tm = table.copy(), table.copy()
        tp[i] += h
        tm[i] -= h
        fd[i] = ((tp[ids] * dout).sum() - (tm[ids] * dout).sum()) / (2 * h)
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-6)
    assert not g[2].any() and not g[4].any()  # untouched rows are zero


def test_reference_backward_accumulate_and_out_dtype(rng):
    V, D = 6, 4
    ids = rng.integers(0, V, (9,)).astype(np.int32)
    dout = randn(rng, (9, D), np.float32)
    base = randn(rng, (V, D), np.float32)
    out = base.copy()
    r = ck.embedding_backward(ids, dout, V, out=out, accumulate=True)
    assert r is out
    np.testing.assert_allclose(out, base + f64_backward(ids, dout, V), rtol=1e-6, atol=1e-6)
    ob = np.full((V, D), np.nan, dtype=ck.bfloat16)
    rb = ck.embedding_backward(ids, dout, V, out=ob)
    assert rb.dtype == ck.bfloat16
    np.testing.assert_allclose(rb.astype(np.float64), f64_backward(ids, dout, V), rtol=2**-8, atol=1e-6)


def test_reference_out_of_range_raises():
    table = np.zeros((4, 2), np.float32)
    with pytest.raises(IndexError, match="ids: value 4 is out of range"):
        ck.embedding(np.array([0, 4], np.int32), table)
    with pytest.raises(IndexError, match="ids: value -1 is out of range"):
        ck.embedding(np.array([-1], np.int64), table)
    with pytest.raises(IndexError, match="ids"):
        ck.embedding_backward(np.array([5], np.int32), np.zeros((1, 2), np.float32), 4)
    with pytest.raises(IndexError, match="ids"):
        ck.SparseRowGrad(4, 2, xp=np).accumulate(np.array([9], np.int32), np.zeros((1, 2), np.float32))


def _sparse_steps(xp, rng, V, D, calls, dtype=np.float32, dout_dtype=np.float32, conv=lambda a: a):
    """Run `calls` accumulate() calls on a SparseRowGrad; return it plus the host ids/douts used."""
    g = ck.SparseRowGrad(V, D, dtype, xp=xp)
    hist = []
    for n in calls:
        ids = rng.integers(0, min(V, 9), n).astype(np.int32) * (V // 9 if V >= 9 else 1)  # repeats + spread rows
        dout = randn(rng, (n, D), dout_dtype)
        g.accumulate(conv(ids), conv(dout))
        hist.append((ids, dout))
    return g, hist


def _check_sparse(g, hist, V, D, rtol=1e-5, atol=1e-5):
    ids = np.concatenate([h[0] for h in hist])
    dout = np.concatenate([h[1] for h in hist])
    dense = f64_backward(ids, dout, V)
    grad = to_host(g.grad).astype(np.float64)
    touched = np.unique(ids)
    np.testing.assert_allclose(grad[touched], dense[touched], rtol=rtol, atol=atol)
    rest = np.setdiff1d(np.arange(V), touched)
    assert not grad[rest].any(), "rows never touched must stay zero"
    c = int(to_host(g.count))
    rows = to_host(g.rows)[:c]
    assert c == touched.size and np.array_equal(np.sort(rows), touched), "each touched row listed exactly once"


def test_reference_sparse_rows(rng):
    V, D = 50, 4
    g, hist = _sparse_steps(np, rng, V, D, [7, 12, 1])
    _check_sparse(g, hist, V, D)
    # zero() clears only the listed rows: a value planted in an unlisted row survives it
    g.grad[1] = 3.0
    g.zero()
    assert int(g.count) == 0 and int(g.generation) == 2
    assert np.all(g.grad[1] == 3.0) and not np.delete(g.grad, 1, axis=0).any()
    g.grad[1] = 0
    g2, hist2 = _sparse_steps(np, rng, V, D, [5])
    g.accumulate(hist2[0][0], hist2[0][1])
    _check_sparse(g, hist2, V, D)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ck.embedding(np.zeros(3, np.float32), np.zeros((4, 2), np.float32)), TypeError, "ids: expected dtype"),
        (lambda: ck.embedding(np.zeros(3, np.int32), np.zeros(4, np.float32)), ValueError, r"table: expected shape \(V, D\)"),
        (lambda: ck.embedding(np.zeros(3, np.int32), np.zeros((4, 2), np.float64)), TypeError, "table: expected dtype"),
        (lambda: ck.embedding(np.zeros(3, np.int32), np.zeros((4, 2), np.float32), out=np.zeros((3, 3), np.float32)), ValueError, "out: expected shape"),
        (lambda: ck.embedding(np.zeros((4, 2), np.int32).T, np.zeros((4, 2), np.float32)), ValueError, "ids: expected a C-contiguous"),
        (lambda: ck.embedding([1, 2], np.zeros((4, 2), np.float32)), TypeError, "ids: expected a numpy.ndarray"),
        (lambda: ck.embedding_backward(np.zeros(3, np.int32), np.zeros((3, 2), np.float32), 0), ValueError, "vocab_size"),
        (lambda: ck.embedding_backward(np.zeros(3, np.int32), np.zeros((4, 2), np.float32), 4), ValueError, "dout: expected shape"),
        (lambda: ck.embedding_backward(np.zeros(3, np.int32), np.zeros((3, 2), np.float32), 4, accumulate=True), ValueError, "accumulate=True"),
        (lambda: ck.embedding_backward(np.zeros(3, np.int32), np.zeros((3, 2), np.float32), 4, out=np.zeros((4, 3), np.float32)), ValueError, "out: expected shape"),
        (lambda: ck.embedding_backward(np.zeros(3, np.int32), np.zeros((3, 2), np.float32), 4, out=np.zeros((4, 2), np.float64)), TypeError, "out: expected dtype"),
        (lambda: ck.SparseRowGrad(4, 2, xp=np).accumulate(np.zeros(3, np.int32), np.zeros((3, 5), np.float32)), ValueError, "dout: expected last dimension 2"),
        (lambda: ck.SparseRowGrad(4, 2, np.float64, xp=np), TypeError, "dtype"),
        (lambda: ck.SparseRowGrad(0, 2, xp=np), ValueError, "vocab_size"),
    ],
)
def test_bad_input_messages(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ---------------------------------------------------------------- GPU
DIMS = [1, 3, 8, 127, 1000, 2048, 4097]


@pytest.mark.gpu
@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_forward_matches_reference(rng, D, dtype, misalign):
    V = 301
    table = randn(rng, (V, D), dtype)
    for shape, idt in (((0,), np.int32), ((1,), np.int64), ((3, 67), np.int32), ((199,), np.int64)):
        ids = rng.integers(0, V, shape).astype(idt)
        ref = ck.embedding(ids, table)
        out = poisoned(shape + (D,), dtype, misalign)
        err = dev0(0, np.int32)
        y = ck.embedding(device_copy(ids, misalign), device_copy(table, misalign), out=out, error=err)
        assert y is out
        assert np.array_equal(to_host(y).view(np.uint8), ref.view(np.uint8)), "a gather must be exact"
        assert int(to_host(err)) == 0


@pytest.mark.gpu
def test_gpu_out_of_range_ids_are_clamped_and_flagged(rng):
    V, D = 10, 16
    table = randn(rng, (V, D), np.float32)
    ids = np.array([3, -5, 10, 2**40, 9], np.int64)
    err = dev0(0, np.int32)
    y = to_host(ck.embedding(device_copy(ids), device_copy(table), error=err))
    assert int(to_host(err)) == 1
    np.testing.assert_array_equal(y, table[np.clip(ids, 0, V - 1)])
    # the module-level word when none is passed
    ck.embedding_error().fill(0)
    ck.embedding(device_copy(ids[:1]), device_copy(table))
    assert int(ck.embedding_error()) == 0
    ck.embedding(device_copy(ids), device_copy(table))
    assert int(ck.embedding_error()) == 1
    ck.embedding_error().fill(0)
    # backward clamps too (the gradient lands on rows 0 and V-1) and flags
    err.fill(0)
    dout = randn(rng, (5, D), np.float32)
    g = to_host(ck.embedding_backward(device_copy(ids), device_copy(dout), V, error=err))
    assert int(to_host(err)) == 1
    np.testing.assert_allclose(g, f64_backward(np.clip(ids, 0, V - 1), dout, V), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [1, 3, 127, 1000, 2048, 4097])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("odtype", DTYPES, ids=["out_f32", "out_bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_backward_matches_reference(rng, D, dtype, odtype, misalign):
    V = 1000
    n = 199 if D <= 2048 else 57
    ids = rng.integers(0, V // 4, (n,)).astype(np.int32) * 4  # repeats, untouched rows between
    dout = randn(rng, (n, D), dtype)
    base = randn(rng, (V, D), odtype)
    ref = ck.embedding_backward(ids, dout, V, out=np.zeros((V, D), odtype))
    ref_acc = ck.embedding_backward(ids, dout, V, out=base.copy(), accumulate=True)
    idd, dod = device_copy(ids, misalign), device_copy(dout, misalign)
    out = poisoned((V, D), odtype, misalign)
    g = ck.embedding_backward(idd, dod, V, out=out)
    assert g is out
    assert_close(g, ref, odtype, rtol=max(TOL[np.dtype(odtype)][0], 1e-5), what="dtable")
    acc = device_copy(base, misalign)
    ck.embedding_backward(idd, dod, V, out=acc, accumulate=True)
    assert_close(acc, ref_acc, odtype, rtol=max(TOL[np.dtype(odtype)][0], 1e-5), what="dtable accumulate")


@pytest.mark.gpu
@pytest.mark.parametrize("V", [1, 3, 256, 257, 70000])
def test_gpu_backward_vocab_sizes_and_int64(rng, V):
    D, n = 64, 5000  # > 2 radix tiles; V=257 and 70000 need 2 and 3 sort passes
    ids = rng.integers(0, V, (n,)).astype(np.int64)
    dout = randn(rng, (n, D), np.float32)
    g = to_host(ck.embedding_backward(device_copy(ids), device_copy(dout), V))
    # fp32 adds in position order, like np.add.at: equal to the reference up to fp32 rounding
    np.testing.assert_allclose(g, ck.embedding_backward(ids, dout, V), rtol=1e-5, atol=1e-5)
    assert g.dtype == np.float32 and g.shape == (V, D)


@pytest.mark.gpu
def test_gpu_backward_deterministic_with_heavy_repeats(rng):
    V, D, n = 50000, 512, 20000
    ids = rng.integers(0, 3, (n,)).astype(np.int32) * 7919  # three ids, ~6700 positions each
    ids[::97] = rng.integers(0, V, ids[::97].shape)
    dout = device_copy(randn(rng, (n, D), np.float32, scale=10.0))
    idd = device_copy(ids)
    g1 = to_host(ck.embedding_backward(idd, dout, V))
    g2 = to_host(ck.embedding_backward(idd, dout, V))
    assert np.array_equal(g1.view(np.uint32), g2.view(np.uint32)), "dense backward must be bit-identical"
    np.testing.assert_allclose(g1, f64_backward(ids, to_host(dout), V), rtol=1e-4, atol=1e-2)


def _owner_case(rng, case):
    """(V, D, ids) for the row-owner dense backward (emb_run_starts + emb_bwd_dense)."""
    if case == "uniform":
        V, D = 5000, 200
        ids = rng.integers(0, V, (3000,))
    elif case == "one_id":  # one run of every position; every other row (before and after it) is zeros
        V, D = 300, 64
        ids = np.full(4000, V // 2)
    elif case == "edges":  # the first and last rows, long gaps of untouched rows between
        V, D = 1000, 136
        ids = rng.choice(np.array([0, V - 1, 1, 517]), 50)
    else:  # "wide_row": rows longer than one pass of TPR x 4 packs (the per-thread chunk loop runs 2-3 times)
        V, D = 40, 33008
        ids = rng.integers(0, V // 2, (20,)) * 2
    return V, D, ids.astype(np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["uniform", "one_id", "edges", "wide_row"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("odtype", DTYPES, ids=["out_f32", "out_bf16"])
def test_gpu_dense_backward_row_owner(rng, case, dtype, odtype):
    """The dense backward writes every table row itself (no memset): untouched rows of a NaN-poisoned out come
    back as zeros, and each row equals what the accumulate path (emb_bwd_reduce, adding into zeros) gives, bit
    for bit: both sum a row's positions in position order from 0 in fp32."""
    import cupy as cp

    V, D, ids = _owner_case(rng, case)
    dout = randn(rng, (ids.size, D), dtype)
    idd, dod = device_copy(ids), device_copy(dout)
    dense = ck.embedding_backward(idd, dod, V, out=poisoned((V, D), odtype))
    acc = ck.embedding_backward(idd, dod, V, out=cp.zeros((V, D), dtype=odtype), accumulate=True)
    assert np.array_equal(to_host(dense).view(np.uint8), to_host(acc).view(np.uint8)), "dense != accumulate"
    ref = ck.embedding_backward(ids, dout, V, out=np.zeros((V, D), odtype))
    assert_close(dense, ref, odtype, rtol=max(TOL[np.dtype(odtype)][0], 1e-5), what=case)
    untouched = np.setdiff1d(np.arange(V), ids)
    assert not to_host(dense)[untouched].astype(np.float32).any(), "an untouched row is not zero"
    again = ck.embedding_backward(idd, dod, V, out=poisoned((V, D), odtype))
    assert np.array_equal(to_host(again).view(np.uint8), to_host(dense).view(np.uint8)), "rerun not bit-identical"


@pytest.mark.gpu
def test_gpu_dense_backward_no_positions_is_zeros():
    import cupy as cp

    out = poisoned((7, 5), np.float32)
    g = ck.embedding_backward(cp.zeros((0,), cp.int32), cp.zeros((0, 5), cp.float32), 7, out=out)
    assert g is out and not to_host(g).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["grad_f32", "grad_bf16"])
def test_gpu_sparse_rows_match_dense(rng, dtype):
    import cupy as cp

    V, D = 4099, 136
    g, hist = _sparse_steps(cp, rng, V, D, [300, 1, 77], dtype=dtype, dout_dtype=ck.bfloat16, conv=device_copy)
    tol = TOL[np.dtype(dtype)]
    # bf16 buffer: rounded once per accumulate() call, so vs the float64 sum allow a few roundings of partials
    atol = 0.1 if np.dtype(dtype) == np.dtype(ck.bfloat16) else 1e-5
    _check_sparse(g, hist, V, D, rtol=max(tol[0], 1e-5), atol=atol)
    # the same buffer on the NumPy path agrees element for element
    gr, _ = _sparse_steps(np, np.random.default_rng(0), V, D, [], dtype=dtype)
    for ids, dout in hist:
        gr.accumulate(ids, dout)
    assert_close(g.grad, gr.grad, dtype, what="sparse grad")
    # zero() clears exactly the listed rows: plant a value in an unlisted row, it must survive
    rows = to_host(g.rows)[: int(to_host(g.count))]
    free = int(np.setdiff1d(np.arange(V), rows)[0])
    g.grad[free] = device_copy(np.full(D, 5, dtype))
    g.zero()
    host = to_host(g.grad).astype(np.float32)
    assert int(to_host(g.count)) == 0 and int(to_host(g.generation)) == 2
    assert np.all(host[free] == 5) and not np.delete(host, free, axis=0).any()
    g.grad[free] = device_copy(np.zeros(D, dtype))
    # next step: rows touched again are listed again (new generation), sums start from zero
    ids = np.array([rows[0], rows[0], free], np.int32)
    dout = randn(rng, (3, D), ck.bfloat16)
    g.accumulate(device_copy(ids), device_copy(dout))
    _check_sparse(g, [(ids, dout)], V, D, rtol=max(tol[0], 1e-5), atol=max(tol[1], 1e-5))


@pytest.mark.gpu
def test_gpu_capture_forward_backward_sparse(rng):
    """embedding, embedding_backward and SparseRowGrad accumulate/zero are graph-capturable."""
    import cupy as cp

    V, D, n = 777, 256, 300
    table = device_copy(randn(rng, (V, D), ck.bfloat16))
    ids = device_copy(rng.integers(0, V, (n,)).astype(np.int32))
    dout = device_copy(randn(rng, (n, D), ck.bfloat16))
    y = cp.empty((n, D), dtype=ck.bfloat16)
    dt = cp.empty((V, D), dtype=cp.float32)
    g = ck.SparseRowGrad(V, D, xp=cp)
    ck.embedding(ids, table, out=y)
    ck.embedding_backward(ids, dout, V, out=dt)
    g.accumulate(ids, dout)
    g.zero()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.embedding(ids, table, out=y)
        ck.embedding_backward(ids, dout, V, out=dt)
        g.zero()
        g.accumulate(ids, dout)
        graph = s.end_capture()
    y.fill(np.nan)
    dt.fill(np.nan)
    cp.cuda.Device().synchronize()  # (the poison ran on the legacy stream: the replay must not race it)
    graph.launch(s)
    s.synchronize()
    h_ids, h_dout = to_host(ids), to_host(dout)
    assert_close(y, ck.embedding(h_ids, to_host(table)), ck.bfloat16)
    ref = ck.embedding_backward(h_ids, h_dout, V)
    assert_close(dt, ref, np.float32, rtol=1e-5, atol=1e-5)
    assert_close(g.grad, ref, np.float32, rtol=1e-5, atol=1e-5)
    assert int(to_host(g.count)) == np.unique(h_ids).size


# ---------------------------------------------------------------- sparse rows across ranks: pack + merge
def _ranks_packs(xp, rng, V, D, batches, wire, conv=lambda a: a, poison=False):
    """One SparseRowGrad per 'rank', each accumulating its own batch; returns (grads, packs, dense sums)."""
    grads, packs, dense = [], [], []
    for ids in batches:
        g = ck.SparseRowGrad(V, D, xp=xp)
        dout = randn(rng, (ids.size, D), np.float32)
        g.accumulate(conv(ids), conv(dout))
        cap = ids.size + 3  # room for every touched row, then -1 padding
        pid = xp.full((cap,), 7, np.int32)
        prow = (poisoned((cap, D), wire) if poison else xp.full((cap, D), np.nan, wire))
        g.pack(pid, prow)
        d = np.zeros((V, D), np.float32)
        np.add.at(d, ids, dout)
        grads.append(g), packs.append((pid, prow)), dense.append(d)
    return grads, packs, dense


@pytest.mark.parametrize("wire", DTYPES, ids=["wire_f32", "wire_bf16"])
def test_reference_pack_and_merge_across_ranks(rng, wire):
    """Each rank packs its listed rows; every rank merges all packs in rank order: the same bits everywhere,
    equal to scale * the rank-order sum of the ranks' (wire-rounded) row sums, the union listed once, zero
    elsewhere; zero() then clears the union."""
    V, D = 40, 6
    batches = [np.array([3, 7, 3, 0], np.int32), np.array([7, 39, 1], np.int32), np.array([5], np.int32)]
    grads, packs, dense = _ranks_packs(np, rng, V, D, batches, wire)
    pid, prow = packs[0]
    assert list(pid) == list(grads[0].rows[:3]) + [-1] * 4  # 3 distinct rows, then padding
    union = sorted({int(v) for b in batches for v in b})
    want = np.zeros((V, D), np.float32)
    for k, d in enumerate(dense):  # rank order, wire-rounded, scaled, multiply then add
        x = np.float32(0.5) * d.astype(wire).astype(np.float32)
        want = x if k == 0 else want + x
    for g in grads:
        g.merge(packs, scale=0.5)
        assert int(g.count) == len(union) and sorted(g.rows[:int(g.count)]) == union
        w = want.copy()
        w[np.setdiff1d(np.arange(V), union)] = 0
        np.testing.assert_array_equal(g.grad, w)  # on every rank: the same bits
        g.zero()
        assert not g.grad.any() and int(g.count) == 0


def test_reference_pack_overflow_and_checks(rng):
    g = ck.SparseRowGrad(10, 4, xp=np)
    g.accumulate(np.array([1, 2, 3], np.int32), np.ones((3, 4), np.float32))
    err = np.zeros((), np.int32)
    g.pack(np.zeros(2, np.int32), np.zeros((2, 4), np.float32), error=err)
    assert int(err) == 2
    with pytest.raises(ValueError, match="3 rows are listed; the pack holds 2"):
        g.pack(np.zeros(2, np.int32), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"rows: expected shape \(3, 4\)"):
        g.pack(np.zeros(3, np.int32), np.zeros((3, 5), np.float32))
    with pytest.raises(TypeError, match="ids: expected dtype int32"):
        g.pack(np.zeros(3, np.int64), np.zeros((3, 4), np.float32))
    with pytest.raises(TypeError, match="merge: the exchange merges into a float32 gradient"):
        ck.SparseRowGrad(10, 4, ck.bfloat16, xp=np).merge([(np.zeros(3, np.int32), np.zeros((3, 4), np.float32))])
    with pytest.raises(ValueError, match="packs: expected"):
        g.merge([])


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 37])  # 16-byte packs, and the scalar path
@pytest.mark.parametrize("wire", DTYPES, ids=["wire_f32", "wire_bf16"])
def test_gpu_pack_and_merge_match_reference(rng, D, wire):
    """GPU pack + merge (padding rows poisoned: never read) equal the NumPy path bit for bit, on every rank;
    a pack too small ORs 2 into the error word."""
    import cupy as cp

    V = 4099
    batches = [rng.integers(0, V, n).astype(np.int32) for n in (700, 1, 333)]
    seed = int(rng.integers(1 << 30))
    gg, gp, _ = _ranks_packs(cp, np.random.default_rng(seed), V, D, batches, wire, conv=device_copy, poison=True)
    hg, hp, _ = _ranks_packs(np, np.random.default_rng(seed), V, D, batches, wire)
    for (a, b), (c, d) in zip(gp, hp):
        assert sorted(to_host(a)) == sorted(c)  # the same rows (the GPU list is in no particular order)
    hg[0].merge(hp, scale=1 / 3)
    for g in gg:
        g.merge(gp, scale=1 / 3)
        assert int(to_host(g.count)) == int(hg[0].count)
        assert sorted(to_host(g.rows)[:int(to_host(g.count))]) == sorted(hg[0].rows[:int(hg[0].count)])
        np.testing.assert_array_equal(to_host(g.grad), hg[0].grad)
    g = gg[0]
    err = cp.zeros((), cp.int32)
    g.pack(cp.zeros(5, cp.int32), cp.zeros((5, D), wire), error=err)
    assert int(err) == 2
