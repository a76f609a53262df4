"""Models, registered by Hugging Face ``model_type``: ``ck.from_pretrained(path)`` reads ``config.json`` and
builds the right class (or reads a trainer checkpoint / run folder). Adding a family is one file here (config,
blocks, name map, ``@register``), a config under ``examples/configs`` and a test."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..io import checkpoint as C
from ..io import hf_folder
from ..io import peft
from ..nn import init_context
from ..nn import lora
from .base import REGISTRY, CausalLM, ModelConfig, model_class, register
from .generate import GenerationMixin
from .gpt2 import GPT2, GPT2Config
from .llama import Llama, LlamaConfig
from .mistral import Mistral, MistralConfig
from .qwen2 import Qwen2, Qwen2Config
from .qwen3 import Qwen3, Qwen3Config


LORA_META = "lora"  # a LoRA run's checkpoint meta: {"config": LoraConfig fields, "base": {"path", "fingerprint"}}


def resolve_pretrained(path) -> tuple[str, Path]:
    """What :func:`from_pretrained` reads at ``path``: ``("hf", folder)`` for a Hugging Face folder (``config.json``;
    or one of its ``.safetensors`` files), ``("checkpoint", file)`` for a trainer checkpoint (``step_*.ckpt``), a
    run folder or its ``checkpoints/`` folder (the newest checkpoint), ``("adapter", folder)`` for a PEFT adapter
    folder (``adapter_config.json``; or a LoRA run folder without checkpoints: its ``adapter/``). A ValueError
    subclass naming the path otherwise."""
    p = Path(path)
    if hf_folder.is_hf_folder(p) or (p.is_file() and p.suffix == ".safetensors"):
        return "hf", hf_folder.folder_of(p)
    if peft.is_adapter_folder(p):
        return "adapter", p
    if p.is_file():
        return "checkpoint", p
    if p.is_dir():
        found = C.latest(p) or C.latest(p / "checkpoints")
        if found is None and peft.is_adapter_folder(p / "adapter"):
            return "adapter", p / "adapter"
        if found is None:
            raise C.CheckpointError(f"{p}: neither a Hugging Face folder (config.json) nor a run folder with "
                                    f"step_*.ckpt checkpoints (in it or in its checkpoints/)")
        return "checkpoint", found
    raise C.CheckpointError(f"{p}: no such file or folder (expected a Hugging Face folder, a trainer checkpoint "
                            f"step_*.ckpt or a run folder)")


def from_pretrained(path, *, xp=np, dtype=None, adapter=None, **kw):
    """A model from a Hugging Face folder, its class picked by ``config.json``'s ``model_type``, or from a trainer
    checkpoint (``step_*.ckpt``), a run folder or its ``checkpoints/`` folder (the newest checkpoint; its class
    from the checkpoint's model type). ``dtype=ck.bfloat16``: inference weights, no fp32 copy. Every name and
    shape is checked before anything is copied.

    LoRA: ``adapter`` names a PEFT adapter folder to add (``model.load_adapter``); a LoRA run's checkpoint (or run
    folder) gives its base (re-read from where the run read it, and checked to be the same weights) with the run's
    adapters; a PEFT adapter folder alone gives the base its ``base_model_name_or_path`` names with the adapter.
    The adapters stay unmerged (``model.merge_adapter()`` folds them in).

    Example::

        >>> model = ck.from_pretrained("runs/tiny")          # the run's newest checkpoint
        >>> model.save_pretrained("tiny-hf")                  # a Hugging Face folder (python -m cukernels.export)
        >>> model = ck.from_pretrained("Llama-3.2-1B", adapter="runs/lora/adapter", xp=cupy, dtype=ck.bfloat16)
    """
    kind, p = resolve_pretrained(path)
    if kind == "adapter":
        if adapter is not None:
            raise peft.PeftFormatError(f"adapter: {path} is itself an adapter folder; give the base model as the path")
        base = peft.read_config(p)["base_model_name_or_path"]
        if base is not None and not Path(base).exists() and (p / base).exists():
            base = p / base  # (a relative path written beside the adapter: "../base")
        if base is None or not Path(base).exists():
            raise peft.PeftFormatError(f"{p}: its base_model_name_or_path {base!r} is not a folder here; load it onto "
                                       f"its base: ck.from_pretrained(BASE, adapter={str(p)!r})")
        return from_pretrained(base, xp=xp, dtype=dtype, adapter=p, **kw)
    if kind == "hf":
        d, where = hf_folder.read_config(p)
        mt = d.get("model_type")
        if mt not in REGISTRY:
            raise hf_folder.HFFormatError(f"{where}: model_type {mt!r} is not supported; supported: "
                                          f"{sorted(REGISTRY)}")
        return REGISTRY[mt].from_pretrained(path, xp=xp, dtype=dtype, adapter=adapter, **kw)
    arrays, meta = C.read_training(p)  # (verifies the file's checksum first)
    if isinstance(meta.get(LORA_META), dict):
        if adapter is not None:
            raise C.CheckpointError(f"adapter: {p} is a LoRA run's checkpoint, which has its adapters already")
        return _lora_checkpoint(p, arrays, meta, xp, dtype, kw)
    mt = meta.get("model_type")
    if mt not in REGISTRY:
        raise C.CheckpointError(f"{p}: model_type {mt!r} is not supported; supported: {sorted(REGISTRY)}")
    cls = REGISTRY[mt]
    try:
        config = cls.config_class.from_dict(meta.get("model_config") or {}, strict=False)
    except (TypeError, ValueError) as e:
        raise C.CheckpointError(f"{p}: its model config does not load: {e}") from None
    with init_context(empty=True, dtype=dtype):
        model = cls(config, xp=xp, **kw)
    sd = C.model_arrays(arrays)
    C.check_compatible(p, sd, model.state_dict(), "model", dtypes=False)  # (the dtype converts on load)
    model.load_state_dict(sd)
    if adapter is not None:
        model.load_adapter(adapter)
    return model


def lora_base(path, meta):
    """``(base path, its fingerprint)`` recorded in a LoRA run's checkpoint ``meta``, after checking the base is
    there and holds the same weights the run trained on (``cukernels.io.peft.base_fingerprint``); CheckpointError
    naming both otherwise."""
    try:
        base = meta[LORA_META]["base"]
        bp, fp = str(base["path"]), str(base["fingerprint"])
    except (KeyError, TypeError):
        raise C.CheckpointError(f"{path}: malformed LoRA meta (expected lora.base.path and .fingerprint)") from None
    if not Path(bp).exists():
        raise C.CheckpointError(f"{path}: the adapters of this LoRA run apply to the base model at {bp}, which is "
                                f"not there (init_from of the run); put it back, or load the run's adapter/ folder "
                                f"onto it: ck.from_pretrained(BASE, adapter=RUN/adapter)")
    now = peft.base_fingerprint(bp)
    if now != fp:
        raise C.CheckpointError(f"{path}: the base model at {bp} is not the one this LoRA run trained on (weights "
                                f"fingerprint {now}, the run recorded {fp}): its adapters would apply to other "
                                f"weights")
    return bp, fp


def _lora_checkpoint(p, arrays, meta, xp, dtype, kw):
    """The base of a LoRA run's checkpoint with the run's adapters (unmerged)."""
    bp, _ = lora_base(p, meta)
    model = from_pretrained(bp, xp=xp, dtype=dtype, **kw)
    try:
        model.add_adapter(lora.LoraConfig(**meta[LORA_META]["config"]), init=False, strict=False)
        lora.load_lora_state_dict(model, C.model_arrays(arrays), where=str(p))
    except (TypeError, ValueError, KeyError) as e:
        raise C.CheckpointError(f"{p}: its LoRA adapters do not load onto {bp}: {e}") from None
    return model


__all__ = ["REGISTRY", "CausalLM", "GenerationMixin", "ModelConfig", "model_class", "register", "from_pretrained",
           "resolve_pretrained", "Llama", "LlamaConfig", "GPT2", "GPT2Config", "Qwen2", "Qwen2Config", "Qwen3",
           "Qwen3Config", "Mistral", "MistralConfig", "LORA_META", "lora_base"]
