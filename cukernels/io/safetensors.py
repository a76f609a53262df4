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
from .atomic import atomic_open

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": bfloat16,
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
NAMES = {v: k for k, v in DTYPES.items()}


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


def read(path, names=None) -> SafeTensors:
    """Open a safetensors file: every header entry is checked (dtype known, offsets inside the data, size equal
    to the shape's); ``names`` restricts the mapping (a missing one is an error). SafetensorsError names the
    file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise SafetensorsError(f"{path}: no such safetensors file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file (truncated?)")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} exceeds the file size {size} (truncated or not "
                                   f"a safetensors file)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: safetensors header is not a JSON object")
    base, data_len = 8 + n, size - 8 - n
    entries = {}
    for name, inf in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        try:
            dt = DTYPES[inf["dtype"]]
            shape = tuple(int(s) for s in inf["shape"])
            b, e = (int(x) for x in inf["data_offsets"])
        except KeyError as k:
            raise SafetensorsError(f"{path}: tensor {name!r}: unknown dtype or missing field {k}") from None
        except (TypeError, ValueError) as err:
            raise SafetensorsError(f"{path}: tensor {name!r}: malformed entry {inf!r} ({err})") from None
        want = math.prod(shape) * dt.itemsize
        if not 0 <= b <= e <= data_len or e - b != want:
            raise SafetensorsError(f"{path}: tensor {name!r}: data_offsets [{b}, {e}] do not hold {shape} "
                                   f"{inf['dtype']} ({want} bytes) within the {data_len} data bytes (truncated?)")
        entries[name] = (base + b, base + e, dt, shape)
    if names is not None:
        missing = sorted(set(names) - set(entries))
        if missing:
            raise SafetensorsError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    return SafeTensors(path, entries, mm)


def _shape_dtype(name, a):
    dt = np.dtype(a.dtype)
    if dt not in NAMES:
        raise TypeError(f"{name}: dtype {dt} has no safetensors name")
    return tuple(int(s) for s in a.shape), dt


def _host(a):
    h = a.get() if hasattr(a, "get") else np.asarray(a)
    h = np.ascontiguousarray(h)
    return h.astype(h.dtype.newbyteorder("<")) if h.dtype.byteorder == ">" else h


def write(path, arrays: Mapping, metadata: dict | None = None):
    """Write ``{name: array}`` (NumPy or CuPy) as a safetensors file, atomically, one tensor in host memory at a
    time."""
    specs = {k: _shape_dtype(k, a) for k, a in arrays.items()}
    return write_specs(path, specs, arrays.__getitem__, metadata)


def write_specs(path, specs: dict, get, metadata: dict | None = None):
    """The streaming writer: ``specs`` {name: (shape, dtype)} fixes the header; ``get(name)`` produces each
    tensor (host or device) when its turn comes. Tensors are laid out in sorted name order, the header padded to
    8 bytes (as the reference implementation does)."""
    header, off = {}, 0
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
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
