"""The FP8 linear: ``y = x @ W^T (+ b)`` with its three GEMMs on FP8 tensor cores (``autocast(ck.float8)``).

With ``q(t) = fp8(t * s_t)`` (per-tensor scales on the device, ``ops/fp8.py``) and ``^T`` a transposed copy made in
the same cast pass (cuBLASLt on Hopper multiplies FP8 operands only K-major)::

    forward   y  = (s_x s_W)^-1  q4(x) @ q4(W)^T                  E4M3 x E4M3 -> bf16
    backward  dx = (s_g s_W)^-1  qg(dy) @ q4(W)^T^T   = dy @ W     qg(dy) [N, out] x W^T [in, out]
              dW += (s_g s_x)^-1 qg(dy)^T @ q4(x)^T^T = dy^T @ x   fp32, beta = 1 into W's .grad

``q4`` is E4M3 (inputs, weights), ``qg`` the recipe's gradient format. The weight comes as the optimizer's FP8 copy
when it keeps one (``w_fp8 = (q, q^T, s_inv)``: ``amp.fp8_weight``, written in the update's pass, no cast here),
else it is read from its bf16 shadow (``amp.lowp_weight``) or the fp32 master and quantised per call, once for every
use (the q / k / v and gate / up packs: one joined weight, one scale). The forward keeps ``q4(x)^T`` (1 byte an
element, instead of bf16 x's 2) and ``q4(W)^T`` for the backward. The bias, when there is one, is added to the bf16
output and its gradient is the bf16 column sums of dy, as in :class:`array_ops.Linear`. Scaling per
:class:`amp.Float8Recipe`: current (an amax pass before each cast) or delayed (the amax of the previous call of the same layer, kept in a
device history on the module: one pass). On NumPy arrays the same Functions run the references (ml_dtypes
casts, the product of the dequantised values), so the math is checked on the CPU.

Shapes cuBLASLt's FP8 GEMMs take: in and out features multiples of 16, and (when a gradient is wanted) a token
count that is one too (the weight-gradient GEMM's K); :func:`fp8_ok` says whether a layer qualifies, and the
layers run the bf16 path otherwise.
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from ..autograd import Function, _xp, is_grad_enabled
from ..blas import matmul as _ck_matmul
from ..ops.activations import swiglu_packed as _swiglu_p, swiglu_packed_backward as _swiglu_p_bwd
from ..ops.elementwise import add as _ck_add
from ..ops.fp8 import fp8_history, fp8_quantize, fp8_swiglu_quantize, take_amax
from .array_ops import _ones_row, _weight_grad, gemm, joined_rows

E4M3 = B.float8_e4m3fn


class Fp8State:
    """A layer's delayed-scaling histories (``ck.fp8_history``: one per tensor it casts: input, weight, output
    gradient), made at the first call (eagerly, before any graph capture) and kept on the module. ``g_amax``:
    ``(dy, amax)`` left by the op that produced this layer's output gradient with its amax (:class:`Fp8SwiGLUDown`
    for the gate / up pack), taken by the layer's backward when ``dy`` is the array it receives."""

    __slots__ = ("x", "w", "g", "g_amax")

    def __init__(self):
        self.x = self.w = self.g = self.g_amax = None


def fp8_ok(in_features, out_features, x, needs_grad=None) -> bool:
    """Whether cuBLASLt's FP8 GEMMs take this layer: features multiples of 16, and the token count too when a
    gradient will be wanted (it is the weight gradient's K)."""
    if in_features % 16 or out_features % 16:
        return False
    if needs_grad is None:
        needs_grad = is_grad_enabled()
    if needs_grad:
        shape = x.shape
        tokens = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return tokens % 16 == 0
    return True


def _contig(a):
    return a if a.flags.c_contiguous else _xp(a).ascontiguousarray(a)


def _delayed(recipe, slot) -> bool:
    """Whether the recipe scales tensor ``slot`` (x, w or g) by its history: delayed, or hybrid for x and w."""
    return recipe.scaling == "delayed" or (recipe.scaling == "hybrid" and slot != "g")


def _quantize(t, fmt, recipe, state, slot, transpose=True, amax=None):
    """``(q, q^T, s_inv)`` of a 2-D array under the recipe (delayed: the layer's history for ``slot``; current:
    ``amax``, max |t| from the kernel that wrote t, when given, else an amax pass)."""
    hist = None
    if _delayed(recipe, slot) and state is not None:
        hist = getattr(state, slot)
        if hist is None or _xp(hist) is not _xp(t):
            hist = fp8_history(t)
            setattr(state, slot, hist)
    r = fp8_quantize(t, dtype=fmt, margin=recipe.margin, transpose=transpose, history=hist,
                     amax=amax if hist is None else None)
    return r if transpose else (r[0], None, r[1])


def _weight(src, w_fp8, recipe, state, transpose):
    """``(q, q^T, s_inv)`` of the weight: the optimizer's FP8 copy when given, else quantised from ``src``."""
    if w_fp8 is not None:
        return w_fp8
    return _quantize(_contig(src), E4M3, recipe, state, "w", transpose)


def _gemm(a, b, sa, sb, fa, fb, fast, out=None, out_dtype=None, accumulate=False):
    return _ck_matmul(a, b, trans_b=True, a_scale=sa, b_scale=sb, a_dtype=fa, b_dtype=fb, fast_accum=fast, out=out,
                      out_dtype=out_dtype, beta=1.0 if accumulate else 0.0)


def _dy_and_dx(ctx, g, wqT, sw, dx_dtype, amax=None):
    """The backward's first half, shared by the FP8 Functions: dy (``g``) as a 2-D array and quantised in the
    recipe's gradient format (``amax``: max |dy| from the kernel that wrote it, else the recipe's own rule), and
    ``dx = dy @ W`` in ``dx_dtype`` when input 0 wants it. Returns ``(g2, q(dy)^T, s_inv, dx or None)``.

    Without ``amax``, current scaling of the gradient takes the one noted for ``g`` itself by the kernel that
    wrote it (``ops.fp8.take_amax``: add_rms_norm's backward, :class:`~cukernels.functional.rms_norm.AddRMSNormF`),
    so no amax pass reads dy again."""
    r = ctx.recipe
    noted = take_amax(g)  # taken (and dropped) whatever the recipe: a note is never left behind
    if amax is None and not _delayed(r, "g"):
        amax = noted
    g2 = _contig(g.reshape(-1, g.shape[-1]))
    gq, gqT, sg = _quantize(g2, r.grad_dtype, r, ctx.state, "g", amax=amax)
    dx = None
    if ctx.needs_input_grad[0]:
        dx = _gemm(gq, wqT, sg, sw, r.grad_dtype, E4M3, r.fast_accum_grad, out_dtype=dx_dtype)
    return g2, gqT, sg, dx


def _dw(ctx, i, gqT, xqT, sg, sx):
    """``dW = dy^T @ x`` (fp32) for weight input ``i``: into its ``.grad`` (beta = 1 once the step's first write has
    overwritten the stale buffer), or returned; ``gqT`` q(dy)^T or its rows of that weight."""
    r = ctx.recipe
    return _weight_grad(ctx, i, lambda out, acc: _gemm(gqT, xqT, sg, sx, r.grad_dtype, E4M3, r.fast_accum_grad,
                                                       out=out, out_dtype=np.float32 if out is None else None,
                                                       accumulate=acc))


class Fp8Linear(Function):
    """``y = x @ W^T (+ b)`` in FP8 (module docstring). W is [out, in]; ``w_lowp`` the array the casts read (the
    bf16 shadow) or None (W itself); the gradient goes to W, written straight into its ``.grad`` (fp32, beta = 1
    once the step's first write has overwritten the stale buffer)."""

    @staticmethod
    def forward(ctx, x, w, w_lowp=None, b=None, recipe=None, state=None, w_fp8=None):
        src = w_lowp if w_lowp is not None else w
        x2 = _contig(x.reshape(-1, x.shape[-1]))
        odt = x2.dtype if x2.dtype in B.FLOATS else np.dtype(np.float32)
        tr = any(ctx.needs_input_grad)  # the transposed copies serve the backward only
        xq, xqT, sx = _quantize(x2, E4M3, recipe, state, "x", tr)
        wq, wqT, sw = _weight(src, w_fp8, recipe, state, tr)
        y = _gemm(xq, wq, sx, sw, E4M3, E4M3, recipe.fast_accum, out_dtype=odt)
        if b is not None:
            if _xp(y) is np:
                y += b.astype(y.dtype)
            else:
                _ck_add(y, b, out=y)
        ctx.save_for_backward(xqT, wqT, sx, sw)
        ctx.xshape, ctx.xdtype, ctx.recipe, ctx.state = x.shape, odt, recipe, state
        return y.reshape(x.shape[:-1] + (w.shape[0],))

    @staticmethod
    def backward(ctx, g):
        xqT, wqT, sx, sw = ctx.saved_tensors
        g2, gqT, sg, gx = _dy_and_dx(ctx, g, wqT, sw, ctx.xdtype)
        gx = None if gx is None else gx.reshape(ctx.xshape)
        gw = _dw(ctx, 1, gqT, xqT, sg, sx)
        gb = None
        if len(ctx.needs_input_grad) > 3 and ctx.needs_input_grad[3]:
            gb = _bias_grad(ctx, 3, g2)
        return gx, gw, None, gb, None, None, None


def _bias_grad(ctx, i, g2):
    """The column sums of dy as one GEMM ``ones[1, N] @ dy`` (array_ops.Linear's), into b's .grad when it has one."""
    ones = _ones_row(_xp(g2), g2.shape[0], g2.dtype)
    gb = _weight_grad(ctx, i, lambda out, acc: gemm(ones, g2, out=None if out is None else out.reshape(1, -1),
                                                    accumulate=acc))
    return None if gb is None else gb.reshape(-1)


class Fp8PackedLinear(Function):
    """``y = x @ [W_1; ...; W_n]^T`` in FP8 (the q / k / v and gate / up packs; :class:`array_ops.PackedLinear`'s
    layout): the n weights quantised as one joined matrix (one scale: a view when the arrays the casts read lie
    back to back, as the optimizer's flat buffers put them, else a concatenated copy), one GEMM each way, and the
    weight gradient one GEMM into the joined ``.grad`` buffers or one per weight on row slices of ``dy^T``."""

    @staticmethod
    def forward(ctx, x, lows, recipe, state, w_fp8, *ws):
        x2 = _contig(x.reshape(-1, x.shape[-1]))
        odt = x2.dtype if x2.dtype in B.FLOATS else np.dtype(np.float32)
        cuts = np.cumsum([0] + [w.shape[0] for w in ws]).tolist()
        W = None
        if w_fp8 is None:
            srcs = [lo if lo is not None else w for w, lo in zip(ws, lows)]
            W = joined_rows(srcs)
            if W is None:
                W = _xp(x2).concatenate([s if s.dtype == srcs[0].dtype else s.astype(srcs[0].dtype) for s in srcs],
                                        axis=0)
        tr = any(ctx.needs_input_grad)
        xq, xqT, sx = _quantize(x2, E4M3, recipe, state, "x", tr)
        wq, wqT, sw = _weight(W, w_fp8, recipe, state, tr)
        y = _gemm(xq, wq, sx, sw, E4M3, E4M3, recipe.fast_accum, out_dtype=odt)
        ctx.save_for_backward(xqT, wqT, sx, sw)
        ctx.xshape, ctx.xdtype, ctx.recipe, ctx.state, ctx.cuts = x.shape, odt, recipe, state, cuts
        return y.reshape(x.shape[:-1] + (cuts[-1],))

    @staticmethod
    def backward(ctx, g):
        xqT, wqT, sx, sw = ctx.saved_tensors
        r, cuts = ctx.recipe, ctx.cuts
        n = len(cuts) - 1
        amax = None
        st = ctx.state
        if st is not None and st.g_amax is not None:
            if st.g_amax[0] is g:  # dy came with its amax (Fp8SwiGLUDown's backward)
                amax = st.g_amax[1]
            st.g_amax = None
        _, gqT, sg, gx = _dy_and_dx(ctx, g, wqT, sw, ctx.xdtype, amax=amax)
        gx = None if gx is None else gx.reshape(ctx.xshape)
        first = 5  # the weights' argument positions: (x, lows, recipe, state, w_fp8, *ws)
        want = [ctx.needs_input_grad[first + i] for i in range(n)]
        bufs = [ctx.leaf_grad(first + i) for i in range(n)]
        G = joined_rows(bufs) if all(want) else None
        stale = {ctx.inputs[first + i].grad_stale for i in range(n)} if G is not None else set()
        gws = [None] * n
        if G is not None and len(stale) == 1:
            acc = False
            for i in range(n):
                _, acc = ctx.leaf_grad_write(first + i)
            _gemm(gqT, xqT, sg, sx, r.grad_dtype, E4M3, r.fast_accum_grad, out=G, accumulate=acc)
        else:
            for i in range(n):  # dy^T's rows of weight i: contiguous, 16-byte aligned (N % 16)
                gws[i] = _dw(ctx, first + i, gqT[cuts[i]:cuts[i + 1]], xqT, sg, sx)
        return (gx, None, None, None, None, *gws)


class Fp8SwiGLUDown(Function):
    """``down(swiglu_packed(gu))``: the LLaMA MLP's SwiGLU and its down projection in FP8, as
    ``Fp8Linear.apply(SwiGLUPackedF.apply(gu), W)`` computes it (the same bits), with the amax of what the SwiGLU
    kernels write taken in their own pass: current scaling then needs no amax pass over h (forward) or dgu
    (backward: handed to the gate / up pack's backward through its :class:`Fp8State`, ``up_state``). At the 1B
    shape h is 8.4 M and dgu 16.8 M elements a layer, 2 bytes each an amax pass would read: ~1.6 ms a step (NOTES,
    FP8). Delayed scaling of h (delayed, hybrid): h is cast as the SwiGLU computes it (``ck.fp8_swiglu_quantize``),
    never stored in bf16."""

    @staticmethod
    def forward(ctx, gu, w, w_lowp=None, recipe=None, state=None, up_state=None, w_fp8=None):
        xp = _xp(gu)
        src = w_lowp if w_lowp is not None else w
        odt = gu.dtype if gu.dtype in B.FLOATS else np.dtype(np.float32)
        tr = any(ctx.needs_input_grad)
        if tr and _delayed(recipe, "x") and state is not None and gu.dtype == B.bfloat16:
            gu2 = _contig(gu.reshape(-1, gu.shape[-1]))
            if state.x is None or _xp(state.x) is not xp:  # seeded with max |h| of the first call (eager)
                state.x = fp8_history(_swiglu_p(gu2))
            hq, hqT, sh = fp8_swiglu_quantize(gu2, state.x, margin=recipe.margin)
        else:
            amax = None if _delayed(recipe, "x") else xp.empty((), np.float32)
            h = _swiglu_p(gu, amax=amax)
            hq, hqT, sh = _quantize(h.reshape(-1, h.shape[-1]), E4M3, recipe, state, "x", tr, amax=amax)
        wq, wqT, sw = _weight(src, w_fp8, recipe, state, tr)
        y = _gemm(hq, wq, sh, sw, E4M3, E4M3, recipe.fast_accum, out_dtype=odt)
        ctx.save_for_backward(gu, hqT, wqT, sh, sw)
        ctx.recipe, ctx.state, ctx.up_state = recipe, state, up_state
        return y.reshape(gu.shape[:-1] + (w.shape[0],))

    @staticmethod
    def backward(ctx, g):
        gu, hqT, wqT, sh, sw = ctx.saved_tensors
        _, gqT, sg, dh = _dy_and_dx(ctx, g, wqT, sw, gu.dtype)
        dgu = None
        if dh is not None:
            up = ctx.up_state
            amax = None if up is None or _delayed(ctx.recipe, "g") else _xp(gu).empty((), np.float32)
            dgu = _swiglu_p_bwd(gu, dh.reshape(gu.shape[:-1] + (gu.shape[-1] // 2,)), amax=amax)
            if amax is not None:
                up.g_amax = (dgu, amax)
        return dgu, _dw(ctx, 1, gqT, hqT, sg, sh), None, None, None, None, None


def fp8_swiglu_down(gu, w, w_lowp=None, *, recipe, state=None, up_state=None, w_fp8=None):
    """``swiglu_packed(gu) @ w.T`` in FP8 (:class:`Fp8SwiGLUDown`); ``state`` the down projection's
    :class:`Fp8State`, ``up_state`` the gate / up pack's (the dgu amax goes there), or None; ``w_fp8`` the
    optimizer's ``(q, q^T, s_inv)`` of w (``amp.fp8_weight``) or None."""
    return Fp8SwiGLUDown.apply(gu, w, w_lowp, recipe, state, up_state, w_fp8)


def fp8_linear(x, w, w_lowp=None, b=None, *, recipe, state=None, w_fp8=None):
    """``x @ w.T (+ b)`` with the GEMMs in FP8 (:class:`Fp8Linear`); ``recipe`` an :class:`amp.Float8Recipe`,
    ``state`` the layer's :class:`Fp8State` (delayed scaling), ``w_fp8`` the optimizer's ``(q, q^T, s_inv)`` of w
    (``amp.fp8_weight``) or None (w is quantised here)."""
    return Fp8Linear.apply(x, w, w_lowp, b, recipe, state, w_fp8)


def fp8_packed_linear(x, ws, lows=None, *, recipe, state=None, w_fp8=None):
    """``x @ concat(ws, axis=0).T`` with the GEMMs in FP8 (:class:`Fp8PackedLinear`); ``w_fp8`` the optimizer's
    ``(q, q^T, s_inv)`` of the joined weights or None."""
    ws = list(ws)
    return Fp8PackedLinear.apply(x, tuple(lows) if lows is not None else (None,) * len(ws), recipe, state, w_fp8,
                                 *ws)


__all__ = ["Fp8Linear", "Fp8PackedLinear", "Fp8State", "Fp8SwiGLUDown", "fp8_linear", "fp8_ok", "fp8_packed_linear",
           "fp8_swiglu_down"]
