"""Dropout (kernels_cu/dropout.cu, cukernels/ops/dropout.py): the Philox4x32-10 reference against the published
known answers, mask statistics, gradients, and the kernels against the reference bit for bit."""
import itertools
import math

import numpy as np
import pytest

import cukernels as ck
from cukernels.ops import dropout as D
from cukernels.ops.dropout import dropout, dropout_add, dropout_backward, keep_mask, philox4x32, philox_bits
from helpers import DTYPES, assert_close, device_copy, poisoned, randn, to_host

BF = np.dtype(ck.bfloat16)
F32 = np.dtype(np.float32)
# seed / offset with both 32-bit halves non-zero, so a swapped or dropped high word shows.
SEED = 0x9E3779B97F4A7C15
OFFSET = 0x00000003_DEADBEEF

# Random123 (github.com/DEShawResearch/random123) tests/kat_vectors, the philox4x32 lines:
# rounds, counter c0..c3, key k0 k1, expected output words.
KAT = [
    (10, [0x00000000] * 4, [0x00000000] * 2, [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    (10, [0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    (10, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    (7, [0x00000000] * 4, [0x00000000] * 2, [0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48]),
    (7, [0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662]),
    (7, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A]),
]


def _philox_scalar(ctr, key, rounds=10):
    """A second, independent Philox4x32: plain Python ints, one counter, key bumped *after* each round (the
    kernel's order; the vectorised reference bumps before rounds 2..R, Random123's)."""
    c, (k0, k1) = list(ctr), key
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


def _band(n, q, sigmas=5.0):
    """Binomial(n, q) count: mean and a sigmas-wide half band."""
    return n * q, sigmas * math.sqrt(n * q * (1 - q))


# ---------------------------------------------------------------- CPU: the generator
@pytest.mark.parametrize("rounds, ctr, key, want", KAT)
def test_philox_known_answers(rounds, ctr, key, want):
    got = philox4x32(np.array(ctr, np.uint32), np.array(key, np.uint32), rounds=rounds)
    assert got.dtype == np.uint32
    assert [int(v) for v in got] == want
    assert _philox_scalar(ctr, key, rounds) == want


def test_philox_vectorised_equals_scalar(rng):
    ctr = rng.integers(0, 2**32, (257, 4), dtype=np.uint64)
    key = rng.integers(0, 2**32, (257, 2), dtype=np.uint64)
    got = philox4x32(ctr, key)
    for i in range(ctr.shape[0]):
        assert [int(v) for v in got[i]] == _philox_scalar([int(v) for v in ctr[i]], [int(v) for v in key[i]])
    # one key broadcast over many counters
    got = philox4x32(ctr, key[0])
    assert [int(v) for v in got[5]] == _philox_scalar([int(v) for v in ctr[5]], [int(v) for v in key[0]])


def test_counter_layout():
    """Element i is word i % 4 of Philox(counter = (i//4 lo, i//4 hi, offset lo, offset hi), key = seed)."""
    bits = philox_bits(4 * 9 + 3, SEED, OFFSET)
    for i in [0, 1, 2, 3, 4, 17, 38]:
        g = i // 4
        w = _philox_scalar([g & 0xFFFFFFFF, g >> 32, OFFSET & 0xFFFFFFFF, OFFSET >> 32],
                           [SEED & 0xFFFFFFFF, SEED >> 32])
        assert int(bits[i]) == w[i % 4], i
    # past 2^34 elements the group index has a high word (c1 != 0); `start` reads a window anywhere
    start = 4 * 2**32 + 6
    win = philox_bits(5, SEED, OFFSET, start=start)
    for j in range(5):
        i = start + j
        g = i // 4
        w = _philox_scalar([g & 0xFFFFFFFF, g >> 32, OFFSET & 0xFFFFFFFF, OFFSET >> 32],
                           [SEED & 0xFFFFFFFF, SEED >> 32])
        assert int(win[j]) == w[i % 4]
    # windows agree with the whole, across chunk boundaries of the NumPy path
    whole = philox_bits(3 * D._CHUNK * 4 // 2 + 7, 1, 2)
    assert np.array_equal(philox_bits(4 * D._CHUNK + 9, 1, 2, start=3), whole[3:4 * D._CHUNK + 12])


_HOST_SHIM = """#include <cstdio>
#include <cstdlib>
#define __device__
#define __forceinline__ inline
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return (unsigned int)(((unsigned long long)a * b) >> 32);
}
"""
_HOST_MAIN = r"""
int main(int argc, char** argv) {
  const unsigned int kat[3][6] = {{0, 0, 0, 0, 0, 0},
                                  {~0u, ~0u, ~0u, ~0u, ~0u, ~0u},
                                  {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u}};
  for (int t = 0; t < 3; ++t) {
    PhiloxKey k;
    k.init(kat[t][4], kat[t][5]);
    const Philox4 r = philox4x32_10(kat[t][0], kat[t][1], kat[t][2], kat[t][3], k);
    printf("%08x %08x %08x %08x\n", r.x, r.y, r.z, r.w);
  }
  const unsigned long long seed = strtoull(argv[1], 0, 0), off = strtoull(argv[2], 0, 0);
  const long long n = atoll(argv[4]);
  const DropRng g = make_rng(nullptr, seed, nullptr, off, (unsigned int)strtoul(argv[3], 0, 0), 1.f);
  for (long long j = 0; j < n / 8; ++j) {  // the bf16 vector path: units of 8, then the tail one by one
    bool kp[8];
    g.keep<8>(j * 8, kp);
    for (int i = 0; i < 8; ++i) putchar(kp[i] ? '1' : '0');
  }
  for (long long c = n / 8 * 8; c < n; ++c) {
    bool kp[1];
    g.keep<1>(c, kp);
    putchar(kp[0] ? '1' : '0');
  }
  putchar('\n');
  for (long long j = 0; j < n / 4; ++j) {  // the fp32 vector and the scalar paths: units of 4
    bool kp[4];
    g.keep<4>(j * 4, kp);
    for (int i = 0; i < 4; ++i) putchar(kp[i] ? '1' : '0');
  }
  for (long long c = n / 4 * 4; c < n; ++c) {
    bool kp[1];
    g.keep<1>(c, kp);
    putchar(kp[0] ? '1' : '0');
  }
  putchar('\n');
  for (long long c = 0; c < n; ++c) {  // every element through the one-by-one (tail) path
    bool kp[1];
    g.keep<1>(c, kp);
    putchar(kp[0] ? '1' : '0');
  }
  putchar('\n');
  // the device-memory path of make_rng: the values behind the pointers win
  const unsigned long long s2 = seed ^ 1, o2 = off + 1;
  const DropRng h = make_rng(&s2, 0, &o2, 0, 0, 1.f);
  const Philox4 r = h.group(5);
  PhiloxKey k;
  k.init((unsigned int)s2, (unsigned int)(s2 >> 32));
  const Philox4 e = philox4x32_10(5, 0, (unsigned int)o2, (unsigned int)(o2 >> 32), k);
  printf("%d\n", r.x == e.x && r.y == e.y && r.z == e.z && r.w == e.w);
  return 0;
}
"""


def test_kernel_generator_compiled_for_the_host(tmp_path):
    """The generator section of kernels_cu/dropout.cu (Philox, key schedule, keep() for units of 8, 4 and 1)
    compiled with the host C++ compiler: the known answers, and the NumPy reference's masks, bit for bit."""
    import shutil
    import subprocess

    from cukernels import _loader

    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = (_loader.kernel_dir() / "dropout.cu").read_text()
    body = src[src.index("// ---- generator begin"):src.index("// ---- generator end")]
    (tmp_path / "gen.cpp").write_text(_HOST_SHIM + body + _HOST_MAIN)
    subprocess.run([cxx, "-std=c++17", "-O1", "-o", str(tmp_path / "gen"), str(tmp_path / "gen.cpp")], check=True)
    p, n = 0.3, 4095  # tails of 7 (units of 8) and 3 (units of 4) elements
    lines = subprocess.run([str(tmp_path / "gen"), str(SEED), str(OFFSET), str(D.keep_threshold(p)), str(n)],
                           check=True, capture_output=True, text=True).stdout.splitlines()
    for line, (_, _, _, want) in zip(lines[:3], KAT[:3]):
        assert [int(w, 16) for w in line.split()] == want
    ref = "".join("1" if k else "0" for k in keep_mask((n,), p, seed=SEED, offset=OFFSET))
    assert lines[3] == ref, "units of 8 + tail"
    assert lines[4] == ref, "units of 4 + tail"
    assert lines[5] == ref, "one by one"
    assert lines[6] == "1", "make_rng reads seed and offset through the pointers"


def test_keep_threshold():
    assert D.keep_threshold(0.0) == 0
    assert D.keep_threshold(0.5) == 2**31
    assert D.keep_threshold(0.1) == round(0.1 * 2**32)
    assert D.keep_threshold(1 - 2**-40) == 2**32 - 1  # rounds to 2^32: clamped, the compare stays 32-bit


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_fraction_is_binomial(p):
    n = (1 << 20) + 3
    for seed, offset in [(SEED, OFFSET), (0, 0), (1, 0), (0, 1)]:
        kept = int(keep_mask((n,), p, seed=seed, offset=offset).sum())
        mu, half = _band(n, 1 - p)
        assert abs(kept - mu) <= half, (seed, offset, kept, mu, half)


def test_draws_are_uniform():
    """Each of the 32 bits is set half the time, and the top 4 bits fill 16 bins evenly (5-sigma bands)."""
    n = 1 << 20
    u = philox_bits(n, SEED, OFFSET)
    mu, half = _band(n, 0.5)
    for b in range(32):
        assert abs(int(((u >> np.uint32(b)) & np.uint32(1)).sum()) - mu) <= half, b
    counts = np.bincount(u >> np.uint32(28), minlength=16)
    mu, half = _band(n, 1 / 16)
    assert np.all(np.abs(counts - mu) <= half), counts


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mean_is_preserved(rng, p):
    n = 1 << 20
    x = (1.0 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    y = dropout(x, p, seed=SEED, offset=OFFSET)
    diff = y.astype(np.float64) - x
    # E[y] = E[x]: the mean difference is within 5 standard errors of 0
    assert abs(diff.mean()) <= 5 * diff.std() / math.sqrt(n)
    kept = y != 0
    np.testing.assert_array_equal(kept, keep_mask(x.shape, p, seed=SEED, offset=OFFSET))
    np.testing.assert_allclose(y[kept], x[kept].astype(np.float64) / (1 - p), rtol=2**-22)


@pytest.mark.parametrize("din, dout", list(itertools.product(DTYPES, DTYPES)), ids=lambda d: np.dtype(d).name)
def test_forward_formula(rng, din, dout):
    x = randn(rng, (37, 29), din, 3.0)
    p = 0.3
    y = dropout(x, p, seed=7, offset=9, dtype=dout)
    assert y.dtype == np.dtype(dout) and y.shape == x.shape
    m = keep_mask(x.shape, p, seed=7, offset=9)
    ref = np.where(m, x.astype(np.float32) * np.float32(1 / (1 - p)), np.float32(0)).astype(dout)
    assert np.array_equal(y.view(np.uint8), ref.view(np.uint8))
    np.testing.assert_allclose(y.astype(np.float64), np.where(m, x.astype(np.float64) / (1 - p), 0),
                               rtol=2**-7 if np.dtype(dout) == BF else 2**-22)


def test_backward_is_the_adjoint(rng):
    """Dropout is linear for a fixed mask: dx = dy * mask / (1 - p), and <dropout(x), dy> = <x, dx>."""
    shape, p = (64, 100), 0.25
    x = randn(rng, shape, np.float32)
    dy = randn(rng, shape, np.float32)
    y = dropout(x, p, seed=SEED, offset=OFFSET)
    dx = dropout_backward(dy, p, seed=SEED, offset=OFFSET)
    m = keep_mask(shape, p, seed=SEED, offset=OFFSET)
    np.testing.assert_allclose(dx, dy.astype(np.float64) * m / (1 - p), rtol=2**-22, atol=0)
    lhs = float((y.astype(np.float64) * dy).sum())
    rhs = float((x.astype(np.float64) * dx).sum())
    assert abs(lhs - rhs) <= 1e-5 * (abs(lhs) + abs(rhs) + 1)
    # finite differences along a random direction: f(x) = <dropout(x), dy> is linear, slope <v, dx>
    v = randn(rng, shape, np.float32)
    h = 1e-2
    f = lambda z: float((dropout(z, p, seed=SEED, offset=OFFSET).astype(np.float64) * dy).sum())  # noqa: E731
    fd = (f((x + h * v).astype(np.float32)) - f((x - h * v).astype(np.float32))) / (2 * h)
    assert abs(fd - float((v.astype(np.float64) * dx).sum())) <= 1e-3 * (abs(fd) + 1)
    # bf16 gradient from an fp32 dy (dtype=)
    dxb = dropout_backward(dy, p, seed=SEED, offset=OFFSET, dtype=ck.bfloat16)
    assert dxb.dtype == BF and np.array_equal(dxb.view(np.uint16), dx.astype(ck.bfloat16).view(np.uint16))


def test_same_seed_offset_same_mask_and_others_differ(rng):
    n, p = 1 << 16, 0.5
    base = keep_mask((n,), p, seed=SEED, offset=OFFSET)
    assert np.array_equal(base, keep_mask((n,), p, seed=SEED, offset=OFFSET))
    x = randn(rng, (n,), np.float32) + 4.0  # never 0, so y == 0 exactly where dropped
    assert np.array_equal(dropout(x, p, seed=SEED, offset=OFFSET) != 0, base)
    q = p * p + (1 - p) * (1 - p)  # P(two independent masks agree at an element)
    mu, half = _band(n, q)
    for seed, offset in [(SEED, OFFSET + 1), (SEED + 1, OFFSET), (SEED, OFFSET + 2**32), (SEED ^ 2**63, OFFSET)]:
        other = keep_mask((n,), p, seed=seed, offset=offset)
        agree = int((other == base).sum())
        assert abs(agree - mu) <= half, (seed, offset, agree)


def test_mask_depends_on_the_flat_index_only(rng):
    x = randn(rng, (6, 7, 5), np.float32)
    y = dropout(x, 0.4, seed=3, offset=4)
    assert np.array_equal(y.reshape(-1), dropout(x.reshape(-1), 0.4, seed=3, offset=4))
    # a prefix of a longer array gets the same mask (no dependence on n)
    long = keep_mask((1000,), 0.4, seed=3, offset=4)
    assert np.array_equal(keep_mask((210,), 0.4, seed=3, offset=4), long[:210])


def test_dropout_add_is_residual_plus_dropout(rng):
    shape, p = (33, 65), 0.2
    x, r = randn(rng, shape, np.float32), randn(rng, shape, np.float32)
    s = dropout_add(x, r, p, seed=SEED, offset=OFFSET)
    ref = r + dropout(x, p, seed=SEED, offset=OFFSET)
    assert s.dtype == F32 and np.array_equal(s.view(np.uint32), ref.view(np.uint32))  # fp32: bit for bit
    # bf16 branch into an fp32 residual, in place
    xb = x.astype(ck.bfloat16)
    h = r.copy()
    assert dropout_add(xb, h, p, seed=SEED, offset=OFFSET, out=h) is h
    ref = r + dropout(xb, p, seed=SEED, offset=OFFSET, dtype=np.float32)
    assert np.array_equal(h.view(np.uint32), ref.view(np.uint32))
    # bf16 output: the fp32 sum rounded once
    rb = r.astype(ck.bfloat16)
    s = dropout_add(xb, rb, p, seed=SEED, offset=OFFSET)
    assert s.dtype == BF
    ref32 = rb.astype(np.float32) + dropout(xb, p, seed=SEED, offset=OFFSET, dtype=np.float32)
    assert np.array_equal(s.view(np.uint16), ref32.astype(ck.bfloat16).view(np.uint16))


def test_p_zero_is_a_copy(rng):
    x = randn(rng, (5, 9), ck.bfloat16)
    y = dropout(x, 0.0, seed=1)
    assert y is not x and np.array_equal(y.view(np.uint16), x.view(np.uint16))
    out = np.empty((5, 9), np.float32)
    assert dropout(x, 0, seed=1, out=out) is out and np.array_equal(out, x.astype(np.float32))


def test_p_near_one(rng):
    n = 1 << 16
    x = np.ones(n, np.float32)
    p = 1 - 2**-10
    y = dropout(x, p, seed=SEED, offset=OFFSET)
    kept = int((y != 0).sum())
    mu, half = _band(n, 2**-10)
    assert abs(kept - mu) <= half
    assert np.all(y[y != 0] == np.float32(1 / (1 - p)))  # 1024, finite
    assert np.all(np.isfinite(dropout(x, 1 - 2**-40, seed=1)))  # threshold clamped, scale 2^40


def test_seed_and_offset_as_0d_arrays(rng):
    x = randn(rng, (1000,), np.float32)
    ref = dropout(x, 0.3, seed=SEED, offset=OFFSET)
    for s, o in [(np.array(SEED, np.uint64), np.array(OFFSET, np.uint64)),
                 (np.array(SEED, np.uint64).view(np.int64), np.array(OFFSET, np.int64)),
                 (np.uint64(SEED), np.int64(OFFSET))]:
        assert np.array_equal(dropout(x, 0.3, seed=s, offset=o), ref)
    # an int64 -1 is the 64-bit pattern 2^64 - 1
    assert np.array_equal(dropout(x, 0.3, seed=np.array(-1, np.int64)), dropout(x, 0.3, seed=2**64 - 1))


def test_empty_and_0d(rng):
    assert dropout(np.zeros((0, 8), np.float32), 0.5, seed=1).shape == (0, 8)
    x = np.array(2.0, np.float32)
    y = dropout(x, 0.5, seed=1, offset=0)
    assert y.shape == () and float(y) in (0.0, 4.0)
    assert float(y) == (4.0 if keep_mask((), 0.5, seed=1) else 0.0)


# ---------------------------------------------------------------- bad input
_f = lambda *s: np.zeros(s, np.float32)  # noqa: E731


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: dropout(_f(4), 1.0, seed=1), ValueError, r"p: expected a finite number in \[0, 1\)"),
        (lambda: dropout(_f(4), -0.1, seed=1), ValueError, "p: expected a finite number"),
        (lambda: dropout(_f(4), float("nan"), seed=1), ValueError, "p: expected a finite number"),
        (lambda: dropout(_f(4), float("inf"), seed=1), ValueError, "p: expected a finite number"),
        (lambda: dropout(_f(4), "0.1", seed=1), TypeError, "p: expected a number"),
        (lambda: dropout(_f(4), True, seed=1), TypeError, "p: expected a number"),
        (lambda: dropout(_f(4), 0.1), TypeError, "seed"),
        (lambda: dropout(_f(4), 0.1, seed=-1), ValueError, r"seed: expected an int in \[0, 2\*\*64\)"),
        (lambda: dropout(_f(4), 0.1, seed=2**64), ValueError, "seed: expected an int"),
        (lambda: dropout(_f(4), 0.1, seed=1.5), TypeError, "seed: expected an int"),
        (lambda: dropout(_f(4), 0.1, seed=True), TypeError, "seed: expected an int"),
        (lambda: dropout(_f(4), 0.1, seed=1, offset=-3), ValueError, "offset: expected an int"),
        (lambda: dropout(_f(4), 0.1, seed=np.array(1, np.int32)), TypeError, "seed: expected dtype uint64, int64"),
        (lambda: dropout(_f(4), 0.1, seed=1, offset=np.zeros(1, np.uint64)), ValueError, "offset: expected a 0-d"),
        (lambda: dropout(np.zeros(4, np.float64), 0.1, seed=1), TypeError, "x: expected dtype"),
        (lambda: dropout(_f(4, 2).T, 0.1, seed=1), ValueError, "x: expected a C-contiguous"),
        (lambda: dropout(_f(4), 0.1, seed=1, out=_f(5)), ValueError, r"out: expected shape \(4,\)"),
        (lambda: dropout(_f(4), 0.1, seed=1, dtype=np.float16), TypeError, "dtype: expected float32 or bfloat16"),
        (lambda: dropout(_f(4), 0.1, seed=1, out=_f(4), dtype=ck.bfloat16), TypeError, "out: dtype float32 disagrees"),
        (lambda: dropout_backward(np.zeros(4, np.int32), 0.1, seed=1), TypeError, "dy: expected dtype"),
        (lambda: dropout_add(_f(3, 4), _f(4), 0.1, seed=1), ValueError, r"residual: expected shape \(3, 4\)"),
        (lambda: dropout_add(_f(4), np.zeros(4, np.float64), 0.1, seed=1), TypeError, "residual: expected dtype"),
        (lambda: dropout_add(_f(4), _f(4), 1.5, seed=1), ValueError, "p: expected a finite number"),
        (lambda: dropout_add(_f(4), [0.0] * 4, 0.1, seed=1), TypeError, "residual: expected a numpy.ndarray"),
    ],
)
def test_bad_input_messages(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ---------------------------------------------------------------- GPU: kernels against the reference, bit for bit
SIZES = [0, 1, 3, 127, 4097, (1 << 20) + 3]


def _bits(a):
    a = to_host(a)
    return a.view(np.uint16 if a.dtype == BF else np.uint32)


def assert_bits(got, ref, what=""):
    g = to_host(got)
    assert g.dtype == ref.dtype and g.shape == ref.shape, f"{what}: {g.dtype}{g.shape} vs {ref.dtype}{ref.shape}"
    gb, rb = _bits(g).ravel(), _bits(ref).ravel()
    bad = np.flatnonzero(gb != rb)
    assert bad.size == 0, f"{what}: {bad.size} of {gb.size} differ, first at {bad[:5]}: {gb[bad[:5]]} vs {rb[bad[:5]]}"


def _nonzero_randn(rng, shape, dtype):
    """Values bounded away from 0 (|x| >= 0.25), so a dropped element (exactly 0) is told from a kept one."""
    x = np.asarray(rng.standard_normal(shape), dtype=np.float32)  # (a 0-d array for shape (), not a scalar)
    return np.asarray((x + np.where(x >= 0, 0.25, -0.25)).astype(np.float32).astype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("din, dout", list(itertools.product(DTYPES, DTYPES)), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_dropout_bit_exact(rng, n, din, dout, misalign):
    x = _nonzero_randn(rng, (n,), din)
    p = 0.1
    o = poisoned((n,), dout, misalign)
    assert dropout(device_copy(x, misalign), p, seed=SEED, offset=OFFSET, out=o) is o
    ref = dropout(x, p, seed=SEED, offset=OFFSET, dtype=dout)
    assert_bits(o, ref, "dropout")
    np.testing.assert_array_equal(to_host(o) != 0, keep_mask((n,), p, seed=SEED, offset=OFFSET))
    # backward: the same mask drawn again, from dy
    dy = _nonzero_randn(rng, (n,), din)
    dx = poisoned((n,), dout, misalign)
    dropout_backward(device_copy(dy, misalign), p, seed=SEED, offset=OFFSET, out=dx)
    assert_bits(dx, dropout_backward(dy, p, seed=SEED, offset=OFFSET, dtype=dout), "dropout_backward")
    np.testing.assert_array_equal(to_host(dx) != 0, to_host(o) != 0)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 127, 4097, (1 << 20) + 3])
@pytest.mark.parametrize("dx_, dr, do", list(itertools.product(DTYPES, DTYPES, DTYPES)),
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_dropout_add_bit_exact(rng, n, dx_, dr, do, misalign):
    x, r = randn(rng, (n,), dx_, 2.0), randn(rng, (n,), dr)
    p = 0.15
    o = poisoned((n,), do, misalign)
    assert dropout_add(device_copy(x, misalign), device_copy(r, misalign), p, seed=SEED, offset=OFFSET, out=o) is o
    assert_bits(o, dropout_add(x, r, p, seed=SEED, offset=OFFSET, dtype=do), "dropout_add")


@pytest.mark.gpu
@pytest.mark.parametrize("dx_, dr", list(itertools.product(DTYPES, DTYPES)), ids=lambda d: np.dtype(d).name)
def test_gpu_dropout_add_in_place(rng, dx_, dr):
    shape, p = (199, 1000), 0.1
    x, r = randn(rng, shape, dx_), randn(rng, shape, dr)
    ref = dropout_add(x, r, p, seed=5, offset=6)
    h = device_copy(r)
    assert dropout_add(device_copy(x), h, p, seed=5, offset=6, out=h) is h  # h += dropout(x)
    assert_bits(h, ref, "out=residual")
    if dx_ == dr:
        xd = device_copy(x)
        assert dropout_add(xd, device_copy(r), p, seed=5, offset=6, out=xd) is xd
        assert_bits(xd, ref, "out=x")
        xd = device_copy(x)
        assert dropout(xd, p, seed=5, offset=6, out=xd) is xd
        assert_bits(xd, dropout(x, p, seed=5, offset=6), "dropout in place")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0, 16), (1, 8), (199, 1000), (4, 3, 24), (5, 127), ()])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_shapes(rng, shape, dtype):
    x = _nonzero_randn(rng, shape, dtype)
    o = poisoned(shape, dtype)
    dropout(device_copy(x), 0.5, seed=11, offset=12, out=o)
    assert_bits(o, dropout(x, 0.5, seed=11, offset=12), str(shape))


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1 - 2**-20])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_p_values(rng, p, dtype):
    x = _nonzero_randn(rng, (65537,), dtype)
    o = poisoned(x.shape, dtype)
    dropout(device_copy(x), p, seed=SEED, offset=OFFSET, out=o)
    assert_bits(o, dropout(x, p, seed=SEED, offset=OFFSET), f"p={p}")
    if p == 0.0:
        assert_bits(o, x, "p=0 is a copy")


@pytest.mark.gpu
def test_gpu_partial_misalignment_takes_the_scalar_path(rng):
    """Only one pointer off 16 bytes (out): still exact (element accesses for all)."""
    n = 10_007
    x, r = _nonzero_randn(rng, (n,), ck.bfloat16), randn(rng, (n,), np.float32)
    o = poisoned((n,), ck.bfloat16, misalign=True)
    dropout(device_copy(x), 0.3, seed=1, offset=2, out=o)
    assert_bits(o, dropout(x, 0.3, seed=1, offset=2), "dropout")
    o = poisoned((n,), np.float32, misalign=True)
    dropout_add(device_copy(x), device_copy(r), 0.3, seed=1, offset=2, out=o)
    assert_bits(o, dropout_add(x, r, 0.3, seed=1, offset=2), "dropout_add")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["uint64", "int64"])
def test_gpu_seed_and_offset_from_device_memory(rng, kind):
    import cupy as cp

    n = 4097
    x = _nonzero_randn(rng, (n,), ck.bfloat16)
    for s, o in [(SEED, OFFSET), (2**64 - 1, 2**63 + 5), (0, 0)]:
        sd = cp.asarray(np.array(s, np.uint64).view(kind))
        od = cp.asarray(np.array(o, np.uint64).view(kind))
        ref = dropout(x, 0.5, seed=s, offset=o)
        assert_bits(dropout(device_copy(x), 0.5, seed=sd, offset=od), ref, f"device seed/offset {s}, {o}")
        assert_bits(dropout(device_copy(x), 0.5, seed=s, offset=od), ref, "device offset only")
        r = randn(rng, (n,), np.float32)
        assert_bits(dropout_add(device_copy(x), device_copy(r), 0.5, seed=sd, offset=od),
                    dropout_add(x, r, 0.5, seed=s, offset=o), "dropout_add, device seed/offset")


@pytest.mark.gpu
def test_gpu_graph_replays_draw_fresh_masks(rng):
    """A captured step that advances a device offset (offset += 1) and then drops out: each replay uses the next
    offset, bit-identical to the reference at that offset."""
    import cupy as cp

    shape, p = (64, 1000), 0.5
    x = _nonzero_randn(rng, shape, ck.bfloat16)
    r = randn(rng, shape, np.float32)
    xd, rd = device_copy(x), device_copy(r)
    off = cp.zeros((), cp.uint64)
    y = cp.empty(shape, ck.bfloat16)
    dx = cp.empty(shape, np.float32)
    h = cp.empty(shape, np.float32)
    s = cp.cuda.Stream(non_blocking=True)

    def step():
        cp.add(off, 1, out=off)  # `off += 1` at top level; one CuPy elementwise launch
        dropout(xd, p, seed=SEED, offset=off, out=y)
        dropout_backward(y, p, seed=SEED, offset=off, out=dx, dtype=np.float32)
        h[...] = rd
        dropout_add(xd, h, p, seed=SEED + 1, offset=off, out=h)

    with s:
        step()  # compile and warm up outside the capture
        s.synchronize()
        s.begin_capture()
        try:
            step()
        finally:
            g = s.end_capture()
        off.fill(41)
        outs = []
        for _ in range(2):
            y.fill(np.nan)
            cp.cuda.Device().synchronize()  # (the poison ran on the legacy stream: the replay must not race it)
            g.launch(s)
            s.synchronize()  # (the copies below run on the legacy stream)
            outs.append((y.copy(), dx.copy(), h.copy()))
        s.synchronize()
    assert int(off.get()) == 43
    for k, (yk, dxk, hk) in zip((42, 43), outs):
        yr = dropout(x, p, seed=SEED, offset=k)
        assert_bits(yk, yr, f"replay offset {k}")
        assert_bits(dxk, dropout_backward(yr, p, seed=SEED, offset=k, dtype=np.float32), f"backward {k}")
        assert_bits(hk, dropout_add(x, r, p, seed=SEED + 1, offset=k), f"dropout_add {k}")
    m0, m1 = to_host(outs[0][0]) != 0, to_host(outs[1][0]) != 0
    assert (m0 != m1).mean() > 0.4  # two independent p = 0.5 masks differ at ~half the elements


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_extreme_values(dtype):
    """inf / NaN / huge / subnormal / signed zero inputs: kept values scale (3e38 * 2 overflows to inf in both
    paths), dropped values are exactly +0 even for inf and NaN (a select, not a multiply by 0)."""
    base = np.array([np.inf, -np.inf, np.nan, 3e38, -3e38, 1e-40, -1e-40, 0.0, -0.0, 1.0, -2.5, 6e4],
                    np.float32)
    x = np.tile(base, 1001).astype(dtype)  # 12012 elements: each value lands on kept and dropped positions
    ref = dropout(x, 0.5, seed=SEED, offset=OFFSET)
    got = to_host(dropout(device_copy(x), 0.5, seed=SEED, offset=OFFSET))
    # Subnormal inputs: the H200 run flushed 1e-40 * 2 to zero in the kernel's fp32 multiply (FTZ), NumPy keeps
    # 2e-40; both are accepted there (a difference below 1.2e-38, the smallest normal float), bits elsewhere.
    sub = np.abs(x.astype(np.float32)) < np.finfo(np.float32).tiny
    sub &= x.astype(np.float32) != 0
    assert np.all((got[sub] == 0) | (got[sub] == ref[sub]))
    got, ref = np.where(sub, 0, got).astype(got.dtype), np.where(sub, 0, ref).astype(ref.dtype)
    assert_close(got, ref, rtol=0, atol=0, what="extreme values")
    m = keep_mask(x.shape, 0.5, seed=SEED, offset=OFFSET)
    assert np.all(_bits(got)[~m] == 0), "dropped elements must be +0"
    assert np.isinf(got[m & np.isinf(x.astype(np.float32))]).all()
    r = np.zeros(x.shape, np.float32)
    ga = to_host(dropout_add(device_copy(x), device_copy(r), 0.5, seed=SEED, offset=OFFSET))
    gr = dropout_add(x, r, 0.5, seed=SEED, offset=OFFSET)
    assert np.all((ga[sub] == 0) | (ga[sub] == gr[sub]))
    assert_close(np.where(sub, 0, ga).astype(ga.dtype), np.where(sub, 0, gr).astype(gr.dtype), rtol=0, atol=0,
                 what="dropout_add")


@pytest.mark.gpu
def test_gpu_large_grid_stride(rng):
    """2^24 + 5 bf16 elements: more than one wave of units, so every thread loops; an odd tail."""
    n = (1 << 24) + 5
    x = _nonzero_randn(rng, (n,), ck.bfloat16)
    assert_bits(dropout(device_copy(x), 0.1, seed=SEED, offset=OFFSET), dropout(x, 0.1, seed=SEED, offset=OFFSET),
                "dropout")


@pytest.mark.gpu
def test_gpu_mixing_numpy_and_cupy_is_a_type_error():
    import cupy as cp

    with pytest.raises(TypeError, match="offset: is a numpy array but x is a cupy array"):
        dropout(cp.ones(4, cp.float32), 0.1, seed=1, offset=np.array(0, np.uint64))
    with pytest.raises(TypeError, match="seed: is a cupy array but x is a numpy array"):
        dropout(np.ones(4, np.float32), 0.1, seed=cp.zeros((), cp.uint64))
    with pytest.raises(TypeError, match="seed: a device array's value is read by the kernel"):
        keep_mask((4,), 0.1, seed=cp.zeros((), cp.uint64))
