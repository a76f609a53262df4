"""safetensors files, read memory-mapped and written tensor by tensor.

Format (https://github.com/huggingface/safetensors): u64 little-endian header length N, N bytes of JSON
``{name: {"dtype": "F32"|"BF16"|..., "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``
(offsets relative to the end of the header), then the raw little-endian bytes.

Reading returns a :class:`SafeTensors` mapping whose values are read-only memory-mapped views: nothing is read
until a tensor is used, so loading a 1B model into the GPU keeps about one tensor in host memory at a time
(``safetensors.numpy`` cannot read BF16 -- it has no NumPy dtype for it -- so the header is parsed here, every
entry checked). Writing computes the header from shapes and dtypes alone, then copies one tensor at a time to
the host (device arrays included) and streams it into a temporary file renamed atomically.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .._backend import bfloat16
from .atomic import atomic_open, check_target

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": bfloat16,
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # bytes: the reference implementation's limit (a larger length is a lie or an attack)
ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


class SafetensorsError(ValueError):
    """A safetensors file is malformed (bad header, unknown dtype, offsets outside the file, truncated)."""


class SafeTensors(Mapping):
    """``{name: read-only NumPy view}`` over one memory-mapped safetensors file (BF16 as ``ck.bfloat16``)."""

    def __init__(self, path, entries, mm):
        self.path, self._entries, self._mm = Path(path), entries, mm

    def __getitem__(self, name):
        b, e, dt, shape = self._entries[name]
        return self._mm[b:e].view(dt).reshape(shape)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self):
        return len(self._entries)

    def info(self, name):
        """(shape, dtype) without touching the data."""
        _, _, dt, shape = self._entries[name]
        return shape, dt


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check_header(header, data_len, path="safetensors"):
    """The whole parsed header, validated before any tensor is read: ``{name: (begin, end, dtype, shape)}`` with
    offsets relative to the data, or SafetensorsError naming the file, the tensor and what is wrong.

    A checksum proves a file is intact, not that it tells the truth: a header rewritten consistently must still
    be refused. Checked: a JSON object; ``__metadata__`` absent or ``{str: str}``; each tensor name a non-empty
    string whose entry is exactly {dtype, shape, data_offsets}; dtype one of :data:`DTYPES`; shape a list of
    non-negative integers (not floats: they were truncated); data_offsets two integers ``0 <= begin <= end``
    with ``end - begin`` = the shape's size x the dtype's; and, sorted by offset, the tensors tile the data
    exactly (each starts where the previous ended, the last ends at the end of the file): no negative offset
    reading the header as data, no two tensors sharing bytes, no dtype reinterpreting another tensor's bytes, no
    gap, nothing outside the file."""
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: safetensors header is not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and (not isinstance(meta, dict)
                             or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise SafetensorsError(f"{path}: __metadata__: expected an object of string keys and string values; got "
                               f"{str(meta)[:80]}")
    out = {}
    for name, inf in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not name:
            raise SafetensorsError(f"{path}: a tensor with an empty name")
        if not isinstance(inf, dict) or set(inf) != ENTRY_KEYS:
            raise SafetensorsError(f"{where}: expected an entry with exactly the fields dtype, shape, data_offsets; "
                                   f"got {str(inf)[:120]}")
        dt = DTYPES.get(inf["dtype"]) if isinstance(inf["dtype"], str) else None
        if dt is None:
            raise SafetensorsError(f"{where}: unknown dtype {inf['dtype']!r} (known: {', '.join(DTYPES)})")
        shape, offs = inf["shape"], inf["data_offsets"]
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise SafetensorsError(f"{where}: shape {shape!r}: expected a list of non-negative integers")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(x) for x in offs):
            raise SafetensorsError(f"{where}: data_offsets {offs!r}: expected [begin, end], two integers")
        b, e = offs
        want = math.prod(shape) * dt.itemsize
        if not 0 <= b <= e <= data_len or e - b != want:
            raise SafetensorsError(f"{where}: data_offsets [{b}, {e}] do not hold {tuple(shape)} {inf['dtype']} "
                                   f"({want} bytes) within the {data_len} data bytes (truncated or forged?)")
        out[name] = (b, e, dt, tuple(shape))
    pos = 0
    for name, (b, e, _, _) in sorted(out.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if b != pos:
            what = "overlaps the tensor before it" if b < pos else f"leaves a gap of {b - pos} bytes before it"
            raise SafetensorsError(f"{path}: tensor {name!r}: data_offsets [{b}, {e}] {what} (the tensors must tile "
                                   f"the data in order)")
        pos = e
    if pos != data_len:
        raise SafetensorsError(f"{path}: the tensors cover {pos} of the {data_len} data bytes (trailing bytes: "
                               f"truncated or forged?)")
    return out


def read(path, names=None) -> SafeTensors:
    """Open a safetensors file: the whole header is validated first (:func:`check_header`: known dtypes, integer
    non-negative shapes, dtype x shape = byte length, offsets in order, non-overlapping, inside the file,
    metadata of the right types); ``names`` restricts the mapping (a missing one is an error). SafetensorsError
    names the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise SafetensorsError(f"{path}: no such safetensors file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file (truncated?)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER:  # (before reading it: a length of 2**40 asked for a terabyte)
            raise SafetensorsError(f"{path}: header length {n} exceeds the format's limit of {MAX_HEADER} bytes "
                                   f"(not a safetensors file, or a corrupt one)")
        if n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} exceeds the file size {size} (truncated or not "
                                   f"a safetensors file)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: safetensors header is not a JSON object")
    entries = {k: (8 + n + b, 8 + n + e, dt, shape)
               for k, (b, e, dt, shape) in check_header(header, size - 8 - n, path).items()
               if names is None or k in names}
    if names is not None:
        missing = sorted(set(names) - set(entries))
        if missing:
            raise SafetensorsError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    return SafeTensors(path, entries, mm)


def _shape_dtype(name, a):
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise TypeError(f"arrays: tensor names must be non-empty strings other than '__metadata__'; got {name!r}")
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"arrays[{name!r}]: expected a NumPy or CuPy array; got {type(a).__name__}")
    dt = np.dtype(a.dtype)
    if dt not in NAMES:
        raise TypeError(f"arrays[{name!r}]: dtype {dt} has no safetensors name (known: {', '.join(DTYPES)})")
    return tuple(int(s) for s in a.shape), dt


def _host(a):
    h = a.get() if hasattr(a, "get") else np.asarray(a)
    h = np.ascontiguousarray(h)
    return h.astype(h.dtype.newbyteorder("<")) if h.dtype.byteorder == ">" else h


def write(path, arrays: Mapping, metadata: dict | None = None):
    """Write ``{name: array}`` (NumPy or CuPy) as a safetensors file, atomically, one tensor in host memory at a
    time."""
    if not isinstance(arrays, Mapping):
        raise TypeError(f"arrays: expected a mapping {{name: array}}; got {type(arrays).__name__}")
    specs = {k: _shape_dtype(k, a) for k, a in arrays.items()}
    return write_specs(path, specs, arrays.__getitem__, metadata)


def write_specs(path, specs: dict, get, metadata: dict | None = None):
    """The streaming writer: ``specs`` {name: (shape, dtype)} fixes the header; ``get(name)`` produces each
    tensor (host or device) when its turn comes. Tensors are laid out in sorted name order, the header padded to
    8 bytes (as the reference implementation does)."""
    path = check_target(path)
    header, off = {}, 0
    if metadata is not None and (not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        # the format's __metadata__ is {str: str}; other values were converted with str() silently
        raise TypeError(f"metadata: expected a dict of string keys and string values (safetensors' __metadata__); "
                        f"got {str(metadata)[:80]}")
    meta = dict(metadata or {})
    if meta:
        header["__metadata__"] = meta
    order = sorted(specs)
    for k in order:
        shape, dt = specs[k]
        nb = math.prod(shape) * np.dtype(dt).itemsize
        header[k] = {"dtype": NAMES[np.dtype(dt)], "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    path = Path(path)
    with atomic_open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for k in order:
            h = _host(get(k))
            shape, dt = specs[k]
            if tuple(h.shape) != tuple(shape) or h.dtype != np.dtype(dt):
                raise ValueError(f"{k}: produced {h.dtype} {tuple(h.shape)}; the header promised {dt} {shape}")
            f.write(memoryview(h.reshape(-1).view(np.uint8)))
    return path


__all__ = ["SafeTensors", "SafetensorsError", "read", "write", "write_specs", "DTYPES", "NAMES"]
