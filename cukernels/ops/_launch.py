"""Launch helpers shared by the kernel families: grid sizes, the 16-byte vector guard, row plans and row chunks.

Nothing here validates user input (the op modules do that); these turn validated shapes into launch
configurations, on the host, with no device work: the kernel attributes they read (register count, shared
memory) are cached per kernel object, so a captured step never queries them.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

from .. import _backend as B
from ..settings import settings

# Grid-stride kernels (run_flat / run_rows in common/pointwise.cuh): 256 threads a block, UNROLL units of work
# per thread in flight (EW_U in elementwise.cu, ACT_U in activations.cu).
THREADS = 256
UNROLL = 4
# Rows shorter than a block share one: threads per row x rows per block = ROW_BLOCK (the row kernels' blockDim).
ROW_BLOCK = 256

_waves: dict = {}
_smem_limit: dict = {}


def with_smem(kernel, smem: int):
    """``kernel`` with its dynamic shared memory limit raised to at least ``smem`` bytes: a host-side attribute,
    set once per kernel object (and again only for a larger size), before any capture. CUDA refuses a launch
    with more than 48 KB of dynamic shared memory without it."""
    key = id(kernel)
    if _smem_limit.get(key, -1) < smem:
        kernel.max_dynamic_shared_size_bytes = int(smem)
        _smem_limit[key] = int(smem)
    return kernel


def wave(kernel, threads: int, smem: int = 0) -> int:
    """Blocks of ``threads`` threads that fit on the device at once (SMs x resident blocks per SM, from the
    kernel's register and shared-memory use), cached per kernel object: kernels are per device, so is this."""
    key = (id(kernel), threads, smem)
    hit = _waves.get(key)
    if hit is not None and hit[0] is kernel:
        return hit[1]
    n = B.sm_count() * B.blocks_per_sm(kernel, threads, smem)
    _waves[key] = (kernel, n)  # holding the kernel keeps its id from being reused by another object
    return n


def launch_grid(kernel, work_items: int, threads: int = THREADS) -> int:
    """Blocks for a grid-stride kernel: enough for ``work_items`` thread-iterations, at most one wave."""
    return int(max(1, min(-(-work_items // threads), wave(kernel, threads))))


# run_rows kernels index units with 32-bit unsigned math: one launch covers fewer than 2^31 units (a grid-stride
# step is then always < 2^32 - n); bigger row-structured launches are split into row chunks.
MAX_ROW_UNITS = 2**31 - 1


def row_chunks(rows: int, units_per_row: int, what: str):
    """(first row, row count) pieces of a run_rows launch, each under MAX_ROW_UNITS units."""
    if units_per_row > MAX_ROW_UNITS:
        raise ValueError(f"{what}: a row of {units_per_row} units is too long for the row kernels (max {MAX_ROW_UNITS})")
    step = max(1, MAX_ROW_UNITS // max(1, units_per_row))
    return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)]


def ptr(a, elem_offset=0):
    """Raw device pointer ``elem_offset`` elements into ``a`` (a kernel argument)."""
    return np.uint64(a.data.ptr + elem_offset * a.itemsize)


def vec_ok(*arrays) -> bool:
    """The 16-byte guard on pointers (sizes are each op's business)."""
    return B.aligned16(*arrays)


def row_plan(C: int, itemsize: int, vec: bool, *, max_tpr: int, target_vpt: int, max_vpt: int, min_tpr: int = 1,
             max_elems=None):
    """Launch shape of a one-row-per-thread-group kernel (rms_norm, layer_norm, softmax): ``(threads per row,
    16-byte packs per thread, rows per block)``, or None when the row is too long for the register kernels (the
    family's loop kernel takes it).

    A row is ``C // E`` units (E elements per 16-byte pack when ``vec``, else single elements). Threads per
    row start at ``min_tpr`` and double, up to ``max_tpr``, while a thread would hold more than ``target_vpt``
    units; packs per thread are then the power of two that covers the row. The family's register budget
    bounds the result: at most ``max_vpt`` packs a thread, and, when given, at most ``max_elems(tpr)``
    elements a thread (softmax's fp32 row cache). Rows of fewer than ROW_BLOCK threads share a block.
    """
    E = 16 // itemsize if vec else 1
    units = C // E
    tpr = min_tpr
    while tpr < max_tpr and units > tpr * target_vpt:
        tpr *= 2
    vpt = 1
    while tpr * vpt < units:
        vpt *= 2
    if vpt > max_vpt or (max_elems is not None and vpt * E > max_elems(tpr)):
        return None
    return tpr, vpt, max(1, ROW_BLOCK // tpr)


# Programmatic dependent launch (kernels_cu/common/pdl.cuh): Hopper lets a kernel start while the one before it
# in the stream still runs, its pre-pdl_wait() part (a decode GEMV's first weight loads) overlapping the
# other's tail. CuPy's launch takes no launch attributes, so a PDL launch goes through the driver's
# cuLaunchKernelEx. Only kernels that call pdl_wait() before touching shared state may be launched so (the
# launchers that pass pdl=True), and only inside pdl_scope(): a kernel's pre-wait loads read weights, which
# the code that opens the scope (the fused decode step) promises no kernel of the step writes -- an eager
# ck.gemv right after an optimizer step updated its weight must not read them early. ck.settings.pdl = False
# turns it off everywhere (an A/B switch for the benchmarks).
# Shared-memory carveout (percent of the unified L1 / shared storage) of every kernel launched with pdl=True,
# ck.settings.pdl_carveout.
# An SM runs blocks of one carveout at a time: when consecutive kernels want different carveouts (the decode
# GEMV's cp.async ring asks ~210 KB a SM, the small kernels between them the default split), the SM drains
# before the next kernel's blocks may land, which is the very overlap PDL is there for. 100 = the most shared
# memory for all of them (their global loads bypass L1 anyway); -1 = the driver's default per kernel. Measured
# (session 6, H200, LLaMA-1B B1 step with the ring GEMV): 1.285 ms at 100 against 1.338 at the default, with
# the GEMV grid capped at 2 blocks a SM (same process); with a full wave 1.161 ms at 100 (run C) and 1.175 at
# the default (run B, another process).
_carveout: dict = {}
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_pdl_state: list = []


def _pdl_api():
    """(cuLaunchKernelEx, config type, attribute type), or None where the driver lacks it."""
    if not _pdl_state:
        import ctypes

        lib = B.libcuda()
        fn = getattr(lib, "cuLaunchKernelEx", None) if lib is not None else None
        if fn is None:
            _pdl_state.append(None)
        else:
            class Attr(ctypes.Structure):  # CUlaunchAttribute: id, 4 pad bytes, a 64-byte value union
                _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                            ("rest", ctypes.c_char * 60)]

            class Config(ctypes.Structure):  # CUlaunchConfig
                _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                            ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attr)),
                            ("num_attrs", ctypes.c_uint)]

            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            _pdl_state.append((fn, Config, Attr))
    return _pdl_state[0]


_scope = threading.local()


@contextlib.contextmanager
def pdl_scope():
    """Within this block, launch(..., pdl=True) uses programmatic dependent launch (where pdl_enabled()). The
    caller vouches that the kernels' pre-wait reads (weights, tables) are not written by the kernels launched
    in the block."""
    prev = getattr(_scope, "on", False)
    _scope.on = True
    try:
        yield
    finally:
        _scope.on = prev


def pdl_enabled() -> bool:
    """Whether launch(..., pdl=True) takes the PDL path on the current device (sm_90+, a driver with
    cuLaunchKernelEx, and ck.settings.pdl on)."""
    return settings.pdl and B.capability() >= 90 and _pdl_api() is not None


def _dims(d):
    d = tuple(int(v) for v in (d if isinstance(d, tuple) else (d,)))
    return d + (1,) * (3 - len(d))


def launch(kernel, grid, block, args, shared_mem: int = 0, *, pdl: bool = False):
    """``kernel(grid, block, args, shared_mem=...)`` on the current stream; with ``pdl`` (inside pdl_scope(),
    where pdl_enabled()) the
    programmatic-serialization attribute is set, so the kernel may start before the previous one ends (it must
    call pdl_wait(): kernels_cu/common/pdl.cuh). Arguments are NumPy scalars (the launchers' convention)."""
    if pdl and _carveout.get(id(kernel), (None, None))[1] != settings.pdl_carveout:
        carveout = settings.pdl_carveout
        kernel.preferred_shared_memory_carveout = carveout  # host-side attribute, allowed in a capture
        _carveout[id(kernel)] = (kernel, carveout)  # holding the kernel keeps its id from being reused
    if not (pdl and getattr(_scope, "on", False) and pdl_enabled()):
        kernel(grid, block, args, shared_mem=shared_mem)
        return
    import ctypes

    import cupy

    fn, Config, Attr = _pdl_api()
    vals = [np.asarray(a) for a in args]
    for a, v in zip(args, vals):
        if v.ndim != 0 or v.dtype.kind not in "iufb":
            raise TypeError(f"launch: kernel arguments must be NumPy scalars; got {type(a).__name__}")
    params = (ctypes.c_void_p * max(1, len(vals)))(*[v.ctypes.data for v in vals])
    attr = Attr(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = Config((ctypes.c_uint * 3)(*_dims(grid)), (ctypes.c_uint * 3)(*_dims(block)), int(shared_mem),
                 ctypes.c_void_p(cupy.cuda.get_current_stream().ptr), ctypes.pointer(attr), 1)
    # CuPy's RawKernel holds the CUfunction in .kernel (a cupy.cuda.function.Function with .ptr)
    handle = getattr(kernel, "kernel", kernel).ptr
    r = fn(ctypes.byref(cfg), ctypes.c_void_p(handle), params, None)
    if r != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {r}) for a {_dims(grid)} x {_dims(block)} launch")


def pipe_stages(target: int, stage_bytes: int, blocks_per_sm: int) -> int:
    """cp.async stages a block for the pipelined norm backwards (kernels_cu/common/pipe.cuh): 2..4, at most
    ``target``, such that ``blocks_per_sm`` blocks of ``stage_bytes`` a stage still fit an SM's shared memory
    (8 KB left for the static arrays)."""
    cap = (B.smem_optin() // blocks_per_sm - 8192) // max(1, stage_bytes)
    return int(max(2, min(target, 4, cap)))
