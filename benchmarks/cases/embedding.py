"""Benchmark cases for ck.embedding / ck.embedding_backward / ck.SparseRowGrad (kernels_cu/embedding.cu)."""
import numpy as np

import cukernels as ck
from bench_ops import Case

V = 128256  # LLaMA-3 vocabulary
SHAPES = [(65536, 2048, ck.bfloat16, "bf16"), (16384, 4096, np.float32, "f32")]


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    import cupyx

    out = []
    shapes = [(8192, 2048, ck.bfloat16, "bf16")] if ctx.quick else SHAPES
    for n, D, dt, dn in shapes:
        s = np.dtype(dt).itemsize
        table = cp.random.standard_normal((V, D), dtype=cp.float32).astype(dt)
        k = ctx.nsets(2 * n * D * s)
        ids = [cp.random.randint(0, V, n, dtype=cp.int32) for _ in range(k)]
        ys = [cp.empty((n, D), dtype=dt) for _ in range(k)]
        douts = [cp.random.standard_normal((n, D), dtype=cp.float32).astype(dt) for _ in range(k)]
        shape = f"{n}x{D} V={V}"
        tf = tb = None
        if torch is not None:
            F = torch.nn.functional
            tt = ctx.t(table)
            tids = [torch.as_tensor(i, device="cuda").long() for i in ids]
            tdo = [ctx.t(d) for d in douts]

            def tf(i, tt=tt, tids=tids):
                return F.embedding(tids[i], tt)

            def tb(i, tids=tids, tdo=tdo):  # deterministic-mode-free dense backward, output in dout's dtype
                return torch.ops.aten.embedding_dense_backward(tdo[i], tids[i], V, -1, False)

        out.append(Case("embedding fwd", shape, dn, 2 * n * D * s + 4 * n, "2*n*D*s + 4*n",
                        lambda i, ids=ids, table=table, ys=ys: ck.embedding(ids[i], table, out=ys[i]),
                        lambda i, ids=ids, table=table, ys=ys: cp.take(table, ids[i], axis=0, out=ys[i]),
                        tf, extra=dict(nsets=k)))
        # dense backward into a dtable of dout's dtype (as torch's embedding_dense_backward returns); the bytes
        # model is exact for the row-owner kernel: every table row written once, every dout row read once
        dtab = cp.empty((V, D), dtype=dt)
        dtab32 = cp.empty((V, D), dtype=cp.float32)

        def comp_bwd(i, ids=ids, douts=douts, dtab32=dtab32):  # float atomics: not deterministic
            dtab32.fill(0)
            cupyx.scatter_add(dtab32, ids[i], douts[i].astype(cp.float32))
            return dtab32

        uniq = int(cp.unique(ids[0]).size)
        out.append(Case("embedding bwd dense", shape, dn, V * D * s + n * D * s + 4 * n, "V*D*s + n*D*s + 4*n",
                        lambda i, ids=ids, douts=douts, dtab=dtab: ck.embedding_backward(ids[i], douts[i], V, out=dtab),
                        comp_bwd, tb, extra=dict(nsets=k),
                        note=f"sort passes {(max(1, (V - 1).bit_length()) + 7) // 8} + run starts, then every row "
                             f"written once by its owner (no memset); {uniq} distinct ids"))
        g = ck.SparseRowGrad(V, D, xp=cp)

        def sparse(i, ids=ids, douts=douts, g=g):
            g.accumulate(ids[i], douts[i])
            g.zero()

        out.append(Case("embedding bwd sparse+zero", shape, dn, n * D * s + 3 * uniq * D * 4 + 4 * n,
                        "n*D*s + 3*u*D*4 (u touched rows: add read+write, zero write)", sparse,
                        note=f"fp32 grad, u={uniq}", extra=dict(nsets=k)))
        # ZeroAdamW's sparse exchange (one rank's side of a 2-rank step): pack this rank's u touched fp32 rows
        # into the bf16 wire, then merge 2 packs (its own and a peer's) back into the fp32 gradient. The merge
        # writes each row of the first pack and read-modify-writes the rows the second pack shares with it.
        g.accumulate(ids[0], douts[0])
        pid = [cp.empty(n, dtype=cp.int32) for _ in range(2)]
        prow = [cp.empty((n, D), dtype=ck.bfloat16) for _ in range(2)]
        g.pack(pid[0], prow[0])
        g2 = ck.SparseRowGrad(V, D, xp=cp)
        g2.accumulate(ids[-1], douts[-1])
        g2.pack(pid[1], prow[1])
        u2 = int(cp.unique(cp.concatenate([ids[0], ids[-1]])).size)
        uniq2 = int(cp.unique(ids[-1]).size)  # g2 keeps its rows (g is zeroed by the case above, merged below)
        out.append(Case("embedding rows pack", shape, dn, uniq2 * D * (4 + 2) + 8 * uniq2, "u*D*(4+2) + 8*u",
                        lambda i, g2=g2: g2.pack(pid[1], prow[1]), note=f"fp32 rows -> bf16 wire, u={uniq2}"))
        out.append(Case("embedding rows merge x2", shape, dn,
                        2 * n * D * 2 + u2 * D * 4 + (2 * uniq - u2) * D * 8 + 16 * n,
                        "2 packs read + u2 rows written + shared rows read+written",
                        lambda i, g=g: g.merge(list(zip(pid, prow)), scale=0.5),
                        note=f"2 ranks' bf16 packs -> fp32 rows, union u2={u2}"))
    return out
