#!/usr/bin/env python
"""Do our Qwen2 / Qwen3 / Mistral kernels compute transformers' logits on the GPU? (Issue 37.) Run on the GPU machine
(CuPy, PyTorch, transformers 5.x):

    PYTHONPATH=. python tests/gpu_families_check.py          # ~1 min; exit status 1 on any failure

For each family a small random model at shapes the kernels take (head_dim 64 / 128, windows shorter than the
sequences, Qwen3 with heads * head_dim != hidden, Qwen2 with q / k / v biases and a tied head; biases and norm
weights random too) is written by ``save_pretrained``, loaded by ``transformers.AutoModelForCausalLM`` (sdpa), and
compared on a left-padded batch (position_ids from the mask; only real positions compared):

* fp32: our CuPy fp32 path (materialised attention with the window) against transformers fp32: max error < 1e-4 of
  the largest logit;
* bf16 weights (``from_pretrained(..., dtype=ck.bfloat16)``: flash attention with the window, Qwen3's q / k norm on
  the packed heads) against transformers in bf16: max error < 6 % and mean < 1 % of the largest logit (two bf16
  computations of 2 layers);
* bf16 autocast over fp32 weights (the training path) against transformers under torch.autocast: the same bounds;
* greedy generation (our static engine: prefill, captured fused decode steps) against transformers' ``generate``:
  equal tokens, or a first difference at a near-tie of transformers' own logits (top-2 within 1 % of their spread);
* config.json: transformers reads our rope_theta, head_dim, layer types / windows and biases as we meant them.
"""
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cukernels as ck  # noqa: E402

FAIL = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        FAIL.append(what)


def build(name):
    base = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05, rope_theta=1e6)
    if name == "qwen2":  # head_dim 64, biases, tied, a window of 24 on layers >= 1
        c = ck.Qwen2Config(**base, tie_word_embeddings=True, use_sliding_window=True, sliding_window=24,
                           max_window_layers=1)
    elif name == "qwen3":  # 4 heads of 128 on 256 wide, q / k norm, a window of 32 on layer 2
        c = ck.Qwen3Config(**base, head_dim=128, tie_word_embeddings=True, use_sliding_window=True,
                           sliding_window=32, max_window_layers=2)
    else:  # head_dim 64, a window of 20 everywhere, untied
        c = ck.MistralConfig(**dict(base, rope_theta=1e4), head_dim=64, sliding_window=20)
    m = {"qwen2": ck.Qwen2, "qwen3": ck.Qwen3, "mistral": ck.Mistral}[name](c, seed=7, fused=False)
    rng = np.random.default_rng(1)
    for n, p in m.named_parameters():
        if n.endswith("norm.weight"):
            p.data[...] = 1 + 0.2 * rng.standard_normal(p.shape)
        elif n.endswith(".bias"):
            p.data[...] = 0.1 * rng.standard_normal(p.shape)
    return m


def left_padded(rng, lengths, T, V):
    ids = np.zeros((len(lengths), T), np.int64)
    mask = np.zeros((len(lengths), T), np.int64)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = rng.integers(0, V, n)
        mask[b, T - n:] = 1
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    return ids, mask, pos


def compare(got, want, mask, bound, what):
    keep = mask.astype(bool)
    scale = float(np.abs(want[keep]).max())
    err = np.abs(got.astype(np.float32) - want.astype(np.float32))[keep]
    if bound == "fp32":
        check(err.max() < 1e-4 * scale, f"{what}: max error {err.max() / scale:.2e} of the largest logit {scale:.2f}")
    else:
        check(err.max() < 0.06 * scale and err.mean() < 0.01 * scale,
              f"{what}: max error {err.max() / scale:.2e}, mean {err.mean() / scale:.2e} of the largest logit "
              f"{scale:.2f}")


def run(name, tmp):
    import cupy as cp
    import torch
    import transformers

    src = build(name)
    folder = Path(tmp) / name
    src.save_pretrained(folder)
    cfg = transformers.AutoConfig.from_pretrained(str(folder))
    c = src.config
    check(type(cfg).__name__.lower().startswith(name) and cfg.rope_parameters["rope_theta"] == c.rope_theta
          and getattr(cfg, "head_dim", c.hidden_size // c.num_attention_heads) == c.head_dim,
          f"{name}: transformers reads {type(cfg).__name__}, rope_theta, head_dim")
    windows = c.layer_windows()
    if name == "mistral":
        check(cfg.sliding_window == c.sliding_window, f"{name}: sliding_window {cfg.sliding_window}")
    else:
        theirs = [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
        check(theirs == windows, f"{name}: layer windows {theirs} (ours {windows})")
    rng = np.random.default_rng(3)
    ids, mask, pos = left_padded(rng, [61, 40, 9], 61, c.vocab_size)
    t = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    for prec in ("fp32", "bf16", "autocast"):
        dt = torch.float32 if prec != "bf16" else torch.bfloat16
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dt,
                                                                attn_implementation="sdpa").cuda().eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=prec == "autocast"):
            want = ref(t(ids), attention_mask=t(mask), position_ids=t(pos)).logits.float().cpu().numpy()
        del ref
        mine = ck.from_pretrained(folder, xp=cp, dtype=ck.bfloat16 if prec == "bf16" else None)
        with ck.no_grad(), ck.autocast(ck.bfloat16, enabled=prec == "autocast"):
            got = mine(cp.asarray(ids), attention_mask=cp.asarray(mask), position_ids=cp.asarray(pos)).data
        compare(cp.asnumpy(got.astype(cp.float32)), want, mask, "fp32" if prec == "fp32" else "bf16",
                f"{name} {prec} logits")
    # greedy generation: our static engine against transformers' generate (bf16 both)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).cuda().eval()
    prompt = rng.integers(0, c.vocab_size, (1, 12))
    with torch.no_grad():
        theirs = ref.generate(t(prompt), max_new_tokens=48, do_sample=False, pad_token_id=0).cpu().numpy()
    mine = ck.from_pretrained(folder, xp=cp, dtype=ck.bfloat16)
    got = ck.generate(mine, prompt, 48, temperature=0)
    diff = np.nonzero(got[0] != theirs[0])[0]
    if diff.size == 0:
        check(True, f"{name}: 48 greedy tokens equal transformers'")
    else:
        i = int(diff[0])
        with torch.no_grad():
            lg = ref(t(theirs[:, :i])).logits[0, -1].float().cpu().numpy()
        top = np.sort(lg)[-2:]
        check(top[1] - top[0] < 0.01 * lg.std(), f"{name}: greedy tokens differ from transformers' at {i} with "
                                                 f"a top-2 margin of {top[1] - top[0]:.4f} (logit std {lg.std():.3f})")


def main():
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        print(f"needs PyTorch and transformers: {e}")
        return 1
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("qwen2", "qwen3", "mistral"):
            try:
                run(name, tmp)
            except Exception as e:  # a crash is a failure of that family, the others still run
                import traceback
                traceback.print_exc()
                check(False, f"{name}: {type(e).__name__}: {e}")
    print(f"\n{len(FAIL)} failure(s)" if FAIL else "\nall checks passed")
    return 1 if FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
