"""Generation speed: the static engine (bf16 weights, static KV cache, one captured decode step per token,
split-KV decode attention, device sampling) against transformers' ``generate``.

    PYTHONPATH=. python benchmarks/bench_generate.py [--model llama|gpt2] [--batches 1,8,64] [--prompts 128,2048]
        [--new 256] [--vs-hf]

Model: the LLaMA-3.2-1B shape (tied embeddings, as released: 1.24e9 parameters) or GPT-2 124M, random bf16
weights (speed does not depend on the values; greedy decoding, no early stop). Prints prefill ms, decode tokens/s
(all rows) and the weight-read floor: every decode step reads all weights once, bytes / 4.2 TB/s.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

LLAMA_1B_TIED = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     tie_word_embeddings=True, max_position_embeddings=131072)
GPT2_124M = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0)
COPY_BW = 4.2e12


def build(name, cp):
    import cukernels as ck
    if name == "gpt2":
        return ck.GPT2(ck.GPT2Config(**GPT2_124M), xp=cp, dtype=ck.bfloat16)
    return ck.Llama(ck.LlamaConfig(**LLAMA_1B_TIED), xp=cp, dtype=ck.bfloat16)


REPS = 3  # timed generate() calls a row: the median (METHOD.md); session 6 saw a row's first call 3-6 % slower


def ours(model, B, T, new, cp, reps=None):
    """(prefill ms, decode tokens/s): medians of ``reps`` timed generate() calls after an untimed one."""
    from cukernels.generation import generate
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    prompt = rng.integers(0, V, (B, T))
    generate(model, prompt, 4, temperature=0)  # compile, cache rope tables
    pre, tps = [], []
    for _ in range(reps or REPS):
        st = {}
        cp.cuda.Device().synchronize()
        generate(model, prompt, new, temperature=0, stats=st)
        pre.append(st["prefill_s"] * 1e3)
        tps.append(B * (st["new_tokens"] - 1) / st["decode_s"])
    return float(np.median(pre)), float(np.median(tps))


def hf(name, B, T, new, mode):
    import torch
    import transformers
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(**GPT2_124M)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(**LLAMA_1B_TIED)
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to("cuda", torch.bfloat16).eval()
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if mode == "static-compile":
        # transformers >= 4.48 compiles the forward itself when generate() runs on a static cache (its own
        # compile_config); wrapping forward in torch.compile(mode="reduce-overhead") as well made transformers 5.17
        # fail on the H200 ("accessing tensor output of CUDAGraphs that has been overwritten", session 3).
        kw["cache_implementation"] = "static"
    ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
    with torch.no_grad():
        for _ in range(2):  # warm-up (compile)
            model.generate(ids, **dict(kw, max_new_tokens=8, min_new_tokens=8))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return B * new / dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompts", default="128,2048")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--vs-hf", action="store_true", help="transformers generate at batch 1, prompt 128")
    ap.add_argument("--generic", action="store_true",
                    help="also batch 1, prompt 128 through the generic forward (model.fast_decode = False)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="also batch 1, prompt 128 with programmatic dependent launch off, and with the GEMV's "
                         "L2 prefetch varied (gemv.PREFETCH_KB)")
    ap.add_argument("--reps", type=int, default=REPS, help="timed runs a row (the median is printed)")
    ap.add_argument("--ab", default="",
                    help="also batch 1, prompt 128 with each of these settings in turn, e.g. "
                         "'gemv.DEPTH=2;gemv.DEPTH=2,gemv.DEPTH_LONG=2' (';' between rows, ',' between the "
                         "settings of one row; see benchmarks/ab.py)")
    ap.add_argument("--hf-worker", choices=["eager", "static-compile"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    globals()["REPS"] = max(1, a.reps)
    if a.hf_worker:  # (a child of --vs-hf: transformers alone in this process)
        print(f"HF {hf(a.model, 1, 128, a.new, a.hf_worker):.3f}", flush=True)
        return
    import cupy as cp
    model = build(a.model, cp)
    wbytes = sum(p.data.nbytes for p in model.parameters())
    floor = COPY_BW / wbytes
    print(f"{a.model}: {model.num_parameters() / 1e9:.3f}e9 params, {wbytes / 1e9:.2f} GB of bf16 weights: "
          f"floor {wbytes / COPY_BW * 1e3:.3f} ms per decode step = {floor:,.0f} steps/s")
    print(f"{'batch':>5} {'prompt':>6} {'prefill ms':>11} {'decode tok/s':>13} {'ms/step':>8} {'% of floor':>10}")
    for B in [int(b) for b in a.batches.split(",")]:
        for T in [int(t) for t in a.prompts.split(",")]:
            try:
                pre, tps = ours(model, B, T, a.new, cp)
            except Exception as e:  # report and go on (e.g. memory at B64 x 2048)
                print(f"{B:5d} {T:6d}  failed: {type(e).__name__}: {e}")
                continue
            step_ms = B / tps * 1e3
            print(f"{B:5d} {T:6d} {pre:11.2f} {tps:13,.0f} {step_ms:8.3f} {100 * (1e3 / step_ms) / floor:9.1f}%",
                  flush=True)
    if a.pdl_ab:  # the same fused step with programmatic dependent launch off (plain launches)
        from cukernels.ops import _launch
        _launch.PDL = False
        pre, tps = ours(model, 1, 128, a.new, cp)
        print(f"    1    128 {pre:11.2f} {tps:13,.0f} {1e3 / tps:8.3f} {100 * tps / floor:9.1f}%   "
              f"(programmatic dependent launch off)", flush=True)
        _launch.PDL = True
        from cukernels.ops import gemv as gmod
        for what, mod, attr, val in (("gemv.PREFETCH_KB = 0", gmod, "PREFETCH_KB", 0),
                                     ("gemv.PREFETCH_KB = 2", gmod, "PREFETCH_KB", 2),
                                     ("gemv.PREFETCH_KB = 8", gmod, "PREFETCH_KB", 8)):
            old = getattr(mod, attr)
            setattr(mod, attr, val)
            pre, tps = ours(model, 1, 128, a.new, cp)
            print(f"    1    128 {pre:11.2f} {tps:13,.0f} {1e3 / tps:8.3f} {100 * tps / floor:9.1f}%   ({what})",
                  flush=True)
            setattr(mod, attr, old)
    import ab
    for setting in ab.rows(a.ab):
        with ab.applied(setting):
            pre, tps = ours(model, 1, 128, a.new, cp)
        print(f"    1    128 {pre:11.2f} {tps:13,.0f} {1e3 / tps:8.3f} {100 * tps / floor:9.1f}%   ({setting})",
              flush=True)
    if a.generic:  # the same step through the generic forward (no fused per-block decode), batch 1, prompt 128
        model.fast_decode = False
        pre, tps = ours(model, 1, 128, a.new, cp)
        print(f"    1    128 {pre:11.2f} {tps:13,.0f} {1e3 / tps:8.3f} {100 * tps / floor:9.1f}%   "
              f"(generic forward, fast_decode=False)", flush=True)
        model.fast_decode = True
    if a.vs_hf:
        del model
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
        # Each transformers run in a fresh process: in this one (CuPy's pools and modules loaded) session 4
        # measured 16 tok/s eager and 7 static-compile, 6-20x under what a clean process gives on the same GPU.
        import subprocess
        for mode in ("eager", "static-compile"):
            r = subprocess.run([sys.executable, __file__, "--hf-worker", mode, "--model", a.model, "--new",
                                str(a.new)], capture_output=True, text=True)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("HF ")]
            if r.returncode == 0 and line:
                tps = float(line[-1].split()[1])
                print(f"transformers generate ({mode}), batch 1, prompt 128: {tps:,.0f} tok/s "
                      f"(its own process)", flush=True)
            else:
                print(f"transformers generate ({mode}): failed: {(r.stderr or r.stdout).strip()[-400:]}")


if __name__ == "__main__":
    main()
