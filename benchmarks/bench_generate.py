"""Generation speed: the static engine (bf16 weights, static KV cache, one captured decode step per token,
split-KV decode attention, device sampling) against transformers' ``generate``.

    PYTHONPATH=. python benchmarks/bench_generate.py [--model llama|gpt2] [--batches 1,8,64] [--prompts 128,2048]
        [--new 256] [--vs-hf [--hf-modes eager,static-compile,static-compile-forward]]

Model: the LLaMA-3.2-1B shape (tied embeddings, as released: 1.24e9 parameters) or GPT-2 124M, random bf16
weights (speed does not depend on the values; greedy decoding, no early stop). Prints prefill ms, decode tokens/s
(all rows) and the weight-read floor: every decode step reads all weights once, bytes / 4.2 TB/s.

``--vs-hf``: transformers' ``generate`` run as its documentation says to run it fast (the "Optimizing inference"
page: a static cache with the forward compiled, ``mode="reduce-overhead", fullgraph=True``), each mode of
``HF_MODES`` in a fresh process, side by side with ours at batch 1 and each ``--prompts`` length: tokens/s over the
whole generate() call (prefill included, ``B * new / wall time``), the median of ``--reps`` timed calls after
``HF_WARMUP`` untimed calls at exactly the timed lengths (batch, prompt, new tokens), so no timed call compiles,
records a CUDA graph or re-allocates a cache. (Before this, transformers was warmed up at 8 new tokens and timed
once at 256, so the static cache was rebuilt and the forward recompiled inside the timed call: 12 tok/s, where the
same mode warmed at the timed lengths gives 141 on the same H200.)
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


# transformers' generate modes (``--hf-modes``), each what a user of transformers writes for it.
HF_MODES = {
    "eager": "default dynamic cache, no compile",
    # transformers >= 4.48 compiles the forward itself when generate() runs on a static cache; its compile_config
    # set to the docs' torch.compile arguments.
    "static-compile": "cache_implementation='static', generate's own compile (CompileConfig(fullgraph=True, "
                      "mode='reduce-overhead'))",
    # The docs' recipe, word for word (transformers 5.17 failed in it once, "accessing tensor output of CUDAGraphs
    # that has been overwritten", when warmed at other lengths; reported as a failed row if it does again).
    "static-compile-forward": "cache_implementation='static', model.forward = torch.compile(model.forward, "
                              "mode='reduce-overhead', fullgraph=True)",
}
HF_WARMUP = 3  # untimed generate() calls at the timed lengths: compile, CUDA-graph warm-up and recording


def hf(name, B, T, new, mode, reps=None):
    """transformers ``generate`` (bf16, greedy, exactly ``new`` tokens after a ``T``-token prompt, batch ``B``) in
    ``mode`` (``HF_MODES``): the median tokens/s of ``reps`` timed calls (prefill included) after ``HF_WARMUP``
    calls at the same lengths. Returns (median tok/s, every timed call's tok/s)."""
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
        kw["cache_implementation"] = "static"
        CompileConfig = getattr(transformers, "CompileConfig", None)
        if CompileConfig is None:
            from transformers.generation.configuration_utils import CompileConfig
        kw["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
    elif mode == "static-compile-forward":
        kw["cache_implementation"] = "static"
        kw["disable_compile"] = True  # (generate's own compile would wrap the compiled forward again)
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    elif mode != "eager":
        raise ValueError(f"mode: expected one of {list(HF_MODES)}; got {mode!r}")
    ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
    mask = torch.ones_like(ids)
    tps = []
    with torch.no_grad():
        for i in range(HF_WARMUP + (reps or REPS)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, **kw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if out.shape != (B, T + new):
                raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {(B, T + new)}")
            if i >= HF_WARMUP:
                tps.append(B * new / dt)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return float(np.median(tps)), tps


def ours_e2e(model, B, T, new, cp, reps=None):
    """Our generate() timed as ``hf`` times transformers: median of ``B * new / wall time`` (prefill included) over
    ``reps`` calls after ``HF_WARMUP`` calls at the same lengths."""
    from cukernels.generation import generate
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (B, T))
    tps = []
    for i in range(HF_WARMUP + (reps or REPS)):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        out = generate(model, prompt, new, temperature=0)
        cp.cuda.Device().synchronize()
        dt = time.perf_counter() - t0
        if out.shape != (B, T + new):
            raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {(B, T + new)}")
        if i >= HF_WARMUP:
            tps.append(B * new / dt)
    return float(np.median(tps)), tps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompts", default="128,2048")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--vs-hf", action="store_true",
                    help="transformers generate side by side with ours at batch 1 and each --prompts length, "
                         "warmed at the same lengths, the median of --reps calls (see the header)")
    ap.add_argument("--hf-modes", default=",".join(HF_MODES),
                    help=f"transformers modes for --vs-hf, of {list(HF_MODES)}")
    ap.add_argument("--generic", action="store_true",
                    help="also batch 1, prompt 128 through the generic forward (model.fast_decode = False)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="also batch 1, prompt 128 with programmatic dependent launch off, and with the GEMV's "
                         "L2 prefetch varied (ck.settings.gemv_prefetch_kb)")
    ap.add_argument("--reps", type=int, default=REPS, help="timed runs a row (the median is printed)")
    ap.add_argument("--ab", default="",
                    help="also batch 1, prompt 128 with each of these settings in turn, e.g. "
                         "'gemv_depth=2;gemv_depth=2,gemv_depth_long=2' (';' between rows, ',' between the "
                         "settings of one row; see benchmarks/ab.py)")
    ap.add_argument("--hf-worker", choices=list(HF_MODES), help=argparse.SUPPRESS)
    ap.add_argument("--hf-prompt", type=int, default=128, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    globals()["REPS"] = max(1, a.reps)
    if a.hf_worker:  # (a child of --vs-hf: transformers alone in this process)
        med, runs = hf(a.model, 1, a.hf_prompt, a.new, a.hf_worker)
        print(f"HF {med:.3f} {','.join(f'{t:.3f}' for t in runs)}", flush=True)
        return
    hf_modes = [m for m in a.hf_modes.split(",") if m]
    for m in hf_modes:
        if m not in HF_MODES:
            ap.error(f"--hf-modes: expected modes of {list(HF_MODES)}; got {m!r}")
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
        import cukernels as ck
        with ck.settings(pdl=False):
            pre, tps = ours(model, 1, 128, a.new, cp)
        print(f"    1    128 {pre:11.2f} {tps:13,.0f} {1e3 / tps:8.3f} {100 * tps / floor:9.1f}%   "
              f"(programmatic dependent launch off)", flush=True)
        for kb in (0, 2, 8):
            with ck.settings(gemv_prefetch_kb=kb):
                pre, tps = ours(model, 1, 128, a.new, cp)
            print(f"    1    128 {pre:11.2f} {tps:13,.0f} {1e3 / tps:8.3f} {100 * tps / floor:9.1f}%   "
                  f"(gemv_prefetch_kb = {kb})", flush=True)
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
        prompts = [int(t) for t in a.prompts.split(",")]
        mine = {T: ours_e2e(model, 1, T, a.new, cp) for T in prompts}  # before the model goes
        del model
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
        # Each transformers run in a fresh process: in this one (CuPy's pools and modules loaded) transformers ran
        # 6-20x under what a clean process gives on the same GPU.
        import subprocess
        for T in prompts:
            print(f"\nside by side: batch 1, prompt {T}, {a.new} new tokens, greedy, bf16; tokens/s over the whole "
                  f"generate() call (prefill included), median of {REPS} after {HF_WARMUP} warm-up calls at these "
                  f"lengths; transformers {transformers_version()}, each mode in its own process", flush=True)
            ours_tps, ours_runs = mine[T]
            print(f"  {'cukernels (static engine)':<36} {ours_tps:9,.0f} tok/s   "
                  f"runs {', '.join(f'{t:,.0f}' for t in ours_runs)}", flush=True)
            best = None
            for mode in hf_modes:
                r = subprocess.run([sys.executable, __file__, "--hf-worker", mode, "--model", a.model, "--new",
                                    str(a.new), "--hf-prompt", str(T), "--reps", str(REPS)],
                                   capture_output=True, text=True)
                line = [ln for ln in r.stdout.splitlines() if ln.startswith("HF ")]
                if r.returncode == 0 and line:
                    _, med, runs = line[-1].split()
                    tps = float(med)
                    best = tps if best is None else max(best, tps)
                    print(f"  {'transformers ' + mode:<36} {tps:9,.0f} tok/s   runs "
                          f"{', '.join(f'{float(t):,.0f}' for t in runs.split(','))}   (cukernels "
                          f"{ours_tps / tps:.1f}x; {HF_MODES[mode]})", flush=True)
                else:
                    err = (r.stderr or r.stdout).strip().splitlines()
                    print(f"  {'transformers ' + mode:<36} failed: {' | '.join(err[-3:])[-400:]}", flush=True)
            if best:
                print(f"  cukernels / transformers' fastest mode: {ours_tps / best:.1f}x", flush=True)


def transformers_version():
    try:
        import importlib.metadata as md
        return md.version("transformers")
    except Exception:  # (not installed: every mode reports its failure)
        return "(not installed)"


if __name__ == "__main__":
    main()
