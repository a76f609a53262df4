"""sample_tokens: the NumPy reference against its definitions (CPU: Philox known answers, greedy, top-k / top-p
kept sets, a chi-square test of the drawn distribution, the repetition penalty, seeds), and the kernel against
the reference (GPU: the same tokens for the same seed, up to documented near-ties; graphs; large vocabularies)."""
import numpy as np
import pytest

import cukernels as ck
from cukernels.ops import _launch
from cukernels.ops import sampling as S_
from cukernels.ops.sampling import (NEAR_TIE, draw_bits, greedy_smem, greedy_splits, philox4x32_10, reference_margins,
                                    sample_tokens, sample_workspace)
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
        (dict(workspace=[0] * 6000), TypeError, "workspace: expected a numpy.ndarray or cupy.ndarray"),
        (dict(workspace=np.zeros(S_.WORKSPACE_INTS, np.int64)), TypeError, "workspace: expected dtype int32"),
        (dict(workspace=np.zeros(100, np.int32)), ValueError, "workspace: expected a 1-D int32 array of at least"),
        (dict(workspace=np.zeros((2, S_.WORKSPACE_INTS), np.int32)), ValueError, "workspace: expected a 1-D"),
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
@pytest.mark.parametrize("B", [1, 3, 8, 64])
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


# ---------------------------------------------------------------- greedy across blocks (session 5)
def slices(V, off, E, S):
    """The kernel's slicing of one row (sampling.cu greedy_slice): token ranges [t0, t1) of the S slices of a row
    whose first element sits `off` elements into its 16-byte pack."""
    npk = (off + V + E - 1) // E
    pps = -(-npk // S)
    out = []
    for s in range(S):
        p0, p1 = s * pps, min(npk, (s + 1) * pps)
        out.append((max(p0 * E - off, 0), max(min(p1 * E - off, V), max(p0 * E - off, 0))))
    return out


@pytest.mark.parametrize("itemsize", [4, 2])
def test_greedy_plan_covers_every_row_within_the_workspace(itemsize):
    """For every batch, vocabulary and alignment: the slices tile [0, V) in order with no gap or overlap,
    B * S partials fit the workspace (and B its counters when S > 1), the bitmap holds a slice's tokens, and
    LLaMA-3's row splits into the 63 (fp32) / 32 (bf16) blocks NOTES.md's prediction assumes."""
    E = 16 // itemsize
    for Bsz in (1, 2, 3, 8, 31, 33, 64, 100, 1023, 1024, 1025, 4096, 70000):
        for V in (1, 2, 7, 31, 1000, 4099, 50257, 128256, S_.MAX_VOCAB):
            S = greedy_splits(Bsz, V, itemsize)
            assert 1 <= S <= S_.GREEDY_MAX_SPLITS
            assert S == 1 or (Bsz * S <= S_.WS_SLOTS and Bsz <= S_.WS_ROWS)
            for off in range(E):
                sl = slices(V, off, E, S)
                assert sl[0][0] == 0 and sl[-1][1] == V
                assert all(a[1] == b[0] for a, b in zip(sl, sl[1:]))
                assert max(t1 - t0 for t0, t1 in sl) <= greedy_smem(V, itemsize, S) * 8
                assert sl[0][1] > 0  # slice 0 is never empty (an all-empty row would have no candidate)
    assert greedy_splits(1, 128256, 4) == 63 and greedy_splits(8, 128256, 4) == 63
    assert greedy_splits(1, 128256, 2) == 32 and greedy_splits(1, 50257, 4) == 25
    assert greedy_splits(1, 7, 4) == 1  # a one-pack row: one block, no workspace
    assert greedy_smem(S_.MAX_VOCAB, 2, 1) >= greedy_smem(S_.MAX_VOCAB, 4, 1) >= S_.MAX_VOCAB // 8


def test_greedy_kernel_getter_raises_the_limit_to_the_largest_bitmap(monkeypatch):
    class Fake:
        def __init__(self, name):
            self.name, self.sets = name, []

        @property
        def max_dynamic_shared_size_bytes(self):
            return self.sets[-1]

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, v):
            self.sets.append(v)

    made = {}
    monkeypatch.setattr(S_, "get_function", lambda fam, name: made.setdefault(name, Fake(name)))
    monkeypatch.setattr(_launch, "_smem_limit", {})  # (keyed by id(): a dead fake's id may come back)
    for dtype, tag in ((np.float32, "f32"), (BF16, "bf16")):
        k = S_._greedy_kernel(dtype)
        assert k.name == f"sample_greedy_{tag}" and k.sets == [greedy_smem(S_.MAX_VOCAB, 2, 1)]
        # every launch fits: the largest per-block bitmap is a whole row at S = 1
        assert all(greedy_smem(V, np.dtype(dtype).itemsize, 1) <= k.sets[0] for V in (1, 128256, S_.MAX_VOCAB))


def test_greedy_workspace_is_ignored_on_the_reference_path(rng):
    l = rng.standard_normal((3, 40)).astype(np.float32)
    ws = np.zeros(S_.WORKSPACE_INTS, np.int32)
    assert np.array_equal(sample_tokens(l, temperature=0, workspace=ws), l.argmax(1))
    assert not ws.any()


def _greedy_ref(l, **kw):
    return sample_tokens(np.asarray(l), temperature=0.0, **kw)


def _plant_tie(row, b, sl):
    """Row b's max (50 + b, exact in bf16) planted at the last token of slice s, the first of slice s + 1 and the
    first of the last slice (s from b): the lowest planted index must win. Returns it."""
    assert len(sl) >= 4, "the tie test needs a split row"
    s = 1 + b % (len(sl) - 2)
    idx = [sl[s][1] - 1, sl[s + 1][0], sl[-1][0]]
    row[idx] = np.float32(50.0 + b)
    return min(idx)


@pytest.mark.gpu
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("V", [50257, 128256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_greedy_ties_across_slice_boundaries_lowest_index(rng, dtype, V, misalign):
    c = cp()
    Bsz = 8
    l = _logits(rng, "normal", Bsz, V, np.float32)
    E = 16 // np.dtype(dtype).itemsize
    # device_copy(misalign=True) puts element 0 one element past an aligned address; V * itemsize keeps every
    # row at that offset only when it is a multiple of 16
    off = 1 if misalign and V * np.dtype(dtype).itemsize % 16 == 0 else None
    if off is None and misalign:
        pytest.skip("rows of this V start at different pack offsets: covered by the strided test")
    sl = slices(V, off or 0, E, greedy_splits(Bsz, V, np.dtype(dtype).itemsize))
    want = np.array([_plant_tie(l[b], b, sl) for b in range(Bsz)], np.int32)
    l = l.astype(dtype)
    assert np.array_equal(_greedy_ref(l), want)
    got = sample_tokens(device_copy(l, misalign), temperature=0.0, out=c.full((Bsz,), -1, c.int32))
    assert np.array_equal(to_host(got), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_greedy_strided_rows_each_at_its_own_alignment(rng, dtype):
    """Rows of a wider buffer, stride V + 5: every row starts at another offset within its 16-byte pack, so its
    slices (and partial end packs) differ; ties planted at each row's own slice boundaries."""
    c = cp()
    Bsz, V = 8, 128256
    E = 16 // np.dtype(dtype).itemsize
    wide = _logits(rng, "normal", Bsz, V + 5, np.float32)
    buf = c.empty((Bsz, V + 5), dtype=dtype)
    view = buf[:, 3:3 + V]
    S = greedy_splits(Bsz, V, np.dtype(dtype).itemsize)
    offs = [(view[b].data.ptr // np.dtype(dtype).itemsize) % E for b in range(Bsz)]
    assert len(set(offs)) > 1
    want = [_plant_tie(wide[b, 3:3 + V], b, slices(V, offs[b], E, S)) for b in range(Bsz)]
    buf.set(wide.astype(dtype))
    got = to_host(sample_tokens(view, temperature=0.0))
    assert np.array_equal(got, np.array(want, np.int32))
    assert np.array_equal(got, _greedy_ref(wide[:, 3:3 + V].astype(dtype)))


NASTY_ROWS = ("all NaN", "all -inf", "NaN + one -inf", "NaN every 3rd + 100", "two +inf", "+-0", "-3e38 + -1e38",
              "subnormals 1e-39 + 3e-39", "NaN + one 0.0")


def _nasty_rows(rng, V, dtype):
    """Rows of non-finite, signed-zero, extreme and subnormal logits (NASTY_ROWS names them)."""
    Bsz = len(NASTY_ROWS)
    l = _logits(rng, "normal", Bsz, V, np.float32)
    l[0, :] = np.nan                                    # all NaN -> 0
    l[1, :] = -np.inf                                   # all -inf -> 0
    l[2, :] = np.nan
    l[2, V - 1] = -np.inf                               # -inf beats NaN: the only non-NaN wins
    l[3, ::3] = np.nan                                  # NaN never wins, wherever the max is
    l[3, V // 2 + 1] = 100.0
    l[4, [V // 3, V - 1]] = np.inf                      # +inf: the first one
    l[5, :] = 0.0
    l[5, : V // 2] = -0.0                               # -0 == +0: index 0
    l[6, :] = -3.0e38
    l[6, V - 1] = -1.0e38                               # extremes of the fp32 range
    l[7, :] = 1e-39                                     # subnormals (in bf16 too), one larger
    l[7, V * 2 // 3] = 3e-39
    l[8, :] = np.nan
    l[8, V // 2] = 0.0
    return l.astype(dtype)


def _name_rows(got, want):
    bad = np.nonzero(np.asarray(got) != np.asarray(want))[0]
    return "; ".join(f"row {b} ({NASTY_ROWS[b]}): got {int(got[b])}, want {int(want[b])}" for b in bad)


def _emulate_greedy_slice(l, S, off):
    """greedy_slice on the host, integer for integer: f2key on the bits (NaN -> 0, +-0 -> 2^31), the 64-bit
    code key << 32 | ~index, each slice's max from a zero start, the max over the S partials, ~code decoded."""
    Bsz, V = l.shape
    b = np.ascontiguousarray(l, dtype=np.float32).view(np.uint32).astype(np.uint64)
    mag = b & 0x7FFFFFFF
    key = np.where(b & 0x80000000, ~b & 0xFFFFFFFF, b | 0x80000000)
    key = np.where(mag == 0, 0x80000000, np.where(mag > 0x7F800000, 0, key)).astype(np.uint64)
    code = (key << np.uint64(32)) | (~np.arange(V, dtype=np.uint64) & np.uint64(0xFFFFFFFF))
    E = 16 // np.dtype(l.dtype).itemsize
    parts = [code[:, t0:t1].max(axis=1) if t1 > t0 else np.zeros(Bsz, np.uint64) for t0, t1 in slices(V, off, E, S)]
    best = np.max(parts, axis=0)
    return (~best & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("V", [7, 50257, 128256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_greedy_slice_emulation_on_nasty_rows(rng, dtype, V):
    """The split kernel's integer path (keys, codes, slices, combine) emulated on the host picks the reference's
    token on every nasty row, for S = 1, the planned S and a few others, at every alignment of the row."""
    l = _nasty_rows(rng, V, dtype)
    want = _greedy_ref(l)
    assert want[:3].tolist() == [0, 0, V - 1] and want[5] == 0 and want[7] == V * 2 // 3
    E = 16 // np.dtype(dtype).itemsize
    for S in sorted({1, 2, 3, greedy_splits(len(l), V, np.dtype(dtype).itemsize), min(63, V)}):
        for off in range(E):
            got = _emulate_greedy_slice(l, S, off)
            np.testing.assert_array_equal(got, want, err_msg=f"S={S} off={off}: {_name_rows(got, want)}")


@pytest.mark.gpu
@pytest.mark.parametrize("V", [7, 50257, 128256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_greedy_nan_inf_and_signed_zero_rows(rng, dtype, V, monkeypatch):
    """Both greedy kernels (split rows, and the one-block kernel a capture without a workspace takes) on the
    nasty rows; a failure names the rows. (Session 5: row 7, subnormals, returned 0 -- CuPy builds with
    -ftz=true and f2key's `v == 0.f` held for 1e-39; the one-block kernel's x * 1.f also flushed it.)"""
    c = cp()
    l = _nasty_rows(rng, V, dtype)
    want = _greedy_ref(l)
    assert want[:3].tolist() == [0, 0, V - 1] and want[5] == 0 and want[7] == V * 2 // 3
    for split in (True, False):
        monkeypatch.setattr(ck.settings, "greedy_split", split)
        out = c.full((len(l),), -1, c.int32)
        got = to_host(sample_tokens(device_copy(l), temperature=0.0, out=out))
        np.testing.assert_array_equal(got, want, err_msg=f"greedy_split={split}: {_name_rows(got, want)}")


@pytest.mark.gpu
@pytest.mark.parametrize("V", [7, 50257, 128256])
@pytest.mark.parametrize("B", [1, 3, 8, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_greedy_repetition_penalty_per_slice(rng, dtype, B, V):
    """The penalty's membership test per slice: the best tokens, ids straddling slice boundaries, duplicates and
    out-of-range ids in the history; penalty > 1 (pushes the best down) and < 1 (lifts penalised tokens); the
    history length on the device and on the host."""
    c = cp()
    L = 400
    l = _logits(rng, "llm", B, V, dtype)
    prev = rng.integers(-5, V + 5, (B, L)).astype(np.int32)
    k = min(V, 20)
    prev[:, :k] = np.argsort(-l.astype(np.float32), axis=1)[:, :k]
    S = greedy_splits(B, V, np.dtype(dtype).itemsize)
    bounds = [t for t0, t1 in slices(V, 0, 16 // np.dtype(dtype).itemsize, S) for t in (t0, t1 - 1)]
    prev[:, k:k + len(bounds)] = np.array(bounds[:L - k], np.int32)
    ld = c.asarray(l)
    pd = c.asarray(prev)
    for pen in (1.3, 0.7):
        for plen in (0, 9, L):
            want = _greedy_ref(l, repetition_penalty=pen, prev_tokens=prev, prev_len=plen)
            got_dev = sample_tokens(ld, temperature=0.0, repetition_penalty=pen, prev_tokens=pd,
                                    prev_len=c.array(plen, c.int32))
            got_host = sample_tokens(ld, temperature=0.0, repetition_penalty=pen, prev_tokens=pd, prev_len=plen)
            assert np.array_equal(to_host(got_dev), want), (pen, plen)
            assert np.array_equal(to_host(got_host), want), (pen, plen)


@pytest.mark.gpu
def test_gpu_greedy_one_block_rows_large_batch_with_penalty(rng):
    """From B = WS_ROWS + 1 each row is one block (S = 1: whole-row bitmap, no workspace)."""
    c = cp()
    Bsz, V = S_.WS_ROWS + 7, 5003
    assert greedy_splits(Bsz, V, 4) == 1
    l = _logits(rng, "normal", Bsz, V, np.float32)
    prev = rng.integers(0, V, (Bsz, 64)).astype(np.int32)
    prev[:, 0] = l.argmax(1)
    for kw in (dict(), dict(repetition_penalty=2.0, prev_tokens=prev)):
        want = _greedy_ref(l, **kw)
        dkw = dict(kw, prev_tokens=c.asarray(prev)) if kw else kw
        assert np.array_equal(to_host(sample_tokens(device_copy(l, True), temperature=0.0, **dkw)), want)


def _counters(ws):
    return to_host(ws[2 * S_.WS_SLOTS:2 * S_.WS_SLOTS + S_.WS_ROWS])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_greedy_split_equals_one_block_kernel_and_reruns_bit_identical(rng, dtype, monkeypatch):
    c = cp()
    l = _logits(rng, "ties", 8, 128256, dtype)  # integer logits: thousands of exact ties at the max
    ld = c.asarray(l)
    ws = sample_workspace()
    first = to_host(sample_tokens(ld, temperature=0.0, workspace=ws))
    for _ in range(20):
        assert np.array_equal(to_host(sample_tokens(ld, temperature=0.0, workspace=ws)), first)
        assert np.array_equal(to_host(sample_tokens(ld, temperature=0.0)), first)  # the stream's cached one
    assert not _counters(ws).any(), "a counter was left non-zero"
    monkeypatch.setattr(ck.settings, "greedy_split", False)
    assert np.array_equal(to_host(sample_tokens(ld, temperature=0.0)), first)
    assert np.array_equal(first, _greedy_ref(l))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("B", [1, 8])
def test_gpu_greedy_captured_graph_replays(rng, B, pdl):
    """Capture greedy sampling (logits written by a kernel just before it: the PDL predecessor) with an explicit
    workspace, with the stream's cached one, and on a fresh stream with none (the one-block fallback); replay
    each several times with new logits: the reference's tokens every time, counters back at 0."""
    c = cp()
    if pdl and not _launch.pdl_enabled():
        pytest.skip("programmatic dependent launch needs sm_90")
    V = 128256
    src = c.asarray(_logits(rng, "normal", B, V, np.float32))
    scale = c.ones((), c.float32)
    buf = c.empty_like(src)
    ws = sample_workspace()
    c.multiply(src, scale, out=buf)  # warm-up outside any capture: compile / load the kernels
    sample_tokens(buf, temperature=0.0, workspace=ws)
    sample_tokens(buf, temperature=1.0)  # (the one-block kernel, the fresh stream's fallback)
    c.cuda.Device().synchronize()
    streams = []  # (kept alive: a destroyed stream's handle may come back for the next one)
    for mode in ("explicit", "cached", "fresh"):
        s = c.cuda.Stream(non_blocking=True)
        streams.append(s)
        key = (c.cuda.runtime.getDevice(), s.ptr)
        S_._workspaces.pop(key, None)  # (a handle an earlier test's stream had: this stream has no workspace yet)
        outs = c.full((B,), -1, c.int32)

        def call():
            c.multiply(src, scale, out=buf)  # the producer of the logits, right before the sampler
            with _launch.pdl_scope() if pdl else _nullcontext():
                sample_tokens(buf, temperature=0.0, out=outs, workspace=ws if mode == "explicit" else None)

        with s:
            if mode == "cached":
                call()  # an eager call first: the stream's workspace exists before the capture
            s.synchronize()
            s.begin_capture()
            call()
            g = s.end_capture()
        for rep in range(5):
            scale.fill(np.float32(-1.0) if rep % 2 else np.float32(1.0 + rep))  # flips the argmax on odd replays
            src_h = to_host(src) * to_host(scale)
            outs.fill(-1)
            c.cuda.Device().synchronize()
            g.launch(s)
            s.synchronize()
            assert np.array_equal(to_host(outs), _greedy_ref(src_h)), (mode, rep)
        assert not _counters(ws).any()
        if mode == "cached":
            assert not _counters(S_._workspaces[key]).any()
        if mode == "fresh":  # the capture made no workspace (it took the one-block kernel)
            assert key not in S_._workspaces


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.gpu
def test_gpu_greedy_back_to_back_under_pdl_share_a_workspace(rng):
    """Ten greedy launches in a row on one workspace under PDL, each on different logits: each waits for the one
    before it (pdl_wait) before touching the counters, so every result is right."""
    c = cp()
    ls = [_logits(rng, "normal", 4, 128256, np.float32) for _ in range(10)]
    lds = [c.asarray(x) for x in ls]
    outs = [c.full((4,), -1, c.int32) for _ in ls]
    ws = sample_workspace()
    with _launch.pdl_scope():
        for ld, o in zip(lds, outs):
            sample_tokens(ld, temperature=0.0, out=o, workspace=ws)
    for x, o in zip(ls, outs):
        assert np.array_equal(to_host(o), _greedy_ref(x))
    assert not _counters(ws).any()
