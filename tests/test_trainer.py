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


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_bf16_gradients_track_fp32_gradients(tmp_path, device):
    """grad_dtype: bfloat16 (autocast, one micro-batch): the same run as fp32 gradient buffers within bf16
    rounding of the weight gradients; two micro-batches a step are refused (they would round each)."""
    base = ["autocast=bf16", "sparse_embedding=true", "total_batch_size=256", "max_steps=8", f"device={device}",
            "sample_chars=0"]
    runs = {}
    for gd in ("float32", "bfloat16"):
        tr, _ = _run(tmp_path / gd, base + [f"grad_dtype={gd}"])
        runs[gd] = np.array([(r["loss"], r["grad_norm"]) for r in tr])
    np.testing.assert_allclose(runs["bfloat16"], runs["float32"], rtol=2e-3)
    assert not np.array_equal(runs["bfloat16"], runs["float32"])  # the buffers did change precision
    from cukernels.train.config import check_world
    cfg = load_config(CFG("tiny"), SMALL + base[:2] + ["grad_dtype=bfloat16", "total_batch_size=512"])
    with pytest.raises(ck.train.ConfigError, match="grad_dtype: bfloat16 needs one micro-batch a step"):
        check_world(cfg, 1)
    with pytest.raises(ck.train.ConfigError, match=r"batch_size \* seq_len \* 2 ranks = 512; got 1024"):
        check_world(dict(cfg, total_batch_size=1024), 2)
    assert check_world(cfg, 2)[1] == 1  # 2 ranks x one micro-batch each


@pytest.mark.parametrize("override,match", [
    ("max_step=5", r"max_step: unknown config key \(did you mean 'max_steps'\?\)"),
    ("model.num_layers=3", r"model.num_layers: unknown key for model.type llama \(did you mean 'num_hidden_layers'\?\)"),
    ("log_format=xml", r"log_format: expected one of \['jsonl', 'csv'\]; got 'xml'"),
    ("data.kind=bogus", r"data.kind: expected one of \['text', 'llmc'\]"),
    ("fused=maybe", "fused: expected true or false; got 'maybe'"),
    ("batch_size=0", "batch_size: expected > 0; got 0"),
    ("batch_size=-4", "batch_size: expected > 0; got -4"),
    ("batch_size=abc", "batch_size: expected an integer; got 'abc'"),
    ("max_steps=2.5", "max_steps: expected an integer; got 2.5"),
    ("device=tpu", r"device: expected one of \['cpu', 'gpu', 'auto'\]; got 'tpu'"),
    ("betas=[0.9, 1.5]", r"betas: expected two numbers in \[0, 1\)"),
    ("lr=-1", "lr: expected >= 0; got -1.0"),
    ("model.type=gpt9", "model.type: expected one of"),
    ("model.hidden_size=15", "model: .*hidden_size \\(15\\) must be a multiple"),
    ("total_batch_size=100", "total_batch_size: 100 is not a multiple of batch_size \\* seq_len"),
    ("grad_dtype=bfloat16", "grad_dtype: bfloat16 needs autocast: bf16"),
    ("grad_dtype=float16", r"grad_dtype: expected one of \['float32', 'bfloat16'\]"),
    ("nokey", "expected key=value"),
])
def test_config_errors_name_the_key(override, match):
    with pytest.raises(ck.train.ConfigError, match=match):
        load_config(CFG("tiny"), [override])


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --config {tmp_path / 'nope.yaml'}: no such file; a path to a YAML file or one of "
                          f"the shipped configs: ") and "tiny" in err and "\n" not in err, err
    assert cli.main(["--config", CFG("tiny"), "num_layers=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: num_layers: unknown config key") and "\n" not in err


def test_run_folder_gets_resolved_config_and_nothing_to_run_says_so(tmp_path, capsys):
    import yaml
    cfg = load_config(CFG("tiny"), SMALL + [f"out_dir={tmp_path}", "max_steps=0"])
    rows = trainer.train(cfg)
    assert rows == [] and "nothing to run: max_steps is 0" in capsys.readouterr().out
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["hidden_size"] == 64 and saved["max_steps"] == 0 and saved["model"]["type"] == "llama"
    assert load_config(str(tmp_path / "config.yaml")) == cfg  # the resolved file is itself a valid config


def test_console_bar_and_lines():
    import io
    from cukernels.train.console import Console
    s = io.StringIO()
    c = Console("bar", stream=s)
    c.step(5, 10, 0, "step 5/10 | loss 1.0")
    c.say("val")
    c.close()
    assert "\r[############------------] step 5/10" in s.getvalue() and "<" in s.getvalue()
    s = io.StringIO()
    Console("auto", stream=s).step(5, 10, 0, "step 5/10 | loss 1.0")  # not a tty: plain lines
    assert s.getvalue() == "step 5/10 | loss 1.0\n"
