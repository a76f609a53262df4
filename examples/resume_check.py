#!/usr/bin/env python
"""Train a config twice -- once straight through, once killed half-way and resumed from its checkpoint -- and
show that the logged losses agree step for step (the issue-7 acceptance run on the GPU).

    python examples/resume_check.py --config examples/configs/small.yaml [key=value ...]

Run A trains ``max_steps``; run B stops after ``max_steps // 2`` steps (as a killed run would: periodic
checkpoints only, ``ckpt_every = max_steps // 2``), then a fresh ``train(..., resume="latest")`` continues it.
Exit status 1 when any logged train loss or grad norm differs.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cukernels.train import load_config, train  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", default="runs/resume_check")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    base = load_config(a.config, a.overrides)
    half = base["max_steps"] // 2
    common = list(a.overrides) + [f"ckpt_every={half}", "plot=true"]
    t0 = time.perf_counter()
    ra = train(load_config(a.config, common + [f"out_dir={a.out}/a"]))
    ta = time.perf_counter() - t0
    cfg_b = load_config(a.config, common + [f"out_dir={a.out}/b"])
    train(cfg_b, stop_after=half)
    print(f"--- run b killed after {half} steps; resuming from its latest checkpoint")
    rb = train(load_config(a.config, common + [f"out_dir={a.out}/b", "resume=latest"]))
    tr = lambda rows: [(r["step"], r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"]  # noqa: E731
    A, Bm = tr(ra), tr(rb)
    same = A == Bm
    print(f"\nrun a: {len(A)} logged train steps in {ta:.1f} s; run b (killed at {half}, resumed): {len(Bm)}")
    print(f"{'step':>6} {'loss a':>10} {'loss b':>10}")
    for (s, la, _), (_, lb, _) in zip(A, Bm):
        if s % max(1, base["max_steps"] // 10) == 0 or s == half or s == half + base["log_every"]:
            print(f"{s:6d} {la:10.6f} {lb:10.6f}")
    print("resumed run identical to the uninterrupted one, step for step (loss and grad norm): "
          + ("YES" if same else "NO"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
