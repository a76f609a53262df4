"""Qwen2 (Hugging Face ``model_type: qwen2``): LLaMA's blocks (:mod:`cukernels.models.llama`) with biases on the q, k
and v projections (none on o_proj), a head tied to the embedding or not (Qwen2-0.5B / 1.5B tie it), rope_theta
1e6 in the released models, and sliding-window attention on the layers ``layer_types`` marks
``"sliding_attention"`` (transformers 5; derived from ``use_sliding_window`` / ``sliding_window`` /
``max_window_layers`` when absent: layers ``i >= max_window_layers`` slide when ``use_sliding_window``).

Parameter names are Hugging Face's: LLaMA's plus ``model.layers.N.self_attn.{q,k,v}_proj.bias``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ..io.hf_folder import HFFormatError
from .base import check_int, register
from .llama import Llama, LlamaConfig

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass
class Qwen2Config(LlamaConfig):
    """Hugging Face ``Qwen2Config`` fields (same names and meanings; the same defaults except
    ``num_key_value_heads``, None = ``num_attention_heads``, and ``sliding_window``, None unless given -- a
    ``config.json`` without them reads as transformers reads it); checked at construction.

    Sliding windows as transformers 5 reads them: ``sliding_window`` counts only when ``use_sliding_window`` is
    true (transformers sets it to null otherwise; here a window given without the switch is an error, not
    ignored), and ``layer_types`` (one ``"full_attention"`` / ``"sliding_attention"`` per layer) defaults to
    sliding for layers ``i >= max_window_layers``. A layer slides over ``sliding_window`` positions: the query and
    the ``sliding_window - 1`` keys before it.
    """

    model_type = "qwen2"
    hf_architecture = "Qwen2ForCausalLM"
    hf_refused = ()  # (transformers' Qwen2 has no bias switches: q / k / v always have one, o and the MLP never)

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    sliding_window: Optional[int] = None
    max_window_layers: int = 28
    layer_types: Optional[list] = None

    def validate(self):
        super().validate()
        w = type(self).__name__
        if not isinstance(self.use_sliding_window, (bool, np.bool_)):
            raise TypeError(f"{w}.use_sliding_window: expected true or false; got {self.use_sliding_window!r}")
        if self.sliding_window is not None:
            check_int(w, "sliding_window", self.sliding_window)
            if not self.use_sliding_window:
                raise ValueError(f"{w}.sliding_window: {self.sliding_window} is set but use_sliding_window is false "
                                 f"(transformers would ignore it): set use_sliding_window: true, or sliding_window: "
                                 f"null")
        elif self.use_sliding_window:
            raise ValueError(f"{w}.sliding_window: use_sliding_window is true but sliding_window is null; give the "
                             f"window (positions a query sees, itself included)")
        check_int(w, "max_window_layers", self.max_window_layers, minimum=0)
        n = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if self.sliding_window is not None and i >= self.max_window_layers
                                else "full_attention" for i in range(n)]
        if isinstance(self.layer_types, tuple):
            self.layer_types = list(self.layer_types)
        if not isinstance(self.layer_types, list) or len(self.layer_types) != n:
            raise ValueError(f"{w}.layer_types: expected a list of {n} entries (num_hidden_layers), each one of "
                             f"{list(LAYER_TYPES)}; got {self.layer_types!r}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"{w}.layer_types: expected entries in {list(LAYER_TYPES)}; got {bad[0]!r}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError(f"{w}.layer_types: has sliding_attention layers but sliding_window is null (set "
                             f"use_sliding_window: true and sliding_window)")

    def attention_options(self, i) -> dict:
        window = self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return dict(bias=True, out_bias=False, qk_norm=None, window=window)

    @classmethod
    def _hf_common(cls, d, where):
        absent = "num_key_value_heads" not in d
        d = super()._hf_common(d, where)
        if absent:  # (transformers' default when the key is absent; null means num_attention_heads)
            d["num_key_value_heads"] = 32
        # transformers' __post_init__: a window without use_sliding_window is dropped (released Qwen2.5 configs
        # carry "sliding_window": 32768 with "use_sliding_window": false); 4096 when switched on and absent.
        use = d.get("use_sliding_window", False)
        if not isinstance(use, bool):
            raise HFFormatError(f"{where}: use_sliding_window: expected true or false; got {use!r}")
        d["sliding_window"] = d.get("sliding_window", 4096) if use else None
        if d["sliding_window"] is None:  # (switched on with a null window: transformers runs full attention)
            d["use_sliding_window"] = False
        if d.get("layer_types") is None:
            d.pop("layer_types", None)
        return d

    def hf_fields(self) -> dict:
        f = {k: getattr(self, k) for k in (*self._HF_SIZES, "tie_word_embeddings")}
        return {**f, "hidden_act": "silu", "rope_parameters": self.rope_parameters(), "rope_theta": self.rope_theta,
                "use_sliding_window": self.use_sliding_window, "sliding_window": self.sliding_window,
                "max_window_layers": self.max_window_layers, "layer_types": list(self.layer_types),
                "attention_dropout": 0.0, **{k: getattr(self, k) for k in ("bos_token_id", "eos_token_id",
                                                                            "pad_token_id")}}


@register
class Qwen2(Llama):
    """Qwen2 decoder: :class:`~cukernels.models.llama.Llama` with q / k / v biases and per-layer sliding windows.

    Args: as :class:`~cukernels.models.llama.Llama`, with a :class:`Qwen2Config`.

    Example::

        >>> model = ck.from_pretrained("Qwen2.5-0.5B", xp=cupy, dtype=ck.bfloat16)   # dispatches on model_type
        >>> model.generate(ids, 64, temperature=0)
    """

    model_type = "qwen2"
    config_class = Qwen2Config
