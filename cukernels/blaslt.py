"""cuBLASLt on a handle of our own: the FP8 GEMMs behind ``ck.matmul`` (Hopper / Ada tensor cores, twice the bf16
rate), graph-capturable like ``blas.py``'s cuBLAS GEMMs.

Called through ctypes on the libcublasLt that CuPy's CUDA ships (libcublas links it, so the process has it loaded
once CuPy's cuBLAS is): one ``cublasLtHandle_t`` and one 32 MiB workspace per device. A plan -- the matmul
descriptor, the four matrix layouts and the algorithm cuBLASLt's heuristic picked -- is made once per (device,
shape, leading dimensions, batch strides, types, fast accumulation) on the host and kept; a call then only sets
the two scale pointers on its descriptor and enqueues ``cublasLtMatmul`` on CuPy's current stream, which it takes
as an argument (no ``SetStream``, nothing synchronising, no allocation): a CUDA graph captured around it replays
it with the scales it then finds in device memory.

Row-major ``D[M, N] = alpha * (a_scale * A[M, K]) (b_scale * B[N, K])^T + beta * D`` with both operands K-major
(the only FP8 layout Hopper's cuBLASLt runs: "TN") is the column-major product ``D^T = op(B') op(A')`` with
``B'`` = our B read as a K x N column-major matrix transposed (``transa = T``) and ``A'`` = our A as a K x M
column-major matrix (``transb = N``); so cuBLASLt's A is our ``b`` and its A scale our ``b_scale``. Enum values
are cublasLt.h's (CUDA 12.0 - 13.x; unchanged since FP8 arrived in 11.8): cudaDataType R_32F 0, R_16BF 14,
R_8F_E4M3 28, R_8F_E5M2 29; CUBLAS_COMPUTE_32F 68; cublasLtMatmulDescAttributes_t TRANSA 3, TRANSB 4,
A_SCALE_POINTER 17, B_SCALE_POINTER 18, FAST_ACCUM 25 (int8); layout BATCH_COUNT 5 (int32),
STRIDED_BATCH_OFFSET 6 (int64); preference MAX_WORKSPACE_BYTES 1 (uint64), MIN_ALIGNMENT_A/B/C/D_BYTES 5-8 (uint32:
the heuristic assumes 256-byte aligned buffers unless told; a plan is keyed on its pointers' alignment, 16 to 256
bytes, so a row slice of a buffer never gets an algorithm that needs more). ``cublasLtMatmulHeuristicResult_t``
is the 64-byte algorithm, a size_t workspace size, an int status, a float wave count and 4 reserved ints.
"""
from __future__ import annotations

import ctypes
import functools
import threading

from . import _backend as B

R_32F, R_16BF, R_8F_E4M3, R_8F_E5M2 = 0, 14, 28, 29
CUDA_TYPE = {B.float32: R_32F, B.bfloat16: R_16BF, B.float8_e4m3fn: R_8F_E4M3, B.float8_e5m2: R_8F_E5M2}
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB, _DESC_A_SCALE, _DESC_B_SCALE, _DESC_FAST_ACCUM = 3, 4, 17, 18, 25
_LAYOUT_BATCH_COUNT, _LAYOUT_BATCH_STRIDE = 5, 6
_PREF_MAX_WORKSPACE = 1
_PREF_MIN_ALIGN = (5, 6, 7, 8)  # MIN_ALIGNMENT_{A,B,C,D}_BYTES (uint32; default 256)
_OP_N, _OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20  # cuBLAS recommends >= 32 MiB on Hopper
MIN_CAPABILITY = 89  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) on


class BlasLtError(RuntimeError):
    """A cuBLASLt call failed (the status name is in the message), or the GPU has no FP8 tensor cores."""


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_library(stem, error):
    """``ctypes.CDLL`` of NVIDIA library ``stem`` ("cublas", "cublasLt"): the copy CuPy's own cuBLAS module loaded
    (found by cuda.pathfinder where it is installed), else libSTEM.so.13 / .so.12 / .so; ``error`` (an exception
    class) naming what was tried otherwise. blas.py loads libcublas through it too."""
    import cupy  # noqa: F401

    try:  # CuPy's cuBLAS module loads libcublas, which loads libcublasLt: bind the copies already in the process
        from cupy_backends.cuda.libs import cublas as _cb  # noqa: F401
    except Exception:
        pass
    names = []
    try:
        from cuda import pathfinder

        names.append(pathfinder.load_nvidia_dynamic_lib(stem).abs_path)
    except Exception:
        pass
    names += [f"lib{stem}.so.13", f"lib{stem}.so.12", f"lib{stem}.so"]
    for n in names:
        if not n:
            continue
        try:
            return ctypes.CDLL(n)
        except OSError:
            continue
    raise error(f"lib{stem} not found (tried {names})")


@functools.lru_cache(maxsize=1)
def _lib():
    lib = load_library("cublasLt", BlasLtError)
    vp, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), i, i]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i, vp, sz]
    lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i, u64, u64, i64]
    lib.cublasLtMatrixLayoutSetAttribute.argtypes = [vp, i, vp, sz]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i, vp, sz]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [vp]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i, ctypes.POINTER(_Heuristic),
                                                   ctypes.POINTER(i)]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
    lib.cublasLtGetStatusName.restype = ctypes.c_char_p
    lib.cublasLtGetStatusName.argtypes = [i]
    return lib


def _check(status, what):
    if status != 0:
        try:
            name = _lib().cublasLtGetStatusName(status).decode()
        except Exception:
            name = "?"
        raise BlasLtError(f"{what} failed with cuBLAS status {status} ({name})")


class _Handle:
    """One cuBLASLt handle + workspace per device."""

    def __init__(self):
        import cupy

        h = ctypes.c_void_p()
        _check(_lib().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        self.h = h
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)


class _Plan:
    """A matmul descriptor, its layouts and the heuristic's algorithm for one problem (kept for the process)."""

    __slots__ = ("desc", "la", "lb", "lc", "algo", "ws")

    def __init__(self, h, key):
        (m, n, k, lda, ldb, ldc, nbatch, sa, sb, sc, ta, tb, tc, fast, al_a, al_b, al_c) = key
        lib = _lib()
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, R_32F), "cublasLtMatmulDescCreate")
        for attr, val in ((_DESC_TRANSA, ctypes.c_int32(_OP_T)), (_DESC_TRANSB, ctypes.c_int32(_OP_N)),
                          (_DESC_FAST_ACCUM, ctypes.c_int8(1 if fast else 0))):
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(val), ctypes.sizeof(val)),
                   "cublasLtMatmulDescSetAttribute")
        # cuBLASLt's A: our b stored [N, K] row-major = K x N column-major (ld = ldb), transposed -> N x K;
        # its B: our a, K x M column-major (ld = lda); C = D: N x M column-major (ld = ldc).
        self.la = self._layout(tb, k, n, ldb, nbatch, sb)
        self.lb = self._layout(ta, k, m, lda, nbatch, sa)
        self.lc = self._layout(tc, n, m, ldc, nbatch, sc)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            wsb = ctypes.c_uint64(WORKSPACE_BYTES)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(wsb), 8),
                   "cublasLtMatmulPreferenceSetAttribute")
            # cuBLASLt's A is our b, its B our a; C and D are out
            for attr, al in zip(_PREF_MIN_ALIGN, (al_b, al_a, al_c, al_c)):
                v = ctypes.c_uint32(al)
                _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(v), 4),
                       "cublasLtMatmulPreferenceSetAttribute")
            self.algo = _Heuristic()
            found = ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(h, self.desc, self.la, self.lb, self.lc, self.lc, pref, 1,
                                                      ctypes.byref(self.algo), ctypes.byref(found)),
                   "cublasLtMatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if found.value < 1:
            raise BlasLtError(f"cuBLASLt has no FP8 algorithm for M={m} N={n} K={k} (lda {lda}, ldb {ldb}, ldc {ldc}, "
                              f"batch {nbatch}, types {ta}/{tb} -> {tc})")
        self.ws = int(self.algo.workspace_size)

    @staticmethod
    def _layout(t, rows, cols, ld, nbatch, stride):
        lib = _lib()
        lay = ctypes.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), t, rows, cols, ld), "cublasLtMatrixLayoutCreate")
        if nbatch > 1:
            c = ctypes.c_int32(nbatch)
            s = ctypes.c_int64(stride)
            _check(lib.cublasLtMatrixLayoutSetAttribute(lay, _LAYOUT_BATCH_COUNT, ctypes.byref(c), 4),
                   "cublasLtMatrixLayoutSetAttribute")
            _check(lib.cublasLtMatrixLayoutSetAttribute(lay, _LAYOUT_BATCH_STRIDE, ctypes.byref(s), 8),
                   "cublasLtMatrixLayoutSetAttribute")
        return lay


_handles: dict = {}
_plans: dict = {}
_lock = threading.Lock()


def _handle(dev):
    h = _handles.get(dev)
    if h is None:
        with _lock:
            h = _handles.get(dev) or _Handle()
            _handles[dev] = h
    return h


def _align(ptr) -> int:
    """The largest power of two dividing ``ptr``, at most 256 (the alignment cuBLASLt's heuristic is told)."""
    return min(256, ptr & -ptr) if ptr else 256


def check_device():
    """Raise BlasLtError when the current GPU has no FP8 tensor cores (compute capability below 8.9)."""
    cc = B.capability()
    if cc < MIN_CAPABILITY:
        raise BlasLtError(f"FP8 GEMMs need a GPU of compute capability {MIN_CAPABILITY // 10}.{MIN_CAPABILITY % 10} "
                          f"or newer (Ada, Hopper); this one is {cc // 10}.{cc % 10}: use bfloat16 operands")


def gemm_fp8(a, b, out, *, a_fmt, b_fmt, a_scale, b_scale, M, N, K, lda, ldb, ldc, sa, sb, sc, nbatch, alpha,
             beta, fast_accum):
    """Enqueue ``out = alpha * a_scale * b_scale * a @ b^T + beta * out`` (row-major; a [M, K], b [N, K] K-major FP8
    bits, strided batches; a batch stride 0 shares the operand) on the current stream. Arguments are validated
    by the caller (``blas.matmul``); scales are 0-d float32 device arrays or None (1)."""
    import cupy

    dev = cupy.cuda.Device().id
    h = _handle(dev)
    key = (M, N, K, lda, ldb, ldc, nbatch, sa, sb, sc, CUDA_TYPE[a_fmt], CUDA_TYPE[b_fmt], CUDA_TYPE[out.dtype],
           bool(fast_accum), _align(a.data.ptr), _align(b.data.ptr), _align(out.data.ptr))
    pk = (dev,) + key
    lib = _lib()
    with _lock:  # the descriptor's scale pointers are set per call: one thread at a time per plan
        plan = _plans.get(pk)
        if plan is None:
            plan = _plans[pk] = _Plan(h.h, key)
        # cuBLASLt's A is our b (see the module docstring): its A scale is b_scale.
        for attr, s in ((_DESC_A_SCALE, b_scale), (_DESC_B_SCALE, a_scale)):
            p = ctypes.c_void_p(s.data.ptr if s is not None else 0)
            _check(lib.cublasLtMatmulDescSetAttribute(plan.desc, attr, ctypes.byref(p), ctypes.sizeof(p)),
                   "cublasLtMatmulDescSetAttribute")
        al, be = ctypes.c_float(alpha), ctypes.c_float(beta)
        d = ctypes.c_void_p(out.data.ptr)
        _check(lib.cublasLtMatmul(h.h, plan.desc, ctypes.byref(al), ctypes.c_void_p(b.data.ptr), plan.la,
                                  ctypes.c_void_p(a.data.ptr), plan.lb, ctypes.byref(be), d, plan.lc, d, plan.lc,
                                  ctypes.byref(plan.algo), ctypes.c_void_p(h.workspace.data.ptr), WORKSPACE_BYTES,
                                  ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)), "cublasLtMatmul")
    return out


def plan_count() -> int:
    """How many GEMM plans (descriptor + layouts + algorithm) are cached, all devices together."""
    return len(_plans)
