"""Fused attention as autograd Functions: :func:`flash_attention` (``FlashAttentionF``: ``ck.flash_attention``, which
runs the wgmma kernels on Hopper) and :func:`flash_attention_packed` (``FlashAttentionPackedF``: q, k, v as head slices
of one packed projection, the rope in place, one dqkv): ops/attention.py, ops/attention_sm90.py.
"""
from __future__ import annotations

from ..autograd import Function, _xp
from ..ops.attention import flash_attention as _flash, flash_attention_backward as _flash_bwd
from ..ops.rope import rope as _rope, rope_backward as _rope_bwd
from ..settings import settings
from .array_ops import _contig


def _mask_kw(key_mask, window):
    """The keyword arguments of the flash calls for an optional key mask and sliding window (none when absent)."""
    kw = {} if key_mask is None else {"key_mask": key_mask}
    if window is not None:
        kw["window"] = window
    return kw


class FlashAttentionF(Function):
    """Fused causal/non-causal attention on [B, T, heads, D] bf16 q, k, v (ck.flash_attention), with an optional
    key-padding mask [B, Tk] applied inside the kernels (no [B, H, Tq, Tk] mask is made) and an optional sliding
    window (``window``: a query sees its W latest keys; causal only), passed to the forward and the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal=True, scale=None, key_mask=None, window=None):
        kw = _mask_kw(key_mask, window)
        o, lse = _flash(q, k, v, causal=causal, scale=scale, return_lse=True, **kw)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.kw = causal, scale, kw
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved_tensors
        if g.dtype != o.dtype or not g.flags.c_contiguous:
            g = _contig(g, o.dtype)
        return (*_flash_bwd(g, q, k, v, o, lse, causal=ctx.causal, scale=ctx.scale, **ctx.kw),
                None, None, None, None)


# FlashAttentionPackedF's rope backward inside the attention backward's store (sm_90) instead of one ck.rope_backward
# launch over dq / dk after it: ck.settings.rope_in_attention_backward (the A/B switch: --ab
# "rope_in_attention_backward=0").


class FlashAttentionPackedF(Function):
    """Fused attention reading q, k, v as head slices of one packed projection output qkv [B, T, H + 2 Hkv, D]
    (GPT-2's c_attn, LLaMA's q / k / v as one :func:`packed_linear`), returning dqkv as one array: three GetItem
    gradients would each allocate and zero a full-size buffer and two adds would sum them (~2 ms of a GPT-2 124M
    step at B8xT1024).

    ``rope = (cos, sin, positions)``: the rotary embedding of the q and k heads first, **in place in qkv** (the
    first H + Hkv heads of each token are q then k: one ``ck.rope`` launch over a token-strided view), so the
    caller passes a projection output nothing else reads; the backward has the attention kernels store dq, dk, dv
    straight into the head slices of one dqkv array (no concatenate: 50 MB a layer at B8xT1024), dq and dk rotated
    back by the rope's backward inside that store on Hopper (``flash_attention_backward(rope=)``). ``window``: the
    sliding window of :func:`flash_attention`, forward and backward."""

    @staticmethod
    def forward(ctx, qkv, H, Hkv, causal=True, scale=None, key_mask=None, rope=None, window=None):
        kw = _mask_kw(key_mask, window)
        if rope is not None:
            qk = qkv[:, :, :H + Hkv]
            _rope(qk, rope[0], rope[1], positions=rope[2], out=qk)
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
        o, lse = _flash(q, k, v, causal=causal, scale=scale, return_lse=True, **kw)
        ctx.save_for_backward(qkv, o, lse)
        ctx.H, ctx.Hkv, ctx.causal, ctx.scale, ctx.kw, ctx.rope = H, Hkv, causal, scale, kw, rope
        return o

    @staticmethod
    def backward(ctx, g):
        qkv, o, lse = ctx.saved_tensors
        H, Hkv = ctx.H, ctx.Hkv
        if g.dtype != o.dtype or not g.flags.c_contiguous:
            g = _contig(g, o.dtype)
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
        dqkv = _xp(qkv).empty(qkv.shape, dtype=qkv.dtype)  # the kernels store dq, dk, dv into its head slices
        fuse = ctx.rope is not None and settings.rope_in_attention_backward
        _flash_bwd(g, q, k, v, o, lse, causal=ctx.causal, scale=ctx.scale, **ctx.kw,
                   grads_out=(dqkv[:, :, :H], dqkv[:, :, H:H + Hkv], dqkv[:, :, H + Hkv:]),
                   rope=ctx.rope if fuse else None)
        if ctx.rope is not None and not fuse:  # one rope launch over the q and k heads of dqkv
            cos, sin, pos = ctx.rope
            dqk = dqkv[:, :, :H + Hkv]
            _rope_bwd(dqk, cos, sin, positions=pos, out=dqk)
        return (dqkv,) + (None,) * 7


def flash_attention(q, k, v, *, causal=True, scale=None, key_mask=None, window=None):
    """Fused attention (ck.flash_attention): q [B, Tq, H, D], k/v [B, Tk, Hkv, D], bf16 -> o [B, Tq, H, D];
    ``key_mask`` [B, Tk] (nonzero = keep) removes padded keys; ``window=W`` (causal) keeps each query's W latest
    keys only (sliding-window attention: Mistral, Qwen2's "sliding_attention" layers)."""
    return FlashAttentionF.apply(q, k, v, causal, scale, key_mask, window)


def flash_attention_packed(qkv, n_heads, n_kv_heads, *, causal=True, scale=None, key_mask=None, rope=None,
                           window=None):
    """:func:`flash_attention` on the head slices of a packed qkv [B, T, H + 2 Hkv, D]; one gradient array.
    ``rope=(cos, sin, positions)`` rotates the q and k heads first, in place in qkv (see FlashAttentionPackedF);
    ``window``: the sliding window (see :func:`flash_attention`)."""
    return FlashAttentionPackedF.apply(qkv, n_heads, n_kv_heads, causal, scale, key_mask, rope, window)


__all__ = ['FlashAttentionF', 'FlashAttentionPackedF', 'flash_attention', 'flash_attention_packed']
