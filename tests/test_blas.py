import numpy as np
import pytest

import cukernels as ck
from helpers import assert_close, device_copy, randn, to_host


def _ref(a, b, ta, tb):
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return np.matmul(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_reference_matches_f64(rng, ta, tb):
    a = randn(rng, (2, 5, 3) if not ta else (2, 3, 5), np.float32)
    b = randn(rng, (3, 4) if not tb else (4, 3), np.float32)
    r = ck.matmul(a, b, trans_a=ta, trans_b=tb)
    np.testing.assert_allclose(r, _ref(a, b, ta, tb), rtol=1e-5, atol=1e-6)


def test_reference_accumulates_with_beta(rng):
    a, b = randn(rng, (4, 6), ck.bfloat16), randn(rng, (6, 5), ck.bfloat16)
    out = randn(rng, (4, 5), np.float32)
    expect = out.astype(np.float64) + _ref(a, b, False, False)
    ck.matmul(a, b, out=out, beta=1.0)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ck.matmul(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32)), ValueError, "inner dimensions"),
        (lambda: ck.matmul(np.ones((2, 3), np.float32), np.ones((3, 5), ck.bfloat16)), TypeError, "b: expected dtype"),
        (lambda: ck.matmul(np.ones((2, 3), np.float32), np.ones((3, 5), np.float32), beta=1.0), ValueError, "out: required"),
        (lambda: ck.matmul(np.ones((2, 2, 3), np.float32), np.ones((3, 3, 5), np.float32)), ValueError, "batch dimensions"),
    ],
)
def test_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.gpu
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("dtype,odt", [(np.float32, np.float32), (ck.bfloat16, ck.bfloat16), (ck.bfloat16, np.float32)])
@pytest.mark.parametrize("batch", [(), (3,), (2, 2)])
def test_gpu_matches_reference(rng, ta, tb, dtype, odt, batch):
    M, K, N = 37, 130, 67
    a = randn(rng, (*batch, *((K, M) if ta else (M, K))), dtype)
    b = randn(rng, (*((N, K) if tb else (K, N)),) if batch == (3,) else (*batch, *((N, K) if tb else (K, N))), dtype)
    ref = _ref(a, b, ta, tb)
    got = ck.matmul(device_copy(a), device_copy(b), trans_a=ta, trans_b=tb, out_dtype=odt)
    assert got.dtype == np.dtype(odt) and got.shape == ref.shape
    tol = 1e-4 if odt == np.float32 else 1e-2
    assert_close(got, ref.astype(np.float32), np.float32, rtol=tol, atol=tol * 4)


@pytest.mark.gpu
def test_gpu_weight_grad_accumulates_into_fp32_and_captures(rng):
    import cupy as cp

    dy, x = randn(rng, (64, 48), ck.bfloat16), randn(rng, (64, 40), ck.bfloat16)
    g0 = randn(rng, (48, 40), np.float32)
    dyd, xd, gd = device_copy(dy), device_copy(x), device_copy(g0)
    ck.matmul(dyd, xd, trans_a=True, out=gd, beta=1.0)  # warm-up / handle creation outside capture
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.matmul(dyd, xd, trans_a=True, out=gd, beta=1.0)
        g = s.end_capture()
    g.launch(s)
    s.synchronize()
    expect = g0.astype(np.float64) + 2 * _ref(dy, x, True, False)
    assert_close(gd, expect.astype(np.float32), np.float32, rtol=1e-4, atol=1e-3)
