"""One call of each kernel family's main paths on small odd shapes, for the CUDA sanitizers:

    compute-sanitizer --tool racecheck python benchmarks/racecheck_ops.py     (shared-memory hazards)
    compute-sanitizer --tool synccheck python benchmarks/racecheck_ops.py     (barrier misuse)
    compute-sanitizer --tool memcheck  python benchmarks/racecheck_ops.py     (out-of-bounds accesses)

The shapes are small (the tools slow kernels 10-100x) but pick the same kernels as the training shapes: rows of
768 and 2048 columns for the norms (the one-warp-a-row layer_norm backward at 768 bf16), 32768-column softmax rows
(the cluster kernels), 128256-column cross-entropy rows. Prints each call as it finishes; the tool prints hazards.
The sm_90a attention kernels (TMA, mbarriers, wgmma: asynchronous proxies the tools do not follow) are left out.
"""
import sys
import time

import cupy as cp
import numpy as np

import cukernels as ck

BF = ck.bfloat16


def r(shape, dt=np.float32, scale=1.0):
    return (cp.random.standard_normal(shape, dtype=cp.float32) * scale).astype(dt)


def run(name, fn):
    t = time.time()
    fn()
    cp.cuda.Device().synchronize()
    print(f"{name:<44} {time.time() - t:7.2f} s", flush=True)


def main(only=None):
    cp.random.seed(0)
    calls = []
    for dt in (np.float32, BF):
        dn = np.dtype(dt).name
        for N, C in ((300, 768), (257, 2048)):
            x, res, w, dy = r((N, C), dt), r((N, C), dt), r((C,)), r((N, C), dt)
            calls.append((f"rms_norm fwd+bwd {dn} {N}x{C}", lambda x=x, w=w, dy=dy: ck.rms_norm_backward(
                dy, x, w, ck.rms_norm(x, w, return_rstd=True)[1])))
            calls.append((f"add_rms_norm fwd+bwd {dn} {N}x{C}", lambda x=x, res=res, w=w, dy=dy: (
                lambda y, h, rs: ck.add_rms_norm_backward(dy, dy, h, w, rs))(*ck.add_rms_norm(x, res, w, return_rstd=True))))
            g, b = r((C,)), r((C,))
            calls.append((f"layer_norm fwd+bwd {dn} {N}x{C}", lambda x=x, g=g, b=b, dy=dy: (
                lambda y, m, rs: ck.layer_norm_backward(dy, x, g, m, rs))(*ck.layer_norm(x, g, b, return_stats=True))))
        for N, C in ((64, 1024), (4, 32768), (3, 50000)):
            x, dy = r((N, C), dt), r((N, C), dt)
            calls.append((f"softmax fwd+bwd {dn} {N}x{C}", lambda x=x, dy=dy: ck.softmax_backward(ck.softmax(x), dy)))
        s = r((2, 4, 100, 130), dt)
        km = cp.asarray(np.random.default_rng(0).random((2, 130)) > 0.2)
        calls.append((f"attn_softmax causal+mask fwd+bwd {dn}", lambda s=s, km=km: ck.attn_softmax_backward(
            ck.attn_softmax(s, key_mask=km, causal=True), s)))
        for N, V in ((37, 128256), (20, 50257), (9, 1000)):
            z = r((N, V), dt, 3.0)
            t = cp.asarray(np.random.default_rng(1).integers(0, V, N).astype(np.int32))
            calls.append((f"cross_entropy fused {dn} {N}x{V}", lambda z=z, t=t: ck.cross_entropy_fused(z.copy(), t,
                                                                                                       label_smoothing=0.1)))
            calls.append((f"cross_entropy fwd+bwd {dn} {N}x{V}", lambda z=z, t=t: (
                lambda l, lse: ck.cross_entropy_backward(z, t, lse, cp.ones((), cp.float32)))(*ck.cross_entropy(z, t, return_lse=True))))
        ids = cp.asarray(np.random.default_rng(2).integers(0, 1000, (4, 77)).astype(np.int32))
        tab, dout = r((1000, 256), dt), r((4, 77, 256), dt)
        calls.append((f"embedding fwd+bwd {dn}", lambda ids=ids, tab=tab, dout=dout: (
            ck.embedding(ids, tab), ck.embedding_backward(ids, dout, 1000))))
        q = r((2, 33, 8, 64), dt)
        cos, sin = ck.rope_cache(64, 64, xp=cp)
        calls.append((f"rope fwd+bwd {dn}", lambda q=q, cos=cos, sin=sin: ck.rope_backward(ck.rope(q, cos, sin), cos, sin)))
        a, bb, d = r((300, 1000), dt), r((300, 1000), dt), r((300, 1000), dt)
        calls.append((f"swiglu / gelu fwd+bwd {dn}", lambda a=a, bb=bb, d=d: (
            ck.swiglu_backward(a, bb, d), ck.gelu_backward(a, d), ck.swiglu(a, bb), ck.gelu(a))))
        calls.append((f"dropout {dn}", lambda a=a: ck.dropout(a, 0.1, seed=1)))
    for n in (100003, 3_000_000):
        p, gr, m, v = r((n,)), r((n,)), cp.zeros(n, cp.float32), cp.zeros(n, cp.float32)
        sh = cp.empty(n, BF)
        calls.append((f"adam_step {n}", lambda p=p, gr=gr, m=m, v=v, sh=sh: ck.adam_step(p, gr, m, v, lr=1e-3, step=1,
                                                                                      weight_decay=0.1, shadow=sh)))
        calls.append((f"global_norm {n}", lambda gr=gr: ck.global_norm([gr, gr[:n // 3]])))
    lg = r((4, 50257), np.float32, 3.0)
    calls.append(("sample_tokens top-k / top-p", lambda lg=lg: (ck.sample_tokens(lg, temperature=0.8, top_k=40, seed=3),
                                                                ck.sample_tokens(lg, top_p=0.9, seed=4),
                                                                ck.sample_tokens(lg, temperature=0))))
    xg, wg = r((2, 2048), BF), r((3000, 2048), BF)
    calls.append(("gemv bf16 2 x 2048 x 3000", lambda xg=xg, wg=wg: ck.gemv(xg, wg)))
    for name, fn in calls:
        if only is None or only in name:
            run(name, fn)
    print("racecheck_ops: all calls done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
