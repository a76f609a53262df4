"""Decode GEMV with a fused norm prologue and bias / activation / residual epilogue: ``ck.gemv``.
Kernels: ``kernels_cu/gemv.cu``."""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from . import _launch as L

FAMILY = "gemv"
THREADS = 256          # 8 warps a block (gemv.cu's __launch_bounds__)
MAX_B = 8              # rows of x one kernel call takes (NB accumulators per warp); more: the unfused path
# Shared-memory cap for the staged xn (NB x Kp x sizeof(x), NB = B rounded up to 1/2/4/8, Kp = K rounded up
# to 8): 128 KiB keeps bf16 x at B = 8 up to K = 8192 (LLaMA's down projection: exactly 128 KiB) and fits the
# opt-in limit of both sm_80 (163 KB) and sm_90 (227 KB); fp32 x reaches K = 4096 at B = 8, K = 16384 at
# B <= 2. Beyond it the launcher takes the unfused path (gemv.cu's header has the numbers).
SMEM_CAP = 128 * 1024
# From NB = 4 rows (B >= 3) a warp takes G = 2 adjacent output columns: each xn value it reads from shared memory
# and widens serves two W rows, ~25 % fewer instructions per W byte where B = 8 is issue-bound (gemv.cu), at the
# price of half the warps (N = 2048: 128 blocks). Kernels exist for NB 4 and 8 with G 1 and 2;
# ck.settings.gemv_pair_min_nb > 8 turns the pairing off (the benchmark compares both).
#
# ck.settings.gemv_prefetch_kb: KB of its first rows each warp asks into L2 before it waits on the previous kernel
# (gemv.cu; 0: none). A hint: the results do not depend on it. Session 5 (H200, LLaMA-1B B1 step, one process): 0 KB
# 1.184 ms, 2 KB 1.211, 4 KB 1.182, 8 KB 1.244 (8 KB x ~3K warps floods the DRAM queues ahead of the running kernel's
# own tail); the kernel alone at 8 KB: qkv 8.2 -> 7.9 us, o 5.6 -> 4.8.
#
# Stages of the per-lane cp.async ring the weight streams through (gemv.cu, 16-byte-aligned weights): 2 KB a warp
# a stage, 16 KB a block. Measured (session 6, H200, B1, captured chain under PDL, us at depth 2 / 3 / 4): qkv
# with rms 5.73 / 5.75 / 6.00, gate_up 19.8 / 18.2 / 17.5, down (K = 8192: 8 chunks a row) 11.3 / 11.4 / 10.5.
# So 3 stages (ck.settings.gemv_depth), 4 for rows of K >= LONG_K (gemv_depth_long); the launcher lowers it where
# xn leaves less room (sm_80's 163 KB opt-in limit with a 128 KB xn: 2 stages).
LONG_K = 4096
RING_STAGE = 16 * 1024
# (Tried and removed, session 6: capping the grid at 2 or 3 blocks a SM so the next kernel's blocks land beside
# this one under PDL and stream their first chunks early. LLaMA-1B B1 step: 1.285 ms at 2 a SM against 1.161
# with a full wave (run C); 1.001 at 3 and 1.068 at 2 with every kernel fitting beside its neighbour, against
# 0.973 (run D).)
NORMS = ("rms", "layer")
ACTS = {"swiglu": 1, "gelu_tanh": 2, "gelu": 3}
_REF_CHUNK = 8192      # weight rows widened to fp32 at a time by the NumPy path (<= 64 MB at K = 2048)


def _nb(rows: int) -> int:
    return 1 if rows <= 1 else 2 if rows <= 2 else 4 if rows <= 4 else 8


def _smem(rows: int, K: int, itemsize: int) -> int:
    return _nb(rows) * (-(-K // 8) * 8) * itemsize


def kernel_name(x_dtype, w_dtype, rows: int, swiglu: bool, vec: bool):
    """(entry point, columns a warp G) of the gemv kernel the launcher takes for these operands (B <= MAX_B)."""
    nb = _nb(rows)
    G = 2 if nb >= settings.gemv_pair_min_nb else 1
    name = (f"gemv_{B.DTYPE_TAG[np.dtype(x_dtype)]}_{B.DTYPE_TAG[np.dtype(w_dtype)]}_b{nb}_r{2 if swiglu else 1}"
            f"_g{G}_{'v' if vec else 's'}")
    return name, G


def _ptr_of(a) -> int:
    return a.data.ptr if B._kind(a) is not np else a.__array_interface__["data"][0]


def _rows_layout(name, a, want_disjoint=False):
    """(rows, row stride in elements) of ``a`` seen as [rows, C]: the last axis contiguous, the leading axes
    walked by one stride (``x[:, 0]`` of a [B, T, K] tensor, a column slice of a wider buffer, any C-contiguous
    array). Output buffers (``want_disjoint``) may not have rows that overlap."""
    C = a.shape[-1]
    s = a.itemsize
    rows = int(np.prod(a.shape[:-1], dtype=np.int64)) if a.ndim > 1 else 1
    if a.size == 0:
        return rows, max(1, C)
    st = a.strides
    if C > 1 and st[-1] != s:
        raise ValueError(f"{name}: the last axis must be contiguous (stride {s} bytes); got strides {st} for shape "
                         f"{tuple(a.shape)} (no silent copies are made)")
    if _ptr_of(a) % s:
        raise ValueError(f"{name}: the data pointer is not aligned to the {s}-byte element size")
    dims = [(n, t) for n, t in zip(a.shape[:-1], st[:-1]) if n > 1]
    if not dims:
        return rows, max(1, C)
    for n, t in dims:
        if t < 0 or t % s:
            raise ValueError(f"{name}: row strides must be non-negative multiples of the {s}-byte element size; "
                             f"got strides {st} for shape {tuple(a.shape)}")
    for (_, t0), (n1, t1) in zip(dims, dims[1:]):
        if t0 != n1 * t1:
            raise ValueError(f"{name}: the leading axes must flatten to rows with one stride; got strides {st} for "
                             f"shape {tuple(a.shape)}")
    ld = dims[-1][1] // s
    if want_disjoint and ld < C:
        raise ValueError(f"{name}: rows overlap (row stride {ld} elements < row length {C}); got strides {st}")
    return rows, ld


def _extent(a, rows, ld):
    lo = _ptr_of(a)
    return lo, lo + ((rows - 1) * ld + a.shape[-1]) * a.itemsize


def _check_vec1(name, a, n):
    B.check_dtype(name, a, B.FLOATS)
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},); got {tuple(a.shape)}")
    B.check_contiguous(name, a)


def _validate(x, weight, bias, norm, norm_weight, norm_bias, act, residual, out):
    B.check_dtype("x", x, B.FLOATS)
    B.check_ndim("x", x, 1)
    K = int(x.shape[-1])
    if K < 1:
        raise ValueError(f"x: the last axis (K) must have at least 1 element; got shape {tuple(x.shape)}")
    rows, ldx = _rows_layout("x", x)
    B.check_dtype("weight", weight, B.FLOATS)
    if weight.ndim != 2 or weight.shape[1] != K:
        raise ValueError(f"weight: expected shape (N, {K}) to match x's last axis; got {tuple(weight.shape)}")
    N, ldw = _rows_layout("weight", weight)
    if not 1 <= N < 2**31:
        raise ValueError(f"weight: expected 1 <= N < 2**31 rows; got shape {tuple(weight.shape)}")
    if act is not None and not isinstance(act, str):
        raise TypeError(f"act: expected None, 'swiglu', 'gelu_tanh' or 'gelu'; got {type(act).__name__} {act!r}")
    if act is not None and act not in ACTS:
        raise ValueError(f"act: expected None, 'swiglu', 'gelu_tanh' or 'gelu'; got {act!r}")
    if act == "swiglu" and N % 2:
        raise ValueError(f"weight: act='swiglu' needs an even number of rows (gate rows, then up rows); got {N}")
    n_out = N // 2 if act == "swiglu" else N
    if bias is not None:
        _check_vec1("bias", bias, N)
    if norm is not None and not isinstance(norm, str):
        raise TypeError(f"norm: expected None, 'rms' or 'layer'; got {type(norm).__name__} {norm!r}")
    if norm is not None and norm not in NORMS:
        raise ValueError(f"norm: expected None, 'rms' or 'layer'; got {norm!r}")
    if norm is None:
        for nm, v in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
            if v is not None:
                raise ValueError(f"{nm}: given but norm is None (pass norm='rms' or norm='layer')")
    else:
        if norm_weight is None:
            raise ValueError(f"norm_weight: required with norm={norm!r} (shape ({K},))")
        _check_vec1("norm_weight", norm_weight, K)
        if norm == "layer":
            if norm_bias is None:
                raise ValueError(f"norm_bias: required with norm='layer' (shape ({K},); zeros for none)")
            _check_vec1("norm_bias", norm_bias, K)
            B.check_dtype("norm_bias", norm_bias, (norm_weight.dtype,))
        elif norm_bias is not None:
            raise ValueError("norm_bias: RMSNorm has no bias (norm='rms'); pass None")
    out_shape = tuple(x.shape[:-1]) + (n_out,)
    if out is not None:
        B.check_dtype("out", out, B.FLOATS)
        B.check_shape("out", out, out_shape)
        B.check_writable("out", out)
        _, ldo = _rows_layout("out", out, want_disjoint=True)
    odt = out.dtype if out is not None else x.dtype
    ldr = 0
    if residual is not None:
        B.check_dtype("residual", residual, (odt,))
        B.check_shape("residual", residual, out_shape, " (the output's shape)")
        _, ldr = _rows_layout("residual", residual)
        if out is not None and rows and n_out:
            same = _ptr_of(residual) == _ptr_of(out) and residual.strides == out.strides
            if not same:
                r0, r1 = _extent(residual, rows, ldr)
                o0, o1 = _extent(out, rows, ldo)
                if r0 < o1 and o0 < r1:
                    raise ValueError("residual: overlaps out without being the same array; pass out=residual for "
                                     "the in-place residual stream, or disjoint buffers")
    return K, rows, ldx, N, ldw, n_out, out_shape, np.dtype(odt), ldr


def _mid_dtype(x_dtype, odt):
    """The dtype of the unfused composition's intermediates: matmul's output (out's dtype for bf16 x, fp32 for
    fp32 inputs, whose GEMM gives fp32 only), then the activation's (the same). See gemv.cu's header."""
    return B.bfloat16 if (x_dtype == B.bfloat16 and odt == B.bfloat16) else np.dtype(np.float32)


def _reference(x2, weight, bias, norm, nw, nb, eps, act, res2, odt):
    """The NumPy path: fp32 math with the kernel's rounding points, vectorised (the weight is widened to fp32
    in chunks of _REF_CHUNK rows, then one float32 matmul each)."""
    from .activations import _gelu64, _gelu_erf64, _silu64

    f32 = np.float32
    md = _mid_dtype(x2.dtype, odt)
    xf = x2.astype(f32)
    if norm == "rms":
        x64 = x2.astype(np.float64)
        r = (1.0 / np.sqrt(np.mean(x64 * x64, axis=-1) + eps)).astype(f32)
        xn = (xf * r[:, None] * nw.astype(f32)).astype(x2.dtype)
    elif norm == "layer":
        x64 = x2.astype(np.float64)
        mu = x64.mean(axis=-1)
        var = ((x64 - mu[:, None]) ** 2).mean(axis=-1)
        mean, rstd = mu.astype(f32), (1.0 / np.sqrt(var + eps)).astype(f32)
        xn = ((xf - mean[:, None]) * rstd[:, None] * nw.astype(f32) + nb.astype(f32)).astype(x2.dtype)
    else:
        xn = x2
    a = xn.astype(f32)
    N = weight.shape[0]
    y = np.empty((a.shape[0], N), dtype=f32)
    for n0 in range(0, N, _REF_CHUNK):
        n1 = min(N, n0 + _REF_CHUNK)
        y[:, n0:n1] = a @ weight[n0:n1].astype(f32).T
    y = y.astype(md)
    if bias is not None:
        y = (y.astype(f32) + bias.astype(f32)).astype(md)
    if act == "swiglu":
        F = N // 2
        v = (_silu64(y[:, :F].astype(np.float64)) * y[:, F:].astype(np.float64)).astype(md)
    elif act == "gelu_tanh":
        v = _gelu64(y.astype(np.float64)).astype(md)
    elif act == "gelu":
        v = _gelu_erf64(y.astype(np.float64)).astype(md)
    else:
        v = y
    if res2 is not None:
        v = res2.astype(f32) + v.astype(f32)
    return v.astype(odt)


def _unfused(xp, x2, weight, bias, norm, nw, nb, eps, act, res2, out2, odt):
    """B > MAX_B rows (or xn over SMEM_CAP): the composition of our ops, same rounding points as the kernel.
    Allocates its intermediates (not workspace-free), and copies x (or residual) when their rows are strided."""
    from ..blas import matmul
    from .activations import gelu, swiglu_packed
    from .elementwise import add, cast
    from .layer_norm import layer_norm
    from .rms_norm import rms_norm

    md = _mid_dtype(x2.dtype, odt)
    xc = x2 if x2.flags.c_contiguous else xp.ascontiguousarray(x2)
    if norm == "rms":
        xc = rms_norm(xc, nw, eps)
    elif norm == "layer":
        xc = layer_norm(xc, nw, nb, eps)
    a, w = xc, weight
    if a.dtype != w.dtype:  # mixed dtypes: the fp32 GEMM on the exactly widened bf16 operand
        if a.dtype != np.float32:
            a = a.astype(np.float32)
        else:
            w = w.astype(np.float32)
    y = matmul(a, w, trans_b=True, out_dtype=md if a.dtype == B.bfloat16 else np.float32)
    if y.dtype != md:
        y = cast(y, md)
    if bias is not None:
        add(y, bias, out=y)
    if act == "swiglu":
        y = swiglu_packed(y)
    elif act is not None:
        gelu(y, approximate="tanh" if act == "gelu_tanh" else "none", out=y)
    if res2 is not None:
        rc = res2 if res2.flags.c_contiguous else xp.ascontiguousarray(res2)
        if out2.flags.c_contiguous:
            add(rc, y, out=out2)  # rc may be out2 itself: in place
        else:
            out2[...] = add(rc, y, dtype=odt)
    elif out2.flags.c_contiguous:
        cast(y, odt, out=out2)
    else:
        out2[...] = cast(y, odt)


def _rows2(a, rows, ld):
    """[rows, C] view of a validated array (no copy: the leading axes are walked by one stride)."""
    C = a.shape[-1]
    if a.ndim == 2:
        return a
    xp = np if B._kind(a) is np else B._kind(a)
    if a.size == 0 or rows <= 1:
        return a.reshape(rows, C)
    if xp is np:
        return np.lib.stride_tricks.as_strided(a, shape=(rows, C), strides=(ld * a.itemsize, a.itemsize))
    return xp.lib.stride_tricks.as_strided(a, shape=(rows, C), strides=(ld * a.itemsize, a.itemsize))


@B.interop
def gemv(x, weight, *, bias=None, norm=None, norm_weight=None, norm_bias=None, eps=1e-5, act=None, residual=None,
         out=None):
    """``out = residual + act(norm(x) @ weight.T + bias)`` for a few rows of x (the decode step), in one kernel.

    * ``norm``: None; ``"rms"``: ``xn = x * rsqrt(mean(x**2) + eps) * norm_weight``; ``"layer"``: ``xn = (x -
      mean) * rsqrt(var + eps) * norm_weight + norm_bias``. fp32 statistics per row, xn rounded to x's dtype
      (as ``ck.rms_norm`` / ``ck.layer_norm`` give it to the GEMM).
    * ``y[b, n] = sum_k xn[b, k] * weight[n, k] (+ bias[n])``, fp32 accumulation.
    * ``act``: None; ``"swiglu"``: ``a[b, j] = silu(y[b, j]) * y[b, N/2 + j]`` (weight packs the gate rows, then
      the up rows; the output has N/2 columns); ``"gelu_tanh"`` / ``"gelu"`` (exact erf).
    * ``out = residual + a`` (residual may be ``out`` itself: the in-place residual stream), or ``a``.

    Rounding: intermediates (the GEMM output, bias sum and activation) are rounded to bf16 when x and out are
    both bf16, as the unfused ``ck.matmul`` -> ``ck.add`` -> ``ck.swiglu_packed`` / ``ck.gelu`` -> ``ck.add``
    composition does; with fp32 x or an fp32 out (the LM head's logits) they stay fp32. The final value is
    rounded once to out's dtype.

    B <= 8 rows with ``B x ceil8(K) x sizeof(x) <= 128 KiB`` (B rounded up to 1/2/4/8): one kernel that reads
    the weight once, graph-capturable and allocation-free when ``out`` is given. Otherwise (the crossover:
    B >= 9; or xn over 128 KiB: fp32 x at B 5-8 with K > 4096, B 3-4 with K > 8192) the unfused composition
    of ``ck.rms_norm`` / ``ck.layer_norm``, ``ck.matmul``, ``ck.add``, ``ck.swiglu_packed`` / ``ck.gelu``:
    same results within rounding, but it allocates its intermediates. At B >= 9 the weight-streaming GEMV's FMA and shared-memory issue exceed the
    memory time (gemv.cu), where cuBLAS's tensor-core GEMM does not.

    Args:
        x: ``(..., K)`` float32 or bfloat16; the leading axes flatten to B rows (one stride apart: a [B, 1, K]
            tensor, a column slice of a wider buffer), the last axis contiguous.
        weight: ``(N, K)`` bfloat16 or float32, last axis contiguous; rows may lie further apart than K (a
            padded head).
        bias: ``(N,)`` float32 or bfloat16, or None.
        norm, norm_weight, norm_bias, eps: the prologue (``norm_weight``, ``norm_bias``: ``(K,)``, the same
            dtype; ``eps`` > 0).
        act: None, ``"swiglu"`` (N even), ``"gelu_tanh"`` or ``"gelu"``.
        residual: ``(..., N_out)`` in out's dtype, or None.
        out: ``(..., N_out)`` float32 or bfloat16 (default: x's dtype), last axis contiguous, rows any stride.

    Returns:
        ``out``, shape ``x.shape[:-1] + (N_out,)`` with ``N_out = N // 2`` for swiglu, else N.

    Example::

        >>> h = ck.gemv(x, w_qkv, norm="rms", norm_weight=ln1)              # [B, 3072]
        >>> ck.gemv(attn, w_o, residual=x, out=x)                          # x += attn @ w_o.T
        >>> ck.gemv(x, w_gate_up, norm="rms", norm_weight=ln2, act="swiglu")
        >>> logits = ck.gemv(x, w_head, norm="rms", norm_weight=ln_f, out=cp.empty((B, V), cp.float32))
    """
    xp = B.array_module(x=x, weight=weight, bias=bias, norm_weight=norm_weight, norm_bias=norm_bias,
                        residual=residual, out=out)
    K, rows, ldx, N, ldw, n_out, out_shape, odt, ldr = _validate(x, weight, bias, norm, norm_weight, norm_bias,
                                                                 act, residual, out)
    eps = B.check_real("eps", eps, min=0, min_open=True)
    if out is None:
        out = xp.empty(out_shape, dtype=odt)
    _, ldo = _rows_layout("out", out, want_disjoint=True)
    if rows == 0 or n_out == 0:
        return out
    x2 = _rows2(x, rows, ldx)
    res2 = None if residual is None else _rows2(residual, rows, ldr)
    out2 = _rows2(out, rows, ldo)
    if xp is np:
        out2[...] = _reference(x2, weight, bias, norm, norm_weight, norm_bias, eps, act, res2, odt)
        return out
    smem = _smem(rows, K, x.itemsize)
    if rows > MAX_B or smem > SMEM_CAP:
        _unfused(xp, x2, weight, bias, norm, norm_weight, norm_bias, eps, act, res2, out2, odt)
        return out

    Ew, Ex = 16 // weight.itemsize, 16 // x.itemsize
    vec = K % Ew == 0 and _ptr_of(weight) % 16 == 0 and (N == 1 or (ldw * weight.itemsize) % 16 == 0)
    x_vec = K % Ex == 0 and _ptr_of(x) % 16 == 0 and (rows == 1 or (ldx * x.itemsize) % 16 == 0)
    nb = _nb(rows)
    swiglu = act == "swiglu"
    flags = ((1 if odt == np.float32 else 0)
             | (2 if bias is not None and bias.dtype == np.float32 else 0)
             | (4 if norm_weight is not None and norm_weight.dtype == np.float32 else 0)
             | (8 if _mid_dtype(x.dtype, odt) == B.bfloat16 else 0)
             | (16 if x_vec else 0)
             | (settings.gemv_prefetch_kb << 8))  # (0..255, checked by the settings)
    inv_k = np.float32(1.0) / np.float32(K)  # correctly rounded, as the kernels' 1.f / C
    name, G = kernel_name(x.dtype, weight.dtype, rows, swiglu, vec)
    if vec:
        smem = -(-smem // 16) * 16
        want = settings.gemv_depth_long if K >= LONG_K else settings.gemv_depth
        depth = max(1, min(want, (B.smem_optin() - smem) // RING_STAGE))
        smem += depth * RING_STAGE
    else:
        depth = 1
    # one limit per kernel object (set once, before any capture): the largest xn plus the deepest ring
    limit = min(B.smem_optin(), SMEM_CAP + max(settings.gemv_depth, settings.gemv_depth_long) * RING_STAGE)
    k = L.with_smem(get_function(FAMILY, name), limit)
    groups = -(-n_out // G)
    grid = max(1, min(-(-groups // (THREADS // 32)), L.wave(k, THREADS, smem)))
    L.launch(k, (grid,), (THREADS, 1, 1),
      (L.ptr(x), np.int64(ldx), np.int32(rows), np.int32(K), L.ptr(weight), np.int64(ldw),
       L.ptr(bias) if bias is not None else B.NULL,
       L.ptr(norm_weight) if norm_weight is not None else B.NULL,
       L.ptr(norm_bias) if norm_bias is not None else B.NULL,
       np.float32(eps), inv_k,
       L.ptr(residual) if residual is not None else B.NULL, np.int64(ldr),
       L.ptr(out), np.int64(ldo), np.int32(n_out), np.int32(n_out if swiglu else 0),
       np.int32(0 if norm is None else NORMS.index(norm) + 1), np.int32(ACTS.get(act, 0)), np.uint32(flags),
       np.int32(depth)),
      smem, pdl=True)
    return out


__all__ = ["gemv"]
