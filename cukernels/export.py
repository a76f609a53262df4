"""A training run (or any checkpoint we read) as a Hugging Face folder:

    python -m cukernels.export runs/tiny tiny-hf                 # a run folder: its newest checkpoint
    python -m cukernels.export runs/tiny/checkpoints/step_00000120.ckpt tiny-hf --dtype bfloat16
    python -m cukernels.export runs/llmc gpt2-hf --tokenizer path/to/gpt2     # copies its tokenizer files
    python -m cukernels.export runs/lora lora-merged-hf         # a LoRA run: its base with the adapters merged in
    python -m cukernels.export path/to/Llama-3.2-1B merged-hf --adapter runs/lora/adapter

The folder is ``config.json`` (with ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``: the tokenizer's, or
null) and ``model.safetensors``, plus the tokenizer's files when the run has one (``--tokenizer``, or a
``tokenizer.json`` in the run folder); ``ck.from_pretrained(folder)`` and transformers'
``AutoModelForCausalLM.from_pretrained(folder)`` load it. A 256-token model (the byte-level text runs) needs no
tokenizer file: ``ck.Tokenizer.from_pretrained(folder)`` gives the byte tokenizer. LoRA adapters (a LoRA run's, or
``--adapter FOLDER`` in PEFT's format) are merged into the weights (``model.merge_adapter()``: W += s B A), and the
base's tokenizer files come along when the run has none. From Python: :func:`export`.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

from . import _backend as B
from ._cli import UsageError, add_debug, run
from .io.checkpoint import CheckpointError
from .io.hf_folder import SPECIAL_IDS, HFFormatError
from .io.peft import PeftFormatError, is_adapter_folder
from .models import from_pretrained, resolve_pretrained
from .tokenizer import ByteTokenizer, Tokenizer

__all__ = ["export", "find_tokenizer"]

DTYPES = {"float32": np.float32, "bfloat16": B.bfloat16, "float16": np.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _run_folder(ckpt: Path) -> Path:
    """The run folder of a trainer checkpoint (``<run>/checkpoints/step_N.ckpt`` or ``<run>/step_N.ckpt``)."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def find_tokenizer(path, vocab_size, tokenizer=None, base=None):
    """The tokenizer of what ``path`` names (:func:`cukernels.models.resolve_pretrained`), or None: ``tokenizer``
    (a folder with ``tokenizer.json``) when given; else the Hugging Face folder's ``tokenizer.json``, or one in a
    checkpoint's run folder, or in ``base`` (a LoRA model's base folder: ``model.base_path``); else the byte
    tokenizer for a 256-token model. UsageError when the tokenizer cannot be read or has more tokens than the
    model."""
    kind, p = resolve_pretrained(path)
    folder = Path(tokenizer) if tokenizer is not None else (p if kind == "hf" else _run_folder(p))
    if tokenizer is None and not (folder / "tokenizer.json").is_file() and base is not None:
        b = Path(base)
        b = b if b.is_dir() else _run_folder(b)
        if (b / "tokenizer.json").is_file():
            folder = b
    what = "--tokenizer" if tokenizer is not None else str(folder)
    if tokenizer is not None or (folder / "tokenizer.json").is_file():
        try:
            tok = Tokenizer.from_pretrained(folder)
        except (ValueError, ImportError, TypeError) as e:
            raise UsageError(f"{what}: {e}") from None
        if tok.vocab_size > vocab_size:
            raise UsageError(f"{what}: the tokenizer has {tok.vocab_size} tokens, the model {vocab_size}: not this "
                             f"model's tokenizer")
        return tok
    return ByteTokenizer() if vocab_size == ByteTokenizer.vocab_size else None


def describe_source(path) -> str:
    kind, p = resolve_pretrained(path)
    return {"hf": "Hugging Face folder", "adapter": "PEFT adapter folder"}.get(kind, "trainer checkpoint") + f" {p}"


def export(src, out_dir, *, dtype=np.float32, tokenizer=None, overwrite=False, adapter=None):
    """Write the model of ``src`` (a run folder, a trainer checkpoint, or a Hugging Face folder) into ``out_dir`` as
    a Hugging Face folder; returns ``(out_dir as a Path, the tokenizer found or None)``. The special-token ids the
    model's config lacks come from the tokenizer (:func:`find_tokenizer`), whose files are copied beside the
    weights. ``out_dir`` must be new or empty (``overwrite``: or an earlier export). LoRA adapters -- a LoRA run's,
    or ``adapter`` (a PEFT folder) -- are merged into the weights first."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT_DIR {out}: is a file; give a folder to create")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UsageError(f"OUT_DIR {out}: exists and is not empty; give a new folder (or --overwrite to replace "
                         f"an earlier export)")
    if np.dtype(dtype) not in {np.dtype(d) for d in DTYPES.values()}:
        raise UsageError(f"--dtype: expected one of {list(DTYPES)}; got {dtype!r}")
    if adapter is not None and not is_adapter_folder(adapter):
        raise UsageError(f"--adapter {adapter}: not a PEFT adapter folder (no adapter_config.json)")
    model = from_pretrained(src, xp=np, fused=False, adapter=adapter)
    if model.has_adapter():
        model.merge_adapter()
    tok = find_tokenizer(src, model.config.vocab_size, tokenizer, base=model.base_path)
    for k in SPECIAL_IDS:  # the tokenizer's ids where the model's config has none
        if getattr(model.config, k, None) is None and getattr(tok, k, None) is not None:
            setattr(model.config, k, int(getattr(tok, k)))
    model.save_pretrained(out, dtype=dtype)
    if isinstance(tok, Tokenizer):
        for name in TOKENIZER_FILES:
            f = Path(tok.path) / name
            if f.is_file() and f.resolve() != (out / name).resolve():
                shutil.copyfile(f, out / name)
    return out, tok


def main(argv=None, prog="python -m cukernels.export"):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].rstrip(":") + ".",
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", metavar="RUN_DIR_OR_CKPT", help="a run folder (its newest checkpoint), a step_*.ckpt "
                                                              "file, or a Hugging Face folder")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face folder to write (new or empty)")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES), help="tensor dtype in the folder")
    ap.add_argument("--tokenizer", default=None, metavar="FOLDER",
                    help="a folder with the run's tokenizer.json (copied into OUT_DIR; its bos/eos/pad ids go into "
                         "config.json)")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT_DIR")
    ap.add_argument("--adapter", default=None, metavar="FOLDER", help="a PEFT LoRA adapter folder to merge in")
    add_debug(ap)
    a = ap.parse_args(argv)

    def body():
        what = describe_source(a.source)
        out, tok = export(a.source, a.out_dir, dtype=DTYPES[a.dtype], tokenizer=a.tokenizer, overwrite=a.overwrite,
                          adapter=a.adapter)
        tk = ("byte tokenizer (256 ids; no file needed)" if isinstance(tok, ByteTokenizer) else
              f"tokenizer files from {tok.path}" if tok is not None else "no tokenizer (ids in, ids out)")
        print(f"{what} -> {out} ({a.dtype}; {tk})\nload it with ck.from_pretrained({str(out)!r}) or "
              f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return run(body, debug=a.debug, user_errors=(CheckpointError, HFFormatError, PeftFormatError))


if __name__ == "__main__":
    sys.exit(main())
