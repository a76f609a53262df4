"""The scaling table of issue 39: our training step on 1, 2, 4 and 8 GPUs of one host (ZeRO-1 over the ranks, the same
per-GPU batch), beside PyTorch's DDP or FSDP2 peer at each count, each count in a fresh set of processes.

    python benchmarks/bench_scaling.py --nprocs 1,2,4,8 --configs b8t1024,b4t64 [--vs-torch ddp] [--timeline DIR]
        [--json benchmarks/results/bench_scaling.json]
    python benchmarks/bench_scaling.py --model llama8b --nprocs 8 --configs b4t1024 --vs-torch fsdp2   # the 8B row
    python benchmarks/bench_scaling.py --table benchmarks/results/bench_scaling.json                   # print again

Each count N runs ``bench_train.py --configs ... --nproc N`` (N = 1: one GPU, AdamW) and, with ``--vs-torch``,
``bench_torch_dist.py --mode ddp|fsdp2`` under ``python -m cukernels.run --nproc-per-node N`` at every config.
The table: ms/step, tokens/s over all GPUs, the speed-up (tokens/s over the one-GPU row's), the efficiency
(speed-up / N), the peak memory per GPU, the peer's tokens/s and ours over it; at B8xT1024 the issue's bars
(>= 1.97x on 2 GPUs, >= 3.9x on 4, >= 7.6x on 8) are checked. ``--timeline DIR`` passes on to bench_train (a kernel
timeline of every rank, the exposed communication: benchmarks/timeline.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BARS = {"b8t1024": {2: 1.97, 4: 3.9, 8: 7.6}}  # issue 39: the speed-up each count must reach at B8xT1024 per GPU
SHAPE = {"llama": "1b", "llama8b": "8b"}  # --model -> bench_torch_dist's --shape


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


def ours(model, n, configs, steps, timeline, tmp):
    """bench_train's main row of each config at n GPUs: {config: row}."""
    js = Path(tmp) / f"ours-{n}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--model", model, "--configs",
           ",".join(configs), "--steps", str(steps), "--json", str(js)]
    if n > 1:
        cmd += ["--nproc", str(n)]
        if timeline:
            cmd += ["--timeline", str(Path(timeline) / f"n{n}")]
    rc = subprocess.call(cmd, cwd=ROOT, env=_env())
    if rc or not js.exists():
        print(f"bench_train at {n} GPU(s): exit {rc}", flush=True)
        return {}
    rows = json.loads(js.read_text())["rows"]
    return {r["config"]: r for r in rows if not r.get("setting") and not r.get("oom") and "ms" in r}


def peer(mode, model, n, config, steps, tmp):
    """bench_torch_dist's row at n GPUs for one config, or None."""
    from bench_train import config_shape

    B, T = config_shape(config)
    js = Path(tmp) / f"torch-{mode}-{n}-{config}.json"
    cmd = [sys.executable, "-m", "cukernels.run", "--nproc-per-node", str(n), "--quiet-others",
           str(ROOT / "benchmarks" / "bench_torch_dist.py"), "--mode", mode, "--shape", SHAPE[model], "--batch",
           str(B), "--seq", str(T), "--steps", str(steps), "--json", str(js)]
    rc = subprocess.call(cmd, cwd=ROOT, env=_env())
    if rc or not js.exists():
        print(f"torch {mode} at {n} GPU(s), {config}: exit {rc}", flush=True)
        return None
    return json.loads(js.read_text())


def table(data):
    """(lines, ok): the scaling table of ``data`` (``{"rows": [{config, n, ms, tok_s, peak_gib, torch}]}``) and
    whether every bar that applies is met (a missing one-GPU row: no speed-ups, no verdict)."""
    lines, ok = [], True
    head = (f"{'config':<9} {'GPUs':>4} {'ms/step':>9} {'tok/s':>11} {'speed-up':>8} {'eff.':>6} {'GiB/GPU':>8} "
            f"{'peer tok/s':>11} {'ours/peer':>9}  bar")
    for c in dict.fromkeys(r["config"] for r in data["rows"]):
        rows = sorted((r for r in data["rows"] if r["config"] == c), key=lambda r: r["n"])
        one = next((r for r in rows if r["n"] == 1), None)
        lines += ["", head]
        for r in rows:
            su = r["tok_s"] / one["tok_s"] if one else None
            t = r.get("torch") or {}
            bar = BARS.get(c, {}).get(r["n"])
            verdict = ""
            if bar is not None and su is not None:
                verdict = f">= {bar}x {'PASS' if su >= bar else 'FAIL'}"
                ok &= su >= bar
            n, tok = r["n"], r["tok_s"]
            su_s, eff_s = (f"{su:.2f}x", f"{su / n:.3f}") if su else ("-", "-")
            pt_s, vs_s = (f"{t['tok_s']:,.0f}", f"{tok / t['tok_s']:.2f}x") if t else ("-", "-")
            lines.append(f"{c:<9} {n:>4} {r['ms']:>9.2f} {tok:>11,.0f} {su_s:>8} {eff_s:>6} {r['peak_gib']:>8.1f} "
                         f"{pt_s:>11} {vs_s:>9}  {verdict}")
    return lines, ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=sorted(SHAPE))
    ap.add_argument("--nprocs", default="1,2", help="comma list of GPU counts")
    ap.add_argument("--configs", default="b8t1024,b4t64")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--vs-torch", default="", choices=["", "ddp", "fsdp2"], help="the PyTorch peer at each count")
    ap.add_argument("--timeline", default="", help="a folder: each count's kernel timelines (bench_train --timeline)")
    ap.add_argument("--json", default="")
    ap.add_argument("--table", default="", help="print the table of this JSON and stop")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if args.table:
        lines, ok = table(json.loads(Path(args.table).read_text()))
        print("\n".join(lines))
        return 0 if ok else 1
    try:
        ns = sorted({int(v) for v in args.nprocs.split(",") if v})
    except ValueError:
        ap.error(f"--nprocs: expected a comma list of integers; got {args.nprocs!r}")
    if not ns or ns[0] < 1:
        ap.error(f"--nprocs: expected GPU counts >= 1; got {args.nprocs!r}")
    configs = [c for c in args.configs.split(",") if c]
    data = dict(command=" ".join(["python benchmarks/bench_scaling.py", *(sys.argv[1:] if argv is None else argv)]),
                date=time.strftime("%Y-%m-%d"), model=args.model, rows=[])
    with tempfile.TemporaryDirectory() as tmp:
        for n in ns:
            got = ours(args.model, n, configs, args.steps, args.timeline, tmp)
            for c in configs:
                if c not in got:
                    continue
                r = got[c]
                row = dict(config=c, n=n, ms=r["ms"], tok_s=r["tok_s"], peak_gib=r["peak_gib"],
                           timeline=r.get("timeline"))
                if args.vs_torch:
                    row["torch"] = peer(args.vs_torch, args.model, n, c, args.steps, tmp)
                data["rows"].append(row)
    lines, ok = table(data)
    print("\n".join(lines), flush=True)
    data["table"], data["ok"] = lines, ok
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
