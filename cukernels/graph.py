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
"""
from __future__ import annotations

import ctypes

from . import _backend as B

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
    return _PriorityGraph(g, lib)


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
