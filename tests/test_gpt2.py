"""GPT-2 on the kernels: Hugging Face layout (Conv1D [in, out] weights, with or without the "transformer."
prefix), the fused path equal to the composite (logits, loss, every gradient), dropout through the model,
the trainer on the tiny config and on an llm.c token file; on the GPU, transformers' GPT2LMHeadModel's logits,
loss and gradients with and without a padding mask, and bf16 training that tracks it."""
import json
import os

import numpy as np
import pytest

import cukernels as ck
from cukernels.io import safetensors as st
from cukernels.train import load_config, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**kw):
    d = dict(vocab_size=67, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
             attn_pdrop=0.0, initializer_range=0.2)
    d.update(kw)
    return ck.GPT2Config(**d)


def _ids(rng, B=2, T=11, V=67):
    return rng.integers(0, V, (B, T)).astype(np.int32)


def _write_hf(folder, model, prefix=True):
    """A folder as Hugging Face writes it: Conv1D weights [in, out], lm_head omitted (tied)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for n, a in model.state_dict().items():
        a = np.asarray(a)
        if type(model).hf_transposed(n):
            a = np.ascontiguousarray(a.T)
        out[n if prefix else n[len("transformer."):]] = a
    st.write(folder / "model.safetensors", out, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(model.config.to_hf()))


@pytest.mark.parametrize("prefix", [True, False], ids=["transformer-prefix", "bare-names"])
def test_hf_folder_layout_round_trip(tmp_path, rng, prefix):
    src = ck.GPT2(_config(), seed=1, fused=False).eval()
    _write_hf(tmp_path / "hf", src, prefix=prefix)
    names = set(st.read(tmp_path / "hf" / "model.safetensors"))
    key = ("transformer." if prefix else "") + "h.0.attn.c_attn.weight"
    assert key in names and st.read(tmp_path / "hf" / "model.safetensors")[key].shape == (32, 96)  # [in, out]
    m = ck.from_pretrained(tmp_path / "hf", fused=False).eval()
    assert isinstance(m, ck.GPT2)
    ids = _ids(rng)
    with ck.no_grad():
        np.testing.assert_array_equal(m(ids).data, src(ids).data)
    m.save_pretrained(tmp_path / "back")  # and our export is the HF layout again
    back = st.read(tmp_path / "back" / "model.safetensors")
    np.testing.assert_array_equal(back["transformer.h.1.mlp.c_fc.weight"],
                                  np.asarray(src.state_dict()["transformer.h.1.mlp.c_fc.weight"]).T)
    assert "lm_head.weight" not in back


@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
def test_fused_reference_path_equals_composite(rng, act):
    """Kernel Functions (their NumPy references here) vs plain array ops: logits, loss and every gradient."""
    ids = _ids(rng)
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding in row 1
    res = {}
    for fused in (True, False):
        m = ck.GPT2(_config(activation_function=act), seed=2, fused=fused)
        loss = m(ids[:, :-1], ids[:, 1:], attention_mask=mask[:, :-1])
        loss.backward()
        res[fused] = (float(loss.data), {n: p.grad.copy() for n, p in m.named_parameters()})
    assert abs(res[True][0] - res[False][0]) < 1e-5
    for n, g in res[True][1].items():
        np.testing.assert_allclose(g, res[False][1][n], rtol=2e-4, atol=2e-6, err_msg=n)


def test_gelu_exact_matches_erf():
    import math
    x = np.linspace(-5, 5, 101).astype(np.float32)
    y = ck.functional.gelu(ck.tensor(x), fused=False, approximate="none").data
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)


def test_dropout_in_the_model(rng):
    m = ck.GPT2(_config(resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3), seed=3)
    ids = _ids(rng)
    a = float(m(ids[:, :-1], ids[:, 1:]).data)
    b = float(m(ids[:, :-1], ids[:, 1:]).data)
    assert a != b  # the offset advanced: fresh masks
    assert int(m.dropout_rng.offset) == 2
    m.eval()
    with ck.no_grad():
        e1, e2 = m(ids).data, m(ids).data
    np.testing.assert_array_equal(e1, e2)  # no dropout in eval, offset untouched
    assert int(m.dropout_rng.offset) == 2
    # same seed and offset -> same loss; the gradient of a dropped path is the mask's (finite differences)
    m2 = ck.GPT2(_config(resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3), seed=3, dtype=np.float64, fused=False)
    m2.dropout_rng.offset[...] = 5
    w = m2.transformer.h[0].mlp.c_fc.bias
    loss = m2(ids[:, :-1], ids[:, 1:])
    loss.backward()
    g = w.grad.copy()
    num = []
    for j in range(3):
        for s in (1, -1):
            w.data[j] += s * 1e-6
            m2.dropout_rng.offset[...] = 5  # the forward advances to 6 again: the same masks
            num.append(float(m2(ids[:, :-1], ids[:, 1:]).data))
            w.data[j] -= s * 1e-6
    fd = [(num[2 * j] - num[2 * j + 1]) / 2e-6 for j in range(3)]
    np.testing.assert_allclose(g[:3], fd, rtol=1e-4, atol=1e-8)


def test_dropout_mask_statistics_and_gradient():
    x = np.ones((256, 512), np.float32)
    for p in (0.1, 0.5):
        t = ck.tensor(x, requires_grad=True)
        y = ck.functional.dropout(t, p, seed=11, offset=3)
        keep = y.data != 0
        n = keep.size
        assert abs(keep.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)
        np.testing.assert_allclose(y.data[keep], np.float32(1 / (1 - p)))
        y.sum().backward()
        np.testing.assert_array_equal(t.grad, y.data)  # dx = dy * mask / (1 - p) with dy = 1


SMALL = ["max_steps=30", "eval_every=15", "eval_steps=2", "log_every=5", "plot=false", "batch_size=8",
         "seq_len=32", "total_batch_size=256", "model.n_embd=64", "model.n_layer=2", "warmup_steps=4", "lr=0.01",
         "sample_chars=0"]


def test_gpt2_tiny_config_learns(tmp_path):
    cfg = load_config(os.path.join(ROOT, "examples", "configs", "gpt2-tiny.yaml"), SMALL + [f"out_dir={tmp_path}"])
    rows = trainer.train(cfg, quiet=True)
    va = [r["loss"] for r in rows if r["kind"] == "val"]
    assert va[0] > 5.0 and va[-1] < va[0] - 1.5, va


def test_gpt2_on_an_llmc_token_file_with_dropout_resumes_bit_identically(tmp_path):
    from cukernels.data import write_token_file
    rng = np.random.default_rng(0)
    toks = np.tile(rng.integers(0, 300, 97), 60)  # a repeating pattern: learnable
    write_token_file(tmp_path / "train.bin", toks, kind="gpt2")
    extra = [f"data.kind=llmc", f"data.path={tmp_path / 'train.bin'}", "model.vocab_size=300",
             "model.resid_pdrop=0.1", "model.attn_pdrop=0.1", "model.embd_pdrop=0.1", "max_steps=8", "eval_every=4",
             "log_every=1", "fused=false"]
    base = os.path.join(ROOT, "examples", "configs", "gpt2-tiny.yaml")
    full = trainer.train(load_config(base, SMALL + extra + [f"out_dir={tmp_path / 'full'}"]), quiet=True)
    trainer.train(load_config(base, SMALL + extra + [f"out_dir={tmp_path / 'k'}", "ckpt_every=4"]), quiet=True,
                  stop_after=5)
    resumed = trainer.train(load_config(base, SMALL + extra + [f"out_dir={tmp_path / 'k'}", "ckpt_every=4",
                                                               "resume=latest"]), quiet=True)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("ms_per_step", "tok_per_s")} for r in rows]  # noqa
    assert strip(resumed) == strip(full)
    tr = [r["loss"] for r in full if r["kind"] == "train"]
    assert tr[-1] < tr[0]


def test_config_validation():
    with pytest.raises(ValueError, match="n_embd \\(30\\) must be a multiple of n_head \\(4\\)"):
        ck.GPT2Config(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="activation_function"):
        ck.GPT2Config(activation_function="relu")
    with pytest.raises(ValueError, match="attn_pdrop: expected a probability"):
        ck.GPT2Config(attn_pdrop=1.0)


# ------------------------------------------------------------------------------------------------ GPU
def _hf_pair(tmp_path, cfg_kw, seed=4):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import cupy as cp
    src = ck.GPT2(_config(**cfg_kw), seed=seed, fused=False)
    src.save_pretrained(tmp_path / "hf")
    ref = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32,
                                                       attn_implementation="eager")
    ours = ck.from_pretrained(tmp_path / "hf", xp=cp)
    return torch, ref, ours, cp


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "left-padded"])
def test_logits_loss_grads_equal_transformers(tmp_path, rng, masked):
    torch, ref, ours, cp = _hf_pair(tmp_path, dict(n_embd=64, n_head=4, vocab_size=101, n_positions=64))
    ref.eval()
    ours.eval()
    ids = rng.integers(0, 101, (3, 20)).astype(np.int64)
    mask = np.ones_like(ids)
    if masked:
        mask[1, :7] = 0
        mask[2, :19] = 0
    tgt = np.where((mask[:, :-1] == 1) & (mask[:, 1:] == 1), ids[:, 1:], -100)  # no target on a padded input
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    out = ref(torch.from_numpy(ids[:, :-1]), attention_mask=torch.from_numpy(mask[:, :-1]),
              position_ids=torch.from_numpy(pos[:, :-1]), labels=None)
    logits = out.logits
    loss_t = torch.nn.functional.cross_entropy(logits.reshape(-1, 101), torch.from_numpy(tgt).reshape(-1),
                                               ignore_index=-100)
    loss_t.backward()
    with ck.no_grad():
        lg = ours(cp.asarray(ids[:, :-1]), attention_mask=cp.asarray(mask[:, :-1]),
                  position_ids=cp.asarray(pos[:, :-1])).data
    real = mask[:, :-1] == 1
    np.testing.assert_allclose(cp.asnumpy(lg)[real], logits.detach().numpy()[real], atol=1e-4, rtol=0)
    loss = ours(cp.asarray(ids[:, :-1]), cp.asarray(tgt), attention_mask=cp.asarray(mask[:, :-1]),
                position_ids=cp.asarray(pos[:, :-1]))
    loss.backward()
    assert abs(float(loss.data) - loss_t.item()) < 1e-5
    theirs = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        g = theirs[n].grad.numpy()
        if type(ours).hf_transposed(n):
            g = g.T
        np.testing.assert_allclose(cp.asnumpy(p.grad), g, atol=2e-5, rtol=1e-3, err_msg=n)


@pytest.mark.gpu
def test_bf16_training_tracks_transformers(tmp_path, rng):
    """Ten AdamW steps, same init and batches: ours under bf16 autocast (flash attention, fused kernels) vs
    transformers in fp32; the losses agree within bf16 noise and both fall."""
    torch, ref, ours, cp = _hf_pair(tmp_path, dict(n_embd=128, n_head=2, vocab_size=211, n_positions=128), seed=6)
    opt_t = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    opt = ck.optim.AdamW(ours.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ck.amp.attach_shadows(ours.parameters(), opt)
    data = rng.integers(0, 211, (10, 4, 65)).astype(np.int64)
    lt, lo = [], []
    for b in data:
        x, y = b[:, :-1], b[:, 1:]
        opt_t.zero_grad()
        loss_t = ref(torch.from_numpy(x), labels=None).logits.reshape(-1, 211)
        loss_t = torch.nn.functional.cross_entropy(loss_t, torch.from_numpy(y).reshape(-1))
        loss_t.backward()
        opt_t.step()
        lt.append(loss_t.item())
        opt.zero_grad()
        with ck.autocast(ck.bfloat16):
            loss = ours(cp.asarray(x), cp.asarray(y))
        loss.backward()
        opt.step()
        lo.append(float(loss.data))
    np.testing.assert_allclose(lo, lt, atol=0.05, rtol=0)
    assert lo[-1] < lo[0] - 0.1 and lt[-1] < lt[0] - 0.1
