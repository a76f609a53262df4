"""Hugging Face weights: safetensors read/write (cross-checked with the safetensors package), export -> import
round trips bit-exactly, HF-layout folders (single file, sharded index, tied embeddings) load and reproduce the
source model's logits, rope_theta / LLaMA-3 rope_scaling are honoured, bad folders are refused clearly."""
import json
import math

import numpy as np
import pytest

import cukernels as ck
from cukernels.io import hf_folder as hf
from cukernels.io import safetensors as st
from cukernels.ops.rope import _inv_freq as _rope_inv_freq


def _config(**kw):
    d = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
    d.update(kw)
    return ck.LlamaConfig(**d)


def _model(seed=0, **kw):
    return ck.Llama(_config(**kw), seed=seed, fused=False)


def _logits(model, ids):
    with ck.no_grad():
        return model(ids).data


def _ids(rng, V=61, B=2, T=9):
    return rng.integers(0, V, size=(B, T)).astype(np.int32)


@pytest.mark.parametrize("dtype", [np.float32, ck.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_import_round_trip_is_bit_exact(tmp_path, dtype, tied):
    m = _model(tie_word_embeddings=tied)
    m.save_pretrained(tmp_path / "a", dtype=dtype)
    names = set(st.read(tmp_path / "a" / hf.SAFE))
    assert ("lm_head.weight" in names) == (not tied)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["torch_dtype"] == ("bfloat16" if dtype is ck.bfloat16 else "float32")
    assert cfg["tie_word_embeddings"] is tied and cfg["model_type"] == "llama"
    m2 = ck.Llama.from_pretrained(tmp_path / "a", fused=False)
    assert m2.config == m.config
    for n, p in m.state_dict().items():
        want = p.astype(dtype).astype(np.float32)  # exact for fp32; the bf16 rounding for bf16
        np.testing.assert_array_equal(m2.state_dict()[n], want, err_msg=n)
    m2.save_pretrained(tmp_path / "b", dtype=dtype)
    assert (tmp_path / "a" / hf.SAFE).read_bytes() == (tmp_path / "b" / hf.SAFE).read_bytes()


def _write_hf_folder(folder, model, *, shards=None, dtype=np.float32, extra=None, drop=(), lm_head_when_tied=False):
    """An HF-layout folder written independently of save_pretrained: the safetensors package's writer (or the
    raw format for bf16-less package versions), HF's config.json field names, optional sharding by hand."""
    from safetensors.numpy import save_file
    folder.mkdir(parents=True, exist_ok=True)
    c = model.config
    tensors = {n: np.ascontiguousarray(p.astype(dtype)) for n, p in model.state_dict().items() if n not in drop}
    if c.tie_word_embeddings and lm_head_when_tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors.update(extra or {})
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "rope_scaling": c.rope_scaling, "tie_word_embeddings": c.tie_word_embeddings,
           "max_position_embeddings": c.max_position_embeddings, "torch_dtype": "float32", "attention_bias": False,
           "pretraining_tp": 1, "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(cfg))
    if not shards:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    parts = [names[i::shards] for i in range(shards)]
    wm = {}
    for i, part in enumerate(parts):
        fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / fn), metadata={"format": "pt"})
        wm.update({n: fn for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                      "weight_map": wm}))


@pytest.mark.parametrize("layout", ["single", "sharded", "tied", "tied+lm_head", "bf16-sharded", "llama3-rope"])
def test_hf_layout_folder_gives_the_same_logits(tmp_path, rng, layout):
    kw = {}
    if layout.startswith("tied"):
        kw["tie_word_embeddings"] = True
    if layout == "llama3-rope":
        kw.update(rope_theta=500000.0, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16, "rope_type": "llama3"})
    src = _model(seed=3, **kw)
    dtype = ck.bfloat16 if layout.startswith("bf16") else np.float32
    if dtype is ck.bfloat16:  # the source model holds bf16-representable weights, so the logits must match
        for p in src.parameters():
            p.data[...] = p.data.astype(ck.bfloat16).astype(np.float32)
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    _write_hf_folder(tmp_path / "hf", src, shards=3 if "sharded" in layout else None, dtype=dtype, extra=extra,
                     lm_head_when_tied=layout == "tied+lm_head")
    m = ck.Llama.from_pretrained(tmp_path / "hf", fused=False)
    assert m.config.rope_theta == src.config.rope_theta and m.config.rope_scaling == src.config.rope_scaling
    assert m.config.tie_word_embeddings == src.config.tie_word_embeddings
    ids = _ids(rng, T=40)  # past original_max_position_embeddings: the scaled frequencies matter
    np.testing.assert_array_equal(_logits(m, ids), _logits(src, ids))


def test_llama3_rope_scaling_matches_hf_formula():
    # Hugging Face's _compute_llama3_parameters, written out independently
    D, theta = 64, 500000.0
    sc = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
              rope_type="llama3")
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    lo_w, hi_w = 8192 / 1.0, 8192 / 4.0
    want = []
    for f in inv:
        w = 2 * math.pi / f
        if w < hi_w:
            want.append(f)
        elif w > lo_w:
            want.append(f / 32.0)
        else:
            s = (8192 / w - 1.0) / (4.0 - 1.0)
            want.append((1 - s) * f / 32.0 + s * f)
    np.testing.assert_allclose(_rope_inv_freq(D, theta, sc), want, rtol=1e-12)
    assert not np.allclose(_rope_inv_freq(D, theta, sc), inv)  # it does change something


def test_safetensors_reader_writer_agree_with_the_package(tmp_path):
    from safetensors import deserialize
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((3, 5)).astype(np.float32),
              "b": rng.standard_normal(7).astype(np.float32).astype(ck.bfloat16),
              "c": np.arange(4, dtype=np.int64), "d": np.zeros((0, 3), np.float16)}
    save_file(arrays, str(tmp_path / "pkg.safetensors"))
    got = st.read(tmp_path / "pkg.safetensors")
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype and got[k].shape == a.shape
        np.testing.assert_array_equal(got[k].view(np.uint8), a.view(np.uint8))
    # our streaming writer's files are read back by the package's own parser
    st.write(tmp_path / "raw.safetensors", arrays, {"format": "pt"})
    parsed = dict(deserialize((tmp_path / "raw.safetensors").read_bytes()))
    assert {k: (v["dtype"], list(v["shape"])) for k, v in parsed.items()} == {
        "a": ("F32", [3, 5]), "b": ("BF16", [7]), "c": ("I64", [4]), "d": ("F16", [0, 3])}
    assert bytes(parsed["b"]["data"]) == arrays["b"].tobytes()
    raw = st.read(tmp_path / "raw.safetensors")
    for k, a in arrays.items():
        np.testing.assert_array_equal(raw[k].view(np.uint8), a.view(np.uint8))


def test_bad_folders_are_refused_naming_file_and_problem(tmp_path):
    src = _model()
    _write_hf_folder(tmp_path / "missing", src, drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(hf.HFFormatError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]") as e:
        ck.Llama.from_pretrained(tmp_path / "missing", fused=False)
    assert str(tmp_path / "missing" / "model.safetensors") in str(e.value)
    _write_hf_folder(tmp_path / "shape", src, extra={"model.norm.weight": np.ones(31, np.float32)})
    with pytest.raises(hf.HFFormatError, match=r"model.norm.weight: shape \(31,\) in the file, \(32,\) in the model"):
        ck.Llama.from_pretrained(tmp_path / "shape", fused=False)
    src.save_pretrained(tmp_path / "trunc")
    f = tmp_path / "trunc" / hf.SAFE
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(hf.HFFormatError, match="truncated") as e:
        ck.Llama.from_pretrained(tmp_path / "trunc", fused=False)
    assert str(f) in str(e.value)
    src.save_pretrained(tmp_path / "rope")
    cj = tmp_path / "rope" / "config.json"
    cj.write_text(json.dumps(dict(json.loads(cj.read_text()), rope_scaling={"rope_type": "yarn", "factor": 4.0})))
    with pytest.raises(hf.HFFormatError, match="rope_scaling type 'yarn' is not supported"):
        ck.Llama.from_pretrained(tmp_path / "rope", fused=False)
    with pytest.raises(hf.HFFormatError, match="no config.json"):
        ck.Llama.from_pretrained(tmp_path, fused=False)


def test_save_pretrained_shards(tmp_path, rng):
    m = _model(seed=5)
    m.save_pretrained(tmp_path / "s", max_shard_size=20000)
    idx = json.loads((tmp_path / "s" / hf.INDEX).read_text())
    assert len(set(idx["weight_map"].values())) > 1 and not (tmp_path / "s" / hf.SAFE).exists()
    assert set(idx["weight_map"]) == set(m.state_dict())
    m2 = ck.Llama.from_pretrained(tmp_path / "s", fused=False)
    ids = _ids(rng)
    np.testing.assert_array_equal(_logits(m2, ids), _logits(m, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("tied,rope", [(False, None), (True, "llama3")])
def test_transformers_loads_our_export(tmp_path, rng, tied, rope):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kw = dict(tie_word_embeddings=tied)
    if rope:
        kw.update(rope_theta=500000.0, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16, "rope_type": "llama3"})
    m = _model(seed=7, **kw)
    m.save_pretrained(tmp_path / "hf")
    ref = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    ids = _ids(rng, T=40)
    with torch.no_grad():
        theirs = ref(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()
    np.testing.assert_allclose(_logits(m, ids), theirs, atol=1e-4, rtol=0)
    # and back: what transformers saves loads here with the same logits
    ref.save_pretrained(str(tmp_path / "back"), safe_serialization=True)
    m2 = ck.Llama.from_pretrained(tmp_path / "back", fused=False)
    np.testing.assert_array_equal(_logits(m2, ids), _logits(m, ids))


def test_transformers5_rope_parameters_are_read():
    """transformers >= 5 writes rope_theta and the scaling under "rope_parameters"; both must be honoured."""
    d = dict(model_type="llama", vocab_size=11, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
             num_attention_heads=4, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16})
    c = ck.LlamaConfig.from_hf(d)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    c = ck.LlamaConfig.from_hf(d)
    assert c.rope_theta == 1234.0 and c.rope_scaling is None
