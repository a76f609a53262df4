"""Fused scaled-dot-product attention: ``ck.flash_attention``, ``ck.flash_attention_backward``.
Kernels: ``kernels_cu/attention.cu`` (mma.sync, sm_80+); on Hopper the wgmma kernels of ``ops/attention_sm90.py``
(:func:`_use_sm90` picks them). Argument checks and the NumPy reference: ``ops/_attention.py``."""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from . import _launch
from . import attention_sm90 as _sm90
from ._attention import (HEAD_DIMS, _check_key_mask, _check_saved, _strides, _validate, check_grads_out,
                         check_rope_grads, check_window, reference_backward, reference_forward)
from .rope import rope_backward as _rope_backward

FAMILY = "attention"
THREADS = 128
BM = 64  # rows of the query tile (fwd, dq) and of the key tile (dkdv): 16 per warp, 4 warps
# head_dim -> (key tile of fwd, key tile of dq, query tile of dkdv); must match the entries in attention.cu.
TILES = {32: (64, 64, 64), 64: (64, 32, 64), 128: (32, 32, 32)}
assert tuple(TILES) == HEAD_DIMS


def _smem(kind, D):
    """Dynamic shared memory bytes of each kernel (the layouts in attention.cu)."""
    bn_fwd, bn_dq, bq = TILES[D]
    row = (D + 8) * 2  # padded bf16 row
    if kind == "fwd":
        return (BM + 4 * bn_fwd) * row
    if kind == "dq":
        return (2 * BM + 4 * bn_dq) * row + BM * 4
    return (2 * BM + 4 * bq) * row + 4 * bq * 4


def _kernel(kind, D, masked=False, window=None):
    """The kernel and its dynamic shared memory; ``masked``: the key-padding-mask instantiation (``*_km``, same
    tiles, same shared memory, three more arguments: the mask, its row stride in elements, its entry size);
    ``window``: the sliding-window one (``*_sw`` / ``*_km_sw``, one more argument after those: the window)."""
    name = f"attn_{'bwd_' if kind != 'fwd' else ''}{kind}_d{D}{'_km' if masked else ''}{'_sw' if window else ''}"
    smem = _smem(kind, D)
    return _launch.with_smem(get_function(FAMILY, name), smem), smem


@B.interop
def flash_attention(q, k, v, *, causal=True, scale=None, key_mask=None, window=None, out=None, return_lse=False):
    """Scaled-dot-product attention without materialising the scores (FlashAttention-2 style), bf16.

    ``o[b, i, h] = sum_n softmax_n(scale * <q[b, i, h], k[b, n, h // G]> + mask) * v[b, n, h // G]`` with
    ``G = heads / kv_heads`` (grouped-query attention; G = 1 is plain multi-head). ``causal=True`` masks key n
    for query i when ``n > i + seq_k - seq_q`` (aligned at the end: with seq_q == seq_k, "up to my own
    position"); ``window=W`` (sliding-window attention, Mistral's ``sliding_window``) also masks key n when
    ``i + seq_k - seq_q - n >= W``: a query sees at most the W latest keys, itself included; ``key_mask`` also
    masks key n of batch row b where ``key_mask[b, n] == 0`` (padding). The softmax and the accumulation are fp32;
    the probabilities enter the second product rounded to bf16 (tensor cores), so the result matches an fp32
    reference to bf16 accuracy.

    Args:
        q: bfloat16 ``[batch, seq_q, heads, head_dim]``; head_dim 32, 64 or 128.
        k, v: bfloat16 ``[batch, seq_k, kv_heads, head_dim]``, kv_heads dividing heads.
            q, k and v may be strided views (e.g. slices of one fused QKV projection): the last axis must be
            contiguous, the data pointer and the other strides multiples of 16 bytes.
        causal: the causal mask above (a bool).
        scale: the score multiplier, a finite number > 0; default ``1 / sqrt(head_dim)``.
        key_mask: optional key-padding mask ``[batch, seq_k]`` (Hugging Face's ``attention_mask``: 1 = keep,
            0 = padding, left or right padding or any pattern), bool or an integer dtype, nonzero = keep; the last
            axis contiguous, any row stride (a slice ``mask[:, :seq_k]`` of a longer mask is read in place). It
            is applied per key inside the kernels: no ``[batch, heads, seq_q, seq_k]`` mask or score tensor is
            made, and key tiles that are all padding are skipped.
        window: None (no window), or an integer W >= 1 with ``causal=True`` (Hugging Face's
            ``sliding_window_overlay``: key n visible to query position p iff ``p - W < n <= p``). Key tiles outside
            every query's window are neither loaded nor computed: at seq_q = seq_k = T the work is
            ``(2 T W - W^2) / T^2`` of the causal call's (0.75 at T 8192, W 4096). W >= seq_k is no window (the same
            result bit for bit). Combines with ``key_mask``.
        out: optional C-contiguous bfloat16 buffer of q's shape.
        return_lse: also return ``lse`` float32 ``[batch, heads, seq_q]``, the natural-log softmax normaliser
            (what :func:`flash_attention_backward` needs). A query that sees no key (under the causal mask and
            the padding mask together, e.g. a left-padding position, or one whose window holds only padding) gets
            o = 0 and lse = -inf.

    Returns:
        ``o`` (C-contiguous ``[batch, seq_q, heads, head_dim]``), or ``(o, lse)``.

    Example::

        >>> q = cp.random.standard_normal((8, 1024, 32, 64), dtype=cp.float32).astype(ck.bfloat16)
        >>> k = v = cp.random.standard_normal((8, 1024, 8, 64), dtype=cp.float32).astype(ck.bfloat16)
        >>> attention_mask = cp.ones((8, 1024), dtype=cp.int64); attention_mask[1, :100] = 0  # left padding
        >>> o, lse = ck.flash_attention(q, k, v, causal=True, key_mask=attention_mask, return_lse=True)
        >>> o = ck.flash_attention(q, k, v, causal=True, window=4096)  # Mistral's sliding window
    """
    xp = B.array_module(q=q, k=k, v=v, key_mask=key_mask, out=out)
    Bsz, Tq, Tk, H, Hkv, D, causal, scale = _validate(q, k, v, causal, scale)
    return_lse = B.check_bool("return_lse", return_lse)  # ("yes" was taken as true)
    km = _check_key_mask(key_mask, xp, Bsz, Tk)
    window = check_window(window, causal, Tk)
    o = B.empty(xp, q.shape, B.bfloat16, out)
    if xp is np:
        lse = reference_forward(q, k, v, causal, scale, key_mask, o, window)
        return (o, lse) if return_lse else o
    lse = xp.empty((Bsz, H, Tq), dtype=np.float32)
    if Bsz * H * Tq == 0:
        return (o, lse) if return_lse else o
    if _use_sm90(km, D):
        o, lse = _sm90.flash_attention_sm90(q, k, v, causal=causal, scale=scale, window=window, out=o,
                                            return_lse=True)
        return (o, lse) if return_lse else o
    sq, sk, sv = _strides("q", q), _strides("k", k), _strides("v", v)
    kern, smem = _kernel("fwd", D, km is not None, window)
    kern((-(-Tq // BM), H, Bsz), (THREADS, 1, 1),
         (q, k, v, o, lse, *sq, *sk, *sv, np.int32(Tq), np.int32(Tk), np.int32(H), np.int32(Hkv), scale,
          np.bool_(causal), *_mask_args(key_mask, km), *_window_args(window)), shared_mem=smem)
    return (o, lse) if return_lse else o


_SM90 = {}  # device id -> whether it runs the sm_90a kernels


def _use_sm90(km, D) -> bool:
    """The backend of a CuPy call, chosen here and only here: the wgmma kernels of ops/attention_sm90.py on a
    compute capability 9.0 GPU (H100 / H200) for calls without a key mask at head_dim 64 / 128 (with or without a
    sliding window: both families have the windowed twins), unless
    ``ck.settings.attention_wgmma`` is off; else the mma.sync kernels of this module. Measured on one H200 (``python
    benchmarks/bench_ops.py --quick --only attention_sm90``, B8xT1024 H32/8 D64 causal): fwd+bwd 0.580 ms against 0.818
    for the mma.sync kernels, 1.39x; 1.60x at B2xT4096. Both write the same lse format, so either forward pairs with
    either backward."""
    if not settings.attention_wgmma or km is not None or D not in _sm90.HEAD_DIMS:
        return False
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _SM90:
        _SM90[dev] = _sm90.supported()
    return _SM90[dev]


def _mask_args(key_mask, km):
    """The *_km kernels' extra arguments (mask pointer, row stride in elements, entry bytes), or none."""
    return () if km is None else (key_mask, *km)


def _window_args(window):
    """The *_sw kernels' extra argument (the window, 1 <= W < seq_k: check_window), or none."""
    return () if window is None else (np.int32(window),)


@B.interop
def flash_attention_backward(dout, q, k, v, out, lse, *, causal=True, scale=None, key_mask=None, window=None,
                             grads_out=None, rope=None):
    """Gradients of :func:`flash_attention`: ``(dq, dk, dv)``.

    With ``P`` recomputed from ``lse``: ``delta_i = <dO_i, o_i>``, ``dS = P * (dO V^T - delta)``,
    ``dq = scale * dS K``, ``dk = scale * dS^T Q``, ``dv = P^T dO``; dk and dv are summed over the G query heads
    that share a K/V head. Deterministic (no atomics). Masked pairs have P = 0: a padding key gets dk = dv = 0,
    a query that sees no key (lse = -inf) gets dq = 0.

    Args:
        dout: bfloat16 like ``q`` (strided views allowed, as for q).
        q, k, v, causal, scale, key_mask, window: exactly as passed to the forward.
        out, lse: the forward's ``o`` (C-contiguous) and ``lse``.
        grads_out: optional ``(dq, dk, dv)`` bfloat16 buffers to write (shapes of q, k, k), strided views allowed
            as for q: the head slices of one packed ``dqkv`` [B, T, H + 2 Hkv, D] get the gradients in place
            (the sm_90 kernels store there directly; the other paths copy in).
        rope: optional ``(cos, sin, positions)`` with which q and k were rotated by ``ck.rope`` (rotate-half)
            before the forward: dq and dk are then the gradients of the unrotated q and k (``ck.rope_backward``
            applied; on the sm_90 path inside the kernels' store, in fp32 before the one rounding). Needs
            seq_q == seq_k.

    Returns:
        ``(dq, dk, dv)``: ``grads_out`` when given, else new C-contiguous arrays (dq like q, dk and dv like k).
    """
    xp = B.array_module(dout=dout, q=q, k=k, v=v, out=out, lse=lse, key_mask=key_mask)
    Bsz, Tq, Tk, H, Hkv, D, causal, scale = _validate(q, k, v, causal, scale)
    km = _check_key_mask(key_mask, xp, Bsz, Tk)
    window = check_window(window, causal, Tk)
    _check_saved(dout, q, out, lse, Bsz, H, Tq)
    if xp is np:
        return reference_backward(dout, q, k, v, out, lse, causal, scale, key_mask, grads_out, rope, window)
    if rope is not None:
        rope = check_rope_grads(rope, Bsz, Tq, Tk, D, xp)
        if _use_sm90(km, D) and Bsz * H and Tq and (rope[2] is None or rope[2].dtype == np.int32):
            return _sm90.flash_attention_backward_sm90(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                                       window=window, grads_out=grads_out, rope=rope)
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                              key_mask=key_mask, window=window, grads_out=grads_out)
        for g in (dq, dk):
            _rope_backward(g, rope[0], rope[1], positions=rope[2], out=g)
        return dq, dk, dv
    if grads_out is not None:
        grads_out = check_grads_out(grads_out, q, k, xp)
        if _use_sm90(km, D) and Bsz * H and Tq and Tk:
            return _sm90.flash_attention_backward_sm90(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                                       window=window, grads_out=grads_out)
        res = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, key_mask=key_mask,
                                       window=window)
        for o, r in zip(grads_out, res):
            o[...] = r
        return grads_out
    dq = xp.empty(q.shape, dtype=B.bfloat16)
    dk = xp.empty(k.shape, dtype=B.bfloat16)
    dv = xp.empty(k.shape, dtype=B.bfloat16)
    if Bsz * H == 0:
        return dq, dk, dv
    if _use_sm90(km, D) and Tq and Tk:
        return _sm90.flash_attention_backward_sm90(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                                   window=window)
    delta = xp.empty((Bsz, H, Tq), dtype=np.float32)  # workspace: written by the dq kernel, read by dkdv
    sq, sk, sv, sd = _strides("q", q), _strides("k", k), _strides("v", v), _strides("dout", dout)
    tail = (np.int32(Tq), np.int32(Tk), np.int32(H), np.int32(Hkv), scale, np.bool_(causal),
            *_mask_args(key_mask, km), *_window_args(window))
    if Tq:
        kq, smq = _kernel("dq", D, km is not None, window)
        kq((-(-Tq // BM), H, Bsz), (THREADS, 1, 1),
           (q, k, v, out, dout, lse, delta, dq, *sq, *sk, *sv, *sd, *tail), shared_mem=smq)
    if Tk:
        kd, smd = _kernel("dkdv", D, km is not None, window)
        kd((-(-Tk // BM), Hkv, Bsz), (THREADS, 1, 1),
           (q, k, v, dout, lse, delta, dk, dv, *sq, *sk, *sv, *sd, *tail), shared_mem=smd)
    return dq, dk, dv


__all__ = ["flash_attention", "flash_attention_backward"]
