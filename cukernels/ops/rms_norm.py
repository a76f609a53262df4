"""RMSNorm: ``ck.rms_norm`` / ``ck.rms_norm_backward``. Kernels: ``kernels_cu/rms_norm.cu``."""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from . import _launch as L

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
    if rows:
        vec = C % (16 // x.itemsize) == 0 and B.aligned16(x, y)
        w_vec = B.aligned16(weight)
        kind, tpr, vpt, rpb = _plan(C, x.itemsize, vec, 512)
        tag, vs = _names(x, weight, vec)
        if kind == "reg":
            k = get_function(FAMILY, f"rms_fwd_{tag}_{vpt}{vs}")
            block = (tpr, rpb, 1)
            # One row group per block: measured faster than a persistent one-wave grid (NOTES.md, run 4).
            grid = (rows + rpb - 1) // rpb
        else:
            k = get_function(FAMILY, f"rms_fwd_loop_{tag}_{vs}")
            grid, block = rows, (1024, 1, 1)
        k((min(grid, 2**31 - 1),), block,
          (x, weight, y, rstd if rstd is not None else B.NULL, np.int64(rows), np.int32(C), np.float32(eps),
           np.bool_(w_vec)))
    return (y, rstd) if return_rstd else y


@B.interop
def rms_norm_backward(dy, x, weight, rstd, *, out=None):
    """Gradients of :func:`rms_norm`.

    With ``g = dy * weight``: ``dx = rstd * (g - x * rstd**2 * mean(g * x, axis=-1))`` and
    ``dweight = sum(dy * x * rstd, over all rows)``. dweight is reduced in two stages (per-block partials, then
    a fixed-order sum): bit-identical from run to run.

    Args:
        dy: gradient of y, same shape and dtype as ``x``.
        x, weight: the forward inputs.
        rstd: float32, shape ``x.shape[:-1]``, from ``rms_norm(..., return_rstd=True)``.
        out: optional buffer for ``dx``.

    Returns:
        ``(dx, dweight)``: dx like ``x``, dweight like ``weight``.
    """
    xp = B.array_module(dy=dy, x=x, weight=weight, rstd=rstd, out=out)
    C = _validate(x, weight)
    B.check_dtype("dy", dy, (x.dtype,))
    B.check_shape("dy", dy, x.shape, " (the shape of x)")
    B.check_contiguous("dy", dy)
    B.check_dtype("rstd", rstd, (np.float32,))
    B.check_shape("rstd", rstd, x.shape[:-1], " (x.shape[:-1])")
    B.check_contiguous("rstd", rstd)
    dx = B.empty(xp, x.shape, x.dtype, out)
    rows = x.size // C
    if xp is np:
        xf, gf = x.astype(np.float64), dy.astype(np.float64)
        r = rstd.astype(np.float64)[..., None]
        g = gf * weight.astype(np.float64)
        dx[...] = (r * (g - xf * r * r * np.mean(g * xf, axis=-1, keepdims=True))).astype(x.dtype)
        dw = (gf * xf * r).reshape(-1, C).sum(axis=0).astype(weight.dtype)
        return dx, dw

    dw = xp.empty((C,), dtype=weight.dtype)
    if rows == 0:
        return dx, B.zero_(dw)
    vec = C % (16 // x.itemsize) == 0 and B.aligned16(x, dy, dx)
    w_vec = B.aligned16(weight)
    kind, tpr, vpt, rpb = _plan(C, x.itemsize, vec, 256)
    tag, vs = _names(x, weight, vec)
    if kind == "reg":
        k = get_function(FAMILY, f"rms_bwd_{tag}_{vpt}{vs}")
        block = (tpr, rpb, 1)
        # One wave of blocks: enough rows per block that the fp32 partials stay a few % of the traffic.
        nparts = min((rows + rpb - 1) // rpb, L.wave(k, tpr * rpb))
        part = xp.empty((nparts, C), dtype=np.float32)
        k((nparts,), block, (dy, x, weight, rstd, dx, part, np.int64(rows), np.int32(C), np.bool_(w_vec)))
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
            (dy, x, weight, rstd, coef, dx, part, np.int64(rows), np.int32(C), np.int32(rpg), np.bool_(w_vec)))
    fin = get_function(FAMILY, f"rms_dw_finalize_{B.DTYPE_TAG[weight.dtype]}")
    fin(((C + 31) // 32,), (32, 16, 1), (part, dw, np.int32(nparts), np.int32(C)))
    return dx, dw
