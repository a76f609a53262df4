"""Softmax and attention softmax: ``ck.softmax`` / ``ck.softmax_backward`` / ``ck.attn_softmax`` /
``ck.attn_softmax_backward``. Kernels: ``kernels_cu/softmax.cu`` (one forward kernel serves both ops: plain
softmax is attention softmax with scale 1, no mask, not causal)."""
from __future__ import annotations


import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from . import _launch as L

FAMILY = "softmax"
# 16-byte packs each thread aims to hold: the row is split over more threads until each has at most this many.
TARGET_VPT = 4
_MASK_TAG = {None: "none", np.dtype(np.bool_): "u8", B.float32: "f32", B.bfloat16: "bf16"}


def _fwd_max_elems(tpr: int) -> int:
    # The forward caches its row as fp32 in registers: 32 floats a thread, 16 at 1024 threads per row.
    return 16 if tpr > 512 else 32


def _plan(C: int, itemsize: int, vec: bool, backward: bool):
    """(threads per row, packs per thread, rows per block), or None for the long-row "loop" kernel.

    Forward caches the row as fp32: at most 32 floats a thread, 16 at 1024 threads per row (register limits,
    see softmax.cu); backward holds VPT packs of y and dy with up to 512 threads per row, VPT <= 8.
    """
    return L.row_plan(C, itemsize, vec, max_tpr=512 if backward else 1024, target_vpt=TARGET_VPT, max_vpt=8,
                      max_elems=None if backward else _fwd_max_elems)


# Wide kernels (sm_fwd_wide_*, no key mask): packs a thread, 16-byte path / element path (softmax.cu).
WIDE_VPT = {True: 8, False: 16}


def _wide_plan(C: int, itemsize: int, vec: bool):
    """Threads per row of the wide forward kernel (one row a block, the row kept as raw packs in registers), or
    None when the row is too long for it too (the loop kernel takes it).

    512 threads while they cover the row (two 512-thread rows per SM at <= 64 registers), else 1024. With 16-byte
    packs that is bf16 up to 65536 columns (32768 at 512 threads) and fp32 up to 32768; the element path up to
    16384. Only asked when :func:`_plan` returned None.
    """
    E = 16 // itemsize if vec else 1
    units = C // E
    vpt = WIDE_VPT[vec]
    for tpr in (512, 1024):
        if units <= tpr * vpt:
            return tpr
    return None


# Rows over a thread-block cluster (sm_fwd_cluster<n>_*, sm_bwd_cluster<n>_*: sm_90+ only, 16-byte packs, no key
# mask; softmax.cu). The row is split over n CTAs (n in CLUSTER_SIZES, compiled in), each holding a contiguous
# slice in registers, so the row is read from DRAM once and the reductions cross the cluster through DSMEM.
# Settings (ck.settings.softmax_cluster*, A/B switches: ``--ab softmax_cluster=0`` in bench_train; bench_ops prints
# its own A/B rows of them, benchmarks/cases/softmax.py):
#   softmax_cluster            False keeps the wide / loop kernels everywhere (what sm_80 runs).
#   softmax_cluster_threads    threads a CTA the plan aims for: 512 = two CTAs a SM at <= 64 registers (one loads while
#                      the other reduces); 256 = four a SM; past 8 CTAs of this, 8 CTAs of up to 1024 threads.
#   softmax_cluster_fwd_from_* forward rows longer than this take the cluster kernel: every row past the register
#                      kernels (16384). Session 11 run C at 2048 x 32768: the cluster kernel 76.5 us bf16 (83 % of
#                      copy) / 130.8 us fp32 (97 %) against the wide kernel's 107.6 (59 %) / 152.3 (84 %): one exp2
#                      an element instead of two, and the row spread over 2 SMs' SFUs.
# The backward's register kernel ends at 512 threads x 8 packs (bf16 32768, fp32 16384 columns); the cluster
# kernel takes every 16-byte row past that, the loop kernel the rest (element path, or longer than 8 CTAs hold).
CLUSTER_SIZES = (2, 4, 8)
# Row values a thread holds (softmax.cu): the forward 32 fp32 values (fp32 8 packs, bf16 4), the backward 4
# packs of y and 4 of dy.
CLUSTER_FWD_VALUES = 32
CLUSTER_BWD_VPT = 4
# ck.settings.softmax_cluster_max_grid: CTAs launched at most, in whole clusters (the kernels stride over rows by the
# cluster count): by default one cluster a row; 264 (= 2 CTAs x 132 SMs) is a one-wave grid whose clusters walk the
# rows.


def _cluster_plan(C: int, itemsize: int, backward: bool):
    """``(cluster size n, threads a CTA, packs a CTA)`` of the cluster kernels for a 16-byte-pack row of C
    columns, or None when 8 CTAs of 1024 threads cannot hold it.

    The smallest n whose slice (packs a CTA = ceil(units / n), as even as the row allows) fits
    ck.settings.softmax_cluster_threads
    threads; then the smallest n that fits 1024. Threads are whole warps, each warp owning 32 x packs-a-thread
    consecutive packs of the slice (softmax.cu). Limits: forward 8 x 1024 x 32 = 262144 columns (either dtype),
    backward 8 x 1024 x 4 packs: bf16 262144, fp32 131072.
    """
    E = 16 // itemsize
    if C % E:
        return None
    units = C // E
    vpt = CLUSTER_BWD_VPT if backward else CLUSTER_FWD_VALUES // E
    for limit in sorted({settings.softmax_cluster_threads, 1024}):
        for n in CLUSTER_SIZES:
            upc = -(-units // n)
            threads = -(-upc // (32 * vpt)) * 32
            if threads <= limit:
                return n, threads, upc
    return None


def _cluster_ok(vec: bool, cc: int) -> bool:
    return settings.softmax_cluster and vec and cc >= 90


def _fwd_route(C: int, itemsize: int, vec: bool, masked: bool, cc: int):
    """Which forward kernel a row gets: ``("reg", (tpr, vpt, rpb))``, ``("cluster", (n, threads, upc))``,
    ``("wide", tpr)`` or ``("loop", None)``; ``cc`` is the device's compute capability (90 for Hopper)."""
    plan = _plan(C, itemsize, vec, backward=False)
    if plan is not None:
        return "reg", plan
    if masked:
        return "loop", None
    start = settings.softmax_cluster_fwd_from_bf16 if itemsize == 2 else settings.softmax_cluster_fwd_from_f32
    if _cluster_ok(vec, cc) and C > start:
        cl = _cluster_plan(C, itemsize, backward=False)
        if cl is not None:
            return "cluster", cl
    wide = _wide_plan(C, itemsize, vec)
    return ("wide", wide) if wide is not None else ("loop", None)


def _bwd_route(C: int, itemsize: int, vec: bool, cc: int):
    """Which backward kernel a row gets: ``("reg", plan)``, ``("cluster", (n, threads, upc))`` or ``("loop", None)``."""
    plan = _plan(C, itemsize, vec, backward=True)
    if plan is not None:
        return "reg", plan
    if _cluster_ok(vec, cc):
        cl = _cluster_plan(C, itemsize, backward=True)
        if cl is not None:
            return "cluster", cl
    return "loop", None


def _cluster_grid(rows: int, n: int) -> int:
    return min(rows, settings.softmax_cluster_max_grid // n) * n


def _launch_fwd(x, y, mask, mvec, rows, C, Q, HQ, scale, causal, window=0):
    # window: the sliding window W (causal only), 0 for none. Every forward kernel (reg, wide, loop, cluster) skips
    # the packs before each row's window as it skips those past the diagonal (softmax.cu), so the route is the
    # same with or without one.
    vec = C % (16 // x.itemsize) == 0 and B.aligned16(x, y)
    mvec = bool(mvec and vec)
    kind, plan = _fwd_route(C, x.itemsize, vec, mask is not None, B.capability())
    tag = f"{B.DTYPE_TAG[x.dtype]}_{_MASK_TAG[None if mask is None else mask.dtype]}"
    vs = "v" if vec else "s"
    if kind == "cluster":
        n, threads, upc = plan
        k = get_function(FAMILY, f"sm_fwd_cluster{n}_{tag}_v")
        k((_cluster_grid(rows, n),), (threads, 1, 1),
          (x, y, np.int64(rows), np.int32(C), np.int32(Q), np.int64(HQ), np.float32(scale), np.bool_(causal),
           np.int32(window), np.int32(upc)))
        return
    if kind == "reg":
        tpr, vpt, rpb = plan
        k = get_function(FAMILY, f"sm_fwd_{tag}_{vpt}{vs}")
        grid, block = (rows + rpb - 1) // rpb, (tpr, rpb, 1)
    elif kind == "wide":
        k = get_function(FAMILY, f"sm_fwd_wide_{tag}_{vs}")
        grid, block = rows, (plan, 1, 1)
    else:
        k = get_function(FAMILY, f"sm_fwd_loop_{tag}_{vs}")
        grid, block = rows, (512, 1, 1)
    k((min(grid, 2**31 - 1),), block,
      (x, mask if mask is not None else B.NULL, y, np.int64(rows), np.int32(C), np.int32(Q), np.int64(HQ),
       np.float32(scale), np.bool_(causal), np.int32(window), np.bool_(mvec)))


def _launch_bwd(y, dy, dx, rows, C, scale):
    vec = C % (16 // y.itemsize) == 0 and B.aligned16(y, dy, dx)
    kind, plan = _bwd_route(C, y.itemsize, vec, B.capability())
    vs = "v" if vec else "s"
    if kind == "cluster":
        n, threads, upc = plan
        k = get_function(FAMILY, f"sm_bwd_cluster{n}_{B.DTYPE_TAG[y.dtype]}_v")
        k((_cluster_grid(rows, n),), (threads, 1, 1),
          (y, dy, dx, np.int64(rows), np.int32(C), np.float32(scale), np.int32(upc)))
        return
    if kind == "reg":
        tpr, vpt, rpb = plan
        k = get_function(FAMILY, f"sm_bwd_{B.DTYPE_TAG[y.dtype]}_{vpt}{vs}")
        grid, block = (rows + rpb - 1) // rpb, (tpr, rpb, 1)
    else:
        k = get_function(FAMILY, f"sm_bwd_loop_{B.DTYPE_TAG[y.dtype]}_{vs}")
        grid, block = rows, (512, 1, 1)
    k((min(grid, 2**31 - 1),), block, (y, dy, dx, np.int64(rows), np.int32(C), np.float32(scale)))


def _ref_softmax(z64, out_dtype):
    """Row softmax of float64 logits (-inf = masked) on the last axis; all-masked rows give zeros."""
    m = z64.max(axis=-1, keepdims=True) if z64.shape[-1] else np.zeros(z64.shape[:-1] + (1,))
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(z64 - m)
    s = e.sum(axis=-1, keepdims=True)
    return (e / np.where(s > 0, s, 1.0)).astype(out_dtype)


def _check_axis(x, axis):
    axis = B.check_int("axis", axis)
    if axis not in (-1, x.ndim - 1):
        raise ValueError(f"axis: only the last axis is supported (-1 or {x.ndim - 1}); got {axis!r}")


@B.interop
def softmax(x, axis=-1, *, out=None):
    """Softmax over the last axis: ``y = exp(x - max(x)) / sum(exp(x - max(x)))``, fp32 math.

    Args:
        x: ``(..., C)`` float32 or bfloat16, C-contiguous; any number of rows, any C (a row of 0 elements
            gives an empty result).
        axis: must be the last axis (-1 or ``x.ndim - 1``); other axes raise ValueError (transpose first).
        out: optional output buffer, same shape and dtype as ``x`` (``out=x`` works in place).

    Returns:
        ``y``, like ``x``.

    Example::

        >>> p = ck.softmax(cp.random.standard_normal((4, 1000), dtype=cp.float32))
    """
    xp = B.array_module(x=x, out=out)
    B.check_dtype("x", x, B.FLOATS)
    B.check_ndim("x", x, 1)
    _check_axis(x, axis)
    B.check_contiguous("x", x)
    y = B.empty(xp, x.shape, x.dtype, out)
    C = x.shape[-1]
    if xp is np:
        y[...] = _ref_softmax(x.astype(np.float32).astype(np.float64), x.dtype)
        return y
    rows = x.size // C if C else 0
    if rows:
        _launch_fwd(x, y, None, False, rows, C, 1, 1, 1.0, False)
    return y


def _check_backward(y, dy, names):
    B.check_dtype(names[0], y, B.FLOATS)
    B.check_ndim(names[0], y, 1)
    B.check_contiguous(names[0], y)
    B.check_dtype(names[1], dy, (y.dtype,))
    B.check_shape(names[1], dy, y.shape, f" (the shape of {names[0]})")
    B.check_contiguous(names[1], dy)


@B.interop
def softmax_backward(y, dy, *, out=None):
    """Gradient of :func:`softmax`: ``dx = y * (dy - sum(dy * y, axis=-1))``.

    Args:
        y: the forward output ``(..., C)``, float32 or bfloat16, C-contiguous.
        dy: gradient of y, same shape and dtype.
        out: optional buffer for ``dx``.

    Returns:
        ``dx``, like ``y``.
    """
    return _softmax_backward(y, dy, 1.0, out, ("y", "dy"))


def _softmax_backward(y, dy, scale, out, names):
    xp = B.array_module(**{names[0]: y, names[1]: dy, "out": out})
    _check_backward(y, dy, names)
    dx = B.empty(xp, y.shape, y.dtype, out)
    C = y.shape[-1]
    if xp is np:
        yf, gf = y.astype(np.float64), dy.astype(np.float64)
        dx[...] = (scale * yf * (gf - (gf * yf).sum(axis=-1, keepdims=True))).astype(y.dtype)
        return dx
    rows = y.size // C if C else 0
    if rows:
        _launch_bwd(y, dy, dx, rows, C, scale)
    return dx


def _window_keep(Q, K, window):
    """[Q, K] bool: key n visible to query i (causal, the diagonal at the end, off = K - Q) within ``window``."""
    pos = np.arange(Q)[:, None] + (K - Q)
    n = np.arange(K)[None, :]
    keep = n <= pos
    if window is not None:
        keep &= pos - n < window
    return keep


@B.interop
def attn_softmax(scores, *, key_mask=None, causal=False, scale=1.0, window=None, out=None):
    """Masked, scaled softmax of attention scores over the keys.

    ``z = scores * scale (+ key_mask if additive)``; keys where a boolean ``key_mask`` is False, with
    ``causal`` keys ``j > i + (k_len - q_len)`` of query ``i``, and with a sliding ``window`` W also keys
    ``j <= i + (k_len - q_len) - W`` are excluded (query i sees at most W keys, itself included: Hugging Face's
    ``kv_idx > q_idx - sliding_window``); ``probs = softmax(z, axis=-1)``. A row with every key excluded (or every
    additive mask value -inf) is all zeros, never NaN. fp32 math. With ``causal`` the masked tail of a row (and
    with ``window`` its keys before the window) are written as zeros without being read.

    Args:
        scores: ``[batch, heads, q_len, k_len]`` float32 or bfloat16, C-contiguous.
        key_mask: optional ``[batch, k_len]`` key-padding mask, broadcast over heads and queries: bool
            (True = keep) or an additive float mask (float32, or the dtype of ``scores``).
        causal: mask keys after the query, the diagonal aligned at the end (needs ``q_len <= k_len``).
        scale: a finite number; multiplies the scores before the mask is added and before the max.
        window: None (no window) or an int >= 1, with ``causal=True`` only: query i sees keys ``j`` with
            ``0 <= (i + k_len - q_len) - j < window``; ``window >= k_len`` is the same as None.
        out: optional output buffer like ``scores``; ``out=scores`` works in place.

    Returns:
        ``probs``, like ``scores``.

    Example::

        >>> s = cp.random.standard_normal((2, 8, 128, 128), dtype=cp.float32).astype(ck.bfloat16)
        >>> keep = cp.ones((2, 128), dtype=cp.bool_)
        >>> p = ck.attn_softmax(s, key_mask=keep, causal=True, scale=128 ** -0.5)
        >>> p = ck.attn_softmax(s, causal=True, scale=128 ** -0.5, window=64)     # Mistral-style sliding window
    """
    xp = B.array_module(scores=scores, key_mask=key_mask, out=out)
    B.check_dtype("scores", scores, B.FLOATS)
    if scores.ndim != 4:
        raise ValueError(f"scores: expected shape [batch, heads, q_len, k_len] (4 dimensions); got {tuple(scores.shape)}")
    B.check_contiguous("scores", scores)
    Bn, H, Q, K = (int(d) for d in scores.shape)
    if key_mask is not None:
        B.check_dtype("key_mask", key_mask, sorted({np.dtype(np.bool_), B.float32, scores.dtype}, key=str))
        B.check_shape("key_mask", key_mask, (Bn, K), " ([batch, k_len] of scores)")
        B.check_contiguous("key_mask", key_mask)
    causal = B.check_bool("causal", causal)
    if causal and Q > K:
        raise ValueError(f"causal: needs q_len <= k_len (the diagonal is aligned at the end); got q_len {Q} > k_len {K}")
    scale = B.check_f32("scale", scale)
    window = B.check_window(window, causal)
    y = B.empty(xp, scores.shape, scores.dtype, out)
    if xp is np:
        z = (scores.astype(np.float32) * scale).astype(np.float32)
        if key_mask is not None:
            if key_mask.dtype == np.bool_:
                z = np.where(key_mask[:, None, None, :], z, -np.inf)
            else:
                z = (z + key_mask.astype(np.float32)[:, None, None, :]).astype(np.float32)
        if causal:
            z = np.where(_window_keep(Q, K, window), z, -np.inf)
        y[...] = _ref_softmax(z.astype(np.float64), scores.dtype)
        return y
    rows = Bn * H * Q
    if rows and K:
        # A window of >= k_len keys drops nothing: the kernel gets 0 (none), the same launch as without one.
        _launch_fwd(scores, y, key_mask, key_mask is not None and B.aligned16(key_mask), rows, K, max(Q, 1), H * Q,
                    float(scale), causal, 0 if window is None or window >= K else window)
    return y


@B.interop
def attn_softmax_backward(probs, dprobs, *, scale=1.0, out=None):
    """Gradient of :func:`attn_softmax` with respect to the scores.

    ``dscores = scale * probs * (dprobs - sum(dprobs * probs, axis=-1))``: masked keys have probs 0 and so
    get 0; an all-masked row gets zeros.

    Args:
        probs: the forward output, ``[batch, heads, q_len, k_len]`` (any leading shape works), float32 or
            bfloat16, C-contiguous.
        dprobs: gradient of probs, same shape and dtype.
        scale: the forward's ``scale``.
        out: optional buffer for the result.

    Returns:
        ``dscores``, like ``probs``.
    """
    scale = B.check_f32("scale", scale)
    return _softmax_backward(probs, dprobs, float(scale), out, ("probs", "dprobs"))


__all__ = ["attn_softmax", "attn_softmax_backward", "softmax", "softmax_backward"]
