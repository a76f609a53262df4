"""LLaMA assembled from cukernels.nn, with Hugging Face parameter names.

``Llama(config)(ids)`` -> logits [B, T, V]; ``Llama(config)(ids, targets)`` -> the mean token cross-entropy as a
0-d fp32 device array (wrapped in a Tensor; the logits are not kept: the fused loss writes dlogits over them).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from .. import amp
from .. import functional as F
from ..autograd import Tensor
from ..nn import Embedding, Linear, LlamaBlock, Module, ModuleList, RMSNorm


@dataclasses.dataclass
class LlamaConfig:
    """Hugging Face ``LlamaConfig`` fields (same names and meanings)."""

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

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self):
        return dataclasses.asdict(self)


def _rope_inv_freq(head_dim, theta, scaling):
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = np.clip((old / wavelen - lo) / (hi - lo), 0.0, 1.0)
        inv = np.where(wavelen < old / hi, inv, np.where(wavelen > old / lo, inv / factor,
                                                          (1 - smooth) * inv / factor + smooth * inv))
    return inv


def rope_cache(seq_len, head_dim, theta, scaling, xp):
    """(cos, sin) fp32 [seq_len, head_dim // 2]: ``ck.rope_cache`` when present, else the same formula here."""
    import cukernels as ck
    if hasattr(ck, "rope_cache"):
        return ck.rope_cache(seq_len, head_dim, theta=theta, scaling=scaling, xp=xp)
    ang = np.arange(seq_len, dtype=np.float64)[:, None] * _rope_inv_freq(head_dim, theta, scaling)[None, :]
    return xp.asarray(np.cos(ang).astype(np.float32)), xp.asarray(np.sin(ang).astype(np.float32))


class LlamaModel(Module):
    def __init__(self, c: LlamaConfig, *, xp=np, rng=None, sparse_embedding=False):
        std = c.initializer_range
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, sparse=sparse_embedding, xp=xp, rng=rng, std=std)
        self.layers = ModuleList(
            LlamaBlock(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                       c.rms_norm_eps, c.head_dim, xp=xp, rng=rng, std=std)
            for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, xp=xp)


class Llama(Module):
    """LLaMA decoder. Parameters are named exactly as in Hugging Face checkpoints (``model.embed_tokens.weight``,
    ``model.layers.N.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight`` unless tied).

    Args:
        config: a :class:`LlamaConfig`.
        xp: numpy (CPU reference path) or cupy (kernels).
        seed: initialisation seed (normal(0, initializer_range) weights, unit norm weights).
        fused: kernel Functions (True) or the composite of plain array operations (False).
        sparse_embedding: sparse-row embedding gradient (ignored with tied embeddings).
        dtype: parameter dtype (float32 for training; float64 on NumPy for gradient checks with fused=False).
    """

    def __init__(self, config: LlamaConfig, *, xp=np, seed=0, fused=True, sparse_embedding=False, dtype=None):
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

    def rope_tables(self, T, xp):
        key = xp.__name__
        c = self.config
        if key not in self._rope or self._rope[key][0].shape[0] < T:
            n = max(T, min(c.max_position_embeddings, 1024))
            self._rope[key] = rope_cache(n, c.head_dim, c.rope_theta, c.rope_scaling, xp)
        cos, sin = self._rope[key]
        return cos[:T], sin[:T]

    def head(self, x):
        """The output projection (lm_head, or the embedding table when tied)."""
        if self.config.tie_word_embeddings:
            emb = self.model.embed_tokens
            x = x if amp.get_autocast_dtype() is None else F.cast(x, amp.get_autocast_dtype())
            w = emb.weight
            dt = amp.get_autocast_dtype()
            if dt is not None and w.dtype != dt:
                if self.fused:
                    return F.linear(x, w, amp.lowp_weight(w, dt))
                return F.linear(x, F.cast(w, dt))
            return F.linear(x, w)
        return self.lm_head(x)

    def forward(self, ids, targets=None, *, ignore_index=-100):
        ids = ids.data if isinstance(ids, Tensor) else ids
        xp = Tensor(ids).xp
        Bsz, T = ids.shape
        cos, sin = self.rope_tables(T, xp)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        logits = self.head(x)
        if targets is None:
            return logits
        targets = targets.data if isinstance(targets, Tensor) else targets
        return F.cross_entropy(F.reshape(logits, (Bsz * T, -1)), targets.reshape(-1), ignore_index=ignore_index,
                               fused=self.fused, inplace=True)
