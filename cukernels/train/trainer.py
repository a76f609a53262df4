"""The training loop, as library code (nanoGPT's train.py, on cukernels): evaluate -> step -> log -> checkpoint.

A step: ``grad_accum = total_batch_size / (batch_size * seq_len * world_size)`` micro-batches, each backward
accumulating into the optimizer's flat gradient buffer (all but the last inside ``no_sync``: one reduction a step),
the global norm of the averaged gradient and its clip scale on the device, one AdamW step at the scheduled lr (its
step counter and lr on the device too: no host read; ``graph: true`` replays the whole step from one CUDA graph).
The loss and norm are read back on logging steps only.

Every run trains over a process group (:mod:`cukernels.distributed`): one process is a world of one (the plain
optimizer, nothing sent); under a launcher with ``WORLD_SIZE`` > 1 (or ``train(cfg, group=...)``, e.g. a
``FakeGroup`` rank per thread in CPU tests) one process per GPU and AdamW sharded ZeRO-1 (the ``zero`` keys).
``batch_size`` is per rank and ``total_batch_size`` counts every rank: rank r takes rows ``[r*B, (r+1)*B)`` of each
global batch, so N ranks train on exactly the tokens one process would; the logged loss is the mean over the
ranks, tokens/s counts them all, and only rank 0 evaluates, logs, prints and writes files. Checkpoints
(:mod:`.checkpoint`) resume bit-identically, on any number of ranks.
"""
from __future__ import annotations

import contextlib
import gc
import os
import time

import numpy as np

from .. import _backend as B
from ..amp import attach_shadows, autocast, float8
from ..autograd import no_grad
from ..data import RandomWindows, TokenLoader, train_val_tokens
from ..distributed import destroy_process_group
from ..generation import generate
from ..graph import CapturedStep
from ..optim import AdamW, CompositeAdamW
from ..tokenizer import ByteTokenizer
from . import checkpoint
from .config import ConfigError, TrainConfig, check_world, lr_at, save_yaml
from .preflight import build_model, check_host_memory, check_model_fits, check_out_dir, pick_xp, setup_group
from .console import Console, Logger

__all__ = ["train", "train_step", "evaluate", "lr_at"]


def make_optimizer(o, model, group, tokens):
    """The run's optimizer from its section ``o``: AdamW over ``group`` (``fused``) -- no weight decay on 1-D
    parameters; the sparse-row embedding's rows attached (across ranks exchanged, ``zero.sparse_exchange``, each
    rank touching at most its ``tokens`` per step); fp32 values gathered after each step for every parameter (fp32
    forward) or only the 1-D ones (bf16 autocast: the 2-D weights are read through their shadows); gradient-ready
    hooks (``zero.overlap``); every rank from rank 0's parameters -- or the composite baseline (one rank). The lr
    schedule attached. Only the parameters that require a gradient (``model.named_trainable_parameters()``: under
    ``lora`` the adapters, the frozen base has no gradient and no optimizer state)."""
    named = list(model.named_trainable_parameters())
    params = [p for _, p in named]
    kw = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
              no_decay={n for n, p in named if p.ndim < 2})
    if not o.fused:
        opt = CompositeAdamW(params, **kw)
    else:
        z, sparse = o.zero, {n for n, p in named if getattr(p, "_sparse_rows", False)}
        opt = AdamW(params, group=group, shadow_dtype=B.bfloat16 if o.autocast else None, sparse=sparse or None,
                    grad_dtype=B.bfloat16 if o.grad_dtype == "bfloat16" else np.float32,
                    gather_fp32=(lambda n, a: a.ndim < 2) if o.autocast else None,
                    wire_dtype=B.bfloat16 if z.wire == "bf16" else np.float32, bucket_elems=z.bucket_elems,
                    sm_margin=z.sm_margin, overlap_gather=z.overlap_gather and o.autocast,
                    sparse_rows=tokens if sparse and z.sparse_exchange else None,
                    fp8_shadows=o.fp8_shadow and (group is None or group.world_size == 1), **kw)
        for n in sparse:
            opt.attach_sparse(n)  # the embedding backward lists touched rows; Adam updates only those
        opt.broadcast_params(0)
        if z.overlap:
            opt.attach_grad_hooks()
    if o.autocast:
        attach_shadows(params, opt)
    opt.set_schedule(o.schedule())
    return opt


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


def precision_of(cfg):
    """What the config's steps run under ``autocast``: ``ck.bfloat16``, or with ``fp8: true`` the module's
    ``float8`` recipe (so a caller may swap it) with the config's fp8_* keys applied."""
    if not cfg.fp8:
        return B.bfloat16
    keys = {"head_grad_dtype": B.float8_e5m2, "head_fp8_dw": cfg.fp8_head is True} if cfg.fp8_head else {}
    if cfg.fp8_fast_accum_grad:
        keys["fast_accum_grad"] = True
    return float8.replace(scaling=cfg.fp8_scaling, **keys)


class Run:
    """Everything a training step touches: config, model, optimizer, loader, process group, precision, graph."""

    def __init__(self, cfg, xp, group, model, opt, train_loader, accum):
        self.cfg, self.xp, self.group, self.model, self.opt = cfg, xp, group, model, opt
        self.train_loader, self.accum = train_loader, accum
        self.rank, self.world = group.rank, group.world_size
        self.amp_ctx = autocast(precision_of(cfg), enabled=cfg.autocast)
        self.graph = None


def train_step(run, step):
    """One optimizer step (0-based ``step``): ``accum`` micro-batches forward + backward into the flat gradient
    buffer, the clipped global norm on the device, one AdamW step (its lr from the device step counter).

    Returns ``(sum of the micro-batch losses, grad norm)`` as device scalars: no host read. With ``graph: true``
    the batches are copied into fixed device buffers and the rest of the step is replayed from one CUDA graph."""
    batches = [run.train_loader.next_batch() for _ in range(run.accum)]
    if run.graph is None:
        return _step_body(run, batches)
    for i, (x, y) in enumerate(batches):
        run.ids_buf[i][...] = x
        run.tgt_buf[i][...] = y
    return run.graph()


def _step_body(run, batches):
    """Lazily zeroed gradients (the first backward write of each overwrites it: weight-gradient GEMMs with beta =
    0), every micro-batch's backward but the last inside ``no_sync`` (the reductions, started by the
    gradient-ready hooks or at the norm, run once per step), the global norm of the averaged gradient (times
    1/accum) and its clip scale, the AdamW step (across ranks: the sharded update and its all-gathers)."""
    opt = run.opt
    opt.zero_grad(lazy=True)
    loss_sum = None
    for i, (x, y) in enumerate(batches):
        with opt.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
            with run.amp_ctx:
                loss = run.model(x, y)
            loss.backward()
        loss_sum = loss.data if loss_sum is None else loss_sum + loss.data
    norm, scale = opt.clip_grad_norm(run.cfg.optim.grad_clip, prescale=1.0 / run.accum)
    opt.step(grad_scale=scale)
    return loss_sum, norm


def setup_graph(run):
    """With ``graph: true``: fixed input buffers and a CapturedStep over the step body (GPU, fused only)."""
    cfg, xp = run.cfg, run.xp
    if not cfg.graph:
        return
    if xp is np or not cfg.fused:
        raise ConfigError("graph: true needs the GPU and fused: true (the composite optimizer keeps host state)")
    shape = (run.accum, cfg.data.batch_size, cfg.data.seq_len)
    run.ids_buf, run.tgt_buf = xp.zeros(shape, dtype=np.int32), xp.zeros(shape, dtype=np.int32)
    batches = [(run.ids_buf[i], run.tgt_buf[i]) for i in range(run.accum)]
    run.graph = CapturedStep(lambda: _step_body(run, batches), warmup=2)


def _sample(model, n, xp, use_autocast, seed):
    """``n`` bytes sampled after a newline from the trained model (temperature 0.8, top-k 40, the run's seed)."""
    n = min(n, model.max_positions() - 1)
    ids = generate(model, np.array([[10]], dtype=np.int32), n, temperature=0.8, top_k=40, seed=seed,
                   autocast=B.bfloat16 if use_autocast else None)
    return ByteTokenizer().decode(ids[0, 1:])


def train(cfg, quiet=False, stop_after=None, console=None, group=None):
    """Run a training from a checked config (:func:`cukernels.train.load_config`'s dict, or a
    :class:`~cukernels.train.config.TrainConfig`); returns the list of log rows (dicts with step, kind, loss, ...).

    ``stop_after``: return after that many optimizer steps of this session without the final checkpoint, as a
    killed run would (for tests); the periodic checkpoints are written as usual.

    ``group``: a :class:`cukernels.distributed.ProcessGroup` to train over instead of the one the launcher's
    environment gives; e.g. ``FakeGroup(2).run(lambda g: train(cfg, group=g))`` trains two ranks as threads of this
    process on the NumPy path. Every rank returns the same rows (losses averaged over the ranks); only rank 0 prints
    and writes files."""
    cfg = cfg if isinstance(cfg, TrainConfig) else TrainConfig.from_dict(cfg)
    check_out_dir(cfg)
    xp = pick_xp(cfg.device)
    group, owned = setup_group(cfg, xp, group)
    try:
        return _train(cfg, xp, group, quiet, stop_after, console)
    finally:
        if owned:
            gc.collect()  # the step's CUDA graph (it captured collectives) must be gone before the communicator
            destroy_process_group()


def _train(cfg, xp, group, quiet, stop_after, console):
    rank, world = group.rank, group.world_size
    con = console if (console is not None and rank == 0) else Console(cfg.progress, quiet=quiet or rank != 0)
    tbs, accum = check_world(cfg, world)
    resume = checkpoint.resolve(cfg.ckpt.resume, cfg.ckpt.folder)  # (a missing checkpoint fails before the build)
    if resume:  # a changed max_steps keeps the checkpoint's schedule (lr_decay_steps: null)
        cfg = checkpoint.resume_schedule(cfg, resume, con.say)
    d = cfg.data
    try:  # the data before the model: a missing file fails before a large build
        train_tok, val_tok = train_val_tokens(d.kind, d.path, d.val_path, d.val_fraction, d.batch_size * d.seq_len + 1)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if xp is np:
        check_host_memory(cfg)
    if xp is not np:
        xp.random.seed(cfg.seed)
    # On a GPU the model is built in a memory pool of its own, released once the optimizer has copied the
    # parameters into its flat buffers: built in the default pool, later small allocations were carved out of
    # the freed parameter blocks and ~1 GiB of them stayed pooled for the whole run (bench_train, LLaMA-1B).
    build_pool = xp.cuda.MemoryPool() if xp is not np else None
    with xp.cuda.using_allocator(build_pool.malloc) if build_pool is not None else contextlib.nullcontext():
        model, init_note, model_section = build_model(cfg, xp)
    cfg = cfg.with_model(model_section)
    check_model_fits(cfg, model, train_tok, val_tok)
    model.set_recompute(cfg.recompute)  # (training forwards only: evaluation and sampling record nothing)
    if build_pool is not None:
        model.__dict__["_build_pool"] = build_pool  # (its non-parameter arrays live there: keep it alive)
    if cfg.sparse_embedding and not getattr(model.config, "tie_word_embeddings", False):
        model.input_embedding().weight._sparse_rows = True
    opt = make_optimizer(cfg.optim, model, group, tbs // world)
    if xp is not np:  # the model's own parameter arrays, now copied into the optimizer's flat buffers, are free
        gc.collect()  # blocks the step (its own graph pool) never reuses: 5.6 GiB at the 1B shape (bench_train's memory rows)
        build_pool.free_all_blocks()
        xp.get_default_memory_pool().free_all_blocks()
    per_rank = dict(rank=rank, world_size=world)
    tl = (RandomWindows(train_tok, d.batch_size, d.seq_len, xp, d.seed, **per_rank) if d.sampling == "random"
          else TokenLoader(train_tok, d.batch_size, d.seq_len, xp, **per_rank))
    run = Run(cfg, xp, group, model, opt, tl, accum)
    try:
        return _loop(run, con, resume, init_note, tbs, TokenLoader(val_tok, d.batch_size, d.seq_len, xp),
                     f"{len(train_tok)} train / {len(val_tok)} val tokens", stop_after)
    finally:
        run.graph = None  # a captured step holds the communicator's collectives (see distributed.group)


def _loop(run, con, resume, init_note, tbs, val_loader, data_note, stop_after):
    cfg, model, opt, group, xp, say = run.cfg, run.model, run.opt, run.group, run.xp, con.say
    main, schedule = run.rank == 0, cfg.optim.schedule()
    setup_graph(run)
    start, rows, loss_acc, n_acc = checkpoint.load(run, resume, say) if resume else (0, [], None, 0)
    log = Logger(cfg.out_dir, cfg.log_format, write=main)
    if main:
        save_yaml(cfg.as_dict(), os.path.join(cfg.out_dir, "config.yaml"))
    for r in rows:
        log.log(r)
    ranks = (f" x {run.world} ranks (ZeRO-1, {np.dtype(opt.wire_dtype).name} reduce-scatter, {len(opt._order)} "
             f"bucket(s))" if run.world > 1 else "")
    say(f"{model.model_type} {model.num_parameters() / 1e6:.2f}M params | device {xp.__name__} | fused {cfg.fused} | "
        f"autocast {('fp8' if cfg.fp8 else 'bf16') if cfg.autocast else None} | {cfg.data.batch_size}x{cfg.data.seq_len} x {run.accum} "
        f"accum{ranks} = {tbs} tok/step | {data_note} | out {cfg.out_dir}")
    if init_note:
        say(init_note)
    if start >= cfg.max_steps:
        say(f"nothing to run: max_steps is {cfg.max_steps} and the run is at step {start}"
            + (" (raise max_steps to continue it)" if resume else ""))
        return log.rows
    sync(xp)
    t_last, steps_since = time.perf_counter(), 0
    for step in range(start, cfg.max_steps):
        last = step == cfg.max_steps - 1
        if cfg.eval_every and (step % cfg.eval_every == 0 or last):
            # Rank 0 evaluates the batches one process would; the others wait in the broadcast. The shadow
            # all-gathers a step deferred (zero.overlap_gather) are collectives: every rank finishes them first.
            opt.wait_gathers()
            vb = xp.full((1,), evaluate(model, val_loader, cfg.eval_steps, cfg.autocast) if main else 0.0, np.float64)
            vloss = float(group.broadcast(vb, 0)[0])
            log.log({"step": step, "kind": "val", "loss": vloss})
            say(f"step {step:5d} | val loss {vloss:.4f}")
            sync(xp)
            t_last, steps_since = time.perf_counter(), 0
        loss_sum, norm = train_step(run, step)
        # (copy: with graph: true, loss_sum is the graph's output buffer, rewritten by every replay)
        loss_acc = loss_sum.copy() if loss_acc is None else loss_acc + loss_sum
        n_acc += run.accum
        steps_since += 1
        if (step + 1) % cfg.log_every == 0 or last:
            # the mean over every rank's micro-batches (equal counts: the mean of the rank means); the host reads
            lb = group.all_reduce(xp.array(loss_acc, dtype=np.float32).reshape(1), "avg")
            lv, nv = float(lb[0]) / n_acc, float(norm)
            opt.check_errors()  # a refused update (NaN clip scale, ...) stops the run here, weights intact
            lr = float(schedule.lr_at(step + 1))
            sync(xp)
            ms = (time.perf_counter() - t_last) * 1e3 / steps_since
            tps = tbs / (ms / 1e3)  # every rank's tokens
            log.log({"step": step + 1, "kind": "train", "loss": lv, "lr": lr, "grad_norm": nv, "ms_per_step": ms,
                     "tok_per_s": tps})
            con.step(step + 1, cfg.max_steps, start,
                     f"step {step + 1:5d}/{cfg.max_steps} | loss {lv:.4f} | lr {lr:.2e} | norm {nv:.3f} | "
                     f"{ms:.1f} ms | {tps:,.0f} tok/s | {memory_str(xp)}")
            loss_acc, n_acc = None, 0
            t_last, steps_since = time.perf_counter(), 0
        if (cfg.ckpt.every and (step + 1) % cfg.ckpt.every == 0) or (last and cfg.ckpt.final):
            say(f"checkpoint {checkpoint.save(run, step + 1, log.rows, loss_acc, n_acc)}")
            t_last, steps_since = time.perf_counter(), 0
        if stop_after is not None and step + 1 - start >= stop_after:
            con.close()
            return log.rows
    con.close()
    if cfg.lora is not None:
        opt.gather_params()  # (every rank: a collective) the adapters' fp32 values complete
        if main:
            say(f"adapter: {model.save_adapter(os.path.join(cfg.out_dir, 'adapter'))} (PEFT's format: "
                f"ck.from_pretrained(base, adapter=...), peft.PeftModel.from_pretrained)")
    if main and cfg.plot:
        png = log.plot(cfg.out_dir)
        say(f"log: {log.path}" + (f" | plot: {png}" if png else
                                   " | plot skipped: matplotlib is not installed (pip install '.[train]')"))
    elif main:
        say(f"log: {log.path}")
    if cfg.sample_chars and cfg.data.kind == "text" and model.config.vocab_size == 256:
        opt.gather_params()  # (every rank: a collective) the fp32 weights complete for the sampler
        if main:
            text = _sample(model, cfg.sample_chars, xp, cfg.autocast, cfg.seed)
            say("sample (temperature 0.8, top-k 40):\n  " + text.replace("\n", "\n  "))
    return log.rows
