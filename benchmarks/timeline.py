"""Kernel timeline of a few replays of a step, from CUPTI through torch.profiler: which kernels ran on which stream
and when, and how much of the NCCL collectives' time ran beside compute.

    import timeline
    summary = timeline.record(step, sync, steps=2, path="out/tl_b8t1024_rank0")

Writes ``path.csv`` (kind, stream, start_us from the first kernel, dur_us, name; one row per kernel / memcpy /
memset) and returns a summary dict, printed by :func:`report`:

* ``span_ms``: first start to last end, per step;
* ``busy_ms``: the union of every GPU activity, per step (span - busy = the GPU idle, e.g. host gaps);
* per stream: kernels and their union, per step;
* ``nccl_ms``: the union of NCCL kernels per step, ``nccl_alone_ms``: the part of it with no other kernel running
  (a collective that overlaps nothing), ``compute_with_nccl_ms``: compute kernel time beside a collective.

Used by ``bench_train.py --timeline DIR`` (each rank writes its own file under the launcher). torch is imported
here only: CUPTI records every kernel of the process, CuPy's, cuBLAS's and NCCL's included.
"""
from __future__ import annotations

import json
import os


def _union(iv):
    iv = sorted(iv)
    out = []
    for s, e in iv:
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(iv):
    return sum(e - s for s, e in iv)


def _intersect(a, b):
    """Length of the intersection of two unions (sorted, disjoint interval lists)."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            tot += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def summarise(rows, steps):
    """rows: (kind, stream, start_us, dur_us, name). Per-step figures in ms."""
    if not rows:
        return {"steps": steps, "span_ms": 0.0}
    t0 = min(r[2] for r in rows)
    t1 = max(r[2] + r[3] for r in rows)
    iv = lambda sel: _union([[r[2], r[2] + r[3]] for r in rows if sel(r)])  # noqa: E731
    is_nccl = lambda r: "nccl" in r[4].lower()  # noqa: E731
    allu = iv(lambda r: True)
    nccl = iv(is_nccl)
    comp = iv(lambda r: r[0] == "kernel" and not is_nccl(r))
    per = lambda us: us / 1e3 / steps  # noqa: E731
    streams = {}
    for s in sorted({r[1] for r in rows}):
        sr = [r for r in rows if r[1] == s]
        streams[s] = dict(kernels=len(sr) / steps, busy_ms=per(_length(iv(lambda r, s=s: r[1] == s))),
                          nccl_kernels=sum(1 for r in sr if is_nccl(r)) / steps)
    ov = _intersect(nccl, comp)
    return dict(steps=steps, span_ms=per(t1 - t0), busy_ms=per(_length(allu)), compute_ms=per(_length(comp)),
                nccl_ms=per(_length(nccl)), nccl_alone_ms=per(_length(nccl) - ov), compute_with_nccl_ms=per(ov),
                nccl_kernel_sum_ms=per(sum(r[3] for r in rows if is_nccl(r))), streams=streams)


def record(step, sync, *, steps=2, path):
    """Run ``step()`` ``steps`` times under the profiler (``sync()`` after), write ``path.csv``, return the
    summary (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    tmp = f"{path}.trace.json"
    prof.export_chrome_trace(tmp)
    with open(tmp) as f:
        ev = json.load(f).get("traceEvents", [])
    os.remove(tmp)
    kinds = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
    rows = [(kinds[e["cat"]], int(e.get("args", {}).get("stream", e.get("tid", -1))), float(e["ts"]),
             float(e.get("dur", 0.0)), str(e.get("name", "")))
            for e in ev if e.get("ph") == "X" and e.get("cat") in kinds]
    t0 = min((r[2] for r in rows), default=0.0)
    with open(f"{path}.csv", "w") as f:
        f.write("kind,stream,start_us,dur_us,name\n")
        for k, s, ts, d, n in sorted(rows, key=lambda r: r[2]):
            f.write(f"{k},{s},{ts - t0:.3f},{d:.3f},\"{n[:160].replace(chr(34), chr(39))}\"\n")
    return summarise(rows, steps)


def report(summary, label, log=print):
    s = summary
    if not s.get("span_ms"):
        log(f"timeline {label}: no GPU activity recorded")
        return
    log(f"timeline {label} (per step, {s['steps']} steps): span {s['span_ms']:.2f} ms, GPU busy {s['busy_ms']:.2f}, "
        f"compute kernels {s['compute_ms']:.2f}; NCCL {s['nccl_ms']:.2f} ms (kernel sum {s['nccl_kernel_sum_ms']:.2f}), "
        f"of which alone {s['nccl_alone_ms']:.2f}, beside compute {s['compute_with_nccl_ms']:.2f}")
    small = {st: v for st, v in s["streams"].items() if v["kernels"] <= 4}
    for st, v in s["streams"].items():
        if st not in small:
            log(f"    stream {st}: {v['kernels']:.0f} activities ({v['nccl_kernels']:.0f} NCCL), busy {v['busy_ms']:.2f} ms")
    if small:  # a replayed graph gives each branch a stream of its own
        log(f"    {len(small)} streams of <= 4 activities (graph branches): "
            f"{sum(v['kernels'] for v in small.values()):.0f} activities "
            f"({sum(v['nccl_kernels'] for v in small.values()):.0f} NCCL), busy {sum(v['busy_ms'] for v in small.values()):.2f} ms")


def load(path):
    """Rows of a ``record`` CSV: (kind, stream, start_us, dur_us, name)."""
    import csv

    with open(path) as f:
        return [(r["kind"], int(r["stream"]), float(r["start_us"]), float(r["dur_us"]), r["name"])
                for r in csv.DictReader(f)]


def show(rows, *, t0=0.0, t1=None, min_us=50.0, log=print):
    """Per stream, runs of consecutive same-name activities in [t0, t1) us: start-end ms, count, busy ms. Graph
    replays give every branch its own stream id, so streams with one or two activities are side-stream work."""
    t1 = max((r[2] + r[3] for r in rows), default=0.0) if t1 is None else t1
    for st in sorted({r[1] for r in rows}):
        runs = []
        for k, s, ts, d, n in rows:
            if s != st or not (t0 <= ts < t1):
                continue
            nm = n[:48]
            if runs and runs[-1][0] == nm:
                runs[-1][1] += 1
                runs[-1][3] = ts + d
                runs[-1][4] += d
            else:
                runs.append([nm, 1, ts, ts + d, d])
        shown = [r for r in runs if r[4] >= min_us or "nccl" in r[0].lower()]
        if shown:
            log(f"stream {st}: {sum(r[1] for r in runs)} activities")
        for nm, c, s, e, d in shown:
            log(f"  {s / 1e3:9.3f} - {e / 1e3:9.3f} ms  x{c:<4d} busy {d / 1e3:7.3f}  {nm}")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="print a recorded timeline: the summary, then the runs per stream")
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=2, help="steps the file holds (for the per-step summary)")
    ap.add_argument("--from-ms", type=float, default=0.0)
    ap.add_argument("--to-ms", type=float, default=None)
    ap.add_argument("--min-us", type=float, default=50.0, help="hide runs shorter than this (NCCL always shown)")
    a = ap.parse_args()
    rows = load(a.csv)
    report(summarise(rows, a.steps), a.csv)
    show(rows, t0=a.from_ms * 1e3, t1=None if a.to_ms is None else a.to_ms * 1e3, min_us=a.min_us)
