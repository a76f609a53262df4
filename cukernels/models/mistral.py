"""Mistral (Hugging Face ``model_type: mistral``): LLaMA's block (:mod:`cukernels.models.llama`: no biases, SwiGLU,
GQA, an explicit ``head_dim``) with sliding-window attention on every layer when ``sliding_window`` is set
(Mistral-7B-v0.1: 4096; v0.2 and later: null, full attention). A query sees itself and the ``sliding_window - 1``
keys before it (Hugging Face's ``kv_idx > q_idx - sliding_window``).

Parameter names are LLaMA's (Hugging Face's).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .base import check_int, register
from .llama import Llama, LlamaConfig


@dataclasses.dataclass
class MistralConfig(LlamaConfig):
    """Hugging Face ``MistralConfig`` fields (same names, meanings and defaults, except ``num_key_value_heads``: None
    = ``num_attention_heads``); checked at construction. ``sliding_window``: None (full attention) or W >= 1."""

    model_type = "mistral"
    hf_architecture = "MistralForCausalLM"
    hf_refused = ()  # (transformers' Mistral has no bias switches)

    intermediate_size: int = 14336
    max_position_embeddings: int = 4096 * 32
    sliding_window: Optional[int] = 4096

    def validate(self):
        super().validate()
        if self.sliding_window is not None:
            check_int(type(self).__name__, "sliding_window", self.sliding_window)

    def attention_options(self, i) -> dict:
        return dict(bias=False, out_bias=False, qk_norm=None, window=self.sliding_window)

    @classmethod
    def _hf_common(cls, d, where):
        absent = "num_key_value_heads" not in d
        d = super()._hf_common(d, where)
        # transformers' defaults when the keys are absent (null: full attention; num_attention_heads)
        d.setdefault("sliding_window", 4096)
        if absent:
            d["num_key_value_heads"] = 8
        return d

    def hf_fields(self) -> dict:
        f = {k: getattr(self, k) for k in (*self._HF_SIZES, "tie_word_embeddings")}
        return {**f, "hidden_act": "silu", "rope_parameters": self.rope_parameters(), "rope_theta": self.rope_theta,
                "sliding_window": self.sliding_window, "attention_dropout": 0.0,
                **{k: getattr(self, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}}


@register
class Mistral(Llama):
    """Mistral decoder: :class:`~cukernels.models.llama.Llama` with a sliding window on every layer.

    Args: as :class:`~cukernels.models.llama.Llama`, with a :class:`MistralConfig`.

    Example::

        >>> model = ck.from_pretrained("Mistral-7B-v0.1", xp=cupy, dtype=ck.bfloat16)   # sliding_window 4096
    """

    model_type = "mistral"
    config_class = MistralConfig
