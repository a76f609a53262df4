import itertools

import numpy as np
import pytest

import cukernels as ck
from helpers import DTYPES, assert_close, device_copy, poisoned, randn, to_host

BF = np.dtype(ck.bfloat16)
F32 = np.dtype(np.float32)


def rne_bf16_bits(f32):
    """Independent fp32 -> bf16 conversion on the bit patterns: round to nearest, ties to even; NaN -> quiet
    NaN 0x7fc0 keeping the sign (what ml_dtypes documents and the kernel implements)."""
    u = np.ascontiguousarray(f32, np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(nan, ((u >> 16) & 0x8000) | 0x7FC0, r).astype(np.uint16)


# Special fp32 bit patterns: signed zeros, subnormals, ties (even down / odd up), just-below/above ties,
# the largest finite (rounds to inf), infinities, NaNs with and without payload, signalling NaNs.
SPECIAL = np.array([
    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x00800000,
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000, 0x3F800000, 0x7F7F8000,
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
    0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F812345, 0x7F808000, 0x477FE000, 0x477FF000,
], dtype=np.uint32).view(np.float32)


# ---------------------------------------------------------------- CPU: reference semantics
def test_cast_reference_is_bit_exact_rne(rng):
    rand = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([SPECIAL, rand])
    y = ck.cast(x, ck.bfloat16)
    assert y.dtype == BF
    assert np.array_equal(y.view(np.uint16), rne_bf16_bits(x))
    # bf16 -> fp32 is exact, every one of the 65536 patterns (NaN payloads kept)
    allb = np.arange(2**16, dtype=np.uint16).view(ck.bfloat16)
    back = ck.cast(allb, np.float32)
    assert np.array_equal(back.view(np.uint32), allb.view(np.uint16).astype(np.uint32) << 16)
    # same dtype: a copy
    c = ck.cast(x, "float32")
    assert c is not x and np.array_equal(c.view(np.uint32), x.view(np.uint32))


def test_add_mul_reference_match_f64(rng):
    a = randn(rng, (7, 33), np.float32)
    b = randn(rng, (7, 33), ck.bfloat16)
    y = ck.add(a, b, alpha=0.25)
    assert y.dtype == F32
    np.testing.assert_allclose(y, a.astype(np.float64) + 0.25 * b.astype(np.float64), rtol=1e-6, atol=1e-7)
    y = ck.add(a, b, dtype=ck.bfloat16)
    assert y.dtype == BF
    np.testing.assert_allclose(y.astype(np.float64), a + b.astype(np.float64), rtol=2**-8, atol=1e-6)
    y = ck.mul(b, a)
    assert y.dtype == BF
    np.testing.assert_allclose(y.astype(np.float64), a * b.astype(np.float64), rtol=2**-8, atol=1e-6)
    bias = randn(rng, (33,), np.float32)
    np.testing.assert_allclose(ck.add(a, bias), a.astype(np.float64) + bias, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ck.mul(a, bias), a.astype(np.float64) * bias, rtol=1e-6, atol=1e-7)


def test_result_dtype_rules_and_in_place(rng):
    a = randn(rng, (4, 8), np.float32)
    b = randn(rng, (4, 8), ck.bfloat16)
    assert ck.add(a, b).dtype == F32 and ck.add(b, a).dtype == BF
    out = np.empty((4, 8), ck.bfloat16)
    assert ck.add(a, b, out=out) is out and out.dtype == BF
    ref = ck.add(a, b, alpha=-1.5)
    ai = a.copy()
    assert ck.add(ai, b, out=ai, alpha=-1.5) is ai and np.array_equal(ai, ref)
    bi = b.copy()
    ref = ck.mul(a, b, dtype=ck.bfloat16)
    assert ck.mul(a, bi, out=bi) is bi and np.array_equal(bi.view(np.uint16), ref.view(np.uint16))


def test_row_chunks_cover_every_row_once(monkeypatch):
    from cukernels.ops import _launch as L

    monkeypatch.setattr(L, "MAX_ROW_UNITS", 10)
    for rows, upr in [(1, 1), (7, 3), (100, 10), (5, 11 - 1), (0, 4)]:
        ch = L.row_chunks(rows, upr, "a")
        assert sum(n for _, n in ch) == rows and all(n * upr <= 10 for _, n in ch)
        assert [r0 for r0, _ in ch] == list(np.cumsum([0] + [n for _, n in ch])[:-1])
    with pytest.raises(ValueError, match="a: a row of 11 units is too long"):
        L.row_chunks(3, 11, "a")


# ---------------------------------------------------------------- bad input
_f = lambda *s: np.zeros(s, np.float32)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ck.add(np.zeros(4, np.float64), _f(4)), TypeError, "a: expected dtype"),
        (lambda: ck.add(_f(4), np.zeros(4, np.int32)), TypeError, "b: expected dtype"),
        (lambda: ck.add(_f(3, 4), _f(3)), ValueError, r"b: expected shape \(3, 4\) .* or \(4,\)"),
        (lambda: ck.mul(_f(3, 4), _f(1, 4)), ValueError, "b: expected shape"),
        (lambda: ck.add(_f(4, 2).T, _f(2, 4)), ValueError, "a: expected a C-contiguous"),
        (lambda: ck.add(_f(4), _f(4), out=np.zeros(4, ck.bfloat16), dtype=np.float32), TypeError, "out: dtype bfloat16 disagrees"),
        (lambda: ck.add(_f(4), _f(4), dtype=np.float16), TypeError, "dtype: expected float32 or bfloat16"),
        (lambda: ck.add(_f(4), _f(4), out=_f(5)), ValueError, r"out: expected shape \(4,\)"),
        (lambda: ck.add(_f(4), _f(4), alpha="x"), TypeError, "alpha: expected a real number"),
        (lambda: ck.cast(_f(4), np.int8), TypeError, "dtype: expected float32 or bfloat16"),
        (lambda: ck.cast(_f(4), "nonsense"), TypeError, "dtype: expected a dtype"),
        (lambda: ck.cast(np.zeros(4, np.float64), np.float32), TypeError, "x: expected dtype"),
        (lambda: ck.cast(_f(4), ck.bfloat16, out=np.zeros(4, np.float32)), TypeError, "out: expected dtype bfloat16"),
    ],
)
def test_bad_input_messages(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ---------------------------------------------------------------- GPU: kernel against the reference (bit for bit)
SIZES = [1, 3, 127, 1000, 4097, 65537]
COMBOS = list(itertools.product(DTYPES, DTYPES, DTYPES))


def _bits(a):
    a = to_host(a)
    return a.view(np.uint16 if a.dtype == BF else np.uint32)


def assert_bits(got, ref, what=""):
    assert to_host(got).dtype == ref.dtype and to_host(got).shape == ref.shape, what
    g, r = _bits(got), _bits(ref)
    bad = np.flatnonzero(g.ravel() != r.ravel())
    assert bad.size == 0, f"{what}: {bad.size} elements differ, first at {bad[:5]}: {g.ravel()[bad[:5]]} vs {r.ravel()[bad[:5]]}"


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("da, db, do", COMBOS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_add_mul_bit_exact(rng, n, da, db, do, misalign):
    a, b = randn(rng, (n,), da, 3.0), randn(rng, (n,), db)
    ad, bd = device_copy(a, misalign), device_copy(b, misalign)
    o = poisoned((n,), do, misalign)
    assert ck.add(ad, bd, out=o, alpha=0.3) is o
    assert_bits(o, ck.add(a, b, dtype=do, alpha=0.3), "add")
    y = ck.mul(ad, bd, dtype=do)
    assert y.dtype == np.dtype(do)
    assert_bits(y, ck.mul(a, b, dtype=do), "mul")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(199, 1000), (5, 127), (3, 4096), (1, 8), (0, 16), (4, 3, 24)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_broadcast_and_in_place(rng, shape, dtype, misalign):
    a = randn(rng, shape, np.float32, 2.0)
    bias = randn(rng, shape[-1:], dtype)
    full = randn(rng, shape, dtype)
    ad = device_copy(a, misalign)
    assert ck.add(ad, device_copy(bias, misalign), out=ad, alpha=-0.5) is ad  # fp32 += bf16 bias, in place
    assert_bits(ad, ck.add(a, bias, alpha=-0.5), "bias add in place")
    y = ck.mul(device_copy(full, misalign), device_copy(bias, misalign))
    assert_bits(y, ck.mul(full, bias), "broadcast mul")
    ad = device_copy(a, misalign)
    assert ck.add(ad, device_copy(full, misalign), out=ad) is ad  # residual add, in place
    assert_bits(ad, ck.add(a, full), "residual add in place")


@pytest.mark.gpu
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_cast_bit_exact_special_values(rng, misalign):
    rand = rng.integers(0, 2**32, 1_000_003, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([SPECIAL, rand])  # includes NaNs with payloads, infinities, ties, subnormals
    o = poisoned(x.shape, ck.bfloat16, misalign)
    assert ck.cast(device_copy(x, misalign), ck.bfloat16, out=o) is o
    assert np.array_equal(_bits(o), rne_bf16_bits(x))
    with np.errstate(invalid="ignore"):
        assert np.array_equal(_bits(o), x.astype(ck.bfloat16).view(np.uint16))  # = ml_dtypes
    allb = np.arange(2**16, dtype=np.uint16).view(ck.bfloat16)
    o = poisoned(allb.shape, np.float32, misalign)
    ck.cast(device_copy(allb, misalign), np.float32, out=o)
    assert np.array_equal(_bits(o), allb.view(np.uint16).astype(np.uint32) << 16)


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("din, dout", list(itertools.product(DTYPES, DTYPES)), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_cast_sizes(rng, n, din, dout, misalign):
    x = randn(rng, (n,), din, 10.0)
    o = poisoned((n,), dout, misalign)
    assert ck.cast(device_copy(x, misalign), dout, out=o) is o
    assert_bits(o, ck.cast(x, dout), "cast")


@pytest.mark.gpu
def test_gpu_large_grid_stride(rng):
    """~9.4 M elements: every thread of a full wave loops 2-3 times; odd size leaves a tail."""
    n = 9 * 2**20 + 7
    a, b = randn(rng, (n,), np.float32), randn(rng, (n,), ck.bfloat16)
    ad = device_copy(a)
    ck.add(ad, device_copy(b), out=ad)
    assert_bits(ad, ck.add(a, b), "add")
    assert_bits(ck.cast(device_copy(a), ck.bfloat16), ck.cast(a, ck.bfloat16), "cast")


@pytest.mark.gpu
def test_gpu_mixing_numpy_and_cupy_is_a_type_error():
    import cupy as cp

    with pytest.raises(TypeError, match="b: is a numpy array but a is a cupy array"):
        ck.add(cp.ones(4, cp.float32), np.ones(4, np.float32))


@pytest.mark.gpu
def test_gpu_runs_on_current_stream_and_captures(rng):
    import cupy as cp

    h = device_copy(randn(rng, (64, 2048), np.float32))
    d = device_copy(randn(rng, (64, 2048), ck.bfloat16))
    h0 = to_host(h)
    y = cp.empty((64, 2048), dtype=ck.bfloat16)
    ck.cast(h, ck.bfloat16, out=y)  # compile + warm up outside capture
    ck.add(cp.empty_like(h), d)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.add(h, d, out=h)
        ck.cast(h, ck.bfloat16, out=y)
        g = s.end_capture()
    y.fill(np.nan)
    cp.cuda.Device().synchronize()  # (the poison ran on the legacy stream: the replay must not race it)
    g.launch(s)
    s.synchronize()
    ref = ck.add(h0, to_host(d))
    assert_bits(h, ref, "add")
    assert_bits(y, ck.cast(ref, ck.bfloat16), "cast")
