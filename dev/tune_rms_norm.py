"""Question: which (threads-per-row, packs-per-thread) plan should rms_norm's launcher pick? Forces each plan and times
it, forward and backward; backward plans run twice: through the cp.async pipelined kernel (rms_bwd_pipe, the
launcher's choice on the 16-byte path for VPT <= 4) and through the register kernel (rms_bwd_reg, forced by
ck.settings.rms_norm_pipe = False), plan by plan. GPU only.

Answer (2026-11-29, one H200, ``python dev/tune_rms_norm.py``): two 16-byte packs a thread won almost everywhere
(f32 8192x2048 forward 33.5 us = 4.0 TB/s, backward 56.1 us = 3.6 TB/s; bf16 forward 18.8 us, backward 40.8 us);
1 pack lost (too little in flight), 8 packs lost in the backward (177 registers: one block an SM). The launcher aims
at 2 packs (benchmarks/NOTES.md, "rms_norm").

    PYTHONPATH=. python dev/tune_rms_norm.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # bench_ops, timeline
import cupy as cp
import numpy as np

import cukernels as ck
from bench_ops import _time_graph, copy_bandwidth
from cukernels.ops import rms_norm as R

bw = copy_bandwidth()
orig = R._plan
for dt, dn in ((np.float32, "f32"), (ck.bfloat16, "bf16")):
    for N, C in ((8192, 2048), (4096, 4096), (8192, 8192)):
        sz = np.dtype(dt).itemsize
        units = C // (16 // sz)
        k = 3
        xs = [cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt) for _ in range(k)]
        dys = [cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt) for _ in range(k)]
        w = cp.random.standard_normal(C, dtype=cp.float32).astype(dt)
        ys = [cp.empty_like(x) for x in xs]
        rs = [ck.rms_norm(x, w, 1e-5, return_rstd=True)[1] for x in xs]
        for direction, max_tpr, kern in (("fwd", 512, ""), ("bwd", 256, "pipe"), ("bwd", 256, "reg")):
            res = []
            ck.settings.rms_norm_pipe = kern != "reg"
            for vpt in (1, 2, 4, 8):
                tpr = units // vpt
                if tpr < 32 or tpr > max_tpr:
                    continue
                R._plan = lambda *a, tpr=tpr, vpt=vpt: ("reg", tpr, vpt, max(1, 256 // tpr))
                if direction == "fwd":
                    f = lambda i: ck.rms_norm(xs[i], w, 1e-5, out=ys[i])
                    nb = 2 * N * C * sz
                else:
                    f = lambda i: ck.rms_norm_backward(dys[i], xs[i], w, rs[i], out=ys[i])
                    nb = 3 * N * C * sz
                ms = _time_graph(f, k, 20, 10)
                res.append(f"tpr={tpr:4d} vpt={vpt}: {ms*1e3:7.1f} us {nb/ms/1e6:6.0f} GB/s ({100*nb/ms/1e6/bw:3.0f}%)")
            R._plan = orig
            ck.settings.reset("rms_norm_pipe")
            heur = orig(C, sz, True, 512 if direction == "fwd" else 256)
            print(f"{direction} {kern} {dn} {N}x{C} (heuristic tpr={heur[1]} vpt={heur[2]}):\n   " + "\n   ".join(res),
                  flush=True)
        del xs, dys, ys, rs
        cp.get_default_memory_pool().free_all_blocks()
