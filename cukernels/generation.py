"""Text generation: ``ck.generate`` / ``model.generate`` (the engines live in ``cukernels/models/generate.py``, the
models layer, so that ``generate`` is a method of the model classes), and :func:`load_model`: a model from any
checkpoint we write or read (a Hugging Face folder, a trainer checkpoint, a run folder).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .io import checkpoint as C
from .io import hf_folder
from .models import from_pretrained, model_class
from .models.generate import generate, sample
from .nn import init_context


def load_model(path, *, xp=np, fused=True, dtype=None):
    """A model from a Hugging Face folder (``config.json`` + safetensors; the class from its ``model_type``), a
    trainer checkpoint file (``step_*.ckpt``), or a folder holding trainer checkpoints (its newest, also looked
    for in ``<folder>/checkpoints``). ``dtype=ck.bfloat16`` loads inference weights (no fp32 copy). Returns
    ``(model, source description)``."""
    p = Path(path)
    if hf_folder.is_hf_folder(p):
        return from_pretrained(p, xp=xp, fused=fused, dtype=dtype), f"Hugging Face folder {p}"
    if p.is_dir():
        found = C.latest(p) or C.latest(p / "checkpoints")
        if found is None:
            raise C.CheckpointError(f"{p}: neither a Hugging Face folder (config.json) nor a folder with "
                                    f"step_*.ckpt checkpoints")
        p = found
    arrays, meta = C.read_training(p)
    cls = model_class(meta["model_type"])
    config = cls.config_class.from_dict(meta["model_config"], strict=False)
    with init_context(empty=True, dtype=dtype):
        model = cls(config, xp=xp, fused=fused)
    sd = C.model_arrays(arrays)
    C.check_compatible(p, sd, model.state_dict(), "model", dtypes=False)  # (the dtype converts on load)
    model.load_state_dict(sd)
    return model, f"trainer checkpoint {p} (step {meta.get('step')})"


__all__ = ["generate", "sample", "load_model"]
