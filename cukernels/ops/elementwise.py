"""Mixed-dtype elementwise ops and casts: ``ck.add``, ``ck.mul``, ``ck.cast``. Kernels: ``kernels_cu/elementwise.cu``.

Every op converts its operands to fp32 in registers and rounds once to the output dtype, so a bf16 branch can be
added into an fp32 residual stream without a temporary (the seed's §3.1.2). Launch helpers: ``ops/_launch.py``.
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from . import _launch as L
from ._launch import THREADS, UNROLL, ptr, row_chunks, vec_ok

FAMILY = "elementwise"


def resolve_dtype(name, dtype):
    return B.check_dtype_arg(name, dtype)


def _result_dtype(a, out, dtype):
    if dtype is not None:
        d = resolve_dtype("dtype", dtype)
        if out is not None and out.dtype != d:
            raise TypeError(f"out: dtype {out.dtype} disagrees with dtype={d}")
        return d
    if out is not None:
        B.check_dtype("out", out, B.FLOATS)
        return out.dtype
    return a.dtype


def _validate_binary(a, b):
    B.check_dtype("a", a, B.FLOATS)
    B.check_dtype("b", b, B.FLOATS)
    B.check_contiguous("a", a)
    B.check_contiguous("b", b)
    if tuple(b.shape) == tuple(a.shape):
        return False
    if a.ndim >= 1 and tuple(b.shape) == tuple(a.shape[-1:]):
        return True
    raise ValueError(
        f"b: expected shape {tuple(a.shape)} (a's shape) or {tuple(a.shape[-1:])} (broadcast along a's last axis); "
        f"got {tuple(b.shape)}"
    )


def _binary(a, b, out, dtype, alpha, is_mul):
    xp = B.array_module(a=a, b=b, out=out)
    bcast = _validate_binary(a, b)
    rd = _result_dtype(a, out, dtype)
    al = B.check_f32("alpha", alpha)
    y = B.empty(xp, a.shape, rd, out)
    if xp is np:
        af, bf = a.astype(np.float32), b.astype(np.float32)
        r = af * bf if is_mul else af + al * bf  # float32 arithmetic, rounded once below
        y[...] = r.astype(rd)
        return y
    n = a.size
    if n == 0:
        return y
    E = 16 // min(a.itemsize, b.itemsize, y.itemsize)
    tags = f"{B.DTYPE_TAG[a.dtype]}_{B.DTYPE_TAG[b.dtype]}_{B.DTYPE_TAG[rd]}"
    if not bcast:
        vec = vec_ok(a, b, y)
        name = f"binary_{tags}_{'v' if vec else 's'}"
        k = get_function(FAMILY, name)
        grid = L.launch_grid(k, -(-(n // E if vec else n) // UNROLL))
        k((grid,), (THREADS, 1, 1), (a, b, y, np.int64(n), al, np.bool_(is_mul)))
        return y
    C = a.shape[-1]
    rows = n // C
    vec = vec_ok(a, b, y) and C % E == 0
    name = f"bcast_{tags}_{'v' if vec else 's'}"
    k = get_function(FAMILY, name)
    Cu = C // E if vec else C
    for r0, nr in row_chunks(rows, Cu, "a"):
        grid = L.launch_grid(k, -(-(nr * Cu) // UNROLL))
        k((grid,), (THREADS, 1, 1),
          (ptr(a, r0 * C), b, ptr(y, r0 * C), np.uint32(nr), np.uint32(C), al, np.bool_(is_mul)))
    return y


@B.interop
def add(a, b, *, out=None, dtype=None, alpha=1.0):
    """``out = a + alpha * b``, computed in fp32 and rounded once to the output dtype.

    Mixed dtypes are the point: e.g. a bf16 branch output added into an fp32 residual stream in place,
    ``ck.add(resid, branch, out=resid)``. The fp32 arithmetic is exactly NumPy's float32 ``a + float32(alpha) * b``
    (no fused multiply-add), so kernel and reference agree bit for bit.

    Args:
        a: float32 or bfloat16 array, C-contiguous, any shape.
        b: float32 or bfloat16, C-contiguous, either ``a.shape`` or ``a.shape[-1:]`` — the latter is broadcast
            along a's last axis (a bias: ``b[j]`` is added to ``a[..., j]``). No other broadcasting.
        out: optional output buffer of ``a.shape``; may be ``a`` itself (in place), or ``b`` when b is not
            broadcast. Other overlaps between out and the inputs are not supported.
        dtype: result dtype (float32 or bfloat16). Default: ``out.dtype`` if out is given, else ``a.dtype``.
        alpha: scalar multiplier of b (a finite number, rounded to float32).

    Returns:
        the result array (``out`` when given).

    Example::

        >>> h = cp.zeros((4, 2048), cp.float32); d = cp.ones((4, 2048), ck.bfloat16)
        >>> ck.add(h, d, out=h)          # fp32 += bf16, in place
        >>> ck.add(h, d, dtype=ck.bfloat16, alpha=0.5)
    """
    return _binary(a, b, out, dtype, alpha, False)


@B.interop
def mul(a, b, *, out=None, dtype=None):
    """``out = a * b``, computed in fp32 and rounded once to the output dtype.

    Same operand rules as :func:`add`: dtypes float32/bfloat16 freely mixed, ``b.shape`` either ``a.shape`` or
    ``a.shape[-1:]`` (broadcast along the last axis), ``out`` may be ``a`` (in place), result dtype is
    ``dtype`` or ``out.dtype`` or ``a.dtype``. Bit-identical to NumPy's float32 product rounded once.

    Example::

        >>> ck.mul(x_bf16, scale_f32)                 # scale_f32.shape == x_bf16.shape[-1:]
    """
    return _binary(a, b, out, dtype, 1.0, True)


@B.interop
def cast(x, dtype, *, out=None):
    """``x`` converted to ``dtype`` (float32 <-> bfloat16; same dtype is a copy).

    float32 -> bfloat16 rounds to nearest, ties to even, bit-for-bit what ``ml_dtypes``' ``astype`` does:
    overflow goes to inf, subnormals are kept, NaN becomes the quiet NaN ``0x7fc0`` with x's sign.
    bfloat16 -> float32 is exact (NaN payloads kept). 16-byte loads and stores when both pointers are aligned.

    Args:
        x: float32 or bfloat16, C-contiguous.
        dtype: float32 or bfloat16.
        out: optional buffer of ``x.shape`` and ``dtype``.

    Returns:
        the converted array.

    Example::

        >>> w16 = ck.cast(w32, ck.bfloat16)
    """
    xp = B.array_module(x=x, out=out)
    B.check_dtype("x", x, B.FLOATS)
    B.check_contiguous("x", x)
    d = resolve_dtype("dtype", dtype)
    y = B.empty(xp, x.shape, d, out)
    if xp is np:
        with np.errstate(invalid="ignore"):  # ml_dtypes warns on NaN; NaN -> quiet NaN is intended
            y[...] = x.astype(d)
        return y
    n = x.size
    if n == 0:
        return y
    vec = vec_ok(x, y)
    E = 16 // min(x.itemsize, y.itemsize)
    name = f"cast_{B.DTYPE_TAG[x.dtype]}_{B.DTYPE_TAG[d]}_{'v' if vec else 's'}"
    k = get_function(FAMILY, name)
    units = n // E if vec else n
    grid = L.launch_grid(k, -(-units // UNROLL))
    k((grid,), (THREADS, 1, 1), (x, y, np.int64(n)))
    return y


__all__ = ["add", "cast", "mul"]
