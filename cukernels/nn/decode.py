"""The fused decode step of a pre-norm block: a handful of kernels per layer instead of ~20.

Generating one token reads every weight once: LLaMA-3.2-1B's 2.47 GB of bf16 is 0.59 ms at 4.2 TB/s. The
generic forward (norm, three projection GEMMs, two rope launches, two cache appends, attention split + combine,
output GEMM, add, norm, gate and up GEMMs, SwiGLU, down GEMM, add) ran ~20 kernels per layer and cuBLAS's M = 1
GEMMs streamed a 2-8 MB weight at 1.5-3 TB/s (session 4 profile: 1.50 ms of kernel time, 1.74 ms per captured
step). Here, per block and with arrays only (no tape; generation runs under ``no_grad``):

1. ``ck.gemv``: the first norm as the prologue of one GEMV over the packed q/k/v weight (+ bias); with Qwen3's
   q / k norms, ``ck.rms_norm`` over the q heads and over the k heads of its output, in place (two launches of a
   few KB at batch 1);
2. ``ck.decode_attention_rope``: rotary positions on q and k, k and v appended to the static cache at its device
   length, split-KV attention and the combine, in one launch (session 6; before: ``ck.rope_kv_write`` then
   ``ck.decode_attention``, bit-identical, still taken with ``ck.settings.decode_fused_attention = False``);
3. ``ck.gemv``: the output projection with the residual add as its epilogue, in place on the stream ``x``;
4. ``ck.gemv``: the second norm, the packed gate/up (SwiGLU) or the first MLP layer (GELU) with its activation;
5. ``ck.gemv``: the down projection + residual, in place.

On Hopper the step runs under programmatic dependent launch (``CausalLM._decode_fast`` opens
``ops._launch.pdl_scope()``): each kernel is scheduled while the one before it finishes and waits on it only
before touching what that one writes; a GEMV requests its first weight chunk (and prefetches more into L2)
before it waits. Session 5: 1.273 -> 1.182 ms per LLaMA-1B step.

A sliding-window layer (Mistral, Qwen2 / Qwen3's "sliding_attention" layers) hands its ``window`` to the
attention kernel, which reads only the keys inside it.

Packed weights: q/k/v (and gate/up) are copied once into one [sum(out), in] buffer and the parameters become
row views of it (no second copy of the model). That is done only for inference weights (bf16 parameters, no
optimizer holding them; see ``CausalLM._fast_decode_ok``); parameters already laid out one after another are
used in place.
"""
from __future__ import annotations

import math

import numpy as np

from ..autograd import _xp
from ..ops.decode_attention import decode_attention, decode_attention_rope, rope_kv_write
from ..ops.gemv import gemv
from ..ops.rms_norm import rms_norm
from ..settings import settings
from .layers import LayerNorm, RMSNorm

# Rows the fused step takes (ck.settings.decode_max_rows, read by CausalLM._fast_decode_ok). Measured on one H200
# (`python benchmarks/bench_generate.py --model llama --batches 1,8 --prompts 128 --generic`): at B = 1 the fused step
# runs 1.255 ms against the generic forward's 1.754 (LLaMA-1B); at B = 8, ck.gemv streams the weights at 12-31 % of
# copy bandwidth (its
# per-row FMA and shared-memory work) and the step took 2.85 ms against 1.86 through cuBLAS: so batch 1 only.
# Rotary + cache append + attention in one kernel (ck.decode_attention_rope); ck.settings.decode_fused_attention =
# False: ck.rope_kv_write then ck.decode_attention, bit-identical (the A/B of benchmarks/bench_generate.py --ab
# "decode_fused_attention=0").


def norm_args(norm):
    """The ``ck.gemv`` prologue arguments of an RMSNorm / LayerNorm module."""
    if isinstance(norm, RMSNorm):
        return dict(norm="rms", norm_weight=norm.weight.data, eps=norm.eps)
    if isinstance(norm, LayerNorm):
        return dict(norm="layer", norm_weight=norm.weight.data, norm_bias=norm.bias.data, eps=norm.eps)
    raise TypeError(f"norm: expected an RMSNorm or LayerNorm module; got {type(norm).__name__}")


def _ptr(a):
    if isinstance(a, np.ndarray):  # (a bf16 NumPy array's .data cannot be made: no buffer format for it)
        return a.__array_interface__["data"][0]
    return a.data.ptr


def _contiguous_run(arrays):
    """The arrays as one view stacked along axis 0 when they already lie one after another in one buffer (same
    dtype and trailing shape, C-contiguous), else None."""
    first = arrays[0]
    base = first.base if first.base is not None else first
    ptr = _ptr(first)
    for a in arrays:
        if _ptr(a) != ptr or a.shape[1:] != first.shape[1:] or not a.flags.c_contiguous or a.dtype != first.dtype:
            return None
        ptr += a.size * a.itemsize
    total = sum(a.size for a in arrays)
    off = (_ptr(first) - _ptr(base)) // first.itemsize
    if not base.flags.c_contiguous or off + total > base.size:
        return None
    return base.reshape(-1)[off:off + total].reshape((-1,) + first.shape[1:])


def _pack(params):
    """One array holding the parameters' arrays one after another along axis 0; the parameters become views of
    it (no second copy). Arrays already laid out that way are used in place."""
    arrays = [p.data for p in params]
    if len(arrays) == 1:
        return arrays[0]
    run = _contiguous_run(arrays)
    if run is not None:
        return run
    out = _xp(arrays[0]).concatenate(arrays, axis=0)
    r = 0
    for p in params:
        n = p.data.shape[0]
        p.data = out[r:r + n]
        r += n
    return out


def packed(owner, key, linears):
    """``(weight [sum(out), in], bias [sum(out)] or None)`` of Linears that read the same input, packed once
    (:func:`_pack`; inference weights only) and reused while the parameters still are those views."""
    cache = owner.__dict__.setdefault("_decode_packed", {})
    params = [lin.weight for lin in linears] + [lin.bias for lin in linears if lin.bias is not None]
    hit = cache.get(key)
    if hit is not None and len(hit[2]) == len(params) and all(p.data is a for p, a in zip(params, hit[2])):
        return hit[0], hit[1]
    biases = [lin.bias for lin in linears]
    if any(x is None for x in biases) and any(x is not None for x in biases):
        raise ValueError(f"{key}: some projections have a bias and some not")
    W = _pack([lin.weight for lin in linears])
    b = None if biases[0] is None else _pack(biases)
    cache[key] = (W, b, [p.data for p in params])
    return W, b


def attention(att, x, layer_cache, norm, *, cos=None, sin=None, positions=None):
    """``x += o_proj(attention(norm(x)))`` for the newest token of each row, in place; ``x`` [B, hidden]."""
    Bsz = x.shape[0]
    H, Hkv, D = att.H, att.Hkv, att.D
    names = att.names
    lins = [getattr(att, names["qkv"])] if att.packed else [getattr(att, names[n]) for n in ("q", "k", "v")]
    W, b = packed(att, "qkv", lins)
    qkv = gemv(x, W, bias=b, **norm_args(norm))
    if att.qk_norm:
        qk_norm_rows(qkv, H, Hkv, D, att.q_norm, att.k_norm)
    c = layer_cache.cache
    kc, vc = c.k[layer_cache.i], c.v[layer_cache.i]
    rope = dict(cos=cos, sin=sin, positions=positions) if att.rope else {}
    qkv = qkv.reshape(Bsz, 1, -1)
    # One launch: rotary on q and k, the k / v append at the device length, split-KV attention + combine; under
    # PDL it loads the cached K/V rows, the length, the mask and cos / sin while the qkv GEMV still runs (those
    # are written by no kernel of this layer: the length is advanced before the step's first kernel). The
    # workspace is keyed by q's shape: the q part of qkv stands in for it (a view, no allocation).
    ws = c.workspace(qkv[..., :H * D].reshape(Bsz, 1, H, D))
    win = att.window_kw()
    if settings.decode_fused_attention:
        o = decode_attention_rope(qkv, H, Hkv, kc, vc, c.length, **rope, scale=1.0 / math.sqrt(D),
                                  key_mask=c.key_mask, workspace=ws, **win)
    else:
        q = rope_kv_write(qkv, H, Hkv, kc, vc, c.length, **rope)
        o = decode_attention(q, kc, vc, c.length, scale=1.0 / math.sqrt(D), key_mask=c.key_mask, workspace=ws,
                             **win)
    o_proj = getattr(att, names["o"])
    gemv(o.reshape(Bsz, H * D), o_proj.weight.data, bias=o_proj.bias.data if o_proj.bias is not None else None,
         residual=x, out=x)
    return x


def qk_norm_rows(qkv, H, Hkv, D, q_norm, k_norm):
    """Qwen3's q / k norms over the heads of the qkv GEMV's output [B, (H + 2 Hkv) * D], in place: ``ck.rms_norm``
    rows of D over the q part, then the k part. At one row each part is contiguous and is normalised in place (the
    kernel holds a row in registers before writing it); at several rows the parts are token-strided, so each is
    copied out, normalised and copied back (decode rows are a few KB)."""
    Bsz = qkv.shape[0]
    for norm, lo, hi in ((q_norm, 0, H * D), (k_norm, H * D, (H + Hkv) * D)):
        part = qkv[:, lo:hi]
        w = norm.weight.data
        if Bsz == 1:
            rows = part.reshape(-1, D)
            rms_norm(rows, w, norm.eps, out=rows)
        else:
            part[...] = rms_norm(_xp(qkv).ascontiguousarray(part).reshape(-1, D), w, norm.eps).reshape(Bsz, -1)
    return qkv


def swiglu_mlp(mlp, x, norm):
    """``x += down(silu(gate(norm(x))) * up(norm(x)))``, in place (LLaMA's MLP)."""
    W, b = packed(mlp, "gate_up", [mlp.gate_proj, mlp.up_proj])
    a = gemv(x, W, bias=b, act="swiglu", **norm_args(norm))
    d = mlp.down_proj
    gemv(a, d.weight.data, bias=d.bias.data if d.bias is not None else None, residual=x, out=x)
    return x


def gelu_mlp(fc, proj, x, norm, approximate):
    """``x += proj(gelu(fc(norm(x))))``, in place (GPT-2's MLP; ``approximate`` "tanh" or "none")."""
    a = gemv(x, fc.weight.data, bias=fc.bias.data if fc.bias is not None else None,
             act="gelu_tanh" if approximate == "tanh" else "gelu", **norm_args(norm))
    gemv(a, proj.weight.data, bias=proj.bias.data if proj.bias is not None else None, residual=x, out=x)
    return x
