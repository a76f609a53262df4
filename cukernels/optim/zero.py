"""``ZeroAdamW``: AdamW with its state sharded across the ranks of a process group (ZeRO stage 1).

Layout. The parameters are grouped as ``ck.optim.AdamW`` groups them (one flat fp32 buffer per weight decay, every
parameter starting on a 64-element = 256-byte boundary), plus one split: parameters whose fp32 values the forward
reads must be complete on every rank (``gather_fp32``), the others only through their bf16 shadow. Each flat
group is cut into **buckets** of whole parameters (one bucket per group unless ``bucket_elems`` is given), each
bucket padded to a multiple of ``world_size * 64`` elements and cut into ``world_size`` equal **pieces**: rank r
owns piece r of every bucket, so 1/N of every group, every piece 64-element (256-byte) aligned.
:func:`shard_layout` is that arithmetic; ``ShardLayout.owners(i)`` says which rank owns which slice of parameter i.

Buffers per rank (n parameters, N ranks; bytes per parameter in brackets):

* full, as on one GPU: fp32 parameters ``P`` [4] (the model's ``p.data`` are views of it), fp32 gradients ``G``
  [4] (the backward accumulates into ``p.grad`` views), bf16 shadow ``S`` [2] (autocast reads it);
* the rank's shard: Adam moments ``M``, ``V`` [8/N] and the reduced gradient ``GS`` [4/N fp32 or 2/N bf16];
* bf16 wire only: a bf16 copy of the gradient to send, ``W`` [2] -- unless ``grad_dtype=ck.bfloat16``: then ``G``
  itself is bf16 [2] (the backward's bf16 GEMMs write it) and is sent as it is, with no ``W``.

So for 1.5e9 parameters on 2 GPUs: AdamW keeps 4+4+4+4+2 = 18 bytes/param (27 GB), ZeroAdamW 10 + 8/2 + 4/2 = 16
(fp32 wire, 24 GB) or 10 + 8/2 + 2/2 + 2 = 17 (bf16 wire, 25.5 GB), 4 + 2 + 2 + 8/2 + 2/2 = 13 with bf16
gradients (19.5 GB); on 8 GPUs 11.5 / 13.25 / 9.25. The saving grows with
N; the fp32 gradient stays full (ZeRO-2 would shard it too, but our backward accumulates into one flat buffer),
and the bf16 wire trades 2 bytes/param of send buffer for half the bytes on the wire.

One optimizer step:

1. **reduce-scatter** each bucket's gradient (``avg`` over ranks by default: NCCL's pre-multiplied sum; ``sum``
   with ``average=False``) into ``GS``: fp32 on the wire, or cast to bf16 first (``wire_dtype=ck.bfloat16``: half
   the bytes; the reduced bf16 gradient is what Adam reads, widened to fp32 in registers -- the same numbers a
   separate widening pass would give, one pass fewer; the cast runs on the current stream, the collective on the
   side stream: ``CAST_ON_COMPUTE_STREAM``). With :meth:`ZeroAdamW.attach_grad_hooks` a bucket is sent
   as soon as the backward has finished every parameter in it, on a side stream ordered by CUDA events, so the
   communication hides behind the rest of the backward; otherwise all buckets go at the first of
   :meth:`~ZeroAdamW.grad_norm` / :meth:`~ZeroAdamW.step`. Buckets are always sent in one fixed order (the
   reverse of the parameter order, the order the backward finishes them), identical on every rank as NCCL needs.
2. **global gradient norm** (optional, for clipping): ``ck.global_norm`` of the rank's shard, squared in fp64,
   all-reduced (sum, fp64), square root -- deterministic, no host sync.
3. **AdamW** (``ck.adam_step``) on the owned piece of every bucket: fp32 master, moments, bf16 shadow piece.
4. **all-gather** the updated pieces: the bf16 shadow of every group, and the fp32 parameters of the
   ``gather_fp32`` groups, bucket by bucket on the side stream (bucket k's all-gather overlaps bucket k+1's Adam).
   With ``overlap_gather=True`` only the first bucket in forward order (and the fp32 groups) is gathered here;
   the other shadows' all-gathers are queued when the next forward first reads a shadow, and each layer waits
   only for its own bucket (``param.shadow_wait``, honoured by ``ck.amp.lowp_weight``), so they run under the
   forward's GEMMs. Measured on 2 x H200 at the LLaMA-3.2-1B shape, B8xT1024 (session 7, with the lazy zeroing
   of the sparse embedding's group): 127.4 -> 125.4 ms a step; the update alone is 5.8 ms instead of ~9.5 with
   the all-gathers beside it and after it.

Every step is graph-capturable: device step / lr / clip scale as in AdamW, collectives on the current (or side)
stream joined back to it, no host read, no allocation after the first step.

The fp32 parameters of groups outside ``gather_fp32`` are then current on each rank only in its own pieces;
:meth:`~ZeroAdamW.gather_params` makes them complete (before saving the model or an fp32 evaluation).
Default ``gather_fp32=None`` gathers every fp32 parameter (always correct, twice the bytes of bf16); under bf16
autocast with shadows attached, the GEMM weights are read only through their shadows, so
``gather_fp32=lambda name, a: a.ndim < 2`` (norm weights, biases) is enough.

Embedding rows (``sparse=``): the rows a batch touches differ from rank to rank. Two ways:

* ``sparse_rows=n`` (the trainer's default; n = the tokens a rank reads per step, an upper bound on its touched
  rows): the lazy row update of one-GPU ``AdamW(sparse=)``, across ranks. Each sparse table is a group of its
  own, **replicated**: full fp32 moments on every rank (+8 (N-1)/N bytes a table element against sharding), no
  reduce-scatter, no all-gather. After its backward each rank packs its listed rows (``SparseRowGrad.pack``: ids
  + rows in the wire dtype, n of them), the packs are all-gathered, and every rank merges all packs in rank order
  (``SparseRowGrad.merge``: the rank-order sum, times 1/N with ``average``): every rank then holds the same bits
  for the union of the rows, listed once, and runs the same ``adam_step_rows`` on them -- the tables stay
  identical with nothing gathered. The norm counts each rank's 1/N slice of the (identical) table gradient.
  Cost at LLaMA-3.2-1B, B8xT1024 per rank (D = 2048): N packs of 8192 x 4 KB (bf16) = 34 MB each against the
  dense 0.53 GB reduce-scatter + 0.53 GB all-gather, and ~8-16k rows through Adam instead of V / N = 64k.
  A pack that overflows n sets an error :meth:`~ZeroAdamW.check_errors` raises.
* ``sparse_rows=None``: the table is treated densely. :meth:`~ZeroAdamW.attach_sparse` still gives the embedding
  backward its ``SparseRowGrad`` over the flat gradient (the backward writes only the touched rows), but the
  whole V x D gradient is reduce-scattered and updated (dense AdamW: untouched rows' moments decay, as without
  ``sparse``): 0.53 GB of bf16 per step on the wire each way at the LLaMA shape.

Gradient accumulation: the backward accumulates micro-batches into ``G``; the reduce-scatter runs once per
optimizer step. With grad hooks attached, wrap every backward but the last of a step in :meth:`no_sync`.

Checkpoints: :meth:`state_dict_shard` is this rank's part (its slice of every parameter's fp32 value and moments,
keyed by parameter name and element range, so it does not depend on the bucket layout); :func:`consolidate_state`
turns the N shards into the one-GPU ``AdamW.state_dict`` format plus the full fp32 parameters;
:meth:`load_state_dict` takes that format, or a list of shards from any number of ranks, and keeps its own slices.
So 2 -> 1, 1 -> 2 and 2 -> 3 resume with the same parameters and moments.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from .. import _backend as B
from .. import blas
from ..distributed import ProcessGroup, SingleGroup, get_group, is_initialized
from ..ops import adam as _A
from ..ops.elementwise import cast as _cast
from ..ops.embedding import SparseRowGrad
from .adamw import ALIGN, AdamW, WarmupCosine, _matcher, check_hyperparameters, check_lr, check_state

SHARD_KIND = "ZeroAdamW.shard"
# Waves of blocks in the AdamW update's grid while collectives run beside it (``ck.adam_step(occupancy=)``; used
# when sm_margin is 0 and there is more than one rank). 1 = one persistent wave.
ADAM_OCCUPANCY = 1.0
# With overlap_gather: how many buckets (the first in forward order: the embedding's at the LLaMA shape) step()
# still all-gathers itself, beside the rest of the update, so the next forward does not start by waiting for it.
EAGER_GATHERS = 1
# bf16 wire: where each bucket's fp32 -> bf16 cast runs. True: on the current stream when the bucket is complete
# (the side stream carries only the collectives, and the cast's blocks do not cut into the backward's persistent
# GEMMs from a high-priority stream); False: on the side stream before its reduce-scatter. Session 7, 2 x H200,
# same-process A/B: B4xT64 23.49 -> 22.84 ms, B8xT1024 128.14 -> 126.44 ms.
CAST_ON_COMPUTE_STREAM = True
# The side stream's priority (see ZeroAdamW._side): -100 is clamped to the device's highest.
SIDE_PRIORITY = -100


# ---------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Bucket:
    """Parameters ``params`` (indices into the group, consecutive) at ``[start, stop)`` of the group's flat
    buffers; ``stop - start`` is a multiple of ``world_size * align``; rank r owns ``[start + r*piece,
    start + (r+1)*piece)``, stored at ``[shard_offset, shard_offset + piece)`` of its shard buffers."""

    index: int
    start: int
    stop: int
    piece: int
    shard_offset: int
    params: tuple

    def piece_range(self, rank):
        """``(lo, hi)``: rank's piece in the group's flat buffers."""
        return self.start + rank * self.piece, self.start + (rank + 1) * self.piece


@dataclass(frozen=True)
class ShardLayout:
    """Where every parameter of one flat group lives, and which rank owns which part (see :func:`shard_layout`).

    ``offsets[i]``, ``sizes[i]``: parameter i's range in the flat buffers; ``buckets`` in memory order;
    ``total``: flat buffer length; ``shard_size``: every rank's shard buffer length (sum of the pieces)."""

    world_size: int
    align: int
    sizes: tuple
    offsets: tuple
    buckets: tuple
    total: int
    shard_size: int

    def bucket_of(self, i):
        """Index of the bucket holding parameter i."""
        for b in self.buckets:
            if i in b.params:
                return b.index
        raise IndexError(f"parameter index {i} out of range (the group has {len(self.sizes)})")

    def owners(self, i):
        """``[(rank, lo, hi, shard_offset)]``: rank owns elements ``[lo, hi)`` of parameter i (flattened), kept at
        ``[shard_offset, shard_offset + hi - lo)`` of its shard buffers; consecutive ranks, slices tiling
        ``[0, sizes[i])``. Empty for a parameter of 0 elements."""
        b = self.buckets[self.bucket_of(i)]
        o, n = self.offsets[i], self.sizes[i]
        if n == 0:
            return []
        out = []
        for r in range((o - b.start) // b.piece, (o + n - 1 - b.start) // b.piece + 1):
            lo_g, hi_g = b.piece_range(r)
            lo, hi = max(o, lo_g), min(o + n, hi_g)
            out.append((r, lo - o, hi - o, b.shard_offset + (lo - lo_g)))
        return out

    def owned(self, i, rank):
        """``(lo, hi, shard_offset)`` of parameter i owned by ``rank``, or None."""
        for r, lo, hi, so in self.owners(i):
            if r == rank:
                return lo, hi, so
        return None


def _round_up(n, m):
    return -(-n // m) * m


def shard_layout(sizes, world_size, *, bucket_elems=None, align=ALIGN) -> ShardLayout:
    """The ZeRO layout of one flat group of parameters with ``sizes`` elements (in this order) over ``world_size``
    ranks.

    Parameters are placed in order, each on an ``align``-element boundary (as ``ck.optim.AdamW``). Buckets are
    runs of whole parameters formed from the **end** of the list (the backward finishes the last parameters
    first): a bucket closes once it holds at least ``bucket_elems`` (aligned) elements; ``bucket_elems=None``
    makes one bucket. Each bucket is padded to a multiple of ``world_size * align`` and split into
    ``world_size`` equal pieces (rank r owns piece r), so every piece starts on an ``align`` boundary of the
    flat buffer and of the shard buffer. Padding is zero and stays zero (a zero gradient on a zero parameter is a
    zero AdamW update).

    Example::

        >>> L = shard_layout([10, 200, 7], 2)        # offsets 0, 64, 320; one bucket of 384 = 2 * 192
        >>> L.owners(1)                               # [(0, 0, 128, 64), (1, 128, 200, 0)]
    """
    world_size = B.check_int("world_size", world_size, min=1)
    align = B.check_int("align", align, min=1)
    sizes = tuple(B.check_int(f"sizes[{i}]", s, min=0) for i, s in enumerate(sizes))
    if bucket_elems is not None:
        bucket_elems = B.check_int("bucket_elems", bucket_elems, min=1)
    aligned = [_round_up(s, align) for s in sizes]
    runs, cur, acc = [], [], 0  # runs of parameter indices, built from the end
    for i in reversed(range(len(sizes))):
        cur.append(i)
        acc += aligned[i]
        if bucket_elems is not None and acc >= bucket_elems:
            runs.append(sorted(cur))
            cur, acc = [], 0
    if cur or not runs:
        runs.append(sorted(cur))
    runs.reverse()  # memory order
    offsets = [0] * len(sizes)
    buckets, pos, shard = [], 0, 0
    for k, run in enumerate(runs):
        start = pos
        for i in run:
            offsets[i] = pos
            pos += aligned[i]
        length = _round_up(pos - start, world_size * align)
        piece = length // world_size
        buckets.append(Bucket(k, start, start + length, piece, shard, tuple(run)))
        pos = start + length
        shard += piece
    return ShardLayout(world_size, align, sizes, tuple(offsets), tuple(buckets), pos, shard)


# ---------------------------------------------------------------------------------------------- state
def _check_shards(shards):
    """Validate the shards of one run (see :func:`consolidate_state`); returns ``(sorted shards, {name: (shape,
    [(lo, hi, rank, entry)] sorted, tiling [0, n)})``) without reading any array."""
    shards = list(shards)
    if not shards:
        raise ValueError("shards: expected the state_dict_shard() of every rank; got none")
    for i, s in enumerate(shards):
        if not isinstance(s, dict) or s.get("kind") != SHARD_KIND:
            raise ValueError(f"shards[{i}]: not a ZeroAdamW shard (kind {s.get('kind') if isinstance(s, dict) else type(s).__name__!r})")
    world = shards[0]["world_size"]
    ranks = sorted(s["rank"] for s in shards)
    if any(s["world_size"] != world for s in shards) or ranks != list(range(world)):
        raise ValueError(f"shards: expected one shard per rank of one run; got ranks {ranks} of world sizes "
                         f"{sorted({s['world_size'] for s in shards})}")
    shards = sorted(shards, key=lambda s: s["rank"])
    steps = {int(s["step"]) for s in shards}
    if len(steps) != 1:
        raise ValueError(f"shards: the ranks are at different steps {sorted(steps)}")
    names = list(shards[0]["state"])
    for s in shards[1:]:
        if list(s["state"]) != names:
            raise ValueError(f"shards: rank {s['rank']} lists other parameters than rank 0")
    layout = {}
    for name in names:
        shape = tuple(shards[0]["state"][name]["shape"])
        n = int(np.prod(shape, dtype=np.int64))
        parts = []
        for s in shards:
            e = s["state"][name]
            if tuple(e["shape"]) != shape:
                raise ValueError(f"shards: {name!r} has shape {tuple(e['shape'])} on rank {s['rank']}, {shape} on "
                                 f"rank 0")
            if e["stop"] > e["start"]:
                parts.append((int(e["start"]), int(e["stop"]), s["rank"], e))
        parts.sort(key=lambda p: p[:3])
        pos = 0
        for lo, hi, r, _ in parts:
            if lo != pos:
                raise ValueError(f"shards: {name!r}: elements [{pos}, {lo}) are owned by no rank (or twice; rank {r} "
                                 f"starts at {lo})")
            pos = hi
        if pos != n:
            raise ValueError(f"shards: {name!r}: the ranks' slices end at {pos}; the parameter has {n} elements")
        for lo, hi, r, e in parts:
            for key in ("param", "exp_avg", "exp_avg_sq"):
                if int(np.prod(e[key].shape, dtype=np.int64)) != hi - lo:
                    raise ValueError(f"shards: {name!r} {key} of rank {r}: {int(np.prod(e[key].shape))} elements "
                                     f"for the range [{lo}, {hi})")
        layout[name] = (shape, parts)
    return shards, layout


def _host_flat(a):
    a = a.get() if hasattr(a, "get") else np.asarray(a)
    return a.reshape(-1)


def _assemble(parts, key, lo, hi):
    """Elements ``[lo, hi)`` of one flattened parameter's ``key`` from the shards' slices (fp32 NumPy)."""
    out = np.empty((hi - lo,), dtype=np.float32)
    for plo, phi, _, e in parts:
        a, b = max(lo, plo), min(hi, phi)
        if a < b:
            out[a - lo:b - lo] = _host_flat(e[key])[a - plo:b - plo]
    return out


class ShardedArray:
    """One full parameter-shaped array of a ZeRO checkpoint, assembled from the ranks' slices only when read
    (``np.asarray(x)``, or ``x[lo:hi]`` of the flattened array through :meth:`flat`): a loader that keeps only its
    own slices never holds the whole state in host memory. ``shape`` and ``dtype`` (float32) without reading."""

    dtype = np.dtype(np.float32)

    def __init__(self, shape, parts, key):
        self.shape, self._parts, self._key = tuple(shape), parts, key
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.ndim = len(self.shape)

    def flat(self, lo, hi):
        return _assemble(self._parts, self._key, lo, hi)

    def __array__(self, dtype=None, copy=None):
        a = self.flat(0, self.size).reshape(self.shape)
        return a if dtype is None else a.astype(dtype)


def consolidate_state(shards, *, lazy=False):
    """The full optimizer state from the :meth:`ZeroAdamW.state_dict_shard` of every rank of one run.

    Returns ``(state, params)``: ``state`` in the ``ck.optim.AdamW.state_dict`` format (``kind "AdamW"``, step, lr,
    hyperparameters, ``{name: {"exp_avg", "exp_avg_sq"}}`` full-shape NumPy arrays) and ``params``
    ``{name: full fp32 NumPy array}`` (the master weights, each slice from its owner). Checks that there is one
    shard per rank of one world size, one step, the same parameters and shapes, and that the slices of every
    parameter tile it exactly; ValueError naming what disagrees otherwise.

    ``lazy=True``: every array is a :class:`ShardedArray`, assembled when read (``np.asarray``): with memory-mapped
    shards (a checkpoint on disk) a loader copies one parameter at a time instead of the whole state."""
    shards, layout = _check_shards(shards)
    state, params = {}, {}
    for name, (shape, parts) in layout.items():
        arrays = {key: ShardedArray(shape, parts, key) for key in ("param", "exp_avg", "exp_avg_sq")}
        if not lazy:
            arrays = {k: np.asarray(v) for k, v in arrays.items()}
        state[name] = {"exp_avg": arrays["exp_avg"], "exp_avg_sq": arrays["exp_avg_sq"]}
        params[name] = arrays["param"]
    s0 = shards[0]
    return ({"kind": "AdamW", "step": int(s0["step"]), "lr": float(s0["lr"]), "betas": tuple(s0["betas"]),
             "eps": float(s0["eps"]), "weight_decay": float(s0["weight_decay"]), "state": state}, params)


# ---------------------------------------------------------------------------------------------- optimizer
class _Slot:
    __slots__ = ("name", "obj", "shape", "group", "index", "order", "data", "grad", "shadow", "bucket")


class _Group:
    """One flat group: its layout, full buffers P / G / S (/ W), shard buffers M / V / GS."""

    def __init__(self, wd, full, replicated=False):
        self.wd, self.full, self.replicated = wd, full, replicated
        self.slots = []
        self.layout = None
        self.P = self.G = self.S = self.W = self.M = self.V = self.GS = None
        self.sparse_grads = []  # (slot, SparseRowGrad) attached over G
        # replicated (a sparse table with sparse_rows): full M, V on every rank, no GS; the exchange's buffers
        self.X = None  # (send ids [cap], send rows [cap, D], gathered ids [N * cap], gathered rows [N * cap, D])


class _ShadowWait:
    """``param.shadow_wait`` while the all-gather of the parameter's bucket is deferred (ZeroAdamW
    overlap_gather): calling it queues the deferred gathers if needed and orders the current stream after the
    bucket's."""

    __slots__ = ("opt", "key")

    def __init__(self, opt, key):
        self.opt, self.key = opt, key

    def __call__(self):
        self.opt._shadow_wait(self.key)


def _clear_waits(slots):
    """Drop the pending ``shadow_wait`` of these slots' objects (only ours: another optimizer's is not touched)."""
    for sl in slots:
        if isinstance(getattr(sl.obj, "shadow_wait", None), _ShadowWait):
            sl.obj.shadow_wait = None


_KERNELS = {}


def _norm_kernels():
    """fp32 shard norm -> fp64 square, and fp64 sum -> fp32 norm * prescale (tiny CuPy kernels, capturable)."""
    if not _KERNELS:
        import cupy as cp
        _KERNELS["sq"] = cp.ElementwiseKernel("float32 n", "float64 s", "s = (double)n * (double)n",
                                              "ck_zero_norm_sq")
        _KERNELS["root"] = cp.ElementwiseKernel("float64 s, float32 pre", "float32 n",
                                                "n = (float)sqrt(s); n = n * pre", "ck_zero_norm_root")
    return _KERNELS


class ZeroAdamW:
    """AdamW over flat buffers with the moments sharded across ``group`` (see the module docstring).

    Args:
        params, lr, betas, eps, weight_decay, shadow_dtype, no_decay, sparse: as ``ck.optim.AdamW`` (``sparse``
            parameters are updated densely here; :meth:`attach_sparse` keeps their sparse backward).
        group: the :class:`cukernels.distributed.ProcessGroup` (default: the initialised default group, else a
            world of one on the parameters' array module).
        gather_fp32: names or ``callable(name, array) -> bool`` of the parameters whose fp32 values must be
            complete on every rank after each step (read in fp32 by the forward). Default None: all of them.
        wire_dtype: float32 (default) or ``ck.bfloat16``: the gradient's dtype on the wire.
        sparse_rows: None (default: ``sparse`` tables reduced and updated densely) or the most rows of a sparse
            table one rank touches in a step (its tokens per step): the rows are then exchanged and updated
            lazily on a replicated table state (module docstring); needs :meth:`attach_sparse` for each.
        grad_dtype: float32 (default) or ``ck.bfloat16`` (with the bf16 wire): the full gradient buffers ``G``
            in bf16, written by the bf16 weight-gradient GEMMs under autocast (as ``AdamW(grad_dtype=)``); each
            bucket is then reduce-scattered straight from ``G``: no fp32 gradient write, no wire cast, no ``W``.
            Every further write to a gradient in the same step rounds to bf16 again: one micro-batch a step.
        average: reduce with ``avg`` (True, default: each rank's loss is a mean over its own batch) or ``sum``.
        bucket_elems: bucket size in elements (None: one bucket per group); with :meth:`attach_grad_hooks`,
            about 2**25 (64 MiB of bf16) overlaps well.
        sm_margin: multiprocessors left to NCCL while a collective overlaps compute (default 0: none). From the
            first bucket sent under the backward until the reductions are joined, cuBLAS sizes the GEMMs for
            ``SMs - sm_margin`` (:func:`cukernels.blas.set_sm_count_target`; Hopper's persistent GEMMs otherwise
            hold every SM and a reduce-scatter only runs between them), and the AdamW update runs on that
            fraction of a wave so the all-gathers of updated buckets run beside it.
        overlap_gather: False (default): :meth:`step` all-gathers every updated bf16 shadow before it returns.
            True: it all-gathers the first ``EAGER_GATHERS`` bucket(s) in forward order (and every ``gather_fp32``
            group) beside the update, and defers the other shadows' all-gathers to the next forward: they are
            queued on the side stream when it first reads a shadow, and each parameter's reader waits for its own
            bucket (``param.shadow_wait``, called by ``ck.amp.lowp_weight``). The collectives then run under the
            forward's GEMMs instead of after the update. Needs parameters given as autograd Tensors (others are
            gathered in the step) and every shadow read through ``amp.lowp_weight``, as the ``nn`` layers do;
            before reading the shadows any other way, call :meth:`wait_gathers` (the checkpoint and gather
            methods here do).

    Example::

        >>> dist.init_process_group()
        >>> opt = ZeroAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, no_decay=lambda n, a: a.ndim < 2,
        ...                 gather_fp32=lambda n, a: a.ndim < 2, wire_dtype=ck.bfloat16, bucket_elems=2**25)
        >>> opt.attach_grad_hooks()
        >>> loss.backward(); norm, scale = opt.clip_grad_norm(1.0); opt.step(grad_scale=scale); opt.zero_grad()
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, group=None,
                 shadow_dtype=B.bfloat16, no_decay=None, sparse=None, gather_fp32=None, wire_dtype=np.float32,
                 average=True, bucket_elems=None, sm_margin=0, overlap_gather=False, grad_dtype=np.float32,
                 sparse_rows=None):
        lr, beta1, beta2, eps, weight_decay = check_hyperparameters(lr, betas, eps, weight_decay)
        if shadow_dtype is not None:
            B.check_dtype_arg("shadow_dtype", shadow_dtype, (B.bfloat16,))
        wire = B.check_dtype_arg("wire_dtype", wire_dtype, (np.dtype(np.float32), B.bfloat16))
        if wire not in (np.dtype(np.float32), B.bfloat16):
            raise TypeError(f"wire_dtype: expected float32 or ck.bfloat16; got {wire}")
        try:
            gdt = np.dtype(grad_dtype)
        except TypeError:
            gdt = None
        if gdt not in (np.dtype(np.float32), B.bfloat16):
            raise TypeError(f"grad_dtype: expected float32 or ck.bfloat16; got {grad_dtype!r}")
        if gdt == B.bfloat16 and wire != B.bfloat16:
            raise ValueError("grad_dtype: bf16 gradient buffers go on the wire as they are; pass "
                             "wire_dtype=ck.bfloat16 with grad_dtype=ck.bfloat16")
        self.grad_dtype = gdt
        self.sparse_rows = None if sparse_rows is None else B.check_int("sparse_rows", sparse_rows, min=1)
        self.average = B.check_bool("average", average)
        if bucket_elems is not None:
            bucket_elems = B.check_int("bucket_elems", bucket_elems, min=1)
        self.betas = (float(beta1), float(beta2))
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.shadow_dtype = None if shadow_dtype is None else B.bfloat16
        self.wire_dtype, self.bucket_elems = wire, bucket_elems
        self.sm_margin = B.check_int("sm_margin", sm_margin, min=0)
        self.overlap_gather = B.check_bool("overlap_gather", overlap_gather)
        if self.overlap_gather and shadow_dtype is None:
            raise ValueError("overlap_gather: defers the all-gather of the bf16 shadows; with shadow_dtype=None there "
                             "are none (pass overlap_gather=False)")
        self._sm_prev = None  # the cuBLAS SM target to restore while a margin is in force

        entries = AdamW._normalise(params)
        if not entries:
            raise ValueError("params: got an empty parameter list")
        xp = B.array_module(**{f"params[{name!r}]": a for name, _, a in entries})
        self.xp = xp
        if group is None:
            group = get_group() if is_initialized() else SingleGroup(xp)
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"group: expected a cukernels.distributed ProcessGroup; got {type(group).__name__}")
        if group.xp is not xp:
            raise TypeError(f"group: a {group.backend!r} group takes {group.xp.__name__} arrays; the parameters are "
                            f"{xp.__name__} arrays")
        self.group = group
        self.rank, self.world_size = group.rank, group.world_size
        is_nd, is_sparse = _matcher(no_decay, "no_decay"), _matcher(sparse, "sparse")
        is_full = (lambda name, a: True) if gather_fp32 is None else _matcher(gather_fp32, "gather_fp32")

        keyed = {}  # (weight decay, gathers fp32) -> [(order, name, obj, array)]
        replicated = []  # sparse tables exchanged by rows (sparse_rows): a group each
        self._sparse_names = set()
        for order, (name, obj, a) in enumerate(entries):
            B.check_dtype(f"params[{name!r}]", a, (np.float32,))
            if is_sparse(name, a):
                if a.ndim != 2:
                    raise ValueError(f"params[{name!r}]: sparse parameters must be 2-D (V, D); got shape "
                                     f"{tuple(a.shape)}")
                self._sparse_names.add(name)
            wd = 0.0 if is_nd(name, a) else self.weight_decay
            if self.sparse_rows is not None and is_sparse(name, a):
                replicated.append(((order, name, obj, a), wd))
                continue
            keyed.setdefault((wd, bool(is_full(name, a))), []).append((order, name, obj, a))
        self._by_name, self._by_id = {}, {}
        self._groups = [self._build(keyed[k], *k) for k in sorted(keyed, key=lambda k: (-k[0], not k[1]))]
        self._groups += [self._build([item], wd, True, replicated=True) for item, wd in replicated]
        self._by_name = {name: self._by_name[name] for name, _, _ in entries}

        # One fixed launch order for every rank: buckets by descending first-parameter position (the backward
        # finishes the last parameters first; a bucket is complete when its earliest parameter is).
        order = []
        for gi, g in enumerate(self._groups):
            for b in g.layout.buckets:
                first = min((g.slots[i].order for i in b.params), default=-1)
                order.append((-first, gi, b.index))
        self._order = [(gi, bi) for _, gi, bi in sorted(order)]
        self._fwd_order = self._order[::-1]  # the order the next forward reads the buckets in
        self._bucket_params = {(gi, b.index): len(b.params) for gi, g in enumerate(self._groups)
                               for b in g.layout.buckets}

        self._step = xp.zeros((), dtype=np.int32)
        self._lr = xp.zeros((), dtype=np.float32)
        self.set_lr(lr)
        self._schedule = None
        self._norm = xp.zeros((), dtype=np.float32)
        self._norm_sq = xp.zeros((), dtype=np.float64)
        self._scale = xp.ones((), dtype=np.float32)
        self._norm_ws = None
        # Device error word of this optimizer's updates (as AdamW's): a NaN clip scale skips the update on every
        # rank alike (the norm is all-reduced), sets a bit here, and check_errors() raises at the next host read.
        self._err = None if xp is np else xp.zeros((), dtype=np.int32)
        # The sparse exchange's error word: a pack that overflowed sparse_rows (check_errors raises).
        self._xerr = xp.zeros((), dtype=np.int32)
        self._hooks = []
        self._sync_grads = True
        self._comm = None  # side stream (CuPy, world > 1)
        self._events = []
        self._deferred = []  # (group, bucket) whose shadow all-gather waits for the next forward (overlap_gather)
        self._gather_events = {}  # (group, bucket) -> event after its deferred all-gather, until waited for
        self._new_step()

    # ------------------------------------------------------------------------------------------ layout
    def _build(self, items, wd, full, replicated=False):
        xp, N = self.xp, self.world_size
        g = _Group(wd, full, replicated)
        # (a replicated group's layout only says which rank writes which slice into a checkpoint)
        g.layout = L = shard_layout([a.size for _, _, _, a in items], N,
                                    bucket_elems=None if replicated else self.bucket_elems)
        g.P = xp.zeros((L.total,), dtype=np.float32)
        for (_, _, _, a), off in zip(items, L.offsets):
            g.P[off:off + a.size] = a.reshape(-1)
        g.G = xp.zeros((L.total,), dtype=np.float32 if replicated else self.grad_dtype)
        g.S = g.P.astype(B.bfloat16) if self.shadow_dtype is not None else None
        n_state = L.total if replicated else L.shard_size
        g.M = xp.zeros((n_state,), dtype=np.float32)
        g.V = xp.zeros((n_state,), dtype=np.float32)
        # A world of one owns everything: the shard space is the flat space, the reduction is in place (no copy).
        if replicated:
            pass  # rows exchanged through the SparseRowGrad packs (attach_sparse), no reduce-scatter
        elif self.grad_dtype == B.bfloat16:  # the backward's bf16 gradient is the wire buffer: no W, no cast
            g.GS = g.G if N == 1 else xp.zeros((L.shard_size,), dtype=B.bfloat16)
        elif self.wire_dtype == B.bfloat16:
            g.W = xp.zeros((L.total,), dtype=B.bfloat16)
            g.GS = g.W if N == 1 else xp.zeros((L.shard_size,), dtype=B.bfloat16)
        else:
            g.GS = g.G if N == 1 else xp.zeros((L.shard_size,), dtype=np.float32)
        bucket_of = {i: b.index for b in L.buckets for i in b.params}
        for i, ((order, name, obj, a), off) in enumerate(zip(items, L.offsets)):
            s = _Slot()
            s.name, s.obj, s.shape, s.group, s.index, s.order = name, obj, tuple(a.shape), g, i, order
            s.bucket = bucket_of[i]
            s.data = g.P[off:off + a.size].reshape(a.shape)
            s.grad = g.G[off:off + a.size].reshape(a.shape)
            s.shadow = g.S[off:off + a.size].reshape(a.shape) if g.S is not None else None
            if obj is not None:
                old_grad = getattr(obj, "grad", None)
                if old_grad is not None and B._kind(old_grad) is xp and tuple(old_grad.shape) == s.shape:
                    s.grad[...] = old_grad
                obj.data = s.data
                obj.grad = s.grad
                self._by_id[id(obj)] = s
            self._by_name[name] = s
            g.slots.append(s)
        return g

    def _slot(self, p):
        if isinstance(p, str):
            s = self._by_name.get(p)
        else:
            s = self._by_id.get(id(p))
            if s is None:
                s = next((t for t in self._by_name.values() if t.data is p), None)
        if s is None:
            raise KeyError(f"{p if isinstance(p, str) else type(p).__name__}: not a parameter of this optimizer")
        return s

    def layout(self, p):
        """``(ShardLayout of p's group, p's index in it)``."""
        s = self._slot(p)
        return s.group.layout, s.index

    def owners(self, p):
        """``[(rank, lo, hi)]``: which rank owns which element range of parameter ``p`` (flattened)."""
        L, i = self.layout(p)
        return [(r, lo, hi) for r, lo, hi, _ in L.owners(i)]

    def named_parameters(self):
        return [(n, s.data) for n, s in self._by_name.items()]

    def param(self, p):
        return self._slot(p).data

    def grad(self, p):
        return self._slot(p).grad

    def shadow(self, p):
        s = self._slot(p)
        if s.shadow is None:
            raise ValueError("shadow: this optimizer was built with shadow_dtype=None")
        return s.shadow

    def memory_bytes(self):
        """``{buffer name: bytes on this rank}`` (P, G, S, W, M, V, GS; GS aliasing G or W counts 0; X: the sparse
        exchange's packs)."""
        out = dict.fromkeys(("P", "G", "S", "W", "M", "V", "GS", "X"), 0)
        for g in self._groups:
            for k in out:
                a = getattr(g, k)
                if k == "X":
                    out[k] += sum(x.nbytes for x in a) if a is not None else 0
                elif a is not None and not (k == "GS" and (a is g.G or a is g.W)):
                    out[k] += a.nbytes
        return out

    # ------------------------------------------------------------------------------------------ lr / step
    @property
    def lr_array(self):
        return self._lr

    @property
    def step_array(self):
        return self._step

    def check_errors(self):
        """Raise FloatingPointError if an update since the last check found an invalid device lr, step or
        grad_scale (that update was skipped on every rank: parameters and moments unchanged). A host sync."""
        if int(self._xerr):
            self._xerr.fill(0)
            raise ValueError(f"rank {self.rank}: a step touched more rows of a sparse table than sparse_rows="
                             f"{self.sparse_rows} (the rows past it were not exchanged: this step's update is wrong); "
                             f"pass sparse_rows >= the tokens a rank reads per step (batch * seq_len * micro-batches)")
        if self._err is None:
            return
        code = int(self._err)
        if code:
            self._err.fill(0)
            raise FloatingPointError(f"rank {self.rank}: " + _A.adam_error_message(code) + " (a NaN/inf loss or "
                                     "gradient gives a NaN clip scale; lower the lr, check the data)")

    @property
    def step_count(self):
        """Steps taken (a host sync; raises if an update was refused)."""
        self.check_errors()
        return int(self._step)

    def get_lr(self):
        self.check_errors()
        return float(self._lr)

    def set_lr(self, lr):
        lr = check_lr(lr)
        if not (_A._is_number(lr) and np.isfinite(lr)):
            raise ValueError(f"lr: expected a finite number; got {lr!r}")
        if self.xp is np:
            self._lr[...] = np.float32(lr)
        else:
            self._lr.fill(np.float32(lr))

    def set_schedule(self, schedule):
        if schedule is not None and not isinstance(schedule, WarmupCosine):
            raise TypeError(f"schedule: expected a WarmupCosine or None; got {type(schedule).__name__}")
        self._schedule = schedule

    # ------------------------------------------------------------------------------------------ gradients
    def _sync(self):
        """Put back views the caller's objects lost (rebound .data / .grad), copying their values in first."""
        for s in self._by_id.values():
            obj = s.obj
            d = obj.data
            if d is not s.data:
                B.check_shape(f"{s.name}.data", d, s.shape, " (the parameter's shape)")
                s.data[...] = d
                if s.shadow is not None:
                    s.shadow[...] = s.data.astype(B.bfloat16)
                obj.data = s.data
            gr = getattr(obj, "grad", None)
            if gr is not s.grad:
                if gr is None:
                    self._zero(s.grad)
                else:
                    B.check_shape(f"{s.name}.grad", gr, s.shape, " (the parameter's shape)")
                    s.grad[...] = gr
                obj.grad = s.grad

    def _zero(self, a):
        if self.xp is np:
            a.fill(0)
        else:
            B.zero_(a)

    def attach_sparse(self, p):
        """A ``ck.SparseRowGrad`` over parameter ``p``'s (V, D) view of the flat gradient, set as
        ``p.sparse_grad``: the embedding backward writes only the touched rows; the reduction and the update
        stay dense (see the module docstring). ``zero_grad`` zeroes the listed rows (``lazy=True``) or the whole
        buffer, and resets the row list. Only the sparse backward may write this gradient (an untied embedding)."""
        s = self._slot(p)
        if len(s.shape) != 2:
            raise ValueError(f"{s.name}: not a 2-D parameter (shape {s.shape})")
        sg = SparseRowGrad(s.shape[0], s.shape[1], xp=self.xp, grad=s.grad)
        g = s.group
        if g.replicated:
            if g.sparse_grads:
                raise ValueError(f"{s.name}: attach_sparse was called already")
            if self.world_size > 1:
                xp, cap, D, N = self.xp, self.sparse_rows, s.shape[1], self.world_size
                wire = self.wire_dtype
                g.X = (xp.zeros((cap,), np.int32), xp.zeros((cap, D), wire), xp.zeros((N * cap,), np.int32),
                       xp.zeros((N * cap, D), wire))
        s.group.sparse_grads.append((s, sg))
        if s.obj is not None:
            s.obj.sparse_grad = sg
        return sg

    def set_rows(self, p, rows, row_count):
        raise ValueError(f"{self._slot(p).name}: ZeroAdamW takes the rows from attach_sparse's SparseRowGrad (with "
                         f"sparse_rows= they are exchanged and updated lazily; without, every row is updated)")

    def zero_grad(self, lazy=False):
        """Zero every gradient. ``lazy=True`` (parameters given as autograd Tensors): dense gradients are only marked
        stale, as ``AdamW.zero_grad`` does (the first backward write overwrites: the weight-gradient GEMMs run with
        beta = 0, no memset, no read of the old gradient); a parameter with an attached ``SparseRowGrad`` gets
        only its listed rows zeroed and its row list reset (the rest of its gradient is zero already: only the
        sparse backward writes it, the models attach it only to untied embeddings). ``lazy=False``: one memset
        of every flat gradient, row lists reset."""
        self._sync()
        for g in self._groups:
            sparse = {id(s) for s, _ in g.sparse_grads}
            if lazy and all(s.obj is not None for s in g.slots):
                # (session 7: the sparse embedding shares the 2-D group, and zeroing that whole group cost a
                # 1.33 ms memset of 5.6 GB a step and turned every weight-gradient GEMM into beta = 1)
                for s in g.slots:
                    if id(s) not in sparse:
                        s.obj.grad_stale = True
            else:
                self._zero(g.G)
            for _, sg in g.sparse_grads:
                sg.zero()
        self._new_step()

    def flush_stale(self):
        """Zero the gradients still marked stale by a lazy :meth:`zero_grad` (nothing wrote them this step)."""
        for g in self._groups:
            for s in g.slots:
                self._flush(s)

    def _flush(self, s):
        if s.obj is not None and getattr(s.obj, "grad_stale", False):
            self._zero(s.grad)
            s.obj.grad_stale = False

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally; the grad hooks send nothing (gradient accumulation: wrap every
        micro-batch's backward but the last of a step)."""
        prev, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = prev

    def attach_grad_hooks(self):
        """Register a gradient-ready hook on every parameter given as an autograd Tensor, so each bucket's
        reduce-scatter starts as soon as the backward has finished all its parameters. Needs
        ``Tensor.register_grad_ready_hook(fn)`` (``fn(tensor)`` called once per backward when the tensor's
        ``.grad`` is final). Returns the number of hooks."""
        self.detach_grad_hooks()
        for s in self._by_name.values():
            if s.obj is None:
                continue
            reg = getattr(s.obj, "register_grad_ready_hook", None)
            if reg is None:
                raise TypeError(f"params[{s.name!r}]: {type(s.obj).__name__} has no register_grad_ready_hook(fn); "
                                f"the autograd needs the gradient-ready hook to overlap the reduction with the "
                                f"backward (without hooks, ZeroAdamW reduces everything at step())")
            self._hooks.append(reg(lambda t, s=s: self.grad_ready(s.obj if s.obj is not None else s.name)))
        return len(self._hooks)

    def detach_grad_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def grad_ready(self, p):
        """Declare parameter ``p``'s gradient final for this step (what the hook calls): when every parameter of
        the next bucket in the launch order is ready, its reduce-scatter starts. Ignored inside :meth:`no_sync`."""
        if not self._sync_grads:
            return
        s = self._slot(p)
        key = (self._groups.index(s.group), s.bucket)
        if key in self._launched:
            raise RuntimeError(f"{s.name}: its gradient became ready again after its bucket was sent in this step; "
                               f"with gradient accumulation, run every backward but the last inside "
                               f"optimizer.no_sync()")
        if s.name in self._ready_params:
            return
        self._ready_params.add(s.name)
        self._remaining[key] -= 1
        while self._cursor < len(self._order) and self._remaining[self._order[self._cursor]] == 0:
            self._launch(*self._order[self._cursor])
            self._cursor += 1

    def _new_step(self):
        self._remaining = dict(self._bucket_params)
        self._ready_params = set()
        self._launched = set()
        self._cursor = 0
        self._reduced = False

    def _side(self):
        """The side stream (CuPy, world > 1), or None: work goes on the current stream."""
        if self.xp is np or self.world_size == 1:
            return None
        if self._comm is None:
            # The highest priority the device offers: a block of the NCCL kernel is scheduled as soon as an SM
            # frees up, instead of after every queued block of the GEMM or Adam kernel running beside it (default
            # priority: the 2-GPU B8xT1024 step lost ~10 ms, the overlapped collectives ran as if serial).
            # Captured graphs keep it per node (cukernels.graph instantiates with node priorities).
            # (CuPy has no cudaDeviceGetStreamPriorityRange; CUDA clamps a priority outside the device's range
            # to the nearest end, so -100 is the greatest, -5 on Hopper.)
            self._comm = self.xp.cuda.Stream(non_blocking=True, priority=SIDE_PRIORITY)
        return self._comm

    def _fork(self):
        """Order the side stream after the work queued so far on the current stream; returns the side stream."""
        side = self._side()
        if side is not None:
            ev = self.xp.cuda.Event(block=False, disable_timing=True)
            ev.record(self.xp.cuda.get_current_stream())
            side.wait_event(ev)
            self._events.append(ev)
        return side

    def _join(self):
        """The current stream waits for everything queued on the side stream."""
        side = self._comm
        if side is not None and self._events:
            ev = self.xp.cuda.Event(block=False, disable_timing=True)
            ev.record(side)
            self.xp.cuda.get_current_stream().wait_event(ev)
            self._events = []

    def _launch(self, gi, bi):
        if self._deferred:  # (no forward read a shadow since the step: the gathers still go first)
            self._launch_deferred()
        g = self._groups[gi]
        b = g.layout.buckets[bi]
        for i in b.params:  # a gradient nothing wrote this step is zero, not stale garbage
            self._flush(g.slots[i])
        self._launched.add((gi, bi))
        if g.replicated:
            return self._exchange(g)
        if b.stop == b.start:
            return
        send = g.G[b.start:b.stop]
        if g.W is not None and CAST_ON_COMPUTE_STREAM:  # the bf16 wire copy made in line with the backward
            send = _cast(send, B.bfloat16, out=g.W[b.start:b.stop])
        side = self._fork()
        self._margin_on()
        with side if side is not None else contextlib.nullcontext():
            if g.W is not None and not CAST_ON_COMPUTE_STREAM:
                send = _cast(send, B.bfloat16, out=g.W[b.start:b.stop])
            self.group.reduce_scatter(send, g.GS[b.shard_offset:b.shard_offset + b.piece],
                                      "avg" if self.average else "sum")

    def _exchange(self, g):
        """A sparse table's rows across the ranks, on the side stream: pack this rank's listed rows, all-gather the
        packs, merge them in rank order (every rank then holds the same summed rows, and the union as its list)."""
        if not g.sparse_grads:
            raise RuntimeError(f"{g.slots[0].name}: sparse_rows= exchanges the rows listed by attach_sparse's "
                               f"SparseRowGrad; call attach_sparse({g.slots[0].name!r}) before the first backward")
        if self.world_size == 1:
            return  # the local rows are the rows
        (_, sg), = g.sparse_grads
        ids, rows, all_ids, all_rows = g.X
        cap, N = ids.shape[0], self.world_size
        side = self._fork()
        with side if side is not None else contextlib.nullcontext():
            sg.pack(ids, rows, error=self._xerr)
            self.group.all_gather(ids, all_ids)
            self.group.all_gather(rows.reshape(-1), all_rows.reshape(-1))
            sg.merge([(all_ids[k * cap:(k + 1) * cap], all_rows[k * cap:(k + 1) * cap]) for k in range(N)],
                     scale=1.0 / N if self.average else 1.0)

    def reduce_gradients(self):
        """Send every bucket not sent yet (in the fixed order) and make the current stream wait for the
        reductions. Called by :meth:`grad_norm` and :meth:`step`; idempotent within a step."""
        if self._reduced:
            return
        self._sync()
        if self._deferred:
            self._launch_deferred()
        while self._cursor < len(self._order):
            self._launch(*self._order[self._cursor])
            self._cursor += 1
        self._join()
        self._margin_off()
        self._reduced = True

    def _margin_on(self):
        if self.sm_margin and self._comm is not None and self._sm_prev is None:
            self._sm_prev = blas.set_sm_count_target(max(1, B.sm_count() - self.sm_margin))

    def _margin_off(self):
        if self._sm_prev is not None:
            blas.set_sm_count_target(self._sm_prev)
            self._sm_prev = None

    # ------------------------------------------------------------------------------------------ norm
    def grad_norm(self, prescale=1.0):
        """Global L2 norm of the reduced gradient times ``prescale`` (e.g. ``1 / accumulation steps``), a 0-d fp32
        device array (the same buffer every call). Reduces first if needed. On one rank: ``ck.global_norm``;
        on N: per-shard ``ck.global_norm``, squared in fp64, all-reduced, square-rooted -- within an ulp or two
        of the one-GPU norm (the per-shard fp32 square roots round once more)."""
        pre = B.check_f32("prescale", prescale, min=0, min_open=True)
        self.reduce_gradients()
        # a replicated table's gradient is the same on every rank: each counts its own slice of it once
        shards = [g.G[slice(*g.layout.buckets[0].piece_range(self.rank))] if g.replicated else g.GS
                  for g in self._groups]
        if self._norm_ws is None:
            self._norm_ws = _A.global_norm_workspace(shards)
        xp = self.xp
        if self.world_size == 1:
            _A.global_norm(shards, out=self._norm, workspace=self._norm_ws)
            if pre != 1:
                xp.multiply(self._norm, pre, out=self._norm)
            return self._norm
        local = _A.global_norm(shards, out=self._norm, workspace=self._norm_ws)
        if xp is np:
            self._norm_sq[...] = np.float64(local) * np.float64(local)
            self.group.all_reduce(self._norm_sq, "sum")
            self._norm[...] = np.float32(np.sqrt(self._norm_sq)) * pre
        else:
            k = _norm_kernels()
            k["sq"](local, self._norm_sq)
            self.group.all_reduce(self._norm_sq, "sum")
            k["root"](self._norm_sq, pre, self._norm)
        return self._norm

    def clip_grad_norm(self, max_norm, *, prescale=1.0):
        """``(norm, scale)`` device scalars: ``norm = grad_norm(prescale)``, ``scale = min(1, max_norm / (norm +
        1e-6)) * prescale`` (``max_norm`` None or 0: ``scale = prescale``). Pass ``scale`` to :meth:`step` as
        ``grad_scale``: the update then sees the gradient times ``prescale``, clipped."""
        pre = B.check_f32("prescale", prescale, min=0, min_open=True)
        norm = self.grad_norm(prescale)
        xp = self.xp
        if max_norm:
            _A.clip_scale(norm, max_norm, out=self._scale)
            if pre != 1:
                xp.multiply(self._scale, pre, out=self._scale)
        elif xp is np:
            self._scale[...] = pre
        else:
            self._scale.fill(pre)
        return norm, self._scale

    # ------------------------------------------------------------------------------------------ the step
    def step(self, grad_scale=None):
        """Reduce (if not yet done), advance the device step (and lr schedule), AdamW on this rank's pieces, then
        all-gather the updated shadows (and the fp32 parameters of ``gather_fp32`` groups)."""
        self.reduce_gradients()
        _A.tick(self._step, self._lr, increment=1,
                schedule=self._schedule.as_tuple() if self._schedule is not None else None)
        b1, b2 = self.betas
        kw = dict(lr=self._lr, step=self._step, beta1=b1, beta2=b2, eps=self.eps, grad_scale=grad_scale)
        if self._err is not None:
            kw["error"] = self._err
        if self.sm_margin and self._side() is not None:
            kw["occupancy"] = max(0.05, 1.0 - self.sm_margin / B.sm_count())
        elif self._side() is not None:
            kw["occupancy"] = ADAM_OCCUPANCY
        r = self.rank
        eager = EAGER_GATHERS
        for gi, bi in self._fwd_order if self.overlap_gather else self._order:
            g = self._groups[gi]
            b = g.layout.buckets[bi]
            if g.replicated:  # every rank: the same lazy update of the same rows (the exchange's union)
                self._step_rows(g, grad_scale)
                continue
            if b.piece == 0:
                continue
            lo, hi = b.piece_range(r)
            sh = slice(b.shard_offset, b.shard_offset + b.piece)
            _A.adam_step(g.P[lo:hi], g.GS[sh], g.M[sh], g.V[sh], weight_decay=g.wd,
                         shadow=g.S[lo:hi] if g.S is not None else None, **kw)
            if self.world_size == 1:
                continue
            if self._deferrable(g, b):
                if eager <= 0:
                    self._deferred.append((gi, bi))
                    continue
                eager -= 1
            side = self._fork()
            with side if side is not None else contextlib.nullcontext():
                if g.S is not None:
                    self.group.all_gather(g.S[lo:hi], g.S[b.start:b.stop])
                if g.full:
                    self.group.all_gather(g.P[lo:hi], g.P[b.start:b.stop])
        self._join()
        for key in self._deferred:  # the next forward's first shadow read queues them, each reader waits its own
            g = self._groups[key[0]]
            wait = _ShadowWait(self, key)
            for i in g.layout.buckets[key[1]].params:
                g.slots[i].obj.shadow_wait = wait
        self._new_step()

    def _step_rows(self, g, grad_scale):
        (s, sg), = g.sparse_grads  # (the exchange raised already without one)
        n, shape = s.data.size, s.shape
        off = g.layout.offsets[s.index]
        view = lambda a: a[off:off + n].reshape(shape)  # noqa: E731
        b1, b2 = self.betas
        _A.adam_step_rows(view(g.P), view(g.G), view(g.M), view(g.V), sg.rows, sg.count, lr=self._lr,
                          step=self._step, beta1=b1, beta2=b2, eps=self.eps, weight_decay=g.wd,
                          shadow=view(g.S) if g.S is not None else None, grad_scale=grad_scale,
                          **({"error": self._err} if self._err is not None else {}))

    def _deferrable(self, g, b):
        """Whether bucket b's all-gather may wait for the next forward: overlap_gather, shadows only (no fp32
        gather), every parameter an object that can carry ``shadow_wait``."""
        return (self.overlap_gather and not g.full and not g.replicated and g.S is not None
                and all(g.slots[i].obj is not None for i in b.params))

    def _launch_deferred(self):
        """Queue the deferred shadow all-gathers (forward order) on the side stream, an event after each."""
        keys, self._deferred = self._deferred, []
        side = self._fork()
        with side if side is not None else contextlib.nullcontext():
            for gi, bi in keys:
                g = self._groups[gi]
                b = g.layout.buckets[bi]
                lo, hi = b.piece_range(self.rank)
                self.group.all_gather(g.S[lo:hi], g.S[b.start:b.stop])
                if side is not None:
                    ev = self.xp.cuda.Event(block=False, disable_timing=True)
                    ev.record(side)
                    self._gather_events[(gi, bi)] = ev

    def _shadow_wait(self, key):
        """What ``param.shadow_wait`` calls: queue the deferred gathers if not yet, then order the current stream
        after bucket ``key``'s, and clear the waits of its parameters."""
        if self._deferred:
            self._launch_deferred()
        g = self._groups[key[0]]
        _clear_waits(g.slots[i] for i in g.layout.buckets[key[1]].params)
        ev = self._gather_events.pop(key, None)
        if ev is not None:
            self.xp.cuda.get_current_stream().wait_event(ev)

    def wait_gathers(self):
        """Finish the shadow all-gathers a step deferred (``overlap_gather``): queue them if no forward has, and
        make the current stream wait for them. Call before reading the shadows other than through the ``nn``
        layers; the checkpoint, gather and broadcast methods call it. No-op otherwise."""
        if self._deferred:
            self._launch_deferred()
        self._gather_events.clear()
        _clear_waits(sl for g in self._groups for sl in g.slots)
        self._join()

    def gather_params(self):
        """All-gather the fp32 parameters of the groups outside ``gather_fp32`` (their non-owned pieces are stale
        after a step): call before saving the model's weights or running it in fp32. No-op on one rank."""
        if self.world_size == 1:
            return
        self.wait_gathers()
        for gi, bi in self._order:
            g = self._groups[gi]
            b = g.layout.buckets[bi]
            if g.full or g.replicated or b.piece == 0:
                continue
            lo, hi = b.piece_range(self.rank)
            side = self._fork()
            with side if side is not None else contextlib.nullcontext():
                self.group.all_gather(g.P[lo:hi], g.P[b.start:b.stop])
        self._join()

    def broadcast_params(self, root=0):
        """Give every rank rank ``root``'s parameters (one broadcast of each flat fp32 group, then the shadows
        re-derived): data-parallel replicas start identical even if their initialisations could differ."""
        if self.world_size == 1:
            return
        self._sync()
        for g in self._groups:
            self.group.broadcast(g.P, root)
        self.refresh_shadows()

    def refresh_shadows(self):
        """Recompute every bf16 shadow from the fp32 parameters (after writing full parameter values on every
        rank, e.g. loading a checkpoint)."""
        if self.shadow_dtype is None:
            return
        self.wait_gathers()  # (a deferred gather still writing them would land after this)
        for g in self._groups:
            g.S[...] = g.P.astype(B.bfloat16)

    # ------------------------------------------------------------------------------------------ state
    def state_dict_shard(self, copy=True):
        """This rank's part of the state: ``{"kind": "ZeroAdamW.shard", "rank", "world_size", "step", "lr",
        "betas", "eps", "weight_decay", "state": {name: {"shape", "start", "stop", "param", "exp_avg",
        "exp_avg_sq"}}}`` -- elements ``[start, stop)`` of each flattened parameter (empty where this rank owns
        none). ``copy=True``: NumPy copies (a host sync); ``copy=False``: views of the device buffers, for a
        writer that streams them. Every rank writes its own; :func:`consolidate_state` joins them."""
        self.check_errors()
        host = (lambda a: a.copy()) if self.xp is np else (lambda a: a.get())
        take = host if copy else (lambda a: a)
        state = {}
        for name, s in self._by_name.items():
            g, L = s.group, s.group.layout
            own = L.owned(s.index, self.rank)
            if own is None:
                lo = hi = so = 0
                e = {k: take(g.M[0:0]) for k in ("param", "exp_avg", "exp_avg_sq")}
            else:
                lo, hi, so = own
                off = L.offsets[s.index]
                if g.replicated:  # full moments on every rank: each writes its layout slice of them
                    so = off + lo
                e = {"param": take(g.P[off + lo:off + hi]), "exp_avg": take(g.M[so:so + hi - lo]),
                     "exp_avg_sq": take(g.V[so:so + hi - lo])}
            state[name] = dict(shape=list(s.shape), start=lo, stop=hi, **e)
        return {"kind": SHARD_KIND, "rank": self.rank, "world_size": self.world_size, "step": int(self._step),
                "lr": float(self._lr), "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "state": state}

    def state_dict(self, copy=True):
        """:meth:`state_dict_shard` (ZeroAdamW's state is per rank; see :func:`consolidate_state`)."""
        return self.state_dict_shard(copy=copy)

    def load_state_dict(self, state, params=None):
        """Load the optimizer state, keeping this rank's slices.

        Args:
            state: ``AdamW.state_dict()`` format (one GPU, or :func:`consolidate_state`'s), or the list of every
                rank's :meth:`state_dict_shard` from a run on any number of ranks (or the one shard of a world of
                one).
            params: optional ``{name: full fp32 array}`` written into the parameters on every rank (a list of
                shards brings its own; ``params=False`` keeps the current values even then). Without it the current
                parameter values stay (load the model first).
        Shards are read lazily (:class:`ShardedArray`): from memory-mapped checkpoint files, host memory holds one
        parameter at a time, and each rank reads only its own slices of the moments.
        Everything is checked before anything is written; the shadows are then refreshed from the fp32 values.
        """
        if isinstance(state, (list, tuple)):
            state, own_params = consolidate_state(state, lazy=True)
            params = own_params if params is None else params
        elif isinstance(state, dict) and state.get("kind") == SHARD_KIND:
            if state.get("world_size") != 1:
                raise ValueError(f"state: one shard of a world of {state.get('world_size')}; pass the list of every "
                                 f"rank's shard")
            state, own_params = consolidate_state([state], lazy=True)
            params = own_params if params is None else params
        if params is False:
            params = None
        step, lr, st = check_state(state, list(self._by_name))
        host = lambda a: np.asarray(a.get() if hasattr(a, "get") else a)  # noqa: E731

        def piece(a, lo, hi):  # elements [lo, hi) of the flattened array, reading no more than that when lazy
            if isinstance(a, ShardedArray):
                return a.flat(lo, hi)
            return host(a).reshape(-1)[lo:hi]

        for n, s in self._by_name.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(st[n][key].shape) != s.shape:
                    raise ValueError(f"state_dict[{n!r}][{key!r}]: expected shape {s.shape}; got "
                                     f"{tuple(st[n][key].shape)}")
            if params is not None:
                if n not in params:
                    raise KeyError(f"params: missing {n!r}")
                if tuple(params[n].shape) != s.shape:
                    raise ValueError(f"params[{n!r}]: expected shape {s.shape}; got {tuple(params[n].shape)}")
        for n, s in self._by_name.items():
            g, L = s.group, s.group.layout
            if params is not None:
                s.data[...] = self.xp.asarray(host(params[n]).astype(np.float32, copy=False).reshape(s.shape))
            own = L.owned(s.index, self.rank)
            if g.replicated:  # every rank keeps the whole of a replicated table's moments
                off = L.offsets[s.index]
                own = (0, s.data.size, off)
            if own is None:
                continue
            lo, hi, so = own
            for key, buf in (("exp_avg", g.M), ("exp_avg_sq", g.V)):
                src = piece(st[n][key], lo, hi)
                buf[so:so + hi - lo] = self.xp.asarray(src.astype(np.float32, copy=False))
        step = int(step)
        if self.xp is np:
            self._step[...] = np.int32(step)
        else:
            self._step.fill(np.int32(step))
        self.set_lr(lr)
        self.refresh_shadows()

    def __repr__(self):
        def kind(g):  # a replicated group's P is whole on every rank too, but nothing of it is gathered
            return "replicated, sparse rows exchanged" if g.replicated else f"fp32 gathered={g.full}"
        groups = ", ".join(f"(wd={g.wd}, {kind(g)}, n={len(g.slots)}, buckets={len(g.layout.buckets)})"
                           for g in self._groups)
        return (f"ZeroAdamW(rank={self.rank}, world_size={self.world_size}, wire={self.wire_dtype}, "
                f"average={self.average}, groups=[{groups}])")
