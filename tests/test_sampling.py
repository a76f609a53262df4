"""sample_tokens: the NumPy reference against its definitions (CPU: Philox known answers, greedy, top-k / top-p
kept sets, a chi-square test of the drawn distribution, the repetition penalty, seeds), and the kernel against
the reference (GPU: the same tokens for the same seed, up to documented near-ties; graphs; large vocabularies)."""
import numpy as np
import pytest

import cukernels as ck
from cukernels.ops.sampling import NEAR_TIE, draw_bits, philox4x32_10, reference_margins, sample_tokens
from helpers import cp, device_copy, to_host

BF16 = ck.bfloat16


def softmax64(l):
    l = np.asarray(l, dtype=np.float64)
    e = np.exp(l - l.max())
    return e / e.sum()


def chi2(counts, probs):
    """Pearson's statistic over the cells with p > 0; asserts no draw fell outside them."""
    counts, probs = np.asarray(counts, dtype=np.float64), np.asarray(probs, dtype=np.float64)
    assert counts[probs == 0].sum() == 0, f"draws outside the kept set: {counts}, {probs}"
    n = counts.sum()
    k = probs > 0
    return float(((counts[k] - n * probs[k]) ** 2 / (n * probs[k])).sum()), int(k.sum()) - 1


# chi-square critical values at alpha = 1e-4 by degrees of freedom (the draws are seeded: a pass is stable)
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}


def expected_probs(l, T, top_k=0, top_p=1.0):
    """softmax(l / T) restricted to the top-k, then to the top-p set, renormalised (float64; distinct logits)."""
    p = softmax64(np.asarray(l, np.float64) / T)
    keep = np.ones_like(p, bool)
    if 0 < top_k < len(p):
        keep &= p >= np.sort(p)[-top_k]
    q = np.where(keep, p, 0)
    q = q / q.sum()
    if top_p < 1:
        order = np.argsort(-q)
        above = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
        k2 = np.zeros_like(keep)
        k2[order] = above < top_p
        keep &= k2
    q = np.where(keep, p, 0)
    return q / q.sum()


# ---------------------------------------------------------------- CPU: the generator
KAT = [  # Random123 kat_vectors for philox4x32_10: (counter, key, output)
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_known_answers(ctr, key, expected):
    assert tuple(int(w) for w in philox4x32_10(ctr, key)) == expected


def test_draw_bits_counter_layout():
    seed, offset = 0x0123456789ABCDEF, 0xFEDCBA9876543210
    r = draw_bits(3, seed, offset)
    for row in range(3):
        w = philox4x32_10((row, 0, offset & 0xFFFFFFFF, offset >> 32), (seed & 0xFFFFFFFF, seed >> 32))
        assert int(r[row]) == (int(w[0]) << 32) | int(w[1])
    assert len(set(int(x) for x in draw_bits(1000, 7, 0))) == 1000


# ---------------------------------------------------------------- CPU: the reference's semantics
def test_reference_greedy_is_argmax_ties_lowest_nan_never(rng):
    l = rng.standard_normal((6, 50)).astype(np.float32)
    l[1, [3, 17, 40]] = 9.0             # ties at the max -> lowest index
    l[2, 5] = np.nan                    # NaN never wins
    l[2, 6] = 100.0
    l[3] = np.nan                       # all NaN -> 0
    l[4] = -np.inf                      # all -inf -> 0
    l[5, 7] = np.inf                    # +inf is the argmax
    tok = sample_tokens(l, temperature=0.0)
    assert tok.dtype == np.int32 and tok.shape == (6,)
    assert tok.tolist() == [int(np.argmax(l[0])), 3, 6, 0, 0, 7]
    # a non-finite row max samples nothing either: the argmax
    assert sample_tokens(l[3:], temperature=1.0, seed=5).tolist() == [0, 0, 7]


def test_reference_top_k_1_and_tiny_top_p_are_greedy(rng):
    l = rng.standard_normal((64, 1000)).astype(np.float32) * 3
    g = sample_tokens(l, temperature=0)
    for o in range(3):
        assert np.array_equal(sample_tokens(l, temperature=0.7, top_k=1, seed=1, offset=o), g)
        assert np.array_equal(sample_tokens(l, temperature=1.3, top_p=1e-6, seed=2, offset=o), g)


@pytest.mark.parametrize("top_k,top_p,kept", [(0, 0.7, {0, 1}), (0, 0.85, {0, 1, 2}), (3, 1.0, {0, 1, 2}),
                                              (3, 0.9, {0, 1, 2}), (2, 0.5, {0}), (0, 0.45, {0})])
def test_reference_kept_sets(top_k, top_p, kept):
    """probabilities 0.5, 0.3, 0.15, 0.05 (in a shuffled vocabulary order): the drawn tokens are exactly the set
    that top-k / top-p keep, whatever the offsets."""
    perm = np.array([2, 0, 3, 1])  # token perm[i] has the i-th largest probability
    l = np.zeros((64, 4), np.float32)
    l[:, perm] = np.log([0.5, 0.3, 0.15, 0.05]).astype(np.float32)
    drawn = set()
    for o in range(40):
        drawn |= set(sample_tokens(l, top_k=top_k, top_p=top_p, seed=11, offset=o).tolist())
    assert drawn == {int(perm[i]) for i in kept}


CONFIGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0), (0.8, 0, 0.8), (1.0, 4, 0.75),
]
LOGITS6 = np.array([1.0, 2.2, -0.5, 0.3, 1.7, -1.4], np.float32)


@pytest.mark.parametrize("T,top_k,top_p", CONFIGS)
def test_reference_distribution_chi_square(T, top_k, top_p):
    """64 rows x 250 offsets = 16000 draws against softmax(l / T) restricted to the kept set."""
    p = expected_probs(LOGITS6, T, top_k, top_p)
    l = np.tile(LOGITS6, (64, 1))
    counts = np.zeros(6)
    for o in range(250):
        counts += np.bincount(sample_tokens(l, temperature=T, top_k=top_k, top_p=top_p, seed=99, offset=o),
                              minlength=6)
    stat, dof = chi2(counts, p)
    assert stat < CHI2_CRIT[dof], f"chi2 {stat:.1f} (dof {dof}): counts {counts} vs {p * counts.sum()}"


def test_reference_repetition_penalty():
    l = np.array([[2.0, 1.9, -1.0, -1.2, 0.5]], np.float32)
    prev = np.array([[0, 2, 0, 77, -3]], np.int32)  # duplicates and out-of-range ids are harmless
    # 2.0 -> 2.0 / 1.5 = 1.33 < 1.9: token 1 wins greedily
    assert sample_tokens(l, temperature=0, repetition_penalty=1.5, prev_tokens=prev).tolist() == [1]
    # only the first entry counts with prev_len = 1; a penalty of 1 is off
    assert sample_tokens(l, temperature=0, repetition_penalty=1.5, prev_tokens=prev, prev_len=0).tolist() == [0]
    assert sample_tokens(l, temperature=0, repetition_penalty=1.0, prev_tokens=prev).tolist() == [0]
    # negative logits are multiplied: -1.0 -> -1.5 falls below -1.2
    l2 = np.array([[-1.0, -1.2, -3.0]], np.float32)
    one = np.array([[0]], np.int32)
    assert sample_tokens(l2, temperature=0, repetition_penalty=1.5, prev_tokens=one).tolist() == [1]
    # the sampled distribution sees the penalised logits: penalty 1e3 takes the two best to ~0 < 3 (p ~ 0.05)
    big = np.tile(np.array([5.0, 4.0, 3.0, 3.0], np.float32), (64, 1))
    prev2 = np.tile(np.array([0, 1], np.int32), (64, 1))
    drawn = np.concatenate([sample_tokens(big, repetition_penalty=1e3, prev_tokens=prev2, seed=3, offset=o)
                            for o in range(10)])
    assert (drawn >= 2).mean() > 0.9 and (drawn < 2).any()


def test_reference_seeds_offsets_reproducible(rng):
    l = rng.standard_normal((64, 500)).astype(np.float32)
    a = sample_tokens(l, temperature=1.0, seed=123, offset=7)
    assert np.array_equal(a, sample_tokens(l, temperature=1.0, seed=123, offset=7))
    assert not np.array_equal(a, sample_tokens(l, temperature=1.0, seed=123, offset=8))
    assert not np.array_equal(a, sample_tokens(l, temperature=1.0, seed=124, offset=7))
    # 0-d arrays read as the same 64 bits; int32 is sign-extended
    assert np.array_equal(a, sample_tokens(l, seed=np.array(123, np.int64), offset=np.array(7, np.uint64)))
    assert np.array_equal(sample_tokens(l, seed=5, offset=np.array(-1, np.int32)),
                          sample_tokens(l, seed=5, offset=2**64 - 1))


def test_reference_bf16_equals_fp32_of_the_same_values(rng):
    l = rng.standard_normal((8, 300)).astype(np.float32).astype(BF16)
    kw = dict(temperature=0.9, top_k=40, top_p=0.9, seed=1, offset=2)
    assert np.array_equal(sample_tokens(l, **kw), sample_tokens(l.astype(np.float32), **kw))


def test_reference_sizes_and_out(rng):
    assert sample_tokens(np.zeros((5, 1), np.float32), temperature=1.0, seed=3).tolist() == [0] * 5
    assert sample_tokens(np.zeros((0, 7), np.float32)).shape == (0,)
    out = np.full(3, -1, np.int32)
    assert sample_tokens(rng.standard_normal((3, 9)).astype(np.float32), out=out) is out and (out >= 0).all()


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(logits=np.zeros((2, 4), np.float64)), TypeError, "logits: expected dtype"),
        (dict(logits=np.zeros(4, np.float32)), ValueError, "logits: expected 2 dimensions"),
        (dict(logits=np.zeros((2, 0), np.float32)), ValueError, "logits: the vocabulary axis"),
        (dict(logits=np.zeros((4, 2), np.float32).T), ValueError, "logits: the last .* axis must be contiguous"),
        (dict(temperature=np.inf), ValueError, "temperature: expected a finite number"),
        (dict(temperature="hot"), ValueError, "temperature"),
        (dict(top_k=-1), ValueError, "top_k: expected an int >= 0"),
        (dict(top_k=2.5), ValueError, "top_k"),
        (dict(top_p=0.0), ValueError, r"top_p: expected a number in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(repetition_penalty=0.0), ValueError, "repetition_penalty: expected a finite number > 0"),
        (dict(prev_tokens=np.zeros((2, 3), np.int64)), TypeError, "prev_tokens: expected dtype int32"),
        (dict(prev_tokens=np.zeros((3, 3), np.int32)), ValueError, r"prev_tokens: expected shape \(2, length\)"),
        (dict(prev_tokens=np.zeros((2, 3), np.int32), prev_len=4), ValueError, "prev_len: expected 0 <= prev_len"),
        (dict(prev_len=1), ValueError, "prev_len: given without prev_tokens"),
        (dict(prev_tokens=np.zeros((2, 3), np.int32), prev_len=np.array([1], np.int32)), ValueError,
         "prev_len: expected an int or a 0-d array"),
        (dict(seed=-1), ValueError, r"seed: expected an int in \[0, 2\*\*64\)"),
        (dict(seed=2**64), ValueError, "seed"),
        (dict(seed=1.5), TypeError, "seed: expected an int or a 0-d"),
        (dict(offset=np.array(3, np.float32)), TypeError, "offset: expected dtype"),
        (dict(out=np.zeros(2, np.int64)), TypeError, "out: expected dtype int32"),
        (dict(out=np.zeros(3, np.int32)), ValueError, "out: expected shape"),
    ],
)
def test_bad_input_messages(kw, exc, match):
    logits = kw.pop("logits", np.zeros((2, 4), np.float32))
    with pytest.raises(exc, match=match):
        sample_tokens(logits, **kw)


@pytest.mark.gpu
def test_mixing_numpy_and_cupy_is_a_type_error():
    c = cp()
    with pytest.raises(TypeError, match="offset: is a numpy array but logits is a cupy array"):
        sample_tokens(c.zeros((2, 4), c.float32), offset=np.array(1, np.int64))


# ---------------------------------------------------------------- GPU: the kernel against the reference
DTYPES = [np.float32, BF16]


def assert_same_tokens(got, logits, min_decisive=0.25, **kw):
    """Kernel tokens against the reference: equal on every row whose margin exceeds NEAR_TIE (the documented
    tolerance: exp in the last ulps). ``min_decisive``: the fraction of rows that must be decisive, so that the
    comparison has teeth (a top-p cut inside a dense tail of tiny masses is a near-tie by construction)."""
    ref, margin = reference_margins(logits, **kw)
    got = to_host(got)
    assert got.dtype == np.int32 and got.shape == ref.shape
    assert ((got >= 0) & (got < logits.shape[1])).all(), "token out of range (unwritten?)"
    decisive = margin > NEAR_TIE
    bad = (got != ref) & decisive
    assert not bad.any(), f"rows {np.nonzero(bad)[0][:10]} differ: kernel {got[bad][:10]} vs reference {ref[bad][:10]}"
    assert decisive.mean() >= min_decisive, f"only {decisive.sum()} of {len(ref)} rows are decisive"
    return ref


def _teeth(kind, top_p):
    """The decisive fraction to demand: top-p >= 0.9 cuts through the dense tail of normal / flat rows."""
    return 0.0 if top_p >= 0.9 and not (kind == "llm" and top_p < 0.99) else 0.25


def _logits(rng, kind, B, V, dtype):
    if kind == "normal":
        x = rng.standard_normal((B, V), dtype=np.float32) * 2
    elif kind == "llm":  # a few high logits far above a broad low bulk, like a trained LM head
        x = rng.standard_normal((B, V), dtype=np.float32) * 2 - 4
        idx = rng.integers(0, V, (B, 20))
        np.put_along_axis(x, idx, rng.uniform(8, 14, (B, 20)).astype(np.float32), 1)
    elif kind == "flat":
        x = rng.standard_normal((B, V), dtype=np.float32) * 0.05
    elif kind == "ties":  # integers: massive exact ties
        x = rng.integers(-4, 5, (B, V)).astype(np.float32)
    else:
        raise ValueError(kind)
    return x.astype(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("V", [1, 7, 1000, 50257, 128256])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_greedy_is_the_reference_argmax(rng, dtype, B, V, misalign):
    l = _logits(rng, "ties" if V < 100 else "normal", B, V, dtype)
    if B > 1:
        l[1, :] = l[1, 0]  # a whole row of ties -> 0
    out = cp().full((B,), -1, cp().int32)
    got = sample_tokens(device_copy(l, misalign), temperature=0.0, out=out)
    assert got is out
    assert np.array_equal(to_host(got), sample_tokens(l, temperature=0.0))


SAMPLE_CONFIGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (0.6, 50, 1.0), (1.0, 0, 0.9), (0.8, 50, 0.9), (1.2, 1, 1.0), (1.0, 0, 1e-6), (0.9, 0, 0.999),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", SAMPLE_CONFIGS, ids=lambda c: f"T{c[0]}k{c[1]}p{c[2]}")
@pytest.mark.parametrize("V", [50257, 128256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["normal", "llm"])
def test_gpu_sampling_matches_reference(rng, kind, dtype, V, cfg):
    T, k, p = cfg
    l = _logits(rng, kind, 64, V, dtype)
    kw = dict(temperature=T, top_k=k, top_p=p, seed=int(rng.integers(0, 2**63)), offset=int(rng.integers(0, 2**40)))
    got = sample_tokens(device_copy(l), **kw)
    assert_same_tokens(got, l, min_decisive=_teeth(kind, p), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(1.0, 30000, 1.0), (1.0, 64000, 0.95), (1.0, 0, 0.999), (1.0, 127000, 1.0),
                                 (1.0, 3, 0.5)], ids=["k30000", "k64000p95", "p999", "k127000", "k3p5"])
@pytest.mark.parametrize("kind", ["normal", "flat", "ties", "llm"])
def test_gpu_thresholds_far_below_the_max_and_ties(rng, kind, cfg):
    """Large top-k / top-p near 1 on flat rows: the threshold falls below the first 2^24-key window (the
    kernel's retry pass); integer logits: exact ties at every threshold (all kept)."""
    T, k, p = cfg
    l = _logits(rng, kind, 16, 128256, np.float32)
    kw = dict(temperature=T, top_k=k, top_p=p, seed=7, offset=int(rng.integers(0, 1000)))
    got = sample_tokens(device_copy(l), **kw)
    assert_same_tokens(got, l, min_decisive=_teeth(kind, p), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("V", [1, 2, 33, 257])
def test_gpu_small_and_odd_vocabularies(rng, V, misalign):
    l = _logits(rng, "normal", 37, V, np.float32)
    for cfg in SAMPLE_CONFIGS:
        kw = dict(temperature=cfg[0], top_k=cfg[1], top_p=cfg[2], seed=5, offset=9)
        assert_same_tokens(sample_tokens(device_copy(l, misalign), **kw), l, min_decisive=0.0, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("T,top_k,top_p", CONFIGS)
def test_gpu_distribution_chi_square(T, top_k, top_p):
    """20000 rows of the same logits (each row its own Philox counter) in one call, then 100 offsets x 64 rows."""
    c = cp()
    p = expected_probs(LOGITS6, T, top_k, top_p)
    tok = to_host(sample_tokens(c.asarray(np.tile(LOGITS6, (20000, 1))), temperature=T, top_k=top_k, top_p=top_p,
                                seed=42))
    stat, dof = chi2(np.bincount(tok, minlength=6), p)
    assert stat < CHI2_CRIT[dof], f"rows: chi2 {stat:.1f} (dof {dof})"
    l = c.asarray(np.tile(LOGITS6, (64, 1)))
    counts = np.zeros(6)
    for o in range(100):
        counts += np.bincount(to_host(sample_tokens(l, temperature=T, top_k=top_k, top_p=top_p, seed=42, offset=o)),
                              minlength=6)
    stat, dof = chi2(counts, p)
    assert stat < CHI2_CRIT[dof], f"offsets: chi2 {stat:.1f} (dof {dof})"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_repetition_penalty_device_prev_len(rng, dtype):
    c = cp()
    B, V, L = 8, 128256, 300
    l = _logits(rng, "llm", B, V, dtype)
    prev = rng.integers(-5, V + 5, (B, L)).astype(np.int32)  # includes out-of-range ids
    prev[:, :20] = np.argsort(-l.astype(np.float32), axis=1)[:, :20]  # the best tokens were seen already
    for plen in (0, 7, 150, L):
        for cfg in ((0.0, 0, 1.0), (1.0, 40, 0.9)):
            kw = dict(temperature=cfg[0], top_k=cfg[1], top_p=cfg[2], repetition_penalty=1.3, seed=1, offset=plen)
            got = sample_tokens(c.asarray(l), prev_tokens=c.asarray(prev), prev_len=c.array(plen, c.int32), **kw)
            assert_same_tokens(got, l, prev_tokens=prev, prev_len=plen, **kw)


@pytest.mark.gpu
def test_gpu_seed_offset_device_scalars_graph_replay_and_determinism(rng):
    """Capture once with seed / offset in device memory; bump the offset on the device and replay: each replay
    draws the reference's tokens for the new offset. Reruns are identical."""
    c = cp()
    l = _logits(rng, "llm", 64, 50257, BF16)
    ld = c.asarray(l)
    seed = c.array(2**40 + 17, dtype=c.uint64)
    off = c.array(5, dtype=c.int64)
    out = c.full((64,), -1, c.int32)
    kw = dict(temperature=0.8, top_k=40, top_p=0.95)
    sample_tokens(ld, seed=seed, offset=off, out=out, **kw)  # compile + warm up
    first = to_host(out).copy()
    assert np.array_equal(first, to_host(sample_tokens(ld, seed=2**40 + 17, offset=5, **kw)))
    s = c.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        sample_tokens(ld, seed=seed, offset=off, out=out, **kw)
        g = s.end_capture()
    for o in (5, 6, 1000, 2**33 + 3):
        off.fill(o)
        out.fill(-1)
        c.cuda.Device().synchronize()  # the fills ran on the default stream
        g.launch(s)
        s.synchronize()
        assert_same_tokens(out, l, seed=2**40 + 17, offset=o, **kw)
        if o == 5:
            assert np.array_equal(to_host(out), first)
