"""The fused LM head + loss as an autograd Function: ``LinearCrossEntropyF`` over ``ck.linear_cross_entropy``
(ops/linear_cross_entropy.py).

Why: the unfused head writes all N x V logits (LLaMA-3.2-1B at B8 x T1024: 8192 x 128256 bf16 = 2.1 GB) and
the fused cross-entropy turns them into dlogits in place; ``ck.linear_cross_entropy`` walks the rows in chunks
through one [C, V] workspace (0.53 GB) and produces the loss, dx and dW in one call. Its backward is therefore
done in the FORWARD of this Function:

* dW goes straight into the head weight's fp32 ``.grad`` (the optimizer's flat-buffer view) during the forward,
  with the lazy-zero contract of ``Context.leaf_grad_write``: the first write of a step overwrites (GEMM
  beta = 0, no zeroing pass), later writes add (beta = 1). Under a tied embedding the head runs last in the
  forward and so first in the backward: the forward's write is the step's first one and the embedding's
  backward then adds its rows into the same buffer (``EmbeddingF`` asks ``leaf_grad_write`` too, which says
  "accumulate" once this Function has cleared ``grad_stale``).
* dx is kept and handed on by ``backward``. With the implicit 1 of ``loss.backward()`` nothing else happens.
  Any other incoming gradient g scales dx, and dW when this Function's write was the buffer's first of the
  step (the buffer then holds exactly dW: one in-place multiply by the device scalar); when the write was
  added to earlier content (gradient accumulation, a non-lazy zero_grad) dW cannot be rescaled and the
  backward raises RuntimeError saying what to do (the trainer calls ``loss.backward()`` unscaled and folds
  1 / accumulation into the optimizer's ``grad_scale``).
* A bf16 ``.grad`` (``grad_dtype=ck.bfloat16``) is written the same way when this is its first write of the step
  and the rows are taken in one chunk (the GEMM's fp32 sum is rounded once); otherwise, and without a usable
  ``.grad`` buffer (none yet, a non-leaf weight), dW is a fresh fp32 array, returned by ``backward`` like any
  gradient (and added into a bf16 ``.grad`` by the autograd).

Chunks (``ck.settings.head_workspace``): the model's head takes up to 1 GiB of logits a chunk, twice the op's default,
because every chunk's dW GEMM reads and writes the whole fp32 [V, H] gradient (2.1 GB at the LLaMA-3.2-1B head) and
taller GEMMs run faster. A bf16 ``.grad`` takes all rows in one chunk when its logits fit head_workspace plus the
V x H x 4 bytes of the fp32 dW that several chunks would need instead (the same peak). Measured on the H200 at
B8 x T1024 (8192 rows; session 15, run E, rows interleaved in one process, 20 steps each): fp32 gradients, 2
chunks of 4096 rows 115.7 ms a step and 36.5 GiB against 4 chunks of 2048 116.2 ms and 36.0 GiB; bf16 gradients,
one chunk of 2.1 GB 113.7 ms and 35.2 GiB against 4 chunks and the fp32 dW 115.1 ms and 34.7 GiB. Lower
head_workspace to trade that speed for memory.

Consequences for callers: the head weight's ``.grad`` changes during the forward, so a loss computed with
gradients enabled should be back-propagated (compute it under ``no_grad()`` otherwise: then no gradient is
computed at all, only the loss); ``backward(retain_graph=True)`` twice adds dW once.

Autocast: like the Linear Function, the GEMMs read ``w_lowp`` (the optimizer's bf16 shadow) when given, else W
cast once to x's dtype; the gradient is W's (fp32). A vocabulary that is not a multiple of 64 (GPT-2's 50257)
runs on the same zero-padded [Vp, H] copy of W that ``linear(pad_rows=True)`` uses, with ``num_classes=V``.
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from ..autograd import Function, _xp
from ..ops.linear_cross_entropy import chunk_rows_for
from ..ops.linear_cross_entropy import linear_cross_entropy as _lce
from ..settings import settings
from .array_ops import _data, _padded_weight

PAD = 64  # the row quantum of the padded weight (array_ops._padded_weight): 128-byte bf16 rows


class LinearCrossEntropyF(Function):
    """Token cross-entropy of ``x @ w.T`` against ``targets``; a 0-d fp32 loss (see the module docstring).

    forward(x [..., H], w [V, H], w_lowp [V, H] or None, targets [...] int, ignore_index, reduction,
    label_smoothing) -> loss. ``reduction`` is "mean" or "sum".
    """

    @staticmethod
    def forward(ctx, x, w, w_lowp=None, targets=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                grad_fp8=None, grad_fp8_dw=True):
        H = x.shape[-1]
        x2 = x.reshape(-1, H)
        xp = _xp(x2)
        if not x2.flags.c_contiguous:
            x2 = xp.ascontiguousarray(x2)
        t = targets.reshape(-1)
        if not t.flags.c_contiguous:
            t = xp.ascontiguousarray(t)
        wl = w_lowp if w_lowp is not None else (w if w.dtype == x2.dtype else w.astype(x2.dtype))
        kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
        if grad_fp8 is not None and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            kw["grad_fp8"] = grad_fp8  # the gradient GEMMs in FP8 (ops/linear_cross_entropy.py)
            kw["grad_fp8_dw"] = grad_fp8_dw  # False: dx's only
        V = w.shape[0]
        if xp is not np and V % PAD:
            kw["num_classes"] = V  # the GEMMs on 16-byte-aligned dimensions (see the op's docstring)
            wl = _padded_weight(wl)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.xshape = x.shape
        ctx.dx = ctx.dw = None
        ctx.dw_fresh = ctx.dw_added = False
        N = x2.shape[0]
        kw["chunk_rows"] = max(1, chunk_rows_for(N, wl.shape[0], x2.itemsize, settings.head_workspace))
        if not (need_x or need_w):
            loss, _, _ = _lce(x2, wl, t, compute_grad=False, **kw)
            return loss
        buf, acc = None, False
        if need_w:
            cand = ctx.leaf_grad(1)
            if (cand is not None and cand.flags.c_contiguous and B._kind(cand) is xp
                    and tuple(cand.shape) == tuple(w.shape)):
                if cand.dtype == np.float32:
                    buf, acc = ctx.leaf_grad_write(1)  # clears grad_stale: later writers of a tied weight add
                elif (cand.dtype == B.bfloat16 and ctx.inputs[1].grad_stale
                      and N * wl.shape[0] * x2.itemsize <= settings.head_workspace + w.size * 4):
                    # a bf16 .grad (grad_dtype=bf16): its first write of the step, in one chunk -> the dW GEMM
                    # writes the rounded sum straight into it (no fp32 [V, H] temporary, no add pass)
                    buf, acc = ctx.leaf_grad_write(1)
                    kw["chunk_rows"] = max(1, N)
        loss, dx, dw = _lce(x2, wl, t, grad_weight=buf, accumulate=acc, **kw)
        ctx.dx = dx if need_x else None
        if need_w:
            if buf is None:
                ctx.dw, ctx.dw_fresh = dw, True  # returned by backward
            else:
                ctx.dw, ctx.dw_added = buf, acc  # already in .grad
                ctx.w_tensor, ctx.w_epoch = ctx.inputs[1], ctx.inputs[1].grad_epoch
        return loss

    @staticmethod
    def backward(ctx, g):
        dx, dw = ctx.dx, ctx.dw
        ctx.dx = None
        wt = getattr(ctx, "w_tensor", None)
        if wt is not None and wt.grad_epoch != ctx.w_epoch:
            name = getattr(wt, "name", None) or "the head weight"
            raise RuntimeError(
                f"{name}: zero_grad() ran between the forward and this backward, and the fused head + loss had "
                f"already written this weight's gradient during the forward: call zero_grad() before the forward "
                f"(or after the optimizer step), as the trainer does")
        if not ctx.seed_one:
            xp = _xp(g)
            gf = g.astype(np.float32) if g.dtype != np.float32 else g
            if dx is not None:
                xp.multiply(dx, gf, out=dx, casting="unsafe")
            if dw is not None:
                if ctx.dw_added:
                    raise RuntimeError(
                        "LinearCrossEntropyF: the fused head + loss added the head weight's gradient (for a loss "
                        "gradient of 1) into .grad during the forward, on top of an earlier gradient, and now "
                        "gets another loss gradient: call loss.backward() on the unscaled loss and scale the "
                        "gradients instead (e.g. AdamW.step(grad_scale=...)), or set model.fused_head_loss = "
                        "False")
                # a fresh dW, or the .grad buffer whose first write of the step this was: it holds exactly dW
                xp.multiply(dw, gf, out=dw)
        gw = dw if ctx.dw_fresh else None
        ctx.dw = None
        return (None if dx is None else dx.reshape(ctx.xshape)), gw, None, None, None, None, None, None, None


def linear_cross_entropy(x, w, targets, *, w_lowp=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         grad_fp8=None, grad_fp8_dw=True):
    """Cross-entropy of the logits ``x @ w.T`` (never materialised: ``ck.linear_cross_entropy`` in row chunks)
    against int ``targets`` of x's leading shape; a 0-d fp32 loss Tensor. ``w_lowp``: the array the GEMMs read
    instead of w (the bf16 shadow under autocast). The head weight's gradient is written during the forward
    (see :class:`LinearCrossEntropyF`). ``grad_fp8``: the gradient GEMMs in FP8 with dlogits in this format
    (``Float8Recipe(head_grad_dtype=)``), or None; ``grad_fp8_dw``: False keeps the dW GEMM in bf16
    (``Float8Recipe(head_fp8_dw=False)``)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'mean' or 'sum'; got {reduction!r}")
    return LinearCrossEntropyF.apply(x, w, w_lowp, _data(targets), ignore_index, reduction, label_smoothing, grad_fp8,
                                     grad_fp8_dw)


def linear_cross_entropy_ok(x, w, w_lowp=None, bias=None) -> bool:
    """True when :func:`linear_cross_entropy` takes these operands: no bias, float32 / bfloat16 activations, a 2-D
    weight (or shadow) of x's dtype or castable to it, fewer than 2**31 classes."""
    xd, wd = _data(x), _data(w)
    if bias is not None or xd.dtype not in B.FLOATS:
        return False
    if wd.ndim != 2 or wd.shape[1] != xd.shape[-1] or not 0 < wd.shape[0] < 2**31:
        return False
    if w_lowp is not None:
        return w_lowp.dtype == xd.dtype and tuple(w_lowp.shape) == tuple(wd.shape)
    return wd.dtype in B.FLOATS  # cast once per call to x's dtype when they differ


__all__ = ["LinearCrossEntropyF", "linear_cross_entropy", "linear_cross_entropy_ok"]
