"""The example trainer: configs parse, the tiny config learns on the CPU, grad accumulation and the
composite (fused: false) path run."""
import os

import numpy as np
import pytest

from cukernels.train import cli, trainer
from cukernels.train import load_config

import cukernels as ck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CFG = lambda n: os.path.join(ROOT, "examples", "configs", f"{n}.yaml")  # noqa: E731


def test_configs_parse_and_1b_shape():
    for n in ["tiny", "small", "llama3.2-1b"]:
        cfg = load_config(CFG(n))
        ck.LlamaConfig.from_dict(cfg["model"])
    c = ck.LlamaConfig.from_dict(load_config(CFG("llama3.2-1b"))["model"])
    assert (c.vocab_size, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size) == (128256, 16, 2048, 32, 8, 8192)
    per_layer = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * 512 + 3 * 2048 * 8192 + 2 * 2048
    n = 2 * c.vocab_size * c.hidden_size + c.num_hidden_layers * per_layer + c.hidden_size
    assert abs(n / 1e9 - 1.50) < 0.01
    cfg = load_config(CFG("tiny"), ["model.hidden_size=64", "fused=false", "lr=0.01"])
    assert cfg["model"]["hidden_size"] == 64 and cfg["fused"] is False and cfg["lr"] == 0.01


def test_lr_schedule():
    cfg = dict(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert trainer.lr_at(0, cfg) == pytest.approx(0.1)
    assert trainer.lr_at(9, cfg) == pytest.approx(1.0)
    assert trainer.lr_at(59, cfg) == pytest.approx(0.55)  # optimizer step t = 60: half way through the cosine
    assert trainer.lr_at(110, cfg) == pytest.approx(0.1)
    # the fused optimizer's device schedule (graph: true, and every fused run) computes the same values
    sched = ck.optim.WarmupCosine(1.0, 110, 10, 0.1)
    for step in range(0, 115, 7):
        assert trainer.lr_at(step, cfg) == pytest.approx(sched.lr_at(step + 1), rel=1e-12)


SMALL = ["max_steps=24", "eval_every=12", "eval_steps=2", "log_every=6", "plot=false", "batch_size=8",
         "seq_len=32", "total_batch_size=256", "model.hidden_size=64", "model.intermediate_size=160",
         "model.num_hidden_layers=2", "warmup_steps=4", "lr=0.01"]


def _run(tmp_path, extra):
    cfg = load_config(CFG("tiny"), SMALL + [f"out_dir={tmp_path}"] + extra)
    rows = trainer.train(cfg, quiet=True)
    tr = [r for r in rows if r["kind"] == "train"]
    va = [r for r in rows if r["kind"] == "val"]
    assert all(np.isfinite(r["loss"]) for r in rows)
    return tr, va


def test_tiny_config_learns_on_cpu(tmp_path):
    tr, va = _run(tmp_path, [])
    assert os.path.exists(os.path.join(tmp_path, "log.jsonl"))
    assert va[0]["loss"] > 5.0  # ~ln(256) at init
    assert tr[-1]["loss"] < va[0]["loss"] - 1.5, (tr, va)
    assert va[-1]["loss"] < va[0]["loss"] - 1.5


def test_composite_path_with_grad_accumulation(tmp_path):
    tr, va = _run(tmp_path, ["fused=false", "total_batch_size=512", "max_steps=12", "log_format=csv"])
    assert tr[-1]["loss"] < va[0]["loss"] - 1.0
    assert os.path.exists(os.path.join(tmp_path, "log.csv"))
