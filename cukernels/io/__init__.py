"""Files: atomic writes, safetensors (streamed, tensor by tensor), Hugging Face folders, PEFT adapter folders and our
checkpoints.

Nothing here knows a model: a model hands in ``{name: array}`` mappings and its own config dict, and gets lazy
``{name: array}`` mappings back (memory-mapped: peak host memory stays near one tensor).
"""
from . import atomic, checkpoint, hf_folder, peft, safetensors
from .checkpoint import CheckpointError
from .hf_folder import HFFormatError
from .peft import PeftFormatError

__all__ = ["atomic", "checkpoint", "hf_folder", "peft", "safetensors", "CheckpointError", "HFFormatError",
           "PeftFormatError"]
