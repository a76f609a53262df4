"""LLaMA assembled from cukernels.nn, with Hugging Face parameter names.

``Llama(config)(ids)`` -> logits [B, T, V]; ``Llama(config)(ids, targets)`` -> the mean token cross-entropy as a
0-d fp32 device array (wrapped in a Tensor; the logits are not kept: the fused loss writes dlogits over them).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np

from .. import amp
from .. import functional as F
from ..autograd import Tensor
from ..nn import Embedding, KVCache, Linear, LlamaBlock, Module, ModuleList, RMSNorm


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


def rope_cache(seq_len, head_dim, theta, scaling, xp):
    """(cos, sin) fp32 [seq_len, head_dim // 2] for this config: ``ck.rope_cache`` (HF llama3 scaling)."""
    from ..ops.rope import rope_cache as _rc

    return _rc(seq_len, head_dim, theta=theta, scaling=scaling, xp=xp)


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
        for n, p in self.named_parameters():
            p.name = n  # Hugging Face names: what the optimizer, checkpoints and from_pretrained key on

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

    def forward(self, ids, targets=None, *, ignore_index=-100, kv_cache=None):
        ids = ids.data if isinstance(ids, Tensor) else ids
        if kv_cache is not None:
            return self._forward_cached(ids, kv_cache)
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

    # ------------------------------------------------------------------------------------- inference
    def new_kv_cache(self, max_len):
        """An empty :class:`cukernels.nn.KVCache` for up to ``max_len`` positions (prompt + new tokens)."""
        return KVCache(self.config.num_hidden_layers, max_len)

    def _forward_cached(self, ids, cache):
        """Logits [B, 1, V] of the last of the T new tokens ``ids`` [B, T], which take positions
        ``cache.pos .. cache.pos + T - 1``; their keys and values are appended to ``cache``. No tape."""
        xp = Tensor(ids).xp
        Bsz, T = ids.shape
        p0 = cache.pos
        cos, sin = self.rope_tables(p0 + T, xp)
        cos, sin = cos[p0:], sin[p0:]
        from ..autograd import no_grad
        with no_grad():
            x = self.model.embed_tokens(ids)
            for layer, lc in zip(self.model.layers, cache.layers):
                x = layer(x, cos, sin, kv_cache=lc)
            x = F.contiguous(F.getitem(x, (slice(None), slice(T - 1, T))))  # only the last position's logits
            return self.head(self.model.norm(x))

    def generate(self, ids, max_new_tokens, **kw):
        """Sample continuations of ``ids`` [B, T] (int): see :func:`cukernels.generation.generate`."""
        from ..generation import generate
        return generate(self, ids, max_new_tokens, **kw)

    # ------------------------------------------------------------------------------------- Hugging Face
    @classmethod
    def from_pretrained(cls, path, *, xp=np, dtype=None, fused=True, **kw):
        """Load a Hugging Face LLaMA checkpoint folder: ``config.json`` + ``model.safetensors`` or a sharded
        ``model.safetensors.index.json`` (bf16, fp16 or fp32 tensors; parameters become float32, or ``dtype``).
        HF names map one to one (tied embeddings: ``lm_head.weight`` absent or ignored); rope_theta and LLaMA-3
        rope_scaling come from the config. Every name and shape is checked before anything is copied
        (``cukernels.hf.HFFormatError`` naming the file and what disagrees).

        Example::

            >>> model = ck.Llama.from_pretrained("Llama-3.2-1B", xp=cupy)
        """
        from .. import hf
        config = hf.read_config(path)
        tensors = hf.read_weights(path)
        model = cls(config, xp=xp, fused=fused, **kw)
        where = Path(path)
        where = where / (hf.INDEX if (where / hf.INDEX).is_file() else hf.SAFE) if where.is_dir() else where
        sd = hf.hf_to_state(tensors, config, where, model.state_dict())
        model.load_state_dict(sd)
        if dtype is not None:
            for p in model.parameters():
                p.data = p.data.astype(dtype)
        return model

    def save_pretrained(self, path, *, dtype=np.float32, max_shard_size=None):
        """Write the Hugging Face layout into folder ``path``: ``config.json`` and ``model.safetensors`` (or
        shards of at most ``max_shard_size`` bytes plus ``model.safetensors.index.json``), tensors in ``dtype``
        (float32, or ck.bfloat16 / float16), so ``transformers.LlamaForCausalLM.from_pretrained(path)`` loads it.
        """
        from .. import hf
        return hf.save_folder(path, self.config, self.state_dict(), dtype=dtype, max_shard_size=max_shard_size)
