"""GPT-2 (Hugging Face ``model_type: gpt2``): learned position embeddings, pre-LayerNorm blocks with biases,
multi-head attention from one packed ``c_attn`` projection, a GELU MLP, dropout on the embeddings, the attention
probabilities and both residual branches, the output head tied to the token embedding.

Parameter names are Hugging Face's (``transformer.wte.weight``, ``transformer.h.N.attn.c_attn.weight``, ...).
Hugging Face stores the Conv1D weights (``c_attn``, ``c_proj``, ``c_fc``) as [in, out]; ours are [out, in] like
every Linear, transposed once when a folder is read or written, never per step.

``fused`` is the switch of the fused-softmax/LayerNorm write-up (``use_fused_kernel``): True runs ``ck.layer_norm``,
``ck.attn_softmax`` (scale + causal + key-padding mask in one kernel) or ``ck.flash_attention`` under bf16 (when
attention dropout is off), and the fused GELU, embedding, cross-entropy and AdamW; False the composite of array ops.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from .._backend import bfloat16
from ..io.hf_folder import SPECIAL_IDS, HFFormatError, check_special_ids, read_special_ids
from ..nn import Attention, Dropout, DropoutRNG, Embedding, LayerNorm, Linear, Module, ModuleList, decode
from .. import functional as F
from .base import CausalLM, ModelConfig, check_int, check_real, register

ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


@dataclasses.dataclass
class GPT2Config(ModelConfig):
    """Hugging Face ``GPT2Config`` fields (same names and meanings); checked at construction."""

    model_type = "gpt2"

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: Optional[int] = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    bos_token_id: Optional[int] = None  # (to_hf: 50256, GPT-2's <|endoftext|>, for a GPT-2-sized vocabulary)
    eos_token_id: Optional[int] = None  # (or a list of ids)
    pad_token_id: Optional[int] = None

    def validate(self):
        w = "GPT2Config"
        for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            check_int(w, k, getattr(self, k))
        if self.n_inner is not None:
            check_int(w, "n_inner", self.n_inner)
        if self.n_embd % self.n_head:
            raise ValueError(f"{w}.n_head: n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not isinstance(self.activation_function, str) or self.activation_function not in ACTIVATIONS:
            raise ValueError(f"{w}.activation_function: expected one of {sorted(ACTIVATIONS)}; got "
                             f"{self.activation_function!r}")
        for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            v = getattr(self, k)
            check_real(w, k, v, positive=False)
            if not 0 <= v < 1:
                raise ValueError(f"{w}.{k}: expected a probability in [0, 1); got {v}")
        check_real(w, "layer_norm_epsilon", self.layer_norm_epsilon)
        check_real(w, "initializer_range", self.initializer_range)
        if not isinstance(self.tie_word_embeddings, (bool, np.bool_)):
            raise TypeError(f"{w}.tie_word_embeddings: expected true or false; got {self.tie_word_embeddings!r}")
        check_special_ids(w, self)

    @property
    def ffn(self):
        return self.n_inner or 4 * self.n_embd

    @classmethod
    def from_hf(cls, d: dict, where="config.json"):
        for k, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
            if k in d and bool(d[k]) != want:
                raise HFFormatError(f"{where}: {k}={d[k]} is not supported (GPT-2 here: {k}={want})")
        missing = [k for k in ("vocab_size", "n_embd", "n_layer", "n_head") if k not in d]
        if missing:
            raise HFFormatError(f"{where}: missing fields {missing}")
        d = dict({k: v for k, v in d.items() if k not in SPECIAL_IDS}, **read_special_ids(d, d["vocab_size"]))
        if d.get("n_inner") is None:
            d.pop("n_inner", None)
        try:
            return cls.from_dict(d, strict=False)
        except (TypeError, ValueError) as e:
            raise HFFormatError(f"{where}: {e}") from None

    def to_hf(self, dtype=np.float32) -> dict:
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                **{k: getattr(self, k) for k in self.field_names()},
                "scale_attn_weights": True, "use_cache": True,
                **({"bos_token_id": 50256, "eos_token_id": 50256} if self.vocab_size > 50256 and
                   self.bos_token_id is None and self.eos_token_id is None else {}),
                "torch_dtype": "bfloat16" if np.dtype(dtype) == bfloat16 else np.dtype(dtype).name}


class GPT2MLP(Module):
    """``c_proj(gelu(c_fc(x)))`` with biases (Hugging Face GPT-2 names)."""

    def __init__(self, c: GPT2Config, *, xp=np, rng=None):
        std = c.initializer_range
        self.approximate = ACTIVATIONS[c.activation_function]
        self.c_fc = Linear(c.n_embd, c.ffn, bias=True, xp=xp, rng=rng, std=std)
        # GPT-2's scaled init of the residual projections: std / sqrt(2 n_layer)
        self.c_proj = Linear(c.ffn, c.n_embd, bias=True, xp=xp, rng=rng, std=std / math.sqrt(2 * c.n_layer))

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), fused=self.fused, approximate=self.approximate))


class GPT2Block(Module):
    """``h = x + drop(attn(ln_1(x))); out = h + drop(mlp(ln_2(h)))``."""

    def __init__(self, c: GPT2Config, drng: DropoutRNG, *, xp=np, rng=None):
        std = c.initializer_range
        self.ln_1 = LayerNorm(c.n_embd, c.layer_norm_epsilon, xp=xp)
        self.attn = Attention(c.n_embd, c.n_head, bias=True, rope=False, causal=True,
                              names={"qkv": "c_attn", "o": "c_proj"},
                              attn_dropout=Dropout(c.attn_pdrop, drng.new_site()),
                              xp=xp, rng=rng, std=std, out_std=std / math.sqrt(2 * c.n_layer))
        self.ln_2 = LayerNorm(c.n_embd, c.layer_norm_epsilon, xp=xp)
        self.mlp = GPT2MLP(c, xp=xp, rng=rng)
        self.drop_attn = Dropout(c.resid_pdrop, drng.new_site())
        self.drop_mlp = Dropout(c.resid_pdrop, drng.new_site())

    def forward(self, x, **attn):
        h = self.drop_attn.add(self.attn(self.ln_1(x), **attn), x)
        return self.drop_mlp.add(self.mlp(self.ln_2(h)), h)

    def decode(self, x, layer_cache, **rope):
        """The fused decode step (:mod:`cukernels.nn.decode`; dropout inactive): x [B, hidden] in place."""
        decode.attention(self.attn, x, layer_cache, self.ln_1)
        return decode.gelu_mlp(self.mlp.c_fc, self.mlp.c_proj, x, self.ln_2, self.mlp.approximate)


class GPT2Model(Module):
    def __init__(self, c: GPT2Config, drng: DropoutRNG, *, xp=np, rng=None, sparse_embedding=False):
        std = c.initializer_range
        self.wte = Embedding(c.vocab_size, c.n_embd, sparse=sparse_embedding, xp=xp, rng=rng, std=std)
        self.wpe = Embedding(c.n_positions, c.n_embd, xp=xp, rng=rng, std=std)
        self.drop = Dropout(c.embd_pdrop, drng.new_site())
        self.h = ModuleList(GPT2Block(c, drng, xp=xp, rng=rng) for _ in range(c.n_layer))
        self.ln_f = LayerNorm(c.n_embd, c.layer_norm_epsilon, xp=xp)


_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@register
class GPT2(CausalLM):
    """GPT-2 decoder (``GPT2LMHeadModel``'s parameters and numbers).

    Args:
        config: a :class:`GPT2Config`.
        xp: numpy (CPU reference path) or cupy (kernels).
        seed: initialisation seed; also the dropout generator's base seed.
        fused: kernel Functions (True) or the composite of plain array operations (False).
        sparse_embedding: sparse-row gradient for the token embedding (only when it is not tied).
        dtype: parameter dtype (float32 for training, ck.bfloat16 for inference).
    """

    model_type = "gpt2"
    config_class = GPT2Config
    hf_ignored_suffixes = (".attn.bias", ".attn.masked_bias")

    def __init__(self, config: GPT2Config, *, xp=np, seed=0, fused=True, sparse_embedding=False, dtype=None):
        if not isinstance(config, GPT2Config):
            raise TypeError(f"config: expected a GPT2Config; got {type(config).__name__}")
        self.config = c = config
        rng = np.random.default_rng(seed) if xp is np else xp.random.default_rng(seed)
        self.dropout_rng = DropoutRNG(seed, xp)
        self.transformer = GPT2Model(c, self.dropout_rng, xp=xp, rng=rng,
                                     sparse_embedding=sparse_embedding and not c.tie_word_embeddings)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.n_embd, c.vocab_size, xp=xp, rng=rng, std=c.initializer_range)
        self.set_fused(fused)
        if dtype is not None:
            for p in self.parameters():
                p.data = p.data.astype(dtype)
        for n, p in self.named_parameters():
            p.name = n

    @classmethod
    def hf_rename(cls, hf_name):
        # the original OpenAI-converted checkpoints (and GPT2Model.save_pretrained) omit the "transformer." prefix
        if hf_name.startswith(("transformer.", "lm_head.")):
            return hf_name
        return "transformer." + hf_name

    @classmethod
    def hf_transposed(cls, name):
        return name.endswith(_CONV1D)

    def input_embedding(self):
        return self.transformer.wte

    def embed(self, ids, position_ids):
        pos = self.positions(position_ids, ids.shape[1], self.xp)
        x = self.transformer.wte(ids) + self.transformer.wpe(pos if pos.ndim == 2 else pos[None])
        return self.transformer.drop(x)

    def layers(self):
        return self.transformer.h

    def final_norm(self, x):
        return self.transformer.ln_f(x)

    def decode_final_norm(self):
        return self.transformer.ln_f

    def output_weight(self):
        if self.config.tie_word_embeddings:
            return self, self.transformer.wte.weight, None
        return self.lm_head, self.lm_head.weight, None

    def max_positions(self):
        return self.config.n_positions

    def forward(self, ids, targets=None, **kw):
        if self.training and self.dropout_rng is not None and kw.get("kv_cache") is None:
            with self.dropout_rng.forward_pass():
                return super().forward(ids, targets, **kw)
        return super().forward(ids, targets, **kw)
