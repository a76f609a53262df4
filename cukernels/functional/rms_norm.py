"""RMSNorm as autograd Functions: :func:`rms_norm` (``RMSNormF`` over ``ck.rms_norm`` / ``ck.rms_norm_backward``) and
the residual add + norm :func:`add_rms_norm` (``ck.add_rms_norm``): ops/rms_norm.py, kernels_cu/rms_norm.cu.

``add_rms_norm(x, r, w, eps) -> (y, h)``, ``h = x + r``, ``y = rms_norm(h)``. The tape autograd
(:mod:`cukernels.autograd`) gives a Function exactly one output Tensor, and runs a node only when a gradient reached
its output. A fused op with two outputs (y and h) whose backward needs *both* incoming gradients
(``dx = dh + rms_norm_backward(dy)`` in one kernel pass) is built from three nodes:

* :class:`AddRMSNormF` (inputs x, r, w) runs the fused forward kernel and outputs a hidden *pair* Tensor. Its
  data is h's array (any array would do: nobody outside this module sees the pair). Its backward runs once,
  after both picks below, with whatever gradients they collected.
* :class:`PickF` ``(pair, slot)`` outputs y (slot 0) or h (slot 1). Its backward does no arithmetic: it hands its
  incoming gradient to the pair's shared state and returns, for the pair, a token gradient (the pair's own
  array) -- only the first pick to run returns it, so the tape never adds anything into the pair's gradient.

Because the picks are the pair's only consumers, the tape runs both of them (those that got a gradient) before
AddRMSNormF, and runs AddRMSNormF whenever at least one of y, h got a gradient: h unused downstream (a final
norm), y unused, or both used all come out right, and no extra pass over memory is made. Gradients of x and r
are the same array (as :class:`~cukernels.functional.array_ops.Add` does); dweight is fp32-accumulated by the
kernel's deterministic two-stage reduction (``ck.rms_norm_backward``).

Nothing here touches the tape's internals: it uses Function.apply / ctx only.

FP8 training with current-scaled gradients (``autocast(ck.float8)``, ``scaling`` "current" or "hybrid"): dx of
:class:`AddRMSNormF` is the output gradient of the sublayer before it (the o_proj or down projection), which its FP8
backward casts after taking max |dy|. The backward kernel takes that amax of the dx it writes
(``ck.add_rms_norm_backward(..., amax=)``) and notes it for the array (``ops.fp8.note_amax``); the FP8 backward takes
it (``take_amax``) instead of an amax pass over dx (32 of the 48 such passes a step at the LLaMA-1B shape, 0.55 ms for
all 48). Decided at forward time, from the recipe active then (:func:`_grad_amax_wanted`; the backward may run outside
autocast); on NumPy arrays too, where the reference computes the same amax, so the CPU tests cover the hand-off. The
plain :class:`RMSNormF` does not: in the pre-norm models here its input is the embedding output, which no FP8 linear
reads, so its note would only hold a dx alive.

:func:`qk_rms_norm` (``QKRMSNormF``) is Qwen3's per-head RMSNorm of q and k on the heads of a packed projection output
qkv [B, T, H + 2 Hkv, D], the rope after it, in place (see its docstring for the passes it costs).
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from ..amp import get_fp8_recipe
from ..autograd import Function, _xp
from ..ops.fp8 import note_amax
from ..ops.rms_norm import add_rms_norm as _add_rms, add_rms_norm_backward as _add_rms_bwd
from ..ops.rms_norm import rms_norm as _rms, rms_norm_backward as _rms_bwd
from ..ops.rope import rope as _rope, rope_backward as _rope_bwd
from .array_ops import _composite_norm_args, _contig, _data, add, cast, mean, mul, pow, rsqrt
from .fp8 import _delayed, fp8_ok


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


class _Pair:
    """State shared by one AddRMSNormF node and its two PickF nodes: the forward's outputs until picked, then the
    gradients the picks collected until AddRMSNormF's backward consumes them."""

    __slots__ = ("y", "h", "dy", "dh", "token_sent")

    def __init__(self, y, h):
        self.y, self.h = y, h
        self.dy = self.dh = None
        self.token_sent = False


def _grad_amax_wanted(h) -> bool:
    """Whether the backward takes max |dx| for an FP8 linear's backward (module docstring): an FP8 recipe whose
    gradients are current-scaled is active, h is bfloat16 (what autocast's FP8 layers produce), and its shape is
    one the FP8 GEMMs take (:func:`~cukernels.functional.fp8.fp8_ok` of a layer with C outputs), so a note is not
    left for a consumer that runs in bf16."""
    r = get_fp8_recipe()
    if r is None or _delayed(r, "g") or h.dtype != B.bfloat16:
        return False
    C = h.shape[-1]
    return fp8_ok(C, C, h, needs_grad=True)


class AddRMSNormF(Function):
    """``(y, h)`` of ck.add_rms_norm as one hidden pair Tensor; use :func:`add_rms_norm`, which picks y and h."""

    @staticmethod
    def forward(ctx, x, r, w, eps, pair_box):
        y, h, rstd = _add_rms(x, r, w, eps, return_rstd=True)
        pair = _Pair(y, h)
        pair_box.append(pair)  # how apply()'s caller gets the state (apply returns only the output Tensor)
        ctx.pair = pair
        ctx.grad_amax = _grad_amax_wanted(h)
        ctx.save_for_backward(h, w, rstd)
        return h

    @staticmethod
    def backward(ctx, token):
        pair = ctx.pair
        dy, dh = pair.dy, pair.dh
        pair.dy = pair.dh = None  # ready for another backward through a retained graph
        pair.token_sent = False
        h, w, rstd = ctx.saved_tensors
        dw = None
        if dy is not None:
            dh = _contig(dh, h.dtype) if dh is not None else None
            amax = _xp(h).empty((), np.float32) if ctx.grad_amax else None
            dx, dw = _add_rms_bwd(_contig(dy, h.dtype), dh, h, w, rstd, amax=amax)
            if amax is not None:
                note_amax(dx, amax)  # for the FP8 backward of r's producer (functional/fp8.py, _dy_and_dx)
        else:  # only h got a gradient: it flows straight to x and r, and y contributes nothing to w
            dx = dh
        return dx, dx, dw, None, None


class PickF(Function):
    """Slot 0 (y) or 1 (h) of an AddRMSNormF pair; see the module docstring."""

    @staticmethod
    def forward(ctx, pair_data, pair, slot):
        ctx.pair, ctx.slot = pair, slot
        out = pair.y if slot == 0 else pair.h
        if slot == 0:
            pair.y = None  # the pick owns it now (the pair keeps no activation alive)
        else:
            pair.h = None
        return out

    @staticmethod
    def backward(ctx, g):
        pair = ctx.pair
        if ctx.slot == 0:
            pair.dy = g
        else:
            pair.dh = g
        if pair.token_sent:
            return None, None, None
        pair.token_sent = True
        return ctx.inputs[0].data, None, None  # the token: AddRMSNormF's backward ignores its value


def add_rms_norm(x, r, w, eps=1e-6, fused=True):
    """``h = x + r``, ``y = rms_norm(h, w, eps)``; returns ``(y, h)``.

    fused: one kernel forward (ck.add_rms_norm) and one backward pass that adds h's own gradient into dx
    (ck.add_rms_norm_backward). When x and r differ in dtype (the kernel takes one dtype; ``x + r`` promotes)
    it is ``add`` then the RMSNorm kernel Function. False: ``add`` then ``rms_norm(..., fused=False)``, the
    composite of plain array Functions (the reference the fused path is checked against).
    """
    if fused and _data(x).dtype == _data(r).dtype:
        box = []
        pair = AddRMSNormF.apply(x, r, w, eps, box)
        state = box[0]
        return PickF.apply(pair, state, 0), PickF.apply(pair, state, 1)
    h = add(x, r)
    return rms_norm(h, w, eps, fused=fused), h


class QKRMSNormF(Function):
    """Qwen3's q / k norms on a packed projection output, then the rope, **in place**: for qkv [B, T, H + 2 Hkv, D]
    the q heads ``qkv[:, :, :H]`` become ``rope(rms_norm(q, wq))`` and the k heads ``qkv[:, :, H:H + Hkv]``
    ``rope(rms_norm(k, wk))`` (v untouched); the output is qkv itself, which the packed attention then reads
    (``flash_attention_packed(qkv, ..., rope=None)``), so the projection stays one GEMM and the attention one
    packed gradient.

    ``ck.rms_norm`` reads C-contiguous rows and the q heads of a packed output are token-strided, so each of q and
    k is copied out once (that copy is also the pre-norm input the backward needs), normalised, and rotated by
    ``ck.rope`` straight back into its strided heads (rope takes token-strided views): 3 passes of q + k forward
    (a plain rope in place would be 1), against the 4 of a separate copy-back. Backward, on the incoming dqkv:
    ``ck.rope_backward`` from the strided heads into a contiguous buffer, ``ck.rms_norm_backward``, the result
    written back into the heads of dqkv (updated in place and returned: the packed attention's backward hands a
    fresh array that nothing else holds). Bytes and launches: benchmarks/NOTES.md, "Qwen3's q / k norm".
    """

    @staticmethod
    def forward(ctx, qkv, wq, wk, H, Hkv, eps, rope):
        xp = _xp(qkv)
        heads = ((qkv[:, :, :H], wq), (qkv[:, :, H:H + Hkv], wk))
        saved = []
        for view, w in heads:
            xc = xp.ascontiguousarray(view)  # the pre-norm heads, kept for the backward
            y, rstd = _rms(xc, w, eps, return_rstd=True)
            if rope is not None:
                _rope(y, rope[0], rope[1], positions=rope[2], out=view)
            else:
                view[...] = y
            saved += [xc, rstd]
        ctx.save_for_backward(*saved, wq, wk)
        ctx.H, ctx.Hkv, ctx.rope = H, Hkv, rope
        return qkv

    @staticmethod
    def backward(ctx, g):
        xq, rq, xk, rk, wq, wk = ctx.saved_tensors
        H, Hkv, rope = ctx.H, ctx.Hkv, ctx.rope
        if g.dtype != xq.dtype:
            g = g.astype(xq.dtype)  # (a fresh array: written in place below)
        dws = []
        for view, x, rstd, w in ((g[:, :, :H], xq, rq, wq), (g[:, :, H:H + Hkv], xk, rk, wk)):
            if rope is not None:  # strided heads in, a contiguous dy out
                dy = _rope_bwd(view, rope[0], rope[1], positions=rope[2])
            else:
                dy = _xp(g).ascontiguousarray(view)
            dx, dw = _rms_bwd(dy, x, w, rstd)
            view[...] = dx
            dws.append(dw)
        return g, dws[0], dws[1], None, None, None, None


def qk_rms_norm(qkv, n_heads, n_kv_heads, q_weight, k_weight, eps=1e-6, *, rope=None):
    """RMSNorm over head_dim of the q heads (``q_weight`` [D]) and the k heads (``k_weight`` [D]) of a packed
    projection output qkv [B, T, n_heads + 2 n_kv_heads, D], then ``rope = (cos, sin, positions)`` if given, in
    place (:class:`QKRMSNormF`); returns qkv (a Tensor over the same array) for the packed attention.

    ``q = rope(q / sqrt(mean(q**2, -1) + eps) * q_weight)``, the same for k with ``k_weight`` (Qwen3's
    ``self_attn.q_norm`` / ``k_norm``, applied before the rotary embedding).

    Example::

        >>> qkv = F.qk_rms_norm(qkv, 16, 8, att.q_norm.weight, att.k_norm.weight, 1e-6, rope=(cos, sin, None))
        >>> o = F.flash_attention_packed(qkv, 16, 8)
    """
    return QKRMSNormF.apply(qkv, q_weight, k_weight, int(n_heads), int(n_kv_heads), eps, rope)


__all__ = ['RMSNormF', 'AddRMSNormF', 'PickF', 'QKRMSNormF', 'rms_norm', 'add_rms_norm', 'qk_rms_norm']
