"""The training loop, as library code (nanoGPT's train.py, on cukernels): tape autograd + kernel layers + AdamW,
gradient accumulation, clipping, warmup + cosine lr, evaluation, checkpoints with bit-identical resume, optional
CUDA-graph replay of the whole step.

Each step: ``grad_accum = total_batch_size / (batch_size * seq_len)`` micro-batches, each ``loss.backward()``
accumulating into the optimizer's flat gradient buffer; then the global gradient norm (device), a clip scale
(device) folded with ``1/grad_accum`` into the optimizer's ``grad_scale`` -- no host read -- and one AdamW step.
The loss and norm are read back only on logging steps.

Checkpoints (``cukernels.io.checkpoint``'s training schema: one file, streamed, atomic, whole-file SHA-256):
every ``ckpt_every`` steps and at the end, holding the fp32 parameters, the optimizer's moments, step and lr
(bf16 shadows are re-derived on load), the data loader's cursor (or the sampler's RNG state), the running loss
accumulator, the log rows and the config. Resuming continues bit-identically (nothing else draws random numbers
after initialisation). A corrupt, truncated or mismatched file is refused before anything is loaded.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np

from .. import _backend as B
from ..amp import attach_shadows, autocast
from ..autograd import no_grad
from ..data import ByteTokenizer, TokenLoader, load_text_tokens, read_token_file
from ..generation import generate, load_model
from ..graph import CapturedStep
from ..io import checkpoint as C
from ..models import model_class
from ..ops.adam import clip_scale, global_norm
from ..optim import AdamW, CompositeAdamW, WarmupCosine
from .config import RESUME_FREE, save_yaml
from .console import Console, Logger


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
    if device == "cpu" or (device == "auto" and not B.gpu_available()):
        return np
    if not B.gpu_available():
        raise SystemExit("device: gpu asked for, but CuPy sees no CUDA device (device=cpu runs the NumPy path)")
    import cupy
    return cupy


def build_data(cfg, vocab_size):
    d = cfg["data"]
    for key in ("path", "val_path"):
        if d.get(key) and not os.path.isfile(d[key]):
            raise SystemExit(f"data.{key}: no such file: {d[key]}")
    if d["kind"] == "llmc":
        if not d.get("path"):
            raise SystemExit("data.path: data.kind llmc needs an llm.c token file")
        train = read_token_file(d["path"])
        val = read_token_file(d["val_path"]) if d.get("val_path") else None
        if val is None:
            n = max(cfg["batch_size"] * cfg["seq_len"] + 1, int(len(train) * d["val_fraction"]))
            train, val = train[:-n], train[-n:]
    else:
        train, val = load_text_tokens(d.get("path"), d["val_fraction"])
    top = int(max(train.max(), val.max()))
    if top >= vocab_size:
        raise SystemExit(f"data: token id {top} does not fit model.vocab_size {vocab_size}")
    return train, val


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


def make_optimizer(cfg, model, xp):
    """``(optimizer, fused)``: ck.optim.AdamW over flat buffers (fused) or the composite baseline; no weight
    decay on 1-D parameters; the sparse-row embedding attached when asked."""
    named = list(model.named_parameters())
    no_decay = {n for n, p in named if p.ndim < 2}
    kw = dict(lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"], weight_decay=cfg["weight_decay"],
              no_decay=no_decay)
    params = [p for _, p in named]
    if not cfg["fused"]:
        return CompositeAdamW(params, **kw), False
    sparse = {n for n, p in named if getattr(p, "_sparse_rows", False)}
    opt = AdamW(params, shadow_dtype=B.bfloat16 if cfg["autocast"] else None, sparse=sparse or None, **kw)
    for n in sparse:
        opt.attach_sparse(n)  # the embedding backward lists touched rows; Adam updates only those
    if cfg["autocast"]:
        attach_shadows(params, opt)
    return opt, True


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
        norm = global_norm(grads)
        norm *= 1.0 / accum  # in place: stays a 0-d array on both paths
        scale = clip_scale(norm, max_norm) if max_norm else xp.ones((), np.float32)
        return norm, xp.asarray(scale * (1.0 / accum))
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


def evaluate(model, loader, steps, use_autocast):
    """Mean validation loss over ``steps`` batches from the loader's start, in eval mode (no dropout, so the
    training randomness is untouched)."""
    loader.reset()
    tot = None
    was = model.training
    model.eval()
    try:
        with no_grad(), autocast(B.bfloat16, enabled=bool(use_autocast)):
            for _ in range(steps):
                x, y = loader.next_batch()
                loss = model(x, y).data
                tot = loss if tot is None else tot + loss
    finally:
        model.train(was)
    return float(tot) / steps


class Run:
    """Everything a training step touches: model, optimizer, loader, precision context, sizes, graph."""

    def __init__(self, cfg, xp, model, opt, opt_fused, train_loader, accum):
        self.cfg, self.xp, self.model, self.opt, self.opt_fused = cfg, xp, model, opt, opt_fused
        self.train_loader, self.accum = train_loader, accum
        self.amp_ctx = autocast(B.bfloat16, enabled=bool(cfg["autocast"]))
        self.graph = None
        self.device_lr = False


def train_step(run, step):
    """One optimizer step (0-based ``step``): ``accum`` micro-batches forward + backward into the flat gradient
    buffer, global norm + clip scale on the device, one AdamW step at ``lr_at(step)``.

    Returns ``(sum of the micro-batch losses, grad norm)`` as device scalars: no host read. With ``graph: true``
    the batches are copied into fixed device buffers and the rest of the step is replayed from one CUDA graph
    (the fused optimizer computes the lr from its device step counter)."""
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
    """The device lr schedule (fused optimizer), and with ``graph: true`` fixed input buffers and a CapturedStep
    over the step body (GPU, fused only)."""
    cfg, xp = run.cfg, run.xp
    run.device_lr = bool(run.opt_fused)
    if run.device_lr:
        run.opt.set_schedule(WarmupCosine(cfg["lr"], cfg["max_steps"], min(cfg["warmup_steps"], cfg["max_steps"]),
                                          cfg["lr"] * cfg["min_lr_ratio"]))
    if not cfg["graph"]:
        return
    if xp is np or not run.opt_fused:
        raise SystemExit("graph: true needs the GPU and fused: true (the composite optimizer keeps host state)")
    Bsz, T = cfg["batch_size"], cfg["seq_len"]
    run.ids_buf = xp.zeros((run.accum, Bsz, T), dtype=np.int32)
    run.tgt_buf = xp.zeros((run.accum, Bsz, T), dtype=np.int32)
    batches = [(run.ids_buf[i], run.tgt_buf[i]) for i in range(run.accum)]
    run.graph = CapturedStep(lambda: _step_body(run, batches), warmup=2)


# ------------------------------------------------------------------------------------------------ checkpoints
def ckpt_folder(cfg):
    return cfg["ckpt_dir"] or os.path.join(cfg["out_dir"], "checkpoints")


def save_checkpoint(run, step, log_rows, loss_acc, n_acc):
    """Write ``step_<step>.ckpt`` (after ``step`` completed optimizer steps); prune old ones."""
    cfg = run.cfg
    extra = {"loss_acc": np.asarray(loss_acc.get() if hasattr(loss_acc, "get") else loss_acc, np.float32)} \
        if n_acc else {}
    drng = getattr(run.model, "dropout_rng", None)
    if drng is not None:  # the dropout stream's position: a resumed run draws the masks this one would have
        extra["dropout_offset"] = drng.offset
    meta = {"step": int(step), "config": {k: v for k, v in cfg.items() if k != "resume"},
            "loader": run.train_loader.state_dict(), "n_acc": int(n_acc), "log": log_rows}
    path = C.save_training(C.step_path(ckpt_folder(cfg), step), model=run.model,
                           optimizer_state=run.opt.state_dict(copy=False), meta=meta, extra_arrays=extra)
    C.prune(ckpt_folder(cfg), cfg["keep_last"])
    return path


def resolve_resume(cfg):
    r = cfg["resume"]
    if not r:
        return None
    if str(r) == "latest":
        p = C.latest(ckpt_folder(cfg))
        if p is None:
            raise C.CheckpointError(f"--resume latest: no step_*.ckpt checkpoint in {ckpt_folder(cfg)}")
        return p
    if os.path.isdir(r):
        p = C.latest(r) or C.latest(os.path.join(r, "checkpoints"))
        if p is None:
            raise C.CheckpointError(f"--resume {r}: no step_*.ckpt checkpoint in that folder")
        return p
    return r


class _Like:
    def __init__(self, a):
        self.shape, self.dtype = tuple(a.shape), np.dtype(a.dtype)


def read_resume(path, cfg, run, say):
    """Load and check a trainer checkpoint against this run; nothing is written into the run here.
    Returns (arrays, meta). CheckpointError naming the file and what disagrees."""
    arrays, meta = C.read_training(path)  # verifies the whole-file SHA-256 first
    if meta["model_type"] != run.model.model_type:
        raise C.CheckpointError(f"{path}: a {meta['model_type']} checkpoint; this run trains "
                                f"{run.model.model_type}")
    mine, theirs = run.model.config.to_dict(), meta["model_config"]
    diff = [f"{k}: {theirs.get(k)!r} in the file, {mine.get(k)!r} in this run" for k in mine
            if theirs.get(k) != mine.get(k)]
    if diff:
        raise C.CheckpointError(f"{path}: model config does not match this run: " + "; ".join(diff))
    C.check_compatible(path, C.model_arrays(arrays), run.model.state_dict(), "model")
    mom = {f"{n}/{k}": _Like(a) for n, s in C.optimizer_state(arrays, meta)["state"].items() for k, a in s.items()}
    want = {f"{n}/{k}": _Like(a) for n, p in run.model.named_parameters()
            for k, a in (("exp_avg", p.data), ("exp_avg_sq", p.data))}
    C.check_compatible(path, mom, {k: v for k, v in want.items()}, "optimizer")
    saved = meta.get("config", {})
    changed = sorted(k for k in set(saved) | set(cfg) if k not in RESUME_FREE and saved.get(k) != cfg.get(k))
    if changed:
        say(f"warning: resuming {path} with a different " + ", ".join(
            f"{k} ({saved.get(k)!r} -> {cfg.get(k)!r})" for k in changed) + ": the losses will not match the "
            f"uninterrupted run")
    kind, mine_kind = meta["optimizer"].get("kind"), run.opt.state_dict(copy=False)["kind"]
    if kind != mine_kind:
        say(f"warning: {path} was written by {kind}; continuing with {mine_kind}")
    return arrays, meta


def apply_resume(run, arrays, meta):
    """Write a checked checkpoint into the model, optimizer and loader (parameters first: the optimizer
    re-derives its bf16 shadows from them), one tensor at a time."""
    run.model.load_state_dict(C.model_arrays(arrays))
    run.opt.load_state_dict(C.optimizer_state(arrays, meta))
    run.train_loader.load_state_dict(meta["loader"])
    drng = getattr(run.model, "dropout_rng", None)
    saved = C.train_arrays(arrays).get("dropout_offset")
    if drng is not None and saved is not None:
        drng.offset[...] = run.xp.asarray(np.asarray(saved, dtype=np.uint64))


def build_model(cfg, xp):
    """``(model, note)``: from ``cfg["model"]`` (its ``type`` picks the family), or from ``init_from`` (its
    config and weights; the run's model section is replaced by it)."""
    src = cfg["init_from"]
    m = dict(cfg["model"])
    cls = model_class(m.pop("type", "llama"))
    kw = dict(xp=xp, fused=cfg["fused"], sparse_embedding=cfg["sparse_embedding"])
    if not src:
        return cls(cls.config_class.from_dict(m), seed=cfg["seed"], **kw), None
    if not os.path.exists(src):
        raise SystemExit(f"init_from: no such file or folder: {src}")
    model, what = load_model(src, xp=xp, fused=cfg["fused"])
    if cfg["sparse_embedding"]:
        model = type(model)(model.config, seed=cfg["seed"], **kw).load_state_dict(model.state_dict())
    mine = model.config.to_dict()
    clash = {k: v for k, v in m.items() if k in mine and mine[k] != v}
    note = f"init_from {what}"
    if clash:
        note += " (its config overrides model." + ", model.".join(f"{k}={v!r}" for k, v in clash.items()) + ")"
    cfg["model"] = dict(mine, type=model.model_type)
    return model, note


def _sample(model, n, xp, use_autocast, seed):
    """``n`` bytes sampled after a newline from the trained model (temperature 0.8, top-k 40, the run's seed)."""
    n = min(n, model.max_positions() - 1)
    ids = generate(model, np.array([[10]], dtype=np.int32), n, temperature=0.8, top_k=40, seed=seed,
                   autocast=B.bfloat16 if use_autocast else None)
    return ByteTokenizer().decode(ids[0, 1:])


def train(cfg, quiet=False, stop_after=None, console=None):
    """Run a training from a checked config (:func:`cukernels.train.load_config`); returns the list of log rows
    (dicts with step, kind, loss, ...).

    ``stop_after``: return after that many optimizer steps of this session without the final checkpoint, as a
    killed run would (for tests); the periodic checkpoints are written as usual."""
    xp = pick_xp(cfg["device"])
    con = console or Console(cfg["progress"], quiet=quiet)
    say = con.say
    Bsz, T = cfg["batch_size"], cfg["seq_len"]
    tbs = cfg["total_batch_size"] or Bsz * T
    accum = tbs // (Bsz * T)
    if xp is not np:
        xp.random.seed(cfg["seed"])
    resume = resolve_resume(cfg)
    model, init_note = build_model(cfg, xp)
    mc = model.config
    if cfg["sparse_embedding"] and not getattr(mc, "tie_word_embeddings", False):
        model.input_embedding().weight._sparse_rows = True
    opt, opt_fused = make_optimizer(cfg, model, xp)
    train_tok, val_tok = build_data(cfg, mc.vocab_size)
    if cfg["data"]["sampling"] == "random":
        tl = RandomWindows(train_tok, Bsz, T, xp, seed=cfg["seed"])
    else:
        tl = TokenLoader(train_tok, Bsz, T, xp)
    vl = TokenLoader(val_tok, Bsz, T, xp)
    run = Run(cfg, xp, model, opt, opt_fused, tl, accum)
    setup_graph(run)
    start, loss_acc, n_acc, rows = 0, None, 0, []
    if resume is not None:
        arrays, meta = read_resume(resume, cfg, run, say)  # everything checked before anything is written
        apply_resume(run, arrays, meta)
        start, n_acc, rows = int(meta["step"]), int(meta.get("n_acc", 0)), list(meta.get("log", []))
        if n_acc:
            loss_acc = xp.asarray(np.asarray(C.train_arrays(arrays)["loss_acc"]).reshape(()))
    log = Logger(cfg["out_dir"], cfg["log_format"])
    save_yaml(cfg, os.path.join(cfg["out_dir"], "config.yaml"))
    for r in rows:
        log.log(r)
    say(f"{model.model_type} {model.num_parameters() / 1e6:.2f}M params | device {xp.__name__} | fused "
        f"{cfg['fused']} | autocast {cfg['autocast']} | {Bsz}x{T} x {accum} accum = {tbs} tok/step | "
        f"{len(train_tok)} train / {len(val_tok)} val tokens | out {cfg['out_dir']}")
    if init_note:
        say(init_note)
    if resume is not None:
        say(f"resumed from {resume} at step {start}")
    if start >= cfg["max_steps"]:
        say(f"nothing to run: max_steps is {cfg['max_steps']} and the run is at step {start}"
            + (" (raise max_steps to continue it)" if resume is not None else ""))
        return log.rows
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
            if run.opt_fused:
                run.opt.check_errors()  # a refused update (NaN clip scale, ...) stops the run here, weights intact
            lr = lr_at(step, cfg)
            sync(xp)
            now = time.perf_counter()
            ms = (now - t_last) * 1e3 / steps_since
            tps = tbs / (ms / 1e3)
            log.log({"step": step + 1, "kind": "train", "loss": lv, "lr": lr, "grad_norm": nv,
                     "ms_per_step": ms, "tok_per_s": tps})
            con.step(step + 1, cfg["max_steps"], start,
                     f"step {step + 1:5d}/{cfg['max_steps']} | loss {lv:.4f} | lr {lr:.2e} | norm {nv:.3f} | "
                     f"{ms:.1f} ms | {tps:,.0f} tok/s | {memory_str(xp)}")
            loss_acc, n_acc = None, 0
            t_last, steps_since = time.perf_counter(), 0
        if (cfg["ckpt_every"] and (step + 1) % cfg["ckpt_every"] == 0) or (last and cfg["ckpt_final"]):
            path = save_checkpoint(run, step + 1, log.rows, loss_acc, n_acc)
            say(f"checkpoint {path}")
            t_last, steps_since = time.perf_counter(), 0
        if stop_after is not None and step + 1 - start >= stop_after:
            con.close()
            return log.rows
    con.close()
    if cfg["plot"]:
        png = log.plot(cfg["out_dir"])
        say(f"log: {log.path}" + (f" | plot: {png}" if png else
                                   " | plot skipped: matplotlib is not installed (pip install '.[train]')"))
    else:
        say(f"log: {log.path}")
    if cfg["sample_chars"] and cfg["data"]["kind"] == "text" and mc.vocab_size == 256:
        text = _sample(model, cfg["sample_chars"], xp, cfg["autocast"], cfg["seed"])
        say("sample (temperature 0.8, top-k 40):\n  " + text.replace("\n", "\n  "))
    return log.rows
