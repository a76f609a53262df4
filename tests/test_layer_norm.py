import numpy as np
import pytest

import cukernels as ck
from helpers import DTYPES, TOL, assert_close, device_copy, poisoned, randn, to_host


def f64_forward(x, g, b, eps):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    r = 1.0 / np.sqrt(var + eps)
    return (x - mu) * r * g.astype(np.float64) + b.astype(np.float64), mu[..., 0], r[..., 0]


def f64_loss_grad(x, g, b, dy, eps):
    """Gradients of sum(y * dy) by central finite differences in float64 (small shapes only)."""
    h = 1e-6

    def loss(x_, g_, b_):
        return (f64_forward(x_, g_, b_, eps)[0] * dy).sum()

    def fd(a, f):
        out = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            ap, am = a.copy(), a.copy()
            ap[i] += h
            am[i] -= h
            out[i] = (f(ap) - f(am)) / (2 * h)
        return out

    return (fd(x, lambda v: loss(v, g, b)), fd(g, lambda v: loss(x, v, b)), fd(b, lambda v: loss(x, g, v)))


# ---------------------------------------------------------------- CPU: the reference against float64 math
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 130), (0, 16), (4, 4097)])
def test_reference_forward_matches_f64(rng, shape):
    x = randn(rng, shape, np.float32, scale=2.0) + 0.5
    g = randn(rng, shape[-1:], np.float32)
    b = randn(rng, shape[-1:], np.float32)
    y, mean, rstd = ck.layer_norm(x, g, b, eps=1e-5, return_stats=True)
    y64, m64, r64 = f64_forward(x, g, b, 1e-5)
    np.testing.assert_allclose(y, y64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mean, m64, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rstd, r64, rtol=1e-6)
    assert mean.dtype == rstd.dtype == np.float32 and mean.shape == rstd.shape == shape[:-1]


def test_reference_backward_matches_finite_differences(rng):
    x = rng.standard_normal((3, 6)) * 2 + 1
    g, b = rng.standard_normal(6), rng.standard_normal(6)
    dy = rng.standard_normal((3, 6))
    gx, gg, gb = f64_loss_grad(x, g, b, dy, 1e-5)
    f = lambda a: a.astype(np.float32)
    _, mean, rstd = ck.layer_norm(f(x), f(g), f(b), 1e-5, return_stats=True)
    dx, dg, db = ck.layer_norm_backward(f(dy), f(x), f(g), mean, rstd)
    np.testing.assert_allclose(dx, gx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dg, gg, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(db, gb, rtol=1e-4, atol=1e-4)
    assert dg.dtype == db.dtype == np.float32


def test_reference_bf16_and_large_offset(rng):
    # A large common offset: the variance must come from (x - mean), not from E[x^2] - E[x]^2.
    x = (randn(rng, (5, 64), np.float32) + 1e4).astype(np.float32)
    g, b = np.ones(64, ck.bfloat16), np.zeros(64, ck.bfloat16)
    y = ck.layer_norm(x.astype(ck.bfloat16), g, b)
    y64, _, _ = f64_forward(x.astype(ck.bfloat16), g, b, 1e-5)
    assert y.dtype == ck.bfloat16
    np.testing.assert_allclose(y.astype(np.float64), y64, rtol=2**-7, atol=2**-7)


def test_out_is_used(rng):
    x = randn(rng, (3, 8), np.float32)
    out = np.full_like(x, np.nan)
    y = ck.layer_norm(x, np.ones(8, np.float32), np.zeros(8, np.float32), out=out)
    assert y is out and not np.isnan(out).any()


# ---------------------------------------------------------------- bad input
F, BF = np.float32, ck.bfloat16


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ck.layer_norm(np.ones((2, 4), np.float64), np.ones(4, F), np.ones(4, F)), TypeError, "x: expected dtype"),
        (lambda: ck.layer_norm(np.ones((2, 4), F), np.ones(5, F), np.ones(4, F)), ValueError, r"gamma: expected shape \(4,\)"),
        (lambda: ck.layer_norm(np.ones((2, 4), F), np.ones(4, F), np.ones(3, F)), ValueError, r"beta: expected shape \(4,\)"),
        (lambda: ck.layer_norm(np.ones((2, 4), F), np.ones(4, F), np.ones(4, BF)), TypeError, "beta: expected dtype float32"),
        (lambda: ck.layer_norm(np.ones((2, 4), F), np.ones(4, F), None), TypeError, "beta"),
        (lambda: ck.layer_norm(np.ones((4, 2), F).T, np.ones(4, F), np.ones(4, F)), ValueError, "x: expected a C-contiguous"),
        (lambda: ck.layer_norm(np.ones((2, 0), F), np.ones(0, F), np.ones(0, F)), ValueError, "at least 1 element"),
        (lambda: ck.layer_norm(np.ones((2, 4), F), np.ones(4, F), np.ones(4, F), eps=-1), ValueError, "eps"),
        (lambda: ck.layer_norm(np.ones((2, 4), F), np.ones(4, F), np.ones(4, F), out=np.ones((2, 4), BF)), TypeError, "out: expected dtype"),
        (lambda: ck.layer_norm_backward(np.ones((2, 4), F), np.ones((2, 4), F), np.ones(4, F), np.ones(2, F), np.ones(3, F)), ValueError, "rstd: expected shape"),
        (lambda: ck.layer_norm_backward(np.ones((2, 4), F), np.ones((2, 4), F), np.ones(4, F), np.ones(2, np.float64), np.ones(2, F)), TypeError, "mean: expected dtype"),
        (lambda: ck.layer_norm_backward(np.ones((2, 4), BF), np.ones((2, 4), F), np.ones(4, F), np.ones(2, F), np.ones(2, F)), TypeError, "dy: expected dtype"),
        (lambda: ck.layer_norm_backward(np.ones((2, 5), F), np.ones((2, 4), F), np.ones(4, F), np.ones(2, F), np.ones(2, F)), ValueError, "dy: expected shape"),
    ],
)
def test_bad_input_messages(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.gpu
def test_mixing_numpy_and_cupy_is_a_type_error():
    import cupy as cp

    with pytest.raises(TypeError, match="gamma: is a numpy array but x is a cupy array"):
        ck.layer_norm(cp.ones((2, 4), cp.float32), np.ones(4, np.float32), np.ones(4, np.float32))


# ---------------------------------------------------------------- GPU: kernel against the reference
# 1..64: rows share a warp; 1000/2048: vector reg kernel; 4097: element path; 8192 fp32 / 16384: the
# backward's largest reg rows; 32768 fp32, 65536: the loop kernels (Welford forward, two-pass backward).
COLS = [1, 3, 64, 127, 1000, 2048, 4097, 16384, 65536]


def _check(rng, rows, C, dtype, wdtype, misalign, scale=3.0, offset=0.0, ytol=(None, None)):
    x = (randn(rng, (rows, C), np.float32, scale=scale) + offset).astype(dtype)
    g = randn(rng, (C,), wdtype)
    b = randn(rng, (C,), wdtype)
    dy = randn(rng, (rows, C), dtype)
    y_ref, m_ref, r_ref = ck.layer_norm(x, g, b, eps=1e-5, return_stats=True)
    dx_ref, dg_ref, db_ref = ck.layer_norm_backward(dy, x, g, m_ref, r_ref)

    xd, gd, bd, dyd = (device_copy(a, misalign) for a in (x, g, b, dy))
    out = poisoned(x.shape, dtype, misalign)
    y, m, r = ck.layer_norm(xd, gd, bd, eps=1e-5, return_stats=True, out=out)
    assert y is out
    assert_close(y, y_ref, dtype, rtol=ytol[0], atol=ytol[1], what="y")
    assert_close(m, m_ref, np.float32, rtol=1e-5, atol=1e-5 * max(1.0, abs(offset)), what="mean")
    assert_close(r, r_ref, np.float32, rtol=1e-4, atol=0, what="rstd")
    dxo = poisoned(x.shape, dtype, misalign)
    dx, dg, db = ck.layer_norm_backward(dyd, xd, gd, m, r, out=dxo)
    assert dx is dxo and dg.dtype == db.dtype == np.dtype(wdtype)
    assert_close(dx, dx_ref, dtype, rtol=TOL[np.dtype(dtype)][0] * 5, atol=TOL[np.dtype(dtype)][1] * 5, what="dx")
    # dgamma/dbeta sum `rows` terms: fp32 summation-order error grows like sqrt(rows).
    rt, at = TOL[np.dtype(wdtype)]
    # With a large offset the two fp32 means (kernel, reference) may differ by an ulp of the offset
    # (~6e-8 * offset), which moves every x_hat of the row by that / scale; dgamma sums `rows` such shifts
    # with random-sign dy: ~sqrt(rows) * 6e-8 * offset / scale (1e-4 at offset 1e4, scale 100, 301 rows).
    at_dg = max(at, 1e-4) + 4 * np.sqrt(max(rows, 1)) * 6e-8 * abs(offset) / scale
    assert_close(dg, dg_ref, wdtype, rtol=max(rt, 1e-4), atol=at_dg, what="dgamma")
    assert_close(db, db_ref, wdtype, rtol=max(rt, 1e-4), atol=max(at, 1e-4), what="dbeta")


@pytest.mark.gpu
@pytest.mark.parametrize("C", COLS)
@pytest.mark.parametrize("rows", [0, 1, 199])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_matches_reference(rng, rows, C, dtype, misalign):
    if rows * C > 199 * 4096:
        rows = 7 if misalign else 23  # long rows: few of them (the host reference is the slow part)
    wdtype = np.float32 if C % 2 else ck.bfloat16  # both parameter dtypes get exercised
    _check(rng, rows, C, dtype, wdtype, misalign)


@pytest.mark.gpu
@pytest.mark.parametrize("target", [1, 2, 4])
@pytest.mark.parametrize("C", [8, 64, 768, 1000, 2048, 16384, 32768])
@pytest.mark.parametrize("dtype, wdtype", [(ck.bfloat16, np.float32), (ck.bfloat16, ck.bfloat16),
                                           (np.float32, np.float32), (np.float32, ck.bfloat16)],
                         ids=["bf16-f32", "bf16-bf16", "f32-f32", "f32-bf16"])
def test_gpu_forward_plans(rng, monkeypatch, target, C, dtype, wdtype):
    """The forward plans every target picks (fp32 rows default to 2 packs a thread, bf16 rows to 4), both
    parameter dtypes, against the reference."""
    from cukernels.ops import layer_norm as LN

    monkeypatch.setattr(ck.settings, "layer_norm_fwd_target_vpt", target)
    monkeypatch.setattr(ck.settings, "layer_norm_fwd_target_vpt_bf16", target)
    _check(rng, 37 if C <= 2048 else 5, C, dtype, wdtype, misalign=False)


@pytest.mark.gpu
@pytest.mark.parametrize("C", [8192, 32768])
def test_gpu_fp32_reg_and_loop_boundaries(rng, C):
    _check(rng, 37, C, np.float32, np.float32, False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("C", [512, 65536])
def test_gpu_large_offset_large_values_and_determinism(rng, dtype, C):
    # mean ~1e4, spread ~1e2: a one-pass E[x^2] - E[x]^2 would lose the variance; ours stays exact.
    rows = 301 if C == 512 else 5
    # fp32 x carries ~1e-7 * 1e4 absolute error, ~1e-5 after dividing by the spread: y gets a wider tolerance.
    ytol = (2e-4, 2e-4) if dtype == np.float32 else (None, None)
    _check(rng, rows, C, dtype, np.float32, False, scale=100.0, offset=1e4, ytol=ytol)
    x = device_copy(randn(rng, (rows, C), dtype, scale=1e4))
    g = device_copy(randn(rng, (C,), np.float32))
    b = device_copy(randn(rng, (C,), np.float32))
    dy = device_copy(randn(rng, (rows, C), dtype))
    y, m, r = ck.layer_norm(x, g, b, return_stats=True)
    assert np.isfinite(to_host(y).astype(np.float32)).all()
    dx1, dg1, db1 = ck.layer_norm_backward(dy, x, g, m, r)
    dx2, dg2, db2 = ck.layer_norm_backward(dy, x, g, m, r)
    assert np.array_equal(to_host(dg1), to_host(dg2)) and np.array_equal(to_host(db1), to_host(db2)), \
        "dgamma/dbeta must be bit-identical run to run"
    assert np.array_equal(to_host(dx1).view(np.uint8), to_host(dx2).view(np.uint8))


@pytest.mark.gpu
def test_gpu_leading_dims(rng):
    x = randn(rng, (2, 3, 37, 96), ck.bfloat16)
    g, b = randn(rng, (96,), ck.bfloat16), randn(rng, (96,), ck.bfloat16)
    y, m, r = ck.layer_norm(device_copy(x), device_copy(g), device_copy(b), return_stats=True)
    y_ref, m_ref, _ = ck.layer_norm(x, g, b, return_stats=True)
    assert m.shape == (2, 3, 37)
    assert_close(y, y_ref, ck.bfloat16, what="y")


@pytest.mark.gpu
def test_gpu_runs_on_current_stream_and_captures(rng):
    """Forward and backward are graph-capturable: no host sync, no H2D copy, launches on the current stream."""
    import cupy as cp

    x = device_copy(randn(rng, (64, 1024), ck.bfloat16))
    g = device_copy(randn(rng, (1024,), np.float32))
    b = device_copy(randn(rng, (1024,), np.float32))
    dy = device_copy(randn(rng, (64, 1024), ck.bfloat16))
    y, dx = cp.empty_like(x), cp.empty_like(x)
    _, m, r = ck.layer_norm(x, g, b, out=y, return_stats=True)  # compile + warm up outside capture
    ck.layer_norm_backward(dy, x, g, m, r, out=dx)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.layer_norm(x, g, b, out=y)
        _, dgc, dbc = ck.layer_norm_backward(dy, x, g, m, r, out=dx)
        gr = s.end_capture()
    y.fill(np.nan)
    dx.fill(np.nan)
    cp.cuda.Device().synchronize()  # (the poison ran on the legacy stream: the replay must not race it)
    gr.launch(s)
    s.synchronize()
    xh, gh, bh, dyh = to_host(x), to_host(g), to_host(b), to_host(dy)
    y_ref, m_ref, r_ref = ck.layer_norm(xh, gh, bh, return_stats=True)
    assert_close(y, y_ref, ck.bfloat16)
    dx_ref, dg_ref, _ = ck.layer_norm_backward(dyh, xh, gh, m_ref, r_ref)
    assert_close(dx, dx_ref, ck.bfloat16, rtol=0.05, atol=0.05)
    assert_close(dgc, dg_ref, np.float32, rtol=1e-4, atol=1e-4)


# Issue 17: shapes for the cp.async pipelined backward (ln_bwd_pipe: 16-byte path, >= 32 threads a row, 1 or 2
# packs a thread; row slots per 512-thread block 16 .. 1), with row counts that leave a block's last row group
# partly empty and blocks with more than one trip; (999, 128) keeps the register kernel (4 threads a row at bf16).
PIPE_SHAPES = [(999, 128), (1000, 256), (777, 512), (2049, 2048), (301, 4096), (130, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, C", PIPE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_pipelined_backward_shapes(rng, rows, C, dtype):
    _check(rng, rows, C, dtype, np.float32 if C % 256 else ck.bfloat16, False)
    x, dy = device_copy(randn(rng, (rows, C), dtype)), device_copy(randn(rng, (rows, C), dtype))
    g, b = device_copy(randn(rng, (C,), np.float32)), device_copy(randn(rng, (C,), np.float32))
    _, m, r = ck.layer_norm(x, g, b, return_stats=True)
    a, c = ck.layer_norm_backward(dy, x, g, m, r), ck.layer_norm_backward(dy, x, g, m, r)
    for u, v in zip(a, c):
        assert np.array_equal(to_host(u).view(np.uint8), to_host(v).view(np.uint8)), "bit-identical reruns"


# The one-warp-a-row backward (ln_bwd_warp) on bf16 rows of 65..128 packs (C 520..1024), and the
# rows just outside (512, 1032: the pipelined kernel), for rows from fewer than a block's warps to a grid capped at 4
# waves (8195 rows at one row a warp: the warps loop), both parameter dtypes, the bf16 gamma misaligned (element loads
# while staging it; x and dy still 16-byte); the same inputs through ln_bwd_pipe (layer_norm_bwd_kernel "pipe") too.
WARP_COLS = [512, 520, 768, 1024, 1032]
VARIANTS = [("warp", 4), ("warp", 1), ("pipe", 4)]  # (layer_norm_bwd_kernel, layer_norm_warp_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [3, 517, 8195])
@pytest.mark.parametrize("wdtype", [np.float32, ck.bfloat16], ids=["wf32", "wbf16"])
def test_gpu_warp_backward_matches_reference(rng, monkeypatch, rows, wdtype):
    from cukernels.ops import layer_norm as LN

    dtype = ck.bfloat16
    for C in WARP_COLS:
        x = (randn(rng, (rows, C), np.float32, scale=3.0) + 1.0).astype(dtype)
        dy = randn(rng, (rows, C), dtype)
        g = randn(rng, (C,), wdtype)
        _, m, r = ck.layer_norm(x, g, randn(rng, (C,), wdtype), eps=1e-5, return_stats=True)
        ref = ck.layer_norm_backward(dy, x, g, m, r)
        xd, dyd, md, rd = (device_copy(a) for a in (x, dy, m, r))
        gd = device_copy(g, misalign=np.dtype(wdtype).itemsize == 2)
        rt, at = TOL[np.dtype(wdtype)]
        for kernel, trips in VARIANTS:
            monkeypatch.setattr(ck.settings, "layer_norm_bwd_kernel", kernel)
            monkeypatch.setattr(ck.settings, "layer_norm_warp_rows", trips)
            dxo = poisoned(x.shape, dtype)
            runs = [ck.layer_norm_backward(dyd, xd, gd, md, rd, out=dxo if i == 0 else None) for i in range(2)]
            assert runs[0][0] is dxo
            what = f"{kernel}, {trips} rows a warp, C={C}"
            assert_close(runs[0][0], ref[0], dtype, rtol=TOL[np.dtype(dtype)][0] * 5,
                         atol=TOL[np.dtype(dtype)][1] * 5, what=f"dx ({what})")
            for name, a, b in (("dgamma", runs[0][1], ref[1]), ("dbeta", runs[0][2], ref[2])):
                assert_close(a, b, wdtype, rtol=max(rt, 1e-4), atol=max(at, 1e-3 * np.sqrt(rows)),
                             what=f"{name} ({what})")
            for a, b in zip(runs[0], runs[1]):
                assert np.array_equal(to_host(a).view(np.uint8), to_host(b).view(np.uint8)), f"reruns ({what})"


def test_warp_block_mirrors_the_kernels():
    """WARP_WARPS x 32 must be the LN_WARP instantiations' __launch_bounds__ count (a bigger block than the bound
    fails to launch)."""
    import re
    from pathlib import Path

    from cukernels.ops import layer_norm as LN

    src = (Path(LN.__file__).parents[2] / "kernels_cu" / "layer_norm.cu").read_text()
    inst = re.findall(r"^LN_WARP\(bf16, \w+, bf16, \w+, (\d+), (\d+), (\d+)\)", src, re.M)
    assert len(inst) == 2 and all((int(v), int(n)) == (4, 32 * LN.WARP_WARPS) for v, n, _ in inst)


# The pipelined backward at each pipeline depth (2..4 row groups in flight a block) and block size (256 threads,
# three blocks an SM; 512, one), with row counts from fewer row groups than SMs to many trips a block (the mean and
# rstd prefetched one group ahead must follow the right row).
@pytest.mark.gpu
@pytest.mark.parametrize("stages, threads", [(2, 256), (3, 256), (4, 256), (2, 512), (3, 512)])
@pytest.mark.parametrize("rows, C", [(3, 2048), (517, 1024), (8195, 2048), (130, 8192)])
@pytest.mark.parametrize("dtype, wdtype", [(ck.bfloat16, np.float32), (np.float32, ck.bfloat16)],
                         ids=["bf16", "f32-wbf16"])
def test_gpu_pipelined_backward_depths(rng, monkeypatch, stages, threads, rows, C, dtype, wdtype):
    from cukernels.ops import layer_norm as LN

    monkeypatch.setattr(ck.settings, "layer_norm_pipe_stages", stages)
    monkeypatch.setattr(ck.settings, "layer_norm_pipe_threads", threads)
    monkeypatch.setattr(ck.settings, "layer_norm_bwd_kernel", "pipe")  # bf16 C 1024: else the one-warp-a-row kernel
    _check(rng, rows, C, dtype, wdtype, False)
    x, dy = device_copy(randn(rng, (rows, C), dtype)), device_copy(randn(rng, (rows, C), dtype))
    g, b = device_copy(randn(rng, (C,), wdtype)), device_copy(randn(rng, (C,), wdtype))
    _, m, r = ck.layer_norm(x, g, b, return_stats=True)
    a, c = ck.layer_norm_backward(dy, x, g, m, r), ck.layer_norm_backward(dy, x, g, m, r)
    for u, v in zip(a, c):
        assert np.array_equal(to_host(u).view(np.uint8), to_host(v).view(np.uint8)), "bit-identical reruns"


@pytest.mark.gpu
def test_gpu_pipelined_backward_captures(rng):
    """The pipelined backward (dynamic shared memory attribute set on first use, outside capture) replays from a
    CUDA graph with the eager result bit for bit."""
    import cupy as cp

    x, dy = (device_copy(randn(rng, (512, 2048), ck.bfloat16)) for _ in range(2))
    g, b = device_copy(randn(rng, (2048,), np.float32)), device_copy(randn(rng, (2048,), np.float32))
    _, m, r = ck.layer_norm(x, g, b, return_stats=True)
    dx = cp.empty_like(x)
    eager = [a.copy() for a in ck.layer_norm_backward(dy, x, g, m, r, out=dx)]
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        res = ck.layer_norm_backward(dy, x, g, m, r, out=dx)
        graph = s.end_capture()
    for a in res:
        a.fill(np.nan)
    cp.cuda.Device().synchronize()  # (the poison ran on the legacy stream: the replay must not race it)
    graph.launch(s)
    s.synchronize()
    for a, e in zip(res, eager):
        assert np.array_equal(to_host(a).view(np.uint8), to_host(e).view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("C", [768, 1024])
def test_gpu_warp_backward_partials_survive_reruns(rng, C):
    """ln_bwd_warp writes its dgamma partial row and then its dbeta one through the same shared-memory buffer; a
    missing barrier between them (session 15) let warp 0 of the second overwrite columns the other warps were still
    copying out of the first: dgamma wrong in ~10 % of columns, depending on timing. 40 reruns at row counts that fill
    1 to 4 waves must give the same bits, and the reference's values."""
    dtype = ck.bfloat16
    for rows in (2048, 8195, 16384):
        x = device_copy((randn(rng, (rows, C), np.float32, scale=3.0) + 1.0).astype(dtype))
        dy = device_copy(randn(rng, (rows, C), dtype))
        g = device_copy(randn(rng, (C,), np.float32))
        _, m, r = ck.layer_norm(x, g, device_copy(randn(rng, (C,), np.float32)), eps=1e-5, return_stats=True)
        first = [to_host(a) for a in ck.layer_norm_backward(dy, x, g, m, r)[1:]]
        for i in range(40):
            again = [to_host(a) for a in ck.layer_norm_backward(dy, x, g, m, r)[1:]]
            for name, a, b in zip(("dgamma", "dbeta"), again, first):
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8),
                                              err_msg=f"{name}, rerun {i}, {rows} x {C}")
        ref = ck.layer_norm_backward(to_host(dy), to_host(x), to_host(g), to_host(m), to_host(r))
        for name, a, b in zip(("dgamma", "dbeta"), first, ref[1:]):
            assert_close(a, b, np.float32, rtol=1e-4, atol=1e-3 * np.sqrt(rows), what=f"{name}, {rows} x {C}")
