"""Feed-forward blocks: the gated SwiGLU MLP (LLaMA) and the two-layer GELU MLP (GPT-2)."""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .. import amp
from .. import functional as F
from .layers import Linear, fp8_recipe, fp8_state, packable, project_packed, weight_for_gemm
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
            gu = project_packed(self, x, pair)
            down = self.down_proj
            r = None
            if type(down) is Linear and down.bias is None and gu.dtype == B.bfloat16:  # (no LoRA adapter on it)
                r = fp8_recipe(down, gu, down.in_features, down.out_features)
            if r is not None:  # FP8: the SwiGLU kernels take the amax the casts of h and dgu need
                wt, wl = weight_for_gemm(down, down.weight)
                pack8 = (not any(hasattr(lin, "project_packed") for lin in pair)  # project_packed ran the FP8 pack
                         and fp8_recipe(self, x, pair[0].in_features, sum(lin.out_features for lin in pair)) is not None)
                up = fp8_state(self, "_fp8_packed_state") if pack8 else None
                return F.fp8_swiglu_down(gu, wt, wl, recipe=r, state=fp8_state(down), up_state=up,
                                         w_fp8=amp.fp8_weight([down.weight]))
            return down(F.swiglu_packed(gu))
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x), fused=self.fused))
