"""Trainer checkpoints: a run killed after a checkpoint and resumed gives exactly the losses of an uninterrupted
run; corrupt, truncated and mismatched checkpoints are refused with the file named, before anything loads."""
import dataclasses
import os

import numpy as np
import pytest

from cukernels.train import cli, trainer
from cukernels.train import load_config

import cukernels as ck
from cukernels.io import checkpoint as C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KERNELS = all(hasattr(ck, o) for o in ["rms_norm", "attn_softmax", "cross_entropy_fused", "embedding", "rope",
                                       "swiglu"])
BASE = ["max_steps=8", "eval_every=4", "eval_steps=1", "log_every=1", "plot=false", "batch_size=4", "seq_len=16",
        "total_batch_size=64", "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "warmup_steps=2", "lr=0.01", "keep_last=2"]
TIMING = ("ms_per_step", "tok_per_s")


def _cfg(out, extra=()):
    return load_config(os.path.join(ROOT, "examples", "configs", "tiny.yaml"),
                                   BASE + [f"out_dir={out}"] + list(extra))


def _rows(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture
def adamw_on_cpu(monkeypatch):
    """ck.optim.AdamW (the fused-path optimizer, NumPy reference) under a composite model: the production
    optimizer's checkpoint path on a machine without the model's kernel families."""
    orig = trainer.make_optimizer

    def make(optim, model, group, tokens):
        if getattr(model.input_embedding().weight, "_sparse_rows", False):  # (sparse_embedding: the sparse-row
            model.model.embed_tokens.set_fused(True)  # gradient exists on the embedding kernel's path only)
        return orig(dataclasses.replace(optim, fused=True), model, group, tokens)
    monkeypatch.setattr(trainer, "make_optimizer", make)


VARIANTS = {
    "composite": ["fused=false"],
    # random batches (sampler RNG state), 2 micro-batches per step, a checkpoint in the middle of a log interval
    "random-accum": ["fused=false", "data.sampling=random", "total_batch_size=128", "log_every=3"],
    "adamw": ["fused=false"],
    "adamw-sparse-embedding": ["fused=false", "sparse_embedding=true"],
    "fused": ["fused=true"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_equals_uninterrupted(tmp_path, variant, request):
    if variant.startswith("adamw"):
        request.getfixturevalue("adamw_on_cpu")
    if variant == "fused" and not KERNELS:
        pytest.skip("kernel families not merged yet")
    extra = VARIANTS[variant]
    full = trainer.train(_cfg(tmp_path / "full", extra), quiet=True)
    killed_dir = tmp_path / "killed"
    part = trainer.train(_cfg(killed_dir, extra + ["ckpt_every=2"]), quiet=True, stop_after=5)
    assert C.latest(killed_dir / "checkpoints").name == "step_00000004.ckpt"
    assert sorted(p.name for p in (killed_dir / "checkpoints").iterdir()) == ["step_00000002.ckpt",
                                                                             "step_00000004.ckpt"]
    assert len(part) > 0
    resumed = trainer.train(_cfg(killed_dir, extra + ["ckpt_every=2", "resume=latest"]), quiet=True)
    assert _rows(resumed) == _rows(full)  # exact: every loss, lr and grad norm, train and val
    assert len([r for r in full if r["kind"] == "train"]) >= 3
    # the end-of-run checkpoint holds the same parameters as the uninterrupted run's
    a, _ = C.load(C.latest(killed_dir / "checkpoints"))
    b, _ = C.load(C.latest(tmp_path / "full" / "checkpoints"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture
def one_ckpt(tmp_path):
    trainer.train(_cfg(tmp_path / "run", ["fused=false", "max_steps=2"]), quiet=True)
    return C.latest(tmp_path / "run" / "checkpoints")


def _resume(tmp_path, path, extra=()):
    return trainer.train(_cfg(tmp_path / "again", ["fused=false", f"resume={path}"] + list(extra)), quiet=True)


def test_flipped_byte_and_truncation_are_refused(tmp_path, one_ckpt):
    data = one_ckpt.read_bytes()
    for name, blob in [("flipped", data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:]),
                       ("truncated", data[:len(data) - 100]),
                       ("header_cut", data[:20])]:
        bad = tmp_path / f"{name}.ckpt"
        bad.write_bytes(blob)
        with pytest.raises(C.CheckpointError) as e:
            _resume(tmp_path, bad)
        msg = str(e.value)
        assert str(bad) in msg and ("checksum" in msg or "truncated" in msg), msg


def test_mismatched_checkpoint_is_refused(tmp_path, one_ckpt):
    with pytest.raises(C.CheckpointError, match=r"hidden_size: 32 in the file, 48 in this run") as e:
        _resume(tmp_path, one_ckpt, ["model.hidden_size=48"])
    assert str(one_ckpt) in str(e.value)
    # a well-formed file whose arrays disagree with the model (another dtype, another shape)
    arrays, meta = C.load(one_ckpt)
    arrays = dict(arrays)  # (the loaded mapping is read-only, memory-mapped)
    arrays["model/model.norm.weight"] = arrays["model/model.norm.weight"].astype(np.float16)
    arrays["model/lm_head.weight"] = arrays["model/lm_head.weight"][:-1]
    bad = C.save(tmp_path / "bad" / "step_00000002.ckpt", arrays, meta)
    with pytest.raises(C.CheckpointError) as e:
        _resume(tmp_path, bad)
    msg = str(e.value)
    assert str(bad) in msg and "model.norm.weight: dtype float16" in msg and "lm_head.weight: shape" in msg, msg
    # not a trainer checkpoint at all
    other = C.save(tmp_path / "other.ckpt", {"x": np.zeros(3, np.float32)}, {"kind": "something"})
    with pytest.raises(C.CheckpointError, match="not a trainer checkpoint"):
        _resume(tmp_path, other)


def test_keys_newer_than_the_checkpoint_resume_at_their_defaults(tmp_path, one_ckpt, capsys):
    """A checkpoint written before a config key existed (grad_dtype, session 8) resumes without a warning when the
    run keeps that key's default; a key whose value changed is still named."""
    arrays, meta = C.load(one_ckpt)
    meta = dict(meta, config={k: v for k, v in meta["config"].items() if k != "grad_dtype"})
    old = C.save(tmp_path / "old" / "step_00000002.ckpt", dict(arrays), meta)
    capsys.readouterr()
    same = ["fused=false", "max_steps=2", f"resume={old}"]
    trainer.train(_cfg(tmp_path / "again", same), quiet=False)
    assert "with a different" not in capsys.readouterr().out
    trainer.train(_cfg(tmp_path / "again2", same + ["grad_clip=0.5"]), quiet=False)
    out = capsys.readouterr().out
    assert "with a different grad_clip (1.0 -> 0.5)" in out and "grad_dtype" not in out, out


def test_cli_resume_latest_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    rc = cli.main(["--config", os.path.join(ROOT, "examples", "configs", "tiny.yaml"), "--resume", "latest",
                   f"out_dir={tmp_path}", "fused=false"])
    assert rc == 2
    assert "no step_00000000.ckpt" not in capsys.readouterr().err
    rc = cli.main(["--config", os.path.join(ROOT, "examples", "configs", "tiny.yaml"), "--resume", "latest",
                   f"out_dir={tmp_path}", "fused=false"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --resume latest: no step_*.ckpt checkpoint in"), err


def test_init_from_trainer_checkpoint_and_hf_folder(tmp_path, one_ckpt):
    from cukernels.generation import load_model
    m, _ = load_model(one_ckpt, fused=False)
    m.save_pretrained(tmp_path / "hf")
    for src in (one_ckpt, tmp_path / "hf"):
        cfg = _cfg(tmp_path / f"init-{src.name}", ["fused=false", f"init_from={src}", "max_steps=1", "lr=0",
                                                   "weight_decay=0", "ckpt_final=true"])
        trainer.train(cfg, quiet=True)
        a, _ = C.load(C.latest(tmp_path / f"init-{src.name}" / "checkpoints"))
        for n, p in m.state_dict().items():  # lr 0: the weights are still the ones it started from
            np.testing.assert_array_equal(a[C.MODEL_PREFIX + n], p, err_msg=n)
