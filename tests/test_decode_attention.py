"""decode_attention (flash-decoding against a static KV cache): the NumPy reference against an independent float64
loop (CPU), the split-KV kernels against the reference (GPU): GQA / MHA / GPT-2 head layouts, several new tokens,
a NaN-poisoned cache tail, left-padding masks, strided cache views, the length on the device, CUDA graphs."""
import math

import numpy as np
import pytest

import cukernels as ck
from cukernels.ops import _launch
from cukernels.ops import decode_attention as DA
from cukernels.ops.decode_attention import decode_attention, decode_attention_workspace, rope_kv_write
from helpers import cp, poisoned, to_host

BF16 = ck.bfloat16


def f64_decode(q, k, v, L, scale, key_mask=None, window=None):
    """Per (batch, token, head) loop in float64, written from the definition: query t sits at position
    L - Tq + t and sees keys n <= that position, n < L, key_mask[b, n] != 0 and, with a sliding window W,
    position - n < W; none visible: zeros."""
    Bsz, Tq, H, D = q.shape
    Hkv = k.shape[2]
    o = np.zeros((Bsz, Tq, H, D))
    for b in range(Bsz):
        for t in range(Tq):
            n = np.arange(L)
            n = n[n <= L - Tq + t]
            if window is not None:
                n = n[(L - Tq + t) - n < window]
            if key_mask is not None:
                n = n[np.asarray(key_mask)[b, n] != 0]
            if n.size == 0:
                continue
            for h in range(H):
                j = h // (H // Hkv)
                s = scale * (k[b, n, j].astype(np.float64) @ q[b, t, h].astype(np.float64))
                e = np.exp(s - s.max())
                o[b, t, h] = (e / e.sum()) @ v[b, n, j].astype(np.float64)
    return o


def close(got, ref, tol=2e-2, what=""):
    """bf16 output against a float reference: |err| <= tol * max(1, max|ref|) (P enters P V as bf16)."""
    got, ref = to_host(got).astype(np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten, or a NaN cache row was read)"
    err = np.abs(got - ref).max() if got.size else 0.0
    lim = tol * max(1.0, np.abs(ref).max() if ref.size else 0.0)
    assert err <= lim, f"{what}: max error {err:.4g} > {lim:.4g}"


def make_cache(rng, Bsz, Lmax, Hkv, D, L, poison=True):
    """bf16 K/V caches with the tail [L, Lmax) set to NaN (it must never be read)."""
    k = rng.standard_normal((Bsz, Lmax, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((Bsz, Lmax, Hkv, D), dtype=np.float32)
    if poison:
        k[:, L:] = np.nan
        v[:, L:] = np.nan
    return k.astype(BF16), v.astype(BF16)


def left_pad_mask(Bsz, Lmax, pads, dtype=np.bool_):
    m = np.ones((Bsz, Lmax), dtype=dtype)
    for b, p in enumerate(pads):
        m[b, :p] = 0
    return m


# ---------------------------------------------------------------- CPU: the reference against float64
CPU_CASES = [  # (B, Tq, H, Hkv, D, L, Lmax)
    (1, 1, 4, 1, 32, 1, 3),
    (2, 1, 8, 2, 64, 37, 50),
    (3, 4, 6, 3, 64, 20, 21),
    (2, 3, 4, 4, 128, 9, 9),
    (1, 5, 2, 1, 32, 3, 8),   # cache_len < Tq: the first two queries see no key -> zeros
]


@pytest.mark.parametrize("case", CPU_CASES)
def test_reference_matches_f64(rng, case):
    Bsz, Tq, H, Hkv, D, L, Lmax = case
    q = rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k, v = make_cache(rng, Bsz, Lmax, Hkv, D, L)
    o = decode_attention(q, k, v, L)
    assert o.dtype == BF16 and o.shape == q.shape and o.flags.c_contiguous
    ref = f64_decode(q, k, v, L, 1 / math.sqrt(D))
    np.testing.assert_allclose(o.astype(np.float64), ref, rtol=2**-7, atol=1e-5)
    if Tq > L:
        assert not o[:, : Tq - L].astype(np.float32).any(), "queries that see no key must be zeros"


def test_reference_mask_scale_and_device_scalar_length(rng):
    Bsz, Tq, H, Hkv, D, L, Lmax = 3, 2, 8, 2, 64, 30, 40
    q = rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k, v = make_cache(rng, Bsz, Lmax, Hkv, D, L)
    mask = left_pad_mask(Bsz, Lmax, [0, 7, 29], np.int32)
    k[1, :7] = np.nan  # masked keys are never read either
    v[1, :7] = np.nan
    o = decode_attention(q, k, v, np.array(L, np.int32), scale=0.3, key_mask=mask)
    ref = f64_decode(q, k, v, L, 0.3, mask)
    assert np.isfinite(o.astype(np.float32)).all()
    np.testing.assert_allclose(o.astype(np.float64), ref, rtol=2**-7, atol=1e-5)
    # row 2 keeps only key 29 (its new token, visible to query 1 alone): query 0 sees nothing
    assert not o[2, 0].astype(np.float32).any()
    np.testing.assert_allclose(o[2, 1].astype(np.float64), np.repeat(v[2, 29].astype(np.float64), H // Hkv, 0),
                               rtol=2**-7)


def test_reference_zero_length_and_fully_masked_rows_are_zeros(rng):
    q = rng.standard_normal((2, 1, 4, 32), dtype=np.float32).astype(BF16)
    k, v = make_cache(rng, 2, 5, 2, 32, 0)
    assert not decode_attention(q, k, v, 0).astype(np.float32).any()
    k, v = make_cache(rng, 2, 5, 2, 32, 4)
    mask = np.zeros((2, 5), np.uint8)
    mask[1, 2] = 1
    o = decode_attention(q, k, v, 4, key_mask=mask)
    assert not o[0].astype(np.float32).any()
    np.testing.assert_allclose(o[1, 0].astype(np.float64), np.repeat(v[1, 2].astype(np.float64), 2, 0), rtol=2**-7)


def test_reference_out_is_used(rng):
    q = rng.standard_normal((1, 1, 2, 32), dtype=np.float32).astype(BF16)
    k, v = make_cache(rng, 1, 4, 1, 32, 4)
    out = np.full(q.shape, np.nan, BF16)
    assert decode_attention(q, k, v, 4, out=out) is out and np.isfinite(out.astype(np.float32)).all()


# ---------------------------------------------------------------- bad input
def _args(**kw):
    base = dict(q=np.zeros((2, 1, 8, 64), BF16), k_cache=np.zeros((2, 16, 2, 64), BF16),
                v_cache=np.zeros((2, 16, 2, 64), BF16), cache_len=5)
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(q=np.zeros((2, 1, 8, 64), np.float32)), TypeError, "q: expected dtype bfloat16"),
        (dict(q=np.zeros((2, 8, 64), BF16)), ValueError, "q: expected 4 dimensions"),
        (dict(q=np.zeros((2, 1, 8, 48), BF16)), ValueError, "q: head_dim must be one of"),
        (dict(k_cache=np.zeros((3, 16, 2, 64), BF16)), ValueError, "k_cache: expected shape"),
        (dict(k_cache=np.zeros((2, 16, 3, 64), BF16), v_cache=np.zeros((2, 16, 3, 64), BF16)), ValueError,
         r"k_cache: kv_heads \(3\) must divide"),
        (dict(v_cache=np.zeros((2, 15, 2, 64), BF16)), ValueError, "v_cache: expected shape"),
        (dict(v_cache=np.zeros((2, 16, 2, 64), np.float32)), TypeError, "v_cache: expected dtype"),
        (dict(cache_len=17), ValueError, "cache_len: expected 0 <= cache_len <= max_len"),
        (dict(cache_len=-1), ValueError, "cache_len: expected 0 <= cache_len"),
        (dict(cache_len=2.0), TypeError, "cache_len: expected an int or a 0-d int32 array"),
        (dict(cache_len=True), TypeError, "cache_len: expected an int"),
        (dict(cache_len=np.array(3, np.int64)), TypeError, "cache_len: expected dtype int32"),
        (dict(cache_len=np.array([3], np.int32)), ValueError, "cache_len: expected a 0-d int32 array"),
        (dict(key_mask=np.ones((2, 15), np.bool_)), ValueError, "key_mask: expected shape"),
        (dict(key_mask=np.ones((2, 16), np.float32)), TypeError, "key_mask: expected a bool or integer dtype"),
        (dict(key_mask=np.ones((16, 2), np.bool_).T), ValueError, "key_mask: the last axis must be contiguous"),
        (dict(scale=0.0), ValueError, "scale: expected a finite number > 0"),
        (dict(scale="a"), TypeError, "scale: expected a real number"),
        (dict(num_splits=0), ValueError, "num_splits: expected an int >= 1"),
        (dict(out=np.zeros((2, 1, 8, 64), np.float32)), TypeError, "out: expected dtype bfloat16"),
        (dict(out=np.zeros((2, 2, 8, 64), BF16)), ValueError, "out: expected shape"),
        (dict(q=[[1.0]]), TypeError, "q: expected a numpy.ndarray or cupy.ndarray"),
    ],
)
def test_bad_input_messages(kw, exc, match):
    a = _args(**kw)
    extra = {k: a.pop(k) for k in ("scale", "key_mask", "out", "num_splits") if k in a}
    with pytest.raises(exc, match=match):
        decode_attention(a["q"], a["k_cache"], a["v_cache"], a["cache_len"], **extra)


def test_mask_split_limit_message():
    a = _args(k_cache=np.zeros((1, 9000, 1, 32), BF16), v_cache=np.zeros((1, 9000, 1, 32), BF16),
              q=np.zeros((1, 1, 1, 32), BF16))
    with pytest.raises(ValueError, match="num_splits: with key_mask a split covers at most 8192 keys"):
        decode_attention(a["q"], a["k_cache"], a["v_cache"], 5, key_mask=np.ones((1, 9000), np.bool_), num_splits=1)


@pytest.mark.gpu
def test_mixing_numpy_and_cupy_is_a_type_error():
    c = cp()
    q = c.zeros((1, 1, 2, 32), BF16)
    k = c.zeros((1, 4, 1, 32), BF16)
    with pytest.raises(TypeError, match="cache_len: is a numpy array but q is a cupy array"):
        decode_attention(q, k, k, np.array(2, np.int32))
    with pytest.raises(TypeError, match="v_cache: is a numpy array"):
        decode_attention(q, k, np.zeros((1, 4, 1, 32), BF16), 2)


# ---------------------------------------------------------------- GPU: kernels against the reference
HEADS = [(32, 8), (8, 8), (12, 12)]  # LLaMA-3.2-1B (G = 4), MHA, GPT-2


def _gpu_case(rng, Bsz, Tq, H, Hkv, D, L, Lmax, *, mask=None, dev_len=True, num_splits=None, scale=None):
    c = cp()
    q = rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k, v = make_cache(rng, Bsz, Lmax, Hkv, D, L)
    if mask is not None:  # masked keys hold NaN too: they must not be read
        k = np.where((mask == 0)[:, :, None, None], np.float32(np.nan), k.astype(np.float32)).astype(BF16)
        v = np.where((mask == 0)[:, :, None, None], np.float32(np.nan), v.astype(np.float32)).astype(BF16)
    ref = decode_attention(q, k, v, L, key_mask=mask, scale=scale)
    qd, kd, vd = c.asarray(q), c.asarray(k), c.asarray(v)
    md = c.asarray(mask) if mask is not None else None
    out = c.full(q.shape, np.nan, dtype=BF16)
    length = c.array(L, dtype=c.int32) if dev_len else L
    o = decode_attention(qd, kd, vd, length, key_mask=md, out=out, num_splits=num_splits, scale=scale)
    assert o is out
    return q, k, v, ref, to_host(o)


@pytest.mark.gpu
@pytest.mark.parametrize("L", [1, 17, 1000, 4096])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}kv{h[1]}")
@pytest.mark.parametrize("Tq", [1, 4])
@pytest.mark.parametrize("Bsz", [1, 3, 8])
def test_gpu_matches_reference(rng, Bsz, Tq, heads, D, L):
    H, Hkv = heads
    if Bsz == 8 and L == 4096 and Tq == 4:
        Tq = 1  # keeps the host reference small; B8 x L4096 x Tq4 adds no kernel path beyond the others
    Lmax = L + 1 + int(rng.integers(0, 300))  # a NaN tail past cache_len
    q, k, v, ref, o = _gpu_case(rng, Bsz, Tq, H, Hkv, D, L, Lmax, dev_len=bool(L % 2))
    close(o, ref.astype(np.float32), what=f"B{Bsz} Tq{Tq} H{H}/{Hkv} D{D} L{L}")
    if L <= 17 and Bsz * Tq * H <= 96:  # small enough for the float64 loop
        close(o, f64_decode(q, k, v, L, 1 / math.sqrt(D)), what="vs float64")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 300])
@pytest.mark.parametrize("Tq,heads", [(1, (32, 8)), (6, (32, 8)), (16, (32, 8)), (16, (64, 4))],
                         ids=["t1g4", "t6g4", "t16g4", "t16g16"])  # 1, 2, 4, 16 row tiles of 16
@pytest.mark.parametrize("D", [32, 64, 128])
def test_gpu_forced_splits_and_row_tiles(rng, splits, Tq, heads, D):
    """Every split count (1: the direct write, no combine; 300 > keys / stage: empty splits) and row-tile
    layout (MTB 1 / 2 / 4, and 4 row groups when G * Tq = 256) against the reference."""
    H, Hkv = heads
    L, Lmax = 777, 1000
    _, _, _, ref, o = _gpu_case(rng, 2, Tq, H, Hkv, D, L, Lmax, num_splits=splits)
    close(o, ref.astype(np.float32), what=f"splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("mdtype", [np.bool_, np.int32, np.uint8, np.int64])
@pytest.mark.parametrize("Tq", [1, 3])
def test_gpu_left_padding_mask(rng, mdtype, Tq):
    Bsz, H, Hkv, D, L, Lmax = 4, 32, 8, 64, 300, 333
    mask = left_pad_mask(Bsz, Lmax, [0, 5, 200, 299], mdtype)  # the last row keeps only its newest key
    q, k, v, ref, o = _gpu_case(rng, Bsz, Tq, H, Hkv, D, L, Lmax, mask=mask)
    close(o, ref.astype(np.float32), what=f"mask {np.dtype(mdtype)}")
    if Tq > 1:  # row 3: only key 299 is kept, which only the last query sees
        assert not o[3, : Tq - 1].astype(np.float32).any()


@pytest.mark.gpu
def test_gpu_mask_with_many_splits_and_all_masked_row(rng):
    Bsz, Tq, H, Hkv, D, L, Lmax = 2, 2, 8, 2, 128, 9000, 9100  # > 8192 keys: at least two splits with a mask
    mask = np.ones((Bsz, Lmax), np.bool_)
    mask[0] = False
    mask[1, ::3] = False
    _, _, _, ref, o = _gpu_case(rng, Bsz, Tq, H, Hkv, D, L, Lmax, mask=mask)
    assert not o[0].astype(np.float32).any(), "a fully masked row must be zeros"
    close(o, ref.astype(np.float32), what="mask, 9000 keys")


@pytest.mark.gpu
def test_gpu_strided_cache_and_query_views_are_read_in_place(rng):
    """A layer's slice of a [layers, B, L_max, Hkv, D] cache, K and V interleaved in one buffer, and q a slice of
    a fused QKV projection: batch / token / head strides by value."""
    c = cp()
    layers, Bsz, Lmax, H, Hkv, D, Tq, L = 3, 3, 500, 12, 4, 64, 2, 431
    kv = rng.standard_normal((layers, Bsz, Lmax, 2, Hkv, D), dtype=np.float32)
    kv[:, :, L:] = np.nan
    kv = kv.astype(BF16)
    qkv = rng.standard_normal((Bsz, Tq, H + 2 * Hkv, D), dtype=np.float32).astype(BF16)
    kvd, qkvd = c.asarray(kv), c.asarray(qkv)
    k, v, q = kvd[1, :, :, 0], kvd[1, :, :, 1], qkvd[:, :, :H]
    assert not (k.flags.c_contiguous or q.flags.c_contiguous)
    o = decode_attention(q, k, v, c.array(L, c.int32))
    ref = decode_attention(qkv[:, :, :H].copy(), kv[1, :, :, 0].copy(), kv[1, :, :, 1].copy(), L)
    close(o, ref.astype(np.float32), what="strided views")


@pytest.mark.gpu
def test_gpu_misaligned_view_is_refused(rng):
    c = cp()
    buf = c.zeros((1 * 8 * 2 * 64 + 1,), BF16)
    k = buf[1:].reshape(1, 8, 2, 64)
    with pytest.raises(ValueError, match="k_cache: the kernel reads 16-byte chunks"):
        decode_attention(c.zeros((1, 1, 2, 64), BF16), k, k, 3)


@pytest.mark.gpu
def test_gpu_zero_length_large_scores_and_determinism(rng):
    c = cp()
    Bsz, Tq, H, Hkv, D, Lmax = 2, 3, 8, 2, 128, 2048
    q = (rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32) * 30).astype(BF16)  # scaled scores ~ +-100
    k, v = make_cache(rng, Bsz, Lmax, Hkv, D, 1500)
    qd, kd, vd = c.asarray(q), c.asarray(k), c.asarray(v)
    length = c.array(0, dtype=c.int32)
    for splits in (None, 1):
        o = decode_attention(qd, kd, vd, length, out=c.full(q.shape, np.nan, BF16), num_splits=splits)
        assert not to_host(o).astype(np.float32).any(), "cache_len 0: every query sees nothing -> zeros"
    length.fill(1500)
    o1 = to_host(decode_attention(qd, kd, vd, length))
    o2 = to_host(decode_attention(qd, kd, vd, length))
    assert np.array_equal(o1.view(np.uint16), o2.view(np.uint16)), "reruns must be bit-identical"
    close(o1, decode_attention(q, k, v, 1500).astype(np.float32), what="large scores")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1])
def test_gpu_graph_replay_reads_the_new_length(rng, splits):
    """Capture once with the length on the device, then grow the cache (new K/V rows written, length bumped on
    the device) and replay: the output is that of the new length. The workspace is preallocated."""
    c = cp()
    Bsz, Tq, H, Hkv, D, Lmax = 2, 1, 32, 8, 64, 4096
    q = rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k, v = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    kp, vp = k.copy(), v.copy()
    kp[:, 1000:] = np.nan  # the device cache starts with only 1000 valid rows
    vp[:, 1000:] = np.nan
    qd, kd, vd = c.asarray(q), c.asarray(kp), c.asarray(vp)
    length = c.array(1000, dtype=c.int32)
    ws = decode_attention_workspace(qd, kd, num_splits=splits)
    out = c.empty(q.shape, BF16)
    decode_attention(qd, kd, vd, length, out=out, workspace=ws, num_splits=splits)  # compile + warm up
    s = c.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        decode_attention(qd, kd, vd, length, out=out, workspace=ws, num_splits=splits)
        g = s.end_capture()
    for L in (1000, 1001, 3333, 17):
        kd[:, :L] = c.asarray(k[:, :L])  # the new tokens' K/V written before the step
        vd[:, :L] = c.asarray(v[:, :L])
        length.fill(L)
        out.fill(np.nan)
        c.cuda.Device().synchronize()  # the writes above ran on the default stream; s does not wait for it
        g.launch(s)
        s.synchronize()
        close(out, decode_attention(q, k, v, L).astype(np.float32), what=f"graph replay at L={L}")


# ---------------------------------------------------------------- one kernel: split partials + last-block combine
# CPU: the split-count model (decode_attention.py: _choose_splits) on the H200's numbers: 132 SMs, 4 resident
# blocks of dattn_split_d64_m1 per SM (121 registers), 64-key stages of 16 KB (K + V, D = 64).
H200 = dict(stage=64, stage_bytes=64 * 64 * 2 * 2, sms=132, per_sm=4)


def test_split_time_model_by_hand():
    # B1 LLaMA-3.2-1B (8 K/V heads) at max_len 384, 6 splits: chunk 64, 48 blocks (one a SM), one stage each:
    # 2.0 fixed + 1 x max(0.7 latency, 16384 B / 32 GB/s = 0.51) + combine 1.0 + 6 x 0.02 = 3.82 us
    assert DA._split_time(6, 8, 384, **H200) == pytest.approx(3.82)
    # one split: 6 stages of 0.7 us after the fixed 2.0, no combine
    assert DA._split_time(1, 8, 384, **H200) == pytest.approx(6.2)
    # B8 at max_len 2304, 4 splits: chunk 576 = 9 stages, 256 blocks = 2 a SM sharing its 32 GB/s:
    # 2.0 + 9 x (2 x 0.512) + 1.0 + 0.08
    assert DA._split_time(4, 64, 2304, **H200) == pytest.approx(2.0 + 9 * 2 * 16384 / 32e3 + 1.08)
    # B8, 17 splits (the former two-wave rule): chunk ceil(2304 / 17) = 136 -> 192 keys = 3 stages, 12 live
    # splits x 64 = 768 blocks > 132 x 4: two waves, 4 blocks a SM sharing it -> the fixed cost twice
    assert DA._split_time(17, 64, 2304, **H200) == pytest.approx(2 * (2.0 + 3 * 4 * 16384 / 32e3) + 1.0 + 0.34)


@pytest.mark.parametrize("units, Lmax, want", [
    (8, 64, 1),        # one stage: nothing to split
    (8, 128, 1),       # two stages (1.4 us) < one stage + the combine (1.7 us)
    (8, 384, 6),       # the session-5 decode step (B1, 128 + 256): one 64-key stage a block, 48 blocks
    (8, 2304, 36),     # B1 at 2048 + 256: 288 blocks, 3 a SM, one stage each
    (64, 2304, 4),     # B8: 256 blocks of 9 stages (the former rule: 17 splits, 2 waves)
    (512, 2304, 1),    # B64: 512 heads already fill the 528 slots of one wave
    (8, 4352, 23),     # B1 at 4096 + 256: 184 blocks of 3 stages (68 splits would need 2 waves)
])
def test_choose_splits_on_h200_numbers(units, Lmax, want):
    s = DA._choose_splits(units, Lmax, **H200)
    assert s == want
    chunk = -(-(-(-Lmax // s)) // 64) * 64
    assert units * -(-Lmax // chunk) <= 132 * 4, "the chosen grid fits one wave"


def test_choose_splits_edges():
    assert DA._choose_splits(8, 0, **H200) == 1
    assert DA._choose_splits(8, 1, **H200) == 1
    # a key_mask needs ceil(max_len / 8192) splits (its bits live in shared memory): a floor, not a target
    s = DA._choose_splits(1, 20000, **H200, min_splits=3)
    assert s >= 3 and -(-20000 // s) <= DA.MASK_CHUNK
    assert DA._choose_splits(1, 100, **H200, min_splits=2) == 2


def test_workspace_size_includes_the_counters():
    # B2, 8 K/V heads, G 4, Tq 1, D 64, 6 splits: 2 * 8 counters first, then partials 2 * 8 * 6 * 4 rows * 66 floats
    assert DA._partial_elems(2, 8, 4, 1, 64, 6) == 2 * 8 * 6 * 4 * 66
    assert DA._workspace_elems(2, 8, 4, 1, 64, 6) == 2 * 8 * 6 * 4 * 66 + 2 * 8
    # G 16, Tq 16: 256 rows = 4 row groups of 64 -> 4 counters per (b, K/V head)
    assert DA._workspace_elems(1, 4, 16, 16, 64, 3) == 4 * 3 * 256 * 66 + 4 * 4
    # B1, one K/V head: 1 counter, padded to 4 (the partials after it are read as 16-byte float4)
    assert DA._counter_elems(1, 1, 4, 1) == 4 and DA._workspace_elems(1, 1, 4, 1, 64, 2) == 4 + 2 * 4 * 66
    assert DA._workspace_elems(2, 8, 4, 1, 64, 1) == 0
    assert not decode_attention_workspace(np.zeros((1, 1, 4, 32), BF16), np.zeros((1, 8, 1, 32), BF16)).any()


def _counters(ws, Bsz, Hkv, G, Tq, D, splits):
    """The int32 counters at the start of the workspace (all zero between launches; where they are does not
    depend on the split count)."""
    n = Bsz * Hkv * DA._row_tiles(G, Tq)[1]
    return to_host(ws[:n].view(np.int32))


def _bits(a):
    return to_host(a).view(np.uint16)


def _nan_rows(x, rows):
    """x (host bf16 [B, Lmax, Hkv, D]) with NaN where rows[b, n] is True."""
    return np.where(rows[:, :, None, None], np.float32(np.nan), x.astype(np.float32)).astype(BF16)


LENS = (0, 1, 31, 63, 64, 65, 130, 200, 257)  # max_len 257: 64- and 32-key stage boundaries, L < Tq, L = max_len


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 40])  # 40: more splits than stages at every length (empty ones)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("Tq", [1, 5])  # G * Tq = 4 rows (MTB 1, 64-key stages), 20 rows (MTB 2, 32-key stages)
@pytest.mark.parametrize("Bsz", [1, 3, 8])
def test_gpu_one_kernel_combine_at_every_length(rng, splits, masked, Tq, Bsz):
    """The one-launch split + combine against the reference for L from 0 to max_len (the cache tail and masked
    rows hold NaN), outputs poisoned (one of them one element off 16 bytes); the workspace variant, the pool
    variant and a rerun bit-identical to each other; the counters back at zero after every launch."""
    c = cp()
    H, Hkv, D, Lmax = 32, 8, 64, 257
    G = H // Hkv
    q = rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k0, v0 = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    mask = None
    if masked:
        mask = rng.random((Bsz, Lmax)) > 0.3
        mask[0, :40] = False           # left padding
        mask[Bsz - 1, :] = False       # the last row keeps only key 62 (every query with L > 62 sees it alone)
        mask[Bsz - 1, 62] = True
    qd = c.asarray(q)
    md = c.asarray(mask) if masked else None
    ws = decode_attention_workspace(qd, c.asarray(k0), key_mask=md, num_splits=splits)
    assert (splits == 1) == (ws.size == 1)
    length = c.zeros((), c.int32)
    for L in LENS:
        hidden = np.zeros((Bsz, Lmax), bool)
        hidden[:, L:] = True           # never read: past the length
        if masked:
            hidden |= ~mask            # never read: dropped by the mask
        k, v = _nan_rows(k0, hidden), _nan_rows(v0, hidden)
        kd, vd = c.asarray(k), c.asarray(v)
        ref = decode_attention(q, k, v, L, key_mask=mask)
        length.fill(L)
        o_ws = poisoned(q.shape, BF16, misalign=bool(L % 2))
        decode_attention(qd, kd, vd, length, key_mask=md, out=o_ws, num_splits=splits, workspace=ws)
        if splits > 1:
            assert not _counters(ws, Bsz, Hkv, G, Tq, D, splits).any(), f"L={L}: counters not reset"
        o_pool = decode_attention(qd, kd, vd, length, key_mask=md, out=poisoned(q.shape, BF16), num_splits=splits)
        o_again = decode_attention(qd, kd, vd, length, key_mask=md, num_splits=splits, workspace=ws)
        what = f"splits={splits} L={L}"
        close(o_ws, ref.astype(np.float32), what=what)
        assert np.array_equal(_bits(o_ws), _bits(o_pool)), f"{what}: workspace and pool results differ"
        assert np.array_equal(_bits(o_ws), _bits(o_again)), f"{what}: rerun not bit-identical"
        if L < Tq:
            assert not to_host(o_ws)[:, : Tq - L].astype(np.float32).any(), f"{what}: queries without keys"


@pytest.mark.gpu
def test_gpu_model_split_count_on_the_decode_step_shape(rng):
    """B1, LLaMA-3.2-1B heads, max_len 384 (128 + 256) with the all-ones key_mask the fused step passes: the
    model's split count, at the lengths a generation walks through, against the reference."""
    c = cp()
    Bsz, Tq, H, Hkv, D, Lmax = 1, 1, 32, 8, 64, 384
    s = DA._splits(Bsz, Hkv, D, Lmax, H // Hkv, Tq, np.ones(1), None)
    assert 1 <= s <= Lmax // 64
    for L in (129, 192, 193, 300, 384):
        _, _, _, ref, o = _gpu_case(rng, Bsz, Tq, H, Hkv, D, L, Lmax, mask=np.ones((Bsz, Lmax), np.bool_))
        close(o, ref.astype(np.float32), what=f"model splits {s}, L={L}")


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("splits", [None, 3, 7])
def test_gpu_graph_replays_with_growing_length_reset_the_counters(rng, splits, pdl):
    """One captured decode step for three layers sharing one workspace: length += 1, then per layer the new
    token's K/V appended at the device length (kv_cache_write) and decode_attention; replayed 12 times from
    length 58 (crossing the 64-key chunk boundary: 1 -> 2 live splits at 7 splits). Every replay's outputs are
    those of its length: a counter left non-zero by a launch would make the next launch's combine run early
    (missing splits) or never (o left NaN)."""
    c = cp()
    if pdl and not _launch.pdl_enabled():
        pytest.skip("programmatic dependent launch needs sm_90")
    layers, Bsz, Tq, H, Hkv, D, Lmax, L0 = 3, 2, 1, 32, 8, 64, 384, 58
    G = H // Hkv
    q = rng.standard_normal((layers, Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k = rng.standard_normal((layers, Bsz, Lmax, Hkv, D), dtype=np.float32).astype(BF16)
    v = rng.standard_normal((layers, Bsz, Lmax, Hkv, D), dtype=np.float32).astype(BF16)
    knew = rng.standard_normal((layers, Bsz, 1, Hkv, D), dtype=np.float32).astype(BF16)
    vnew = rng.standard_normal((layers, Bsz, 1, Hkv, D), dtype=np.float32).astype(BF16)
    k[:, :, L0:] = np.nan  # rows past the length: NaN until a replay appends there
    v[:, :, L0:] = np.nan
    mask = np.ones((Bsz, Lmax), np.bool_)
    mask[1, :3] = False  # row 1 left-padded by 3
    qd, kd, vd, knd, vnd, md = (c.asarray(x) for x in (q, k, v, knew, vnew, mask))
    ws = decode_attention_workspace(qd[0], kd[0], key_mask=md, num_splits=splits)
    outs = [c.empty((Bsz, Tq, H, D), BF16) for _ in range(layers)]
    length = c.array(L0, dtype=c.int32)

    def step():
        c.add(length, 1, out=length)
        for i in range(layers):
            ck.kv_cache_write(knd[i], kd[i], length)
            ck.kv_cache_write(vnd[i], vd[i], length)
            with (_launch.pdl_scope() if pdl else _nullcontext()):
                decode_attention(qd[i], kd[i], vd[i], length, key_mask=md, out=outs[i], num_splits=splits,
                                 workspace=ws)

    s = c.cuda.Stream(non_blocking=True)
    with s:  # compile + warm up every kernel of the step outside the capture (the append on a scratch cache)
        ck.kv_cache_write(knd[0], c.empty_like(kd[0]), length)
        c.add(length, 0, out=length)
        decode_attention(qd[0], kd[0], vd[0], length, key_mask=md, out=outs[0], workspace=ws, num_splits=splits)
        s.synchronize()
        s.begin_capture()
        step()
        g = s.end_capture()
    for rep in range(12):
        L = L0 + rep + 1
        k[:, :, L - 1], v[:, :, L - 1] = knew[:, :, 0], vnew[:, :, 0]
        for o in outs:
            o.fill(np.nan)
        c.cuda.Device().synchronize()
        g.launch(s)
        s.synchronize()
        assert int(length) == L
        for i in range(layers):
            ref = decode_attention(q[i], k[i], v[i], L, key_mask=mask)
            close(outs[i], ref.astype(np.float32), what=f"replay {rep} (L={L}) layer {i}")
    if ws.size > 1:
        assert not _counters(ws, Bsz, Hkv, G, Tq, D, DA._splits(Bsz, Hkv, D, Lmax, G, Tq, md, splits)).any()


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.gpu
def test_gpu_back_to_back_under_pdl_share_a_workspace(rng):
    """Ten launches in a row on one workspace under PDL (each may start while the one before runs: pdl_wait
    before it reads or writes anything), each with its own query and length: every result right, counters 0."""
    c = cp()
    Bsz, Tq, H, Hkv, D, Lmax = 3, 2, 32, 8, 64, 700
    k, v = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    kd, vd = c.asarray(k), c.asarray(v)
    qs = [rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16) for _ in range(10)]
    lens = [int(x) for x in rng.integers(0, Lmax + 1, 10)]
    lds = [c.array(L, c.int32) for L in lens]
    ws = decode_attention_workspace(c.asarray(qs[0]), kd, num_splits=5)
    qds = [c.asarray(q) for q in qs]
    outs = [poisoned(qs[0].shape, BF16) for _ in qs]
    c.cuda.Device().synchronize()
    with _launch.pdl_scope():
        for qd, ld, o in zip(qds, lds, outs):
            decode_attention(qd, kd, vd, ld, out=o, num_splits=5, workspace=ws)
    for q, L, o in zip(qs, lens, outs):
        close(o, decode_attention(q, k, v, L).astype(np.float32), what=f"L={L}")
    assert not _counters(ws, Bsz, Hkv, H // Hkv, Tq, D, 5).any()


@pytest.mark.gpu
def test_gpu_workspace_too_small_for_the_counters_is_refused():
    c = cp()
    q, kc = c.zeros((2, 1, 32, 64), BF16), c.zeros((2, 512, 8, 64), BF16)
    need = DA._workspace_elems(2, 8, 4, 1, 64, 4)
    with pytest.raises(ValueError, match=f"workspace: expected a 16-byte aligned float32 buffer of >= {need}"):
        decode_attention(q, kc, kc, 5, num_splits=4, workspace=c.zeros((need - 1,), np.float32))


# ------------------------------------------------------------------------------------- kv_cache_write
def test_kv_cache_write_reference():
    cache = np.zeros((2, 6, 3, 4), np.float32).astype(ck.bfloat16)
    new = (np.arange(2 * 2 * 3 * 4).reshape(2, 2, 3, 4) + 1).astype(np.float32).astype(ck.bfloat16)
    ck.kv_cache_write(new, cache, 5)  # the two new tokens take rows 3 and 4
    np.testing.assert_array_equal(cache[:, 3:5], new)
    assert not cache[:, :3].astype(np.float32).any() and not cache[:, 5:].astype(np.float32).any()
    with pytest.raises(TypeError, match="new: expected the cache's dtype"):
        ck.kv_cache_write(new.astype(np.float32), cache, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [ck.bfloat16, np.int32])
def test_gpu_kv_cache_write_at_device_length_and_in_a_graph(rng, dtype):
    import cupy as cp
    big = cp.full((3, 2, 40, 4, 8), -7, dtype=dtype)     # [layers, B, L, Hkv, D]: write into layer 1's view
    cache = big[1]
    length = cp.array(9, dtype=cp.int32)
    new = cp.asarray(rng.integers(0, 100, (2, 3, 4, 8)).astype(np.float32).astype(dtype))
    ck.kv_cache_write(new, cache, length)
    want = np.full((2, 40, 4, 8), -7).astype(dtype)
    want[:, 6:9] = cp.asnumpy(new)
    np.testing.assert_array_equal(cp.asnumpy(cache), want)
    assert (cp.asnumpy(big[0]) == -7).all() and (cp.asnumpy(big[2]) == -7).all()
    # captured once, replayed with the length advanced on the device: each replay appends one token
    one = cp.asarray(np.ones((2, 1, 4, 8)).astype(dtype))
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        length += 1
        ck.kv_cache_write(one, cache, length)
        g = s.end_capture()
    for _ in range(3):
        g.launch(s)
    s.synchronize()
    assert int(length) == 12 and (cp.asnumpy(cache[:, 9:12]) == 1).all() and (cp.asnumpy(cache[:, 12:]) == -7).all()


# ------------------------------------------------------------------------------------- rope_kv_write
def f64_rope_kv(qkv, H, Hkv, L, Lmax, cos=None, sin=None, positions=None):
    """From the definition, per (b, t, head, pair) in float64: q and k rotated by the angle of position p
    (rotate-half pairs (i, i + D/2)), k and v rows landing at cache row L - T + t when inside [0, Lmax).
    Returns (q [B, T, H, D], {(b, row): (k [Hkv, D], v [Hkv, D])})."""
    Bsz, T, C = qkv.shape
    D = C // (H + 2 * Hkv)
    x = qkv.astype(np.float64).reshape(Bsz, T, H + 2 * Hkv, D)
    out = x.copy()
    if cos is not None:
        half = D // 2
        for b in range(Bsz):
            for t in range(T):
                p = t if positions is None else int(np.asarray(positions)[t] if np.ndim(positions) == 1
                                                    else np.asarray(positions)[b, t])
                c, sn = cos[p].astype(np.float64), sin[p].astype(np.float64)
                for h in range(H + Hkv):
                    x1, x2 = x[b, t, h, :half], x[b, t, h, half:]
                    out[b, t, h, :half] = x1 * c - x2 * sn
                    out[b, t, h, half:] = x2 * c + x1 * sn
    rows = {}
    for b in range(Bsz):
        for t in range(T):
            r = L - T + t
            if 0 <= r < Lmax:
                rows[(b, r)] = (out[b, t, H:H + Hkv], out[b, t, H + Hkv:])
    return out[:, :, :H], rows


def _rkv_case(rng, Bsz, T, H, Hkv, D, Lmax, dtype, rope=True, pos_kind=None, Lc=None):
    qkv = rng.standard_normal((Bsz, T, (H + 2 * Hkv) * D)).astype(np.float32).astype(dtype)
    cos = sin = positions = None
    if rope:
        Lc = Lc or Lmax
        cos, sin = ck.rope_cache(Lc, D, 500000.0, xp=np)
        if pos_kind == "seq":
            positions = rng.integers(0, Lc, T).astype(np.int32)
        elif pos_kind == "batch":
            positions = rng.integers(0, Lc, (Bsz, T)).astype(np.int64)
    return qkv, cos, sin, positions


@pytest.mark.parametrize("pos_kind", [None, "seq", "batch"])
@pytest.mark.parametrize("L", [1, 3, 7, 9])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_rope_kv_write_reference_matches_f64(rng, pos_kind, L, dtype):
    Bsz, T, H, Hkv, D, Lmax = 2, 3, 4, 2, 8, 9
    qkv, cos, sin, pos = _rkv_case(rng, Bsz, T, H, Hkv, D, Lmax, dtype, pos_kind=pos_kind)
    kc = np.full((Bsz, Lmax, Hkv, D), -5.0, np.float32).astype(dtype)
    vc = kc.copy()
    q = rope_kv_write(qkv, H, Hkv, kc, vc, L, cos=cos, sin=sin, positions=pos)
    q64, rows = f64_rope_kv(qkv, H, Hkv, L, Lmax, cos, sin, pos)
    tol = 1e-6 if dtype == np.float32 else 2.0**-8
    np.testing.assert_allclose(q.astype(np.float64), q64, rtol=tol, atol=1e-6)
    for b in range(Bsz):
        for r in range(Lmax):
            if (b, r) in rows:
                np.testing.assert_allclose(kc[b, r].astype(np.float64), rows[(b, r)][0], rtol=tol, atol=1e-6)
                np.testing.assert_array_equal(vc[b, r].astype(np.float64), rows[(b, r)][1])  # v: copied exactly
            else:
                assert (kc[b, r].astype(np.float32) == -5).all() and (vc[b, r].astype(np.float32) == -5).all()


def test_rope_kv_write_reference_no_rotation_views_and_in_place(rng):
    """GPT-2 (no rotary, odd head_dim fine), qkv a column view of a wider buffer, q_out = qkv's own q part."""
    Bsz, T, H, Hkv, D, Lmax = 2, 2, 3, 3, 5, 6
    buf = rng.standard_normal((Bsz, T, (H + 2 * Hkv) * D + 4)).astype(np.float32)
    qkv = buf[..., 2:2 + (H + 2 * Hkv) * D]
    kc, vc = np.zeros((Bsz, Lmax, Hkv, D), np.float32), np.zeros((Bsz, Lmax, Hkv, D), np.float32)
    want = qkv[..., :H * D].reshape(Bsz, T, H, D).copy()
    q = rope_kv_write(qkv, H, Hkv, kc, vc, 4)
    np.testing.assert_array_equal(q, want)
    np.testing.assert_array_equal(kc[:, 2:4], qkv[..., H * D:(H + Hkv) * D].reshape(Bsz, T, Hkv, D))
    np.testing.assert_array_equal(vc[:, 2:4], qkv[..., (H + Hkv) * D:].reshape(Bsz, T, Hkv, D))
    # rotate q in place inside qkv
    cos, sin = ck.rope_cache(8, 4, xp=np)
    qkv2 = rng.standard_normal((1, 1, 3 * 4)).astype(np.float32)
    ref = ck.rope(np.ascontiguousarray(qkv2[..., :4].reshape(1, 1, 1, 4)), cos, sin)
    qv = qkv2[..., :4].reshape(1, 1, 1, 4)
    r = rope_kv_write(qkv2, 1, 1, np.zeros((1, 2, 1, 4), np.float32), np.zeros((1, 2, 1, 4), np.float32), 1,
                      cos=cos, sin=sin, q_out=qv)
    assert r is qv
    np.testing.assert_array_equal(qkv2[..., :4].reshape(1, 1, 1, 4), ref)


_QKV = np.zeros((1, 1, 16), np.float32)  # H 2, Hkv 1, D 4
_KC = np.zeros((1, 4, 1, 4), np.float32)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(qkv=np.zeros((1, 1, 16))), TypeError, "qkv: expected dtype"),
        (dict(qkv=np.zeros((1, 16), np.float32)), ValueError, "qkv: expected 3 dimensions"),
        (dict(qkv=np.zeros((1, 1, 15), np.float32)), ValueError, r"qkv: the last axis \(15\)"),
        (dict(n_heads=0), ValueError, "n_heads"),
        (dict(n_kv_heads=1.5), TypeError, "n_kv_heads"),
        (dict(k_cache=np.zeros((1, 4, 1, 4), BF16)), TypeError, "k_cache: expected qkv's dtype"),
        (dict(k_cache=np.zeros((1, 4, 2, 4), np.float32)), ValueError, r"k_cache: expected shape \(1, max_len, 1, 4\)"),
        (dict(v_cache=np.zeros((1, 5, 1, 4), np.float32)), ValueError, "v_cache: expected shape"),
        (dict(cache_len=5), ValueError, "cache_len: expected 0 <= cache_len <= max_len"),
        (dict(cache_len=np.zeros((1,), np.int32)), ValueError, "cache_len: expected a 0-d int32 array"),
        (dict(cache_len="3"), TypeError, "cache_len: expected an int"),
        (dict(cos=np.ones((4, 2), np.float32)), ValueError, "cos, sin: pass both"),
        (dict(positions=np.zeros(1, np.int32)), ValueError, "positions: given without cos"),
        (dict(cos=np.ones((4, 3), np.float32), sin=np.ones((4, 3), np.float32)), ValueError, r"cos: expected shape \(L, 2\)"),
        (dict(cos=np.ones((4, 2)), sin=np.ones((4, 2))), TypeError, "cos: expected dtype"),
        (dict(cos=np.ones((4, 2), np.float32), sin=np.ones((3, 2), np.float32)), ValueError, "sin: expected shape"),
        (dict(cos=np.ones((4, 2), np.float32), sin=np.ones((4, 2), np.float32), positions=np.zeros(2, np.int32)),
         ValueError, r"positions: expected shape \(1,\) or \(1, 1\)"),
        (dict(cos=np.ones((4, 2), np.float32), sin=np.ones((4, 2), np.float32), positions=np.zeros(1, np.float32)),
         TypeError, "positions: expected dtype"),
        (dict(q_out=np.zeros((1, 1, 2, 5), np.float32)), ValueError, "q_out: expected shape"),
        (dict(q_out=np.zeros((1, 1, 2, 4), BF16)), TypeError, "q_out: expected dtype"),
    ],
)
def test_rope_kv_write_bad_input(kw, exc, match):
    a = dict(qkv=_QKV, n_heads=2, n_kv_heads=1, k_cache=_KC, v_cache=_KC.copy(), cache_len=1)
    a.update(kw)
    pos = {k: a.pop(k) for k in ("qkv", "n_heads", "n_kv_heads", "k_cache", "v_cache", "cache_len")}
    with pytest.raises(exc, match=match):
        rope_kv_write(*pos.values(), **a)


def test_rope_kv_write_odd_head_dim_with_rope_refused():
    with pytest.raises(ValueError, match=r"head_dim \(5\) must be even"):
        rope_kv_write(np.zeros((1, 1, 15), np.float32), 1, 1, np.zeros((1, 2, 1, 5), np.float32),
                      np.zeros((1, 2, 1, 5), np.float32), 1, cos=np.ones((2, 2), np.float32),
                      sin=np.ones((2, 2), np.float32))


def _gpu_composition(qkv, H, Hkv, kc, vc, length, cos, sin, pos):
    """The unfused GPU path: contiguous q / k copies, ck.rope on each, ck.kv_cache_write of k and of v."""
    import cupy as cp

    Bsz, T, C = qkv.shape
    D = C // (H + 2 * Hkv)
    q = cp.ascontiguousarray(qkv[..., :H * D]).reshape(Bsz, T, H, D)
    k = cp.ascontiguousarray(qkv[..., H * D:(H + Hkv) * D]).reshape(Bsz, T, Hkv, D)
    v = qkv[..., (H + Hkv) * D:].reshape(Bsz, T, Hkv, D)
    if cos is not None:
        q = ck.rope(q, cos, sin, positions=pos)
        k = ck.rope(k, cos, sin, positions=pos)
    ck.kv_cache_write(k, kc, length)
    ck.kv_cache_write(v, vc, length)
    return q


def _same_as_composition(got, want, dtype, what, min_identical=0.99):
    """Within 1 bf16 ulp / 1e-6 (fp32) everywhere, bit-identical for >= min_identical of the elements, the same
    NaN pattern (rows written / skipped). Against the GPU composition the rotation is the same fp32 expression
    (rope.cu's PTX pattern: mul, mul, sub / mul, fma), so all should match bit for bit; >= 99 % leaves room for
    ptxas contracting one of the two kernels differently. Against NumPy (float64 math, one rounding) fp32 values
    differ in the last bits: min_identical = 0 there."""
    g, w = to_host(got), to_host(want)
    assert g.shape == w.shape, what
    nan_g, nan_w = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
    assert np.array_equal(nan_g, nan_w), f"{what}: NaN pattern differs (rows written / skipped)"
    g64, w64 = g.astype(np.float64)[~nan_g], w.astype(np.float64)[~nan_w]
    rtol = 2.0**-8 if np.dtype(dtype) == BF16 else 1e-6
    np.testing.assert_allclose(g64, w64, rtol=rtol, atol=1e-6, err_msg=what)
    if np.dtype(dtype) != BF16:  # fp32 on the H200: within 1e-6 everywhere but only 91 % bit-identical (ptxas
        min_identical = 0.0      # contracts the two kernels' products into FMAs differently); bf16 rounds that away
    if g64.size:
        assert np.mean(g64 == w64) >= min_identical, f"{what}: only {np.mean(g64 == w64):.4f} bit-identical"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pos_kind", [None, "seq", "batch"])
@pytest.mark.parametrize("shape", [(1, 1, 32, 8, 64), (3, 1, 32, 8, 64), (2, 4, 8, 8, 128), (2, 3, 4, 2, 6),
                                   (1, 2, 12, 12, 64)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_rope_kv_write_matches_rope_then_write(rng, shape, pos_kind, dtype, misalign):
    """Against the GPU composition (rope + kv_cache_write), caches and q_out poisoned with NaN (unwritten rows
    stay NaN), the length on the device; and against the NumPy composition on the host copies."""
    import cupy as cp

    Bsz, T, H, Hkv, D = shape
    Lmax, L = 40, 23
    qkv, cos, sin, pos = _rkv_case(rng, Bsz, T, H, Hkv, D, Lmax, dtype, pos_kind=pos_kind, Lc=64)
    dq = device_copy_view(qkv, misalign)
    dcos, dsin = cp.asarray(cos), cp.asarray(sin)
    dpos = None if pos is None else cp.asarray(pos)
    length = cp.array(L, dtype=cp.int32)
    kc1, vc1 = (cp.full((Bsz, Lmax, Hkv, D), np.nan, dtype=dtype) for _ in range(2))
    kc2, vc2 = (cp.full((Bsz, Lmax, Hkv, D), np.nan, dtype=dtype) for _ in range(2))
    q_out = cp.full((Bsz, T, H, D), np.nan, dtype=dtype)
    got = rope_kv_write(dq, H, Hkv, kc1, vc1, length, cos=dcos, sin=dsin, positions=dpos, q_out=q_out)
    assert got is q_out
    want = _gpu_composition(dq, H, Hkv, kc2, vc2, length, dcos, dsin, dpos)
    _same_as_composition(got, want, dtype, "q")
    _same_as_composition(kc1, kc2, dtype, "k_cache")
    assert np.array_equal(to_host(vc1).view(np.uint8), to_host(vc2).view(np.uint8)), "v_cache: not copied exactly"
    # the NumPy composition on the host copies
    hk, hv = (np.full((Bsz, Lmax, Hkv, D), np.nan, np.float32).astype(dtype) for _ in range(2))
    hq = rope_kv_write(qkv, H, Hkv, hk, hv, L, cos=cos, sin=sin, positions=pos)
    frac = 0.99 if dtype == BF16 else 0.0
    _same_as_composition(got, hq, dtype, "q vs NumPy", frac)
    _same_as_composition(kc1, hk, dtype, "k_cache vs NumPy", frac)


def device_copy_view(a, misalign):
    """A device copy of the [B, T, C] qkv: misaligned (one element past 16 bytes: the element path), or a
    row-strided view of a wider buffer (rows C + 8 apart: the 16-byte path on strided rows)."""
    import cupy as cp

    from helpers import device_copy

    if misalign:
        return device_copy(a, misalign=True)
    Bsz, T, C = a.shape
    buf = cp.full((Bsz, T, C + 8), np.nan, dtype=a.dtype)
    buf[..., :C] = cp.asarray(a)
    return buf[..., :C]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_gpu_rope_kv_write_no_rotation_layer_views_in_place_q(rng, dtype):
    """GPT-2 (no rotary; head_dim 5: element path), writing into layer 1 of [layers, B, Lmax, Hkv, D] caches;
    then RoPE with q_out = the q part of qkv itself (rotated in place)."""
    import cupy as cp

    Bsz, T, H, Hkv, D, Lmax = 2, 3, 12, 12, 5, 10
    qkv = cp.asarray(rng.standard_normal((Bsz, T, 3 * H * D)).astype(np.float32).astype(dtype))
    big_k = cp.full((3, Bsz, Lmax, Hkv, D), np.nan, dtype=dtype)
    big_v = cp.full((3, Bsz, Lmax, Hkv, D), np.nan, dtype=dtype)
    q = rope_kv_write(qkv, H, Hkv, big_k[1], big_v[1], 6)
    hq = to_host(qkv)
    assert np.array_equal(to_host(q), hq[..., :H * D].reshape(Bsz, T, H, D))
    assert np.array_equal(to_host(big_k[1, :, 3:6]), hq[..., H * D:2 * H * D].reshape(Bsz, T, Hkv, D))
    assert np.array_equal(to_host(big_v[1, :, 3:6]), hq[..., 2 * H * D:].reshape(Bsz, T, Hkv, D))
    assert np.isnan(to_host(big_k[1, :, :3]).astype(np.float32)).all()
    assert np.isnan(to_host(big_k[0]).astype(np.float32)).all() and np.isnan(to_host(big_v[2]).astype(np.float32)).all()
    # RoPE in place: q_out is qkv's q part
    H, Hkv, D = 32, 8, 64
    cos, sin = ck.rope_cache(32, D)
    qkv = cp.asarray(rng.standard_normal((Bsz, 1, (H + 2 * Hkv) * D)).astype(np.float32).astype(dtype))
    want = ck.rope(cp.ascontiguousarray(qkv[..., :H * D]).reshape(Bsz, 1, H, D), cos, sin)
    qv = qkv[..., :H * D].reshape(Bsz, 1, H, D)
    kc = cp.zeros((Bsz, 8, Hkv, D), dtype=dtype)
    rope_kv_write(qkv, H, Hkv, kc, cp.zeros_like(kc), 1, cos=cos, sin=sin, q_out=qv)
    _same_as_composition(qkv[..., :H * D].reshape(Bsz, 1, H, D), want, dtype, "q rotated in place")


@pytest.mark.gpu
def test_gpu_rope_kv_write_graph_replay_follows_the_device_length(rng):
    """Captured once (length += 1, then the fused write at positions = length - 1), replayed three times: each
    replay writes the next cache row, rotated by its own position."""
    import cupy as cp

    Bsz, H, Hkv, D, Lmax = 2, 32, 8, 64, 16
    cos, sin = ck.rope_cache(Lmax, D)
    qkv = cp.asarray(rng.standard_normal((Bsz, 1, (H + 2 * Hkv) * D)).astype(np.float32).astype(BF16))
    kc = cp.full((Bsz, Lmax, Hkv, D), np.nan, dtype=BF16)
    vc = cp.full((Bsz, Lmax, Hkv, D), np.nan, dtype=BF16)
    length = cp.array(5, dtype=cp.int32)
    pos = cp.zeros((1,), dtype=cp.int32)
    q = cp.empty((Bsz, 1, H, D), dtype=BF16)
    rope_kv_write(qkv, H, Hkv, kc, vc, length, cos=cos, sin=sin, positions=pos, q_out=q)  # warm up (row 4)
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        length += 1
        cp.subtract(length.reshape(1), 1, out=pos)
        rope_kv_write(qkv, H, Hkv, kc, vc, length, cos=cos, sin=sin, positions=pos, q_out=q)
        g = s.end_capture()
    for _ in range(3):
        g.launch(s)
    s.synchronize()
    assert int(length) == 8
    hk = to_host(kc)
    for row in range(5, 8):  # written with position `row`
        ref = ck.rope(cp.ascontiguousarray(qkv[..., H * D:(H + Hkv) * D]).reshape(Bsz, 1, Hkv, D), cos, sin,
                      positions=cp.array([row], dtype=cp.int32))
        _same_as_composition(hk[:, row:row + 1], ref, BF16, f"row {row}")
    assert np.isnan(hk[:, 8:].astype(np.float32)).all()


def test_rope_kv_write_entry_points_compiled():
    """CPU: the 8 rope_kv_<dtype>_<positions dtype>_<v|s> kernels the launcher names exist in the NVRTC build."""
    from cukernels import _loader, _nvrtc

    if not _nvrtc.available():
        pytest.skip("libnvrtc not installed")
    entries = set(_loader.list_entries("decode_attention", "sm_90"))
    want = {f"rope_kv_{d}_{p}_{v}" for d in ("f32", "bf16") for p in ("i32", "i64") for v in "vs"}
    assert want <= entries, sorted(want - entries)


# ------------------------------------------------------------------------------------- decode_attention_rope
# The fused op: rope_kv_write + decode_attention for one new token in one launch. Its NumPy path is that
# composition; on the GPU it must equal the GPU composition BIT FOR BIT (same q rounding, split count, tiles
# and combine), outputs and caches.
from cukernels.ops.decode_attention import decode_attention_rope  # noqa: E402


def _fused_case(rng, Bsz, H, Hkv, D, Lmax, *, rope=True, pos_kind="batch", Lc=None, amp=1.0):
    """Host qkv [B, 1, C] (times amp), rotary tables and positions (None / [1] int32 / [B, 1] int64)."""
    qkv = (rng.standard_normal((Bsz, 1, (H + 2 * Hkv) * D)) * amp).astype(np.float32).astype(BF16)
    cos = sin = pos = None
    if rope:
        Lc = Lc or Lmax + 8
        cos, sin = ck.rope_cache(Lc, D, 500000.0, xp=np)
        if pos_kind == "seq":
            pos = rng.integers(0, Lc, 1).astype(np.int32)
        elif pos_kind == "batch":
            pos = rng.integers(0, Lc, (Bsz, 1)).astype(np.int64)
    return qkv, cos, sin, pos


@pytest.mark.parametrize("rope, pos_kind", [(True, None), (True, "seq"), (True, "batch"), (False, None)])
@pytest.mark.parametrize("L", [1, 6, 12])
def test_decode_attention_rope_reference_matches_f64(rng, rope, pos_kind, L):
    """The NumPy path against float64 from the definitions (f64_rope_kv, then f64_decode on the bf16-rounded q
    and cache, as the op stores them), a left-padding mask that may drop the new key itself, and the cache:
    row L - 1 written, every other row untouched."""
    Bsz, H, Hkv, D, Lmax = 3, 8, 2, 32, 12
    qkv, cos, sin, pos = _fused_case(rng, Bsz, H, Hkv, D, Lmax, rope=rope, pos_kind=pos_kind)
    k0, v0 = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    kc, vc = k0.copy(), v0.copy()
    mask = left_pad_mask(Bsz, Lmax, [0, 2, L - 1 if L > 1 else 0])
    if L > 1:
        mask[2, L - 1] = False  # row 2: the new key itself is dropped (still appended to the cache)
    o = decode_attention_rope(qkv, H, Hkv, kc, vc, np.array(L, np.int32), cos=cos, sin=sin, positions=pos,
                              key_mask=mask)
    assert o.dtype == BF16 and o.shape == (Bsz, 1, H, D)
    q64, rows = f64_rope_kv(qkv, H, Hkv, L, Lmax, cos, sin, pos)
    kw, vw = k0.copy(), v0.copy()
    for (b, r), (kr, vr) in rows.items():
        kw[b, r], vw[b, r] = kr.astype(np.float32).astype(BF16), vr.astype(np.float32).astype(BF16)
    tol = 2.0**-8
    np.testing.assert_allclose(kc.astype(np.float64), kw.astype(np.float64), rtol=tol, atol=1e-6)
    np.testing.assert_array_equal(vc.astype(np.float32), vw.astype(np.float32))  # v copied exactly
    ref = f64_decode(q64.astype(np.float32).astype(BF16), kw, vw, L, 1 / math.sqrt(D), mask)
    np.testing.assert_allclose(o.astype(np.float64), ref, rtol=2**-7, atol=2e-3)
    if L > 1:  # the fully-padded row 2 (keys 0 .. L - 2 padded, L - 1 dropped) sees nothing
        assert not o[2].astype(np.float32).any()


def test_decode_attention_rope_reference_is_the_composition(rng):
    """The NumPy path is rope_kv_write then decode_attention: same o, same caches, out= used."""
    Bsz, H, Hkv, D, Lmax, L = 2, 12, 12, 64, 9, 7  # GPT-2 heads, no rotary
    qkv, *_ = _fused_case(rng, Bsz, H, Hkv, D, Lmax, rope=False)
    k1, v1 = make_cache(rng, Bsz, Lmax, Hkv, D, L - 1)
    k2, v2 = k1.copy(), v1.copy()
    out = np.full((Bsz, 1, H, D), np.nan, np.float32).astype(BF16)
    assert decode_attention_rope(qkv, H, Hkv, k1, v1, L, scale=0.2, out=out) is out
    q = rope_kv_write(qkv, H, Hkv, k2, v2, L)
    want = decode_attention(q, k2, v2, L, scale=0.2)
    for got, w in ((out, want), (k1, k2), (v1, v2)):
        assert np.array_equal(got.view(np.uint16), w.view(np.uint16))


_FQKV = np.zeros((2, 1, (8 + 2 * 2) * 32), BF16)   # H 8, Hkv 2, D 32
_FKC = np.zeros((2, 10, 2, 32), BF16)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(qkv=_FQKV.astype(np.float32), k_cache=_FKC.astype(np.float32), v_cache=_FKC.astype(np.float32)),
         TypeError, "qkv: expected dtype bfloat16"),
        (dict(qkv=np.zeros((2, 2, 12 * 32), BF16)), ValueError, "qkv: expected one new token"),
        (dict(qkv=np.zeros((2, 12 * 32), BF16)), ValueError, "qkv: expected 3 dimensions"),
        (dict(qkv=np.zeros((2, 1, 12 * 48), BF16), k_cache=np.zeros((2, 10, 2, 48), BF16),
              v_cache=np.zeros((2, 10, 2, 48), BF16)), ValueError, "qkv: head_dim must be one of"),
        (dict(n_heads=3, n_kv_heads=2, qkv=np.zeros((2, 1, 7 * 32), BF16)), ValueError,
         r"n_kv_heads: \(2\) must divide n_heads \(3\)"),
        (dict(k_cache=np.zeros((2, 10, 2, 32), np.float32)), TypeError, "k_cache: expected qkv's dtype"),
        (dict(v_cache=np.zeros((2, 11, 2, 32), BF16)), ValueError, "v_cache: expected shape"),
        (dict(cache_len=11), ValueError, "cache_len: expected 0 <= cache_len <= max_len"),
        (dict(cos=np.ones((4, 16), np.float32)), ValueError, "cos, sin: pass both"),
        (dict(cos=np.ones((4, 16), np.float32), sin=np.ones((4, 16), np.float32),
              positions=np.zeros(2, np.int32)), ValueError, r"positions: expected shape \(1,\) or \(2, 1\)"),
        (dict(key_mask=np.ones((2, 9), np.bool_)), ValueError, "key_mask: expected shape"),
        (dict(key_mask=np.ones((2, 10), np.float32)), TypeError, "key_mask: expected a bool or integer dtype"),
        (dict(scale=-1.0), ValueError, "scale: expected a finite number > 0"),
        (dict(num_splits=0), ValueError, "num_splits: expected an int >= 1"),
        (dict(out=np.zeros((2, 1, 8, 32), np.float32)), TypeError, "out: expected dtype bfloat16"),
        (dict(out=np.zeros((2, 8, 32), BF16)), ValueError, "out: expected shape"),
    ],
)
def test_decode_attention_rope_bad_input(kw, exc, match):
    a = dict(qkv=_FQKV, n_heads=8, n_kv_heads=2, k_cache=_FKC, v_cache=_FKC.copy(), cache_len=3)
    a.update(kw)
    pos = {k: a.pop(k) for k in ("qkv", "n_heads", "n_kv_heads", "k_cache", "v_cache", "cache_len")}
    with pytest.raises(exc, match=match):
        decode_attention_rope(*pos.values(), **a)


def test_decode_attention_rope_entry_points_compiled():
    """CPU: the 9 dattn_rope_d<D>_m<MTB> kernels exist, and before griddepcontrol.wait they store nothing to
    global memory (st.global / atom / red): the PDL rule that the pre-wait part only reads."""
    import re

    from cukernels import _loader, _nvrtc

    if not _nvrtc.available():
        pytest.skip("libnvrtc not installed")
    want = {f"dattn_rope_d{d}_m{m}" for d in DA.HEAD_DIMS for m in (1, 2, 4)}
    entries = set(_loader.list_entries("decode_attention", "sm_90"))
    assert want <= entries, sorted(want - entries)
    ptx = _loader.compile_ptx("decode_attention", "sm_90", entries=sorted(want))
    for name in sorted(want):
        i = ptx.index(f".entry {name}")
        j = ptx.find(".entry", i + 1)
        body = ptx[i:j if j > 0 else len(ptx)]
        assert body.count("griddepcontrol.wait") == 1, name
        pre = body[:body.index("griddepcontrol.wait")]
        assert not re.search(r"\b(st\.global|atom\.|red\.global|st\.async)", pre), f"{name}: writes before the wait"
        assert "cp.async.cg.shared.global" in pre, f"{name}: the cached K/V copies should start before the wait"


def _gpu_fused_vs_composition(qkv_d, H, Hkv, kA, vA, kB, vB, length, cos, sin, pos, mask, splits, wsA, wsB,
                              misalign_out=False):
    """Run the fused op on caches A and the GPU composition on caches B (same inputs); return (o_fused, o_comp)."""
    oA = poisoned((qkv_d.shape[0], 1, H, kA.shape[3]), BF16, misalign=misalign_out)
    r = decode_attention_rope(qkv_d, H, Hkv, kA, vA, length, cos=cos, sin=sin, positions=pos, key_mask=mask,
                              out=oA, num_splits=splits, workspace=wsA)
    assert r is oA
    q = rope_kv_write(qkv_d, H, Hkv, kB, vB, length, cos=cos, sin=sin, positions=pos)
    oB = decode_attention(q, kB, vB, length, key_mask=mask, out=poisoned(oA.shape, BF16), num_splits=splits,
                          workspace=wsB)
    return oA, oB


def _assert_same_bits(a, b, what):
    ha, hb = _bits(a), _bits(b)
    if not np.array_equal(ha, hb):
        bad = np.argwhere(ha != hb)
        raise AssertionError(f"{what}: {len(bad)} elements differ, first at {tuple(bad[0])}: "
                             f"{to_host(a)[tuple(bad[0])]} vs {to_host(b)[tuple(bad[0])]}")


FUSED_SHAPES = [(32, 8, 64, True), (12, 12, 64, False), (128, 1, 32, True), (16, 2, 128, True)]
FUSED_LENS = (0, 1, 2, 63, 64, 65, 130, 200, 256, 257)  # max_len 257: stage boundaries, the newest in tile 0..4


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 2, 3, 7, 40])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}{'' if s[3] else '-norope'}")
@pytest.mark.parametrize("Bsz", [1, 2, 4])
def test_gpu_decode_attention_rope_is_the_composition_bit_for_bit(rng, Bsz, shape, masked, splits):
    """Against rope_kv_write + decode_attention on the GPU at every length 0 .. max_len (same split count):
    o, k_cache and v_cache bit-identical; the cache rows from the newest on and the masked rows hold NaN (the
    newest must be written, the others never read); outputs poisoned (one element off 16 bytes at odd
    lengths); the counters back at 0; and o within bf16 tolerance of the NumPy path. LLaMA (G 4), GPT-2 (no
    rotary), G 128 at D 32 (4 row tiles, 2 row groups: blocks that must not write the cache), D 128."""
    c = cp()
    H, Hkv, D, rope = shape
    Lmax = 257
    qkv, cos, sin, pos = _fused_case(rng, Bsz, H, Hkv, D, Lmax, rope=rope,
                                     pos_kind="batch" if Bsz % 2 == 0 else "seq")
    k0, v0 = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    mask = None
    if masked:
        mask = rng.random((Bsz, Lmax)) > 0.3
        mask[0, :40] = False
        mask[Bsz - 1, :] = False
        mask[Bsz - 1, 62] = True
    qd = c.asarray(qkv)
    cd, sd = (c.asarray(cos), c.asarray(sin)) if rope else (None, None)
    pd = c.asarray(pos) if pos is not None else None
    md = c.asarray(mask) if masked else None
    q_like = c.empty((Bsz, 1, H, D), BF16)
    wsA = decode_attention_workspace(q_like, c.asarray(k0), key_mask=md, num_splits=splits)
    wsB = decode_attention_workspace(q_like, c.asarray(k0), key_mask=md, num_splits=splits)
    s = DA._splits(Bsz, Hkv, D, Lmax, H // Hkv, 1, md, splits)
    length = c.zeros((), c.int32)
    for L in FUSED_LENS:
        hidden = np.zeros((Bsz, Lmax), bool)
        hidden[:, max(L - 1, 0):] = True
        if masked:
            hidden |= ~mask
        k, v = _nan_rows(k0, hidden), _nan_rows(v0, hidden)
        kA, vA, kB, vB = c.asarray(k), c.asarray(v), c.asarray(k), c.asarray(v)
        length.fill(L)
        what = f"splits={splits} ({s}) L={L}"
        oA, oB = _gpu_fused_vs_composition(qd, H, Hkv, kA, vA, kB, vB, length, cd, sd, pd, md, splits, wsA, wsB,
                                           misalign_out=bool(L % 2))
        _assert_same_bits(oA, oB, f"{what}: o")
        _assert_same_bits(kA, kB, f"{what}: k_cache")
        _assert_same_bits(vA, vB, f"{what}: v_cache")
        if s > 1:
            assert not _counters(wsA, Bsz, Hkv, H // Hkv, 1, D, s).any(), f"{what}: counters not reset"
        hk, hv = k.copy(), v.copy()
        ref = decode_attention_rope(qkv, H, Hkv, hk, hv, L, cos=cos, sin=sin, positions=pos, key_mask=mask)
        close(oA, ref.astype(np.float32), what=what)
        if L >= 1:
            np.testing.assert_array_equal(to_host(vA)[:, L - 1].astype(np.float32), hv[:, L - 1].astype(np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("view", ["misaligned", "strided"])
def test_gpu_decode_attention_rope_qkv_views_and_out_of_range_lengths(rng, view):
    """qkv one element off 16 bytes (the 2-byte load path) or a row-strided view of a wider buffer (rows C + 8
    apart), B 3, per-row int64 positions: bit-identical to the composition (which takes rope_kv's element
    path). Then device lengths outside [1, max_len] (no host check can see them): 0 -> zeros and no write;
    max_len + 5 -> attention over the whole cache (clamped) and no write, as the composition does."""
    c = cp()
    Bsz, H, Hkv, D, Lmax = 3, 32, 8, 64, 100
    qkv, cos, sin, pos = _fused_case(rng, Bsz, H, Hkv, D, Lmax, pos_kind="batch")
    qd = device_copy_view(qkv, view == "misaligned")
    cd, sd, pd = c.asarray(cos), c.asarray(sin), c.asarray(pos)
    k0, v0 = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    for L in (37, 0, Lmax + 5, Lmax):
        kA, vA, kB, vB = (c.asarray(x) for x in (k0, v0, k0, v0))
        length = c.array(L, dtype=c.int32)
        oA, oB = _gpu_fused_vs_composition(qd, H, Hkv, kA, vA, kB, vB, length, cd, sd, pd, None, None, None, None)
        _assert_same_bits(oA, oB, f"{view} L={L}: o")
        _assert_same_bits(kA, kB, f"{view} L={L}: k_cache")
        _assert_same_bits(vA, vB, f"{view} L={L}: v_cache")
        if L in (0, Lmax + 5):
            assert np.array_equal(_bits(kA), k0.view(np.uint16)), f"L={L}: the cache was written"
        if L == 0:
            assert not to_host(oA).astype(np.float32).any()
        if L == Lmax + 5:
            close(oA, decode_attention(to_host(rope_kv_write(qd, H, Hkv, c.empty_like(kA), c.empty_like(vA), 0,
                                                             cos=cd, sin=sd, positions=pd)),
                                       k0, v0, Lmax).astype(np.float32), what="clamped length")


@pytest.mark.gpu
def test_gpu_decode_attention_rope_large_scores_and_reruns(rng):
    """A numerical-stability input: qkv x 40 (scores in the thousands: the softmax max subtraction must hold),
    bit-identical to the composition and to a rerun, within tolerance of the NumPy path."""
    c = cp()
    Bsz, H, Hkv, D, Lmax, L = 2, 32, 8, 64, 384, 300
    qkv, cos, sin, pos = _fused_case(rng, Bsz, H, Hkv, D, Lmax, pos_kind="batch", amp=40.0)
    k0, v0 = make_cache(rng, Bsz, Lmax, Hkv, D, L - 1)
    k0 = (k0.astype(np.float32) * 8).astype(BF16)
    qd, cd, sd, pd = c.asarray(qkv), c.asarray(cos), c.asarray(sin), c.asarray(pos)
    kA, vA, kB, vB = (c.asarray(x) for x in (k0, v0, k0, v0))
    length = c.array(L, dtype=c.int32)
    oA, oB = _gpu_fused_vs_composition(qd, H, Hkv, kA, vA, kB, vB, length, cd, sd, pd, None, None, None, None)
    _assert_same_bits(oA, oB, "o")
    again = decode_attention_rope(qd, H, Hkv, kA, vA, length, cos=cd, sin=sd, positions=pd)
    _assert_same_bits(oA, again, "rerun")
    hk, hv = k0.copy(), v0.copy()
    ref = decode_attention_rope(qkv, H, Hkv, hk, hv, L, cos=cos, sin=sin, positions=pos)
    close(oA, ref.astype(np.float32), what="large scores")


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("splits", [None, 3, 7])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gpu_decode_attention_rope_graph_after_a_gemv_growing_length(rng, family, splits, pdl):
    """The decode step's shape of use: per layer ck.gemv writes qkv (a PDL kernel: the fused op's pre-wait part
    overlaps it) and the fused op reads it; length += 1 and positions = length - 1 at the start of the step
    (written >= 2 kernels before any attention, as in generation.py). Three layers sharing one workspace,
    captured once, replayed 12 times from length 58 (crossing the 64-key boundary): every replay's outputs
    bit-identical to the same graph with rope_kv_write + decode_attention, the caches too, counters at 0, and
    within tolerance of the NumPy path at the first and last replay."""
    c = cp()
    if pdl and not _launch.pdl_enabled():
        pytest.skip("programmatic dependent launch needs sm_90")
    H, Hkv, D, rope = (32, 8, 64, True) if family == "llama" else (12, 12, 64, False)
    layers, Bsz, hidden, Lmax, L0 = 3, 2, 256, 384, 58
    C = (H + 2 * Hkv) * D
    x = rng.standard_normal((Bsz, hidden)).astype(np.float32).astype(BF16)
    W = (rng.standard_normal((layers, C, hidden)) / math.sqrt(hidden)).astype(np.float32).astype(BF16)
    k = rng.standard_normal((layers, Bsz, Lmax, Hkv, D)).astype(np.float32).astype(BF16)
    v = rng.standard_normal((layers, Bsz, Lmax, Hkv, D)).astype(np.float32).astype(BF16)
    k[:, :, L0:] = np.nan
    v[:, :, L0:] = np.nan
    mask = np.ones((Bsz, Lmax), np.bool_)
    mask[1, :3] = False
    cos, sin = ck.rope_cache(Lmax, D, xp=np) if rope else (None, None)
    xd, Wd, md = c.asarray(x), c.asarray(W), c.asarray(mask)
    cd, sd = (c.asarray(cos), c.asarray(sin)) if rope else (None, None)
    q_like = c.empty((Bsz, 1, H, D), BF16)

    def setup():
        st = dict(k=c.asarray(k), v=c.asarray(v), length=c.array(L0, dtype=c.int32),
                  pos=c.zeros((1,), c.int32) if rope else None, qkv=[c.empty((Bsz, C), BF16) for _ in range(layers)],
                  q=[c.empty((Bsz, 1, H, D), BF16) for _ in range(layers)],
                  o=[c.empty((Bsz, 1, H, D), BF16) for _ in range(layers)],
                  ws=decode_attention_workspace(q_like, c.asarray(k[0]), key_mask=md, num_splits=splits))
        return st

    def step(st, fused):
        c.add(st["length"], 1, out=st["length"])
        if rope:
            c.subtract(st["length"].reshape(1), 1, out=st["pos"])
        rot = dict(cos=cd, sin=sd, positions=st["pos"]) if rope else {}
        with (_launch.pdl_scope() if pdl else _nullcontext()):
            for i in range(layers):
                qkv = ck.gemv(xd, Wd[i], out=st["qkv"][i]).reshape(Bsz, 1, C)
                if fused:
                    decode_attention_rope(qkv, H, Hkv, st["k"][i], st["v"][i], st["length"], **rot, key_mask=md,
                                          out=st["o"][i], num_splits=splits, workspace=st["ws"])
                else:
                    q = rope_kv_write(qkv, H, Hkv, st["k"][i], st["v"][i], st["length"], **rot, q_out=st["q"][i])
                    decode_attention(q, st["k"][i], st["v"][i], st["length"], key_mask=md, out=st["o"][i],
                                     num_splits=splits, workspace=st["ws"])

    s = c.cuda.Stream(non_blocking=True)
    graphs, states = [], []
    with s:
        for fused in (True, False):
            st = setup()
            scratch = dict(st, k=c.empty_like(st["k"]), v=c.empty_like(st["v"]), length=c.array(L0, c.int32),
                           pos=c.zeros((1,), c.int32) if rope else None)
            step(scratch, fused)  # compile + warm up outside the capture, on scratch caches / length
            s.synchronize()
            s.begin_capture()
            step(st, fused)
            graphs.append(s.end_capture())
            states.append(st)
    A, Bst = states
    for rep in range(12):
        L = L0 + rep + 1
        for st in states:
            for o in st["o"]:
                o.fill(np.nan)
        c.cuda.Device().synchronize()
        for g in graphs:
            g.launch(s)
        s.synchronize()
        assert int(A["length"]) == L and int(Bst["length"]) == L
        for i in range(layers):
            _assert_same_bits(A["o"][i], Bst["o"][i], f"replay {rep} (L={L}) layer {i}")
            if rep in (0, 11):
                hk, hv = to_host(Bst["k"][i]).copy(), to_host(Bst["v"][i]).copy()
                hk[:, L - 1], hv[:, L - 1] = np.nan, np.nan  # (rewritten by the reference from qkv)
                hp = np.array([L - 1], np.int32) if rope else None
                ref = decode_attention_rope(to_host(A["qkv"][i]).reshape(Bsz, 1, C), H, Hkv, hk, hv, L, cos=cos,
                                            sin=sin, positions=hp, key_mask=mask)
                close(A["o"][i], ref.astype(np.float32), what=f"replay {rep} layer {i} vs NumPy")
    _assert_same_bits(A["k"], Bst["k"], "k caches")
    _assert_same_bits(A["v"], Bst["v"], "v caches")
    if A["ws"].size > 1:
        sp = DA._splits(Bsz, Hkv, D, Lmax, H // Hkv, 1, md, splits)
        assert not _counters(A["ws"], Bsz, Hkv, H // Hkv, 1, D, sp).any()



# ------------------------------------------------------------------------------------- sliding windows (issue 37)
# Query t at position p = cache_len - Tq + t sees the cache rows (p - W, p]; the kernels scan [lo, cache_len) with
# lo = max(0, cache_len - Tq + 1 - W) computed on the device, and the split plan divides that range, not max_len.
def _window_lo(L, Tq, W):
    return 0 if W is None else max(0, L - Tq + 1 - W)


def _hidden_rows(Bsz, Lmax, L, Tq, W, mask=None):
    """[B, Lmax] rows no query may read: before the window, at or past the length, dropped by the mask."""
    h = np.zeros((Bsz, Lmax), bool)
    h[:, :_window_lo(L, Tq, W)] = True
    h[:, L:] = True
    if mask is not None:
        h |= np.asarray(mask) == 0
    return h


WINDOW_CPU_CASES = [  # (B, Tq, H, Hkv, D, L, Lmax, W)
    (1, 1, 4, 1, 32, 10, 12, 1),
    (2, 1, 8, 2, 64, 37, 50, 5),
    (3, 4, 6, 3, 64, 20, 21, 3),      # Tq > W: each query sees its own 3 rows, the first query rows 15..17
    (2, 3, 4, 4, 128, 9, 9, 7),
    (1, 5, 2, 1, 32, 3, 8, 2),        # cache_len < Tq: the first queries see nothing
    (2, 2, 8, 2, 64, 30, 40, 35),     # cache_len <= W < max_len: every key (as without a window)
    (2, 2, 8, 2, 64, 30, 40, 100),    # W >= max_len: no window
]


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("case", WINDOW_CPU_CASES)
def test_reference_window_matches_f64(rng, case, masked):
    """The NumPy path against the float64 loop; rows before the window (and masked rows) hold NaN: never read."""
    Bsz, Tq, H, Hkv, D, L, Lmax, W = case
    q = rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k, v = make_cache(rng, Bsz, Lmax, Hkv, D, L)
    mask = left_pad_mask(Bsz, Lmax, [min(b * 3, L) for b in range(Bsz)]) if masked else None
    hidden = _hidden_rows(Bsz, Lmax, L, Tq, W, mask)
    k, v = _nan_rows(k, hidden), _nan_rows(v, hidden)
    o = decode_attention(q, k, v, np.array(L, np.int32), key_mask=mask, window=W)
    assert np.isfinite(o.astype(np.float32)).all()
    ref = f64_decode(q, k, v, L, 1 / math.sqrt(D), mask, window=W)
    np.testing.assert_allclose(o.astype(np.float64), ref, rtol=2**-7, atol=1e-5)
    if W >= L:  # the window drops nothing: the same bits as without one
        k0, v0 = _nan_rows(k, hidden), _nan_rows(v, hidden)
        assert np.array_equal(o.view(np.uint16), decode_attention(q, k0, v0, L, key_mask=mask).view(np.uint16))


def test_reference_window_one_is_the_own_value(rng):
    """W = 1: query t sees only its own row: o[b, t, h] = v[b, L - Tq + t, h // G] exactly (left-padded row:
    zeros where its own row is padding)."""
    Bsz, Tq, H, Hkv, D, L, Lmax = 2, 3, 8, 2, 64, 9, 12
    q = rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k, v = make_cache(rng, Bsz, Lmax, Hkv, D, L)
    mask = left_pad_mask(Bsz, Lmax, [0, 7])  # row 1: query 0 (position 6) is padding itself
    o = decode_attention(q, k, v, L, key_mask=mask, window=1)
    want = np.repeat(v[:, L - Tq:L], H // Hkv, axis=2).astype(np.float32)
    want[1, 0] = 0
    np.testing.assert_array_equal(o.astype(np.float32), want)


def test_span_and_split_plan_follow_the_window():
    """The split plan (and the key_mask floor, the workspace) is made on the keys a launch scans: W + Tq - 1 at
    most, not max_len. The H200 plan of a 4096-key window over a 32768-row cache (B1, 8 K/V heads, D 128: 3
    blocks a SM, 64-key stages of 32 KB) is that of a 4096-row cache: its splits divide the window."""
    assert DA._span(32768, 1, None) == 32768
    assert DA._span(32768, 1, 4096) == 4096 and DA._span(32768, 4, 4096) == 4099
    assert DA._span(100, 1, 4096) == 100
    d128 = dict(stage=64, stage_bytes=64 * 128 * 2 * 2, sms=132, per_sm=3)
    s_full = DA._choose_splits(8, 32768, **d128)
    s_win = DA._choose_splits(8, DA._span(32768, 1, 4096), **d128)
    chunk = -(-(-(-4096 // s_win)) // 64) * 64
    assert chunk * s_win >= 4096 and chunk * (s_win - 1) < 4096, "every split holds window keys"
    t_full = DA._split_time(s_full, 8, 32768, **d128)
    t_win = DA._split_time(s_win, 8, 4096, **d128)
    assert t_win < t_full / 4, (t_full, t_win)  # modelled 36.1 vs 7.4 us (NOTES.md, decode_attention)
    assert DA._window_arg(None, 100) == DA.NO_WINDOW and DA._window_arg(100, 100) == DA.NO_WINDOW
    assert DA._window_arg(99, 100) == 99


def test_windowed_split_count_never_exceeds_the_unwindowed_one(monkeypatch):
    """The split model is not monotone in the key count: on the H200's numbers (132 SMs, 4 blocks a SM of the
    D 64 kernel) one (b, K/V head) takes 64 splits for 4096 keys but 35 for 4418. A 4096-key window over a
    4418-row cache then runs 35 (the unwindowed plan), so a workspace made without ``window`` holds it."""
    from cukernels import _backend

    monkeypatch.setattr(DA, "_split_kernel", lambda D, mtb: (None, DA._smem(D, mtb)))
    monkeypatch.setattr(_backend, "blocks_per_sm", lambda k, threads, smem: 4)
    monkeypatch.setattr(_backend, "sm_count", lambda: 132)
    assert DA._choose_splits(1, 4096, **H200) == 64 and DA._choose_splits(1, 4418, **H200) == 35
    assert DA._splits(1, 1, 64, 4418, 4, 1, None, None) == 35
    assert DA._splits(1, 1, 64, 4418, 4, 1, None, None, window=4096) == 35
    assert DA._splits(1, 1, 64, 8192, 4, 1, None, None, window=4096) == 64  # (8192 keys: 64 as well)
    assert DA._splits(1, 1, 64, 4418, 4, 1, None, None, window=300) == DA._choose_splits(1, 300, **H200)


def test_window_relaxes_the_key_mask_split_floor():
    """With key_mask a split covers at most 8192 keys: of the window, when there is one."""
    q, kc = np.zeros((1, 1, 1, 32), BF16), np.zeros((1, 9000, 1, 32), BF16)
    mask = np.ones((1, 9000), np.bool_)
    decode_attention(q, kc, kc, 9000, key_mask=mask, num_splits=1, window=4096)  # 4096 keys: one split holds them
    with pytest.raises(ValueError, match="need >= 2 splits for max_len 9000"):
        decode_attention(q, kc, kc, 9000, key_mask=mask, num_splits=1)
    with pytest.raises(ValueError, match="need >= 2 splits for a window of 8500 keys"):
        decode_attention(q, kc, kc, 9000, key_mask=mask, num_splits=1, window=8500)


_WBAD = [
    (0, ValueError, "window: expected an integer >= 1"),
    (-2, ValueError, "window: expected an integer >= 1"),
    (2**40, ValueError, "window: expected an integer <= 2147483647"),
    (4.0, TypeError, "window: expected an integer >= 1 .* or None; got"),
    (True, TypeError, "window: expected an integer"),
    ("8", TypeError, "window: expected an integer"),
]


@pytest.mark.parametrize("window, exc, match", _WBAD)
def test_window_bad_input_messages(window, exc, match):
    a = _args()
    with pytest.raises(exc, match=match):
        decode_attention(a["q"], a["k_cache"], a["v_cache"], a["cache_len"], window=window)
    with pytest.raises(exc, match=match):
        decode_attention_workspace(a["q"], a["k_cache"], window=window)
    with pytest.raises(exc, match=match):
        decode_attention_rope(_FQKV, 8, 2, _FKC, _FKC.copy(), 3, window=window)


@pytest.mark.parametrize("W", [1, 3, 6, 40])
def test_decode_attention_rope_window_reference(rng, W):
    """The fused op's NumPy path with a window: the composition (rope_kv_write, then decode_attention with the
    window), and the float64 loop on the rotated q and the written cache."""
    Bsz, H, Hkv, D, Lmax, L = 3, 8, 2, 32, 12, 9
    qkv, cos, sin, pos = _fused_case(rng, Bsz, H, Hkv, D, Lmax, pos_kind="batch")
    k0, v0 = make_cache(rng, Bsz, Lmax, Hkv, D, L - 1)
    mask = left_pad_mask(Bsz, Lmax, [0, 2, 5])
    k1, v1, k2, v2 = k0.copy(), v0.copy(), k0.copy(), v0.copy()
    o = decode_attention_rope(qkv, H, Hkv, k1, v1, L, cos=cos, sin=sin, positions=pos, key_mask=mask, window=W)
    q = rope_kv_write(qkv, H, Hkv, k2, v2, L, cos=cos, sin=sin, positions=pos)
    want = decode_attention(q, k2, v2, L, key_mask=mask, window=W)
    assert np.array_equal(o.view(np.uint16), want.view(np.uint16))
    np.testing.assert_allclose(o.astype(np.float64), f64_decode(q, k2, v2, L, 1 / math.sqrt(D), mask, window=W),
                               rtol=2**-7, atol=2e-3)


# ------------------------------------------------------------------------------------- GPU: windows
WINDOWS = (1, 7, 64, 100, 1000)  # 1; below a 16/32/64-key stage; one stage; a stage and a half; > most lengths
WLENS = (0, 1, 5, 63, 64, 65, 300, 1100)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 3, 40])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("Tq", [1, 4])
@pytest.mark.parametrize("W", WINDOWS)
def test_gpu_window_matches_reference(rng, W, Tq, masked, splits):
    """decode_attention with a window against the reference at lengths 0 .. max_len, the device length, rows
    before the window / past the length / masked holding NaN (a loaded one would leak NaN through P V),
    outputs poisoned (one element off 16 bytes), the workspace from decode_attention_workspace(window=), its
    counters back at zero, a rerun bit-identical."""
    c = cp()
    Bsz, H, Hkv, D, Lmax = 2, 32, 8, 64, 1100
    G = H // Hkv
    q = rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k0, v0 = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    mask = None
    if masked:
        mask = rng.random((Bsz, Lmax)) > 0.3
        mask[1, :70] = False  # left padding
    qd = c.asarray(q)
    md = c.asarray(mask) if masked else None
    ws = decode_attention_workspace(qd, c.asarray(k0), key_mask=md, num_splits=splits, window=W)
    s = DA._splits(Bsz, Hkv, D, Lmax, G, Tq, md, splits, W)
    if splits is None:  # planned on the window, at most the unwindowed plan
        assert s == min(DA._splits(Bsz, Hkv, D, min(Lmax, W + Tq - 1), G, Tq, md, None),
                        DA._splits(Bsz, Hkv, D, Lmax, G, Tq, md, None))
    length = c.zeros((), c.int32)
    for L in WLENS:
        hidden = _hidden_rows(Bsz, Lmax, L, Tq, W, mask)
        k, v = _nan_rows(k0, hidden), _nan_rows(v0, hidden)
        kd, vd = c.asarray(k), c.asarray(v)
        ref = decode_attention(q, k, v, L, key_mask=mask, window=W)
        length.fill(L)
        what = f"W={W} splits={splits} ({s}) L={L}"
        o = poisoned(q.shape, BF16, misalign=bool(L % 2))
        decode_attention(qd, kd, vd, length, key_mask=md, window=W, out=o, num_splits=splits, workspace=ws)
        close(o, ref.astype(np.float32), what=what)
        if s > 1:
            assert not _counters(ws, Bsz, Hkv, G, Tq, D, s).any(), f"{what}: counters not reset"
        again = decode_attention(qd, kd, vd, length, key_mask=md, window=W, num_splits=splits)
        assert np.array_equal(_bits(o), _bits(again)), f"{what}: rerun (pool workspace) not bit-identical"


@pytest.mark.gpu
@pytest.mark.parametrize("W, splits", [(500, None), (100, 2), (100, 7)])
def test_gpu_full_and_window_launches_share_one_workspace(rng, W, splits):
    """A model's full layers and sliding-window layers take turns on one workspace made without ``window`` (what
    the static cache keeps per query shape), with different split counts: the window's own plan (W 500: 8 splits
    against the full layers' 12 on the H200) or forced ones (2, 7). Had the counters followed the partials, one
    launch's partials would cover the other's counters. Every result right, the counters back at zero."""
    c = cp()
    Bsz, Tq, H, Hkv, D, Lmax = 2, 1, 32, 8, 64, 2304
    q = rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k, v = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    qd, kd, vd = c.asarray(q), c.asarray(k), c.asarray(v)
    ws = decode_attention_workspace(qd, kd)
    s_full = DA._splits(Bsz, Hkv, D, Lmax, H // Hkv, Tq, None, None)
    ns = None if splits is None else min(splits, s_full)  # (a forced count past the full plan would not fit)
    s_win = DA._splits(Bsz, Hkv, D, Lmax, H // Hkv, Tq, None, ns, W)
    assert s_win <= s_full and ws.size >= DA._workspace_elems(Bsz, Hkv, H // Hkv, Tq, D, s_win)
    for L in (2000, 150, 2304, 77, 1000):
        length = c.array(L, c.int32)
        for win, n in ((None, None), (W, ns), (None, None), (W, ns)):
            o = decode_attention(qd, kd, vd, length, window=win, num_splits=n, workspace=ws,
                                 out=poisoned(q.shape, BF16))
            close(o, decode_attention(q, k, v, L, window=win).astype(np.float32),
                  what=f"L={L} window={win} splits={s_win if win else s_full}")
            assert not _counters(ws, Bsz, Hkv, H // Hkv, Tq, D, 0).any()


@pytest.mark.gpu
@pytest.mark.parametrize("W", [1, 5, 100])
@pytest.mark.parametrize("shape", [(16, 2, 128, 3), (12, 12, 32, 2), (64, 4, 64, 16)],
                         ids=["g8d128t3", "g1d32t2", "g16d64t16"])  # (H, Hkv, D, Tq): MTB 2; MTB 1; MTB 4 x 4 groups
def test_gpu_window_head_layouts(rng, shape, W):
    """Other head layouts with a window: D 128 (MTB 2 at G 8 x Tq 3), GPT-2's G = 1 at D 32, and G 16 x Tq 16 =
    256 rows (4 row groups of 64, each block re-reading the window's K/V); several splits."""
    H, Hkv, D, Tq = shape
    Bsz, L, Lmax = 2, 700, 777
    for splits in (None, 7):
        *_, ref, o = _gpu_window_case(rng, Bsz, Tq, H, Hkv, D, L, Lmax, W, splits=splits)
        close(o, ref.astype(np.float32), what=f"{shape} W={W} splits={splits}")


def _gpu_window_case(rng, Bsz, Tq, H, Hkv, D, L, Lmax, W, *, mask=None, splits=None):
    """Host inputs with NaN in every row no query may read, the reference, and the kernel's output (poisoned,
    the length on the device)."""
    c = cp()
    q = rng.standard_normal((Bsz, Tq, H, D), dtype=np.float32).astype(BF16)
    k, v = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    hidden = _hidden_rows(Bsz, Lmax, L, Tq, W, mask)
    k, v = _nan_rows(k, hidden), _nan_rows(v, hidden)
    ref = decode_attention(q, k, v, L, key_mask=mask, window=W)
    o = decode_attention(c.asarray(q), c.asarray(k), c.asarray(v), c.array(L, c.int32),
                         key_mask=None if mask is None else c.asarray(mask), window=W, num_splits=splits,
                         out=poisoned(q.shape, BF16))
    return q, k, v, ref, o


@pytest.mark.gpu
@pytest.mark.parametrize("Tq", [1, 3])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_gpu_window_over_a_long_cache_reads_only_the_window(rng, Tq, masked):
    """The benchmark's shape: B1, 32 / 8 heads, D 128, a 4096-key window over a 32768-row cache. Every row
    before the window is NaN: one loaded row would make o NaN. The split plan is the window's."""
    Bsz, H, Hkv, D, Lmax, W = 1, 32, 8, 128, 32768, 4096
    G = H // Hkv
    assert DA._splits(Bsz, Hkv, D, Lmax, G, Tq, None, None, W) == min(
        DA._splits(Bsz, Hkv, D, W + Tq - 1, G, Tq, None, None), DA._splits(Bsz, Hkv, D, Lmax, G, Tq, None, None))
    for L in (Lmax, 20001, W + 1, W, 3):
        mask = None
        if masked:
            mask = np.ones((Bsz, Lmax), np.bool_)
            mask[0, :max(0, L - W + 50)] = False  # padding reaching 50 rows into the window
        _, _, _, ref, o = _gpu_window_case(rng, Bsz, Tq, H, Hkv, D, L, Lmax, W, mask=mask)
        close(o, ref.astype(np.float32), what=f"L={L}")


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["decode_attention", "decode_attention_rope"])
def test_gpu_window_at_least_the_length_is_no_window_bit_for_bit(rng, fused):
    """W >= max_len: the launch is the unwindowed one (same plan, same bits). max_len > W >= cache_len with the
    same forced split count: lo = 0 and no key dropped, so the same bits too (the model's own plan differs there:
    it plans on W, so only the tolerance is checked)."""
    c = cp()
    Bsz, H, Hkv, D, Lmax = 2, 32, 8, 64, 600
    qkv, cos, sin, pos = _fused_case(rng, Bsz, H, Hkv, D, Lmax, pos_kind="batch")
    q = rng.standard_normal((Bsz, 1, H, D), dtype=np.float32).astype(BF16)
    k0, v0 = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    mask = left_pad_mask(Bsz, Lmax, [0, 9])
    qd, md, qkvd = c.asarray(q), c.asarray(mask), c.asarray(qkv)
    cd, sd, pd = c.asarray(cos), c.asarray(sin), c.asarray(pos)

    def run(L, W, splits):
        kd, vd = c.asarray(k0), c.asarray(v0)
        length = c.array(L, c.int32)
        if fused:
            return decode_attention_rope(qkvd, H, Hkv, kd, vd, length, cos=cd, sin=sd, positions=pd, key_mask=md,
                                         window=W, num_splits=splits, out=poisoned((Bsz, 1, H, D), BF16))
        return decode_attention(qd, kd, vd, length, key_mask=md, window=W, num_splits=splits,
                                out=poisoned(q.shape, BF16))

    for L in (1, 64, 333, Lmax):
        base = run(L, None, None)
        for W in (Lmax, Lmax + 1, 2**31 - 1):
            _assert_same_bits(run(L, W, None), base, f"L={L} W={W}")
        for W in sorted({L, L + 1, Lmax - 1}):
            if not L <= W < Lmax:
                continue
            for splits in (1, 3, 40):
                _assert_same_bits(run(L, W, splits), run(L, None, splits), f"L={L} W={W} splits={splits}")
            close(run(L, W, None), to_host(base).astype(np.float32), what=f"L={L} W={W} (model's split count)")


FUSED_WINDOWS = (1, 5, 64, 100, 300)  # 300 >= max_len 257: no window


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 3, 40])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("W", FUSED_WINDOWS)
@pytest.mark.parametrize("shape", FUSED_SHAPES[:2] + FUSED_SHAPES[3:],
                         ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}{'' if s[3] else '-norope'}")
def test_gpu_decode_attention_rope_window_is_the_composition_bit_for_bit(rng, shape, W, masked, splits):
    """decode_attention_rope with a window against rope_kv_write + decode_attention(window=) on the GPU at every
    length 0 .. max_len: o and both caches bit-identical, rows before the window (as well as the newest and the
    masked rows) NaN in the input caches, the counters back at zero, o within tolerance of the NumPy path."""
    c = cp()
    H, Hkv, D, rope = shape
    Bsz, Lmax = 2, 257
    qkv, cos, sin, pos = _fused_case(rng, Bsz, H, Hkv, D, Lmax, rope=rope, pos_kind="batch")
    k0, v0 = make_cache(rng, Bsz, Lmax, Hkv, D, Lmax, poison=False)
    mask = None
    if masked:
        mask = rng.random((Bsz, Lmax)) > 0.3
        mask[0, :40] = False
    qd = c.asarray(qkv)
    cd, sd = (c.asarray(cos), c.asarray(sin)) if rope else (None, None)
    pd = c.asarray(pos) if pos is not None else None
    md = c.asarray(mask) if masked else None
    q_like = c.empty((Bsz, 1, H, D), BF16)
    wsA = decode_attention_workspace(q_like, c.asarray(k0), key_mask=md, num_splits=splits, window=W)
    wsB = decode_attention_workspace(q_like, c.asarray(k0), key_mask=md, num_splits=splits, window=W)
    s = DA._splits(Bsz, Hkv, D, Lmax, H // Hkv, 1, md, splits, W)
    length = c.zeros((), c.int32)
    for L in FUSED_LENS:
        hidden = _hidden_rows(Bsz, Lmax, L, 1, W, mask)
        hidden[:, max(L - 1, 0):] = True  # the newest row comes from qkv
        k, v = _nan_rows(k0, hidden), _nan_rows(v0, hidden)
        kA, vA, kB, vB = c.asarray(k), c.asarray(v), c.asarray(k), c.asarray(v)
        length.fill(L)
        what = f"W={W} splits={splits} ({s}) L={L}"
        oA = poisoned((Bsz, 1, H, D), BF16, misalign=bool(L % 2))
        decode_attention_rope(qd, H, Hkv, kA, vA, length, cos=cd, sin=sd, positions=pd, key_mask=md, window=W,
                              out=oA, num_splits=splits, workspace=wsA)
        qB = rope_kv_write(qd, H, Hkv, kB, vB, length, cos=cd, sin=sd, positions=pd)
        oB = decode_attention(qB, kB, vB, length, key_mask=md, window=W, out=poisoned(oA.shape, BF16),
                              num_splits=splits, workspace=wsB)
        _assert_same_bits(oA, oB, f"{what}: o")
        _assert_same_bits(kA, kB, f"{what}: k_cache")
        _assert_same_bits(vA, vB, f"{what}: v_cache")
        if s > 1:
            assert not _counters(wsA, Bsz, Hkv, H // Hkv, 1, D, s).any(), f"{what}: counters not reset"
        ref = decode_attention_rope(qkv, H, Hkv, k.copy(), v.copy(), L, cos=cos, sin=sin, positions=pos,
                                    key_mask=mask, window=W)
        close(oA, ref.astype(np.float32), what=what)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("fused, pdl", [(False, False), (False, True), (True, False)],
                         ids=["decode_attention", "decode_attention-pdl", "decode_attention_rope"])
def test_gpu_window_graph_replay_moves_the_window_on_the_device(rng, fused, splits, pdl):
    """One captured step (length += 1, then per layer the append and the windowed attention, one workspace),
    replayed 16 times from length 142 with W = 150: the window start leaves row 0 at length 151 and then moves
    one row a replay, computed on the device from the length; the rows before it turn NaN as it passes (the
    replay must not read them). Every replay's outputs are those of its length. (The fused op under PDL reads
    the length before its wait, so the kernel right before it must not write the length: the existing
    test_gpu_decode_attention_rope_graph_after_a_gemv_growing_length covers that shape of use, a GEMV between.)"""
    c = cp()
    if pdl and not _launch.pdl_enabled():
        pytest.skip("programmatic dependent launch needs sm_90")
    layers, Bsz, H, Hkv, D, Lmax, L0, W = 2, 2, 32, 8, 64, 384, 142, 150
    q = rng.standard_normal((layers, Bsz, 1, H, D), dtype=np.float32).astype(BF16)
    qkv = rng.standard_normal((layers, Bsz, 1, (H + 2 * Hkv) * D), dtype=np.float32).astype(BF16)
    k = rng.standard_normal((layers, Bsz, Lmax, Hkv, D), dtype=np.float32).astype(BF16)
    v = rng.standard_normal((layers, Bsz, Lmax, Hkv, D), dtype=np.float32).astype(BF16)
    knew = rng.standard_normal((layers, Bsz, 1, Hkv, D), dtype=np.float32).astype(BF16)
    vnew = rng.standard_normal((layers, Bsz, 1, Hkv, D), dtype=np.float32).astype(BF16)
    k[:, :, L0:] = np.nan
    v[:, :, L0:] = np.nan
    mask = np.ones((Bsz, Lmax), np.bool_)
    mask[1, :3] = False
    qd, kd, vd, knd, vnd, md, qkvd = (c.asarray(x) for x in (q, k, v, knew, vnew, mask, qkv))
    ws = decode_attention_workspace(qd[0], kd[0], key_mask=md, num_splits=splits, window=W)
    outs = [c.empty((Bsz, 1, H, D), BF16) for _ in range(layers)]
    length = c.array(L0, dtype=c.int32)

    def step(kk, vv, ln):
        c.add(ln, 1, out=ln)
        for i in range(layers):
            with (_launch.pdl_scope() if pdl else _nullcontext()):
                if fused:
                    decode_attention_rope(qkvd[i], H, Hkv, kk[i], vv[i], ln, key_mask=md, window=W, out=outs[i],
                                          num_splits=splits, workspace=ws)
                else:
                    ck.kv_cache_write(knd[i], kk[i], ln)
                    ck.kv_cache_write(vnd[i], vv[i], ln)
                    decode_attention(qd[i], kk[i], vv[i], ln, key_mask=md, window=W, out=outs[i],
                                     num_splits=splits, workspace=ws)

    s = c.cuda.Stream(non_blocking=True)
    with s:  # compile + warm up outside the capture on scratch caches and length
        step(c.empty_like(kd), c.empty_like(vd), c.array(L0, c.int32))
        s.synchronize()
        s.begin_capture()
        step(kd, vd, length)
        g = s.end_capture()
    for rep in range(16):
        L = L0 + rep + 1
        lo = max(0, L - W)
        kd[:, :, :lo] = np.nan  # rows the window has left: never read again
        vd[:, :, :lo] = np.nan
        for o in outs:
            o.fill(np.nan)
        c.cuda.Device().synchronize()
        g.launch(s)
        s.synchronize()
        assert int(length) == L
        hk, hv = to_host(kd), to_host(vd)
        for i in range(layers):
            if fused:
                hk[i, :, L - 1] = hv[i, :, L - 1] = np.nan  # (the reference rewrites the newest row from qkv)
                ref = decode_attention_rope(qkv[i], H, Hkv, hk[i], hv[i], L, key_mask=mask, window=W)
            else:
                ref = decode_attention(q[i], hk[i], hv[i], L, key_mask=mask, window=W)
            close(outs[i], ref.astype(np.float32), what=f"replay {rep} (L={L}) layer {i}")
    if ws.size > 1:
        sp = DA._splits(Bsz, Hkv, D, Lmax, H // Hkv, 1, md, splits, W)
        assert not _counters(ws, Bsz, Hkv, H // Hkv, 1, D, sp).any()
