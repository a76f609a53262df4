"""Question: would choosing cuBLASLt's algorithm per shape speed up the LLaMA-3.2-1B step's GEMMs? (issue 17: B8xT1024
<= 112 ms; the GEMMs are ~87 ms of the 116 ms step.)

Answer (2026-12-01, one H200 each, ``python dev/gemm_algos.py``): no. Over the 15 GEMM shapes of the step,
8 candidates each: eager loop GemmEx 83.59 ms against the best candidate per shape 81.55 (-2.5 %); graph-replayed on
a fresh machine 89.12 against 88.23 (-1.0 %); the per-shape winners disagree between the two runs, so the gain is
the size of the noise. In the graph-replayed run every candidate of four large shapes returned results far from
GemmEx's (max relative error ~1) while the eager checks were exact: not understood, the raw ctypes Lt path below is
the suspect. Dropped (benchmarks/NOTES.md, "GEMMs").

``ck.matmul`` calls ``cublasGemmEx`` with CUBLAS_GEMM_DEFAULT: cuBLAS' own heuristic picks one kernel. cuBLASLt's
``cublasLtMatmulAlgoGetHeuristic`` returns a ranked list of candidates for the same problem. For each GEMM shape
of the step (forward, input gradient, weight gradient; per layer x 16, the LM head's 4 row chunks) this times
GemmEx and each Lt candidate (CUDA events, same inputs), checks each candidate's result against GemmEx's, and
prints the per-shape best and the step-weighted total that a per-shape choice would save. GPU only.

    PYTHONPATH=. python dev/gemm_algos.py [--tokens 8192] [--algos 12] [--reps 20]
"""
import argparse
import ctypes

import cupy as cp
import numpy as np

import cukernels as ck
from cukernels import blas

vp, c_int, c_size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t


class HeurResult(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", c_size), ("state", c_int),
                ("wavesCount", ctypes.c_float), ("reserved", c_int * 4)]


def lt_lib():
    names = []
    try:
        from cuda import pathfinder
        names.append(pathfinder.load_nvidia_dynamic_lib("cublasLt").abs_path)
    except Exception:
        pass
    names += ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError:
            continue
    raise RuntimeError(f"libcublasLt not found: {names}")


def chk(s, what):
    if s != 0:
        raise RuntimeError(f"{what}: cuBLASLt status {s}")


R_32F, R_16BF, COMPUTE_32F = 0, 14, 68
TRANSA, TRANSB = 3, 4
PREF_MAX_WS = 1


class Lt:
    def __init__(self):
        self.lib = L = lt_lib()
        self.h = vp()
        chk(L.cublasLtCreate(ctypes.byref(self.h)), "create")
        self.ws_bytes = 32 << 20
        self.ws = cp.empty(self.ws_bytes, cp.uint8)

    def layout(self, dt, rows, cols, ld):
        lay = vp()
        chk(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), c_int(dt), ctypes.c_uint64(rows),
                                                 ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return lay

    def plan(self, M, N, K, trans_a, trans_b, in_dt, out_dt, n_algos):
        """Row-major C[M, N] = op(A) @ op(B) as column-major C^T = op(B)^T op(A)^T (as ck.matmul): Lt's m = N,
        n = M; Lt's A is our B, Lt's B is our A."""
        L = self.lib
        desc = vp()
        chk(L.cublasLtMatmulDescCreate(ctypes.byref(desc), c_int(COMPUTE_32F), c_int(R_32F)), "desc")
        ta, tb = c_int(1 if trans_b else 0), c_int(1 if trans_a else 0)
        chk(L.cublasLtMatmulDescSetAttribute(desc, c_int(TRANSA), ctypes.byref(ta), c_size(4)), "transa")
        chk(L.cublasLtMatmulDescSetAttribute(desc, c_int(TRANSB), ctypes.byref(tb), c_size(4)), "transb")
        m, n, k = N, M, K
        a_lay = self.layout(in_dt, k, m, k) if trans_b else self.layout(in_dt, m, k, m)
        b_lay = self.layout(in_dt, n, k, n) if trans_a else self.layout(in_dt, k, n, k)
        c_lay = self.layout(out_dt, m, n, m)
        pref = vp()
        chk(L.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(self.ws_bytes)
        chk(L.cublasLtMatmulPreferenceSetAttribute(pref, c_int(PREF_MAX_WS), ctypes.byref(ws), c_size(8)), "ws")
        res = (HeurResult * n_algos)()
        cnt = c_int(0)
        chk(L.cublasLtMatmulAlgoGetHeuristic(self.h, desc, a_lay, b_lay, c_lay, c_lay, pref, c_int(n_algos), res,
                                             ctypes.byref(cnt)), "heuristic")
        return desc, a_lay, b_lay, c_lay, [res[i] for i in range(cnt.value) if res[i].state == 0]

    def run(self, plan, algo, a, b, c, beta):
        desc, a_lay, b_lay, c_lay, _ = plan
        al, be = ctypes.c_float(1.0), ctypes.c_float(beta)
        chk(self.lib.cublasLtMatmul(self.h, desc, ctypes.byref(al), vp(b.data.ptr), a_lay, vp(a.data.ptr), b_lay,
                                    ctypes.byref(be), vp(c.data.ptr), c_lay, vp(c.data.ptr), c_lay,
                                    ctypes.byref(algo.algo), vp(self.ws.data.ptr), c_size(self.ws_bytes),
                                    vp(cp.cuda.get_current_stream().ptr)), "matmul")


def timed(fn, reps):
    """ms a call: `reps` calls captured in one CUDA graph (no host launch cost, as in the captured step), the
    median of 5 replays after 2."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.begin_capture()
        for _ in range(reps):
            fn()
        g = stream.end_capture()
        ts = []
        for i in range(7):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record(stream)
            g.launch(stream)
            e.record(stream)
            e.synchronize()
            if i >= 2:
                ts.append(cp.cuda.get_elapsed_time(s, e) / reps)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--algos", type=int, default=12)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--grad-dtype", default="bf16", choices=["bf16", "f32"])
    a = ap.parse_args()
    T, H, I, V, L = a.tokens, 2048, 8192, 128256, 16
    chunk = min(T, 2048)
    bf, f32 = ck.bfloat16, np.float32
    gdt = bf if a.grad_dtype == "bf16" else f32
    # (name, M, N, K, trans_a, trans_b, out dtype, beta, count a step)
    shapes = []
    for nm, out_f, in_f in (("qkv", 3072, H), ("o", H, H), ("gate/up", 2 * I, H), ("down", H, I)):
        shapes.append((f"{nm} fwd", T, out_f, in_f, False, True, bf, 0.0, L))
        shapes.append((f"{nm} dX", T, in_f, out_f, False, False, bf, 0.0, L))
        shapes.append((f"{nm} dW", out_f, in_f, T, True, False, gdt, 0.0, L))
    nch = -(-T // chunk)
    shapes.append(("head fwd", chunk, V, H, False, True, bf, 0.0, nch))
    shapes.append(("head dX", chunk, H, V, False, False, bf, 0.0, nch))
    shapes.append(("head dW", V, H, chunk, True, False, f32, 1.0, nch))
    lt = Lt()
    rng = cp.random.default_rng(0)
    total_def = total_best = total_lt0 = total_bit = 0.0
    print(f"{'gemm':<12} {'M x N x K':>22} {'GemmEx ms':>10} {'TFLOP/s':>8} {'Lt#0':>8} {'best Lt':>8} "
          f"{'#':>3} {'gain':>6}  x step  n_algos  max rel err")
    for name, M, N, K, ta, tb, odt, beta, count in shapes:
        A = (rng.standard_normal((K, M) if ta else (M, K), dtype=cp.float32)).astype(bf)
        Bm = (rng.standard_normal((N, K) if tb else (K, N), dtype=cp.float32)).astype(bf)
        C0 = rng.standard_normal((M, N), dtype=cp.float32).astype(odt)
        C = C0.copy()
        ref = C0.copy()
        ck.matmul(A, Bm, trans_a=ta, trans_b=tb, out=ref, beta=beta)
        t_def = timed(lambda: ck.matmul(A, Bm, trans_a=ta, trans_b=tb, out=C, beta=beta), a.reps)
        plan = lt.plan(M, N, K, ta, tb, 14, 14 if odt == bf else 0, a.algos)
        times, errs, same = [], [], []
        refd = ref.astype(cp.float32)
        scale = float(cp.abs(refd).max()) + 1e-30
        for algo in plan[4]:
            C[...] = C0
            try:
                lt.run(plan, algo, A, Bm, C, beta)
                cp.cuda.Device().synchronize()
            except RuntimeError:
                times.append(float("inf"))
                errs.append(float("nan"))
                same.append(False)
                continue
            errs.append(float(cp.abs(C.astype(cp.float32) - refd).max()) / scale)
            same.append(bool((C.view(cp.uint8) == ref.view(cp.uint8)).all()))
            times.append(timed(lambda: lt.run(plan, algo, A, Bm, C, beta), a.reps))
        flops = 2.0 * M * N * K
        ok = [t if e < 2e-2 else float("inf") for t, e in zip(times, errs)]
        okb = [t if sm else float("inf") for t, sm in zip(ok, same)]  # bit-identical to GemmEx's output
        t_bit = min([t_def] + okb)
        total_bit += count * t_bit
        best_i = int(np.argmin(ok)) if ok else -1
        t_best = min(t_def, ok[best_i]) if ok else t_def
        t_lt0 = ok[0] if ok else t_def
        total_def += count * t_def
        total_best += count * t_best
        total_lt0 += count * t_lt0
        print(f"{name:<12} {f'{M}x{N}x{K}':>22} {t_def:10.4f} {flops / t_def / 1e9:8.0f} {t_lt0:8.4f} "
              f"{(ok[best_i] if ok else float('nan')):8.4f} {best_i:3d} {100 * (t_def - t_best) / t_def:5.1f}%  "
              f"x{count:<3d}  {len(plan[4]):3d}  {max(errs) if errs else float('nan'):.1e}  bit-identical best "
              f"{100 * (t_def - t_bit) / t_def:5.1f}%  ({sum(same)} of {len(same)} identical)", flush=True)
        del A, Bm, C, C0, ref, refd
    print(f"step total: GemmEx {total_def:.2f} ms, Lt#0 {total_lt0:.2f} ms, per-shape best {total_best:.2f} ms "
          f"(-{total_def - total_best:.2f} ms, {100 * (total_def - total_best) / total_def:.1f} %); best among the "
          f"candidates bit-identical to GemmEx {total_bit:.2f} ms (-{total_def - total_bit:.2f} ms)")


if __name__ == "__main__":
    main()
