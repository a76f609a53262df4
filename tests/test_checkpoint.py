import numpy as np
import pytest

import cukernels as ck
from cukernels.io import atomic
from cukernels.io import checkpoint as C


def _arrays(rng):
    return {
        "w": rng.standard_normal((5, 7)).astype(np.float32),
        "s": rng.standard_normal(9).astype(np.float32).astype(ck.bfloat16),
        "i": np.arange(4, dtype=np.int64),
    }


def test_round_trip_is_exact(tmp_path, rng):
    arrs = _arrays(rng)
    p = C.save(tmp_path / "step_3.ckpt", arrs, {"step": 3, "rng": [1, 2]})
    got, meta = C.load(p)
    assert meta == {"step": 3, "rng": [1, 2]}
    for k, v in arrs.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k].view(np.uint8), v.view(np.uint8))
    assert not list(tmp_path.glob("*.tmp-*"))
    assert C.latest(tmp_path) == p


def test_flipped_byte_and_truncation_are_refused(tmp_path, rng):
    p = C.save(tmp_path / "a.ckpt", _arrays(rng), {})
    data = bytearray(p.read_bytes())
    for pos in (len(data) // 3, len(data) // 2, 200):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        q = tmp_path / f"flip{pos}.ckpt"
        q.write_bytes(bytes(bad))
        with pytest.raises(C.CheckpointError, match=str(q.name)):
            C.load(q)
    t = tmp_path / "trunc.ckpt"
    t.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(C.CheckpointError, match="trunc.ckpt"):
        C.load(t)


def test_mismatch_names_what_disagrees(tmp_path, rng):
    arrs = _arrays(rng)
    want = dict(arrs, w=np.zeros((5, 8), np.float32))
    with pytest.raises(C.CheckpointError, match=r"w: shape \(5, 7\) in the file, \(5, 8\) in the model"):
        C.check_compatible("x.ckpt", arrs, want)
    want = dict(arrs, s=np.zeros(9, np.float32))
    with pytest.raises(C.CheckpointError, match="s: dtype bfloat16 in the file, float32"):
        C.check_compatible("x.ckpt", arrs, want)
    with pytest.raises(C.CheckpointError, match="missing"):
        C.check_compatible("x.ckpt", {}, want)


def test_failed_write_keeps_previous(tmp_path, rng, monkeypatch):
    p = C.save(tmp_path / "step_1.ckpt", _arrays(rng), {"step": 1})
    before = p.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "fsync", boom)  # the write dies before the rename
    with pytest.raises(OSError):
        C.save(p, _arrays(rng), {"step": 2})
    assert p.read_bytes() == before and not list(tmp_path.glob("*.tmp-*"))


def test_version1_training_checkpoint_still_loads(tmp_path, rng):
    """Files written by the code before the io/ redesign (meta version 1, no model_type) keep loading."""
    from cukernels.generation import load_model
    m = ck.Llama(ck.LlamaConfig(vocab_size=17, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                num_attention_heads=2), seed=3)
    arrays = {C.MODEL_PREFIX + n: a for n, a in m.state_dict().items()}
    meta = {"kind": C.TRAIN_KIND, "version": 1, "step": 4, "model_config": m.config.to_dict(),
            "optimizer": {"kind": "AdamW", "step": 4, "lr": 1e-3}}
    p = C.save(tmp_path / "step_00000004.ckpt", arrays, meta)
    got, what = load_model(p)
    assert "step 4" in what
    for n, a in m.state_dict().items():
        np.testing.assert_array_equal(got.state_dict()[n], a)


def test_load_is_memory_mapped_and_read_only(tmp_path, rng):
    p = C.save(tmp_path / "m.ckpt", _arrays(rng), {})
    arrays, _ = C.load(p)
    a = next(iter(arrays.values()))
    assert isinstance(a.base, np.ndarray) or isinstance(a, np.memmap) or not a.flags.owndata
    with pytest.raises(ValueError):
        a[...] = 0
