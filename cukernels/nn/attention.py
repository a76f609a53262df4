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

Per layer, two options of the LLaMA-style families: ``window`` (sliding-window attention, Mistral / Qwen2 /
Qwen3's "sliding_attention" layers: with the causal mask, query i -- at key index i + Tk - Tq -- sees key n iff
``i + Tk - Tq - W < n <= i + Tk - Tq``, Hugging Face's ``kv_idx > q_idx - sliding_window``; handed to every
attention op as ``window=``) and ``qk_norm`` (Qwen3: an RMSNorm over head_dim on every q and k head before the
rope, parameters ``q_norm.weight`` / ``k_norm.weight``). On the fused path the norm runs on the q and k heads of the
packed projection output (``F.qk_rms_norm``, rope included) so the packed GEMM and the packed attention stay.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _backend as B
from .. import amp
from .. import functional as F
from ..autograd import Tensor, _xp
from ..ops.attention import HEAD_DIMS as FLASH_HEAD_DIMS
from ..ops.decode_attention import HEAD_DIMS as DECODE_HEAD_DIMS
from ..ops.decode_attention import decode_attention, decode_attention_workspace, kv_cache_write
from .dropout import Dropout
from .layers import Linear, RMSNorm, check_input, packable, project_packed
from .module import Module, check_eps, check_param_args

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
        out_bias: the output projection's bias (default: ``bias``; Qwen2 has q / k / v biases and none on o_proj).
        qk_norm: None, or the eps of an RMSNorm over head_dim applied to every q head (``q_norm``) and k head
            (``k_norm``) before the rope (Qwen3).
        window: None (full attention) or the sliding window W >= 1 (with ``causal``): a query sees itself and the
            W - 1 keys before it (Hugging Face's ``sliding_window``).

    Example::

        >>> att = Attention(1024, 16, 8, 128, qk_norm=1e-6, window=4096)      # a Qwen3 sliding layer's shape
        >>> y = att(x, cos=cos, sin=sin)                                      # x [B, T, 1024]
    """

    def __init__(self, hidden, n_heads, n_kv_heads=None, head_dim=None, *, bias=False, rope=True, causal=True,
                 names=None, attn_dropout=None, xp=np, rng=None, std=0.02, out_std=None, dtype=None,
                 out_bias=None, qk_norm=None, window=None):
        hidden, n_heads = check_param_args(hidden=hidden, n_heads=n_heads, std=std, dtype=dtype, xp=xp)
        n_kv_heads = n_heads if n_kv_heads is None else B.check_size("n_kv_heads", n_kv_heads)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads}) "
                             "(num_attention_heads, num_key_value_heads)")
        if head_dim is None and hidden % n_heads:
            # hidden // n_heads would drop features: Attention(10, 3) had head_dim 3 and o_proj 9 -> 10
            raise ValueError(f"n_heads: hidden ({hidden}) must be a multiple of n_heads ({n_heads}), or give head_dim")
        if out_std is not None:
            B.check_real("out_std", out_std, min=0)
        self.H, self.Hkv = n_heads, n_kv_heads
        self.D = hidden // n_heads if head_dim is None else B.check_size("head_dim", head_dim)
        self.rope, self.causal = B.check_bool("rope", rope), B.check_bool("causal", causal)
        bias = B.check_bool("bias", bias)
        out_bias = bias if out_bias is None else B.check_bool("out_bias", out_bias)
        if window is not None:
            window = B.check_int("window", window, min=1, max=2**31 - 1)
            if not self.causal:
                raise ValueError(f"window: a sliding window ({window}) is defined with the causal mask; got "
                                 "causal=False (pass window=None)")
        self.window = window
        if qk_norm is not None:
            qk_norm = check_eps(qk_norm)
        if attn_dropout is not None and not isinstance(attn_dropout, Dropout):
            raise TypeError(f"attn_dropout: expected None or a cukernels.nn.Dropout; got {B._got(attn_dropout)}")
        if names is not None:
            if not isinstance(names, dict) or set(names) not in ({"q", "k", "v", "o"}, {"qkv", "o"}):
                raise ValueError(f"names: expected a dict with the keys q, k, v, o (separate projections) or qkv, o "
                                 f"(one packed projection); got {B._short(names)}")
            if not all(isinstance(v, str) and v.isidentifier() for v in names.values()):
                raise TypeError(f"names: expected attribute names (identifiers) as values; got {B._short(names)}")
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
        setattr(self, self.names["o"], Linear(H * D, hidden, **dict(kw, bias=out_bias, std=out_std or std)))
        self.qk_norm = qk_norm is not None
        if self.qk_norm:  # (after the projections: q, k, v stay adjacent in the optimizer's flat buffer)
            self.q_norm = RMSNorm(D, qk_norm, xp=xp, dtype=dtype)
            self.k_norm = RMSNorm(D, qk_norm, xp=xp, dtype=dtype)
        self.flash = True  # use ck.flash_attention where it applies (False: GEMM + attn_softmax + GEMM)
        self.attn_dropout = attn_dropout

    def extra_repr(self):
        return (f"heads={self.H}, kv_heads={self.Hkv}, head_dim={self.D}, rope={self.rope}, causal={self.causal}"
                + (f", window={self.window}" if self.window is not None else "")
                + (", qk_norm=True" if self.qk_norm else ""))

    def window_kw(self):
        """``{"window": W}`` for a sliding-window layer, ``{}`` otherwise (what every attention op is handed)."""
        return {} if self.window is None else {"window": self.window}

    def _flash_ok(self, data, dtype):
        """The fused kernel runs for q of this dtype and array kind: fused, flash on, CuPy bf16 activations, a
        head_dim it has, no attention dropout active."""
        return (self.fused and self.flash and not isinstance(data, np.ndarray) and dtype == B.bfloat16
                and self.D in FLASH_HEAD_DIMS and not (self.attn_dropout is not None and self.attn_dropout.active()))

    def _uses_flash(self, q):
        return self._flash_ok(q.data, q.data.dtype)

    def _split(self, qkv):
        H, Hkv = self.H, self.Hkv
        q = F.getitem(qkv, (slice(None), slice(None), slice(0, H)))
        k = F.getitem(qkv, (slice(None), slice(None), slice(H, H + Hkv)))
        v = F.getitem(qkv, (slice(None), slice(None), slice(H + Hkv, None)))
        return q, k, v

    def _separate(self):
        return [getattr(self, self.names[n]) for n in ("q", "k", "v")]

    def _packed_qkv(self, x):
        """[B, T, H + 2 Hkv, D] from one GEMM (the packed projection, or q / k / v as one PackedLinear), or None
        when neither applies (separate projections with biases, or unfused)."""
        Bsz, T, _ = x.shape
        shape = (Bsz, T, self.H + 2 * self.Hkv, self.D)
        if self.packed:
            return F.reshape(getattr(self, self.names["qkv"])(x), shape)
        lins = self._separate()
        if packable(self, lins) and self._flash_input(x):
            return F.reshape(project_packed(self, x, lins), shape)
        return None

    def _flash_input(self, x):
        """Whether the projections of x will feed the fused kernel (what :meth:`_uses_flash` will say of q, whose
        dtype is the autocast dtype or x's): only then are separate q / k / v packed, since the materialised path
        would slice the packed output apart again (three GetItem gradients of the packed size)."""
        return self._flash_ok(x.data, amp.get_autocast_dtype() or x.dtype)

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
        xd = x.data if isinstance(x, Tensor) else x
        if B._kind(xd) is None or xd.ndim != 3:
            raise ValueError(f"x: expected [batch, seq, hidden]; got "
                             f"{('shape ' + str(tuple(xd.shape))) if B._kind(xd) is not None else B._got(x)}")
        Bsz, T, _ = x.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        G = H // Hkv
        scale = 1.0 / math.sqrt(D)
        o_proj = getattr(self, self.names["o"])
        if self.rope:
            if position_ids is None:
                p0 = kv_cache.pos if kv_cache is not None else 0
                cos_t, sin_t, pos = cos[p0:p0 + T], sin[p0:p0 + T], None
            else:
                cos_t, sin_t, pos = cos, sin, position_ids
        win = self.window_kw()
        qkv = self._packed_qkv(x) if kv_cache is None else None
        if qkv is not None:  # training / eval: one projection GEMM, rope on q and k in one launch, packed gradient
            if self._uses_flash(qkv):
                rope = (cos_t, sin_t, pos) if self.rope else None
                if self.qk_norm:  # q / k norms then the rope on the packed heads (F.qk_rms_norm), in place
                    qkv = F.qk_rms_norm(qkv, H, Hkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                        rope=rope)
                    rope = None
                o = F.flash_attention_packed(qkv, H, Hkv, causal=self.causal, scale=scale, key_mask=attention_mask,
                                             rope=rope, **win)
                return o_proj(F.reshape(o, (Bsz, T, H * D)))
            q, k, v = self._split(qkv)
        else:
            q, k, v = self._qkv(x)
        if self.qk_norm:  # over head_dim, before the rope (Qwen3)
            q = self.q_norm(F.contiguous(q) if qkv is not None or self.packed else q)
            k = self.k_norm(F.contiguous(k) if qkv is not None or self.packed else k)
        if self.rope:
            if (qkv is not None or self.packed) and not self.qk_norm:  # rope reads contiguous heads
                q, k = F.contiguous(q), F.contiguous(k)
            q = F.rope(q, cos_t, sin_t, positions=pos, fused=self.fused)
            k = F.rope(k, cos_t, sin_t, positions=pos, fused=self.fused)
        if isinstance(kv_cache, StaticLayerCache):
            return o_proj(F.reshape(kv_cache.attend(self, q, k, v, scale, attention_mask), (Bsz, T, H * D)))
        if kv_cache is None and self._uses_flash(q):
            o = F.flash_attention(q, k, v, causal=self.causal, scale=scale, key_mask=attention_mask, **win)
            return o_proj(F.reshape(o, (Bsz, T, H * D)))
        q = F.reshape(F.contiguous(F.transpose(q, (0, 2, 1, 3))), (Bsz, Hkv, G * T, D))
        k = F.contiguous(F.transpose(k, (0, 2, 1, 3)))
        v = F.contiguous(F.transpose(v, (0, 2, 1, 3)))
        if kv_cache is not None:
            kk, vv = kv_cache.append(k.data, v.data)
            k, v = Tensor(kk), Tensor(vv)
        L = k.shape[2]
        s = F.reshape(F.matmul(q, k, trans_b=True), (Bsz, H, T, L))
        p = F.attn_softmax(s, causal=self.causal, scale=scale, key_mask=attention_mask, fused=self.fused, **win)
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


class StaticKVCache:
    """A preallocated cache for fast generation: ``k``, ``v`` of shape [layers, B, max_len, Hkv, D] (bf16), the
    number of filled positions ``length`` as a 0-d int32 device array, and ``key_mask`` [B, max_len] (False at
    the left padding of shorter prompts).

    Everything a decode step touches lives at a fixed address and the length is read on the device, so one
    decode step can be captured as a CUDA graph and replayed per token: the caller advances ``length`` (on the
    device) before each forward; each layer then writes its new keys/values at rows ``length - T ..`` (the
    ``ck.kv_cache_write`` kernel) and attends with ``ck.decode_attention`` (split-KV flash-decoding). The
    prefill (``T > 1`` with an empty cache) writes rows ``0 .. T - 1`` and attends through the training path
    (``ck.flash_attention`` under bf16)."""

    def __init__(self, num_layers, batch, max_len, kv_heads, head_dim, *, xp, dtype):
        self.k = xp.zeros((num_layers, batch, max_len, kv_heads, head_dim), dtype=dtype)
        self.v = xp.zeros_like(self.k)
        self.length = xp.zeros((), dtype=np.int32)
        self.key_mask = xp.ones((batch, max_len), dtype=np.bool_)
        self.max_len, self.batch = int(max_len), int(batch)
        self.prefilled = False
        self.layers = [StaticLayerCache(self, i) for i in range(num_layers)]
        self._ws = {}

    def workspace(self, q):
        """decode_attention's split partials: one fixed buffer per query shape (a graph must not use a pool
        temporary that later calls may reuse)."""
        key = tuple(q.shape)
        if key not in self._ws:
            self._ws[key] = decode_attention_workspace(q, self.k[0], key_mask=self.key_mask)
        return self._ws[key]


class StaticLayerCache:
    """Layer ``i``'s view of a :class:`StaticKVCache`."""

    def __init__(self, cache, i):
        self.cache, self.i = cache, i

    def attend(self, att, q, k, v, scale, attention_mask):
        """Store k, v (Tensors [B, T, Hkv, D]) and return attention's output [B, T, H, D] (a Tensor, no tape)."""
        c = self.cache
        kc, vc = c.k[self.i], c.v[self.i]
        qd, kd, vd = q.data, k.data, v.data
        T = qd.shape[1]
        win = att.window_kw()
        if not c.prefilled:  # the prompt: rows 0 .. T-1, attention over the prompt itself
            kc[:, :T] = kd
            vc[:, :T] = vd
            if att._uses_flash(q):
                return F.flash_attention(q, k, v, causal=att.causal, scale=scale, key_mask=attention_mask, **win)
            return Tensor(_prompt_attention(att, qd, kd, vd, scale, attention_mask))
        kv_cache_write(kd, kc, c.length)  # (strided views of a packed projection are read in place)
        kv_cache_write(vd, vc, c.length)
        if qd.dtype == B.bfloat16 and att.D in DECODE_HEAD_DIMS:
            return Tensor(decode_attention(qd, kc, vc, c.length, scale=scale, key_mask=c.key_mask,
                                           workspace=c.workspace(qd), **win))
        raise ValueError("a static KV cache decodes bf16 attention with head_dim in "
                         f"{DECODE_HEAD_DIMS}; got {qd.dtype}, head_dim {att.D}")


def _prompt_attention(att, q, k, v, scale, key_mask):
    """The prompt's attention on the materialised path (fp32 softmax), arrays in and out: [B, T, H, D]."""
    Bsz, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    xp = _xp(q)
    qq = xp.ascontiguousarray(q.transpose(0, 2, 1, 3)).reshape(Bsz, Hkv, G * T, D)
    kk = xp.ascontiguousarray(k.transpose(0, 2, 1, 3))
    vv = xp.ascontiguousarray(v.transpose(0, 2, 1, 3))
    s = F.gemm(qq, kk, trans_b=True).reshape(Bsz, H, T, T)
    p = F.attn_softmax(Tensor(s), causal=att.causal, scale=scale, key_mask=key_mask, fused=att.fused,
                       **att.window_kw()).data
    o = F.gemm(xp.ascontiguousarray(p.reshape(Bsz, Hkv, G * T, T)).astype(vv.dtype), vv)
    return xp.ascontiguousarray(o.reshape(Bsz, H, T, D).transpose(0, 2, 1, 3))
