"""Per-kernel GPU time of one whole training step (LLaMA-3.2-1B shape or GPT-2 124M), from CUPTI through
torch.profiler.

    PYTHONPATH=. python benchmarks/profile_step.py [--model llama|gpt2] [--configs b8t1024] [--graph]
        [--fp8 current|delayed]

CUPTI records every kernel the process launches, CuPy's and cuBLAS's included, so PyTorch is used only as the
recorder. Prints, per config, the kernels grouped by name with total ms per step, calls and share of the step.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    ap.add_argument("--configs", default="b8t1024")
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--fp8", default="", help="the Linear GEMMs in FP8 with this scaling (current, hybrid, delayed; "
                    "-shadow: the optimizer's FP8 copies of the weights; -head: the LM head's gradient GEMMs in FP8, "
                    "-headdx: its dx GEMM only)")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import bench_train as bt

    bt.MODEL["name"] = args.model
    if args.fp8:
        import cukernels as ck

        scaling, *how = args.fp8.split("-")
        head = ({"head_grad_dtype": ck.float8_e5m2, "head_fp8_dw": "head" in how}
                if "head" in how or "headdx" in how else {})
        bt.FP8["recipe"], bt.FP8["shadow"] = ck.float8.replace(scaling=scaling, **head), "shadow" in how
    all_feats = bt.GPT2_ROWS[-1][1] if args.model == "gpt2" else bt.FEATURES
    feats = [f for f in all_feats if args.graph or f != "graph"]
    for c in args.configs.split(","):
        B, T = bt.CONFIGS[c]
        s = bt.OurStep(B, T, feats)
        batches = bt.make_batches("synthetic", B, T, 1, s.mcfg["vocab_size"])
        for _ in range(3):
            s.new_batch(batches)
            s.step()
        s.step.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                s.step()
            s.step.synchronize()
        agg = collections.defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                a = agg[e.name[:90]]
                a[0] += e.device_time_total / 1e3 / args.steps
                a[1] += 1
        total = sum(v[0] for v in agg.values())
        print(f"\n== B{B}xT{T} ({'graph' if args.graph else 'eager'}{', fp8 ' + args.fp8 if args.fp8 else ''}): GPU busy {total:.2f} ms/step, "
              f"{len(agg)} distinct kernels")
        for name, (ms, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"{ms:8.3f} ms {ms / total * 100:5.1f}%  {n // args.steps:5d}x  {name}")
        del s
        import cupy as cp
        import gc

        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
