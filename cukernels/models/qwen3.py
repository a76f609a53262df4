"""Qwen3 (Hugging Face ``model_type: qwen3``): Qwen2's layout (:mod:`cukernels.models.qwen2`: sliding windows per
``layer_types``) without the q / k / v biases by default (``attention_bias`` puts one on q, k, v *and* o), an explicit
``head_dim`` (128 in every released size, so ``heads * head_dim`` may differ from ``hidden_size``: Qwen3-0.6B has
hidden 1024 and 16 heads of 128), and an RMSNorm over head_dim on every q and k head before the rope
(``self_attn.q_norm.weight``, ``self_attn.k_norm.weight``, eps ``rms_norm_eps``).

On the GPU the norms run on the heads of the packed q / k / v projection output (``F.qk_rms_norm``, the rope with
them), so training keeps one projection GEMM and the packed flash attention; the fused decode step normalises the
heads of its qkv GEMV in place (:mod:`cukernels.nn.decode`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from .base import register
from .qwen2 import Qwen2, Qwen2Config


@dataclasses.dataclass
class Qwen3Config(Qwen2Config):
    """Hugging Face ``Qwen3Config`` fields (same names, defaults and meanings; ``head_dim`` defaults to 128 as
    there); sliding windows as :class:`~cukernels.models.qwen2.Qwen2Config`. Checked at construction."""

    model_type = "qwen3"
    hf_architecture = "Qwen3ForCausalLM"
    hf_refused = ("mlp_bias",)

    head_dim: Optional[int] = 128
    attention_bias: bool = False

    def validate(self):
        super().validate()
        if not isinstance(self.attention_bias, (bool, np.bool_)):
            raise TypeError(f"{type(self).__name__}.attention_bias: expected true or false; got "
                            f"{self.attention_bias!r}")

    def attention_options(self, i) -> dict:
        window = self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return dict(bias=bool(self.attention_bias), out_bias=bool(self.attention_bias), qk_norm=self.rms_norm_eps,
                    window=window)

    def hf_fields(self) -> dict:
        return {**super().hf_fields(), "attention_bias": bool(self.attention_bias)}


@register
class Qwen3(Qwen2):
    """Qwen3 decoder: :class:`~cukernels.models.qwen2.Qwen2`'s layout with per-head q / k RMSNorm, an explicit
    head_dim and optional attention biases.

    Args: as :class:`~cukernels.models.llama.Llama`, with a :class:`Qwen3Config`.

    Example::

        >>> c = ck.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        ...                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
        >>> model = ck.Qwen3(c, xp=cupy)                                   # the Qwen3-0.6B shape
    """

    model_type = "qwen3"
    config_class = Qwen3Config
