"""Models, registered by Hugging Face ``model_type``: ``ck.from_pretrained(path)`` reads ``config.json`` and
builds the right class (or reads a trainer checkpoint / run folder). Adding a family is one file here (config,
blocks, name map, ``@register``), a config under ``examples/configs`` and a test."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..io import checkpoint as C
from ..io import hf_folder
from ..nn import init_context
from .base import REGISTRY, CausalLM, ModelConfig, model_class, register
from .generate import GenerationMixin
from .gpt2 import GPT2, GPT2Config
from .llama import Llama, LlamaConfig


def resolve_pretrained(path) -> tuple[str, Path]:
    """What :func:`from_pretrained` reads at ``path``: ``("hf", folder)`` for a Hugging Face folder (``config.json``;
    or one of its ``.safetensors`` files), ``("checkpoint", file)`` for a trainer checkpoint (``step_*.ckpt``), a
    run folder or its ``checkpoints/`` folder (the newest checkpoint). A ValueError subclass naming the path
    otherwise."""
    p = Path(path)
    if hf_folder.is_hf_folder(p) or (p.is_file() and p.suffix == ".safetensors"):
        return "hf", hf_folder.folder_of(p)
    if p.is_file():
        return "checkpoint", p
    if p.is_dir():
        found = C.latest(p) or C.latest(p / "checkpoints")
        if found is None:
            raise C.CheckpointError(f"{p}: neither a Hugging Face folder (config.json) nor a run folder with "
                                    f"step_*.ckpt checkpoints (in it or in its checkpoints/)")
        return "checkpoint", found
    raise C.CheckpointError(f"{p}: no such file or folder (expected a Hugging Face folder, a trainer checkpoint "
                            f"step_*.ckpt or a run folder)")


def from_pretrained(path, *, xp=np, dtype=None, **kw):
    """A model from a Hugging Face folder, its class picked by ``config.json``'s ``model_type``, or from a trainer
    checkpoint (``step_*.ckpt``), a run folder or its ``checkpoints/`` folder (the newest checkpoint; its class
    from the checkpoint's model type). ``dtype=ck.bfloat16``: inference weights, no fp32 copy. Every name and
    shape is checked before anything is copied.

    Example::

        >>> model = ck.from_pretrained("runs/tiny")          # the run's newest checkpoint
        >>> model.save_pretrained("tiny-hf")                  # a Hugging Face folder (python -m cukernels.export)
    """
    kind, p = resolve_pretrained(path)
    if kind == "hf":
        d, where = hf_folder.read_config(p)
        mt = d.get("model_type")
        if mt not in REGISTRY:
            raise hf_folder.HFFormatError(f"{where}: model_type {mt!r} is not supported; supported: "
                                          f"{sorted(REGISTRY)}")
        return REGISTRY[mt].from_pretrained(path, xp=xp, dtype=dtype, **kw)
    arrays, meta = C.read_training(p)  # (verifies the file's checksum first)
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
    return model


__all__ = ["REGISTRY", "CausalLM", "GenerationMixin", "ModelConfig", "model_class", "register", "from_pretrained",
           "resolve_pretrained", "Llama", "LlamaConfig", "GPT2", "GPT2Config"]
