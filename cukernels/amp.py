"""bf16 autocast policy, and FP8 GEMMs for the Linear layers (``autocast(ck.float8)``).

Inside ``with ck.autocast(ck.bfloat16):`` the layers run their GEMMs on bf16 operands (cuBLAS accumulates in
fp32) and keep the activations between them in bf16; the weights they read are the optimizer's bf16
**shadow** copies (``param.shadow``, kept equal to the fp32 master by the Adam kernel, attached with
:func:`attach_shadows`), so no weight is cast per use. Norms, softmax and the loss compute in fp32 inside their
kernels whatever the storage dtype; master weights and gradients stay fp32 (a weight gradient is accumulated
into the fp32 ``.grad`` buffer). Without shadows (or on the ``fused: false`` path) each use casts the weight.

Inside ``with ck.autocast(ck.float8):`` everything is as under bf16 autocast except the fused Linear layers'
GEMMs (LLaMA's q / k / v / o and gate / up / down, GPT-2's c_attn / c_proj / c_fc), which run on FP8 tensor
cores through cuBLASLt (``functional/fp8.py``): the input and the weight (its bf16 shadow) cast to E4M3, the
output gradient to E5M2 (or E4M3), per-tensor scales computed on the device, fp32 accumulation, bf16 outputs,
the weight gradient accumulated in fp32 into ``.grad``. The LM head, the embedding and attention stay bf16.
:class:`Float8Recipe` holds the choices; ``ck.float8`` is the default recipe.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np

from . import _backend as B


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How ``autocast(recipe)`` runs the Linear layers' GEMMs in FP8 (``ck.float8`` is ``Float8Recipe()``).

    Args:
        grad_dtype: the FP8 format of the output gradients, ``ck.float8_e4m3fn`` (default) or ``ck.float8_e5m2``
            (Transformer Engine's hybrid format: 2 mantissa bits for 2^15 more range). Inputs and weights are always
            E4M3. Per-tensor scales leave the gradients E4M3's 18 binades, and its third mantissa bit is what
            measured: small.yaml, 2000 steps, last-100 mean loss vs bf16's +0.39 % with E4M3 gradients, +8.2 % with
            E5M2 (``python benchmarks/fp8_quality.py``, H200; benchmarks/NOTES.md, FP8).
        scaling: ``"current"`` (default): each cast scales by the amax of the tensor it casts (an amax pass, then
            the cast pass); ``"delayed"``: by the amax the previous step's cast of the same tensor recorded, the
            amax of this one recorded in the same pass (one pass; a tensor whose range jumps saturates for a step);
            ``"hybrid"``: delayed for the inputs and weights (their ranges move slowly), current for the output
            gradients (the ones whose range jumps: delayed scaling of them cost 1.6 % of small.yaml's loss after 2000
            steps, hybrid 0.3 %; benchmarks/NOTES.md, FP8).
        margin: an integer in [0, 8]: scales are divided by ``2**margin`` (headroom).
        fast_accum: the forward GEMM uses cuBLASLt's fast FP8 accumulation (default True, as Transformer Engine);
        fast_accum_grad: the two backward GEMMs do (default False: their sums over thousands of tokens keep the
            periodic promotion to fp32).
        head_grad_dtype: None (default: the LM head stays bf16), or ``ck.float8_e5m2`` / ``ck.float8_e4m3fn``: the
            fused head + loss (``ck.linear_cross_entropy``) runs its two gradient GEMMs in FP8, dlogits in this
            format (their scale from the bound |dlogits| <= dloss / count); the logits and the loss stay bf16.
            E5M2 keeps the small softmax probabilities a 128k vocabulary spreads below the target's gradient;
            E4M3 has the finer steps. Quality cost measured (benchmarks/NOTES.md, "FP8"): a speed option.
        head_fp8_dw: with ``head_grad_dtype``: True (default) both of the head's gradient GEMMs in FP8; False only
            the dx GEMM, the weight gradient from the bf16 dlogits (the sum whose FP8 rounding measured the cost).
    """

    grad_dtype: object = B.float8_e4m3fn
    scaling: str = "current"
    margin: int = 0
    fast_accum: bool = True
    fast_accum_grad: bool = False
    head_grad_dtype: object = None
    head_fp8_dw: bool = True

    def __post_init__(self):
        g = B.check_dtype_arg("grad_dtype", self.grad_dtype, B.FP8)
        object.__setattr__(self, "grad_dtype", g)
        B.check_choice("scaling", self.scaling, ("current", "delayed", "hybrid"))
        B.check_int("margin", self.margin, min=0, max=8)
        B.check_bool("fast_accum", self.fast_accum)
        B.check_bool("fast_accum_grad", self.fast_accum_grad)
        B.check_bool("head_fp8_dw", self.head_fp8_dw)
        if self.head_grad_dtype is not None:
            object.__setattr__(self, "head_grad_dtype", B.check_dtype_arg("head_grad_dtype", self.head_grad_dtype,
                                                                          B.FP8))

    def replace(self, **changes) -> "Float8Recipe":
        """A copy with some fields changed (``ck.float8.replace(scaling="delayed")``)."""
        return dataclasses.replace(self, **changes)


float8 = Float8Recipe()

# Per thread, as torch's autocast: ranks run as threads in the in-process FakeGroup, and one thread leaving its
# autocast block must not switch another's off mid-forward (a module global did: rank 0's evaluation ended the
# other rank's bf16 forward half way, session 7).
_state = threading.local()


class autocast:
    """``with autocast(ck.bfloat16): loss = model(x, y)``; ``with autocast(ck.float8):`` the same with the Linear
    layers' GEMMs in FP8 (a :class:`Float8Recipe`). ``enabled=False`` (or dtype None) is a no-op."""

    def __init__(self, dtype=None, enabled=True):
        self.fp8 = dtype if isinstance(dtype, Float8Recipe) and enabled else None
        if self.fp8 is not None:
            dtype = B.bfloat16  # everything but the FP8 GEMMs runs as under bf16 autocast
        self.dtype = np.dtype(B.bfloat16 if dtype is None else dtype) if enabled else None

    def __enter__(self):
        self._prev = (getattr(_state, "dtype", None), getattr(_state, "fp8", None))
        _state.dtype, _state.fp8 = self.dtype, self.fp8
        return self

    def __exit__(self, *exc):
        _state.dtype, _state.fp8 = self._prev


def get_autocast_dtype():
    """The active autocast dtype of this thread, or None (bfloat16 under ``autocast(ck.float8)``)."""
    return getattr(_state, "dtype", None)


def get_fp8_recipe():
    """The active :class:`Float8Recipe` of this thread (``autocast(ck.float8)``), or None."""
    return getattr(_state, "fp8", None)


def lowp_weight(param, dtype):
    """The parameter's shadow array when it exists in ``dtype`` (and on the same module), else None.

    Every read of a shadow goes through here, so an optimizer whose update of the shadow is still in flight on
    another stream (``ZeroAdamW(overlap_gather=True)``: the all-gather of the updated pieces runs under the next
    forward) leaves ``param.shadow_wait``, a callable that orders the current stream after it; it is called
    once, before the first reader is queued."""
    s = getattr(param, "shadow", None)
    if s is None or s.dtype != dtype or type(s) is not type(param.data):
        return None
    wait = getattr(param, "shadow_wait", None)
    if wait is not None:
        wait()
    return s


def fp8_weight(params):
    """``(q, q^T, scale_inv)``: the E4M3 copy of these weights (one, or a pack joined by rows under one scale) that
    their optimizer writes in its update (``AdamW(fp8_shadows=True)``, attached by :func:`attach_shadows`), or
    None (no such optimizer, or it cannot keep one: :meth:`cukernels.optim.AdamW.fp8_shadow`). The FP8 linear layers
    then skip their weight casts."""
    opt = getattr(params[0], "fp8_owner", None) if params else None
    if opt is None or any(getattr(p, "fp8_owner", None) is not opt for p in params):
        return None
    return opt.fp8_shadow(params)


def attach_shadows(params, optimizer):
    """Give each parameter ``p.shadow = optimizer.shadow(p)`` (None where the optimizer keeps none), and
    ``p.fp8_owner = optimizer`` when it keeps FP8 copies on request (``fp8_shadows=True``: :func:`fp8_weight`)."""
    fp8 = optimizer if getattr(optimizer, "fp8_shadows", False) else None
    for p in params:
        try:
            p.shadow = optimizer.shadow(p)
        except (KeyError, AttributeError, ValueError):
            p.shadow = None
        p.fp8_owner = fp8
