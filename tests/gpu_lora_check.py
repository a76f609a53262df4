#!/usr/bin/env python
"""Does the real PEFT load the adapters we write, and do we load PEFT's, with the same logits? Run where PyTorch,
transformers and PEFT are installed (the GPU machine):

    PYTHONPATH=. python tests/gpu_lora_check.py          # ~30 s; exit status 1 on any failure
    PYTHONPATH=. python tests/gpu_lora_check.py --cpu    # the same on the NumPy path (the bf16 rows skipped)

1. LLaMA (tests/fixtures/lora_llama/base): our LoRA run of a few AdamW steps on the GPU (fp32 base, so the check
   is exact to fp32 rounding), ``model.save_adapter``; ``peft.PeftModel.from_pretrained(LlamaForCausalLM, folder)``
   must give our logits (atol 1e-4), and PEFT's ``merge_and_unload`` our ``merge_adapter`` logits.
2. PEFT's own adapter (the fixture) loaded by us on the GPU in the trainer's setting -- bf16 base, bf16 autocast --
   against the fp32 logits PEFT computed (bf16 tolerance), and exactly (fp32) on the GPU without autocast.
3. A LoRA run of the trainer (``lora:`` section, GPU, bf16, ``graph: true``) on the fixture base: its
   ``<out_dir>/adapter/`` loaded by PEFT onto the fp32 base gives what our fp32 model with that adapter gives;
   ``python -m cukernels.export`` of the run (merged) loads in transformers with the same logits.
4. GPT-2 (Conv1D projections: PEFT's ``fan_in_fan_out``): adapters on c_attn and c_proj, saved by us, loaded by PEFT.
"""
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cukernels as ck  # noqa: E402
from cukernels.export import export  # noqa: E402
from cukernels.train import load_config, train  # noqa: E402

FIX = ROOT / "tests" / "fixtures" / "lora_llama"
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAILS = []
GPU = "--cpu" not in sys.argv
if GPU:
    import cupy as cp
else:
    cp = np  # (the NumPy path: the same calls)


def check(name, got, want, atol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.abs(got - want).max())
    ok = err <= atol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max |diff| {err:.2e} (atol {atol:g})", flush=True)
    if not ok:
        FAILS.append(name)


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def train_ours(model, ids, steps=4, autocast=False):
    opt = ck.optim.AdamW(model.trainable_parameters(), lr=2e-2, shadow_dtype=ck.bfloat16 if autocast else None)
    if autocast:
        ck.amp.attach_shadows(model.trainable_parameters(), opt)
    x, y = cp.asarray(ids[:, :-1]), cp.asarray(ids[:, 1:])
    for _ in range(steps):
        opt.zero_grad(lazy=True)
        with ck.autocast(ck.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        opt.step()
    return float(loss.data)


def llama(tmp, torch, peft, transformers):
    e = np.load(FIX / "expected.npz")
    ids = e["ids"]
    tid = torch.from_numpy(ids.astype(np.int64))

    def hf_base():
        return transformers.LlamaForCausalLM.from_pretrained(FIX / "base", dtype=torch.float32).eval()

    # 1. ours -> PEFT
    m = ck.from_pretrained(FIX / "base", xp=cp)
    m.add_adapter(r=4, alpha=8, target_modules=SEVEN, seed=1)
    loss = train_ours(m, ids)
    print(f"     our LoRA run: loss {loss:.4f} after 4 steps")
    m.eval()
    ours = host(m(cp.asarray(ids)).data)
    m.save_adapter(tmp / "ours")
    with torch.no_grad():
        pm = peft.PeftModel.from_pretrained(hf_base(), tmp / "ours")
        check("llama: PEFT loads our adapter, logits", pm(tid).logits.numpy(), ours, 1e-4)
        merged_theirs = pm.merge_and_unload()(tid).logits.numpy()
    m.merge_adapter()
    check("llama: our merge_adapter vs PEFT's merge_and_unload", host(m(cp.asarray(ids)).data), merged_theirs, 1e-4)

    # 2. PEFT's adapter -> ours on the GPU
    g = ck.from_pretrained(FIX / "base", xp=cp, adapter=FIX / "adapter")
    check("llama: PEFT's adapter on our GPU path, fp32", host(g(cp.asarray(ids)).data), e["logits"], 1e-4)
    if GPU:
        b = ck.from_pretrained(FIX / "base", xp=cp, dtype=ck.bfloat16, adapter=FIX / "adapter")
        with ck.autocast(ck.bfloat16):
            got = host(b(cp.asarray(ids)).data).astype(np.float32)
        check("llama: PEFT's adapter, bf16 base + autocast", got, e["logits"], 0.08)

    # 3. the trainer's LoRA run (bf16, graph) -> PEFT; the merged export -> transformers
    base = tmp / "base256"
    ck.Llama(ck.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
             seed=3).save_pretrained(base)
    run = tmp / "run"
    dev = ["device=gpu", "autocast=bf16", "graph=true"] if GPU else ["device=cpu"]
    train(load_config("tiny", [f"init_from={base}", "lora.r=8", "lora.alpha=16", *dev, "max_steps=6",
                               "eval_every=0", "log_every=2", "plot=false", "sample_chars=0", "batch_size=4",
                               "seq_len=32", "total_batch_size=128", f"out_dir={run}"]), quiet=True)
    ids2 = np.random.default_rng(0).integers(0, 256, (2, 20))
    ref = ck.from_pretrained(base, adapter=run / "adapter")  # fp32, NumPy
    want = ref(ids2).data
    with torch.no_grad():
        hb = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        pm = peft.PeftModel.from_pretrained(hb, run / "adapter")
        check("trainer run: PEFT loads <out_dir>/adapter", pm(torch.from_numpy(ids2)).logits.numpy(), want, 1e-4)
    export(run, tmp / "merged")
    with torch.no_grad():
        hm = transformers.AutoModelForCausalLM.from_pretrained(tmp / "merged", dtype=torch.float32).eval()
        check("trainer run: the merged export in transformers", hm(torch.from_numpy(ids2)).logits.numpy(), want,
              1e-4)


def gpt2(tmp, torch, peft, transformers):
    cfg = ck.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    m = ck.GPT2(cfg, seed=2, xp=cp)
    m.save_pretrained(tmp / "gpt2")
    m.add_adapter(r=4, alpha=4, target_modules=["c_attn", "c_proj"], seed=1)
    ids = np.random.default_rng(1).integers(0, 256, (2, 17))
    train_ours(m, ids)
    m.eval()
    ours = host(m(cp.asarray(ids)).data)
    m.save_adapter(tmp / "gpt2_adapter")
    with torch.no_grad():
        hb = transformers.GPT2LMHeadModel.from_pretrained(tmp / "gpt2", dtype=torch.float32).eval()
        pm = peft.PeftModel.from_pretrained(hb, tmp / "gpt2_adapter")
        check("gpt2: PEFT loads our adapter (Conv1D, fan_in_fan_out)", pm(torch.from_numpy(ids)).logits.numpy(), ours,
              1e-4)


def main():
    try:
        import peft
        import torch
        import transformers
    except ImportError as e:
        print(f"needs torch, transformers and peft: {e}")
        return 1
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")
    tmp = Path(tempfile.mkdtemp(prefix="lora_check_"))
    try:
        llama(tmp, torch, peft, transformers)
        gpt2(tmp, torch, peft, transformers)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("all checks passed" if not FAILS else f"FAILED: {FAILS}")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
