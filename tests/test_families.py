"""Qwen2, Qwen3 and Mistral (issue 37) against transformers, without transformers: the folders and the expected
outputs of tests/fixtures/families/ were made by transformers 5.24 in float64 (tests/fixtures/make_families.py).
Loaded with ck.from_pretrained (dispatch on model_type), the NumPy path gives their logits (plain and left-padded),
loss, gradients and greedy continuations; save_pretrained writes the same tensors and the config fields transformers
wrote; the trainer trains each family by ``model.type``; bad configs are refused naming the field; the per-head q / k
norm on the packed projection (F.qk_rms_norm) equals the separate path. GPU tests: the kernels against the NumPy path
(fp32 and bf16 autocast, flash with windows and the packed q / k norm), the static engine against the dynamic one,
the fused decode step against the generic forward."""
import json
from pathlib import Path

import numpy as np
import pytest

import cukernels as ck
import cukernels.functional as F
from cukernels.autograd import Tensor
from cukernels.io import hf_folder as hf
from cukernels.io import safetensors as st

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "families"
FAMILIES = ["qwen2", "qwen3", "mistral"]
CLASSES = {"qwen2": ck.Qwen2, "qwen3": ck.Qwen3, "mistral": ck.Mistral}
# Layer windows of the fixtures (tests/fixtures/make_families.py): qwen2's layer_types, qwen3's max_window_layers,
# mistral's sliding_window on every layer.
WINDOWS = {"qwen2": [None, 3], "qwen3": [None, 4], "mistral": [4, 4]}


def _expected(name):
    with np.load(FIXTURES / name / "expected.npz") as z:
        e = {k: z[k] for k in z.files}
    e["grad_names"] = json.loads((FIXTURES / name / "grad_names.json").read_text())
    return e


def _targets(labels):
    """transformers shifts ``labels`` inside its loss; our targets are aligned with the ids."""
    return np.concatenate([labels[:, 1:], np.full((labels.shape[0], 1), -100)], axis=1)


def _close(got, want, rtol=2e-5, what=""):
    """fp32 against transformers' float64: errors relative to the largest magnitude."""
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(np.asarray(got, np.float64) - want).max()) / scale
    assert err < rtol, f"{what}: max error {err:.2e} of the largest magnitude {scale:.3g}"


# ------------------------------------------------------------------ against transformers (stored fixtures)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composite"])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name, fused):
    e = _expected(name)
    m = ck.from_pretrained(FIXTURES / name, fused=fused)
    assert type(m) is CLASSES[name] and m.config.model_type == name
    assert m.config.layer_windows() == WINDOWS[name]
    assert [a.window for a in m.modules() if isinstance(a, ck.nn.Attention)] == WINDOWS[name]
    with ck.no_grad():
        _close(m(e["ids"]).data, e["logits"], what="logits")
        got = m(e["ids"], attention_mask=e["mask"], position_ids=e["position_ids"]).data
    keep = e["mask"].astype(bool)  # (a padded query row sees no key: each side's own convention there)
    assert np.isfinite(got).all()
    _close(got[keep], e["masked_logits"][keep], what="left-padded logits")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composite"])
@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_gradients_match_transformers(name, fused):
    e = _expected(name)
    m = ck.from_pretrained(FIXTURES / name, fused=fused)
    loss = m(e["ids"], _targets(e["labels"]))
    assert float(loss.data) == pytest.approx(float(e["loss"]), rel=2e-6)
    loss.backward()
    params = dict(m.named_parameters())
    for n in e["grad_names"]:
        _close(params[n].grad, e[f"grad/{n}"], rtol=1e-5, what=n)


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv-cache", "recompute"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generation_matches_transformers(name, use_cache):
    """A left-padded batch of prompts, 8 greedy tokens (transformers' generate; the fixture checked every step's
    top-2 logit gap); the KV cache path runs the windows over the cached keys."""
    e = _expected(name)
    m = ck.from_pretrained(FIXTURES / name)
    got = ck.generate(m, e["prompt"], 8, temperature=0, attention_mask=e["prompt_mask"], use_cache=use_cache)
    T = e["prompt"].shape[1]
    np.testing.assert_array_equal(got[:, T:], e["generated"][:, T:])


# ------------------------------------------------------------------ Hugging Face folders
@pytest.mark.parametrize("name", FAMILIES)
def test_save_pretrained_writes_the_tensors_and_config_transformers_wrote(tmp_path, name):
    src = FIXTURES / name
    m = ck.from_pretrained(src)
    m.save_pretrained(tmp_path / "out")
    theirs, ours = st.read(src / hf.SAFE), st.read(tmp_path / "out" / hf.SAFE)
    assert set(ours) == set(theirs)  # (tied heads: no lm_head.weight in either)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    want = json.loads((src / "config.json").read_text())
    got = json.loads((tmp_path / "out" / "config.json").read_text())
    skip = {"transformers_version", "dtype", "use_cache"}  # (we write torch_dtype, which transformers 5 also reads)
    for k, v in want.items():
        if k not in skip:
            assert k in got and got[k] == v, f"config.json {k}: ours {got.get(k)!r}, transformers' {v!r}"
    m2 = ck.from_pretrained(tmp_path / "out")
    assert type(m2) is type(m) and m2.config == m.config
    ids = np.arange(12)[None] % m.config.vocab_size
    with ck.no_grad():
        np.testing.assert_array_equal(m2(ids).data, m(ids).data)


def _random(name, xp=np, seed=0, fused=True, **kw):
    """A small random model of ``name`` with every parameter random (biases and norm weights too, so that a
    mix-up of q_norm / k_norm or of a bias shows), head_dim 32 or 64 (what the flash and decode kernels take) and
    windows shorter than the test sequences."""
    base = dict(vocab_size=97, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1)
    if name == "qwen2":
        c = ck.Qwen2Config(**dict(base, tie_word_embeddings=True, use_sliding_window=True, sliding_window=7,
                                  max_window_layers=1, rope_theta=1e6, **kw))
    elif name == "qwen3":
        c = ck.Qwen3Config(**dict(base, head_dim=64, use_sliding_window=True, sliding_window=9, max_window_layers=1,
                                  **kw))
    else:
        c = ck.MistralConfig(**dict(base, head_dim=32, sliding_window=6, **kw))
    m = CLASSES[name](c, xp=np, seed=seed, fused=fused)
    rng = np.random.default_rng(seed + 1)
    for n, p in m.named_parameters():
        if n.endswith("norm.weight"):
            p.data[...] = 1 + 0.2 * rng.standard_normal(p.shape)
        elif n.endswith(".bias"):
            p.data[...] = 0.1 * rng.standard_normal(p.shape)
    return m if xp is np else m.to("gpu")


def test_qwen3_attention_bias_round_trip(tmp_path):
    """attention_bias puts a bias on q, k, v and o (transformers' Qwen3Attention); the folder round-trips."""
    m = _random("qwen3", attention_bias=True)
    names = [n for n, _ in m.named_parameters()]
    assert "model.layers.0.self_attn.o_proj.bias" in names and "model.layers.1.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" in names
    m.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["attention_bias"] is True and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["layer_types"] == ["full_attention", "sliding_attention"] and cfg["head_dim"] == 64
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    m2 = ck.from_pretrained(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(0, 97, (2, 13))
    with ck.no_grad():
        np.testing.assert_array_equal(m2(ids).data, m(ids).data)


def test_hf_configs_as_released():
    """config.json fields as the released checkpoints have them: Qwen2.5's window without use_sliding_window is
    dropped (transformers' rule), Qwen3's head_dim 128 with hidden 1024, transformers 4's top-level rope_theta,
    Mistral v0.1's window on every layer and v0.2's null."""
    q25 = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
           "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "rope_theta": 1000000.0,
           "rope_scaling": None, "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21,
           "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151643}
    c = ck.Qwen2Config.from_hf(q25)
    assert c.sliding_window is None and c.layer_windows() == [None] * 24 and c.rope_theta == 1e6 and c.head_dim == 64
    c = ck.Qwen2Config.from_hf(dict(q25, use_sliding_window=True))
    assert c.layer_windows() == [None] * 21 + [32768] * 3
    q3 = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
          "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
          "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28,
          "tie_word_embeddings": True, "attention_bias": False, "rms_norm_eps": 1e-06}
    c = ck.Qwen3Config.from_hf(q3)
    assert (c.head_dim, c.num_attention_heads * c.head_dim, c.hidden_size) == (128, 2048, 1024)
    assert c.attention_options(0) == dict(bias=False, out_bias=False, qk_norm=1e-6, window=None)
    assert ck.Qwen3Config.from_hf({k: v for k, v in q3.items() if k != "head_dim"}).head_dim == 128
    mi = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 10000.0,
          "sliding_window": 4096}
    assert ck.MistralConfig.from_hf(mi).layer_windows() == [4096] * 32
    assert ck.MistralConfig.from_hf(dict(mi, sliding_window=None)).layer_windows() == [None] * 32
    assert ck.MistralConfig.from_hf({k: v for k, v in mi.items() if k != "sliding_window"}).sliding_window == 4096
    # absent KV heads: transformers' class defaults (Mistral 8, Qwen 32); null: one per head
    no_kv = lambda d: {k: v for k, v in d.items() if k != "num_key_value_heads"}  # noqa: E731
    assert ck.MistralConfig.from_hf(no_kv(mi)).num_key_value_heads == 8
    assert ck.MistralConfig.from_hf(dict(mi, num_key_value_heads=None)).num_key_value_heads == 32
    assert ck.Qwen3Config.from_hf(no_kv(dict(q3, num_attention_heads=32, head_dim=64))).num_key_value_heads == 32
    rp = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    assert ck.MistralConfig.from_hf(dict(mi, **rp)).rope_theta == 5e5


@pytest.mark.parametrize("d, match", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported by Qwen3Config"),
    ({"use_sliding_window": "yes"}, "use_sliding_window: expected true or false"),
    ({"layer_types": ["full_attention"]}, "layer_types: expected a list of 2 entries"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
])
def test_bad_hf_configs_are_refused(d, match):
    base = {"model_type": "qwen3", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    with pytest.raises(hf.HFFormatError, match=match):
        ck.Qwen3Config.from_hf(dict(base, **d))


# ------------------------------------------------------------------ config validation
SMALL = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2)


@pytest.mark.parametrize("cls, kw, err, match", [
    (ck.Qwen2Config, dict(sliding_window=8), ValueError, "sliding_window: 8 is set but use_sliding_window is false"),
    (ck.Qwen2Config, dict(use_sliding_window=True), ValueError, "use_sliding_window is true but sliding_window"),
    (ck.Qwen2Config, dict(use_sliding_window=True, sliding_window=0), ValueError, "sliding_window: expected an int"),
    (ck.Qwen2Config, dict(layer_types=["full_attention"] * 3), ValueError, "layer_types: expected a list of 2"),
    (ck.Qwen2Config, dict(layer_types=["full_attention", "local"]), ValueError, "got 'local'"),
    (ck.Qwen2Config, dict(layer_types=["full_attention", "sliding_attention"]), ValueError,
     "has sliding_attention layers but sliding_window is null"),
    (ck.Qwen2Config, dict(use_sliding_window=1), TypeError, "use_sliding_window: expected true or false"),
    (ck.Qwen2Config, dict(max_window_layers=-1), ValueError, "max_window_layers: expected an integer >= 0"),
    (ck.Qwen3Config, dict(attention_bias="no"), TypeError, "Qwen3Config.attention_bias: expected true or false"),
    (ck.Qwen3Config, dict(head_dim=15), ValueError, "head_dim must be even"),
    (ck.MistralConfig, dict(sliding_window=2.5), TypeError, "MistralConfig.sliding_window: expected an integer"),
    (ck.MistralConfig, dict(num_key_value_heads=3, num_attention_heads=4), ValueError, "multiple of"),
])
def test_config_validated_at_construction(cls, kw, err, match):
    with pytest.raises(err, match=match):
        cls(**dict(SMALL, **kw))


def test_model_refuses_another_familys_config():
    with pytest.raises(TypeError, match="config: expected a Qwen2Config; got Qwen3Config"):
        ck.Qwen2(ck.Qwen3Config(**SMALL, head_dim=16))
    with pytest.raises(TypeError, match="config: expected a LlamaConfig; got MistralConfig"):
        ck.Llama(ck.MistralConfig(**SMALL))
    with pytest.raises(ValueError, match="window: a sliding window"):
        ck.nn.Attention(32, 2, window=4, causal=False)
    with pytest.raises(ValueError, match="window"):
        ck.nn.Attention(32, 2, window=0)


# ------------------------------------------------------------------ the trainer
@pytest.mark.parametrize("name", FAMILIES)
def test_trainer_trains_each_family_by_model_type(tmp_path, name):
    """The tiny config of each family (examples/configs/<name>-tiny.yaml), a few steps: the loss falls, the run
    loads back as the family (ck.from_pretrained of the run folder) and exports to a folder that loads with the same
    logits."""
    from cukernels.export import export
    from cukernels.train import load_config, train

    run = tmp_path / "run"
    cfg = load_config(f"{name}-tiny", ["max_steps=6", "eval_every=0", "log_every=1", "plot=false", "sample_chars=0",
                                       "batch_size=4", "seq_len=32", "total_batch_size=128", "warmup_steps=1",
                                       "progress=lines", f"out_dir={run}"])
    assert cfg["model"]["type"] == name
    rows = [r for r in train(cfg, quiet=True) if r.get("kind") == "train"]
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
    m = ck.from_pretrained(run)
    assert type(m) is CLASSES[name]
    export(run, tmp_path / "hf")
    m2 = ck.from_pretrained(tmp_path / "hf")
    assert type(m2) is CLASSES[name] and m2.config == m.config
    ids = np.arange(40)[None] % 256
    with ck.no_grad():
        np.testing.assert_array_equal(m2(ids).data, m(ids).data)


def test_trainer_config_names_the_familys_fields():
    from cukernels.train import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.sliding_windows: unknown key for model.type mistral.*sliding_window"):
        load_config("mistral-tiny", ["model.sliding_windows=4"])
    with pytest.raises(ConfigError, match="model: Qwen2Config.sliding_window"):
        load_config("qwen2-tiny", ["model.use_sliding_window=false"])


def test_shipped_qwen3_0_6b_config_is_the_released_shape():
    from cukernels.train import load_config

    m = load_config("qwen3-0.6b")["model"]
    c = ck.Qwen3Config.from_dict({k: v for k, v in m.items() if k != "type"})
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.tie_word_embeddings) == (28, 1024, 3072, 16, 8, 128, 151936, True)
    params = (c.vocab_size * c.hidden_size + c.num_hidden_layers * (
        c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size + 2 * c.head_dim) + c.hidden_size)
    assert params == pytest.approx(5.96e8, rel=1e-3)


# ------------------------------------------------------------------ the q / k norm on the packed heads
@pytest.mark.parametrize("with_rope", [True, False])
def test_qk_rms_norm_on_packed_heads_equals_the_separate_path(rng, with_rope):
    """F.qk_rms_norm on the heads of a packed [B, T, H + 2 Hkv, D] array (in place, rope included) against
    rms_norm + rope on contiguous copies: values, and the gradients of qkv and of both norm weights."""
    Bsz, T, H, Hkv, D = 2, 7, 3, 1, 32
    qkv0 = rng.standard_normal((Bsz, T, H + 2 * Hkv, D)).astype(np.float32)
    wq0 = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    wk0 = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    g = rng.standard_normal(qkv0.shape).astype(np.float32)
    cos, sin = ck.rope_cache(16, D, theta=1e4)
    pos = np.array([[3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6]], np.int32)
    rope = (cos, sin, pos) if with_rope else None

    qkv, wq, wk = (Tensor(a.copy(), requires_grad=True) for a in (qkv0, wq0, wk0))
    base = qkv * 1.0  # (a non-leaf: the Function writes into it)
    out = F.qk_rms_norm(base, H, Hkv, wq, wk, 1e-6, rope=rope)
    assert out.data is base.data
    (out * Tensor(g)).sum().backward()

    r, rq, rk = (Tensor(a.copy(), requires_grad=True) for a in (qkv0, wq0, wk0))
    q = F.rms_norm(F.contiguous(F.getitem(r, (slice(None), slice(None), slice(0, H)))), rq, 1e-6, fused=False)
    k = F.rms_norm(F.contiguous(F.getitem(r, (slice(None), slice(None), slice(H, H + Hkv)))), rk, 1e-6, fused=False)
    if with_rope:
        q, k = (F.rope(a, cos, sin, positions=pos, fused=False) for a in (q, k))
    v = F.getitem(r, (slice(None), slice(None), slice(H + Hkv, None)))
    ref = F.concat([q, k, v], axis=2)
    (ref * Tensor(g)).sum().backward()
    np.testing.assert_allclose(out.data, ref.data, rtol=1e-5, atol=1e-5)
    for a, b, n in ((qkv, r, "qkv"), (wq, rq, "q_weight"), (wk, rk, "k_weight")):
        np.testing.assert_allclose(a.grad, b.grad, rtol=1e-4, atol=1e-4, err_msg=n)


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_and_composite_layers_agree(name, rng):
    """The kernel Functions (NumPy references) and the composite of array ops: logits and gradients."""
    out = {}
    ids = rng.integers(0, 97, (2, 19))
    tg = rng.integers(0, 97, (2, 19))
    for fused in (True, False):
        m = _random(name, fused=fused)
        loss = m(ids, tg)
        loss.backward()
        out[fused] = float(loss.data), {n: p.grad.copy() for n, p in m.named_parameters()}
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5)
    for n, gr in out[False][1].items():
        _close(out[True][1][n], gr, rtol=1e-4, what=n)


@pytest.mark.parametrize("name", FAMILIES)
def test_flash_path_wiring_on_numpy_references(name, monkeypatch):
    """The training path the GPU takes under bf16 autocast -- q / k / v as one packed projection (not qwen2's, which
    have biases), qwen3's q / k norm and the rope on its heads (F.qk_rms_norm), the flash attention with the window
    -- run on the ops' NumPy
    references (the flash path let through on NumPy here), against the materialised path (attn_softmax with the
    window) under the same autocast: loss and gradients to bf16 accuracy, and the Functions taken are counted."""
    from cukernels.nn import attention as att_mod
    from cukernels.ops.attention import HEAD_DIMS

    monkeypatch.setattr(att_mod.Attention, "_flash_ok", lambda self, data, dtype: (
        self.fused and self.flash and dtype == ck.bfloat16 and self.D in HEAD_DIMS))
    calls = {"packed": 0, "separate": 0, "qk": 0}
    for cls, key in ((F.FlashAttentionPackedF, "packed"), (F.FlashAttentionF, "separate"), (F.QKRMSNormF, "qk")):
        real = cls.forward
        monkeypatch.setattr(cls, "forward", staticmethod(
            lambda *a, _r=real, _k=key, **k: calls.__setitem__(_k, calls[_k] + 1) or _r(*a, **k)))
    rng = np.random.default_rng(4)
    ids, tg = rng.integers(0, 97, (2, 21)), rng.integers(0, 97, (2, 21))
    out = {}
    for flash in (True, False):
        m = _random(name, seed=3)
        for a in m.modules():
            if isinstance(a, ck.nn.Attention):
                a.flash = flash
        with ck.autocast(ck.bfloat16):
            loss = m(ids, tg)
        loss.backward()
        out[flash] = float(loss.data), {n: p.grad.astype(np.float32) for n, p in m.named_parameters()}
    # (qwen2's biased q / k / v are not packed: separate GEMMs + bias, then the flash kernel on the three)
    assert calls == ({"packed": 0, "separate": 2, "qk": 0} if name == "qwen2" else
                     {"packed": 2, "separate": 0, "qk": 2 if name == "qwen3" else 0})
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-2)
    for n, g in out[False][1].items():
        scale = np.abs(g).max() + 1e-12
        np.testing.assert_allclose(out[True][1][n] / scale, g / scale, rtol=0, atol=4e-2, err_msg=n)


# ------------------------------------------------------------------ the fused decode step (NumPy references)
def _peaked(name, xp):
    """A bf16 model whose residual stream is dominated by the embedding (attention and MLP outputs scaled by 0.1),
    so that rounding differences between decode paths stay far below the logit gaps."""
    m = _random(name, seed=11)
    for b in m.model.layers:
        b.self_attn.o_proj.weight.data *= 0.1
        b.mlp.down_proj.weight.data *= 0.1
    m = m.to(ck.bfloat16)
    return m if xp is np else m.to("gpu")


def _decode_logits(m, xp, prompt, steps, fast):
    m.fast_decode = fast
    B, T = prompt.shape
    cache = m.new_static_cache(B, T + steps + 1)
    pos0 = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    with ck.no_grad():
        lg = m(xp.asarray(prompt.astype(np.int32)), position_ids=xp.asarray(pos0), kv_cache=cache).data
        out, toks = [], []
        for s in range(steps):
            ids = lg[:, -1].astype(np.float32).argmax(-1).astype(np.int32).reshape(B, 1)
            toks.append(ids)
            cache.length[...] += 1
            lg = m(ids, position_ids=xp.full((B, 1), T + s, dtype=np.int32), kv_cache=cache).data
            out.append(lg[:, -1].astype(np.float32))
    host = (lambda a: a.get()) if xp is not np else (lambda a: a)
    return np.stack([host(o) for o in out]), np.concatenate([host(t) for t in toks], 1)


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_decode_step_equals_the_generic_forward_numpy(name, monkeypatch):
    """The fused per-block decode (packed q/k/v GEMV with Qwen2's biases, Qwen3's q / k norms in place on its
    output, the window handed to the decode attention) against the generic forward through the static cache,
    past the window (12 prompt tokens + 6 steps against windows of 6-9), batch 1 and 3."""
    monkeypatch.setattr(ck.settings, "decode_max_rows", 8)
    m = _peaked(name, np)
    for B in (1, 3):
        prompt = np.random.default_rng(B).integers(0, 97, size=(B, 12))
        fast, tf = _decode_logits(m, np, prompt, 6, True)
        assert m.__dict__.get("_fast_decode_checked") is True
        slow, ts = _decode_logits(m, np, prompt, 6, False)
        np.testing.assert_array_equal(tf, ts)
        np.testing.assert_allclose(fast, slow, atol=0.02 * np.abs(slow).max(), rtol=0, err_msg=f"B={B}")


# ------------------------------------------------------------------ GPU: the kernels against the NumPy path
def _to_gpu_copy(m):
    import cupy as cp
    g = type(m)(m.config, xp=cp, seed=0, fused=m.fused)
    g.load_state_dict(m.state_dict())
    return g


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_training_forward_backward_matches_numpy(name, precision, monkeypatch):
    """Loss, logits and every gradient on the kernels against the NumPy path (fp32 weights): fp32 through the
    materialised attention (attn_softmax with the window), bf16 autocast through flash attention with the window
    (qwen3: the packed projection, the q / k norm on its heads -- F.qk_rms_norm -- and the packed attention;
    counted). T = 37 tokens, longer than every window; a left-padded row."""
    import cupy as cp
    ref = _random(name, seed=5)
    gpu = _to_gpu_copy(ref)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 97, (2, 37))
    tg = rng.integers(0, 97, (2, 37))
    mask = np.ones((2, 37), bool)
    mask[1, :5] = False
    tg[1, :5] = -100
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    calls = []
    real = F.QKRMSNormF.forward
    monkeypatch.setattr(F.QKRMSNormF, "forward", staticmethod(lambda *a, **k: calls.append(1) or real(*a, **k)))
    bf16 = precision != "fp32"
    loss_ref = ref(ids, tg, attention_mask=mask, position_ids=pos)
    loss_ref.backward()
    with ck.autocast(ck.bfloat16, enabled=bf16):
        loss = gpu(cp.asarray(ids), cp.asarray(tg), attention_mask=cp.asarray(mask), position_ids=cp.asarray(pos))
    loss.backward()
    assert len(calls) == (2 if bf16 and name == "qwen3" else 0)
    # bf16 against fp32: the NumPy bf16 path's own worst gradient is 4.5e-2 of its tensor's largest entry (qwen2's
    # k_proj.bias, whose gradient nearly cancels: a k bias shifts every score of a query alike but for the rope)
    tol = 6e-2 if bf16 else 2e-4
    assert float(loss.data) == pytest.approx(float(loss_ref.data), rel=1e-2 if bf16 else 1e-5)
    for n, p in ref.named_parameters():
        g = cp.asnumpy(dict(gpu.named_parameters())[n].grad).astype(np.float32)
        scale = np.abs(p.grad).max() + 1e-12
        np.testing.assert_allclose(g / scale, p.grad / scale, rtol=0, atol=tol, err_msg=n)
    with ck.no_grad(), ck.autocast(ck.bfloat16, enabled=bf16):
        got = cp.asnumpy(gpu(cp.asarray(ids), attention_mask=cp.asarray(mask),
                             position_ids=cp.asarray(pos)).data.astype(cp.float32))
    with ck.no_grad():
        want = ref(ids, attention_mask=mask, position_ids=pos).data
    scale = np.abs(want).max()
    assert np.abs(got - want)[mask].max() < (0.05 if bf16 else 1e-4) * scale


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_bf16_weights_flash_prefill_matches_numpy(name):
    """bf16 inference weights (from_pretrained(..., dtype=ck.bfloat16)): the prefill through flash attention with
    the windows against the NumPy path of the same bf16 weights."""
    import cupy as cp
    m, g = _peaked(name, np), _peaked(name, cp)
    ids = np.random.default_rng(2).integers(0, 97, (3, 29))
    with ck.no_grad():
        want = m(ids).data.astype(np.float32)
        got = cp.asnumpy(g(cp.asarray(ids)).data.astype(cp.float32))
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_static_engine_equals_dynamic(name):
    """Greedy tokens of the static engine (flash prefill, captured fused decode steps) equal the dynamic engine's
    and recomputing without a cache, 40 new tokens past the windows (6-9); in a left-padded batch a short row gets
    the tokens it gets alone."""
    import cupy
    from test_generate import _assert_greedy_equal  # noqa: E402  (the near-tie rule of the LLaMA tests)
    m = _peaked(name, cupy)
    prompt = np.array([[5, 17, 90, 3, 9, 44, 20], [1, 2, 3, 4, 5, 6, 7]])
    got = ck.generate(m, prompt, 40, temperature=0, static=True)
    dyn = ck.generate(m, prompt, 40, temperature=0, static=False)
    ref = ck.generate(m, prompt, 40, temperature=0, static=False, use_cache=False)
    _assert_greedy_equal(m, 7, got, ref)
    _assert_greedy_equal(m, 7, dyn, ref)
    padded = np.array([[5, 17, 90, 3, 9, 44, 20], [0, 0, 1, 2, 3, 4, 5]])
    mask = np.array([[1] * 7, [0, 0] + [1] * 5])
    rows = ck.generate(m, padded, 24, temperature=0, attention_mask=mask)
    alone = ck.generate(m, padded[1:, 2:], 24, temperature=0)
    _assert_greedy_equal(m, 5, np.concatenate([padded[1, 2:], rows[1, 7:]])[None], alone)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_fused_decode_step_equals_the_generic_forward(name, monkeypatch):
    """The fused decode step on the kernels (gemv, the in-place q / k norms, decode_attention_rope with the window)
    against the generic forward, batch 1 and 3, past the windows."""
    import cupy
    from test_generate import _assert_greedy_equal  # noqa: E402
    monkeypatch.setattr(ck.settings, "decode_max_rows", 8)
    m = _peaked(name, cupy)
    for B in (1, 3):
        prompt = np.random.default_rng(B).integers(0, 97, size=(B, 12))
        fast, tf = _decode_logits(m, cupy, prompt, 8, True)
        slow, ts = _decode_logits(m, cupy, prompt, 8, False)
        np.testing.assert_allclose(fast, slow, atol=0.02 * np.abs(slow).max(), rtol=0, err_msg=f"B={B}")
        _assert_greedy_equal(m, 0, tf, ts)
