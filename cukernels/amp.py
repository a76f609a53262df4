"""bf16 autocast policy.

Inside ``with ck.autocast(ck.bfloat16):`` the layers run their GEMMs on bf16 operands (cuBLAS accumulates in
fp32) and keep the activations between them in bf16; the weights they read are the optimizer's bf16
**shadow** copies (``param.shadow``, kept equal to the fp32 master by the Adam kernel, attached with
:func:`attach_shadows`), so no weight is cast per use. Norms, softmax and the loss compute in fp32 inside their
kernels whatever the storage dtype; master weights and gradients stay fp32 (a weight gradient is accumulated
into the fp32 ``.grad`` buffer). Without shadows (or on the ``fused: false`` path) each use casts the weight.
"""
from __future__ import annotations

import threading

import numpy as np

# Per thread, as torch's autocast: ranks run as threads in the in-process FakeGroup, and one thread leaving its
# autocast block must not switch another's off mid-forward (a module global did: rank 0's evaluation ended the
# other rank's bf16 forward half way, session 7).
_state = threading.local()


class autocast:
    """``with autocast(ck.bfloat16): loss = model(x, y)``. ``enabled=False`` (or dtype None) is a no-op."""

    def __init__(self, dtype=None, enabled=True):
        from ._backend import bfloat16
        self.dtype = np.dtype(bfloat16 if dtype is None else dtype) if enabled else None

    def __enter__(self):
        self._prev = getattr(_state, "dtype", None)
        _state.dtype = self.dtype
        return self

    def __exit__(self, *exc):
        _state.dtype = self._prev


def get_autocast_dtype():
    """The active autocast dtype of this thread, or None."""
    return getattr(_state, "dtype", None)


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


def attach_shadows(params, optimizer):
    """Give each parameter ``p.shadow = optimizer.shadow(p)`` (None where the optimizer keeps none)."""
    for p in params:
        try:
            p.shadow = optimizer.shadow(p)
        except (KeyError, AttributeError, ValueError):
            p.shadow = None
