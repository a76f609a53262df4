"""Rotary position embedding: ``ck.rope_cache``, ``ck.rope``, ``ck.rope_backward``. Kernels: ``kernels_cu/rope.cu``."""
from __future__ import annotations

import math

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from ._launch import THREADS, launch_grid, vec_ok

FAMILY = "rope"
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


_ROPE_TYPES = ("default", "linear", "llama3")


def _check_scaling(scaling):
    """Hugging Face's rope_scaling dict, validated: (kind, {key: value}) with the numbers the kind needs."""
    if scaling is None:
        return "default", {}
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling: expected None or a dict in Hugging Face's rope_scaling form; got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(kind, str) or kind not in _ROPE_TYPES:
        raise ValueError(f"scaling: rope_type {kind!r} is not supported (use 'llama3', 'linear' or 'default')")
    need = {"default": (), "linear": ("factor",), "llama3": _LLAMA3_KEYS}[kind]
    missing = [k for k in need if k not in scaling]
    if missing:
        raise ValueError(f"scaling: rope_type {kind!r} needs keys {list(need)}; missing {missing}")
    v = {}
    for k in need:
        if k == "original_max_position_embeddings":
            v[k] = B.check_int(f"scaling[{k!r}]", scaling[k], min=1)
        else:  # factor 0 gave NaN tables, a negative one flipped the rotation: both refused
            v[k] = B.check_real(f"scaling[{k!r}]", scaling[k], min=0, min_open=True)
    if kind == "llama3" and not v["high_freq_factor"] > v["low_freq_factor"]:
        raise ValueError(f"scaling['high_freq_factor']: expected a number > low_freq_factor "
                         f"({v['low_freq_factor']!r}); got {v['high_freq_factor']!r}")
    return kind, v


def _inv_freq(head_dim, theta, scaling):
    """inv_freq[i] = theta^(-2i / head_dim), i < head_dim / 2, float64, with Hugging Face's rope_scaling applied."""
    inv = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind, v = _check_scaling(scaling)
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / v["factor"]
    # transformers.modeling_rope_utils._compute_llama3_parameters, in float64.
    factor = v["factor"]
    low_freq_factor = v["low_freq_factor"]
    high_freq_factor = v["high_freq_factor"]
    old_context_len = float(v["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv
    # wavelen < high_freq_wavelen: unchanged; wavelen > low_freq_wavelen: divided by factor
    inv_llama = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
    # in between: interpolate smoothly
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_llama)


def rope_cache(seq_len, head_dim, theta=500000.0, scaling=None, *, xp=None):
    """The cos/sin tables for :func:`rope`.

    ``inv_freq[i] = theta ** (-2i / head_dim)`` for ``i < head_dim / 2`` (optionally rescaled, below), and
    ``cos[p, i] = cos(p * inv_freq[i])``, ``sin[p, i] = sin(p * inv_freq[i])``, computed in float64 on the host
    and rounded once to float32.

    Layout: ``[seq_len, head_dim // 2]``, one column per frequency, used by both RoPE layouts (Hugging Face's
    ``cos`` of ``[seq_len, head_dim]`` is this table concatenated with itself along the last axis).

    Args:
        seq_len: number of positions (rows), >= 1.
        head_dim: even, >= 2.
        theta: the base (LLaMA-3: 500000; LLaMA-2: 10000).
        scaling: None (plain RoPE), or Hugging Face's ``rope_scaling`` dict: ``{"rope_type": "llama3",
            "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}`` (LLaMA-3.1/3.2; transformers'
            ``_compute_llama3_parameters``: wavelengths above ``orig / low_freq_factor`` are divided by
            ``factor``, below ``orig / high_freq_factor`` kept, smoothly interpolated in between), also
            ``{"rope_type": "linear", "factor": f}`` and ``{"rope_type": "default"}``. Checked: factors
            finite and > 0, ``high_freq_factor > low_freq_factor``, ``original_max_position_embeddings`` an
            integer >= 1 (ValueError / TypeError naming the key).
        xp: ``numpy`` or ``cupy``: the module of the returned arrays (default: cupy when a GPU is visible).

    Returns:
        ``(cos, sin)``, float32 ``[seq_len, head_dim // 2]``.

    Example::

        >>> cos, sin = ck.rope_cache(8192, 64, 500000.0, {"rope_type": "llama3", "factor": 32.0,
        ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    """
    seq_len = B.check_size("seq_len", seq_len)  # (the kernels take int32 positions)
    head_dim = B.check_size("head_dim", head_dim, min=-2**63)
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim: expected an even integer >= 2; got {head_dim!r}")
    theta = B.check_real("theta", theta, min=0, min_open=True)
    if xp is not None and xp is not np and (B._cupy() is None or xp is not B._cupy()):
        raise TypeError(f"xp: expected numpy, cupy or None; got {xp!r}")
    # The tables are computed in float64 on the host (angles, cos, sin: 3 x 8 bytes an entry, then the two
    # float32 tables): a size typed wrong is refused here, before NumPy is asked for it.
    B.check_alloc("seq_len" if seq_len >= head_dim else "head_dim", (seq_len, head_dim // 2, 4), np.float64, np,
                  "the rope tables' float64 work")
    inv = _inv_freq(head_dim, theta, scaling)
    ang = np.arange(seq_len, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    if xp is None:
        xp = B._cupy() if B.gpu_available() else np
    if xp is np:
        return cos, sin
    return xp.asarray(cos), xp.asarray(sin)


def _validate(xn, x, cos, sin, positions):
    B.check_dtype(xn, x, B.FLOATS)
    if x.ndim != 4:
        raise ValueError(f"{xn}: expected 4 dimensions [batch, seq, heads, head_dim]; got shape {tuple(x.shape)}")
    Bsz, S, H, D = (int(v) for v in x.shape)
    if D < 2 or D % 2:
        raise ValueError(f"{xn}: head_dim (last axis) must be even and >= 2; got shape {tuple(x.shape)}")
    ts = token_stride(xn, x)
    L, mode = check_tables(cos, sin, positions, Bsz, S, D, xn)
    return Bsz, S, H, D, L, mode, ts


def token_stride(name, a):
    """Elements between consecutive tokens of ``a`` [batch, seq, heads, head_dim] whose heads and head_dim are
    contiguous and whose tokens are evenly spaced: H * D for a C-contiguous array, more for the q and k heads of a
    packed qkv projection (``qkv[:, :, :H + Hkv]``). Anything else is a ValueError naming the argument."""
    Bsz, S, H, D = (int(v) for v in a.shape)
    if a.size == 0:  # nothing is addressed (CuPy reports strides of 0 for empty arrays)
        return H * D
    it = a.itemsize
    st = [int(v) for v in a.strides]
    ts = st[1] // it if S > 1 else (st[0] // it if Bsz > 1 else H * D)
    ok = ((D < 2 or st[3] == it) and (H < 2 or st[2] == D * it) and ts >= H * D and st[1] % it == 0
          and (S < 2 or st[1] == ts * it) and (Bsz < 2 or st[0] == S * ts * it))
    if not ok:
        raise ValueError(f"{name}: expected [batch, seq, heads, head_dim] with heads and head_dim contiguous and "
                         f"evenly spaced tokens (C-contiguous, or the q/k heads of a packed projection); got strides "
                         f"{a.strides} for shape {tuple(a.shape)} (call ascontiguousarray first)")
    return ts


def check_tables(cos, sin, positions, Bsz, S, D, xn):
    """Validate the rotary tables and positions for ``Bsz`` rows of ``S`` tokens of head_dim ``D`` (``xn``: the
    input's name in messages). Returns ``(L, mode)``: the table length and how positions are read (0: none,
    token s uses row s; 1: [S] shared by the batch; 2: [Bsz, S]). Shared by ``rope`` and ``rope_kv_write``."""
    for name, t in (("cos", cos), ("sin", sin)):
        B.check_dtype(name, t, (np.float32,))
        if t.ndim != 2 or t.shape[1] != D // 2 or t.shape[0] < 1:
            raise ValueError(f"{name}: expected shape (L, {D // 2}) = (positions, head_dim // 2) with L >= 1; "
                             f"got {tuple(t.shape)}")
        B.check_contiguous(name, t)
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected shape {tuple(cos.shape)} (the shape of cos); got {tuple(sin.shape)}")
    L = int(cos.shape[0])
    if positions is None:
        if S > L:
            raise ValueError(f"cos: has {L} positions but {xn} has seq = {S} (pass a longer cache, or positions=)")
        return L, 0
    B.check_dtype("positions", positions, (np.int32, np.int64))
    if tuple(positions.shape) == (S,):
        mode = 1
    elif tuple(positions.shape) == (Bsz, S):
        mode = 2
    else:
        raise ValueError(f"positions: expected shape ({S},) or ({Bsz}, {S}); got {tuple(positions.shape)}")
    B.check_contiguous("positions", positions)
    return L, mode


def _rope(xn, x, cos, sin, positions, interleaved, out, sgn):
    xp = B.array_module(**{xn: x}, cos=cos, sin=sin, positions=positions, out=out)
    Bsz, S, H, D, L, mode, xs = _validate(xn, x, cos, sin, positions)
    if out is not None:
        B.check_dtype("out", out, (x.dtype,))
        B.check_shape("out", out, x.shape)
        B.check_writable("out", out)
        ys = token_stride("out", out)
        y = out
    else:
        y, ys = xp.empty(x.shape, dtype=x.dtype), H * D
    half = D // 2
    if xp is np:
        if positions is None:
            pos = np.arange(S)[None, :]
        else:
            pos = positions.astype(np.int64)
            pos = pos[None, :] if pos.ndim == 1 else pos
            if pos.size and (pos.min() < 0 or pos.max() >= L):
                raise ValueError(f"positions: values must lie in [0, {L}) (the rows of cos); "
                                 f"got min {pos.min()}, max {pos.max()}")
        c = cos.astype(np.float64)[pos][:, :, None, :]  # (1 or B, S, 1, D/2)
        s = sgn * sin.astype(np.float64)[pos][:, :, None, :]
        xf = x.astype(np.float64)
        if interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            r = np.empty_like(xf)
            r[..., 0::2] = x1 * c - x2 * s
            r[..., 1::2] = x2 * c + x1 * s
        else:
            x1, x2 = xf[..., :half], xf[..., half:]
            r = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
        y[...] = r.astype(x.dtype)
        return y

    ntok = Bsz * S
    if ntok * H == 0:
        return y
    E = 16 // x.itemsize
    vec = vec_ok(x, y) and (D % E == 0 if interleaved else half % E == 0) and xs % E == 0 and ys % E == 0
    pe = E if vec else (2 if interleaved else 1)  # elements per unit, per head
    units = ntok * ((D if interleaved else half) // pe)
    cs_vec = vec_ok(cos, sin) and half % 4 == 0
    ptag = B.DTYPE_TAG[positions.dtype] if positions is not None else "i32"
    name = f"rope_{B.DTYPE_TAG[x.dtype]}_{ptag}_{'i' if interleaved else 'h'}_{'v' if vec else 's'}"
    k = get_function(FAMILY, name)
    # Split the heads across threads until a wave is full (about 2048 threads per SM), one head per thread at most;
    # then round each thread's head chunk to the nearest multiple of the kernel's 4 heads in flight
    # (ck.settings.rope_head_round; 1 = none).
    # The packed q + k of LLaMA-3.2-1B (40 heads) at 8192 tokens gave chunks of 5: a round of 4 heads and one of
    # 1 (a quarter of the bytes in flight for a whole DRAM round trip); 4 took the call from 33.7 to 30.5 us
    # (session 16, run A). Rounding 7 down to 4 (32 heads at 16384 tokens) cost 10 %: twice the unit iterations,
    # each with its cos / sin loads and index divisions; 7 goes up to 8.
    hsplit = int(min(H, max(1, -(-B.sm_count() * 2048 // units))))
    r = settings.rope_head_round
    if r > 1:
        hc = -(-H // hsplit)
        hc = min(H, max(r, (2 * hc + r) // (2 * r) * r))  # nearest, ties up
        hsplit = -(-H // hc)
    grid = launch_grid(k, units * hsplit)
    k((grid,), (THREADS, 1, 1),
      (x, y, cos, sin, positions if positions is not None else B.NULL, np.int64(ntok), np.int32(S), np.int32(H),
       np.int32(D), np.int32(L), np.int32(mode), np.float32(sgn), np.bool_(cs_vec), np.int32(hsplit),
       np.int64(xs), np.int64(ys)))
    return y


@B.interop
def rope(x, cos, sin, *, positions=None, interleaved=False, out=None):
    """Apply rotary position embedding to ``x`` [batch, seq, heads, head_dim] (fp32 math).

    For token (b, s) at position ``p`` and frequency ``i < D/2`` with ``c = cos[p, i]``, ``sn = sin[p, i]``, the
    pair ``(x1, x2)`` becomes ``(x1 c - x2 sn, x2 c + x1 sn)``; the pairs are ``(i, i + D/2)`` when
    ``interleaved=False`` (Hugging Face's rotate-half layout: ``x * cos + rotate_half(x) * sin``, so HF
    checkpoints work unchanged) and ``(2i, 2i + 1)`` when ``interleaved=True`` (the original RoPE / Meta layout).

    Args:
        x: ``[batch, seq, heads, head_dim]`` float32 or bfloat16, head_dim even; C-contiguous, or with only the
            tokens spaced wider (the q / k heads ``qkv[:, :, :H + Hkv]`` of a packed projection, in place).
        cos, sin: float32 ``[L, head_dim // 2]`` from :func:`rope_cache`.
        positions: optional int32/int64 ``[seq]`` or ``[batch, seq]``: each token's position (row of cos/sin).
            Default ``arange(seq)`` (then L >= seq is required). Values must lie in ``[0, L)``: the NumPy path
            raises otherwise; the kernel clamps them into the table (it never reads outside it, and cannot
            check without a host sync).
        interleaved: the pair layout (above).
        out: optional output of x's shape and dtype (its tokens may be spaced as x's may); ``out=x`` rotates in
            place.

    Returns:
        ``y`` like ``x``.

    Example::

        >>> cos, sin = ck.rope_cache(4096, 64)
        >>> q = ck.rope(q, cos, sin, out=q)          # q: [batch, seq, heads, 64], in place
    """
    return _rope("x", x, cos, sin, positions, B.check_bool("interleaved", interleaved), out, 1.0)


@B.interop
def rope_backward(dy, cos, sin, *, positions=None, interleaved=False, out=None):
    """Gradient of :func:`rope`: the inverse (transposed) rotation, ``(dy1 c + dy2 sn, dy2 c - dy1 sn)``.

    Same arguments as :func:`rope` with ``dy`` in place of ``x``; ``out=dy`` works in place. Because the
    rotation is orthogonal, ``<rope(x), y> == <x, rope_backward(y)>``.
    """
    return _rope("dy", dy, cos, sin, positions, B.check_bool("interleaved", interleaved), out, -1.0)


__all__ = ["rope", "rope_backward", "rope_cache"]
