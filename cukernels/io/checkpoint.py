"""Checkpoint files: one file per checkpoint, written atomically and streamed, verified before anything loads.

Layout (little-endian):  ``b"CKCKPT01"`` | u64 header length | header JSON | array bytes | SHA-256 of all before.

The header JSON lists every array (dtype, shape, offset, byte count; bfloat16 stored as its raw bits) and
whatever metadata the caller adds. The trailing SHA-256 covers every byte before it, so one flipped byte
anywhere, or a truncated file, is refused.

Streaming: the header needs only shapes and dtypes, so :func:`save` copies one array at a time to the host
(from the GPU) and writes it; :func:`load` hashes the file in 4 MiB chunks, then hands back memory-mapped views.
Peak host memory is about one tensor either way (the whole-model copy of the earlier code took ~18 GB at 1B).

Writing goes to ``<name>.tmp-<pid>`` in the same folder, fsync, ``os.replace``, fsync of the folder: a crash at
any point leaves the previous checkpoint intact.

The training checkpoint schema (one place, read by ``cukernels.train`` and ``cukernels.generation``): arrays
``model/<parameter name>``, ``optim/<parameter name>/exp_avg`` and ``/exp_avg_sq``, ``train/<name>``; meta
``kind`` = :data:`TRAIN_KIND`, ``version``, ``step``, ``model_type``, ``model_config``, ``optimizer``
(``{"kind", "step", "lr"}`` and what the trainer adds: the ranges of a shard's slices) and whatever else the
trainer adds (loader state, log, config; ``cukernels.train.checkpoint`` describes its files).
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .._backend import bfloat16
from .atomic import atomic_open, check_target, fsync_dir  # noqa: F401  (fsync_dir re-exported for callers of the old module)

MAGIC = b"CKCKPT01"
CHUNK = 4 << 20

TRAIN_KIND = "cukernels-train"
VERSION = 2  # 1: no model_type (LLaMA only); 2: model_type in the meta
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
TRAIN_PREFIX = "train/"


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, corrupt, truncated, or does not match what it is loaded into."""


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _dtype_name(dt):
    dt = np.dtype(dt)
    return "bfloat16" if dt == bfloat16 else dt.str


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check_header(doc, data_len):
    """The whole parsed header of a checkpoint, validated before any array is read: ``(entries, meta)`` with
    entries ``{name: (offset from the data start, nbytes, dtype, shape)}``; ValueError saying what is wrong.

    The trailing SHA-256 proves the file is intact, not that its header tells the truth (a rewritten header with a
    recomputed checksum passes it), so every entry is checked: a dict with dtype (one of the numeric dtypes a
    checkpoint holds), shape (a list of non-negative integers), offset and nbytes (non-negative integers, nbytes =
    the shape's size x the dtype's); in the order listed the arrays lie one after another without overlapping
    (each offset >= the previous end) and end inside the data; ``meta`` is a dict."""
    if not isinstance(doc, dict) or not isinstance(doc.get("arrays"), dict):
        raise ValueError("the header is not an object with an 'arrays' object")
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError(f"meta: expected an object; got {type(meta).__name__}")
    entries, end = {}, 0
    for name, inf in doc["arrays"].items():
        if not isinstance(inf, dict) or not {"dtype", "shape", "offset", "nbytes"} <= set(inf):
            raise ValueError(f"array {name!r}: expected an entry with dtype, shape, offset, nbytes; got "
                             f"{str(inf)[:100]}")
        dt = _DTYPES.get(inf["dtype"]) if isinstance(inf["dtype"], str) else None
        if dt is None:
            raise ValueError(f"array {name!r}: unknown dtype {inf['dtype']!r}")
        shape, off, nb = inf["shape"], inf["offset"], inf["nbytes"]
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise ValueError(f"array {name!r}: shape {shape!r}: expected a list of non-negative integers")
        if not (_is_int(off) and _is_int(nb)) or off < 0 or nb != math.prod(shape) * dt.itemsize:
            raise ValueError(f"array {name!r}: {nb!r} bytes at offset {off!r} do not hold {tuple(shape)} {dt}")
        if off < end:
            raise ValueError(f"array {name!r}: offset {off} overlaps the array before it (which ends at {end})")
        if off + nb > data_len:
            raise ValueError(f"array {name!r}: {nb} bytes at offset {off} end past the {data_len} data bytes")
        end = off + nb
        entries[name] = (off, nb, dt, tuple(shape))
    return entries, meta


# The dtypes a checkpoint holds (and a header may name): numeric, fixed-size. An object or string dtype read from a
# forged header would reinterpret raw bytes as pointers.
_DTYPES = {_dtype_name(d): np.dtype(d) for d in (np.float64, np.float32, np.float16, bfloat16, np.int64, np.int32,
                                                  np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8,
                                                  np.bool_)}


def _check_arrays(arrays):
    if not isinstance(arrays, Mapping):
        raise TypeError(f"arrays: expected a mapping {{name: array}}; got {type(arrays).__name__}")
    for name, a in arrays.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"arrays: names must be non-empty strings; got {name!r}")
        if not (hasattr(a, "shape") and hasattr(a, "dtype")) or isinstance(a, (str, bytes)):
            raise TypeError(f"arrays[{name!r}]: expected a NumPy or CuPy array; got {type(a).__name__}")
        if _dtype_name(a.dtype) not in _DTYPES:
            raise TypeError(f"arrays[{name!r}]: dtype {a.dtype} cannot be stored (numeric dtypes only: "
                            f"{', '.join(_DTYPES)})")


def save(path, arrays: Mapping, meta: dict | None = None) -> Path:
    """Atomically write ``arrays`` (name -> NumPy or CuPy array) and ``meta`` (JSON-serialisable) to ``path``,
    one array in host memory at a time. Non-arrays, dtypes a checkpoint cannot hold and metadata JSON cannot
    encode are TypeErrors naming them, raised before anything is written."""
    path = check_target(path)
    _check_arrays(arrays)
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f"meta: expected a dict (JSON-serialisable) or None; got {type(meta).__name__}")
    info, off = {}, 0
    for name, a in arrays.items():
        nb = math.prod(a.shape) * np.dtype(a.dtype).itemsize
        info[name] = dict(dtype=_dtype_name(a.dtype), shape=[int(s) for s in a.shape], offset=off, nbytes=nb)
        off += nb
    try:
        header = json.dumps(dict(arrays=info, meta=meta or {})).encode()
    except (TypeError, ValueError) as e:  # (a set, an array, a custom object in meta)
        raise TypeError(f"meta: not JSON-serialisable ({e}); store arrays in arrays=, plain values in meta") from None
    with atomic_open(path, "wb") as f:
        sha = hashlib.sha256()
        for chunk in (MAGIC, struct.pack("<Q", len(header)), header):
            f.write(chunk)
            sha.update(chunk)
        for name, a in arrays.items():
            h = np.asarray(_host(a), order="C")  # (ascontiguousarray would turn 0-d into 1-d)
            if h.nbytes != info[name]["nbytes"]:
                raise ValueError(f"{name}: changed size while being saved")
            mv = memoryview(h.reshape(-1).view(np.uint8))
            f.write(mv)
            sha.update(mv)
        f.write(sha.digest())
    return path


class Arrays(Mapping):
    """``{name: read-only NumPy view}`` memory-mapped from a verified checkpoint file."""

    def __init__(self, path, entries, mm):
        self.path, self._entries, self._mm = path, entries, mm

    def __getitem__(self, name):
        off, nb, dt, shape = self._entries[name]
        return self._mm[off:off + nb].view(dt).reshape(shape)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self):
        return len(self._entries)


def _verify(path: Path, size: int):
    tail = size - 32
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        left = tail
        while left:
            b = f.read(min(CHUNK, left))
            if not b:
                break
            sha.update(b)
            left -= len(b)
        digest = f.read(32)
    if sha.digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch: the file is corrupt or truncated")


def load(path) -> tuple[Arrays, dict]:
    """Read and verify a checkpoint: ``(arrays, meta)``; arrays are read-only NumPy views memory-mapped from the
    file (the whole file is hashed first, so nothing from a corrupt file is ever returned). CheckpointError names
    the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8)
    if size < len(MAGIC) + 8 + 32 or head[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path}: not a cukernels checkpoint (bad magic or too short: truncated?)")
    _verify(path, size)
    try:
        (hlen,) = struct.unpack_from("<Q", head, len(MAGIC))
        base = len(MAGIC) + 8
        if hlen > size - base - 32:  # (checked before reading: a length of 2**40 asked for a terabyte)
            raise ValueError(f"header length {hlen} exceeds the {size - base - 32} bytes the file has for it")
        with open(path, "rb") as f:
            f.seek(base)
            doc = json.loads(f.read(hlen).decode())
        base += hlen
        rel, meta = check_header(doc, size - 32 - base)
        entries = {name: (base + off, nb, dt, shape) for name, (off, nb, dt, shape) in rel.items()}
    except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed checkpoint header ({type(e).__name__}: {e})") from None
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    return Arrays(path, entries, mm), meta


def check_compatible(path, arrays: Mapping, expected: Mapping, what: str = "model", *, dtypes: bool = True):
    """Raise CheckpointError unless ``arrays`` has exactly the names, shapes and (``dtypes=True``) dtypes of
    ``expected`` (name -> array-like with .shape/.dtype), naming the file and the first disagreements."""
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
        elif dtypes and np.dtype(a.dtype) != np.dtype(e.dtype):
            problems.append(f"{name}: dtype {a.dtype} in the file, {e.dtype} in the {what}")
    if problems:
        raise CheckpointError(f"{path}: does not match the {what}: " + "; ".join(problems[:6]))


def _steps(folder):
    out = []
    for p in Path(folder).glob("step_*.ckpt"):
        try:
            out.append((int(p.stem.split("_", 1)[1]), p))
        except ValueError:
            continue
    return sorted(out)


def latest(folder) -> Path | None:
    """The newest complete checkpoint ``step_*.ckpt`` in ``folder`` (highest step), or None."""
    s = _steps(folder)
    return s[-1][1] if s else None


def step_path(folder, step) -> Path:
    """``<folder>/step_<step, 8 digits>.ckpt``: the name :func:`latest` and :func:`prune` understand."""
    return Path(folder) / f"step_{int(step):08d}.ckpt"


def prune(folder, keep_last: int):
    """Delete all but the ``keep_last`` newest ``step_*.ckpt`` files of ``folder`` (``keep_last <= 0``: keep
    all). Only complete files carry that name (a write in progress has a ``.tmp-<pid>`` suffix)."""
    if keep_last is None or keep_last <= 0:
        return []
    gone = [p for _, p in _steps(folder)[:-keep_last]]
    for p in gone:
        p.unlink()
    return gone


# ---------------------------------------------------------------------------------- training checkpoints
def save_training(path, *, model, optimizer_state: dict, meta: dict, extra_arrays: Mapping | None = None) -> Path:
    """A training checkpoint: the model's parameters (``model.state_dict()``), the optimizer's moments
    (``optimizer_state``: the ``state_dict()`` format of ``cukernels.optim`` -- one rank's slices or whole moments --,
    arrays on either module) and ``extra_arrays`` under ``train/``; ``meta`` plus the schema's own fields
    (``meta["optimizer"]``, when given, is kept with the optimizer's kind, step and lr added: where a shard's slices
    lie)."""
    arrays = {MODEL_PREFIX + n: a for n, a in model.state_dict().items()}
    for n, s in optimizer_state["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            arrays[f"{OPTIM_PREFIX}{n}/{k}"] = s[k]
    for k, a in (extra_arrays or {}).items():
        arrays[TRAIN_PREFIX + k] = a
    full = dict(meta, kind=TRAIN_KIND, version=VERSION, model_type=model.model_type,
                model_config=model.config.to_dict(),
                optimizer=dict(meta.get("optimizer") or {}, kind=optimizer_state.get("kind", "AdamW"),
                               step=int(optimizer_state["step"]), lr=float(optimizer_state["lr"])))
    return save(path, arrays, full)


def read_training(path) -> tuple[Arrays, dict]:
    """``load`` + the schema check (a trainer checkpoint); old version-1 files (LLaMA) get ``model_type``."""
    arrays, meta = load(path)
    if meta.get("kind") != TRAIN_KIND:
        raise CheckpointError(f"{path}: not a trainer checkpoint (kind {meta.get('kind')!r})")
    meta.setdefault("model_type", "llama")
    return arrays, meta


def model_arrays(arrays: Mapping) -> dict:
    """``{parameter name: array}`` of a training checkpoint."""
    n = len(MODEL_PREFIX)
    return {k[n:]: arrays[k] for k in arrays if k.startswith(MODEL_PREFIX)}


def optimizer_state(arrays: Mapping, meta: dict) -> dict:
    """The optimizer's ``state_dict()`` format rebuilt from a training checkpoint."""
    o, st, n = meta["optimizer"], {}, len(OPTIM_PREFIX)
    for k in arrays:
        if k.startswith(OPTIM_PREFIX):
            name, which = k[n:].rsplit("/", 1)
            st.setdefault(name, {})[which] = arrays[k]
    return {"kind": o.get("kind"), "step": int(o["step"]), "lr": float(o["lr"]), "state": st}


def train_arrays(arrays: Mapping) -> dict:
    n = len(TRAIN_PREFIX)
    return {k[n:]: arrays[k] for k in arrays if k.startswith(TRAIN_PREFIX)}
