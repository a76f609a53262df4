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
from cukernels import data as ckdata  # noqa: E402
from cukernels.nn import CompositeAdamW  # noqa: E402

DEFAULTS = {
    "model": {},
    "data": {"kind": "text", "path": None, "val_path": None, "val_fraction": 0.1},
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
}


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
        d = cfg
        *parents, leaf = k.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return cfg


def lr_at(step, cfg):
    """Linear warmup to lr over warmup_steps, then cosine down to lr * min_lr_ratio at max_steps."""
    lr, warm, total = cfg["lr"], cfg["warmup_steps"], cfg["max_steps"]
    if step < warm:
        return lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
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
    params = model.parameters()
    no_decay = [p for p in params if p.ndim < 2]
    betas = tuple(cfg["betas"])
    if cfg["fused"] and hasattr(ck, "optim"):
        sparse = [p for p in params if getattr(p, "_sparse_rows", False)]
        kw = dict(shadow_dtype=ck.bfloat16 if cfg["autocast"] else None, no_decay=no_decay)
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


def train(cfg, quiet=False):
    """Run a training; returns the list of log rows (dicts with step, kind, loss, ...)."""
    xp = pick_xp(cfg["device"])
    mc = ck.LlamaConfig.from_dict(cfg["model"])
    B, T = cfg["batch_size"], cfg["seq_len"]
    tbs = cfg["total_batch_size"] or B * T
    if tbs % (B * T):
        raise SystemExit(f"total_batch_size {tbs} is not a multiple of batch_size*seq_len = {B * T}")
    accum = tbs // (B * T)
    if xp is not np:
        xp.random.seed(cfg["seed"])
    model = ck.Llama(mc, xp=xp, seed=cfg["seed"], fused=cfg["fused"], sparse_embedding=cfg["sparse_embedding"])
    if cfg["sparse_embedding"] and not mc.tie_word_embeddings:
        model.model.embed_tokens.weight._sparse_rows = True
    opt, opt_fused = make_optimizer(cfg, model, xp)
    train_tok, val_tok = build_data(cfg, mc.vocab_size)
    tl = ckdata.TokenLoader(train_tok, B, T, xp)
    vl = ckdata.TokenLoader(val_tok, B, T, xp)
    log = Logger(cfg["out_dir"], cfg["log_format"])
    say = (lambda *a: None) if quiet else print
    say(f"device {xp.__name__} | fused {cfg['fused']} | autocast {cfg['autocast']} | params "
        f"{model.num_parameters() / 1e6:.2f}M | {B}x{T} x {accum} accum = {tbs} tok/step | "
        f"{len(train_tok)} train / {len(val_tok)} val tokens")
    amp_ctx = ck.autocast(ck.bfloat16, enabled=bool(cfg["autocast"]))
    loss_acc, n_acc = None, 0
    sync(xp)
    t_last, steps_since = time.perf_counter(), 0
    for step in range(cfg["max_steps"]):
        last = step == cfg["max_steps"] - 1
        if cfg["eval_every"] and (step % cfg["eval_every"] == 0 or last):
            vloss = evaluate(model, vl, cfg["eval_steps"], cfg["autocast"])
            log.log({"step": step, "kind": "val", "loss": vloss})
            say(f"step {step:5d} | val loss {vloss:.4f}")
            sync(xp)
            t_last, steps_since = time.perf_counter(), 0
        lr = lr_at(step, cfg)
        opt.set_lr(lr)
        opt.zero_grad()
        for _ in range(accum):
            x, y = tl.next_batch()
            with amp_ctx:
                loss = model(x, y)
            loss.backward()
            loss_acc = loss.data if loss_acc is None else loss_acc + loss.data
            n_acc += 1
        norm, scale = clip_and_scale(grad_arrays(model), cfg["grad_clip"], accum, opt_fused, xp)
        opt.step(grad_scale=scale)
        steps_since += 1
        if (step + 1) % cfg["log_every"] == 0 or last:
            lv = float(loss_acc) / n_acc  # the one host read, on logging steps only
            nv = float(norm)
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
    png = log.plot(cfg["out_dir"]) if cfg["plot"] else None
    say(f"log: {log.path}" + (f" | plot: {png}" if png else ""))
    return log.rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (examples/configs/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (model.hidden_size=256, fused=false, ...)")
    a = ap.parse_args(argv)
    train(load_config(a.config, a.overrides))


if __name__ == "__main__":
    main()
