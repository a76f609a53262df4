"""Sample text from a model trained here or loaded from Hugging Face weights, with a KV cache, streaming it as it
is sampled:

    python -m cukernels.sample --checkpoint runs/tiny --prompt "ROMEO:" --max-new-tokens 200 --top-k 40
    python -m cukernels.sample --checkpoint path/to/Llama-3.2-1B --prompt "The capital of France is" --temperature 0
    python -m cukernels.sample --checkpoint path/to/Llama-3.2-1B --prompt-ids "128000 791 6864" --max-new-tokens 20
    python -m cukernels.sample --checkpoint path/to/Llama-3.2-1B --adapter runs/lora/adapter --prompt "Once upon"

(``examples/generate.py`` is the same command.) ``--checkpoint``: a trainer checkpoint (``step_*.ckpt``), a run
folder or its ``checkpoints/`` folder (the newest checkpoint), or a Hugging Face folder (``config.json`` +
``model.safetensors`` / a sharded index). ``--prompt`` text goes through the model's tokenizer: the folder's
``tokenizer.json`` (or ``--tokenizer FOLDER``), or the byte tokenizer of a 256-token model; the text is printed as
it is sampled. Without a tokenizer, token ids go in (``--prompt-ids``) and come out. The prompt and the new tokens
must fit the model's positions (``max_position_embeddings``; GPT-2's ``n_positions``). ``--adapter FOLDER`` adds a
PEFT LoRA adapter (PEFT's ``save_pretrained`` or a LoRA run's ``adapter/``); a LoRA run folder or checkpoint given as
``--checkpoint`` brings its base and adapters by itself. The adapters are merged into the weights before sampling
(the fused decode step applies; ``--no-merge`` keeps them apart), and the base's tokenizer is used when the run
has none.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import _backend as B
from ._cli import UsageError, add_debug, run
from .export import describe_source, find_tokenizer
from .io.checkpoint import CheckpointError
from .io.hf_folder import HFFormatError
from .io.peft import PeftFormatError, is_adapter_folder
from .models import from_pretrained
from .models.generate import generate
from .tokenizer import ByteTokenizer, TextStream


def pick_xp(device):
    if device == "cpu" or (device == "auto" and not B.gpu_available()):
        return np
    if not B.gpu_available():
        raise UsageError(f"--device {device}: CuPy sees no CUDA device (--device cpu runs the NumPy path)")
    import cupy
    return cupy


def prompt_ids(a, tok, V):
    """The prompt as a list of ids: ``--prompt-ids``, ``--prompt`` through the tokenizer, or the tokenizer's BOS
    (a newline for the byte tokenizer, else id 0)."""
    if a.prompt_ids is not None:
        try:
            ids = [int(t) for t in a.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise UsageError(f"--prompt-ids: expected integer token ids separated by spaces or commas; got "
                             f"{a.prompt_ids!r}") from None
        bad = [i for i in ids if not 0 <= i < V]
        if bad:
            raise UsageError(f"--prompt-ids: token id {bad[0]} is outside the model's vocabulary (0..{V - 1})")
    elif a.prompt is not None:
        if tok is None:
            raise UsageError(f"--prompt: the model has {V} tokens and no tokenizer was found (no tokenizer.json in "
                             f"the folder): give --tokenizer FOLDER, or the prompt as --prompt-ids")
        ids = list(tok.encode(a.prompt))
    elif tok is not None and tok.bos_token_id is not None:
        ids = [tok.bos_token_id]
    else:
        ids = [10] if isinstance(tok, ByteTokenizer) else [0]
    if not ids:
        raise UsageError("--prompt: empty (it gave no tokens); give some text or --prompt-ids")
    return ids


def _printer(stream):
    """``on_token`` for a batch of one: the text the new id makes printable, written at once."""
    def on_token(nxt):
        sys.stdout.write(stream.push(int(nxt[0])))
        sys.stdout.flush()
    return on_token


def main(argv=None, prog="python -m cukernels.sample"):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].rstrip(":") + ".",
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="trainer checkpoint / run folder / Hugging Face folder")
    ap.add_argument("--adapter", default=None, metavar="FOLDER", help="a PEFT LoRA adapter folder to add")
    ap.add_argument("--no-merge", action="store_true", help="keep LoRA adapters unmerged (slower decoding)")
    ap.add_argument("--prompt", default=None, help="prompt text (through the model's tokenizer)")
    ap.add_argument("--prompt-ids", default=None, help="prompt token ids, space or comma separated")
    ap.add_argument("--tokenizer", default=None, metavar="FOLDER", help="a folder with tokenizer.json (default: the "
                                                                        "model's folder, or the byte tokenizer)")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="at most the model's positions minus the prompt")
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--num-samples", type=int, default=1)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu", "cuda"], help="cuda is gpu")
    ap.add_argument("--fused", default="true", choices=["auto", "true", "false"],
                    help="kernel ops (true, auto) or the composite of plain array ops")
    ap.add_argument("--autocast", action="store_true", help="bf16 GEMMs")
    ap.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every token")
    ap.add_argument("--eos-id", type=int, default=None,
                    help="stop at this token id (default: the tokenizer's end token, if it has one; -1: never stop)")
    ap.add_argument("--print-ids", action="store_true", help="print token ids, also when there is a tokenizer")
    add_debug(ap)
    a = ap.parse_args(argv)
    return run(lambda: _sample(a), debug=a.debug, user_errors=(CheckpointError, HFFormatError, PeftFormatError))


def _sample(a):
    if a.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens: expected an integer >= 0; got {a.max_new_tokens}")
    if a.num_samples < 1:
        raise UsageError(f"--num-samples: expected an integer >= 1; got {a.num_samples}")
    if a.top_k is not None and a.top_k < 1:
        raise UsageError(f"--top-k: expected an integer >= 1; got {a.top_k}")
    if a.temperature < 0:
        raise UsageError(f"--temperature: expected a number >= 0; got {a.temperature}")
    xp = pick_xp("gpu" if a.device == "cuda" else a.device)
    fused = a.fused != "false"
    what = describe_source(a.checkpoint)
    if a.adapter is not None and not is_adapter_folder(a.adapter):
        raise UsageError(f"--adapter {a.adapter}: not a PEFT adapter folder (no adapter_config.json)")
    model = from_pretrained(a.checkpoint, xp=xp, fused=fused, adapter=a.adapter)
    if model.has_adapter():
        what += f" + LoRA adapter{' (merged)' if not a.no_merge else ''}"
        if not a.no_merge:
            model.merge_adapter()
    V, P = model.config.vocab_size, model.max_positions()
    tok = find_tokenizer(a.checkpoint, V, a.tokenizer, base=model.base_path)
    ids = prompt_ids(a, tok, V)
    if len(ids) + a.max_new_tokens > P:
        raise UsageError(f"--max-new-tokens: the prompt's {len(ids)} tokens + {a.max_new_tokens} new ones exceed the "
                         f"model's {P} positions; at most {max(P - len(ids), 0)} new tokens")
    eos = a.eos_id
    if eos is None:
        eos = getattr(tok, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos == -1:
        eos = None
    if isinstance(eos, int) and not 0 <= eos < V:
        raise UsageError(f"--eos-id: {eos} is outside the model's vocabulary (0..{V - 1}; -1: never stop)")
    text_out = tok is not None and not a.print_ids
    print(f"# {what} | {model.num_parameters() / 1e6:.2f}M params | {xp.__name__} | fused {fused} | "
          f"{'no cache' if a.no_cache else 'kv cache'} | {type(tok).__name__ if tok else 'no tokenizer'}",
          file=sys.stderr)
    rng = np.random.default_rng(a.seed)
    prompt = np.array(ids, dtype=np.int64)
    for i in range(a.num_samples):
        stream = TextStream(tok) if text_out else None
        if stream is not None:
            sys.stdout.write("".join(stream.push(t) for t in ids))  # the prompt as the tokenizer writes it
            sys.stdout.flush()
        t0 = time.perf_counter()
        stats = {}
        out = generate(model, prompt, a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, rng=rng,
                       use_cache=not a.no_cache, eos_token_id=eos, autocast=B.bfloat16 if a.autocast else None,
                       on_token=None if stream is None else _printer(stream), stats=stats,
                       seed=None if a.seed is None else a.seed + i)
        dt = time.perf_counter() - t0
        n = len(out) - len(ids)
        if stream is not None:
            print(stream.flush())
        else:
            print(" ".join(str(int(t)) for t in out))
        pre, dec = stats.get("prefill_s", 0.0), stats.get("decode_s", 0.0)
        print(f"# sample {i + 1}: {n} tokens in {dt:.2f} s | prefill {len(ids)} tokens {pre * 1e3:.1f} ms | decode "
              f"{max(n - 1, 0) / max(dec, 1e-9):.1f} tok/s", file=sys.stderr)
        if i + 1 < a.num_samples:
            print("-" * 40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
