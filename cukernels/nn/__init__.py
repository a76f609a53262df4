"""Layers: Module, Linear, Embedding, RMSNorm, LayerNorm, the MLPs, self-attention with its KV cache, and LoRA
adapters (:mod:`.lora`)."""
from . import decode
from .attention import Attention, KVCache, LayerKVCache, StaticKVCache
from .dropout import Dropout, DropoutRNG
from .layers import Embedding, LayerNorm, Linear, Residual, RMSNorm, autocast_input, project, weight_for_gemm
from .lora import LoraConfig, LoRALinear, apply_lora, merge_lora
from .mlp import SwiGLUMLP
from .module import Module, ModuleList, Parameter, init_context, new_param

__all__ = ["Module", "ModuleList", "Parameter", "Linear", "Embedding", "RMSNorm", "Residual", "LayerNorm", "SwiGLUMLP",
           "Attention", "Dropout", "DropoutRNG", "KVCache", "LayerKVCache", "StaticKVCache", "init_context", "new_param", "weight_for_gemm", "project",
           "autocast_input", "LoraConfig", "LoRALinear", "apply_lora", "merge_lora"]
