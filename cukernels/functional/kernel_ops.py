"""One autograd Function per kernel family, and the functional API the layers call.

Each Function's forward calls ``ck.<op>`` and its backward ``ck.<op>_backward`` (on NumPy arrays these run the
ops' reference paths, so both are checked on the CPU). Each functional entry point takes ``fused``: True runs
the Function, False the composite of plain array Functions (:mod:`.array_ops`) with the same math, so a kernel's
gain can be measured and its gradient cross-checked.
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from ..autograd import Function, Tensor, _xp
from ..ops.activations import gelu as _gelu, gelu_backward as _gelu_bwd
from ..ops.activations import swiglu as _swiglu, swiglu_backward as _swiglu_bwd
from ..ops.activations import swiglu_packed as _swiglu_p, swiglu_packed_backward as _swiglu_p_bwd
from ..ops.attention import flash_attention as _flash, flash_attention_backward as _flash_bwd
from ..ops.dropout import dropout as _drop, dropout_add as _drop_add, dropout_backward as _drop_bwd
from ..ops.dropout import keep_mask as _keep_mask
from ..ops.cross_entropy import cross_entropy as _ce, cross_entropy_backward as _ce_bwd
from ..ops.cross_entropy import cross_entropy_fused as _ce_fused
from ..ops.cross_entropy import check_options as _ce_options, cross_entropy_error as _ce_error
from ..ops.cross_entropy import _host_check_targets as _ce_host_check_targets
from ..ops.embedding import SparseRowGrad, embedding as _emb, embedding_backward as _emb_bwd
from ..ops.embedding import embedding_error as _emb_error
from ..ops.layer_norm import layer_norm as _ln, layer_norm_backward as _ln_bwd
from ..ops.rms_norm import rms_norm as _rms, rms_norm_backward as _rms_bwd
from ..ops.rope import rope as _rope, rope_backward as _rope_bwd
from ..ops.softmax import attn_softmax as _attn_sm, attn_softmax_backward as _attn_sm_bwd
from ..ops.softmax import softmax as _sm, softmax_backward as _sm_bwd
from ..settings import settings
from .array_ops import (PickLast, Take, _contig, _data, add, cast, concat, div, erf, exp, getitem, log,
                        masked_fill, mean, mul, pow, reshape, rsqrt, sigmoid, silu, sub, sum, tanh)


# ========================================================================== kernel-family Functions
class RMSNormF(Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = _rms(x, w, eps, return_rstd=True)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        dx, dw = _rms_bwd(_contig(g, x.dtype), x, w, rstd)
        return dx, dw, None


class LayerNormF(Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, eps):
        y, mean, rstd = _ln(x, gamma, beta, eps, return_stats=True)
        ctx.save_for_backward(x, gamma, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, gamma, mean, rstd = ctx.saved_tensors
        dx, dgamma, dbeta = _ln_bwd(_contig(g, x.dtype), x, gamma, mean, rstd)
        return dx, dgamma, dbeta, None


class SoftmaxF(Function):
    @staticmethod
    def forward(ctx, x):
        y = _sm(x, axis=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return _sm_bwd(y, _contig(g, y.dtype))


class AttnSoftmaxF(Function):
    """``softmax(scale * scores + mask)`` over the last axis of [B, H, Tq, Tk] scores (ck.attn_softmax)."""

    @staticmethod
    def forward(ctx, scores, key_mask=None, causal=False, scale=1.0):
        p = _attn_sm(scores, key_mask=key_mask, causal=causal, scale=scale)
        ctx.save_for_backward(p)
        ctx.scale = scale
        return p

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return _attn_sm_bwd(p, _contig(g, p.dtype), scale=ctx.scale), None, None, None


class FlashAttentionF(Function):
    """Fused causal/non-causal attention on [B, T, heads, D] bf16 q, k, v (ck.flash_attention), with an optional
    key-padding mask [B, Tk] applied inside the kernels (no [B, H, Tq, Tk] mask is made)."""

    @staticmethod
    def forward(ctx, q, k, v, causal=True, scale=None, key_mask=None):
        kw = {} if key_mask is None else {"key_mask": key_mask}
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
                None, None, None)


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
    back by the rope's backward inside that store on Hopper (``flash_attention_backward(rope=)``)."""

    @staticmethod
    def forward(ctx, qkv, H, Hkv, causal=True, scale=None, key_mask=None, rope=None):
        kw = {} if key_mask is None else {"key_mask": key_mask}
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
        return (dqkv,) + (None,) * 6


class CrossEntropyF(Function):
    """Mean (or sum) token cross-entropy of [N, V] logits; a 0-d fp32 device loss.

    When a gradient is wanted, the forward runs ``ck.cross_entropy_fused`` (loss and dlogits in one pass over
    the logits; with ``inplace=True`` dlogits overwrite the logits, which nothing else keeps) and the backward
    hands dlogits on as they are when the incoming gradient is the implicit 1 of ``loss.backward()``, scaled
    by it otherwise. ``fused_backward=False`` uses ``cross_entropy`` + ``cross_entropy_backward`` instead.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                inplace=False, fused_backward=True):
        kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
        ctx.kw = kw
        if not ctx.needs_input_grad[0]:
            return _ce(logits, targets, **kw)
        if fused_backward:
            loss, dlogits = _ce_fused(logits, targets, **kw, out=logits if inplace else None)
            ctx.save_for_backward(dlogits)
            ctx.fused = True
            return loss
        loss, lse = _ce(logits, targets, **kw, return_lse=True)
        ctx.save_for_backward(logits, targets, lse)
        ctx.fused = False
        return loss

    @staticmethod
    def backward(ctx, g):
        if ctx.fused:
            (dlogits,) = ctx.saved_tensors
            if not ctx.seed_one:
                xp = _xp(dlogits)
                xp.multiply(dlogits, g.astype(np.float32), out=dlogits, casting="unsafe")
            return (dlogits,) + (None,) * 6
        logits, targets, lse = ctx.saved_tensors
        dl = _ce_bwd(logits, targets, lse, g, **ctx.kw)
        return (dl,) + (None,) * 6


class EmbeddingF(Function):
    """``table[ids]`` through ``ck.embedding``; dense gradient through ``ck.embedding_backward``, accumulated
    straight into the table's ``.grad`` buffer when it has one."""

    @staticmethod
    def forward(ctx, table, ids):
        ctx.save_for_backward(ids)
        ctx.V = table.shape[0]
        return _emb(ids, table)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        g = _contig(g)
        buf, acc = ctx.leaf_grad_write(0)
        if buf is not None:
            _emb_bwd(ids, g, ctx.V, out=buf, accumulate=acc)
            return None, None
        return _emb_bwd(ids, g, ctx.V), None


class SparseEmbeddingF(Function):
    """As EmbeddingF, but the gradient goes to ``table_tensor.sparse_grad`` (a ``ck.SparseRowGrad``: only the
    rows seen are touched, and the optimizer updates only those rows). ``table_lowp`` is an optional array
    read instead of the table (the bf16 shadow under autocast)."""

    @staticmethod
    def forward(ctx, table, ids, sparse_grad, table_lowp=None):
        ctx.save_for_backward(ids)
        ctx.sg = sparse_grad
        return _emb(ids, table if table_lowp is None else table_lowp)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        ctx.sg.accumulate(ids, _contig(g))
        return None, None, None, None


class EmbeddingLowpF(Function):
    """Dense embedding reading a low-precision copy of the table (the shadow) with the gradient to the table."""

    @staticmethod
    def forward(ctx, table, ids, table_lowp):
        ctx.save_for_backward(ids)
        ctx.V = table.shape[0]
        return _emb(ids, table_lowp)

    @staticmethod
    def backward(ctx, g):
        gt, _ = EmbeddingF.backward(ctx, g)
        return gt, None, None


class RopeF(Function):
    @staticmethod
    def forward(ctx, x, cos, sin, positions=None):
        ctx.save_for_backward(cos, sin, positions)
        return _rope(x, cos, sin, positions=positions)

    @staticmethod
    def backward(ctx, g):
        cos, sin, positions = ctx.saved_tensors
        return _rope_bwd(_contig(g), cos, sin, positions=positions), None, None, None


class SwiGLUF(Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _swiglu(gate, up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        return _swiglu_bwd(gate, up, _contig(g, gate.dtype))


class SwiGLUPackedF(Function):
    @staticmethod
    def forward(ctx, gu):
        ctx.save_for_backward(gu)
        return _swiglu_p(gu)

    @staticmethod
    def backward(ctx, g):
        (gu,) = ctx.saved_tensors
        return _swiglu_p_bwd(gu, _contig(g, gu.dtype))


class DropoutF(Function):
    """Inverted dropout (ck.dropout); the backward draws the same mask again from (seed, offset)."""

    @staticmethod
    def forward(ctx, x, p, seed, offset):
        ctx.rng = (p, seed, offset)
        return _drop(x, p, seed=seed, offset=offset)

    @staticmethod
    def backward(ctx, g):
        p, seed, offset = ctx.rng
        return _drop_bwd(_contig(g), p, seed=seed, offset=offset), None, None, None


class DropoutAddF(Function):
    """``residual + dropout(x)`` in one kernel (ck.dropout_add): GPT-2's residual branch."""

    @staticmethod
    def forward(ctx, x, residual, p, seed, offset):
        ctx.rng = (p, seed, offset)
        ctx.xdt = x.dtype
        return _drop_add(x, _contig(residual), p, seed=seed, offset=offset)

    @staticmethod
    def backward(ctx, g):
        p, seed, offset = ctx.rng
        g = _contig(g)
        dx = _drop_bwd(g, p, seed=seed, offset=offset, dtype=ctx.xdt) if ctx.needs_input_grad[0] else None
        return dx, g, None, None, None


class GeluF(Function):
    """ck.gelu: the tanh approximation or the exact erf form (``approximate="none"``)."""

    @staticmethod
    def forward(ctx, x, approximate="tanh"):
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return _gelu(x, approximate=approximate)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _gelu_bwd(x, _contig(g, x.dtype), approximate=ctx.approximate), None


# ---- the composite (fused=False) paths check their arguments as the kernel ops do (issue 36); float64 stays
# allowed there (the gradient-check oracle), everything else matches: eps, weight shapes, ids and positions.
def _composite_norm_args(x, eps, **weights):
    xd = _data(x)
    if B._kind(xd) is None or not (xd.dtype.kind == "f" or xd.dtype == B.bfloat16) or xd.ndim < 1:
        raise TypeError(f"x: expected a float array or Tensor [..., C]; got {B._got(x)}")
    C = xd.shape[-1]
    for name, w in weights.items():
        wd = _data(w)
        if B._kind(wd) is None or tuple(wd.shape) != (C,):
            raise ValueError(f"{name}: expected shape ({C},) to match x's last axis; got "
                             f"{tuple(wd.shape) if B._kind(wd) is not None else B._got(w)}")
    B.check_real("eps", eps, min=0, min_open=True)


def _composite_rows(name, ids, n, xp, err_word):
    """Integer ``ids`` indexing ``n`` rows on a composite path: the NumPy path raises for one outside [0, n) (as
    the kernel ops' reference does; NumPy would wrap a negative one silently); on CuPy they are clamped into
    range and ``err_word`` is set, as the kernels do (device-side: no host read)."""
    if B._kind(ids) is None or ids.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array; got {B._got(ids) if B._kind(ids) is None else ids.dtype}")
    if xp is np:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise B.IdsOutOfRange(f"{name}: value {bad} is out of range for {n} rows (valid: 0..{n - 1})")
        return ids
    if err_word is not None:
        bad = ((ids < 0) | (ids >= n)).any().astype(np.int32)
        xp.bitwise_or(err_word, bad, out=err_word)
    return xp.clip(ids, 0, n - 1)


def rms_norm(x, w, eps=1e-6, fused=True):
    """RMSNorm over the last axis. fused -> ck.rms_norm; else pow/mean/rsqrt/mul in fp32."""
    if fused:
        return RMSNormF.apply(x, w, eps)
    _composite_norm_args(x, eps, weight=w)
    dt = _data(x).dtype
    xf = cast(x, np.float32) if dt == B.bfloat16 else x
    r = rsqrt(add(mean(pow(xf, 2), axis=-1, keepdims=True), eps))
    wf = cast(w, _data(xf).dtype)
    return cast(mul(mul(xf, r), wf), dt)


def layer_norm(x, gamma, beta, eps=1e-5, fused=True):
    if fused:
        return LayerNormF.apply(x, gamma, beta, eps)
    _composite_norm_args(x, eps, gamma=gamma, beta=beta)
    dt = _data(x).dtype
    xf = cast(x, np.float32) if dt == B.bfloat16 else x
    c = sub(xf, mean(xf, axis=-1, keepdims=True))
    r = rsqrt(add(mean(pow(c, 2), axis=-1, keepdims=True), eps))
    ft = _data(xf).dtype
    return cast(add(mul(mul(c, r), cast(gamma, ft)), cast(beta, ft)), dt)


def softmax(x, fused=True):
    """Softmax over the last axis. fused -> ck.softmax; else max/exp/sum (max held constant: exact)."""
    if fused:
        return SoftmaxF.apply(x)
    dt = _data(x).dtype
    xf = cast(x, np.float32) if dt == B.bfloat16 else x
    m = _data(xf).max(axis=-1, keepdims=True)
    e = exp(sub(xf, m))
    return cast(div(e, sum(e, axis=-1, keepdims=True)), dt)


def flash_attention(q, k, v, *, causal=True, scale=None, key_mask=None):
    """Fused attention (ck.flash_attention): q [B, Tq, H, D], k/v [B, Tk, Hkv, D], bf16 -> o [B, Tq, H, D];
    ``key_mask`` [B, Tk] (nonzero = keep) removes padded keys."""
    return FlashAttentionF.apply(q, k, v, causal, scale, key_mask)


def flash_attention_packed(qkv, n_heads, n_kv_heads, *, causal=True, scale=None, key_mask=None, rope=None):
    """:func:`flash_attention` on the head slices of a packed qkv [B, T, H + 2 Hkv, D]; one gradient array.
    ``rope=(cos, sin, positions)`` rotates the q and k heads first, in place in qkv (see FlashAttentionPackedF)."""
    return FlashAttentionPackedF.apply(qkv, n_heads, n_kv_heads, causal, scale, key_mask, rope)


def attn_softmax(scores, *, causal=False, scale=1.0, key_mask=None, fused=True):
    """softmax(scale * scores) over [B, H, Tq, Tk] with a causal mask aligned at the end (query i sees keys
    <= i + Tk - Tq) and an optional boolean key mask [B, Tk] (True = keep). Fully masked rows give zeros."""
    if fused:
        return AttnSoftmaxF.apply(scores, key_mask, causal, scale)
    s = _data(scores)
    xp, (Tq, Tk) = _xp(s), s.shape[-2:]
    dt = s.dtype
    x = mul(cast(scores, np.float32) if dt == B.bfloat16 else scores, scale)
    drop = None
    if causal:
        drop = xp.arange(Tk)[None, :] > (xp.arange(Tq)[:, None] + (Tk - Tq))
    if key_mask is not None:
        km = ~key_mask.astype(bool)[:, None, None, :]
        drop = km if drop is None else (drop | km)
    if drop is None:
        return cast(softmax(x, fused=False), dt)
    x = masked_fill(x, drop, -np.inf)
    xd = _data(x)
    m = xd.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0).astype(xd.dtype)
    e = exp(sub(x, m))
    ssum = _data(e).sum(axis=-1, keepdims=True)
    den = add(sum(e, axis=-1, keepdims=True), (ssum == 0).astype(xd.dtype))  # fully masked rows -> 0
    return cast(div(e, den), dt)


def cross_entropy(logits, targets, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, fused=True,
                  inplace=False, fused_backward=True):
    """Token cross-entropy of [N, V] logits against int targets [N]; a 0-d fp32 loss. Targets equal to
    ignore_index count for nothing; "mean" divides by the number of the others."""
    if B.check_bool("fused", fused):
        return CrossEntropyF.apply(logits, targets, ignore_index, reduction, label_smoothing, inplace,
                                   fused_backward)
    # The composite path validates as the kernels do (ops.cross_entropy.check_options: reduction, ignore_index,
    # label_smoothing in [0, 1]), and treats a target outside [0, V) that is not ignore_index as they do: an
    # error on the NumPy path; on CuPy the row counts as ignored and the cross-entropy error word is set
    # (a device-side flag: no host read).
    ig, _ = _ce_options(ignore_index, reduction, label_smoothing)
    x0, t = _data(logits), _data(targets)
    xp = B.array_module(logits=x0, targets=t)
    if not (x0.dtype.kind == "f" or x0.dtype == B.bfloat16) or x0.ndim < 1 or x0.shape[-1] < 1:
        raise TypeError(f"logits: expected a float array [..., V] with V >= 1; got {x0.dtype} {tuple(x0.shape)}")
    B.check_dtype("targets", t, (np.int32, np.int64))
    B.check_shape("targets", t, x0.shape[:-1], " (logits.shape[:-1])")
    V = x0.shape[-1]
    x = cast(logits, np.float32) if x0.dtype == B.bfloat16 else logits
    m = _data(x).max(axis=-1, keepdims=True)
    z = sub(x, m)
    lse = log(sum(exp(z), axis=-1, keepdims=True))
    valid = t != ig
    if xp is np:
        _ce_host_check_targets(t, V, ig)
    else:
        bad = valid & ((t < 0) | (t >= V))
        err = _ce_error()
        xp.bitwise_or(err, bad.any().astype(np.int32), out=err)
        valid = valid & ~bad
    nll = sub(reshape(lse, t.shape), PickLast.apply(z, xp.where(valid, t, 0)))
    if label_smoothing:
        smooth = sub(reshape(lse, t.shape), mul(sum(z, axis=-1), 1.0 / V))
        nll = add(mul(nll, 1.0 - label_smoothing), mul(smooth, label_smoothing))
    ft = _data(x).dtype
    per_row = mul(nll, valid.astype(ft))
    if reduction == "none":
        return per_row
    tot = sum(per_row)
    if reduction == "sum":
        return tot
    return mul(tot, (1.0 / xp.maximum(valid.sum(), 1)).astype(ft))


def embedding(table, ids, *, fused=True, table_lowp=None, sparse=False):
    """Rows of ``table`` [V, D] at int ids; gradient dense (into table.grad) or sparse-row
    (into table.sparse_grad, a ck.SparseRowGrad)."""
    ids = _data(ids)
    if not fused:
        ids = _composite_rows("ids", ids, _data(table).shape[0], _xp(_data(table)),
                              None if _xp(_data(table)) is np else _emb_error())
        out = Take.apply(table, ids)
        return cast(out, table_lowp.dtype) if table_lowp is not None else out
    if sparse and isinstance(table, Tensor) and table.requires_grad:
        if table.sparse_grad is None:
            table.sparse_grad = _new_sparse_grad(table)
        return SparseEmbeddingF.apply(table, ids, table.sparse_grad, table_lowp)
    if table_lowp is not None:
        return EmbeddingLowpF.apply(table, ids, table_lowp)
    return EmbeddingF.apply(table, ids)


def _new_sparse_grad(table):
    return SparseRowGrad(table.shape[0], table.shape[1])


def rotate_half(x):
    D = _data(x).shape[-1]
    return concat([mul(getitem(x, (Ellipsis, slice(D // 2, None))), -1.0),
                   getitem(x, (Ellipsis, slice(0, D // 2)))], axis=-1)


def rope(x, cos, sin, *, positions=None, fused=True):
    """Rotary embedding on [B, T, H, D] (HF rotate-half layout) with fp32 cos/sin [>=T, D/2]."""
    if fused:
        return RopeF.apply(x, cos, sin, positions)
    xd = _data(x)
    xp, T = _xp(xd), xd.shape[1]
    if positions is not None:  # (the kernel clamps positions into the table; the reference raises)
        positions = _composite_rows("positions", positions, cos.shape[0], xp, None)
    elif T > cos.shape[0]:
        raise ValueError(f"cos: has {cos.shape[0]} positions but x has seq = {T} (pass a longer cache, or positions=)")
    c = cos[positions] if positions is not None else cos[:T]
    s = sin[positions] if positions is not None else sin[:T]
    c = xp.concatenate([c, c], axis=-1)
    s = xp.concatenate([s, s], axis=-1)
    c = (c[:, :, None, :] if c.ndim == 3 else c[None, :, None, :])
    s = (s[:, :, None, :] if s.ndim == 3 else s[None, :, None, :])
    dt = xd.dtype
    xf = cast(x, np.float32) if dt == B.bfloat16 else x
    ft = _data(xf).dtype
    return cast(add(mul(xf, c.astype(ft)), mul(rotate_half(xf), s.astype(ft))), dt)


def swiglu(gate, up, fused=True):
    """``silu(gate) * up``."""
    if fused:
        return SwiGLUF.apply(gate, up)
    if tuple(_data(up).shape) != tuple(_data(gate).shape):  # (broadcast silently, or NumPy's message)
        raise ValueError(f"up: expected shape {tuple(_data(gate).shape)} (the shape of gate); got "
                         f"{tuple(_data(up).shape)}")
    return mul(silu(gate), up)


def swiglu_packed(gu, fused=True):
    """``silu(gu[..., :F]) * gu[..., F:]`` for gu [..., 2F]."""
    if fused:
        return SwiGLUPackedF.apply(gu)
    F2 = _data(gu).shape[-1]
    return swiglu(getitem(gu, (Ellipsis, slice(0, F2 // 2))), getitem(gu, (Ellipsis, slice(F2 // 2, None))),
                  fused=False)


def dropout(x, p, *, seed, offset, training=True):
    """Inverted dropout with a counter-based mask (ck.dropout): ``seed`` per site, ``offset`` per forward pass
    (ints or 0-d device arrays: a captured step that advances the offset draws fresh masks). Identity when not
    training or p == 0."""
    if not training or not p:
        return x
    if _data(x).dtype == np.float64:  # gradient checks on the NumPy path: the same mask, as a constant product
        return mul(x, _mask64(x, p, seed, offset))
    return DropoutF.apply(x, p, seed, offset)


def _mask64(x, p, seed, offset):
    keep = _keep_mask(_data(x).shape, p, seed=int(seed), offset=int(offset))
    return keep.astype(np.float64) / (1.0 - p)


def dropout_add(x, residual, p, *, seed, offset, training=True):
    """``residual + dropout(x)`` (one kernel when training with p > 0, else a plain add)."""
    if not training or not p:
        return add(residual, x)
    if _data(x).dtype == np.float64:
        return add(residual, mul(x, _mask64(x, p, seed, offset)))
    return DropoutAddF.apply(x, residual, p, seed, offset)


def gelu(x, fused=True, approximate="tanh"):
    """GELU. ``approximate="tanh"`` (GPT-2's "gelu_new"): ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``;
    ``"none"``: the exact ``0.5 x (1 + erf(x / sqrt(2)))``. Fused: the ck.gelu kernels (both forms); composite:
    array ops (float64 inputs, gradient checks, take this path for the exact form too)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate: expected 'tanh' or 'none'; got {approximate!r}")
    if fused and not (approximate == "none" and _data(x).dtype == np.float64):
        return GeluF.apply(x, approximate)
    if approximate == "none":
        return mul(mul(x, 0.5), add(erf(mul(x, float(1 / np.sqrt(2.0)))), 1.0))
    c = float(np.sqrt(2.0 / np.pi))
    inner = mul(add(x, mul(pow(x, 3), 0.044715)), c)
    return mul(mul(x, 0.5), add(tanh(inner), 1.0))


