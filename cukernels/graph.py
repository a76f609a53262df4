"""Replay a whole training step from one captured CUDA graph.

A LLaMA-1B step issues thousands of kernels; from Python each launch costs ~9 µs of host time, far more
than many of the kernels take on the GPU, so at small batch the step is launch-bound. Capturing the step
once and replaying it costs ~1 µs per kernel.

``CapturedStep(fn)`` runs ``fn()`` eagerly ``warmup`` times (compiles kernels, creates the cuBLAS handle,
fills the memory pool), then captures one call into a CUDA graph and from then on every call replays it.
Everything ``fn`` allocates comes from a private CuPy memory pool that nothing else uses, and every array it
returns is kept alive, so the addresses recorded in the graph stay valid: temporaries freed during the
capture are handed out again *within* the capture, in stream order, exactly as on every replay.

What ``fn`` must respect (the graph-capturable contract of every cukernels op, DESIGN.md):
- read its inputs from fixed device buffers (copy each new batch into them before calling);
- never read to the host (``float(x)``, ``.item()``, ``.get()``) and never copy host data to the device;
- keep values that change every step on the device (the optimizer's step and learning rate are device
  scalars updated by a kernel inside the step, so a replay advances them);
- GEMMs through ``ck.matmul`` (our own cuBLAS handle; ``cupy.matmul`` refuses capture).

Before instantiation the captured graph's small memset nodes (cuBLAS' workspace memsets: 168 in a LLaMA-1B step)
become kernel nodes writing the same bytes (``ck.settings.graph_memset_nodes``, ``kernels_cu/graph_fill.cu``): the
gaps around them shrink to kernel-to-kernel size (B4xT64: -0.11 ms a step on one H200, `python
benchmarks/bench_train.py --configs b4t64 --steps 30 --ab "graph_memset_nodes=keep"`).
"""
from __future__ import annotations

import ctypes

from . import _backend as B
from .settings import settings

# CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY: a kernel node keeps the priority of the stream it was captured
# from. Without it every node runs at the priority of the stream the graph is launched into, and the NCCL
# kernels that ZeroAdamW queues on its high-priority side stream wait, inside the graph, behind every block of
# the GEMM running beside them: on 2 x H200 the overlapped reduce-scatter then cost as much as not overlapping
# it (session 4: 2-GPU B8xT1024 135.7 ms vs 126.0 on one GPU). CuPy instantiates with no flags, so the graph is
# instantiated here through the driver API (libcuda, always present where a GPU is).
_USE_NODE_PRIORITY = 8


class _PriorityGraph:
    """A captured graph instantiated through the driver with per-node priorities; ``launch`` / ``upload`` as
    CuPy's ``Graph``. Owns the executable graph only (the ``CUgraph`` is destroyed once instantiated)."""

    def __init__(self, graph, lib):
        self._lib, self._exec = lib, ctypes.c_void_p()
        try:
            r = lib.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), graph,
                                                ctypes.c_ulonglong(_USE_NODE_PRIORITY))
            if r != 0:  # (a driver without the flag: the plain instantiation, launch-stream priority)
                r = lib.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), graph, ctypes.c_ulonglong(0))
            if r != 0:
                raise RuntimeError(f"cuGraphInstantiateWithFlags failed (CUresult {r})")
        finally:
            lib.cuGraphDestroy(graph)

    def _call(self, fn, stream):
        r = fn(self._exec, ctypes.c_void_p(stream.ptr))
        if r != 0:
            raise RuntimeError(f"{fn.__name__} failed (CUresult {r})")

    def launch(self, stream):
        self._call(self._lib.cuGraphLaunch, stream)

    def upload(self, stream):
        self._call(self._lib.cuGraphUpload, stream)

    def __del__(self):
        if getattr(self, "_exec", None) and self._exec.value:
            self._lib.cuGraphExecDestroy(self._exec)


# Small memset nodes become kernel nodes before instantiation (kernels_cu/graph_fill.cu says why, with the
# numbers): ck.settings.graph_memset_nodes "kernel" (default) or "keep" (the captured graph as it is, for A/B rows and
# for a driver where the rewrite fails). Only fills of at most MEMSET_KERNEL_MAX_BYTES are rewritten; larger ones stay
# memset nodes.
MEMSET_KERNEL_MAX_BYTES = 1 << 20
_NODE_TYPE_MEMSET = 2  # CU_GRAPH_NODE_TYPE_MEMSET


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS (_v2: + kern, ctx, both NULL here)
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def fill_plan(dst, pitch, value, elsize, width, height):
    """A memset node's fill as ``graph_fill`` arguments ``(pitch, value, elsize, width, height)``: 1- and 2-byte
    fills whose address, pitch (when there are several rows) and row length are 4-byte aligned become 4-byte
    fills of the replicated value (same bytes, a quarter / half of the stores)."""
    if elsize not in (1, 2, 4):
        raise ValueError(f"elsize: expected 1, 2 or 4; got {elsize!r}")
    value &= (1 << (8 * elsize)) - 1
    row = width * elsize
    if elsize < 4 and dst % 4 == 0 and row % 4 == 0 and (height == 1 or pitch % 4 == 0):
        value *= 0x01010101 if elsize == 1 else 0x00010001
        width, elsize = row // 4, 4
    return pitch, value, elsize, width, height


def fill_reference(buf, offset, pitch, value, elsize, width, height):
    """NumPy reference of a memset node on the bytes ``buf`` (uint8): what ``graph_fill`` must leave."""
    import numpy as np

    pattern = np.frombuffer(int(value & ((1 << (8 * elsize)) - 1)).to_bytes(elsize, "little"), np.uint8)
    out = buf.copy()
    for r in range(height):
        a = offset + r * pitch
        out[a:a + width * elsize] = np.tile(pattern, width)
    return out


def _driver_fn(lib, *names):
    for n in names:
        f = getattr(lib, n, None)
        if f is not None:
            return n, f
    raise AttributeError(f"libcuda has none of {names}")


def _node_list(fn, v2, *head):
    """Call a cuGraph* getter that fills (nodes, count), twice: size, then contents."""
    n = ctypes.c_size_t(0)
    args = (*head, None, None, ctypes.byref(n)) if v2 else (*head, None, ctypes.byref(n))
    r = fn(*args)
    if r != 0:
        return None
    if n.value == 0:  # (a second call with an array and a count of 0 is refused)
        return []
    arr = (ctypes.c_void_p * n.value)()
    args = (*head, arr, None, ctypes.byref(n)) if v2 else (*head, arr, ctypes.byref(n))
    r = fn(*args)
    return None if r != 0 else list(arr[:n.value])


def memsets_to_kernels(graph, lib) -> int:
    """Rewrite each memset node of the (not yet instantiated) ``graph`` that fills at most
    MEMSET_KERNEL_MAX_BYTES as a ``graph_fill`` kernel node with the same dependencies and dependents; returns
    how many were rewritten. A node whose edges carry data (a programmatic edge) or any driver call that fails
    leaves that node as it was: the graph stays correct either way."""
    from ._loader import get_function

    _, get_nodes = _driver_fn(lib, "cuGraphGetNodes")
    dn, get_deps = _driver_fn(lib, "cuGraphNodeGetDependencies_v2", "cuGraphNodeGetDependencies")
    on, get_outs = _driver_fn(lib, "cuGraphNodeGetDependentNodes_v2", "cuGraphNodeGetDependentNodes")
    an, add_deps = _driver_fn(lib, "cuGraphAddDependencies_v2", "cuGraphAddDependencies")
    _, add_kernel = _driver_fn(lib, "cuGraphAddKernelNode_v2")
    nodes = _node_list(get_nodes, False, graph)
    if not nodes:
        return 0
    func = get_function("graph_fill", "graph_fill")
    sms = B.sm_count()
    done = 0
    for node in nodes:
        t = ctypes.c_int(-1)
        if lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)) != 0 or t.value != _NODE_TYPE_MEMSET:
            continue
        p = _MemsetParams()
        if lib.cuGraphMemsetNodeGetParams(ctypes.c_void_p(node), ctypes.byref(p)) != 0:
            continue
        if p.elementSize not in (1, 2, 4) or p.width * p.elementSize * p.height > MEMSET_KERNEL_MAX_BYTES:
            continue
        deps = _node_list(get_deps, dn.endswith("_v2"), ctypes.c_void_p(node))
        outs = _node_list(get_outs, on.endswith("_v2"), ctypes.c_void_p(node))
        if deps is None or outs is None:  # e.g. CUDA_ERROR_LOSSY_QUERY: an edge with data
            continue
        pitch, value, elsize, width, height = fill_plan(p.dst, p.pitch, p.value, p.elementSize, p.width, p.height)
        n = width * height
        if n == 0:
            continue
        args = [ctypes.c_uint64(p.dst), ctypes.c_uint64(pitch), ctypes.c_uint(value), ctypes.c_uint(elsize),
                ctypes.c_uint64(width), ctypes.c_uint64(height)]
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        kp = _KernelParams(func=ctypes.c_void_p(func.kernel.ptr),  # RawKernel .kernel: the CUfunction
                           gridDimX=int(min(-(-n // 256), 4 * sms)), gridDimY=1,
                           gridDimZ=1, blockDimX=256, blockDimY=1, blockDimZ=1, sharedMemBytes=0,
                           kernelParams=ctypes.cast(ptrs, ctypes.c_void_p))
        dep_arr = (ctypes.c_void_p * max(1, len(deps)))(*deps)
        new = ctypes.c_void_p()
        if add_kernel(ctypes.byref(new), graph, dep_arr if deps else None, ctypes.c_size_t(len(deps)),
                      ctypes.byref(kp)) != 0:
            continue
        if outs:
            src = (ctypes.c_void_p * len(outs))(*([new.value] * len(outs)))
            dst = (ctypes.c_void_p * len(outs))(*outs)
            r = (add_deps(graph, src, dst, None, ctypes.c_size_t(len(outs))) if an.endswith("_v2")
                 else add_deps(graph, src, dst, ctypes.c_size_t(len(outs))))
            if r != 0:
                lib.cuGraphDestroyNode(new)
                continue
        # The memset goes last: had this failed, both fills would run, and the dependents wait for both.
        lib.cuGraphDestroyNode(ctypes.c_void_p(node))
        done += 1
    return done


def end_capture(stream):
    """End ``stream``'s capture; the graph instantiated with per-node stream priorities (driver API), or CuPy's
    own ``Graph`` where libcuda cannot be loaded (then every node runs at the launch stream's priority: correct,
    less overlap). CuPy's ``end_capture`` instantiates at once with no flags, so the driver ends the capture."""
    lib = B.libcuda()
    if lib is None:
        return stream.end_capture()
    g = ctypes.c_void_p()
    r = lib.cuStreamEndCapture(ctypes.c_void_p(stream.ptr), ctypes.byref(g))
    if r != 0:
        raise RuntimeError(f"cuStreamEndCapture failed (CUresult {r})")
    converted = 0
    mode = settings.graph_memset_nodes  # "kernel" or "keep" (checked by the settings)
    if mode == "kernel":
        try:
            converted = memsets_to_kernels(g, lib)
        except Exception as e:  # an optimisation only: whatever was rewritten is complete, the rest as captured
            import warnings

            warnings.warn(f"cukernels.graph: memset nodes left as captured ({type(e).__name__}: {e}); set "
                          f"ck.settings.graph_memset_nodes = 'keep' to silence this", RuntimeWarning, stacklevel=2)
    out = _PriorityGraph(g, lib)
    out.memsets_converted = converted
    return out


class CapturedStep:
    """Capture ``fn`` (no arguments) into a CUDA graph after ``warmup`` eager calls; then replay it.

    Calling the object returns what ``fn`` returned at capture time (device arrays whose contents each
    replay refreshes). ``graph=False`` keeps calling ``fn`` eagerly (same stream, same pool) so the two
    modes can be compared.
    """

    def __init__(self, fn, *, warmup: int = 2, graph: bool = True):
        import cupy as cp

        self.fn = fn
        self.warmup = warmup
        self.use_graph = graph
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.pool = cp.cuda.MemoryPool()
        self.calls = 0
        self.graph = None
        self.out = None

    def _ctx(self):
        import contextlib

        import cupy as cp

        st = contextlib.ExitStack()
        st.enter_context(self.stream)
        st.enter_context(cp.cuda.using_allocator(self.pool.malloc))
        return st

    def __call__(self):
        import cupy as cp

        caller = cp.cuda.get_current_stream()
        # The step's stream waits for what the caller queued (the batch copied into the input buffers), and
        # the caller's stream waits for the step (its outputs): events, no host synchronisation.
        self.stream.wait_event(caller.record())
        if self.graph is not None:
            self.graph.launch(self.stream)
        else:
            with self._ctx():
                if not self.use_graph or self.calls < self.warmup:
                    self.calls += 1
                    self.out = self.fn()
                else:
                    self.stream.synchronize()
                    self.stream.begin_capture()
                    try:
                        out = self.fn()
                    except BaseException:
                        try:
                            end_capture(self.stream)
                        except Exception:
                            pass
                        raise
                    self.graph = end_capture(self.stream)
                    self.graph.upload(self.stream)
                    self.out = out
                    self.calls += 1
                    self.graph.launch(self.stream)  # the captured call itself did not run: run it now
        caller.wait_event(self.stream.record())
        return self.out

    def synchronize(self):
        self.stream.synchronize()
