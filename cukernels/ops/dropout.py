"""Dropout from a counter-based generator: ``ck.dropout``, ``ck.dropout_backward``, ``ck.dropout_add``.
Kernels: ``kernels_cu/dropout.cu``.

The mask is a pure function of ``(seed, offset, flat element index)``: Philox4x32-10 (Salmon et al., SC11; the
generator of cuRAND's ``Philox4_32_10`` and PyTorch's CUDA dropout) keyed by the 64-bit ``seed``, with the 128-bit
counter ``offset * 2**64 + i // 4``; element ``i`` takes word ``i % 4`` of that call and is kept iff it is
``>= round(p * 2**32)``. Nothing is stored: the backward draws the same mask again. The NumPy path computes the
very same integers (:func:`philox4x32`, checked against Random123's known-answer vectors), so the kernel's mask
equals the reference's bit for bit.

Seeds and offsets, and CUDA graphs. Each may be a Python int in ``[0, 2**64)`` or a 0-d uint64 / int64 array (a
device array on the CuPy path, read by the kernel, so its value at replay time counts). There is no
``advance`` op: one ``offset += 1`` on a 0-d device array (one CuPy elementwise launch, captured like any
other) per forward pass is all a captured training step needs to draw fresh masks on every replay. The usual
pattern for a model with many dropout sites::

    step_off = cp.zeros((), cp.uint64)                 # advanced once per forward: step_off += 1
    y = ck.dropout(x, 0.1, seed=(base_seed << 32) | site, offset=step_off)   # site: 0, 1, 2, ... per layer
    dx = ck.dropout_backward(dy, 0.1, seed=(base_seed << 32) | site, offset=step_off)  # before the advance

Different keys give independent streams, and so do different offsets under one key (each offset value owns
a whole 2**64-group counter range, so ``+= 1`` is enough: no need to advance by the element count). Every
forward pass that should see a fresh mask needs its own (seed, offset): with gradient accumulation, advance
per micro-batch, not per optimizer step.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ._launch import THREADS, launch_grid, vec_ok

FAMILY = "dropout"
UNROLL = 4  # units per thread in flight (DO_U in dropout.cu)

# Random123's Philox4x32 constants (philox.h): round multipliers and the key's Weyl increments.
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_U64 = (np.dtype(np.uint64), np.dtype(np.int64))
# NumPy path: Philox groups per chunk (~8 uint64 temporaries of this length live at once: 64 MB).
_CHUNK = 1 << 20


# ---------------------------------------------------------------------------------------------- Philox (NumPy)
def philox4x32(counter, key, rounds: int = 10):
    """Philox4x32-R of each counter under each key, vectorised, exact (uint64 products of 32-bit words).

    Written in Random123's order (round 1 with the key as given, the key bumped by ``PHILOX_W`` before each
    later round); the kernel bumps after each round instead, which is the same function.

    Args:
        counter: integer array ``(..., 4)`` of 32-bit words (c0 is the lowest).
        key: integer array ``(..., 2)`` (k0 lowest), broadcast against counter's leading axes.
        rounds: 10 for Philox4x32-10 (what the kernels use); 7 is the other published variant.

    Returns:
        uint32 array ``(..., 4)``.

    Example::

        >>> philox4x32(np.zeros(4, np.uint32), np.zeros(2, np.uint32))   # 0x6627e8d5 0xe169c58d ...
    """
    c = np.asarray(counter).astype(np.uint64) & _MASK32
    k = np.asarray(key).astype(np.uint64) & _MASK32
    if c.shape[-1:] != (4,) or k.shape[-1:] != (2,):
        raise ValueError(f"counter, key: expected shapes (..., 4) and (..., 2); got {c.shape} and {k.shape}")
    c0, c1, c2, c3 = c[..., 0], c[..., 1], c[..., 2], c[..., 3]
    k0, k1 = k[..., 0], k[..., 1]
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    w0, w1 = np.uint64(PHILOX_W[0]), np.uint64(PHILOX_W[1])
    s32 = np.uint64(32)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + w0) & _MASK32, (k1 + w1) & _MASK32
        p0, p1 = c0 * m0, c2 * m1  # < 2^64: exact
        c0, c1, c2, c3 = (p1 >> s32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> s32) ^ c3 ^ k1, p0 & _MASK32
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(np.uint32)


def philox_bits(n: int, seed: int, offset: int, start: int = 0) -> np.ndarray:
    """The uint32 draws of elements ``start .. start + n - 1`` for ``(seed, offset)`` (NumPy): element ``i`` is
    word ``i % 4`` of Philox4x32-10 with counter ``(i // 4 low, i // 4 high, offset low, offset high)`` and key
    ``(seed low, seed high)``. The kernels draw exactly these bits."""
    seed, offset = int(seed), int(offset)
    out = np.empty(n, np.uint32)
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint64)
    g_first, g_end = start // 4, -(-(start + n) // 4)
    for g0 in range(g_first, g_end, _CHUNK):
        g = np.arange(g0, min(g0 + _CHUNK, g_end), dtype=np.uint64)
        ctr = np.empty(g.shape + (4,), np.uint64)
        ctr[:, 0], ctr[:, 1] = g & _MASK32, g >> np.uint64(32)
        ctr[:, 2], ctr[:, 3] = offset & 0xFFFFFFFF, offset >> 32
        words = philox4x32(ctr, key).reshape(-1)  # elements 4 * g0 ...
        lo = max(start, 4 * g0)
        hi = min(start + n, 4 * (g0 + g.size))
        out[lo - start:hi - start] = words[lo - 4 * g0:hi - 4 * g0]
    return out


def keep_threshold(p) -> int:
    """``round(p * 2**32)`` (at most 2**32 - 1): an element is kept iff its draw is ``>=`` this."""
    return min(int(round(float(p) * 2.0**32)), 2**32 - 1)


def keep_mask(shape, p, *, seed, offset=0) -> np.ndarray:
    """The boolean keep mask (NumPy) that :func:`dropout` applies to a C-contiguous array of ``shape`` (flat index
    order). For tests and debugging; the ops never materialise it."""
    _check_p(p)
    s = _seed_value("seed", seed)
    o = _seed_value("offset", offset)
    n = int(np.prod(shape, dtype=np.int64))
    return (philox_bits(n, s, o) >= np.uint32(keep_threshold(p))).reshape(shape)


# ---------------------------------------------------------------------------------------------- validation
def _check_p(p):
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Real):
        raise TypeError(f"p: expected a number in [0, 1) (the drop probability); got {type(p).__name__}")
    if not (math.isfinite(float(p)) and 0.0 <= float(p) < 1.0):
        raise ValueError(f"p: expected a finite number in [0, 1) (the drop probability); got {p!r}")
    return float(p)


def _rng_arg(name, v):
    """(0-d array or None, value): a Python/NumPy integer in [0, 2**64), or a 0-d uint64/int64 array."""
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int in [0, 2**64) or a 0-d uint64/int64 array; got bool")
    if isinstance(v, numbers.Integral):
        v = int(v)
        if not 0 <= v < 2**64:
            raise ValueError(f"{name}: expected an int in [0, 2**64); got {v}")
        return None, v
    if B._kind(v) is not None:
        B.check_dtype(name, v, _U64)
        if v.ndim != 0:
            raise ValueError(f"{name}: expected a 0-d array (a device scalar); got shape {tuple(v.shape)}")
        return v, 0
    raise TypeError(f"{name}: expected an int in [0, 2**64) or a 0-d uint64/int64 array; got {type(v).__name__}")


def _seed_value(name, v) -> int:
    """Host value of a seed/offset (NumPy path): an int, or a 0-d NumPy array's 64 bits as unsigned."""
    arr, val = _rng_arg(name, v)
    if arr is None:
        return val
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name}: a device array's value is read by the kernel; the NumPy path needs an int "
                        "or a NumPy array")
    return int(arr.view(np.uint64)[()])  # int64 -1 is the pattern 2**64 - 1


def _resolve_dtype(default, out, dtype):
    """Result dtype: ``dtype``, else ``out.dtype``, else ``default`` (the rule of ``ck.add``)."""
    if dtype is not None:
        try:
            d = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype: expected a dtype (float32 or bfloat16); got {dtype!r}") from None
        if d not in B.FLOATS:
            raise TypeError(f"dtype: expected float32 or bfloat16; got {d}")
        if out is not None and out.dtype != d:
            raise TypeError(f"out: dtype {out.dtype} disagrees with dtype={d}")
        return d
    if out is not None:
        B.check_dtype("out", out, B.FLOATS)
        return out.dtype
    return default


def _check_float(name, a):
    B.check_dtype(name, a, B.FLOATS)
    B.check_contiguous(name, a)


def _scale(p) -> np.float32:
    return np.float32(1.0 / (1.0 - p))


def _kernel_rng_args(seed, offset, p):
    (sa, sv), (oa, ov) = _rng_arg("seed", seed), _rng_arg("offset", offset)
    return (sa if sa is not None else B.NULL, np.uint64(sv), oa if oa is not None else B.NULL, np.uint64(ov),
            np.uint32(keep_threshold(p)), _scale(p))


def _run(name, arrays, n, E, vec, rng_args):
    k = get_function(FAMILY, name)
    units = n // E if vec else n // 4  # the scalar kernels work in units of one Philox group (4 elements)
    grid = launch_grid(k, -(-units // UNROLL), THREADS)
    k((grid,), (THREADS, 1, 1), (*arrays, np.int64(n), *rng_args))


def _dropped(xf, keep, scale):
    """NumPy: float32 ``keep ? x * scale : 0`` (the kernel's __fmul_rn and select)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(keep, xf * scale, np.float32(0.0))


# ---------------------------------------------------------------------------------------------- the ops
def _dropout(x, p, seed, offset, out, dtype, xname):
    sarr, _ = _rng_arg("seed", seed)
    oarr, _ = _rng_arg("offset", offset)
    xp = B.array_module(**{xname: x}, out=out, seed=sarr, offset=oarr)
    p = _check_p(p)
    _check_float(xname, x)
    rd = _resolve_dtype(x.dtype, out, dtype)
    y = B.empty(xp, x.shape, rd, out)
    if xp is np:
        keep = keep_mask(x.shape, p, seed=seed, offset=offset)
        y[...] = _dropped(x.astype(np.float32), keep, _scale(p)).astype(rd)
        return y
    n = x.size
    if n == 0:
        return y
    vec = vec_ok(x, y)
    E = 16 // min(x.itemsize, y.itemsize)
    name = f"dropout_{B.DTYPE_TAG[x.dtype]}_{B.DTYPE_TAG[rd]}_{'v' if vec else 's'}"
    _run(name, (x, y), n, E, vec, _kernel_rng_args(seed, offset, p))
    return y


@B.interop
def dropout(x, p, *, seed, offset=0, out=None, dtype=None):
    """Inverted dropout: ``y = x * keep / (1 - p)``, ``keep ~ Bernoulli(1 - p)`` drawn from ``(seed, offset)``.

    Element ``i`` of the flattened (C-order) array is kept iff ``philox_bits(i) >= round(p * 2**32)``; a kept
    element is ``x * float32(1 / (1 - p))`` in fp32, rounded once to the output dtype, a dropped one is exactly
    0 (also when x is inf or NaN). The same ``(seed, offset)`` gives the same mask on the kernel and NumPy
    paths, for any shape with the same number of elements (the mask of the first k elements does not depend
    on the size). ``p == 0`` is the identity, still written into a new array (or ``out``).

    Args:
        x: float32 or bfloat16, C-contiguous, any shape.
        p: the drop probability, a finite number in ``[0, 1)``.
        seed: the generator key, an int in ``[0, 2**64)`` or a 0-d uint64/int64 array (a device array is read
            by the kernel: graph-capturable). Required: there is no hidden global generator.
        offset: the counter's high 64 bits, same types as seed (default 0). Use a new value for every forward
            pass that should draw a fresh mask (module docstring).
        out: optional output buffer of ``x.shape`` (may be ``x``: in place).
        dtype: result dtype (float32 or bfloat16); default ``out.dtype`` if out is given, else ``x.dtype``.

    Returns:
        ``y`` (``out`` when given).

    Example::

        >>> off = cp.zeros((), cp.uint64)
        >>> y = ck.dropout(h, 0.1, seed=1234, offset=off)      # off += 1 before the next forward
    """
    return _dropout(x, p, seed, offset, out, dtype, "x")


@B.interop
def dropout_backward(dy, p, *, seed, offset=0, out=None, dtype=None):
    """Gradient of :func:`dropout`: ``dx = dy * keep / (1 - p)`` with the forward's mask, drawn again from the same
    ``(seed, offset)`` (nothing was stored). Dropout is linear for a fixed mask, so this is the same function
    of ``dy`` as the forward is of ``x``, and the same kernel.

    Args:
        dy: float32 or bfloat16, C-contiguous, the shape of the forward's x.
        p, seed, offset: exactly the forward's (a device offset must not have been advanced in between).
        out: optional output buffer of ``dy.shape`` (may be ``dy``).
        dtype: result dtype; default ``out.dtype`` if out is given, else ``dy.dtype`` (pass the forward input's
            dtype to get a bf16 gradient from an fp32 ``dy``).

    Returns:
        ``dx``.

    Example::

        >>> dx = ck.dropout_backward(dy, 0.1, seed=1234, offset=off)
    """
    return _dropout(dy, p, seed, offset, out, dtype, "dy")


@B.interop
def dropout_add(x, residual, p, *, seed, offset=0, out=None, dtype=None):
    """``out = residual + dropout(x, p, seed=seed, offset=offset)`` in one pass (GPT-2's ``h + dropout(branch)``).

    Computed in fp32 as ``residual + (keep ? x * scale : 0)`` and rounded once to the output dtype (so an fp32
    result equals ``residual + dropout(x)`` bit for bit; a bf16 one is rounded once, not twice). The mask is
    :func:`dropout`'s for the same ``(seed, offset)``. Gradients: ``d residual = dout`` and
    ``dx = dropout_backward(dout, p, seed=seed, offset=offset)``.

    Args:
        x: float32 or bfloat16, C-contiguous (the branch output).
        residual: float32 or bfloat16, C-contiguous, ``x.shape`` (no broadcasting).
        p, seed, offset: as :func:`dropout`.
        out: optional output buffer of ``x.shape``; may be ``residual`` (in place: ``h += dropout(branch)``) or
            ``x``. Other overlaps are not supported.
        dtype: result dtype; default ``out.dtype`` if out is given, else ``residual.dtype``.

    Returns:
        the sum (``out`` when given).

    Example::

        >>> ck.dropout_add(attn_out_bf16, h_f32, 0.1, seed=s, offset=off, out=h_f32)   # fp32 h += bf16, in place
    """
    sarr, _ = _rng_arg("seed", seed)
    oarr, _ = _rng_arg("offset", offset)
    xp = B.array_module(x=x, residual=residual, out=out, seed=sarr, offset=oarr)
    p = _check_p(p)
    _check_float("x", x)
    _check_float("residual", residual)
    B.check_shape("residual", residual, x.shape, " (the shape of x)")
    rd = _resolve_dtype(residual.dtype, out, dtype)
    y = B.empty(xp, x.shape, rd, out)
    if xp is np:
        keep = keep_mask(x.shape, p, seed=seed, offset=offset)
        d = _dropped(x.astype(np.float32), keep, _scale(p))
        with np.errstate(over="ignore", invalid="ignore"):
            y[...] = (residual.astype(np.float32) + d).astype(rd)
        return y
    n = x.size
    if n == 0:
        return y
    vec = vec_ok(x, residual, y)
    E = 16 // min(x.itemsize, residual.itemsize, y.itemsize)
    tags = f"{B.DTYPE_TAG[x.dtype]}_{B.DTYPE_TAG[residual.dtype]}_{B.DTYPE_TAG[rd]}"
    _run(f"dropout_add_{tags}_{'v' if vec else 's'}", (x, residual, y), n, E, vec,
            _kernel_rng_args(seed, offset, p))
    return y


__all__ = ["dropout", "dropout_add", "dropout_backward"]
