#!/usr/bin/env python
"""Sample text from a LLaMA trained here (or loaded from Hugging Face weights), with a KV cache.

    python examples/generate.py --checkpoint runs/small/checkpoints/step_00001500.ckpt --prompt "ROMEO:"
    python examples/generate.py --checkpoint runs/small --prompt "ROMEO:" --temperature 0.8 --top-k 40 --seed 1
    python examples/generate.py --checkpoint path/to/Llama-3.2-1B --prompt-ids "128000 791 6864" --max-new-tokens 20

``--checkpoint``: a trainer checkpoint (``step_*.ckpt``), a run folder or its ``checkpoints/`` folder (the
newest checkpoint), or a Hugging Face folder (``config.json`` + ``model.safetensors`` / sharded index).
Models with a 256-token vocabulary use the byte tokenizer of our runs (text in, text out); any other
vocabulary takes token ids in (``--prompt-ids``) and prints token ids out.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cukernels as ck  # noqa: E402
from cukernels.data import ByteTokenizer  # noqa: E402
from cukernels.generation import generate, load_model  # noqa: E402

KERNEL_OPS = ["rms_norm", "attn_softmax", "embedding", "rope", "swiglu", "cross_entropy"]


def pick(device):
    if device == "cpu" or (device == "auto" and not ck.gpu_available()):
        return np
    if not ck.gpu_available():
        raise SystemExit("--device gpu: CuPy sees no CUDA device")
    import cupy
    return cupy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="trainer checkpoint / run folder / Hugging Face folder")
    ap.add_argument("--prompt", default=None, help="prompt text (byte-vocabulary models)")
    ap.add_argument("--prompt-ids", default=None, help="prompt token ids, space or comma separated")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--num-samples", type=int, default=1)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    ap.add_argument("--fused", default="auto", choices=["auto", "true", "false"],
                    help="kernel ops (auto: when all are present) or the composite of plain array ops")
    ap.add_argument("--autocast", action="store_true", help="bf16 GEMMs")
    ap.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every token")
    ap.add_argument("--eos-id", type=int, default=None, help="stop at this token id")
    ap.add_argument("--print-ids", action="store_true", help="print token ids, also for byte-vocabulary models")
    a = ap.parse_args(argv)

    xp = pick(a.device)
    fused = all(hasattr(ck, o) for o in KERNEL_OPS) if a.fused == "auto" else a.fused == "true"
    try:
        model, what = load_model(a.checkpoint, xp=xp, fused=fused)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    V = model.config.vocab_size
    tok = ByteTokenizer() if V == ByteTokenizer.vocab_size else None
    byte_io = tok is not None and not a.print_ids
    if a.prompt_ids is not None:
        ids = np.array([int(t) for t in a.prompt_ids.replace(",", " ").split()], dtype=np.int64)
    elif a.prompt is not None:
        if tok is None:
            raise SystemExit(f"the model's vocabulary has {V} tokens, not the 256 bytes of our runs: give the prompt "
                             f"as --prompt-ids")
        ids = tok.encode(a.prompt).astype(np.int64)
    else:
        ids = np.array([tok.encode("\n")[0] if tok else 0], dtype=np.int64)
    if ids.size == 0:
        raise SystemExit("empty prompt")
    print(f"# {what} | {model.num_parameters() / 1e6:.2f}M params | {xp.__name__} | fused {fused} | "
          f"{'no cache' if a.no_cache else 'kv cache'}", file=sys.stderr)
    rng = np.random.default_rng(a.seed)
    for i in range(a.num_samples):
        stream = None
        if byte_io:
            sys.stdout.write(tok.decode(ids))
            pending = []

            def stream(nxt, pending=pending):  # bytes may split a UTF-8 character: flush whole ones
                pending.append(int(nxt[0]))
                try:
                    s = bytes(pending).decode("utf-8")
                except UnicodeDecodeError:
                    if len(pending) < 4:
                        return
                    s = bytes(pending).decode("utf-8", errors="replace")
                pending.clear()
                sys.stdout.write(s)
                sys.stdout.flush()
        t0 = time.perf_counter()
        stats = {}
        out = generate(model, ids, a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, rng=rng,
                       use_cache=not a.no_cache, eos_token_id=a.eos_id,
                       autocast=ck.bfloat16 if a.autocast else None, on_token=stream, stats=stats,
                       seed=None if a.seed is None else a.seed + i)
        dt = time.perf_counter() - t0
        n = len(out) - len(ids)
        if not byte_io:
            print(" ".join(str(int(t)) for t in out))
        else:
            print()
        pre, dec = stats.get("prefill_s", 0.0), stats.get("decode_s", 0.0)
        print(f"# sample {i + 1}: {n} tokens in {dt:.2f} s | prefill {len(ids)} tokens {pre * 1e3:.1f} ms | decode "
              f"{max(n - 1, 0) / max(dec, 1e-9):.1f} tok/s", file=sys.stderr)
        if i + 1 < a.num_samples:
            print("-" * 40)


if __name__ == "__main__":
    main()
