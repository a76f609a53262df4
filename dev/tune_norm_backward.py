"""Question: which pipeline depth and block size should the pipelined rms_norm / layer_norm backwards use at
8192 x 2048, and how much of a call is fixed cost? Knobs first, then a row sweep of the defaults that splits each call
into a fixed cost and a streaming rate (t = a + bytes / bw, least squares); ``--timeline`` prints the CUPTI kernel and
gap timeline of back-to-back calls instead. GPU only.

Answer (2026-11-30, one H200, ``python dev/tune_norm_backward.py``): rms bf16 2 stages (3: +8 %), fp32 3 stages;
layer_norm 2 stages and 256-thread blocks (512: +6 to +20 %). The sweep over 1024..65536 rows of 2048: rms bf16
fixed 10.2 us + 3.82 TB/s (90 % of copy), fp32 7.5 us + 3.87; layer_norm bf16 11.7 us + 3.24 TB/s (77 %), fp32
9.7 us + 3.90. The kernels stream near copy speed once running; at 8192 rows the ~10 us fixed cost is what keeps
them at 56-67 % (benchmarks/NOTES.md, "rms_norm and layer_norm backward").

    PYTHONPATH=. python dev/tune_norm_backward.py [--quick] [--timeline]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # bench_ops, timeline
import cupy as cp
import numpy as np

import cukernels as ck
from bench_ops import _time_graph, copy_bandwidth

ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true")
ap.add_argument("--timeline", action="store_true", help="only the CUPTI kernel/gap timeline")
args = ap.parse_args()
bw = copy_bandwidth()
print(f"copy bandwidth {bw:.0f} GB/s", flush=True)


def inputs(N, C, dt, k):
    xs = [cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt) for _ in range(k)]
    dys = [cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt) for _ in range(k)]
    w = cp.random.standard_normal(C, dtype=cp.float32)
    b = cp.random.standard_normal(C, dtype=cp.float32)
    outs = [cp.empty_like(x) for x in xs]
    rs = [ck.rms_norm(x, w, 1e-5, return_rstd=True)[1] for x in xs]
    st = [ck.layer_norm(x, w, b, return_stats=True)[1:] for x in xs]
    return xs, dys, w, outs, rs, st


def time_pair(N, C, dt):
    """(rms us, ln us, bytes) for the current module settings."""
    sz = np.dtype(dt).itemsize
    nb = 3 * N * C * sz
    k = max(2, min(6, -(-3 * 60e6 // nb)))
    xs, dys, w, outs, rs, st = inputs(N, C, dt, int(k))
    t_r = _time_graph(lambda i: ck.rms_norm_backward(dys[i], xs[i], w, rs[i], out=outs[i]), int(k), 20, 10)
    t_l = _time_graph(lambda i: ck.layer_norm_backward(dys[i], xs[i], w, st[i][0], st[i][1], out=outs[i]),
                      int(k), 20, 10)
    del xs, dys, outs, rs, st
    cp.get_default_memory_pool().free_all_blocks()
    return t_r * 1e3, t_l * 1e3, nb


def pct(nb, us):
    return f"{nb / us / 1e3:6.0f} GB/s {100 * nb / us / 1e3 / bw:3.0f}%"


KNOBS = dict(rs=("rms_norm_pipe_stages_bf16", "rms_norm_pipe_stages_f32"), rt=("rms_norm_pipe_threads",),
             ls=("layer_norm_pipe_stages",), lt=("layer_norm_pipe_threads",))  # short name -> ck.settings
defaults = {n: getattr(ck.settings, n) for names in KNOBS.values() for n in names}


def apply(**kw):
    """ck.settings knobs by short name (rs, rt, ls, lt); the rest at their defaults."""
    ck.settings.reset(*defaults)
    for k, v in kw.items():
        for n in KNOBS[k]:
            setattr(ck.settings, n, v)


# Each row times one rms and one layer_norm variant; the first is the default.
settings = [dict(), dict(rs=3, ls=3), dict(rs=2, ls=4), dict(rt=256, lt=512), dict(rs=4, ls=3)]
if args.quick:
    settings = settings[:3]
if args.timeline:
    settings = []
for dt, dn in ((ck.bfloat16, "bf16"), (np.float32, "f32")):
    if settings:
        print(f"\n{dn} 8192x2048: rms | layer_norm (knobs apart from the defaults {defaults})", flush=True)
    for kw in settings:
        apply(**kw)
        tr, tl, nb = time_pair(8192, 2048, dt)
        print(f"  {str(kw):40s} rms {tr:6.1f} us {pct(nb, tr)} | ln {tl:6.1f} us {pct(nb, tl)}", flush=True)
apply()

print(f"\nrow sweep at C = 2048, defaults {defaults}: fixed cost + streaming rate", flush=True)
for dt, dn in ((ck.bfloat16, "bf16"), (np.float32, "f32")):
    rows = (1024, 4096, 8192, 32768, 65536) if not args.quick else (2048, 8192, 32768)
    if args.timeline:
        break
    pts = []
    for N in rows:
        tr, tl, nb = time_pair(N, 2048, dt)
        pts.append((nb, tr, tl))
        print(f"  {dn} {N:6d}x2048: rms {tr:7.1f} us {pct(nb, tr)} | ln {tl:7.1f} us {pct(nb, tl)}", flush=True)
    A = np.array([[1.0, p[0] / 1e3] for p in pts])  # us = a + (bytes / 1e3) / (GB/s)
    for col, name in ((1, "rms"), (2, "ln")):
        y = np.array([p[col] for p in pts])
        (a, inv), *_ = np.linalg.lstsq(A, y, rcond=None)
        print(f"  {dn} {name}: fixed {a:5.1f} us, streams at {1 / inv:6.0f} GB/s ({100 / inv / bw:3.0f}% of copy)",
              flush=True)

if args.timeline:  # kernel durations and the gaps between back-to-back calls (CUPTI), per path
    import timeline

    for N in (1024, 8192):
        for kw in (dict(),):
            apply(**kw)
            xs, dys, w, outs, rs, st = inputs(N, 2048, ck.bfloat16, 2)
            s = cp.cuda.Stream(non_blocking=True)
            with s:
                for f in (lambda i: ck.rms_norm_backward(dys[i], xs[i], w, rs[i], out=outs[i]),
                          lambda i: ck.layer_norm_backward(dys[i], xs[i], w, st[i][0], st[i][1], out=outs[i]),
                          lambda i: ck.rms_norm(xs[i], w, 1e-5, out=outs[i])):
                    f(0), f(1)
                    s.synchronize()
                    s.begin_capture()
                    for i in range(10):
                        f(i % 2)
                    g = s.end_capture()
                    g.upload(s)
                    g.launch(s)
                    s.synchronize()
                    timeline.record(lambda: g.launch(s), s.synchronize, steps=1, path="/tmp/tl_norm")
                    rows_ = timeline.load("/tmp/tl_norm.csv")
                    ks = [r for r in rows_ if r[0] == "kernel"]
                    by = {}
                    for a, b in zip(ks, ks[1:] + [None]):
                        d = by.setdefault(a[4][:40], [[], []])
                        d[0].append(a[3])
                        if b is not None:
                            d[1].append(b[2] - (a[2] + a[3]))
                    span = ks[-1][2] + ks[-1][3] - ks[0][2]
                    print(f"  N={N} {kw}: {len(ks)} kernels in {span:.1f} us ("
                          + "; ".join(f"{n}: {np.mean(d[0]):.1f} us, gap after {np.mean(d[1]) if d[1] else 0:.1f}"
                                      for n, d in by.items()) + ")", flush=True)
