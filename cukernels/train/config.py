"""The training configuration: every key, its type, its default and what it means, in one table.

A config is YAML (``--config file.yaml``, or the name of a shipped config: ``--config tiny``) plus ``key=value``
overrides (``model.hidden_size=256``, ``lr=3e-3``); :func:`load_config` merges them over the defaults and checks
everything before a run starts: an unknown or misspelled key is an error that names it and the closest key
(``max_step`` -> ``max_steps``), a wrong type or an invalid choice is a one-line error naming the key
(:class:`ConfigError`). Numbers are read as YAML 1.2 reads them (``3e-3`` is a number; YAML 1.1 made it a string).
The ``model`` section is the model family's own config (``model.type``, default ``llama``; its fields are Hugging
Face's and are checked by that config class). The resolved config is written as ``<out_dir>/config.yaml`` next to
the log.
"""
from __future__ import annotations

import copy
import dataclasses
import numbers
import os
import re
import textwrap
import types
from typing import Any, Callable, Optional

import yaml

from ..data import example_path
from ..models import REGISTRY
from ..models.base import suggest
from ..optim import WarmupCosine


class ConfigError(ValueError):
    """A training config key that is unknown, of the wrong type, or out of range."""


@dataclasses.dataclass(frozen=True)
class Key:
    default: Any
    doc: str
    kind: str = "str"               # int | float | bool | str | choice | betas | section
    choices: tuple = ()
    check: Optional[Callable] = None  # value -> error text or None
    optional: bool = False          # None allowed
    aliases: tuple = ()             # (alias, choice) pairs a choice also answers to (device: cuda -> gpu)


def _ge(lo):
    return lambda v: None if v >= lo else f"expected >= {lo}; got {v}"


def _gt(lo):
    return lambda v: None if v > lo else f"expected > {lo}; got {v}"


def _unit(v):
    return None if 0 <= v <= 1 else f"expected a number in [0, 1]; got {v}"


DATA = {
    "kind": Key("text", "text: tinyshakespeare-style UTF-8 bytes (vocab 256); llmc: an llm.c token file",
                "choice", ("text", "llmc")),
    "path": Key(None, "the text file (default: tinyshakespeare, shipped with the package) or the llm.c train token "
                      "file; relative paths are from the current folder", optional=True),
    "val_path": Key(None, "llm.c validation token file (default: the last val_fraction of the train tokens)",
                    optional=True),
    "val_fraction": Key(0.1, "fraction of the tokens held out for validation", "float",
                        check=lambda v: None if 0 < v < 1 else f"expected a number in (0, 1); got {v}"),
    "sampling": Key("sequential", "sequential: llm.c's cursor over the tokens; random: seeded windows (nanoGPT)",
                    "choice", ("sequential", "random")),
}

ZERO = {
    "wire": Key("auto", "gradient dtype on the wire for the reduce-scatter: bf16 (half the bytes), fp32, or auto "
                        "(bf16 under autocast bf16, else fp32)", "choice", ("auto", "bf16", "fp32")),
    "bucket_elems": Key(1 << 25, "elements per reduce-scatter bucket (whole parameters, closed from the last "
                                 "layer back); null: one bucket per parameter group", "int", check=_gt(0),
                        optional=True),
    "overlap": Key(True, "start each bucket's reduce-scatter as soon as the backward has finished it (autograd "
                         "gradient-ready hooks); false: reduce everything after the backward", "bool"),
    "overlap_gather": Key(True, "under bf16 autocast, all-gather the updated shadows under the next forward (each "
                                "layer waits for its own) instead of at the end of the step", "bool"),
    "sparse_exchange": Key(True, "with sparse_embedding: exchange each rank's touched rows and update them lazily, "
                                 "as one GPU does (the table's moments replicated); false: reduce and update the "
                                 "whole table densely", "bool"),
    "sm_margin": Key(0, "multiprocessors left to NCCL while collectives overlap the backward's GEMMs and the "
                        "update (cuBLAS SM target, Adam grid); 0: none", "int", check=_ge(0)),
}

LORA = {
    "r": Key(16, "adapter rank", "int", check=_gt(0)),
    "alpha": Key(32.0, "adapters add alpha / r times their product (alpha / sqrt(r) with use_rslora)", "float",
                 check=_gt(0)),
    "dropout": Key(0.0, "dropout on the adapters' input while training, in [0, 1) (0: none, no extra pass)", "float",
                   check=lambda v: None if 0 <= v < 1 else f"expected a number in [0, 1); got {v}"),
    "target_modules": Key("all-linear", "the Linears that get adapters, named as PEFT matches them: a list of module "
                                        "names ([q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]), a "
                                        "regular expression, or all-linear (every Linear but the output head)",
                          "targets"),
    "use_rslora": Key(False, "rank-stabilised scaling alpha / sqrt(r)", "bool"),
}

SCHEMA = {
    "model": Key({}, "the model family's config: model.type and that family's Hugging Face fields; a field not given "
                     "takes the family's default (LLaMA's are the 7B shape: a config gives the sizes)", "section"),
    "data": Key(None, "training data (its keys: " + ", ".join(DATA) + ")", "section"),
    "device": Key("auto", "cpu (NumPy reference path), gpu (CUDA kernels; also cuda) or auto", "choice",
                  ("cpu", "gpu", "auto"), aliases=(("cuda", "gpu"),)),
    "fused": Key(True, "kernels (true) or the composite of plain array ops (false, the baseline); "
                       "use_fused_kernel is the same key (the fused-softmax/LayerNorm write-up's name)", "bool"),
    "autocast": Key(None, "bf16: bf16 GEMMs over fp32 master weights; null: fp32", "choice", ("bf16",), optional=True),
    "fp8": Key(False, "the Linear layers' GEMMs on FP8 tensor cores (GPU of compute capability 8.9+: E4M3 inputs and "
                      "weights and gradients, per-tensor scales on the device, fp32 master weights); implies "
                      "autocast: bf16 for the rest (LM head, embedding, attention stay bf16)", "bool"),
    "fp8_scaling": Key("current", "with fp8: current (each cast scaled by the amax of the tensor it casts: an amax "
                                  "pass first), hybrid (inputs and weights by the amax their previous step's cast "
                                  "recorded, one pass; gradients current: ~2.4 % faster at the 1B shape) or delayed "
                                  "(every tensor by its previous amax; a tensor whose range jumps saturates for a "
                                  "step)", "choice", ("current", "delayed", "hybrid")),
    "fp8_head": Key(False, "with fp8: true: the fused LM head + loss runs its two gradient GEMMs in FP8 (dlogits in "
                           "E5M2; the logits and the loss stay bf16): -4.6 ms a step at the 1B shape on an H200, but "
                           "quality +0.6 % at 1B x 200 steps, +15 % on small.yaml at 2000 (docs/performance.md, FP8); "
                           "dx: only the dx GEMM (-1.9 ms, but +9.6 % on small.yaml at 2000 steps); false: both bf16",
                    "choice", (False, True, "dx")),
    "fp8_shadow": Key(False, "with fp8 on one GPU: the optimizer writes each Linear weight's E4M3 copy in its update "
                             "(scaled by the amax after the previous update) and no step casts a weight: ~1.3 ms "
                             "faster at the 1B shape; its 2000-step quality runs spread as the cast's do, but "
                             "measured worse on average (docs/performance.md, FP8); false: each step casts the bf16 "
                             "shadow under fp8_scaling", "bool"),
    "fp8_fast_accum_grad": Key(False, "with fp8: the two backward GEMMs (dx, dW) also take cuBLASLt's fast FP8 "
                                      "accumulation, as the forward does: 91.8 -> 88.6 ms a step at the 1B shape "
                                      "with fp8_scaling: hybrid on an H200, loss within 0.5 % of bf16 at the three "
                                      "quality bars (docs/performance.md, FP8); false: their sums over the tokens "
                                      "are promoted to fp32 as they go (Transformer Engine's and torchao's default)",
                               "bool"),
    "sparse_embedding": Key(False, "sparse-row embedding gradient and Adam on the touched rows only", "bool"),
    "batch_size": Key(8, "sequences per micro-batch", "int", check=_gt(0)),
    "seq_len": Key(64, "tokens per sequence", "int", check=_gt(0)),
    "total_batch_size": Key(None, "tokens per optimizer step (a multiple of batch_size * seq_len; gradient "
                                  "accumulation makes up the rest); default batch_size * seq_len", "int",
                            check=_gt(0), optional=True),
    "max_steps": Key(100, "optimizer steps", "int", check=_ge(0)),
    "lr_decay_steps": Key(None, "length of the lr schedule (warmup + cosine) in steps; null: max_steps, and on "
                                "--resume the checkpoint's length, so a raised max_steps continues at the final lr "
                                "instead of stretching the cosine (the lr never rises again unasked)", "int",
                          check=_ge(1), optional=True),
    "lr": Key(1e-3, "peak learning rate (linear warmup, then cosine decay)", "float", check=_ge(0)),
    "min_lr_ratio": Key(0.1, "the cosine ends at lr * min_lr_ratio", "float", check=_unit),
    "warmup_steps": Key(10, "linear warmup steps", "int", check=_ge(0)),
    "weight_decay": Key(0.1, "AdamW decoupled weight decay (not on 1-D parameters: norms, biases)", "float",
                        check=_ge(0)),
    "betas": Key([0.9, 0.95], "AdamW betas, each in [0, 1)", "betas"),
    "eps": Key(1e-8, "AdamW epsilon", "float", check=_gt(0)),
    "grad_clip": Key(1.0, "clip the global gradient norm to this (0: no clipping)", "float", check=_ge(0)),
    "grad_dtype": Key("float32", "gradient buffers: float32, or bfloat16 under autocast (the weight-gradient GEMMs "
                                 "write bf16, as autocast's do; half the gradient bytes; one micro-batch a step, "
                                 "one GPU)", "choice", ("float32", "bfloat16")),
    "eval_every": Key(50, "validation loss every N steps and at the end (0: never)", "int", check=_ge(0)),
    "eval_steps": Key(4, "validation batches per evaluation", "int", check=_gt(0)),
    "log_every": Key(10, "log a train line every N steps", "int", check=_gt(0)),
    "seed": Key(1337, "initialisation and data-sampling seed", "int"),
    "out_dir": Key("runs/llama", "run folder: log.jsonl, config.yaml, loss.png, checkpoints/"),
    "log_format": Key("jsonl", "log file format", "choice", ("jsonl", "csv")),
    "plot": Key(True, "draw loss.png at the end (needs matplotlib: pip install '.[train]')", "bool"),
    "progress": Key("auto", "console: a progress bar on a terminal, plain lines when piped (auto)", "choice",
                    ("auto", "bar", "lines")),
    "sample_chars": Key(200, "bytes of text generated at the end of a run on text data (0: none)", "int",
                        check=_ge(0)),
    "graph": Key(False, "replay each step from one captured CUDA graph (GPU, fused)", "bool"),
    "recompute": Key("none", "activation recompute per block, for long sequences: none (keep every activation), "
                             "attention (the attention sub-block runs again in the backward), full (each block keeps "
                             "only its input and runs its forward again in the backward: at the 1B shape ~1/10 of the "
                             "activation memory for ~1.2x the step time)", "choice", ("none", "attention", "full")),
    "ckpt_every": Key(0, "save a checkpoint every N steps (0: only at the end)", "int", check=_ge(0)),
    "ckpt_final": Key(True, "save a checkpoint at the end", "bool"),
    "ckpt_dir": Key(None, "checkpoint folder (default <out_dir>/checkpoints)", optional=True),
    "keep_last": Key(3, "keep the N newest checkpoints (0: all)", "int", check=_ge(0)),
    "resume": Key(None, "a checkpoint file, a folder of them, or 'latest' (newest in ckpt_dir)", optional=True),
    "init_from": Key(None, "initial weights: a Hugging Face folder or a trainer checkpoint", optional=True),
    "lora": Key(None, "LoRA fine-tuning of init_from (its keys: " + ", ".join(LORA) + "): the base frozen (bf16 "
                      "under autocast: no fp32 copy, gradients or moments), only the adapters trained and "
                      "checkpointed, <out_dir>/adapter/ written in PEFT's format; null: full fine-tune", "section",
                optional=True),
    "distributed": Key("auto", "data parallel over the ranks of a launcher (python -m cukernels.run, torchrun, "
                               "srun) with ZeRO-1 sharded AdamW: true, false, or auto (on when WORLD_SIZE > 1). "
                               "batch_size is per rank; total_batch_size counts every rank", "tristate"),
    "zero": Key(None, "ZeRO-1 optimizer settings under distributed (its keys: " + ", ".join(ZERO) + ")", "section"),
}

# Keys that may differ between a checkpoint and the run resuming it without touching the trajectory.
# (max_steps: the schedule's length is lr_decay_steps, kept from the checkpoint unless the config sets it.)
RESUME_FREE = {"out_dir", "ckpt_dir", "ckpt_every", "ckpt_final", "keep_last", "resume", "log_every", "log_format",
               "plot", "eval_every", "eval_steps", "progress", "sample_chars", "distributed", "max_steps",
               "lr_decay_steps", "recompute"}
# zero settings that do not change the arithmetic of a step (the wire dtype does)
ZERO_RESUME_FREE = {"bucket_elems", "overlap", "overlap_gather"}


def defaults() -> dict:
    cfg = {k: copy.deepcopy(v.default) for k, v in SCHEMA.items()}
    cfg["data"] = {k: v.default for k, v in DATA.items()}
    cfg["zero"] = {k: v.default for k, v in ZERO.items()}
    cfg["model"] = {}
    return cfg


def _model_fields(width=116) -> list:
    """``model.<field>`` of every registered family, with its defaults (the Hugging Face config fields)."""
    out = [f"  model.{'type':10s} {repr('llama'):>14}  the model family: {', '.join(sorted(REGISTRY))}; then its "
           f"fields (Hugging Face names) and their defaults:"]
    for mt in sorted(REGISTRY):
        cls = REGISTRY[mt].config_class
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
        out += textwrap.wrap(fields, width, initial_indent=f"    {mt}: ", subsequent_indent="      ")
    return out


def describe() -> str:
    """Every key with its default and meaning, the model fields of each family included (the trainer's
    ``--help``; docs/training.md's table)."""
    out = []
    for k, v in SCHEMA.items():
        out.append(f"{k:18s} {v.default!r:>14}  {v.doc}")
        if k == "model":
            out += _model_fields()
        if k == "data":
            out += [f"  data.{dk:11s} {dv.default!r:>14}  {dv.doc}" for dk, dv in DATA.items()]
        if k == "zero":
            out += [f"  zero.{zk:11s} {zv.default!r:>14}  {zv.doc}" for zk, zv in ZERO.items()]
        if k == "lora":
            out += [f"  lora.{lk:11s} {lv.default!r:>14}  {lv.doc}" for lk, lv in LORA.items()]
    return "\n".join(out)


def _check(path, spec: Key, v):
    if v is None:
        if spec.optional:
            return None
        raise ConfigError(f"{path}: expected {spec.kind if spec.kind != 'choice' else 'one of ' + str(list(spec.choices))}"
                          f"; got null")
    if spec.kind == "int":
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise ConfigError(f"{path}: expected an integer; got {v!r}")
    elif spec.kind == "float":
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ConfigError(f"{path}: expected a number; got {v!r}")
        v = float(v)
        if v != v or v in (float("inf"), float("-inf")):
            raise ConfigError(f"{path}: expected a finite number; got {v!r}")
    elif spec.kind == "bool":
        if not isinstance(v, bool):
            raise ConfigError(f"{path}: expected true or false; got {v!r}")
    elif spec.kind == "choice":
        v = dict(spec.aliases).get(v, v) if isinstance(v, str) else v
        # (type-exact: fp8_head's choices mix true / false with "dx", and 1 == True)
        if not any(type(v) is type(c) and v == c for c in spec.choices):
            opts = [str(c).lower() if isinstance(c, bool) else c for c in spec.choices] + (["null"] if spec.optional
                                                                                           else [])
            names = [c for c in spec.choices if isinstance(c, str)]
            hint = suggest(v, names) if isinstance(v, str) else ""
            raise ConfigError(f"{path}: expected one of {opts}; got {v!r}{hint}")
    elif spec.kind == "tristate":
        if isinstance(v, str) and v.lower() in ("true", "false", "auto"):
            v = {"true": True, "false": False, "auto": "auto"}[v.lower()]
        if not (v is True or v is False or v == "auto"):
            raise ConfigError(f"{path}: expected true, false or auto; got {v!r}")
    elif spec.kind == "betas":
        if (not isinstance(v, (list, tuple)) or len(v) != 2
                or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 <= b < 1 for b in v)):
            raise ConfigError(f"{path}: expected two numbers in [0, 1), e.g. [0.9, 0.95]; got {v!r}")
        v = [float(b) for b in v]
    elif spec.kind == "targets":
        ok_list = isinstance(v, (list, tuple)) and v and all(isinstance(t, str) and t for t in v)
        if not (ok_list or (isinstance(v, str) and v)):
            raise ConfigError(f"{path}: expected a list of module names (e.g. [q_proj, v_proj]), a regular "
                              f"expression or all-linear; got {v!r}")
        v = list(v) if ok_list else v
    elif spec.kind == "str":
        if not isinstance(v, (str, os.PathLike)):
            raise ConfigError(f"{path}: expected a string (a path or name); got {v!r}")
        v = str(v)
    if spec.check is not None and spec.kind in ("int", "float"):
        err = spec.check(v)
        if err:
            raise ConfigError(f"{path}: {err}")
    return v


def _check_model(m):
    if not isinstance(m, dict):
        raise ConfigError(f"model: expected a mapping of model config fields; got {m!r}")
    m = dict(m)
    mt = m.pop("type", m.pop("model_type", "llama"))
    if mt not in REGISTRY:
        raise ConfigError(f"model.type: expected one of {sorted(REGISTRY)}; got {mt!r}{suggest(mt, REGISTRY)}")
    cls = REGISTRY[mt].config_class
    names = cls.field_names()
    for k in m:
        if k not in names:
            raise ConfigError(f"model.{k}: unknown key for model.type {mt}{suggest(k, names)}")
    try:
        cls.from_dict(m)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model: {e}") from None
    return dict(m, type=mt)


ALIASES = {"use_fused_kernel": "fused"}


def validate(cfg: dict) -> dict:
    """Check every key of a merged config; returns the normalised config (ints, floats, lists)."""
    out = {}
    cfg = dict(cfg)
    for alias, key in ALIASES.items():
        if alias in cfg:
            cfg[key] = cfg.pop(alias)
    for k, v in cfg.items():
        if k not in SCHEMA:
            raise ConfigError(f"{k}: unknown config key{suggest(k, SCHEMA)}")
    for k, spec in SCHEMA.items():
        v = cfg.get(k, spec.default)
        if k in ("data", "zero"):
            table = DATA if k == "data" else ZERO
            v = {} if v is None else v
            if not isinstance(v, dict):
                raise ConfigError(f"{k}: expected a mapping; got {v!r}")
            for dk in v:
                if dk not in table:
                    raise ConfigError(f"{k}.{dk}: unknown config key{suggest(dk, table)}")
            out[k] = {dk: _check(f"{k}.{dk}", ds, v.get(dk, ds.default)) for dk, ds in table.items()}
        elif k == "lora":
            if v is not None and not isinstance(v, dict):
                raise ConfigError(f"lora: expected a mapping of LoRA keys ({', '.join(LORA)}) or null; got {v!r}")
            for lk in v or {}:
                if lk not in LORA:
                    raise ConfigError(f"lora.{lk}: unknown config key{suggest(lk, LORA)}; the lora keys are "
                                      f"{', '.join(LORA)}")
            out[k] = None if v is None else {lk: _check(f"lora.{lk}", ls, v.get(lk, ls.default))
                                             for lk, ls in LORA.items()}
        elif k == "model":
            out[k] = _check_model(v)
        else:
            out[k] = _check(k, spec, v)
    B, T = out["batch_size"], out["seq_len"]
    tbs = out["total_batch_size"]
    if tbs is not None and tbs % (B * T):
        raise ConfigError(f"total_batch_size: {tbs} is not a multiple of batch_size * seq_len = {B * T}")
    if out["fp8"]:
        if not out["fused"]:
            raise ConfigError("fp8: needs fused: true (the FP8 GEMMs are the fused Linear layers'; the composite "
                              "baseline has none)")
        out["autocast"] = "bf16"  # everything but the Linear GEMMs runs as under bf16 autocast
    elif out["fp8_head"]:
        raise ConfigError("fp8_head: runs the LM head's gradient GEMMs in FP8; set fp8: true with it, or remove it")
    elif out["fp8_fast_accum_grad"]:
        raise ConfigError("fp8_fast_accum_grad: applies to the FP8 GEMMs' backward; set fp8: true with it, or "
                          "remove it")
    elif out["fp8_shadow"]:
        raise ConfigError("fp8_shadow: keeps FP8 copies of the Linear weights for FP8 GEMMs; set fp8: true with it, "
                          "or remove it")
    elif out["fp8_scaling"] != "current":
        raise ConfigError(f"fp8_scaling: {out['fp8_scaling']!r} applies to FP8 GEMMs only; set fp8: true with it, "
                          "or remove it")
    if out["grad_dtype"] == "bfloat16":
        if out["autocast"] != "bf16" or not out["fused"]:
            raise ConfigError("grad_dtype: bfloat16 needs autocast: bf16 and fused: true (bf16 weight gradients "
                              "come from the bf16 GEMMs into the fused optimizer's buffers)")
    if out["lora"] is not None:
        if not out["init_from"]:
            raise ConfigError("lora: needs init_from, the base model the adapters fine-tune (a Hugging Face folder "
                              "or a trainer checkpoint); lora: null trains every weight")
        if out["sparse_embedding"]:
            raise ConfigError("sparse_embedding: the embedding is frozen under lora (it has no gradient); set "
                              "sparse_embedding: false")
    return out


def check_world(cfg, world_size: int):
    """The checks that depend on the number of ranks (``cfg``: a validated config dict or a :class:`TrainConfig`):
    ``total_batch_size`` (every rank's tokens per step) must be a multiple of ``batch_size * seq_len *
    world_size``; across ranks the optimizer is the fused one, and bf16 gradient buffers go on a bf16 wire. Returns
    ``(total_batch_size, micro-batches per rank and step)``; ConfigError otherwise. The default total is one
    micro-batch per rank."""
    if isinstance(cfg, TrainConfig):
        cfg = cfg.as_dict()
    B, T = cfg["batch_size"], cfg["seq_len"]
    tbs = cfg["total_batch_size"] or B * T * world_size
    if tbs % (B * T * world_size):
        raise ConfigError(f"total_batch_size: {tbs} tokens per step are not a multiple of batch_size * seq_len * "
                          f"{world_size} ranks = {B * T * world_size}")
    accum = tbs // (B * T * world_size)
    if cfg.get("grad_dtype") == "bfloat16" and accum > 1:
        ranks = f" * {world_size} ranks" if world_size > 1 else ""
        raise ConfigError(f"grad_dtype: bfloat16 needs one micro-batch a step (total_batch_size = batch_size * "
                          f"seq_len{ranks} = {B * T * world_size}; got {tbs}): accumulating in bf16 would round "
                          f"every micro-batch; set grad_dtype: float32 to accumulate")
    if world_size > 1 and not cfg["fused"]:
        raise ConfigError("distributed: needs fused: true (the sharded AdamW shards the fused optimizer's flat "
                          "buffers; the composite optimizer keeps one process's state)")
    if world_size > 1 and cfg.get("grad_dtype") == "bfloat16" and zero_wire(cfg) != "bf16":
        raise ConfigError("grad_dtype: bfloat16 sends the bf16 gradient buffers as they are; set zero.wire: bf16 "
                          "(or auto) with it, or grad_dtype: float32 for an fp32 wire")
    return tbs, accum


def zero_wire(cfg) -> str:
    """``zero.wire`` resolved: ``auto`` is bf16 under bf16 autocast, else fp32."""
    w = cfg["zero"]["wire"]
    return ("bf16" if cfg["autocast"] else "fp32") if w == "auto" else w


def lr_schedule(lr, steps, warmup_steps, min_lr_ratio):
    """The run's lr schedule: linear warmup to ``lr`` over ``warmup_steps`` (at most ``steps``), then cosine down to
    ``lr * min_lr_ratio`` at ``steps`` (``lr_decay_steps``, default ``max_steps``), held there after -- computed on
    the device by the fused optimizer's step, on the host by the composite one and for the log."""
    return WarmupCosine(lr, steps, min(warmup_steps, steps), lr * min_lr_ratio)


def schedule_steps(cfg) -> int:
    """The schedule's length of a config dict: ``lr_decay_steps``, else ``max_steps``."""
    return cfg.get("lr_decay_steps") or cfg["max_steps"]


def lr_at(step, cfg):
    """The lr of step ``step`` (0-based: the optimizer's step ``t = step + 1``) under ``cfg``'s schedule (a config
    dict with lr, max_steps, warmup_steps, min_lr_ratio and optionally lr_decay_steps)."""
    return float(lr_schedule(cfg["lr"], schedule_steps(cfg), cfg["warmup_steps"], cfg["min_lr_ratio"]).lr_at(step + 1))


# ---------------------------------------------------------------------------------------------- typed sections
def _section(cls, d, **renamed):
    """A frozen section built from a dict's keys (``renamed``: field -> key)."""
    return cls(**{f.name: d[renamed.get(f.name, f.name)] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What the data loaders are built from: the ``data`` section plus the batch shape and the seed."""

    kind: str
    path: Optional[str]
    val_path: Optional[str]
    val_fraction: float
    sampling: str
    batch_size: int
    seq_len: int
    seed: int


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """The ``zero`` section: what several ranks add to the optimizer (no effect in a world of one)."""

    wire: str  # resolved: bf16 or fp32
    bucket_elems: Optional[int]
    overlap: bool
    overlap_gather: bool
    sparse_exchange: bool
    sm_margin: int


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """What the optimizer, its schedule and the clipping are built from."""

    fused: bool
    lr: float
    betas: tuple
    eps: float
    weight_decay: float
    grad_clip: float
    grad_dtype: str
    warmup_steps: int
    min_lr_ratio: float
    max_steps: int
    lr_decay_steps: Optional[int]
    autocast: bool
    zero: ZeroConfig
    fp8_shadow: bool = False  # fp8 and fp8_shadow: AdamW(fp8_shadows=True) on one rank

    def schedule(self):
        """The lr schedule of these keys (:func:`lr_schedule`; its length ``lr_decay_steps`` or ``max_steps``)."""
        return lr_schedule(self.lr, self.lr_decay_steps or self.max_steps, self.warmup_steps, self.min_lr_ratio)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and when checkpoints are written, and which one a run resumes from."""

    folder: str
    every: int
    final: bool
    keep_last: int
    resume: Optional[str]


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """The ``lora`` section: the adapters the trainer adds to ``init_from`` (``cukernels.nn.LoraConfig``'s fields
    under the config's shorter names)."""

    r: int
    alpha: float
    dropout: float
    target_modules: Any  # a tuple of names, or a string (a regex, all-linear)
    use_rslora: bool

    def lora_config(self):
        """The ``cukernels.nn.LoraConfig`` of this section."""
        from ..nn.lora import LoraConfig
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules, use_rslora=self.use_rslora)


def _lora_section(c):
    lo = c.get("lora")
    if not lo:
        return None
    t = lo["target_modules"]
    return LoraSection(lo["r"], lo["alpha"], lo["dropout"], tuple(t) if isinstance(t, list) else t, lo["use_rslora"])


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A validated config as typed sections, built once (:meth:`from_dict`) and handed to the parts; frozen. The
    model section is the model family's own fields (a read-only mapping); :meth:`as_dict` gives the config as
    validated (what ``config.yaml`` and a checkpoint keep)."""

    model: Any
    data: DataConfig
    optim: OptimConfig
    ckpt: CheckpointConfig
    device: str
    fused: bool
    autocast: bool
    sparse_embedding: bool
    graph: bool
    seed: int
    init_from: Optional[str]
    distributed: Any
    max_steps: int
    eval_every: int
    eval_steps: int
    log_every: int
    out_dir: str
    log_format: str
    plot: bool
    progress: str
    sample_chars: int
    recompute: str = "none"
    fp8: bool = False
    fp8_scaling: str = "current"
    fp8_head: Any = False  # False, True or "dx"
    fp8_fast_accum_grad: bool = False
    lora: Any = None  # a LoraSection, or None (full fine-tune)
    _source: Any = dataclasses.field(repr=False, compare=False, default=None)

    @classmethod
    def from_dict(cls, cfg: dict) -> "TrainConfig":
        c = copy.deepcopy(dict(cfg))
        zero = ZeroConfig(**dict(c["zero"], wire=zero_wire(c)))
        optim = _section(OptimConfig, dict(c, betas=tuple(c["betas"]), autocast=bool(c["autocast"]), zero=zero,
                                           fp8_shadow=bool(c["fp8"] and c["fp8_shadow"])))
        ckpt = CheckpointConfig(c["ckpt_dir"] or os.path.join(c["out_dir"], "checkpoints"), c["ckpt_every"],
                                c["ckpt_final"], c["keep_last"], c["resume"])
        top = {f.name: c[f.name] for f in dataclasses.fields(cls) if f.name in c and f.name not in ("model", "data")}
        return cls(model=types.MappingProxyType(dict(c["model"])), data=_section(DataConfig, dict(c["data"], **c)),
                   optim=optim, ckpt=ckpt, **dict(top, autocast=bool(c["autocast"]), lora=_lora_section(c)), _source=c)

    def with_model(self, model: dict) -> "TrainConfig":
        """The same config with another model section (``init_from``'s resolved one): a new object."""
        return dataclasses.replace(self, model=types.MappingProxyType(dict(model)),
                                   _source=dict(self._source, model=dict(model)))

    def with_keys(self, **keys) -> "TrainConfig":
        """The same config with these top-level keys changed (already checked values): a new object."""
        return TrainConfig.from_dict(dict(self._source, **keys))

    def as_dict(self) -> dict:
        """The config as validated (a fresh copy), the model section as resolved."""
        return copy.deepcopy(self._source)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading numbers as YAML 1.2 does: ``3e-3`` and ``1e5`` (no dot) are floats, not the
    strings YAML 1.1 makes of them."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def read_yaml(text):
    """YAML text (or an open file) as Python values, numbers as YAML 1.2 reads them (:class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _parse_override(o):
    if "=" not in o:
        raise ConfigError(f"override {o!r}: expected key=value (e.g. max_steps=500)")
    k, v = o.split("=", 1)
    try:
        v = read_yaml(v) if v.strip() else None
    except yaml.YAMLError:
        v = v.strip()  # not YAML (an unbalanced bracket, ...): the string, checked against the key's type
    return k.strip(), v


def shipped_configs() -> dict:
    """``{name: path}`` of the example configs (``tiny``, ``small``, ...) shipped with the package or in the
    checkout's ``examples/configs/``."""
    folder = example_path("configs")
    return {p.stem: str(p) for p in sorted(folder.glob("*.yaml"), key=lambda p: p.stem)} if folder.is_dir() else {}


def config_path(name) -> str:
    """The file ``--config`` names: a path, or the name of a shipped config (``tiny``, ``small.yaml``)."""
    if os.path.isfile(name):
        return name
    known = shipped_configs()
    stem = os.path.basename(str(name))[:-5] if str(name).endswith(".yaml") else str(name)
    if os.sep not in str(name).rstrip(os.sep) and stem in known:
        return known[stem]
    raise ConfigError(f"--config {name}: no such file; a path to a YAML file or one of the shipped configs: "
                      f"{', '.join(known) or '(none found)'}")


def load_config(path=None, overrides=()) -> dict:
    """Defaults <- the YAML file (a path, or a shipped config's name: ``tiny``) <- ``key=value`` overrides,
    checked (ConfigError names the key)."""
    cfg = defaults()
    if path:
        path = config_path(path)
        with open(path) as f:
            try:
                user = read_yaml(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
        if not isinstance(user, dict):
            raise ConfigError(f"--config {path}: expected a mapping of keys; got {type(user).__name__}")
        for k, v in user.items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
    for o in overrides:
        k, v = _parse_override(o)
        d = cfg
        *parents, leaf = k.split(".")
        for p in parents:
            if p not in d:
                raise ConfigError(f"{k}: unknown config key{suggest(p, SCHEMA)}")
            if d is cfg and d[p] is None and SCHEMA[p].kind == "section":
                d[p] = {}  # a null section given a key (lora.r=8 turns LoRA on)
            if not isinstance(d[p], dict):
                raise ConfigError(f"{k}: {p} is not a section")
            d = d[p]
        d[leaf] = v
    return validate(cfg)


def save_yaml(cfg: dict, path):
    from ..io.atomic import atomic_open
    with atomic_open(path, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
