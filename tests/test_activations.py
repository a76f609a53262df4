import math
import warnings

import numpy as np
import pytest

import cukernels as ck
from cukernels.ops.activations import _erf64, _erfc64
from helpers import DTYPES, TOL, assert_close, device_copy, poisoned, randn, to_host

K = math.sqrt(2.0 / math.pi)
FORMS = ["tanh", "none"]


# Independent float64 formulas: sigmoid through tanh (sigmoid(z) = (1 + tanh(z/2)) / 2, no overflow anywhere),
# and GELU exactly as GPT-2 writes it.
def silu64(g):
    return g * 0.5 * (1.0 + np.tanh(0.5 * g))


def swiglu64(g, u):
    return silu64(g) * u


def gelu64(x):
    return 0.5 * x * (1.0 + np.tanh(K * (x + 0.044715 * x**3)))


_erf_exact = np.vectorize(math.erf, otypes=[np.float64])  # slow (~0.2 us an element): small arrays only
_erfc_exact = np.vectorize(math.erfc, otypes=[np.float64])


def gelu_erf64(x):
    """The exact GELU with Python's math.erfc: x Phi(x) = 0.5 x erfc(-x / sqrt 2), the same as 0.5 x (1 + erf(x /
    sqrt 2)) without its cancellation for x << 0 (at x = -9.19, 1 + erf is 0 in float64; the GELU is -1.8e-19)."""
    return 0.5 * x * _erfc_exact(-x / math.sqrt(2.0))


GELU64 = {"tanh": gelu64, "none": gelu_erf64}


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
    np.testing.assert_array_equal(ck.gelu(x, approximate="tanh"), ck.gelu(x))  # the default is tanh
    np.testing.assert_allclose(ck.gelu(x, approximate="none"), gelu_erf64(x.astype(np.float64)), rtol=1e-6,
                               atol=1e-7)


def test_reference_bf16_rounds_once(rng):
    g, u = randn(rng, (4, 64), ck.bfloat16, 3.0), randn(rng, (4, 64), ck.bfloat16)
    y = ck.swiglu(g, u)
    assert y.dtype == ck.bfloat16
    ref = swiglu64(g.astype(np.float64), u.astype(np.float64)).astype(ck.bfloat16)
    assert np.array_equal(y.view(np.uint16), ref.view(np.uint16))
    yg = ck.gelu(g)
    assert np.array_equal(yg.view(np.uint16), gelu64(g.astype(np.float64)).astype(ck.bfloat16).view(np.uint16))
    ye = ck.gelu(g, approximate="none")
    assert np.array_equal(ye.view(np.uint16), gelu_erf64(g.astype(np.float64)).astype(ck.bfloat16).view(np.uint16))


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


@pytest.mark.parametrize("form", FORMS)
def test_reference_gelu_backward_matches_finite_differences(rng, form):
    x = (rng.standard_normal((6, 11)) * 3).astype(np.float32)
    dy = rng.standard_normal((6, 11)).astype(np.float32)
    fd = dy.astype(np.float64) * central_diff(GELU64[form], x.astype(np.float64))
    np.testing.assert_allclose(ck.gelu_backward(x, dy, approximate=form), fd, rtol=1e-5, atol=1e-6)


def test_reference_erf_matches_math_erf():
    """The float64 erf / erfc behind the exact GELU's reference, against Python's math.erf / math.erfc at 1e4 points
    over [-28, 28] (both branches, the switch at |x| = 2, the underflow end) plus a few exact points."""
    x = np.concatenate([np.linspace(-28.0, 28.0, 10_000), [0.0, -0.0, 1e-300, -1e-12, 2.0, -2.0,
                                                            np.nextafter(2.0, 0.0), 0.5, 5.0, 26.5]])
    e, c = _erf64(x), _erfc64(x)
    want_e = np.array([math.erf(v) for v in x])
    want_c = np.array([math.erfc(v) for v in x])
    np.testing.assert_allclose(e, want_e, rtol=4e-15, atol=1e-300)  # measured 9e-16
    ok = want_c > 1e-290  # below that erfc is subnormal in float64 (the CPU's too)
    np.testing.assert_allclose(c[ok], want_c[ok], rtol=1e-12)  # measured 1.9e-13
    assert np.all(c[~ok] < 1e-280) and e.shape == x.shape
    assert np.isnan(_erf64(np.array([np.nan]))).all() and _erfc64(np.array([40.0, -40.0])).tolist() == [0.0, 2.0]
    big = np.random.default_rng(0).standard_normal((3, 1000)) * 4  # any shape; the rational tail of math.erf
    np.testing.assert_allclose(_erf64(big), _erf_exact(big), rtol=4e-15, atol=1e-300)


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
        ye, dxe = ck.gelu(x, approximate="none"), ck.gelu_backward(x, one, approximate="none")
        ye_huge = ck.gelu(np.array([-3e38, 3e38], np.float32), approximate="none")
    for a in (y, dg, du, yg, dx, ye, dxe, ye_huge):
        assert np.isfinite(a).all()
    assert y[-1] == 1e4 and y[0] == 0 and dg[-1] == 1 and dg[0] == 0
    assert yg[-1] == 1e4 and yg[0] == 0 and dx[-1] == 1 and dx[0] == 0
    assert ye[-1] == 1e4 and ye[0] == 0 and dxe[-1] == 1 and dxe[0] == 0
    np.testing.assert_array_equal(ye_huge, np.array([0.0, 3e38], np.float32))  # no overflow inside either


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
        (lambda: ck.gelu(_f(3), approximate="exact"), ValueError, "approximate: expected 'tanh' .* or 'none'"),
        (lambda: ck.gelu(_f(3), approximate=None), TypeError, "approximate: expected 'tanh' or 'none'; got NoneType"),
        (lambda: ck.gelu_backward(_f(3), _f(3), approximate="erf"), ValueError, "approximate"),
        (lambda: ck.gelu_backward(_f(3), _f(3), approximate=True), TypeError, "approximate"),
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
    for form in FORMS:
        o = out()
        assert ck.gelu(gd, approximate=form, out=o) is o
        assert_close(o, ck.gelu(g, approximate=form), dtype, what=f"gelu {form}")
        o = out()
        assert ck.gelu_backward(gd, dyd, approximate=form, out=o) is o
        assert_close(o, ck.gelu_backward(g, dy, approximate=form), dtype, what=f"gelu dx {form}")


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
    ex = dict(approximate="none")
    outs = [ck.swiglu(xd, od), *ck.swiglu_backward(xd, od, od), ck.gelu(xd), ck.gelu_backward(xd, od),
            ck.gelu(xd, **ex), ck.gelu_backward(xd, od, **ex)]
    refs = [ck.swiglu(x, one), *ck.swiglu_backward(x, one, one), ck.gelu(x), ck.gelu_backward(x, one),
            ck.gelu(x, **ex), ck.gelu_backward(x, one, **ex)]
    for name, o, r in zip(["swiglu", "dgate", "dup", "gelu", "gelu dx", "gelu erf", "gelu erf dx"], outs, refs):
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
    xd = device_copy(g)
    assert ck.gelu(xd, approximate="none", out=xd) is xd
    assert_close(xd, ck.gelu(g, approximate="none"), dtype)


def _gelu_step_elems(kname, dtype, vec):
    """Elements one grid-stride step of a full-wave GELU kernel covers (the launcher's grid: one wave)."""
    from cukernels import _backend as B
    from cukernels._loader import get_function
    from cukernels.ops._launch import THREADS, UNROLL, wave

    k = get_function("activations", f"{kname}_{B.DTYPE_TAG[np.dtype(dtype)]}_{'v' if vec else 's'}")
    E = 16 // np.dtype(dtype).itemsize if vec else 1
    return wave(k, THREADS) * THREADS * UNROLL * E, E


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_gelu_pipelined_steps(rng, form, dtype, misalign):
    """GELU's software-pipelined loop (run_flat_pipe: step k+1 loaded while step k is computed, the slot halves
    swapping every step): an even number of full steps, an odd number with a partial last step and a scalar
    tail, and one unit short of three steps; forward and backward, out= poisoned, then in place."""
    fname = "gelu_erf" if form == "none" else "gelu"
    S, E = _gelu_step_elems(f"{fname}_fwd", dtype, not misalign)
    Sb, _ = _gelu_step_elems(f"{fname}_bwd", dtype, not misalign)
    sizes = [2 * S, 2 * S + E + 3, 3 * Sb - 1] if form == "tanh" else [2 * S + E + 3]
    for n in sizes:
        x, dy = randn(rng, (n,), dtype, 3.0), randn(rng, (n,), dtype)
        xd, dyd = device_copy(x, misalign), device_copy(dy, misalign)
        y_ref, dx_ref = ck.gelu(x, approximate=form), ck.gelu_backward(x, dy, approximate=form)
        o = poisoned((n,), dtype, misalign)
        assert ck.gelu(xd, approximate=form, out=o) is o
        assert_close(o, y_ref, dtype, what=f"gelu {form} n={n}")
        o = poisoned((n,), dtype, misalign)
        assert ck.gelu_backward(xd, dyd, approximate=form, out=o) is o
        assert_close(o, dx_ref, dtype, what=f"gelu dx {form} n={n}")
        assert ck.gelu_backward(xd, dyd, approximate=form, out=dyd) is dyd  # in place over dy
        assert_close(dyd, dx_ref, dtype, what=f"gelu dx in place {form} n={n}")
        assert ck.gelu(xd, approximate=form, out=xd) is xd
        assert_close(xd, y_ref, dtype, what=f"gelu in place {form} n={n}")


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
    with s:  # the poison on the replay's stream (a legacy-stream fill races a non-blocking stream's replay)
        y.fill(np.nan)
        dgu.fill(np.nan)
        g.launch(s)
    s.synchronize()
    assert_close(y, ck.swiglu_packed(to_host(gu)), ck.bfloat16)
    assert_close(dgu, ck.swiglu_packed_backward(to_host(gu), to_host(dy)), ck.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("form", FORMS)
def test_gpu_gelu_matches_torch(rng, dtype, form):
    """Both forms against torch.nn.functional.gelu(approximate=form) and its autograd gradient on the same inputs
    (|x| up to ~20: both tails). fp32: a few ulp apart (different evaluation orders); bf16: one rounding step."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from cukernels._backend import to_torch

    x = randn(rng, (4097,), dtype, 5.0)
    dy = randn(rng, (4097,), dtype)
    xd, dyd = device_copy(x), device_copy(dy)
    tx = to_torch(xd, torch).clone().requires_grad_(True)
    ty = torch.nn.functional.gelu(tx, approximate=form)
    (tdx,) = torch.autograd.grad(ty, tx, to_torch(dyd, torch))
    y = ck.gelu(xd, approximate=form)
    dx = ck.gelu_backward(xd, dyd, approximate=form)
    tol = (1e-5, 1e-6) if np.dtype(dtype) == np.float32 else TOL[np.dtype(dtype)]
    assert_close(y, ty.detach().float().cpu().numpy(), dtype, *tol, what=f"gelu {form} vs torch")
    assert_close(dx, tdx.float().cpu().numpy(), dtype, *tol, what=f"gelu {form} dx vs torch")
