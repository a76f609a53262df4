import math
import warnings

import numpy as np
import pytest

import cukernels as ck
from helpers import DTYPES, TOL, assert_close, device_copy, poisoned, randn, to_host

K = math.sqrt(2.0 / math.pi)


# Independent float64 formulas: sigmoid through tanh (sigmoid(z) = (1 + tanh(z/2)) / 2, no overflow anywhere),
# and GELU exactly as GPT-2 writes it.
def silu64(g):
    return g * 0.5 * (1.0 + np.tanh(0.5 * g))


def swiglu64(g, u):
    return silu64(g) * u


def gelu64(x):
    return 0.5 * x * (1.0 + np.tanh(K * (x + 0.044715 * x**3)))


def central_diff(f, x, h=1e-6):
    """Elementwise derivative of an elementwise float64 function by central differences."""
    return (f(x + h) - f(x - h)) / (2 * h)


# ---------------------------------------------------------------- CPU: the reference against float64 math
@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 5, 130), (0, 4)])
def test_reference_forward_matches_f64(rng, shape):
    g, u = randn(rng, shape, np.float32, 4.0), randn(rng, shape, np.float32)
    y = ck.swiglu(g, u)
    assert y.dtype == np.float32 and y.shape == shape
    np.testing.assert_allclose(y, swiglu64(g.astype(np.float64), u), rtol=1e-6, atol=1e-7)
    x = randn(rng, shape, np.float32, 3.0)
    np.testing.assert_allclose(ck.gelu(x), gelu64(x.astype(np.float64)), rtol=1e-6, atol=1e-7)


def test_reference_bf16_rounds_once(rng):
    g, u = randn(rng, (4, 64), ck.bfloat16, 3.0), randn(rng, (4, 64), ck.bfloat16)
    y = ck.swiglu(g, u)
    assert y.dtype == ck.bfloat16
    ref = swiglu64(g.astype(np.float64), u.astype(np.float64)).astype(ck.bfloat16)
    assert np.array_equal(y.view(np.uint16), ref.view(np.uint16))
    yg = ck.gelu(g)
    assert np.array_equal(yg.view(np.uint16), gelu64(g.astype(np.float64)).astype(ck.bfloat16).view(np.uint16))


def test_reference_swiglu_backward_matches_finite_differences(rng):
    g = rng.standard_normal((5, 9)) * 3
    u = rng.standard_normal((5, 9))
    dy = rng.standard_normal((5, 9))
    f32 = lambda a: a.astype(np.float32)
    dg, du = ck.swiglu_backward(f32(g), f32(u), f32(dy))
    # d/dg and d/du of sum(dy * silu(g) * u), elementwise by central differences at the fp32-rounded inputs
    g32, u32, dy32 = (f32(a).astype(np.float64) for a in (g, u, dy))
    dg_fd = dy32 * u32 * central_diff(silu64, g32)
    du_fd = dy32 * central_diff(lambda v: swiglu64(g32, v), u32)
    np.testing.assert_allclose(dg, dg_fd, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(du, du_fd, rtol=1e-5, atol=1e-6)


def test_reference_gelu_backward_matches_finite_differences(rng):
    x = (rng.standard_normal((6, 11)) * 3).astype(np.float32)
    dy = rng.standard_normal((6, 11)).astype(np.float32)
    fd = dy.astype(np.float64) * central_diff(gelu64, x.astype(np.float64))
    np.testing.assert_allclose(ck.gelu_backward(x, dy), fd, rtol=1e-5, atol=1e-6)


def test_reference_packed_equals_separate(rng):
    g, u = randn(rng, (3, 4, 10), np.float32, 3.0), randn(rng, (3, 4, 10), np.float32)
    gu = np.concatenate([g, u], -1)
    dy = randn(rng, (3, 4, 10), np.float32)
    assert np.array_equal(ck.swiglu_packed(gu), ck.swiglu(g, u))
    dg, du = ck.swiglu_backward(g, u, dy)
    assert np.array_equal(ck.swiglu_packed_backward(gu, dy), np.concatenate([dg, du], -1))


def test_reference_large_inputs_are_finite_and_exact():
    x = np.array([-1e4, -1e3, -100.0, -30.0, 0.0, 30.0, 100.0, 1e3, 1e4], np.float32)
    one = np.ones_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warnings on the reference path either
        y = ck.swiglu(x, one)
        dg, du = ck.swiglu_backward(x, one, one)
        yg, dx = ck.gelu(x), ck.gelu_backward(x, one)
    for a in (y, dg, du, yg, dx):
        assert np.isfinite(a).all()
    assert y[-1] == 1e4 and y[0] == 0 and dg[-1] == 1 and dg[0] == 0
    assert yg[-1] == 1e4 and yg[0] == 0 and dx[-1] == 1 and dx[0] == 0


def test_out_is_used_and_in_place(rng):
    g, u = randn(rng, (3, 8), np.float32), randn(rng, (3, 8), np.float32)
    ref = ck.swiglu(g, u)
    out = np.full_like(g, np.nan)
    assert ck.swiglu(g, u, out=out) is out and np.array_equal(out, ref)
    gi = g.copy()
    assert ck.swiglu(gi, u, out=gi) is gi and np.array_equal(gi, ref)
    gu = np.concatenate([g, u], -1)
    dy = randn(rng, (3, 8), np.float32)
    ref = ck.swiglu_packed_backward(gu, dy)
    assert ck.swiglu_packed_backward(gu, dy, out=gu) is gu and np.array_equal(gu, ref)


# ---------------------------------------------------------------- bad input
_f = lambda *s: np.zeros(s, np.float32)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ck.swiglu(np.zeros(4, np.float64), _f(4)), TypeError, "gate: expected dtype"),
        (lambda: ck.swiglu(_f(4), np.zeros(4, ck.bfloat16)), TypeError, "up: expected dtype float32"),
        (lambda: ck.swiglu(_f(4), _f(5)), ValueError, r"up: expected shape \(4,\) \(the shape of gate\)"),
        (lambda: ck.swiglu(_f(4, 2).T, _f(2, 4)), ValueError, "gate: expected a C-contiguous"),
        (lambda: ck.swiglu(_f(4), _f(4), out=_f(5)), ValueError, r"out: expected shape \(4,\)"),
        (lambda: ck.swiglu(_f(4), [0.0] * 4), TypeError, "up: expected a numpy.ndarray or cupy.ndarray"),
        (lambda: ck.swiglu_backward(_f(4), _f(4), _f(3)), ValueError, "dy: expected shape"),
        (lambda: ck.swiglu_backward(_f(4), _f(4), _f(4), out_dup=np.zeros(4, ck.bfloat16)), TypeError, "out_dup: expected dtype"),
        (lambda: ck.swiglu_packed(_f(3, 5)), ValueError, "gu: the last axis .* even"),
        (lambda: ck.swiglu_packed(_f(3, 0)), ValueError, "gu: the last axis .* nonzero"),
        (lambda: ck.swiglu_packed(_f(3, 8), out=_f(3, 8)), ValueError, r"out: expected shape \(3, 4\)"),
        (lambda: ck.swiglu_packed_backward(_f(3, 8), _f(3, 8)), ValueError, r"dy: expected shape \(3, 4\)"),
        (lambda: ck.gelu(np.zeros(3, np.int32)), TypeError, "x: expected dtype"),
        (lambda: ck.gelu_backward(_f(3), np.zeros(3, ck.bfloat16)), TypeError, "dy: expected dtype float32"),
    ],
)
def test_bad_input_messages(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ---------------------------------------------------------------- GPU: kernel against the reference
SIZES = [1, 3, 127, 1000, 4097, 65537]


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_flat_matches_reference(rng, n, dtype, misalign):
    shape = (n,) if n % 2 else (n // 2, 2)
    g, u, dy = randn(rng, shape, dtype, 4.0), randn(rng, shape, dtype), randn(rng, shape, dtype)
    dev = lambda a: device_copy(a, misalign)
    out = lambda: poisoned(shape, dtype, misalign)
    gd, ud, dyd = dev(g), dev(u), dev(dy)

    o = out()
    assert ck.swiglu(gd, ud, out=o) is o
    assert_close(o, ck.swiglu(g, u), dtype, what="swiglu")
    o1, o2 = out(), out()
    dg, du = ck.swiglu_backward(gd, ud, dyd, out_dgate=o1, out_dup=o2)
    assert dg is o1 and du is o2
    rg, ru = ck.swiglu_backward(g, u, dy)
    assert_close(dg, rg, dtype, what="dgate")
    assert_close(du, ru, dtype, what="dup")
    o = out()
    assert ck.gelu(gd, out=o) is o
    assert_close(o, ck.gelu(g), dtype, what="gelu")
    o = out()
    assert ck.gelu_backward(gd, dyd, out=o) is o
    assert_close(o, ck.gelu_backward(g, dy), dtype, what="gelu dx")


@pytest.mark.gpu
@pytest.mark.parametrize("rows, F", [(1, 1), (3, 5), (199, 64), (7, 1000), (2, 4097), (0, 8), (33, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_packed_matches_reference(rng, rows, F, dtype, misalign):
    gu, dy = randn(rng, (rows, 2 * F), dtype, 3.0), randn(rng, (rows, F), dtype)
    gud, dyd = device_copy(gu, misalign), device_copy(dy, misalign)
    o = poisoned((rows, F), dtype, misalign)
    assert ck.swiglu_packed(gud, out=o) is o
    assert_close(o, ck.swiglu_packed(gu), dtype, what="swiglu_packed")
    o = poisoned((rows, 2 * F), dtype, misalign)
    assert ck.swiglu_packed_backward(gud, dyd, out=o) is o
    ref = ck.swiglu_packed_backward(gu, dy)
    assert_close(o, ref, dtype, what="dgu")
    assert ck.swiglu_packed_backward(gud, dyd, out=gud) is gud  # in place over the forward input
    assert_close(gud, ref, dtype, what="dgu in place")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_large_inputs_are_finite(rng, dtype):
    x = np.concatenate([np.array([-1e4, 1e4, -1e3, 1e3, -88.0, -89.0, 88.0, 0.0], np.float32),
                        (rng.standard_normal(1000) * 100).astype(np.float32)]).astype(dtype)
    one = np.ones_like(x)
    xd, od = device_copy(x), device_copy(one)
    outs = [ck.swiglu(xd, od), *ck.swiglu_backward(xd, od, od), ck.gelu(xd), ck.gelu_backward(xd, od)]
    refs = [ck.swiglu(x, one), *ck.swiglu_backward(x, one, one), ck.gelu(x), ck.gelu_backward(x, one)]
    for name, o, r in zip(["swiglu", "dgate", "dup", "gelu", "gelu dx"], outs, refs):
        h = to_host(o).astype(np.float32)
        assert np.isfinite(h).all(), name
        assert_close(o, r, dtype, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_large_grid_stride_and_in_place(rng, dtype):
    """~9.4 M elements: every thread of a full wave loops 2-3 times; odd size leaves a tail."""
    n = 9 * 2**20 + 7
    g, u = randn(rng, (n,), dtype, 3.0), randn(rng, (n,), dtype)
    gd = device_copy(g)
    assert ck.swiglu(gd, device_copy(u), out=gd) is gd
    assert_close(gd, ck.swiglu(g, u), dtype)
    xd = device_copy(g)
    assert ck.gelu(xd, out=xd) is xd
    assert_close(xd, ck.gelu(g), dtype)


@pytest.mark.gpu
def test_gpu_mixing_numpy_and_cupy_is_a_type_error():
    import cupy as cp

    with pytest.raises(TypeError, match="up: is a numpy array but gate is a cupy array"):
        ck.swiglu(cp.ones(4, cp.float32), np.ones(4, np.float32))


@pytest.mark.gpu
def test_gpu_runs_on_current_stream_and_captures(rng):
    import cupy as cp

    gu = device_copy(randn(rng, (64, 2 * 1024), ck.bfloat16))
    dy = device_copy(randn(rng, (64, 1024), ck.bfloat16))
    y = cp.empty((64, 1024), dtype=ck.bfloat16)
    dgu = cp.empty_like(gu)
    ck.swiglu_packed(gu, out=y)  # compile + warm up outside capture
    ck.swiglu_packed_backward(gu, dy, out=dgu)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.swiglu_packed(gu, out=y)
        ck.swiglu_packed_backward(gu, dy, out=dgu)
        g = s.end_capture()
    y.fill(np.nan)
    dgu.fill(np.nan)
    g.launch(s)
    s.synchronize()
    assert_close(y, ck.swiglu_packed(to_host(gu)), ck.bfloat16)
    assert_close(dgu, ck.swiglu_packed_backward(to_host(gu), to_host(dy)), ck.bfloat16)
