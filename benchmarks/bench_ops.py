"""Per-kernel benchmark: one table per run.

    PYTHONPATH=. python benchmarks/bench_ops.py [--only rms_norm,softmax] [--quick] [--json out.json]

For every case (op, shape, dtype) it prints:
  ms        GPU time per call: back-to-back calls captured in one CUDA graph and replayed, timed with CUDA
            events, median of repeats (graph replay removes Python launch overhead; `eager` is the same
            calls issued from Python, which is what a notebook sees for tiny shapes)
  GB/s      bytes / ms, bytes from the formula printed beside it (each input read once, each output
            written once: the fewest bytes the op must move)
  %copy     GB/s over the device-to-device copy bandwidth measured in this run
  x cupy    time of a CuPy composite of the same math / ours
  x torch   time of the PyTorch op / ours, when torch is importable (timed the same way)
Inputs rotate among several copies when one set would fit in L2, so the figures are HBM figures.

Cases live in benchmarks/cases/<family>.py, each exposing ``cases(ctx)``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@dataclass
class Case:
    op: str
    shape: str
    dtype: str
    nbytes: float
    formula: str
    ours: Callable[[int], object]  # called with the input-set index
    composite: Callable[[int], object] | None = None
    torch: Callable[[int], object] | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)
    flops: float = 0.0  # compute-bound cases: model FLOPs per call, printed as TFLOP/s


class Ctx:
    """What case builders get: cupy, torch (or None), helpers for rotating inputs and torch views."""

    def __init__(self, quick: bool, group: str = ""):
        import cupy

        self.cp = cupy
        self.quick = quick
        self.group = group  # --group: a case file that knows the name builds only those rows (others ignore it)
        try:
            import torch

            self.torch = torch if torch.cuda.is_available() else None
        except Exception:
            self.torch = None
        self.l2 = cupy.cuda.Device().attributes["L2CacheSize"]

    def nsets(self, bytes_per_set: float) -> int:
        """Copies of the inputs so that the working set is >= 3 x L2 (at most 8)."""
        return int(max(1, min(8, -(-3 * self.l2 // max(1, int(bytes_per_set))))))

    def t(self, a):
        """A zero-copy torch view of a CuPy array (bf16 through a uint16 view)."""
        import ml_dtypes
        import numpy as np

        torch = self.torch
        if a.dtype == np.dtype(ml_dtypes.bfloat16):
            return torch.as_tensor(a.view(self.cp.uint16), device="cuda").view(torch.bfloat16)
        return torch.as_tensor(a, device="cuda")


def _time_graph(fn, nsets, calls, repeats):
    import cupy as cp

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for i in range(nsets):
            fn(i)  # warm-up (compiles, allocates) outside the capture
        s.synchronize()
        s.begin_capture()
        for i in range(calls):
            fn(i % nsets)
        g = s.end_capture()
        g.upload(s)
        g.launch(s)
        s.synchronize()
        times = []
        for _ in range(repeats):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            g.launch(s)
            b.record(s)
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) / calls)
    return statistics.median(times)


def _time_eager(fn, nsets, calls, repeats):
    import cupy as cp

    for i in range(nsets):
        fn(i)
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for i in range(calls):
            fn(i % nsets)
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / calls)
    return statistics.median(times)


def _time_torch_graph(torch, fn, nsets, calls, repeats):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(nsets):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i % nsets)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def _budget(fn, nsets, torch=None):
    """(calls per graph, repeats) sized from one warm eager call: >= ~2 ms per timed region, ~0.3 s in all."""
    import cupy as cp

    for i in range(nsets):
        fn(i)
    sync = torch.cuda.synchronize if torch is not None else cp.cuda.Device().synchronize
    sync()
    t0 = time.perf_counter()
    fn(0)
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    calls = int(min(20, max(1, 2e-3 // one)))
    repeats = int(min(15, max(3, 0.3 // (one * calls))))
    return calls, repeats


def timeit(fn, nsets, torch=None):
    """(ms per call, how): graph-replayed when capture works, eager otherwise."""
    calls, repeats = _budget(fn, nsets, torch)
    try:
        if torch is not None:
            return _time_torch_graph(torch, fn, nsets, calls, repeats), "graph"
        return _time_graph(fn, nsets, calls, repeats), "graph"
    except Exception as e:  # capture refused (e.g. a host sync inside): fall back, and say so
        import cupy as cp

        try:
            cp.cuda.Device().synchronize()
        except Exception:
            pass
        return _time_eager(fn, nsets, calls, repeats), f"eager ({type(e).__name__})"


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), 1 GiB buffers."""
    import cupy as cp

    n = 1 << 28
    a = cp.ones(n, dtype=cp.float32)
    b = cp.empty_like(a)
    ms = _time_eager(lambda i: cp.copyto(b, a), 1, 10, 10)
    del a, b
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated families (default: all in benchmarks/cases)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--group", default="", help="only a family's rows of this group, where its case file has one "
                    "(window: the sliding-window rows of attention, attention_sm90, decode_attention)")
    ap.add_argument("--json", default="", help="save the rows to this file")
    ap.add_argument("--no-startup", action="store_true", help="ignored: start-up is benchmarks/bench_startup.py's")
    ap.add_argument("--ab", default="", help="A/B rows of ck.settings (benchmarks/ab.py): each case is timed "
                    "again under every row, printed below its default row")
    args = ap.parse_args(argv)

    import ab
    import cupy as cp



    fams = [f.strip() for f in args.only.split(",") if f.strip()] or sorted(
        p.stem for p in (Path(__file__).parent / "cases").glob("*.py") if not p.stem.startswith("_")
    )
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"device: {name}, {dev.attributes['MultiProcessorCount']} SMs, L2 {dev.attributes['L2CacheSize'] >> 20} MiB; "
          f"CuPy {cp.__version__}")
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw:.0f} GB/s (read + write)")

    ctx = Ctx(args.quick, args.group)
    rows = []
    hdr = f"{'op':<28} {'shape':<20} {'dtype':<5} {'ms':>9} {'GB/s':>7} {'%copy':>6} {'x cupy':>7} {'x torch':>8} {'eager ms':>9}  bytes"
    print(hdr)
    print("-" * len(hdr))
    def safe(fn, *a, **k):
        try:
            return fn(*a, **k)[0]
        except Exception as e:  # a baseline that cannot run this case: shown as "-", with the reason
            print(f"    ({getattr(fn, '__name__', 'timing')} failed: {type(e).__name__}: {str(e)[:160]})")
            return None

    for fam in fams:
        try:
            mod = importlib.import_module(f"cases.{fam}")
            cases = mod.cases(ctx)
        except Exception as e:
            print(f"{fam}: could not build cases: {type(e).__name__}: {e}")
            continue
        for c in cases:
            nsets = c.extra.get("nsets", 1)
            try:
                ms, how = timeit(c.ours, nsets)
                eager, _ = timeit_eager(c.ours, nsets)
            except Exception as e:
                print(f"{c.op:<28} {c.shape:<20} {c.dtype:<5} FAILED: {type(e).__name__}: {str(e)[:200]}")
                continue
            comp = safe(timeit, c.composite, nsets) if c.composite else None
            tor = safe(timeit, c.torch, nsets, torch=ctx.torch) if (c.torch and ctx.torch) else None
            gbs = c.nbytes / (ms * 1e-3) / 1e9
            row = dict(op=c.op, shape=c.shape, dtype=c.dtype, ms=ms, gbs=gbs, pct_copy=100 * gbs / bw,
                       x_cupy=(comp / ms) if comp else None, x_torch=(tor / ms) if tor else None,
                       cupy_ms=comp, torch_ms=tor, eager_ms=eager, bytes=c.nbytes, formula=c.formula,
                       timing=how, note=c.note, tflops=(c.flops / (ms * 1e-3) / 1e12) if c.flops else None)
            rows.append(row)
            f = lambda v, fmt: (fmt % v) if v is not None else "-"  # noqa: E731
            print(f"{c.op:<28} {c.shape:<20} {c.dtype:<5} {ms:9.4f} {gbs:7.0f} {row['pct_copy']:5.0f}% "
                  f"{f(row['x_cupy'], '%6.2fx'):>7} {f(row['x_torch'], '%7.2fx'):>8} {eager:9.4f}  {c.formula}"
                  + (f"  [{how}]" if how != "graph" else "") + (f"  {c.note}" if c.note else "")
                  + (f"  {row['tflops']:.0f} TFLOP/s" if c.flops else ""), flush=True)
            for ab_row in ab.rows(args.ab):
                try:
                    with ab.applied(ab_row):
                        ms_ab, _ = timeit(c.ours, nsets)
                except Exception as e:
                    print(f"  ({ab_row}) FAILED: {type(e).__name__}: {str(e)[:200]}")
                    continue
                gb_ab = c.nbytes / (ms_ab * 1e-3) / 1e9
                rows.append(dict(row, ms=ms_ab, gbs=gb_ab, pct_copy=100 * gb_ab / bw, ab=ab_row, x_cupy=None,
                                 x_torch=(tor / ms_ab) if tor else None, eager_ms=None))
                print(f"{'  (' + ab_row + ')':<54} {ms_ab:9.4f} {gb_ab:7.0f} {100 * gb_ab / bw:5.0f}% {'':>7} "
                      f"{f(rows[-1]['x_torch'], '%7.2fx'):>8}", flush=True)
        del cases
        cp.get_default_memory_pool().free_all_blocks()
    if args.json:  # one run as in benchmarks/results/bench_ops.json: the command, the date, the device
        cmd = " ".join(["python benchmarks/bench_ops.py", *(sys.argv[1:] if argv is None else argv)])
        Path(args.json).write_text(json.dumps(dict(command=cmd, date=time.strftime("%Y-%m-%d"), device=name,
                                                   cupy=cp.__version__, copy_gbs=bw, rows=rows), indent=1))
    return rows


def timeit_eager(fn, nsets):
    calls, repeats = _budget(fn, nsets)
    return _time_eager(fn, nsets, calls, repeats), "eager"


if __name__ == "__main__":
    main()
