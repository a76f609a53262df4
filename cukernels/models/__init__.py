"""Models, registered by Hugging Face ``model_type``: ``ck.from_pretrained(path)`` reads ``config.json`` and
builds the right class. Adding a family is one file here (config, blocks, name map, ``@register``), a config
under ``examples/configs`` and a test."""
from __future__ import annotations

import numpy as np

from ..io import hf_folder
from .base import REGISTRY, CausalLM, ModelConfig, model_class, register
from .generate import GenerationMixin
from .gpt2 import GPT2, GPT2Config
from .llama import Llama, LlamaConfig


def from_pretrained(path, *, xp=np, dtype=None, **kw):
    """A model from a Hugging Face folder, its class picked by ``config.json``'s ``model_type``
    (``dtype=ck.bfloat16``: inference weights, no fp32 copy)."""
    d, where = hf_folder.read_config(path)
    mt = d.get("model_type")
    if mt not in REGISTRY:
        raise hf_folder.HFFormatError(f"{where}: model_type {mt!r} is not supported; supported: {sorted(REGISTRY)}")
    return REGISTRY[mt].from_pretrained(path, xp=xp, dtype=dtype, **kw)


__all__ = ["REGISTRY", "CausalLM", "GenerationMixin", "ModelConfig", "model_class", "register", "from_pretrained",
           "Llama", "LlamaConfig", "GPT2", "GPT2Config"]
