"""Hugging Face LLaMA weights: safetensors files, ``config.json``, and the name mapping.

Layout read and written (what ``transformers.LlamaForCausalLM.save_pretrained`` produces)::

    <folder>/config.json                     LlamaConfig fields (model_type "llama")
    <folder>/model.safetensors               one file, or
    <folder>/model.safetensors.index.json    {"metadata": {"total_size": N}, "weight_map": {name: shard}}
    <folder>/model-00001-of-0000K.safetensors ...

Names: our parameters already carry the Hugging Face names (``model.embed_tokens.weight``,
``model.layers.N.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.N.mlp.{gate,up,down}_proj.weight``,
``model.layers.N.{input,post_attention}_layernorm.weight``, ``model.norm.weight``, ``lm_head.weight``), so the
mapping is the identity except: with tied embeddings ``lm_head.weight`` is not a parameter (written: omitted,
as Hugging Face does; read: ignored), and old ``...rotary_emb.inv_freq`` buffers are ignored. The rotary layout
is Hugging Face's rotate-half one (``functional.rope``), so q/k rows need no permutation.

safetensors format (https://github.com/huggingface/safetensors): u64 little-endian header length N, N bytes of
JSON ``{name: {"dtype": "F32"|"BF16"|..., "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``
(offsets relative to the end of the header), then the raw little-endian bytes. ``safetensors.numpy`` cannot
read BF16 (it has no NumPy dtype for it), so files are read here (memory-mapped, every header entry checked)
and written with ``safetensors.numpy.save_file`` when the package is installed (it takes ml_dtypes' bfloat16),
by the same few lines here otherwise. Writes are atomic (temporary name, fsync, rename).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from ._backend import bfloat16

SAFE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": bfloat16,
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_ROPE_TYPES = (None, "default", "llama3")


class HFFormatError(ValueError):
    """A Hugging Face checkpoint folder or safetensors file is malformed or does not fit the model."""


# ---------------------------------------------------------------------------------------------- safetensors
def read_safetensors(path, names=None) -> dict:
    """``{name: NumPy array}`` from a safetensors file (all tensors, or only ``names``). BF16 comes back as
    ``ck.bfloat16``. Raises HFFormatError naming the file on a bad header, an unknown dtype, offsets outside
    the file or a size that disagrees with the shape."""
    path = Path(path)
    if not path.is_file():
        raise HFFormatError(f"{path}: no such safetensors file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HFFormatError(f"{path}: {size} bytes is too short for a safetensors file (truncated?)")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise HFFormatError(f"{path}: header length {n} exceeds the file size {size} (truncated or not "
                                f"a safetensors file)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HFFormatError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise HFFormatError(f"{path}: safetensors header is not a JSON object")
    base, data_len = 8 + n, size - 8 - n
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    out = {}
    for name, inf in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        try:
            dt = _DTYPES[inf["dtype"]]
            shape = tuple(int(s) for s in inf["shape"])
            b, e = (int(x) for x in inf["data_offsets"])
        except KeyError as k:
            raise HFFormatError(f"{path}: tensor {name!r}: unknown dtype or missing field {k}") from None
        except (TypeError, ValueError) as err:
            raise HFFormatError(f"{path}: tensor {name!r}: malformed entry {inf!r} ({err})") from None
        want = math.prod(shape) * dt.itemsize
        if not 0 <= b <= e <= data_len or e - b != want:
            raise HFFormatError(f"{path}: tensor {name!r}: data_offsets [{b}, {e}] do not hold {shape} "
                                f"{inf['dtype']} ({want} bytes) within the {data_len} data bytes (truncated?)")
        out[name] = np.array(mm[base + b: base + e]).view(dt).reshape(shape)
    if names is not None:
        missing = sorted(set(names) - set(out))
        if missing:
            raise HFFormatError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return out


def _fsync_replace(tmp: Path, path: Path):
    from .checkpoint import fsync_dir

    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_safetensors(path, arrays: dict, metadata: dict | None = None):
    """Write ``{name: array}`` (NumPy or CuPy; float32/bfloat16/...) as a safetensors file, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    host = {}
    for k, a in arrays.items():
        h = np.ascontiguousarray(a.get() if hasattr(a, "get") else np.asarray(a))
        if h.dtype not in _NAMES:
            raise TypeError(f"{k}: dtype {h.dtype} has no safetensors name")
        host[k] = h.astype(h.dtype.newbyteorder("<")) if h.dtype.byteorder == ">" else h
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        try:
            from safetensors.numpy import save_file
        except ImportError:
            save_file = None
        if save_file is not None:
            save_file(host, str(tmp), metadata=meta or None)
        else:
            _write_safetensors_raw(tmp, host, meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        _fsync_replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _write_safetensors_raw(path, host: dict, meta: dict):
    """The format by hand (when the safetensors package is absent): header padded to 8 bytes with spaces."""
    header, off = {}, 0
    if meta:
        header["__metadata__"] = meta
    for k in sorted(host):
        h = host[k]
        header[k] = {"dtype": _NAMES[h.dtype], "shape": list(h.shape), "data_offsets": [off, off + h.nbytes]}
        off += h.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for k in sorted(host):
            f.write(memoryview(host[k].reshape(-1).view(np.uint8)))


# ---------------------------------------------------------------------------------------------- config
def config_from_hf(d: dict, where="config.json"):
    """A :class:`LlamaConfig` from a Hugging Face ``config.json`` dict; HFFormatError for what we cannot run
    (another architecture, biases, another activation, an unsupported rope_scaling)."""
    from .models.llama import LlamaConfig
    mt = d.get("model_type", "llama")
    if mt != "llama":
        raise HFFormatError(f"{where}: model_type {mt!r}; only 'llama' is supported")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise HFFormatError(f"{where}: hidden_act {act!r}; the LLaMA MLP here is SwiGLU (silu)")
    for k in ("attention_bias", "mlp_bias"):
        if d.get(k):
            raise HFFormatError(f"{where}: {k}=true is not supported (no biases in this LLaMA)")
    rs = d.get("rope_scaling")
    rp = d.get("rope_parameters")  # transformers >= 5 writes theta and scaling together under this key
    if isinstance(rp, dict):
        if "rope_theta" in rp:
            d = dict(d, rope_theta=rp["rope_theta"])
        if rs is None:
            rs = {k: v for k, v in rp.items() if k != "rope_theta"}
    if rs is not None:
        rt = rs.get("rope_type", rs.get("type"))
        if rt not in _ROPE_TYPES:
            raise HFFormatError(f"{where}: rope_scaling type {rt!r} is not supported (supported: default, llama3)")
        if rt in (None, "default"):
            rs = None
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    if missing:
        raise HFFormatError(f"{where}: missing fields {missing}")
    d = dict(d, rope_scaling=rs)
    if d.get("head_dim") is None:
        d.pop("head_dim", None)
    if d.get("num_key_value_heads") is None:
        d.pop("num_key_value_heads", None)
    return LlamaConfig.from_dict(d)


def config_to_hf(c, dtype=np.float32) -> dict:
    """The ``config.json`` dict Hugging Face's ``LlamaConfig`` reads."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "initializer_range": c.initializer_range,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "use_cache": True,
        "torch_dtype": "bfloat16" if np.dtype(dtype) == bfloat16 else np.dtype(dtype).name,
    }


# ---------------------------------------------------------------------------------------------- folders
def _folder(path) -> Path:
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return p.parent
    if not p.is_dir():
        raise HFFormatError(f"{p}: not a folder with {CONFIG} and {SAFE} (or {INDEX})")
    return p


def read_config(path):
    folder = _folder(path)
    cj = folder / CONFIG
    if not cj.is_file():
        raise HFFormatError(f"{folder}: no {CONFIG}")
    try:
        d = json.loads(cj.read_text())
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{cj}: unreadable JSON ({e})") from None
    return config_from_hf(d, where=str(cj))


def read_weights(path) -> dict:
    """All tensors of a checkpoint folder (single file or sharded through the index), original dtypes."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return read_safetensors(p)
    folder = _folder(p)
    if (folder / INDEX).is_file():
        idx_path = folder / INDEX
        try:
            wm = json.loads(idx_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFFormatError(f"{idx_path}: unreadable index ({type(e).__name__}: {e})") from None
        shards = {}
        for name, shard in wm.items():
            shards.setdefault(shard, set()).add(name)
        out = {}
        for shard, names in sorted(shards.items()):
            out.update(read_safetensors(folder / shard, names=names))
        return out
    if (folder / SAFE).is_file():
        return read_safetensors(folder / SAFE)
    raise HFFormatError(f"{folder}: neither {SAFE} nor {INDEX}")


def hf_to_state(tensors: dict, config, where, expected: dict) -> dict:
    """Map Hugging Face tensors onto our parameter names, as float32 arrays of ``expected``'s shapes; every
    name and shape is checked first (HFFormatError naming ``where`` and what disagrees)."""
    from .checkpoint import CheckpointError, check_compatible
    sd = {}
    for k, a in tensors.items():
        if k.endswith(_IGNORED_SUFFIXES):
            continue
        if k == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding table is the output projection
        sd[k] = a
    for k, a in sd.items():
        if a.dtype.kind != "f" and a.dtype != bfloat16:
            raise HFFormatError(f"{where}: {k}: dtype {a.dtype}; expected a floating-point tensor")
    try:
        check_compatible(where, {k: _Shape(a.shape) for k, a in sd.items()},
                         {k: _Shape(e.shape) for k, e in expected.items()}, "model")
    except CheckpointError as e:
        raise HFFormatError(str(e)) from None
    return {k: a.astype(np.float32) for k, a in sd.items()}


class _Shape:
    """Shape + a dtype placeholder so check_compatible compares names and shapes only."""

    dtype = np.dtype(np.float32)

    def __init__(self, shape):
        self.shape = tuple(shape)


def state_to_hf(state: dict, config, dtype=np.float32) -> dict:
    dt = bfloat16 if np.dtype(dtype) == bfloat16 else np.dtype(dtype)
    if dt not in (np.dtype(np.float32), bfloat16, np.dtype(np.float16)):
        raise TypeError(f"dtype: expected float32, bfloat16 or float16; got {dt}")
    out = {}
    for k, a in state.items():
        h = a.get() if hasattr(a, "get") else np.asarray(a)
        out[k] = np.ascontiguousarray(h.astype(dt))
    return out


def save_folder(path, config, state: dict, dtype=np.float32, max_shard_size=None):
    """Write ``config.json`` and the weights (one ``model.safetensors``, or shards of at most
    ``max_shard_size`` bytes with ``model.safetensors.index.json``) into folder ``path``."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = state_to_hf(state, config, dtype)
    total = sum(a.nbytes for a in tensors.values())
    meta = {"format": "pt"}
    for stale in [folder / SAFE, folder / INDEX, *folder.glob("model-*-of-*.safetensors")]:
        if stale.exists():
            stale.unlink()
    if max_shard_size is None or total <= max_shard_size:
        write_safetensors(folder / SAFE, tensors, meta)
    else:
        shards, cur, cur_bytes = [], {}, 0
        for k, a in tensors.items():
            if cur and cur_bytes + a.nbytes > max_shard_size:
                shards.append(cur)
                cur, cur_bytes = {}, 0
            cur[k] = a
            cur_bytes += a.nbytes
        shards.append(cur)
        wm = {}
        for i, sh in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(folder / name, sh, meta)
            wm.update({k: name for k in sh})
        _write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": wm})
    _write_json(folder / CONFIG, config_to_hf(config, dtype))
    return folder


def _write_json(path: Path, obj):
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_replace(tmp, path)


__all__ = ["HFFormatError", "read_safetensors", "write_safetensors", "config_from_hf", "config_to_hf",
           "read_config", "read_weights", "hf_to_state", "state_to_hf", "save_folder"]
