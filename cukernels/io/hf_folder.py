"""Hugging Face checkpoint folders, whatever the model:

    <folder>/config.json                      the model's config (``model_type`` names the family)
    <folder>/model.safetensors                one file, or
    <folder>/model.safetensors.index.json     {"metadata": {"total_size": N}, "weight_map": {name: shard}}
    <folder>/model-00001-of-0000K.safetensors ...

Reading gives the config as a dict and the weights as one lazy ``{name: memory-mapped view}`` mapping across
the shards; writing streams tensors one at a time (cast / transposed on the way by the caller's ``get``). The
name map and the config fields belong to each model (``cukernels.models``).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from . import safetensors as st
from .atomic import write_json

SAFE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
# the special-token ids of config.json; a folder written here always carries all three (null when a model has none),
# so transformers never falls back to its class defaults (GPT-2's 50256 on a 256-token model, LLaMA's 1 and 2)
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class HFFormatError(ValueError):
    """A Hugging Face checkpoint folder or safetensors file is malformed or does not fit the model."""


def _err(e):
    return HFFormatError(str(e))


def folder_of(path) -> Path:
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return p.parent
    if not p.is_dir():
        raise HFFormatError(f"{p}: not a folder with {CONFIG} and {SAFE} (or {INDEX})")
    return p


def is_hf_folder(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file()


def read_config(path) -> tuple[dict, str]:
    """``(config.json as a dict, its path as a string for messages)``."""
    folder = folder_of(path)
    cj = folder / CONFIG
    if not cj.is_file():
        raise HFFormatError(f"{folder}: no {CONFIG}")
    try:
        d = json.loads(cj.read_text())
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{cj}: unreadable JSON ({e})") from None
    if not isinstance(d, dict):
        raise HFFormatError(f"{cj}: expected a JSON object")
    return d, str(cj)


def _id_error(name, v, vocab_size):
    def ok(i):
        return isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) and 0 <= i < vocab_size
    if v is None or ok(v):
        return None
    if name == "eos_token_id" and isinstance(v, (list, tuple)) and v and all(ok(i) for i in v):
        return None  # (several end tokens: Llama-3.1's [128001, 128008, 128009])
    return (f"{name}: expected null or a token id in [0, {vocab_size})" + (" (or a list of them)" if
            name == "eos_token_id" else "") + f"; got {v!r}")


def check_special_ids(where, config):
    """ValueError naming the field unless each of ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of a model
    config is None or an id of its vocabulary (``eos_token_id`` may be a list)."""
    for k in SPECIAL_IDS:
        err = _id_error(k, getattr(config, k, None), config.vocab_size)
        if err:
            raise ValueError(f"{where}.{err}")


def read_special_ids(d: dict, vocab_size) -> dict:
    """The special-token ids of a ``config.json`` dict that fit its vocabulary (an id outside it is dropped, not
    an error: the ids are metadata, and the weights still load)."""
    return {k: (list(d[k]) if isinstance(d[k], tuple) else d[k]) for k in SPECIAL_IDS
            if k in d and _id_error(k, d[k], vocab_size) is None}


class _Union(Mapping):
    """Several SafeTensors mappings seen as one (a sharded checkpoint)."""

    def __init__(self, parts, where):
        self._where = {}
        for part in parts:
            for k in part:
                self._where[k] = part
        self.path = where

    def __getitem__(self, k):
        return self._where[k][k]

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def info(self, k):
        return self._where[k].info(k)


def weights_path(path) -> Path:
    """The file that names the weights: the index of a sharded folder, else ``model.safetensors``."""
    p = Path(path)
    if p.is_file():
        return p
    folder = folder_of(p)
    return folder / INDEX if (folder / INDEX).is_file() else folder / SAFE


def read_weights(path) -> Mapping:
    """All tensors of a folder (one file or shards through the index) as one lazy mapping (original dtypes)."""
    p = Path(path)
    try:
        if p.is_file() and p.suffix == ".safetensors":
            return st.read(p)
        folder = folder_of(p)
        if (folder / INDEX).is_file():
            idx_path = folder / INDEX
            try:
                wm = json.loads(idx_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFFormatError(f"{idx_path}: unreadable index ({type(e).__name__}: {e})") from None
            shards = {}
            for name, shard in wm.items():
                shards.setdefault(shard, set()).add(name)
            return _Union([st.read(folder / s, names=n) for s, n in sorted(shards.items())], idx_path)
        if (folder / SAFE).is_file():
            return st.read(folder / SAFE)
    except st.SafetensorsError as e:
        raise _err(e) from None
    raise HFFormatError(f"{folder}: neither {SAFE} nor {INDEX}")


def save_folder(path, config: dict, specs: dict, get, *, max_shard_size=None):
    """Write ``config.json`` and the weights into folder ``path``: ``specs`` {name: (shape, dtype)} as they will
    be stored, ``get(name)`` producing each tensor (NumPy or CuPy) when it is written. One ``model.safetensors``,
    or shards of at most ``max_shard_size`` bytes plus the index. Stale weight files of an earlier save are
    removed first. ``config.json`` always carries ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` (null
    where ``config`` has none)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    nbytes = {k: int(np.prod(s)) * np.dtype(d).itemsize for k, (s, d) in specs.items()}
    total = sum(nbytes.values())
    meta = {"format": "pt"}
    for stale in [folder / SAFE, folder / INDEX, *folder.glob("model-*-of-*.safetensors")]:
        if stale.exists():
            stale.unlink()
    if max_shard_size is None or total <= max_shard_size:
        st.write_specs(folder / SAFE, specs, get, meta)
    else:
        shards, cur, cur_bytes = [], [], 0
        for k in specs:
            if cur and cur_bytes + nbytes[k] > max_shard_size:
                shards.append(cur)
                cur, cur_bytes = [], 0
            cur.append(k)
            cur_bytes += nbytes[k]
        shards.append(cur)
        wm = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            st.write_specs(folder / fname, {k: specs[k] for k in names}, get, meta)
            wm.update({k: fname for k in names})
        write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": wm})
    config = dict(config)
    for k in SPECIAL_IDS:  # explicit nulls: transformers assumes its class defaults for missing ids, and warns
        config.setdefault(k, None)
    write_json(folder / CONFIG, config)
    return folder


__all__ = ["HFFormatError", "SAFE", "INDEX", "CONFIG", "SPECIAL_IDS", "read_config", "read_weights", "save_folder",
           "folder_of", "is_hf_folder", "weights_path", "check_special_ids", "read_special_ids"]
