"""Activations: ``ck.swiglu`` (separate and packed gate/up), ``ck.gelu`` (tanh approximation), and their
backwards. Kernels: ``kernels_cu/activations.cu``."""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ._launch import THREADS, UNROLL, launch_grid, ptr, row_chunks, vec_ok

FAMILY = "activations"
GELU_K = float(np.sqrt(2.0 / np.pi))
GELU_C = 0.044715


# ---------------------------------------------------------------- NumPy reference math (float64)
def _sigmoid64(z):
    """sigmoid in float64 without overflow warnings: e^-|z| never overflows."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _silu64(g):
    return g * _sigmoid64(g)


def _gelu64(x):
    return 0.5 * x * (1.0 + np.tanh(GELU_K * (x + GELU_C * x**3)))


def _gelu_grad64(x):
    t = np.tanh(GELU_K * (x + GELU_C * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * GELU_C * x * x)


# ---------------------------------------------------------------- validation and launch
def _check_same(name, a, ref_name, ref):
    B.check_dtype(name, a, (ref.dtype,))
    B.check_shape(name, a, ref.shape, f" (the shape of {ref_name})")
    B.check_contiguous(name, a)


def _check_float(name, a):
    B.check_dtype(name, a, B.FLOATS)
    B.check_contiguous(name, a)


def _launch(kname, T, arrays, n, vec):
    """Launch a flat activations kernel over n elements (run_flat in common/pointwise.cuh)."""
    name = f"{kname}_{B.DTYPE_TAG[T]}_{'v' if vec else 's'}"
    k = get_function(FAMILY, name)
    units = n // (16 // T.itemsize) if vec else n
    grid = launch_grid(k, -(-units // UNROLL))
    k((grid,), (THREADS, 1, 1), (*arrays, np.int64(n)))


def _launch_packed(kname, gu, others, rows, F, vec):
    """Launch a packed-layout kernel (run_rows): gate rows at gu + r * 2F, up rows F further; ``others`` are
    (array, row length, offset) for the remaining pointer arguments, in order."""
    name = f"{kname}_rows_{B.DTYPE_TAG[gu.dtype]}_{'v' if vec else 's'}"
    k = get_function(FAMILY, name)
    Fu = F // (16 // gu.itemsize) if vec else F
    for r0, nr in row_chunks(rows, Fu, "gu"):
        args = [ptr(gu, r0 * 2 * F), ptr(gu, r0 * 2 * F + F)]
        for a, ld, off in others:
            args.append(ptr(a, r0 * ld + off))
        grid = launch_grid(k, -(-(nr * Fu) // UNROLL))
        k((grid,), (THREADS, 1, 1), (*args, np.uint32(nr), np.uint32(F), np.int64(2 * F)))


@B.interop
def swiglu(gate, up, *, out=None):
    """SwiGLU: ``y = silu(gate) * up`` with ``silu(g) = g * sigmoid(g)``, computed in fp32.

    Stable for any finite input (``silu(-1e4) = -0``, ``silu(1e4) = 1e4``; no exp overflow reaches the output).

    Args:
        gate, up: same shape, same dtype (float32 or bfloat16), C-contiguous.
        out: optional output buffer like ``gate`` (may be ``gate`` or ``up``: in place).

    Returns:
        ``y``, shape and dtype of ``gate``.

    Example::

        >>> h = ck.swiglu(x @ w_gate, x @ w_up)
    """
    xp = B.array_module(gate=gate, up=up, out=out)
    _check_float("gate", gate)
    _check_same("up", up, "gate", gate)
    y = B.empty(xp, gate.shape, gate.dtype, out)
    if xp is np:
        y[...] = (_silu64(gate.astype(np.float64)) * up.astype(np.float64)).astype(gate.dtype)
        return y
    n = gate.size
    if n:
        _launch("swiglu_fwd", gate.dtype, (gate, up, y), n, vec_ok(gate, up, y))
    return y


@B.interop
def swiglu_backward(gate, up, dy, *, out_dgate=None, out_dup=None):
    """Gradients of :func:`swiglu`: with ``s = sigmoid(gate)``,

    ``dgate = dy * up * s * (1 + gate * (1 - s))`` and ``dup = dy * gate * s``.

    Args:
        gate, up: the forward inputs (same shape and dtype, float32 or bfloat16).
        dy: gradient of y, same shape and dtype.
        out_dgate, out_dup: optional output buffers (may alias gate / up respectively: in place).

    Returns:
        ``(dgate, dup)``, each like ``gate``.

    Example::

        >>> dg, du = ck.swiglu_backward(g, u, dy)
    """
    xp = B.array_module(gate=gate, up=up, dy=dy, out_dgate=out_dgate, out_dup=out_dup)
    _check_float("gate", gate)
    _check_same("up", up, "gate", gate)
    _check_same("dy", dy, "gate", gate)
    dg = B.empty(xp, gate.shape, gate.dtype, out_dgate, name="out_dgate")
    du = B.empty(xp, gate.shape, gate.dtype, out_dup, name="out_dup")
    if xp is np:
        g, u, d = gate.astype(np.float64), up.astype(np.float64), dy.astype(np.float64)
        s = _sigmoid64(g)
        rg = d * u * s * (1.0 + g * (1.0 - s))
        ru = d * g * s
        dg[...] = rg.astype(gate.dtype)
        du[...] = ru.astype(gate.dtype)
        return dg, du
    n = gate.size
    if n:
        _launch("swiglu_bwd", gate.dtype, (gate, up, dy, dg, du), n, vec_ok(gate, up, dy, dg, du))
    return dg, du


def _validate_packed(gu):
    _check_float("gu", gu)
    B.check_ndim("gu", gu, 1)
    F2 = gu.shape[-1]
    if F2 % 2 or F2 == 0:
        raise ValueError(f"gu: the last axis holds [gate | up] and must have an even, nonzero length; got shape {tuple(gu.shape)}")
    return F2 // 2


@B.interop
def swiglu_packed(gu, *, out=None):
    """SwiGLU on a packed gate/up buffer (one matmul producing both): ``gu[..., :F]`` is the gate,
    ``gu[..., F:]`` the up projection, and ``y = silu(gate) * up`` of shape ``gu.shape[:-1] + (F,)``.

    Args:
        gu: ``(..., 2F)`` float32 or bfloat16, C-contiguous.
        out: optional ``(..., F)`` buffer of gu's dtype.

    Returns:
        ``y`` ``(..., F)``.

    Example::

        >>> y = ck.swiglu_packed(x @ w_gate_up)      # w_gate_up: (hidden, 2 * ffn)
    """
    xp = B.array_module(gu=gu, out=out)
    F = _validate_packed(gu)
    y = B.empty(xp, gu.shape[:-1] + (F,), gu.dtype, out)
    if xp is np:
        g, u = gu[..., :F].astype(np.float64), gu[..., F:].astype(np.float64)
        y[...] = (_silu64(g) * u).astype(gu.dtype)
        return y
    rows = gu.size // (2 * F)
    if rows:
        E = 16 // gu.itemsize
        vec = vec_ok(gu, y) and F % E == 0
        _launch_packed("swiglu_fwd", gu, [(y, F, 0)], rows, F, vec)
    return y


@B.interop
def swiglu_packed_backward(gu, dy, *, out=None):
    """Gradient of :func:`swiglu_packed`: ``dgu[..., :F] = dgate``, ``dgu[..., F:] = dup`` (formulas as
    :func:`swiglu_backward`).

    Args:
        gu: ``(..., 2F)`` the forward input.
        dy: ``(..., F)`` gradient of y, gu's dtype.
        out: optional ``(..., 2F)`` buffer for dgu; may be ``gu`` itself (in place).

    Returns:
        ``dgu`` ``(..., 2F)``.
    """
    xp = B.array_module(gu=gu, dy=dy, out=out)
    F = _validate_packed(gu)
    B.check_dtype("dy", dy, (gu.dtype,))
    B.check_shape("dy", dy, gu.shape[:-1] + (F,), " (gu.shape[:-1] + (F,))")
    B.check_contiguous("dy", dy)
    dgu = B.empty(xp, gu.shape, gu.dtype, out)
    if xp is np:
        g, u, d = gu[..., :F].astype(np.float64), gu[..., F:].astype(np.float64), dy.astype(np.float64)
        s = _sigmoid64(g)
        rg = d * u * s * (1.0 + g * (1.0 - s))
        ru = d * g * s
        dgu[..., :F] = rg.astype(gu.dtype)
        dgu[..., F:] = ru.astype(gu.dtype)
        return dgu
    rows = gu.size // (2 * F)
    if rows:
        E = 16 // gu.itemsize
        vec = vec_ok(gu, dy, dgu) and F % E == 0
        _launch_packed("swiglu_bwd", gu, [(dy, F, 0), (dgu, 2 * F, 0), (dgu, 2 * F, F)], rows, F, vec)
    return dgu


@B.interop
def gelu(x, *, out=None):
    """GELU, tanh approximation (GPT-2): ``y = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``.

    The kernel evaluates the identical ``x * sigmoid(2 * sqrt(2/pi) * (x + 0.044715 x^3))`` in fp32, which has
    no cancellation and no overflow for finite x (``gelu(-1e4) = -0``, ``gelu(1e4) = 1e4``).

    Args:
        x: float32 or bfloat16, C-contiguous, any shape.
        out: optional buffer like ``x`` (may be ``x``: in place).

    Returns:
        ``y`` like ``x``.

    Example::

        >>> y = ck.gelu(h)
    """
    xp = B.array_module(x=x, out=out)
    _check_float("x", x)
    y = B.empty(xp, x.shape, x.dtype, out)
    if xp is np:
        y[...] = _gelu64(x.astype(np.float64)).astype(x.dtype)
        return y
    n = x.size
    if n:
        _launch("gelu_fwd", x.dtype, (x, y), n, vec_ok(x, y))
    return y


@B.interop
def gelu_backward(x, dy, *, out=None):
    """Gradient of :func:`gelu`: with ``t = tanh(k (x + 0.044715 x^3))``, ``k = sqrt(2/pi)``,

    ``dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 * 0.044715 x^2))``.

    Args:
        x: the forward input; dy: gradient of y, same shape and dtype.
        out: optional buffer like ``x`` (may alias x or dy).

    Returns:
        ``dx`` like ``x``.
    """
    xp = B.array_module(x=x, dy=dy, out=out)
    _check_float("x", x)
    _check_same("dy", dy, "x", x)
    dx = B.empty(xp, x.shape, x.dtype, out)
    if xp is np:
        dx[...] = (dy.astype(np.float64) * _gelu_grad64(x.astype(np.float64))).astype(x.dtype)
        return dx
    n = x.size
    if n:
        _launch("gelu_bwd", x.dtype, (x, dy, dx), n, vec_ok(x, dy, dx))
    return dx
