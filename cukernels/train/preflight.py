"""What a run sets up and checks before its first step: the array module, the process group, the model, and every
user error that can be found then (out_dir writable, the model fits the host's memory, the data fits the model's
vocabulary and positions), each a ConfigError naming the key."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from .. import _backend as B
from ..distributed import ProcessGroup, SingleGroup, from_environ, init_process_group
from ..generation import load_model
from ..io.peft import base_fingerprint
from ..models import model_class, resolve_pretrained
from ..nn import init_context
from ..nn.lora import lora_modules
from .config import ConfigError

__all__ = ["pick_xp", "setup_group", "build_model", "add_lora", "check_out_dir", "check_host_memory",
           "check_model_fits"]


def pick_xp(device):
    if device == "cpu" or (device == "auto" and not B.gpu_available()):
        return np
    if not B.gpu_available():
        raise ConfigError("device: gpu asked for, but CuPy sees no CUDA device (device=cpu runs the NumPy path)")
    import cupy
    return cupy


def setup_group(cfg, xp, group=None):
    """``(group, owned)``: the process group this run trains over. ``group`` given (tests: a ``FakeGroup`` rank per
    thread) is used as it is; otherwise the launcher's environment: ``WORLD_SIZE`` > 1 joins the NCCL group
    (``owned``: this run destroys it at the end) unless ``distributed: false``; one process is a world of one."""
    if group is not None:
        if cfg.distributed is False:
            raise ConfigError("distributed: false, but the run was given a process group")
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"group: expected a cukernels.distributed ProcessGroup; got {type(group).__name__}")
        if group.xp is not xp:
            raise ConfigError(f"device: the {group.backend!r} group works on {group.xp.__name__} arrays; this run "
                             f"computes on {xp.__name__} (device={cfg.device})")
        return group, False
    try:
        env = from_environ()
    except ValueError as e:
        raise ConfigError(f"distributed: the launcher's environment is not usable: {e}") from None
    if env.world_size == 1:
        return SingleGroup(xp), False
    if cfg.distributed is False:
        raise ConfigError(f"distributed: false, but this process is rank {env.rank} of {env.world_size} "
                          f"({env.source}): every rank would train alone into the same out_dir; set "
                          f"distributed: auto (or true), or start one process")
    if xp is np:
        raise ConfigError(f"distributed: {env.world_size} ranks need one GPU each (NCCL); the NumPy path has no "
                         f"multi-process backend (CPU tests run the ranks as threads: train(cfg, group=FakeGroup "
                         f"rank))")
    return init_process_group(), True


def build_model(cfg, xp):
    """``(model, note, model section)``: from the config's model section (its ``type`` picks the family), or from
    ``init_from`` (its config and weights; the section returned is the one it brings). With a ``lora`` section the
    ``init_from`` base is loaded in bf16 under autocast on the GPU (fp32 otherwise) and frozen, its adapters added
    (:func:`add_lora`)."""
    m = dict(cfg.model)
    cls = model_class(m.pop("type", "llama"))
    kw = dict(xp=xp, fused=cfg.fused, sparse_embedding=cfg.sparse_embedding)
    if not cfg.init_from:
        return cls(cls.config_class.from_dict(m), seed=cfg.seed, **kw), None, dict(cfg.model)
    if not os.path.exists(cfg.init_from):
        raise ConfigError(f"init_from: no such file or folder: {cfg.init_from}")
    lowp = cfg.lora is not None and cfg.autocast and xp is not np  # a frozen base: bf16 only, no fp32 copy ever
    model, what = load_model(cfg.init_from, xp=xp, fused=cfg.fused, dtype=B.bfloat16 if lowp else None)
    if cfg.sparse_embedding:
        model = type(model)(model.config, seed=cfg.seed, **kw).load_state_dict(model.state_dict())
    mine = model.config.to_dict()
    clash = {k: v for k, v in m.items() if k in mine and mine[k] != v}
    note = f"init_from {what}"
    if clash:
        note += " (its config overrides model." + ", model.".join(f"{k}={v!r}" for k, v in clash.items()) + ")"
    if cfg.lora is not None:
        note += "; " + add_lora(cfg, model)
    return model, note, dict(mine, type=model.model_type)


def add_lora(cfg, model):
    """The run's adapters on ``model`` (``cfg.lora``; A drawn from the run's seed), every base parameter frozen, and
    the base's identity recorded (``model.base_path``: the file or folder ``init_from`` resolved to;
    ``model.base_fingerprint``: :func:`cukernels.io.peft.base_fingerprint` of it), which checkpoints keep and a
    resume checks. Returns a note for the log. ConfigError when the targets do not fit the model."""
    try:
        lc = model.add_adapter(cfg.lora.lora_config(), seed=cfg.seed & 0x7FFFFFFF)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"lora.{e}" if str(e).startswith("target_modules") else f"lora: {e}") from None
    kind, base = resolve_pretrained(cfg.init_from)
    model.__dict__["base_path"] = str(Path(base).resolve())
    model.__dict__["base_fingerprint"] = base_fingerprint(base)
    n, total = sum(p.size for p in model.trainable_parameters()), model.num_parameters()
    return (f"LoRA r={lc.r} alpha={lc.lora_alpha:g}{' (rsLoRA)' if lc.use_rslora else ''} on "
            f"{len(lora_modules(model))} Linears: {n:,} trainable parameters ({100 * n / total:.2f} % of {total:,}), "
            f"the base frozen in {np.dtype(model.parameters()[0].dtype).name}")


def check_out_dir(cfg):
    """``out_dir`` and the checkpoint folder exist (made here) and take a file; ConfigError naming the key."""
    for key, folder in (("out_dir", cfg.out_dir), ("ckpt_dir", cfg.ckpt.folder)):
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
                pass
        except OSError as e:
            raise ConfigError(f"{key}: cannot write into {folder!r} ({e.strerror or e}); give a folder this user "
                              f"can write (out_dir=runs/NAME)") from None


def _host_memory():
    """Bytes of memory available to a new allocation (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(cfg):
    """On the NumPy path, the model's fp32 weights, gradients and AdamW moments (16 bytes a parameter) must fit the
    host's available memory (counted on an uninitialised build, which touches no memory): a run that cannot fit
    stops here with the sizes, not later through the kernel's out-of-memory killer, with no message."""
    avail = _host_memory()
    if cfg.init_from or avail is None:
        return
    m = dict(cfg.model)
    cls = model_class(m.pop("type", "llama"))
    with init_context(empty=True):
        n = cls(cls.config_class.from_dict(m), xp=np, fused=cfg.fused).num_parameters()
    need = 16 * n
    if need > avail:
        raise ConfigError(f"model: {n / 1e9:.2f}B parameters need about {need / 2**30:.1f} GiB on the CPU (fp32 "
                          f"weights, gradients and AdamW moments, before activations); {avail / 2**30:.1f} GiB are "
                          f"available: give smaller model.* sizes (the tiny config: --config tiny)")


def check_model_fits(cfg, model, train_tok, val_tok):
    """Before the first step: the data's token ids fit the vocabulary and ``seq_len`` fits the positions."""
    top = int(max(train_tok.max(), val_tok.max()))
    if top >= model.config.vocab_size:
        raise ConfigError(f"data: token id {top} does not fit model.vocab_size {model.config.vocab_size} (the "
                          f"tokenizer of data.path has more tokens than the model: raise model.vocab_size)")
    P, T = model.max_positions(), cfg.data.seq_len
    if T > P:
        field = "n_positions" if model.model_type == "gpt2" else "max_position_embeddings"
        raise ConfigError(f"seq_len: {T} tokens a sequence exceed the model's {P} positions (model.{field}); "
                          f"lower seq_len or raise model.{field}")
