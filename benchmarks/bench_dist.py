"""Collectives and the ZeRO-1 optimizer step on several GPUs of one host.

    python -m cukernels.run --nproc-per-node 2 benchmarks/bench_dist.py            # the full run (~2 min)
    python -m cukernels.run --nproc-per-node 2 benchmarks/bench_dist.py --quick    # small sizes, 2 layers
    python benchmarks/bench_dist.py                                                # 1 GPU: AdamW vs ZeroAdamW(N=1)

Table 1, collectives (NCCL through cukernels.distributed, on the current stream): all_reduce (in place),
reduce_scatter and all_gather of S bytes (the full array: reduce_scatter's input, all_gather's output), bf16 (and
fp32 with --fp32). Time: CUDA events around ``--calls`` back-to-back calls, median of ``--repeats``, the slowest
rank. Bandwidths as nccl-tests: algbw = S / t; busbw = algbw * 2(N-1)/N for all_reduce, algbw * (N-1)/N for
reduce_scatter and all_gather (the bytes each link carries; comparable across N).

Table 2, one optimizer step on the LLaMA-3.2-1B parameter shapes (untied head: 1.498e9 parameters), gradients
already in place (no backward): ck.optim.AdamW on one GPU vs ZeroAdamW on all ranks -- clip (global norm) +
step, replayed from a CUDA graph (ms), then the eager phases timed with events: reduce (cast to the wire dtype +
reduce-scatter), norm (shard norm + fp64 all-reduce), adam + gather (Adam on the owned pieces, all-gather of the
shadows / fp32 parameters). Memory: the optimizer's buffers per GPU (P, G, S, W, M, V, GS).

Prediction for 2 x H200 (NVLink; issue 15's measurements: 1.5e9 bf16 reduce-scatter 5.4 ms, all-gather 5.2 ms,
all-reduce 8.7 ms = 346 GB/s busbw; fp32 twice; run 6 of NOTES.md: adam_step + shadow 3.96 TB/s):
  busbw at 1.5e9: all_reduce ~345 GB/s, reduce_scatter ~280 (algbw 556), all_gather ~290; at 1e6 elements
  latency-bound (tens of us).
  AdamW, 1 GPU: norm 6 GB -> ~1.5 ms + adam+shadow 45 GB -> 11.4 ms = ~13 ms.
  ZeroAdamW N=2 (shard 0.75e9), phases: cast 9 GB -> ~2.3 ms (bf16 wire only) + reduce-scatter 5.4 ms (fp32: 10.8);
  norm ~0.4 ms (bf16 shard; fp32 0.8); adam 21 GB -> ~5.3 ms (bf16 grad; fp32 5.7); all-gather shadows 5.2 ms
  (+ fp32 parameters 10.4 ms when every fp32 parameter is gathered). So the isolated step is slower than one
  GPU's (bf16, 1-D gathered, one bucket: ~18.6 ms; fp32 wire, all gathered: ~33 ms): the reduce is meant to hide
  behind the backward (grad hooks). What stays in a training step is norm + adam + gather: ~10.9 ms with one
  bucket, ~6.5 ms with buckets (bucket k's all-gather overlaps bucket k+1's Adam), vs ~13 ms on one GPU.
  Memory: AdamW 18 B/param = 27.0 GB; ZeroAdamW 16 B (fp32 wire) = 24.0 GB, 17 B (bf16 wire) = 25.5 GB.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cukernels as ck  # noqa: E402
from cukernels import distributed as dist  # noqa: E402
from cukernels.graph import CapturedStep  # noqa: E402
from cukernels.optim import AdamW, ZeroAdamW  # noqa: E402


def llama_1b_shapes(layers=16, vocab=128256, hidden=2048, inter=8192, heads=32, kv_heads=8):
    """(name, shape) of LLaMA-3.2-1B with an untied LM head, Hugging Face names, model order."""
    hd = hidden // heads
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)),
                (p + "self_attn.q_proj.weight", (heads * hd, hidden)),
                (p + "self_attn.k_proj.weight", (kv_heads * hd, hidden)),
                (p + "self_attn.v_proj.weight", (kv_heads * hd, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, heads * hd)),
                (p + "post_attention_layernorm.weight", (hidden,)),
                (p + "mlp.gate_proj.weight", (inter, hidden)),
                (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter))]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


class Param:
    def __init__(self, name, data):
        self.name, self.data, self.grad = name, data, None


def slowest(g, ms):
    """The largest of every rank's value (what a synchronous step waits for)."""
    cp = g.xp if g.xp is not np else None
    if cp is None or g.world_size == 1:
        return ms
    a = cp.asarray([ms], dtype=np.float64)
    g.all_reduce(a, "max")
    return float(a.get()[0])


def time_calls(cp, fn, calls, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        times.append(cp.cuda.get_elapsed_time(s, e) / calls)
    return statistics.median(times)


def bench_collectives(g, cp, sizes, dtypes, calls, repeats):
    N = g.world_size
    rows = []
    for dt in dtypes:
        item = np.dtype(dt).itemsize
        for n in sizes:
            n = int(n) // N * N
            if n == 0:
                continue
            x = cp.ones(n, dtype=dt)
            part = cp.ones(n // N, dtype=dt)
            r = g.rank
            cases = [
                ("all_reduce", lambda: g.all_reduce(x), 2 * (N - 1) / N),
                ("reduce_scatter", lambda: g.reduce_scatter(x, part), (N - 1) / N),
                ("all_gather", lambda: g.all_gather(x[r * (n // N):(r + 1) * (n // N)], x), (N - 1) / N),
            ]
            for op, fn, factor in cases:
                g.barrier()
                ms = slowest(g, time_calls(cp, fn, calls if n < 1 << 27 else max(2, calls // 4), repeats))
                algbw = n * item / (ms * 1e-3) / 1e9
                rows.append((op, np.dtype(dt).name, n, n * item / 1e9, ms, algbw, algbw * factor))
            del x, part
            cp.get_default_memory_pool().free_all_blocks()
    return rows


def build(cls, shapes, cp, rank, **kw):
    rng = cp.random.RandomState(1234)  # the same weights on every rank
    params = [Param(name, rng.standard_normal(shape, dtype=cp.float32) * 0.02) for name, shape in shapes]
    opt = cls(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, no_decay=lambda n, a: a.ndim < 2, **kw)
    grng = cp.random.RandomState(99 + rank)  # each rank its own gradient
    for p in params:
        p.grad[...] = grng.standard_normal(p.data.shape, dtype=cp.float32) * 1e-3
    cp.get_default_memory_pool().free_all_blocks()
    return params, opt


def opt_bytes(opt):
    if isinstance(opt, ZeroAdamW):
        return sum(opt.memory_bytes().values())
    return sum(a.nbytes for g in opt._groups for a in (g.P, g.G, g.M, g.V, g.S) if a is not None)


def bench_step(g, cp, shapes, configs, repeats):
    rows = []
    n_params = sum(int(np.prod(s)) for _, s in shapes)
    for label, cls, kw in configs:
        if cls is ZeroAdamW:
            kw = dict(kw, group=g)
        params, opt = build(cls, shapes, cp, g.rank, **kw)

        def body():
            _, scale = opt.clip_grad_norm(1.0)
            opt.step(grad_scale=scale)

        step = CapturedStep(body, warmup=2)
        g.barrier()
        ms = slowest(g, time_calls(cp, step, 1, repeats, warmup=3))
        phases = [float("nan")] * 3
        if cls is ZeroAdamW:
            ph = []
            for _ in range(repeats):
                ev = [cp.cuda.Event() for _ in range(4)]
                g.barrier()
                ev[0].record()
                opt.reduce_gradients()
                ev[1].record()
                _, scale = opt.clip_grad_norm(1.0)
                ev[2].record()
                opt.step(grad_scale=scale)
                ev[3].record()
                ev[3].synchronize()
                ph.append([cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) for i in range(3)])
            phases = [slowest(g, statistics.median(p[i] for p in ph)) for i in range(3)]
        else:
            ph = []
            for _ in range(repeats):
                ev = [cp.cuda.Event() for _ in range(3)]
                ev[0].record()
                _, scale = opt.clip_grad_norm(1.0)
                ev[1].record()
                opt.step(grad_scale=scale)
                ev[2].record()
                ev[2].synchronize()
                ph.append([cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) for i in range(2)])
            phases = [0.0, statistics.median(p[0] for p in ph), statistics.median(p[1] for p in ph)]
        rows.append((label, ms, *phases, opt_bytes(opt) / 1e9, opt_bytes(opt) / n_params))
        del step, params, opt, body
        cp.get_default_memory_pool().free_all_blocks()
    return rows, n_params


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1e6,1.6e7,1.34e8,1.5e9", help="collective sizes in elements")
    ap.add_argument("--fp32", action="store_true", help="also time fp32 collectives")
    ap.add_argument("--layers", type=int, default=16, help="LLaMA layers for the optimizer step (16: 1.5e9)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="sizes 1e6,1.6e7; 2 layers; 3 repeats")
    ap.add_argument("--skip-collectives", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--ab", default="", help="also the 2^25-bucket step with these module settings, e.g. "
                    "'zero.ADAM_OCCUPANCY=8' (';' between rows; see benchmarks/ab.py)")
    a = ap.parse_args()
    if a.quick:
        a.sizes, a.layers, a.repeats = "1e6,1.6e7", 2, 3
    import cupy as cp

    g = dist.init_process_group()
    N, rank = g.world_size, g.rank
    say = print if rank == 0 else (lambda *x, **k: None)
    say(f"# bench_dist: {N} rank(s), GPU {cp.cuda.runtime.getDeviceProperties(g.device or 0)['name'].decode()}, "
        f"backend {g.backend}")
    if N > 1 and not a.skip_collectives:
        dtypes = [ck.bfloat16] + ([np.float32] if a.fp32 else [])
        rows = bench_collectives(g, cp, [float(s) for s in a.sizes.split(",")], dtypes, a.calls, a.repeats)
        say("\n| collective | dtype | elements | GB | ms | algbw GB/s | busbw GB/s |")
        say("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for op, dt, n, gb, ms, alg, bus in rows:
            say(f"| {op} | {dt} | {n:.3g} | {gb:.3f} | {ms:.3f} | {alg:.0f} | {bus:.0f} |")
    if not a.skip_step:
        shapes = llama_1b_shapes(layers=a.layers)
        one_d = lambda n, x: x.ndim < 2  # noqa: E731
        configs = [
            ("AdamW, 1 GPU (each rank alone)", AdamW, {}),
            ("ZeroAdamW fp32 wire, all fp32 gathered, 1 bucket", ZeroAdamW, {}),
            ("ZeroAdamW bf16 wire, 1-D fp32 gathered, 1 bucket", ZeroAdamW,
             dict(wire_dtype=ck.bfloat16, gather_fp32=one_d)),
            ("ZeroAdamW bf16 wire, 1-D fp32 gathered, 2^25 buckets", ZeroAdamW,
             dict(wire_dtype=ck.bfloat16, gather_fp32=one_d, bucket_elems=1 << 25)),
        ]
        rows, n_params = bench_step(g, cp, shapes, configs, a.repeats)
        import ab
        for setting in ab.rows(a.ab):
            with ab.applied(setting):
                more, _ = bench_step(g, cp, shapes, [(f"{configs[-1][0]}, {setting}",) + configs[-1][1:]], a.repeats)
            rows += more
        say(f"\nOptimizer step, LLaMA-3.2-1B shapes ({a.layers} layers, {n_params:.4g} parameters), {N} rank(s); "
            f"graph = clip + step replayed from a CUDA graph; phases eager")
        say("| optimizer | graph ms | reduce ms | norm ms | adam + gather ms | GB / GPU | B / param |")
        say("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for label, ms, red, nrm, upd, gb, bpp in rows:
            say(f"| {label} | {ms:.2f} | {red:.2f} | {nrm:.2f} | {upd:.2f} | {gb:.1f} | {bpp:.1f} |")
    g.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
