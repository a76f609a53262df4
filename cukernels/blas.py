"""GEMMs on a cuBLAS handle of our own: graph-capturable, mixed precision, accumulate into fp32.

``ck.matmul(a, b, *, trans_a=False, trans_b=False, out=None, out_dtype=None, alpha=1.0, beta=0.0)``

Why not ``cupy.matmul``: CuPy 14's cuBLAS wrappers call ``setStream`` before every GEMM and that raises
while a stream is being captured, so a training step with GEMMs could not become one CUDA graph. Here the
cuBLAS entry points are called through ctypes on the same libcublas CuPy loaded, with our own handle per
device: its stream is set only when the current stream changes (outside capture, or to the capture stream at
its start), and right after it a fixed workspace (cublasSetStream resets the workspace to cuBLAS' own pool,
whose allocations capture cannot hold) — the contract cuBLAS documents for graph capture.

Mixed precision (cublasGemmEx): bf16 x bf16 -> fp32 output with fp32 accumulation and ``beta=1`` lets a weight
gradient accumulate straight into the fp32 gradient buffer (no bf16 output + cast + add); bf16 -> bf16 for
activations; fp32 -> fp32 (compute 32F, no TF32 unless ``allow_tf32``).

Row-major ``C[M, N] = op(A) @ op(B)`` is computed as the column-major product ``C^T = op(B)^T op(A)^T``, so
no transposes are materialised. Leading dimensions broadcast like ``numpy.matmul`` when they are equal, or
when one operand is 2-D (a weight shared by every batch entry: batch stride 0).
"""
from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from . import _backend as B

_CUDA_R = {np.dtype(np.float32): 0, np.dtype(np.float16): 2, B.bfloat16: 14}
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77
_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # cuBLAS recommends >= 32 MiB on Hopper


class BlasError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _lib():
    import cupy  # noqa: F401  (CuPy loads libcublas; we bind the same library)

    from cupy_backends.cuda.libs import cublas as _cb  # noqa: F401  forces the load

    names = []
    try:
        from cuda import pathfinder

        names.append(pathfinder.load_nvidia_dynamic_lib("cublas").abs_path)
    except Exception:
        pass
    names += ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    for n in names:
        if not n:
            continue
        try:
            lib = ctypes.CDLL(n)
            break
        except OSError:
            continue
    else:
        raise BlasError(f"libcublas not found (tried {names})")
    vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasSetMathMode.argtypes = [vp, i]
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll,
                                               i, i, i]
    return lib


def _check(status, what):
    if status != 0:
        raise BlasError(f"{what} failed with cuBLAS status {status}")


class _Handle:
    """One cuBLAS handle + workspace per device; remembers the stream it is bound to."""

    def __init__(self):
        import cupy

        lib = _lib()
        h = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.h = h
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        self.stream = None

    def bind(self):
        import cupy

        s = cupy.cuda.get_current_stream().ptr
        if s != self.stream:
            lib = _lib()
            _check(lib.cublasSetStream_v2(self.h, ctypes.c_void_p(s)), "cublasSetStream")
            _check(lib.cublasSetWorkspace_v2(self.h, ctypes.c_void_p(self.workspace.data.ptr), WORKSPACE_BYTES),
                   "cublasSetWorkspace")
            self.stream = s
        return self.h


_handles: dict[int, _Handle] = {}
_lock = threading.Lock()


def _handle():
    import cupy

    dev = cupy.cuda.Device().id
    h = _handles.get(dev)
    if h is None:
        with _lock:
            h = _handles.get(dev) or _Handle()
            _handles[dev] = h
    return h.bind()


@B.interop
def matmul(a, b, *, trans_a=False, trans_b=False, out=None, out_dtype=None, alpha=1.0, beta=0.0,
           allow_tf32=False):
    """``out = alpha * op(a) @ op(b) + beta * out`` with ``op(x) = x.T`` (last two axes) when asked.

    Args:
        a: ``(..., M, K)`` (``(..., K, M)`` with ``trans_a``), float32 or bfloat16, C-contiguous.
        b: ``(..., K, N)`` (``(..., N, K)`` with ``trans_b``), same dtype as ``a``; a 2-D ``b`` (or ``a``)
            is shared by every batch entry.
        out: optional ``(..., M, N)`` output; required when ``beta != 0`` (it is accumulated into).
        out_dtype: float32 or bfloat16 (default: ``out.dtype`` or ``a.dtype``); bf16 inputs with an fp32
            output accumulate and store in fp32.
        alpha, beta: finite host numbers (captured by value in a CUDA graph).
        allow_tf32: fp32 inputs use TF32 tensor cores (faster, ~1e-3 relative error).

    Returns:
        ``out``. On NumPy arrays: the same product computed in float32 (float64 when inputs are float64).

    Example::

        >>> dw = cp.zeros((out_f, in_f), cp.float32)
        >>> ck.matmul(dy_bf16, x_bf16, trans_a=True, out=dw, beta=1.0)   # dw += dy^T @ x, fp32 accumulate
    """
    xp = B.array_module(a=a, b=b, out=out)
    trans_a = B.check_bool("trans_a", trans_a)
    trans_b = B.check_bool("trans_b", trans_b)
    allow_tf32 = B.check_bool("allow_tf32", allow_tf32)
    alpha = B.check_real("alpha", alpha)
    beta = B.check_real("beta", beta)
    allowed = B.FLOATS + ((np.dtype(np.float64),) if xp is np else ())
    B.check_dtype("a", a, allowed)
    B.check_dtype("b", b, (a.dtype,))
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"a, b: expected at least 2 dimensions; got shapes {a.shape} and {b.shape}")
    B.check_contiguous("a", a)
    B.check_contiguous("b", b)
    M, K = (a.shape[-1], a.shape[-2]) if trans_a else a.shape[-2:]
    Kb, N = (b.shape[-1], b.shape[-2]) if trans_b else b.shape[-2:]
    if K != Kb:
        raise ValueError(f"b: inner dimensions disagree: op(a) is {M}x{K} but op(b) is {Kb}x{N}")
    ba, bb = a.shape[:-2], b.shape[:-2]
    if ba and bb and ba != bb:
        raise ValueError(f"b: batch dimensions {bb} do not match a's {ba} (equal, or one operand 2-D)")
    batch = ba or bb
    nbatch = int(np.prod(batch)) if batch else 1
    shape = (*batch, M, N)
    if out_dtype is not None:
        odt = B.check_dtype_arg("out_dtype", out_dtype, allowed)
    else:
        odt = out.dtype if out is not None else a.dtype
    if beta != 0 and out is None:
        raise ValueError("out: required when beta != 0 (the product is accumulated into it)")
    if xp is np:
        ct = np.float64 if a.dtype == np.float64 else np.float32
        opa = np.swapaxes(a, -1, -2) if trans_a else a
        opb = np.swapaxes(b, -1, -2) if trans_b else b
        r = alpha * np.matmul(opa.astype(ct), opb.astype(ct))
        if beta != 0:
            r = r + beta * out.astype(ct)
        if out is None:
            return r.astype(odt)
        B.check_out("out", out, shape, odt)
        out[...] = r.astype(odt)
        return out
    if odt not in _CUDA_R:
        raise TypeError(f"out_dtype: expected float32 or bfloat16; got {odt}")
    if a.dtype == np.float32 and odt != np.float32:
        raise TypeError(f"out_dtype: float32 inputs give a float32 output; got {odt}")
    out = B.empty(xp, shape, odt, out)
    if out.size == 0:
        return out
    if K == 0:
        if beta == 0:
            B.zero_(out)
        elif beta != 1:
            out *= beta
        return out
    lib = _lib()
    h = _handle()
    compute = _COMPUTE_32F_FAST_TF32 if (allow_tf32 and a.dtype == np.float32) else _COMPUTE_32F
    al, be = ctypes.c_float(alpha), ctypes.c_float(beta)
    ta, tb = int(bool(trans_a)), int(bool(trans_b))
    lda, ldb, ldc = a.shape[-1], b.shape[-1], N
    at, ot = _CUDA_R[a.dtype], _CUDA_R[odt]
    args_b = (ctypes.c_void_p(b.data.ptr), at, ldb)
    args_a = (ctypes.c_void_p(a.data.ptr), at, lda)
    if nbatch == 1:
        _check(lib.cublasGemmEx(h, tb, ta, N, M, K, ctypes.byref(al), *args_b, *args_a, ctypes.byref(be),
                                ctypes.c_void_p(out.data.ptr), ot, ldc, compute, _GEMM_DEFAULT), "cublasGemmEx")
    else:
        sa = M * K if ba else 0
        sb = K * N if bb else 0
        _check(lib.cublasGemmStridedBatchedEx(h, tb, ta, N, M, K, ctypes.byref(al), *args_b, sb, *args_a, sa,
                                              ctypes.byref(be), ctypes.c_void_p(out.data.ptr), ot, ldc, M * N,
                                              nbatch, compute, _GEMM_DEFAULT), "cublasGemmStridedBatchedEx")
    return out
