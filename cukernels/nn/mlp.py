"""Feed-forward blocks: the gated SwiGLU MLP (LLaMA) and the two-layer GELU MLP (GPT-2)."""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .. import functional as F
from .layers import Linear, packable, project_packed
from .module import Module, check_param_args


class SwiGLUMLP(Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Hugging Face LLaMA names)."""

    def __init__(self, hidden, ffn, *, bias=False, xp=np, rng=None, std=0.02, dtype=None):
        hidden, ffn = check_param_args(hidden=hidden, ffn=ffn, std=std, dtype=dtype, xp=xp)
        bias = B.check_bool("bias", bias)
        kw = dict(bias=bias, xp=xp, rng=rng, std=std, dtype=dtype)
        self.gate_proj = Linear(hidden, ffn, **kw)
        self.up_proj = Linear(hidden, ffn, **kw)
        self.down_proj = Linear(ffn, hidden, **kw)

    def forward(self, x):
        pair = (self.gate_proj, self.up_proj)
        if packable(self, pair):  # gate and up as one GEMM, [..., 2 ffn] read by the packed SwiGLU kernel
            return self.down_proj(F.swiglu_packed(project_packed(self, x, pair)))
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x), fused=self.fused))
