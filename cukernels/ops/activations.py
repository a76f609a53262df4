"""Activations: ``ck.swiglu`` (separate and packed gate/up), ``ck.gelu`` (tanh approximation or exact erf form),
and their backwards. Kernels: ``kernels_cu/activations.cu``."""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ._launch import THREADS, UNROLL, launch_grid, ptr, row_chunks, vec_ok

FAMILY = "activations"
GELU_K = float(np.sqrt(2.0 / np.pi))
GELU_C = 0.044715
GELU_FORMS = ("tanh", "none")  # PyTorch's ``approximate`` values: tanh approximation, exact (erf)


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


_RSQRTPI = 1.0 / np.sqrt(np.pi)
_ERF_SERIES_TERMS = 40  # Maclaurin terms for |x| < 2 (see _erfc64)
_ERFC_CF_DEPTH = 40  # continued-fraction levels for |x| >= 2


def _erf_series(z):
    """erf(z) for 0 <= z < 2: 2/sqrt(pi) sum_{n<40} (-1)^n z^(2n+1) / (n! (2n+1))."""
    z2 = z * z
    term, s = z.copy(), z.copy()
    for n in range(1, _ERF_SERIES_TERMS):
        term *= -z2 / n
        s += term / (2 * n + 1)
    return 2.0 * _RSQRTPI * s


def _erfc_cf(z):
    """erfc(z) for z >= 2: Laplace's continued fraction, evaluated from the bottom."""
    z = np.minimum(z, 28.0)  # e^-784 = 0 exactly (erfc(27.3) is below the smallest double); z^2 stays finite
    f = z.copy()
    for k in range(_ERFC_CF_DEPTH, 0, -1):
        f = z + (0.5 * k) / f
    return np.exp(-z * z) * _RSQRTPI / f


def _erfc64(x):
    """erfc in float64 for an array of any shape (NumPy has no erf, there is no SciPy here, and
    np.vectorize(math.erfc) costs ~0.2 us an element). Measured against math.erfc / math.erf at 1e4 points in
    [-28, 28] (tests): relative error <= ~3e-13 for erfc and <= ~2e-15 for erf, far below fp32's 6e-8. Two
    classical expansions on a = |x|, each used where it converges fast:

    * a < 2: the Maclaurin series of erf, 40 terms (at a = 2 the last is ~4e-25 of the sum; the largest, ~3.2
      at n = 2, costs under a digit to cancellation), then erfc = 1 - erf (relative error grows towards a = 2,
      where erfc = 0.0047: ~2.4e-13);
    * a >= 2: Laplace's continued fraction erfc(a) = e^(-a^2) / sqrt(pi) / (a + (1/2) / (a + 1 / (a + (3/2) /
      (a + ...)))), 40 levels (6e-14 relative at a = 2, better beyond).

    Negative x: erfc(x) = 2 - erfc(|x|), which has no cancellation.
    """
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    r = np.empty_like(a)
    lo = a < 2.0
    hi = ~lo
    if lo.any():
        r[lo] = 1.0 - _erf_series(a[lo])
    if hi.any():
        r[hi] = _erfc_cf(a[hi])
    return np.where(x < 0, 2.0 - r, r)


def _erf64(x):
    """erf in float64 (see :func:`_erfc64`); the series directly below |x| = 2 (no 1 - erfc loss near 0)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    r = np.empty_like(a)
    lo = a < 2.0
    hi = ~lo
    if lo.any():
        r[lo] = _erf_series(a[lo])
    if hi.any():
        r[hi] = 1.0 - _erfc_cf(a[hi])
    return np.where(x < 0, -r, r)


def _gelu_erf64(x):
    """x Phi(x) with Phi(x) = 0.5 erfc(-x / sqrt 2): no cancellation for x << 0 (unlike 0.5 (1 + erf))."""
    return x * (0.5 * _erfc64(-x * np.sqrt(0.5)))


def _gelu_erf_grad64(x):
    """Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi) (|x| clamped at 40 for phi: it is 0 there, and x^2
    of a huge x would overflow with a warning)."""
    c = np.minimum(np.abs(x), 40.0)
    return 0.5 * _erfc64(-x * np.sqrt(0.5)) + x * (np.exp(-0.5 * c * c) * (_RSQRTPI * np.sqrt(0.5)))


def _check_form(approximate):
    if not isinstance(approximate, str):
        raise TypeError(f"approximate: expected 'tanh' or 'none'; got {type(approximate).__name__} {approximate!r}")
    if approximate not in GELU_FORMS:
        raise ValueError(f"approximate: expected 'tanh' (the tanh approximation) or 'none' (exact, erf); "
                         f"got {approximate!r}")
    return approximate == "none"


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


def _launch_packed(kname, gu, others, rows, F, vec, amax=None):
    """Launch a packed-layout kernel (run_rows): gate rows at gu + r * 2F, up rows F further; ``others`` are
    (array, row length, offset) for the remaining pointer arguments, in order. ``amax``: a 0-d float32 array
    that receives max |output| (the _amax kernels: zeroed here, then one atomicMax a block)."""
    name = f"{kname}_rows{'_amax' if amax is not None else ''}_{B.DTYPE_TAG[gu.dtype]}_{'v' if vec else 's'}"
    k = get_function(FAMILY, name)
    tail = ()
    if amax is not None:
        B.zero_(amax)
        tail = (amax,)
    Fu = F // (16 // gu.itemsize) if vec else F
    for r0, nr in row_chunks(rows, Fu, "gu"):
        args = [ptr(gu, r0 * 2 * F), ptr(gu, r0 * 2 * F + F)]
        for a, ld, off in others:
            args.append(ptr(a, r0 * ld + off))
        grid = launch_grid(k, -(-(nr * Fu) // UNROLL))
        k((grid,), (THREADS, 1, 1), (*args, np.uint32(nr), np.uint32(F), np.int64(2 * F), *tail))


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


def _check_amax(amax):
    """The ``amax`` output of the packed SwiGLU ops: a writable 0-d float32 array."""
    B.check_dtype("amax", amax, (np.dtype(np.float32),))
    if amax.shape != ():
        raise ValueError(f"amax: expected a 0-d float32 array (xp.zeros((), numpy.float32)); got shape "
                         f"{tuple(amax.shape)}")
    B.check_writable("amax", amax)


def _ref_amax_into(amax, *arrays):
    """max |a| over the arrays into the 0-d amax (NaN when any element is NaN; 0 for no elements)."""
    m = np.float32(0)
    for a in arrays:
        if a.size:
            m = np.maximum(m, np.abs(a.astype(np.float32)).max())
    amax[...] = m


@B.interop
def swiglu_packed(gu, *, out=None, amax=None):
    """SwiGLU on a packed gate/up buffer (one matmul producing both): ``gu[..., :F]`` is the gate,
    ``gu[..., F:]`` the up projection, and ``y = silu(gate) * up`` of shape ``gu.shape[:-1] + (F,)``.

    Args:
        gu: ``(..., 2F)`` float32 or bfloat16, C-contiguous.
        out: optional ``(..., F)`` buffer of gu's dtype.
        amax: optional 0-d float32 output: receives ``max |y|`` (of y as stored), computed in the same pass --
            what :func:`fp8_quantize` takes as ``amax=`` to scale y without an amax pass of its own.

    Returns:
        ``y`` ``(..., F)``.

    Example::

        >>> y = ck.swiglu_packed(x @ w_gate_up)      # w_gate_up: (hidden, 2 * ffn)
    """
    xp = B.array_module(gu=gu, out=out, amax=amax)
    F = _validate_packed(gu)
    if amax is not None:
        _check_amax(amax)
    y = B.empty(xp, gu.shape[:-1] + (F,), gu.dtype, out)
    if xp is np:
        g, u = gu[..., :F].astype(np.float64), gu[..., F:].astype(np.float64)
        y[...] = (_silu64(g) * u).astype(gu.dtype)
        if amax is not None:
            _ref_amax_into(amax, y)
        return y
    rows = gu.size // (2 * F)
    if rows:
        E = 16 // gu.itemsize
        vec = vec_ok(gu, y) and F % E == 0
        _launch_packed("swiglu_fwd", gu, [(y, F, 0)], rows, F, vec, amax)
    elif amax is not None:
        B.zero_(amax)
    return y


@B.interop
def swiglu_packed_backward(gu, dy, *, out=None, amax=None):
    """Gradient of :func:`swiglu_packed`: ``dgu[..., :F] = dgate``, ``dgu[..., F:] = dup`` (formulas as
    :func:`swiglu_backward`).

    Args:
        gu: ``(..., 2F)`` the forward input.
        dy: ``(..., F)`` gradient of y, gu's dtype.
        out: optional ``(..., 2F)`` buffer for dgu; may be ``gu`` itself (in place).
        amax: optional 0-d float32 output: receives ``max |dgu|`` (as stored), computed in the same pass.

    Returns:
        ``dgu`` ``(..., 2F)``.
    """
    xp = B.array_module(gu=gu, dy=dy, out=out, amax=amax)
    F = _validate_packed(gu)
    if amax is not None:
        _check_amax(amax)
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
        if amax is not None:
            _ref_amax_into(amax, dgu)
        return dgu
    rows = gu.size // (2 * F)
    if rows:
        E = 16 // gu.itemsize
        vec = vec_ok(gu, dy, dgu) and F % E == 0
        _launch_packed("swiglu_bwd", gu, [(dy, F, 0), (dgu, 2 * F, 0), (dgu, 2 * F, F)], rows, F, vec, amax)
    elif amax is not None:
        B.zero_(amax)
    return dgu


@B.interop
def gelu(x, *, approximate="tanh", out=None):
    """GELU, in fp32 registers, rounded once to x's dtype.

    ``approximate="tanh"`` (default; GPT-2's ``gelu_new``)::

        y = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))

    evaluated as the identical ``x * sigmoid(2 * sqrt(2/pi) * (x + 0.044715 x^3))``: no cancellation and no
    overflow for finite x (``gelu(-1e4) = -0``, ``gelu(1e4) = 1e4``).

    ``approximate="none"`` (exact; Hugging Face's ``"gelu"``, ``torch.nn.functional.gelu``'s default)::

        y = x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2)))

    with CUDA's ``erff``, as PyTorch computes it (for x < -4 the absolute error is ~1e-7, well below bf16).

    Args:
        x: float32 or bfloat16, C-contiguous, any shape.
        approximate: "tanh" or "none" (PyTorch's names).
        out: optional buffer like ``x`` (may be ``x``: in place).

    Returns:
        ``y`` like ``x``.

    Example::

        >>> y = ck.gelu(h)                        # GPT-2
        >>> y = ck.gelu(h, approximate="none")    # BERT / exact
    """
    xp = B.array_module(x=x, out=out)
    exact = _check_form(approximate)
    _check_float("x", x)
    y = B.empty(xp, x.shape, x.dtype, out)
    if xp is np:
        f = _gelu_erf64 if exact else _gelu64
        y[...] = f(x.astype(np.float64)).astype(x.dtype)
        return y
    n = x.size
    if n:
        _launch("gelu_erf_fwd" if exact else "gelu_fwd", x.dtype, (x, y), n, vec_ok(x, y))
    return y


@B.interop
def gelu_backward(x, dy, *, approximate="tanh", out=None):
    """Gradient of :func:`gelu` (same ``approximate``).

    tanh: with ``t = tanh(k (x + 0.044715 x^3))``, ``k = sqrt(2/pi)``,
    ``dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 * 0.044715 x^2))``.

    none: ``dx = dy * (Phi(x) + x * phi(x))`` with ``Phi(x) = 0.5 (1 + erf(x / sqrt 2))`` and
    ``phi(x) = exp(-x^2 / 2) / sqrt(2 pi)``.

    Args:
        x: the forward input; dy: gradient of y, same shape and dtype.
        approximate: "tanh" or "none", as in the forward.
        out: optional buffer like ``x`` (may alias x or dy).

    Returns:
        ``dx`` like ``x``.
    """
    xp = B.array_module(x=x, dy=dy, out=out)
    exact = _check_form(approximate)
    _check_float("x", x)
    _check_same("dy", dy, "x", x)
    dx = B.empty(xp, x.shape, x.dtype, out)
    if xp is np:
        g = _gelu_erf_grad64 if exact else _gelu_grad64
        dx[...] = (dy.astype(np.float64) * g(x.astype(np.float64))).astype(x.dtype)
        return dx
    n = x.size
    if n:
        _launch("gelu_erf_bwd" if exact else "gelu_bwd", x.dtype, (x, dy, dx), n, vec_ok(x, dy, dx))
    return dx


__all__ = ["gelu", "gelu_backward", "swiglu", "swiglu_backward", "swiglu_packed", "swiglu_packed_backward"]
