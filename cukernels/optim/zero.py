"""ZeRO-1's part of ``ck.optim.AdamW``: the shard layout, the one optimizer state format, and the switches of the
collectives.

Layout (:func:`shard_layout`). A flat group of parameters (one per weight decay, every parameter starting on a
64-element = 256-byte boundary) is cut into **buckets** of whole parameters (one bucket per group unless
``bucket_elems`` is given), each bucket padded to a multiple of ``world_size * 64`` elements and cut into
``world_size`` equal **pieces**: rank r owns piece r of every bucket, so 1/N of every group, every piece 64-element
(256-byte) aligned. ``ShardLayout.owners(i)`` says which rank owns which slice of parameter i. A world of one owns
everything: its one piece is the flat buffer.

State. Every optimizer of ``cukernels.optim`` writes one format, the state of a rank (:func:`make_shard`):
``{"kind": "AdamW.shard", "rank", "world_size", "step", "lr", "betas", "eps", "weight_decay", "state": {name:
{"shape", "start", "stop", "param", "exp_avg", "exp_avg_sq"}}}`` -- elements ``[start, stop)`` of each flattened
parameter's fp32 value and moments (a slice covering the whole parameter keeps the parameter's shape, so a world
of one's state holds the parameters' own shapes). :func:`consolidate_state` joins the shards of every rank into the
full format ``{"kind": "AdamW", "step", "lr", ..., "state": {name: {"exp_avg", "exp_avg_sq"}}}`` (full shapes;
what ``state_dict()`` returned before issue 34) plus the parameters; every ``load_state_dict`` takes a list of
shards of any world size, a world of one's shard, or the full format (:func:`full_state`). So 2 -> 1, 1 -> 2 and
2 -> 3 resume with the same parameters and moments.

Its A/B switches are ``ck.settings.zero_*`` (``benchmarks/ab.py``: ``--ab zero_eager_gathers=0``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _backend as B

ALIGN = 64  # elements: every parameter view starts on a 256-byte boundary of its fp32 buffer
SHARD_KIND = "AdamW.shard"
SHARD_KINDS = (SHARD_KIND, "ZeroAdamW.shard")  # (the second: the shards written before issue 34)
FULL_KIND = "AdamW"

# The ZeRO A/B switches are ck.settings' zero_* fields (zero_adam_occupancy, zero_eager_gathers,
# zero_cast_on_compute_stream, zero_side_priority), read at each use.


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
        raise ValueError("shards: expected the state_dict() of every rank; got none")
    for i, s in enumerate(shards):
        if not isinstance(s, dict) or s.get("kind") not in SHARD_KINDS:
            kind = s.get("kind") if isinstance(s, dict) else type(s).__name__
            raise ValueError(f"shards[{i}]: not an optimizer shard (kind {kind!r}; expected {SHARD_KIND!r})")
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


def host(a):
    """A NumPy view or copy of an array of either module (or of a :class:`ShardedArray`, assembled)."""
    return np.asarray(a.get() if hasattr(a, "get") else a)


def _assemble(parts, key, lo, hi):
    """Elements ``[lo, hi)`` of one flattened parameter's ``key`` from the shards' slices (fp32 NumPy)."""
    out = np.empty((hi - lo,), dtype=np.float32)
    for plo, phi, _, e in parts:
        a, b = max(lo, plo), min(hi, phi)
        if a < b:
            out[a - lo:b - lo] = host(e[key]).reshape(-1)[a - plo:b - plo]
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
    """The full optimizer state from the ``state_dict()`` of every rank of one run (the shards).

    Returns ``(state, params)``: ``state`` in the full format (``kind "AdamW"``, step, lr,
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
    hyper = {k: s0.get(k) for k in ("betas", "eps", "weight_decay")}  # (None where a shard left them out)
    return dict(hyper, kind=FULL_KIND, step=int(s0["step"]), lr=float(s0["lr"]), state=state), params


def make_shard(rank, world_size, step, lr, betas, eps, weight_decay, state):
    """The one state format (module docstring): ``state`` is ``{name: {"shape", "start", "stop", "param",
    "exp_avg", "exp_avg_sq"}}``."""
    return {"kind": SHARD_KIND, "rank": int(rank), "world_size": int(world_size), "step": int(step),
            "lr": float(lr), "betas": tuple(betas), "eps": float(eps), "weight_decay": float(weight_decay),
            "state": state}


def full_state(state):
    """``(full-format state, {name: fp32 parameter} or None)`` from any state this package writes: the list of
    every rank's shard (read lazily: :class:`ShardedArray`), the one shard of a world of one, or the full format
    (returned as it is, no parameters)."""
    if isinstance(state, (list, tuple)):
        return consolidate_state(state, lazy=True)
    if isinstance(state, dict) and state.get("kind") in SHARD_KINDS:
        if state.get("world_size") != 1:
            raise ValueError(f"state: one shard of a world of {state.get('world_size')}; pass the list of every "
                             f"rank's shard")
        return consolidate_state([state], lazy=True)
    return state, None


def check_state(state, names, what="state_dict"):
    """A full-format optimizer state to load: a dict with ``step`` (an integer >= 0), ``lr`` (a number >= 0) and
    ``state`` ({name: {"exp_avg", "exp_avg_sq"}} covering exactly ``names``, arrays): every problem a TypeError /
    ValueError naming the key (a missing "state" was a bare KeyError). Returns ``(step, lr, state["state"])``."""
    if not isinstance(state, dict):
        raise TypeError(f"{what}: expected a dict (an optimizer's state_dict()); got {B._got(state)}")
    for k in ("state", "step", "lr"):
        if k not in state:
            raise ValueError(f"{what}: missing the key {k!r} (the keys of an optimizer's state_dict(): kind, step, "
                             f"lr, betas, eps, weight_decay, state); got keys {sorted(map(str, state))}")
    st = state["state"]
    if not isinstance(st, dict):
        raise TypeError(f"{what}['state']: expected a dict {{parameter name: moments}}; got {B._got(st)}")
    missing, unexpected = set(names) - set(st), set(st) - set(names)
    if missing or unexpected:
        raise KeyError(f"state_dict: missing parameters {sorted(missing)}, unexpected {sorted(unexpected)}")
    for n in names:
        e = st[n]
        if not isinstance(e, dict) or not {"exp_avg", "exp_avg_sq"} <= set(e):
            raise ValueError(f"{what}['state'][{n!r}]: expected a dict with 'exp_avg' and 'exp_avg_sq'; got "
                             f"{B._short(e)}")
        for key in ("exp_avg", "exp_avg_sq"):
            if not hasattr(e[key], "shape"):
                raise TypeError(f"{what}['state'][{n!r}][{key!r}]: expected an array; got {B._got(e[key])}")
    step = B.check_int(f"{what}['step']", state["step"], min=0, max=2**31 - 1)  # (the device step is int32)
    lr = B.check_f32(f"{what}['lr']", state["lr"], min=0)
    return step, float(lr), st
