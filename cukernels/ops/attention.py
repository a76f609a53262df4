"""Fused scaled-dot-product attention: ``ck.flash_attention``, ``ck.flash_attention_backward``.
Kernels: ``kernels_cu/attention.cu``."""
from __future__ import annotations

import math

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from . import _launch
from .rope import check_tables as _check_rope_tables
from .rope import rope_backward as _rope_backward

FAMILY = "attention"
THREADS = 128
BM = 64  # rows of the query tile (fwd, dq) and of the key tile (dkdv): 16 per warp, 4 warps
# head_dim -> (key tile of fwd, key tile of dq, query tile of dkdv); must match the entries in attention.cu.
TILES = {32: (64, 64, 64), 64: (64, 32, 64), 128: (32, 32, 32)}
HEAD_DIMS = tuple(TILES)


def _smem(kind, D):
    """Dynamic shared memory bytes of each kernel (the layouts in attention.cu)."""
    bn_fwd, bn_dq, bq = TILES[D]
    row = (D + 8) * 2  # padded bf16 row
    if kind == "fwd":
        return (BM + 4 * bn_fwd) * row
    if kind == "dq":
        return (2 * BM + 4 * bn_dq) * row + BM * 4
    return (2 * BM + 4 * bq) * row + 4 * bq * 4


def _kernel(kind, D, masked=False):
    """The kernel and its dynamic shared memory; ``masked``: the key-padding-mask instantiation (``*_km``, same
    tiles, same shared memory, three more arguments: the mask, its row stride in elements, its entry size)."""
    name = f"attn_{'bwd_' if kind != 'fwd' else ''}{kind}_d{D}{'_km' if masked else ''}"
    smem = _smem(kind, D)
    return _launch.with_smem(get_function(FAMILY, name), smem), smem


def _check_qkv(name, a, shape_hint):
    B.check_dtype(name, a, (B.bfloat16,))
    if a.ndim != 4:
        raise ValueError(f"{name}: expected 4 dimensions {shape_hint}; got shape {tuple(a.shape)}")


def _strides(name, a):
    """Element strides (batch, token, head) of a [B, T, heads, D] view the kernels can read in place."""
    isz = a.itemsize
    if a.size and a.shape[3] > 1 and a.strides[3] != isz:  # (CuPy gives an empty array strides of 0)
        raise ValueError(f"{name}: the last axis (head_dim) must be contiguous; got strides {a.strides}")
    if a.size and (a.data.ptr % 16 or any(s % 16 for s in a.strides[:3])):
        raise ValueError(f"{name}: the kernels read 16-byte chunks: the data pointer and the batch / token / head "
                         f"strides must be multiples of 16 bytes; got pointer offset {a.data.ptr % 16}, strides "
                         f"{a.strides} (use a contiguous copy)")
    return tuple(np.int64(s // isz) for s in a.strides[:3])


def check_rope_grads(rope, Bsz, Tq, Tk, D, xp):
    """``rope=(cos, sin, positions)`` of the backward: the tables ``ck.rope`` takes, on q's device, for seq_q ==
    seq_k tokens; returned as a tuple."""
    if not isinstance(rope, (tuple, list)) or len(rope) != 3:
        raise TypeError(f"rope: expected a tuple (cos, sin, positions); got {type(rope).__name__}")
    cos, sin, positions = rope
    if Tq != Tk:
        raise ValueError(f"rope: q and k must be rotated at the same positions (seq_q == seq_k); got seq_q = {Tq}, "
                         f"seq_k = {Tk}")
    for name, a in (("rope[cos]", cos), ("rope[sin]", sin), ("rope[positions]", positions)):
        if a is not None and B._kind(a) is not xp:
            raise TypeError(f"{name}: expected an array on the inputs' device ({xp.__name__}); got {type(a).__name__}")
    _check_rope_tables(cos, sin, positions, Bsz, Tq, D, "q")
    return tuple(rope)


def check_grads_out(grads_out, q, k, xp):
    """``grads_out`` of the backward: three bfloat16 buffers shaped like q, k, k on q's device, each readable by
    :func:`_strides` (16-byte chunks, contiguous head_dim); returned as a tuple."""
    if not isinstance(grads_out, (tuple, list)) or len(grads_out) != 3:
        raise TypeError(f"grads_out: expected a tuple (dq, dk, dv) of three arrays; got {type(grads_out).__name__}")
    for name, a, like in zip(("dq", "dk", "dv"), grads_out, (q, k, k)):
        name = f"grads_out[{name}]"
        if B._kind(a) is not xp:
            raise TypeError(f"{name}: expected an array on the inputs' device ({xp.__name__}); got "
                            f"{type(a).__name__}")
        B.check_dtype(name, a, (B.bfloat16,))
        B.check_shape(name, a, like.shape)
        B.check_writable(name, a)
        if xp is not np:
            _strides(name, a)
    return tuple(grads_out)


def _check_saved(dout, q, out, lse, Bsz, H, Tq):
    """The backward's extra inputs: dout like q, the forward's C-contiguous o and lse [batch, heads, seq_q]."""
    _check_qkv("dout", dout, "[batch, seq_q, heads, head_dim]")
    B.check_shape("dout", dout, q.shape, " (the shape of q)")
    B.check_dtype("out", out, (B.bfloat16,))
    B.check_shape("out", out, q.shape, " (the shape of q)")
    B.check_contiguous("out", out)
    B.check_dtype("lse", lse, (np.float32,))
    B.check_shape("lse", lse, (Bsz, H, Tq), " ([batch, heads, seq_q])")
    B.check_contiguous("lse", lse)
    if isinstance(lse, np.ndarray) and lse.size:
        # The forward's lse is finite, or -inf for a row that sees no key. A NaN (or +inf) one gave finite, wrong
        # gradients on the NumPy path (its rows were treated as masked). Device values are not read (no sync).
        bad = np.isnan(lse) | np.isposinf(lse)
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad)), lse.shape)
            raise ValueError(f"lse: expected the forward's log-sum-exp (finite, or -inf for a row with no key); got "
                             f"{lse[i]} at {tuple(int(v) for v in i)}")


def _check_scale(scale, D):
    """``scale`` as float32: None -> 1 / sqrt(head_dim); else a real number (TypeError otherwise), finite and > 0
    in float32 (ValueError). > 0 because the kernels take the row max of the unscaled scores
    (max(s) * scale = max(s * scale) needs scale > 0)."""
    if scale is None:
        return np.float32(1.0 / math.sqrt(D))
    s32 = B.check_f32("scale", scale, min=0, min_open=True)
    if s32 == 0:  # below float32's smallest subnormal
        raise ValueError(f"scale: expected a finite number > 0 that stays > 0 in float32; got {scale!r}")
    return s32


def _check_key_mask(key_mask, xp, Bsz, Tk):
    """Validate ``key_mask`` ([batch, seq_k], bool or integer, last axis contiguous); returns its row stride in
    elements and its entry size in bytes (what the *_km kernels take), or None when no mask is given."""
    if key_mask is None:
        return None
    dt = key_mask.dtype
    if dt.kind not in "biu":
        raise TypeError(f"key_mask: expected dtype bool or an integer dtype (nonzero = keep, 0 = padding); got {dt}")
    if tuple(key_mask.shape) != (Bsz, Tk):
        raise ValueError(f"key_mask: expected shape ({Bsz}, {Tk}) ([batch, seq_k], matching k); "
                         f"got {tuple(key_mask.shape)}")
    isz = dt.itemsize
    if Tk > 1 and key_mask.strides[1] != isz:
        raise ValueError(f"key_mask: the last axis (seq_k) must be contiguous; got strides {key_mask.strides} "
                         f"for itemsize {isz} (a row slice of a larger mask is fine: key_mask[:, :seq_k])")
    ptr = key_mask.ctypes.data if xp is np else key_mask.data.ptr
    if key_mask.strides[0] % isz or (key_mask.size and ptr % isz):
        raise ValueError(f"key_mask: entries must be aligned to their size ({isz} bytes); got strides "
                         f"{key_mask.strides}, pointer offset {ptr % isz}")
    return np.int64(key_mask.strides[0] // isz), np.int32(isz)


def gqa_shapes(q, k, v, head_dims, *, k_name="k", v_name="v", len_name="seq_k", d_hint=""):
    """``(batch, q_len, heads, head_dim, k_len, kv_heads)`` of grouped-query attention operands laid out
    [batch, len, heads, head_dim], checked: head_dim in ``head_dims``, k [batch, k_len, kv_heads, head_dim] with
    kv_heads dividing the query heads, v shaped like k (errors name ``k_name`` / ``v_name``). Shared with
    decode_attention (the KV cache)."""
    Bsz, Tq, H, D = (int(s) for s in q.shape)
    if D not in head_dims:
        raise ValueError(f"q: head_dim must be one of {head_dims}; got {D}{d_hint}")
    if k.shape[0] != Bsz or k.shape[3] != D:
        raise ValueError(f"{k_name}: expected shape ({Bsz}, {len_name}, kv_heads, {D}) to match q {tuple(q.shape)}; "
                         f"got {tuple(k.shape)}")
    Tk, Hkv = int(k.shape[1]), int(k.shape[2])
    B.check_shape(v_name, v, k.shape, f" (the shape of {k_name})")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"{k_name}: kv_heads ({Hkv}) must divide the query heads ({H})")
    return Bsz, Tq, H, D, Tk, Hkv


def _validate(q, k, v, causal, scale):
    _check_qkv("q", q, "[batch, seq_q, heads, head_dim]")
    _check_qkv("k", k, "[batch, seq_k, kv_heads, head_dim]")
    _check_qkv("v", v, "[batch, seq_k, kv_heads, head_dim]")
    Bsz, Tq, H, D, Tk, Hkv = gqa_shapes(q, k, v, HEAD_DIMS, d_hint=" (use attn_softmax for other sizes)")
    return Bsz, Tq, Tk, H, Hkv, D, B.check_bool("causal", causal), _check_scale(scale, D)


def _ref_probs(q, k, causal, scale, key_mask=None):
    """NumPy path: fp32 scores [B, H, Tq, Tk] with the masks applied (-inf), and lse [B, H, Tq] (-inf for a row
    that sees no key)."""
    Bsz, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    qf = q.astype(np.float32).transpose(0, 2, 1, 3)
    kf = np.repeat(k.astype(np.float32).transpose(0, 2, 1, 3), H // Hkv, axis=1)
    s = np.matmul(qf, kf.transpose(0, 1, 3, 2)) * np.float32(scale)
    if causal:
        vis = np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + (Tk - Tq)
        s = np.where(vis, s, np.float32(-np.inf))
    if key_mask is not None:
        s = np.where((key_mask != 0)[:, None, None, :], s, np.float32(-np.inf))
    m = s.max(-1, keepdims=True) if Tk else np.full(s.shape[:-1] + (1,), -np.inf, np.float32)
    mb = np.where(np.isfinite(m), m, 0).astype(np.float32)
    with np.errstate(divide="ignore"):
        lse = (np.log(np.exp(s - mb).sum(-1, keepdims=True)) + mb).astype(np.float32)
    return s, lse[..., 0]


@B.interop
def flash_attention(q, k, v, *, causal=True, scale=None, key_mask=None, out=None, return_lse=False):
    """Scaled-dot-product attention without materialising the scores (FlashAttention-2 style), bf16.

    ``o[b, i, h] = sum_n softmax_n(scale * <q[b, i, h], k[b, n, h // G]> + mask) * v[b, n, h // G]`` with
    ``G = heads / kv_heads`` (grouped-query attention; G = 1 is plain multi-head). ``causal=True`` masks key n
    for query i when ``n > i + seq_k - seq_q`` (aligned at the end: with seq_q == seq_k, "up to my own
    position"); ``key_mask`` also masks key n of batch row b where ``key_mask[b, n] == 0`` (padding). The softmax
    and the accumulation are fp32; the probabilities enter the second product rounded to bf16 (tensor cores), so
    the result matches an fp32 reference to bf16 accuracy.

    Args:
        q: bfloat16 ``[batch, seq_q, heads, head_dim]``; head_dim 32, 64 or 128.
        k, v: bfloat16 ``[batch, seq_k, kv_heads, head_dim]``, kv_heads dividing heads.
            q, k and v may be strided views (e.g. slices of one fused QKV projection): the last axis must be
            contiguous, the data pointer and the other strides multiples of 16 bytes.
        causal: the causal mask above (a bool).
        scale: the score multiplier, a finite number > 0; default ``1 / sqrt(head_dim)``.
        key_mask: optional key-padding mask ``[batch, seq_k]`` (Hugging Face's ``attention_mask``: 1 = keep,
            0 = padding, left or right padding or any pattern), bool or an integer dtype, nonzero = keep; the last
            axis contiguous, any row stride (a slice ``mask[:, :seq_k]`` of a longer mask is read in place). It
            is applied per key inside the kernels: no ``[batch, heads, seq_q, seq_k]`` mask or score tensor is
            made, and key tiles that are all padding are skipped.
        out: optional C-contiguous bfloat16 buffer of q's shape.
        return_lse: also return ``lse`` float32 ``[batch, heads, seq_q]``, the natural-log softmax normaliser
            (what :func:`flash_attention_backward` needs). A query that sees no key (under the causal mask and
            the padding mask together, e.g. a left-padding position) gets o = 0 and lse = -inf.

    Returns:
        ``o`` (C-contiguous ``[batch, seq_q, heads, head_dim]``), or ``(o, lse)``.

    Example::

        >>> q = cp.random.standard_normal((8, 1024, 32, 64), dtype=cp.float32).astype(ck.bfloat16)
        >>> k = v = cp.random.standard_normal((8, 1024, 8, 64), dtype=cp.float32).astype(ck.bfloat16)
        >>> attention_mask = cp.ones((8, 1024), dtype=cp.int64); attention_mask[1, :100] = 0  # left padding
        >>> o, lse = ck.flash_attention(q, k, v, causal=True, key_mask=attention_mask, return_lse=True)
    """
    xp = B.array_module(q=q, k=k, v=v, key_mask=key_mask, out=out)
    Bsz, Tq, Tk, H, Hkv, D, causal, scale = _validate(q, k, v, causal, scale)
    return_lse = B.check_bool("return_lse", return_lse)  # ("yes" was taken as true)
    km = _check_key_mask(key_mask, xp, Bsz, Tk)
    o = B.empty(xp, q.shape, B.bfloat16, out)
    if xp is np:
        s, lse = _ref_probs(q, k, causal, scale, key_mask)
        with np.errstate(invalid="ignore"):
            p = np.where(np.isfinite(lse)[..., None], np.exp(s - lse[..., None]), 0).astype(np.float32)
        vf = np.repeat(v.astype(np.float32).transpose(0, 2, 1, 3), H // Hkv, axis=1)
        o[...] = np.matmul(p, vf).transpose(0, 2, 1, 3).astype(B.bfloat16)
        return (o, lse) if return_lse else o
    lse = xp.empty((Bsz, H, Tq), dtype=np.float32)
    if Bsz * H * Tq == 0:
        return (o, lse) if return_lse else o
    A90 = _use_sm90(km, D)
    if A90 is not None:
        o, lse = A90.flash_attention_sm90(q, k, v, causal=causal, scale=scale, out=o, return_lse=True)
        return (o, lse) if return_lse else o
    sq, sk, sv = _strides("q", q), _strides("k", k), _strides("v", v)
    kern, smem = _kernel("fwd", D, km is not None)
    kern((-(-Tq // BM), H, Bsz), (THREADS, 1, 1),
         (q, k, v, o, lse, *sq, *sk, *sv, np.int32(Tq), np.int32(Tk), np.int32(H), np.int32(Hkv), scale,
          np.bool_(causal), *_mask_args(key_mask, km)), shared_mem=smem)
    return (o, lse) if return_lse else o


# Hopper (compute capability 9.0): calls without a key mask at head_dim 64 / 128 run the wgmma kernels of
# ops/attention_sm90.py (measured on the H200, session 4, B8xT1024 H32/8 D64 causal: fwd+bwd 0.580 ms against
# 0.818 for the mma.sync kernels here, 1.39x; 1.60x at B2xT4096). Same lse format, so either forward pairs with
# either backward. ck.settings.attention_wgmma = False: always the mma.sync kernels (to compare).
_SM90 = {}
# ops/attention_sm90.py registers itself here when imported (cukernels/__init__ imports it): it builds on this
# module's validation, so this module must not import it (no import cycle, lazy ones included).
_SM90_IMPL = {}


def _use_sm90(km, D):
    A90 = _SM90_IMPL.get("module")
    if A90 is None or not settings.attention_wgmma or km is not None or D not in (64, 128):
        return None
    import cupy
    dev = cupy.cuda.Device().id
    if dev not in _SM90:
        _SM90[dev] = A90.supported()
    return A90 if _SM90[dev] else None


def _mask_args(key_mask, km):
    """The *_km kernels' extra arguments (mask pointer, row stride in elements, entry bytes), or none."""
    return () if km is None else (key_mask, *km)


@B.interop
def flash_attention_backward(dout, q, k, v, out, lse, *, causal=True, scale=None, key_mask=None, grads_out=None,
                             rope=None):
    """Gradients of :func:`flash_attention`: ``(dq, dk, dv)``.

    With ``P`` recomputed from ``lse``: ``delta_i = <dO_i, o_i>``, ``dS = P * (dO V^T - delta)``,
    ``dq = scale * dS K``, ``dk = scale * dS^T Q``, ``dv = P^T dO``; dk and dv are summed over the G query heads
    that share a K/V head. Deterministic (no atomics). Masked pairs have P = 0: a padding key gets dk = dv = 0,
    a query that sees no key (lse = -inf) gets dq = 0.

    Args:
        dout: bfloat16 like ``q`` (strided views allowed, as for q).
        q, k, v, causal, scale, key_mask: exactly as passed to the forward.
        out, lse: the forward's ``o`` (C-contiguous) and ``lse``.
        grads_out: optional ``(dq, dk, dv)`` bfloat16 buffers to write (shapes of q, k, k), strided views allowed
            as for q: the head slices of one packed ``dqkv`` [B, T, H + 2 Hkv, D] get the gradients in place
            (the sm_90 kernels store there directly; the other paths copy in).
        rope: optional ``(cos, sin, positions)`` with which q and k were rotated by ``ck.rope`` (rotate-half)
            before the forward: dq and dk are then the gradients of the unrotated q and k (``ck.rope_backward``
            applied; on the sm_90 path inside the kernels' store, in fp32 before the one rounding). Needs
            seq_q == seq_k.

    Returns:
        ``(dq, dk, dv)``: ``grads_out`` when given, else new C-contiguous arrays (dq like q, dk and dv like k).
    """
    xp = B.array_module(dout=dout, q=q, k=k, v=v, out=out, lse=lse, key_mask=key_mask)
    Bsz, Tq, Tk, H, Hkv, D, causal, scale = _validate(q, k, v, causal, scale)
    km = _check_key_mask(key_mask, xp, Bsz, Tk)
    _check_saved(dout, q, out, lse, Bsz, H, Tq)
    if rope is not None:
        rope = check_rope_grads(rope, Bsz, Tq, Tk, D, xp)
        A90 = _use_sm90(km, D) if xp is not np else None
        if A90 is not None and Bsz * H and Tq and (rope[2] is None or rope[2].dtype == np.int32):
            return A90.flash_attention_backward_sm90(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                                     grads_out=grads_out, rope=rope)
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                              key_mask=key_mask, grads_out=grads_out)
        for g in (dq, dk):
            _rope_backward(g, rope[0], rope[1], positions=rope[2], out=g)
        return dq, dk, dv
    if grads_out is not None:
        grads_out = check_grads_out(grads_out, q, k, xp)
        A90 = _use_sm90(km, D) if xp is not np else None
        if A90 is not None and Bsz * H and Tq and Tk:
            return A90.flash_attention_backward_sm90(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                                     grads_out=grads_out)
        res = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, key_mask=key_mask)
        for o, r in zip(grads_out, res):
            o[...] = r
        return grads_out
    G = H // Hkv
    if xp is np:
        s, _ = _ref_probs(q, k, causal, scale, key_mask)
        lse_ = lse.astype(np.float32)[..., None]
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.where(np.isfinite(lse_) & np.isfinite(s), np.exp(s - lse_), 0).astype(np.float32)
        tr = (0, 2, 1, 3)
        do = dout.astype(np.float32).transpose(tr)
        of = out.astype(np.float32).transpose(tr)
        qf = q.astype(np.float32).transpose(tr)
        kf = np.repeat(k.astype(np.float32).transpose(tr), G, axis=1)
        vf = np.repeat(v.astype(np.float32).transpose(tr), G, axis=1)
        delta = (do * of).sum(-1, keepdims=True)
        ds = p * (np.matmul(do, vf.transpose(0, 1, 3, 2)) - delta)
        dq = np.float32(scale) * np.matmul(ds, kf)
        dk = np.float32(scale) * np.matmul(ds.transpose(0, 1, 3, 2), qf)
        dv = np.matmul(p.transpose(0, 1, 3, 2), do)
        dk = dk.reshape(Bsz, Hkv, G, Tk, D).sum(2)
        dv = dv.reshape(Bsz, Hkv, G, Tk, D).sum(2)
        return tuple(np.ascontiguousarray(a.transpose(tr)).astype(B.bfloat16) for a in (dq, dk, dv))
    dq = xp.empty(q.shape, dtype=B.bfloat16)
    dk = xp.empty(k.shape, dtype=B.bfloat16)
    dv = xp.empty(k.shape, dtype=B.bfloat16)
    if Bsz * H == 0:
        return dq, dk, dv
    A90 = _use_sm90(km, D)
    if A90 is not None and Tq and Tk:
        return A90.flash_attention_backward_sm90(dout, q, k, v, out, lse, causal=causal, scale=scale)
    delta = xp.empty((Bsz, H, Tq), dtype=np.float32)  # workspace: written by the dq kernel, read by dkdv
    sq, sk, sv, sd = _strides("q", q), _strides("k", k), _strides("v", v), _strides("dout", dout)
    tail = (np.int32(Tq), np.int32(Tk), np.int32(H), np.int32(Hkv), scale, np.bool_(causal),
            *_mask_args(key_mask, km))
    if Tq:
        kq, smq = _kernel("dq", D, km is not None)
        kq((-(-Tq // BM), H, Bsz), (THREADS, 1, 1),
           (q, k, v, out, dout, lse, delta, dq, *sq, *sk, *sv, *sd, *tail), shared_mem=smq)
    if Tk:
        kd, smd = _kernel("dkdv", D, km is not None)
        kd((-(-Tk // BM), Hkv, Bsz), (THREADS, 1, 1),
           (q, k, v, dout, lse, delta, dk, dv, *sq, *sk, *sv, *sd, *tail), shared_mem=smd)
    return dq, dk, dv
