"""ck.linear_cross_entropy: the LM head GEMM and the loss fused in row chunks (cukernels/ops/linear_cross_entropy.py).

CPU: the NumPy reference against an independent float64 formula, finite differences, the unfused composite,
chunked == unchunked, the chunk plan's numbers, validation. GPU: the kernel path against the reference.
"""
import math

import numpy as np
import pytest

import cukernels as ck
from cukernels.ops import linear_cross_entropy as lce_mod
from cukernels.ops.linear_cross_entropy import chunk_rows_for, linear_cross_entropy
from helpers import DTYPES, device_copy, poisoned, to_host

IG = -100


def _case(rng, N, H, V, dtype, ignore_frac=0.2, zscale=1.0, idt=np.int32):
    """x ~ N(0, 1), W ~ N(0, zscale^2 / H): logits ~ N(0, zscale^2) whatever H is."""
    x = rng.standard_normal((N, H)).astype(np.float32).astype(dtype)
    w = (rng.standard_normal((V, H)) * zscale / np.sqrt(max(H, 1))).astype(np.float32).astype(dtype)
    t = rng.integers(0, V, N).astype(idt)
    t[rng.random(N) < ignore_frac] = IG
    return x, w, t


def _grid_case(rng, N, H, V, dtype, ignore_frac=0.2):
    """Inputs whose logits are exact in fp32 and bf16 whatever the GEMM's order: x in {-1, -3/4, ..., 1},
    W in {-1/2, -3/8, ..., 1/2}: every partial sum is a multiple of 1/32 with |z| <= 4 (H <= 8), i.e. at most
    8 significant bits: exact in fp32 and bf16."""
    assert H <= 8
    x = (rng.integers(-4, 5, (N, H)) / 4).astype(np.float32).astype(dtype)
    w = (rng.integers(-4, 5, (V, H)) / 8).astype(np.float32).astype(dtype)
    t = rng.integers(0, V, N).astype(np.int32)
    t[rng.random(N) < ignore_frac] = IG
    return x, w, t


def f64_oracle(x, w, t, ignore=IG, eps=0.0, reduction="mean", dloss=1.0, round_logits=None):
    """Independent float64 formula, row by row: (loss, dx, dW). round_logits: dtype the logits are rounded to."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    z = x64 @ w64.T
    if round_logits is not None:
        z = z.astype(round_logits).astype(np.float64)
    N, V = z.shape
    loss, dz = np.zeros(N), np.zeros_like(z)
    valid = t != ignore
    count = valid.sum()
    g = (dloss / count if count else 0.0) if reduction == "mean" else dloss
    for i in range(N):
        if not valid[i]:
            continue
        lse = np.logaddexp.reduce(z[i])
        q = np.full(V, eps / V)
        q[t[i]] += 1 - eps
        loss[i] = -(q * (z[i] - lse)).sum()
        dz[i] = g * (np.exp(z[i] - lse) - q)
    if reduction == "none":
        L = loss
    else:
        L = loss.sum() / (count if reduction == "mean" and count else 1)
    return L, dz @ w64, dz.T @ x64


def _close(got, ref, rtol, atol_rel, what):
    """|got - ref| <= rtol |ref| + atol_rel * max|ref| (absolute floor relative to the array's scale)."""
    g, r = to_host(got).astype(np.float64), np.asarray(to_host(ref)).astype(np.float64)
    assert g.shape == r.shape, f"{what}: shape {g.shape} != {r.shape}"
    assert np.isfinite(g).all(), f"{what}: non-finite values (unwritten or NaN)"
    scale = float(np.abs(r).max()) if r.size else 0.0
    np.testing.assert_allclose(g, r, rtol=rtol, atol=atol_rel * scale + 1e-30, err_msg=what)


# ---------------------------------------------------------------- CPU: the reference
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [None, 3])
def test_reference_matches_f64(rng, reduction, eps, chunk):
    x, w, t = _case(rng, 10, 6, 13, np.float32, zscale=3.0)
    t[0] = IG
    loss, dx, dw = linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=eps, chunk_rows=chunk,
                                        dloss=0.75)
    L, DX, DW = f64_oracle(x, w, t, eps=eps, reduction=reduction, dloss=0.75)
    assert loss.dtype == np.float32 and loss.shape == ((10,) if reduction == "none" else ())
    assert dx.dtype == np.float32 and dx.shape == (10, 6) and dw.dtype == np.float32 and dw.shape == (13, 6)
    np.testing.assert_allclose(loss, L, rtol=1e-6, atol=1e-6)
    # fp32 sums of ~10 terms of O(1): over 300 seeds the error beyond rtol reached 2.6e-7, so atol 1e-6
    np.testing.assert_allclose(dx, DX, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, DW, rtol=1e-5, atol=1e-6)
    assert not dx[0].any(), "an ignored row gets no input gradient"


def test_reference_bf16_rounds_the_logits_once_like_the_unfused_path(rng):
    """bf16: the logits are the GEMM's bf16 output; the f64 formula on those rounded logits agrees tightly."""
    x, w, t = _case(rng, 9, 16, 21, ck.bfloat16, zscale=4.0)
    loss, dx, dw = linear_cross_entropy(x, w, t, label_smoothing=0.05)
    L, DX, DW = f64_oracle(x, w, t, eps=0.05, round_logits=ck.bfloat16)
    np.testing.assert_allclose(loss, L, rtol=1e-6)
    assert dx.dtype == ck.bfloat16 and dw.dtype == np.float32
    # dlogits are rounded to bf16 before the gradient GEMMs (as the in-place kernel writes them): ~2^-9 relative
    np.testing.assert_allclose(dx.astype(np.float64), DX, rtol=1e-2, atol=2e-3 * np.abs(DX).max())
    np.testing.assert_allclose(dw, DW, rtol=1e-2, atol=2e-3 * np.abs(DW).max())
    # and the unrounded f64 logits differ by more than that: the rounding is really there
    L_exact = f64_oracle(x, w, t, eps=0.05)[0]
    assert abs(float(loss) - L_exact) > 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_equals_unfused_composite(rng, dtype, reduction):
    """Same as ck.matmul -> ck.cross_entropy_fused (in place) -> the two gradient matmuls on the full logits."""
    x, w, t = _case(rng, 12, 8, 17, dtype, zscale=2.0)
    loss, dx, dw = linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=0.1)
    z = ck.matmul(x, w, trans_b=True)
    l_ref, dz = ck.cross_entropy_fused(z, t, reduction=reduction, label_smoothing=0.1, out=z)
    dx_ref = ck.matmul(dz, w)
    dw_ref = ck.matmul(dz, x, trans_a=True, out_dtype=np.float32)
    np.testing.assert_allclose(loss, l_ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dx.astype(np.float32), dx_ref.astype(np.float32), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_reference_gradients_match_finite_differences(rng, reduction, eps):
    N, H, V = 4, 3, 5
    x, w, _ = _case(rng, N, H, V, np.float32, zscale=2.0)
    t = np.array([1, IG, 4, 0], np.int32)
    dl = 1.5

    def L(x_, w_):
        return float(np.sum(f64_oracle(x_, w_, t, eps=eps, reduction=reduction, dloss=dl)[0])) * dl

    def fd(a, f):
        out = np.zeros(a.shape)
        a = a.astype(np.float64)
        for i in np.ndindex(a.shape):
            ap, am = a.copy(), a.copy()
            ap[i] += 1e-6
            am[i] -= 1e-6
            out[i] = (f(ap) - f(am)) / 2e-6
        return out

    fdx = fd(x, lambda a: L(a, w))
    fdw = fd(w, lambda a: L(x, a))
    _, dx, dw = linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=eps, dloss=dl, chunk_rows=3)
    np.testing.assert_allclose(dx, fdx, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dw, fdw, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_all_ignored_is_zero_not_nan(rng, reduction):
    x, w, _ = _case(rng, 5, 4, 7, np.float32)
    t = np.full(5, IG, np.int32)
    gw = np.full((7, 4), np.nan, np.float32)
    loss, dx, dw = linear_cross_entropy(x, w, t, reduction=reduction, grad_weight=gw, chunk_rows=2)
    assert dw is gw
    assert not np.asarray(loss).any() and not dx.any() and not dw.any()
    assert np.isfinite(dw).all()
    g0 = rng.standard_normal((7, 4)).astype(np.float32)
    gw = g0.copy()
    linear_cross_entropy(x, w, t, reduction=reduction, grad_weight=gw, accumulate=True)
    np.testing.assert_array_equal(gw, g0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_reference_chunked_equals_unchunked(rng, dtype, reduction):
    N = 11
    x, w, t = _grid_case(rng, N, 5, 9, dtype)  # exact logits: a one-row chunk (gemv) rounds them the same
    base = linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=0.05)
    # dx is rounded to x's dtype after an fp32 GEMM whose order may depend on the chunk: one ulp for bf16
    dx_rtol = 1e-6 if np.dtype(dtype) == np.float32 else 2**-8
    for c in (1, 2, 3, 4, 7, 10, 11, 12, 100):
        got = linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=0.05, chunk_rows=c)
        np.testing.assert_array_equal(got[0], base[0], err_msg=f"loss chunk_rows={c}")
        np.testing.assert_allclose(got[1].astype(np.float32), base[1].astype(np.float32), rtol=dx_rtol, atol=1e-7,
                                   err_msg=f"dx chunk_rows={c}")
        np.testing.assert_allclose(got[2], base[2], rtol=1e-6, atol=1e-7, err_msg=f"dW chunk_rows={c}")


def test_reference_accumulate_out_buffers_and_eval(rng):
    x, w, t = _grid_case(rng, 6, 4, 10, ck.bfloat16)
    loss, dx, dw = linear_cross_entropy(x, w, t)
    g0 = rng.standard_normal((10, 4)).astype(np.float32)
    gw, gi = g0.copy(), np.full((6, 4), np.nan, ck.bfloat16)
    loss2, dx2, dw2 = linear_cross_entropy(x, w, t, grad_weight=gw, accumulate=True, grad_input=gi, chunk_rows=4)
    assert dw2 is gw and dx2 is gi
    np.testing.assert_allclose(gw, g0 + dw, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gi.astype(np.float32), dx.astype(np.float32), rtol=2**-8, atol=1e-7)
    le, dxe, dwe = linear_cross_entropy(x, w, t, compute_grad=False, chunk_rows=5)
    assert dxe is None and dwe is None
    np.testing.assert_allclose(le, loss, rtol=1e-6)
    # dloss scales the gradients only; a 0-d float32 array reads the same as the float
    l3, dx3, dw3 = linear_cross_entropy(x, w, t, dloss=np.asarray(2.0, np.float32))
    np.testing.assert_array_equal(l3, loss)
    np.testing.assert_allclose(dw3, 2 * dw, rtol=1e-6)


def test_reference_bf16_grad_weight_is_one_chunk_rounded_once(rng):
    """A bf16 grad_weight (an optimizer's bf16 gradient) takes the single chunk's fp32 dW rounded once; a call
    of several chunks, or accumulate, would round per chunk and is refused with the fix named."""
    x, w, t = _case(rng, 12, 8, 30, ck.bfloat16)
    _, _, dw = linear_cross_entropy(x, w, t)
    gw = np.full((30, 8), np.nan, ck.bfloat16)
    _, _, got = linear_cross_entropy(x, w, t, grad_weight=gw)
    assert got is gw
    np.testing.assert_array_equal(gw.view(np.uint16), dw.astype(ck.bfloat16).view(np.uint16))
    with pytest.raises(ValueError, match=r"grad_weight: a bfloat16 buffer takes dW from a single chunk \(N = 12 "
                                         r"rows, chunks of 5\).*pass a float32 buffer"):
        linear_cross_entropy(x, w, t, grad_weight=gw, chunk_rows=5)
    with pytest.raises(ValueError, match="without accumulate"):
        linear_cross_entropy(x, w, t, grad_weight=gw, accumulate=True)
    with pytest.raises(TypeError, match="grad_weight"):
        linear_cross_entropy(x, w, t, grad_weight=np.zeros((30, 8), np.float16))


def test_reference_int64_targets_ignore_index_in_range_and_empty(rng):
    x, w, t = _case(rng, 7, 3, 6, np.float32, ignore_frac=0.0, idt=np.int64)
    t[[1, 4]] = 0
    loss, dx, dw = linear_cross_entropy(x, w, t, ignore_index=0)
    L, DX, DW = f64_oracle(x, w, t, ignore=0)
    np.testing.assert_allclose(loss, L, rtol=1e-6)
    np.testing.assert_allclose(dw, DW, rtol=1e-5, atol=1e-7)
    assert not dx[1].any() and not dx[4].any()
    e = np.zeros((0, 3), np.float32)
    gw = np.full((6, 3), np.nan, np.float32)
    loss, dx, dw = linear_cross_entropy(e, w, np.zeros(0, np.int32), grad_weight=gw)
    assert float(loss) == 0.0 and dx.shape == (0, 3) and dw is gw and not gw.any()
    ln, _, _ = linear_cross_entropy(e, w, np.zeros(0, np.int32), reduction="none")
    assert ln.shape == (0,) and ln.dtype == np.float32


def test_reference_out_of_range_target_raises(rng):
    x, w, _ = _case(rng, 2, 3, 4, np.float32)
    with pytest.raises(ValueError, match="targets: value 4 is out of range for 4 classes"):
        linear_cross_entropy(x, w, np.array([0, 4], np.int32))
    with pytest.raises(ValueError, match="targets: value -3"):
        linear_cross_entropy(x, w, np.array([-3, 1], np.int32), compute_grad=False)


def test_chunk_plan_numbers():
    """The numbers the module docstring and NOTES.md quote, and the plan's invariants."""
    assert chunk_rows_for(8192, 128256, 2) == 2048  # 4 chunks, 2048 x 128256 x 2 = 525 MB
    assert chunk_rows_for(8192, 128256, 4) == 1024  # fp32: 8 chunks
    assert chunk_rows_for(8192, 50257, 2) == 4096  # GPT-2: 2 chunks of 412 MB
    assert chunk_rows_for(4097, 128256, 2) == 1408  # 3 chunks: 1408 + 1408 + 1281
    assert chunk_rows_for(1000, 128256, 2) == 1000 and chunk_rows_for(1, 7, 4) == 1 and chunk_rows_for(0, 7, 2) == 0
    assert chunk_rows_for(8192, 8_000_000, 2) == 128  # the floor: 128 rows even over the budget
    assert chunk_rows_for(8192, 128256, 2, 1 << 30) == 4096  # the head budget (settings.head_workspace): 2 chunks
    rng = np.random.default_rng(0)
    for _ in range(2000):
        N, V, s = int(rng.integers(1, 200_000)), int(rng.integers(1, 1_000_000)), int(rng.choice([2, 4]))
        c = chunk_rows_for(N, V, s)
        cmax = max(128, lce_mod.WORKSPACE_BUDGET // (V * s) // 128 * 128)
        assert 1 <= c <= N
        assert c * V * s <= max(lce_mod.WORKSPACE_BUDGET, 128 * V * s)
        assert c == N or c % 128 == 0
        assert -(-N // c) == -(-N // cmax), "no more chunks than the budget needs"


# ---------------------------------------------------------------- CPU: a padded weight (num_classes)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_reference_padded_weight_equals_unpadded(rng, reduction):
    """weight = V class rows + padding rows (GPT-2's [50304, H] layout): the reference never reads the padding rows,
    even NaN ones (the GPU path needs them finite: see the GPU test); dweight is [V, H]; a target in [V, Vw) is out
    of range."""
    N, H, V, Vw = 9, 5, 13, 16
    x, w, t = _case(rng, N, H, V, np.float32, zscale=2.0)
    wp = np.full((Vw, H), np.nan, np.float32)
    wp[:V] = w
    ref = linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=0.1, chunk_rows=4)
    got = linear_cross_entropy(x, wp, t, reduction=reduction, label_smoothing=0.1, chunk_rows=4, num_classes=V)
    assert got[2].shape == (V, H)
    for a, b, name in zip(got, ref, ("loss", "dx", "dW")):
        np.testing.assert_array_equal(a, b, err_msg=name)
    same = linear_cross_entropy(x, w, t, num_classes=V)  # num_classes == rows: the plain call
    np.testing.assert_array_equal(same[0], linear_cross_entropy(x, w, t)[0])
    t[0] = V  # a padding row's index is not a class
    with pytest.raises(ValueError, match="targets: value 13 is out of range for 13 classes"):
        linear_cross_entropy(x, wp, t, num_classes=V)


def _bad(**kw):
    x = np.zeros((3, 4), np.float32)
    a = dict(x=x, weight=np.zeros((5, 4), np.float32), targets=np.zeros(3, np.int32))
    a.update(kw)
    return lambda: linear_cross_entropy(a.pop("x"), a.pop("weight"), a.pop("targets"), **a)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (_bad(x=np.zeros((3, 4), np.float64)), TypeError, "x: expected dtype"),
        (_bad(x=np.zeros((2, 3, 4), np.float32)), ValueError, r"x: expected a 2-D array \[N, H\]"),
        (_bad(x=np.zeros((4, 3), np.float32).T), ValueError, "x: expected a C-contiguous"),
        (_bad(weight=np.zeros((5, 4), ck.bfloat16)), TypeError, "weight: expected dtype float32"),
        (_bad(weight=np.zeros((5, 3), np.float32)), ValueError, r"weight: expected shape \[V, 4\]"),
        (_bad(weight=np.zeros(4, np.float32)), ValueError, "weight: expected shape"),
        (_bad(weight=np.zeros((0, 4), np.float32)), ValueError, "weight: expected at least 1 row"),
        (_bad(weight=np.zeros((4, 5), np.float32).T), ValueError, "weight: expected a C-contiguous"),
        (_bad(targets=np.zeros(3, np.float32)), TypeError, "targets: expected dtype"),
        (_bad(targets=np.zeros(4, np.int32)), ValueError, r"targets: expected shape \(3,\)"),
        (_bad(targets=np.zeros((3, 1), np.int32)), ValueError, "targets: expected shape"),
        (_bad(ignore_index=1.5), TypeError, "ignore_index"),
        (_bad(reduction="avg"), ValueError, "reduction"),
        (_bad(label_smoothing=1.5), ValueError, "label_smoothing"),
        (_bad(label_smoothing="a"), TypeError, "label_smoothing"),
        (_bad(grad_weight=np.zeros((5, 4), np.float16)), TypeError, "grad_weight: expected dtype float32"),
        (_bad(grad_weight=np.zeros((4, 5), np.float32)), ValueError, r"grad_weight: expected shape \(5, 4\)"),
        (_bad(grad_weight=np.zeros((4, 5), np.float32).T), ValueError, "grad_weight: expected a C-contiguous"),
        (_bad(accumulate=True), ValueError, "grad_weight: required when accumulate=True"),
        (_bad(accumulate=1), TypeError, "accumulate: expected True or False"),
        (_bad(compute_grad=None), TypeError, "compute_grad"),
        (_bad(compute_grad=False, grad_weight=np.zeros((5, 4), np.float32)), ValueError, "grad_weight: given"),
        (_bad(compute_grad=False, grad_input=np.zeros((3, 4), np.float32)), ValueError, "grad_input: given"),
        (_bad(chunk_rows=0), ValueError, "chunk_rows: expected a positive integer"),
        (_bad(chunk_rows=2.0), TypeError, "chunk_rows: expected an integer"),
        (_bad(chunk_rows=True), TypeError, "chunk_rows"),
        (_bad(grad_input=np.zeros((3, 4), ck.bfloat16)), TypeError, "grad_input: expected dtype"),
        (_bad(grad_input=np.zeros((3, 5), np.float32)), ValueError, "grad_input: expected shape"),
        (_bad(dloss="1"), TypeError, "dloss"),
        (_bad(dloss=np.ones((), np.float64)), TypeError, "dloss: expected dtype"),
        (_bad(dloss=np.ones(3, np.float32)), ValueError, r"dloss: expected shape \(\)"),
        (_bad(error=np.zeros((), np.int64)), TypeError, "error: expected dtype"),
        (_bad(weight=[[0.0] * 4] * 5), TypeError, "weight: expected a numpy.ndarray or cupy.ndarray"),
        (_bad(num_classes=0), ValueError, r"num_classes: expected an integer in \[1, 5\]"),
        (_bad(num_classes=6), ValueError, r"num_classes: expected an integer in \[1, 5\]"),
        (_bad(num_classes=4.0), TypeError, "num_classes: expected an integer"),
        (_bad(num_classes=4, grad_weight=np.zeros((5, 4), np.float32)), ValueError,
         r"grad_weight: expected shape \(4, 4\)"),
    ],
)
def test_bad_input_messages(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ---------------------------------------------------------------- GPU
# Tolerances (rtol, atol relative to max|ref|) of the kernel path against the reference. Both round the logits
# and dlogits to x's dtype once and accumulate the GEMMs in fp32; they differ by the GEMMs' summation order
# (fp32: ~1e-6 relative), which for bf16 can flip the rounding of an element by one ulp (2^-8 relative; at
# |z| < 8 that is <= 0.031 in a per-row loss).
LOSS_TOL = {np.dtype(np.float32): (1e-5, 1e-5), np.dtype(ck.bfloat16): (2e-3, 1e-3)}
ROW_TOL = {np.dtype(np.float32): (1e-4, 1e-5), np.dtype(ck.bfloat16): (1e-2, 4e-3)}  # atol x max|loss_i| (~10)
GRAD_TOL = {np.dtype(np.float32): (1e-3, 1e-4), np.dtype(ck.bfloat16): (2e-2, 1e-2)}


def _check(got, ref, dtype, reduction, what=""):
    d = np.dtype(dtype)
    (lr, la), (gr, ga) = (ROW_TOL if reduction == "none" else LOSS_TOL)[d], GRAD_TOL[d]
    _close(got[0], ref[0], lr, la, f"{what} loss")
    if ref[1] is not None:
        _close(got[1], ref[1], gr, ga, f"{what} dx")
        _close(got[2], ref[2], gr, ga, f"{what} dW")


# (N, H, V, chunk_rows): single rows, odd N, odd V (GPT-2's 50257), chunk boundaries with a short last chunk
GPU_SHAPES = [(1, 64, 1000, None), (3, 40, 50257, None), (1000, 96, 1000, 128), (4097, 64, 1000, 1024),
              (1000, 64, 50257, 256), (257, 128, 32000, 64), (37, 33, 4099, 5)]


@pytest.mark.gpu
@pytest.mark.parametrize("N, H, V, chunk", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_matches_reference(rng, N, H, V, chunk, dtype):
    misalign = N == 37  # odd H and misaligned views: cuBLAS and the CE kernel's element paths
    eps = 0.1 if V % 2 else 0.0
    x, w, t = _case(rng, N, H, V, dtype, idt=np.int64 if N % 2 else np.int32)
    xd, wd, td = device_copy(x, misalign), device_copy(w, misalign), device_copy(t, misalign)
    for reduction in ("mean", "sum", "none"):
        ref = linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=eps, chunk_rows=chunk)
        gi = poisoned((N, H), dtype, misalign)
        gw = poisoned((V, H), np.float32)  # beta = 0 on the first chunk: NaN must not leak through
        got = linear_cross_entropy(xd, wd, td, reduction=reduction, label_smoothing=eps, chunk_rows=chunk,
                                   grad_weight=gw, grad_input=gi)
        assert got[1] is gi and got[2] is gw
        assert got[0].shape == ref[0].shape and got[0].dtype == np.float32
        _check(got, ref, dtype, reduction, f"{N}x{H}x{V} chunk={chunk} {reduction}")
    # evaluation: the loss only, same numbers
    loss = linear_cross_entropy(xd, wd, td, label_smoothing=eps, chunk_rows=chunk, compute_grad=False)
    assert loss[1] is None and loss[2] is None
    ref = linear_cross_entropy(x, w, t, label_smoothing=eps, compute_grad=False)
    _close(loss[0], ref[0], *LOSS_TOL[np.dtype(dtype)], "eval loss")


@pytest.mark.gpu
@pytest.mark.parametrize("N, H, V, chunk", [(1, 64, 1000, None), (1000, 64, 50257, 256), (37, 33, 4099, 5)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_padded_weight_matches_reference(rng, N, H, V, chunk, dtype):
    """num_classes: W in a [ceil(V/64)*64, H] buffer whose padding rows hold large finite values (NaN rows are
    refused by the contract: the dx GEMM multiplies them by zero gradients). The logits and dx GEMMs run over the
    padded rows; a padding column that reached the loss or a padding dlogit left unzeroed changes the result."""
    import cupy as cp

    misalign = N == 37
    Vw = -(-V // 64) * 64 + (64 if V % 64 == 0 else 0)  # always some padding
    x, w, t = _case(rng, N, H, V, dtype)
    xd, td = device_copy(x, misalign), device_copy(t, misalign)
    wp = cp.full((Vw, H), 1e3, dtype=np.float32).astype(dtype)  # padding logits ~1e3 x |x| would dominate
    wp[:V] = cp.asarray(w)
    for reduction in ("mean", "none"):
        ref = linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=0.1, chunk_rows=chunk)
        gw = poisoned((V, H), np.float32)
        gi = poisoned((N, H), dtype, misalign)
        got = linear_cross_entropy(xd, wp, td, reduction=reduction, label_smoothing=0.1, chunk_rows=chunk,
                                   grad_weight=gw, grad_input=gi, num_classes=V)
        assert got[2].shape == (V, H)
        _check(got, ref, dtype, reduction, f"padded {N}x{H}x{V}->{Vw} {reduction}")
    loss = linear_cross_entropy(xd, wp, td, compute_grad=False, num_classes=V, chunk_rows=chunk)
    _close(loss[0], linear_cross_entropy(x, w, t, compute_grad=False)[0], *LOSS_TOL[np.dtype(dtype)], "eval")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_chunk_sizes_agree(rng, dtype):
    """Every chunking gives the same result (up to the GEMMs' order): boundaries are handled."""
    N, H, V = 515, 72, 3001
    x, w, t = _case(rng, N, H, V, dtype)
    xd, wd, td = device_copy(x), device_copy(w), device_copy(t)
    base = [to_host(a) for a in linear_cross_entropy(xd, wd, td, reduction="none", label_smoothing=0.1)]
    for c in (1, 7, 128, 514, 515, 10_000):
        got = linear_cross_entropy(xd, wd, td, reduction="none", label_smoothing=0.1, chunk_rows=c)
        _check(got, base, dtype, "none", f"chunk_rows={c}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_accumulate_adds_into_grad_weight(rng, dtype):
    import cupy as cp

    N, H, V = 300, 64, 2000
    x, w, t = _case(rng, N, H, V, dtype)
    g0 = rng.standard_normal((V, H)).astype(np.float32) * 1e-3
    _, dx_ref, dw_ref = linear_cross_entropy(x, w, t, chunk_rows=128)
    gw = cp.asarray(g0)
    _, _, dw = linear_cross_entropy(device_copy(x), device_copy(w), device_copy(t), grad_weight=gw, accumulate=True,
                                    chunk_rows=128)
    assert dw is gw
    gr, ga = GRAD_TOL[np.dtype(dtype)]
    _close(gw, g0 + dw_ref, gr, ga, "g0 + dW")


@pytest.mark.gpu
@pytest.mark.parametrize("N, V", [(256, 2000), (37, 4099)])
def test_gpu_bf16_grad_weight_single_chunk(rng, N, V):
    """bf16 grad_weight, one chunk, poisoned: the fp32 dW rounded once, within a bf16 ulp of the rounded
    reference (cuBLAS may pick another kernel, i.e. another summation order, for a bf16 output)."""
    H = 64
    x, w, t = _case(rng, N, H, V, ck.bfloat16)
    _, _, dw_ref = linear_cross_entropy(x, w, t)
    gw = poisoned((V, H), ck.bfloat16)
    _, _, dw = linear_cross_entropy(device_copy(x), device_copy(w), device_copy(t), grad_weight=gw)
    assert dw is gw
    got = to_host(gw).astype(np.float32)
    assert np.isfinite(got).all()
    _close(got, dw_ref, *GRAD_TOL[np.dtype(ck.bfloat16)], "bf16 dW")


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gpu_all_ignored_empty_and_bad_targets(rng, reduction):
    import cupy as cp

    N, H, V = 9, 16, 333
    x, w, _ = _case(rng, N, H, V, ck.bfloat16)
    xd, wd = device_copy(x), device_copy(w)
    err = cp.zeros((), cp.int32)
    gw, gi = poisoned((V, H), np.float32), poisoned((N, H), ck.bfloat16)
    loss, dx, dw = linear_cross_entropy(xd, wd, cp.full(N, IG, cp.int32), reduction=reduction, grad_weight=gw,
                                        grad_input=gi, chunk_rows=4, error=err)
    assert not to_host(loss).any() and not to_host(dx).astype(np.float32).any() and not to_host(dw).any()
    assert np.isfinite(to_host(dw)).all() and int(to_host(err)) == 0
    # N = 0: loss 0 (or an empty "none"), dW zeroed (not accumulated into: left as is)
    gw = poisoned((V, H), np.float32)
    loss, dx, dw = linear_cross_entropy(xd[:0], wd, cp.zeros(0, cp.int32), reduction=reduction, grad_weight=gw)
    assert to_host(loss).shape == ((0,) if reduction == "none" else ()) and not to_host(loss).any()
    assert dx.shape == (0, H) and not to_host(dw).any()
    # out-of-range targets: flagged, the row counts as ignored (also in the mean's divisor)
    th = rng.integers(0, V, N).astype(np.int32)
    th[2], th[5] = V, -7
    got = linear_cross_entropy(xd, wd, device_copy(th), reduction=reduction, error=err)
    assert int(to_host(err)) == 1
    keep = th.copy()
    keep[[2, 5]] = IG
    _check(got, linear_cross_entropy(x, w, keep, reduction=reduction), ck.bfloat16, reduction, "bad targets")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_large_logits_stay_finite(rng, dtype):
    N, H, V = 64, 32, 4099
    x, w, t = _case(rng, N, H, V, dtype, zscale=300.0)  # |z| up to ~1e3: exp would overflow without the max
    got = linear_cross_entropy(device_copy(x), device_copy(w), device_copy(t), reduction="none", chunk_rows=24)
    ref = linear_cross_entropy(x, w, t, reduction="none", chunk_rows=24)
    for a in got:
        assert np.isfinite(to_host(a).astype(np.float32)).all()
    # a per-row loss ~ |z| ~ 1e3: one ulp of a bf16 logit there is 4, of fp32 ~6e-5 (times the GEMM order)
    # and an fp32 GEMM error of ~6e-4 at |z| ~ 1e3 moves a softmax of close top logits by ~6e-4 relative
    bf = np.dtype(dtype) == np.dtype(ck.bfloat16)
    rtol = 1e-2 if bf else 1e-4
    _close(got[0], ref[0], rtol, rtol, "loss rows")
    gtol = (2e-2, 1e-2) if bf else (5e-3, 1e-3)
    _close(got[1], ref[1], *gtol, "dx")
    _close(got[2], ref[2], *gtol, "dW")


@pytest.mark.gpu
def test_gpu_device_dloss_and_bit_identical_reruns(rng):
    import cupy as cp

    N, H, V = 700, 128, 5000
    x, w, t = _case(rng, N, H, V, ck.bfloat16)
    xd, wd, td = device_copy(x), device_copy(w), device_copy(t)
    runs = [[to_host(a) for a in linear_cross_entropy(xd, wd, td, label_smoothing=0.1, chunk_rows=256,
                                                      dloss=cp.full((), 0.5, cp.float32))] for _ in range(2)]
    for a, b, name in zip(runs[0], runs[1], ("loss", "dx", "dW")):
        assert a.tobytes() == b.tobytes(), f"{name} differs between two identical calls"
    ref = linear_cross_entropy(x, w, t, label_smoothing=0.1, chunk_rows=256, dloss=0.5)
    _check(runs[0], ref, ck.bfloat16, "mean", "dloss 0.5 on the device")


@pytest.mark.gpu
def test_gpu_extra_memory_is_the_workspace_not_the_logits(rng):
    """Under a private pool, a call allocates the [chunk, V] workspace, dx and a few scalars: not [N, V]."""
    import cupy as cp

    N, H, V, C = 4096, 256, 32000, 512
    x, w, t = _case(rng, N, H, V, ck.bfloat16)
    xd, wd, td = device_copy(x), device_copy(w), device_copy(t)
    gw = cp.zeros((V, H), cp.float32)
    linear_cross_entropy(xd, wd, td, grad_weight=gw, chunk_rows=C)  # warm-up: kernels, cuBLAS handle
    cp.cuda.Device().synchronize()
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        linear_cross_entropy(xd, wd, td, grad_weight=gw, chunk_rows=C)
        cp.cuda.Device().synchronize()
    need = C * V * 2 + N * H * 2  # workspace + dx: 32.8 + 2.1 MB (full logits would be 262 MB)
    assert pool.total_bytes() <= need + (1 << 20), f"{pool.total_bytes()} bytes held, expected ~{need}"
    pool.free_all_blocks()


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("N, H, V, chunk", [(3, 40, 50257, None), (1000, 64, 50257, 256), (37, 33, 4099, 5)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_staged_weight_matches_reference(rng, N, H, V, chunk, dtype, stage, monkeypatch):
    """A weight with an unaligned row count is staged into zero-padded rows (ck.settings.lce_stage_weight, the
    default) or used as it is (off): both agree with the reference; the caller's weight is never written."""
    import cupy as cp

    monkeypatch.setattr(ck.settings, "lce_stage_weight", bool(stage))
    misalign = N == 37
    x, w, t = _case(rng, N, H, V, dtype)
    xd, wd, td = device_copy(x, misalign), device_copy(w, misalign), device_copy(t, misalign)
    before = cp.asnumpy(wd).tobytes()
    for reduction in ("mean", "none"):
        ref = linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=0.1, chunk_rows=chunk)
        got = linear_cross_entropy(xd, wd, td, reduction=reduction, label_smoothing=0.1, chunk_rows=chunk,
                                   grad_weight=poisoned((V, H), np.float32),
                                   grad_input=poisoned((N, H), dtype, misalign))
        _check(got, ref, dtype, reduction, f"stage={stage} {N}x{H}x{V} {reduction}")
    assert cp.asnumpy(wd).tobytes() == before


@pytest.mark.gpu
@pytest.mark.parametrize("V", [3000, 3001], ids=["aligned", "staged"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_captured_call_replays(rng, reduction, V):
    """A CUDA graph of the call (ck.graph.CapturedStep) replays to the eager result, and follows new contents of
    its input buffers (new x and new targets: the mean's divisor is recounted on the device each replay); with
    V = 3001 the weight's staging copy is part of the graph."""
    import cupy as cp

    N, H = 600, 64
    x, w, t = _case(rng, N, H, V, ck.bfloat16)
    xd, wd, td = device_copy(x), device_copy(w), device_copy(t)
    gw = cp.zeros((V, H), cp.float32)
    gi = cp.empty((N, H), dtype=ck.bfloat16)

    def step():
        return linear_cross_entropy(xd, wd, td, reduction=reduction, label_smoothing=0.1, grad_weight=gw,
                                    grad_input=gi, chunk_rows=256)

    s = ck.graph.CapturedStep(step, warmup=1)
    s()
    out = s()  # captured and replayed
    assert s.graph is not None
    s.synchronize()
    ref = linear_cross_entropy(x, w, t, reduction=reduction, label_smoothing=0.1, chunk_rows=256)
    _check([to_host(a) for a in out], ref, ck.bfloat16, reduction, "replay")
    x2, _, t2 = _case(rng, N, H, V, ck.bfloat16, ignore_frac=0.6)
    xd[...] = cp.asarray(x2)
    td[...] = cp.asarray(t2)
    gi.fill(np.nan)
    out = s()
    s.synchronize()
    replay = [to_host(a) for a in out]  # host copies: dx and dW live in gi / gw, which the eager call rewrites
    ref = linear_cross_entropy(x2, w, t2, reduction=reduction, label_smoothing=0.1, chunk_rows=256)
    _check(replay, ref, ck.bfloat16, reduction, "replay with new inputs")
    eager = [to_host(a) for a in step()]
    for a, b, name in zip(replay, eager, ("loss", "dx", "dW")):
        assert a.tobytes() == b.tobytes(), f"{name}: the replay and the eager call differ"


@pytest.mark.gpu
def test_gpu_rejects_mixed_modules(rng):
    x, w, t = _case(rng, 4, 8, 16, np.float32)
    with pytest.raises(TypeError, match="weight: is a numpy array but x is a cupy array"):
        linear_cross_entropy(device_copy(x), w, device_copy(t))
    with pytest.raises(TypeError, match="dloss: is a numpy array but x is a cupy array"):
        linear_cross_entropy(device_copy(x), device_copy(w), device_copy(t), dloss=np.ones((), np.float32))


# ---------------------------------------------------------------- grad_fp8: the gradient GEMMs in FP8
E4, E5 = np.dtype(ck.float8_e4m3fn), np.dtype(ck.float8_e5m2)


def _deq8(a, fmt):
    """An independent current-scaling quantise-dequantise: s = max / amax, ml_dtypes on clip(a * s)."""
    a = a.astype(np.float32)
    amax = float(np.abs(a).max())
    mx = 448.0 if fmt == E4 else 57344.0
    s = np.float32(mx / amax) if amax > 0 else np.float32(1)
    q = np.clip(a * s, -mx, mx).astype(fmt)
    return q.astype(np.float32) * (np.float32(1) / s)


def _deq8_bound(a, g, fmt):
    """An independent quantise-dequantise with the dlogits' scale: the largest power of two s with s |g| <= max
    (|dlogits| <= |g|), ml_dtypes on clip(a * s)."""
    mx = 448.0 if fmt == E4 else 57344.0
    s = np.float32(2.0 ** math.floor(math.log2(mx / abs(g))))
    q = np.clip(a.astype(np.float32) * s, -mx, mx).astype(fmt)
    return q.astype(np.float32) * (np.float32(1) / s)


@pytest.mark.parametrize("g, fmt, want", [(1 / 4096, E5, 2.0**27), (1 / 4096, E4, 2.0**20), (1.0, E5, 2.0**15),
                                          (1.8, E5, 2.0**14), (1.75, E5, 2.0**15), (-1 / 3, E4, 2.0**10),
                                          (0.0, E5, 1.0), (np.inf, E5, 1.0), (1e-40, E5, 1.0), (1e-30, E4, 2.0**108)])
def test_dlogits_scale_is_the_largest_power_of_two_under_the_bound(g, fmt, want):
    """1.75 = 57344 / 2^15: the boundary is kept (s |g| == max); 1e-30 x 2^109 > 448, 2^108 fits."""
    from cukernels.ops.linear_cross_entropy import dlogits_scale
    assert dlogits_scale(np.float32(g), fmt) == np.float32(want)


@pytest.mark.parametrize("fmt", [E5, E4], ids=["e5m2", "e4m3"])
def test_reference_grad_fp8_is_the_dequantised_formula(rng, fmt):
    """Each chunk's bf16 dlogits quantised with the scale of the bound |dz| <= g (g = 1 / count: "mean"), x per
    chunk and W once in E4M3: dx and dW are the products of the dequantised values; the last chunk (8 rows: no
    multiple of 16) takes the bf16 GEMMs; the loss is the plain op's."""
    bf = ck.bfloat16
    N, H, V, C = 72, 32, 48, 32
    x, w, t = _case(rng, N, H, V, bf)
    base = linear_cross_entropy(x, w, t, chunk_rows=C)
    loss, dx, dw = linear_cross_entropy(x, w, t, chunk_rows=C, grad_fp8=fmt)
    assert loss == base[0]
    # dlogits as the op rounds them (softmax in float64, rounded to bf16), chunk by chunk
    xf, wf = x.astype(np.float32), w.astype(np.float32)
    w8 = _deq8(wf, E4)
    want_dw = np.zeros((V, H), np.float32)
    for c0 in range(0, N, C):
        c1 = min(N, c0 + C)
        z = (xf[c0:c1] @ wf.T).astype(bf).astype(np.float64)
        ok = t[c0:c1] != IG
        tc = np.where(ok, t[c0:c1], 0)
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(c1 - c0), tc] -= 1
        g = (p * ok[:, None] / (t != IG).sum()).astype(bf).astype(np.float32)  # "mean": over all valid targets
        if (c1 - c0) % 16:
            np.testing.assert_array_equal(dx[c0:c1], base[1][c0:c1])  # the bf16 GEMMs
            want_dw += g.T @ xf[c0:c1]
            continue
        g8 = _deq8_bound(g, np.float32(1) / np.float32((t != IG).sum()), fmt)
        np.testing.assert_allclose(dx[c0:c1].astype(np.float32), (g8 @ w8).astype(bf).astype(np.float32),
                                   rtol=1e-2, atol=1e-6)
        want_dw += g8.T @ _deq8(xf[c0:c1], E4)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-7)
    assert not np.array_equal(dw, base[2])  # the FP8 products did run


def test_reference_grad_fp8_dx_only_keeps_dw_in_bf16(rng):
    """grad_fp8_dw=False: dx as with both GEMMs in FP8 (the same dequantised product), dW the bf16 op's."""
    x, w, t = _case(rng, 64, 32, 48, ck.bfloat16)
    base = linear_cross_entropy(x, w, t, chunk_rows=32)
    full = linear_cross_entropy(x, w, t, chunk_rows=32, grad_fp8=E5)
    dxo = linear_cross_entropy(x, w, t, chunk_rows=32, grad_fp8=E5, grad_fp8_dw=False)
    assert dxo[0] == base[0]
    np.testing.assert_array_equal(dxo[1], full[1])
    np.testing.assert_array_equal(dxo[2], base[2])
    assert not np.array_equal(dxo[1], base[1])


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(grad_fp8_dw=False), ValueError, "grad_fp8_dw: False keeps dW out of FP8 when grad_fp8 is given"),
    (dict(grad_fp8=E5, grad_fp8_dw=1), TypeError, "grad_fp8_dw"),
    (dict(grad_fp8=np.float32), TypeError, "grad_fp8: expected"),
    (dict(grad_fp8=E5, compute_grad=False), ValueError, "grad_fp8: given, but compute_grad=False"),
    (dict(grad_fp8=E5, dtype=np.float32), TypeError, "grad_fp8: the FP8 gradient GEMMs take bfloat16"),
    (dict(grad_fp8=E5, H=24), ValueError, r"grad_fp8: cuBLASLt's FP8 GEMMs need H .* H = 24"),
    (dict(grad_fp8=E5, V=40), ValueError, "40 rows"),
])
def test_grad_fp8_bad_arguments(rng, kw, exc, msg):
    kw = dict(kw)
    x, w, t = _case(rng, 16, kw.pop("H", 32), kw.pop("V", 48), kw.pop("dtype", ck.bfloat16))
    with pytest.raises(exc, match=msg):
        linear_cross_entropy(x, w, t, **kw)


def test_model_head_grad_fp8_follows_the_recipe():
    """Float8Recipe(head_grad_dtype=) puts the fused head's gradient GEMMs in FP8: the same loss, a head gradient
    near the bf16 one; without it (or outside autocast) the head is untouched."""
    cfg = ck.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 64, (2, 17)).astype(np.int32)  # 32 tokens: one chunk of a multiple of 16 rows
    out = {}
    head = ck.float8.replace(head_grad_dtype=ck.float8_e5m2)
    for name, recipe in (("plain", ck.float8), ("head", head), ("dx", head.replace(head_fp8_dw=False))):
        m = ck.Llama(cfg, seed=0)
        with ck.autocast(recipe):
            loss = m(ids[:, :-1], ids[:, 1:])
        loss.backward()
        out[name] = (float(loss.data), m.lm_head.weight.grad.copy(), m.model.norm.weight.grad.copy())
    assert out["plain"][0] == out["head"][0] == out["dx"][0]
    gp, gh = out["plain"][1], out["head"][1]
    assert not np.array_equal(gp, gh)
    assert np.abs(gh - gp).max() <= 0.2 * np.abs(gp).max()
    # head_fp8_dw=False: the head's weight gradient is the bf16 one; dx (seen through the final norm's gradient)
    # is the FP8 one
    np.testing.assert_array_equal(out["dx"][1], gp)
    np.testing.assert_array_equal(out["dx"][2], out["head"][2])
    assert not np.array_equal(out["dx"][2], out["plain"][2])


def test_grad_fp8_recipe_field():
    assert ck.float8.head_grad_dtype is None
    assert ck.float8.replace(head_grad_dtype="float8_e5m2").head_grad_dtype == E5
    with pytest.raises(TypeError, match="head_grad_dtype"):
        ck.Float8Recipe(head_grad_dtype=np.float16)
    assert ck.float8.head_fp8_dw is True
    with pytest.raises(TypeError, match="head_fp8_dw"):
        ck.Float8Recipe(head_fp8_dw="no")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dw", [True, False], ids=["both", "dx-only"])
@pytest.mark.parametrize("fmt", [E5, E4], ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("N, H, V, C, Vw", [(256, 64, 1024, 128, None), (200, 32, 1000, 64, 1024),
                                           (96, 48, 512, 96, None), (64, 32, 1008, 32, None)])
def test_gpu_grad_fp8_matches_reference(rng, fmt, N, H, V, C, Vw, fp8_dw):
    """The GPU path against the reference on the dequantised operands (a padded weight: the 1000 classes in 1024
    zero rows; N = 200: a last chunk of 8 rows on the bf16 GEMMs). The casts are the reference's rule, but the
    device's logits may sit one bf16 ulp from the reference's (its GEMM sums in another order), and such a dlogit
    can round to the neighbouring FP8 code (one E5M2 step: 12-25 % of that term): measured on the H200, 167 of
    65536 dW elements moved by up to 8 % (rel.), all within 1e-3 of the largest. So: nearly every element to 1e-3
    relative, every element to 1 % of the largest -- a wrong scale, transpose or beta misses both by far."""
    x, w, t = _case(rng, N, H, V, ck.bfloat16)
    wp = w
    if Vw is not None:
        wp = np.zeros((Vw, H), ck.bfloat16)
        wp[:V] = w
    kw = dict(chunk_rows=C, grad_fp8=fmt, num_classes=V if Vw else None, grad_fp8_dw=fp8_dw)
    hl, hdx, hdw = linear_cross_entropy(x, wp, t, **kw)
    gdw = poisoned((V, H), np.float32)
    dl, ddx, ddw = linear_cross_entropy(device_copy(x), device_copy(wp), device_copy(t), grad_weight=gdw, **kw)
    np.testing.assert_allclose(to_host(dl), hl, rtol=1e-5)
    np.testing.assert_allclose(to_host(ddx).astype(np.float32), hdx.astype(np.float32), rtol=2e-2, atol=1e-5)
    ddw, top = to_host(ddw), np.abs(hdw).max()
    if not fp8_dw:  # the bf16 GEMM on bf16 dlogits: as the plain op's GPU test
        _close(ddw, hdw, *GRAD_TOL[np.dtype(ck.bfloat16)], "dW")
        return
    near = np.isclose(ddw, hdw, rtol=1e-3, atol=1e-6 * top)
    assert near.mean() > 0.99, f"{(~near).sum()} of {near.size} dW elements off"
    np.testing.assert_allclose(ddw, hdw, rtol=0, atol=1e-2 * top)


@pytest.mark.gpu
@pytest.mark.parametrize("both", [False, True], ids=["q8", "q8b"])
@pytest.mark.parametrize("fmt", [E5, E4], ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("idt", [np.int32, np.int64])
@pytest.mark.parametrize("rows, V, ld, qoff", [(48, 1000, 1024, 0), (16, 128256, 128256, 0), (5, 37, 64, 3),
                                               (33, 520, 520, 0)])
def test_gpu_fp8_dlogits_are_the_cast_of_the_bf16_ones(rng, both, fmt, idt, rows, V, ld, qoff):
    """ce_fused_q8 writes, bit for bit, ck.fp8_cast of the dlogits ce_fused writes in bf16 from the same logits,
    with dlogits_scale(g) (and 1 / s for the GEMMs); ignored rows are code 0; the losses are the same bits. Odd V,
    rows that start off the 8-byte grid (qoff: the scalar path), 128k classes, label smoothing. ce_fused_q8b also
    writes the bf16 dlogits in place over the logits: the bf16 kernel's bits, the columns past V untouched."""
    import cupy as cp
    from cukernels import _backend as B
    from cukernels._loader import get_function
    from cukernels.ops import cross_entropy as ce
    from cukernels.ops.linear_cross_entropy import dlogits_scale
    z = (rng.standard_normal((rows, ld)) * 3).astype(np.float32).astype(ck.bfloat16)
    t = rng.integers(0, V, rows).astype(idt)
    t[::4] = IG
    zd, td = device_copy(z), cp.asarray(t)
    cnt = cp.asarray(np.int32((t != IG).sum()))
    err = cp.zeros((), np.int32)
    eps, threads = np.float32(0.1), ce._threads(V, 2)
    tag = f"bf16_{'i32' if idt == np.int32 else 'i64'}"
    dz, l16 = zd.copy(), cp.empty((rows,), np.float32)
    k = get_function(ce.FAMILY, f"ce_fused_{tag}")
    k((ce._grid(k, rows, threads),), (threads, 1, 1),
      (dz, td, dz, l16, err, cnt, B.NULL, np.float32(1), np.int64(rows), np.int32(V), np.int64(ld), np.int64(ld),
       np.int64(IG), eps, np.bool_(True), np.bool_(True)))
    qbuf = cp.full((rows * ld + qoff,), 0xAB, np.uint8)
    q = qbuf[qoff:].reshape(rows, ld)
    l8, sinv = cp.empty((rows,), np.float32), poisoned((), np.float32)
    kq = get_function(ce.FAMILY, f"ce_fused_{'q8b' if both else 'q8'}_{tag}_{'e5m2' if fmt == E5 else 'e4m3'}")
    args = (zd, td, q, l8, err, cnt, B.NULL, np.float32(1), np.int64(rows), np.int32(V), np.int64(ld), np.int64(ld),
            np.int64(IG), eps, np.bool_(True), np.bool_(True), sinv)
    kq((ce._grid(kq, rows, threads),), (threads, 1, 1), args + ((zd, np.int64(ld)) if both else ()))
    s = dlogits_scale(np.float32(1) / np.float32((t != IG).sum()), fmt)
    want = to_host(ck.fp8_cast(dz[:, :V].copy(), float(s), dtype=fmt))
    got = to_host(q)
    np.testing.assert_array_equal(got[:, :V], want)
    assert (got[:, V:] == 0xAB).all()  # nothing past V
    assert (got[t == IG, :V] == 0).all()
    assert float(to_host(sinv)) == 1 / float(s)
    np.testing.assert_array_equal(to_host(l8), to_host(l16))
    assert int(to_host(err)) == 0
    if both:  # the logits became the bf16 dlogits; the columns past V kept the logits
        np.testing.assert_array_equal(to_host(zd)[:, :V].view(np.uint16), to_host(dz)[:, :V].view(np.uint16))
        np.testing.assert_array_equal(to_host(zd)[:, V:].view(np.uint16), z[:, V:].view(np.uint16))
