"""Decode attention against a static KV cache (flash-decoding, split-KV): ``decode_attention``; the cache append
(``kv_cache_write``), the rotary + append of a packed projection (``rope_kv_write``), and both fused into the
attention launch for one new token (``decode_attention_rope``). Kernels: ``kernels_cu/decode_attention.cu``."""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from .. import _backend as B
from .._loader import get_function
from . import _launch
from ._attention import gqa_shapes
from .rope import check_tables

FAMILY = "decode_attention"
HEAD_DIMS = (32, 64, 128)
THREADS = 128   # 4 warps (NW in decode_attention.cu)
BN = 16         # keys per warp per stage
MASK_CHUNK = 8192  # with key_mask, a split covers at most this many keys (its mask bits live in shared memory)
MASK_WORDS = (MASK_CHUNK + 128) // 32
MASK_DTYPES = tuple(np.dtype(d) for d in (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                                          np.int64, np.uint64))


def _row_tiles(G, Tq):
    """(row tiles of 16 per block MTB, row groups RG) for R = G * Tq rows per K/V head."""
    mt = -(-(G * Tq) // 16)
    mtb = 1 if mt == 1 else 2 if mt == 2 else 4
    return mtb, -(-mt // mtb)


def _smem(D, mtb):
    """Dynamic shared memory of dattn_split_d<D>_m<mtb> (Layout<D, MTB> in decode_attention.cu)."""
    LD, stage = D + 8, (4 // mtb) * BN
    q_bytes = mtb * 16 * LD * 2
    kv_bytes = 2 * 2 * stage * LD * 2
    merge_bytes = (4 * 32 + 4 * 16 * (D + 4)) * 4
    return q_bytes + max(kv_bytes, merge_bytes) + MASK_WORDS * 4


def _split_kernel(D, mtb):
    smem = _smem(D, mtb)
    return _launch.with_smem(get_function(FAMILY, f"dattn_split_d{D}_m{mtb}"), smem), smem


def _check_4d(name, a, hint):
    B.check_dtype(name, a, (B.bfloat16,))
    if a.ndim != 4:
        raise ValueError(f"{name}: expected 4 dimensions {hint}; got shape {tuple(a.shape)}")


def _strides(name, a):
    """Element strides (batch, token, head) of a [B, T, heads, D] view the kernel reads in place (an axis of
    length 1 is never stepped along: its stride is taken as 0, whatever the view says)."""
    isz = a.itemsize
    if a.shape[3] > 1 and a.strides[3] != isz:
        raise ValueError(f"{name}: the last axis (head_dim) must be contiguous; got strides {a.strides}")
    st = [s if n > 1 else 0 for s, n in zip(a.strides[:3], a.shape[:3])]
    if a.size and (a.data.ptr % 16 or any(s % 16 for s in st)):
        raise ValueError(f"{name}: the kernel reads 16-byte chunks: the data pointer and the batch / token / head "
                         f"strides must be multiples of 16 bytes; got pointer offset {a.data.ptr % 16}, strides "
                         f"{a.strides} (use a contiguous copy)")
    return tuple(np.int64(s // isz) for s in st)


def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


NO_WINDOW = 2**31 - 1  # the kernels' "no sliding window" (DArgs::window): every key n <= p_t is within it


def _span(Lmax, Tq, window):
    """The most keys one launch scans per (batch, K/V head): max_len, or with a sliding window W the W + Tq - 1
    positions from the first query's window start to the last query (fewer when max_len is shorter). The split
    plan, the key_mask split floor and the workspace size follow this, not max_len."""
    return Lmax if window is None else min(Lmax, window + Tq - 1)


def _window_arg(window, Lmax):
    """The kernels' window argument: NO_WINDOW for None and for W >= max_len (no position p < max_len has a key
    p - n >= W, so those launches are exactly the unwindowed ones), else W."""
    return np.int32(NO_WINDOW if window is None or window >= Lmax else window)


def _validate_options(key_mask, Bsz, Lmax, D, scale, num_splits, span=None):
    """key_mask, scale and num_splits of decode_attention / decode_attention_rope; returns the scale (fp32).
    ``span``: the keys a launch scans at most (:func:`_span`; default max_len)."""
    span = Lmax if span is None else span
    if key_mask is not None:
        if key_mask.dtype not in MASK_DTYPES:
            raise TypeError(f"key_mask: expected a bool or integer dtype (nonzero = keep); got {key_mask.dtype}")
        B.check_shape("key_mask", key_mask, (Bsz, Lmax), " ([batch, max_len])")
        if key_mask.size and Lmax > 1 and key_mask.strides[1] != key_mask.itemsize:
            raise ValueError(f"key_mask: the last axis must be contiguous; got strides {key_mask.strides}")
        if Bsz > 1 and key_mask.strides[0] % key_mask.itemsize:
            raise ValueError(f"key_mask: the row stride must be a whole number of elements; got {key_mask.strides}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    scale = B.scalar_f32("scale", scale)
    if not (np.isfinite(scale) and scale > 0):  # the kernel takes the row max of the unscaled scores
        raise ValueError(f"scale: expected a finite number > 0; got {scale}")
    if num_splits is not None:
        if not _is_int(num_splits):
            raise TypeError(f"num_splits: expected an int >= 1 or None; got {B._got(num_splits)}")
        if int(num_splits) < 1:
            raise ValueError(f"num_splits: expected an int >= 1 or None; got {num_splits!r}")
        B.check_size("num_splits", num_splits)  # (a kernel argument: at most 2**31 - 1)
        if key_mask is not None and -(-span // int(num_splits)) > MASK_CHUNK:
            what = f"max_len {Lmax}" if span == Lmax else f"a window of {span} keys"
            raise ValueError(f"num_splits: with key_mask a split covers at most {MASK_CHUNK} keys: need "
                             f">= {-(-span // MASK_CHUNK)} splits for {what}; got {int(num_splits)}")
    return scale


def _validate(q, k_cache, v_cache, cache_len, scale, key_mask, num_splits, window=None):
    _check_4d("q", q, "[batch, new_tokens, heads, head_dim]")
    _check_4d("k_cache", k_cache, "[batch, max_len, kv_heads, head_dim]")
    _check_4d("v_cache", v_cache, "[batch, max_len, kv_heads, head_dim]")
    Bsz, Tq, H, D, Lmax, Hkv = gqa_shapes(q, k_cache, v_cache, HEAD_DIMS, k_name="k_cache", v_name="v_cache",
                                          len_name="max_len")
    if Lmax >= 2**31:
        raise ValueError(f"k_cache: max_len must be < 2**31; got {Lmax}")
    _check_cache_len(cache_len, Lmax)
    scale = _validate_options(key_mask, Bsz, Lmax, D, scale, num_splits, _span(Lmax, Tq, window))
    return Bsz, Tq, H, Hkv, D, Lmax, scale


# ---- split count: a latency / bandwidth model of one launch (NOTES.md "Decode attention in one kernel").
# The blocks of one wave run concurrently, so a block's fixed cost is paid once on the critical path, not once per
# block; what splitting buys is a shorter serial chain of K/V stages per block, until the blocks of one SM
# share its bandwidth or spill into a second wave, plus the combine that any split count > 1 adds:
#   t(s) = waves * (FIXED_US + stages * max(STAGE_US, k * stage_bytes / SM_GBS)) + [s > 1] (COMBINE_US + s * PART_US)
# s splits of chunk = ceil(max_len / s) rounded up to a stage, n = ceil(max_len / chunk) of them live at full
# length, N = units * n blocks (units = batch * kv_heads * row groups), k = min(ceil(N / SMs), blocks per SM)
# blocks sharing an SM, waves = ceil(N / (SMs * blocks per SM)). Constants (H200, from session 4-5 numbers):
FIXED_US = 2.0     # launch + the cache_len, key_mask / Q and first-stage DRAM round trips + merge + stores
STAGE_US = 0.7     # a lone block's next 64-key stage: one loaded DRAM round trip (one stage in flight ahead)
SM_GBS = 32.0e3    # bytes per us an SM gets when its blocks saturate HBM: 4232 GB/s copy / 132 SMs
COMBINE_US = 1.0   # the last block's fence + counter atomic + partial re-read: three dependent L2 round trips
PART_US = 0.02     # + per split in the combine's ordered loop (4 splits' loads in flight per L2 round trip)


def _split_time(s, units, Lmax, stage, stage_bytes, sms, per_sm):
    """Modelled microseconds of one launch with ``s`` splits at cache length ``Lmax`` (the model above)."""
    chunk = -(-(-(-Lmax // s)) // stage) * stage
    live = -(-Lmax // chunk)
    n_blocks = units * live
    k = min(-(-n_blocks // sms), per_sm)
    waves = -(-n_blocks // (sms * per_sm))
    t = waves * (FIXED_US + (chunk // stage) * max(STAGE_US, k * stage_bytes / SM_GBS))
    return t + (COMBINE_US + s * PART_US if s > 1 else 0.0)


@functools.lru_cache(maxsize=1024)
def _choose_splits(units, Lmax, stage, stage_bytes, sms, per_sm, min_splits=1):
    """The split count in [min_splits, min(ceil(Lmax / stage), two waves)] of least modelled time (ties: the
    fewest splits).
    Pure host arithmetic (cached): units = batch * kv_heads * row groups, stage = keys per K/V stage,
    stage_bytes = its K + V bytes, sms / per_sm = the device's SMs and this kernel's resident blocks per SM."""
    if Lmax <= stage:
        return max(1, min_splits)
    # Past two full waves of blocks every extra split adds a wave's fixed cost for stages the SMs' shared
    # bandwidth already bounds: the search stops there (a bounded loop for any max_len < 2^31).
    top = min(-(-Lmax // stage), -(-2 * sms * per_sm // units))
    best, best_t = None, None
    for s in range(max(1, min_splits), max(min_splits, top) + 1):
        t = _split_time(s, units, Lmax, stage, stage_bytes, sms, per_sm)
        if best_t is None or t < best_t - 1e-9:
            best, best_t = s, t
    return best


def _splits(Bsz, Hkv, D, Lmax, G, Tq, key_mask, num_splits, window=None):
    """Key splits per (batch, K/V head): ``num_splits`` when given, else the model's choice from the longest key
    range a launch scans (max_len, or with a sliding window min(max_len, window + Tq - 1): the current length
    lives on the device, the window start is computed there); with key_mask at least ceil(that / MASK_CHUNK).
    A 4096-key window over a 32768-row cache plans for 4096 keys: its splits divide the window, not the cache."""
    if num_splits is not None:
        return int(num_splits)
    span = _span(Lmax, Tq, window)
    mtb, rg = _row_tiles(G, Tq)
    stage = (4 // mtb) * BN
    k, smem = _split_kernel(D, mtb)
    per_sm = B.blocks_per_sm(k, THREADS, smem)
    plan = functools.partial(_choose_splits, max(1, Bsz * Hkv * rg), stage=stage, stage_bytes=stage * D * 2 * 2,
                             sms=B.sm_count(), per_sm=per_sm)
    s = plan(span, min_splits=-(-span // MASK_CHUNK) if key_mask is not None else 1)
    if span < Lmax:
        # At most the unwindowed plan: the model is not monotone in the key count (4418 keys can take fewer
        # splits than 4096), and a workspace made without ``window`` (one buffer for a model's full and sliding
        # layers) must hold every windowed launch of those shapes. Modelled cost <= 2.5 % over D 32-128, 1-256
        # (b, K/V head) units, max_len 512-131072, windows 128-8192.
        s = min(s, plan(Lmax, min_splits=-(-Lmax // MASK_CHUNK) if key_mask is not None else 1))
    return s


def _partial_elems(Bsz, Hkv, G, Tq, D, splits):
    """fp32 elements of the split partials (acc, then (m, l)); 0 with one split."""
    return 0 if splits == 1 else Bsz * Hkv * splits * G * Tq * (D + 2)


def _counter_elems(Bsz, Hkv, G, Tq):
    """The int32 counters at the start of the workspace, one per (batch, K/V head, row group), padded to a
    multiple of 4 (the partials after them are read as 16-byte float4)."""
    return -(-Bsz * Hkv * _row_tiles(G, Tq)[1] // 4) * 4


def _workspace_elems(Bsz, Hkv, G, Tq, D, splits):
    """The counters (4 bytes each, as float32 elements; first, at a place no split count moves) plus the
    partials; 0 with one split."""
    if splits == 1:
        return 0
    return _counter_elems(Bsz, Hkv, G, Tq) + _partial_elems(Bsz, Hkv, G, Tq, D, splits)


def _workspace(xp, workspace, Bsz, Hkv, G, Tq, D, splits):
    """The launch's workspace: ``workspace`` after validation, else a pool temporary with zeroed counters (None
    with one split)."""
    need = _workspace_elems(Bsz, Hkv, G, Tq, D, splits)
    if workspace is not None:
        B.check_dtype("workspace", workspace, (np.float32,))
        B.check_contiguous("workspace", workspace)
        if workspace.size < need or workspace.data.ptr % 16:
            raise ValueError(f"workspace: expected a 16-byte aligned float32 buffer of >= {need} elements "
                             f"(decode_attention_workspace: partials + counters); got {workspace.size} at "
                             f"pointer offset {workspace.data.ptr % 16}")
        return workspace
    if need:
        ws = xp.empty((need,), dtype=np.float32)
        B.zero_(ws[:_counter_elems(Bsz, Hkv, G, Tq)])  # the counters start at zero
        return ws
    return None


def _len_args(cache_len):
    """(device pointer or null, host value) of cache_len for the kernels: a device scalar is read by the kernel."""
    dev = B._kind(cache_len) is not None
    return (_launch.ptr(cache_len) if dev else B.NULL, np.int32(0 if dev else int(cache_len)))


def _mask_args(key_mask, Bsz):
    """(pointer, row stride in elements, element bytes) of key_mask for the kernels; null without one."""
    if key_mask is None:
        return B.NULL, np.int64(0), np.int32(1)
    mrow = key_mask.strides[0] // key_mask.itemsize if Bsz > 1 else 0
    return _launch.ptr(key_mask), np.int64(mrow), np.int32(key_mask.itemsize)


@B.interop
def decode_attention_workspace(q, k_cache, *, key_mask=None, num_splits=None, window=None):
    """A zero-initialised float32 buffer for :func:`decode_attention`'s split partials and its last-block
    counters with these shapes (and the same ``key_mask`` / ``num_splits`` / ``window``: the split count is
    planned on the window), for a captured decode step that must not allocate: pass it as ``workspace=``. Size:
    ``batch * kv_heads * row_groups`` int32 counters first (padded to a multiple of 4), then ``batch * kv_heads *
    splits * heads/kv_heads * new_tokens * (head_dim + 2)`` partials. A buffer made without ``window`` also
    serves the windowed launches of the same shapes (their split count never exceeds the unwindowed one, and the
    counters do not move with it), so a model's full and sliding-window layers may share one.

    The counters must be zero when a launch starts; every launch leaves them zero again (the last block of each
    group resets its counter), so the buffer may be reused by any number of calls one after the other on one
    stream (e.g. every layer of a decode step, and every replay of its graph) -- but never by two calls that
    may run at the same time (two streams, or two graphs in flight): they would count each other's blocks. If a
    launch was aborted (a device error), zero the buffer again."""
    xp = B.array_module(q=q, k_cache=k_cache, key_mask=key_mask)
    Bsz, Tq, H, D = (int(s) for s in q.shape)
    Lmax, Hkv = int(k_cache.shape[1]), int(k_cache.shape[2])
    window = B.check_window(window)
    if xp is np:
        return np.zeros((1,), dtype=np.float32)
    _validate(q, k_cache, k_cache, 0, None, key_mask, num_splits, window)
    s = _splits(Bsz, Hkv, D, Lmax, H // Hkv, Tq, key_mask, num_splits, window)
    return xp.zeros((max(1, _workspace_elems(Bsz, Hkv, H // Hkv, Tq, D, s)),), dtype=np.float32)


def _reference(q, k_cache, v_cache, L, scale, key_mask, o, window=None):
    """NumPy path: fp32 scores of the visible keys only (the cache tail past L, and with a window the rows
    before the first query's window, are never touched). The G query heads of a K/V head and the Tq tokens are
    the rows of one [G * Tq, L - lo] score matrix, as in the kernel."""
    Bsz, Tq, H, D = q.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv
    lo = 0 if window is None else max(0, L - Tq + 1 - window)
    if L == lo or Bsz * Tq * H == 0:
        o[...] = 0
        return o
    keep = np.ones((Bsz, L - lo), dtype=bool) if key_mask is None else (np.asarray(key_mask)[:, lo:L] != 0)
    # Masked rows may hold anything (NaN): zero them so that 0 * NaN never reaches o.
    kf = np.where(keep[:, :, None, None], k_cache[:, lo:L].astype(np.float32), np.float32(0))
    vf = np.where(keep[:, :, None, None], v_cache[:, lo:L].astype(np.float32), np.float32(0))
    kf = kf.transpose(0, 2, 3, 1)  # [B, Hkv, D, L]
    vf = vf.transpose(0, 2, 1, 3)  # [B, Hkv, L, D]
    # rows r = t * G + g of K/V head j: q[b, t, j * G + g]
    qg = q.astype(np.float32).reshape(Bsz, Tq, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(Bsz, Hkv, Tq * G, D)
    s = np.matmul(qg, kf) * np.float32(scale)  # [B, Hkv, Tq * G, L]
    pos = np.repeat(L - Tq + np.arange(Tq), G)  # row r's position
    n = np.arange(lo, L)[None, :]
    vis = n <= pos[:, None]
    if window is not None:
        vis &= pos[:, None] - n < window
    vis = vis[None, None] & keep[:, None, None, :]
    s = np.where(vis, s, np.float32(-np.inf))
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(np.float32)
    p = np.where(vis, np.exp(s - m), 0).astype(np.float32)
    den = p.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        res = np.where(den > 0, np.matmul(p, vf) / np.where(den > 0, den, 1), 0)  # [B, Hkv, Tq * G, D]
    o[...] = res.reshape(Bsz, Hkv, Tq, G, D).transpose(0, 2, 1, 3, 4).reshape(Bsz, Tq, H, D).astype(B.bfloat16)
    return o


@B.interop
def decode_attention(q, k_cache, v_cache, cache_len, *, scale=None, key_mask=None, window=None, out=None,
                     num_splits=None, workspace=None):
    """Attention of a few new query tokens against a static KV cache (flash-decoding, split-KV), bf16.

    The new tokens sit at positions ``cache_len - Tq .. cache_len - 1`` and their K/V are already written there.
    Query ``t`` (head ``h``, K/V head ``h // G``, ``G = heads / kv_heads``) at position ``p = cache_len - Tq + t``
    attends to keys ``n <= p`` (all of ``[0, cache_len)`` for the last query) with ``key_mask[b, n] != 0`` and,
    with a sliding ``window`` W, ``p - n < W`` (the rows ``(p - W, p]``: at most W keys, itself included;
    Hugging Face's ``kv_idx > q_idx - sliding_window``)::

        o[b, t, h] = sum_n softmax_n(scale * <q[b, t, h], k_cache[b, n, h // G]>) v_cache[b, n, h // G]

    A query that sees no key gets ``o = 0``. Keys at or past ``cache_len`` are never read (the cache tail may
    hold anything, NaN included), nor are keys the mask drops, nor rows before the first query's window (the
    split-KV plan divides the window, not the cache: a 4096-key window over a 32768-row cache reads 4096 rows).
    fp32 softmax and accumulation; the probabilities enter the P V product rounded to bf16 (tensor cores), as in
    :func:`flash_attention`.

    ``cache_len`` may be a 0-d int32 device array: the kernels read it on the device (clamped to
    ``[0, max_len]``), so a decode step captured once in a CUDA graph stays valid as the length grows. One
    launch: the key range is split across blocks (``num_splits``, chosen from ``max_len``, the SM count and a
    latency / bandwidth model) and the last block of each (batch, K/V head) to finish -- found with an int
    counter in the workspace -- combines the per-split partials, splits in a fixed order (bit-identical
    reruns); with one split each block writes ``o`` directly. On Hopper it is launched with programmatic
    dependent launch inside ``_launch.pdl_scope()`` (the fused decode step).

    Args:
        q: bfloat16 ``[batch, new_tokens, heads, head_dim]``, head_dim 32, 64 or 128.
        k_cache, v_cache: bfloat16 ``[batch, max_len, kv_heads, head_dim]``, kv_heads dividing heads: e.g. one
            layer's slice of a ``[layers, batch, max_len, kv_heads, head_dim]`` cache. q, k_cache and v_cache
            may be strided views: last axis contiguous, data pointer and the other strides multiples of 16 bytes.
        cache_len: the number of valid keys (including the new tokens): an int in ``[0, max_len]`` or a 0-d int32
            array.
        scale: the score multiplier, > 0; default ``1 / sqrt(head_dim)``.
        key_mask: optional ``[batch, max_len]`` bool or integer array, nonzero = keep (left padding of batched
            prompts); last axis contiguous, read in place.
        window: None (every earlier key) or an int >= 1: the sliding window in positions (padded rows count, as
            in transformers); the window start is computed on the device from ``cache_len`` (graph-capturable).
            ``window >= max_len`` is the same as None.
        out: optional C-contiguous bfloat16 buffer of q's shape.
        num_splits: override the number of key splits (tests, tuning); with ``key_mask`` a split may cover at
            most 8192 keys (of the window, with one).
        workspace: optional float32 buffer from :func:`decode_attention_workspace` (same shapes and options,
            ``window`` included;
            its counters zero, as that function returns them and every launch leaves them; not shared by two
            calls in flight at once): without it the split partials take a memory-pool temporary whose counters
            are zeroed (a memset) before the launch, which a captured graph must not rely on.

    Returns:
        ``o``: C-contiguous bfloat16 ``[batch, new_tokens, heads, head_dim]``.

    Example::

        >>> kc = cp.zeros((16, 1, 2048, 8, 64), ck.bfloat16); vc = cp.zeros_like(kc)   # [layers, B, L, Hkv, D]
        >>> length = cp.array(129, dtype=cp.int32)                 # 128 prompt tokens + the new one
        >>> o = ck.decode_attention(q, kc[3], vc[3], length)       # q: [1, 1, 32, 64]
    """
    xp = B.array_module(q=q, k_cache=k_cache, v_cache=v_cache, key_mask=key_mask, out=out, workspace=workspace,
                        cache_len=cache_len if B._kind(cache_len) is not None else None)
    window = B.check_window(window)
    Bsz, Tq, H, Hkv, D, Lmax, scale = _validate(q, k_cache, v_cache, cache_len, scale, key_mask, num_splits, window)
    o = B.empty(xp, q.shape, B.bfloat16, out)
    if xp is np:
        return _reference(q, k_cache, v_cache, min(max(int(cache_len), 0), Lmax), scale, key_mask, o,
                          None if window is None or window >= Lmax else window)
    G = H // Hkv
    if Bsz * Tq * H == 0:
        return o
    if Bsz > 65535:
        raise ValueError(f"q: batch must be <= 65535 (the kernel's grid z); got {Bsz}")
    mtb, rg = _row_tiles(G, Tq)
    if Hkv * rg > 65535:
        raise ValueError(f"k_cache: kv_heads * row groups ({Hkv} * {rg}) must be <= 65535")
    sq, sk, sv = _strides("q", q), _strides("k_cache", k_cache), _strides("v_cache", v_cache)
    splits = _splits(Bsz, Hkv, D, Lmax, G, Tq, key_mask, num_splits, window)
    ws = _workspace(xp, workspace, Bsz, Hkv, G, Tq, D, splits)
    len_args = _len_args(cache_len)
    mask_args = _mask_args(key_mask, Bsz)
    kern, smem = _split_kernel(D, mtb)
    _launch.launch(kern, (splits, Hkv * rg, Bsz), (THREADS, 1, 1),
                   (_launch.ptr(q), _launch.ptr(k_cache), _launch.ptr(v_cache), *len_args, *mask_args,
                    _launch.ptr(ws) if ws is not None else B.NULL, _launch.ptr(o), *sq, *sk, *sv, np.int32(Tq),
                    np.int32(H), np.int32(Hkv), np.int32(Lmax), np.int32(splits), np.int32(rg), scale,
                    _window_arg(window, Lmax), np.int32(1 if splits == 1 else 0)),
                   shared_mem=smem, pdl=True)
    return o


def _row_strides(name, a, nd):
    """(batch stride, token stride) in elements of an [B, T, ...] view whose rows (axes 2..) are contiguous."""
    if a.ndim != nd:
        raise ValueError(f"{name}: expected {nd} dimensions; got shape {tuple(a.shape)}")
    isz = a.itemsize
    inner = 1
    for ax in range(nd - 1, 1, -1):  # axes 2.. must be contiguous together
        if a.shape[ax] > 1 and a.strides[ax] != inner * isz:
            raise ValueError(f"{name}: the axes after [batch, token] must be contiguous; got strides {a.strides}")
        inner *= a.shape[ax]
    if any(s % isz for s in a.strides[:2]):
        raise ValueError(f"{name}: strides must be multiples of the element size; got {a.strides}")
    return np.int64(a.strides[0] // isz), np.int64(a.strides[1] // isz)


@B.interop
def kv_cache_write(new, cache, cache_len):
    """Write the new tokens' rows into a static cache at the positions the device length gives: ``cache[b,
    cache_len - T + t] = new[b, t]`` for the T new tokens (the append of a captured decode step: the length lives
    in device memory and a replay writes where the cache now ends).

    Args:
        new: ``[batch, T, ...]`` (keys or values ``[B, T, Hkv, D]``, or token ids ``[B, T]``), 2- or 4-byte elements.
        cache: ``[batch, max_len, ...]`` of the same dtype and row shape (a layer's slice of a
            ``[layers, B, max_len, Hkv, D]`` cache, a token buffer); both may be strided across batch and token.
        cache_len: the length after the append, an int or a 0-d int32 array; positions outside
            ``[0, max_len)`` are skipped.

    Returns:
        ``cache``.

    Example::

        >>> length += 1                                  # device scalar: one new token
        >>> ck.kv_cache_write(k_new, kc[layer], length)  # k_new [B, 1, Hkv, D] lands at row length - 1
    """
    xp = B.array_module(new=new, cache=cache, cache_len=cache_len if B._kind(cache_len) is not None else None)
    B.check_array("new", new)
    if B.check_array("cache", cache).itemsize not in (2, 4) or cache.ndim < 2:
        raise TypeError(f"cache: expected [batch, max_len, ...] of 2- or 4-byte elements (bf16 keys, int32 ids); "
                        f"got {cache.dtype} {tuple(cache.shape)}")
    if new.dtype != cache.dtype:
        raise TypeError(f"new: expected the cache's dtype {cache.dtype}; got {new.dtype}")
    if new.ndim < 2 or new.shape[0] != cache.shape[0] or new.shape[2:] != cache.shape[2:]:
        raise ValueError(f"new: expected [batch, T, ...] matching cache {tuple(cache.shape)} except the token axis; "
                         f"got {tuple(new.shape)}")
    B.check_writable("cache", cache)
    Bsz, T = int(new.shape[0]), int(new.shape[1])
    Lmax = int(cache.shape[1])
    # An int length in [0, max_len] (3.7 was truncated before), or a 0-d int32 array (the device length of a
    # captured step, where rows outside [0, max_len) are skipped by the kernel).
    _check_cache_len(cache_len, Lmax)
    R = int(np.prod(new.shape[2:], dtype=np.int64))
    if xp is np:
        L = int(cache_len)
        for t in range(T):
            pos = L - T + t
            if 0 <= pos < Lmax:
                cache[:, pos] = new[:, t]
        return cache
    sb, st = _row_strides("new", new, new.ndim)
    db, dt = _row_strides("cache", cache, cache.ndim)
    n = Bsz * T * R
    if n == 0:
        return cache
    dev_len = B._kind(cache_len) is not None
    if dev_len:
        B.check_dtype("cache_len", cache_len, (np.int32,))
    len_args = (cache_len if dev_len else B.NULL, np.int32(0 if dev_len else int(cache_len)))
    k = get_function(FAMILY, f"kv_write_w{new.itemsize}")
    k((min(-(-n // 256), 4096),), (256, 1, 1), (new, cache, *len_args, sb, st, db, dt, np.int32(T), np.int32(R),
                                                np.int32(Lmax), np.int64(n)))
    return cache


def _check_cache_len(cache_len, Lmax):
    if _is_int(cache_len):
        if not 0 <= int(cache_len) <= Lmax:
            raise ValueError(f"cache_len: expected 0 <= cache_len <= max_len ({Lmax}); got {int(cache_len)}")
    elif B._kind(cache_len) is not None:
        B.check_dtype("cache_len", cache_len, (np.int32,))
        if cache_len.ndim != 0:
            raise ValueError(f"cache_len: expected a 0-d int32 array (a device scalar) or an int; got shape "
                             f"{tuple(cache_len.shape)}")
    else:
        raise TypeError(f"cache_len: expected an int or a 0-d int32 array; got {type(cache_len).__name__}")


def _validate_rope_kv(qkv, n_heads, n_kv_heads, k_cache, v_cache, cache_len, cos, sin, positions, q_out):
    B.check_dtype("qkv", qkv, B.FLOATS)
    if qkv.ndim != 3:
        raise ValueError(f"qkv: expected 3 dimensions [batch, T, (n_heads + 2 n_kv_heads) * head_dim]; got shape "
                         f"{tuple(qkv.shape)}")
    H = B.check_size("n_heads", n_heads)
    Hkv = B.check_size("n_kv_heads", n_kv_heads)
    Bsz, T, C = (int(s) for s in qkv.shape)
    NH = H + 2 * Hkv
    if C < NH or C % NH:
        raise ValueError(f"qkv: the last axis ({C}) must be (n_heads + 2 n_kv_heads) * head_dim = {NH} * head_dim")
    D = C // NH
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if B.check_array(name, c).dtype != qkv.dtype:
            raise TypeError(f"{name}: expected qkv's dtype {qkv.dtype}; got {c.dtype}")
        if c.ndim != 4 or c.shape[0] != Bsz or c.shape[2:] != (Hkv, D):
            raise ValueError(f"{name}: expected shape ({Bsz}, max_len, {Hkv}, {D}) = [batch, max_len, n_kv_heads, "
                             f"head_dim]; got {tuple(c.shape)}")
        B.check_writable(name, c)
    B.check_shape("v_cache", v_cache, k_cache.shape, " (the shape of k_cache)")
    Lmax = int(k_cache.shape[1])
    if Lmax >= 2**31:
        raise ValueError(f"k_cache: max_len must be < 2**31; got {Lmax}")
    _check_cache_len(cache_len, Lmax)
    if (cos is None) != (sin is None):
        raise ValueError("cos, sin: pass both (rotary embedding) or neither (no rotation)")
    Lc, mode = 0, 0
    if cos is None:
        if positions is not None:
            raise ValueError("positions: given without cos / sin (no rotation to position)")
    else:
        if D % 2:
            raise ValueError(f"qkv: head_dim ({D}) must be even for the rotary embedding")
        Lc, mode = check_tables(cos, sin, positions, Bsz, T, D, "qkv")
    if q_out is not None:
        B.check_dtype("q_out", q_out, (qkv.dtype,))
        B.check_shape("q_out", q_out, (Bsz, T, H, D), " ([batch, T, n_heads, head_dim])")
        B.check_writable("q_out", q_out)
    return Bsz, T, H, Hkv, D, Lmax, Lc, mode


@B.interop
def rope_kv_write(qkv, n_heads, n_kv_heads, k_cache, v_cache, cache_len, *, cos=None, sin=None, positions=None,
                  q_out=None):
    """Split a packed QKV projection, rotate q and k (RoPE), and append k and v to a static cache: one kernel.

    The same values as ``q = ck.rope(q, cos, sin, positions=positions)``, ``k = ck.rope(k, ...)``,
    ``ck.kv_cache_write(k, k_cache, cache_len)``, ``ck.kv_cache_write(v, v_cache, cache_len)`` on the heads of
    ``qkv`` (rotate-half layout, fp32 rotation, one rounding), in one launch instead of four (plus the two
    contiguous copies of the packed q / k views that ``ck.rope`` needs).

    Args:
        qkv: ``[batch, T, (n_heads + 2 n_kv_heads) * head_dim]`` float32 or bfloat16: q heads, then k heads,
            then v heads; the last axis contiguous, batch and token strides free (a view of a wider buffer).
        n_heads, n_kv_heads: head counts (ints >= 1).
        k_cache, v_cache: ``[batch, max_len, n_kv_heads, head_dim]`` of qkv's dtype (one layer's slice of a
            ``[layers, B, max_len, Hkv, D]`` cache; batch and token strides free, a token's heads contiguous).
        cache_len: the length after the append (an int, or a 0-d int32 device array, read by the kernel:
            graph-capturable); token t lands at row ``cache_len - T + t``; rows outside ``[0, max_len)`` are
            skipped.
        cos, sin: float32 ``[L, head_dim // 2]`` from :func:`rope_cache`, or both None (no rotation: GPT-2).
        positions: optional int32 / int64 ``[T]`` or ``[batch, T]``, as :func:`rope` takes it (default:
            ``arange(T)``); the kernel clamps positions into the table, the NumPy path raises.
        q_out: optional ``[batch, T, n_heads, head_dim]`` output (a token's heads contiguous, batch / token
            strides free); may be the q part of ``qkv`` itself (rotated in place).

    Returns:
        ``q_out``: the rotated queries (a new C-contiguous array when not given).

    Example::

        >>> length += 1                                                  # device scalar
        >>> q = ck.rope_kv_write(qkv, 32, 8, kc[layer], vc[layer], length, cos=cos, sin=sin, positions=pos)
        >>> o = ck.decode_attention(q, kc[layer], vc[layer], length)
    """
    xp = B.array_module(qkv=qkv, k_cache=k_cache, v_cache=v_cache, cos=cos, sin=sin, positions=positions,
                        q_out=q_out, cache_len=cache_len if B._kind(cache_len) is not None else None)
    Bsz, T, H, Hkv, D, Lmax, Lc, mode = _validate_rope_kv(qkv, n_heads, n_kv_heads, k_cache, v_cache, cache_len,
                                                          cos, sin, positions, q_out)
    if q_out is None:
        q_out = xp.empty((Bsz, T, H, D), dtype=qkv.dtype)
    sb, st = _row_strides("qkv", qkv, 3)
    qb, qt = _row_strides("q_out", q_out, 4)
    kb, kt = _row_strides("k_cache", k_cache, 4)
    vb, vt = _row_strides("v_cache", v_cache, 4)
    if xp is np:
        from .rope import rope as _rope

        q = qkv[..., :H * D].reshape(Bsz, T, H, D)
        k = qkv[..., H * D:(H + Hkv) * D].reshape(Bsz, T, Hkv, D)
        v = qkv[..., (H + Hkv) * D:].reshape(Bsz, T, Hkv, D)
        if cos is not None:
            q = _rope(np.ascontiguousarray(q), cos, sin, positions=positions)
            k = _rope(np.ascontiguousarray(k), cos, sin, positions=positions)
        q_out[...] = q
        kv_cache_write(k, k_cache, cache_len)
        kv_cache_write(v, v_cache, cache_len)
        return q_out
    if Bsz * T == 0:
        return q_out
    rot = cos is not None
    E = 16 // qkv.itemsize
    isz = qkv.itemsize
    vec = ((D // 2) % E == 0 if rot else D % E == 0) and B.aligned16(qkv, q_out, k_cache, v_cache) and all(
        int(s) * isz % 16 == 0 for s in (sb, st, qb, qt, kb, kt, vb, vt))
    cs_vec = rot and B.aligned16(cos, sin) and (D // 2) % 4 == 0
    len_args = _len_args(cache_len)
    ptag = B.DTYPE_TAG[positions.dtype] if positions is not None else "i32"
    k = get_function(FAMILY, f"rope_kv_{B.DTYPE_TAG[qkv.dtype]}_{ptag}_{'v' if vec else 's'}")
    units = Bsz * T * (H + 2 * Hkv) * (((D // 2) if rot else D) // (E if vec else 1))
    grid = _launch.launch_grid(k, units)
    P = _launch.ptr
    _launch.launch(k, (grid,), (_launch.THREADS, 1, 1),
                   (P(qkv), sb, st, P(q_out), qb, qt, P(k_cache), kb, kt, P(v_cache), vb, vt, *len_args,
                    P(cos) if rot else B.NULL,
                    P(sin) if rot else B.NULL, P(positions) if positions is not None else B.NULL, np.int32(Bsz),
                    np.int32(T), np.int32(H), np.int32(Hkv), np.int32(D), np.int32(Lc), np.int32(mode),
                    np.int32(Lmax), np.bool_(cs_vec)), 0, pdl=True)
    return q_out


@B.interop
def decode_attention_rope(qkv, n_heads, n_kv_heads, k_cache, v_cache, cache_len, *, cos=None, sin=None,
                          positions=None, scale=None, key_mask=None, window=None, out=None, num_splits=None,
                          workspace=None):
    """One decode step's attention from the packed QKV projection of the newest token, in ONE launch: rotary
    positions on q and k, k and v appended to the static cache at the device length, and split-KV attention
    of the rotated q over the cache (the combine in the same launch). Bit-identical to::

        q = rope_kv_write(qkv, n_heads, n_kv_heads, k_cache, v_cache, cache_len, cos=cos, sin=sin,
                          positions=positions)
        o = decode_attention(q, k_cache, v_cache, cache_len, scale=scale, key_mask=key_mask,
                             window=window, num_splits=num_splits)

    (q rounded to bf16 as rope_kv_write stores it, the same rotation arithmetic, the same split count and
    summation order), which is also the NumPy path. The newest key / value enter the attention from registers;
    exactly one block writes each element of the appended cache row.

    Under programmatic dependent launch (inside ``_launch.pdl_scope()``, sm_90+) the kernel reads, before it
    waits for the kernel launched just before it: the length, ``key_mask``, ``positions``, ``cos`` / ``sin`` and
    the cache rows ``[0, cache_len - 1)``, and starts copying those rows into shared memory; only ``qkv`` is read
    after the wait. The code that opens the scope vouches that the kernel launched right before this one (in
    the fused decode step: the qkv GEMV) writes none of those (see decode_attention.cu, "PDL and what may be
    read before pdl_wait"). Outside the scope the launch is an ordinary one.

    Args:
        qkv: bfloat16 ``[batch, 1, (n_heads + 2 n_kv_heads) * head_dim]``: q heads, then k heads, then v heads
            of the one new token (rope_kv_write's layout); the last axis contiguous, the batch stride free.
            head_dim 32, 64 or 128.
        n_heads, n_kv_heads: head counts, n_kv_heads dividing n_heads.
        k_cache, v_cache: bfloat16 ``[batch, max_len, n_kv_heads, head_dim]`` (a layer's slice of a
            ``[layers, B, max_len, Hkv, D]`` cache); last axis contiguous, pointer and strides multiples of 16
            bytes. Row ``cache_len - 1`` is written (skipped when outside ``[0, max_len)``).
        cache_len: the length after the append: an int in ``[0, max_len]`` or a 0-d int32 device array (read by
            the kernel: graph-capturable).
        cos, sin: float32 ``[L, head_dim // 2]`` (:func:`rope_cache`), or both None (no rotation: GPT-2).
        positions: optional int32 / int64 ``[1]`` or ``[batch, 1]`` as rope_kv_write takes it (default:
            position 0); the kernel clamps into the table, the NumPy path raises.
        scale, key_mask, window, num_splits, workspace: as :func:`decode_attention` (the workspace of
            :func:`decode_attention_workspace` for a ``[batch, 1, n_heads, head_dim]`` q and this ``window``):
            the new token at position ``cache_len - 1`` sees the cache rows ``[cache_len - window, cache_len)``.
        out: optional C-contiguous bfloat16 ``[batch, 1, n_heads, head_dim]``.

    Returns:
        ``o``: bfloat16 ``[batch, 1, n_heads, head_dim]``.

    Example::

        >>> length += 1                                                        # device scalar
        >>> qkv = ck.gemv(x, w_qkv, norm="rms", norm_weight=g)                 # [1, 3072] (LLaMA-3.2-1B)
        >>> o = ck.decode_attention_rope(qkv.reshape(1, 1, -1), 32, 8, kc[i], vc[i], length, cos=cos, sin=sin,
        ...                              positions=pos, key_mask=mask, workspace=ws)
    """
    xp = B.array_module(qkv=qkv, k_cache=k_cache, v_cache=v_cache, cos=cos, sin=sin, positions=positions,
                        key_mask=key_mask, out=out, workspace=workspace,
                        cache_len=cache_len if B._kind(cache_len) is not None else None)
    B.check_dtype("qkv", qkv, (B.bfloat16,))
    window = B.check_window(window)
    Bsz, T, H, Hkv, D, Lmax, Lc, mode = _validate_rope_kv(qkv, n_heads, n_kv_heads, k_cache, v_cache, cache_len,
                                                          cos, sin, positions, None)
    if T != 1:
        raise ValueError(f"qkv: expected one new token per sequence ([batch, 1, ...]); got T = {T} (use "
                         f"rope_kv_write + decode_attention for several)")
    if D not in HEAD_DIMS:
        raise ValueError(f"qkv: head_dim must be one of {HEAD_DIMS}; got {D}")
    if H % Hkv:
        raise ValueError(f"n_kv_heads: ({Hkv}) must divide n_heads ({H})")
    scale = _validate_options(key_mask, Bsz, Lmax, D, scale, num_splits, _span(Lmax, 1, window))
    o = B.empty(xp, (Bsz, 1, H, D), B.bfloat16, out)
    if xp is np:
        q = rope_kv_write(qkv, H, Hkv, k_cache, v_cache, cache_len, cos=cos, sin=sin, positions=positions)
        return decode_attention(q, k_cache, v_cache, cache_len, scale=scale, key_mask=key_mask, window=window, out=o)
    G = H // Hkv
    if Bsz == 0:
        return o
    if Bsz > 65535:
        raise ValueError(f"qkv: batch must be <= 65535 (the kernel's grid z); got {Bsz}")
    mtb, rg = _row_tiles(G, 1)
    if Hkv * rg > 65535:
        raise ValueError(f"n_kv_heads: kv_heads * row groups ({Hkv} * {rg}) must be <= 65535")
    sb = _row_strides("qkv", qkv, 3)[0] if Bsz > 1 else np.int64(0)
    sk, sv = _strides("k_cache", k_cache), _strides("v_cache", v_cache)
    splits = _splits(Bsz, Hkv, D, Lmax, G, 1, key_mask, num_splits, window)  # decode_attention's: the same bits
    ws = _workspace(xp, workspace, Bsz, Hkv, G, 1, D, splits)
    qkv_vec = B.aligned16(qkv) and (int(sb) * qkv.itemsize) % 16 == 0
    rot = cos is not None
    cs_vec = rot and B.aligned16(cos, sin) and (D // 2) % 4 == 0
    P = _launch.ptr
    len_args = _len_args(cache_len)
    pos_args = (P(positions) if positions is not None else B.NULL,
                np.int32(positions.itemsize if positions is not None else 4), np.int32(mode), np.int32(Lc))
    smem = _smem(D, mtb)
    kern = _launch.with_smem(get_function(FAMILY, f"dattn_rope_d{D}_m{mtb}"), smem)
    _launch.launch(kern, (splits, Hkv * rg, Bsz), (THREADS, 1, 1),
                   (P(qkv), sb, np.int32(qkv_vec), P(k_cache), P(v_cache), *len_args,
                    P(cos) if rot else B.NULL, P(sin) if rot else B.NULL, *pos_args, np.int32(cs_vec),
                    *_mask_args(key_mask, Bsz), P(ws) if ws is not None else B.NULL, P(o), *sk, *sv,
                    np.int32(H), np.int32(Hkv), np.int32(Lmax), np.int32(splits), np.int32(rg), scale,
                    _window_arg(window, Lmax), np.int32(1 if splits == 1 else 0)),
                   shared_mem=smem, pdl=True)
    return o


__all__ = ["decode_attention", "decode_attention_rope", "decode_attention_workspace", "kv_cache_write", "rope_kv_write"]
