"""The two array paths, the validation every op shares, and interop with other array libraries.

A public op takes CuPy arrays (CUDA kernel on the current stream) or NumPy arrays (NumPy reference, same
semantics); mixing them is a TypeError. Validation runs before anything is launched and names the argument,
what was expected and what came: arrays (``check_array``, ``check_dtype``, ``check_shape``, ``check_out`` ...),
plain values (``check_real``, ``check_int``, ``check_bool``, ``check_choice``, ``check_callable``), sizes checked
before anything is allocated (``check_alloc``) and token ids checked against a vocabulary before any cast
(``check_token_ids``, ``token_ids_int32``). The policy is docs/errors.md: TypeError for the wrong kind of value,
ValueError for a value of the right kind outside what is allowed, one line starting with the argument's name.

``@interop`` (applied to every public op) lets the ops take other libraries' arrays without a copy: a GPU
array exposing ``__dlpack__`` (PyTorch, JAX, CuPy-compatible libraries) or ``__cuda_array_interface__`` (Numba)
becomes a CuPy view of the same memory, a CPU array exposing ``__dlpack__`` (a CPU ``torch.Tensor``) a NumPy
view (the reference path); results come back as ``torch.Tensor`` when a torch tensor was passed, else as CuPy
/ NumPy arrays. Arguments that are already NumPy or CuPy arrays or plain values cost one set lookup each.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import sys
import threading

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
FLOATS = (float32, bfloat16)
# FP8 formats (ml_dtypes). CuPy 14 has no float8 dtype (cupy/_core/_scalar.pyx knows a C type for bfloat16 only), so
# FP8 data lives in uint8 arrays of the same bits on the device, and the ops that take it are told the format
# (``ops/fp8.py``); NumPy arrays may be either those uint8 bits or ml_dtypes' float8 arrays (``q.view(fmt)``).
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
FP8 = (float8_e4m3fn, float8_e5m2)
# Short dtype names used in kernel entry-point names (rms_fwd_bf16_f32_4v ...).
DTYPE_TAG = {float32: "f32", bfloat16: "bf16", np.dtype(np.int32): "i32", np.dtype(np.int64): "i64",
             float8_e4m3fn: "e4m3", float8_e5m2: "e5m2"}
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


def _tensor_like_type(t) -> bool:
    return any(c.__name__ == "Tensor" for c in t.__mro__)


def is_autograd_tensor(a) -> bool:
    """A cukernels autograd ``Tensor`` or a subclass (``nn.Parameter``), duck-typed: ops sit below autograd and do
    not import it. A class named Tensor in its MRO, ``requires_grad``, and a ``.data`` that is a NumPy or CuPy
    array (a ``torch.Tensor``'s ``.data`` is a torch tensor)."""
    return (_tensor_like_type(type(a)) and hasattr(a, "requires_grad")
            and _kind(getattr(a, "data", None)) is not None)


def tensor_message(name, op=None) -> str:
    """The TypeError text for an autograd Tensor passed to kernel op ``op``: where the differentiable version is."""
    F = sys.modules.get("cukernels.functional")  # looked up, not imported: functional sits above the ops
    if op is None:
        hint = f"use the differentiable version in ck.functional, or pass {name}.data"
        what = "the kernel ops take"
    elif F is not None and callable(getattr(F, op, None)):
        hint = f"use ck.functional.{op} (the differentiable version), or pass {name}.data"
        what = f"ck.{op} takes"
    else:
        hint = f"pass {name}.data (ck.functional has no {op})"
        what = f"ck.{op} takes"
    return f"{name}: got a cukernels autograd Tensor; {what} arrays: {hint}"


def _not_array(name, a) -> TypeError:
    """The TypeError for a value that is not a NumPy / CuPy array where one is required."""
    if is_autograd_tensor(a):
        return TypeError(tensor_message(name))
    hint = ""
    if _foreign_kind(a) is not None:
        hint = " (another library's array: the public ck.* ops take it without a copy; or convert it " \
               "with cupy.from_dlpack / numpy.from_dlpack)"
    elif isinstance(a, (list, tuple)) or isinstance(a, numbers.Number):
        hint = f" (make it an array first: numpy.asarray({name}, dtype=numpy.float32) or the dtype the op takes)"
    return TypeError(f"{name}: expected a numpy.ndarray or cupy.ndarray, got {_got(a) if a is None else type(a).__name__}"
                     f"{hint}")


def check_array(name, a):
    """``a`` itself after checking it is a NumPy or CuPy array (TypeError naming ``name`` otherwise: None, a list,
    a number, an autograd Tensor ...). Every ``check_*`` of an array calls it first, so a required array given as
    None is a TypeError naming it, never an AttributeError from ``.dtype``."""
    if type(a) is np.ndarray or _kind(a) is not None:
        return a
    raise _not_array(name, a)


def array_module(**arrays):
    """numpy or cupy, from the arrays given by name (None values are skipped: optional arguments).

    Raises TypeError naming the argument when one is not an array, or when NumPy and CuPy arrays are mixed, or
    (naming the first argument) when every one is None. CuPy arrays must live on the current device (ValueError
    otherwise).
    """
    xp = None
    first = None
    for name, a in arrays.items():
        if a is None:
            continue
        k = _kind(a)
        if k is None:
            raise _not_array(name, a)
        if xp is None:
            xp, first = k, name
        elif k is not xp:
            raise TypeError(
                f"{name}: is a {k.__name__} array but {first} is a {xp.__name__} array; "
                "pass all arrays from one module (CuPy for the kernels, NumPy for the reference)"
            )
    if xp is None:
        if arrays:
            raise TypeError(f"{next(iter(arrays))}: expected a numpy.ndarray or cupy.ndarray, got None")
        raise TypeError("no array arguments given")
    if xp is not np:
        dev = xp.cuda.Device().id
        for name, a in arrays.items():
            if a is not None and a.device.id != dev:
                raise ValueError(f"{name}: is on device {a.device.id}, but the current device is {dev}")
    return xp


def check_dtype(name, a, allowed):
    check_array(name, a)
    allowed = tuple(np.dtype(d) for d in allowed)
    if a.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        hint = ""
        if a.dtype == np.float64 and float32 in allowed:
            # NumPy's default dtype is the first thing a NumPy user passes.
            hint = f" (the ops take float32 or bfloat16 only, not NumPy's default float64: cast with " \
                   f"{name}.astype(numpy.float32))"
        raise TypeError(f"{name}: expected dtype {names}; got {a.dtype}{hint}")


def check_shape(name, a, shape, what=""):
    check_array(name, a)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}{what}; got {tuple(a.shape)}")


def check_ndim(name, a, min_ndim):
    check_array(name, a)
    if a.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimension(s); got shape {tuple(a.shape)}")


def check_contiguous(name, a):
    check_array(name, a)
    if not a.flags.c_contiguous:
        raise ValueError(
            f"{name}: expected a C-contiguous array; got strides {a.strides} for shape {tuple(a.shape)} "
            "(call .copy() or ascontiguousarray first; no silent copies are made)"
        )


def check_writable(name, a):
    """A NumPy array the op writes into must be writable (CuPy arrays always are)."""
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ValueError(f"{name}: is read-only (flags.writeable is False) but the op writes into it; "
                         "pass a writable array (e.g. a .copy())")


def check_out(name, out, shape, dtype):
    """Validate a caller-provided output buffer."""
    check_dtype(name, out, (dtype,))
    check_shape(name, out, shape)
    check_contiguous(name, out)
    check_writable(name, out)


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


_sm_targets: dict[int, int] = {}  # device -> SMs the kernels queued from now on may hold (0 / absent: all)


def set_sm_target(n: int) -> int:
    """Record how many SMs the work queued from now on (this device) should size itself for, returning the
    previous value (0 = all). ``cukernels.blas.set_sm_count_target`` sets it beside cuBLAS's own target; the
    persistent kernels (sm_90 attention) size their grids by :func:`sm_target`, so a collective that a
    ``ZeroAdamW(sm_margin=)`` runs beside them finds SMs free instead of waiting for a whole persistent wave."""
    import cupy

    dev = cupy.cuda.Device().id
    old = _sm_targets.get(dev, 0)
    _sm_targets[dev] = int(n)
    return old


def sm_target() -> int:
    """SMs a persistent grid should fill on the current device: :func:`set_sm_target`'s value, else all."""
    import cupy

    dev = cupy.cuda.Device().id
    n = _sm_targets.get(dev, 0)
    return min(n, _sm_count(dev)) if n > 0 else _sm_count(dev)


@functools.lru_cache(maxsize=None)
def _smem_optin(dev: int) -> int:
    import cupy

    return int(cupy.cuda.Device(dev).attributes["MaxSharedMemoryPerBlockOptin"])


def smem_optin() -> int:
    """The current device's opt-in shared memory limit a block, in bytes (227 KB on sm_90, 163 KB on sm_80)."""
    import cupy

    return _smem_optin(cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _capability(dev: int) -> int:
    import cupy

    return int(cupy.cuda.Device(dev).compute_capability)


def capability() -> int:
    """The current device's compute capability as an integer (90 for Hopper)."""
    import cupy

    return _capability(cupy.cuda.Device().id)


_LIBCUDA: list = []


def libcuda():
    """The CUDA driver library (ctypes), or None where there is none (a CPU machine). For the few driver entry
    points CuPy does not expose: graph instantiation flags (graph.py), launch attributes (ops/_launch.py)."""
    if not _LIBCUDA:
        import ctypes

        try:
            _LIBCUDA.append(ctypes.CDLL("libcuda.so.1"))
        except OSError:
            _LIBCUDA.append(None)
    return _LIBCUDA[0]


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
    """A real-number argument as np.float32 (TypeError naming it for a string, None, a bool, an array ...)."""
    return np.float32(check_real(name, v, finite=False))


# ---------------------------------------------------------------- plain-number arguments
def _short(v) -> str:
    r = " ".join(repr(v).split())  # one line (an array's repr spans several)
    return r[:40] + "..." if len(r) > 43 else r


def _got(v) -> str:
    return f"{type(v).__name__} {_short(v)}"


def _range_text(lo, lo_open, hi, hi_open) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi}"
    return ""


def check_real(name, v, *, min=None, max=None, min_open=False, max_open=False, finite=True) -> float:  # noqa: A002
    """``v`` as a Python float, after checking it is a real number (an int, a float or a NumPy scalar; not a bool,
    a string, None or an array: TypeError) within the range (ValueError): finite unless ``finite=False``, and
    ``min <= v`` (``min < v`` with ``min_open``), ``v <= max`` (``v < max`` with ``max_open``) when given."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a real number; got {_got(v)}")
    try:
        f = float(v)
    except OverflowError:  # an int beyond the double range
        f = math.inf if v > 0 else -math.inf
    bad = (finite and not math.isfinite(f)) or math.isnan(f)
    if not bad and min is not None:
        bad = f <= min if min_open else f < min
    if not bad and max is not None:
        bad = f >= max if max_open else f > max
    if bad:
        what = "a finite number" if finite else "a number"
        raise ValueError(f"{name}: expected {what}{_range_text(min, min_open, max, max_open)}; got {_short(v)}")
    return f


def check_f32(name, v, **limits) -> np.float32:
    """A finite real-number argument (``check_real`` with ``limits``) that stays finite in float32 (|v| <= 3.4e38):
    the value the kernels take, as np.float32."""
    f = check_real(name, v, **limits)
    if abs(f) > float(np.finfo(np.float32).max):
        raise ValueError(f"{name}: expected a number that is finite in float32 (|{name}| <= 3.4e38); got {v!r}")
    return np.float32(f)


def check_int(name, v, *, min=None, max=None) -> int:  # noqa: A002
    """``v`` as a Python int, after checking it is an integer (Python or NumPy; not a bool or a float: TypeError)
    with ``min <= v <= max`` where given (ValueError)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name}: expected an integer; got {_got(v)}")
    i = int(v)
    if (min is not None and i < min) or (max is not None and i > max):
        raise ValueError(f"{name}: expected an integer{_range_text(min, False, max, False)}; got {_short(v)}")
    return i


def check_size(name, v, *, min=1, max=2**31 - 1) -> int:  # noqa: A002
    """A size or count argument (layer widths, head counts, sequence lengths, vocabulary sizes): ``check_int``,
    with the message naming the one bound that was broken (``>= 1`` for 0 and negatives; ``<= 2147483647``, the
    int32 sizes the kernels index with, for a size typed wrong such as ``2**40``)."""
    i = check_int(name, v)
    if i < min:
        raise ValueError(f"{name}: expected an integer >= {min}; got {_short(v)}")
    if max is not None and i > max:
        raise ValueError(f"{name}: expected an integer <= {max} (sizes are indexed in int32); got {_short(v)}")
    return i


def check_window(window, causal=True):
    """``window`` of the attention ops (flash, attn_softmax, decode): None (no sliding window) or an integer W >= 1,
    at most 2**31 - 1 (a bool or a non-integer: TypeError; out of range: ValueError), which needs ``causal``: a
    query sees the W keys up to its own causal position (Hugging Face's ``sliding_window_overlay``). Returns None
    or W as an int."""
    if window is None:
        return None
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window: expected an integer >= 1 (the sliding window, in keys) or None; got {_got(window)}")
    window = check_size("window", window)
    if not causal:
        raise ValueError(f"window: a sliding window ({window}) counts keys back from each query's causal position, "
                         f"so it needs causal=True; got causal=False")
    return window


def check_bool(name, v) -> bool:
    """``v`` as a Python bool, after checking it is one (``True``/``False`` or a NumPy bool: a string such as
    "False" would otherwise read as true)."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False; got {_got(v)}")
    return bool(v)


def check_dtype_arg(name, dtype, allowed=FLOATS) -> np.dtype:
    """A dtype argument (``np.float32``, ``"float32"``, ``ck.bfloat16`` ...) as ``np.dtype``, one of ``allowed``."""
    names = " or ".join(str(d) for d in allowed)
    try:
        d = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected a dtype ({names}); got {_got(dtype)}") from None
    if dtype is None or d not in allowed:  # np.dtype(None) is float64
        raise TypeError(f"{name}: expected {names}; got {dtype if dtype is None else d}")
    return d


def check_choice(name, v, choices):
    """``v`` after checking it is one of ``choices`` (mode names; None may be one): ValueError naming them, also for
    a value of another type (``reduction=None``: a choice is a value from a list, as PyTorch reports it)."""
    kinds = tuple({type(c) for c in choices})
    if not isinstance(v, kinds) or (isinstance(v, (bool, np.bool_)) and bool not in kinds):
        raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}; got {_got(v)}")
    if v not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}; got {_short(v)}")
    return v


def check_callable(name, v, what="a callable"):
    if not callable(v):
        raise TypeError(f"{name}: expected {what}; got {_got(v)}")
    return v


def check_str(name, v):
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected a string; got {_got(v)}")
    return v


def check_finite_host(name, a):
    """A NumPy array's values all finite (ValueError naming the argument and the first bad value). CuPy arrays are
    not looked at: reading device values back is a host sync, which the ops never add (their kernels flag or
    propagate instead)."""
    if isinstance(a, np.ndarray) and a.size and (a.dtype.kind == "f" or a.dtype == bfloat16):
        f = a.astype(np.float32, copy=False)
        bad = ~np.isfinite(f)
        if bad.any():
            raise ValueError(f"{name}: expected finite values; got {f.reshape(-1)[np.argmax(bad.reshape(-1))]} at "
                             f"flat index {int(np.argmax(bad.reshape(-1)))}")
    return a


# ---------------------------------------------------------------- sizes: refused before anything is allocated
def _fmt_bytes(n) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"  # pragma: no cover


@functools.lru_cache(maxsize=1)
def host_memory_bytes() -> int:
    """Physical host memory in bytes (2**48 where the OS does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 48


@functools.lru_cache(maxsize=None)
def _device_memory(dev: int) -> int:
    import cupy

    with cupy.cuda.Device(dev):
        return int(cupy.cuda.runtime.memGetInfo()[1])


def device_memory_bytes() -> int:
    """Total memory of the current CUDA device in bytes (cudaMemGetInfo once per device, then cached: no stream
    sync, and no driver call at all after the first). Used by constructors (SparseRowGrad), not by the ops."""
    import cupy

    return _device_memory(cupy.cuda.Device().id)


def check_alloc(name, shape, dtype, xp=np, what="the array"):
    """Refuse (ValueError naming ``name``) an allocation of ``shape`` x ``dtype`` on ``xp`` that exceeds the memory
    of the host (NumPy) or of the current device (CuPy), before anything is allocated: a size typed wrong
    (``2**40``) is an error naming the argument, not a MemoryError (or an out-of-memory error) from inside."""
    dt = np.dtype(dtype)
    n = 1
    for s in shape:
        n *= int(s)
    nbytes = n * dt.itemsize
    cap = host_memory_bytes() if xp is np else device_memory_bytes()
    if nbytes > cap:
        where = "host memory" if xp is np else "memory of the GPU"
        raise ValueError(f"{name}: {what} of shape {tuple(int(s) for s in shape)} {dt} would take "
                         f"{_fmt_bytes(nbytes)}, more than the {_fmt_bytes(cap)} of {where}")
    return nbytes


# ---------------------------------------------------------------- token ids
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


class IdsOutOfRange(ValueError, IndexError):
    """Integer ids outside the range a table or a vocabulary allows (the NumPy path). A ValueError, as the error
    policy says; also an IndexError, which is what the embedding raised before."""


def _check_int_ids(name, a, noun="token ids"):
    check_array(name, a)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer {noun}; got dtype {a.dtype}"
                        + (" (float ids are not truncated: cast them yourself)" if a.dtype.kind == "f" else ""))


def check_token_ids(name, ids, vocab_size=None, *, low=0, high=None, what=None):
    """Integer ``ids`` (NumPy: every value checked on the host, in its own dtype, before any cast) within
    ``[low, high)`` -- ``high`` defaulting to ``vocab_size`` and then to the int32 range. TypeError for a
    non-integer dtype (floats are not truncated), ValueError naming the bound, e.g. ``ids: token ids must be <
    vocab_size=256; got max 4294967299``. CuPy arrays get the dtype check only (a range check would be a host
    sync; see :func:`token_ids_int32` for what the device path does instead)."""
    _check_int_ids(name, ids)
    if high is None:
        high = vocab_size if vocab_size is not None else INT32_MAX + 1
    what = what or ("vocab_size" if vocab_size is not None and high == vocab_size else None)
    if isinstance(ids, np.ndarray) and ids.size:
        lo, hi = int(ids.min()), int(ids.max())  # (Python ints: no wrap-around for uint64 / int64)
        if hi >= high:
            bound = f"{what}={high}" if what else f"{high}"
            raise IdsOutOfRange(f"{name}: token ids must be < {bound}; got max {hi}")
        if lo < low:
            raise IdsOutOfRange(f"{name}: token ids must be >= {low}; got min {lo}")
    return ids


def token_ids_int32(name, a, xp, *, vocab_size=None, low=0, high=None, sentinel=None, what=None):
    """Integer ids as the contiguous int32 array on ``xp`` the kernels take, never wrapped around.

    NumPy input: :func:`check_token_ids` on the original values first (a host check; int64 / uint64 ids >= 2**31
    are errors, not their low 32 bits). CuPy input of a dtype wider than int32 (int64, uint32, uint64): checking
    the values would need a device->host read, which a capturable path must not do, so values outside ``[low,
    high)`` are replaced on the device by ``sentinel`` (default ``high``: out of range for the consumer, whose
    kernel then clamps the id and sets its device error word, as for any other bad id) before the cast: an id of
    2**32 + 3 can no longer alias id 3. int32 / int16 / int8 / uint8 / uint16 CuPy input is cast as is (no
    value can wrap)."""
    _check_int_ids(name, a, "ids")
    if high is None:
        high = vocab_size if vocab_size is not None else INT32_MAX + 1
    if isinstance(a, np.ndarray):
        check_token_ids(name, a, vocab_size, low=low, high=high, what=what)
        a = np.ascontiguousarray(a.astype(np.int32, copy=False))
        return a if xp is np else xp.asarray(a)
    if _kind(a) is not xp:  # a CuPy array for a NumPy model: one host read, then checked there
        return token_ids_int32(name, a.get(), xp, vocab_size=vocab_size, low=low, high=high, what=what)
    if np.can_cast(a.dtype, np.int32):
        return xp.ascontiguousarray(a.astype(np.int32, copy=False))
    s = int(high if sentinel is None else sentinel)
    s = min(max(s, INT32_MIN), INT32_MAX)
    lo_ok = a >= low if a.dtype.kind == "i" or low > 0 else True
    ok = (a < high) & lo_ok
    return xp.ascontiguousarray(xp.where(ok, a, s).astype(np.int32))


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



# ---------------------------------------------------------------- interop: other libraries' arrays, zero copy
# DLPack device types (dlpack.h): where a __dlpack__ array lives.
_DL_CPU, _DL_CUDA, _DL_CUDA_MANAGED = 1, 2, 13

# Types that are never another library's array, so the decorator passes them straight through with one set
# lookup. NumPy and CuPy array types and other plain types seen in the slow path are added as they are met.
_PLAIN = {np.ndarray, float, int, bool, str, bytes, complex, type(None), dict, slice, type, np.float32,
          np.float64, np.float16, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
          np.uint64, np.bool_, type(bfloat16.type(0))}


def _is_torch(a) -> bool:
    return type(a).__module__.partition(".")[0] == "torch"


def _foreign_kind(a):
    """How a non-NumPy/CuPy argument is taken in: "dlpack-gpu" (``__dlpack__`` on a CUDA device),
    "dlpack-cpu" (``__dlpack__`` on the host), "cai" (``__cuda_array_interface__`` only), "dlpack-other" (a
    DLPack device we cannot use), or None (not an array: the op's own validation reports it)."""
    if hasattr(a, "__dlpack__") and hasattr(a, "__dlpack_device__"):
        try:
            dev = int(a.__dlpack_device__()[0])
        except Exception:
            dev = None
        if dev in (_DL_CUDA, _DL_CUDA_MANAGED):
            return "dlpack-gpu"
        if dev == _DL_CPU:
            return "dlpack-cpu"
    try:
        if hasattr(a, "__cuda_array_interface__"):
            return "cai"
    except Exception:  # some producers raise other errors from the property (a torch tensor requiring grad)
        return "cai"
    if hasattr(a, "__dlpack__"):
        return "dlpack-other"
    return None


def _learnable(t) -> bool:
    """Whether every instance of type ``t`` is a plain (non-array) value, so the fast path may skip it."""
    return (t not in (list, tuple) and not _tensor_like_type(t) and not hasattr(t, "__dlpack__")
            and not hasattr(t, "__cuda_array_interface__") and not hasattr(t, "__getattr__"))


def _torch_in(name, a, torch):
    """A torch tensor as something DLPack can carry (bf16 as an int16 view: CuPy / NumPy may not import
    DLPack's bfloat16 code), and whether it was bf16."""
    if a.requires_grad:
        raise TypeError(f"{name}: a torch.Tensor that requires grad; the ck ops do not record torch autograd: "
                        f"pass {name}.detach()")
    if a.dtype == torch.bfloat16:
        return a.view(torch.int16), True
    return a, False


class _Interop:
    """One call's conversions: the originals of converted arguments (so an ``out=`` given as a torch tensor is
    returned as itself) and the torch module when a torch tensor was among them."""

    __slots__ = ("op", "originals", "keep", "torch")

    def __init__(self, op):
        self.op, self.originals, self.keep, self.torch = op, {}, [], None

    def take(self, name, a):
        t = type(a)
        if t in _PLAIN:
            return a
        if t is list or t is tuple:
            items = [self.take(f"{name}[{i}]", e) for i, e in enumerate(a)]
            return a if all(x is y for x, y in zip(items, a)) else t(items)
        k = _kind(a)
        if k is not None:
            if t is np.ndarray or t is getattr(k, "ndarray", None):
                _PLAIN.add(t)  # cupy.ndarray: first met here (importing CuPy is not free)
            return a
        if is_autograd_tensor(a):
            raise TypeError(tensor_message(name, self.op))
        kind = _foreign_kind(a)
        if kind is None:
            if _learnable(t):
                _PLAIN.add(t)
            return a
        conv = self._convert(name, a, kind)
        self.originals[id(conv)] = a
        self.keep.append(conv)  # alive for the call: ids stay unique
        return conv

    def _convert(self, name, a, kind):
        torch = sys.modules.get("torch") if _is_torch(a) else None
        if torch is not None:
            self.torch = torch
        what = f"{name}: a {type(a).__module__}.{type(a).__name__}"
        if kind == "dlpack-other":
            raise TypeError(f"{what} on DLPack device {a.__dlpack_device__()}; expected a CUDA or a CPU array")
        if kind == "dlpack-cpu":
            # The NumPy reference path: a view of the same host memory, never a copy to the GPU.
            src, bf16 = _torch_in(name, a, torch) if torch is not None else (a, False)
            try:
                arr = np.from_dlpack(src)
            except (BufferError, TypeError, RuntimeError, ValueError) as e:
                raise TypeError(f"{what} (CPU, DLPack) could not be viewed as a NumPy array: {e}") from None
            return arr.view(bfloat16) if bf16 else arr
        cp = _cupy()
        if cp is None or not gpu_available():
            raise TypeError(f"{what} lives on a GPU but CuPy sees no CUDA device")
        if kind == "dlpack-gpu":
            # DLPack hands CuPy's current stream to the producer, which orders its pending work before it
            # (an event, no host sync). The result is a view: cupy.from_dlpack does not copy device memory.
            src, bf16 = _torch_in(name, a, torch) if torch is not None else (a, False)
            try:
                arr = cp.from_dlpack(src)
            except (BufferError, TypeError, RuntimeError, ValueError, NotImplementedError) as e:
                raise TypeError(f"{what} (CUDA, DLPack) could not be viewed as a CuPy array: {e}") from None
            return arr.view(bfloat16) if bf16 else arr
        # __cuda_array_interface__ only (e.g. Numba): cupy.asarray wraps the pointer without a copy. CuPy
        # synchronises the producer's stream when the interface names one (CUPY_CUDA_ARRAY_INTERFACE_SYNC=0
        # turns that off); DLPack is preferred above for that reason.
        return cp.asarray(a)

    def give_back(self, r):
        if r is None:
            return r
        t = type(r)
        if t is tuple or t is list:
            return t(self.give_back(e) for e in r)
        orig = self.originals.get(id(r))
        if orig is not None:
            return orig
        if self.torch is not None and _kind(r) is not None:
            return to_torch(r, self.torch)
        return r


def to_torch(a, torch=None):
    """A NumPy or CuPy array as a ``torch.Tensor`` over the same memory (DLPack on the GPU, ``from_numpy`` on the
    host; bfloat16 through an int16 view)."""
    torch = torch if torch is not None else sys.modules["torch"]
    bf16 = a.dtype == bfloat16
    if isinstance(a, np.ndarray):
        t = torch.from_numpy(a.view(np.int16) if bf16 else a)
    else:
        t = torch.from_dlpack(a.view(np.int16) if bf16 else a)
    return t.view(torch.bfloat16) if bf16 else t


def as_array(a, name="a"):
    """``a`` as the NumPy or CuPy array the ops see: itself for NumPy / CuPy, a zero-copy view of another
    library's array (see :func:`interop`)."""
    return _Interop(None).take(name, a)


def interop(fn):
    """Decorator of a public op: other libraries' arrays in, zero copy; torch tensors out when torch tensors came in.

    Each argument (lists and tuples looked into) that is not a NumPy / CuPy array or a plain value is taken in
    as follows, without copying memory:

    * ``__dlpack__`` on a CUDA device (PyTorch, JAX, ...): ``cupy.from_dlpack`` (stream-ordered, no host sync);
    * ``__cuda_array_interface__`` only (Numba): ``cupy.asarray``;
    * ``__dlpack__`` on the host (a CPU ``torch.Tensor``): ``numpy.from_dlpack``, and the NumPy reference path
      runs; a CPU array is never copied to the GPU (mixing it with GPU arrays stays a TypeError);
    * a cukernels autograd ``Tensor``: TypeError pointing to ``ck.functional.<op>``.

    torch bfloat16 tensors travel as int16 views. A torch tensor that requires grad is refused (TypeError: pass
    ``.detach()``). When a torch tensor was passed, array results come back as ``torch.Tensor`` over the same
    memory (``torch.from_dlpack``); an ``out=`` (or in-place) argument comes back as the very object passed.
    Otherwise results are CuPy (or NumPy) arrays. With only NumPy / CuPy arrays and plain values the cost is one
    set lookup per argument (0.3-0.6 us a call on the CPU; benchmarks/NOTES.md).

    Streams: the kernels run on CuPy's current stream; DLPack orders the producer's current stream before it
    (an event, when the two differ). Both libraries default to the legacy default stream, so plain eager use
    needs nothing. Inside a CUDA-graph capture that event crosses into the capture: make torch's current stream
    the capturing one (``torch.cuda.ExternalStream(cupy_stream.ptr)``), or take views once before capturing
    (:func:`as_array`) and pass those.
    """
    params = inspect.signature(fn).parameters.values()
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    op = fn.__name__
    plain = _PLAIN

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for a in args:
            if type(a) not in plain:
                break
        else:
            for a in kwargs.values():
                if type(a) not in plain:
                    break
            else:
                return fn(*args, **kwargs)
        st = _Interop(op)
        args = tuple(st.take(names[i] if i < len(names) else f"args[{i}]", a) for i, a in enumerate(args))
        kwargs = {k: st.take(k, v) for k, v in kwargs.items()}
        res = fn(*args, **kwargs)
        return st.give_back(res) if st.originals else res

    wrapper.__interop__ = True
    return wrapper
