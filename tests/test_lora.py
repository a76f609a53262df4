"""LoRA (cukernels/nn/lora.py, cukernels/io/peft.py, the model API, the trainer's lora section).

The oracle is transformers + PEFT: tests/fixtures/lora_llama/ holds a tiny random LLaMA, two adapters PEFT saved
(r=4 on all seven projections; rsLoRA on a regex target) and the logits, merged logits, loss and adapter gradients
PEFT computed (tests/fixtures/make_lora.py). On the CPU: those numbers from our NumPy path, our saved folders in
PEFT's exact layout, the LoRA Function against finite differences in float64, the frozen base (no gradient, not in
the optimizer), the trainer with a lora section (resume, the adapter folder, the base's identity), and bad input.
GPU tests (``-m gpu``): the CuPy Function against the NumPy one (packed groups, odd sizes, strided input, bf16,
poisoned memory), a bf16 LoRA model against the fp32 NumPy model, a CUDA-graph-captured LoRA step.
``tests/gpu_lora_check.py`` loads our adapters in the real PEFT on the GPU machine.
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

import cukernels as ck
from cukernels import functional as F
from cukernels.autograd import Tensor
from cukernels.io import peft
from cukernels.io.checkpoint import CheckpointError
from cukernels.nn import lora as L
from cukernels.train import load_config, train
from cukernels.train.config import ConfigError
from helpers import assert_close

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "lora_llama"
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def expected():
    return dict(np.load(FIX / "expected.npz"))


def _tiny(**kw):
    d = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
    d.update(kw)
    return ck.LlamaConfig(**d)


# ================================================================================ against PEFT (the fixture)
def test_peft_adapter_gives_pefts_logits(expected):
    m = ck.from_pretrained(FIX / "base", adapter=FIX / "adapter")
    assert m.has_adapter() and len(L.lora_modules(m)) == 14
    np.testing.assert_allclose(m(expected["ids"]).data, expected["logits"], rtol=1e-5, atol=2e-6)
    # the adapter folder alone: its base_model_name_or_path ("../base", resolved against the folder)
    m2 = ck.from_pretrained(FIX / "adapter")
    np.testing.assert_allclose(m2(expected["ids"]).data, expected["logits"], rtol=1e-5, atol=2e-6)


def test_peft_rslora_regex_adapter(expected):
    m = ck.from_pretrained(FIX / "base", adapter=FIX / "adapter_rslora")
    assert sorted(L.lora_modules(m)) == ["model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    assert m.lora_config.use_rslora and m.lora_config.scaling_for("x") == pytest.approx(3 / np.sqrt(2))
    np.testing.assert_allclose(m(expected["ids"]).data, expected["logits_rslora"], rtol=1e-5, atol=2e-6)


def test_loss_and_adapter_gradients_match_peft(expected):
    m = ck.from_pretrained(FIX / "base", adapter=FIX / "adapter")
    ids = expected["ids"]
    loss = m(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert float(loss.data) == pytest.approx(float(expected["loss"]), rel=1e-5)
    named = dict(m.named_parameters())
    keys = [k for k in expected if k.startswith("grad/")]
    assert len(keys) == 2
    for k in keys:
        g = named[k[len("grad/" + peft.PREFIX):]].grad
        np.testing.assert_allclose(g, expected[k], rtol=1e-4, atol=1e-7 * np.abs(expected[k]).max(), err_msg=k)
    frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
    assert len(frozen) == len(m.parameters()) - 28
    assert all(named[n].grad is None for n in frozen), "a frozen base parameter got a gradient"


def test_merge_matches_pefts_merge_and_unmerged(expected):
    m = ck.from_pretrained(FIX / "base", adapter=FIX / "adapter")
    before = m(expected["ids"]).data
    W0 = m.model.layers[0].self_attn.q_proj.weight
    m.merge_adapter()
    assert not m.has_adapter() and m.lora_config is None
    assert type(m.model.layers[0].self_attn.q_proj) is ck.nn.Linear
    assert m.model.layers[0].self_attn.q_proj.weight is W0  # merged in place, the same parameter
    after = m(expected["ids"]).data
    np.testing.assert_allclose(after, expected["logits_merged"], rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=2e-6)


def test_save_adapter_is_pefts_layout(tmp_path, expected):
    m = ck.from_pretrained(FIX / "base", adapter=FIX / "adapter")
    out = m.save_adapter(tmp_path / "a")
    ours = ck.io.safetensors.read(out / peft.WEIGHTS)
    theirs = ck.io.safetensors.read(FIX / "adapter" / peft.WEIGHTS)
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert ours.info(k) == theirs.info(k), k
        np.testing.assert_array_equal(ours[k], theirs[k])
    cfg = json.loads((out / peft.CONFIG).read_text())
    ref = json.loads((FIX / "adapter" / peft.CONFIG).read_text())
    assert set(cfg) <= set(ref), f"keys PEFT does not write: {set(cfg) - set(ref)}"
    for k in ("peft_type", "r", "lora_alpha", "lora_dropout", "bias", "use_rslora", "fan_in_fan_out", "task_type"):
        assert cfg[k] == ref[k], k
    assert sorted(cfg["target_modules"]) == sorted(ref["target_modules"])
    assert cfg["base_model_name_or_path"] == str((FIX / "base").resolve())
    back = ck.from_pretrained(out)  # (its base_model_name_or_path, absolute)
    np.testing.assert_allclose(back(expected["ids"]).data, expected["logits"], rtol=1e-5, atol=2e-6)
    m.save_adapter(tmp_path / "b", dtype=ck.bfloat16)
    assert ck.io.safetensors.read(tmp_path / "b" / peft.WEIGHTS).info(next(iter(theirs)))[1] == ck.bfloat16


# ================================================================================ the Function
def _fd_check(f, arrays, h=1e-6, n=6, rng=None):
    """Compare f's analytic gradients (Tensors in ``arrays`` requiring a gradient) with central differences at
    ``n`` random coordinates of each, float64."""
    rng = rng or np.random.default_rng(0)
    out = f()
    r = rng.standard_normal(out.shape)
    (out * Tensor(r)).sum().backward()
    for t in arrays:
        for _ in range(n):
            i = tuple(int(rng.integers(0, s)) for s in t.shape)
            old = t.data[i]
            t.data[i] = old + h
            up = float((f().data * r).sum())
            t.data[i] = old - h
            dn = float((f().data * r).sum())
            t.data[i] = old
            num = (up - dn) / (2 * h)
            assert t.grad[i] == pytest.approx(num, rel=1e-6, abs=1e-8), (t.name, i)


def _lin(rng, i, o, bias=False, name="w"):
    lin = ck.nn.Linear(i, o, bias=bias, dtype=np.float64, rng=rng, std=0.3)
    lin.weight.name = name
    if bias:
        lin.bias.data[...] = rng.standard_normal(o)
    return lin


def _adapt(lin, rng, r, scaling):
    ll = L.LoRALinear(lin, r, 1.0, scaling, rng.standard_normal((r, lin.in_features)) * 0.3)
    ll.lora_B.weight.data[...] = rng.standard_normal(ll.lora_B.weight.shape) * 0.3
    ll.lora_A.weight.name, ll.lora_B.weight.name = "A", "B"
    return ll


@pytest.mark.parametrize("case", ["single", "bias", "packed", "packed-mixed", "frozen-x", "base-grad"])
def test_lora_function_finite_differences(rng, case):
    """LoRAF (NumPy path, float64) against central differences: x, A, B (and W, b where they want a gradient),
    single and packed groups, one member without an adapter."""
    x = Tensor(rng.standard_normal((2, 5, 7)), requires_grad=case != "frozen-x", name="x")
    outs = [6] if case in ("single", "bias", "frozen-x", "base-grad") else [6, 3, 3]
    lins = [_lin(rng, 7, o, bias=case == "bias", name=f"w{i}") for i, o in enumerate(outs)]
    lls = [_adapt(lin, rng, 2 + i, 0.7 + i) if not (case == "packed-mixed" and i == 1) else lin
           for i, lin in enumerate(lins)]
    for lin in lins:
        lin.weight.requires_grad = case == "base-grad"
        if lin.bias is not None:
            lin.bias.requires_grad = True
    mod = ck.nn.Module()
    ts = [x] + [p for ll in lls for p in ll.parameters() if p.requires_grad]
    _fd_check(lambda: L.lora_project(mod, x, lls), [t for t in ts if t.requires_grad], rng=rng)
    # and the composite reference (plain GEMM Functions) gives the same output
    ref = F.concat([ll.set_fused(False)(x) for ll in lls], axis=-1) if len(lls) > 1 else lls[0].set_fused(False)(x)
    for ll in lls:
        ll.set_fused(True)
    np.testing.assert_allclose(L.lora_project(mod, x, lls).data, ref.data, rtol=1e-12, atol=1e-12)


def test_lora_function_dropout_inputs(rng):
    """With dropout active each adapter reads its own dropped-out input: the gradient flows to x through the base
    and through each mask (finite differences over the masked composite, float64)."""
    x = Tensor(rng.standard_normal((3, 8)), requires_grad=True, name="x")
    lins = [_adapt(_lin(rng, 8, o), rng, 2, 0.5) for o in (4, 5)]
    masks = [(rng.random((3, 8)) > 0.3) / 0.7 for _ in lins]
    for ll in lins:
        ll.weight.requires_grad = False

    def f():
        xds = [x * Tensor(mk) for mk in masks]
        lows = (None,) * 6
        plan = L._Plan([4, 5], [2, 2], [0.5, 0.5], lows, False, True)
        ab = [p for ll in lins for p in (ll.lora_A.weight, ll.lora_B.weight)]
        return L.LoRAF.apply(x, plan, lins[0].weight, lins[1].weight, *ab, *xds)
    params = [x] + [p for ll in lins for p in (ll.lora_A.weight, ll.lora_B.weight)]
    _fd_check(f, params, rng=rng)


def test_joined_adapter_gradients_one_gemm(rng):
    """Under the optimizer's flat buffers the A matrices of q / k / v lie back to back (trainable_parameters'
    order): their gradient is one GEMM into the joined buffer, equal to the per-adapter products."""
    cfg = _tiny()
    grads = {}
    for joined in (True, False):
        m = ck.Llama(cfg, seed=1)
        m.add_adapter(r=4, alpha=8, target_modules=SEVEN, seed=3)
        for p in m.trainable_parameters():
            if "lora_B" in p.name:
                p.data[...] = np.random.default_rng(5).standard_normal(p.shape) * 0.1
        names = [n for n, _ in m.named_trainable_parameters()]
        assert names[:4] == [f"model.layers.0.self_attn.{k}.lora_A.weight" for k in ("q_proj", "k_proj", "v_proj",
                                                                                     "o_proj")]
        if joined:
            opt = ck.optim.AdamW(m.trainable_parameters(), lr=1e-3)
            opt.zero_grad()
            att = m.model.layers[0].self_attn
            assert F.joined_rows([att.q_proj.lora_A.weight.grad, att.k_proj.lora_A.weight.grad,
                                  att.v_proj.lora_A.weight.grad]) is not None
        ids = np.arange(14).reshape(2, 7)
        m(ids[:, :-1], ids[:, 1:]).backward()
        grads[joined] = {n: np.array(p.grad) for n, p in m.named_trainable_parameters()}
    for n, g in grads[True].items():
        np.testing.assert_allclose(g, grads[False][n], rtol=1e-5, atol=1e-8, err_msg=n)


# ================================================================================ the model API
def test_frozen_base_is_not_in_the_optimizer():
    m = ck.Llama(_tiny(), seed=0)
    n_all = m.num_parameters()
    cfg = m.add_adapter(r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    assert isinstance(cfg, ck.nn.LoraConfig) and m.lora_config is cfg
    train_ps = m.trainable_parameters()
    assert len(train_ps) == 8 and all("lora_" in p.name for p in train_ps)
    att, mlp = m.model.layers[1].self_attn, m.model.layers[1].mlp  # the frozen q/k/v (gate/up) packed: one GEMM
    assert F.joined_rows([att.q_proj.weight.data, att.k_proj.weight.data, att.v_proj.weight.data]) is not None
    assert F.joined_rows([mlp.gate_proj.weight.data, mlp.up_proj.weight.data]) is not None
    assert sum(p.size for p in train_ps) == 2 * 2 * (2 * 32 + 32 + 16)
    assert m.num_parameters() == n_all + sum(p.size for p in train_ps)
    opt = ck.optim.AdamW(train_ps, lr=1e-2)
    assert sum(e["stop"] - e["start"] for e in opt.state_dict()["state"].values()) == sum(p.size for p in train_ps)
    ids = np.arange(12).reshape(2, 6)
    before = {n: p.data.copy() for n, p in m.named_parameters() if not p.requires_grad}
    for _ in range(2):
        opt.zero_grad()
        m(ids[:, :-1], ids[:, 1:]).backward()
        opt.step()
    assert all(p.grad is None for p in m.parameters() if not p.requires_grad)
    for n, p in m.named_parameters():
        if not p.requires_grad:
            np.testing.assert_array_equal(p.data, before[n], err_msg=n)
    assert float(np.abs(m.model.layers[0].self_attn.q_proj.lora_B.weight.data).max()) > 0  # B moved off zero


def test_frozen_head_takes_the_logits_path(monkeypatch):
    """A frozen head's loss goes through the logits (its GEMMs skip the weight gradient the fused head + loss op
    would compute and drop); evaluation under no_grad keeps the fused op (no logits, no gradients)."""
    from cukernels.functional.linear_cross_entropy import LinearCrossEntropyF
    calls = []
    real = LinearCrossEntropyF.forward
    monkeypatch.setattr(LinearCrossEntropyF, "forward", staticmethod(lambda *a, **k: calls.append(1) or real(*a, **k)))
    m = ck.Llama(_tiny(), seed=0)
    ids = np.arange(12).reshape(2, 6)
    full = float(m(ids[:, :-1], ids[:, 1:]).data)
    assert calls == [1]
    m.add_adapter(r=2, target_modules=["q_proj"])
    loss = m(ids[:, :-1], ids[:, 1:])
    assert calls == [1] and float(loss.data) == pytest.approx(full, rel=1e-6)
    loss.backward()
    assert m.lm_head.weight.grad is None
    with ck.no_grad():
        m(ids[:, :-1], ids[:, 1:])
    assert calls == [1, 1]


def test_init_is_pefts():
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform(a=sqrt(5))), B = 0: a fresh adapter changes nothing."""
    m = ck.Llama(_tiny(intermediate_size=400), seed=0)
    ids = np.arange(10)[None]
    y0 = m(ids).data
    m.add_adapter(r=8, alpha=16, target_modules=["down_proj"])
    A = m.model.layers[0].mlp.down_proj.lora_A.weight.data
    assert A.shape == (8, 400) and A.dtype == np.float32
    assert np.abs(A).max() <= 1 / np.sqrt(400) and np.abs(A).max() > 0.9 / np.sqrt(400)
    assert abs(A.std() - (1 / np.sqrt(400)) / np.sqrt(3)) < 0.1 / np.sqrt(400)
    assert not np.any(m.model.layers[0].mlp.down_proj.lora_B.weight.data)
    np.testing.assert_array_equal(m(ids).data, y0)
    assert m.model.layers[0].mlp.down_proj.scaling == 2.0


def test_all_linear_skips_the_output_head_and_dropout_trains_only():
    m = ck.Llama(_tiny(), seed=0)
    m.add_adapter(r=2, alpha=2, dropout=0.5, target_modules="all-linear")
    assert len(L.lora_modules(m)) == 14 and "lm_head" not in L.lora_modules(m)
    for p in m.trainable_parameters():
        if "lora_B" in p.name:
            p.data[...] = 0.5
    ids = np.arange(12).reshape(2, 6)
    m.eval()
    e1, e2 = m(ids).data, m(ids).data
    np.testing.assert_array_equal(e1, e2)  # no dropout in eval
    m.train()
    t1 = m(ids).data
    assert not np.allclose(t1, e1)  # masks in training
    loss = m(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert all(np.isfinite(p.grad).all() for p in m.trainable_parameters())
    off = int(m.dropout_rng.offset)
    assert off >= 2  # one offset per training forward


def test_merge_then_fast_decode_and_save_pretrained(tmp_path, expected):
    m = ck.from_pretrained(FIX / "base", adapter=FIX / "adapter")
    with pytest.raises(ValueError, match="merge_adapter"):
        m.save_pretrained(tmp_path / "x")
    m.merge_adapter()
    m.save_pretrained(tmp_path / "merged")
    back = ck.from_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(back(expected["ids"]).data, expected["logits_merged"], rtol=1e-5, atol=2e-6)
    g = ck.generate(back, expected["ids"][0, :4], 5, temperature=0)
    assert g.shape == (9,)


def test_fine_tuning_page_example_runs(tmp_path):
    import re
    text = (ROOT / "docs" / "fine-tuning.md").read_text()
    (code,) = re.findall(r"<!-- docs-example:[^>]*-->\n```python\n(.*?)```", text, re.S)
    exec(compile(code, "docs/fine-tuning.md", "exec"), {"BASE": str(FIX / "base"), "OUT": str(tmp_path)})
    assert (tmp_path / "adapter" / peft.CONFIG).is_file() and (tmp_path / "merged" / "config.json").is_file()


# ================================================================================ bad input
def test_bad_lora_arguments():
    m = ck.Llama(_tiny(), seed=0)
    with pytest.raises(ValueError, match="r: expected"):
        m.add_adapter(r=0)
    with pytest.raises(ValueError, match="lora_alpha"):
        m.add_adapter(r=4, alpha=0)
    with pytest.raises(ValueError, match="lora_alpha"):
        m.add_adapter(r=4, alpha=-1.0)
    with pytest.raises(ValueError, match="lora_dropout"):
        m.add_adapter(r=4, dropout=1.0)
    with pytest.raises(TypeError, match="target_modules"):
        m.add_adapter(r=4, target_modules=[1, 2])
    with pytest.raises(ValueError, match="'qproj' matches no Linear.*q_proj"):
        m.add_adapter(r=4, target_modules=["q_proj", "qproj"])
    with pytest.raises(ValueError, match="matches no Linear"):
        m.add_adapter(r=4, target_modules=r"nothing\..*")
    with pytest.raises(ValueError, match="is a SwiGLUMLP; LoRA adapts Linear layers only"):
        m.add_adapter(r=4, target_modules=["mlp"])
    with pytest.raises(ValueError, match="output head"):
        m.add_adapter(r=4, target_modules=["lm_head"])
    with pytest.raises(ValueError, match="not a valid regular expression"):
        m.add_adapter(r=4, target_modules="(")
    assert not m.has_adapter() and all(p.requires_grad for p in m.parameters())  # nothing changed on an error
    m.add_adapter(r=4, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        m.add_adapter(r=4, target_modules=["v_proj"])
    with pytest.raises(ValueError, match="no LoRA adapter"):
        ck.Llama(_tiny(), seed=0).save_adapter("unused")


def _copy_adapter(tmp_path, name="adapter"):
    import shutil
    dst = tmp_path / name
    shutil.copytree(FIX / "adapter", dst)
    return dst


def _edit_config(folder, **changes):
    f = folder / peft.CONFIG
    d = json.loads(f.read_text())
    d.update(changes)
    f.write_text(json.dumps(d))


@pytest.mark.parametrize("changes, match", [
    (dict(peft_type="IA3"), "peft_type"), (dict(use_dora=True), "DoRA"), (dict(bias="all"), "bias"),
    (dict(r=0), "r: expected a number >= 1"), (dict(r=2.5), "r: expected an integer"),
    (dict(lora_alpha=0), "lora_alpha"), (dict(lora_alpha="8"), "lora_alpha"), (dict(lora_dropout=1.5), "lora_dropout"),
    (dict(target_modules=[]), "target_modules"), (dict(target_modules="("), "regular expression"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"), (dict(layers_to_transform=[0]), "layers_to_transform"),
    (dict(init_lora_weights="pissa"), "rewrites the base"), (dict(use_rslora="yes"), "use_rslora"),
    (dict(target_modules=["nothing_here"]), "matches no Linear"),
    (dict(r=8), "does not fit this model's adapters.*shape"),
])
def test_bad_adapter_config_is_refused(tmp_path, changes, match):
    folder = _copy_adapter(tmp_path)
    _edit_config(folder, **changes)
    m = ck.Llama.from_pretrained(FIX / "base")
    with pytest.raises(peft.PeftFormatError, match=match):
        m.load_adapter(folder)
    assert not m.has_adapter() and all(p.requires_grad for p in m.parameters())  # left as it was


def test_adapter_for_another_base_shape(tmp_path, expected):
    m = ck.Llama(_tiny(hidden_size=48, num_attention_heads=4), seed=0)
    with pytest.raises(peft.PeftFormatError, match=r"lora_A.weight: shape \(4, 32\), the model's adapter is \(4, 48\)"):
        m.load_adapter(FIX / "adapter")
    m2 = ck.from_pretrained(FIX / "base", adapter=FIX / "adapter_rslora")
    with pytest.raises(ValueError, match="has LoRA adapters already"):
        m2.load_adapter(FIX / "adapter")
    assert len(L.lora_modules(m2)) == 2  # the first adapter stays
    m3 = ck.Llama(_tiny(num_hidden_layers=3), seed=0)  # a third layer the file has no adapters for
    with pytest.raises(peft.PeftFormatError, match="missing.*layers.2"):
        m3.load_adapter(FIX / "adapter")


def test_bad_adapter_tensors_are_refused(tmp_path):
    folder = _copy_adapter(tmp_path)
    arrays = dict(ck.io.safetensors.read(folder / peft.WEIGHTS))
    k = next(k for k in arrays if k.endswith("q_proj.lora_B.weight"))
    cases = {
        "lora_B but no lora_A": {kk: v for kk, v in arrays.items() if not kk.endswith("q_proj.lora_A.weight")},
        "not a LoRA weight of a Linear": dict(arrays, **{"base_model.model.lm_head.weight": arrays[k]}),
        "disagree on the rank": dict(arrays, **{k: np.zeros((arrays[k].shape[0], 3), np.float32)}),
        "floating-point": dict(arrays, **{k: arrays[k].astype(np.int32)}),
        "several adapters": {kk.replace(".weight", ".x.weight") if "layers.0" in kk else
                             kk.replace(".weight", ".y.weight"): v for kk, v in arrays.items()},
    }
    for match, arrs in cases.items():
        ck.io.safetensors.write(folder / peft.WEIGHTS, arrs)
        with pytest.raises(peft.PeftFormatError, match=match):
            peft.read_weights(folder)
    (folder / peft.WEIGHTS).unlink()
    (folder / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(peft.PeftFormatError, match="pickle files are not read"):
        peft.read_weights(folder)
    (folder / peft.CONFIG).write_text("{not json")
    with pytest.raises(peft.PeftFormatError, match="unreadable JSON"):
        peft.read_config(folder)
    with pytest.raises(peft.PeftFormatError, match="no adapter_config.json"):
        peft.read_config(tmp_path)


# ================================================================================ the trainer
BASE = ["max_steps=6", "eval_every=3", "eval_steps=1", "log_every=1", "plot=false", "batch_size=4", "seq_len=16",
        "total_batch_size=64", "warmup_steps=2", "lr=0.01", "keep_last=3", "sample_chars=0", "lora.r=4",
        "lora.alpha=8"]
TIMING = ("ms_per_step", "tok_per_s")


@pytest.fixture(scope="module")
def byte_base(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_base")
    ck.Llama(_tiny(vocab_size=256, max_position_embeddings=64), seed=3).save_pretrained(d / "base")
    return d / "base"


def _cfg(base, out, extra=()):
    return load_config("tiny", BASE + [f"init_from={base}", f"out_dir={out}"] + list(extra))


def _losses(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_trainer_lora_resume_and_adapter_folder(tmp_path, byte_base):
    full = train(_cfg(byte_base, tmp_path / "full"), quiet=True)
    assert [r["loss"] for r in full if r["kind"] == "train"][-1] < full[0]["loss"]
    run = tmp_path / "full"
    assert (run / "adapter" / peft.CONFIG).is_file() and (run / "adapter" / peft.WEIGHTS).is_file()
    ckpt = sorted((run / "checkpoints").glob("step_*.ckpt"))[-1]
    arrays, meta = ck.io.checkpoint.read_training(ckpt)
    model_keys = [k for k in arrays if k.startswith("model/")]
    assert model_keys and all(".lora_" in k for k in model_keys)  # adapters only: the base is not in the file
    assert meta["lora"]["base"]["path"] == str(byte_base.resolve())
    assert meta["lora"]["config"]["r"] == 4
    # the run (its checkpoint: base + adapters) and its adapter folder on the base give the same model
    a = ck.from_pretrained(run)
    b = ck.from_pretrained(byte_base, adapter=run / "adapter")
    ids = np.arange(30)[None] % 256
    np.testing.assert_array_equal(a(ids).data, b(ids).data)
    # resume: killed after step 3 (a checkpoint there), resumed: the losses of the uninterrupted run
    out = tmp_path / "resumed"
    train(_cfg(byte_base, out, ["ckpt_every=3"]), quiet=True, stop_after=3)
    rows = train(_cfg(byte_base, out, ["ckpt_every=3", "resume=latest"]), quiet=True)
    assert _losses(rows) == _losses(full)


def test_trainer_lora_refuses_another_base_and_kind(tmp_path, byte_base):
    out = tmp_path / "r"
    train(_cfg(byte_base, out, ["max_steps=2", "eval_every=0"]), quiet=True)
    other = tmp_path / "other"
    ck.Llama(_tiny(vocab_size=256, max_position_embeddings=64), seed=4).save_pretrained(other)  # same shapes
    with pytest.raises(CheckpointError, match="other weights"):
        train(_cfg(other, out, ["max_steps=3", "eval_every=0", "resume=latest"]), quiet=True)
    with pytest.raises(CheckpointError, match="LoRA run's checkpoint"):
        train(load_config("tiny", [b for b in BASE if not b.startswith("lora.")] + [
            f"init_from={byte_base}", f"out_dir={out}", "max_steps=3", "resume=latest"]), quiet=True)
    # loading the run's checkpoint onto a changed base (other weights at the recorded path) is refused too
    import shutil
    moved = tmp_path / "base_copy"
    shutil.copytree(byte_base, moved)
    train(_cfg(moved, tmp_path / "r2", ["max_steps=1", "eval_every=0"]), quiet=True)
    ck.from_pretrained(tmp_path / "r2")  # (fine while the base is the one it trained on)
    ck.Llama(_tiny(vocab_size=256, max_position_embeddings=64), seed=5).save_pretrained(moved)
    with pytest.raises(CheckpointError, match="not the one this LoRA run trained on"):
        ck.from_pretrained(tmp_path / "r2")
    shutil.rmtree(moved)
    with pytest.raises(CheckpointError, match="which is not there"):
        ck.from_pretrained(tmp_path / "r2")


def test_trainer_lora_on_two_ranks_equals_one_process(tmp_path, byte_base):
    """ZeRO-1 over the adapters only (two FakeGroup ranks, threads): the losses of one process taking both
    micro-batches; one adapter folder, written by rank 0."""
    from cukernels.distributed import FakeGroup
    extra = ["total_batch_size=128", "eval_every=0"]
    one = train(_cfg(byte_base, tmp_path / "one", extra), quiet=True)
    cfg = _cfg(byte_base, tmp_path / "two", extra)
    two = FakeGroup(2).run(lambda g: train(cfg, quiet=True, group=g))
    for r in two:
        got, want = [x["loss"] for x in r if x["kind"] == "train"], [x["loss"] for x in one if x["kind"] == "train"]
        np.testing.assert_allclose(got, want, rtol=1e-5)
    a = ck.from_pretrained(byte_base, adapter=tmp_path / "one" / "adapter")
    b = ck.from_pretrained(byte_base, adapter=tmp_path / "two" / "adapter")
    ids = np.arange(20)[None]
    np.testing.assert_allclose(a(ids).data, b(ids).data, rtol=1e-5, atol=1e-6)


def test_lora_config_section_is_checked(byte_base):
    with pytest.raises(ConfigError, match="lora.rank: unknown config key; the lora keys are r, alpha"):
        load_config("tiny", [f"init_from={byte_base}", "lora.rank=4"])
    with pytest.raises(ConfigError, match="lora.r: expected > 0"):
        load_config("tiny", [f"init_from={byte_base}", "lora.r=0"])
    with pytest.raises(ConfigError, match="lora.alpha: expected > 0"):
        load_config("tiny", [f"init_from={byte_base}", "lora.alpha=0"])
    with pytest.raises(ConfigError, match="lora.dropout"):
        load_config("tiny", [f"init_from={byte_base}", "lora.dropout=1"])
    with pytest.raises(ConfigError, match="lora.target_modules"):
        load_config("tiny", [f"init_from={byte_base}", "lora.target_modules=[]"])
    with pytest.raises(ConfigError, match="lora: needs init_from"):
        load_config("tiny", ["lora.r=4"])
    with pytest.raises(ConfigError, match="sparse_embedding"):
        load_config("tiny", [f"init_from={byte_base}", "lora.r=4", "sparse_embedding=true"])
    cfg = load_config("tiny", [f"init_from={byte_base}", "lora.target_modules=[q_proj, v_proj]"])
    assert cfg["lora"] == {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                           "use_rslora": False}
    assert load_config("tiny")["lora"] is None


def test_trainer_lora_target_error_is_a_config_error(tmp_path, byte_base):
    with pytest.raises(ConfigError, match="lora.target_modules: 'c_attn' matches no Linear"):
        train(_cfg(byte_base, tmp_path / "x", ["lora.target_modules=[c_attn]"]), quiet=True)


def test_shipped_lora_config_is_valid():
    cfg = load_config(ROOT / "examples" / "configs" / "lora-llama.yaml")
    assert cfg["lora"]["r"] == 16 and cfg["init_from"]


# ================================================================================ GPU
def _poison_pool(cp, nbytes=64 << 20):
    """Fill free memory of CuPy's pool with NaN bytes so an output element a kernel never writes reads NaN."""
    buf = cp.empty(nbytes // 4, dtype=cp.float32)
    buf.fill(np.nan)
    del buf


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, ck.bfloat16])
@pytest.mark.parametrize("shape", [("qkv", 1, 2048, [2048, 512, 512]), ("gate-up", 3, 199, [1000, 1000]),
                                   ("mixed", 2, 127, [64, 127, 3]), ("single", 5, 4097, [3])])
def test_gpu_lora_function_matches_numpy(dtype, shape):
    """LoRAF on CuPy (cuBLAS on our handle) against the NumPy path on the same values: outputs and every
    gradient, packed groups (one member without an adapter in "mixed"), odd sizes, a strided (sliced) input,
    memory poisoned with NaN before each call."""
    import cupy as cp

    name, rows, width, outs = shape
    rng = np.random.default_rng(len(outs) * 7 + width)
    ranks = [4, 0, 8] if name == "mixed" else [16] * len(outs)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == ck.bfloat16 else dict(rtol=2e-4, atol=2e-4)
    xh = rng.standard_normal((rows, 9, width + 3)).astype(np.float32).astype(dtype)
    res = {}
    for xp in (np, cp):
        mod = ck.nn.Module()
        lins = []
        for i, (o, r) in enumerate(zip(outs, ranks)):
            lin = ck.nn.Linear(width, o, xp=np, rng=np.random.default_rng(i), std=0.05)
            lin.weight.data = lin.weight.data.astype(dtype)
            lin.weight.requires_grad = False
            if r:
                lin = L.LoRALinear(lin, r, 2.0 * r, 2.0, (np.random.default_rng(10 + i).standard_normal(
                    (r, width)) * 0.05).astype(np.float32))
                lin.lora_B.weight.data[...] = np.random.default_rng(20 + i).standard_normal((o, r)) * 0.05
            if xp is cp:
                for p in lin.parameters():
                    p.data = cp.asarray(p.data)
            lins.append(lin)
        xd = xp.asarray(xh)[..., 1:width + 1]  # a strided view: the Function copies it to contiguous rows
        x = Tensor(xd, requires_grad=True)
        if xp is cp:
            _poison_pool(cp)
        with ck.autocast(dtype) if dtype == ck.bfloat16 else _nullctx():
            y = L.lora_project(mod, x, lins)
        g = xp.asarray(rng.standard_normal(y.shape).astype(np.float32).astype(y.dtype)) if xp is np else \
            cp.asarray(res[np]["g"])
        if xp is cp:
            _poison_pool(cp)
        y.backward(g)
        res[xp] = dict(y=y.data, g=g, dx=x.grad, grads={i: [p.grad for p in lin.parameters() if p.requires_grad]
                                                         for i, lin in enumerate(lins)})
    assert_close(res[cp]["y"], res[np]["y"], rtol=tol["rtol"], atol=tol["atol"], what="y")
    assert_close(res[cp]["dx"], res[np]["dx"], rtol=tol["rtol"], atol=tol["atol"] * 4, what="dx")
    for i in res[np]["grads"]:
        for a, b in zip(res[cp]["grads"][i], res[np]["grads"][i]):
            scale = float(np.abs(b).max()) + 1e-12
            assert_close(cp.asnumpy(a) / scale, np.asarray(b) / scale, rtol=0, atol=tol["atol"], what=f"grad {i}")


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.gpu
def test_gpu_bf16_lora_model_matches_numpy(tmp_path):
    """The trainer's setting on the GPU: a bf16 frozen base, fp32 adapters with AdamW's bf16 shadows, bf16
    autocast, packed q/k/v and gate/up through the LoRA Function; loss and adapter gradients against the fp32
    NumPy model (bf16 tolerance). The base parameters stay bf16 with no gradient."""
    import cupy as cp

    base = tmp_path / "base"
    cfg = _tiny(vocab_size=128, hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
    ck.Llama(cfg, seed=2).save_pretrained(base)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (2, 33)).astype(np.int32)
    out = {}
    for xp in (np, cp):
        m = ck.from_pretrained(base, xp=xp, dtype=ck.bfloat16 if xp is cp else None)
        m.add_adapter(r=8, alpha=16, target_modules=SEVEN, seed=1)
        for p in m.trainable_parameters():
            if "lora_B" in p.name:
                p.data[...] = xp.asarray(np.random.default_rng(len(p.name)).standard_normal(p.shape) * 0.05)
        opt = ck.optim.AdamW(m.trainable_parameters(), lr=1e-3, shadow_dtype=ck.bfloat16 if xp is cp else None)
        if xp is cp:
            ck.amp.attach_shadows(m.trainable_parameters(), opt)
        opt.zero_grad()
        with ck.autocast(ck.bfloat16) if xp is cp else _nullctx():
            loss = m(xp.asarray(ids[:, :-1]), xp.asarray(ids[:, 1:]))
        loss.backward()
        out[xp] = (float(loss.data), {n: (p.grad.get() if xp is cp else p.grad).astype(np.float32)
                                      for n, p in m.named_trainable_parameters()})
        if xp is cp:
            assert all(p.dtype == ck.bfloat16 and p.grad is None for p in m.parameters() if not p.requires_grad)
    assert out[cp][0] == pytest.approx(out[np][0], rel=1e-2)
    for n, g in out[np][1].items():
        scale = np.abs(g).max() + 1e-12
        np.testing.assert_allclose(out[cp][1][n] / scale, g / scale, rtol=0, atol=5e-2, err_msg=n)


@pytest.mark.gpu
def test_gpu_lora_step_captures_in_a_graph(tmp_path):
    """A LoRA training step (bf16 base, AdamW over the adapters, autocast) replayed from one CUDA graph gives the
    losses of the same steps run eagerly."""
    import cupy as cp

    base = tmp_path / "base"
    cfg = _tiny(vocab_size=128, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    ck.Llama(cfg, seed=2).save_pretrained(base)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 128, (2, 33)).astype(np.int32)] * 6  # (one batch: the loss must fall)
    losses = {}
    for graph in (False, True):
        m = ck.from_pretrained(base, xp=cp, dtype=ck.bfloat16)
        m.add_adapter(r=4, alpha=8, target_modules=SEVEN, seed=1)
        opt = ck.optim.AdamW(m.trainable_parameters(), lr=1e-2, shadow_dtype=ck.bfloat16)
        ck.amp.attach_shadows(m.trainable_parameters(), opt)
        ids = cp.zeros((2, 32), np.int32)
        tgt = cp.zeros((2, 32), np.int32)

        def step():
            opt.zero_grad(lazy=True)
            with ck.autocast(ck.bfloat16):
                loss = m(ids, tgt)
            loss.backward()
            opt.step()
            return loss.data

        cs = ck.graph.CapturedStep(step, warmup=2, graph=graph)
        got = []
        for b in batches:
            ids[...] = cp.asarray(b[:, :-1])
            tgt[...] = cp.asarray(b[:, 1:])
            got.append(float(cs().copy()))
        cs.synchronize()
        losses[graph] = got
        if graph:
            assert cs.graph is not None
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-3)
    assert losses[True][-1] < losses[True][0]
