"""Question: which kernel does PyTorch's scaled_dot_product_attention run for the issue-17 attention shapes, and how
does each of its backends time there (fwd, fwd+bwd; bf16, causal, GQA through enable_gqa), beside ck.flash_attention
in the same process? The "x torch" column of bench_ops is SDPA's default choice.

Answer (2026-12-01, one H200, torch 2.11, cuDNN 9.19, ``python dev/sdpa_backends.py``): the default is cuDNN (fwd
0.109 vs 0.108 ms forced at B8xT1024; 0.334 vs 0.343 at B2xT4096), FlashAttention-2 the slowest, the memory-efficient
backend refuses the shape. fwd+bwd, ms: B8xT1024 default 0.502, FA2 0.799, ck 0.466 (1.08x); B2xT4096 default 1.275,
FA2 2.111, ck 1.380 (0.92x). benchmarks/NOTES.md, "flash_attention_sm90".

    PYTHONPATH=. python dev/sdpa_backends.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(8, 1024, 32, 8, 64), (2, 4096, 32, 8, 64)]


def timed(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    beg, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(3):
        beg.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, beg.elapsed_time(end) / reps)
    return best


def main():
    import cupy as cp

    import cukernels as ck

    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    for B, T, H, Hkv, D in SHAPES:
        flop_f = 4 * B * H * T * T * D / 2  # causal
        q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
        rows = []
        for name, be in (("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                         ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            ctx = sdpa_kernel([be]) if be is not None else torch.autocast("cuda", enabled=False)
            try:
                with ctx:
                    f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    tf = timed(f)

                    def fb():
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                        torch.autograd.grad(o, (q, k, v), do)
                    tfb = timed(fb)
                rows.append((name, tf, tfb))
            except Exception as e:  # a backend that refuses the shape
                rows.append((name, None, f"{type(e).__name__}: {str(e)[:80]}"))
        # ours on the same shape ([B, T, H, D] views)
        cq = cp.asarray(q.detach().transpose(1, 2).contiguous().view(torch.int16).cpu().numpy()).view(ck.bfloat16)
        ck_ = cp.asarray(k.detach().transpose(1, 2).contiguous().view(torch.int16).cpu().numpy()).view(ck.bfloat16)
        cv = cp.asarray(v.detach().transpose(1, 2).contiguous().view(torch.int16).cpu().numpy()).view(ck.bfloat16)
        cdo = cp.asarray(do.transpose(1, 2).contiguous().view(torch.int16).cpu().numpy()).view(ck.bfloat16)

        def ours_f():
            return ck.flash_attention(cq, ck_, cv, causal=True, return_lse=True)

        def ours_fb():
            o, lse = ck.flash_attention(cq, ck_, cv, causal=True, return_lse=True)
            ck.flash_attention_backward(cdo, cq, ck_, cv, o, lse, causal=True)

        def ctime(fn, reps=30):
            for _ in range(3):
                fn()
            cp.cuda.Device().synchronize()
            best = 1e9
            for _ in range(3):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record()
                for _ in range(reps):
                    fn()
                b.record()
                b.synchronize()
                best = min(best, cp.cuda.get_elapsed_time(a, b) / reps)
            return best
        rows.append(("cukernels", ctime(ours_f), ctime(ours_fb)))
        print(f"B{B} T{T} H{H}/{Hkv} D{D} causal (fwd {flop_f / 1e9:.0f} GFLOP, fwd+bwd {3.5 * flop_f / 1e9:.0f}):")
        for name, tf, tfb in rows:
            if tf is None:
                print(f"  {name:<10} refused: {tfb}")
            else:
                print(f"  {name:<10} fwd {tf:.3f} ms ({flop_f / tf / 1e9:.0f} TFLOP/s)   fwd+bwd {tfb:.3f} ms "
                      f"({3.5 * flop_f / tfb / 1e9:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
