"""LoRA fine-tuning step against our full fine-tune and against PEFT + transformers, in one process.

    PYTHONPATH=. python benchmarks/bench_lora.py [--shape 1b|8b] [--r 16] [--steps 10] [--vs-peft eager,compile]
        [--no-full] [--json benchmarks/results/bench_lora.json] [--smoke]

``--shape 1b``: the LLaMA-3.2-1B shape of ``bench_train.py`` (untied, 1.50e9 parameters) at B8 x T1024, and our full
fine-tune of it (``bench_train.run_ours`` with every feature: fp32 master, AdamW, bf16 shadows, the step in a CUDA
graph) in the same run. ``--shape 8b``: the Llama-3.1-8B shape (32 layers, 4096 wide, FFN 14336, 32 / 8 heads, vocab
128256, untied) at B4 x T1024 (a full fine-tune does not fit one H200: 8.0e9 x 18 bytes).

Our LoRA step: the base built in bf16 (no fp32 copy), frozen; adapters of rank r (alpha 2r) on q, k, v, o, gate,
up, down of every block (``model.add_adapter``); AdamW over the adapters only (fp32 master, bf16 shadows), clip 1.0,
bf16 autocast, the whole step replayed from one CUDA graph; uniform random tokens copied into the step's buffers
before every step. The peer: ``transformers.LlamaForCausalLM`` in bf16 with ``peft.get_peft_model`` and the same
LoraConfig (PEFT keeps the adapters in fp32), ``torch.autocast(bf16)``, ``torch.optim.AdamW(fused=True)`` over the
trainable parameters, clip 1.0, HF's loss (``labels=ids``); ``eager`` as it comes, ``compile`` with
``torch.compile(model)``; each warmed up at the same shape. Prints ms/step (median of the synced steps), tok/s and
peak memory (ours: CuPy's pools' high-water marks, the build pool included; theirs:
``torch.cuda.max_memory_allocated``); ``--json`` writes the table with the machine, the command and the date.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

import bench_train as BT  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192},
                tie_word_embeddings=False, max_position_embeddings=131072)
SHAPES = {"1b": (BT.LLAMA_1B, 8, 1024), "8b": (LLAMA_8B, 4, 1024)}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WARM = 3


class LoraStep:
    """Our LoRA training step (see the module docstring), built in a pool of its own like the trainer's model."""

    def __init__(self, mcfg, B, T, r, *, graph=True):
        import cupy as cp

        import cukernels as ck

        self.cp, self.B, self.T = cp, B, T
        self.build_pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(self.build_pool.malloc):
            with ck.nn.init_context(dtype=ck.bfloat16):  # every base parameter made in bf16 directly
                model = ck.Llama(ck.LlamaConfig.from_dict(mcfg), xp=cp, seed=0)
            model.add_adapter(r=r, alpha=2 * r, target_modules=TARGETS, seed=0)
        params = model.trainable_parameters()
        opt = ck.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                             shadow_dtype=ck.bfloat16)
        ck.amp.attach_shadows(params, opt)
        gc.collect()
        self.build_pool.free_all_blocks()
        cp.get_default_memory_pool().free_all_blocks()
        self.model, self.opt, self.ck = model, opt, ck
        self.n_base = sum(p.size for p in model.parameters() if not p.requires_grad)
        self.n_train = sum(p.size for p in params)
        self.ids = cp.zeros((B, T), dtype=cp.int32)
        self.tgt = cp.zeros((B, T), dtype=cp.int32)
        self.step = ck.graph.CapturedStep(self._step, warmup=2, graph=graph)

    def _step(self):
        ck = self.ck
        self.opt.zero_grad(lazy=True)
        with ck.autocast(ck.bfloat16):
            loss = self.model(self.ids, self.tgt)
        loss.backward()
        norm, scale = self.opt.clip_grad_norm(1.0)
        self.opt.step(grad_scale=scale)
        return loss.data

    def run(self, steps, vocab):
        cp = self.cp
        rng = np.random.default_rng(0)
        times, losses = [], []
        for i in range(WARM + steps):
            self.ids.set(rng.integers(0, vocab, (self.B, self.T), dtype=np.int32))
            self.tgt.set(rng.integers(0, vocab, (self.B, self.T), dtype=np.int32))
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            loss = self.step()
            self.step.synchronize()
            if i >= WARM:
                times.append((time.perf_counter() - t0) * 1e3)
                losses.append(float(loss))
        return statistics.median(times), losses

    def peak_gib(self):
        return (self.cp.get_default_memory_pool().total_bytes() + self.step.pool.total_bytes()
                + self.build_pool.total_bytes()) / 2**30


def run_lora(mcfg, B, T, r, steps):
    import cupy as cp

    s = LoraStep(mcfg, B, T, r)
    ms, losses = s.run(steps, mcfg["vocab_size"])
    row = dict(impl="cukernels LoRA", ms=ms, tok_s=B * T / (ms / 1e3), peak_gib=s.peak_gib(), losses=losses,
               base_params=int(s.n_base), trainable=int(s.n_train))
    del s
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    return row


def run_peft(mcfg, B, T, r, steps, mode):
    """transformers + PEFT at the same shape and adapter config; (row, None) or (None, why not)."""
    import torch

    try:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as e:  # pragma: no cover - not installed
        return None, f"transformers / peft unavailable: {e}"
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    cfg = LlamaConfig(**mcfg)
    cfg._attn_implementation = "sdpa"  # PyTorch's fused attention (cuDNN / FlashAttention kernels)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the base made in bf16 directly (no fp32 copy: 32 GB at the 8B shape)
    try:
        with torch.device("cuda"):
            base = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGETS,
                                            task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    fwd = torch.compile(model) if mode == "compile" else model
    rng = np.random.default_rng(0)

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses = [], []
    for i in range(WARM + 2 + steps):  # (two more warm-up steps: compile's recompiles settle)
        ids = torch.from_numpy(rng.integers(0, mcfg["vocab_size"], (B, T))).to("cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(ids)
        torch.cuda.synchronize()
        if i >= WARM + 2:
            times.append((time.perf_counter() - t0) * 1e3)
            losses.append(float(loss.detach()))
    ms = statistics.median(times)
    row = dict(impl=f"PEFT + transformers, {mode}", ms=ms, tok_s=B * T / (ms / 1e3),
               peak_gib=torch.cuda.max_memory_allocated() / 2**30, losses=losses,
               trainable=int(sum(p.numel() for p in params)))
    del model, base, opt, fwd, params
    gc.collect()
    torch.cuda.empty_cache()
    return row, None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=list(SHAPES))
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=None, help="B (default 8 for 1b, 4 for 8b)")
    ap.add_argument("--seq", type=int, default=1024, help="T")
    ap.add_argument("--vs-peft", default="", help="comma list of eager,compile")
    ap.add_argument("--no-full", action="store_true", help="skip our full fine-tune row (1b)")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer, 1024-vocab model: checks every row runs")
    args = ap.parse_args(argv)
    mcfg, B, T = SHAPES[args.shape]
    B, T = args.batch or B, args.seq
    if args.smoke:
        mcfg = dict(mcfg, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
        BT.LLAMA_1B = mcfg
    import cupy as cp

    import cukernels as ck

    ck.matmul(cp.ones((1, 1), cp.float32), cp.ones((1, 1), cp.float32))  # the cuBLAS handle in the default pool
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {name}; {args.shape} shape at B{B} x T{T}; LoRA r={args.r}, alpha={2 * args.r} on "
          f"{', '.join(TARGETS)}; bf16 autocast, AdamW, clip 1.0; median of {args.steps} steps", flush=True)
    rows = []
    if args.shape == "1b" and not args.no_full:
        ms, losses, mem, n = BT.run_ours(B, T, BT.FEATURES, args.steps)
        rows.append(dict(impl="cukernels full fine-tune", ms=ms, tok_s=B * T / (ms / 1e3), peak_gib=mem,
                         losses=losses, trainable=int(n)))
        print(f"  {rows[-1]['impl']}: {ms:.2f} ms/step, peak {mem:.2f} GiB", flush=True)
    rows.append(run_lora(mcfg, B, T, args.r, args.steps))
    print(f"  {rows[-1]['impl']}: {rows[-1]['ms']:.2f} ms/step, peak {rows[-1]['peak_gib']:.2f} GiB "
          f"({rows[-1]['trainable'] / 1e6:.2f}M trainable)", flush=True)
    for mode in [m for m in args.vs_peft.split(",") if m]:
        if mode not in ("eager", "compile"):
            raise SystemExit(f"--vs-peft: expected eager, compile; got {mode!r}")
        row, why = run_peft(mcfg, B, T, args.r, args.steps, mode)
        if row is None:
            print(f"  PEFT {mode}: {why}", flush=True)
            continue
        rows.append(row)
        print(f"  {row['impl']}: {row['ms']:.2f} ms/step, peak {row['peak_gib']:.2f} GiB", flush=True)
    ours = next(r for r in rows if r["impl"] == "cukernels LoRA")
    full = next((r for r in rows if r["impl"] == "cukernels full fine-tune"), None)
    print(f"\n{'':<34} {'ms/step':>9} {'tok/s':>10} {'peak GiB':>9} {'ours x':>7}")
    for r in rows:
        print(f"{r['impl']:<34} {r['ms']:9.2f} {r['tok_s']:10,.0f} {r['peak_gib']:9.2f} {r['ms'] / ours['ms']:7.2f}")
    if full is not None:
        print(f"\nLoRA / full fine-tune: step {ours['ms'] / full['ms']:.3f}x (target <= 0.75), peak memory "
              f"{ours['peak_gib'] / full['peak_gib']:.3f}x (target <= 0.45)")
    if args.json:  # one table per shape, the newest run of each (the other shape's kept)
        path = Path(args.json)
        doc = json.loads(path.read_text()) if path.is_file() else {}
        doc = doc if doc.get("harness") == "bench_lora" else {"harness": "bench_lora", "shapes": {}}
        doc["shapes"][args.shape] = dict(
            command="python benchmarks/bench_lora.py " + " ".join(sys.argv[1:] if argv is None else argv),
            device=name, date=datetime.date.today().isoformat(), B=B, T=T, r=args.r, rows=rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
