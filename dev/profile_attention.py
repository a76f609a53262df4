"""Question: how do ck.flash_attention's kernels (the mma.sync family) time beside PyTorch's
scaled_dot_product_attention (cuDNN / flash backend), kernel by kernel? From CUPTI through torch.profiler. The
"pad25%L" configuration adds the benchmark's left-padding key mask (ck: the *_km kernels; torch: what transformers'
sdpa path runs, repeated K/V heads and a [B, 1, T, T] boolean mask).

Answer (2026-11-29, one H200, ``python dev/profile_attention.py``): at B8xT1024 H32/8 D64 causal the mma.sync kernels
took fwd ~191 us and bwd ~618 us, cuDNN's sm90 wgmma kernels ~1.7x less (fwd+bwd 0.60x SDPA): what led to the wgmma
family (ck.flash_attention_sm90, now dispatched on Hopper: 1.09x SDPA, ``python benchmarks/bench_ops.py --only
attention_sm90``). benchmarks/NOTES.md, "flash_attention".

    PYTHONPATH=. python dev/profile_attention.py
"""
import os
import sys

import cupy as cp
import torch

sys.path.insert(0, '.')
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # cases
import cukernels as ck
from torch.profiler import profile, ProfilerActivity
import torch.nn.functional as Fn
from cases.attention import left_padding_mask

for (B,T,H,Hkv,D,causal,padded) in [(8,1024,32,8,64,True,False),(8,1024,32,8,64,True,True),
                                    (2,4096,32,8,64,True,False),(8,1024,32,8,64,False,False)]:
    r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)
    q,k,v,do = r(B,T,H,D), r(B,T,Hkv,D), r(B,T,Hkv,D), r(B,T,H,D)
    km = left_padding_mask(cp, B, T) if padded else None
    o,lse = ck.flash_attention(q,k,v,causal=causal,key_mask=km,return_lse=True)
    ck.flash_attention_backward(do,q,k,v,o,lse,causal=causal,key_mask=km)
    tq = torch.randn(B,H,T,D,device='cuda',dtype=torch.bfloat16,requires_grad=True)
    tk = torch.randn(B,Hkv,T,D,device='cuda',dtype=torch.bfloat16,requires_grad=True)
    tv = torch.randn(B,Hkv,T,D,device='cuda',dtype=torch.bfloat16,requires_grad=True)
    tdo = torch.randn(B,H,T,D,device='cuda',dtype=torch.bfloat16)
    if padded:
        keep = torch.as_tensor(km, device='cuda').bool()
        vis = torch.ones(T,T,dtype=torch.bool,device='cuda')
        mask4 = ((torch.tril(vis) if causal else vis)[None,None] & keep[:,None,None,:]).contiguous()
        sdpa = lambda: Fn.scaled_dot_product_attention(tq, tk.repeat_interleave(H//Hkv,1),
                                                       tv.repeat_interleave(H//Hkv,1), attn_mask=mask4)
    else:
        sdpa = lambda: Fn.scaled_dot_product_attention(tq,tk,tv,is_causal=causal,enable_gqa=True)
    cp.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            o,lse = ck.flash_attention(q,k,v,causal=causal,key_mask=km,return_lse=True)
            ck.flash_attention_backward(do,q,k,v,o,lse,causal=causal,key_mask=km)
            to = sdpa()
            torch.autograd.grad(to,(tq,tk,tv),tdo)
        torch.cuda.synchronize()
    agg={}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a=agg.setdefault(e.name[:70],[0,0]); a[0]+=e.device_time_total/3; a[1]+=1
    f = 4*B*H*T*T*D*(0.5 if causal else 1)
    print(f"== {B}x{T}x{H}/{Hkv}x{D} causal={causal}{' pad25%L' if padded else ''}  fwd flops {f:.3g}")
    for n,(us,c) in sorted(agg.items(), key=lambda kv:-kv[1][0])[:10]:
        print(f"  {us:9.1f} us  {c//3:3d}x  {n}")
