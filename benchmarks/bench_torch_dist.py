"""PyTorch's data-parallel training of the shapes ``bench_train.py --nproc N`` runs: its peer on the same machine,
ranks and per-rank batch (issue 39), started by our launcher (or torchrun: the same environment).

    python -m cukernels.run --nproc-per-node 2 benchmarks/bench_torch_dist.py --mode ddp --shape 1b --batch 8 --seq 1024
    python -m cukernels.run --nproc-per-node 8 benchmarks/bench_torch_dist.py --mode fsdp2 --shape 8b --batch 4 \\
        --seq 1024 [--compile] [--json benchmarks/results/bench_torch_dist.json]
    python -m cukernels.run --nproc-per-node 2 benchmarks/bench_torch_dist.py --cpu --shape tiny --mode fsdp2
        # the harness itself on CPUs (gloo, float32): what tests/test_bench_torch_dist.py runs

Each mode as a competent user runs it with PyTorch alone (transformers' ``LlamaForCausalLM``, SDPA attention,
synthetic uniform tokens, AdamW lr 3e-4 betas (0.9, 0.95) weight decay 0.1, the global norm clipped to 1.0):

- ``ddp``: fp32 parameters on every GPU, bf16 autocast, ``DistributedDataParallel(gradient_as_bucket_view=True,
  static_graph=True)`` (gradients all-reduced in buckets under the backward), fused AdamW.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and then the root (torchtitan's layout:
  parameters, gradients and optimizer state sharded over the ranks, each layer's parameters gathered before its
  forward and backward and resharded after), ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, AdamW
  fused where the sharded parameters take it (else foreach; the line says which).
- ``--compile``: ``torch.compile`` of each decoder layer before wrapping (torchtitan's per-block compile).

Printed by rank 0 and written to ``--json``: ms/step (each rank's median over ``--steps`` after ``--warmup``, then
the slowest rank), tokens/s over all ranks, peak memory per GPU (``max_memory_allocated``, the largest rank), and
MFU = model FLOPs per token (``bench_train.model_flops_per_token``: 6 x the matmul parameters + the causal
attention) x tokens/s / (ranks x the GPU's dense bf16 peak: 989 TFLOP/s for H100 / H200; ``--peak-tflops``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            max_position_embeddings=1024)
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense bf16, SXM


def shape_config(name):
    from bench_train import LLAMA_1B, LLAMA_8B

    return {"tiny": TINY, "1b": LLAMA_1B, "8b": LLAMA_8B}[name]


def build(args, torch, dev):
    """The model (wrapped for the mode), its optimizer and a description."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape_config(args.shape))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    with torch.device(dev):  # built on the device: an 8B model in fp32 is 32 GB, sharded right after
        model = LlamaForCausalLM(cfg)
    what = [args.mode]
    if args.compile:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer)
        what.append("compiled per decoder layer")
    opt_kw = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=None if args.cpu else [dev.index], gradient_as_bucket_view=True,
                    static_graph=True)
        opt = torch.optim.AdamW(model.parameters(), fused=not args.cpu, **opt_kw)
        what.append("fused AdamW" if not args.cpu else "AdamW")
        return model, opt, ", ".join(what)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = torch.float32 if args.cpu else torch.bfloat16  # (gloo on CPUs: the harness, not a measurement)
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    try:
        opt = torch.optim.AdamW(model.parameters(), fused=not args.cpu, **opt_kw)
        what.append("fused AdamW" if not args.cpu else "AdamW")
    except (RuntimeError, TypeError) as e:  # sharded parameters the fused kernel does not take
        opt = torch.optim.AdamW(model.parameters(), foreach=True, **opt_kw)
        what.append(f"foreach AdamW (fused refused: {str(e).splitlines()[0][:80]})")
    what.append(f"params {low}, reduce float32")
    return model, opt, ", ".join(what)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="ddp", choices=["ddp", "fsdp2"])
    ap.add_argument("--shape", default="1b", choices=["tiny", "1b", "8b"])
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="CPUs and gloo (checks the harness; no figure to quote)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the GPU's dense bf16 peak (default: by name)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    for name in ("batch", "seq", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: expected an integer >= 1; got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup: expected an integer >= 0; got {args.warmup}")

    import torch
    import torch.distributed as dist

    from bench_train import model_flops_per_token, torch_train_step

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if "MASTER_ADDR" not in os.environ:  # one process without a launcher: a group of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1")
    if args.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    try:
        model, opt, what = build(args, torch, dev)
        cfg = shape_config(args.shape)
        gen = torch.Generator(device=dev).manual_seed(1000 + rank)  # each rank its own batch
        B, T, V = args.batch, args.seq, cfg["vocab_size"]
        params = sum(p.numel() for p in model.parameters())  # (a sharded DTensor's numel is the whole tensor's)

        def sync():
            if not args.cpu:
                torch.cuda.synchronize(dev)

        def step(ids):  # (fsdp2 casts the parameters itself; no autocast on CPUs)
            return torch_train_step(torch, model, model, opt, ids, autocast=args.mode == "ddp" and not args.cpu)

        times, losses = [], []
        for i in range(args.warmup + args.steps):
            ids = torch.randint(0, V, (B, T), device=dev, generator=gen)
            sync()
            t0 = time.perf_counter()
            loss = step(ids)
            sync()
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
            losses.append(float(loss.detach().float()))
        peak = 0.0 if args.cpu else torch.cuda.max_memory_allocated(dev) / 2**30
        red = torch.tensor([statistics.median(times), peak], dtype=torch.float64,
                           device=dev if not args.cpu else "cpu")
        dist.all_reduce(red, op=dist.ReduceOp.MAX)  # the slowest rank's median, the largest rank's peak
        ms, peak = float(red[0]), float(red[1])
        tok_s = world * B * T / (ms * 1e-3)
        name = "cpu" if args.cpu else torch.cuda.get_device_name(dev)
        peak_tf = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
        tflops = model_flops_per_token(cfg, T) * tok_s / 1e12
        mfu = tflops / (world * peak_tf) if peak_tf and not args.cpu else None
        if rank == 0:
            print(f"torch {args.mode:<6} {args.shape} x{world} B{B}xT{T} per rank: {ms:9.2f} ms/step  "
                  f"{tok_s:12,.0f} tok/s  peak {peak:6.1f} GiB/GPU  "
                  f"{'MFU %.1f %%' % (100 * mfu) if mfu is not None else ''}  losses {losses[0]:.4f} .. "
                  f"{losses[-1]:.4f}  ({what}; {params:.4g} parameters; torch {torch.__version__})",
                  flush=True)
            if args.json:
                row = dict(mode=args.mode, shape=args.shape, ranks=world, batch=B, seq=T, compile=args.compile,
                           ms=ms, tok_s=tok_s, peak_gib=peak, tflops=tflops, mfu=mfu, losses=losses, setup=what,
                           params=params, device=name, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                           command="python -m cukernels.run --nproc-per-node %d benchmarks/bench_torch_dist.py %s"
                                   % (world, " ".join(sys.argv[1:] if argv is None else argv)))
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(row, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
