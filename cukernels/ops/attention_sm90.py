"""Flash attention forward on Hopper's warpgroup MMA: ``ck.flash_attention_sm90`` (sm_90 GPUs only: H100 / H200).
Kernels: ``kernels_cu/attention_sm90.cu`` (compiled for sm_90a: wgmma, setmaxnreg).

Same contract as :func:`cukernels.ops.attention.flash_attention` (layout, causal alignment, GQA, lse format), so
its ``lse`` feeds :func:`cukernels.ops.attention.flash_attention_backward` unchanged. No key-padding mask here:
``ck.flash_attention`` keeps those calls on its mma.sync kernels.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import _backend as B
from .._loader import get_function
from .attention import _strides, _validate
from .attention import flash_attention as _flash_attention

FAMILY = "attention_sm90"
THREADS = 384  # producer warpgroup + 2 consumer warpgroups
BM = 128       # query rows per CTA (64 per consumer warpgroup)
# head_dim -> (key tile, pipeline stages); must match the CK_ATTN90_FWD lines of attention_sm90.cu.
CONFIG = {64: (128, 3), 128: (128, 2)}
HEAD_DIMS = tuple(CONFIG)
# Kernel variant (entry-point suffix): "" = pipelined ping-pong consumers (S of tile j + 1 and P V of tile j issued
# together, the softmax under the P V, the two consumer warpgroups alternating on the tensor cores);
# "_serial" = one tile at a time per warpgroup (same tiles and shared memory). Both are tested.
VARIANTS = ("", "_serial")
VARIANT = ""


def smem_bytes(D: int) -> int:
    """Dynamic shared memory of attn_sm90_fwd_d{D} (Smem<D, BN, STAGES>::BYTES in the kernel): the Q tile, the
    K and V stages, the mbarriers (8 bytes each: Q, full and empty per stage) and 1024 bytes of alignment slack."""
    bn, st = CONFIG[D]
    return BM * D * 2 + 2 * st * bn * D * 2 + 8 * (1 + 2 * st) + 1024


@functools.lru_cache(maxsize=None)
def _cc(dev: int) -> str:
    import cupy

    return cupy.cuda.Device(dev).compute_capability


def supported() -> bool:
    """True when the current CUDA device can run the sm_90a kernels (compute capability 9.0 exactly: the
    architecture-specific features compiled here do not exist on other generations)."""
    if not B.gpu_available():
        return False
    import cupy

    return _cc(cupy.cuda.Device().id) == "90"


_configured: set = set()


def _kernel(D, variant):
    k = get_function(FAMILY, f"attn_sm90_fwd_d{D}{variant}")
    smem = smem_bytes(D)
    key = (D, variant, id(k))
    if key not in _configured:  # a host-side attribute, set once before any capture
        k.max_dynamic_shared_size_bytes = smem
        _configured.add(key)
    return k, smem


@B.interop
def flash_attention_sm90(q, k, v, *, causal=True, scale=None, out=None, return_lse=False):
    """Scaled-dot-product attention forward on Hopper's wgmma tensor-core path (bf16, fp32 softmax).

    ``o[b, i, h] = sum_n softmax_n(scale * <q[b, i, h], k[b, n, h // G]>) * v[b, n, h // G]`` with
    ``G = heads / kv_heads``; ``causal=True`` masks key n for query i when ``n > i + seq_k - seq_q``. Same
    contract as :func:`flash_attention` without ``key_mask``; the probabilities enter the second product rounded
    to bf16, so the result matches an fp32 reference to bf16 accuracy.

    Args:
        q: bfloat16 ``[batch, seq_q, heads, head_dim]``; head_dim 64 or 128.
        k, v: bfloat16 ``[batch, seq_k, kv_heads, head_dim]``, kv_heads dividing heads. Strided views are read in
            place (last axis contiguous, pointer and other strides multiples of 16 bytes).
        causal: the causal mask (a bool).
        scale: the score multiplier, a finite number > 0; default ``1 / sqrt(head_dim)``.
        out: optional C-contiguous bfloat16 buffer of q's shape.
        return_lse: also return ``lse`` float32 ``[batch, heads, seq_q]`` (natural log; -inf for a query that
            sees no key), the input of :func:`flash_attention_backward`.

    Returns:
        ``o`` (C-contiguous, q's shape), or ``(o, lse)``.

    Raises:
        ValueError: head_dim not 64 / 128, or (CuPy arrays) the current GPU is not sm_90 (H100 / H200).

    Example::

        >>> if ck.flash_attention_sm90_supported():
        ...     o, lse = ck.flash_attention_sm90(q, k, v, causal=True, return_lse=True)
    """
    xp = B.array_module(q=q, k=k, v=v, out=out)
    Bsz, Tq, Tk, H, Hkv, D, causal, scale = _validate(q, k, v, causal, scale)
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {HEAD_DIMS} for the wgmma kernels; got {D} "
                         f"(flash_attention takes 32 too)")
    if xp is np:  # the NumPy reference is flash_attention's (same math, same lse)
        return _flash_attention(q, k, v, causal=causal, scale=scale, out=out, return_lse=return_lse)
    if not supported():
        import cupy

        raise ValueError(f"q: flash_attention_sm90 runs on compute capability 9.0 GPUs (H100 / H200) only; the "
                         f"current device has {_cc(cupy.cuda.Device().id)} (use flash_attention)")
    o = B.empty(xp, q.shape, B.bfloat16, out)
    lse = xp.empty((Bsz, H, Tq), dtype=np.float32)
    if Bsz * H * Tq == 0:
        return (o, lse) if return_lse else o
    sq, sk, sv = _strides("q", q), _strides("k", k), _strides("v", v)
    kern, smem = _kernel(D, VARIANT)
    kern((-(-Tq // BM), H, Bsz), (THREADS, 1, 1),
         (q, k, v, o, lse, *sq, *sk, *sv, np.int32(Tq), np.int32(Tk), np.int32(H), np.int32(Hkv), scale,
          np.bool_(causal)), shared_mem=smem)
    return (o, lse) if return_lse else o


flash_attention_sm90_supported = supported
