"""The two array paths and the validation every op shares.

A public op takes CuPy arrays (CUDA kernel on the current stream) or NumPy arrays (NumPy reference, same
semantics); mixing them is a TypeError. Validation runs before anything is launched and names the argument,
what was expected and what came.
"""
from __future__ import annotations

import functools
import threading

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
FLOATS = (float32, bfloat16)
# Short dtype names used in kernel entry-point names (rms_fwd_bf16_f32_4v ...).
DTYPE_TAG = {float32: "f32", bfloat16: "bf16", np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}
NULL = np.uint64(0)  # a null pointer kernel argument


def _cupy():
    try:
        import cupy
    except Exception:  # pragma: no cover - CuPy not installed: only the NumPy path exists
        return None
    return cupy


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when CuPy is importable and sees at least one CUDA device."""
    cp = _cupy()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _kind(a):
    if isinstance(a, np.ndarray):
        return np
    cp = _cupy()
    if cp is not None and isinstance(a, cp.ndarray):
        return cp
    return None


def array_module(**arrays):
    """numpy or cupy, from the arrays given by name (None values are skipped).

    Raises TypeError naming the argument when one is not an array, or when NumPy and CuPy arrays are mixed.
    CuPy arrays must live on the current device (ValueError otherwise).
    """
    xp = None
    first = None
    for name, a in arrays.items():
        if a is None:
            continue
        k = _kind(a)
        if k is None:
            raise TypeError(f"{name}: expected a numpy.ndarray or cupy.ndarray, got {type(a).__name__}")
        if xp is None:
            xp, first = k, name
        elif k is not xp:
            raise TypeError(
                f"{name}: is a {k.__name__} array but {first} is a {xp.__name__} array; "
                "pass all arrays from one module (CuPy for the kernels, NumPy for the reference)"
            )
    if xp is None:
        raise TypeError("no array arguments given")
    if xp is not np:
        dev = xp.cuda.Device().id
        for name, a in arrays.items():
            if a is not None and a.device.id != dev:
                raise ValueError(f"{name}: is on device {a.device.id}, but the current device is {dev}")
    return xp


def check_dtype(name, a, allowed):
    allowed = tuple(np.dtype(d) for d in allowed)
    if a.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}; got {a.dtype}")


def check_shape(name, a, shape, what=""):
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}{what}; got {tuple(a.shape)}")


def check_ndim(name, a, min_ndim):
    if a.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimension(s); got shape {tuple(a.shape)}")


def check_contiguous(name, a):
    if not a.flags.c_contiguous:
        raise ValueError(
            f"{name}: expected a C-contiguous array; got strides {a.strides} for shape {tuple(a.shape)} "
            "(call .copy() or ascontiguousarray first; no silent copies are made)"
        )


def check_out(name, out, shape, dtype):
    """Validate a caller-provided output buffer."""
    check_dtype(name, out, (dtype,))
    check_shape(name, out, shape)
    check_contiguous(name, out)


def empty(xp, shape, dtype, out=None, name="out"):
    """The output buffer: ``out`` after validation, else a fresh uninitialised array."""
    if out is not None:
        check_out(name, out, shape, dtype)
        return out
    return xp.empty(shape, dtype=dtype)


def aligned16(*arrays) -> bool:
    """All device pointers 16-byte aligned (the 128-bit access guard; the size guard is the caller's)."""
    return all(a.data.ptr % 16 == 0 for a in arrays)


def zero_(a):
    """Zero a CuPy array with cudaMemsetAsync on the current stream (no fill kernel)."""
    import cupy

    if a.nbytes:
        cupy.cuda.runtime.memsetAsync(a.data.ptr, 0, a.nbytes, cupy.cuda.get_current_stream().ptr)
    return a


@functools.lru_cache(maxsize=None)
def _sm_count(dev: int) -> int:
    import cupy

    return cupy.cuda.Device(dev).attributes["MultiProcessorCount"]


def sm_count() -> int:
    import cupy

    return _sm_count(cupy.cuda.Device().id)


def blocks_per_sm(kernel, threads: int, smem: int = 0) -> int:
    """Resident blocks per SM for ``kernel`` at ``threads`` per block, from its register count (one wave)."""
    regs = max(1, int(kernel.num_regs))
    by_regs = 65536 // (regs * ((threads + 31) // 32 * 32))
    by_threads = 2048 // threads
    by_smem = (228 * 1024) // (smem + int(kernel.shared_size_bytes) + 1024)
    return max(1, min(by_regs, by_threads, by_smem, 32))


def as_f32(a):
    """NumPy-path helper: the array as float32 (bf16 widened exactly)."""
    return a.astype(np.float32)


def scalar_f32(name, v):
    try:
        return np.float32(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number; got {type(v).__name__}") from None


_err_words: dict[tuple[str, int], object] = {}
_err_lock = threading.Lock()


def error_word(family: str):
    """A per-(family, device) 0-d int32 CuPy array that kernels OR error flags into (clamped bad ids or
    targets): checked by the caller whenever a host sync is acceptable, never by the op itself."""
    import cupy

    key = (family, cupy.cuda.Device().id)
    w = _err_words.get(key)
    if w is None:
        with _err_lock:
            w = _err_words.get(key)
            if w is None:
                w = _err_words[key] = cupy.zeros((), dtype=np.int32)
    return w

