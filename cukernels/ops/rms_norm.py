"""RMSNorm: ``ck.rms_norm`` / ``ck.rms_norm_backward``, and the residual-add fusion ``ck.add_rms_norm`` /
``ck.add_rms_norm_backward``. Kernels: ``kernels_cu/rms_norm.cu``."""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from . import _launch as L
from .activations import _check_amax, _ref_amax_into

FAMILY = "rms_norm"


def _validate(x, weight):
    B.check_dtype("x", x, B.FLOATS)
    B.check_dtype("weight", weight, B.FLOATS)
    B.check_ndim("x", x, 1)
    C = x.shape[-1]
    if C < 1:
        raise ValueError(f"x: the normalised (last) axis must have at least 1 element; got shape {x.shape}")
    if weight.ndim != 1 or weight.shape[0] != C:
        raise ValueError(f"weight: expected shape ({C},) to match x's last axis; got {tuple(weight.shape)}")
    B.check_contiguous("x", x)
    B.check_contiguous("weight", weight)
    return C


def _plan(C: int, itemsize: int, vec: bool, max_tpr: int):
    """(kernel kind, threads per row, packs per thread, rows per block) for a row of C elements.

    Two 16-byte packs per thread measured best on the H200 (benchmarks/tune_rms_norm.py, NOTES.md): threads
    per row = packs / 2, between 32 and max_tpr (forward 512, backward 256: their __launch_bounds__ and
    register budgets), packs per thread up to 8; beyond max_tpr x 8 packs the two-pass "loop" kernel.
    Rows of fewer than 256 threads share a block (TPR x RPB = 256).
    """
    p = L.row_plan(C, itemsize, vec, min_tpr=32, max_tpr=max_tpr, target_vpt=2, max_vpt=8)
    return ("loop", 0, 0, 1) if p is None else ("reg", *p)


def _names(x, weight, vec):
    return f"{B.DTYPE_TAG[x.dtype]}_{B.DTYPE_TAG[weight.dtype]}", "v" if vec else "s"


@B.interop
def rms_norm(x, weight, eps=1e-6, *, return_rstd=False, out=None):
    """Root-mean-square normalisation over the last axis.

    ``y = x / sqrt(mean(x**2, axis=-1) + eps) * weight``, computed in fp32.

    Args:
        x: ``(..., C)`` float32 or bfloat16, C-contiguous; any number of rows (including 0), C >= 1.
        weight: ``(C,)`` float32 or bfloat16.
        eps: added to the mean square; a finite number > 0.
        return_rstd: also return ``rstd = 1 / sqrt(mean(x**2) + eps)``, float32, shape ``x.shape[:-1]``.
        out: optional output buffer, same shape and dtype as ``x``.

    Returns:
        ``y`` (dtype of ``x``), or ``(y, rstd)``.

    Example::

        >>> x = cp.random.standard_normal((8, 2048), dtype=cp.float32).astype(ck.bfloat16)
        >>> y, rstd = ck.rms_norm(x, cp.ones(2048, cp.float32), return_rstd=True)
    """
    xp = B.array_module(x=x, weight=weight, out=out)
    C = _validate(x, weight)
    eps = B.check_real("eps", eps, min=0, min_open=True)
    return_rstd = B.check_bool("return_rstd", return_rstd)
    y = B.empty(xp, x.shape, x.dtype, out)
    rows = x.size // C
    if xp is np:
        xf = x.astype(np.float64)
        rstd = (1.0 / np.sqrt(np.mean(xf * xf, axis=-1) + eps)).astype(np.float32)
        y[...] = (x.astype(np.float32) * rstd[..., None] * weight.astype(np.float32)).astype(x.dtype)
        return (y, rstd) if return_rstd else y

    rstd = xp.empty(x.shape[:-1], dtype=np.float32) if return_rstd else None
    _forward(x, None, weight, y, None, rstd, rows, C, eps)
    return (y, rstd) if return_rstd else y


def _forward(x, res, weight, y, h, rstd, rows, C, eps):
    """Launch the forward (``res``/``h`` None: rms_norm; else add_rms_norm, h = x + res written too)."""
    if not rows:
        return
    add = res is not None
    vec = C % (16 // x.itemsize) == 0 and B.aligned16(x, y, *((res, h) if add else ()))
    w_vec = B.aligned16(weight)
    kind, tpr, vpt, rpb = _plan(C, x.itemsize, vec, 512)
    tag, vs = _names(x, weight, vec)
    pre = "rms_addfwd" if add else "rms_fwd"
    if kind == "reg":
        k = get_function(FAMILY, f"{pre}_{tag}_{vpt}{vs}")
        block = (tpr, rpb, 1)
        # One row group per block: measured faster than a persistent one-wave grid (NOTES.md, run 4).
        grid = (rows + rpb - 1) // rpb
    else:
        k = get_function(FAMILY, f"{pre}_loop_{tag}_{vs}")
        grid, block = rows, (1024, 1, 1)
    r = rstd if rstd is not None else B.NULL
    args = (x, res, weight, y, h, r) if add else (x, weight, y, r)
    k((min(grid, 2**31 - 1),), block, (*args, np.int64(rows), np.int32(C), np.float32(eps), np.bool_(w_vec)))


@B.interop
def add_rms_norm(x, residual, weight, eps=1e-6, *, return_rstd=False, out=None, out_sum=None):
    """Residual add fused with RMSNorm: ``h = x + residual``, ``y = rms_norm(h, weight, eps)``, one kernel.

    The transformer block's ``h = x + r; y = norm(h) * w`` in one pass: x and residual are read once, h and y
    written once (the two-launch form writes h and reads it back). h is summed in fp32 and rounded once to x's
    dtype; the rounded h is what gets normalised, so :func:`add_rms_norm_backward` (which takes h) sees exactly
    the forward's input. Bit-identical h to ``ck.add(x, residual)``.

    Args:
        x: ``(..., C)`` float32 or bfloat16, C-contiguous; any number of rows (including 0), C >= 1.
        residual: same shape and dtype as ``x``, C-contiguous.
        weight: ``(C,)`` float32 or bfloat16.
        eps: added to the mean square; a finite number > 0.
        return_rstd: also return ``rstd = 1 / sqrt(mean(h**2) + eps)``, float32, shape ``x.shape[:-1]``.
        out: optional buffer for ``y`` (shape and dtype of ``x``).
        out_sum: optional buffer for ``h`` (shape and dtype of ``x``).

    Returns:
        ``(y, h)``, or ``(y, h, rstd)``.

    Example::

        >>> y, h, rstd = ck.add_rms_norm(x, attn_out, w, 1e-5, return_rstd=True)
        >>> dx, dw = ck.add_rms_norm_backward(dy, dh, h, w, rstd)   # dx is also d(attn_out)
    """
    xp = B.array_module(x=x, residual=residual, weight=weight, out=out, out_sum=out_sum)
    C = _validate(x, weight)
    B.check_dtype("residual", residual, (x.dtype,))
    B.check_shape("residual", residual, x.shape, " (the shape of x)")
    B.check_contiguous("residual", residual)
    eps = B.check_real("eps", eps, min=0, min_open=True)
    return_rstd = B.check_bool("return_rstd", return_rstd)
    y = B.empty(xp, x.shape, x.dtype, out)
    h = B.empty(xp, x.shape, x.dtype, out_sum, name="out_sum")
    if out is not None and out_sum is not None and _same_memory(out, out_sum):
        raise ValueError("out_sum: must not share memory with out (y and h are both written)")
    rows = x.size // C
    if xp is np:
        h[...] = (x.astype(np.float32) + residual.astype(np.float32)).astype(x.dtype)
        res = rms_norm(h, weight, eps, return_rstd=return_rstd, out=y)
        return (res[0], h, res[1]) if return_rstd else (res, h)

    rstd = xp.empty(x.shape[:-1], dtype=np.float32) if return_rstd else None
    _forward(x, residual, weight, y, h, rstd, rows, C, eps)
    return (y, h, rstd) if return_rstd else (y, h)


def _same_memory(a, b):
    if a.size == 0 or b.size == 0:
        return False
    if isinstance(a, np.ndarray):
        return np.shares_memory(a, b)
    lo_a, lo_b = a.data.ptr, b.data.ptr
    return lo_a < lo_b + b.nbytes and lo_b < lo_a + a.nbytes




# Pipelined backward (rms_bwd_pipe, ck.settings.rms_norm_pipe): threads per block by packs per thread, at most the
# kernels' bounds (the RMS_PIPE lines of rms_norm.cu; ck.settings.rms_norm_pipe_threads lowers them). VPT <= 2: 512
# threads (64 registers, 2 blocks per SM); VPT 4: 256 threads (up to 128 registers).
# ck.settings.rms_norm_pipe_stages_bf16 / _f32: cp.async row groups in flight a block (2..4; fewer where two blocks
# would not fit an SM) by element size (`python dev/tune_norm_backward.py`, 8192 x 2048): bf16 2 stages (3 or 4: 6-8 %
# slower), fp32 3 (2-3 % faster than 2).
PIPE_THREADS = {1: 512, 2: 512, 4: 256}


@B.interop
def rms_norm_backward(dy, x, weight, rstd, *, dh=None, out=None, amax=None):
    """Gradients of :func:`rms_norm`.

    With ``g = dy * weight``: ``dx = rstd * (g - x * rstd**2 * mean(g * x, axis=-1)) (+ dh)`` and
    ``dweight = sum(dy * x * rstd, over all rows)``. dweight is reduced in two stages (per-block partials, then
    a fixed-order sum): bit-identical from run to run.

    Args:
        dy: gradient of y, same shape and dtype as ``x``.
        x, weight: the forward inputs.
        rstd: float32, shape ``x.shape[:-1]``, from ``rms_norm(..., return_rstd=True)``.
        dh: optional gradient reaching ``x`` by another path (the residual stream of :func:`add_rms_norm`, where
            x is the sum h), same shape and dtype as ``x``: added into dx in the same pass (one rounding).
        out: optional buffer for ``dx``.
        amax: optional writable 0-d float32 array: receives ``max |dx|`` of dx as stored (NaN when dx has a NaN,
            0 when it is empty), computed in the same pass -- bit for bit :func:`fp8_amax` of dx, which
            :func:`fp8_quantize` takes as ``amax=`` to cast dx (an FP8 linear's output gradient under current
            scaling) without an amax pass of its own.

    Returns:
        ``(dx, dweight)``: dx like ``x``, dweight like ``weight``.

    Example::

        >>> a = cp.empty((), cp.float32)
        >>> dx, dw = ck.rms_norm_backward(dy, x, w, rstd, amax=a)    # a == ck.fp8_amax(dx)
    """
    xp = B.array_module(dy=dy, x=x, weight=weight, rstd=rstd, dh=dh, out=out, amax=amax)
    C = _validate(x, weight)
    B.check_dtype("dy", dy, (x.dtype,))
    B.check_shape("dy", dy, x.shape, " (the shape of x)")
    B.check_contiguous("dy", dy)
    B.check_dtype("rstd", rstd, (np.float32,))
    B.check_shape("rstd", rstd, x.shape[:-1], " (x.shape[:-1])")
    B.check_contiguous("rstd", rstd)
    if dh is not None:
        B.check_dtype("dh", dh, (x.dtype,))
        B.check_shape("dh", dh, x.shape, " (the shape of x)")
        B.check_contiguous("dh", dh)
    if amax is not None:
        _check_amax(amax)
    dx = B.empty(xp, x.shape, x.dtype, out)
    rows = x.size // C
    if xp is np:
        xf, gf = x.astype(np.float64), dy.astype(np.float64)
        r = rstd.astype(np.float64)[..., None]
        g = gf * weight.astype(np.float64)
        d = r * (g - xf * r * r * np.mean(g * xf, axis=-1, keepdims=True))
        if dh is not None:
            d = d + dh.astype(np.float64)
        dx[...] = d.astype(x.dtype)
        dw = (gf * xf * r).reshape(-1, C).sum(axis=0).astype(weight.dtype)
        if amax is not None:
            _ref_amax_into(amax, dx)
        return dx, dw

    dw = xp.empty((C,), dtype=weight.dtype)
    if amax is not None:
        B.zero_(amax)  # the kernels max into it: one atomicMax a block
    if rows == 0:
        return dx, B.zero_(dw)
    am = amax if amax is not None else B.NULL
    add = dh is not None
    vec = C % (16 // x.itemsize) == 0 and B.aligned16(x, dy, dx, *((dh,) if add else ()))
    w_vec = B.aligned16(weight)
    kind, tpr, vpt, rpb = _plan(C, x.itemsize, vec, 256)
    tag, vs = _names(x, weight, vec)
    dh_arg = (dh,) if add else ()
    if kind == "reg" and vec and vpt in PIPE_THREADS and settings.rms_norm_pipe:
        # cp.async pipeline (rms_norm.cu, rms_bwd_pipe): the plan's threads per row, more row slots per block.
        nth = min(PIPE_THREADS[vpt], settings.rms_norm_pipe_threads)
        stage = (3 if add else 2) * vpt * nth * 16
        target = settings.rms_norm_pipe_stages_bf16 if x.itemsize == 2 else settings.rms_norm_pipe_stages_f32
        stages = L.pipe_stages(target, stage, 2)
        smem = stages * stage
        k = L.with_smem(get_function(FAMILY, f"{'rms_addbwdp' if add else 'rms_bwdp'}_{tag}_{vpt}"), smem)
        slots = nth // tpr
        # A persistent grid of one wave: each block's partial dw row covers ~rows / (2 x SMs) rows.
        nparts = min(-(-rows // slots), L.wave(k, nth, smem))
        part = xp.empty((nparts, C), dtype=np.float32)
        k((nparts,), (tpr, slots, 1),
          (dy, x, weight, rstd, *dh_arg, dx, part, np.int64(rows), np.int32(C), np.int32(stages), np.bool_(w_vec),
           am), shared_mem=smem)
    elif kind == "reg":
        k = get_function(FAMILY, f"{'rms_addbwd' if add else 'rms_bwd'}_{tag}_{vpt}{vs}")
        block = (tpr, rpb, 1)
        # One wave of blocks: enough rows per block that the fp32 partials stay a few % of the traffic.
        nparts = min((rows + rpb - 1) // rpb, L.wave(k, tpr * rpb))
        part = xp.empty((nparts, C), dtype=np.float32)
        k((nparts,), block,
          (dy, x, weight, rstd, *dh_arg, dx, part, np.int64(rows), np.int32(C), np.bool_(w_vec), am))
    else:
        # Long rows: per-row coefficients, then column-chunk blocks over row groups (rms_norm.cu).
        units = C // (16 // x.itemsize) if vec else C
        coef = xp.empty((rows,), dtype=np.float32)
        get_function(FAMILY, f"rms_bwd_rowsums_{tag}_{vs}")(
            (min(rows, 8 * B.sm_count()),), (512, 1, 1),
            (dy, x, weight, rstd, coef, np.int64(rows), np.int32(C), np.bool_(w_vec)))
        colblocks = (units + 255) // 256
        # ~8 blocks of 256 threads per SM in all, at least 8 rows per group (partials <= ~5 % of the bytes).
        groups = max(1, min(-(-8 * B.sm_count() // colblocks), -(-rows // 8)))
        rpg = -(-rows // groups)
        nparts = -(-rows // rpg)
        part = xp.empty((nparts, C), dtype=np.float32)
        get_function(FAMILY, f"rms_bwd_cols_{tag}_{vs}")(
            (colblocks, nparts, 1), (256, 1, 1),
            (dy, x, weight, rstd, coef, dh if add else B.NULL, dx, part, np.int64(rows), np.int32(C),
             np.int32(rpg), np.bool_(w_vec), am))
    fin = get_function(FAMILY, f"rms_dw_finalize_{B.DTYPE_TAG[weight.dtype]}")
    fin(((C + 31) // 32,), (32, 32, 1), (part, dw, np.int32(nparts), np.int32(C)))
    return dx, dw


@B.interop
def add_rms_norm_backward(dy, dh, h, weight, rstd, *, out=None, amax=None):
    """Gradients of :func:`add_rms_norm`: the gradient reaching h is ``dh`` (from the residual stream downstream)
    plus the RMSNorm backward of ``dy``; ``dx = dresidual =`` that sum, and ``dweight`` as in
    :func:`rms_norm_backward`. One kernel pass (``rms_norm_backward(dy, h, weight, rstd, dh=dh)``): dh is added
    into dx where dx is formed, instead of a separate add launch that reads and writes dx again.

    Args:
        dy: gradient of y, shape and dtype of ``h``.
        dh: gradient of h from its other consumers, shape and dtype of ``h``; None when h has none (then this is
            :func:`rms_norm_backward`).
        h: the sum ``x + residual`` that the forward returned.
        weight: the forward's weight.
        rstd: float32, shape ``h.shape[:-1]``, from ``add_rms_norm(..., return_rstd=True)``.
        out: optional buffer for dx.
        amax: optional writable 0-d float32 array: receives ``max |dx|`` from the same pass (as in
            :func:`rms_norm_backward`): what the FP8 cast of the sublayer output's gradient (dx) takes its current
            scale from, without an amax pass over dx.

    Returns:
        ``(dx, dweight)``: dx (the gradient of both x and residual) like ``h``, dweight like ``weight``.
    """
    B.array_module(dy=dy, dh=dh, h=h, weight=weight, rstd=rstd, out=out, amax=amax)
    B.check_dtype("h", h, B.FLOATS)  # (rms_norm_backward names it x)
    B.check_ndim("h", h, 1)
    return rms_norm_backward(dy, h, weight, rstd, dh=dh, out=out, amax=amax)


__all__ = ["add_rms_norm", "add_rms_norm_backward", "rms_norm", "rms_norm_backward"]
