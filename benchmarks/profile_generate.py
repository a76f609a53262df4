"""Per-kernel GPU time of one decode step of the static generation engine (CUPTI through torch.profiler), eager
(the kernels the captured step replays, without the graph's gaps) and the captured step's wall time.

    PYTHONPATH=. python benchmarks/profile_generate.py [--model llama|gpt2] [--batch 1] [--prompt 128] [--top 40]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    import cupy as cp
    import torch
    from torch.profiler import ProfilerActivity, profile

    import bench_generate as bg
    from cukernels.generation import generate

    model = bg.build(a.model, cp)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (a.batch, a.prompt))
    generate(model, prompt, 4, temperature=0)
    for graph in (False, True):
        st = {}
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        if graph:
            generate(model, prompt, a.new, temperature=0, stats=st)
            print(f"captured: {st['decode_s'] / (st['new_tokens'] - 1) * 1e3:.3f} ms per decode step")
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(model, prompt, a.new, temperature=0, stats=st, graph=False)
            cp.cuda.Device().synchronize()
        steps = st["new_tokens"] - 1
        agg = collections.defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                r = agg[e.name[:100]]
                r[0] += e.device_time_total / 1e3
                r[1] += 1
        # the prefill's kernels are in the totals too: subtract nothing, report per decode step (prefill ~1 step)
        total = sum(v[0] for v in agg.values())
        n = sum(v[1] for v in agg.values())
        print(f"eager {a.model} B{a.batch} prompt {a.prompt}: {total / steps:.3f} ms kernel time per step, "
              f"{n / steps:.0f} kernels per step ({st['decode_s'] / steps * 1e3:.2f} ms wall, eager)")
        for name, (ms, k) in sorted(agg.items(), key=lambda kv: -kv[1][0])[: a.top]:
            print(f"{ms / steps * 1e3:9.1f} us {ms / total * 100:5.1f}%  {k / steps:6.1f}x  {name}")


if __name__ == "__main__":
    main()
