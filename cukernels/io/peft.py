"""PEFT LoRA adapter folders, read and written: what ``peft.PeftModel.from_pretrained`` and ``save_pretrained`` use.

    <folder>/adapter_config.json          LoraConfig's fields (peft_type "LORA", r, lora_alpha, target_modules, ...)
    <folder>/adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, in], .lora_B.weight [out, r]

The folder is untrusted input: everything is checked before a model is touched -- the JSON's types and ranges (r an
integer >= 1, lora_alpha > 0, lora_dropout in [0, 1), target_modules names or a regex), PEFT features this loader
does not implement refused by name (DoRA, bias adapters, modules_to_save, layers_to_transform, initialisations that
rewrite the base such as PiSSA, ...), the safetensors header (``io.safetensors``), every tensor's name (PEFT's
prefix and suffixes), dtype (floating point) and rank (2-D; A and B of each module agree on r). Whether the adapters
fit a model (which Linears, which shapes) is the model's check (``CausalLM.load_adapter``).

Nothing here knows a model: :func:`read` gives the config as a dict of ``cukernels.nn.LoraConfig`` fields and the
tensors under our parameter names (``<module>.lora_A.weight``); :func:`write` takes the same.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import re
from pathlib import Path

import numpy as np

from .._backend import bfloat16
from . import safetensors as st
from .atomic import write_json

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<which>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")

# Keys that carry no meaning for the weights (metadata, or options of features that are off when their own key is).
_METADATA = {"base_model_name_or_path", "revision", "task_type", "peft_version", "inference_mode", "auto_mapping",
             "megatron_core", "qalora_group_size", "layers_pattern", "init_lora_weights", "loftq_config",
             "eva_config", "corda_config", "lora_ga_config", "runtime_config"}
# Keys read here (checked one by one below).
_READ = {"peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "rank_pattern",
         "alpha_pattern", "fan_in_fan_out", "bias", "lora_bias", "use_dora"}
# Initialisations that leave the base weights as they were (others -- pissa, olora, corda, eva, loftq, ... --
# rewrite the base, and an adapter saved without PEFT's conversion only works on that rewritten base).
_PLAIN_INITS = (True, False, "gaussian")


class PeftFormatError(ValueError):
    """A PEFT adapter folder is malformed, uses a PEFT feature this loader does not implement, or does not fit."""


def is_adapter_folder(path) -> bool:
    """Whether ``path`` is a folder with an ``adapter_config.json`` (a PEFT adapter folder, checked when read)."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file()


def _folder(path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise PeftFormatError(f"{p}: no such folder (expected a PEFT adapter folder with {CONFIG} and {WEIGHTS})")
    if not (p / CONFIG).is_file():
        raise PeftFormatError(f"{p}: no {CONFIG} (not a PEFT adapter folder)")
    return p


def _empty(v):
    return v is None or v is False or (isinstance(v, (dict, list, tuple, str)) and len(v) == 0)


def _number(where, v, *, lo, lo_open, hi=None, hi_open=True, integer=False):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral if integer else numbers.Real):
        raise PeftFormatError(f"{where}: expected {'an integer' if integer else 'a number'}; got {v!r}")
    if not math.isfinite(float(v)) or v < lo or (lo_open and v == lo) or (hi is not None and (
            v > hi or (hi_open and v == hi))):
        rng = f"{'>' if lo_open else '>='} {lo}" + (f" and {'<' if hi_open else '<='} {hi}" if hi is not None else "")
        raise PeftFormatError(f"{where}: expected a number {rng}; got {v!r}")
    return int(v) if integer else float(v)


def read_config(path) -> dict:
    """``adapter_config.json`` of a PEFT LoRA folder as ``cukernels.nn.LoraConfig`` keyword arguments (r,
    lora_alpha, lora_dropout, target_modules, use_rslora, rank_pattern, alpha_pattern) plus
    ``base_model_name_or_path`` (or None) and ``fan_in_fan_out``. PeftFormatError naming the file and the key."""
    f = _folder(path) / CONFIG
    try:
        d = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PeftFormatError(f"{f}: unreadable JSON ({e})") from None
    if not isinstance(d, dict):
        raise PeftFormatError(f"{f}: expected a JSON object")
    w = str(f)
    pt = d.get("peft_type")
    if not isinstance(pt, str) or pt.upper() != "LORA":
        raise PeftFormatError(f"{w}: peft_type {pt!r}; this loader reads LoRA adapters (peft_type \"LORA\")")
    if d.get("use_dora"):
        raise PeftFormatError(f"{w}: use_dora: true (DoRA) is not supported; LoRA adapters only")
    if d.get("bias", "none") != "none" or d.get("lora_bias"):
        raise PeftFormatError(f"{w}: bias {d.get('bias')!r} / lora_bias {d.get('lora_bias')!r}: adapters that train "
                              f"biases are not supported (bias: \"none\" only)")
    init = d.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise PeftFormatError(f"{w}: init_lora_weights {init!r} rewrites the base weights; convert the adapter with "
                              f"PEFT (save_pretrained(path_initial_model_for_weight_conversion=...)) to one that "
                              f"applies to the original base")
    for k, v in d.items():
        if k in _READ or k in _METADATA or _empty(v):
            continue
        raise PeftFormatError(f"{w}: {k} = {str(v)[:60]}: a PEFT feature this loader does not implement (it reads "
                              f"plain LoRA on Linear layers: r, lora_alpha, lora_dropout, target_modules, use_rslora, "
                              f"rank_pattern, alpha_pattern)")
    r = _number(f"{w}: r", d.get("r"), lo=1, lo_open=False, integer=True)
    alpha = _number(f"{w}: lora_alpha", d.get("lora_alpha", 8), lo=0, lo_open=True)
    dropout = _number(f"{w}: lora_dropout", d.get("lora_dropout", 0.0) or 0.0, lo=0, lo_open=False, hi=1)
    t = d.get("target_modules")
    if isinstance(t, str):
        try:
            re.compile(t)
        except re.error as e:
            raise PeftFormatError(f"{w}: target_modules {t!r} is not a valid regular expression ({e})") from None
    elif not (isinstance(t, list) and t and all(isinstance(s, str) and s for s in t)):
        raise PeftFormatError(f"{w}: target_modules: expected a list of module names or a regular expression; "
                              f"got {str(t)[:60]}")
    out = {"r": r, "lora_alpha": alpha, "lora_dropout": dropout,
           "target_modules": t if isinstance(t, str) else tuple(t)}
    for k in ("use_rslora", "fan_in_fan_out"):
        v = d.get(k, False)
        if not isinstance(v, bool):
            raise PeftFormatError(f"{w}: {k}: expected true or false; got {v!r}")
        out[k] = v
    for k, integer in (("rank_pattern", True), ("alpha_pattern", False)):
        v = d.get(k) or {}
        if not isinstance(v, dict):
            raise PeftFormatError(f"{w}: {k}: expected an object {{module pattern: value}}; got {str(v)[:60]}")
        out[k] = {}
        for pk, pv in v.items():
            try:
                re.compile(pk)
            except re.error as e:
                raise PeftFormatError(f"{w}: {k}: {pk!r} is not a valid regular expression ({e})") from None
            out[k][pk] = _number(f"{w}: {k}[{pk!r}]", pv, lo=0, lo_open=True, integer=integer)
    base = d.get("base_model_name_or_path")
    out["base_model_name_or_path"] = base if isinstance(base, str) and base else None
    return out


def read_weights(path) -> dict:
    """The adapter tensors of a PEFT folder as ``{"<module>.lora_A.weight": array, ...}`` (memory-mapped, read-only;
    fp32, bf16 or fp16 as stored), every name, dtype and rank checked: PEFT's ``base_model.model.`` prefix, one
    lora_A and one lora_B per module (a saved adapter name inside the key is accepted, one name for all), 2-D
    floating-point tensors, A [r, in] and B [out, r] with the same r."""
    folder = _folder(path)
    f = folder / WEIGHTS
    if not f.is_file():
        bins = [p.name for p in folder.glob("adapter_model*.bin")]
        extra = (f" (found {bins[0]}: pickle files are not read; re-save with PEFT's save_pretrained, which writes "
                 f"safetensors by default)") if bins else ""
        raise PeftFormatError(f"{folder}: no {WEIGHTS}{extra}")
    try:
        tensors = st.read(f)
    except st.SafetensorsError as e:
        raise PeftFormatError(str(e)) from None
    out, adapters, shapes = {}, set(), {}
    for k in tensors:
        m = _KEY.match(k)
        if m is None:
            raise PeftFormatError(f"{f}: tensor {k!r} is not a LoRA weight of a Linear (expected "
                                  f"base_model.model.<module>.lora_A.weight / .lora_B.weight; embedding adapters, "
                                  f"biases and saved modules are not supported)")
        if m.group("adapter"):
            adapters.add(m.group("adapter"))
        shape, dt = tensors.info(k)
        if not (np.dtype(dt).kind == "f" or np.dtype(dt) == bfloat16) or len(shape) != 2 or 0 in shape:
            raise PeftFormatError(f"{f}: {k}: {np.dtype(dt)} {tuple(shape)}; expected a non-empty 2-D floating-point "
                                  f"matrix")
        name = f"{m.group('module')}.{m.group('which')}.weight"
        if name in out:
            raise PeftFormatError(f"{f}: {name} appears twice (under two adapter names)")
        out[name] = tensors[k]
        shapes[name] = tuple(shape)
    if len(adapters) > 1:
        raise PeftFormatError(f"{f}: holds several adapters {sorted(adapters)}; one adapter per folder")
    if not out:
        raise PeftFormatError(f"{f}: holds no LoRA weights")
    for name, shape in shapes.items():
        mod, which = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
        other = f"{mod}.{'lora_B' if which == 'lora_A' else 'lora_A'}.weight"
        if other not in shapes:
            raise PeftFormatError(f"{f}: {mod} has {which} but no {other.rsplit('.', 2)[1]}")
        if which == "lora_A" and shapes[other][1] != shape[0]:
            raise PeftFormatError(f"{f}: {mod}: lora_A {shape} and lora_B {shapes[other]} disagree on the rank")
    return out


def read(path):
    """``(config, tensors)``: :func:`read_config` and :func:`read_weights` of one folder."""
    return read_config(path), read_weights(path)


def _int_if_whole(v):
    return int(v) if float(v).is_integer() else float(v)  # (PEFT's own files write lora_alpha: 16)


def write(path, config: dict, tensors: dict, *, base_model_name_or_path=None, fan_in_fan_out=False, dtype=None):
    """Write a PEFT adapter folder: ``adapter_config.json`` from ``config`` (``cukernels.nn.LoraConfig`` fields) and
    ``adapter_model.safetensors`` from ``tensors`` ({"<module>.lora_A.weight": array, ...}; NumPy or CuPy; in
    ``dtype`` when given, e.g. ck.bfloat16), streamed and atomic, so ``peft.PeftModel.from_pretrained(base, path)``
    loads it. ``fan_in_fan_out``: True for GPT-2's Conv1D projections (PEFT asks it there). Returns the folder."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise PeftFormatError(f"{folder}: is a file; expected a folder for the adapter")
    folder.mkdir(parents=True, exist_ok=True)
    for k in tensors:
        if not re.match(r"^.+\.lora_[AB]\.weight$", k):
            raise ValueError(f"tensors: {k!r} is not a LoRA parameter name (<module>.lora_A.weight / .lora_B.weight)")
    t = config["target_modules"]
    doc = {
        # The keys PEFT has read since 0.6 (older versions refuse keys they do not know), in its own spelling.
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True, "r": int(config["r"]),
        "lora_alpha": _int_if_whole(config["lora_alpha"]),
        "lora_dropout": float(config["lora_dropout"]), "target_modules": t if isinstance(t, str) else list(t),
        "fan_in_fan_out": bool(fan_in_fan_out), "bias": "none", "use_rslora": bool(config["use_rslora"]),
        "modules_to_save": None, "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": dict(config.get("rank_pattern") or {}),
        "alpha_pattern": {k: _int_if_whole(v) for k, v in (config.get("alpha_pattern") or {}).items()},
    }
    dt = None if dtype is None else np.dtype(dtype)
    specs = {PREFIX + k: (tuple(int(s) for s in a.shape), dt or np.dtype(a.dtype)) for k, a in tensors.items()}

    def get(key):
        a = tensors[key[len(PREFIX):]]
        return a if dt is None or a.dtype == dt else a.astype(dt)
    st.write_specs(folder / WEIGHTS, specs, get, {"format": "pt"})
    write_json(folder / CONFIG, doc)
    return folder


# ------------------------------------------------------------------------------------------------ base identity
_SAMPLES, _WINDOW = 16, 1 << 16


def base_fingerprint(path) -> str:
    """A short hex digest that identifies the weights a base model was loaded from, cheaply: a trainer checkpoint's
    own whole-file SHA-256 (its last 32 bytes); for a Hugging Face folder, SHA-256 over ``config.json``, each
    weight file's name, size and safetensors header, and 16 windows of 64 KiB spread over its data (a fine-tuned
    copy with the same shapes differs there; reading 1 MiB a file, not 16 GB). A LoRA run records it, and resuming
    or loading its adapters onto another base is refused."""
    p = Path(path)
    h = hashlib.sha256()
    if p.is_file() and p.suffix != ".safetensors":
        with open(p, "rb") as f:
            f.seek(max(0, p.stat().st_size - 32))
            h.update(b"ckpt" + f.read(32))
        return h.hexdigest()[:32]
    folder = p.parent if p.is_file() else p
    if (folder / "config.json").is_file():
        h.update((folder / "config.json").read_bytes())
    files = sorted(folder.glob("*.safetensors")) if not p.is_file() else [p]
    for wf in files:
        size = wf.stat().st_size
        h.update(f"{wf.name}:{size}".encode())
        with open(wf, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            n = min(n, size - 8, st.MAX_HEADER)
            h.update(f.read(max(0, n)))
            start, span = 8 + max(0, n), max(0, size - 8 - max(0, n))
            for i in range(_SAMPLES):
                f.seek(start + (span - _WINDOW) * i // max(1, _SAMPLES - 1) if span > _WINDOW else start)
                h.update(f.read(_WINDOW))
    return h.hexdigest()[:32]


__all__ = ["PeftFormatError", "CONFIG", "WEIGHTS", "PREFIX", "is_adapter_folder", "read_config", "read_weights",
           "read", "write", "base_fingerprint"]
