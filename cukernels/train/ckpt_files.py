"""The trainer's checkpoint files on disk: one file per checkpoint on one process, one file plus one optimizer
shard per rank under ZeRO, and which checkpoints are complete.

One process (``ck.optim.AdamW``): ``step_<N>.ckpt`` in ``cukernels.io.checkpoint``'s training schema (model,
moments, loader state, log, config), as before.

ZeRO (``distributed``): every rank writes its optimizer shard ``step_<N>.rank<r>-of-<W>.zero`` (the container
format of ``cukernels.io.checkpoint``: atomic, whole-file SHA-256) holding its slices of every parameter's fp32
value and Adam moments (``optim/<name>/param``, ``/exp_avg``, ``/exp_avg_sq``; meta: kind ``ZeroAdamW.shard``,
rank, world size, step, lr, hyperparameters, and each parameter's shape and element range) and its own running
loss (``train/loss_acc``); then, after a barrier, rank 0 writes ``step_<N>.ckpt`` in the training schema with the
gathered fp32 model, no ``optim/`` arrays, and ``meta["zero"] = {"world_size": W, "shards": [file names]}``. The
main file is written last, so it exists only once every shard does; :func:`is_complete` also checks the shards
named in it (a checkpoint whose shard was deleted or never reached a shared folder is not complete), and
:func:`latest` / :func:`prune` consider complete checkpoints only. The folder must be shared by every rank.

Nothing is gathered on one host to save: rank 0 holds the model (as every rank does in data parallelism) and each
rank streams its own shard, one array at a time. Loading on any number of ranks reads the shards lazily
(``ZeroAdamW.load_state_dict`` / ``consolidate_state(lazy=True)``): each rank copies only its own slices of the
moments, one parameter at a time.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from ..io import checkpoint as C
from ..optim.zero import SHARD_KIND

SHARD_RE = re.compile(r"^step_(\d+)\.rank(\d+)-of-(\d+)\.zero$")
MAIN_RE = re.compile(r"^step_(\d+)\.ckpt$")
ZERO_META = "zero"


def shard_path(folder, step, rank, world_size) -> Path:
    """``<folder>/step_<step, 8 digits>.rank<rank>-of-<world_size>.zero``."""
    return Path(folder) / f"step_{int(step):08d}.rank{int(rank)}-of-{int(world_size)}.zero"


def shard_names(step, world_size):
    return [shard_path(".", step, r, world_size).name for r in range(world_size)]


# ------------------------------------------------------------------------------------------------ shards
def save_shard(path, shard: dict, extra_arrays=None) -> Path:
    """Write one rank's ``ZeroAdamW.state_dict_shard()`` (arrays on either module; copied to the host one at a
    time) and its ``extra_arrays`` (under ``train/``)."""
    arrays, params = {}, {}
    for name, e in shard["state"].items():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            arrays[f"{C.OPTIM_PREFIX}{name}/{key}"] = e[key]
        params[name] = {"shape": [int(x) for x in e["shape"]], "start": int(e["start"]), "stop": int(e["stop"])}
    for k, a in (extra_arrays or {}).items():
        arrays[C.TRAIN_PREFIX + k] = a
    meta = {"kind": SHARD_KIND, "rank": int(shard["rank"]), "world_size": int(shard["world_size"]),
            "step": int(shard["step"]), "lr": float(shard["lr"]), "betas": [float(b) for b in shard["betas"]],
            "eps": float(shard["eps"]), "weight_decay": float(shard["weight_decay"]), "params": params}
    return C.save(path, arrays, meta)


def read_shard(path):
    """``(shard, train arrays)``: the ``state_dict_shard`` format with read-only memory-mapped arrays (the file's
    checksum verified first), and the rank's ``train/`` arrays. CheckpointError names the file."""
    arrays, meta = C.load(path)
    if meta.get("kind") != SHARD_KIND:
        raise C.CheckpointError(f"{path}: not a ZeroAdamW shard (kind {meta.get('kind')!r})")
    try:
        state = {}
        for name, p in meta["params"].items():
            state[name] = dict(shape=list(p["shape"]), start=int(p["start"]), stop=int(p["stop"]),
                               **{key: arrays[f"{C.OPTIM_PREFIX}{name}/{key}"]
                                  for key in ("param", "exp_avg", "exp_avg_sq")})
        shard = {"kind": SHARD_KIND, "rank": int(meta["rank"]), "world_size": int(meta["world_size"]),
                 "step": int(meta["step"]), "lr": float(meta["lr"]), "betas": tuple(meta["betas"]),
                 "eps": float(meta["eps"]), "weight_decay": float(meta["weight_decay"]), "state": state}
    except (KeyError, TypeError, ValueError) as e:
        raise C.CheckpointError(f"{path}: malformed ZeroAdamW shard ({type(e).__name__}: {e})") from None
    return shard, C.train_arrays(arrays)


def read_shards(main_path, meta):
    """Every shard a ZeRO checkpoint names: ``[(shard, train arrays)]`` in rank order; CheckpointError naming the
    missing or disagreeing file."""
    z = meta[ZERO_META]
    folder = Path(main_path).parent
    out = []
    for r, name in enumerate(z["shards"]):
        p = folder / name
        if not p.is_file():
            raise C.CheckpointError(f"{main_path}: its optimizer shard {p} is missing (every rank's shard is needed; "
                                    f"the checkpoint folder must be shared by all ranks)")
        shard, extra = read_shard(p)
        if shard["rank"] != r or shard["world_size"] != z["world_size"] or shard["step"] != meta["step"]:
            raise C.CheckpointError(f"{p}: shard of rank {shard['rank']} of {shard['world_size']} at step "
                                    f"{shard['step']}; {main_path} expects rank {r} of {z['world_size']} at step "
                                    f"{meta['step']}")
        out.append((shard, extra))
    return out


# ------------------------------------------------------------------------------------------------ completeness
def header_meta(path):
    """The meta dict of a checkpoint file from its header alone (no checksum pass), or None if unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(C.MAGIC) + 8)
            if len(head) < len(C.MAGIC) + 8 or head[:len(C.MAGIC)] != C.MAGIC:
                return None
            (n,) = struct.unpack_from("<Q", head, len(C.MAGIC))
            if n > 1 << 30:
                return None
            return json.loads(f.read(n).decode()).get("meta")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return None


def is_complete(path) -> bool:
    """A checkpoint whose every file exists: the main file, and under ZeRO each shard it names. A main file whose
    header cannot be read counts as complete (loading it then says what is wrong with it)."""
    path = Path(path)
    if not path.is_file():
        return False
    meta = header_meta(path)
    if not isinstance(meta, dict) or not isinstance(meta.get(ZERO_META), dict):
        return True
    return all((path.parent / n).is_file() for n in meta[ZERO_META].get("shards", []))


def _mains(folder):
    out = []
    for p in Path(folder).glob("step_*.ckpt"):
        m = MAIN_RE.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def _shards(folder):
    out = []
    for p in Path(folder).glob("step_*.zero"):
        m = SHARD_RE.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest(folder) -> Path | None:
    """The newest complete checkpoint (highest step) in ``folder``, or None."""
    for _, p in reversed(_mains(folder)):
        if is_complete(p):
            return p
    return None


def prune(folder, keep_last: int):
    """Keep the ``keep_last`` newest complete checkpoints of ``folder`` (``<= 0``: keep all); delete every older
    checkpoint file -- main files first (a checkpoint stops being complete before its shards go), then shards,
    including shards whose main file was never written. Files of steps newer than the oldest kept checkpoint are
    left alone (a checkpoint being written). Returns the deleted paths."""
    if keep_last is None or keep_last <= 0:
        return []
    complete = [(s, p) for s, p in _mains(folder) if is_complete(p)]
    if not complete:
        return []
    oldest_kept = complete[-min(keep_last, len(complete))][0]
    gone = []
    for s, p in _mains(folder):
        if s < oldest_kept:
            p.unlink()
            gone.append(p)
    for s, p in _shards(folder):
        if s < oldest_kept:
            p.unlink()
            gone.append(p)
    return gone
