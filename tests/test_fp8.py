"""FP8: the casts (ops/fp8.py, kernels_cu/fp8.cu), the FP8 GEMMs of ck.matmul (cuBLASLt, blaslt.py), the FP8 linear
(functional/fp8.py) under autocast(ck.float8), and the trainer's fp8 key.

CPU: the reference casts against ml_dtypes (every bf16 bit pattern, the special values), the scale rule, delayed
scaling's history, the reference GEMM against the float64 product of the dequantised operands, the FP8 linear's
output and gradients against the dequantised float64 formula, argument errors, the trainer with fp8: true.
GPU: every kernel against the reference bit for bit (casts, transposed casts, amax, scales, dequantisation) on odd
sizes, misaligned views and poisoned outputs; cuBLASLt's FP8 GEMMs against the dequantised product on odd
multiple-of-16 shapes, batched, with beta = 1 accumulation and under graph capture; the FP8 linear and a small
LLaMA's training against the NumPy path.
"""
import numpy as np
import pytest

import cukernels as ck
from cukernels import nn
from helpers import device_copy, poisoned, randn, to_host

E4, E5 = np.dtype(ck.float8_e4m3fn), np.dtype(ck.float8_e5m2)
FMTS = [E4, E5]
MAX = {E4: 448.0, E5: 57344.0}
FLT_MIN = np.float32(np.finfo(np.float32).tiny)
SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 448.0, 449.0, 464.0, 465.0, 480.0, 1e4, 57344.0, 61440.0, 1e30,
                    -1e30, np.inf, -np.inf, np.nan, -np.nan, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11,
                    2.0 ** -14, 2.0 ** -16, 2.0 ** -17, 1.5 * 2.0 ** -16, 1e-30, 1e-40, -1e-40, 0.0625, 0.09375,
                    240.0, 232.0, 248.0], np.float32)


def _expect(x, s, fmt):
    """ml_dtypes on clip(x * s): the cast's definition (fp32 subnormal products flushed, as the kernels do)."""
    with np.errstate(invalid="ignore", over="ignore"):
        v = x.astype(np.float32) * np.float32(s)
        v = np.where(np.abs(x.astype(np.float32)) < FLT_MIN, np.copysign(np.float32(0), x.astype(np.float32)), v)
        return np.clip(v, -MAX[fmt], MAX[fmt]).astype(fmt).view(np.uint8)


def _deq(q, fmt, s_inv=1.0):
    return q.view(fmt).astype(np.float64) * float(s_inv)


# ================================================================================== CPU: the reference casts
@pytest.mark.parametrize("fmt", FMTS)
def test_reference_cast_of_every_bf16_value(fmt):
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ck.bfloat16)
    for s in (1.0, 3.75, 2.0 ** -20):
        q = ck.fp8_cast(x, s, dtype=fmt)
        assert q.dtype == np.uint8 and q.shape == x.shape
        np.testing.assert_array_equal(q, _expect(x, s, fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_reference_cast_special_values_saturate_and_keep_nan(fmt):
    q = ck.fp8_cast(SPECIAL, 1.0, dtype=fmt)
    v = q.view(fmt).astype(np.float32)
    fin = np.isfinite(SPECIAL)
    assert np.all(np.abs(v[fin]) <= MAX[fmt])
    assert v[SPECIAL == np.inf][0] == MAX[fmt] and v[SPECIAL == -np.inf][0] == -MAX[fmt]  # saturated, not NaN/inf
    assert v[SPECIAL == 1e30][0] == MAX[fmt]
    nan = np.isnan(SPECIAL)
    assert np.isnan(v[nan]).all()
    nan_code = 0x7F if fmt == E4 else 0x7E
    np.testing.assert_array_equal(q[nan] & 0x7F, nan_code)
    assert q[SPECIAL == -1e-40][0] == 0x80  # a negative fp32 subnormal: -0
    np.testing.assert_array_equal(q, _expect(SPECIAL, 1.0, fmt))


def test_reference_cast_rounds_to_nearest_even():
    # e4m3 around 1: steps of 1/8. 1 + 1/16 is a tie -> 1 (even); 1 + 3/16 -> 1.25 (even mantissa 010)
    x = np.array([1 + 1 / 16, 1 + 3 / 16, 1 + 1 / 16 + 1e-6, 464.0, 463.9], np.float32)
    v = ck.fp8_cast(x, 1.0).view(E4).astype(np.float32)
    np.testing.assert_array_equal(v, [1.0, 1.25, 1.125, 448.0, 448.0])


@pytest.mark.parametrize("amax,expect", [(0.0, 1.0), (np.inf, 1.0), (np.nan, 1.0), (1e-39, 1.0), (448.0, 1.0),
                                         (1.0, 448.0), (2.0, 224.0), (1e-37, np.float32(2.0 ** 126))])
def test_scale_rule(amax, expect):
    s, si = ck.fp8_scale(np.array(amax, np.float32))
    assert s.dtype == np.float32 and s.shape == ()
    assert float(s) == pytest.approx(expect, rel=1e-7)
    assert si == np.float32(1) / s
    s2, _ = ck.fp8_scale(np.array(amax, np.float32), dtype=ck.float8_e5m2, margin=2)
    if expect == 448.0:
        assert float(s2) == 57344.0 / 4


def test_amax_and_quantize_current():
    rng = np.random.default_rng(0)
    x = randn(rng, (48, 80), ck.bfloat16, scale=3.0)
    a = ck.fp8_amax(x)
    assert a == np.abs(x.astype(np.float32)).max()
    q, qt, si = ck.fp8_quantize(x, transpose=True)
    s = np.float32(448.0) / np.float32(a)
    assert si == np.float32(1) / s
    np.testing.assert_array_equal(q, _expect(x, s, E4))
    np.testing.assert_array_equal(qt, q.T)
    back = _deq(q, E4, si)
    assert np.abs(back).max() == pytest.approx(float(a), rel=2 ** -3)  # the max lands on 448
    err = np.abs(back - x.astype(np.float64))
    assert (err <= np.maximum(np.abs(x.astype(np.float64)) * 2.0 ** -4, 2.0 ** -9 * float(si))).all()
    np.testing.assert_array_equal(ck.fp8_amax(np.array([1.0, np.nan], np.float32)), np.float32(np.nan))
    assert ck.fp8_amax(np.zeros((0, 3), np.float32)) == 0


def test_quantize_delayed_history():
    rng = np.random.default_rng(1)
    x1, x2 = randn(rng, (32, 16), np.float32), randn(rng, (32, 16), np.float32, scale=10.0)
    h = ck.fp8_history(x1)
    assert h.dtype == np.uint32 and h.shape == (4,)
    assert h[:1].view(np.float32)[0] == np.abs(x1).max()  # seeded: the first cast is scaled like the rest
    q1, s1 = ck.fp8_quantize(x1, history=h)
    assert s1 == np.float32(1) / (np.float32(448) / np.abs(x1).max())
    assert h[:1].view(np.float32)[0] == np.abs(x1).max() and (h[1:] == 0).all()
    q2, s2 = ck.fp8_quantize(x2, history=h)  # scaled by x1's amax: x2's large values saturate
    assert s2 == s1
    np.testing.assert_array_equal(q2, _expect(x2, np.float32(1) / s1, E4))
    assert h[:1].view(np.float32)[0] == np.abs(x2).max()


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_every_code(fmt):
    codes = np.arange(256, dtype=np.uint8)
    for src in (codes, codes.view(fmt)):
        y = ck.fp8_dequantize(src, np.float32(0.5), q_dtype=fmt if src.dtype == np.uint8 else None)
        ref = codes.view(fmt).astype(np.float32) * np.float32(0.5)
        np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
        np.testing.assert_array_equal(y[~np.isnan(y)], ref[~np.isnan(ref)])
    yb = ck.fp8_dequantize(codes, 2.0, q_dtype=fmt, dtype=ck.bfloat16)
    assert yb.dtype == ck.bfloat16


@pytest.mark.parametrize("call, exc, match", [
    (lambda: ck.fp8_cast(np.ones(4, np.float64), 1.0), TypeError, "x: expected dtype"),
    (lambda: ck.fp8_cast(np.ones(4, np.float32), 0.0), ValueError, "scale: expected a finite number > 0"),
    (lambda: ck.fp8_cast(np.ones(4, np.float32), 1.0, dtype=np.float32), TypeError, "dtype: expected float8"),
    (lambda: ck.fp8_cast(np.ones(4, np.float32), 1.0, transpose=True), ValueError, "x: transpose=True needs a 2-D"),
    (lambda: ck.fp8_cast(np.ones((2, 2), np.float32).T, 1.0), ValueError, "x: expected a C-contiguous"),
    (lambda: ck.fp8_cast(np.ones((2, 3), np.float32), 1.0, out_t=np.empty((3, 2), np.uint8)), ValueError, "out_t"),
    (lambda: ck.fp8_cast(np.ones(4, np.float32), np.ones(2, np.float32)), ValueError, "scale: expected a 0-d"),
    (lambda: ck.fp8_quantize(np.ones(4, np.float32), margin=-1), ValueError, "margin"),
    (lambda: ck.fp8_quantize(np.ones(4, np.float32), history=np.zeros(3, np.uint32)), ValueError, "history"),
    (lambda: ck.fp8_dequantize(np.zeros(4, np.uint8), 1.0), TypeError, "q_dtype: required"),
    (lambda: ck.fp8_dequantize(np.zeros(4, np.int8), 1.0, q_dtype=E4), TypeError, "q: expected FP8 data"),
    (lambda: ck.fp8_dequantize(np.zeros(4, np.uint8).view(E4), 1.0, q_dtype=E5), TypeError, "q_dtype: .* disagrees"),
    (lambda: ck.fp8_scale(np.float32(1.0)), TypeError, "amax: expected a numpy.ndarray"),
    (lambda: ck.fp8_transpose(np.zeros(4, np.uint8)), ValueError, "q: expected a 2-D"),
    (lambda: ck.fp8_transpose(np.zeros((4, 4), np.float32)), TypeError, "q: expected FP8 data"),
    (lambda: ck.fp8_transpose(np.zeros((4, 4), np.uint8).T), ValueError, "q: expected a C-contiguous"),
    (lambda: ck.fp8_transpose(np.zeros((4, 2), np.uint8), out=np.zeros((4, 2), np.uint8)), ValueError, "out"),
])
def test_argument_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ================================================================================== CPU: the FP8 GEMM reference
def _q(rng, shape, fmt, scale=1.0):
    x = randn(rng, shape, np.float32, scale=scale)
    q, si = ck.fp8_quantize(x, dtype=fmt)
    return q, si


@pytest.mark.parametrize("fa,fb", [(E4, E4), (E4, E5), (E5, E4)])
@pytest.mark.parametrize("odt", [ck.bfloat16, np.float32])
def test_reference_gemm_is_the_dequantised_product(fa, fb, odt):
    rng = np.random.default_rng(2)
    (a, sa), (b, sb) = _q(rng, (2, 5, 32), fa), _q(rng, (48, 32), fb, scale=0.1)
    y = ck.matmul(a, b, trans_b=True, a_scale=sa, b_scale=sb, a_dtype=fa, b_dtype=fb, out_dtype=odt)
    ref = np.matmul(_deq(a, fa, sa), _deq(b, fb, sb).T)
    assert y.dtype == np.dtype(odt) and y.shape == (2, 5, 48)
    np.testing.assert_array_equal(y, ref.astype(odt))
    # NumPy float8 arrays carry the format; beta = 1 accumulates in fp32
    acc = randn(rng, (2, 5, 48), np.float32)
    expect = acc.astype(np.float64) + 0.5 * ref
    ck.matmul(a.view(fa), b.view(fb), trans_b=True, a_scale=sa, b_scale=sb, out=acc, alpha=0.5, beta=1.0)
    np.testing.assert_allclose(acc, expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(a_dtype=E5, b_dtype=E5), TypeError, "no e5m2 x e5m2"),
    (dict(trans_b=False), ValueError, "trans_b: FP8 GEMMs take both operands K-major"),
    (dict(trans_a=True), ValueError, "K-major"),
    (dict(a_dtype=None), TypeError, "a_dtype: required"),
    (dict(a_scale=2.0), TypeError, "a_scale: expected a 0-d float32 array"),
    (dict(b_scale=np.ones(1, np.float32)), ValueError, "b_scale: expected a 0-d"),
    (dict(out_dtype=np.float16), TypeError, "out_dtype"),
    (dict(beta=1.0), ValueError, "out: required"),
])
def test_gemm_argument_errors(kw, exc, match):
    a, b = np.zeros((4, 32), np.uint8), np.zeros((16, 32), np.uint8)
    args = dict(trans_b=True, a_dtype=E4, b_dtype=E4)
    args.update(kw)
    with pytest.raises(exc, match=match):
        ck.matmul(a, b, **args)


def test_gemm_shape_errors():
    kw = dict(trans_b=True, a_dtype=E4, b_dtype=E4)
    with pytest.raises(ValueError, match="K and N multiples of 16"):
        ck.matmul(np.zeros((4, 24), np.uint8), np.zeros((16, 24), np.uint8), **kw)
    with pytest.raises(ValueError, match="K and N multiples of 16"):
        ck.matmul(np.zeros((4, 32), np.uint8), np.zeros((20, 32), np.uint8), **kw)
    with pytest.raises(ValueError, match="inner dimensions"):
        ck.matmul(np.zeros((4, 32), np.uint8), np.zeros((16, 48), np.uint8), **kw)
    with pytest.raises(ValueError, match="16 bytes apart"):
        ck.matmul(np.zeros((4, 40), np.uint8)[:, :32], np.zeros((16, 32), np.uint8), **kw)
    with pytest.raises(ValueError, match="fast_accum: applies to FP8"):
        ck.matmul(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), fast_accum=True)


# ================================================================================== CPU: the FP8 linear
def _fp8_linear_expect(x, w, dy, grad_fmt=E4):
    """Forward output, dx and dW of the FP8 linear from the dequantised operands, in float64."""
    x2 = x.reshape(-1, x.shape[-1]).astype(ck.bfloat16)
    xq, sx = ck.fp8_quantize(x2)
    wq, sw = ck.fp8_quantize(w)
    y = _deq(xq, E4, sx) @ _deq(wq, E4, sw).T
    g2 = dy.reshape(-1, dy.shape[-1]).astype(ck.bfloat16)
    gq, sg = ck.fp8_quantize(g2, dtype=grad_fmt)
    dx = _deq(gq, grad_fmt, sg) @ _deq(wq, E4, sw)
    dw = _deq(gq, grad_fmt, sg).T @ _deq(xq, E4, sx)
    return y, dx, dw


@pytest.mark.parametrize("grad_fmt", FMTS)
def test_fp8_linear_matches_the_dequantised_formula(grad_fmt):
    rng = np.random.default_rng(3)
    lin = nn.Linear(32, 48, rng=rng)
    x = ck.tensor(randn(rng, (2, 8, 32), np.float32), requires_grad=True)
    dy = randn(rng, (2, 8, 48), np.float32, scale=1e-3)
    recipe = ck.float8.replace(grad_dtype=grad_fmt)
    with ck.autocast(recipe):
        y = lin(x)
    assert y.dtype == ck.bfloat16 and y.shape == (2, 8, 48)
    y.backward(dy.astype(ck.bfloat16))
    ey, edx, edw = _fp8_linear_expect(x.data, lin.weight.data, dy, grad_fmt)
    np.testing.assert_array_equal(y.data.reshape(-1, 48), ey.astype(ck.bfloat16))
    np.testing.assert_array_equal(x.grad.reshape(-1, 32), edx.astype(ck.bfloat16).astype(np.float32))
    np.testing.assert_allclose(lin.weight.grad, edw, rtol=1e-6, atol=1e-12)
    # the FP8 result tracks the bf16 one
    with ck.autocast(ck.bfloat16):
        yb = lin(x)
    np.testing.assert_allclose(y.data.astype(np.float32), yb.data.astype(np.float32), rtol=0.1, atol=0.05)


def test_fp8_linear_bias_and_accumulation():
    rng = np.random.default_rng(4)
    lin = nn.Linear(16, 32, bias=True, rng=rng)
    lin.bias.data[...] = randn(rng, (32,), np.float32)
    x = randn(rng, (16, 16), np.float32)
    dy = randn(rng, (16, 32), np.float32)
    for _ in range(2):  # the second backward accumulates into .grad (beta = 1)
        with ck.autocast(ck.float8):
            y = lin(ck.tensor(x))
        y.backward(dy.astype(ck.bfloat16))
    ey, _, edw = _fp8_linear_expect(x, lin.weight.data, dy)
    e = ey.astype(ck.bfloat16)
    e += lin.bias.data.astype(ck.bfloat16)  # (the bf16 path's bias add, as array_ops.Linear's reference does it)
    np.testing.assert_array_equal(y.data, e)
    np.testing.assert_allclose(lin.weight.grad, 2 * edw, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(lin.bias.grad, 2 * dy.astype(ck.bfloat16).astype(np.float64).sum(0), rtol=1e-2)


def test_fp8_packed_linear_is_one_joined_quantisation():
    rng = np.random.default_rng(5)
    mlp = nn.SwiGLUMLP(32, 48, rng=rng)
    x = randn(rng, (16, 32), np.float32)
    with ck.autocast(ck.float8):
        out = nn.layers.project_packed(mlp, ck.tensor(x), (mlp.gate_proj, mlp.up_proj))
    W = np.concatenate([mlp.gate_proj.weight.data, mlp.up_proj.weight.data])
    ey, _, _ = _fp8_linear_expect(x, W, np.zeros((16, 96), np.float32))
    np.testing.assert_array_equal(out.data, ey.astype(ck.bfloat16))
    dy = randn(rng, (16, 96), np.float32)
    out.backward(dy.astype(ck.bfloat16))
    _, _, edw = _fp8_linear_expect(x, W, dy)
    np.testing.assert_allclose(np.concatenate([mlp.gate_proj.weight.grad, mlp.up_proj.weight.grad]), edw, rtol=1e-6,
                               atol=1e-12)


class _PlainLinear(nn.Linear):
    """A Linear the SwiGLU MLP does not fuse with its SwiGLU (not exactly nn.Linear): the unfused composition."""


def _mlp_pair(rng, xp, hidden=32, ffn=48):
    """Two SwiGLU MLPs with the same weights: the fused FP8 path (Fp8SwiGLUDown) and the unfused composition."""
    a = nn.SwiGLUMLP(hidden, ffn, rng=rng, xp=xp)
    b = nn.SwiGLUMLP(hidden, ffn, xp=xp)
    b.down_proj = _PlainLinear(ffn, hidden, xp=xp)
    for la, lb in ((a.gate_proj, b.gate_proj), (a.up_proj, b.up_proj), (a.down_proj, b.down_proj)):
        lb.weight.data[...] = la.weight.data
    assert all(type(p.data) is type(a.gate_proj.weight.data) for p in (*a.parameters(), *b.parameters()))
    return a, b


def _run_mlps(mlps, xp, rng, recipe, steps=2, tokens=(2, 16), hidden=32):
    """Forward and backward of each MLP on the same data for ``steps`` steps (delayed histories carry over); the
    outputs and gradients of the last step, on the host."""
    for _ in range(steps):
        x = randn(rng, tokens + (hidden,), np.float32)
        dy = randn(rng, tokens + (hidden,), np.float32, scale=1e-2).astype(ck.bfloat16)
        outs = []
        for m in mlps:
            for p in m.parameters():
                p.grad = None
            xt = ck.tensor(xp.asarray(x), requires_grad=True)
            with ck.autocast(recipe):
                y = m(xt)
            y.backward(xp.asarray(dy))
            outs.append([to_host(v) for v in (y.data, xt.grad, m.gate_proj.weight.grad, m.up_proj.weight.grad,
                                              m.down_proj.weight.grad)])
    return outs


def _watch_fused(monkeypatch):
    """Counts what the fused MLP path did: Fp8SwiGLUDown forwards, fp8_swiglu_quantize calls, and the tensor slots
    cast with an amax handed over by the kernel that wrote them."""
    import cukernels.functional.fp8 as f8

    seen = dict(fwd=0, swiglu_cast=0, amax_slots=[])
    fwd, quant, sq = f8.Fp8SwiGLUDown.forward, f8._quantize, f8.fp8_swiglu_quantize

    def forward(*a, **k):
        seen["fwd"] += 1
        return fwd(*a, **k)

    def quantize(t, fmt, recipe, state, slot, transpose=True, amax=None):
        if amax is not None:
            seen["amax_slots"].append(slot)
        return quant(t, fmt, recipe, state, slot, transpose, amax)

    def swiglu_quantize(*a, **k):
        seen["swiglu_cast"] += 1
        return sq(*a, **k)

    monkeypatch.setattr(f8.Fp8SwiGLUDown, "forward", staticmethod(forward))
    monkeypatch.setattr(f8, "_quantize", quantize)
    monkeypatch.setattr(f8, "fp8_swiglu_quantize", swiglu_quantize)
    return seen


# per scaling, over one step: the slots cast with a handed-over amax, and the fused SwiGLU casts
FUSED = {"current": (["x", "g"], 0), "hybrid": (["g"], 1), "delayed": ([], 1)}


def _check_fused(seen, scaling, steps):
    slots, casts = FUSED[scaling]
    assert seen["fwd"] == steps, "the MLP did not take the fused path"
    assert sorted(seen["amax_slots"]) == sorted(slots * steps)
    assert seen["swiglu_cast"] == casts * steps


@pytest.mark.parametrize("scaling", ["current", "delayed", "hybrid"])
def test_fp8_swiglu_down_is_the_unfused_composition(scaling, monkeypatch):
    """The fused SwiGLU + down projection (its amax from the SwiGLU kernels, the dgu amax handed to the gate / up
    pack) computes the same bits as swiglu_packed followed by the FP8 Linear with their own amax passes."""
    rng = np.random.default_rng(11)
    a, b = _mlp_pair(rng, np)
    seen = _watch_fused(monkeypatch)
    fused, plain = _run_mlps((a, b), np, rng, ck.float8.replace(scaling=scaling))
    _check_fused(seen, scaling, 2)
    for name, u, v in zip(("y", "dx", "dW gate", "dW up", "dW down"), fused, plain):
        np.testing.assert_array_equal(u, v, err_msg=name)
    assert a.__dict__["_fp8_packed_state"].g_amax is None  # the stash was taken


def test_swiglu_packed_amax_and_quantize_with_a_given_amax():
    rng = np.random.default_rng(12)
    gu = randn(rng, (8, 64), np.float32).astype(ck.bfloat16)
    am = np.zeros((), np.float32)
    y = ck.swiglu_packed(gu, amax=am)
    assert am == np.abs(y.astype(np.float32)).max()
    dy = randn(rng, (8, 32), np.float32).astype(ck.bfloat16)
    dgu = ck.swiglu_packed_backward(gu, dy, amax=am)
    assert am == np.abs(dgu.astype(np.float32)).max()
    q0, t0, s0 = ck.fp8_quantize(dgu, transpose=True)
    q1, t1, s1 = ck.fp8_quantize(dgu, transpose=True, amax=am)
    np.testing.assert_array_equal(q0, q1)
    np.testing.assert_array_equal(t0, t1)
    assert s0 == s1
    h1, h2 = ck.fp8_history(y), ck.fp8_history(y)
    for _ in range(2):  # the fused SwiGLU cast is the cast of swiglu_packed's output, history included
        q0, t0, s0 = ck.fp8_quantize(ck.swiglu_packed(gu), transpose=True, history=h1)
        q1, t1, s1 = ck.fp8_swiglu_quantize(gu, h2)
        for u, v in ((q0, q1), (t0, t1), (s0, s1), (h1, h2)):
            np.testing.assert_array_equal(u, v)
        gu = (gu.astype(np.float32) * 2).astype(ck.bfloat16)
    with pytest.raises(TypeError, match="gu: expected .*bfloat16"):
        ck.fp8_swiglu_quantize(gu.astype(np.float32), h2)
    with pytest.raises(ValueError, match="gu: expected a 2-D"):
        ck.fp8_swiglu_quantize(gu[:, :63].copy(), h2)
    with pytest.raises(ValueError, match="amax: .* pass one of them"):
        ck.fp8_quantize(dgu, amax=am, history=ck.fp8_history(dgu))
    with pytest.raises(ValueError, match="amax: expected a 0-d float32"):
        ck.swiglu_packed(gu, amax=np.zeros((1,), np.float32))
    with pytest.raises(TypeError, match="amax"):
        ck.swiglu_packed(gu, amax=np.zeros((), np.float64))


def test_fp8_linear_without_grad_skips_the_transposes():
    rng = np.random.default_rng(8)
    lin = nn.Linear(32, 16, rng=rng)
    x = ck.tensor(randn(rng, (5, 32), np.float32))  # 5 tokens: fine without a weight gradient
    with ck.autocast(ck.float8), ck.no_grad():
        y = lin(x)
    ey, _, _ = _fp8_linear_expect(x.data, lin.weight.data, np.zeros((5, 16), np.float32))
    np.testing.assert_array_equal(y.data, ey.astype(ck.bfloat16))


def test_fp8_falls_back_to_bf16_where_cublaslt_cannot():
    rng = np.random.default_rng(6)
    lin = nn.Linear(24, 32, rng=rng)  # 24 input features: no FP8 GEMM
    x = ck.tensor(randn(rng, (16, 24), np.float32))
    with ck.autocast(ck.float8):
        y8 = lin(x)
    with ck.autocast(ck.bfloat16):
        yb = lin(x)
    np.testing.assert_array_equal(y8.data, yb.data)
    lin2 = nn.Linear(32, 32, rng=rng)
    x2 = ck.tensor(randn(rng, (5, 32), np.float32), requires_grad=True)  # 5 tokens: no FP8 weight gradient
    with ck.autocast(ck.float8):
        assert not ck.functional.fp8_ok(32, 32, x2.data)
        y = lin2(x2)
    with ck.autocast(ck.bfloat16):
        np.testing.assert_array_equal(y.data, lin2(x2).data)


def test_autocast_float8_state():
    from cukernels import amp

    assert amp.get_fp8_recipe() is None
    with ck.autocast(ck.float8):
        assert amp.get_autocast_dtype() == ck.bfloat16 and amp.get_fp8_recipe() is ck.float8
        with ck.autocast(ck.bfloat16):
            assert amp.get_fp8_recipe() is None
        assert amp.get_fp8_recipe() is ck.float8
        with ck.autocast(ck.float8, enabled=False):
            assert amp.get_autocast_dtype() is None and amp.get_fp8_recipe() is None
    assert amp.get_fp8_recipe() is None and amp.get_autocast_dtype() is None
    with pytest.raises(ValueError, match="scaling"):
        ck.Float8Recipe(scaling="sometimes")
    with pytest.raises(TypeError, match="grad_dtype"):
        ck.Float8Recipe(grad_dtype=np.float16)
    with pytest.raises(ValueError, match="margin"):
        ck.Float8Recipe(margin=9)


def test_fp8_delayed_recipe_trains_a_layer():
    rng = np.random.default_rng(7)
    lin = nn.Linear(32, 16, rng=rng)
    r = ck.float8.replace(scaling="delayed")
    for i in range(3):
        x = ck.tensor(randn(rng, (16, 32), np.float32, scale=1 + i), requires_grad=True)
        with ck.autocast(r):
            y = lin(x)
        y.backward(randn(rng, (16, 16), np.float32).astype(ck.bfloat16))
    st = lin._fp8_state
    assert st.x is not None and st.w is not None and st.g is not None
    assert st.x[:1].view(np.float32)[0] == np.abs(x.data.astype(ck.bfloat16).astype(np.float32)).max()
    assert np.isfinite(lin.weight.grad).all()


def _watch_fp8_shadows(monkeypatch):
    """The set of parameter-name packs for which AdamW.fp8_shadow handed out an FP8 copy."""
    packs = set()
    orig = ck.optim.AdamW.fp8_shadow

    def watched(self, params):
        r = orig(self, params)
        if r is not None:
            packs.add(tuple(self._slot(p).name for p in params))
        return r

    monkeypatch.setattr(ck.optim.AdamW, "fp8_shadow", watched)
    return packs


def test_optimizer_fp8_shadow_feeds_the_fp8_linear():
    """AdamW(fp8_shadows=True): the layer reads the optimizer's E4M3 copy (made from the fp32 master at the first
    call: the same bits as quantising the master, current scaling) and stops reading a bf16 shadow; the update
    rewrites the copy; refresh_shadows rescales it from the present values."""
    from cukernels.amp import attach_shadows

    rng = np.random.default_rng(3)
    lin = nn.Linear(64, 48, rng=rng)
    opt = ck.optim.AdamW(lin.parameters(), lr=1e-2, fp8_shadows=True)
    attach_shadows(lin.parameters(), opt)
    assert lin.weight.shadow is not None and lin.weight.fp8_owner is opt
    x = randn(rng, (32, 64), np.float32)
    r = ck.float8
    with ck.autocast(r):
        y = lin(ck.tensor(x, requires_grad=True))
    q, qt, si = opt.fp8_shadow([lin.weight])
    wq, wqt, sw = ck.fp8_quantize(lin.weight.data, transpose=True)
    assert np.array_equal(q, wq) and np.array_equal(qt, wqt) and si == sw
    assert lin.weight.shadow is None
    with pytest.raises(ValueError, match="has an FP8 shadow instead"):
        opt.shadow(lin.weight)
    ref = ck.functional.fp8_linear(ck.tensor(x.astype(ck.bfloat16)), lin.weight, recipe=r)  # casts the master
    assert np.array_equal(y.data, ref.data)
    y.backward(randn(rng, y.shape, np.float32).astype(ck.bfloat16))
    before = np.float32(np.abs(lin.weight.data).max())
    opt.step()
    assert opt.fp8_shadow([lin.weight])[0] is q  # the same arrays, rewritten
    s = ck.ops.fp8.ref_scale(before, E4)
    assert np.array_equal(q, ck.ops.fp8.ref_cast(lin.weight.data, s, E4)) and si == np.float32(1) / s
    lin.weight.data[...] *= 4
    opt.refresh_shadows()
    assert np.array_equal(q, ck.fp8_quantize(lin.weight.data)[0])
    lin.weight.data = lin.weight.data * -0.5  # a rebound .data: taken back at the next zero_grad, the copy made again
    opt.zero_grad()
    assert np.array_equal(q, ck.fp8_quantize(lin.weight.data)[0]) and np.array_equal(qt, q.T)
    assert opt.fp8_shadow([lin.weight, lin.weight]) is None  # a weight already in another pack


def test_optimizer_fp8_shadow_refuses_what_it_cannot_keep():
    rng = np.random.default_rng(4)
    a, b, c = nn.Linear(32, 16, rng=rng), nn.Linear(32, 16, rng=rng), nn.Linear(48, 16, rng=rng)
    ps = a.parameters() + b.parameters() + c.parameters()
    assert ck.optim.AdamW(ps).fp8_shadow([a.weight]) is None  # fp8_shadows=False
    opt = ck.optim.AdamW(ps, fp8_shadows=True)
    assert opt.fp8_shadow([a.weight, c.weight]) is None  # widths differ
    assert opt.fp8_shadow([b.weight, a.weight]) is None  # not back to back in this order
    assert opt.fp8_shadow([a.weight, b.weight])[0].shape == (32, 32)
    bias = nn.Linear(16, 16, bias=True, rng=rng)
    opt2 = ck.optim.AdamW(bias.parameters(), fp8_shadows=True)
    assert opt2.fp8_shadow([bias.bias]) is None  # not 2-D
    assert opt2.fp8_shadow([nn.Linear(16, 16).weight]) is None  # not this optimizer's
    with pytest.raises(TypeError, match="fp8_shadows"):
        ck.optim.AdamW(ps, fp8_shadows="yes")


# ================================================================================== CPU: the trainer
def test_trainer_precision_follows_the_fp8_keys(monkeypatch):
    """The recipe a config's steps autocast to: bf16 without fp8; with it the module's float8 (a caller's swap is
    kept) under fp8_scaling, fp8_head and fp8_fast_accum_grad."""
    from pathlib import Path

    from cukernels.train import TrainConfig, load_config, trainer

    cfg_path = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")

    def recipe(*over):
        return trainer.precision_of(TrainConfig.from_dict(load_config(cfg_path, list(over))))

    assert recipe() == ck.bfloat16 and recipe("autocast=bf16") == ck.bfloat16
    assert recipe("fp8=true") == ck.float8
    r = recipe("fp8=true", "fp8_scaling=hybrid", "fp8_fast_accum_grad=true")
    assert (r.scaling, r.fast_accum, r.fast_accum_grad, r.head_grad_dtype) == ("hybrid", True, True, None)
    r = recipe("fp8=true", "fp8_head=dx")
    assert (r.fast_accum_grad, r.head_grad_dtype, r.head_fp8_dw) == (False, ck.float8_e5m2, False)
    monkeypatch.setattr(trainer, "float8", ck.float8.replace(margin=2))
    assert recipe("fp8=true", "fp8_fast_accum_grad=true").margin == 2


def test_trainer_fp8_tracks_bf16(tmp_path, monkeypatch):
    from pathlib import Path

    from cukernels.train import load_config, trainer

    cfg_path = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
    small = ["max_steps=8", "eval_every=0", "log_every=2", "plot=false", "batch_size=8", "seq_len=32",
             "total_batch_size=256", "model.hidden_size=64", "model.intermediate_size=160",
             "model.num_hidden_layers=2", "warmup_steps=2", "lr=0.01", "sample_chars=0", "ckpt_final=false"]
    losses = {}
    for name, extra in (("bf16", ["autocast=bf16"]), ("fp8", ["fp8=true"])):
        cfg = load_config(cfg_path, small + [f"out_dir={tmp_path / name}"] + extra)
        rows = trainer.train(cfg, quiet=True)
        losses[name] = np.array([r["loss"] for r in rows if r["kind"] == "train"])
    assert np.isfinite(losses["fp8"]).all()
    np.testing.assert_allclose(losses["fp8"], losses["bf16"], rtol=0.02)
    assert not np.array_equal(losses["fp8"], losses["bf16"])  # the GEMMs did run in FP8
    packs = _watch_fp8_shadows(monkeypatch)
    cfg = load_config(cfg_path, small + [f"out_dir={tmp_path / 'again'}", "fp8=true"])
    trainer.train(cfg, quiet=True)
    assert not packs  # the default, fp8_shadow: false: every step casts the bf16 shadows
    cfg = load_config(cfg_path, small + [f"out_dir={tmp_path / 'shadow'}", "fp8=true", "fp8_shadow=true"])
    rows = trainer.train(cfg, quiet=True)
    np.testing.assert_allclose([r["loss"] for r in rows if r["kind"] == "train"], losses["fp8"], rtol=0.01)
    # fp8_shadow: true: the optimizer keeps a copy of every Linear weight, gate / up as one pack (q / k / v are packed
    # on the GPU path only: flash attention's input), a layer each
    assert sorted(len(k) for k in packs) == [1] * 10 + [2, 2], sorted(packs)
    assert all(k[0].endswith("gate_proj.weight") for k in packs if len(k) == 2)
    cfg = load_config(cfg_path, small + [f"out_dir={tmp_path / 'head'}", "fp8=true", "fp8_head=true"])
    rows = trainer.train(cfg, quiet=True)  # the LM head's gradient GEMMs in FP8 too
    head = np.array([r["loss"] for r in rows if r["kind"] == "train"])
    np.testing.assert_allclose(head, losses["fp8"], rtol=0.02)
    assert not np.array_equal(head, losses["fp8"])  # the head's gradients did change
    cfg = load_config(cfg_path, small + [f"out_dir={tmp_path / 'headdx'}", "fp8=true", "fp8_head=dx"])
    rows = trainer.train(cfg, quiet=True)  # only the head's dx GEMM in FP8
    dxo = np.array([r["loss"] for r in rows if r["kind"] == "train"])
    np.testing.assert_allclose(dxo, losses["fp8"], rtol=0.02)
    assert not np.array_equal(dxo, losses["fp8"]) and not np.array_equal(dxo, head)
    with pytest.raises(ck.train.ConfigError, match=r"fp8_head: expected one of \['false', 'true', 'dx'\]; got 'dw' "
                                                   r"\(did you mean 'dx'\?\)"):
        load_config(cfg_path, ["fp8=true", "fp8_head=dw"])
    with pytest.raises(ck.train.ConfigError, match="fp8_head: runs the LM head's gradient GEMMs in FP8"):
        load_config(cfg_path, ["fp8_head=true"])
    with pytest.raises(ck.train.ConfigError, match="fp8_shadow: keeps FP8 copies"):
        load_config(cfg_path, ["fp8_shadow=true"])
    with pytest.raises(ck.train.ConfigError, match="fp8_fast_accum_grad: applies to the FP8 GEMMs' backward"):
        load_config(cfg_path, ["fp8_fast_accum_grad=true"])
    with pytest.raises(ck.train.ConfigError, match="fp8: needs fused: true"):
        load_config(cfg_path, ["fp8=true", "fused=false"])
    assert load_config(cfg_path, ["fp8=true"])["autocast"] == "bf16"


# ======================================================= CPU: the amax add_rms_norm's backward hands to the FP8 linears
def test_amax_notes_are_taken_by_identity_once():
    """ops.fp8.note_amax / take_amax: the amax comes back for the very array noted (not an equal one, not a view),
    once; at most _AMAX_KEEP notes are kept, the oldest let go first."""
    from cukernels.ops import fp8 as o8

    a, b, am = np.ones(4, np.float32), np.ones(4, np.float32), np.ones((), np.float32)
    try:
        o8.note_amax(a, am)
        assert o8.take_amax(b) is None and o8.take_amax(a.reshape(2, 2)) is None
        assert o8.take_amax(a) is am and o8.take_amax(a) is None
        arrs = [np.zeros(1, np.float32) for _ in range(o8._AMAX_KEEP + 2)]
        for i, x in enumerate(arrs):
            o8.note_amax(x, np.full((), i, np.float32))
        assert len(o8._amax_notes) == o8._AMAX_KEEP
        assert o8.take_amax(arrs[0]) is None and o8.take_amax(arrs[1]) is None
        assert o8.take_amax(arrs[-1]) == len(arrs) - 1
    finally:
        o8._amax_notes.clear()


def _count_amax_hits(monkeypatch):
    """A list that gets, per FP8 backward, whether an amax noted for its dy was taken (functional/fp8.py)."""
    import cukernels.functional.fp8 as f8

    hits, take = [], f8.take_amax

    def counted(g):
        a = take(g)
        hits.append(a is not None)
        return a

    monkeypatch.setattr(f8, "take_amax", counted)
    return hits


def _llama_fp8_grads(xp, recipe, layers=2, hidden=32, ffn=64, heads=2, tokens=(2, 17), vocab=64):
    """Loss and parameter gradients (on the host) of one forward + backward of a small LLaMA under ``recipe``."""
    cfg = ck.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=256)
    m = ck.Llama(cfg, xp=xp, seed=0)
    ids = np.random.default_rng(5).integers(0, vocab, tokens).astype(np.int32)
    with ck.autocast(recipe):
        loss = m(xp.asarray(ids[:, :-1]), xp.asarray(ids[:, 1:]))
    loss.backward()
    return float(loss.data), {n: to_host(p.grad) for n, p in m.named_parameters()}


def _without_rms_amax(monkeypatch, fn, *args):
    """``fn(*args)`` with add_rms_norm's backward taking no amax (the FP8 linears run their amax passes)."""
    import importlib

    frms = importlib.import_module("cukernels.functional.rms_norm")  # (the package's rms_norm is the function)
    with monkeypatch.context() as mp:
        mp.setattr(frms, "_grad_amax_wanted", lambda h: False)
        return fn(*args)


@pytest.mark.parametrize("scaling, hits", [("current", 4), ("hybrid", 4), ("delayed", 0)])
def test_rms_norm_backward_amax_feeds_the_fp8_linears(scaling, hits, monkeypatch):
    """Under current-scaled gradients add_rms_norm's backward takes max |dx| in its pass and hands it to the FP8
    backward of the o_proj / down projection whose output gradient dx is (two a layer: 2 layers, 4); the gradients
    are the bits of the amax passes it replaces, and no note is left behind (NumPy path)."""
    from cukernels.ops import fp8 as o8

    seen = _count_amax_hits(monkeypatch)
    r = ck.float8.replace(scaling=scaling)
    on = _llama_fp8_grads(np, r)
    n_on = sum(seen)
    seen.clear()
    off = _without_rms_amax(monkeypatch, _llama_fp8_grads, np, r)
    assert n_on == hits and sum(seen) == 0
    assert not o8._amax_notes
    assert on[0] == off[0]
    for n, g in on[1].items():
        np.testing.assert_array_equal(g, off[1][n], err_msg=n)


# ================================================================================== GPU
def _cp():
    import cupy

    return cupy


SIZES = [0, 1, 15, 16, 17, 1000, 4097, 65536 + 3]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_cast_every_bf16_value_bit_exact(fmt):
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ck.bfloat16)
    for s in (1.0, 3.75, 2.0 ** -20):
        for dev_scale in (False, True):
            sc = _cp().asarray(np.float32(s)) if dev_scale else s
            q = ck.fp8_cast(device_copy(x), sc, dtype=fmt, out=poisoned(x.shape, np.uint8))
            np.testing.assert_array_equal(to_host(q), _expect(x, s, fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [np.float32, ck.bfloat16])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("misalign", [False, True])
def test_gpu_cast_and_amax_match_reference(rng, fmt, dtype, n, misalign):
    x = randn(rng, (n,), dtype, scale=50.0)
    if n > 40:
        x[:len(SPECIAL)] = SPECIAL.astype(dtype)
    xd = device_copy(x, misalign=misalign)
    amax = _cp().zeros((), np.float32)
    q = ck.fp8_cast(xd, 7.5, dtype=fmt, out=poisoned((n,), np.uint8, misalign=misalign), amax=amax)
    np.testing.assert_array_equal(to_host(q), ck.fp8_cast(x, 7.5, dtype=fmt))
    ref_a = ck.fp8_amax(x)
    np.testing.assert_array_equal(to_host(amax), ref_a)
    np.testing.assert_array_equal(to_host(ck.fp8_amax(xd)), ref_a)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [np.float32, ck.bfloat16])
@pytest.mark.parametrize("shape", [(16, 16), (64, 64), (48, 80), (128, 4096), (130, 67), (1, 1), (0, 5), (3, 200),
                                   (200, 3)])
@pytest.mark.parametrize("misalign", [False, True])
def test_gpu_cast_transpose_matches_reference(rng, fmt, dtype, shape, misalign):
    x = randn(rng, shape, dtype, scale=4.0)
    xd = device_copy(x, misalign=misalign)
    q, qt = ck.fp8_cast(xd, 9.0, dtype=fmt, transpose=True, out=poisoned(shape, np.uint8),
                        out_t=poisoned(shape[::-1], np.uint8, misalign=misalign))
    ref = ck.fp8_cast(x, 9.0, dtype=fmt)
    np.testing.assert_array_equal(to_host(q), ref)
    np.testing.assert_array_equal(to_host(qt), ref.T)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16, 16), (64, 64), (48, 80), (130, 67), (1, 1), (0, 5), (3, 200), (1024, 4096)])
@pytest.mark.parametrize("misalign", [False, True])
def test_gpu_fp8_transpose_matches_reference(rng, shape, misalign):
    q = rng.integers(0, 256, size=shape, dtype=np.uint8)
    qd = device_copy(q, misalign)
    out = poisoned(shape[::-1], np.uint8, misalign)
    got = ck.fp8_transpose(qd, out=out)
    assert got is out and np.array_equal(to_host(got), q.T)
    assert np.array_equal(to_host(ck.fp8_transpose(device_copy(q))), ck.fp8_transpose(q))


@pytest.mark.gpu
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_quantize_current_and_delayed_match_reference(rng, transpose, fmt):
    shape = (96, 64)
    xs = [randn(rng, shape, ck.bfloat16, scale=s) for s in (1.0, 30.0, 0.01)]
    h_host = ck.fp8_history(xs[0])
    h_dev = ck.fp8_history(device_copy(xs[0]))
    np.testing.assert_array_equal(to_host(h_dev), h_host)
    for x in xs:
        for hist in (None, "delayed"):
            rh = ck.fp8_quantize(x, dtype=fmt, transpose=transpose, margin=1,
                                 history=h_host if hist else None)
            rd = ck.fp8_quantize(device_copy(x), dtype=fmt, transpose=transpose, margin=1,
                                 history=h_dev if hist else None)
            for a, b in zip(rd, rh):
                np.testing.assert_array_equal(to_host(a), b)
            if hist:
                np.testing.assert_array_equal(to_host(h_dev), h_host)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("odt", [np.float32, ck.bfloat16])
@pytest.mark.parametrize("n", [1, 17, 256, 4099])
def test_gpu_dequantize_and_scale(rng, fmt, odt, n):
    q = rng.integers(0, 256, n).astype(np.uint8)
    ref = ck.fp8_dequantize(q, np.float32(0.25), q_dtype=fmt, dtype=odt)
    got = ck.fp8_dequantize(device_copy(q, misalign=n > 16), _cp().asarray(np.float32(0.25)), q_dtype=fmt, dtype=odt,
                            out=poisoned((n,), odt))
    g, r = to_host(got).astype(np.float32), ref.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
    np.testing.assert_array_equal(g[~np.isnan(g)], r[~np.isnan(r)])
    for amax in (0.0, 1e-39, np.inf, np.nan, 3.0, 1e-37):
        s, si = ck.fp8_scale(_cp().asarray(np.float32(amax)), dtype=fmt, margin=2)
        rs, rsi = ck.fp8_scale(np.array(amax, np.float32), dtype=fmt, margin=2)
        assert to_host(s) == rs and to_host(si) == rsi


def _gemm_case(rng, M, N, K, fa, fb, batch=(), shared_b=False):
    a = randn(rng, (*batch, M, K), np.float32, scale=2.0)
    b = randn(rng, ((N, K) if shared_b else (*batch, N, K)), np.float32, scale=0.05)
    aq, sa = ck.fp8_quantize(a.reshape(-1, K), dtype=fa)
    bq, sb = ck.fp8_quantize(b.reshape(-1, K), dtype=fb)
    aq, bq = aq.reshape(a.shape), bq.reshape(b.shape)
    ref = np.matmul(_deq(aq, fa, sa), np.swapaxes(_deq(bq, fb, sb), -1, -2))
    return aq, bq, sa, sb, ref


def _close(got, ref, rel):
    g, r = to_host(got).astype(np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(g).any(), "NaN in the output (unwritten?)"
    err = np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)
    assert err <= rel, f"max error {err:.3g} of the largest magnitude (allowed {rel})"


@pytest.mark.gpu
@pytest.mark.parametrize("fa,fb", [(E4, E4), (E4, E5), (E5, E4)])
@pytest.mark.parametrize("odt", [ck.bfloat16, np.float32])
@pytest.mark.parametrize("shape", [(37, 48, 80), (1, 16, 16), (200, 112, 272), (1024, 2048, 512)])
@pytest.mark.parametrize("fast", [False, True])
def test_gpu_fp8_gemm_matches_dequantised_product(rng, fa, fb, odt, shape, fast):
    M, N, K = shape
    aq, bq, sa, sb, ref = _gemm_case(rng, M, N, K, fa, fb)
    cp = _cp()
    y = ck.matmul(device_copy(aq), device_copy(bq), trans_b=True, a_scale=cp.asarray(sa), b_scale=cp.asarray(sb),
                  a_dtype=fa, b_dtype=fb, out=poisoned((M, N), odt), fast_accum=fast)
    _close(y, ref, 1e-2 if (odt != np.float32 or fast) else 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,shared_b", [((3,), False), ((3,), True), ((2, 2), False)])
def test_gpu_fp8_gemm_batched(rng, batch, shared_b):
    aq, bq, sa, sb, ref = _gemm_case(rng, 33, 64, 96, E4, E4, batch, shared_b)
    cp = _cp()
    y = ck.matmul(device_copy(aq), device_copy(bq), trans_b=True, a_scale=cp.asarray(sa), b_scale=cp.asarray(sb),
                  a_dtype=E4, b_dtype=E4, out_dtype=np.float32)
    assert y.shape == ref.shape
    _close(y, ref, 2e-3)


@pytest.mark.gpu
def test_gpu_fp8_gemm_accumulates_into_fp32_and_captures(rng):
    """dW += alpha * dy^T x (beta = 1, fp32) as the weight gradient does, eager and replayed from a captured graph
    whose scales change between replays (read from device memory at each replay)."""
    cp = _cp()
    aq, bq, sa, sb, ref = _gemm_case(rng, 48, 64, 256, E5, E4)
    g0 = randn(rng, (48, 64), np.float32)
    ad, bd, gd = device_copy(aq), device_copy(bq), device_copy(g0)
    sad, sbd = cp.asarray(sa), cp.asarray(sb)
    kw = dict(trans_b=True, a_scale=sad, b_scale=sbd, a_dtype=E5, b_dtype=E4, out=gd, beta=1.0, alpha=0.5)
    ck.matmul(ad, bd, **kw)  # eager (also creates the plan outside the capture)
    _close(gd, g0 + 0.5 * ref, 2e-3)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.matmul(ad, bd, **kw)
        g = s.end_capture()
    with s:
        g.launch(s)
        sad[...] = sad * 2  # (on the replays' stream) the next replay reads the doubled scale
        g.launch(s)
    s.synchronize()
    _close(gd, g0 + 0.5 * ref + 0.5 * ref + 1.0 * ref, 2e-3)


@pytest.mark.gpu
def test_gpu_fp8_gemm_refuses_misaligned_operands(rng):
    aq, bq, sa, sb, _ = _gemm_case(rng, 16, 16, 32, E4, E4)
    with pytest.raises(ValueError, match="16-byte aligned"):
        ck.matmul(device_copy(aq, misalign=True), device_copy(bq), trans_b=True, a_dtype=E4, b_dtype=E4)
    with pytest.raises(TypeError, match="a_scale: expected a 0-d float32 array"):
        ck.matmul(device_copy(aq), device_copy(bq), trans_b=True, a_dtype=E4, b_dtype=E4, a_scale=1.0)
    with pytest.raises(TypeError, match="a_scale: is a numpy array"):
        ck.matmul(device_copy(aq), device_copy(bq), trans_b=True, a_dtype=E4, b_dtype=E4, a_scale=sa)


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_gpu_fp8_linear_matches_numpy_path(rng, scaling):
    """The same layer and data on both paths: the casts are bit-identical, so the outputs differ only by the
    GEMMs' summation order."""
    cp = _cp()
    r = ck.float8.replace(scaling=scaling)
    host = nn.Linear(256, 192, bias=True, rng=rng)
    host.bias.data[...] = randn(rng, (192,), np.float32)
    dev = nn.Linear(256, 192, bias=True, xp=cp)
    dev.weight.data[...] = cp.asarray(host.weight.data)
    dev.bias.data[...] = cp.asarray(host.bias.data)
    for step in range(2):
        x = randn(rng, (4, 32, 256), np.float32)
        dy = randn(rng, (4, 32, 192), np.float32).astype(ck.bfloat16)
        outs = []
        for lin, xp in ((host, np), (dev, cp)):
            xt = ck.tensor(xp.asarray(x), requires_grad=True)
            with ck.autocast(r):
                y = lin(xt)
            y.backward(xp.asarray(dy))
            outs.append((to_host(y.data), to_host(xt.grad), to_host(lin.weight.grad), to_host(lin.bias.grad)))
        for name, a, b in zip(("y", "dx", "dW", "db"), outs[1], outs[0]):
            _close(a, b.astype(np.float64), 2e-2 if name in ("y", "dx", "db") else 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_trainer_fp8_tracks_bf16(tmp_path, graph, monkeypatch):
    from pathlib import Path

    from cukernels.train import load_config, trainer

    packs = _watch_fp8_shadows(monkeypatch)

    cfg_path = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
    small = ["max_steps=30", "eval_every=0", "log_every=5", "plot=false", "batch_size=8", "seq_len=64",
             "total_batch_size=512", "warmup_steps=5", "lr=0.003", "sample_chars=0", "ckpt_final=false",
             "device=gpu", f"graph={str(graph).lower()}"]
    losses = {}
    for name, extra in (("bf16", ["autocast=bf16"]), ("fp8", ["fp8=true", "fp8_shadow=true"]),
                        ("head", ["fp8=true", "fp8_head=true"]), ("headdx", ["fp8=true", "fp8_head=dx"])):
        cfg = load_config(cfg_path, small + [f"out_dir={tmp_path / name}"] + extra)
        rows = trainer.train(cfg, quiet=True)
        losses[name] = np.array([r["loss"] for r in rows if r["kind"] == "train"])
    assert np.isfinite(losses["fp8"]).all() and np.isfinite(losses["head"]).all()
    np.testing.assert_allclose(losses["fp8"], losses["bf16"], rtol=0.03)
    # fp8_head (E5M2 dlogits) trains, but does not track bf16 this closely on 256 classes: measured on the H200,
    # +27 % at step 20 and +4.9 % at step 30 (the head's dW sums dlogits that cancel: NOTES, "FP8", the LM head)
    head, base = losses["head"], losses["bf16"]
    np.testing.assert_allclose(head[:2], base[:2], rtol=0.03)
    assert head[-1] < head[0] - 1.0 and abs(head[-1] / base[-1] - 1) < 0.1, (head, base)
    # fp8_head: dx (the weight gradient in bf16) tracks here as the Linear layers do (it passed on the H200; its
    # cost shows only at 2000 steps of small.yaml: NOTES, "FP8")
    np.testing.assert_allclose(losses["headdx"], base, rtol=0.03)
    assert {len(k) for k in packs} == {1, 2, 3}, sorted(packs)  # the optimizer's copies: q / k / v, gate / up, o, down


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["current", "delayed", "hybrid"])
def test_gpu_fp8_swiglu_down_is_the_unfused_composition(scaling, monkeypatch):
    """On the device too: the SwiGLU kernels' amax (forward h, backward dgu) gives the casts the amax their own
    pass would: the same bits, odd token counts of whole 16s and an FFN width off the 16-byte grid of 128."""
    cp = _cp()
    rng = np.random.default_rng(13)
    a, b = _mlp_pair(rng, cp, hidden=64, ffn=176)
    seen = _watch_fused(monkeypatch)
    fused, plain = _run_mlps((a, b), cp, rng, ck.float8.replace(scaling=scaling), steps=3, tokens=(3, 48),
                             hidden=64)
    _check_fused(seen, scaling, 3)
    for name, u, v in zip(("y", "dx", "dW gate", "dW up", "dW down"), fused, plain):
        np.testing.assert_array_equal(u, v, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, ck.bfloat16])
@pytest.mark.parametrize("rows,F", [(1, 8), (37, 24), (300, 176), (4096, 512), (5, 3)])
def test_gpu_swiglu_packed_amax(rng, dtype, rows, F):
    """The amax the SwiGLU kernels take in their pass is ck.fp8_amax of what they wrote (poisoned amax buffer)."""
    cp = _cp()
    gu = device_copy(randn(rng, (rows, 2 * F), np.float32, scale=3).astype(dtype))
    dy = device_copy(randn(rng, (rows, F), np.float32).astype(dtype))
    for fn, args in ((ck.swiglu_packed, (gu,)), (ck.swiglu_packed_backward, (gu, dy))):
        am = cp.full((), 123456.0, np.float32)
        out = fn(*args, amax=am)
        assert to_host(am) == to_host(ck.fp8_amax(out)), fn.__name__
        np.testing.assert_array_equal(to_host(out), to_host(fn(*args)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows,F", [(64, 64), (48, 176), (37, 24), (1, 8), (256, 1408), (130, 67)])
@pytest.mark.parametrize("misalign", [False, True])
def test_gpu_fp8_swiglu_quantize_is_the_composition(rng, fmt, rows, F, misalign):
    """q, q^T, the scale and the history of the fused SwiGLU cast equal swiglu_packed + fp8_quantize's, bit for bit,
    over two steps (poisoned outputs: an unwritten byte fails)."""
    cp = _cp()
    gu = device_copy(randn(rng, (rows, 2 * F), np.float32, scale=3).astype(ck.bfloat16), misalign=misalign)
    h1 = ck.fp8_history(ck.swiglu_packed(gu))
    h2 = h1.copy()
    for _ in range(2):
        q0, t0, s0 = ck.fp8_quantize(ck.swiglu_packed(gu), transpose=True, history=h1, dtype=fmt)
        q1, t1, s1 = ck.fp8_swiglu_quantize(gu, h2, dtype=fmt, out=poisoned((rows, F), np.uint8),
                                            out_t=poisoned((F, rows), np.uint8))
        for name, u, v in (("q", q0, q1), ("q_t", t0, t1), ("scale_inv", s0, s1), ("history", h1, h2)):
            np.testing.assert_array_equal(to_host(u), to_host(v), err_msg=name)
        gu = gu * cp.asarray(1.5, dtype=gu.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["current", "hybrid"])
def test_gpu_rms_norm_backward_amax_feeds_the_fp8_linears(scaling, monkeypatch):
    """On the device: a 3-layer FP8 LLaMA (head_dim 64, 128 tokens) whose o_proj / down projections take their
    output gradient's amax from add_rms_norm's backward kernel (6 hand-offs) has the gradients of the run with the
    amax passes, bit for bit (or within the run-to-run difference, times 4, should a kernel of the step not repeat
    itself)."""
    cp = _cp()
    from cukernels.ops import fp8 as o8

    seen = _count_amax_hits(monkeypatch)
    r = ck.float8.replace(scaling=scaling)
    kw = dict(layers=3, hidden=128, ffn=256, heads=2, tokens=(2, 65), vocab=1000)
    on = _llama_fp8_grads(cp, r, **kw)
    assert sum(seen) == 6 and not o8._amax_notes
    seen.clear()
    off = _without_rms_amax(monkeypatch, lambda: _llama_fp8_grads(cp, r, **kw))
    control = _without_rms_amax(monkeypatch, lambda: _llama_fp8_grads(cp, r, **kw))
    assert sum(seen) == 0
    for n, g in on[1].items():
        g, w, c = (np.asarray(a[1][n], np.float64) for a in (on, off, control))
        assert np.isfinite(g).all(), n
        noise = np.abs(c - w).max()
        if noise == 0:
            np.testing.assert_array_equal(g, w, err_msg=n)
        else:
            assert np.abs(g - w).max() <= 4 * noise, (n, np.abs(g - w).max(), noise)
    assert on[0] == off[0] or control[0] != off[0]
