"""The front door (issue 35, part B): the command lines (train, generate, export) answer a user error with one line
and exit code 2 before anything runs, without --config the trainer trains the tiny config, YAML numbers like 3e-3,
device cuda, --help lists the model fields, a run exports to a Hugging Face folder whose config.json carries the
special-token ids, ck.from_pretrained takes a run folder or a checkpoint, and a resumed run with a raised max_steps
keeps its lr schedule. (The installed-wheel path end to end: tests/test_newcomer.py.)"""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import cukernels as ck
from cukernels import export, sample
from cukernels.train import cli, config, load_config, preflight, trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "configs" / "tiny.yaml")
FIX = ROOT / "tests" / "fixtures" / "tokenizer_shakespeare"
SMALL = ["max_steps=8", "eval_every=4", "eval_steps=1", "log_every=1", "plot=false", "batch_size=4", "seq_len=16",
         "total_batch_size=64", "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "warmup_steps=2", "lr=0.01",
         "sample_chars=0", "ckpt_every=4", "progress=lines"]


def _one_line_error(capsys, starts):
    err = capsys.readouterr().err.strip().splitlines()
    errs = [e for e in err if e.startswith("error:")]
    assert len(errs) == 1 and errs[0].startswith(f"error: {starts}"), err
    assert not any("Traceback" in e for e in err), err
    return errs[0]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny trained run (8 steps, checkpoints at 4 and 8)."""
    out = tmp_path_factory.mktemp("run") / "tiny"
    trainer.train(load_config(TINY, SMALL + [f"out_dir={out}"]), quiet=True)
    return out


# ------------------------------------------------------------------------------------------------ trainer CLI
def test_without_config_the_trainer_trains_the_tiny_config(tmp_path, capsys):
    assert cli.main([f"out_dir={tmp_path}", "max_steps=0", "plot=false"]) == 0
    err = capsys.readouterr().err
    assert "no --config: training the tiny config" in err and "small" in err, err
    saved = config.read_yaml((tmp_path / "config.yaml").read_text())
    assert saved["model"]["hidden_size"] == 128 and saved["model"]["vocab_size"] == 256  # tiny.yaml's, not 7B
    assert load_config("tiny") == load_config(TINY)  # a shipped config by name


def test_yaml_numbers_and_device_cuda(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 3e-3\nweight_decay: 1e-1\nmax_steps: 1e2\ndevice: cuda\nmodel: {rms_norm_eps: 1e-5}\n")
    cfg = load_config(str(f))
    assert cfg["lr"] == 0.003 and cfg["weight_decay"] == 0.1 and cfg["max_steps"] == 100
    assert cfg["device"] == "gpu" and cfg["model"]["rms_norm_eps"] == 1e-5
    assert load_config(TINY, ["lr=3e-3", "device=cuda"])["device"] == "gpu"
    with pytest.raises(ck.train.ConfigError, match="batch_size: expected an integer; got 'abc'"):
        load_config(TINY, ["batch_size=abc"])


@pytest.mark.parametrize("overrides,starts", [
    (["seq_len=512", "total_batch_size=null"],
     "seq_len: 512 tokens a sequence exceed the model's 256 positions (model.max_position_embeddings)"),
    (["data.path=/nonexistent/text.txt"], "data.path: no such file: /nonexistent/text.txt"),
    (["model.vocab_size=100"], "data: token id 12"),  # (the text's bytes reach 126)
    (["device=gpu"] if not ck.gpu_available() else ["graph=true", "device=cpu"], ""),
])
def test_what_can_be_checked_is_checked_before_the_first_step(tmp_path, capsys, monkeypatch, overrides, starts):
    monkeypatch.setattr(trainer, "train_step", lambda *a: pytest.fail("a step ran before the check"))
    rc = cli.main(["--config", TINY, f"out_dir={tmp_path}"] + SMALL + overrides)
    assert rc == 2
    _one_line_error(capsys, starts or overrides[0].split("=")[0])


def test_gpt2_positions_and_out_dir_and_memory(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trainer, "train_step", lambda *a: pytest.fail("a step ran before the check"))
    gpt2 = str(ROOT / "examples" / "configs" / "gpt2-tiny.yaml")
    assert cli.main(["--config", gpt2, f"out_dir={tmp_path / 'g'}", "seq_len=200", "total_batch_size=null"]) == 2
    _one_line_error(capsys, "seq_len: 200 tokens a sequence exceed the model's 128 positions (model.n_positions)")
    (tmp_path / "file").write_text("")
    assert cli.main(["--config", TINY, f"out_dir={tmp_path / 'file'}"]) == 2
    _one_line_error(capsys, f"out_dir: cannot write into '{tmp_path / 'file'}'")
    # a model that cannot fit the host's memory on the NumPy path: one line, not the out-of-memory killer
    monkeypatch.setattr(preflight, "_host_memory", lambda: 24 * 2**30)
    f = tmp_path / "seven_b.yaml"
    f.write_text("device: cpu\n")  # model: {} -- LLaMA's defaults, the 7B shape
    assert cli.main(["--config", str(f), f"out_dir={tmp_path / 'b'}"]) == 2
    _one_line_error(capsys, "model: 6.74B parameters need about 100.4 GiB on the CPU")
    with pytest.raises(ck.train.ConfigError, match="6.74B parameters"):  # --debug: the traceback
        cli.main(["--config", str(f), f"out_dir={tmp_path / 'b'}", "--debug"])


def test_help_lists_every_model_field(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for family in (ck.LlamaConfig, ck.GPT2Config):
        for name in family.field_names():
            assert f"{name}=" in out, name
    assert "llama: vocab_size=32000, hidden_size=4096" in out and "gpt2: vocab_size=50257, n_positions=1024" in out
    assert "lr_decay_steps" in out and "default: tiny" in " ".join(out.split())
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    out = capsys.readouterr().out
    assert "LLaMA" not in out and "--tokenizer" in out and "positions" in out


# ------------------------------------------------------------------------------------------------ generate CLI
def test_generate_errors_are_one_line_before_anything_runs(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sample, "generate", lambda *a, **k: pytest.fail("generation started"))
    base = ["--checkpoint", str(run_dir), "--device", "cpu"]
    for args, starts in [
        (["--prompt-ids", "1 300"], "--prompt-ids: token id 300 is outside the model's vocabulary (0..255)"),
        (["--prompt-ids", "1 x"], "--prompt-ids: expected integer token ids"),
        (["--prompt", "ROMEO:", "--max-new-tokens", "251"],
         "--max-new-tokens: the prompt's 6 tokens + 251 new ones exceed the model's 256 positions; at most 250"),
        (["--prompt", "ROMEO:", "--eos-id", "999"], "--eos-id: 999 is outside"),
    ]:
        assert sample.main(base + args) == 2, args
        _one_line_error(capsys, starts)
    assert sample.main(["--checkpoint", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    _one_line_error(capsys, f"{tmp_path / 'nope'}: no such file or folder")
    m = ck.Llama(ck.LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, max_position_embeddings=32))
    m.save_pretrained(tmp_path / "v300")
    assert sample.main(["--checkpoint", str(tmp_path / "v300"), "--prompt", "hi", "--device", "cpu"]) == 2
    _one_line_error(capsys, "--prompt: the model has 300 tokens and no tokenizer was found")


class _Writes:
    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass


def test_generate_prompt_text_through_tokenizer_json_streams(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    tok = ck.Tokenizer.from_pretrained(FIX)
    m = ck.Llama(ck.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, max_position_embeddings=64), seed=3)
    m.save_pretrained(tmp_path / "hf")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIX / f, tmp_path / "hf" / f)
    ids = tok.encode("ROMEO: my lord")
    want = ck.generate(m, ids, 12, temperature=0, eos_token_id=tok.eos_token_id)
    w = _Writes()
    monkeypatch.setattr("sys.stdout", w)
    assert sample.main(["--checkpoint", str(tmp_path / "hf"), "--prompt", "ROMEO: my lord", "--max-new-tokens", "12",
                        "--temperature", "0", "--device", "cpu"]) == 0
    text = "".join(w.parts)
    assert text.rstrip("\n") == tok.decode(want, skip_special_tokens=True)
    assert len([p for p in w.parts if p]) > 2  # streamed: the prompt, then piece by piece


# ------------------------------------------------------------------------------------------------ export
def test_export_a_run_and_load_it_back(run_dir, tmp_path, capsys):
    ckpt = run_dir / "checkpoints" / "step_00000008.ckpt"
    a, b = ck.from_pretrained(run_dir), ck.from_pretrained(ckpt)  # a run folder and a .ckpt
    assert export.main([str(run_dir), str(tmp_path / "hf")]) == 0
    assert "ck.from_pretrained" in capsys.readouterr().out
    cj = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: cj[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == dict.fromkeys(
        ("bos_token_id", "eos_token_id", "pad_token_id"))  # the byte tokenizer has none: explicit nulls
    c = ck.from_pretrained(tmp_path / "hf")
    assert isinstance(ck.Tokenizer.from_pretrained(tmp_path / "hf"), ck.ByteTokenizer)
    ids = np.array([[72, 101, 108, 108, 111]])
    for m in (b, c):
        np.testing.assert_array_equal(m(ids).data, a(ids).data)
    assert export.main([str(run_dir), str(tmp_path / "hf")]) == 2  # not over an earlier export unasked
    _one_line_error(capsys, f"OUT_DIR {tmp_path / 'hf'}: exists and is not empty")
    assert export.main([str(run_dir), str(tmp_path / "hf"), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert export.main([str(tmp_path), str(tmp_path / "x")]) == 2
    _one_line_error(capsys, f"{tmp_path}: neither a Hugging Face folder")


def test_exported_configs_carry_special_ids(tmp_path):
    # GPT-2 of 256 tokens: null ids, not transformers' 50256; a GPT-2-sized vocabulary: 50256
    g = ck.GPT2(ck.GPT2Config(vocab_size=256, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    cj = json.loads((g.save_pretrained(tmp_path / "g") / "config.json").read_text())
    assert (cj["bos_token_id"], cj["eos_token_id"], cj["pad_token_id"]) == (None, None, None)
    big = ck.GPT2Config(vocab_size=50304, n_positions=32, n_embd=16, n_layer=1, n_head=2).to_hf()
    assert (big["bos_token_id"], big["eos_token_id"]) == (50256, 50256)
    # ids read from config.json survive the round trip (a list of end tokens too); ids outside the vocab are dropped
    m = ck.Llama(ck.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0))
    m.save_pretrained(tmp_path / "l")
    again = ck.from_pretrained(tmp_path / "l")
    assert (again.config.bos_token_id, again.config.eos_token_id, again.config.pad_token_id) == (1, [2, 3], 0)
    d = json.loads((tmp_path / "l" / "config.json").read_text())
    (tmp_path / "l" / "config.json").write_text(json.dumps(dict(d, bos_token_id=5000)))
    assert ck.from_pretrained(tmp_path / "l").config.bos_token_id is None
    with pytest.raises(ValueError, match=r"LlamaConfig.eos_token_id: expected null or a token id in \[0, 64\)"):
        ck.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, eos_token_id=64)


def test_export_with_a_tokenizer_copies_it_and_takes_its_ids(tmp_path):
    pytest.importorskip("tokenizers")
    m = ck.Llama(ck.LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, max_position_embeddings=32))
    m.save_pretrained(tmp_path / "src")
    out, tok = export.export(tmp_path / "src", tmp_path / "hf", tokenizer=FIX)
    cj = json.loads((out / "config.json").read_text())
    assert (cj["bos_token_id"], cj["eos_token_id"], cj["pad_token_id"]) == (0, 1, 2)  # the fixture's specials
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert ck.Tokenizer.from_pretrained(out).encode("ROMEO:") == tok.encode("ROMEO:")


def test_exported_config_parses_in_transformers_without_warnings(run_dir, tmp_path):
    """transformers' AutoConfig (no torch needed) reads the export with no warning about the special ids (the full
    model load and the logits: tests/gpu_export_check.py on the GPU machine)."""
    transformers = pytest.importorskip("transformers")
    import logging
    import warnings
    export.export(run_dir, tmp_path / "llama")
    ck.GPT2(ck.GPT2Config(vocab_size=256, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(
        tmp_path / "gpt2")  # (transformers assumed 50256 for GPT-2's ids, and warned)
    for name in ("llama", "gpt2"):
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        lg = logging.getLogger("transformers")
        lg.addHandler(handler)
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                c = transformers.AutoConfig.from_pretrained(tmp_path / name)
        finally:
            lg.removeHandler(handler)
        msgs = [r.getMessage() for r in records] + [str(x.message) for x in w]
        assert not [m for m in msgs if "token_id" in m], (name, msgs)
        assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (None, None, None), name


# ------------------------------------------------------------------------------------------------ resume
def test_resume_with_a_raised_max_steps_keeps_the_schedule(run_dir, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(run_dir, run)
    rows = trainer.train(load_config(TINY, SMALL + [f"out_dir={run}", "max_steps=12", "resume=latest"]))
    out = capsys.readouterr().out
    assert "note: max_steps 8 -> 12: the lr schedule keeps the checkpoint's length of 8 steps" in out, out
    assert "with a different" not in out
    lrs = [r["lr"] for r in rows if r["kind"] == "train"]
    final = 0.01 * 0.1
    assert lrs[7] == pytest.approx(final) and all(x == pytest.approx(final) for x in lrs[8:]), lrs
    assert all(b <= a for a, b in zip(lrs[1:], lrs[2:])), lrs  # after the warmup the lr never rises
    assert config.read_yaml((run / "config.yaml").read_text())["lr_decay_steps"] == 8
    # asked for: the cosine stretched over 16 steps, and the rise is said with both values
    again = tmp_path / "s"
    shutil.copytree(run_dir, again)
    rows = trainer.train(load_config(TINY, SMALL + [f"out_dir={again}", "max_steps=9", "lr_decay_steps=16",
                                                    "resume=latest"]))
    out = capsys.readouterr().out
    assert "warning: lr_decay_steps 8 -> 16: at step 8 the learning rate rises from 1.00e-03 to" in out, out
    assert rows[-1]["lr"] == pytest.approx(config.lr_at(8, dict(lr=0.01, lr_decay_steps=16, max_steps=9,
                                                                 warmup_steps=2, min_lr_ratio=0.1)))


def test_lr_decay_steps_sets_the_schedule_length():
    cfg = dict(lr=1.0, warmup_steps=10, max_steps=60, min_lr_ratio=0.1, lr_decay_steps=110)
    assert trainer.lr_at(59, cfg) == pytest.approx(0.55)  # half way through a 110-step cosine at step 60
    assert trainer.lr_at(59, dict(cfg, lr_decay_steps=None)) == pytest.approx(0.1)
    with pytest.raises(ck.train.ConfigError, match="lr_decay_steps: expected >= 1; got 0"):
        load_config(TINY, ["lr_decay_steps=0"])


def test_the_default_text_is_found_where_the_package_is():
    from cukernels import data
    assert os.path.isfile(data.DEFAULT_TEXT) and data.example_path("configs", "tiny.yaml").is_file()
    assert data.ByteTokenizer is ck.ByteTokenizer  # one byte tokenizer (the alias kept)
