"""Layers: Module, Linear, Embedding, RMSNorm, LayerNorm, grouped-query causal self-attention with RoPE, the
SwiGLU MLP and the LLaMA block.

Every layer has ``fused`` (default True): True runs the kernel-family Functions (``ck.rms_norm``, ...), False
a composite of plain array operations (RMSNorm as pow/mean/rsqrt/mul, softmax as max/exp/sum, per-use weight
casts) so each kernel's gain can be measured. Parameter names follow Hugging Face (``q_proj``, ``gate_proj``,
``input_layernorm``, ...).
"""
from __future__ import annotations

import math

import numpy as np

from . import _backend as B
from . import amp
from . import functional as F
from .autograd import Tensor, _xp
from .ops.attention import HEAD_DIMS as flash_head_dims


class Parameter(Tensor):
    def __init__(self, data, name=None):
        super().__init__(data, requires_grad=True, name=name)


def _init_normal(xp, rng, shape, std, dtype=np.float32):
    if xp is np:
        return (rng.standard_normal(shape) * std).astype(dtype)
    return (rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype)


class Module:
    training = True
    fused = True

    def __call__(self, *a, **k):
        return self.forward(*a, **k)

    def named_parameters(self, prefix=""):
        for k, v in self.__dict__.items():
            if isinstance(v, Parameter):
                yield prefix + k, v
            elif isinstance(v, Module):
                yield from v.named_parameters(prefix + k + ".")

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def modules(self):
        yield self
        for v in self.__dict__.values():
            if isinstance(v, Module):
                yield from v.modules()

    def num_parameters(self):
        return int(sum(p.size for p in self.parameters()))

    def state_dict(self):
        """{name: array} (the arrays themselves, not copies)."""
        return {n: p.data for n, p in self.named_parameters()}

    def load_state_dict(self, sd, strict=True):
        """Copy arrays into the parameters in place (an optimizer's views stay bound). NumPy or CuPy sources.

        Everything is checked before anything is copied: a missing/unexpected name or a shape mismatch raises
        ValueError and leaves the model untouched."""
        params = dict(self.named_parameters())
        missing = [n for n in params if n not in sd]
        unexpected = [n for n in sd if n not in params]
        if strict and (missing or unexpected):
            raise ValueError(f"load_state_dict: missing {missing[:8]}, unexpected {unexpected[:8]}")
        for n, p in params.items():
            if n in sd and tuple(sd[n].shape) != p.shape:
                raise ValueError(f"load_state_dict: {n}: expected shape {p.shape}; got {tuple(sd[n].shape)}")
        for n, p in params.items():
            if n not in sd:
                continue
            v = sd[n]
            xp = p.xp
            if xp is np:
                v = v.get() if hasattr(v, "get") else np.asarray(v)
            else:
                v = xp.asarray(v)
            p.data[...] = v.astype(p.dtype, copy=False)
        return self

    def train(self, mode=True):
        for m in self.modules():
            m.training = mode
        return self

    def eval(self):
        return self.train(False)

    def set_fused(self, fused=True):
        for m in self.modules():
            m.fused = bool(fused)
        return self

    def zero_grad(self):
        for p in self.parameters():
            if p.grad is not None:
                p.grad[...] = 0
            if p.sparse_grad is not None:
                p.sparse_grad.zero()

    def to(self, device):
        """Move the parameters to "cpu" (NumPy) or "gpu" (CuPy); drops gradients and shadows."""
        for p in self.parameters():
            if device == "cpu":
                p.data = p.data.get() if hasattr(p.data, "get") else p.data
            else:
                import cupy
                p.data = cupy.asarray(p.data)
            p.grad = p.shadow = p.sparse_grad = None
        return self


class ModuleList(Module):
    def __init__(self, mods):
        self._list = list(mods)
        for i, m in enumerate(self._list):
            setattr(self, str(i), m)

    def __iter__(self):
        return iter(self._list)

    def __len__(self):
        return len(self._list)

    def __getitem__(self, i):
        return self._list[i]


def _autocast_input(x):
    dt = amp.get_autocast_dtype()
    if dt is not None and x.dtype != dt:
        return F.cast(x, dt)
    return x


def _weight_for_gemm(module, w, dt):
    """(weight tensor to differentiate, low-precision array to read or None) under autocast dtype dt."""
    if dt is None or w.dtype == dt:
        return w, None
    if module.fused:
        return w, amp.lowp_weight(w, dt)  # shadow if present; otherwise Linear casts once per call
    return F.cast(w, dt), None  # composite: a per-use cast on the tape


class Linear(Module):
    """``y = x W^T (+ b)``; W is [out_features, in_features]; no bias by default."""

    def __init__(self, in_features, out_features, bias=False, *, xp=np, rng=None, std=0.02, dtype=np.float32):
        rng = rng if rng is not None else (np.random.default_rng(0) if xp is np else xp.random.default_rng(0))
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(_init_normal(xp, rng, (out_features, in_features), std, dtype))
        if bias:
            self.bias = Parameter(xp.zeros(out_features, dtype=dtype))
        else:
            self.bias = None

    def forward(self, x):
        x = _autocast_input(x)
        w, wl = _weight_for_gemm(self, self.weight, amp.get_autocast_dtype())
        y = F.linear(x, w, wl)
        if self.bias is not None:
            y = y + (F.cast(self.bias, y.dtype) if self.bias.dtype != y.dtype else self.bias)
        return y


class Embedding(Module):
    """Rows of a [num_embeddings, dim] table. ``sparse=True``: the gradient goes to ``weight.sparse_grad``
    (a ``ck.SparseRowGrad``; only the rows seen are updated by the optimizer) instead of a dense ``.grad``."""

    def __init__(self, num_embeddings, dim, *, sparse=False, xp=np, rng=None, std=0.02, dtype=np.float32):
        rng = rng if rng is not None else (np.random.default_rng(0) if xp is np else xp.random.default_rng(0))
        self.num_embeddings, self.dim, self.sparse = num_embeddings, dim, sparse
        self.weight = Parameter(_init_normal(xp, rng, (num_embeddings, dim), std, dtype))

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else ids
        dt = amp.get_autocast_dtype()
        lowp = amp.lowp_weight(self.weight, dt) if (dt is not None and self.fused) else None
        y = F.embedding(self.weight, ids, fused=self.fused, table_lowp=lowp, sparse=self.sparse)
        if dt is not None and y.dtype != dt:
            y = F.cast(y, dt)
        return y


class RMSNorm(Module):
    def __init__(self, dim, eps=1e-6, *, xp=np, dtype=np.float32):
        self.eps = eps
        self.weight = Parameter(xp.ones(dim, dtype=dtype))

    def forward(self, x):
        return F.rms_norm(x, self.weight, self.eps, fused=self.fused)


class LayerNorm(Module):
    def __init__(self, dim, eps=1e-5, *, xp=np, dtype=np.float32):
        self.eps = eps
        self.weight = Parameter(xp.ones(dim, dtype=dtype))
        self.bias = Parameter(xp.zeros(dim, dtype=dtype))

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps, fused=self.fused)


class CausalSelfAttention(Module):
    """Multi-head causal self-attention with grouped-query K/V heads and rotary positions.

    Query head h uses K/V head ``h // (H / Hkv)`` (HF's repeat_kv order). No repeated K/V copy is made: q is
    laid out [B, Hkv, group*T, D] so that one strided-batched GEMM per product covers a K/V head's whole group
    of query heads; the scores are viewed as [B, H, T, T] for the causal softmax.
    """

    def __init__(self, hidden, n_heads, n_kv_heads, head_dim=None, *, xp=np, rng=None, std=0.02):
        if n_heads % n_kv_heads:
            raise ValueError(f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv_heads})")
        self.H, self.Hkv = n_heads, n_kv_heads
        self.D = head_dim or hidden // n_heads
        kw = dict(xp=xp, rng=rng, std=std)
        self.q_proj = Linear(hidden, self.H * self.D, **kw)
        self.k_proj = Linear(hidden, self.Hkv * self.D, **kw)
        self.v_proj = Linear(hidden, self.Hkv * self.D, **kw)
        self.o_proj = Linear(self.H * self.D, hidden, **kw)
        self.flash = True  # use ck.flash_attention where it applies (False: GEMM + attn_softmax + GEMM)

    def _flash(self, q):
        """The fused kernel path: fused ops, CuPy, bf16 activations (autocast) and a head_dim it has."""
        d = q.data
        return (self.fused and self.flash and not isinstance(d, np.ndarray) and d.dtype == B.bfloat16
                and self.D in flash_head_dims)

    def forward(self, x, cos, sin, kv_cache=None):
        """Causal self-attention on x [B, T, hidden]; with ``kv_cache`` (a :class:`LayerKVCache`, inference) x
        holds the T new tokens at positions ``cache.pos .. cache.pos + T - 1`` (cos/sin are exactly those rows):
        their K/V go into the cache and the queries attend to every cached key -- the causal mask aligned at the
        end (query i sees keys <= i + Tk - Tq) is "up to my own position". Both paths run the same operations
        (projections, rope, the grouped [B, Hkv, G*T, D] GEMM layout, attn_softmax), so a prefill through the
        cache gives the training forward's numbers; no tape is recorded for the cache."""
        Bsz, T, _ = x.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        G = H // Hkv
        q = F.reshape(self.q_proj(x), (Bsz, T, H, D))
        k = F.reshape(self.k_proj(x), (Bsz, T, Hkv, D))
        v = F.reshape(self.v_proj(x), (Bsz, T, Hkv, D))
        q = F.rope(q, cos, sin, fused=self.fused)
        k = F.rope(k, cos, sin, fused=self.fused)
        if kv_cache is None and self._flash(q):
            # Fused attention reads q, k, v in this [B, T, heads, D] layout (no transposes) and never
            # materialises the [B, H, T, T] scores; its output is already the o_proj input layout.
            o = F.flash_attention(q, k, v, causal=True, scale=1.0 / math.sqrt(D))
            return self.o_proj(F.reshape(o, (Bsz, T, H * D)))
        # Grouped-query layout: query head h = j * G + g serves KV head j, so [B, H, T, D] viewed as
        # [B, Hkv, G * T, D] meets K/V [B, Hkv, T, D] in one batched GEMM (no repeated K/V copies).
        q = F.reshape(F.contiguous(F.transpose(q, (0, 2, 1, 3))), (Bsz, Hkv, G * T, D))
        k = F.contiguous(F.transpose(k, (0, 2, 1, 3)))
        v = F.contiguous(F.transpose(v, (0, 2, 1, 3)))
        if kv_cache is not None:
            kk, vv = kv_cache.append(k.data, v.data)
            k, v = Tensor(kk), Tensor(vv)
        L = k.shape[2]
        s = F.reshape(F.matmul(q, k, trans_b=True), (Bsz, H, T, L))
        p = F.attn_softmax(s, causal=True, scale=1.0 / math.sqrt(D), fused=self.fused)
        o = F.matmul(F.reshape(p, (Bsz, Hkv, G * T, L)), v)  # [B, Hkv, G*T, D]
        o = F.reshape(F.contiguous(F.transpose(F.reshape(o, (Bsz, H, T, D)), (0, 2, 1, 3))), (Bsz, T, H * D))
        return self.o_proj(o)


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


class SwiGLUMLP(Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden, ffn, *, xp=np, rng=None, std=0.02):
        kw = dict(xp=xp, rng=rng, std=std)
        self.gate_proj = Linear(hidden, ffn, **kw)
        self.up_proj = Linear(hidden, ffn, **kw)
        self.down_proj = Linear(ffn, hidden, **kw)

    def forward(self, x):
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x), fused=self.fused))


class LlamaBlock(Module):
    """Pre-norm block: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``."""

    def __init__(self, hidden, ffn, n_heads, n_kv_heads, eps, head_dim=None, *, xp=np, rng=None, std=0.02):
        self.input_layernorm = RMSNorm(hidden, eps, xp=xp)
        self.self_attn = CausalSelfAttention(hidden, n_heads, n_kv_heads, head_dim, xp=xp, rng=rng, std=std)
        self.post_attention_layernorm = RMSNorm(hidden, eps, xp=xp)
        self.mlp = SwiGLUMLP(hidden, ffn, xp=xp, rng=rng, std=std)

    def forward(self, x, cos, sin, kv_cache=None):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache=kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class CompositeAdamW:
    """AdamW as a chain of plain array operations: the ``fused: false`` baseline of ``ck.optim.AdamW``.

    ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (wd p + m_hat / (sqrt(v_hat) + eps))`` with bias
    corrections; ``grad_scale`` (a 0-d device array or a float) multiplies the gradients first (clipping and
    accumulation averaging without a host read). Same interface subset: step, zero_grad, set_lr, state_dict.
    ``shadow_dtype=ck.bfloat16`` keeps a low-precision copy of every parameter, rewritten by a cast after each
    update (``shadow(p)``), so autocast reads it instead of casting per use (the ablation's "shadow" row).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, no_decay=(),
                 shadow_dtype=None):
        self.params = list(params)
        nd = {id(p) for p in no_decay}
        self.wd = [0.0 if id(p) in nd else weight_decay for p in self.params]
        self.lr, self.betas, self.eps = lr, tuple(betas), eps
        self.m = [p.xp.zeros_like(p.data) for p in self.params]
        self.v = [p.xp.zeros_like(p.data) for p in self.params]
        self.t = 0
        self._shadow = ({id(p): p.data.astype(shadow_dtype) for p in self.params}
                        if shadow_dtype is not None else {})

    def shadow(self, p):
        """The low-precision copy of ``p`` (KeyError without ``shadow_dtype``)."""
        return self._shadow[id(p)]

    def set_lr(self, lr):
        self.lr = float(lr)

    def zero_grad(self):
        for p in self.params:
            if p.grad is not None:
                p.grad.fill(0)

    def step(self, grad_scale=None):
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        for p, m, v, wd in zip(self.params, self.m, self.v, self.wd):
            if p.grad is None:
                continue
            xp = p.xp
            g = p.grad if grad_scale is None else p.grad * grad_scale
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * (g * g)
            if wd:
                p.data *= 1.0 - self.lr * wd
            p.data -= self.lr * (m / bc1) / (xp.sqrt(v / bc2) + self.eps)
            if id(p) in self._shadow:
                self._shadow[id(p)][...] = p.data.astype(self._shadow[id(p)].dtype)

    def state_dict(self):
        return {"t": self.t, "m": list(self.m), "v": list(self.v), "lr": self.lr}

    def load_state_dict(self, s):
        self.t, self.lr = int(s["t"]), float(s["lr"])
        for dst, src in zip(self.m + self.v, list(s["m"]) + list(s["v"])):
            dst[...] = src


__all__ = ["CompositeAdamW", "Module", "ModuleList", "Parameter", "Linear", "Embedding", "RMSNorm", "LayerNorm",
           "CausalSelfAttention", "SwiGLUMLP", "LlamaBlock", "KVCache", "LayerKVCache"]
_ = (B, _xp)
