"""Checkpoint files: one file per checkpoint, written atomically, verified before anything is loaded.

Layout (little-endian):  ``b"CKCKPT01"`` | u64 header length | header JSON | array bytes | SHA-256 of all before.

The header JSON lists every array (dtype, shape, offset, byte count; bfloat16 stored as its raw bits) and
whatever metadata the caller adds (config, step, RNG state, data position). The trailing SHA-256 covers every
byte before it, so one flipped byte anywhere, or a truncated file, is refused.

Writing: to ``<name>.tmp-<pid>`` in the same folder, fsync, ``os.replace`` onto the final name, fsync the
folder. A crash at any point leaves the previous checkpoint intact. Reading: the whole file is hashed and
every array decoded before the caller sees any of it, so a bad file never loads half a model.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from ._backend import bfloat16

MAGIC = b"CKCKPT01"

# Trainer checkpoints (examples/train_llama.py): meta["kind"] is TRAIN_KIND; arrays are the model parameters
# under MODEL_PREFIX + their (Hugging Face) names, the optimizer moments under OPTIM_PREFIX, small training
# state under "train/".
TRAIN_KIND = "cukernels-train"
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, corrupt, truncated, or does not match what it is loaded into."""


def _to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def save(path, arrays: dict, meta: dict | None = None) -> Path:
    """Atomically write ``arrays`` (name -> NumPy or CuPy array) and ``meta`` (JSON-serialisable) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hosts, info, off = [], {}, 0
    for name, a in arrays.items():
        h = np.asarray(_to_host(a), order="C")  # (ascontiguousarray would turn 0-d into 1-d)
        info[name] = dict(dtype="bfloat16" if h.dtype == bfloat16 else h.dtype.str, shape=list(h.shape),
                          offset=off, nbytes=h.nbytes)
        off += h.nbytes
        hosts.append(h)
    header = json.dumps(dict(arrays=info, meta=meta or {})).encode()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            sha = hashlib.sha256()
            for chunk in (MAGIC, struct.pack("<Q", len(header)), header):
                f.write(chunk)
                sha.update(chunk)
            for h in hosts:
                mv = memoryview(h.reshape(-1).view(np.uint8))
                f.write(mv)
                sha.update(mv)
            f.write(sha.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    return path


def fsync_dir(folder) -> None:
    """fsync a folder so a rename into it survives a crash (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def load(path) -> tuple[dict, dict]:
    """Read and verify a checkpoint: ``(arrays as NumPy, meta)``. Raises CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    data = path.read_bytes()
    if len(data) < len(MAGIC) + 8 + 32 or data[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path}: not a cukernels checkpoint (bad magic or too short: truncated?)")
    if hashlib.sha256(memoryview(data)[:-32]).digest() != data[-32:]:
        raise CheckpointError(f"{path}: checksum mismatch: the file is corrupt or truncated")
    try:
        (hlen,) = struct.unpack_from("<Q", data, len(MAGIC))
        base = len(MAGIC) + 8
        doc = json.loads(data[base: base + hlen].decode())
        base += hlen
        out = {}
        for name, inf in doc["arrays"].items():
            dt = bfloat16 if inf["dtype"] == "bfloat16" else np.dtype(inf["dtype"])
            a = np.frombuffer(data, dtype=dt, count=inf["nbytes"] // dt.itemsize, offset=base + inf["offset"])
            out[name] = a.reshape(inf["shape"]).copy()
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise CheckpointError(f"{path}: malformed checkpoint header ({type(e).__name__}: {e})") from None
    return out, doc["meta"]


def check_compatible(path, arrays: dict, expected: dict, what: str = "model"):
    """Raise CheckpointError unless ``arrays`` has exactly the names, shapes and dtypes of ``expected``
    (name -> array-like with .shape/.dtype), naming the file and the first disagreements."""
    problems = []
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing:
        problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for name in sorted(set(arrays) & set(expected)):
        a, e = arrays[name], expected[name]
        if tuple(a.shape) != tuple(e.shape):
            problems.append(f"{name}: shape {tuple(a.shape)} in the file, {tuple(e.shape)} in the {what}")
        elif np.dtype(a.dtype) != np.dtype(e.dtype):
            problems.append(f"{name}: dtype {a.dtype} in the file, {e.dtype} in the {what}")
    if problems:
        raise CheckpointError(f"{path}: does not match the {what}: " + "; ".join(problems[:6]))


def latest(folder) -> Path | None:
    """The newest complete checkpoint ``step_*.ckpt`` in ``folder`` (highest step), or None."""
    folder = Path(folder)
    cands = []
    for p in folder.glob("step_*.ckpt"):
        try:
            cands.append((int(p.stem.split("_", 1)[1]), p))
        except ValueError:
            continue
    return max(cands)[1] if cands else None


def step_path(folder, step) -> Path:
    """``<folder>/step_<step, 8 digits>.ckpt``: the name :func:`latest` and :func:`prune` understand."""
    return Path(folder) / f"step_{int(step):08d}.ckpt"


def prune(folder, keep_last: int):
    """Delete all but the ``keep_last`` newest ``step_*.ckpt`` files of ``folder`` (``keep_last <= 0``: keep
    all). Only complete files carry that name (a write in progress has a ``.tmp-<pid>`` suffix)."""
    if keep_last is None or keep_last <= 0:
        return []
    cands = []
    for p in Path(folder).glob("step_*.ckpt"):
        try:
            cands.append((int(p.stem.split("_", 1)[1]), p))
        except ValueError:
            continue
    gone = [p for _, p in sorted(cands)[:-keep_last]]
    for p in gone:
        p.unlink()
    return gone
