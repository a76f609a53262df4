"""Layers and the LLaMA model: HF names, state dicts, GQA attention vs a naive formula, end-to-end gradient check
(float64, composite path), fused vs composite, autocast, and the GPU path vs the NumPy path."""
import numpy as np
import pytest

import cukernels as ck
from cukernels import functional as F
from cukernels.autograd import Tensor
from cukernels.nn import Attention
from cukernels.optim import CompositeAdamW

from test_autograd import numgrad

KERNEL_OPS = ["rms_norm", "attn_softmax", "cross_entropy_fused", "embedding", "rope", "swiglu"]
assert all(hasattr(ck, o) for o in KERNEL_OPS)


def needs_kernels(f):
    return f


def tiny_cfg(**kw):
    c = dict(vocab_size=11, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32)
    c.update(kw)
    return ck.LlamaConfig(**c)


def test_hf_parameter_names():
    m = ck.Llama(tiny_cfg())
    names = [n for n, _ in m.named_parameters()]
    assert names[0] == "model.embed_tokens.weight"
    for s in ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
              "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
              "model.layers.0.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"]:
        assert s in names, s
    assert len(names) == 1 + 2 * 9 + 1 + 1
    shapes = dict((n, p.shape) for n, p in m.named_parameters())
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (8, 16)  # 2 KV heads x head_dim 4
    tied = ck.Llama(tiny_cfg(tie_word_embeddings=True))
    assert "lm_head.weight" not in dict(tied.named_parameters())


def test_state_dict_roundtrip_and_errors(rng):
    a, b = ck.Llama(tiny_cfg(), seed=1), ck.Llama(tiny_cfg(), seed=2)
    keep = b.model.norm.weight.data
    b.load_state_dict({k: v.copy() for k, v in a.state_dict().items()})
    assert b.model.norm.weight.data is keep  # copied in place
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=n)
    sd = a.state_dict()
    bad = dict(sd)
    bad["model.norm.weight"] = np.zeros(3, np.float32)
    before = b.model.layers[0].mlp.up_proj.weight.data.copy()
    with pytest.raises(ValueError, match="model.norm.weight"):
        b.load_state_dict(bad)
    np.testing.assert_array_equal(b.model.layers[0].mlp.up_proj.weight.data, before)
    with pytest.raises(ValueError, match="missing"):
        b.load_state_dict({k: v for k, v in sd.items() if k != "lm_head.weight"})


def _naive_attention(x, att, cos, sin):
    """Independent float64 formula: explicit repeat_kv, explicit rotate-half, masked softmax loops."""
    Bsz, T, C = x.shape
    H, Hkv, D = att.H, att.Hkv, att.D
    q = (x @ att.q_proj.weight.data.T).reshape(Bsz, T, H, D)
    k = (x @ att.k_proj.weight.data.T).reshape(Bsz, T, Hkv, D)
    v = (x @ att.v_proj.weight.data.T).reshape(Bsz, T, Hkv, D)

    def rot(z):
        c = np.concatenate([cos[:T], cos[:T]], -1)[None, :, None, :]
        s = np.concatenate([sin[:T], sin[:T]], -1)[None, :, None, :]
        zr = np.concatenate([-z[..., D // 2:], z[..., :D // 2]], -1)
        return z * c + zr * s

    q, k = rot(q), rot(k)
    rep = H // Hkv
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    out = np.zeros((Bsz, T, H, D))
    for b in range(Bsz):
        for h in range(H):
            s = q[b, :, h] @ k[b, :, h].T / np.sqrt(D)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[b, :, h] = p @ v[b, :, h]
    return out.reshape(Bsz, T, H * D) @ att.o_proj.weight.data.T


def test_gqa_attention_matches_naive(rng):
    att = Attention(16, 4, 2, rng=rng).set_fused(False)
    for p in att.parameters():
        p.data = p.data.astype(np.float64) * 10
    x = rng.standard_normal((2, 5, 16))
    cos, sin = ck.rope_cache(8, 4, theta=10000.0, scaling=None, xp=np)
    got = att(Tensor(x), cos=cos[:5].astype(np.float64), sin=sin[:5].astype(np.float64)).data
    ref = _naive_attention(x, att, cos.astype(np.float64), sin.astype(np.float64))
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)


def test_rope_cache_llama3_scaling():
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    cos, sin = ck.rope_cache(10, 16, theta=500000.0, scaling=sc, xp=np)
    assert cos.shape == (10, 8) and cos.dtype == np.float32
    cos0, sin0 = ck.rope_cache(10, 16, theta=500000.0, scaling=None, xp=np)
    np.testing.assert_allclose(cos[:, 0], cos0[:, 0], rtol=1e-6)  # the highest frequency is not scaled
    np.testing.assert_allclose(sin[1:, -1], sin0[1:, -1] / 8, rtol=1e-3)  # the lowest is divided by factor


def test_llama_end_to_end_gradcheck_float64(rng):
    """2-layer LLaMA (GQA, untied) on the composite path in float64: loss gradient of a sample of entries of
    every parameter vs central finite differences."""
    m = ck.Llama(tiny_cfg(), seed=3, fused=False, dtype=np.float64)
    for p in m.parameters():  # larger weights so every path matters
        p.data = p.data * 10 if p.ndim == 2 else p.data + 0.1 * rng.standard_normal(p.shape)
    ids = rng.integers(0, 11, (2, 5))
    tg = rng.integers(0, 11, (2, 5))
    tg[0, 1] = -100
    m(ids, tg).backward()
    for n, p in m.named_parameters():
        flat = p.data.reshape(-1)
        for j in rng.choice(flat.size, size=min(4, flat.size), replace=False):
            def f():
                return float(m(ids, tg).data)
            view = flat[j:j + 1]
            num = numgrad(f, view, eps=1e-5)[0]
            np.testing.assert_allclose(p.grad.reshape(-1)[j], num, rtol=1e-5, atol=1e-8, err_msg=f"{n}[{j}]")


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_fused_model_matches_composite(tied, rng):
    """fp32 kernel-path model vs float64 composite model with the same weights: loss and every gradient."""
    cfg = tiny_cfg(tie_word_embeddings=tied)
    a = ck.Llama(cfg, seed=4, fused=True)
    b = ck.Llama(cfg, seed=4, fused=False, dtype=np.float64)
    ids = rng.integers(0, 11, (2, 6)).astype(np.int32)
    tg = rng.integers(0, 11, (2, 6)).astype(np.int32)
    la, lb = a(ids, tg), b(ids, tg)
    np.testing.assert_allclose(la.data, lb.data, rtol=1e-5)
    la.backward()
    lb.backward()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_allclose(p.grad, q.grad, rtol=1e-3, atol=1e-5, err_msg=n)


@needs_kernels
def test_logits_and_no_grad(rng):
    m = ck.Llama(tiny_cfg(), seed=5)
    ids = rng.integers(0, 11, (2, 4)).astype(np.int32)
    with ck.no_grad():
        logits = m(ids)
        loss = m(ids, ids)
    assert logits.shape == (2, 4, 11) and not loss.requires_grad
    lz = logits.data.reshape(-1, 11).astype(np.float64)
    lse = np.log(np.exp(lz).sum(-1))
    ref = (lse - lz[np.arange(8), ids.reshape(-1)]).mean()
    np.testing.assert_allclose(loss.data, ref, rtol=1e-5)


def test_autocast_composite_numpy(rng):
    """bf16 autocast on the composite path: GEMM activations in bf16, loss fp32 and close to fp32; grads fp32."""
    m = ck.Llama(tiny_cfg(), seed=6, fused=False)
    ids = rng.integers(0, 11, (2, 5))
    ref = float(m(ids, ids).data)
    with ck.autocast(ck.bfloat16):
        loss = m(ids, ids)
        with ck.autocast(enabled=False):
            assert ck.amp.get_autocast_dtype() is None
    assert loss.dtype == np.float32
    assert abs(float(loss.data) - ref) < 0.05
    loss.backward()
    assert all(p.grad.dtype == np.float32 for p in m.parameters())


def test_linear_reads_shadow_under_autocast(rng):
    lin = ck.nn.Linear(4, 3, rng=rng)
    lin.weight.shadow = (lin.weight.data * 2).astype(ck.bfloat16)  # a distinct shadow shows it is read
    x = rng.standard_normal((2, 4)).astype(np.float32)
    with ck.autocast(ck.bfloat16):
        y = lin(Tensor(x))
    assert y.dtype == ck.bfloat16
    ref = x.astype(ck.bfloat16).astype(np.float32) @ lin.weight.shadow.astype(np.float32).T
    np.testing.assert_allclose(y.data.astype(np.float32), ref, rtol=1e-2, atol=1e-2)
    (y * np.ones((2, 3), ck.bfloat16)).sum().backward()
    assert lin.weight.grad.dtype == np.float32


def test_composite_adamw_matches_formula(rng):
    p = ck.nn.Parameter(rng.standard_normal((3, 2)))
    q = ck.nn.Parameter(rng.standard_normal(4))
    opt = CompositeAdamW([p, q], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.5, no_decay=[q])
    p0, q0 = p.data.copy(), q.data.copy()
    gp, gq = rng.standard_normal((3, 2)), rng.standard_normal(4)
    p.grad, q.grad = gp.copy(), gq.copy()
    opt.step(grad_scale=0.5)
    for x0, g, wd, x in [(p0, gp * 0.5, 0.5, p.data), (q0, gq * 0.5, 0.0, q.data)]:
        m, v = 0.1 * g, 0.01 * g * g
        ref = x0 * (1 - 0.1 * wd) - 0.1 * (m / 0.1) / (np.sqrt(v / 0.01) + 1e-8)
        np.testing.assert_allclose(x, ref, rtol=1e-12)


@pytest.mark.gpu
@needs_kernels
def test_gpu_path_matches_numpy_path_for_several_steps():
    """Same tiny model and batches on CuPy (kernels + cuBLAS) and NumPy (references): losses and gradients agree
    within fp32 tolerance for several AdamW steps (fp32, no autocast)."""
    import cupy as cp

    cfg = tiny_cfg(vocab_size=64, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                   num_key_value_heads=2)
    mh = ck.Llama(cfg, seed=7)
    md = ck.Llama(cfg, seed=7).to("gpu")
    rng = np.random.default_rng(0)
    oh = CompositeAdamW(mh.parameters(), lr=1e-2, weight_decay=0.1)
    od = CompositeAdamW(md.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(4):
        ids = rng.integers(0, 64, (3, 17)).astype(np.int32)
        tg = rng.integers(0, 64, (3, 17)).astype(np.int32)
        tg[0, :3] = -100
        lh = mh(ids, tg)
        ld = md(cp.asarray(ids), cp.asarray(tg))
        np.testing.assert_allclose(float(ld.data), float(lh.data), rtol=2e-5, err_msg=f"loss step {step}")
        oh.zero_grad(), od.zero_grad()
        lh.backward()
        ld.backward()
        for (n, p), (_, q) in zip(mh.named_parameters(), md.named_parameters()):
            scale = np.abs(p.grad).max() + 1e-12
            np.testing.assert_allclose(q.grad.get() / scale, p.grad / scale, rtol=0, atol=2e-4,
                                       err_msg=f"{n} step {step}")
        oh.step()
        od.step()
