"""Question: which memset nodes does cuBLAS put into a captured graph, and what does a replay of the step's GEMMs
cost with them as memset nodes or rewritten as kernel nodes (ck.settings.graph_memset_nodes)?

Answer (2026-12-01, one H200, ``python dev/graph_memsets.py``): 9 memset nodes for the 11 GEMMs, all 4-byte fills of 0
(elementSize 1, width 4). In this replay of GEMMs alone the kernel nodes were not faster (3.978 / 4.268 ms kept
against 4.233 / 4.447 rewritten, alternating rows); in the whole step they gave -0.11 ms at B4xT64 and nothing at
B8xT1024 (``python benchmarks/bench_train.py --configs b4t64 --steps 30 --ab "graph_memset_nodes=keep"``).
ck.settings.graph_memset_nodes = "kernel" stays the default (benchmarks/NOTES.md, "CUDA graphs").

    PYTHONPATH=. python dev/graph_memsets.py
"""
import collections
import ctypes
import time

import cupy as cp
import numpy as np

import cukernels as ck
from cukernels import _backend as B
from cukernels import graph

# LLaMA-3.2-1B at 8192 tokens: forward, dX and dW of the packed qkv, o, packed gate/up and down projections.
SHAPES = [(8192, 2048, 3072, False, False), (8192, 3072, 2048, False, True), (2048, 8192, 3072, True, False),
          (8192, 2048, 2048, False, False), (2048, 8192, 2048, True, False),
          (8192, 2048, 16384, False, False), (8192, 16384, 2048, False, True), (2048, 8192, 16384, True, False),
          (8192, 8192, 2048, False, False), (8192, 2048, 8192, False, True), (8192, 8192, 2048, True, False)]


def main():
    rng = np.random.default_rng(0)
    ops = []
    for m, k, n, ta, tb in SHAPES:
        a = cp.asarray(rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)).astype(ck.bfloat16)
        b = cp.asarray(rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)).astype(ck.bfloat16)
        ops.append((a, b, ta, tb, cp.empty((m, n), dtype=cp.float32 if ta else ck.bfloat16)))

    def fn():
        for a, b, ta, tb, c in ops:
            ck.matmul(a, b, trans_a=ta, trans_b=tb, out=c)

    fn()
    cp.cuda.Device().synchronize()
    lib = B.libcuda()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        fn()
    g = ctypes.c_void_p()
    assert lib.cuStreamEndCapture(ctypes.c_void_p(s.ptr), ctypes.byref(g)) == 0
    nodes = graph._node_list(lib.cuGraphGetNodes, False, g)
    kinds, sizes = collections.Counter(), collections.Counter()
    for node in nodes:
        t = ctypes.c_int()
        lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
        kinds[t.value] += 1
        if t.value == 2:
            p = graph._MemsetParams()
            lib.cuGraphMemsetNodeGetParams(ctypes.c_void_p(node), ctypes.byref(p))
            sizes[(p.elementSize, p.width, p.height, p.pitch, p.value, p.dst % 256)] += 1
    lib.cuGraphDestroy(g)
    print(f"{len(SHAPES)} GEMMs captured: node types {dict(kinds)} (0 kernel, 2 memset)")
    for (es, w, h, pitch, v, mis), c in sizes.most_common():
        print(f"  memset x{c}: elementSize {es}, width {w}, height {h}, pitch {pitch}, value {v}, dst % 256 = {mis}")
    for mode in ("keep", "kernel", "keep", "kernel"):
        ck.settings.graph_memset_nodes = mode
        step = ck.graph.CapturedStep(fn, warmup=1)
        step()
        step()
        step.synchronize()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(20):
                step()
            step.synchronize()
            times.append((time.perf_counter() - t0) / 20 * 1e3)
        print(f"graph_memset_nodes={mode:<6} rewritten {step.graph.memsets_converted:3d}: {min(times):.3f} ms a replay "
              f"of {len(SHAPES)} GEMMs (min of 3 x 20)")
    ck.settings.reset("graph_memset_nodes")


if __name__ == "__main__":
    main()
