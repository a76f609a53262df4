"""Time ck.functional's flash attention fwd+bwd (the training step's path) at the LLaMA-1B B8xT1024 shape with
the wgmma dispatch on and off (ops.attention.WGMMA), CUDA events over 20 repeats."""
import cupy as cp
import numpy as np

import cukernels as ck
from cukernels import functional as F
from cukernels.ops import attention as A

Bsz, T, H, Hkv, D = 8, 1024, 32, 8, 64
rng = cp.random.default_rng(0)
q, k, v, g = (rng.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)
              for s in ((Bsz, T, H, D), (Bsz, T, Hkv, D), (Bsz, T, Hkv, D), (Bsz, T, H, D)))
for flag in (False, True, False, True):
    A.WGMMA = flag

    def run():
        qt, kt, vt = (ck.Tensor(a, requires_grad=True) for a in (q, k, v))
        o = F.flash_attention(qt, kt, vt, causal=True)
        o.backward(ck.Tensor(g))
        return qt.grad
    for _ in range(3):
        run()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(20):
        run()
    e.record()
    e.synchronize()
    print(f"WGMMA={flag}: {cp.cuda.get_elapsed_time(s, e) / 20:.3f} ms fwd+bwd (functional path)", flush=True)
print("sm90 used:", A._SM90)
