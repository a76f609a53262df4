"""Layers and the LLaMA model: HF names, state dicts, GQA attention vs a naive formula, end-to-end gradient check
(float64, composite path), fused vs composite, autocast, and the GPU path vs the NumPy path."""
import numpy as np
import pytest

import cukernels as ck
from cukernels import functional as F
from cukernels.autograd import Tensor
from cukernels.nn import Attention
from cukernels.optim import AdamW, CompositeAdamW

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
        oh.zero_grad(), od.zero_grad()  # before the forward: the fused head writes lm_head's gradient in it
        lh = mh(ids, tg)
        ld = md(cp.asarray(ids), cp.asarray(tg))
        np.testing.assert_allclose(float(ld.data), float(lh.data), rtol=2e-5, err_msg=f"loss step {step}")
        lh.backward()
        ld.backward()
        for (n, p), (_, q) in zip(mh.named_parameters(), md.named_parameters()):
            scale = np.abs(p.grad).max() + 1e-12
            np.testing.assert_allclose(q.grad.get() / scale, p.grad / scale, rtol=0, atol=2e-4,
                                       err_msg=f"{n} step {step}")
        oh.step()
        od.step()


# ---------------------------------------------------------------- packed projections (PackedLinear)
def _packed_vs_separate(rng, ws, x, lows=None, grads=None, stale=False):
    """PackedLinear over Parameters ws against one Linear each: output and every gradient (float64)."""
    r = rng.standard_normal(x.shape[:-1] + (sum(w.shape[0] for w in ws),))
    xt = Tensor(x.copy(), requires_grad=True)
    y = F.packed_linear(xt, ws, lows)
    for w in ws:
        w.grad_stale = stale
    (y * r).sum().backward()
    xs = Tensor(x.copy(), requires_grad=True)
    cuts = np.cumsum([0] + [w.shape[0] for w in ws])
    refs = [Tensor(w.data.copy(), requires_grad=True) for w in ws]
    ys = [F.linear(xs, q) for q in refs]
    np.testing.assert_allclose(y.data, np.concatenate([a.data for a in ys], axis=-1), rtol=1e-13)
    sum((a * r[..., cuts[i]:cuts[i + 1]]).sum() for i, a in enumerate(ys)).backward()
    np.testing.assert_allclose(xt.grad, xs.grad, rtol=1e-12)
    for w, q, g0 in zip(ws, refs, grads or [None] * len(ws)):
        want = q.grad + (g0 if g0 is not None and not stale else 0)
        np.testing.assert_allclose(w.grad, want, rtol=1e-12, err_msg=w.name)
        assert not w.grad_stale


def test_packed_linear_separate_arrays_matches_linears(rng):
    """Weights in separate arrays: a GEMM per weight into column slices, input gradients accumulated (beta=1)."""
    ws = [ck.nn.Parameter(rng.standard_normal((o, 5)), name=f"w{o}") for o in (4, 2, 3)]
    assert F.joined_rows([w.data for w in ws]) is None
    _packed_vs_separate(rng, ws, rng.standard_normal((2, 3, 5)))
    g0 = [rng.standard_normal(w.shape) for w in ws]  # existing gradients are accumulated into
    for w, g in zip(ws, g0):
        w.grad = g.copy()
    _packed_vs_separate(rng, ws, rng.standard_normal((7, 5)), grads=g0)


@pytest.mark.parametrize("stale", [False, True])
def test_packed_linear_joined_flat_buffer(rng, stale):
    """Weights back to back in one flat buffer (the optimizer's layout): one [sum, in] view each way, the weight
    gradient written once into the adjacent .grad views (overwriting when lazily zeroed, else adding)."""
    flat = rng.standard_normal(9 * 5 + 4)
    gflat = rng.standard_normal(9 * 5 + 4)
    ws, off = [], 0
    for o in (4, 2, 3):
        w = ck.nn.Parameter(flat[off:off + o * 5].reshape(o, 5), name=f"w{o}")
        w.grad = gflat[off:off + o * 5].reshape(o, 5)
        ws.append(w)
        off += o * 5
    J = F.joined_rows([w.data for w in ws])
    assert J.shape == (9, 5) and np.shares_memory(J, flat) and np.array_equal(J.reshape(-1), flat[:45])
    g0 = [w.grad.copy() for w in ws]
    tail = gflat[45:].copy()
    _packed_vs_separate(rng, ws, rng.standard_normal((3, 5)), grads=g0, stale=stale)
    np.testing.assert_array_equal(gflat[45:], tail)  # the joined GEMM writes nothing past the three views
    # not adjacent or not in order: no joined view
    assert F.joined_rows([ws[1].data, ws[0].data]) is None
    assert F.joined_rows([ws[0].data, ws[2].data]) is None
    assert F.joined_rows([ws[0].data, flat[20:30].reshape(2, 5).copy()]) is None
    assert F.joined_rows([ws[0].data, flat[20:28].reshape(2, 4)]) is None


def test_packed_projections_in_the_model(rng, monkeypatch):
    """LLaMA's gate / up as one PackedLinear (and the switch that turns it off) give the same loss and gradients;
    with AdamW's flat buffers the two weights are adjacent, so the joined GEMM path runs."""
    from cukernels.nn import layers

    cfg = tiny_cfg()
    ids = rng.integers(0, 11, (2, 6)).astype(np.int32)
    out = {}
    for pack in (True, False):
        monkeypatch.setattr(ck.settings, "pack_projections", pack)
        m = ck.Llama(cfg, seed=4)
        opt = AdamW(m.parameters(), lr=1e-3)
        mlp = m.model.layers[0].mlp
        assert F.joined_rows([mlp.gate_proj.weight.data, mlp.up_proj.weight.data]) is not None
        calls = []
        real = F.PackedLinear.forward
        monkeypatch.setattr(F.PackedLinear, "forward", staticmethod(lambda *a, **k: calls.append(1) or real(*a, **k)))
        opt.zero_grad(lazy=True)
        loss = m(ids, ids)
        loss.backward()
        assert len(calls) == (cfg.num_hidden_layers if pack else 0)
        out[pack] = (float(loss.data), {n: p.grad.copy() for n, p in m.named_parameters()})
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-6)
    for n, g in out[True][1].items():
        np.testing.assert_allclose(g, out[False][1][n], rtol=1e-4, atol=1e-6, err_msg=n)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", ["f32", "bf16"])
def test_gpu_packed_qkv_and_gate_up_match_separate(monkeypatch, grad_dtype):
    """bf16 autocast on the GPU with AdamW's shadows: q / k / v as one GEMM feeding the packed flash attention
    (rope on q and k in place, one launch), gate / up as one GEMM into the packed SwiGLU. Loss and gradients
    against the separate projections (ck.settings.pack_projections off): same math, other GEMM shapes (bf16
    tolerance)."""
    import cupy as cp
    from cukernels.nn import layers

    cfg = tiny_cfg(vocab_size=128, hidden_size=256, intermediate_size=384, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
    rng = np.random.default_rng(3)
    ids = cp.asarray(rng.integers(0, 128, (2, 37)).astype(np.int32))
    tg = cp.asarray(rng.integers(0, 128, (2, 37)).astype(np.int32))
    out = {}
    for pack in (True, False):
        monkeypatch.setattr(ck.settings, "pack_projections", pack)
        m = ck.Llama(cfg, seed=9).to("gpu")
        opt = AdamW(m.parameters(), lr=1e-3, grad_dtype=ck.bfloat16 if grad_dtype == "bf16" else np.float32)
        ck.amp.attach_shadows(m.parameters(), opt)
        att = m.model.layers[1].self_attn
        assert F.joined_rows([amp_w.shadow for amp_w in (att.q_proj.weight, att.k_proj.weight, att.v_proj.weight)]) \
            is not None
        assert F.joined_rows([att.q_proj.weight.grad, att.k_proj.weight.grad, att.v_proj.weight.grad]) is not None
        calls = []
        real = F.FlashAttentionPackedF.forward
        monkeypatch.setattr(F.FlashAttentionPackedF, "forward",
                            staticmethod(lambda *a, **k: calls.append(1) or real(*a, **k)))
        for step in range(2):  # the second backward writes over lazily zeroed gradients
            opt.zero_grad(lazy=True)
            with ck.autocast(ck.bfloat16):
                loss = m(ids, tg)
            loss.backward()
        assert len(calls) == (2 * cfg.num_hidden_layers if pack else 0)
        out[pack] = (float(loss.data), {n: cp.asnumpy(p.grad).astype(np.float32) for n, p in m.named_parameters()})
    assert out[True][0] == pytest.approx(out[False][0], rel=2e-3)
    for n, g in out[True][1].items():
        ref = out[False][1][n]
        scale = np.abs(ref).max() + 1e-12
        np.testing.assert_allclose(g / scale, ref / scale, rtol=0, atol=3e-2, err_msg=n)


def test_packable_only_bias_free_fused_projections(rng, monkeypatch):
    """PackedLinear takes bias-free projections of a fused module only: with biases (or unfused, or the switch off)
    the MLP keeps one Linear call each and gives the same output."""
    from cukernels.nn import layers
    from cukernels.nn.mlp import SwiGLUMLP

    x = Tensor(rng.standard_normal((2, 3, 8)).astype(np.float32))
    for bias, fused, pack, want in ((False, True, True, True), (True, True, True, False),
                                    (False, False, True, False), (False, True, False, False)):
        monkeypatch.setattr(ck.settings, "pack_projections", pack)
        m = SwiGLUMLP(8, 12, bias=bias, rng=np.random.default_rng(1), dtype=np.float32)
        m.set_fused(fused)
        assert layers.packable(m, (m.gate_proj, m.up_proj)) is want
        calls = []
        real = F.PackedLinear.forward
        monkeypatch.setattr(F.PackedLinear, "forward", staticmethod(lambda *a, **k: calls.append(1) or real(*a, **k)))
        y = m(x)
        monkeypatch.setattr(F.PackedLinear, "forward", staticmethod(real))
        assert len(calls) == int(want)
        gate, up = x.data @ m.gate_proj.weight.data.T, x.data @ m.up_proj.weight.data.T
        if bias:
            gate, up = gate + m.gate_proj.bias.data, up + m.up_proj.bias.data
        ref = (gate / (1 + np.exp(-gate)) * up) @ m.down_proj.weight.data.T
        if bias:
            ref = ref + m.down_proj.bias.data
        np.testing.assert_allclose(y.data, ref, rtol=1e-4, atol=1e-6)
