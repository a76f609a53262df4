"""LayerNorm: ``ck.layer_norm`` / ``ck.layer_norm_backward``. Kernels: ``kernels_cu/layer_norm.cu``."""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from . import _launch as L

FAMILY = "layer_norm"
# 16-byte packs each thread aims to hold (ck.settings.layer_norm_target_vpt): the row is split over more threads until
# each has at most this many. Packs per thread the planner aims at: 2 measured best for rms_norm's identical structure
# on the H200 (dev/tune_rms_norm.py) and keeps the backward at 512 threads without spills. The forward's own targets,
# fp32 and bf16 rows (layer_norm_fwd_target_vpt, layer_norm_fwd_target_vpt_bf16). Fewer threads a row means fewer
# cross-warp steps in its two row reductions (two barriers each). Session 12 (NOTES.md), bf16 at 4 packs a thread
# instead of 2, % of copy: 8192 x 2048 64 -> 69, 8192 x 768 48 -> 59, 65536 x 1000 72 -> 88, 16384 x 4096 74 -> 86; fp32
# at 4 lost (92 -> 88 at 8192 x 2048).


def _validate(x, gamma, beta=None):
    B.check_dtype("x", x, B.FLOATS)
    B.check_dtype("gamma", gamma, B.FLOATS)
    B.check_ndim("x", x, 1)
    C = x.shape[-1]
    if C < 1:
        raise ValueError(f"x: the normalised (last) axis must have at least 1 element; got shape {tuple(x.shape)}")
    if gamma.ndim != 1 or gamma.shape[0] != C:
        raise ValueError(f"gamma: expected shape ({C},) to match x's last axis; got {tuple(gamma.shape)}")
    B.check_contiguous("x", x)
    B.check_contiguous("gamma", gamma)
    if beta is not None:
        B.check_dtype("beta", beta, (gamma.dtype,))
        if beta.ndim != 1 or beta.shape[0] != C:
            raise ValueError(f"beta: expected shape ({C},) to match x's last axis; got {tuple(beta.shape)}")
        B.check_contiguous("beta", beta)
    return C


def _plan(C: int, itemsize: int, vec: bool, backward: bool):
    """(threads per row, packs per thread, rows per block), or None for the long-row "loop" kernel.

    Threads per row (a power of two, 1 .. 1024; 512 for backward) grow until each thread holds at most
    ck.settings.layer_norm_target_vpt packs (the forward's vector path: layer_norm_fwd_target_vpt(_bf16)).
    Register limits (see layer_norm.cu): at most 4 vector packs forward, 2 backward (8 element packs) a thread, so
    rows beyond 1024 x 4 packs (forward) or 512 x 2 packs (backward) take the loop kernel.
    Vector packs backward are capped at 2 because x, dy and two accumulators at 4 packs need more than the 128
    registers a 512-thread block allows (ptxas spilled).
    """
    if backward:
        return L.row_plan(C, itemsize, vec, max_tpr=512, target_vpt=settings.layer_norm_target_vpt,
                          max_vpt=2 if vec else 8)
    if vec:
        target = settings.layer_norm_fwd_target_vpt_bf16 if itemsize == 2 else settings.layer_norm_fwd_target_vpt
    else:
        target = settings.layer_norm_target_vpt
    return L.row_plan(C, itemsize, vec, max_tpr=1024, target_vpt=target, max_vpt=4 if vec else 8)


def _tag(x, gamma):
    return f"{B.DTYPE_TAG[x.dtype]}_{B.DTYPE_TAG[gamma.dtype]}"


@B.interop
def layer_norm(x, gamma, beta, eps=1e-5, *, return_stats=False, out=None):
    """Layer normalisation over the last axis.

    ``mean = mean(x)``, ``rstd = 1 / sqrt(mean((x - mean)**2) + eps)``,
    ``y = (x - mean) * rstd * gamma + beta``; fp32 math, one rounding to x's dtype.

    Args:
        x: ``(..., C)`` float32 or bfloat16, C-contiguous; any number of rows (including 0), C >= 1.
        gamma, beta: ``(C,)``, float32 or bfloat16 (both the same dtype).
        eps: added to the variance; a finite number > 0.
        return_stats: also return ``mean`` and ``rstd``, float32, shape ``x.shape[:-1]`` (what
            :func:`layer_norm_backward` needs).
        out: optional output buffer, same shape and dtype as ``x``.

    Returns:
        ``y`` (dtype of ``x``), or ``(y, mean, rstd)``.

    Example::

        >>> x = cp.random.standard_normal((8, 2048), dtype=cp.float32).astype(ck.bfloat16)
        >>> g, b = cp.ones(2048, cp.float32), cp.zeros(2048, cp.float32)
        >>> y, mean, rstd = ck.layer_norm(x, g, b, return_stats=True)
    """
    xp = B.array_module(x=x, gamma=gamma, beta=beta, out=out)
    if beta is None:
        raise TypeError("beta: expected an array of shape (C,); got None")
    C = _validate(x, gamma, beta)
    eps = B.check_real("eps", eps, min=0, min_open=True)
    return_stats = B.check_bool("return_stats", return_stats)
    y = B.empty(xp, x.shape, x.dtype, out)
    rows = x.size // C
    if xp is np:
        xf = x.astype(np.float64)
        mu = xf.mean(axis=-1)
        var = ((xf - mu[..., None]) ** 2).mean(axis=-1)
        mean = mu.astype(np.float32)
        rstd = (1.0 / np.sqrt(var + eps)).astype(np.float32)
        y[...] = ((x.astype(np.float32) - mean[..., None]) * rstd[..., None] * gamma.astype(np.float32)
                  + beta.astype(np.float32)).astype(x.dtype)
        return (y, mean, rstd) if return_stats else y

    mean = xp.empty(x.shape[:-1], dtype=np.float32) if return_stats else None
    rstd = xp.empty(x.shape[:-1], dtype=np.float32) if return_stats else None
    if rows:
        vec = C % (16 // x.itemsize) == 0 and B.aligned16(x, y)
        w_vec = B.aligned16(gamma, beta)
        plan = _plan(C, x.itemsize, vec, backward=False)
        vs = "v" if vec else "s"
        if plan is not None:
            tpr, vpt, rpb = plan
            k = get_function(FAMILY, f"ln_fwd_{_tag(x, gamma)}_{vpt}{vs}")
            grid, block = (rows + rpb - 1) // rpb, (tpr, rpb, 1)
        else:
            k = get_function(FAMILY, f"ln_fwd_loop_{_tag(x, gamma)}_{vs}")
            grid, block = rows, (1024, 1, 1)
        k((min(grid, 2**31 - 1),), block,
          (x, gamma, beta, y, mean if mean is not None else B.NULL, rstd if rstd is not None else B.NULL,
           np.int64(rows), np.int32(C), np.float32(eps), np.bool_(w_vec)))
    return (y, mean, rstd) if return_stats else y


# Pipelined backward (ln_bwd_pipe): ck.settings.layer_norm_pipe_threads threads a block (256: three blocks an SM,
# 3 x SMs partial rows; 512: one; a row of 512 threads takes 512), layer_norm_pipe_stages cp.async row groups in flight
# a block (2..4, fewer where the blocks would not fit an SM; `python dev/tune_norm_backward.py`, 8192 x 2048: 2 stages
# 2-3 % faster than 3, 4 slower). Rows of fewer than 32 threads (C <= 32 bf16 / 16 fp32 elements) keep the register
# kernel: with
# up to 512 row slots a block, the final in-order combine of the slots' dgamma/dbeta would be a long serial loop
# (layer_norm_pipe_min_tpr).

# One warp a row (ln_bwd_warp): bf16 rows of 65..128 16-byte packs (C 520..1024, GPT-2's 768) take it
# instead of ln_bwd_pipe: WARP_WARPS warps a block (the kernel's __launch_bounds__: 4, four blocks an SM), each warp
# ck.settings.layer_norm_warp_rows rows (ceil(rows / 16) blocks, capped at 4 waves: the partial rows stay <= 4 x 4 x SMs
# x C floats a kind, and the warps loop). At 8192 x 768 on one H200: 18.2 us against 22.1. layer_norm_bwd_kernel "pipe"
# keeps ln_bwd_pipe for those rows too (the A/B row: --ab "layer_norm_bwd_kernel=pipe").
WARP_WARPS = 4


@B.interop
def layer_norm_backward(dy, x, gamma, mean, rstd, *, out=None):
    """Gradients of :func:`layer_norm`.

    With ``xh = (x - mean) * rstd`` and ``g = dy * gamma``:
    ``dx = rstd * (g - mean(g, axis=-1) - xh * mean(g * xh, axis=-1))``,
    ``dgamma = sum(dy * xh, over all rows)``, ``dbeta = sum(dy, over all rows)``. dgamma and dbeta are
    reduced in two stages (per-block partials, then a fixed-order sum): bit-identical from run to run.

    Args:
        dy: gradient of y, same shape and dtype as ``x``.
        x, gamma: the forward inputs (beta is not needed).
        mean, rstd: float32, shape ``x.shape[:-1]``, from ``layer_norm(..., return_stats=True)``.
        out: optional buffer for ``dx``.

    Returns:
        ``(dx, dgamma, dbeta)``: dx like ``x``, dgamma and dbeta like ``gamma``.

    Example::

        >>> y, mean, rstd = ck.layer_norm(x, g, b, return_stats=True)
        >>> dx, dg, db = ck.layer_norm_backward(dy, x, g, mean, rstd)
    """
    xp = B.array_module(dy=dy, x=x, gamma=gamma, mean=mean, rstd=rstd, out=out)
    C = _validate(x, gamma)
    B.check_dtype("dy", dy, (x.dtype,))
    B.check_shape("dy", dy, x.shape, " (the shape of x)")
    B.check_contiguous("dy", dy)
    for name, a in (("mean", mean), ("rstd", rstd)):
        B.check_dtype(name, a, (np.float32,))
        B.check_shape(name, a, x.shape[:-1], " (x.shape[:-1])")
        B.check_contiguous(name, a)
    dx = B.empty(xp, x.shape, x.dtype, out)
    rows = x.size // C
    if xp is np:
        xf, gf = x.astype(np.float64), dy.astype(np.float64)
        xh = (xf - mean.astype(np.float64)[..., None]) * rstd.astype(np.float64)[..., None]
        g = gf * gamma.astype(np.float64)
        dx[...] = (rstd.astype(np.float64)[..., None]
                   * (g - g.mean(axis=-1, keepdims=True) - xh * (g * xh).mean(axis=-1, keepdims=True))).astype(x.dtype)
        dgamma = (gf * xh).reshape(-1, C).sum(axis=0).astype(gamma.dtype)
        dbeta = gf.reshape(-1, C).sum(axis=0).astype(gamma.dtype)
        return dx, dgamma, dbeta

    dgamma = xp.empty((C,), dtype=gamma.dtype)
    dbeta = xp.empty((C,), dtype=gamma.dtype)
    if rows == 0:
        return dx, B.zero_(dgamma), B.zero_(dbeta)
    vec = C % (16 // x.itemsize) == 0 and B.aligned16(x, dy, dx)
    w_vec = B.aligned16(gamma)
    plan = _plan(C, x.itemsize, vec, backward=True)
    vs = "v" if vec else "s"
    if vec and settings.layer_norm_bwd_kernel == "warp" and x.dtype == B.bfloat16 and 64 < C // 8 <= 128:
        k = get_function(FAMILY, f"ln_bwdw_{_tag(x, gamma)}_4")
        # Row r on block r % blocks (then warp, then trip).
        nparts = min(-(-rows // (WARP_WARPS * settings.layer_norm_warp_rows)), 4 * L.wave(k, 32 * WARP_WARPS))
        part = xp.empty((2 * nparts, C), dtype=np.float32)
        k((nparts,), (32, WARP_WARPS, 1), (dy, x, gamma, mean, rstd, dx, part, np.int64(rows), np.int32(C)))
    elif plan is not None and vec and plan[0] >= settings.layer_norm_pipe_min_tpr:
        # cp.async pipeline (layer_norm.cu, ln_bwd_pipe): the plan's threads per row, more row slots a block.
        tpr, vpt, _ = plan
        nth = max(settings.layer_norm_pipe_threads, tpr)
        stage = 2 * vpt * nth * 16
        minb = 3 if nth <= 256 else 1  # blocks an SM each kernel is compiled for (layer_norm.cu)
        stages = L.pipe_stages(settings.layer_norm_pipe_stages, stage, minb)
        smem = stages * stage
        k = L.with_smem(get_function(FAMILY, f"ln_bwdp_{_tag(x, gamma)}_{vpt}_{nth}x{minb}"), smem)
        slots = nth // tpr
        nparts = min(-(-rows // slots), L.wave(k, nth, smem))
        part = xp.empty((2 * nparts, C), dtype=np.float32)
        k((nparts,), (tpr, slots, 1), (dy, x, gamma, mean, rstd, dx, part, np.int64(rows), np.int32(C),
                                       np.int32(stages), np.bool_(w_vec)), shared_mem=smem)
    elif plan is not None:
        tpr, vpt, rpb = plan
        name = f"ln_bwd_{_tag(x, gamma)}_{vpt}{vs}"
        k = get_function(FAMILY, name)
        block = (tpr, rpb, 1)
        # One wave of blocks: enough rows per block that the fp32 partials stay a few % of the traffic.
        nparts = min((rows + rpb - 1) // rpb, L.wave(k, tpr * rpb))
        part = xp.empty((2 * nparts, C), dtype=np.float32)
        k((nparts,), block, (dy, x, gamma, mean, rstd, dx, part, np.int64(rows), np.int32(C), np.bool_(w_vec)))
    else:
        # Long rows: per-row sums, then column-chunk blocks over row groups (layer_norm.cu).
        units = C // (16 // x.itemsize) if vec else C
        sums = xp.empty((rows, 2), dtype=np.float32)
        ks = get_function(FAMILY, f"ln_bwd_rowsums_{_tag(x, gamma)}_{vs}")
        ks((min(rows, 8 * B.sm_count()),), (512, 1, 1),
           (dy, x, gamma, mean, rstd, sums, np.int64(rows), np.int32(C), np.bool_(w_vec)))
        colblocks = (units + 255) // 256
        # ~8 blocks of 256 threads per SM in all, at least 8 rows per group (partials <= ~5 % of the bytes).
        groups = max(1, min(-(-8 * B.sm_count() // colblocks), -(-rows // 8)))
        rpg = -(-rows // groups)
        groups = -(-rows // rpg)
        nparts = groups
        part = xp.empty((2 * nparts, C), dtype=np.float32)
        kc = get_function(FAMILY, f"ln_bwd_cols_{_tag(x, gamma)}_{vs}")
        kc((colblocks, groups, 1), (256, 1, 1),
           (dy, x, gamma, mean, rstd, sums, dx, part, np.int64(rows), np.int32(C), np.int32(rpg), np.bool_(w_vec)))
    fin = get_function(FAMILY, f"ln_finalize_{B.DTYPE_TAG[gamma.dtype]}")
    fin(((C + 31) // 32, 2, 1), (32, 16, 1), (part, dgamma, dbeta, np.int32(nparts), np.int32(C)))
    return dx, dgamma, dbeta


__all__ = ["layer_norm", "layer_norm_backward"]
