import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import cukernels as ck
from cukernels.ops.cross_entropy import vec_pair
from helpers import DTYPES, TOL, assert_close, device_copy, poisoned, randn, to_host


def dev0(v, dtype):
    """A 0-d device array (helpers.device_copy goes through np.ascontiguousarray, which makes 0-d arrays 1-d)."""
    import cupy

    return cupy.asarray(np.asarray(v, dtype=dtype))


def f64_rows(x, t, ignore=-100, eps=0.0):
    """Independent float64 formula, row by row: (loss_i, lse_i, valid_i)."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    t = t.reshape(-1)
    V = x.shape[1]
    loss, lse, valid = [], [], []
    for row, ti in zip(x, t):
        l = np.logaddexp.reduce(row)
        lse.append(l)
        ok = ti != ignore
        valid.append(ok)
        logp = row - l
        q = np.full(V, eps / V)
        if ok:
            q[ti] += 1 - eps
        loss.append(-(q * logp).sum() if ok else 0.0)
    return np.array(loss), np.array(lse), np.array(valid, bool)


def f64_loss(x, t, ignore=-100, eps=0.0, reduction="mean"):
    loss, _, valid = f64_rows(x, t, ignore, eps)
    if reduction == "none":
        return loss.reshape(t.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum() if valid.sum() else 0.0


def _targets(rng, N, V, idt=np.int64, ignore_frac=0.2, ignore=-100):
    t = rng.integers(0, V, N).astype(idt)
    t[rng.random(N) < ignore_frac] = ignore
    return t


# ---------------------------------------------------------------- CPU: the reference
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("V", [1, 3, 17])
def test_reference_forward_matches_f64(rng, reduction, eps, V):
    x = randn(rng, (2, 5, V), np.float32, scale=3.0)
    t = _targets(rng, (2, 5), V)
    loss, lse = ck.cross_entropy(x, t, reduction=reduction, label_smoothing=eps, return_lse=True)
    np.testing.assert_allclose(loss, f64_loss(x, t, eps=eps, reduction=reduction), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, f64_rows(x, t)[1].reshape(2, 5), rtol=1e-6)
    assert loss.dtype == np.float32 and lse.shape == (2, 5)
    assert loss.shape == ((2, 5) if reduction == "none" else ())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_reference_backward_matches_finite_differences(rng, reduction, eps):
    N, V = 4, 5
    x = rng.standard_normal((N, V))
    t = np.array([1, -100, 4, 0], np.int64)
    dl = rng.standard_normal(N) if reduction == "none" else np.float64(rng.standard_normal())

    def L(x_):
        l = f64_loss(x_, t, eps=eps, reduction=reduction)
        return (l * dl).sum()

    h = 1e-6
    fd = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp_, xm_ = x.copy(), x.copy()
        xp_[i] += h
        xm_[i] -= h
        fd[i] = (L(xp_) - L(xm_)) / (2 * h)
    x32 = x.astype(np.float32)
    _, lse = ck.cross_entropy(x32, t, reduction=reduction, label_smoothing=eps, return_lse=True)
    dlo = dl.astype(np.float32) if reduction == "none" else np.asarray(dl, np.float32)
    dx = ck.cross_entropy_backward(x32, t, lse, dlo, reduction=reduction, label_smoothing=eps)
    np.testing.assert_allclose(dx, fd, rtol=1e-4, atol=1e-5)
    assert not dx[1].any(), "ignored rows get no gradient"
    loss_f, dx_f = ck.cross_entropy_fused(x32, t, reduction=reduction, label_smoothing=eps,
                                          dloss=float(dl) if reduction != "none" else 1.0)
    if reduction != "none":
        np.testing.assert_allclose(dx_f, dx, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(loss_f, f64_loss(x, t, eps=eps, reduction=reduction), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_forward_out(rng, reduction):
    """out= takes the loss: the per-row losses for 'none', the 0-d loss otherwise; it is what comes back."""
    x = randn(rng, (3, 4, 11), np.float32)
    t = _targets(rng, (3, 4), 11)
    ref = ck.cross_entropy(x, t, reduction=reduction)
    out = np.full((3, 4) if reduction == "none" else (), np.nan, np.float32)
    got, lse = ck.cross_entropy(x, t, reduction=reduction, out=out, return_lse=True)
    assert got is out and lse.shape == (3, 4)
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(ValueError, match=r"out: expected shape \(\)"):
        ck.cross_entropy(x, t, out=np.zeros((3, 4), np.float32))
    with pytest.raises(TypeError, match="out: expected dtype float32"):
        ck.cross_entropy(x, t, reduction="none", out=np.zeros((3, 4), ck.bfloat16))


def test_reference_all_ignored_is_zero_not_nan(rng):
    x = randn(rng, (3, 7), np.float32)
    t = np.full(3, -100, np.int32)
    assert float(ck.cross_entropy(x, t)) == 0.0
    loss, dx = ck.cross_entropy_fused(x, t)
    assert float(loss) == 0.0 and not dx.any()


def test_reference_in_place_and_ignore_index_inside_range(rng):
    x = randn(rng, (4, 6), np.float32)
    t = np.array([0, 2, 0, 5], np.int32)
    ref_loss = f64_loss(x, t, ignore=0)
    ref_dx = ck.cross_entropy_backward(x, t, ck.cross_entropy(x, t, ignore_index=0, return_lse=True)[1],
                                       1.0, ignore_index=0)
    loss, dx = ck.cross_entropy_fused(x, t, ignore_index=0, out=x)
    assert dx is x
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(x, ref_dx, rtol=1e-6, atol=1e-7)


def test_reference_out_of_range_target_raises():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="targets: value 4 is out of range for 4 classes"):
        ck.cross_entropy(x, np.array([0, 4], np.int64))
    with pytest.raises(ValueError, match="targets: value -3"):
        ck.cross_entropy_fused(x, np.array([-3, 1], np.int32))


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ck.cross_entropy(np.zeros((2, 4), np.float64), np.zeros(2, np.int32)), TypeError, "logits: expected dtype"),
        (lambda: ck.cross_entropy(np.zeros((2, 4), np.float32), np.zeros(2, np.float32)), TypeError, "targets: expected dtype"),
        (lambda: ck.cross_entropy(np.zeros((2, 4), np.float32), np.zeros(3, np.int32)), ValueError, r"targets: expected shape \(2,\)"),
        (lambda: ck.cross_entropy(np.zeros((2, 0), np.float32), np.zeros(2, np.int32)), ValueError, "at least 1 element"),
        (lambda: ck.cross_entropy(np.zeros((4, 2), np.float32).T, np.zeros(2, np.int32)), ValueError, "logits: the class .last. axis must be contiguous"),
        (lambda: ck.cross_entropy(np.zeros((2, 4), np.float32), np.zeros(2, np.int32), reduction="avg"), ValueError, "reduction"),
        (lambda: ck.cross_entropy(np.zeros((2, 4), np.float32), np.zeros(2, np.int32), label_smoothing=1.5), ValueError, "label_smoothing"),
        (lambda: ck.cross_entropy(np.zeros((2, 4), np.float32), np.zeros(2, np.int32), ignore_index=1.5), TypeError, "ignore_index"),
        (lambda: ck.cross_entropy_backward(np.zeros((2, 4), np.float32), np.zeros(2, np.int32), np.zeros(3, np.float32), 1.0), ValueError, "lse: expected shape"),
        (lambda: ck.cross_entropy_backward(np.zeros((2, 4), np.float32), np.zeros(2, np.int32), np.zeros(2, np.float32), np.ones(2, np.float32)), ValueError, "dloss: expected a 0-d"),
        (lambda: ck.cross_entropy_backward(np.zeros((2, 4), np.float32), np.zeros(2, np.int32), np.zeros(2, np.float32), "1"), TypeError, "dloss"),
        (lambda: ck.cross_entropy_fused(np.zeros((2, 4), np.float32), np.zeros(2, np.int32), out=np.zeros((2, 4), ck.bfloat16)), TypeError, "out: expected dtype"),
        (lambda: ck.cross_entropy_fused(np.zeros((2, 4), np.float32), np.zeros(2, np.int32), dloss=np.ones((), np.float64)), TypeError, "dloss: expected dtype"),
    ],
)
def test_bad_input_messages(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ---------------------------------------------------------------- CPU: row-strided logits and dlogits
def _padded_host(a, pad):
    """NumPy view of ``a`` [..., V] whose rows lie V + pad apart, the padding NaN; returns (view, buffer)."""
    buf = np.full((*a.shape[:-1], a.shape[-1] + pad), np.nan, dtype=a.dtype)
    v = buf[..., : a.shape[-1]]
    v[...] = a
    return v, buf


def _padding_is_nan(buf, V):
    return bool(np.isnan(to_host(buf)[..., V:].astype(np.float32)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_reference_row_strided_equals_contiguous(rng, dtype):
    """3-D logits [B, T, V] inside [B, T, V + 5] (one row stride over both leading axes) and a strided out give the
    contiguous results exactly; the NaN padding is neither read (the loss would be NaN) nor written."""
    V = 11
    x = randn(rng, (2, 3, V), dtype, scale=3.0)
    t = _targets(rng, (2, 3), V, np.int32)
    t[0, 1] = -100
    xv, xbuf = _padded_host(x, 5)
    assert not xv.flags.c_contiguous
    for reduction in ("mean", "sum", "none"):
        want, wlse = ck.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1, return_lse=True)
        got, glse = ck.cross_entropy(xv, t, reduction=reduction, label_smoothing=0.1, return_lse=True)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(glse, wlse)
        dl = np.float32(0.5) if reduction != "none" else randn(rng, (2, 3), np.float32)
        want_dx = ck.cross_entropy_backward(x, t, wlse, dl, reduction=reduction, label_smoothing=0.1)
        ov, obuf = _padded_host(np.zeros_like(x), 2)
        assert ck.cross_entropy_backward(xv, t, glse, dl, reduction=reduction, label_smoothing=0.1, out=ov) is ov
        np.testing.assert_array_equal(ov, want_dx)
        assert _padding_is_nan(obuf, V)
    want_loss, want_dx = ck.cross_entropy_fused(x, t, label_smoothing=0.1, dloss=0.5)
    _, d = ck.cross_entropy_fused(xv, t, label_smoothing=0.1, dloss=0.5)  # no out: dlogits padded like the logits
    assert d.strides == xv.strides and d.shape == xv.shape
    np.testing.assert_array_equal(d, want_dx)
    assert ck.cross_entropy_fused(x, t)[1].flags.c_contiguous
    loss, dx = ck.cross_entropy_fused(xv, t, label_smoothing=0.1, dloss=0.5, out=xv)  # in place, strided
    assert dx is xv
    np.testing.assert_array_equal(loss, want_loss)
    np.testing.assert_array_equal(xv, want_dx)
    assert _padding_is_nan(xbuf, V)


def test_vec_pair_needs_congruent_rows():
    assert vec_pair(0, 50304, 0, 50304, 2)  # in place in a padded buffer
    assert vec_pair(2, 50257, 2, 50257, 2)  # in place, unpadded: same split on every row
    assert vec_pair(0, 50304, 256, 50312, 2)  # 16 bytes between the row lengths
    assert not vec_pair(0, 50257, 0, 50304, 2)  # row 1 differs by 94 bytes
    assert not vec_pair(0, 64, 4, 64, 4)
    assert vec_pair(0, 1001, 16, 1005, 4)


_Z = np.zeros((2, 4), np.float32)
_T = np.zeros(2, np.int32)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ck.cross_entropy(as_strided(np.zeros(8, np.float32), (2, 4), (8, 4)), _T), "logits: rows overlap"),
        (lambda: ck.cross_entropy(as_strided(np.zeros(12, np.float32), (2, 4), (18, 4)), _T),
         "logits: the row stride must be a non-negative multiple"),
        (lambda: ck.cross_entropy(np.zeros((2, 4), np.float32)[::-1], _T), "logits: the row stride must be"),
        (lambda: ck.cross_entropy(np.zeros((2, 6, 4), np.float32)[:, :3], np.zeros((2, 3), np.int32)),
         "logits: the rows are not evenly spaced"),
        (lambda: ck.cross_entropy_fused(_Z, _T, out=np.zeros((4, 2), np.float32).T), "out: the class .last. axis"),
        (lambda: ck.cross_entropy_backward(_Z, _T, np.zeros(2, np.float32), 1.0, out=np.zeros((4, 2), np.float32).T),
         "out: the class .last. axis"),
    ],
)
def test_bad_row_layouts(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_out_overlapping_the_logits_is_refused_but_in_place_is_not(rng):
    buf = randn(rng, (3, 9), np.float32)
    x, t = buf[:, :7], np.array([1, 2, 3], np.int32)
    with pytest.raises(ValueError, match="out: overlaps logits"):
        ck.cross_entropy_fused(x, t, out=buf[:, 1:8])
    with pytest.raises(ValueError, match="out: overlaps logits"):
        ck.cross_entropy_backward(x, t, np.zeros(3, np.float32), 1.0, out=buf.reshape(-1)[2:23].reshape(3, 7))
    want = ck.cross_entropy_fused(x.copy(), t)[1]
    same = buf[:, :7]  # another view object of the same elements: in place
    assert same is not x
    _, dx = ck.cross_entropy_fused(x, t, out=same)
    np.testing.assert_array_equal(dx, want)


# ---------------------------------------------------------------- GPU
def _tol(dtype):
    # loss / lse are fp32 sums of exp2 over V terms: relative ~1e-6 per term; dx of bf16 rounds once
    return TOL[np.dtype(dtype)] if np.dtype(dtype) == np.dtype(ck.bfloat16) else (1e-4, 1e-6)


VOCABS = [1, 3, 1000, 4097, 50257]


@pytest.mark.gpu
@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("N", [0, 1, 37])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_matches_reference(rng, V, N, dtype, misalign):
    eps = 0.1 if V % 2 else 0.0
    idt = np.int32 if N % 2 else np.int64
    x = randn(rng, (N, V), dtype, scale=4.0)
    t = _targets(rng, N, V, idt)
    xd, td = device_copy(x, misalign), device_copy(t, misalign)
    for reduction in ("mean", "sum", "none"):
        ref_loss, ref_lse = ck.cross_entropy(x, t, reduction=reduction, label_smoothing=eps, return_lse=True)
        loss, lse = ck.cross_entropy(xd, td, reduction=reduction, label_smoothing=eps, return_lse=True)
        assert_close(loss, ref_loss, np.float32, rtol=1e-4, atol=1e-5, what=f"loss {reduction}")
        assert_close(lse, ref_lse, np.float32, rtol=1e-5, atol=1e-5, what="lse")
        dl = np.float32(0.75) if reduction != "none" else randn(rng, (N,), np.float32)
        dld = dev0(dl, np.float32) if reduction != "none" else device_copy(dl)
        ref_dx = ck.cross_entropy_backward(x, t, ref_lse, np.asarray(dl, np.float32), reduction=reduction,
                                           label_smoothing=eps)
        out = poisoned((N, V), dtype, misalign)
        dx = ck.cross_entropy_backward(xd, td, lse, dld, reduction=reduction, label_smoothing=eps, out=out)
        assert dx is out
        rt, at = _tol(dtype)
        assert_close(dx, ref_dx, dtype, rtol=rt, atol=at, what=f"dx {reduction}")
        if reduction == "none":
            continue
        outf = poisoned((N, V), dtype, not misalign)  # a different alignment from the logits: element path
        loss_f, dx_f = ck.cross_entropy_fused(xd, td, reduction=reduction, label_smoothing=eps, dloss=dld, out=outf)
        assert dx_f is outf
        assert_close(loss_f, ref_loss, np.float32, rtol=1e-4, atol=1e-5, what="fused loss")
        assert_close(dx_f, ref_dx, dtype, rtol=rt, atol=at, what="fused dx")


@pytest.mark.gpu
@pytest.mark.parametrize("N", [0, 1, 37])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_forward_out(rng, N, dtype):
    """out= receives the loss (poisoned first: an unwritten element fails), and is the object returned."""
    V = 1000
    x = randn(rng, (N, V), dtype, scale=3.0)
    t = _targets(rng, N, V, np.int32)
    xd, td = device_copy(x), device_copy(t)
    for reduction in ("mean", "sum", "none"):
        ref = ck.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)
        out = poisoned((N,) if reduction == "none" else (), np.float32)
        got = ck.cross_entropy(xd, td, reduction=reduction, label_smoothing=0.1, out=out)
        assert got is out
        assert_close(out, ref, np.float32, rtol=1e-4, atol=1e-5, what=f"out {reduction}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_llama_vocab_fused_in_place(rng, dtype):
    N, V = 5, 128256
    x = randn(rng, (N, V), dtype, scale=2.0)
    t = np.array([0, V - 1, -100, 77777, 3], np.int64)
    ref_loss = ck.cross_entropy(x, t, label_smoothing=0.05)
    ref_dx = ck.cross_entropy_fused(x, t, label_smoothing=0.05, dloss=2.0)[1]
    xd = device_copy(x)
    loss, dx = ck.cross_entropy_fused(xd, device_copy(t), label_smoothing=0.05, dloss=2.0, out=xd)
    assert dx is xd and loss.shape == () and isinstance(loss, type(xd))
    assert_close(loss, ref_loss, np.float32, rtol=1e-4, atol=1e-5, what="loss")
    rt, at = _tol(dtype)
    assert_close(xd, ref_dx, dtype, rtol=rt, atol=at, what="dx in place")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "in_place"])
def test_gpu_fused_cache_hints_change_no_bit(rng, monkeypatch, dtype, inplace):
    """ck.settings.ce_cache_hints (evict-first loads / stores in the fused kernel's pass 2) moves no bit: the fused loss
    and dx with and without them are identical, at the LLaMA vocabulary and at an odd one on misaligned rows, and both
    match the reference."""
    from cukernels.ops import cross_entropy as ce_mod
    for N, V, mis in ((7, 128256, False), (37, 4097, True)):
        x = randn(rng, (N, V), dtype, scale=3.0)
        t = _targets(rng, N, V, np.int32)
        ref_loss, ref_dx = ck.cross_entropy_fused(x, t, label_smoothing=0.1, dloss=1.5)
        got = []
        for hints in (0, 1):
            monkeypatch.setattr(ck.settings, "ce_cache_hints", bool(hints))
            xd = device_copy(x, mis)
            out = xd if inplace else poisoned((N, V), dtype, mis)
            loss, dx = ck.cross_entropy_fused(xd, device_copy(t), label_smoothing=0.1, dloss=1.5, out=out)
            assert dx is out
            got.append((to_host(loss), to_host(dx)))
        assert got[0][0].tobytes() == got[1][0].tobytes(), f"loss bits differ with ce_cache_hints ({N} x {V})"
        np.testing.assert_array_equal(got[0][1].view(np.uint8), got[1][1].view(np.uint8))
        assert_close(got[1][0], ref_loss, np.float32, rtol=1e-4, atol=1e-5, what="fused loss")
        rt, at = _tol(dtype)
        assert_close(got[1][1], ref_dx, dtype, rtol=rt, atol=at, what="fused dx")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_large_logits_stay_finite(rng, dtype):
    N, V = 16, 4099
    x = (rng.choice([-1e4, 1e4], (N, V)) * rng.random((N, V))).astype(np.float32).astype(dtype)
    x[:, 5] = 1e4
    t = rng.integers(0, V, N).astype(np.int32)
    xd, td = device_copy(x), device_copy(t)
    loss, lse = ck.cross_entropy(xd, td, reduction="none", return_lse=True)
    ref_loss, ref_lse = ck.cross_entropy(x, t, reduction="none", return_lse=True)
    assert np.isfinite(to_host(loss)).all() and np.isfinite(to_host(lse)).all()
    # |lse| ~ 1e4: fp32 rounding of lse is ~1e-3 absolute
    assert_close(loss, ref_loss, np.float32, rtol=1e-5, atol=4e-3, what="loss")
    loss_f, dx = ck.cross_entropy_fused(xd, td, reduction="sum")
    h = to_host(dx).astype(np.float32)
    assert np.isfinite(h).all()
    ref_dx = ck.cross_entropy_fused(x, t, reduction="sum")[1]
    assert_close(dx, ref_dx, dtype, rtol=2e-2, atol=1e-4, what="dx")


@pytest.mark.gpu
def test_gpu_all_ignored_and_bad_targets(rng):
    N, V = 9, 333
    x = device_copy(randn(rng, (N, V), ck.bfloat16))
    t = device_copy(np.full(N, -100, np.int64))
    err = dev0(0, np.int32)
    loss = ck.cross_entropy(x, t, error=err)
    assert float(to_host(loss)) == 0.0
    loss, dx = ck.cross_entropy_fused(x, t, error=err)
    assert float(to_host(loss)) == 0.0 and not to_host(dx).astype(np.float32).any()
    assert int(to_host(err)) == 0
    # out-of-range targets: flagged, the row counts as ignored (never read at the bad index)
    th = np.arange(N, dtype=np.int64)
    th[2], th[5] = V, -7
    loss = ck.cross_entropy(x, device_copy(th), error=err)
    assert int(to_host(err)) == 1
    keep = th.copy()
    keep[[2, 5]] = -100
    assert_close(loss, ck.cross_entropy(to_host(x), keep), np.float32, rtol=1e-5, atol=1e-6)
    ck.cross_entropy_error().fill(0)
    ck.cross_entropy_fused(x, device_copy(th))
    assert int(ck.cross_entropy_error()) == 1
    ck.cross_entropy_error().fill(0)


@pytest.mark.gpu
def test_gpu_mean_is_deterministic_and_captures(rng):
    import cupy as cp

    N, V = 300, 32000
    x = device_copy(randn(rng, (N, V), ck.bfloat16, scale=3.0))
    t = device_copy(_targets(rng, N, V, np.int32))
    a = to_host(ck.cross_entropy(x, t))
    b = to_host(ck.cross_entropy(x, t))
    assert a.tobytes() == b.tobytes(), "mean reduction must be bit-identical run to run"
    la, da = ck.cross_entropy_fused(x, t)
    lb, db = ck.cross_entropy_fused(x, t)
    assert to_host(la).tobytes() == to_host(lb).tobytes() and np.array_equal(to_host(da).view(np.uint16), to_host(db).view(np.uint16))
    # graph capture of the fused op with a device dloss (a loss scale read on the device)
    dl = cp.full((), 0.5, dtype=cp.float32)
    dx = cp.empty_like(x)
    ck.cross_entropy_fused(x, t, dloss=dl, out=dx)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        loss, _ = ck.cross_entropy_fused(x, t, dloss=dl, out=dx)
        g = s.end_capture()
    with s:  # on the replay's stream (a legacy-stream fill races a non-blocking stream's replay)
        dx.fill(np.nan)
        dl.fill(2.0)  # changed after capture: the replay must read the new value
        g.launch(s)
    s.synchronize()
    hx, ht = to_host(x), to_host(t)
    ref_loss, ref_dx = ck.cross_entropy_fused(hx, ht, dloss=2.0)
    assert_close(loss, ref_loss, np.float32, rtol=1e-4, atol=1e-5)
    assert_close(dx, ref_dx, ck.bfloat16)


# ---------------------------------------------------------------- GPU: row-strided logits and dlogits
def _padded_dev(a, pad, misalign=False):
    """Device view of host ``a`` [..., V] whose rows lie V + pad elements apart inside a NaN-filled buffer (a read
    of a padding column makes the loss NaN); ``misalign`` puts the base one element past a 256-byte boundary.
    Returns (view, buffer)."""
    import cupy as cp

    lead, V = a.shape[:-1], a.shape[-1]
    flat = cp.empty(int(np.prod(lead)) * (V + pad) + int(misalign), dtype=a.dtype)
    flat.fill(np.nan)
    buf = (flat[1:] if misalign else flat).reshape(*lead, V + pad)
    v = buf[..., :V]
    v[...] = cp.asarray(a)
    return v, buf


# row layouts: (padding, misaligned base). "pad64": rows a multiple of 64 elements apart (every row 16-byte
# aligned: no head, V // E packs, a V % E tail); "odd": 3 extra elements (rows at every alignment); "pad64-mis":
# padded rows all one element past a 16-byte boundary (a 7- or 3-element head on every row).
CE_LAYOUTS = {"pad64": (None, False), "odd": (3, False), "pad64-mis": (None, True)}


def _pad(layout, V):
    p, mis = CE_LAYOUTS[layout]
    return ((-V) % 64 or 64) if p is None else p, mis


@pytest.mark.gpu
@pytest.mark.parametrize("V", [1, 1001, 50257])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", list(CE_LAYOUTS))
def test_gpu_row_strided_matches_reference(rng, V, dtype, layout):
    """Odd V inside padded rows with NaN padding: forward (every reduction, lse), backward into a strided out of
    the same layout (16-byte body) and of another (element path), fused into a separate strided out and in place;
    ignored rows and label smoothing; the padding columns are never read (NaN would reach the loss) or written."""
    N, eps = 37, 0.1
    x = randn(rng, (N, V), dtype, scale=4.0)
    t = _targets(rng, N, V, np.int32)
    t[3] = -100
    pad, mis = _pad(layout, V)
    xd, xbuf = _padded_dev(x, pad, mis)
    td = device_copy(t)
    rt, at = _tol(dtype)
    for reduction in ("mean", "sum", "none"):
        ref_loss, ref_lse = ck.cross_entropy(x, t, reduction=reduction, label_smoothing=eps, return_lse=True)
        loss, lse = ck.cross_entropy(xd, td, reduction=reduction, label_smoothing=eps, return_lse=True)
        assert_close(loss, ref_loss, np.float32, rtol=1e-4, atol=1e-5, what=f"loss {reduction}")
        assert_close(lse, ref_lse, np.float32, rtol=1e-5, atol=1e-5, what="lse")
        dl = np.float32(0.75) if reduction != "none" else randn(rng, (N,), np.float32)
        dld = dev0(dl, np.float32) if reduction != "none" else device_copy(dl)
        ref_dx = ck.cross_entropy_backward(x, t, ref_lse, np.asarray(dl, np.float32), reduction=reduction,
                                           label_smoothing=eps)
        for opad, omis in ((pad, mis), (5, not mis)):
            out, obuf = _padded_dev(np.full((N, V), np.nan, dtype), opad, omis)
            dx = ck.cross_entropy_backward(xd, td, lse, dld, reduction=reduction, label_smoothing=eps, out=out)
            assert dx is out
            assert_close(dx, ref_dx, dtype, rtol=rt, atol=at, what=f"dx {reduction} out pad {opad}")
            assert _padding_is_nan(obuf, V), "backward wrote a padding column"
        if reduction == "none":
            continue
        out, obuf = _padded_dev(np.full((N, V), np.nan, dtype), 5, not mis)  # rows incongruent: element path
        loss_f, dx_f = ck.cross_entropy_fused(xd, td, reduction=reduction, label_smoothing=eps, dloss=dld, out=out)
        assert dx_f is out
        assert_close(loss_f, ref_loss, np.float32, rtol=1e-4, atol=1e-5, what="fused loss")
        assert_close(dx_f, ref_dx, dtype, rtol=rt, atol=at, what="fused dx")
        assert _padding_is_nan(obuf, V), "fused wrote a padding column"
    ref_loss, ref_dx = ck.cross_entropy_fused(x, t, label_smoothing=eps, dloss=2.0)
    loss, dx = ck.cross_entropy_fused(xd, td, label_smoothing=eps, dloss=2.0)  # no out: rows as far apart as x's
    assert dx.strides == xd.strides
    assert_close(loss, ref_loss, np.float32, rtol=1e-4, atol=1e-5, what="default-out loss")
    assert_close(dx, ref_dx, dtype, rtol=rt, atol=at, what="default-out dx")
    loss, dx = ck.cross_entropy_fused(xd, td, label_smoothing=eps, dloss=2.0, out=xd)
    assert dx is xd
    assert_close(loss, ref_loss, np.float32, rtol=1e-4, atol=1e-5, what="in-place loss")
    assert_close(xd, ref_dx, dtype, rtol=rt, atol=at, what="in-place dx")
    assert _padding_is_nan(xbuf, V), "the logits' padding was written"


def _bits(a):
    return np.ascontiguousarray(to_host(a)).view(np.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_row_strided_is_bit_identical_to_contiguous(rng, dtype):
    """V = 1000: contiguous rows (2000 / 4000 B) and rows 1024 apart are all 16-byte aligned, so both layouts take
    the same per-row split, grid and summation order: loss, lse and dlogits agree bit for bit."""
    N, V = 45, 1000
    x = randn(rng, (N, V), dtype, scale=3.0)
    t = _targets(rng, N, V, np.int64)
    xc, td = device_copy(x), device_copy(t)
    xs, _ = _padded_dev(x, 24)
    for reduction in ("mean", "sum", "none"):
        kw = dict(reduction=reduction, label_smoothing=0.1)
        lc, ec = ck.cross_entropy(xc, td, return_lse=True, **kw)
        ls, es = ck.cross_entropy(xs, td, return_lse=True, **kw)
        assert _bits(lc).tobytes() == _bits(ls).tobytes() and _bits(ec).tobytes() == _bits(es).tobytes(), reduction
        dl = 0.5 if reduction != "none" else device_copy(randn(rng, (N,), np.float32))
        dc = ck.cross_entropy_backward(xc, td, ec, dl, **kw)
        ds = ck.cross_entropy_backward(xs, td, es, dl, out=_padded_dev(np.zeros((N, V), dtype), 40)[0], **kw)
        assert _bits(dc).tobytes() == _bits(ds).tobytes(), f"backward {reduction}"
    (fc, gc), (fs, gs) = ck.cross_entropy_fused(xc, td, dloss=0.5), ck.cross_entropy_fused(xs, td, dloss=0.5, out=xs)
    assert _bits(fc).tobytes() == _bits(fs).tobytes() and _bits(gc).tobytes() == _bits(gs).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_padded_odd_vocab_rows_are_bit_identical_to_single_rows(rng, dtype, misalign):
    """V = 50257 in rows 50304 apart: every row sits at the base's address mod 16, as a one-row contiguous copy at
    that alignment does, so row r of the padded call equals the one-row call bit for bit (per-row loss, lse,
    backward and fused dlogits with reduction 'sum', where g = dloss on every row)."""
    N, V, eps = 6, 50257, 0.1
    x = randn(rng, (N, V), dtype, scale=3.0)
    t = _targets(rng, N, V, np.int32, ignore_frac=0.0)
    t[2] = -100
    xs, xbuf = _padded_dev(x, 47, misalign)
    ts = device_copy(t)
    loss, lse = ck.cross_entropy(xs, ts, reduction="none", label_smoothing=eps, return_lse=True)
    dx, _ = _padded_dev(np.zeros((N, V), dtype), 47, misalign)  # out congruent with the logits, as below
    ck.cross_entropy_backward(xs, ts, lse, 0.5, reduction="sum", label_smoothing=eps, out=dx)
    _, fdx = ck.cross_entropy_fused(xs, ts, reduction="sum", label_smoothing=eps, dloss=0.5, out=xs)
    for r in range(N):
        x1, t1 = device_copy(x[r:r + 1], misalign), device_copy(t[r:r + 1])
        l1, e1 = ck.cross_entropy(x1, t1, reduction="none", label_smoothing=eps, return_lse=True)
        assert _bits(loss[r:r + 1]).tobytes() == _bits(l1).tobytes(), f"loss row {r}"
        assert _bits(lse[r:r + 1]).tobytes() == _bits(e1).tobytes(), f"lse row {r}"
        d1 = ck.cross_entropy_backward(x1, t1, e1, 0.5, reduction="sum", label_smoothing=eps,
                                       out=device_copy(np.zeros((1, V), dtype), misalign))
        assert _bits(dx[r:r + 1]).tobytes() == _bits(d1).tobytes(), f"backward row {r}"
        _, f1 = ck.cross_entropy_fused(x1, t1, reduction="sum", label_smoothing=eps, dloss=0.5, out=x1)
        assert _bits(fdx[r:r + 1]).tobytes() == _bits(f1).tobytes(), f"fused row {r}"
    assert _padding_is_nan(xbuf, V)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_row_strided_3d_and_empty(rng, dtype):
    """[B, T, V] logits inside [B, T, V + 23] (one row stride over both leading axes), and 0 rows."""
    B, T, V = 3, 5, 1001
    x = randn(rng, (B, T, V), dtype, scale=3.0)
    t = _targets(rng, (B, T), V, np.int64)
    xd, xbuf = _padded_dev(x, 23)
    ref_loss, ref_dx = ck.cross_entropy_fused(x, t, label_smoothing=0.05)
    loss, dx = ck.cross_entropy_fused(xd, device_copy(t), label_smoothing=0.05, out=xd)
    assert_close(loss, ref_loss, np.float32, rtol=1e-4, atol=1e-5, what="loss")
    assert_close(dx, ref_dx, dtype, *_tol(dtype), what="dx")
    assert _padding_is_nan(xbuf, V)
    e, _ = _padded_dev(np.zeros((0, V), dtype), 64)
    loss, dx = ck.cross_entropy_fused(e, device_copy(np.zeros(0, np.int32)), out=e)
    assert float(to_host(loss)) == 0.0 and dx.shape == (0, V)
