"""Flash attention on Hopper's warpgroup MMA: ``ck.flash_attention_sm90`` and ``ck.flash_attention_backward_sm90``
(sm_90 GPUs only: H100 / H200). Kernels: ``kernels_cu/attention_sm90.cu`` (compiled for sm_90a: wgmma, setmaxnreg).

Same contract as :func:`cukernels.ops.attention.flash_attention` / ``flash_attention_backward`` (layout, causal
alignment, GQA, lse format): the forwards and backwards of both families can be mixed (each backward takes the
other forward's o / lse). No key-padding mask here: ``ck.flash_attention`` keeps those calls on its mma.sync
kernels (``ops/attention.py`` chooses, in ``_use_sm90``). Argument checks and the NumPy reference are the
family's (``ops/_attention.py``).
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from . import _launch
from ._attention import (_check_saved, _strides, _validate, check_grads_out, check_rope_grads, check_window,
                         reference_backward, reference_forward)
from .rope import rope_backward as _rope_backward

FAMILY = "attention_sm90"
THREADS = 384  # producer warpgroup + 2 consumer warpgroups
BM = 128       # query rows per CTA (64 per consumer warpgroup)
# head_dim -> (key tile, pipeline stages, Q buffers); must match the CK_ATTN90_FWD lines of attention_sm90.cu.
CONFIG = {64: (128, 4, 2), 128: (128, 2, 2)}
HEAD_DIMS = tuple(CONFIG)
# Forward kernel variant (entry-point suffix): "" = pipelined ping-pong consumers (S of tile j + 1 and P V of tile j
# issued together, the softmax under the P V, the two consumer warpgroups alternating on the tensor cores); "_serial" =
# one tile at a time per warpgroup (same tiles and shared memory); "_overlap" = the pipelined loop without the
# alternation; "_wg3" = three consumer warpgroups on 192-row work tiles with the overlap loop (FlashAttention-3's shape
# at head_dim 64; D = 64 only: other head_dims run "" under it). All are tested. The backward kernels have a pair
# (ping-pong turns around their serial loops, or none): ck.settings.attention_sm90_bwd_variant.
# ck.settings.attention_sm90_variant = "auto" (the default) picks per call, from same-run measurements
# (one H200, 8192 tokens a call, `python dev/attention_sweep.py`): at head_dim 64 "_overlap" below WG3_MIN_SEQ keys
# (WG3_MIN_SEQ_FULL without the causal mask) and "_wg3" from there (causal T1024: _overlap 126 us, ping-pong 135, _wg3
# 138; T2048: _wg3 198, ping-pong 213, _overlap 215; T4096: _wg3 345, ping-pong 369, _overlap 395; full attention _wg3
# wins from T512: 107 against 110); at head_dim 128 "_serial" (T1024 causal 120 against the ping-pong's 131 us, T4096
# 317 against 387: the alternation's turns cost more than they hide when each S tile is 128 x 128 at D 128).
VARIANTS = ("", "_serial", "_overlap", "_wg3")
BWD_VARIANTS = ("", "_serial")
WG3_MIN_SEQ = 2048
WG3_MIN_SEQ_FULL = 512
D128_AUTO = "_serial"
# The kernels are persistent: a 1-D grid of at most one CTA per SM walks the work tiles (128 query rows of one
# (batch, head) for fwd / dq, 192 for the _wg3 forward, 128 keys of one (batch, K/V head) for dkdv).
# ck.settings.attention_sm90_grid_cap, when set, caps the grid lower (the tests use it to run many tiles through one
# CTA's mbarrier phases); ck.settings.attention_sm90_persistent = False launches one CTA per tile instead (the
# pre-persistent schedule, for A/B benchmarks: the same kernels, each CTA takes one tile).


# head_dim -> (key tile of dq, stages of dq, query tile of dkdv, stages of dkdv, fixed-tile buffers of dq, of
# dkdv): the CK_ATTN90_BWD lines.
BWD_CONFIG = {64: (64, 4, 64, 4, 2, 2), 128: (64, 3, 32, 4, 1, 2)}
# The backward's dq at head_dim 64 (ck.settings.attention_sm90_bwd_dq): "fused" = the five-product backward
# (attn_sm90_bwd_delta, then dkdvq: dkdv also multiplies each pair's dS by K and its dQ writer warps bulk-add it into an
# fp32 dq accumulator in a fixed order under per-query-tile semaphores, then dq_convert); "kernel" = the two-kernel
# backward (the dq kernel recomputes S and dP: 7 products a pair). One H200, same run (`python benchmarks/bench_ops.py
# --quick --only attention_sm90 --ab "attention_sm90_bwd_dq=kernel"`): B8xT1024
# H32/8 causal backward 0.329 ms fused against 0.375 ms, B2xT4096 1.006 against 1.179. Head_dim 128 always takes the two
# kernels (its 32-query dkdv tiles are below wgmma's 64-row A operand).
FUSED_DQ_DIMS = (64,)
FUSED_BQ = 64  # query tile of dkdvq = the row block of dq_acc and of its semaphores


def bwd_smem_bytes(kind: str, D: int) -> int:
    """Dynamic shared memory of attn_sm90_bwd_{kind}_d{D} (SmemDq / SmemDkdv in the kernel; kind "dkdvq": the
    fused backward's SmemDkdv<..., FQ = true>)."""
    bn, stq, bq, stk, qbq, qbk = BWD_CONFIG[D]
    if kind == "dq":  # Q, dO and O tiles per buffer, K and V stages, barriers, alignment slack
        return qbq * 3 * BM * D * 2 + 2 * stq * bn * D * 2 + 8 * (2 * qbq + 2 * stq) + 1024
    # K and V tiles per buffer, Q and dO stages, lse and delta stages, barriers, alignment slack
    n = qbk * 2 * BM * D * 2 + 2 * stk * bq * D * 2 + 2 * stk * bq * 4 + 8 * (2 * qbk + 2 * stk) + 1024
    if kind == "dkdvq":  # + two dS^T tiles [64 keys x bq] bf16, two hand-off buffers of two fp32 [bq x D] partials
        n += 2 * 64 * bq * 2 + 2 * 2 * bq * D * 4
    return n


# The three-consumer forward (variant "_wg3"): head_dim -> (key tile, stages, Q buffers); CK_ATTN90_FWD_WG3 lines.
WG3_CONFIG = {64: (128, 4, 2)}


def fwd_variant(D: int, variant: str | None = None, seq_k: int = 0, causal: bool = True) -> str:
    """The forward kernel variant that runs at head_dim ``D`` over ``seq_k`` keys: ``variant`` (default
    ck.settings.attention_sm90_variant; "auto" resolved as described at VARIANTS) when it is instantiated for D,
    else the ping-pong one."""
    v = settings.attention_sm90_variant if variant is None else variant
    if v == "auto":
        if D != 64:
            return D128_AUTO
        return "_wg3" if seq_k >= (WG3_MIN_SEQ if causal else WG3_MIN_SEQ_FULL) else "_overlap"
    return "" if v == "_wg3" and D not in WG3_CONFIG else v


def fwd_shape(D: int, variant: str = "") -> tuple[int, int, int, int, int]:
    """``(key tile, stages, Q buffers, query rows a work tile, threads)`` of attn_sm90_fwd_d{D}{variant}."""
    if variant == "_wg3":
        bn, st, qb = WG3_CONFIG[D]
        return bn, st, qb, 192, 512
    bn, st, qb = CONFIG[D]
    return bn, st, qb, BM, THREADS


def smem_bytes(D: int, variant: str = "") -> int:
    """Dynamic shared memory of attn_sm90_fwd_d{D}{variant} (Smem<D, BN, STAGES, QB, ROWS>::BYTES in the kernel):
    the Q buffers, the K and V stages, the mbarriers (8 bytes each: full and empty per Q buffer and per stage) and
    1024 bytes of alignment slack."""
    bn, st, qb, rows, _ = fwd_shape(D, variant)
    return qb * rows * D * 2 + 2 * st * bn * D * 2 + 8 * (2 * qb + 2 * st) + 1024


def supported() -> bool:
    """True when the current CUDA device can run the sm_90a kernels (compute capability 9.0 exactly: the
    architecture-specific features compiled here do not exist on other generations)."""
    return B.gpu_available() and B.capability() == 90


def grid(tiles: int, persistent_only: bool = False) -> int:
    """CTAs to launch for ``tiles`` work tiles (each CTA walks them: snake_tile in the kernel). One per SM at
    most (each CTA holds a whole SM's register file: 384 threads x 168 registers, _wg3 512 x 128), and no more
    than ``_backend.sm_target()``: while a ``ZeroAdamW(sm_margin=)`` collective runs beside the backward, the SMs
    it keeps free stay free (a persistent CTA that waited for one would run its whole share of tiles after the
    others). Fewer under ck.settings.attention_sm90_grid_cap; one per tile when
    ck.settings.attention_sm90_persistent is off, except for ``persistent_only`` kernels (the fused backward's
    dkdvq: its CTAs wait on each other's semaphores, so all of them must be resident at once)."""
    if not settings.attention_sm90_persistent and not persistent_only:
        return max(1, tiles)
    n = min(tiles, B.sm_target())
    cap = settings.attention_sm90_grid_cap
    if cap is not None:
        n = min(n, cap)
    return max(1, n)


def _kernel(D, variant, kind="fwd", window=None):
    """The kernel and its dynamic shared memory; ``window``: the sliding-window twin (``..._d{D}_sw{variant}``: same
    tiles and shared memory, the window as one more, last, argument)."""
    sw = "_sw" if window else ""
    if kind == "fwd":
        k, smem = get_function(FAMILY, f"attn_sm90_fwd_d{D}{sw}{variant}"), smem_bytes(D, variant)
    else:
        k, smem = get_function(FAMILY, f"attn_sm90_bwd_{kind}_d{D}{sw}{variant}"), bwd_smem_bytes(kind, D)
    return _launch.with_smem(k, smem), smem


def _window_args(window):
    """The *_sw kernels' last argument (the window, 1 <= W < seq_k: check_window), or none."""
    return () if window is None else (np.int32(window),)


@B.interop
def flash_attention_sm90(q, k, v, *, causal=True, scale=None, window=None, out=None, return_lse=False):
    """Scaled-dot-product attention forward on Hopper's wgmma tensor-core path (bf16, fp32 softmax).

    ``o[b, i, h] = sum_n softmax_n(scale * <q[b, i, h], k[b, n, h // G]>) * v[b, n, h // G]`` with
    ``G = heads / kv_heads``; ``causal=True`` masks key n for query i when ``n > i + seq_k - seq_q``, and
    ``window=W`` also when ``i + seq_k - seq_q - n >= W`` (sliding window). Same contract as
    :func:`flash_attention` without ``key_mask``; the probabilities enter the second product rounded to bf16, so
    the result matches an fp32 reference to bf16 accuracy.

    Args:
        q: bfloat16 ``[batch, seq_q, heads, head_dim]``; head_dim 64 or 128.
        k, v: bfloat16 ``[batch, seq_k, kv_heads, head_dim]``, kv_heads dividing heads. Strided views are read in
            place (last axis contiguous, pointer and other strides multiples of 16 bytes).
        causal: the causal mask (a bool).
        scale: the score multiplier, a finite number > 0; default ``1 / sqrt(head_dim)``.
        window: None, or the sliding window W >= 1 (needs ``causal=True``; see :func:`flash_attention`): key tiles
            outside every query's window are skipped.
        out: optional C-contiguous bfloat16 buffer of q's shape.
        return_lse: also return ``lse`` float32 ``[batch, heads, seq_q]`` (natural log; -inf for a query that
            sees no key), the input of :func:`flash_attention_backward`.

    Returns:
        ``o`` (C-contiguous, q's shape), or ``(o, lse)``.

    Raises:
        ValueError: head_dim not 64 / 128, or (CuPy arrays) the current GPU is not sm_90 (H100 / H200).

    Example::

        >>> if ck.flash_attention_sm90_supported():
        ...     o, lse = ck.flash_attention_sm90(q, k, v, causal=True, return_lse=True)
    """
    xp = B.array_module(q=q, k=k, v=v, out=out)
    Bsz, Tq, Tk, H, Hkv, D, causal, scale = _validate(q, k, v, causal, scale)
    return_lse = B.check_bool("return_lse", return_lse)
    window = check_window(window, causal, Tk)
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {HEAD_DIMS} for the wgmma kernels; got {D} "
                         f"(flash_attention takes 32 too)")
    if xp is np:  # the NumPy reference is flash_attention's (same math, same lse)
        o = B.empty(xp, q.shape, B.bfloat16, out)
        lse = reference_forward(q, k, v, causal, scale, None, o, window)
        return (o, lse) if return_lse else o
    _check_device()
    o = B.empty(xp, q.shape, B.bfloat16, out)
    if o.size and o.data.ptr % 4:  # the kernel stores bf16 pairs (4 bytes)
        raise ValueError(f"out: the data pointer must be 4-byte aligned; got offset {o.data.ptr % 4}")
    lse = xp.empty((Bsz, H, Tq), dtype=np.float32)
    if Bsz * H * Tq == 0:
        return (o, lse) if return_lse else o
    sq, sk, sv = _strides("q", q), _strides("k", k), _strides("v", v)
    # A window leaves each query tile a loop of ~W keys: the auto policy picks by that length (unmeasured for
    # windows; benchmarks/NOTES.md, "flash_attention")
    var = fwd_variant(D, seq_k=Tk if window is None else window, causal=causal)
    kern, smem = _kernel(D, var, window=window)
    *_, rows, threads = fwd_shape(D, var)
    kern((grid(-(-Tq // rows) * H * Bsz),), (threads, 1, 1),
         (q, k, v, o, lse, *sq, *sk, *sv, np.int32(Tq), np.int32(Tk), np.int32(H), np.int32(Hkv), scale,
          np.bool_(causal), np.int32(Bsz), *_window_args(window)), shared_mem=smem)
    return (o, lse) if return_lse else o


def _check_device():
    if not supported():
        cc = B.capability()
        raise ValueError(f"q: the sm_90 attention kernels run on compute capability 9.0 GPUs (H100 / H200) only; "
                         f"the current device has {cc // 10}.{cc % 10} (use flash_attention)")


@B.interop
def flash_attention_backward_sm90(dout, q, k, v, out, lse, *, causal=True, scale=None, window=None, grads_out=None,
                                  rope=None):
    """Gradients of :func:`flash_attention_sm90` (or of :func:`flash_attention` without key_mask) on Hopper's wgmma
    path: ``(dq, dk, dv)``.

    With ``P`` recomputed from ``lse``: ``delta_i = <dO_i, o_i>``, ``dS = P * (dO V^T - delta)``,
    ``dq = scale * dS K``, ``dk = scale * dS^T Q``, ``dv = P^T dO``; dk and dv summed over the G query heads of a
    K/V head. Deterministic: bit-identical on every rerun and grid (head_dim 64: dk / dv per key tile, dq summed
    over the key tiles in ascending order under semaphores; head_dim 128: a second kernel, dq per query tile). A
    query that sees no key (lse = -inf) gets dq = 0 and adds nothing to dk, dv.

    Args:
        dout: bfloat16 like ``q`` (strided views allowed, as for q).
        q, k, v, causal, scale, window: exactly as passed to the forward; head_dim 64 or 128.
        out, lse: the forward's ``o`` (C-contiguous) and ``lse`` (float32 ``[batch, heads, seq_q]``, C-contiguous).

        grads_out: optional ``(dq, dk, dv)`` buffers the kernels store into (see ``flash_attention_backward``;
            dk and dv must share strides: the head slices of one packed dqkv do).
        rope: optional ``(cos, sin, positions)`` (see ``flash_attention_backward``): the rope's backward of dq and dk
            in the kernels' store (positions None or int32; int64 ones take ``ck.rope_backward`` after).

    Returns:
        ``(dq, dk, dv)``: ``grads_out`` when given, else new C-contiguous arrays (dq like q, dk and dv like k).
    """
    xp = B.array_module(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    Bsz, Tq, Tk, H, Hkv, D, causal, scale = _validate(q, k, v, causal, scale)
    window = check_window(window, causal, Tk)
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {HEAD_DIMS} for the wgmma kernels; got {D} "
                         f"(flash_attention_backward takes 32 too)")
    _check_saved(dout, q, out, lse, Bsz, H, Tq)
    if xp is np:  # the NumPy reference is flash_attention_backward's
        return reference_backward(dout, q, k, v, out, lse, causal, scale, None, grads_out, rope, window)
    if rope is not None and rope[2] is not None and rope[2].dtype != np.int32:  # int64 positions: the rope after
        rope = check_rope_grads(rope, Bsz, Tq, Tk, D, xp)
        dq, dk, dv = flash_attention_backward_sm90(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                                   window=window, grads_out=grads_out)
        for g in (dq, dk):
            _rope_backward(g, rope[0], rope[1], positions=rope[2], out=g)
        return dq, dk, dv
    if out.size and out.data.ptr % 16:  # the dq kernel copies o in 16-byte chunks (delta from shared memory)
        raise ValueError(f"out: the data pointer must be 16-byte aligned; got offset {out.data.ptr % 16}")
    _check_device()
    copy_kv = None
    if grads_out is not None:
        dq, dk, dv = check_grads_out(grads_out, q, k, xp)
        if dv.size and _strides("dv", dv) != _strides("dk", dk):  # one stride set for both: dk, dv via copies
            copy_kv = (dk, dv)
            dk, dv = xp.empty(k.shape, dtype=B.bfloat16), xp.empty(k.shape, dtype=B.bfloat16)
    else:
        dq = xp.empty(q.shape, dtype=B.bfloat16)
        dk = xp.empty(k.shape, dtype=B.bfloat16)
        dv = xp.empty(k.shape, dtype=B.bfloat16)
    if Bsz * H == 0:
        return dq, dk, dv
    delta = xp.empty((Bsz, H, Tq), dtype=np.float32)  # workspace: written by the dq (or delta) kernel, read by dkdv
    sq, sk, sv, sd = _strides("q", q), _strides("k", k), _strides("v", v), _strides("dout", dout)
    tail = (np.int32(Tq), np.int32(Tk), np.int32(H), np.int32(Hkv), scale, np.bool_(causal), np.int32(Bsz))
    rt = _rope_args(rope, Bsz, Tq, Tk, D)
    if D in FUSED_DQ_DIMS and settings.attention_sm90_bwd_dq == "fused":
        _backward_fused(q, k, v, out, dout, lse, delta, dq, dk, dv, sq, sk, sv, sd, tail, rt, Bsz, Tq, Tk, H, Hkv,
                        D, scale, xp, window)
    else:
        _backward_two_kernels(q, k, v, out, dout, lse, delta, dq, dk, dv, sq, sk, sv, sd, tail, rt, Bsz, Tq, Tk,
                              H, Hkv, D, window)
    if copy_kv is not None:
        copy_kv[0][...] = dk
        copy_kv[1][...] = dv
        dk, dv = copy_kv
    return dq, dk, dv


def _backward_two_kernels(q, k, v, out, dout, lse, delta, dq, dk, dv, sq, sk, sv, sd, tail, rt, Bsz, Tq, Tk, H,
                          Hkv, D, window=None):
    """dq kernel (writes delta), then dkdv: seven products a (query tile, key tile) pair."""
    if Tq:
        kq, smq = _kernel(D, settings.attention_sm90_bwd_variant, "dq", window)
        kq((grid(-(-Tq // BM) * H * Bsz),), (THREADS, 1, 1),
           (q, k, v, out, dout, lse, delta, dq, *sq, *sk, *sv, *sd, *tail, *_strides("dq", dq), *rt,
            *_window_args(window)), shared_mem=smq)
    if Tk:
        kd, smd = _kernel(D, settings.attention_sm90_bwd_variant, "dkdv", window)
        kd((grid(-(-Tk // BM) * Hkv * Bsz),), (THREADS, 1, 1),
           (q, k, v, dout, lse, delta, dk, dv, *sq, *sk, *sv, *sd, *tail, *_strides("dk", dk), *rt,
            *_window_args(window)), shared_mem=smd)


def _backward_fused(q, k, v, out, dout, lse, delta, dq, dk, dv, sq, sk, sv, sd, tail, rt, Bsz, Tq, Tk, H, Hkv, D,
                    scale, xp, window=None):
    """delta kernel, dkdvq (five products a pair; dq summed into an fp32 accumulator in key-tile order), then the
    accumulator to dq. Workspace: dq_acc, fp32 [B, H, ceil(Tq / 64) * 64, D] (67 MB at B8 x T1024 x H32 x D64),
    and one int32 semaphore per (b, h, 64-query tile), zeroed here (memsetAsync). Under a sliding window the
    semaphores count from the first key tile that sees their query tile (the kernel's jr)."""
    if Tq == 0:
        return
    nqb = -(-Tq // FUSED_BQ)
    sem = xp.zeros((Bsz, H, nqb), dtype=np.int32)
    acc = xp.empty((Bsz, H, nqb * FUSED_BQ, D), dtype=np.float32)
    rows = Bsz * Tq * H
    threads = 256
    get_function(FAMILY, f"attn_sm90_bwd_delta_d{D}")((-(-rows * (D // 8) // threads),), (threads, 1, 1),
                                                     (out, dout, delta, *sd, np.int32(Tq), np.int32(H),
                                                      np.int32(Bsz)))
    if Tk:
        kd, smd = _kernel(D, settings.attention_sm90_bwd_variant, "dkdvq", window)
        kd((grid(-(-Tk // BM) * Hkv * Bsz, persistent_only=True),), (THREADS, 1, 1),
           (q, k, v, dout, lse, delta, dk, dv, *sq, *sk, *sv, *sd, *tail, *_strides("dk", dk), *rt, acc, sem,
            *_window_args(window)), shared_mem=smd)
    get_function(FAMILY, f"attn_sm90_bwd_dq_convert_d{D}")((-(-rows * (D // 8) // threads),), (threads, 1, 1),
                                                          (acc, sem, dq, *_strides("dq", dq), np.int32(Tq),
                                                           np.int32(H), np.int32(Bsz), scale, *rt))


def _rope_args(rope, Bsz, Tq, Tk, D):
    """The kernels' (cos, sin, positions, mode, L) for the fused rope backward (mode -1: none). ``rope`` was checked
    by the caller (``flash_attention_backward``'s check_rope_grads, or here)."""
    if rope is None:
        return (B.NULL, B.NULL, B.NULL, np.int32(-1), np.int32(0))
    cos, sin, pos = check_rope_grads(rope, Bsz, Tq, Tk, D, B._kind(rope[0]))
    mode = 0 if pos is None else (1 if pos.ndim == 1 else 2)
    return (cos, sin, pos if pos is not None else B.NULL, np.int32(mode), np.int32(cos.shape[0]))


flash_attention_sm90_supported = supported


__all__ = ["flash_attention_backward_sm90", "flash_attention_sm90", "flash_attention_sm90_supported"]
