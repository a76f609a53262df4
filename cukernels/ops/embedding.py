"""Token embedding: ``ck.embedding`` / ``ck.embedding_backward`` / ``ck.SparseRowGrad``.

Kernels: ``kernels_cu/embedding.cu``. Out-of-range ids raise on the NumPy path; on the GPU they are clamped
into the table and flagged in a device error word (``ck.embedding_error()``), never read or written wild.
"""
from __future__ import annotations


import numpy as np

from .. import _backend as B
from .._loader import get_function

FAMILY = "embedding"
INTS = (np.int32, np.int64)
_I32 = np.dtype(np.int32)



def embedding_error():
    """The module's device error word (0-d int32 CuPy array) for the current device.

    The GPU kernels of :func:`embedding`, :func:`embedding_backward` and :class:`SparseRowGrad` OR 1 into it
    when an id was outside ``[0, vocab)`` (the id was clamped to the nearest valid row) and they were not given
    an ``error=`` word of their own. Read it whenever a host sync is acceptable (``int(ck.embedding_error())``)
    and clear it with ``.fill(0)``.
    """
    return B.error_word("embedding")


def _error_word(xp, error):
    if error is None:
        return None if xp is np else embedding_error()
    B.check_dtype("error", error, (np.int32,))
    B.check_shape("error", error, ())
    B.check_writable("error", error)
    return error


def _check_ids(ids):
    B.check_dtype("ids", ids, INTS)
    B.check_contiguous("ids", ids)


def _host_check_range(ids, V):
    """NumPy path: every id in [0, V), compared in the ids' own dtype (no cast first, so an int64 id of 2**32 + 3
    is out of range, never row 3). An IdsOutOfRange: a ValueError (the policy), and an IndexError (what this
    raised before)."""
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= V:
            bad = lo if lo < 0 else hi
            raise B.IdsOutOfRange(f"ids: value {bad} is out of range for a table of {V} rows (valid ids are "
                                  f"0..{V - 1})")


def _row_plan(units: int):
    """(threads per row, rows per block): ~4 packs per thread, rows of fewer than 256 threads share a block."""
    tpr = 32
    while tpr < 1024 and units > tpr * 4:
        tpr *= 2
    return tpr, max(1, 256 // tpr)


@B.interop
def embedding(ids, table, *, out=None, error=None):
    """Gather rows of an embedding table: ``out[..., :] = table[ids[...], :]``.

    Args:
        ids: int32 or int64 token ids, any shape, C-contiguous.
        table: ``(V, D)`` float32 or bfloat16, C-contiguous, V >= 1.
        out: optional output, shape ``ids.shape + (D,)``, dtype of ``table``.
        error: optional 0-d int32 device array; the GPU kernel ORs 1 into it when an id was out of range
            (clamped to the table). Default: the module word :func:`embedding_error`. Ignored by the NumPy
            path, which raises ``IdsOutOfRange`` (a ValueError and an IndexError) instead.

    Returns:
        ``out``, shape ``ids.shape + (D,)``.

    Example::

        >>> table = cp.random.standard_normal((128256, 2048), dtype=cp.float32).astype(ck.bfloat16)
        >>> x = ck.embedding(cp.asarray([[1, 5, 9]], cp.int32), table)      # (1, 3, 2048)
    """
    xp = B.array_module(ids=ids, table=table, out=out, error=error)
    _check_ids(ids)
    B.check_dtype("table", table, B.FLOATS)
    if table.ndim != 2 or table.shape[0] < 1:
        raise ValueError(f"table: expected shape (V, D) with V >= 1; got {tuple(table.shape)}")
    B.check_contiguous("table", table)
    V, D = table.shape
    err = _error_word(xp, error)
    y = B.empty(xp, tuple(ids.shape) + (D,), table.dtype, out)
    n = ids.size
    if xp is np:
        _host_check_range(ids, V)
        y[...] = table[ids]
        return y
    if n == 0 or D == 0:
        return y
    E = 16 // table.itemsize
    vec = D % E == 0 and B.aligned16(table, y)
    tpr, rpb = _row_plan(D // E if vec else D)
    k = get_function(FAMILY, f"emb_fwd_{B.DTYPE_TAG[table.dtype]}_{B.DTYPE_TAG[ids.dtype]}_{'v' if vec else 's'}")
    grid = min((n + rpb - 1) // rpb, 2**31 - 1)
    k((grid,), (tpr, rpb, 1), (ids, table, y, err, np.int64(n), np.int64(V), np.int32(D)))
    return y


# ---------------------------------------------------------------- backward (GPU helpers)
_RS_TILE = 2048  # keys per radix-sort block (RS_THREADS * RS_ITEMS in embedding.cu)


def _sort_by_id(ids, V, err):
    """Device arrays (sorted ids, positions): a stable sort of the flattened positions by (clamped) id."""
    import cupy

    n = ids.size
    keys = cupy.empty(n, dtype=np.int32)
    vals = cupy.empty(n, dtype=np.int32)
    prep = get_function(FAMILY, f"emb_sort_prep_{B.DTYPE_TAG[ids.dtype]}")
    prep((min((n + 255) // 256, B.sm_count() * 8),), (256, 1, 1), (ids, np.int32(n), np.int64(V), keys, vals, err))
    bits = max(1, int(V - 1).bit_length())
    passes = (bits + 7) // 8
    nb = (n + _RS_TILE - 1) // _RS_TILE
    hist = cupy.empty(256 * nb, dtype=np.int32)
    k2 = cupy.empty(n, dtype=np.int32)
    v2 = cupy.empty(n, dtype=np.int32)
    h = get_function(FAMILY, "emb_rs_hist")
    scan = get_function(FAMILY, "emb_scan_excl")
    sc = get_function(FAMILY, "emb_rs_scatter")
    for p in range(passes):
        shift = np.int32(8 * p)
        h((nb,), (256, 1, 1), (keys, np.int32(n), shift, hist))
        scan((1,), (1024, 1, 1), (hist, np.int64(hist.size)))
        sc((nb,), (256, 1, 1), (keys, vals, k2, v2, np.int32(n), shift, hist))
        keys, k2 = k2, keys
        vals, v2 = v2, vals
    return keys, vals


def _reduce_rows(sk, sv, dout2, out, n, D, accumulate, record=None):
    """Launch emb_bwd_*: out[id] (+)= sum of dout rows of each id's run; record = (stamps, gen, rows, count)."""
    E = 16 // dout2.itemsize
    vec = D % E == 0 and B.aligned16(dout2)
    o_vec = (D * out.itemsize) % 16 == 0 and B.aligned16(out)
    units = D // E if vec else D
    chunks = (units + 63) // 64
    k = get_function(FAMILY, f"emb_bwd_{B.DTYPE_TAG[dout2.dtype]}_{B.DTYPE_TAG[out.dtype]}_{'v' if vec else 's'}")
    st, gen, rows, cnt = record if record is not None else (B.NULL,) * 4
    k(((n + 7) // 8, chunks), (32, 8, 1),
      (sk, sv, dout2, out, np.int32(n), np.int32(D), np.bool_(accumulate), np.bool_(o_vec), st, gen, rows, cnt))


def _dense_rows(sk, sv, dout2, out, n, V, D):
    """Launch emb_run_starts + emb_bwd_dense_*: out[v] = sum of v's dout rows for every v < V (zeros where no
    position has id v): the table is written once, no memset first."""
    import cupy

    start = cupy.empty(V + 1, dtype=np.int32)
    rs = get_function(FAMILY, "emb_run_starts")
    rs((min((V + 256) // 256, B.sm_count() * 8),), (256, 1, 1), (sk, np.int32(n), np.int64(V), start))
    E = 16 // dout2.itemsize
    vec = D % E == 0 and B.aligned16(dout2)
    o_vec = (D * out.itemsize) % 16 == 0 and B.aligned16(out)
    tpr, _ = _row_plan(D // E if vec else D)
    tpr = min(tpr, 256)  # emb_bwd_dense is __launch_bounds__(256, 3); its loop strides a longer row by U * tpr
    rpb = max(1, 256 // tpr)  # (the H200: 512 or 1024-thread blocks for rows >= 2048 units -> INVALID_VALUE)
    k = get_function(FAMILY, f"emb_bwd_dense_{B.DTYPE_TAG[dout2.dtype]}_{B.DTYPE_TAG[out.dtype]}_{'v' if vec else 's'}")
    k((min((V + rpb - 1) // rpb, 2**31 - 1),), (tpr, rpb, 1),
      (start, sv, dout2, out, np.int64(V), np.int32(D), np.bool_(o_vec)))


def _check_bwd(ids, dout):
    _check_ids(ids)
    B.check_dtype("dout", dout, B.FLOATS)
    B.check_contiguous("dout", dout)
    if dout.ndim != ids.ndim + 1 or tuple(dout.shape[:-1]) != tuple(ids.shape):
        raise ValueError(f"dout: expected shape ids.shape + (D,) = {tuple(ids.shape) + ('D',)}; got {tuple(dout.shape)}")
    if ids.size >= 2**31:
        raise ValueError(f"ids: at most 2**31 - 1 token positions supported; got {ids.size}")
    return dout.shape[-1]


@B.interop
def embedding_backward(ids, dout, vocab_size, *, out=None, accumulate=False, error=None):
    """Gradient of :func:`embedding` with respect to the table (dense, deterministic).

    ``dtable[v, :] = sum over positions p with ids[p] == v of dout[p, :]``, summed in fp32 in position order
    (rows never referenced are 0). Positions are sorted by id on the device (stable radix sort); without
    ``accumulate`` every table row is then written once by the threads that own it (its positions' rows summed,
    or zeros), with ``accumulate`` each id's rows are added by one warp per column chunk: no float atomics,
    bit-identical from run to run, and the same sums either way.

    Args:
        ids: the forward's ids (int32/int64, any shape).
        dout: gradient of the output, shape ``ids.shape + (D,)``, float32 or bfloat16.
        vocab_size: V, the table's row count.
        out: optional ``(V, D)`` float32 or bfloat16 buffer (its dtype is the result's dtype).
        accumulate: add into ``out`` (required then) instead of overwriting it.
        error: optional device error word, as in :func:`embedding`.

    Returns:
        ``dtable``, ``(V, D)``, float32 unless ``out`` says otherwise.

    Example::

        >>> dtable = ck.embedding_backward(ids, dy, 128256)            # (128256, 2048) float32
    """
    xp = B.array_module(ids=ids, dout=dout, out=out, error=error)
    D = _check_bwd(ids, dout)
    V = B.check_size("vocab_size", vocab_size)  # (ids are compared as int64, rows int32)
    accumulate = B.check_bool("accumulate", accumulate)
    if out is None and xp is np:  # (the device path adds no driver query to a capturable op: int32 bound only)
        B.check_alloc("vocab_size", (V, D), np.float32, xp, "dtable")
    if accumulate and out is None:
        raise ValueError("out: accumulate=True needs the buffer to add into")
    if out is not None:
        B.check_dtype("out", out, B.FLOATS)
        B.check_out("out", out, (V, D), out.dtype)
        res = out
    else:
        res = xp.empty((V, D), dtype=np.float32)
    err = _error_word(xp, error)
    n = ids.size
    if xp is np:
        _host_check_range(ids, V)
        acc = res.astype(np.float32) if accumulate else np.zeros((V, D), np.float32)
        np.add.at(acc, ids.reshape(-1), dout.reshape(n, D).astype(np.float32))
        res[...] = acc.astype(res.dtype)
        return res
    if n == 0 or D == 0:
        if not accumulate:
            B.zero_(res)
        return res
    sk, sv = _sort_by_id(ids.reshape(-1), V, err)
    if accumulate:
        _reduce_rows(sk, sv, dout.reshape(n, D), res, n, D, True)
    else:  # every row written once by its owner, zeros included (no memset of the V x D table first)
        _dense_rows(sk, sv, dout.reshape(n, D), res, n, V, D)
    return res


class SparseRowGrad:
    """A persistent ``(V, D)`` embedding gradient that is all zero except the rows touched since ``zero()``.

    For large vocabularies the dense gradient costs a V x D memset and a V x D optimizer pass per step although
    a batch touches a few thousand rows. This buffer keeps the touched rows in a device list: ``rows[0:count]``
    (int32, each row once per generation, in no particular order), with ``count`` a 0-d int32 device array, so
    an optimizer can update only those rows (``ck.adam_step_rows(param, grad.grad, m, v, grad.rows,
    grad.count, ...)``) and ``zero()`` clears only them. Nothing is read back to the host.

    Dedup: ``stamps[v]`` holds the generation in which row v was last listed; ``accumulate`` lists a row when
    ``atomicExch(stamps[v], generation) != generation``; ``zero()`` bumps ``generation`` (a 0-d device int32).

    Attributes:
        grad: ``(V, D)`` gradient buffer (``dtype``), rows summed in fp32 in position order (deterministic).
        rows: ``(V,)`` int32, the touched rows in ``rows[0:count]`` (entries beyond count are stale).
        count: 0-d int32, the number of touched rows.
        stamps: ``(V,)`` int32, per-row generation stamps.
        generation: 0-d int32, the current generation (starts at 1).

    Args:
        vocab_size, dim: V and D.
        dtype: float32 (default) or bfloat16 gradient buffer.
        xp: ``numpy`` (reference path) or ``cupy``; default cupy when a GPU is visible, else numpy.

    Example::

        >>> g = ck.SparseRowGrad(128256, 2048)
        >>> g.accumulate(ids, dy)            # any number of times (gradient accumulation)
        >>> ck.adam_step_rows(table, g.grad, m, v, g.rows, g.count, ...)
        >>> g.zero()
    """

    @B.interop
    def __init__(self, vocab_size, dim, dtype=np.float32, *, xp=None, grad=None):
        if grad is not None:  # an existing (V, D) buffer, e.g. the optimizer's gradient buffer of the table
            xp = B.array_module(grad=grad) if xp is None else xp
            dtype = grad.dtype
        if xp is None:
            xp = B._cupy() if B.gpu_available() else np
        if xp is not np and (B._cupy() is None or xp is not B._cupy()):
            raise TypeError(f"xp: expected numpy or cupy; got {xp!r}")
        V = B.check_size("vocab_size", vocab_size)  # (rows are int32 on the device)
        D = B.check_size("dim", dim)
        dt = B.check_dtype_arg("dtype", dtype)
        if grad is None:  # (grad, rows, stamps: checked before anything is allocated)
            B.check_alloc("vocab_size", (V, D), dt, xp, "the (vocab_size, dim) gradient buffer")
        self.xp, self.vocab_size, self.dim, self.dtype = xp, V, D, dt
        if grad is not None:
            B.check_out("grad", grad, (V, D), dt)
            self.grad = grad  # kept all-zero outside the listed rows by the caller's contract, as ours
        else:
            self.grad = xp.zeros((V, D), dtype=dt)
        self.rows = xp.zeros((V,), dtype=np.int32)
        self.count = xp.zeros((), dtype=np.int32)
        self.stamps = xp.zeros((V,), dtype=np.int32)
        self.generation = xp.ones((), dtype=np.int32)

    @B.interop
    def accumulate(self, ids, dout, *, error=None):
        """``grad[v] += sum of dout[p] over ids[p] == v`` for every touched v, and list the new rows."""
        xp = B.array_module(ids=ids, dout=dout, error=error)
        if xp is not self.xp:
            raise TypeError(f"ids: is a {xp.__name__} array but this SparseRowGrad holds {self.xp.__name__} arrays")
        D = _check_bwd(ids, dout)
        if D != self.dim:
            raise ValueError(f"dout: expected last dimension {self.dim} (the buffer's dim); got {D}")
        err = _error_word(xp, error)
        V, n = self.vocab_size, ids.size
        if xp is np:
            _host_check_range(ids, V)
            if n == 0:
                return self
            flat = ids.reshape(-1)
            uniq, inv = np.unique(flat, return_inverse=True)
            acc = self.grad[uniq].astype(np.float32)
            np.add.at(acc, inv.reshape(-1), dout.reshape(n, D).astype(np.float32))
            self.grad[uniq] = acc.astype(self.dtype)
            g = int(self.generation)
            c = int(self.count)
            for u in uniq:
                if self.stamps[u] != g:
                    self.stamps[u] = g
                    self.rows[c] = u
                    c += 1
            self.count[...] = c
            return self
        if n == 0:
            return self
        sk, sv = _sort_by_id(ids.reshape(-1), V, err)
        _reduce_rows(sk, sv, dout.reshape(n, D), self.grad, n, D, True,
                     record=(self.stamps, self.generation, self.rows, self.count))
        return self

    def zero(self):
        """Zero the listed rows only, empty the list and start a new generation (all on the device)."""
        xp = self.xp
        if xp is np:
            c = int(self.count)
            self.grad[self.rows[:c]] = 0
            self.count[...] = 0
            g = int(self.generation) + 1
            self.generation[...] = g if g <= np.iinfo(np.int32).max else 1
            return self
        D = self.dim
        E = 16 // self.grad.itemsize
        vec = D % E == 0  # our own allocation: 16-byte aligned
        tpr, rpb = _row_plan(D // E if vec else D)
        k = get_function(FAMILY, f"emb_rows_zero_{B.DTYPE_TAG[self.dtype]}_{'v' if vec else 's'}")
        grid = min(B.sm_count() * max(1, 2048 // (tpr * rpb)), (self.vocab_size + rpb - 1) // rpb)
        k((grid,), (tpr, rpb, 1), (self.rows, self.count, self.grad, np.int32(D)))
        get_function(FAMILY, "emb_rows_reset")((1,), (1, 1, 1), (self.count, self.generation))
        return self

    # ------------------------------------------------------------------ across ranks (ZeroAdamW's exchange)
    def _check_pack(self, ids, rows, what):
        xp = B.array_module(ids=ids, rows=rows)
        if xp is not self.xp:
            raise TypeError(f"ids: is a {xp.__name__} array but this SparseRowGrad holds {self.xp.__name__} arrays")
        if self.dtype != np.float32:
            raise TypeError(f"{what}: the exchange merges into a float32 gradient; this buffer is {self.dtype}")
        B.check_dtype("ids", ids, (np.int32,))
        if ids.ndim != 1:
            raise ValueError(f"ids: expected a 1-D int32 array (the pack's capacity); got shape {tuple(ids.shape)}")
        B.check_dtype("rows", rows, B.FLOATS)
        B.check_shape("rows", rows, (ids.shape[0], self.dim), " ([capacity, dim])")
        for name, a in (("ids", ids), ("rows", rows)):
            B.check_contiguous(name, a)
        return ids.shape[0]

    def _pack_launch(self, kind, rows, cap):
        """(kernel, grid, block) of emb_rows_pack / emb_rows_merge over a pack of ``cap`` rows: 16-byte fp32 units
        when D % 4 == 0 and both buffers allow it, a fixed grid striding over the pack."""
        D = self.dim
        vec = D % 4 == 0 and B.aligned16(self.grad) and rows.data.ptr % (4 * rows.itemsize) == 0
        tpr, rpb = _row_plan(D // 4 if vec else D)
        k = get_function(FAMILY, f"emb_rows_{kind}_{B.DTYPE_TAG[rows.dtype]}_{'v' if vec else 's'}")
        grid = max(1, min(B.sm_count() * max(1, 2048 // (tpr * rpb)), (cap + rpb - 1) // rpb))
        return k, (grid,), (tpr, rpb, 1)

    def pack(self, ids, rows, *, error=None):
        """Copy the listed rows into a fixed-size pack for the other ranks: ``ids[i] = self.rows[i]`` and
        ``rows[i] = grad[self.rows[i]]`` (in ``rows``' dtype, float32 or bfloat16) for ``i < count``, ``ids[i] =
        -1`` after that. ``ids`` (int32 ``[cap]``) and ``rows`` (``[cap, dim]``) are the caller's buffers; a
        count above ``cap`` sends the first ``cap`` rows and ORs 2 into ``error`` (default
        ``ck.embedding_error()``): size ``cap`` by the tokens a step can touch. Device-side, capturable."""
        cap = self._check_pack(ids, rows, "pack")
        xp, D = self.xp, self.dim
        if xp is np:
            c = int(self.count)
            n = min(c, cap)
            ids[:n] = self.rows[:n]
            ids[n:] = -1
            rows[:n] = self.grad[self.rows[:n]].astype(rows.dtype)
            if c > cap:
                if error is None:
                    raise ValueError(f"pack: {c} rows are listed; the pack holds {cap}")
                error[...] |= 2
            return self
        err = _error_word(xp, error)
        k, grid, block = self._pack_launch("pack", rows, cap)
        k(grid, block, (self.rows, self.count, self.grad, ids, rows, err, np.int32(cap), np.int32(D)))
        return self

    def merge(self, packs, *, scale=1.0):
        """Rebuild the gradient from the packs of every rank (``[(ids, rows)]`` in rank order, this rank's own
        included): the row list restarts (a new generation), then for each pack in order each listed row is
        written (its first listing) or added to (``grad[id] = grad[id] + scale * rows[i]``, fp32, multiply then
        add), and listed once. Every rank that merges the same packs in the same order holds the same bits.
        The gradient stays zero outside the new list: this rank's old rows are in its own pack."""
        packs = list(packs)
        if not packs:
            raise ValueError("packs: expected the (ids, rows) of every rank; got none")
        s = B.check_f32("scale", scale)
        caps = [self._check_pack(i, r, "merge") for i, r in packs]
        xp, D, V = self.xp, self.dim, self.vocab_size
        if xp is np:
            self.count[...] = 0
            g = int(self.generation) + 1
            self.generation[...] = g = g if g <= np.iinfo(np.int32).max else 1
            c = 0
            for ids, rows in packs:
                for i in range(ids.shape[0]):
                    v = int(ids[i])
                    if not 0 <= v < V:
                        continue
                    x = np.float32(s) * rows[i].astype(np.float32)
                    if self.stamps[v] != g:
                        self.stamps[v] = g
                        self.rows[c] = v
                        c += 1
                        self.grad[v] = x
                    else:
                        self.grad[v] = self.grad[v] + x
            self.count[...] = c
            return self
        get_function(FAMILY, "emb_rows_reset")((1,), (1, 1, 1), (self.count, self.generation))
        for (ids, rows), cap in zip(packs, caps):
            k, grid, block = self._pack_launch("merge", rows, cap)
            k(grid, block, (ids, rows, self.grad, self.stamps, self.generation, self.rows, self.count,
                            np.int32(cap), np.int32(D), np.int64(V), np.float32(s)))
        return self

    def __repr__(self):
        return f"SparseRowGrad(vocab_size={self.vocab_size}, dim={self.dim}, dtype={self.dtype}, xp={self.xp.__name__})"


__all__ = ["SparseRowGrad", "embedding", "embedding_backward", "embedding_error"]
