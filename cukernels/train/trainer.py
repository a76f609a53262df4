"""The training loop, as library code (nanoGPT's train.py, on cukernels): tape autograd + kernel layers + AdamW,
gradient accumulation, clipping, warmup + cosine lr, evaluation, checkpoints with bit-identical resume, optional
CUDA-graph replay of the whole step.

Each step: ``grad_accum = total_batch_size / (batch_size * seq_len)`` micro-batches, each ``loss.backward()``
accumulating into the optimizer's flat gradient buffer; then the global gradient norm (device), a clip scale
(device) folded with ``1/grad_accum`` into the optimizer's ``grad_scale`` -- no host read -- and one AdamW step.
The loss and norm are read back only on logging steps.

Data parallelism (``distributed``: on under a launcher that sets ``WORLD_SIZE`` > 1, or forced): one process per
GPU, the process group from the launcher's environment (:mod:`cukernels.distributed`; ``train(cfg, group=...)``
takes any group, e.g. a ``FakeGroup`` rank for CPU tests), ``ck.optim.ZeroAdamW`` instead of AdamW (ZeRO-1: the
moments sharded, the gradients reduce-scattered bucket by bucket while the backward runs, bf16 or fp32 on the
wire). ``batch_size`` is per rank and ``total_batch_size`` counts every rank: each micro-step reads one global
batch of ``batch_size * world_size`` rows and rank r takes rows ``[r*B, (r+1)*B)``, so N ranks train on exactly
the tokens one process would (one process with ``batch_size * world_size`` rows, or with ``batch_size`` rows and N
times the accumulation, gives the same global batch). Gradient accumulation reduces once per step (every
micro-batch's backward but the last runs in ``no_sync``), the clip norm is the global one (per-shard squares
all-reduced), the logged loss is averaged over ranks, tokens/s counts every rank, and only rank 0 evaluates,
logs, prints and writes (config.yaml, log, plot, the model part of checkpoints). ``graph: true`` captures the
whole step, collectives included.

Checkpoints (``cukernels.io.checkpoint``'s training schema: one file, streamed, atomic, whole-file SHA-256):
every ``ckpt_every`` steps and at the end, holding the fp32 parameters, the optimizer's moments, step and lr
(bf16 shadows are re-derived on load), the data loader's cursor (or the sampler's RNG state), the running loss
accumulator, the log rows and the config. Resuming continues bit-identically (nothing else draws random numbers
after initialisation). A corrupt, truncated or mismatched file is refused before anything is loaded. Under ZeRO
each rank also writes its optimizer shard next to the main file (:mod:`.ckpt_files`); a checkpoint resumes on any
number of ranks (one process included) and any one-process checkpoint resumes under ZeRO.
"""
from __future__ import annotations

import contextlib
import gc
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
from ..optim import AdamW, CompositeAdamW, WarmupCosine, ZeroAdamW
from ..optim.zero import consolidate_state
from . import ckpt_files as CF
from .config import RESUME_FREE, ZERO_RESUME_FREE, ConfigError, check_world, save_yaml
from .config import defaults as config_defaults
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


class RankRows:
    """This rank's rows of every global batch: the wrapped loader yields ``[batch_size * world_size, T]`` host
    batches; rank r keeps rows ``[r * batch_size, (r + 1) * batch_size)`` and moves only those to its device. The
    state (cursor or sampler RNG) is the global loader's, the same on every rank."""

    def __init__(self, loader, rank, batch_size, xp):
        self.loader, self.rank, self.B, self.xp = loader, rank, batch_size, xp

    def next_batch(self):
        x, y = self.loader.next_batch()
        lo = self.rank * self.B
        x, y = np.ascontiguousarray(x[lo:lo + self.B]), np.ascontiguousarray(y[lo:lo + self.B])
        if self.xp is not np:
            x, y = self.xp.asarray(x), self.xp.asarray(y)
        return x, y

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, s):
        self.loader.load_state_dict(s)


def setup_distributed(cfg, xp, group=None):
    """``(group, owned)``: the process group this run trains over, or ``(None, False)`` for one process.

    ``group`` given (tests: a ``FakeGroup`` rank per thread): used as is. Otherwise ``distributed: auto`` is on
    when the launcher's ``WORLD_SIZE`` > 1; on, a world of one trains through ZeroAdamW over a ``SingleGroup``,
    more ranks join the NCCL group (``owned``: this run destroys it at the end)."""
    from ..distributed import ProcessGroup, SingleGroup, from_environ, init_process_group
    mode = cfg["distributed"]
    if group is not None:
        if mode is False:
            raise ConfigError("distributed: false, but the run was given a process group")
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"group: expected a cukernels.distributed ProcessGroup; got {type(group).__name__}")
        if group.xp is not xp:
            raise SystemExit(f"device: the {group.backend!r} group works on {group.xp.__name__} arrays; this run "
                             f"computes on {xp.__name__} (device={cfg['device']})")
        return group, False
    try:
        env = from_environ()
    except ValueError as e:
        raise SystemExit(f"distributed: the launcher's environment is not usable: {e}") from None
    on = env.world_size > 1 if mode == "auto" else bool(mode)
    if not on:
        if env.world_size > 1:
            raise ConfigError(f"distributed: false, but this process is rank {env.rank} of {env.world_size} "
                              f"({env.source}): every rank would train alone into the same out_dir; set "
                              f"distributed: auto (or true), or start one process")
        return None, False
    if env.world_size == 1:
        return SingleGroup(xp), False
    if xp is np:
        raise SystemExit(f"distributed: {env.world_size} ranks need one GPU each (NCCL); the NumPy path has no "
                         f"multi-process backend (CPU tests run the ranks as threads: train(cfg, group=FakeGroup "
                         f"rank))")
    return init_process_group(), True


def zero_wire(cfg):
    w = cfg["zero"]["wire"]
    if w == "auto":
        w = "bf16" if cfg["autocast"] else "fp32"
    return B.bfloat16 if w == "bf16" else np.dtype(np.float32)


def make_zero_optimizer(cfg, model, xp, group):
    """ZeroAdamW over ``group``: AdamW's groups and hyperparameters, the moments sharded; fp32 values gathered
    after each step for every parameter (fp32 forward) or only the 1-D ones (bf16 autocast: the 2-D weights are
    read through their bf16 shadows); the sparse-row embedding keeps its sparse backward and, with
    ``zero.sparse_exchange``, its lazy row update (the ranks' rows exchanged; else reduced and updated densely);
    gradient-ready hooks so each bucket's reduce-scatter starts during the backward
    (``zero.overlap``); every rank starts from rank 0's parameters."""
    if not cfg["fused"]:
        raise SystemExit("distributed: needs fused: true (ZeroAdamW shards the fused optimizer's flat buffers; the "
                         "composite optimizer keeps one process's state)")
    grad_bf16 = cfg.get("grad_dtype") == "bfloat16"
    if grad_bf16 and zero_wire(cfg) != B.bfloat16:
        raise SystemExit("grad_dtype: bfloat16 sends the bf16 gradient buffers as they are; set zero.wire: bf16 "
                         "(or auto) with it, or grad_dtype: float32 for an fp32 wire")
    named = list(model.named_parameters())
    no_decay = {n for n, p in named if p.ndim < 2}
    params = [p for _, p in named]
    sparse = {n for n, p in named if getattr(p, "_sparse_rows", False)}
    z = cfg["zero"]
    # a rank touches at most its tokens per step of a table's rows: the exchange's pack size
    tokens = check_world(cfg, group.world_size)[0] // group.world_size
    opt = ZeroAdamW(params, lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"],
                    weight_decay=cfg["weight_decay"], group=group, no_decay=no_decay, sparse=sparse or None,
                    shadow_dtype=B.bfloat16 if cfg["autocast"] else None,
                    gather_fp32=(lambda n, a: a.ndim < 2) if cfg["autocast"] else None,
                    wire_dtype=zero_wire(cfg), bucket_elems=z["bucket_elems"], sm_margin=z["sm_margin"],
                    overlap_gather=bool(z["overlap_gather"] and cfg["autocast"]),
                    grad_dtype=B.bfloat16 if grad_bf16 else np.float32,
                    sparse_rows=tokens if sparse and z["sparse_exchange"] else None)
    for n in sparse:
        opt.attach_sparse(n)
    if cfg["autocast"]:
        attach_shadows(params, opt)
    opt.broadcast_params(0)
    if z["overlap"]:
        opt.attach_grad_hooks()
    return opt


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
    opt = AdamW(params, shadow_dtype=B.bfloat16 if cfg["autocast"] else None, sparse=sparse or None,
                grad_dtype=B.bfloat16 if cfg.get("grad_dtype") == "bfloat16" else np.float32, **kw)
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

    def __init__(self, cfg, xp, model, opt, opt_fused, train_loader, accum, group=None):
        self.cfg, self.xp, self.model, self.opt, self.opt_fused = cfg, xp, model, opt, opt_fused
        self.train_loader, self.accum = train_loader, accum
        self.amp_ctx = autocast(B.bfloat16, enabled=bool(cfg["autocast"]))
        self.graph = None
        self.device_lr = False
        self.group = group  # data parallel (ZeroAdamW) when not None
        self.zero = group is not None
        self.rank, self.world = (group.rank, group.world_size) if group is not None else (0, 1)


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
    if run.zero:
        return _zero_step_body(run, batches)
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


def _zero_step_body(run, batches):
    """The step under ZeroAdamW: lazily zeroed gradients, every micro-batch's backward but the last inside
    ``no_sync`` (the reduce-scatters, started by the gradient-ready hooks or at the norm, run once per step), the
    global norm of the rank-averaged gradient times 1/accum, clip scale, the sharded AdamW step, the all-gathers."""
    opt = run.opt
    opt.zero_grad(lazy=True)
    loss_sum = None
    last = len(batches) - 1
    for i, (x, y) in enumerate(batches):
        with opt.no_sync() if i < last else contextlib.nullcontext():
            with run.amp_ctx:
                loss = run.model(x, y)
            loss.backward()
        loss_sum = loss.data if loss_sum is None else loss_sum + loss.data
    norm, scale = opt.clip_grad_norm(run.cfg["grad_clip"], prescale=1.0 / run.accum)
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


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def save_checkpoint(run, step, log_rows, loss_acc, n_acc):
    """Write ``step_<step>.ckpt`` (after ``step`` completed optimizer steps), under ZeRO with every rank's
    optimizer shard next to it; prune old ones. Every rank calls it (ZeRO: collectives inside)."""
    if run.zero:
        return _save_zero_checkpoint(run, step, log_rows, loss_acc, n_acc)
    cfg = run.cfg
    extra = {"loss_acc": np.asarray(_host(loss_acc), np.float32)} if n_acc else {}
    drng = getattr(run.model, "dropout_rng", None)
    if drng is not None:  # the dropout stream's position: a resumed run draws the masks this one would have
        extra["dropout_offset"] = drng.offset
    meta = {"step": int(step), "config": {k: v for k, v in cfg.items() if k != "resume"},
            "loader": run.train_loader.state_dict(), "n_acc": int(n_acc), "log": log_rows}
    path = C.save_training(C.step_path(ckpt_folder(cfg), step), model=run.model,
                           optimizer_state=dict(run.opt.state_dict(copy=False), kind=type(run.opt).__name__), meta=meta,
                           extra_arrays=extra)
    CF.prune(ckpt_folder(cfg), cfg["keep_last"])
    return path


def _save_zero_checkpoint(run, step, log_rows, loss_acc, n_acc):
    """Every rank: all-gather the fp32 parameters (rank 0 saves the model), write its own optimizer shard (and its
    running loss), barrier; rank 0 then checks that it sees every shard and writes the main file last, in the
    one-process units: the running loss summed over every rank's micro-batches, ``n_acc`` counting them all."""
    cfg, opt, g = run.cfg, run.opt, run.group
    folder = ckpt_folder(cfg)
    opt.gather_params()
    total = None
    if n_acc:
        total = run.xp.array(loss_acc, dtype=np.float32).reshape(1)
        g.all_reduce(total, "sum")
    mine = {"loss_acc": np.asarray(_host(loss_acc), np.float32)} if n_acc else {}
    CF.save_shard(CF.shard_path(folder, step, run.rank, run.world), opt.state_dict_shard(copy=False), mine)
    g.barrier()  # each rank renamed its shard into place before arriving here
    path = C.step_path(folder, step)
    if run.rank != 0:
        return path
    names = CF.shard_names(step, run.world)
    missing = [n for n in names if not (path.parent / n).is_file()]
    if missing:
        raise C.CheckpointError(f"{folder}: rank 0 does not see the optimizer shard(s) {missing} that the other "
                                f"ranks wrote; the checkpoint folder (ckpt_dir) must be shared by every rank")
    extra = {"loss_acc": _host(total).reshape(())} if n_acc else {}
    drng = getattr(run.model, "dropout_rng", None)
    if drng is not None:
        extra["dropout_offset"] = drng.offset
    meta = {"step": int(step), "config": {k: v for k, v in cfg.items() if k != "resume"},
            "loader": run.train_loader.state_dict(), "n_acc": int(n_acc) * run.world, "log": log_rows,
            CF.ZERO_META: {"world_size": run.world, "shards": names}}
    ostate = {"kind": "ZeroAdamW", "step": opt.step_count, "lr": opt.get_lr(), "state": {}}
    path = C.save_training(path, model=run.model, optimizer_state=ostate, meta=meta, extra_arrays=extra)
    CF.prune(folder, cfg["keep_last"])
    return path


def resolve_resume(cfg):
    r = cfg["resume"]
    if not r:
        return None
    if str(r) == "latest":
        p = CF.latest(ckpt_folder(cfg))
        if p is None:
            raise C.CheckpointError(f"--resume latest: no step_*.ckpt checkpoint in {ckpt_folder(cfg)} (complete: "
                                    f"with every optimizer shard it names)")
        return p
    if os.path.isdir(r):
        p = CF.latest(r) or CF.latest(os.path.join(r, "checkpoints"))
        if p is None:
            raise C.CheckpointError(f"--resume {r}: no complete step_*.ckpt checkpoint in that folder")
        return p
    return r


class _Like:
    def __init__(self, a=None, shape=None, dtype=None):
        self.shape = tuple(a.shape) if a is not None else tuple(shape)
        self.dtype = np.dtype(a.dtype) if a is not None else np.dtype(dtype)


_ADAMW_FAMILY = {"AdamW", "ZeroAdamW"}  # the same update; the state moves between them exactly


class Resume:
    """A checked checkpoint: ``arrays`` / ``meta`` of the main file, ``shards`` ``[(shard, train arrays)]`` of a
    ZeRO checkpoint (None otherwise), ``world`` the number of ranks that wrote it."""

    def __init__(self, path, arrays, meta, shards):
        self.path, self.arrays, self.meta, self.shards = path, arrays, meta, shards
        self.world = len(shards) if shards is not None else 1


def read_resume(path, cfg, run, say):
    """Load and check a trainer checkpoint (and its ZeRO shards) against this run; nothing is written into the
    run here. Returns a :class:`Resume`. CheckpointError naming the file and what disagrees."""
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
    want = {f"{n}/{k}": _Like(p.data) for n, p in run.model.named_parameters()
            for k in ("exp_avg", "exp_avg_sq")}
    shards = None
    if isinstance(meta.get(CF.ZERO_META), dict):
        shards = CF.read_shards(path, meta)  # each verified; memory-mapped
        for shard, _ in shards:
            mom = {f"{n}/{k}": _Like(shape=e["shape"], dtype=np.float32) for n, e in shard["state"].items()
                   for k in ("exp_avg", "exp_avg_sq")}
            C.check_compatible(path, mom, want, "optimizer")
        try:
            consolidate_state([sh for sh, _ in shards], lazy=True)  # slices tile every parameter, one step
        except ValueError as e:
            raise C.CheckpointError(f"{path}: its optimizer shards disagree: {e}") from None
    else:
        mom = {f"{n}/{k}": _Like(a) for n, s in C.optimizer_state(arrays, meta)["state"].items()
               for k, a in s.items()}
        C.check_compatible(path, mom, want, "optimizer")
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
            f"uninterrupted run")
    kind = meta["optimizer"].get("kind")
    mine_kind = "ZeroAdamW" if run.zero else type(run.opt).__name__
    if kind != mine_kind and not {kind, mine_kind} <= _ADAMW_FAMILY:
        say(f"warning: {path} was written by {kind}; continuing with {mine_kind}")
    return Resume(path, arrays, meta, shards)


def apply_resume(run, res):
    """Write a checked checkpoint into the model, optimizer and loader (parameters first: the optimizer
    re-derives its bf16 shadows from them), one tensor at a time. The optimizer state moves between any numbers
    of ranks: shards -> ZeroAdamW (each rank reads its own slices), shards -> AdamW (assembled per parameter),
    AdamW -> ZeroAdamW (each rank keeps its slices)."""
    arrays, meta = res.arrays, res.meta
    run.model.load_state_dict(C.model_arrays(arrays))
    if res.shards is not None:
        shards = [sh for sh, _ in res.shards]
        if run.zero:
            run.opt.load_state_dict(shards, params=False)  # the model's values (the same numbers) stay
        else:
            run.opt.load_state_dict(consolidate_state(shards, lazy=True)[0])
    else:
        run.opt.load_state_dict(C.optimizer_state(arrays, meta))
    run.train_loader.load_state_dict(meta["loader"])
    drng = getattr(run.model, "dropout_rng", None)
    saved = C.train_arrays(arrays).get("dropout_offset")
    if drng is not None and saved is not None:
        drng.offset[...] = run.xp.asarray(np.asarray(saved, dtype=np.uint64))


def resume_loss_acc(run, res, say):
    """``(loss_acc, n_acc)`` of this rank from a checkpoint taken between two logging steps. The main file holds
    them in one-process units (the sum over every rank's micro-batches, and their count); the same number of
    ranks takes its own exact values from its shard; another number of ranks splits the sum evenly (the logged
    mean is the same up to rounding)."""
    n = int(res.meta.get("n_acc", 0))
    if not n:
        return None, 0
    xp = run.xp
    if res.shards is not None and res.world == run.world and run.zero:
        mine = res.shards[run.rank][1].get("loss_acc")
        if mine is not None:
            return xp.asarray(np.asarray(mine, np.float32).reshape(())), n // run.world
    total = np.asarray(C.train_arrays(res.arrays)["loss_acc"], np.float32).reshape(())
    if n % run.world:
        say(f"note: the running loss of {res.path} covers {n} micro-batches, not a multiple of {run.world} ranks; "
            f"the first logged loss after resuming starts afresh")
        return None, 0
    return xp.asarray(np.float32(total / np.float32(run.world)) if run.world > 1 else total), n // run.world


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


def train(cfg, quiet=False, stop_after=None, console=None, group=None):
    """Run a training from a checked config (:func:`cukernels.train.load_config`); returns the list of log rows
    (dicts with step, kind, loss, ...).

    ``stop_after``: return after that many optimizer steps of this session without the final checkpoint, as a
    killed run would (for tests); the periodic checkpoints are written as usual.

    ``group``: a :class:`cukernels.distributed.ProcessGroup` to train over (data parallel, ZeroAdamW) instead of
    the one the launcher's environment gives; e.g. ``FakeGroup(2).run(lambda g: train(cfg, group=g))`` trains two
    ranks as threads of this process on the NumPy path. Every rank returns the same rows (losses averaged over
    the ranks); only rank 0 prints and writes files."""
    xp = pick_xp(cfg["device"])
    group, owned = setup_distributed(cfg, xp, group)
    try:
        return _train(cfg, xp, group, quiet, stop_after, console)
    finally:
        if owned:
            from ..distributed import destroy_process_group
            gc.collect()  # the step's CUDA graph (it captured collectives) must be gone before the communicator
            destroy_process_group()


def _train(cfg, xp, group, quiet, stop_after, console):
    dist_on = group is not None
    rank, world = (group.rank, group.world_size) if dist_on else (0, 1)
    main = rank == 0
    con = console if (console is not None and main) else Console(cfg["progress"], quiet=quiet or not main)
    say = con.say
    Bsz, T = cfg["batch_size"], cfg["seq_len"]
    tbs, accum = check_world(cfg, world)
    if xp is not np:
        xp.random.seed(cfg["seed"])
    resume = resolve_resume(cfg)
    # On a GPU the model is built in a memory pool of its own, released once the optimizer has copied the
    # parameters into its flat buffers: built in the default pool, later small allocations were carved out of
    # the freed parameter blocks and ~1 GiB of them stayed pooled for the whole run (bench_train, LLaMA-1B).
    build_pool = xp.cuda.MemoryPool() if xp is not np else None
    with xp.cuda.using_allocator(build_pool.malloc) if build_pool is not None else contextlib.nullcontext():
        model, init_note = build_model(cfg, xp)
    if build_pool is not None:
        model.__dict__["_build_pool"] = build_pool  # (its non-parameter arrays live there: keep it alive)
    mc = model.config
    if cfg["sparse_embedding"] and not getattr(mc, "tie_word_embeddings", False):
        model.input_embedding().weight._sparse_rows = True
    if dist_on:
        opt, opt_fused = make_zero_optimizer(cfg, model, xp, group), True
    else:
        opt, opt_fused = make_optimizer(cfg, model, xp)
    if xp is not np:  # the model's own parameter arrays, now copied into the optimizer's flat buffers, are free
        gc.collect()  # blocks the step (its own graph pool) never reuses: 5.6 GiB at the 1B shape (session 4)
        build_pool.free_all_blocks()
        xp.get_default_memory_pool().free_all_blocks()
    train_tok, val_tok = build_data(cfg, mc.vocab_size)
    gb = Bsz * world  # rows of one global micro-batch
    lx = np if dist_on else xp  # under data parallelism the host batch is cut before it moves
    if cfg["data"]["sampling"] == "random":
        tl = RandomWindows(train_tok, gb, T, lx, seed=cfg["seed"])
    else:
        tl = TokenLoader(train_tok, gb, T, lx)
    if dist_on:
        tl = RankRows(tl, rank, Bsz, xp)
    vl = TokenLoader(val_tok, Bsz, T, xp)
    run = Run(cfg, xp, model, opt, opt_fused, tl, accum, group=group)
    try:
        return _loop(run, cfg, xp, con, say, resume, init_note, tbs, vl, len(train_tok), len(val_tok), stop_after)
    finally:
        run.graph = None  # a captured step holds the communicator's collectives (see distributed.group)


def _loop(run, cfg, xp, con, say, resume, init_note, tbs, vl, n_train, n_val, stop_after):
    model, group, main = run.model, run.group, run.rank == 0
    Bsz, T, accum = cfg["batch_size"], cfg["seq_len"], run.accum
    mc = model.config
    setup_graph(run)
    start, loss_acc, n_acc, rows = 0, None, 0, []
    if resume is not None:
        res = read_resume(resume, cfg, run, say)  # everything checked before anything is written
        apply_resume(run, res)
        start, rows = int(res.meta["step"]), list(res.meta.get("log", []))
        loss_acc, n_acc = resume_loss_acc(run, res, say)
    log = Logger(cfg["out_dir"], cfg["log_format"], write=main)
    if main:
        save_yaml(cfg, os.path.join(cfg["out_dir"], "config.yaml"))
    for r in rows:
        log.log(r)
    ranks = ""
    if run.zero:
        ranks = (f" x {run.world} ranks (ZeroAdamW, {np.dtype(run.opt.wire_dtype).name} reduce-scatter, "
                 f"{len(run.opt._order)} bucket(s))")
    say(f"{model.model_type} {model.num_parameters() / 1e6:.2f}M params | device {xp.__name__} | fused "
        f"{cfg['fused']} | autocast {cfg['autocast']} | {Bsz}x{T} x {accum} accum{ranks} = {tbs} tok/step | "
        f"{n_train} train / {n_val} val tokens | out {cfg['out_dir']}")
    if init_note:
        say(init_note)
    if resume is not None:
        note = ""
        if res.world != run.world or (res.shards is not None) != run.zero:
            note = (f" (written by {res.world} rank(s) {'with' if res.shards is not None else 'without'} ZeRO; "
                    f"optimizer state re-sharded)")
        say(f"resumed from {resume} at step {start}{note}")
    if start >= cfg["max_steps"]:
        say(f"nothing to run: max_steps is {cfg['max_steps']} and the run is at step {start}"
            + (" (raise max_steps to continue it)" if resume is not None else ""))
        return log.rows
    sync(xp)
    t_last, steps_since = time.perf_counter(), 0
    for step in range(start, cfg["max_steps"]):
        last = step == cfg["max_steps"] - 1
        if cfg["eval_every"] and (step % cfg["eval_every"] == 0 or last):
            # Rank 0 evaluates the same batches one process would; the others wait in the broadcast. The shadow
            # all-gathers a step deferred (zero.overlap_gather) are collectives: every rank finishes them first.
            if run.zero:
                run.opt.wait_gathers()
            vloss = evaluate(model, vl, cfg["eval_steps"], cfg["autocast"]) if main else 0.0
            if run.zero:
                vb = xp.full((1,), vloss, dtype=np.float64)
                group.broadcast(vb, 0)
                vloss = float(vb[0])
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
            if run.zero:  # the mean over every rank's micro-batches (equal counts: the mean of the rank means)
                lb = xp.array(loss_acc, dtype=np.float32).reshape(1)
                group.all_reduce(lb, "avg")
                lv = float(lb[0]) / n_acc
            else:
                lv = float(loss_acc) / n_acc  # the one host read, on logging steps only
            nv = float(norm)
            if run.opt_fused:
                run.opt.check_errors()  # a refused update (NaN clip scale, ...) stops the run here, weights intact
            lr = lr_at(step, cfg)
            sync(xp)
            now = time.perf_counter()
            ms = (now - t_last) * 1e3 / steps_since
            tps = tbs / (ms / 1e3)  # every rank's tokens
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
    if main and cfg["plot"]:
        png = log.plot(cfg["out_dir"])
        say(f"log: {log.path}" + (f" | plot: {png}" if png else
                                   " | plot skipped: matplotlib is not installed (pip install '.[train]')"))
    elif main:
        say(f"log: {log.path}")
    if cfg["sample_chars"] and cfg["data"]["kind"] == "text" and mc.vocab_size == 256:
        if run.zero:
            run.opt.gather_params()  # (every rank: a collective) the fp32 weights complete for the sampler
        if main:
            text = _sample(model, cfg["sample_chars"], xp, cfg["autocast"], cfg["seed"])
            say("sample (temperature 0.8, top-k 40):\n  " + text.replace("\n", "\n  "))
    return log.rows
