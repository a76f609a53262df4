#!/usr/bin/env python
"""Train LLaMA with cukernels: tape autograd + kernel layers + AdamW, no PyTorch.

    python examples/train_llama.py --config examples/configs/tiny.yaml            # CPU, NumPy path, ~1 min
    python examples/train_llama.py --config examples/configs/small.yaml           # GPU, kernels
    python examples/train_llama.py --config examples/configs/tiny.yaml max_steps=50 fused=false

Overrides are ``key=value`` (YAML values; ``model.hidden_size=256`` reaches into the model section).
Each step: ``grad_accum = total_batch_size / (batch_size * seq_len)`` micro-batches, each ``loss.backward()``
accumulating into the optimizer's flat gradient buffer; then the global gradient norm (device), a clip scale
(device) folded with ``1/grad_accum`` into the optimizer's ``grad_scale`` -- no host read -- and one AdamW step
with a warmup + cosine learning rate. The loss and norm are read back only on logging steps.

Checkpoints (``cukernels.checkpoint``: one file, atomic write, whole-file SHA-256): every ``ckpt_every`` steps
and at the end, ``<ckpt_dir or out_dir/checkpoints>/step_<N>.ckpt`` holds the fp32 parameters, the optimizer's
moments, step and lr (bf16 shadows are re-derived from the parameters on load), the data loader's cursor (and
the sampler's RNG state with ``data.sampling: random``), the running loss accumulator, the log rows and the
config; the ``keep_last`` newest are kept. ``--resume PATH`` or ``--resume latest`` continues bit-identically:
the losses after resuming equal those of an uninterrupted run, step for step (nothing else draws random
numbers after initialisation: no dropout; the eval split is read from its start at every eval). A corrupt,
truncated or mismatched file (another model shape or config) is refused before anything is loaded.
``init_from: <Hugging Face folder or trainer checkpoint>`` starts from those weights (fresh optimizer).

    python examples/train_llama.py --config examples/configs/small.yaml ckpt_every=250
    python examples/train_llama.py --config examples/configs/small.yaml --resume latest
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cukernels as ck  # noqa: E402
from cukernels import checkpoint as C  # noqa: E402
from cukernels import data as ckdata  # noqa: E402
from cukernels.nn import CompositeAdamW  # noqa: E402

DEFAULTS = {
    "model": {},
    "data": {"kind": "text", "path": None, "val_path": None, "val_fraction": 0.1,
             "sampling": "sequential"},  # sequential (llm.c cursor) | random (seeded windows)
    "device": "auto",            # cpu | gpu | auto
    "fused": True,               # kernels (True) or the composite of plain array ops (False)
    "autocast": None,            # bf16 | null
    "sparse_embedding": False,
    "batch_size": 8,
    "seq_len": 64,
    "total_batch_size": None,    # tokens per optimizer step; default batch_size * seq_len
    "max_steps": 100,
    "lr": 1e-3,
    "min_lr_ratio": 0.1,
    "warmup_steps": 10,
    "weight_decay": 0.1,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "grad_clip": 1.0,
    "eval_every": 50,
    "eval_steps": 4,
    "log_every": 10,
    "seed": 1337,
    "out_dir": "runs/llama",
    "log_format": "jsonl",       # jsonl | csv
    "plot": True,
    "graph": False,              # replay each step from one captured CUDA graph (GPU, fused)
    "ckpt_every": 0,             # save a checkpoint every N steps (0: only at the end)
    "ckpt_final": True,          # save one at the end
    "ckpt_dir": None,            # default <out_dir>/checkpoints
    "keep_last": 3,              # keep the N newest checkpoints (0: all)
    "resume": None,              # checkpoint path, or "latest" (newest in ckpt_dir)
    "init_from": None,           # Hugging Face folder or trainer checkpoint: initial weights
}

# Config keys that may differ between a checkpoint and the run resuming it without touching the trajectory.
RESUME_FREE = {"out_dir", "ckpt_dir", "ckpt_every", "ckpt_final", "keep_last", "resume", "log_every", "log_format",
               "plot", "eval_every", "eval_steps"}


def load_config(path, overrides=()):
    cfg = json.loads(json.dumps(DEFAULTS))
    if path:
        with open(path) as f:
            user = yaml.safe_load(f) or {}
        for k, v in user.items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
    for o in overrides:
        if "=" not in o:
            raise SystemExit(f"override {o!r}: expected key=value")
        k, v = o.split("=", 1)
        v = yaml.safe_load(v)
        if isinstance(v, str):  # YAML 1.1 reads "3e-3" (no dot) as a string: take it as the number meant
            try:
                v = float(v)
            except ValueError:
                pass
        d = cfg
        *parents, leaf = k.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return cfg


def lr_at(step, cfg):
    """Linear warmup to lr over warmup_steps, then cosine down to lr * min_lr_ratio at max_steps.

    Step ``step`` (0-based) is the optimizer's step ``t = step + 1``; the same function as
    ``ck.optim.WarmupCosine`` (which computes it on the device inside the fused optimizer's step)."""
    lr, total = cfg["lr"], cfg["max_steps"]
    warm = min(cfg["warmup_steps"], total)
    t = step + 1
    if t <= warm:
        return lr * t / warm
    frac = min(1.0, (t - warm) / max(1, total - warm))
    lo = lr * cfg["min_lr_ratio"]
    return lo + 0.5 * (lr - lo) * (1.0 + math.cos(math.pi * frac))


def pick_xp(device):
    if device == "cpu" or (device == "auto" and not ck.gpu_available()):
        return np
    if not ck.gpu_available():
        raise SystemExit("device: gpu asked for, but CuPy sees no CUDA device")
    import cupy
    return cupy


def build_data(cfg, vocab_size):
    d = cfg["data"]
    if d.get("kind", "text") == "llmc":
        train = ckdata.read_token_file(d["path"])
        val = ckdata.read_token_file(d["val_path"]) if d.get("val_path") else None
        if val is None:
            n = max(cfg["batch_size"] * cfg["seq_len"] + 1, int(len(train) * d.get("val_fraction", 0.1)))
            train, val = train[:-n], train[-n:]
    else:
        train, val = ckdata.load_text_tokens(d.get("path"), d.get("val_fraction", 0.1))
    top = int(max(train.max(), val.max()))
    if top >= vocab_size:
        raise SystemExit(f"data: token id {top} does not fit model.vocab_size {vocab_size}")
    return train, val


def make_optimizer(cfg, model, xp):
    named = list(model.named_parameters())
    for n, p in named:
        p.name = n  # the optimizer's names for them: the model's (Hugging Face) names
    params = [p for _, p in named]
    no_decay = [p for p in params if p.ndim < 2]
    betas = tuple(cfg["betas"])
    if cfg["fused"] and hasattr(ck, "optim"):
        # ck.optim.AdamW matches no_decay / sparse by *name* (a set of Tensors would never match)
        sparse = {n for n, p in named if getattr(p, "_sparse_rows", False)}
        kw = dict(shadow_dtype=ck.bfloat16 if cfg["autocast"] else None, no_decay={p.name for p in no_decay})
        if sparse:
            kw["sparse"] = sparse
        opt = ck.optim.AdamW(params, lr=cfg["lr"], betas=betas, eps=cfg["eps"], weight_decay=cfg["weight_decay"],
                             **kw)
        for p in sparse:
            opt.attach_sparse(p)  # the embedding backward lists touched rows; Adam updates only those
        if cfg["autocast"]:
            ck.amp.attach_shadows(params, opt)
        return opt, True
    return CompositeAdamW(params, lr=cfg["lr"], betas=betas, eps=cfg["eps"], weight_decay=cfg["weight_decay"],
                          no_decay=no_decay), False


def grad_arrays(model):
    out = []
    for p in model.parameters():
        if p.sparse_grad is not None:
            out.append(p.sparse_grad.grad)
        elif p.grad is not None:
            out.append(p.grad)
    return out


def clip_and_scale(grads, max_norm, accum, fused, xp):
    """(grad norm of the averaged gradient, the scale the optimizer applies): device 0-d arrays, no host read."""
    if fused:
        norm = ck.global_norm(grads)
        norm *= 1.0 / accum  # in place: stays a 0-d array on both paths
        scale = ck.clip_scale(norm, max_norm) if max_norm else xp.ones((), np.float32)
        return norm, xp.asarray(scale * (1.0 / accum))
    else:
        sq = xp.zeros((), np.float32)
        for g in grads:
            sq = sq + (g.astype(np.float32) ** 2).sum()
        norm = xp.sqrt(sq) * (1.0 / accum)
        scale = xp.minimum(1.0, max_norm / (norm + 1e-6)) if max_norm else xp.ones((), np.float32)
    return norm, scale * (1.0 / accum)


def memory_str(xp):
    if xp is np:
        import resource
        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB rss"
    pool = xp.get_default_memory_pool()
    return f"{pool.used_bytes() / 2**30:.2f}/{pool.total_bytes() / 2**30:.2f} GB"


def sync(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def evaluate(model, loader, steps, autocast):
    loader.reset()
    tot = None
    with ck.no_grad(), ck.autocast(ck.bfloat16, enabled=bool(autocast)):
        for _ in range(steps):
            x, y = loader.next_batch()
            loss = model(x, y).data
            tot = loss if tot is None else tot + loss
    return float(tot) / steps


class Logger:
    def __init__(self, out_dir, fmt):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "log." + ("csv" if fmt == "csv" else "jsonl"))
        self.fmt, self.rows, self._header = fmt, [], False
        open(self.path, "w").close()

    def log(self, row):
        self.rows.append(row)
        with open(self.path, "a") as f:
            if self.fmt == "csv":
                keys = ["step", "kind", "loss", "lr", "grad_norm", "ms_per_step", "tok_per_s"]
                if not self._header:
                    f.write(",".join(keys) + "\n")
                    self._header = True
                f.write(",".join("" if row.get(k) is None else str(row.get(k)) for k in keys) + "\n")
            else:
                f.write(json.dumps(row) + "\n")

    def plot(self, out_dir):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception:
            return None
        tr = [(r["step"], r["loss"]) for r in self.rows if r["kind"] == "train"]
        va = [(r["step"], r["loss"]) for r in self.rows if r["kind"] == "val"]
        fig, ax = plt.subplots(figsize=(6, 4))
        if tr:
            ax.plot(*zip(*tr), label="train")
        if va:
            ax.plot(*zip(*va), "o-", label="val")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
        path = os.path.join(out_dir, "loss.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return path


class RandomWindows:
    """``data.sampling: random``: each batch is B windows of T+1 tokens at offsets drawn from a seeded PCG64
    (nanoGPT style). ``state_dict()`` carries the generator's state, so a resumed run draws the same batches."""

    def __init__(self, tokens, batch_size, seq_len, xp, seed):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"tokens: {len(tokens)} tokens are fewer than one window of {seq_len}+1")
        self.tokens, self.B, self.T, self.xp = tokens, batch_size, seq_len, xp
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next_batch(self):
        ix = self.rng.integers(0, len(self.tokens) - self.T, size=self.B)
        buf = np.stack([np.asarray(self.tokens[i:i + self.T + 1]) for i in ix]).astype(np.int32)
        x, y = buf[:, :-1], buf[:, 1:]
        if self.xp is not np:
            x, y = self.xp.asarray(x), self.xp.asarray(y)
        return x, y

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, s):
        self.rng.bit_generator.state = s["rng"]


class Run:
    """Everything a training step touches: model, optimizer, loader, precision context, sizes."""

    def __init__(self, cfg, xp, model, opt, opt_fused, train_loader, accum):
        self.cfg, self.xp, self.model, self.opt, self.opt_fused = cfg, xp, model, opt, opt_fused
        self.train_loader, self.accum = train_loader, accum
        self.amp_ctx = ck.autocast(ck.bfloat16, enabled=bool(cfg["autocast"]))


def train_step(run, step):
    """One optimizer step (0-based ``step``): ``accum`` micro-batches forward + backward into the flat gradient
    buffer, global norm + clip scale on the device, one AdamW step at ``lr_at(step)``.

    Returns ``(sum of the micro-batch losses, grad norm)`` as device scalars: no host read. Everything a step
    depends on is the model, the optimizer state, the loader state and ``step``; all of them are checkpointed.
    With ``graph: true`` the batches are copied into fixed device buffers and the rest of the step is replayed
    from one CUDA graph (the fused optimizer computes the lr from its device step counter).
    """
    batches = [run.train_loader.next_batch() for _ in range(run.accum)]
    if run.graph is not None:
        for i, (x, y) in enumerate(batches):
            run.ids_buf[i][...] = x
            run.tgt_buf[i][...] = y
        return run.graph()
    if not run.device_lr:
        run.opt.set_lr(lr_at(step, run.cfg))
    return _step_body(run, batches)


def _step_body(run, batches):
    opt = run.opt
    # Fused optimizer: lazy zeroing -- the first backward write of each gradient overwrites it (weight-grad
    # GEMMs with beta = 0), so no zeroing pass; flush_stale zeroes any gradient nothing wrote.
    opt.zero_grad(lazy=True) if run.opt_fused else opt.zero_grad()
    loss_sum = None
    for x, y in batches:
        with run.amp_ctx:
            loss = run.model(x, y)
        loss.backward()
        loss_sum = loss.data if loss_sum is None else loss_sum + loss.data
    if run.opt_fused:
        opt.flush_stale()
    norm, scale = clip_and_scale(grad_arrays(run.model), run.cfg["grad_clip"], run.accum, run.opt_fused, run.xp)
    opt.step(grad_scale=scale)
    return loss_sum, norm


def setup_graph(run):
    """``graph: true``: fixed input buffers and a ck.graph.CapturedStep over the step body (GPU, fused only)."""
    cfg, xp = run.cfg, run.xp
    run.graph = None
    # The fused optimizer computes the lr on the device from its step counter (same values as lr_at).
    run.device_lr = bool(run.opt_fused)
    if run.device_lr:
        run.opt.set_schedule(ck.optim.WarmupCosine(cfg["lr"], cfg["max_steps"], min(cfg["warmup_steps"], cfg["max_steps"]),
                                                   cfg["lr"] * cfg["min_lr_ratio"]))
    if not cfg.get("graph"):
        return
    if xp is np or not run.opt_fused:
        raise SystemExit("graph: true needs the GPU and fused: true (the composite optimizer keeps host state)")
    B, T = cfg["batch_size"], cfg["seq_len"]
    run.ids_buf = xp.zeros((run.accum, B, T), dtype=np.int32)
    run.tgt_buf = xp.zeros((run.accum, B, T), dtype=np.int32)
    batches = [(run.ids_buf[i], run.tgt_buf[i]) for i in range(run.accum)]
    run.graph = ck.graph.CapturedStep(lambda: _step_body(run, batches), warmup=2)


# ------------------------------------------------------------------------------------------------ checkpoints
def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def optimizer_arrays(run):
    """{"optim/<param>/exp_avg" | "/exp_avg_sq": array} plus the scalars for the meta."""
    opt, out = run.opt, {}
    named = list(run.model.named_parameters())
    if run.opt_fused:
        for n, p in named:
            out[f"{C.OPTIM_PREFIX}{n}/exp_avg"] = opt.exp_avg(p)
            out[f"{C.OPTIM_PREFIX}{n}/exp_avg_sq"] = opt.exp_avg_sq(p)
        scalars = {"kind": "AdamW", "step": opt.step_count, "lr": opt.get_lr()}
    else:
        for (n, _), m, v in zip(named, opt.m, opt.v):
            out[f"{C.OPTIM_PREFIX}{n}/exp_avg"] = m
            out[f"{C.OPTIM_PREFIX}{n}/exp_avg_sq"] = v
        scalars = {"kind": "CompositeAdamW", "step": opt.t, "lr": opt.lr}
    return out, scalars


def save_checkpoint(run, step, log_rows, loss_acc, n_acc):
    """Write ``step_<step>.ckpt`` (after ``step`` completed optimizer steps) atomically; prune old ones."""
    cfg = run.cfg
    folder = cfg["ckpt_dir"] or os.path.join(cfg["out_dir"], "checkpoints")
    arrays = {C.MODEL_PREFIX + n: a for n, a in run.model.state_dict().items()}
    oa, scalars = optimizer_arrays(run)
    arrays.update(oa)
    if n_acc:
        arrays["train/loss_acc"] = np.asarray(_host(loss_acc), dtype=np.float32)
    meta = {
        "kind": C.TRAIN_KIND, "version": 1, "step": int(step),
        "config": {k: v for k, v in cfg.items() if k != "resume"},
        "model_config": run.model.config.to_dict(),
        "optimizer": scalars,
        "loader": run.train_loader.state_dict(),
        "n_acc": int(n_acc),
        "log": log_rows,
    }
    path = C.save(C.step_path(folder, step), arrays, meta)
    C.prune(folder, cfg["keep_last"])
    return path


def resolve_resume(cfg):
    r = cfg["resume"]
    if r in (None, False, ""):
        return None
    if str(r) == "latest":
        folder = cfg["ckpt_dir"] or os.path.join(cfg["out_dir"], "checkpoints")
        p = C.latest(folder)
        if p is None:
            raise C.CheckpointError(f"--resume latest: no step_*.ckpt checkpoint in {folder}")
        return p
    return C.latest(r) if os.path.isdir(r) and C.latest(r) else r


def read_resume(path, cfg, run, say):
    """Load and check a trainer checkpoint against this run; nothing is written into the run here.
    Returns (arrays, meta). CheckpointError naming the file and what disagrees."""
    arrays, meta = C.load(path)  # verifies the whole-file SHA-256 first
    if meta.get("kind") != C.TRAIN_KIND:
        raise C.CheckpointError(f"{path}: not a trainer checkpoint (kind {meta.get('kind')!r})")
    mine = run.model.config.to_dict()
    theirs = meta["model_config"]
    diff = [f"{k}: {theirs.get(k)!r} in the file, {mine.get(k)!r} in this run" for k in mine
            if theirs.get(k) != mine.get(k)]
    if diff:
        raise C.CheckpointError(f"{path}: model config does not match this run: " + "; ".join(diff))
    model_arrays = {k[len(C.MODEL_PREFIX):]: a for k, a in arrays.items() if k.startswith(C.MODEL_PREFIX)}
    C.check_compatible(path, model_arrays, run.model.state_dict(), "model")
    oa, scalars = optimizer_arrays(run)
    C.check_compatible(path, {k: a for k, a in arrays.items() if k.startswith(C.OPTIM_PREFIX)}, oa, "optimizer")
    saved = meta.get("config", {})
    changed = sorted(k for k in set(saved) | set(cfg) if k not in RESUME_FREE and saved.get(k) != cfg.get(k))
    if changed:
        say(f"warning: resuming {path} with a different " + ", ".join(
            f"{k} ({saved.get(k)!r} -> {cfg.get(k)!r})" for k in changed) + ": the losses will not match the "
            f"uninterrupted run")
    if meta["optimizer"]["kind"] != scalars["kind"]:
        say(f"warning: {path} was written by {meta['optimizer']['kind']}; continuing with {scalars['kind']}")
    return arrays, meta


def apply_resume(run, arrays, meta):
    """Write a checked checkpoint into the model, optimizer and loader (parameters first: the optimizer
    re-derives its bf16 shadows from them)."""
    run.model.load_state_dict({k[len(C.MODEL_PREFIX):]: a for k, a in arrays.items()
                               if k.startswith(C.MODEL_PREFIX)})
    named = list(run.model.named_parameters())
    o = meta["optimizer"]
    mom = lambda n, w: arrays[f"{C.OPTIM_PREFIX}{n}/{w}"]  # noqa: E731
    if run.opt_fused:
        run.opt.load_state_dict({"step": o["step"], "lr": o["lr"],
                                 "state": {p.name: {"exp_avg": mom(n, "exp_avg"), "exp_avg_sq": mom(n, "exp_avg_sq")}
                                           for n, p in named}})
    else:
        xp = run.xp
        run.opt.load_state_dict({"t": o["step"], "lr": o["lr"], "m": [xp.asarray(mom(n, "exp_avg")) for n, _ in named],
                                 "v": [xp.asarray(mom(n, "exp_avg_sq")) for n, _ in named]})
    run.train_loader.load_state_dict(meta["loader"])


def build_model(cfg, xp):
    """The model from ``cfg["model"]``, or from ``init_from`` (its config and weights)."""
    src = cfg.get("init_from")
    kw = dict(xp=xp, fused=cfg["fused"], sparse_embedding=cfg["sparse_embedding"])
    if not src:
        return ck.Llama(ck.LlamaConfig.from_dict(cfg["model"]), seed=cfg["seed"], **kw), None
    from cukernels.generation import load_model
    model, what = load_model(src, xp=xp, fused=cfg["fused"])
    if cfg["sparse_embedding"]:
        model = ck.Llama(model.config, seed=cfg["seed"], **kw).load_state_dict(model.state_dict())
    mine = model.config.to_dict()
    clash = {k: v for k, v in (cfg.get("model") or {}).items() if k in mine and mine[k] != v}
    note = f"init_from {what}"
    if clash:
        note += " (its config.json overrides model." + ", model.".join(f"{k}={v!r}" for k, v in clash.items()) + ")"
    cfg["model"] = mine
    return model, note


def train(cfg, quiet=False, stop_after=None):
    """Run a training; returns the list of log rows (dicts with step, kind, loss, ...).

    ``stop_after``: return after that many optimizer steps of this session without the final checkpoint, as a
    killed run would (for tests); the periodic checkpoints are written as usual."""
    xp = pick_xp(cfg["device"])
    say = (lambda *a: None) if quiet else print
    B, T = cfg["batch_size"], cfg["seq_len"]
    tbs = cfg["total_batch_size"] or B * T
    if tbs % (B * T):
        raise SystemExit(f"total_batch_size {tbs} is not a multiple of batch_size*seq_len = {B * T}")
    accum = tbs // (B * T)
    if xp is not np:
        xp.random.seed(cfg["seed"])
    resume = resolve_resume(cfg)
    model, init_note = build_model(cfg, xp)
    mc = model.config
    if cfg["sparse_embedding"] and not mc.tie_word_embeddings:
        model.model.embed_tokens.weight._sparse_rows = True
    opt, opt_fused = make_optimizer(cfg, model, xp)
    train_tok, val_tok = build_data(cfg, mc.vocab_size)
    if cfg["data"].get("sampling", "sequential") == "random":
        tl = RandomWindows(train_tok, B, T, xp, seed=cfg["seed"])
    else:
        tl = ckdata.TokenLoader(train_tok, B, T, xp)
    vl = ckdata.TokenLoader(val_tok, B, T, xp)
    run = Run(cfg, xp, model, opt, opt_fused, tl, accum)
    setup_graph(run)
    start, loss_acc, n_acc, rows = 0, None, 0, []
    if resume is not None:
        arrays, meta = read_resume(resume, cfg, run, say)  # everything checked before anything is written
        apply_resume(run, arrays, meta)
        start, n_acc, rows = int(meta["step"]), int(meta.get("n_acc", 0)), list(meta.get("log", []))
        if n_acc:
            loss_acc = xp.asarray(arrays["train/loss_acc"].reshape(()))
    log = Logger(cfg["out_dir"], cfg["log_format"])
    for r in rows:
        log.log(r)
    say(f"device {xp.__name__} | fused {cfg['fused']} | autocast {cfg['autocast']} | params "
        f"{model.num_parameters() / 1e6:.2f}M | {B}x{T} x {accum} accum = {tbs} tok/step | "
        f"{len(train_tok)} train / {len(val_tok)} val tokens")
    if init_note:
        say(init_note)
    if resume is not None:
        say(f"resumed from {resume} at step {start}")
    sync(xp)
    t_last, steps_since = time.perf_counter(), 0
    for step in range(start, cfg["max_steps"]):
        last = step == cfg["max_steps"] - 1
        if cfg["eval_every"] and (step % cfg["eval_every"] == 0 or last):
            vloss = evaluate(model, vl, cfg["eval_steps"], cfg["autocast"])
            log.log({"step": step, "kind": "val", "loss": vloss})
            say(f"step {step:5d} | val loss {vloss:.4f}")
            sync(xp)
            t_last, steps_since = time.perf_counter(), 0
        loss_sum, norm = train_step(run, step)
        # (copy: with graph: true, loss_sum is the graph's output buffer, rewritten by every replay)
        loss_acc = loss_sum.copy() if loss_acc is None else loss_acc + loss_sum
        n_acc += accum
        steps_since += 1
        if (step + 1) % cfg["log_every"] == 0 or last:
            lv = float(loss_acc) / n_acc  # the one host read, on logging steps only
            nv = float(norm)
            lr = lr_at(step, cfg)
            sync(xp)
            now = time.perf_counter()
            ms = (now - t_last) * 1e3 / steps_since
            tps = tbs / (ms / 1e3)
            log.log({"step": step + 1, "kind": "train", "loss": lv, "lr": lr, "grad_norm": nv,
                     "ms_per_step": ms, "tok_per_s": tps})
            say(f"step {step + 1:5d}/{cfg['max_steps']} | loss {lv:.4f} | lr {lr:.2e} | norm {nv:.3f} | "
                f"{ms:.1f} ms | {tps:,.0f} tok/s | {memory_str(xp)}")
            loss_acc, n_acc = None, 0
            t_last, steps_since = time.perf_counter(), 0
        if (cfg["ckpt_every"] and (step + 1) % cfg["ckpt_every"] == 0) or (last and cfg["ckpt_final"]):
            path = save_checkpoint(run, step + 1, log.rows, loss_acc, n_acc)
            say(f"checkpoint {path}")
            t_last, steps_since = time.perf_counter(), 0
        if stop_after is not None and step + 1 - start >= stop_after:
            return log.rows
    png = log.plot(cfg["out_dir"]) if cfg["plot"] else None
    say(f"log: {log.path}" + (f" | plot: {png}" if png else ""))
    return log.rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (examples/configs/*.yaml)")
    ap.add_argument("--resume", default=None, metavar="PATH|latest",
                    help="continue from a checkpoint file (or the newest in ckpt_dir with 'latest')")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (model.hidden_size=256, fused=false, ...)")
    a = ap.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    if a.resume:
        cfg["resume"] = a.resume
    try:
        train(cfg)
    except C.CheckpointError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
