"""decode_attention (flash-decoding against a static KV cache): the NumPy reference against an independent float64
loop (CPU), the split-KV kernels against the reference (GPU): GQA / MHA / GPT-2 head layouts, several new tokens,
a NaN-poisoned cache tail, left-padding masks, strided cache views, the length on the device, CUDA graphs."""
import math

import numpy as np
import pytest

import cukernels as ck
from cukernels.ops.decode_attention import decode_attention, decode_attention_workspace
from helpers import cp, to_host

BF16 = ck.bfloat16


def f64_decode(q, k, v, L, scale, key_mask=None):
    """Per (batch, token, head) loop in float64, written from the definition: query t sits at position
    L - Tq + t and sees keys n <= that position, n < L, key_mask[b, n] != 0; none visible: zeros."""
    Bsz, Tq, H, D = q.shape
    Hkv = k.shape[2]
    o = np.zeros((Bsz, Tq, H, D))
    for b in range(Bsz):
        for t in range(Tq):
            n = np.arange(L)
            n = n[n <= L - Tq + t]
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
