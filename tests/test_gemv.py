"""ck.gemv (kernels_cu/gemv.cu, cukernels/ops/gemv.py): decode GEMV with fused norm / bias / activation / residual."""
import functools
import math

import numpy as np
import pytest

import cukernels as ck
from cukernels.ops.gemv import MAX_B, SMEM_CAP, gemv
from helpers import DTYPES, device_copy, poisoned, randn, to_host

BF16 = np.dtype(ck.bfloat16)
F32 = np.dtype(np.float32)
ACTS = [None, "swiglu", "gelu_tanh", "gelu"]
NORMS = [None, "rms", "layer"]


# ---------------------------------------------------------------- float64 composition (the test's own formula)
def _rnd(v, dtype):
    """Round float64 values to ``dtype`` and back (bf16 through ml_dtypes, round to nearest even)."""
    return v.astype(np.float32).astype(dtype).astype(np.float64) if dtype == BF16 else v


def f64_gemv(x, w, *, bias=None, norm=None, nw=None, nb=None, eps=1e-5, act=None, res=None, mid=None):
    """Plain float64 math. ``mid`` = the intermediates' dtype (bf16 rounds xn, y, y + bias and the activation to
    bf16 at the points the op documents; None: no rounding at all but xn's to x's dtype)."""
    K = x.shape[-1]
    x64 = x.astype(np.float64).reshape(-1, K)
    if norm == "rms":
        xn = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * nw.astype(np.float64)
    elif norm == "layer":
        mu = x64.mean(-1, keepdims=True)
        var = ((x64 - mu) ** 2).mean(-1, keepdims=True)
        xn = (x64 - mu) / np.sqrt(var + eps) * nw.astype(np.float64) + nb.astype(np.float64)
    else:
        xn = x64
    xn = _rnd(xn, np.dtype(x.dtype))
    y = _rnd(xn @ w.astype(np.float64).T, mid)
    if bias is not None:
        y = _rnd(y + bias.astype(np.float64), mid)
    if act == "swiglu":
        F = y.shape[1] // 2
        g, u = y[:, :F], y[:, F:]
        a = _rnd(g / (1.0 + np.exp(-g)) * u, mid)
    elif act == "gelu_tanh":
        a = _rnd(0.5 * y * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3))), mid)
    elif act == "gelu":
        a = _rnd(0.5 * y * (1.0 + np.vectorize(math.erf)(y / math.sqrt(2.0))), mid)
    else:
        a = y
    if res is not None:
        a = res.astype(np.float64).reshape(a.shape) + a
    return a.reshape(x.shape[:-1] + (a.shape[-1],))


def _inputs(rng, Bn, K, N, xdt, wdt=None, *, norm=None, bias=False, act=None, res=False, odt=None, xscale=1.0):
    wdt = wdt or xdt
    odt = odt or xdt
    x = randn(rng, (Bn, K), xdt, scale=xscale)
    w = randn(rng, (N, K), wdt, scale=1.0 / math.sqrt(K))  # y ~ O(1) whatever K
    kw = {}
    if bias:
        kw["bias"] = randn(rng, (N,), np.float32, scale=0.5)
    if norm is not None:
        kw["norm"] = norm
        kw["norm_weight"] = (1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32).astype(xdt)
        if norm == "layer":
            kw["norm_bias"] = randn(rng, (K,), xdt, scale=0.1)
    if act is not None:
        kw["act"] = act
    n_out = N // 2 if act == "swiglu" else N
    if res:
        kw["residual"] = randn(rng, (Bn, n_out), odt)
    return x, w, kw


def _ulp_tol(dtype, n_ulp=2):
    """(rtol, atol) for outputs of O(1): bf16 n_ulp units in the last place (2^-8 relative each); fp32 1e-4."""
    return (n_ulp * 2.0**-8, 1e-5) if np.dtype(dtype) == BF16 else (1e-4, 1e-5)


def _check(got, ref, dtype, n_ulp=2, what="", atol=None):
    """Within ``n_ulp`` bf16 ulps (fp32: 1e-4) of the reference. bf16 outputs: a bf16 intermediate (the GEMM
    output, before the bias / activation / residual) that rounds the other way when the fp32 sums differ in their
    last bits moves the output by an ulp of the intermediate, not of the output: on the H200 0.008-0.015 % of the
    elements were 2-4 output ulps off (a residual added to y of a larger magnitude). So: every element within
    n_ulp ulps plus 4 ulps of the output's RMS, and at most 0.5 % of them beyond the plain n_ulp ulps."""
    got, ref = to_host(got), to_host(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype} != {dtype}"
    g = got.astype(np.float64)
    assert np.isfinite(g).all(), f"{what}: non-finite output (an unwritten element?)"
    r = np.asarray(ref, np.float64)
    rt, at = _ulp_tol(dtype, n_ulp)
    if atol is not None:
        at = atol
    if np.dtype(dtype) == BF16 and r.size:
        err = np.abs(g - r)
        tight = err <= rt * np.abs(r) + at
        assert np.mean(~tight) <= 0.005, f"{what}: {np.mean(~tight):.4%} of the elements beyond {n_ulp} ulps"
        at = max(at, 4 * 2.0**-8 * max(1.0, float(np.sqrt(np.mean(r * r)))))
    np.testing.assert_allclose(g, r, rtol=rt, atol=at, err_msg=what)


# ---------------------------------------------------------------- CPU: the reference against float64
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("res", [False, True], ids=["nores", "res"])
def test_reference_f32_matches_f64(rng, norm, act, bias, res):
    x, w, kw = _inputs(rng, 3, 96, 10, np.float32, norm=norm, bias=bias, act=act, res=res)
    y = gemv(x, w, **kw)
    ref = f64_gemv(x, w, bias=kw.get("bias"), norm=norm, nw=kw.get("norm_weight"), nb=kw.get("norm_bias"), act=act,
                   res=kw.get("residual"))
    assert y.dtype == F32 and y.shape == (3, 5 if act == "swiglu" else 10)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("act", ACTS)
def test_reference_bf16_rounds_where_the_composition_does(rng, norm, act):
    x, w, kw = _inputs(rng, 2, 128, 12, ck.bfloat16, norm=norm, bias=True, act=act, res=True)
    y = gemv(x, w, **kw)
    ref = f64_gemv(x, w, bias=kw["bias"], norm=norm, nw=kw.get("norm_weight"), nb=kw.get("norm_bias"), act=act,
                   res=kw["residual"], mid=BF16)
    _check(y, _rnd(ref, BF16), BF16, n_ulp=2, what="bf16 reference")
    # fp32 logits from bf16 x: no intermediate rounding at all
    y32 = gemv(x, w, **{k: v for k, v in kw.items() if k != "residual"}, out=np.empty(y.shape, np.float32))
    ref32 = f64_gemv(x, w, bias=kw["bias"], norm=norm, nw=kw.get("norm_weight"), nb=kw.get("norm_bias"), act=act)
    np.testing.assert_allclose(y32, ref32, rtol=1e-4, atol=1e-5)


def test_reference_matches_unfused_numpy_ops(rng):
    """The reference is the composition of the library's own NumPy paths (rms_norm, matmul, add, swiglu_packed)."""
    x, w, kw = _inputs(rng, 4, 64, 16, ck.bfloat16, norm="rms", bias=True, act="swiglu", res=True)
    xn = ck.rms_norm(x, kw["norm_weight"], 1e-5)
    yy = ck.matmul(xn, w, trans_b=True)
    ck.add(yy, kw["bias"], out=yy)
    a = ck.swiglu_packed(yy)
    expect = ck.add(kw["residual"], a)
    assert np.array_equal(gemv(x, w, **kw).view(np.uint16), expect.view(np.uint16))


def test_reference_layouts_and_in_place_residual(rng):
    K, N = 40, 6
    buf = randn(rng, (5, 3, K + 7), np.float32)
    x = buf[:, 1:2, :K]  # [B, 1, K] rows (3K+21) apart: strided rows, last axis contiguous
    wbuf = randn(rng, (N, K + 3), np.float32)
    w = wbuf[:, :K]  # padded head rows
    resid = randn(rng, (5, 1, N), np.float32)
    ref = f64_gemv(np.ascontiguousarray(x), np.ascontiguousarray(w), res=resid, norm="rms",
                   nw=np.ones(K, np.float32))
    r2 = resid.copy()
    y = gemv(x, w, norm="rms", norm_weight=np.ones(K, np.float32), residual=r2, out=r2)
    assert y is r2 and y.shape == (5, 1, N)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    obuf = np.full((5, N + 4), np.nan, np.float32)
    o = gemv(x.reshape(5, K), w, out=obuf[:, :N])
    np.testing.assert_allclose(o, f64_gemv(np.ascontiguousarray(x.reshape(5, K)), np.ascontiguousarray(w)),
                               rtol=1e-5, atol=1e-6)
    assert np.isnan(obuf[:, N:]).all()  # nothing past the view's columns touched
    v = gemv(x[0, 0], w)  # 1-D x -> 1-D out
    assert v.shape == (N,)
    assert gemv(np.zeros((0, K), np.float32), w).shape == (0, N)


def test_reference_mixed_dtypes(rng):
    x = randn(rng, (2, 32), np.float32)
    w = randn(rng, (8, 32), ck.bfloat16)
    np.testing.assert_allclose(gemv(x, w), f64_gemv(x, w), rtol=1e-5, atol=1e-6)
    xb = randn(rng, (2, 32), ck.bfloat16)
    wf = randn(rng, (8, 32), np.float32)
    _check(gemv(xb, wf), _rnd(f64_gemv(xb, wf, mid=BF16), BF16), BF16, n_ulp=1)


# ---------------------------------------------------------------- bad input
_X = np.ones((2, 8), np.float32)
_W = np.ones((6, 8), np.float32)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(x=np.ones((2, 8))), TypeError, "x: expected dtype"),
        (dict(weight=np.ones((6, 8), np.int32)), TypeError, "weight: expected dtype"),
        (dict(weight=np.ones((6, 9), np.float32)), ValueError, r"weight: expected shape \(N, 8\)"),
        (dict(weight=np.ones((8, 6), np.float32).T), ValueError, "weight: the last axis must be contiguous"),
        (dict(x=np.ones((8, 2), np.float32).T), ValueError, "x: the last axis must be contiguous"),
        (dict(x=np.ones((2, 0), np.float32)), ValueError, "x: the last axis"),
        (dict(bias=np.ones(5, np.float32)), ValueError, r"bias: expected shape \(6,\)"),
        (dict(act="relu"), ValueError, "act: expected None, 'swiglu'"),
        (dict(act=3), TypeError, "act: expected"),
        (dict(act="swiglu", weight=np.ones((5, 8), np.float32)), ValueError, "weight: act='swiglu' needs an even"),
        (dict(norm="batch"), ValueError, "norm: expected None, 'rms' or 'layer'"),
        (dict(norm="rms"), ValueError, "norm_weight: required"),
        (dict(norm="layer", norm_weight=np.ones(8, np.float32)), ValueError, "norm_bias: required"),
        (dict(norm="rms", norm_weight=np.ones(8, np.float32), norm_bias=np.ones(8, np.float32)), ValueError,
         "norm_bias: RMSNorm has no bias"),
        (dict(norm_weight=np.ones(8, np.float32)), ValueError, "norm_weight: given but norm is None"),
        (dict(norm="rms", norm_weight=np.ones(7, np.float32)), ValueError, r"norm_weight: expected shape \(8,\)"),
        (dict(norm="layer", norm_weight=np.ones(8, np.float32), norm_bias=np.ones(8, ck.bfloat16)), TypeError,
         "norm_bias: expected dtype"),
        (dict(norm="rms", norm_weight=np.ones(8, np.float32), eps=0.0), ValueError, "eps"),
        (dict(residual=np.ones((2, 6), ck.bfloat16)), TypeError, "residual: expected dtype"),
        (dict(residual=np.ones((2, 5), np.float32)), ValueError, "residual: expected shape"),
        (dict(out=np.ones((2, 5), np.float32)), ValueError, "out: expected shape"),
        (dict(out=np.ones((2, 6), np.float64)), TypeError, "out: expected dtype"),
        (dict(x=[[1.0] * 8] * 2), TypeError, "x: expected a numpy.ndarray or cupy.ndarray"),
    ],
)
def test_bad_input_messages(kw, exc, match):
    args = dict(x=_X, weight=_W)
    args.update(kw)
    x, w = args.pop("x"), args.pop("weight")
    with pytest.raises(exc, match=match):
        gemv(x, w, **args)


def test_bad_input_overlapping_residual_and_out():
    buf = np.zeros((2, 7), np.float32)
    with pytest.raises(ValueError, match="residual: overlaps out"):
        gemv(_X, _W, residual=buf[:, 1:], out=buf[:, :6])
    ro = np.zeros((2, 6), np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="out: is read-only"):
        gemv(_X, _W, out=ro)


@pytest.mark.gpu
def test_mixing_numpy_and_cupy_is_a_type_error():
    import cupy as cp

    with pytest.raises(TypeError, match="weight: is a numpy array but x is a cupy array"):
        gemv(cp.ones((2, 8), cp.float32), _W)


# ---------------------------------------------------------------- GPU: kernel against the reference
@functools.lru_cache(maxsize=None)
def _weight(N, K, dtype):
    """Host weights, one set per shape (generating 25M normals per test would dominate the suite's time)."""
    r = np.random.default_rng(N * 100003 + K)
    return (r.standard_normal((N, K), dtype=np.float32) / math.sqrt(K)).astype(dtype)


def _gpu_vs_ref(x, w, kw, odt, *, misalign=False, n_ulp=2, what="", atol=None):
    """Run the op on device copies (out poisoned), compare with the NumPy reference on the host copies."""
    ref = gemv(x, w, **kw, out=np.empty(x.shape[:-1] + ((w.shape[0] // 2 if kw.get("act") == "swiglu" else
                                                           w.shape[0]),), odt))
    dkw = {k: (device_copy(v, misalign) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    xd, wd = device_copy(x, misalign), device_copy(w, misalign)
    out = poisoned(ref.shape, odt, misalign)
    got = gemv(xd, wd, **dkw, out=out)
    assert got is out
    _check(got, ref, odt, n_ulp, what, atol=atol)
    return got, ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("N", [1, 7, 2048, 3072])
@pytest.mark.parametrize("K", [64, 100, 2048, 8192])
@pytest.mark.parametrize("Bn", [1, 2, 3, 8, 9, 16])
def test_gpu_matches_reference(rng, Bn, K, N, dtype):
    x = randn(rng, (Bn, K), dtype)
    w = _weight(N, K, np.dtype(dtype))
    misalign = (Bn + K + N) % 3 == 0  # a third of the cases on views one element off 16-byte alignment
    _gpu_vs_ref(x, w, {}, np.dtype(dtype), misalign=misalign, what=f"B{Bn} K{K} N{N}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("Bn", [1, 3, 9])
def test_gpu_options(rng, Bn, act, norm, dtype):
    """Every prologue x epilogue, with bias and residual, on the kernel (B 1, 3) and the unfused path (B 9)."""
    K, N = 2048, 3072
    x, _, kw = _inputs(rng, Bn, K, N, dtype, norm=norm, bias=True, act=act, res=True, xscale=2.0)
    w = _weight(N, K, np.dtype(dtype))
    # swiglu: a 1-ulp flip of g and of u in bf16 (fp32 sums in another order) can compound: 3 ulps.
    _gpu_vs_ref(x, w, kw, np.dtype(dtype), n_ulp=3 if act == "swiglu" else 2, what=f"{norm} {act} B{Bn}")
    kw.pop("residual")
    _gpu_vs_ref(x, w, kw, np.dtype(dtype), misalign=True, n_ulp=3 if act == "swiglu" else 2,
                what=f"{norm} {act} B{Bn} misaligned, no residual")


@pytest.mark.gpu
@pytest.mark.parametrize("Bn", [1, 8, 9])
@pytest.mark.parametrize("combo", ["f32x_bf16w", "bf16x_f32w", "bf16x_f32out"])
def test_gpu_mixed_dtypes_and_fp32_logits(rng, Bn, combo):
    K, N = 2048, 2048 + 64
    xdt, wdt, odt = {"f32x_bf16w": (F32, BF16, F32), "bf16x_f32w": (BF16, F32, BF16),
                     "bf16x_f32out": (BF16, BF16, F32)}[combo]
    x = randn(rng, (Bn, K), xdt)
    w = _weight(N, K, wdt)
    kw = dict(norm="rms", norm_weight=np.ones(K, np.float32))
    _gpu_vs_ref(x, w, kw, odt, what=combo)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("pad", [8, 3], ids=["pad8", "pad3"])
@pytest.mark.parametrize("Bn", [2, 9])
def test_gpu_strided_views(rng, Bn, pad, dtype):
    """Row-strided weight (padded head: pad 8 keeps the 16-byte path for bf16, pad 3 takes the scalar one),
    x as the last token of a [B, T, K] tensor, out and residual row-strided columns of wider buffers."""
    import cupy as cp

    K, N = 1024, 1000
    wbuf = randn(rng, (N, K + pad), dtype, scale=K**-0.5)
    xbuf = randn(rng, (Bn, 3, K), dtype)
    rbuf = randn(rng, (Bn, N + 5), dtype)
    kw = dict(bias=randn(rng, (N,), dtype), norm="layer", norm_weight=randn(rng, (K,), np.float32),
              norm_bias=randn(rng, (K,), np.float32), act="gelu_tanh")
    ref = gemv(xbuf[:, 2:], wbuf[:, :K], residual=rbuf[:, :N].reshape(Bn, 1, N), **kw)
    wd, xd, rd = cp.asarray(wbuf)[:, :K], cp.asarray(xbuf)[:, 2:], cp.asarray(rbuf)[:, :N].reshape(Bn, 1, N)
    obuf = cp.full((Bn, 1, N + 7), np.nan, dtype=dtype)
    got = gemv(xd, wd, residual=rd, out=obuf[..., :N], **{k: cp.asarray(v) if isinstance(v, np.ndarray) else v
                                                            for k, v in kw.items()})
    _check(got, ref, dtype, what="strided")
    assert np.isnan(to_host(obuf[..., N:]).astype(np.float32)).all(), "wrote past the out view's columns"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("Bn", [1, 4, 8, 12])
def test_gpu_in_place_residual(rng, Bn, dtype):
    """out IS residual (the residual stream updated in place): each element read, then written by one thread."""
    import cupy as cp

    K, N = 8192, 2048  # LLaMA-1B's down projection
    x = randn(rng, (Bn, K), dtype)
    w = _weight(N, K, np.dtype(dtype))
    h = randn(rng, (Bn, N), dtype, scale=3.0)
    ref = gemv(x, w, residual=h)
    hd = cp.asarray(h)
    got = gemv(cp.asarray(x), cp.asarray(w), residual=hd, out=hd)
    assert got is hd
    _check(got, ref, dtype, what="in-place residual")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_stability_and_bit_identical_reruns(rng, dtype):
    """Large magnitudes through the norms (rms of ~1e4 values; a LayerNorm row with mean 1e3 and unit spread:
    the two-pass variance keeps it), then two runs compared bit for bit."""
    import cupy as cp

    K, N = 2048, 3072
    w = _weight(N, K, np.dtype(dtype))
    for norm, x in (("rms", randn(rng, (4, K), dtype, scale=1e4)),
                    ("layer", (1000.0 + rng.standard_normal((4, K))).astype(np.float32).astype(dtype))):
        kw = dict(norm=norm, norm_weight=np.ones(K, np.float32), act="swiglu")
        if norm == "layer":
            kw["norm_bias"] = np.zeros(K, np.float32)
        # (fp32 LayerNorm at mean 1e3: x - mean carries ulp(1e3) = 6e-5 per element, summed over K = 2048 terms
        # of weight ~1/sqrt(K): ~3e-4 on O(1) outputs, measured 3.9e-4 on the H200)
        _gpu_vs_ref(x, w, kw, np.dtype(dtype), n_ulp=3, what=f"stability {norm}",
                    atol=2e-3 if (norm == "layer" and np.dtype(dtype) == F32) else None)
        dkw = {k: cp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        xd, wd = cp.asarray(x), cp.asarray(w)
        a, b = gemv(xd, wd, **dkw), gemv(xd, wd, **dkw)
        assert np.array_equal(to_host(a).view(np.uint8), to_host(b).view(np.uint8)), "reruns differ"


@pytest.mark.gpu
def test_gpu_lm_head_shape_and_smem_crossover(rng):
    """A vocabulary-sized head (fp32 logits from bf16, N not a multiple of anything), and fp32 x at B = 8, K = 8192
    (xn 256 KB > SMEM_CAP: the unfused path) against B = 2 (kernel) on the same data."""
    import cupy as cp

    K, N = 2048, 50257
    x = randn(rng, (1, K), ck.bfloat16)
    w = _weight(N, K, BF16)
    _gpu_vs_ref(x, w, dict(norm="rms", norm_weight=np.ones(K, np.float32)), F32, what="head")
    assert 8 * 8192 * 4 > SMEM_CAP >= 2 * 8192 * 4
    x = randn(rng, (8, 8192), np.float32)
    w = _weight(64, 8192, F32)
    got = gemv(cp.asarray(x), cp.asarray(w))
    _check(got, gemv(x, w), F32, what="fp32 B8 K8192 (unfused)")
    _check(gemv(cp.asarray(x[:2]), cp.asarray(w)), gemv(x[:2], w), F32, what="fp32 B2 K8192 (kernel)")


@pytest.mark.gpu
def test_gpu_zero_rows_and_captures(rng):
    """B = 0 writes nothing; with out= given the op captures into a CUDA graph (no sync, no allocation)."""
    import cupy as cp

    K, N = 2048, 2048
    assert gemv(cp.zeros((0, K), ck.bfloat16), cp.asarray(_weight(N, K, BF16))).shape == (0, N)
    x = cp.asarray(randn(rng, (MAX_B, K), ck.bfloat16))
    w = cp.asarray(_weight(2 * N, K, BF16))
    nw = cp.ones(K, cp.float32)
    h = cp.asarray(randn(rng, (MAX_B, N), ck.bfloat16))
    y = cp.empty((MAX_B, N), ck.bfloat16)
    gemv(x, w, norm="rms", norm_weight=nw, act="swiglu", residual=h, out=y)  # compile + warm up
    ref = to_host(y).copy()
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        gemv(x, w, norm="rms", norm_weight=nw, act="swiglu", residual=h, out=y)
        g = s.end_capture()
    y.fill(np.nan)
    cp.cuda.Device().synchronize()  # (the poison ran on the legacy stream: the replay must not race it)
    g.launch(s)
    s.synchronize()
    assert np.array_equal(to_host(y).view(np.uint16), ref.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [True, False], ids=["G2", "G1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("N", [7, 2049, 3072])
@pytest.mark.parametrize("Bn", [3, 4, 8])
def test_gpu_column_pairing_both_ways(rng, monkeypatch, Bn, N, dtype, pair):
    """B >= 3 runs G = 2 adjacent columns a warp by default (ck.settings.gemv_pair_min_nb); both variants against the
    reference, odd N (the last group's second column is computed from a clamped row and never stored), SwiGLU (N even: 4
    W rows a warp) and plain, with bias and an in-place residual."""
    from cukernels.ops import gemv as gmod

    monkeypatch.setattr(ck.settings, "gemv_pair_min_nb", 4 if pair else 99)
    K = 2048
    for act in ([None, "swiglu"] if N % 2 == 0 else [None, "gelu"]):
        x, _, kw = _inputs(rng, Bn, K, N, dtype, norm="rms", bias=True, act=act, res=True)
        w = _weight(N, K, np.dtype(dtype))
        _gpu_vs_ref(x, w, kw, np.dtype(dtype), n_ulp=3 if act == "swiglu" else 2, what=f"pair={pair} {act}")


def test_every_kernel_the_launcher_names_is_compiled():
    """CPU: each (x dtype, W dtype, B, SwiGLU, vector path, pairing) the launcher can pick names an entry point
    that the NVRTC build of gemv.cu has (the entry points are macro-generated)."""
    from cukernels import _loader, _nvrtc
    from cukernels.ops import gemv as gmod

    if not _nvrtc.available():
        pytest.skip("libnvrtc not installed")
    entries = set(_loader.list_entries("gemv", "sm_90"))
    names = set()
    for pair in (4, 99):
        with ck.settings(gemv_pair_min_nb=pair):
            for xd in DTYPES:
                for wd in DTYPES:
                    for rows in range(1, MAX_B + 1):
                        for sw in (False, True):
                            for vec in (False, True):
                                names.add(gmod.kernel_name(xd, wd, rows, sw, vec)[0])
    assert names <= entries, sorted(names - entries)
    assert len(names) == len(entries) == 96  # and nothing compiled that no launch can reach


@pytest.mark.gpu
@pytest.mark.parametrize("Bn", [1, 3])
def test_gpu_l2_prefetch_changes_no_bit(rng, monkeypatch, Bn):
    """The L2 prefetch before the wait (ck.settings.gemv_prefetch_kb: 0, 4, 255 KB a warp) is a hint: the outputs are
    bit-identical whatever its size, with the rms prologue, SwiGLU and an in-place residual, K = 2048 and 8192."""
    from cukernels.ops import gemv as gmod

    for K, N, act in ((2048, 3072, None), (2048, 4096, "swiglu"), (8192, 2048, None)):
        x, _, kw = _inputs(rng, Bn, K, N, BF16, norm="rms", act=act, res=True)
        w = device_copy(_weight(N, K, BF16))
        dkw = {k: (device_copy(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
        xd = device_copy(x)
        outs = []
        for kb in (0, 4, 255):
            monkeypatch.setattr(ck.settings, "gemv_prefetch_kb", kb)
            outs.append(to_host(gemv(xd, w, **dkw)).view(np.uint16))
        assert all(np.array_equal(outs[0], o) for o in outs[1:]), f"K{K} {act}"


@pytest.mark.gpu
@pytest.mark.parametrize("Bn", [1, 2, 5, 8])
@pytest.mark.parametrize("norm", [None, "rms", "layer"])
def test_gpu_ring_depth_changes_no_bit(rng, monkeypatch, Bn, norm):
    """The weight's cp.async ring (ck.settings.gemv_depth stages of shared memory a lane) only changes when the bytes
    arrive: depths 1-4 give bit-identical outputs, with grid-stride over several rows a warp (N > one wave of warps), K
    not a multiple of a chunk (K = 1000: a partial last chunk), SwiGLU and an in-place residual, and match the
    reference. Rows of x 16-byte aligned (the ring path) and a weight with padded rows (ldw > K)."""
    from cukernels.ops import gemv as gmod

    for K, N, act in ((2048, 3072, None), (1000, 8194, "swiglu"), (8192, 2048, None), (2048, 40000, None)):
        x, _, kw = _inputs(rng, Bn, K, N, BF16, norm=norm, act=act, res=True)
        wfull = _weight(N, K + 8, BF16)  # rows 16 bytes further apart than K: ldw = K + 8
        wh, w = wfull[:, :K], device_copy(wfull)[:, :K]
        dkw = {k: (device_copy(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
        xd = device_copy(x)
        outs = []
        for depth in (1, 2, 3, 4):
            monkeypatch.setattr(ck.settings, "gemv_depth", depth)
            monkeypatch.setattr(ck.settings, "gemv_depth_long", depth)
            outs.append(to_host(gemv(xd, w, **dkw)).view(np.uint16))
        assert all(np.array_equal(outs[0], o) for o in outs[1:]), f"K{K} N{N} {act}"
        _check(outs[0].view(BF16), gemv(x, wh, **kw), BF16, what=f"K{K} N{N} {act} {norm}")
