"""``ck.optim.AdamW``: AdamW over flat buffers laid out as the shards of a process group -- in a world of one (the
default) the plain optimizer, across N ranks ZeRO-1 (the moments sharded, the gradients reduce-scattered, the
updated pieces all-gathered). bf16 shadow weights, sparse-row updates for embeddings, a device-side step counter
and learning rate, and a warmup + cosine schedule that runs on the device.

Layout. At construction every dense parameter is copied into a flat fp32 buffer of its group (weight decay / no
weight decay), next to flat buffers for its gradient, both moments and its bf16 shadow, at the same offsets (each
parameter starts on a 64-element = 256-byte boundary, so every view is 16-byte aligned for the vector paths of the
other kernels; the padding is zero and stays zero). :func:`cukernels.optim.zero.shard_layout` cuts each group
into buckets and each bucket into one piece per rank; rank r keeps the moments of its pieces only. In a world of
one the piece is the whole buffer, and the dense update is one :func:`cukernels.adam_step` launch per group. Each
parameter named in ``sparse`` (a 2-D embedding table) is a group of its own, updated with
:func:`cukernels.adam_step_rows` on the rows the step touched.

What this means for the caller:

* Objects with ``.data`` (e.g. autograd Tensors): the optimizer **replaces** ``p.data`` by a view into its flat
  buffer (same values, same shape) and sets ``p.grad`` to a zeroed view into the flat gradient buffer. The backward
  must then accumulate into ``p.grad`` **in place** (``p.grad += g`` on the array, or ``xp.add(p.grad, g,
  out=p.grad)``), so gradients land in the flat buffer with no copy. Arrays the caller held before construction are
  no longer the parameters. As a safety net, ``step()`` / ``zero_grad()`` check identity: a ``p.data`` or
  ``p.grad`` that was rebound to another array is copied into the flat buffer and the view is put back (one extra
  copy per rebinding; ``p.grad = None`` counts as a zero gradient -- the parameter is still updated, unlike
  PyTorch which skips it).
* ``(name, array)`` pairs: the values are copied; use :meth:`AdamW.param` / :meth:`AdamW.grad` (or
  :meth:`AdamW.named_parameters`) to get the views the model must use from then on.
* :meth:`AdamW.shadow` gives a parameter's bf16 copy, rewritten by every ``step()`` in the same pass as the update:
  autocast reads it instead of casting the fp32 weight every forward. After writing parameter values by other
  means (loading a checkpoint into ``p.data``), call :meth:`AdamW.refresh_shadows`.

Graph capture. ``lr`` and the step count live in 0-d device arrays (:attr:`AdamW.lr_array`,
:attr:`AdamW.step_array`); ``step()`` advances the step (and, with a schedule, computes the lr from it) in one tiny
kernel, then runs the update kernels that read both from device memory, so a captured training step stays valid
replay after replay. ``set_lr`` writes the device lr outside the graph. Across ranks every collective goes on the
current stream or a side stream joined back to it: no host read, no allocation after the first step.

ZeRO-1 (``group`` of N > 1 ranks; bytes per parameter in brackets). Full on every rank: fp32 parameters ``P`` [4],
fp32 gradients ``G`` [4] (or bf16 [2] with ``grad_dtype=ck.bfloat16``), bf16 shadows ``S`` [2]; the rank's shard:
moments ``M``, ``V`` [8/N] and the reduced gradient ``GS`` [4/N fp32 or 2/N bf16]; the bf16 wire's send buffer
``W`` [2] (not with bf16 gradients: ``G`` is sent as it is). For 1.5e9 parameters on 2 GPUs: 18 bytes/param (27 GB)
in a world of one, 16 (fp32 wire), 17 (bf16 wire) or 13 (bf16 gradients) on each of 2 ranks; on 8: 11.5 / 13.25 /
9.25. One step:

1. **reduce-scatter** each bucket's gradient (``avg`` over ranks by default: NCCL's pre-multiplied sum; ``sum``
   with ``average=False``) into ``GS``: fp32 on the wire, or cast to bf16 first (``wire_dtype=ck.bfloat16``: half
   the bytes; the reduced bf16 gradient is what Adam reads, widened in registers; the cast runs on the current
   stream, the collective on the side stream: ``ck.settings.zero_cast_on_compute_stream``). With :meth:`attach_grad_hooks` a
   bucket is sent as soon as the backward has finished every parameter in it, on a side stream ordered by CUDA
   events, so the communication hides behind the rest of the backward; otherwise all buckets go at the first of
   :meth:`grad_norm` / :meth:`step`. Buckets go in one fixed order (the reverse of the parameter order, the order
   the backward finishes them), identical on every rank as NCCL needs.
2. **global gradient norm** (for clipping): ``ck.global_norm`` of the rank's shard, squared in fp64, all-reduced
   (sum, fp64), square root -- deterministic, no host sync.
3. **AdamW** (``ck.adam_step``) on the owned piece of every bucket: fp32 master, moments, bf16 shadow piece.
4. **all-gather** the updated pieces: the bf16 shadow of every group and the fp32 parameters of the
   ``gather_fp32`` groups, bucket by bucket on the side stream (bucket k's all-gather overlaps bucket k+1's Adam).
   With ``overlap_gather=True`` only the first ``ck.settings.zero_eager_gathers`` bucket(s) in forward order (and the fp32
   groups) are gathered here; the other shadows' all-gathers are queued when the next forward first reads a
   shadow, and each layer waits only for its own bucket (``param.shadow_wait``, honoured by
   ``ck.amp.lowp_weight``), so they run under the forward's GEMMs (2 x H200, LLaMA-3.2-1B, B8xT1024: 127.4 ->
   125.4 ms a step).

The fp32 parameters outside ``gather_fp32`` are then current on each rank only in its own pieces:
:meth:`gather_params` completes them (before saving the model or an fp32 evaluation). Default ``gather_fp32=None``
gathers every fp32 parameter; under bf16 autocast with shadows attached the GEMM weights are read only through
their shadows, so ``gather_fp32=lambda name, a: a.ndim < 2`` is enough. Gradient accumulation: the reduction runs
once per step; with grad hooks attached, wrap every backward but the last of a step in :meth:`no_sync`.

Sparse rows across ranks. ``sparse_rows=n`` (n = the tokens a rank reads per step, an upper bound on its touched
rows): each sparse table keeps its full moments on every rank (+8 (N-1)/N bytes a table element), no
reduce-scatter, no all-gather; after its backward each rank packs its listed rows (``SparseRowGrad.pack``), the
packs are all-gathered and every rank merges them in rank order (``SparseRowGrad.merge``, times 1/N with
``average``), so every rank holds the same bits for the union of the rows and runs the same ``adam_step_rows`` on
them (LLaMA-3.2-1B, B8xT1024: N packs of 34 MB instead of 0.53 GB each way). A pack that overflows n sets an error
:meth:`check_errors` raises. ``sparse_rows=None``: across ranks a sparse table is reduced and updated densely in
its dense group (its backward still writes only the touched rows).

In a world of one the ZeRO settings (``gather_fp32``, ``wire_dtype``, ``average``, ``bucket_elems``,
``sm_margin``, ``overlap_gather``, ``sparse_rows``, the grad hooks) are checked and have no effect: nothing is sent.

Checkpoints: :meth:`state_dict` is this rank's part in the one format of :mod:`cukernels.optim.zero` (a world of
one's is the whole state, in the parameters' shapes); :meth:`load_state_dict` takes it, the list of every rank's
from a run on any number of ranks, or the full format, and keeps its own slices.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import _backend as B
from .. import blas
from ..settings import settings
from ..distributed import ProcessGroup, SingleGroup, get_group, is_initialized
from ..ops import adam as _A
from ..ops.elementwise import cast as _cast
from ..ops.embedding import SparseRowGrad
from . import zero as Z
from .zero import ALIGN, ShardedArray, check_state, full_state, host, make_shard, shard_layout

__all__ = ["AdamW", "ZeroAdamW", "WarmupCosine", "ALIGN"]


# ------------------------------------------------------------------------------ argument checks (every optimizer)
def check_lr(lr, name="lr"):
    """A learning rate: a finite number >= 0 that stays finite in float32 (the device lr), refused when it is
    given (at construction, ``set_lr``), not at the first ``step()``."""
    B.check_f32(name, lr, min=0)
    return float(lr)  # (the value as given: the host schedule computes in float64)


def check_hyperparameters(lr, betas, eps, weight_decay):
    """``(lr, beta1, beta2, eps, weight_decay)`` as floats after torch.optim.AdamW's checks (lr >= 0, betas a pair
    in [0, 1), eps > 0, weight_decay >= 0, all finite): TypeError / ValueError naming the argument."""
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise TypeError(f"betas: expected a pair (beta1, beta2) of numbers in [0, 1); got {B._got(betas)}")
    beta1, beta2 = betas
    _A._hyper(beta1, beta2, eps, weight_decay)
    return check_lr(lr), float(beta1), float(beta2), float(eps), float(weight_decay)


def _check_float_dtype(name, dtype, allow_none=False):
    """float32 or ck.bfloat16 (or None when allowed) as a NumPy dtype; TypeError naming the argument."""
    if dtype is None and allow_none:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in (np.dtype(np.float32), np.dtype(B.bfloat16)):
        raise TypeError(f"{name}: expected float32 or ck.bfloat16; got {dtype!r}")
    return dt


class WarmupCosine:
    """Linear warmup from 0 to ``max_lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at
    ``total_steps`` (held at ``min_lr`` after). Attach with :meth:`AdamW.set_schedule`; each ``step()`` then
    computes the lr of its (1-based) step number on the device from the device step counter.

    ``lr(t) = max_lr * t / warmup`` for ``t <= warmup``, else
    ``min_lr + (max_lr - min_lr) * (1 + cos(pi * (t - warmup) / (total - warmup))) / 2``.

    Example::

        >>> opt.set_schedule(ck.optim.WarmupCosine(3e-4, total_steps=10000, warmup_steps=200, min_lr=3e-5))
    """

    def __init__(self, max_lr, total_steps, warmup_steps=0, min_lr=0.0):
        # Integers, not "100" or 100.7 (both were accepted: int() truncated or parsed them), within the schedule
        # kernel's bounds (the step counts of ops.adam.tick's schedule tuple).
        max_lr, min_lr = check_lr(max_lr, "max_lr"), check_lr(min_lr, "min_lr")
        warmup_steps = B.check_int("warmup_steps", warmup_steps, min=0, max=2**62)
        total_steps = B.check_int("total_steps", total_steps, min=0, max=2**62)
        if total_steps < warmup_steps:
            raise ValueError(f"total_steps: expected an integer >= warmup_steps ({warmup_steps}); got {total_steps}")
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.warmup_steps, self.total_steps = int(warmup_steps), int(total_steps)

    def lr_at(self, t):
        """The lr of step number ``t`` (1-based), in float64 on the host."""
        return _A.warmup_cosine(t, self.max_lr, self.min_lr, self.warmup_steps, self.total_steps)

    def as_tuple(self):
        return (self.max_lr, self.min_lr, self.warmup_steps, self.total_steps)

    def __repr__(self):
        return (f"WarmupCosine(max_lr={self.max_lr}, total_steps={self.total_steps}, "
                f"warmup_steps={self.warmup_steps}, min_lr={self.min_lr})")


def _matcher(spec, what):
    """A predicate (name, array) -> bool from None, a callable, or a collection of names."""
    if spec is None:
        return lambda name, a: False
    if callable(spec):
        return lambda name, a: bool(spec(name, a))
    if isinstance(spec, str):
        raise TypeError(f"{what}: expected a set of names or a callable(name, array); got the string {spec!r}")
    try:
        items = list(spec)
    except TypeError:
        raise TypeError(f"{what}: expected a set of names or a callable(name, array); got {B._got(spec)}") from None
    bad = [x for x in items if not isinstance(x, str)]
    if bad:  # a set of Tensors would silently match nothing (and a list of arrays is unhashable)
        raise TypeError(f"{what}: expected parameter names (str) or a callable(name, array); got "
                        f"{type(bad[0]).__name__} elements (pass {{p.name for p in ...}})")
    names = set(items)
    return lambda name, a: name in names


# ---------------------------------------------------------------------------------------------- buffers
class _Slot:
    """One parameter: its name, the caller's object (or None for a pair), its place and its views."""

    __slots__ = ("name", "obj", "shape", "group", "index", "order", "bucket", "data", "grad", "shadow")


class _Group:
    """One flat group: its layout, full buffers P / G / S (/ W), shard buffers M / V / GS. ``sparse``: one 2-D
    table updated on listed rows, its moments whole on every rank (no GS: nothing reduce-scattered)."""

    def __init__(self, wd, full, sparse=False):
        self.wd, self.full, self.sparse = wd, full, sparse
        self.slots = []
        self.layout = None
        self.P = self.G = self.S = self.W = self.M = self.V = self.GS = None
        self.F8 = None  # the ck.Fp8Shadow of P's FP8 packs (AdamW(fp8_shadows=True)), or None
        self.sparse_grads = []  # (slot, SparseRowGrad) attached over G
        self.rows = self.row_count = None  # sparse: the device row list / count each step updates (None: dense)
        self.last_rows = False  # sparse: the last step updated only the listed rows
        self.X = None  # sparse, several ranks: the exchange's buffers (send ids, send rows, gathered ids, rows)

    def table(self, buf):
        """A sparse group's ``(V, D)`` view of one of its flat buffers (the table starts at offset 0)."""
        s = self.slots[0]
        return None if buf is None else buf[:s.data.size].reshape(s.shape)


class _ShadowWait:
    """``param.shadow_wait`` while the all-gather of the parameter's bucket is deferred (overlap_gather): calling it
    queues the deferred gathers if needed and orders the current stream after the bucket's."""

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


# ---------------------------------------------------------------------------------------------- optimizer
class AdamW:
    """AdamW over flat buffers sharded across ``group`` (see the module docstring for the layout, what it does to
    ``.data``, and what several ranks add).

    Args:
        params: a list of ``(name, array)`` pairs, or of objects with ``.data`` (a float32 array), ``.grad``
            (array or None) and optionally ``.name``; all NumPy or all CuPy.
        lr: initial learning rate (device scalar; change with :meth:`set_lr` or a schedule).
        betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        group: the :class:`cukernels.distributed.ProcessGroup` whose ranks share the state (default: a world of
            one on the parameters' array module: the plain optimizer).
        shadow_dtype: ``ck.bfloat16`` (default) to keep a bf16 copy of every parameter, or None.
        no_decay: names (set) or ``callable(name, array) -> bool`` of parameters without weight decay
            (e.g. ``lambda n, a: a.ndim < 2`` for norms and biases). Default: every parameter decays.
        sparse: names or ``callable(name, array) -> bool`` of 2-D parameters updated on listed rows only (lazy
            Adam, see :func:`cukernels.adam_step_rows`) once rows are registered (:meth:`attach_sparse`, or
            :meth:`set_rows` in a world of one); without registered rows they get the dense update.
        grad_dtype: float32 (default) or ``ck.bfloat16``: the dtype of the dense groups' gradient buffers (sparse
            parameters keep fp32 rows). bf16 is what bf16 autocast produces anyway -- a weight-gradient GEMM of
            bf16 operands rounded once to bf16 -- written straight into the buffer, and it halves the gradient's
            bytes (issue 17: ~7.4 GB a LLaMA-1B step). Every further write to a parameter's gradient in the same step
            (gradient accumulation, a tied weight's second use) rounds to bf16 again: use it with one micro-batch.
            Across ranks the bf16 buffers go on the wire as they are (``wire_dtype`` bf16).
        gather_fp32: names or ``callable(name, array) -> bool`` of the parameters whose fp32 values must be
            complete on every rank after each step (read in fp32 by the forward). Default None: all of them.
        wire_dtype: float32 or ``ck.bfloat16``: the gradient's dtype on the wire (default None: the gradient
            buffers' dtype).
        average: reduce with ``avg`` (True, default: each rank's loss is a mean over its own batch) or ``sum``.
        bucket_elems: bucket size in elements (None: one bucket per group); with :meth:`attach_grad_hooks`, about
            2**25 (64 MiB of bf16) overlaps well.
        sm_margin: multiprocessors left to NCCL while a collective overlaps compute (default 0: none): cuBLAS sizes
            the GEMMs for ``SMs - sm_margin`` from the first bucket sent under the backward until the reductions
            are joined (:func:`cukernels.blas.set_sm_count_target`), and the update runs on that fraction of a wave.
        overlap_gather: defer the shadows' all-gathers to the next forward (module docstring). Needs parameters
            given as autograd Tensors (others are gathered in the step) and every shadow read through
            ``amp.lowp_weight``, as the ``nn`` layers do; call :meth:`wait_gathers` before reading shadows any
            other way (the checkpoint and gather methods do).
        sparse_rows: None (default) or the most rows of a sparse table one rank touches in a step: across ranks the
            rows are then exchanged and updated lazily (module docstring); needs :meth:`attach_sparse` for each.
        fp8_shadows: let the FP8 linear layers ask for their weights as E4M3 copies written by the update itself
            (:meth:`fp8_shadow`, ``ck.Fp8Shadow``; a world of one). Those weights get no bf16 shadow: under
            ``autocast(ck.float8)`` nothing casts them any more (4 bytes an element a step: ~1 ms at LLaMA-1B).

    Example::

        >>> opt = ck.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
        ...                      no_decay=lambda n, a: a.ndim < 2, sparse={"tok_emb.weight"})
        >>> opt.attach_sparse(model.tok_emb.weight)   # the embedding backward lists the rows it touches
        >>> loss.backward(); norm, scale = opt.clip_grad_norm(1.0); opt.step(grad_scale=scale); opt.zero_grad()
        >>> # on N GPUs: dist.init_process_group(); AdamW(..., group=dist.get_group(), wire_dtype=ck.bfloat16,
        >>> #            bucket_elems=2**25); opt.attach_grad_hooks()
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, group=None,
                 shadow_dtype=B.bfloat16, no_decay=None, sparse=None, grad_dtype=np.float32, gather_fp32=None,
                 wire_dtype=None, average=True, bucket_elems=None, sm_margin=0, overlap_gather=False,
                 sparse_rows=None, fp8_shadows=False):
        lr, beta1, beta2, eps, weight_decay = check_hyperparameters(lr, betas, eps, weight_decay)
        if shadow_dtype is not None:
            B.check_dtype_arg("shadow_dtype", shadow_dtype, (B.bfloat16,))
        self.grad_dtype = _check_float_dtype("grad_dtype", grad_dtype)
        wire = _check_float_dtype("wire_dtype", wire_dtype, allow_none=True)
        self.wire_dtype = self.grad_dtype if wire is None else wire
        self.sparse_rows = None if sparse_rows is None else B.check_int("sparse_rows", sparse_rows, min=1)
        self.average = B.check_bool("average", average)
        if bucket_elems is not None:
            bucket_elems = B.check_int("bucket_elems", bucket_elems, min=1)
        self.betas = (float(beta1), float(beta2))
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.shadow_dtype = None if shadow_dtype is None else B.bfloat16
        self.bucket_elems = bucket_elems
        self.sm_margin = B.check_int("sm_margin", sm_margin, min=0)
        self.overlap_gather = B.check_bool("overlap_gather", overlap_gather)
        if self.overlap_gather and shadow_dtype is None:
            raise ValueError("overlap_gather: defers the all-gather of the bf16 shadows; with shadow_dtype=None there "
                             "are none (pass overlap_gather=False)")
        self._sm_prev = None  # the cuBLAS SM target to restore while a margin is in force
        self.fp8_shadows = B.check_bool("fp8_shadows", fp8_shadows)
        self._fp8 = {}  # tuple of slot names -> (group, range index): the packs fp8_shadow has made

        entries = self._normalise(params)
        if not entries:
            raise ValueError("params: got an empty parameter list")
        xp = B.array_module(**{f"params[{name!r}]": a for name, _, a in entries})
        self.xp = xp
        if group is None:
            group = SingleGroup(xp)
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"group: expected a cukernels.distributed ProcessGroup; got {type(group).__name__}")
        if group.xp is not xp:
            raise TypeError(f"group: a {group.backend!r} group takes {group.xp.__name__} arrays; the parameters are "
                            f"{xp.__name__} arrays")
        self.group = group
        self.rank, self.world_size = group.rank, group.world_size
        if self.fp8_shadows and self.world_size > 1:
            raise ValueError("fp8_shadows: the FP8 copies are written by the update of whole weights, on one rank; "
                             f"with {self.world_size} ranks each updates a piece (pass fp8_shadows=False: the FP8 "
                             "layers then cast the gathered bf16 shadows)")
        N = self.world_size
        if N > 1 and self.grad_dtype == B.bfloat16 and self.wire_dtype != B.bfloat16:
            raise ValueError("grad_dtype: bf16 gradient buffers go on the wire as they are; pass "
                             "wire_dtype=ck.bfloat16 with grad_dtype=ck.bfloat16")
        is_nd, is_sparse = _matcher(no_decay, "no_decay"), _matcher(sparse, "sparse")
        is_full = (lambda name, a: True) if gather_fp32 is None else _matcher(gather_fp32, "gather_fp32")

        keyed = {}  # (weight decay, gathers fp32) -> [(order, name, obj, array)], in the order given
        tables = []  # sparse tables updated by rows: a group each
        self._sparse_names = set()
        for order, (name, obj, a) in enumerate(entries):
            B.check_dtype(f"params[{name!r}]", a, (np.float32,))
            wd = 0.0 if is_nd(name, a) else self.weight_decay
            if is_sparse(name, a):
                if a.ndim != 2:
                    raise ValueError(f"params[{name!r}]: sparse parameters must be 2-D (V, D); got shape "
                                     f"{tuple(a.shape)}")
                self._sparse_names.add(name)
                if N == 1 or self.sparse_rows is not None:
                    tables.append(((order, name, obj, a), wd))
                    continue
            keyed.setdefault((wd, N == 1 or bool(is_full(name, a))), []).append((order, name, obj, a))
        self._by_name, self._by_id = {}, {}
        # One launch per distinct weight decay in a world of one (one in all when weight_decay == 0), then the tables.
        self._groups = [self._build(keyed[k], *k) for k in sorted(keyed, key=lambda k: (-k[0], not k[1]))]
        self._groups += [self._build([item], wd, True, sparse=True) for item, wd in tables]
        self._by_name = {name: self._by_name[name] for name, _, _ in entries}  # the order given

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
        # This optimizer's device error word: the update kernels OR a bit into it (and write nothing) when the lr,
        # step or grad_scale they read from device memory is invalid (a NaN clip scale after a NaN loss, say: on
        # every rank alike, the norm is all-reduced). Read at the next synchronising call (check_errors,
        # step_count, get_lr, state_dict): no sync is added to the step itself, so a captured step stays capturable.
        self._err = None if xp is np else xp.zeros((), dtype=np.int32)
        # The sparse exchange's error word: a pack that overflowed sparse_rows (check_errors raises).
        self._xerr = xp.zeros((), dtype=np.int32) if N > 1 else None
        self._hooks = []
        self._sync_grads = True
        self._comm = None  # side stream (CuPy, world > 1)
        self._events = []
        self._deferred = []  # (group, bucket) whose shadow all-gather waits for the next forward (overlap_gather)
        self._gather_events = {}  # (group, bucket) -> event after its deferred all-gather, until waited for
        self._new_step()

    # ------------------------------------------------------------------------------------------ layout
    @staticmethod
    def _normalise(params):
        out, seen = [], set()
        for i, p in enumerate(params):
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                name, obj, a = p[0], None, p[1]
            elif hasattr(p, "data"):
                name, obj, a = getattr(p, "name", None) or f"param{i}", p, p.data
            else:
                raise TypeError(f"params[{i}]: expected a (name, array) pair or an object with .data; got "
                                f"{type(p).__name__}")
            if B._kind(a) is None:
                raise TypeError(f"params[{name!r}]: expected a numpy.ndarray or cupy.ndarray; got {type(a).__name__}")
            if name in seen:
                raise ValueError(f"params: the name {name!r} appears twice; parameter names must be unique")
            seen.add(name)
            out.append((name, obj, a))
        return out

    def _build(self, items, wd, full, sparse=False):
        xp, N = self.xp, self.world_size
        g = _Group(wd, full, sparse)
        # (a sparse group's layout only says which rank writes which slice into a checkpoint; buckets exist to
        # overlap the reduction with the backward: a world of one has one per group)
        g.layout = L = shard_layout([a.size for _, _, _, a in items], N,
                                    bucket_elems=None if sparse or N == 1 else self.bucket_elems)
        g.P = xp.zeros((L.total,), dtype=np.float32)
        for (_, _, _, a), off in zip(items, L.offsets):
            g.P[off:off + a.size] = a.reshape(-1)
        g.G = xp.zeros((L.total,), dtype=np.float32 if sparse else self.grad_dtype)
        g.S = g.P.astype(B.bfloat16) if self.shadow_dtype is not None else None
        n_state = L.total if sparse else L.shard_size
        g.M = xp.zeros((n_state,), dtype=np.float32)
        g.V = xp.zeros((n_state,), dtype=np.float32)
        if sparse:
            pass  # rows exchanged through the SparseRowGrad packs (attach_sparse), no reduce-scatter
        elif N == 1:  # a world of one: the gradient is the reduced gradient, nothing goes on a wire
            g.GS = g.G
        elif self.grad_dtype == B.bfloat16:  # the backward's bf16 gradient is the wire buffer: no W, no cast
            g.GS = xp.zeros((L.shard_size,), dtype=B.bfloat16)
        elif self.wire_dtype == B.bfloat16:
            g.W = xp.zeros((L.total,), dtype=B.bfloat16)
            g.GS = xp.zeros((L.shard_size,), dtype=B.bfloat16)
        else:
            g.GS = xp.zeros((L.shard_size,), dtype=np.float32)
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
                    s.grad[...] = old_grad  # keep a gradient that was already accumulated
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
            if s is None:  # a view handed out by param()/grad()
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

    # ------------------------------------------------------------------------------------------ access
    def named_parameters(self):
        """``[(name, param view)]`` in the order given."""
        return [(n, s.data) for n, s in self._by_name.items()]

    def param(self, p):
        """The parameter's array (a view into the flat buffer). ``p``: name, object or view."""
        return self._slot(p).data

    def grad(self, p):
        """The parameter's gradient view (backward accumulates into it in place)."""
        return self._slot(p).grad

    def shadow(self, p):
        """The parameter's bf16 shadow (a view), rewritten by every ``step()``; for autocast."""
        s = self._slot(p)
        if s.shadow is None:
            if any(s.name in key for key in self._fp8):
                raise ValueError(f"shadow: {s.name} has an FP8 shadow instead (fp8_shadow); its bf16 copy is no "
                                 "longer written")
            raise ValueError("shadow: this optimizer was built with shadow_dtype=None")
        return s.shadow

    def fp8_shadow(self, params):
        """``(q, q^T, scale_inv)``: the E4M3 copy of these 2-D parameters joined by rows (a q / k / v pack: one
        matrix, one scale), written by every ``step()`` in the update's own pass (``ck.Fp8Shadow``: the scale
        from the amax after the previous update; ``q^T`` for the input-gradient GEMM), or None where it cannot
        be kept: ``fp8_shadows=False``, several ranks, a graph being captured (the first call allocates: make it
        eagerly), or parameters that are not float32 2-D matrices of one width back to back in one dense group
        with sizes multiples of 16. From the first call on, their bf16 shadows are no longer written
        (:meth:`shadow` raises; ``amp.lowp_weight`` then returns None and a bf16 use casts the fp32 master)."""
        if not self.fp8_shadows or self.world_size > 1:
            return None
        try:
            slots = [self._slot(p) for p in params]
        except (KeyError, ValueError, TypeError):
            return None
        key = tuple(s.name for s in slots)
        hit = self._fp8.get(key)
        if hit is not None:
            g, off = hit
            k = g.F8.offsets.index(off)
            return g.F8.q[k], g.F8.qt[k], g.F8.scale_inv[k]
        g = slots[0].group
        if g.sparse or any(s.group is not g for s in slots) or any(s.name in k for k in self._fp8 for s in slots):
            return None
        if any(len(s.shape) != 2 or s.shape[1] != slots[0].shape[1] for s in slots):
            return None
        offs = [g.layout.offsets[s.index] for s in slots]
        if any(offs[i] + slots[i].data.size != offs[i + 1] for i in range(len(slots) - 1)):
            return None
        rows, cols = sum(s.shape[0] for s in slots), slots[0].shape[1]
        if offs[0] % 16 or (rows * cols) % 16:
            return None
        if self.xp is not np and self.xp.cuda.get_current_stream().is_capturing():
            return None
        g.F8 = (_A.Fp8Shadow(g.P, [(offs[0], (rows, cols))]) if g.F8 is None
                else g.F8.with_range(offs[0], (rows, cols)))
        self._fp8[key] = (g, offs[0])
        for s in slots:  # the update writes E4M3 here instead of bf16: no stale bf16 copy may be read
            s.shadow = None
            if s.obj is not None and getattr(s.obj, "shadow", None) is not None:
                s.obj.shadow = None
        return self.fp8_shadow(params)

    def _moment(self, p, buf):
        s = self._slot(p)
        g = s.group
        if not (g.sparse or self.world_size == 1):
            raise ValueError(f"{s.name}: its moments are sharded across {self.world_size} ranks (state_dict() holds "
                             f"this rank's slices)")
        off = g.layout.offsets[s.index]
        return getattr(g, buf)[off:off + s.data.size].reshape(s.shape)

    def exp_avg(self, p):
        """The parameter's first moment (a view; where this rank holds it whole: one rank, or a sparse table)."""
        return self._moment(p, "M")

    def exp_avg_sq(self, p):
        return self._moment(p, "V")

    @property
    def flat_grads(self):
        """The gradient buffers, one per launch group (flat for dense groups, (V, D) for sparse ones)."""
        return [g.table(g.G) if g.sparse else g.G for g in self._groups]

    def memory_bytes(self):
        """``{buffer name: bytes on this rank}`` (P, G, S, W, M, V, GS; GS aliasing G counts 0; X: the sparse
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
        """The 0-d float32 device array the update kernels read the lr from."""
        return self._lr

    @property
    def step_array(self):
        """The 0-d int32 device array holding the number of steps taken."""
        return self._step

    def check_errors(self):
        """Raise FloatingPointError if an update since the last check found an invalid device lr, step or
        grad_scale (that update was skipped, on every rank: parameters and moments are unchanged), ValueError if a
        sparse exchange overflowed ``sparse_rows``. A host sync: call it where you read the loss anyway (the
        trainer does, on logging steps)."""
        who = f"rank {self.rank}: " if self.world_size > 1 else ""
        if self._xerr is not None and int(self._xerr):
            self._xerr.fill(0)
            raise ValueError(f"{who}a step touched more rows of a sparse table than sparse_rows={self.sparse_rows} "
                             f"(the rows past it were not exchanged: this step's update is wrong); pass "
                             f"sparse_rows >= the tokens a rank reads per step (batch * seq_len * micro-batches)")
        if self._err is None:
            return
        code = int(self._err)
        if code:
            self._err.fill(0)
            raise FloatingPointError(who + _A.adam_error_message(code) + " (a NaN/inf loss or gradient gives a NaN "
                                     "clip scale; lower the lr, check the data)")

    @property
    def step_count(self):
        """Steps taken (reads the device counter: a host sync; raises if an update was refused)."""
        self.check_errors()
        return int(self._step)

    def get_lr(self):
        """The current lr (reads the device scalar: a host sync; raises if an update was refused)."""
        self.check_errors()
        return float(self._lr)

    def set_lr(self, lr):
        """Write the device lr (asynchronous; outside a captured graph). A schedule overrides it at the next
        step."""
        lr = check_lr(lr)  # (a negative lr was accepted here and refused only by the next step())
        if self.xp is np:
            self._lr[...] = np.float32(lr)
        else:
            self._lr.fill(np.float32(lr))

    def set_schedule(self, schedule):
        """Attach a :class:`WarmupCosine` (or None to detach): each ``step()`` then sets the device lr to
        ``schedule.lr_at(t)`` for its step number t, on the device."""
        if schedule is not None and not isinstance(schedule, WarmupCosine):
            raise TypeError(f"schedule: expected a WarmupCosine or None; got {type(schedule).__name__}")
        self._schedule = schedule

    # ------------------------------------------------------------------------------------------ gradients
    def _sync(self):
        """Put back views the caller's objects lost (rebound .data / .grad), copying their values in first."""
        stale = []  # groups whose FP8 copies must be made again from the new values (once each)
        for s in self._by_id.values():
            obj = s.obj
            d = obj.data
            if d is not s.data:
                B.check_shape(f"{s.name}.data", d, s.shape, " (the parameter's shape)")
                s.data[...] = d
                if s.shadow is not None:
                    s.shadow[...] = s.data.astype(B.bfloat16)
                if s.group.F8 is not None and all(g is not s.group for g in stale):
                    stale.append(s.group)
                obj.data = s.data
            gr = getattr(obj, "grad", None)
            if gr is not s.grad:
                if gr is None:
                    self._zero(s.grad)
                else:
                    B.check_shape(f"{s.name}.grad", gr, s.shape, " (the parameter's shape)")
                    s.grad[...] = gr
                obj.grad = s.grad
        for g in stale:
            g.F8.refresh()

    def _zero(self, a):
        if self.xp is np:
            a.fill(0)
        else:
            B.zero_(a)

    def set_rows(self, p, rows, row_count):
        """Register the device buffers listing the rows of sparse parameter ``p`` that each step touches (a world
        of one; across ranks the rows come from :meth:`attach_sparse`).

        ``rows`` (1-D int32, capacity >= count) and ``row_count`` (0-d int32) are read by the kernels at every
        ``step()`` and ``zero_grad()``: keep filling the same buffers (the embedding backward's outputs) and a
        captured step stays valid. ``set_rows(p, None, None)`` goes back to dense updates.
        """
        s = self._slot(p)
        if self.world_size > 1:
            raise ValueError(f"{s.name}: across ranks AdamW takes the rows from attach_sparse's SparseRowGrad (with "
                             f"sparse_rows= they are exchanged and updated lazily; without, every row is updated)")
        if not s.group.sparse:
            raise ValueError(f"{s.name}: not a sparse parameter (name it in AdamW(..., sparse=...))")
        if rows is not None or row_count is not None:
            B.array_module(param=s.data, rows=rows, row_count=row_count)
            _A._check_rows(rows, row_count)
        self._set_rows(s.group, rows, row_count)

    def _set_rows(self, g, rows, row_count):
        self._norm_ws = None  # grad_norm's partials layout depends on which groups have rows
        g.rows, g.row_count = rows, row_count

    def attach_sparse(self, p):
        """Give sparse parameter ``p`` a ``ck.SparseRowGrad`` over this optimizer's gradient buffer of it
        (``p.sparse_grad``): the embedding backward accumulates the touched rows there and lists them on the
        device, ``step()`` updates only those rows (across ranks with ``sparse_rows=None``: every row, reduced
        densely), and ``zero_grad()`` clears only them (and resets the row list). Only the sparse backward may
        write this gradient (an untied embedding). Returns the SparseRowGrad."""
        s = self._slot(p)
        g = s.group
        if s.name not in self._sparse_names:
            raise ValueError(f"{s.name}: not a 2-D sparse parameter (name it in AdamW(..., sparse=...))")
        if g.sparse and g.sparse_grads:
            raise ValueError(f"{s.name}: attach_sparse was called already")
        self._zero(s.grad)
        sg = SparseRowGrad(s.shape[0], s.shape[1], xp=self.xp, grad=s.grad)
        if g.sparse:
            self._set_rows(g, sg.rows, sg.count)
            if self.world_size > 1:
                xp, cap, D, N = self.xp, self.sparse_rows, s.shape[1], self.world_size
                wire = self.wire_dtype
                g.X = (xp.zeros((cap,), np.int32), xp.zeros((cap, D), wire), xp.zeros((N * cap,), np.int32),
                       xp.zeros((N * cap, D), wire))
        g.sparse_grads.append((s, sg))
        if s.obj is not None:
            s.obj.sparse_grad = sg
        return sg

    def zero_grad(self, lazy=False):
        """Zero every gradient: one memset of each flat gradient buffer; a sparse table with an attached
        ``SparseRowGrad`` gets only its listed rows zeroed and its row list reset (the rest is zero already: only
        the sparse backward writes it), one whose last step was a row update only its listed rows.

        ``lazy=True`` (parameters given as autograd Tensors): dense gradients are not touched, only marked
        ``grad_stale``; the first backward write of the step then overwrites instead of adding (the weight-gradient
        GEMM runs with beta = 0), which saves the zeroing pass and one read of every gradient. A gradient nothing
        wrote is zeroed by :meth:`flush_stale`, which :meth:`grad_norm` and :meth:`step` call (in the reduction)."""
        self._sync()
        for g in self._groups:
            attached = {id(s) for s, _ in g.sparse_grads}
            if g.sparse:  # (an attached SparseRowGrad clears its listed rows below)
                if not g.sparse_grads and g.last_rows and g.rows is not None:
                    _A.zero_rows(g.table(g.G), g.rows, g.row_count)
                elif not g.sparse_grads:
                    self._zero(g.G)
            elif lazy and all(s.obj is not None for s in g.slots):
                # (2 x H200, `python benchmarks/bench_train.py --configs b8t1024 --nproc 2 --timeline DIR`: the sparse
                # embedding shares the 2-D group across ranks, and zeroing that whole group cost a 1.33 ms memset of
                # 5.6 GB a step and turned every weight-gradient GEMM into beta = 1)
                for s in g.slots:
                    if id(s) not in attached:
                        s.obj.grad_stale = True
            else:
                self._zero(g.G)
            for _, sg in g.sparse_grads:
                sg.zero()  # clears the listed rows, empties the list, new generation
            for s in g.slots:
                if s.obj is not None and hasattr(s.obj, "grad_epoch"):
                    s.obj.grad_epoch += 1
        self._new_step()

    def flush_stale(self):
        """Zero the gradients still marked stale by a lazy :meth:`zero_grad` (parameters no backward wrote), so
        every gradient buffer holds this step's gradient. The reduction (:meth:`grad_norm`, :meth:`step`) calls it;
        call it before reading gradients any other way."""
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
        ``.grad`` is final). A world of one checks the parameters and registers nothing (nothing to send). Returns
        the number of hooks."""
        self.detach_grad_hooks()
        for s in self._by_name.values():
            if s.obj is not None and getattr(s.obj, "register_grad_ready_hook", None) is None:
                raise TypeError(f"params[{s.name!r}]: {type(s.obj).__name__} has no register_grad_ready_hook(fn); "
                                f"the autograd needs the gradient-ready hook to overlap the reduction with the "
                                f"backward (without hooks, AdamW reduces everything at step())")
        if self.world_size == 1:
            return 0
        for s in self._by_name.values():
            if s.obj is not None:
                self._hooks.append(s.obj.register_grad_ready_hook(lambda t, s=s: self.grad_ready(s.obj)))
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
            self._comm = self.xp.cuda.Stream(non_blocking=True, priority=settings.zero_side_priority)
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
        if g.sparse:
            return self._exchange(g)
        if b.stop == b.start or self.world_size == 1:
            return
        send = g.G[b.start:b.stop]
        if g.W is not None and settings.zero_cast_on_compute_stream:  # the bf16 wire copy made in line with the backward
            send = _cast(send, B.bfloat16, out=g.W[b.start:b.stop])
        side = self._fork()
        self._margin_on()
        with side if side is not None else contextlib.nullcontext():
            if g.W is not None and not settings.zero_cast_on_compute_stream:
                send = _cast(send, B.bfloat16, out=g.W[b.start:b.stop])
            self.group.reduce_scatter(send, g.GS[b.shard_offset:b.shard_offset + b.piece],
                                      "avg" if self.average else "sum")

    def _exchange(self, g):
        """A sparse table's rows across the ranks, on the side stream: pack this rank's listed rows, all-gather the
        packs, merge them in rank order (every rank then holds the same summed rows, and the union as its list)."""
        if self.world_size == 1:
            return  # the local rows are the rows
        if not g.sparse_grads:
            raise RuntimeError(f"{g.slots[0].name}: sparse_rows= exchanges the rows listed by attach_sparse's "
                               f"SparseRowGrad; call attach_sparse({g.slots[0].name!r}) before the first backward")
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
        reductions (in a world of one: flush the stale gradients). Called by :meth:`grad_norm` and :meth:`step`;
        idempotent within a step."""
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
    def _norm_parts(self):
        """``(arrays, rows)`` this rank sums for the global norm: each dense group's reduced shard; a sparse table
        on one rank on its listed rows (zero elsewhere), across ranks each rank its slice (the table's gradient is
        the same on every rank)."""
        parts, rows = [], []
        for g in self._groups:
            if g.sparse and self.world_size == 1:
                parts.append(g.table(g.G))
                rows.append((g.rows, g.row_count) if g.rows is not None else None)
            else:
                parts.append(g.G[slice(*g.layout.buckets[0].piece_range(self.rank))] if g.sparse else g.GS)
                rows.append(None)
        return parts, (rows if any(r is not None for r in rows) else None)

    def grad_norm(self, prescale=1.0):
        """Global L2 norm of the reduced gradient times ``prescale`` (e.g. ``1 / accumulation steps``), a 0-d fp32
        device array (the same buffer every call: safe inside a captured graph; copy it to keep values across
        steps). Reduces first if needed. One rank: ``ck.global_norm`` over the flat buffers (one partial launch
        each, plus the final reduce). N ranks: per-shard ``ck.global_norm``, squared in fp64, all-reduced,
        square-rooted -- within an ulp or two of the one-rank norm (the per-shard fp32 square roots round once
        more)."""
        pre = B.check_f32("prescale", prescale, min=0, min_open=True)
        self.reduce_gradients()
        parts, rows = self._norm_parts()
        if self._norm_ws is None:  # sized for the registered rows; set_rows drops it
            self._norm_ws = _A.global_norm_workspace(parts, rows)
        xp = self.xp
        local = _A.global_norm(parts, out=self._norm, workspace=self._norm_ws, rows=rows)
        if self.world_size == 1:
            if pre != 1:
                xp.multiply(self._norm, pre, out=self._norm)
            return self._norm
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
        ``grad_scale``: the update then sees the gradient times ``prescale``, clipped. No host sync, no allocation
        after the first call (capturable)."""
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
        """One AdamW step: reduce (if not yet done), advance the device step (and the scheduled lr), one
        ``adam_step`` launch per bucket on this rank's piece (one per group on one rank) and one
        ``adam_step_rows`` per sparse table, then (several ranks) all-gather the updated shadows and the fp32
        parameters of ``gather_fp32`` groups.

        Args:
            grad_scale: optional 0-d float32 device array multiplying every gradient (e.g. from
                :meth:`clip_grad_norm`, or an inverse loss scale).
        """
        self.reduce_gradients()
        _A.tick(self._step, self._lr, increment=1,
                schedule=self._schedule.as_tuple() if self._schedule is not None else None)
        b1, b2 = self.betas
        kw = dict(lr=self._lr, step=self._step, beta1=b1, beta2=b2, eps=self.eps, grad_scale=grad_scale)
        if self._err is not None:
            kw["error"] = self._err
        dense = dict(kw)
        if self._side() is not None:  # the grid leaves room for the all-gathers that run beside the update
            dense["occupancy"] = (max(0.05, 1.0 - self.sm_margin / B.sm_count()) if self.sm_margin
                                  else settings.zero_adam_occupancy)
        r = self.rank
        eager = settings.zero_eager_gathers
        for gi, bi in self._fwd_order if self.overlap_gather else self._order:
            g = self._groups[gi]
            b = g.layout.buckets[bi]
            if g.sparse:  # every rank: the same lazy update of the same rows (across ranks the exchange's union)
                self._step_table(g, kw)
                continue
            if b.piece == 0:
                continue
            lo, hi = b.piece_range(r)
            sh = slice(b.shard_offset, b.shard_offset + b.piece)
            _A.adam_step(g.P[lo:hi], g.GS[sh], g.M[sh], g.V[sh], weight_decay=g.wd,
                         shadow=g.S[lo:hi] if g.S is not None else None, fp8_shadow=g.F8, **dense)
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

    def _step_table(self, g, kw):
        """A sparse table: ``adam_step_rows`` on its listed rows, or (one rank, no rows registered) the dense
        update."""
        t = g.table
        if g.rows is not None:
            _A.adam_step_rows(t(g.P), t(g.G), t(g.M), t(g.V), g.rows, g.row_count, weight_decay=g.wd,
                              shadow=t(g.S), **kw)
        else:
            _A.adam_step(t(g.P), t(g.G), t(g.M), t(g.V), weight_decay=g.wd, shadow=t(g.S), **kw)
        g.last_rows = g.rows is not None

    def _deferrable(self, g, b):
        """Whether bucket b's all-gather may wait for the next forward: overlap_gather, shadows only (no fp32
        gather), every parameter an object that can carry ``shadow_wait``."""
        return (self.overlap_gather and not g.full and not g.sparse and g.S is not None
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
            if g.full or g.sparse or b.piece == 0:
                continue
            lo, hi = b.piece_range(self.rank)
            side = self._fork()
            with side if side is not None else contextlib.nullcontext():
                self.group.all_gather(g.P[lo:hi], g.P[b.start:b.stop])
        self._join()

    def broadcast_params(self, root=0):
        """Give every rank rank ``root``'s parameters (one broadcast of each flat fp32 group, then the shadows
        re-derived): data-parallel replicas start identical even if their initialisations could differ. No-op on
        one rank."""
        if self.world_size == 1:
            return
        self._sync()
        for g in self._groups:
            self.group.broadcast(g.P, root)
        self.refresh_shadows()

    def refresh_shadows(self):
        """Recompute every bf16 shadow and FP8 copy (:meth:`fp8_shadow`) from the fp32 parameters (after writing full
        parameter values on every rank, e.g. loading a checkpoint)."""
        for g in self._groups:
            if g.F8 is not None:
                g.F8.refresh()
        if self.shadow_dtype is None:
            return
        self.wait_gathers()  # (a deferred gather still writing them would land after this)
        for g in self._groups:
            g.S[...] = g.P.astype(B.bfloat16)

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self, copy=True):
        """This rank's part of the state in the one format (:mod:`cukernels.optim.zero`): ``{"kind": "AdamW.shard",
        "rank", "world_size", "step", "lr", "betas", "eps", "weight_decay", "state": {name: {"shape", "start",
        "stop", "param", "exp_avg", "exp_avg_sq"}}}`` -- elements ``[start, stop)`` of each flattened parameter
        (empty where this rank owns none; in the parameter's shape where it owns all: always on one rank).
        ``copy=True``: NumPy copies (a host sync); ``copy=False``: views of the device buffers, for a checkpoint
        writer that streams them one at a time. :func:`cukernels.optim.consolidate_state` joins every rank's."""
        self.check_errors()
        take = ((lambda a: a.copy()) if self.xp is np else (lambda a: a.get())) if copy else (lambda a: a)
        state = {}
        for name, s in self._by_name.items():
            g, L = s.group, s.group.layout
            own = L.owned(s.index, self.rank)
            if own is None:
                lo = hi = 0
                e = {k: take(g.M[0:0]) for k in ("param", "exp_avg", "exp_avg_sq")}
            else:
                lo, hi, so = own
                off = L.offsets[s.index]
                if g.sparse:  # full moments on every rank: each writes its layout slice of them
                    so = off + lo
                shape = s.shape if hi - lo == s.data.size else (hi - lo,)
                e = {"param": take(g.P[off + lo:off + hi].reshape(shape)),
                     "exp_avg": take(g.M[so:so + hi - lo].reshape(shape)),
                     "exp_avg_sq": take(g.V[so:so + hi - lo].reshape(shape))}
            state[name] = dict(shape=list(s.shape), start=lo, stop=hi, **e)
        return make_shard(self.rank, self.world_size, int(self._step), float(self._lr), self.betas, self.eps,
                          self.weight_decay, state)

    state_dict_shard = state_dict  # (the name under ZeroAdamW)

    def load_state_dict(self, state, params=None):
        """Load the optimizer state, keeping this rank's slices.

        Args:
            state: the list of every rank's :meth:`state_dict` from a run on any number of ranks, the one of a
                world of one, or the full format (:func:`cukernels.optim.consolidate_state`'s; ``CompositeAdamW``'s
                and the pre-issue-34 ``AdamW.state_dict()``), matched by parameter name.
            params: optional ``{name: full fp32 array}`` written into the parameters on every rank (shards bring
                their own; ``params=False`` keeps the current values even then). Without it, and with the full
                format, the current parameter values stay (load the model first).
        Shards are read lazily (:class:`~cukernels.optim.zero.ShardedArray`): from memory-mapped checkpoint files
        host memory holds one parameter at a time, and each rank reads only its own slices of the moments.
        Hyperparameters stay those given to the constructor. Everything is checked before anything is written; the
        shadows are then refreshed from the fp32 values.
        """
        state, own_params = full_state(state)
        params = own_params if params is None else params
        if params is False:
            params = None
        step, lr, st = check_state(state, list(self._by_name))

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
            if g.sparse:  # every rank keeps the whole of a sparse table's moments
                own = (0, s.data.size, L.offsets[s.index])
            if own is None:
                continue
            lo, hi, so = own
            for key, buf in (("exp_avg", g.M), ("exp_avg_sq", g.V)):
                src = piece(st[n][key], lo, hi)
                buf[so:so + hi - lo] = self.xp.asarray(src.astype(np.float32, copy=False))
        if self.xp is np:
            self._step[...] = np.int32(step)
        else:
            self._step.fill(np.int32(step))
        self.set_lr(lr)
        self.refresh_shadows()

    def __repr__(self):
        def kind(g):
            if g.sparse:
                return "sparse rows" + (" (replicated, exchanged)" if self.world_size > 1 else "")
            return f"fp32 gathered={g.full}" if self.world_size > 1 else "dense"
        groups = ", ".join(f"({kind(g)}, wd={g.wd}, n={len(g.slots)}, buckets={len(g.layout.buckets)})"
                           for g in self._groups)
        ranks = (f"rank={self.rank}, world_size={self.world_size}, wire={self.wire_dtype}, average={self.average}, "
                 if self.world_size > 1 else "")
        return (f"{type(self).__name__}({ranks}betas={self.betas}, eps={self.eps}, weight_decay={self.weight_decay}, "
                f"shadow={self.shadow_dtype is not None}, groups=[{groups}])")


class ZeroAdamW(AdamW):
    """:class:`AdamW` over the default process group (the one ``cukernels.distributed.init_process_group`` made;
    a world of one when none is), with the float32 wire by default: the ZeRO-1 optimizer under its old name. Every
    argument is AdamW's."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, group=None,
                 wire_dtype=np.float32, **kw):
        if group is None and is_initialized():
            group = get_group()
        super().__init__(params, lr, betas, eps, weight_decay, group=group, wire_dtype=wire_dtype, **kw)
