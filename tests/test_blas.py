import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import cukernels as ck
from cukernels import blas
from helpers import assert_close, device_copy, poisoned, randn, to_host


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


def _padded_host(a, pad, fill=np.nan):
    """NumPy view of ``a`` [..., R, C] whose rows lie C + pad elements apart, the padding columns set to ``fill``;
    returns (view, wider buffer)."""
    buf = np.full((*a.shape[:-1], a.shape[-1] + pad), fill, dtype=a.dtype)
    v = buf[..., : a.shape[-1]]
    v[...] = a
    return v, buf


def _padding_is_nan(buf, C):
    return bool(np.isnan(to_host(buf)[..., C:].astype(np.float32)).all())


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("dtype,odt", [(np.float32, np.float32), (ck.bfloat16, np.float32), (ck.bfloat16, ck.bfloat16)])
def test_reference_row_strided_equals_contiguous(rng, ta, tb, dtype, odt):
    """Column slices of wider buffers (a, b and out) give the contiguous call's result; the padding stays put."""
    M, K, N = 7, 5, 9
    a = randn(rng, (K, M) if ta else (M, K), dtype)
    b = randn(rng, (N, K) if tb else (K, N), dtype)
    want = ck.matmul(a, b, trans_a=ta, trans_b=tb, out_dtype=odt)
    av, _ = _padded_host(a, 3)
    bv, _ = _padded_host(b, 6)
    ov, obuf = _padded_host(np.zeros((M, N), odt), 7)
    assert not av.flags.c_contiguous and blas.layout_ok(av) and blas.layout_ok(ov)
    assert ck.matmul(av, bv, trans_a=ta, trans_b=tb, out=ov) is ov
    np.testing.assert_array_equal(ov, want)
    assert _padding_is_nan(obuf, N)
    c0 = randn(rng, (M, N), odt)
    ov[...] = c0
    ck.matmul(av, bv, trans_a=ta, trans_b=tb, out=ov, beta=1.0)
    expect = c0.astype(np.float64) + _ref(a, b, ta, tb)
    tol = 1e-5 if np.dtype(odt) == np.float32 else 1e-2
    np.testing.assert_allclose(ov.astype(np.float64), expect, rtol=tol, atol=tol)
    assert _padding_is_nan(obuf, N)


def test_reference_batched_row_strided_and_interleaved_out(rng):
    """A stack of row-strided matrices, a shared 2-D strided weight, and an out that is the [B, M, N] view of a
    [M, B, N] buffer (row i of every batch entry side by side) are all taken as they are."""
    Bn, M, K, N = 3, 4, 6, 5
    a = randn(rng, (Bn, M, K), np.float32)
    w = randn(rng, (K, N), np.float32)
    av, _ = _padded_host(a, 2)
    wv, _ = _padded_host(w, 3)
    obuf = np.full((M, Bn, N), np.nan, np.float32)
    ov = obuf.transpose(1, 0, 2)
    assert blas.layout_ok(ov) and not ov.flags.c_contiguous
    ck.matmul(av, wv, out=ov)
    np.testing.assert_allclose(ov, _ref(a, w, False, False), rtol=1e-5, atol=1e-6)
    # a slice of whole matrices out of a bigger stack: one batch stride of 2 matrices
    big = randn(rng, (2 * Bn, M, K), np.float32)
    r = ck.matmul(big[::2], w)
    np.testing.assert_allclose(r, _ref(big[::2], w, False, False), rtol=1e-5, atol=1e-6)


def test_reference_k0_zeroes_only_the_strided_view():
    a = np.zeros((3, 0), np.float32)
    b = np.zeros((0, 4), np.float32)
    ov, obuf = _padded_host(np.ones((3, 4), np.float32), 2)
    ck.matmul(a, b, out=ov)
    assert not ov.any() and _padding_is_nan(obuf, 4)


def test_empty_padded_layout():
    z = blas.empty_padded((5, 50257), ck.bfloat16, xp=np)
    assert z.shape == (5, 50257) and z.dtype == ck.bfloat16
    assert z.strides == (50304 * 2, 2) and blas.layout_ok(z)
    z = blas.empty_padded((2, 3, 7), np.float32, xp=np, multiple=4)
    assert z.shape == (2, 3, 7) and z.strides == (3 * 8 * 4, 8 * 4, 4) and blas.layout_ok(z)
    assert blas.empty_padded(64, np.float32, xp=np).shape == (64,)
    with pytest.raises(ValueError, match="multiple"):
        blas.empty_padded((2, 3), np.float32, xp=np, multiple=0)
    with pytest.raises(TypeError, match="shape"):
        blas.empty_padded((2, 3.0), np.float32, xp=np)


_F = np.float32


def _as(a, shape, strides, writeable=True):
    return as_strided(a, shape=shape, strides=strides, writeable=writeable)


@pytest.mark.parametrize(
    "make, match",
    [
        # a transposed view: its last axis is not contiguous
        (lambda: ck.matmul(np.ones((3, 2), _F).T, np.ones((3, 4), _F)), r"a: the last axis must be contiguous.*trans_a"),
        (lambda: ck.matmul(np.ones((2, 3), _F), np.ones((4, 3), _F).T), r"b: the last axis must be contiguous"),
        (lambda: ck.matmul(np.ones((2, 3), _F), np.ones((3, 4), _F), out=np.ones((4, 2), _F).T),
         r"out: the last axis must be contiguous"),
        # reversed rows (negative stride)
        (lambda: ck.matmul(np.ones((2, 3), _F)[::-1], np.ones((3, 4), _F)), r"a: the row stride must be a non-negative"),
        # rows that overlap (stride shorter than a row)
        (lambda: ck.matmul(_as(np.ones(20, _F), (3, 4), (8, 4)), np.ones((4, 2), _F)), r"a: rows overlap"),
        # a row stride that is no multiple of the element size
        (lambda: ck.matmul(_as(np.ones(40, _F), (3, 4), (18, 4)), np.ones((4, 2), _F)), r"a: the row stride must be"),
        # batch axes that one stride cannot walk: the first 3 of 6 matrices of each of 2 groups
        (lambda: ck.matmul(np.ones((2, 6, 2, 3), _F)[:, :3], np.ones((3, 4), _F)), r"a: the batch axes are not walked"),
        # out batch entries that share elements
        (lambda: ck.matmul(np.ones((3, 2, 3), _F), np.ones((3, 4), _F), out=_as(np.zeros(8, _F), (3, 2, 4), (0, 16, 4))),
         r"out: batch entries overlap"),
        (lambda: ck.matmul(np.ones((2, 3), _F), np.ones((3, 4), _F), out=_as(np.zeros(8, _F), (2, 4), (16, 4), False)),
         r"out: is read-only"),
    ],
)
def test_layout_refusals(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_layout_ok():
    x = np.ones((4, 6), _F)
    assert blas.layout_ok(x) and blas.layout_ok(x[:, :5]) and blas.layout_ok(x[1:3, 2:])
    assert not blas.layout_ok(x.T) and not blas.layout_ok(x[:, ::2]) and not blas.layout_ok(x[::-1])
    assert blas.layout_ok(x[:1, ::2][:, :1])  # one element: strides are meaningless
    assert not blas.layout_ok(np.ones(4, _F)) and blas.layout_ok(np.ones((2, 3, 4), _F)[:, :, :2])


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


# ---------------------------------------------------------------- GPU: row-strided operands and outputs
def _strided_dev(a, pad, misalign=False):
    """Device view of host ``a`` [..., R, C] whose rows lie C + pad elements apart inside a NaN-filled buffer
    (cuBLAS reading a padding column would poison the product); ``misalign`` puts the base one element past a
    256-byte boundary. Returns (view, buffer)."""
    import cupy as cp

    lead, C = a.shape[:-1], a.shape[-1]
    n = int(np.prod(lead)) * (C + pad)
    flat = cp.empty(n + int(misalign), dtype=a.dtype)
    flat.fill(np.nan)
    buf = (flat[1:] if misalign else flat).reshape(*lead, C + pad)
    v = buf[..., :C]
    v[...] = cp.asarray(a)
    return v, buf


LAYOUTS = {"pad64": (None, False), "odd": (3, False), "misaligned": (5, True)}


def _pad(kind, C):
    p, mis = LAYOUTS[kind]
    return ((-C) % 64 or 64) if p is None else p, mis


@pytest.mark.gpu
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("dtype,odt", [(np.float32, np.float32), (ck.bfloat16, ck.bfloat16), (ck.bfloat16, np.float32)])
@pytest.mark.parametrize("which", ["a", "b", "out", "all"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_row_strided_matches_reference(rng, ta, tb, dtype, odt, which, layout):
    """lda / ldb / ldc = the row stride: vs the float64 product, poisoned (NaN) output and padding, odd M/N/K, then
    beta = 1 accumulating into the strided output; the padding columns must stay NaN throughout."""
    M, K, N = 37, 131, 67
    a = randn(rng, (K, M) if ta else (M, K), dtype)
    b = randn(rng, (N, K) if tb else (K, N), dtype)
    ref = _ref(a, b, ta, tb)
    ad = _strided_dev(a, *_pad(layout, a.shape[1]))[0] if which in ("a", "all") else device_copy(a)
    bd = _strided_dev(b, *_pad(layout, b.shape[1]))[0] if which in ("b", "all") else device_copy(b)
    if which in ("out", "all"):
        p, mis = _pad(layout, N)
        out, obuf = _strided_dev(np.full((M, N), np.nan, odt), p, mis)  # the product's own region poisoned too
    else:
        out, obuf = poisoned((M, N), odt), None
    got = ck.matmul(ad, bd, trans_a=ta, trans_b=tb, out=out)
    assert got is out
    tol = 1e-4 if np.dtype(odt) == np.float32 else 1e-2
    assert_close(out, ref.astype(np.float32), np.float32, rtol=tol, atol=tol * 4, what="beta=0")
    if obuf is not None:
        assert _padding_is_nan(obuf, N), "a padding column of out was written"
    c0 = randn(rng, (M, N), odt)
    out[...] = device_copy(c0)
    ck.matmul(ad, bd, trans_a=ta, trans_b=tb, out=out, beta=1.0, alpha=0.5)
    expect = c0.astype(np.float64) + 0.5 * ref
    assert_close(out, expect.astype(np.float32), np.float32, rtol=tol, atol=tol * 4, what="beta=1")
    if obuf is not None:
        assert _padding_is_nan(obuf, N), "a padding column of out was written (beta=1)"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,odt", [(np.float32, np.float32), (ck.bfloat16, np.float32)])
def test_gpu_batched_row_strided(rng, dtype, odt):
    """Strided batch: a stack of row-strided matrices x a shared 2-D strided weight into an out that is the
    [B, M, N] view of a [M, B, N] buffer (interleaved rows), and a slice of every other matrix of a stack."""
    import cupy as cp

    Bn, M, K, N = 3, 29, 70, 45
    a = randn(rng, (Bn, M, K), dtype)
    w = randn(rng, (N, K), dtype)
    ad, _ = _strided_dev(a, 10)
    wd, _ = _strided_dev(w, 3)
    obuf = cp.empty((M, Bn, N + 4), dtype=odt)
    obuf.fill(np.nan)
    out = obuf[:, :, :N].transpose(1, 0, 2)
    ck.matmul(ad, wd, trans_b=True, out=out)
    tol = 1e-4
    assert_close(out, _ref(a, w, False, True).astype(np.float32), np.float32, rtol=tol, atol=4 * tol)
    assert _padding_is_nan(obuf, N)
    big = randn(rng, (2 * Bn, K, M), dtype)
    got = ck.matmul(device_copy(big)[1::2], wd, trans_a=True, trans_b=True, out_dtype=odt)
    assert_close(got, _ref(big[1::2], w, True, True).astype(np.float32), np.float32, rtol=tol, atol=4 * tol)


@pytest.mark.gpu
def test_gpu_lm_head_inside_padded_rows(rng):
    """GPT-2's LM head with V = 50257 kept and the logits rows 50304 apart (empty_padded): logits = x W^T (odd N,
    ldc 50304), dx = dlogits W (odd K = 50257, lda 50304), dW += dlogits^T x (fp32, beta = 1, odd M); the
    padding columns are NaN and must neither be read nor written."""
    import cupy as cp

    Nr, H, V = 203, 768, 50257
    x = randn(rng, (Nr, H), ck.bfloat16)
    w = randn(rng, (V, H), ck.bfloat16, scale=H ** -0.5)
    xd, wd = device_copy(x), device_copy(w)
    z = blas.empty_padded((Nr, V), ck.bfloat16, xp=cp)
    full = z.base  # the [Nr, 50304] buffer z is the first V columns of
    assert z.strides == (50304 * 2, 2) and full.shape == (Nr, 50304)
    full.fill(np.nan)  # the product's region too: an unwritten logit fails
    assert ck.matmul(xd, wd, trans_b=True, out=z) is z
    assert_close(z, _ref(x, w, False, True).astype(np.float32), np.float32, rtol=1e-2, atol=2e-2, what="logits")
    assert _padding_is_nan(full, V), "the logits GEMM wrote a padding column"
    dl = randn(rng, (Nr, V), ck.bfloat16, scale=V ** -0.5)
    z[...] = device_copy(dl)
    dx = ck.matmul(z, wd)
    assert_close(dx, _ref(dl, w, False, False).astype(np.float32), np.float32, rtol=1e-2, atol=2e-3, what="dx")
    g0 = randn(rng, (V, H), np.float32)
    gd = device_copy(g0)
    ck.matmul(z, xd, trans_a=True, out=gd, beta=1.0)
    expect = g0.astype(np.float64) + _ref(dl, x, True, False)
    assert_close(gd, expect.astype(np.float32), np.float32, rtol=1e-4, atol=1e-3, what="dW")
    assert _padding_is_nan(full, V)


@pytest.mark.gpu
def test_gpu_k0_and_capture_with_strided_out(rng):
    import cupy as cp

    out, obuf = _strided_dev(np.ones((5, 6), np.float32), 2)
    ck.matmul(cp.zeros((5, 0), cp.float32), cp.zeros((0, 6), cp.float32), out=out)
    assert not to_host(out).any() and _padding_is_nan(obuf, 6)
    a = randn(rng, (48, 40), ck.bfloat16)
    b = randn(rng, (33, 40), ck.bfloat16)
    ad, _ = _strided_dev(a, 8)
    bd, _ = _strided_dev(b, 24)
    g, gbuf = _strided_dev(np.zeros((48, 33), np.float32), 31)
    ck.matmul(ad, bd, trans_b=True, out=g, beta=1.0)  # warm-up outside the capture
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.matmul(ad, bd, trans_b=True, out=g, beta=1.0)
        graph = s.end_capture()
    graph.launch(s)
    s.synchronize()
    assert_close(g, (2 * _ref(a, b, False, True)).astype(np.float32), np.float32, rtol=1e-4, atol=1e-3)
    assert _padding_is_nan(gbuf, 33)
