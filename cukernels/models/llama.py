"""LLaMA (Hugging Face ``model_type: llama``): RMSNorm pre-norm blocks, grouped-query attention with rotary
positions (LLaMA-3 frequency scaling), the SwiGLU MLP, no biases; output head tied to the embedding or not.

``Llama(config)(ids)`` -> logits [B, T, V]; ``Llama(config)(ids, targets)`` -> the mean token cross-entropy as a
0-d fp32 device array (wrapped in a Tensor). Parameter names are Hugging Face's (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight`` unless tied).

This is also the base of the LLaMA-style families (``qwen2.py``, ``qwen3.py``, ``mistral.py``): the same blocks,
names and head; a family's config subclasses :class:`LlamaConfig` (its Hugging Face fields and defaults,
``from_hf`` / ``to_hf`` hooks) and says per layer what its attention has (:meth:`LlamaConfig.attention_options`:
q / k / v and o biases, Qwen3's q / k norm, a sliding window), and its model class subclasses :class:`Llama`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from .._backend import bfloat16
from ..io.hf_folder import SPECIAL_IDS, HFFormatError, check_special_ids, read_special_ids
from ..nn import Attention, Embedding, Linear, Module, ModuleList, Residual, RMSNorm, SwiGLUMLP, decode
from ..ops.rope import _check_scaling as check_rope_scaling
from ..ops.rope import rope_cache
from .base import CausalLM, ModelConfig, check_int, check_real, register

_ROPE_TYPES = (None, "default", "llama3", "linear")


@dataclasses.dataclass
class LlamaConfig(ModelConfig):
    """Hugging Face ``LlamaConfig`` fields (same names and meanings); checked at construction."""

    model_type = "llama"
    hf_architecture = "LlamaForCausalLM"
    hf_refused = ("attention_bias", "mlp_bias")  # config.json switches that must be false (this LLaMA has no biases)

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None  # (or a list of ids)
    pad_token_id: Optional[int] = None

    def validate(self):
        w = type(self).__name__
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings"):
            check_int(w, k, getattr(self, k))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        check_int(w, "num_key_value_heads", self.num_key_value_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"{w}.num_attention_heads: hidden_size ({self.hidden_size}) must be a multiple of "
                                 f"num_attention_heads ({self.num_attention_heads}), or give head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_int(w, "head_dim", self.head_dim, minimum=2)
        if self.head_dim % 2:
            raise ValueError(f"{w}: head_dim must be even for rotary embeddings; got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{w}.num_key_value_heads: num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        check_real(w, "rms_norm_eps", self.rms_norm_eps)
        check_real(w, "rope_theta", self.rope_theta)
        check_real(w, "initializer_range", self.initializer_range)
        if not isinstance(self.tie_word_embeddings, (bool, np.bool_)):
            raise TypeError(f"{w}.tie_word_embeddings: expected true or false; got {self.tie_word_embeddings!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise TypeError(f"{w}.rope_scaling: expected a dict or None; got {type(self.rope_scaling).__name__}")
        check_special_ids(w, self)
        try:  # at construction (it was refused only at the first forward, when the rope tables were built)
            check_rope_scaling(self.rope_scaling)
        except (TypeError, ValueError) as e:
            msg = str(e)
            raise type(e)(f"{w}.rope_{msg}" if msg.startswith("scaling") else f"{w}.rope_scaling: {msg}") from None

    # -- the attention of each layer (the LLaMA-style families override) ---------------------------------------
    def attention_options(self, i) -> dict:
        """Keyword arguments of layer ``i``'s :class:`cukernels.nn.Attention` besides the sizes: ``bias`` (q / k /
        v), ``out_bias`` (o), ``qk_norm`` (None or the eps of Qwen3's per-head norm), ``window`` (None or the
        sliding window). LLaMA: none of them."""
        return dict(bias=False, out_bias=False, qk_norm=None, window=None)

    def layer_windows(self) -> list:
        """The sliding window of every layer (None: full attention)."""
        return [self.attention_options(i)["window"] for i in range(self.num_hidden_layers)]

    # -- config.json ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict, where="config.json"):
        """From a Hugging Face ``config.json`` dict; HFFormatError for what this family cannot run (biases it has
        not, another activation, an unsupported rope_scaling)."""
        d = cls._hf_common(d, where)
        try:
            return cls.from_dict(d, strict=False)
        except (TypeError, ValueError) as e:
            raise HFFormatError(f"{where}: {e}") from None

    @classmethod
    def _hf_common(cls, d: dict, where) -> dict:
        """What every LLaMA-style ``config.json`` needs: the activation, the refused switches, rope_theta and
        rope_scaling from transformers 5's ``rope_parameters`` (or the older top-level keys), the special ids
        that fit the vocabulary, defaults for null head_dim / num_key_value_heads. Returns the field dict."""
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise HFFormatError(f"{where}: hidden_act {act!r}; the LLaMA-style MLP here is SwiGLU (silu)")
        for k in cls.hf_refused:
            if d.get(k):
                raise HFFormatError(f"{where}: {k}=true is not supported by {cls.__name__} (no such biases)")
        rs = d.get("rope_scaling")
        rp = d.get("rope_parameters")  # transformers >= 5 writes theta and scaling together under this key
        if isinstance(rp, dict):
            if "rope_theta" in rp:
                d = dict(d, rope_theta=rp["rope_theta"])
            if rs is None:
                rs = {k: v for k, v in rp.items() if k != "rope_theta"}
        if rs is not None:
            rt = rs.get("rope_type", rs.get("type"))
            if rt not in _ROPE_TYPES:
                raise HFFormatError(f"{where}: rope_scaling type {rt!r} is not supported (supported: default, "
                                    f"linear, llama3)")
            if rt in (None, "default"):
                rs = None
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise HFFormatError(f"{where}: missing fields {missing}")
        d = dict({k: v for k, v in d.items() if k not in SPECIAL_IDS}, rope_scaling=rs,
                 **read_special_ids(d, d["vocab_size"]))
        for k in ("head_dim", "num_key_value_heads"):
            if d.get(k) is None:
                d.pop(k, None)
        return d

    _HF_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "initializer_range", "rms_norm_eps")

    def hf_fields(self) -> dict:
        """The family's own ``config.json`` fields (LLaMA: transformers 4's rope_theta / rope_scaling, which
        transformers 5 reads too, and the bias switches)."""
        return {**{k: getattr(self, k) for k in (*self._HF_SIZES, "rope_theta", "rope_scaling", "tie_word_embeddings",
                                                 *SPECIAL_IDS)},
                "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False}

    def rope_parameters(self) -> dict:
        """transformers 5's ``rope_parameters`` (theta and the scaling together) for this config."""
        rs = {k: v for k, v in (self.rope_scaling or {}).items() if k != "type"}
        rs.setdefault("rope_type", (self.rope_scaling or {}).get("type", "default"))
        return {"rope_theta": self.rope_theta, **rs}

    def to_hf(self, dtype=np.float32) -> dict:
        """The ``config.json`` dict Hugging Face's config class of this family reads."""
        return {
            "architectures": [self.hf_architecture], "model_type": self.model_type, **self.hf_fields(),
            "use_cache": True,
            "torch_dtype": "bfloat16" if np.dtype(dtype) == bfloat16 else np.dtype(dtype).name,
        }


class LlamaBlock(Module):
    """Pre-norm block: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``."""

    def __init__(self, c: LlamaConfig, i=0, *, xp=np, rng=None):
        std = c.initializer_range
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, xp=xp)
        self.self_attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   rope=True, causal=True, xp=xp, rng=rng, std=std, **c.attention_options(i))
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, xp=xp)
        self.mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, xp=xp, rng=rng, std=std)

    def forward(self, x, **attn):
        """x: the residual stream, or a :class:`~cukernels.nn.Residual` (the previous block's pending add, done
        here inside the first norm). Returns a Residual: ``h`` and the MLP output, added by the next norm."""
        if isinstance(x, Residual):
            y, x = self.input_layernorm(x)
        else:
            y = self.input_layernorm(x)
        y, h = self.post_attention_layernorm(Residual(x, self.self_attn(y, **attn)))
        return Residual(h, self.mlp(y))

    def decode(self, x, layer_cache, **rope):
        """The fused decode step (:mod:`cukernels.nn.decode`): x [B, hidden] updated in place."""
        decode.attention(self.self_attn, x, layer_cache, self.input_layernorm, **rope)
        return decode.swiglu_mlp(self.mlp, x, self.post_attention_layernorm)


class LlamaModel(Module):
    def __init__(self, c: LlamaConfig, *, xp=np, rng=None, sparse_embedding=False):
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, sparse=sparse_embedding, xp=xp, rng=rng,
                                      std=c.initializer_range)
        self.layers = ModuleList(LlamaBlock(c, i, xp=xp, rng=rng) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, xp=xp)


@register
class Llama(CausalLM):
    """LLaMA decoder.

    Args:
        config: a :class:`LlamaConfig`.
        xp: numpy (CPU reference path) or cupy (kernels).
        seed: initialisation seed (normal(0, initializer_range) weights, unit norm weights).
        fused: kernel Functions (True) or the composite of plain array operations (False).
        sparse_embedding: sparse-row embedding gradient (ignored with tied embeddings).
        dtype: parameter dtype (float32 for training; ck.bfloat16 for inference; float64 on NumPy for gradient
            checks with fused=False).
    """

    model_type = "llama"
    config_class = LlamaConfig
    hf_ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, config: LlamaConfig, *, xp=np, seed=0, fused=True, sparse_embedding=False, dtype=None):
        want = type(self).config_class
        if not isinstance(config, want) or config.model_type != self.model_type:
            raise TypeError(f"config: expected a {want.__name__}; got {type(config).__name__}")
        self.config = c = config
        rng = np.random.default_rng(seed) if xp is np else xp.random.default_rng(seed)
        sparse = sparse_embedding and not c.tie_word_embeddings
        self.model = LlamaModel(c, xp=xp, rng=rng, sparse_embedding=sparse)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, xp=xp, rng=rng, std=c.initializer_range)
        self._rope = {}
        self.set_fused(fused)
        if dtype is not None:
            for p in self.parameters():
                p.data = p.data.astype(dtype)
        for n, p in self.named_parameters():
            p.name = n  # Hugging Face names: what the optimizer, checkpoints and from_pretrained key on

    def embed(self, ids, position_ids):
        return self.model.embed_tokens(ids)

    def input_embedding(self):
        return self.model.embed_tokens

    def layers(self):
        return self.model.layers

    def decode_final_norm(self):
        return self.model.norm

    def final_norm(self, x):
        if isinstance(x, Residual):
            return self.model.norm(x)[0]
        return self.model.norm(x)

    def output_weight(self):
        if self.config.tie_word_embeddings:
            return self, self.model.embed_tokens.weight, None
        return self.lm_head, self.lm_head.weight, None

    def rope_tables(self, n, xp):
        """(cos, sin) fp32 [>= n, head_dim // 2] for this config (``ck.rope_cache``; HF llama3 scaling), grown
        and cached per array module."""
        key = xp.__name__
        c = self.config
        if key not in self._rope or self._rope[key][0].shape[0] < n:
            m = max(n, min(c.max_position_embeddings, 1024))
            self._rope[key] = rope_cache(m, c.head_dim, theta=c.rope_theta, scaling=c.rope_scaling, xp=xp)
        return self._rope[key]

    def _positions_note(self):
        rs = self.config.rope_scaling
        return f" (rope_scaling {rs} is already in the tables)" if rs else ""
