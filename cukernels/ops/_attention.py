"""The attention family's shared part: argument checks, the strides the kernels read views by, and the NumPy
reference, used by both kernel launchers -- ``ops/attention.py`` (the public ``ck.flash_attention`` /
``flash_attention_backward``, the mma.sync kernels, and the choice of backend) and ``ops/attention_sm90.py`` (the
wgmma kernels, ``ck.flash_attention_sm90``). Here so that attention.py can import attention_sm90 directly.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _backend as B
from .rope import check_tables as _check_rope_tables
from .rope import rope_backward as _rope_backward

HEAD_DIMS = (32, 64, 128)  # the head_dims ck.flash_attention takes (ops/attention.py's TILES has one entry each)


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


def check_window(window, causal, Tk):
    """``window`` of a call (``_backend.check_window``: None or an int >= 1 that needs ``causal=True``). Returns the
    W the kernels take, or None when there is none or when W >= seq_k: a query then already sees at most seq_k <= W
    keys, so the window hides nothing and the plain kernels run (bit for bit the no-window result)."""
    window = B.check_window(window, causal)
    return window if window is not None and window < Tk else None


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
    """q, k, v, causal, scale of a call checked: ``(batch, seq_q, seq_k, heads, kv_heads, head_dim, causal, scale)``
    (scale as float32)."""
    _check_qkv("q", q, "[batch, seq_q, heads, head_dim]")
    _check_qkv("k", k, "[batch, seq_k, kv_heads, head_dim]")
    _check_qkv("v", v, "[batch, seq_k, kv_heads, head_dim]")
    Bsz, Tq, H, D, Tk, Hkv = gqa_shapes(q, k, v, HEAD_DIMS, d_hint=" (use attn_softmax for other sizes)")
    return Bsz, Tq, Tk, H, Hkv, D, B.check_bool("causal", causal), _check_scale(scale, D)


def _ref_probs(q, k, causal, scale, key_mask=None, window=None):
    """NumPy path: fp32 scores [B, H, Tq, Tk] with the masks applied (-inf), and lse [B, H, Tq] (-inf for a row
    that sees no key). ``window`` W (causal): query i sees key n iff ``i + Tk - Tq - W < n <= i + Tk - Tq``."""
    Bsz, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    qf = q.astype(np.float32).transpose(0, 2, 1, 3)
    kf = np.repeat(k.astype(np.float32).transpose(0, 2, 1, 3), H // Hkv, axis=1)
    s = np.matmul(qf, kf.transpose(0, 1, 3, 2)) * np.float32(scale)
    if causal:
        back = np.arange(Tq)[:, None] + (Tk - Tq) - np.arange(Tk)[None, :]  # how far key n lies behind query i
        vis = back >= 0
        if window is not None:
            vis &= back < window
        s = np.where(vis, s, np.float32(-np.inf))
    if key_mask is not None:
        s = np.where((key_mask != 0)[:, None, None, :], s, np.float32(-np.inf))
    m = s.max(-1, keepdims=True) if Tk else np.full(s.shape[:-1] + (1,), -np.inf, np.float32)
    mb = np.where(np.isfinite(m), m, 0).astype(np.float32)
    with np.errstate(divide="ignore"):
        lse = (np.log(np.exp(s - mb).sum(-1, keepdims=True)) + mb).astype(np.float32)
    return s, lse[..., 0]


def reference_forward(q, k, v, causal, scale, key_mask, o, window=None):
    """NumPy: the attention output into ``o`` (bf16, q's shape); returns lse [B, H, Tq] (-inf for a row that sees no
    key). ``scale`` the float32 of :func:`_validate`, ``window`` that of :func:`check_window`."""
    H, Hkv = q.shape[2], k.shape[2]
    s, lse = _ref_probs(q, k, causal, scale, key_mask, window)
    with np.errstate(invalid="ignore"):
        p = np.where(np.isfinite(lse)[..., None], np.exp(s - lse[..., None]), 0).astype(np.float32)
    vf = np.repeat(v.astype(np.float32).transpose(0, 2, 1, 3), H // Hkv, axis=1)
    o[...] = np.matmul(p, vf).transpose(0, 2, 1, 3).astype(B.bfloat16)
    return lse


def reference_backward(dout, q, k, v, out, lse, causal, scale, key_mask, grads_out, rope, window=None):
    """NumPy: ``(dq, dk, dv)`` of ``flash_attention_backward`` (the inputs past :func:`_check_saved`): ``grads_out``
    checked and filled when given, the rope's backward applied to dq and dk when ``rope`` is given."""
    Bsz, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if rope is not None:
        rope = check_rope_grads(rope, Bsz, Tq, Tk, D, np)
    if grads_out is not None:
        grads_out = check_grads_out(grads_out, q, k, np)
    G = H // Hkv
    s, _ = _ref_probs(q, k, causal, scale, key_mask, window)
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
    grads = tuple(np.ascontiguousarray(a.transpose(tr)).astype(B.bfloat16) for a in (dq, dk, dv))
    if grads_out is not None:
        for o, r in zip(grads_out, grads):
            o[...] = r
        grads = grads_out
    if rope is not None:
        for g in grads[:2]:
            _rope_backward(g, rope[0], rope[1], positions=rope[2], out=g)
    return grads
