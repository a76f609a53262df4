"""Training checkpoints in one format, written by :func:`save` and read by :func:`load` (every rank calls both).

The checkpoint of step N in the checkpoint folder (``ckpt_dir``, default ``<out_dir>/checkpoints``):

* ``step_<N>.ckpt``, written by rank 0 in ``cukernels.io.checkpoint``'s training schema (atomic, streamed tensor by
  tensor, whole-file SHA-256): the gathered fp32 model (``model/<name>``), rank 0's optimizer state
  (``optim/<name>/exp_avg``, ``/exp_avg_sq``: its slices of the moments, the parameters' own shapes in a world of
  one; ``meta["optimizer"]``: step, lr, hyperparameters, world size and each parameter's element range), rank 0's
  running loss and the dropout stream's position (``train/``), the loader's state (cursor or sampler RNG), the
  log, the config, and ``meta["zero"] = {"world_size": W, "shards": [the file of each rank's state]}`` (rank 0's:
  this file);
* ``step_<N>.rank<r>-of-<W>.zero`` for every other rank r (the same container): its optimizer slices and its
  running loss.

A LoRA run (a ``lora`` section) keeps only its adapters under ``model/`` (``<module>.lora_A.weight``, ...) and their
moments, and ``meta["lora"] = {"config": the LoraConfig, "base": {"path", "fingerprint"}}``: the frozen base is
re-read from ``init_from`` (:func:`load` refuses a base whose weights differ from the recorded fingerprint, and a
checkpoint of the other kind), so a checkpoint of the LLaMA-3.2-1B shape at r = 16 is ~0.2 GB, not 18.

So one process writes one file and W ranks W files; nothing is gathered on one host but the model, which every
rank holds anyway (bf16 shadows are re-derived on load). Rank 0 writes its file last, after a barrier, so a
checkpoint is complete only once every file it names exists (:func:`is_complete`); :func:`latest` and
:func:`prune` consider complete checkpoints only. The folder must be shared by every rank.

:func:`load` checks everything before anything is written -- the main file and every shard it names (checksums;
the model's type, config, names, shapes and dtypes; the slices tiling every parameter at one step) -- then loads
the model, the optimizer (each rank keeps its own slices, so a checkpoint resumes on any number of ranks), the
loader, the dropout stream and the running loss. Earlier files load too: a one-process checkpoint (moments whole in
the main file, no ``zero`` meta) is a world of one; a ZeRO checkpoint before issue 34 names a file of rank 0's
own.
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import numpy as np

from ..io import checkpoint as C
from ..models import LORA_META
from ..nn.lora import load_lora_state_dict, lora_state_dict
from ..optim.zero import SHARD_KIND, SHARD_KINDS, consolidate_state, make_shard
from .config import RESUME_FREE, ZERO_RESUME_FREE, lr_schedule, schedule_steps
from .config import defaults as config_defaults

SHARD_RE = re.compile(r"^step_(\d+)\.rank(\d+)-of-(\d+)\.zero$")
MAIN_RE = re.compile(r"^step_(\d+)\.ckpt$")
ZERO_META = "zero"
_ADAMW_FAMILY = {"AdamW", "ZeroAdamW"}  # the same update; the state moves between them exactly


def shard_path(folder, step, rank, world_size) -> Path:
    """``<folder>/step_<step, 8 digits>.rank<rank>-of-<world_size>.zero``."""
    return Path(folder) / f"step_{int(step):08d}.rank{int(rank)}-of-{int(world_size)}.zero"


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


# ------------------------------------------------------------------------------------------------ save
def _shard_meta(shard):
    """The meta of one rank's optimizer state: everything but its arrays."""
    return {"rank": int(shard["rank"]), "world_size": int(shard["world_size"]), "step": int(shard["step"]),
            "lr": float(shard["lr"]), "betas": [float(b) for b in shard["betas"]], "eps": float(shard["eps"]),
            "weight_decay": float(shard["weight_decay"]),
            "params": {n: {"shape": [int(x) for x in e["shape"]], "start": int(e["start"]), "stop": int(e["stop"])}
                       for n, e in shard["state"].items()}}


class _Adapters:
    """What a LoRA run's checkpoint keeps of its model (for ``io.checkpoint.save_training``): the adapters only."""

    def __init__(self, model):
        self.model_type, self.config, self._model = model.model_type, model.config, model

    def state_dict(self):
        return lora_state_dict(self._model)


def _model_state(model):
    """``{name: array}`` a checkpoint holds of ``model``: its adapters under LoRA, else every parameter."""
    return lora_state_dict(model) if model.has_adapter() else model.state_dict()


def _lora_meta(model):
    return {"config": model.lora_config.to_dict(),
            "base": {"path": model.base_path, "fingerprint": model.__dict__.get("base_fingerprint")}}


def save(run, step, log_rows, loss_acc, n_acc) -> Path:
    """Write the checkpoint after ``step`` completed optimizer steps and prune old ones; returns the main file's
    path. Every rank calls it (collectives inside): the fp32 parameters gathered, each rank's optimizer state and
    running loss (``loss_acc`` over ``n_acc`` micro-batches) in its file, the main file last."""
    cfg, opt, rank, world = run.cfg, run.opt, run.rank, run.world
    folder = Path(cfg.ckpt.folder)
    opt.gather_params()
    shard = opt.state_dict(copy=False)
    own = {"loss_acc": np.asarray(_host(loss_acc), np.float32).reshape(())} if n_acc else {}
    main = C.step_path(folder, step)
    names = [main.name] + [shard_path(folder, step, r, world).name for r in range(1, world)]
    if rank > 0:
        arrays = {f"{C.OPTIM_PREFIX}{n}/{k}": e[k] for n, e in shard["state"].items()
                  for k in ("exp_avg", "exp_avg_sq")}
        arrays.update({C.TRAIN_PREFIX + k: a for k, a in own.items()})
        C.save(folder / names[rank], arrays, dict(_shard_meta(shard), kind=SHARD_KIND))
    run.group.barrier()  # each rank renamed its file into place before arriving here
    if rank > 0:
        return main
    missing = [n for n in names[1:] if not (folder / n).is_file()]
    if missing:
        raise C.CheckpointError(f"{folder}: rank 0 does not see the optimizer shard(s) {missing} that the other "
                                f"ranks wrote; the checkpoint folder (ckpt_dir) must be shared by every rank")
    drng = getattr(run.model, "dropout_rng", None)
    if drng is not None:  # the dropout stream's position: a resumed run draws the masks this one would have
        own["dropout_offset"] = drng.offset
    meta = {"step": int(step), "config": {k: v for k, v in cfg.as_dict().items() if k != "resume"},
            "loader": run.train_loader.state_dict(), "n_acc": int(n_acc) * world, "log": log_rows,
            "optimizer": _shard_meta(shard), ZERO_META: {"world_size": world, "shards": names}}
    model = run.model
    if cfg.lora is not None:
        meta[LORA_META] = _lora_meta(model)
        model = _Adapters(model)
    path = C.save_training(main, model=model, optimizer_state=dict(shard, kind=type(opt).__name__), meta=meta,
                           extra_arrays=own)
    prune(folder, cfg.ckpt.keep_last)
    return path


# ------------------------------------------------------------------------------------------------ load
def resolve(resume, folder):
    """The checkpoint file ``resume`` names: a path, a folder of checkpoints (or a run folder), or ``latest`` (the
    newest complete one in ``folder``); None when it is empty."""
    if not resume:
        return None
    if str(resume) == "latest":
        p = latest(folder)
        if p is None:
            raise C.CheckpointError(f"--resume latest: no step_*.ckpt checkpoint in {folder} (complete: with every "
                                    f"optimizer shard it names)")
        return p
    if os.path.isdir(resume):
        p = latest(resume) or latest(os.path.join(resume, "checkpoints"))
        if p is None:
            raise C.CheckpointError(f"--resume {resume}: no complete step_*.ckpt checkpoint in that folder")
        return p
    return Path(resume)


def _shard(path, arrays, meta, model):
    """``(one rank's state in cukernels.optim's format, its train/ arrays)`` from a file's arrays and meta; the
    fp32 values are the main file's model (the same numbers: it was gathered). A one-process file of before issue
    34 has no ranges: a world of one, every moment whole."""
    try:
        ranges = meta.get("params") or {k[len(C.OPTIM_PREFIX):].rsplit("/", 1)[0]: None for k in arrays
                                        if k.startswith(C.OPTIM_PREFIX)}
        state = {}
        for n, r in ranges.items():
            m = arrays[f"{C.OPTIM_PREFIX}{n}/exp_avg"]
            shape, lo, hi = (r["shape"], int(r["start"]), int(r["stop"])) if r else (list(m.shape), 0, m.size)
            state[n] = {"shape": list(shape), "start": lo, "stop": hi, "exp_avg": m,
                        "exp_avg_sq": arrays[f"{C.OPTIM_PREFIX}{n}/exp_avg_sq"],
                        "param": model[n].reshape(-1)[lo:hi] if n in model else np.zeros(hi - lo, np.float32)}
        shard = make_shard(meta.get("rank", 0), meta.get("world_size", 1), meta["step"], meta["lr"],
                           meta.get("betas") or (), meta.get("eps") or 0.0, meta.get("weight_decay") or 0.0, state)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise C.CheckpointError(f"{path}: malformed optimizer state ({type(e).__name__}: {e})") from None
    return shard, C.train_arrays(arrays)


def read_shards(main_path, arrays, meta):
    """Every rank's ``(state, train arrays)`` of a checkpoint, in rank order, each file verified (memory-mapped);
    CheckpointError naming the missing or disagreeing file."""
    model = C.model_arrays(arrays)
    z = meta.get(ZERO_META) if isinstance(meta.get(ZERO_META), dict) else {"world_size": 1, "shards": [None]}
    main_path = Path(main_path)
    out = []
    for r, name in enumerate(z["shards"]):
        if name in (None, main_path.name):  # rank 0's state is in the main file
            out.append(_shard(main_path, arrays, meta["optimizer"], model))
            continue
        p = main_path.parent / name
        if not p.is_file():
            raise C.CheckpointError(f"{main_path}: its optimizer shard {p} is missing (every rank's shard is needed; "
                                    f"the checkpoint folder must be shared by all ranks)")
        sa, sm = C.load(p)
        if sm.get("kind") not in SHARD_KINDS:
            raise C.CheckpointError(f"{p}: not an optimizer shard (kind {sm.get('kind')!r})")
        out.append(_shard(p, sa, sm, model))
        sh = out[-1][0]
        if sh["rank"] != r or sh["world_size"] != z["world_size"] or sh["step"] != meta["step"]:
            raise C.CheckpointError(f"{p}: shard of rank {sh['rank']} of {sh['world_size']} at step {sh['step']}; "
                                    f"{main_path} expects rank {r} of {z['world_size']} at step {meta['step']}")
    return out


class _Like:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)


def _check(path, arrays, meta, shards, run):
    """Everything that must hold before anything is written: the model's type, config and arrays; every shard's
    moments (names, shapes, fp32) and their slices tiling every parameter at one step."""
    if meta["model_type"] != run.model.model_type:
        raise C.CheckpointError(f"{path}: a {meta['model_type']} checkpoint; this run trains {run.model.model_type}")
    mine, theirs = run.model.config.to_dict(), meta["model_config"]
    diff = [f"{k}: {theirs.get(k)!r} in the file, {mine.get(k)!r} in this run" for k in mine
            if theirs.get(k) != mine.get(k)]
    if diff:
        raise C.CheckpointError(f"{path}: model config does not match this run: " + "; ".join(diff))
    _check_lora(path, meta, run)
    C.check_compatible(path, C.model_arrays(arrays), _model_state(run.model), "model")
    want = {f"{n}/{k}": _Like(p.data.shape, np.float32) for n, p in run.model.named_trainable_parameters()
            for k in ("exp_avg", "exp_avg_sq")}
    for shard, _ in shards:
        C.check_compatible(path, {f"{n}/{k}": _Like(e["shape"], e[k].dtype) for n, e in shard["state"].items()
                                  for k in ("exp_avg", "exp_avg_sq")}, want, "optimizer")
    try:
        consolidate_state([sh for sh, _ in shards], lazy=True)  # slices tile every parameter, one step
    except ValueError as e:
        raise C.CheckpointError(f"{path}: its optimizer shards disagree: {e}") from None


def _check_lora(path, meta, run):
    """A LoRA checkpoint resumes a LoRA run on the same base weights, a full one a full run."""
    mine, theirs = run.cfg.lora is not None, isinstance(meta.get(LORA_META), dict)
    if mine != theirs:
        what = ("a LoRA run's checkpoint (adapters only); this run trains every weight (lora: null)" if theirs else
                "a full fine-tune's checkpoint; this run trains LoRA adapters (a lora section)")
        raise C.CheckpointError(f"{path}: {what}: resume with the config that wrote it")
    if not mine:
        return
    base = meta[LORA_META].get("base") or {}
    fp = run.model.__dict__.get("base_fingerprint")
    if base.get("fingerprint") != fp:
        raise C.CheckpointError(f"{path}: its adapters were trained on the base at {base.get('path')} (weights "
                                f"fingerprint {base.get('fingerprint')}); init_from now gives {run.model.base_path} "
                                f"({fp}), other weights: resume with the base the run started from")


def resume_schedule(cfg, path, say):
    """The config a run resuming ``path`` trains with: ``lr_decay_steps: null`` takes the checkpoint's schedule
    length (its ``lr_decay_steps``, or the ``max_steps`` it ran with), so a raised ``max_steps`` continues at the
    final lr instead of stretching the cosine (which would raise the lr again); said in a note. An explicit
    ``lr_decay_steps`` that moves the lr at the resumed step is said in a warning, with both values. Reads the
    checkpoint's header only (:func:`load` checks the file)."""
    meta = header_meta(path)
    saved = (meta or {}).get("config")
    if not isinstance(saved, dict) or not isinstance(saved.get("max_steps"), int):
        return cfg
    step, was = int(meta.get("step") or 0), schedule_steps(saved)
    c = cfg.as_dict()
    if c.get("lr_decay_steps") is None:
        if was == c["max_steps"]:
            return cfg
        final = c["lr"] * c["min_lr_ratio"]
        beyond = (f"; steps {was + 1}-{c['max_steps']} run at the final lr {final:.2e}" if c["max_steps"] > was
                  else "")
        say(f"note: max_steps {saved['max_steps']} -> {c['max_steps']}: the lr schedule keeps the checkpoint's "
            f"length of {was} steps{beyond} (lr_decay_steps={c['max_steps']} stretches the cosine instead)")
        return cfg.with_keys(lr_decay_steps=was)
    now = schedule_steps(c)
    if now != was:
        def lr(d, n):
            return float(lr_schedule(d["lr"], n, d["warmup_steps"], d["min_lr_ratio"]).lr_at(step + 1))
        before, after = lr({**c, **saved}, was), lr(c, now)
        if after != before:
            say(f"warning: lr_decay_steps {was} -> {now}: at step {step} the learning rate "
                f"{'rises' if after > before else 'drops'} from {before:.2e} to {after:.2e} (lr_decay_steps={was} "
                f"keeps the checkpoint's schedule)")
    return cfg


def _warn_changes(path, meta, cfg, opt, say):
    saved = dict(meta.get("config", {}))
    for k, v in config_defaults().items():  # a scalar key newer than the checkpoint had its default there
        if not isinstance(v, dict):
            saved.setdefault(k, v)
    changed = sorted(k for k in set(saved) | set(cfg) if k not in RESUME_FREE and k != "zero"
                     and saved.get(k) != cfg.get(k))
    sz, cz = saved.get("zero") or {}, cfg.get("zero") or {}
    changed += [f"zero.{k}" for k in sorted(set(sz) | set(cz)) if k not in ZERO_RESUME_FREE and sz.get(k) != cz.get(k)
                and "zero" in saved]
    if changed:
        def val(d, k):
            return (d.get("zero") or {}).get(k[5:]) if k.startswith("zero.") else d.get(k)
        say(f"warning: resuming {path} with a different " + ", ".join(
            f"{k} ({val(saved, k)!r} -> {val(cfg, k)!r})" for k in changed) + ": the losses will not match the "
            "uninterrupted run")
    kind, mine = meta["optimizer"].get("kind"), type(opt).__name__
    if kind != mine and not {kind, mine} <= _ADAMW_FAMILY:
        say(f"warning: {path} was written by {kind}; continuing with {mine}")


def _loss_acc(path, meta, shards, run, say):
    """``(loss_acc, n_acc)`` of this rank: ``meta["n_acc"]`` counts every rank's micro-batches; the same number of
    ranks takes its own running loss, another number splits the rank-order sum evenly (the logged mean is the same
    up to rounding)."""
    n, world = int(meta.get("n_acc", 0)), run.world
    losses = [np.asarray(t["loss_acc"], np.float32).reshape(()) for _, t in shards if "loss_acc" in t]
    if not n or len(losses) != len(shards):
        return None, 0
    if len(shards) == world:
        return run.xp.asarray(losses[run.rank]), n // world
    if n % world:
        say(f"note: the running loss of {path} covers {n} micro-batches, not a multiple of {world} ranks; the first "
            f"logged loss after resuming starts afresh")
        return None, 0
    total = losses[0]
    for x in losses[1:]:
        total = np.float32(total + x)
    return run.xp.asarray(np.float32(total / np.float32(world)) if world > 1 else total), n // world


def load(run, path, say):
    """Resume ``run`` from the checkpoint ``path`` (:func:`resolve`), every rank: check everything, then write the
    model, the optimizer state, the loader and the dropout stream. Returns ``(step, log rows, loss_acc, n_acc)``.
    CheckpointError naming the file and what disagrees."""
    arrays, meta = C.read_training(path)  # verifies the whole-file SHA-256 first
    shards = read_shards(path, arrays, meta)
    _check(path, arrays, meta, shards, run)
    _warn_changes(path, meta, run.cfg.as_dict(), run.opt, say)
    if run.cfg.lora is not None:  # (first: the optimizer re-derives its shadows from it)
        load_lora_state_dict(run.model, C.model_arrays(arrays), where=str(path))
    else:
        run.model.load_state_dict(C.model_arrays(arrays))
    run.opt.load_state_dict([sh for sh, _ in shards], params=False)  # (the model's values, the same numbers, stay)
    run.train_loader.load_state_dict(meta["loader"])
    drng = getattr(run.model, "dropout_rng", None)
    saved = C.train_arrays(arrays).get("dropout_offset")
    if drng is not None and saved is not None:
        drng.offset[...] = run.xp.asarray(np.asarray(saved, dtype=np.uint64))
    step = int(meta["step"])
    note = f" (written by {len(shards)} rank(s); optimizer state re-sharded)" if len(shards) != run.world else ""
    say(f"resumed from {path} at step {step}{note}")
    return (step, list(meta.get("log", [])), *_loss_acc(path, meta, shards, run, say))


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
    """A checkpoint whose every file exists: the main file and each shard it names. A main file whose header
    cannot be read counts as complete (loading it then says what is wrong with it)."""
    path = Path(path)
    if not path.is_file():
        return False
    meta = header_meta(path)
    if not isinstance(meta, dict) or not isinstance(meta.get(ZERO_META), dict):
        return True
    return all((path.parent / n).is_file() for n in meta[ZERO_META].get("shards", []))


def _files(folder, pattern, regex):
    out = []
    for p in Path(folder).glob(pattern):
        m = regex.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest(folder) -> Path | None:
    """The newest complete checkpoint (highest step) in ``folder``, or None."""
    for _, p in reversed(_files(folder, "step_*.ckpt", MAIN_RE)):
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
    complete = [(s, p) for s, p in _files(folder, "step_*.ckpt", MAIN_RE) if is_complete(p)]
    if not complete:
        return []
    oldest_kept = complete[-min(keep_last, len(complete))][0]
    gone = []
    for pattern, regex in (("step_*.ckpt", MAIN_RE), ("step_*.zero", SHARD_RE)):
        for s, p in _files(folder, pattern, regex):
            if s < oldest_kept:
                p.unlink()
                gone.append(p)
    return gone
