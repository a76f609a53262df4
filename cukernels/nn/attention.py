"""Multi-head self-attention for any decoder: grouped-query K/V heads, rotary positions or none, projections with
or without bias (separate q/k/v or one packed projection), causal or not, a key-padding mask, a KV cache.

Two paths compute the same thing:

* fused attention (``ck.flash_attention``): fused layers, CuPy, bf16 activations (autocast) and a head_dim the
  kernel has (32/64/128). q, k, v are read in place in the projections' [B, T, heads, D] layout (strided views of
  a packed projection too) and the [B, H, Tq, Tk] scores never exist; a key-padding mask is applied inside.
* materialised: the grouped [B, Hkv, G*T, D] GEMM layout (query head h = j*G + g serves KV head j, so one
  batched GEMM per product covers a KV head's group without repeated K/V copies), ``ck.attn_softmax`` with the
  causal and key masks, a second GEMM. The KV-cache (generation) path and the NumPy path take it.

``attention_mask``: [B, Tk] booleans (True = keep), Tk counting the cached keys. A query row that sees no key
(a left-padding position under the causal mask) gets zeros, never NaN.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _backend as B
from .. import functional as F
from ..autograd import Tensor, _xp
from ..ops.attention import HEAD_DIMS as FLASH_HEAD_DIMS
from .dropout import Dropout
from .layers import Linear
from .module import Module

SEPARATE = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


class Attention(Module):
    """Self-attention over x [B, T, hidden].

    Args:
        hidden, n_heads, n_kv_heads, head_dim: sizes (head_dim defaults to hidden // n_heads).
        bias: projections with biases (GPT-2) or not (LLaMA).
        rope: rotary positions applied to q and k (the forward then takes ``cos``/``sin`` tables).
        causal: the causal mask (aligned at the end: query i sees keys <= i + Tk - Tq).
        names: attribute names of the projections: {"q", "k", "v", "o"} (separate), or {"qkv", "o"} for one
            packed projection whose output is q, k, v one after the other (GPT-2's ``c_attn``).
        attn_dropout: a :class:`Dropout` on the attention probabilities (GPT-2's attn_pdrop). While it is active
            (training, p > 0) attention takes the materialised path: the fused kernel has no dropout inside.
    """

    def __init__(self, hidden, n_heads, n_kv_heads=None, head_dim=None, *, bias=False, rope=True, causal=True,
                 names=None, attn_dropout=None, xp=np, rng=None, std=0.02, out_std=None, dtype=None):
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads "
                             f"({n_kv_heads})")
        self.H, self.Hkv = n_heads, n_kv_heads
        self.D = head_dim or hidden // n_heads
        self.rope, self.causal = bool(rope), bool(causal)
        self.names = dict(names or SEPARATE)
        self.packed = "qkv" in self.names
        kw = dict(bias=bias, xp=xp, rng=rng, std=std, dtype=dtype)
        H, Hkv, D = self.H, self.Hkv, self.D
        if self.packed:
            setattr(self, self.names["qkv"], Linear(hidden, (H + 2 * Hkv) * D, **kw))
        else:
            setattr(self, self.names["q"], Linear(hidden, H * D, **kw))
            setattr(self, self.names["k"], Linear(hidden, Hkv * D, **kw))
            setattr(self, self.names["v"], Linear(hidden, Hkv * D, **kw))
        setattr(self, self.names["o"], Linear(H * D, hidden, **dict(kw, std=out_std or std)))
        self.flash = True  # use ck.flash_attention where it applies (False: GEMM + attn_softmax + GEMM)
        self.attn_dropout = attn_dropout

    def extra_repr(self):
        return (f"heads={self.H}, kv_heads={self.Hkv}, head_dim={self.D}, rope={self.rope}, causal={self.causal}")

    def _uses_flash(self, q):
        d = q.data
        return (self.fused and self.flash and not isinstance(d, np.ndarray) and d.dtype == B.bfloat16
                and self.D in FLASH_HEAD_DIMS and not (self.attn_dropout is not None and self.attn_dropout.active()))

    def _split(self, qkv):
        H, Hkv = self.H, self.Hkv
        q = F.getitem(qkv, (slice(None), slice(None), slice(0, H)))
        k = F.getitem(qkv, (slice(None), slice(None), slice(H, H + Hkv)))
        v = F.getitem(qkv, (slice(None), slice(None), slice(H + Hkv, None)))
        return q, k, v

    def _qkv(self, x):
        Bsz, T, _ = x.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        if self.packed:
            return self._split(F.reshape(getattr(self, self.names["qkv"])(x), (Bsz, T, H + 2 * Hkv, D)))
        q = F.reshape(getattr(self, self.names["q"])(x), (Bsz, T, H, D))
        k = F.reshape(getattr(self, self.names["k"])(x), (Bsz, T, Hkv, D))
        v = F.reshape(getattr(self, self.names["v"])(x), (Bsz, T, Hkv, D))
        return q, k, v

    def forward(self, x, *, cos=None, sin=None, position_ids=None, attention_mask=None, kv_cache=None):
        """x [B, T, hidden] -> [B, T, hidden].

        ``cos``/``sin``: fp32 rope tables [L, D/2] covering every position used (rope=True). ``position_ids``
        [B, T] or [T] int: the positions of x's tokens (default: ``kv_cache.pos + 0..T-1``). ``attention_mask``
        [B, Tk] bool (True = keep; Tk = cached + T keys). ``kv_cache``: a :class:`LayerKVCache` (inference): the
        new tokens' K/V are appended and the queries attend to every cached key; no tape is recorded for the
        cache."""
        Bsz, T, _ = x.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        G = H // Hkv
        scale = 1.0 / math.sqrt(D)
        o_proj = getattr(self, self.names["o"])
        if self.packed and not self.rope and kv_cache is None:
            qkv = F.reshape(getattr(self, self.names["qkv"])(x), (Bsz, T, H + 2 * Hkv, D))
            if self._uses_flash(qkv):
                o = F.flash_attention_packed(qkv, H, Hkv, causal=self.causal, scale=scale,
                                             key_mask=attention_mask)
                return o_proj(F.reshape(o, (Bsz, T, H * D)))
            q, k, v = self._split(qkv)
        else:
            q, k, v = self._qkv(x)
        if self.rope:
            if position_ids is None:
                p0 = kv_cache.pos if kv_cache is not None else 0
                cos_t, sin_t, pos = cos[p0:p0 + T], sin[p0:p0 + T], None
            else:
                cos_t, sin_t, pos = cos, sin, position_ids
            if self.packed:  # rope reads contiguous heads
                q, k = F.contiguous(q), F.contiguous(k)
            q = F.rope(q, cos_t, sin_t, positions=pos, fused=self.fused)
            k = F.rope(k, cos_t, sin_t, positions=pos, fused=self.fused)
        if kv_cache is None and self._uses_flash(q):
            o = F.flash_attention(q, k, v, causal=self.causal, scale=scale, key_mask=attention_mask)
            return o_proj(F.reshape(o, (Bsz, T, H * D)))
        q = F.reshape(F.contiguous(F.transpose(q, (0, 2, 1, 3))), (Bsz, Hkv, G * T, D))
        k = F.contiguous(F.transpose(k, (0, 2, 1, 3)))
        v = F.contiguous(F.transpose(v, (0, 2, 1, 3)))
        if kv_cache is not None:
            kk, vv = kv_cache.append(k.data, v.data)
            k, v = Tensor(kk), Tensor(vv)
        L = k.shape[2]
        s = F.reshape(F.matmul(q, k, trans_b=True), (Bsz, H, T, L))
        p = F.attn_softmax(s, causal=self.causal, scale=scale, key_mask=attention_mask, fused=self.fused)
        if self.attn_dropout is not None:
            p = self.attn_dropout(p)
        o = F.matmul(F.reshape(p, (Bsz, Hkv, G * T, L)), v)  # [B, Hkv, G*T, D]
        o = F.reshape(F.contiguous(F.transpose(F.reshape(o, (Bsz, H, T, D)), (0, 2, 1, 3))), (Bsz, T, H * D))
        return o_proj(o)


class LayerKVCache:
    """One attention layer's keys and values for incremental decoding: ``k``, ``v`` of shape
    [B, Hkv, max_len, D] (allocated at the first append, in the dtype of the keys), ``pos`` tokens filled.

    :meth:`append` writes the new tokens' K/V at ``pos`` and returns the filled prefix [B, Hkv, pos + T, D] as
    C-contiguous arrays for the GEMMs (``ck.matmul`` takes contiguous operands; the prefix is a view when
    B * Hkv == 1, a copy of the cached K/V -- not a recomputation -- otherwise)."""

    def __init__(self, max_len):
        self.max_len = int(max_len)
        self.k = self.v = None
        self.pos = 0

    def append(self, k, v):
        Bsz, Hkv, T, D = k.shape
        xp = _xp(k)
        if self.pos + T > self.max_len:
            raise ValueError(f"kv cache: {self.pos} cached + {T} new tokens exceed max_len {self.max_len}")
        if self.k is None:
            self.k = xp.zeros((Bsz, Hkv, self.max_len, D), dtype=k.dtype)
            self.v = xp.zeros((Bsz, Hkv, self.max_len, D), dtype=v.dtype)
        elif self.k.shape[:2] != (Bsz, Hkv) or self.k.shape[3] != D:
            raise ValueError(f"kv cache: holds [B, Hkv, *, D] = {self.k.shape}; got keys {k.shape}")
        self.k[:, :, self.pos:self.pos + T] = k
        self.v[:, :, self.pos:self.pos + T] = v
        self.pos += T
        return (xp.ascontiguousarray(self.k[:, :, :self.pos]), xp.ascontiguousarray(self.v[:, :, :self.pos]))


class KVCache:
    """Keys/values of every layer (``layers[i]`` is a :class:`LayerKVCache`); ``pos`` = tokens cached."""

    def __init__(self, num_layers, max_len):
        self.max_len = int(max_len)
        self.layers = [LayerKVCache(max_len) for _ in range(num_layers)]

    @property
    def pos(self):
        return self.layers[0].pos if self.layers else 0
