"""Generation: the KV-cache path gives the tokens (greedy) and logits of recomputing the whole sequence; the
cached prefill equals the training forward; sampling is seeded; the CLI runs on our checkpoints and HF folders;
on the GPU the kernels' greedy tokens match the NumPy path's."""
import os
import subprocess
import sys

import numpy as np
import pytest

import cukernels as ck
from cukernels.data import ByteTokenizer
from cukernels.generation import generate, sample

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = all(hasattr(ck, o) for o in ["rms_norm", "attn_softmax", "embedding", "rope", "swiglu"])


def _model(xp=np, fused=False, seed=0, **kw):
    d = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.15)
    d.update(kw)
    return ck.Llama(ck.LlamaConfig(**d), xp=xp, seed=seed, fused=fused)


def test_static_engine_is_the_default_only_for_head_dims_decode_attention_takes():
    """generate()'s default engine: static on the GPU for bf16 models whose attention head_dim ck.decode_attention
    takes (32, 64, 128); a head_dim-16 model (hidden 64, 4 heads) decodes on the dynamic engine instead of
    failing at the first token (session 8: the trainer's end-of-run sample of such a model on the GPU raised)."""
    from cukernels.models.generate import _static_default

    small, wide = _model(), _model(hidden_size=128, num_attention_heads=4)  # head_dim 16, 32
    assert not _static_default(small, True, True, ck.bfloat16)
    assert _static_default(wide, True, True, ck.bfloat16)
    assert not _static_default(wide, True, False, ck.bfloat16)  # NumPy: always dynamic
    assert not _static_default(wide, False, True, ck.bfloat16)  # use_cache=False: recompute
    assert not _static_default(wide, True, True, None)  # fp32 weights, no autocast


@pytest.mark.parametrize("B,tied", [(1, False), (2, True)])
def test_kv_cache_greedy_equals_recompute(B, tied):
    m = _model(tie_word_embeddings=tied)
    prompt = np.random.default_rng(1).integers(0, 256, size=(B, 7))
    a = generate(m, prompt, 24, temperature=0, use_cache=True)
    b = generate(m, prompt, 24, temperature=0, use_cache=False)
    assert a.shape == (B, 31)
    np.testing.assert_array_equal(a[:, :7], prompt)
    np.testing.assert_array_equal(a, b)
    assert len(np.unique(a[:, 7:])) > 3  # not a degenerate constant continuation


def test_kv_cache_logits_match_full_forward():
    m = _model(seed=2)
    seq = np.random.default_rng(2).integers(0, 256, size=(2, 12)).astype(np.int32)
    with ck.no_grad():
        full = m(seq).data  # [B, T, V], the training forward
        cache = m.new_kv_cache(12)
        pre = m(seq[:, :5], kv_cache=cache).data  # prefill: last position only
        np.testing.assert_allclose(pre[:, 0], full[:, 4], rtol=0, atol=1e-5)
        for t in range(5, 12):  # one token at a time
            step = m(seq[:, t:t + 1], kv_cache=cache).data
            np.testing.assert_allclose(step[:, 0], full[:, t], rtol=0, atol=1e-5)
        assert cache.pos == 12
        with pytest.raises(ValueError, match="exceed max_len 12"):
            m(seq[:, :1], kv_cache=cache)


def test_training_path_unchanged_by_cache_support():
    m = _model(seed=4)
    names = [n for n, _ in m.named_parameters()]
    assert "model.layers.0.self_attn.q_proj.weight" in names and len(names) == 2 * 9 + 3
    seq = np.random.default_rng(4).integers(0, 256, size=(2, 9)).astype(np.int32)
    loss = m(seq[:, :-1], seq[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_sampling_is_seeded_and_respects_top_k():
    m = _model(seed=3)
    a = generate(m, [10, 20, 30], 16, temperature=1.0, top_k=5, seed=7)
    b = generate(m, [10, 20, 30], 16, temperature=1.0, top_k=5, seed=7)
    c = generate(m, [10, 20, 30], 16, temperature=1.0, top_k=5, seed=8)
    np.testing.assert_array_equal(a, b)
    assert a.ndim == 1 and len(a) == 19 and not np.array_equal(a, c)
    lg = np.array([[0.0, 5.0, 4.0, -1.0, 3.0]])
    rng = np.random.default_rng(0)
    draws = {int(sample(lg, temperature=1.0, top_k=2, rng=rng)[0]) for _ in range(200)}
    assert draws == {1, 2}
    assert int(sample(lg, temperature=0)[0]) == 1
    with pytest.raises(ValueError, match="ids: token ids must be < vocab_size="):
        generate(m, [300], 2)


def test_generate_cli_on_trainer_checkpoint_and_hf_folder(tmp_path):
    from cukernels.io import checkpoint as C
    m = _model(seed=5)
    arrays = {C.MODEL_PREFIX + n: p for n, p in m.state_dict().items()}
    ck_path = C.save(tmp_path / "run" / "checkpoints" / "step_00000010.ckpt", arrays,
                     {"kind": C.TRAIN_KIND, "step": 10, "model_config": m.config.to_dict()})
    m.save_pretrained(tmp_path / "hf")
    want = generate(m, ByteTokenizer().encode("ROMEO:"), 12, temperature=0)
    env = dict(os.environ, PYTHONPATH=ROOT)
    for src in (ck_path, tmp_path / "run", tmp_path / "hf"):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "generate.py"), "--checkpoint", str(src),
                            "--prompt", "ROMEO:", "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu",
                            "--fused", "false", "--print-ids"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert [int(t) for t in r.stdout.split()] == want.tolist(), (r.stdout, want)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "generate.py"), "--checkpoint", str(ck_path),
                        "--prompt", "ROMEO:", "--max-new-tokens", "12", "--seed", "1", "--device", "cpu",
                        "--fused", "false"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ROMEO:"), (r.stdout, r.stderr)
    # another vocabulary: ids in, ids out
    m2 = _model(seed=6, vocab_size=300)
    m2.save_pretrained(tmp_path / "hf300")
    want = generate(m2, [1, 299, 5], 5, temperature=0)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "generate.py"), "--checkpoint",
                        str(tmp_path / "hf300"), "--prompt-ids", "1 299 5", "--max-new-tokens", "5", "--temperature",
                        "0", "--device", "cpu", "--fused", "false"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert [int(t) for t in r.stdout.split()] == want.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not KERNELS, reason="kernel families not merged yet")
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_kv_cache_greedy_matches_numpy(fused):
    import cupy
    ref = _model(seed=9)
    gpu = _model(xp=cupy, seed=9, fused=fused)
    gpu.load_state_dict(ref.state_dict())
    prompt = np.random.default_rng(9).integers(0, 256, size=(2, 11))
    want = generate(ref, prompt, 32, temperature=0)
    got = generate(gpu, prompt, 32, temperature=0)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(generate(gpu, prompt, 32, temperature=0, use_cache=False), want)


# ------------------------------------------------------------------ the static engine (GPU): captured decode
def _peaked(xp, model_cls="llama", seed=11):
    """A small bf16 model whose residual stream is dominated by the token embedding (the attention and MLP output
    projections scaled by 0.1): rounding differences between engines stay far below the logit gaps, while every
    kernel of the decode path still contributes."""
    if model_cls == "gpt2":
        m = ck.GPT2(ck.GPT2Config(vocab_size=301, n_positions=256, n_embd=128, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1),
                    xp=xp, seed=seed)
        small = [b.attn.c_proj.weight for b in m.transformer.h] + [b.mlp.c_proj.weight for b in m.transformer.h]
    else:
        m = ck.Llama(ck.LlamaConfig(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    initializer_range=0.1), xp=xp, seed=seed)
        small = [b.self_attn.o_proj.weight for b in m.model.layers] + [b.mlp.down_proj.weight for b in m.model.layers]
    for w in small:
        w.data *= 0.1
    return m.to(ck.bfloat16)


def _assert_greedy_equal(model, prompt_len, got, want, rel=0.01):
    """Greedy sequences equal, except after a genuine near-tie: at the first differing token, the reference
    sequence's top-2 logits (recomputed without a cache) must lie within ``rel`` of the logits' spread or four
    bf16 units in the last place of the top logit (the H200 run: margins of 1 and 2 ulps at 28 and 25 tokens)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    for b in range(got.shape[0]):
        diff = np.nonzero(got[b] != want[b])[0]
        if diff.size == 0:
            continue
        i = int(diff[0])
        assert i >= prompt_len, f"row {b}: the prompt changed at {i}"
        with ck.no_grad():
            lg = model(want[b:b + 1, :i]).data[0, -1].astype(np.float32)
        lg = lg.get() if hasattr(lg, "get") else lg
        top = np.sort(lg)[-2:]
        margin = float(top[1] - top[0])
        # bf16 logits: a few units in the last place of the top logit apart is a tie decided by rounding
        ulp = 2.0 ** (np.floor(np.log2(max(abs(float(top[1])), 1e-30))) - 7)
        assert margin < max(rel * float(lg.std()), 4 * ulp), (
            f"row {b}: diverges at {i} ({got[b, i]} vs {want[b, i]}) with a clear margin {margin:.4f} (logit std "
            f"{lg.std():.3f}, bf16 ulp {ulp:.4f})")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_static_engine_greedy_equals_dynamic_and_recompute(family):
    import cupy
    m = _peaked(cupy, family)
    prompt = np.array([[5, 17, 200, 3, 9, 44, 120], [1, 2, 3, 4, 5, 6, 7]])
    stats = {}
    got = generate(m, prompt, 40, temperature=0, static=True, stats=stats)
    assert stats["new_tokens"] == 40 and got.shape == (2, 47)
    dyn = generate(m, prompt, 40, temperature=0, static=False)
    ref = generate(m, prompt, 40, temperature=0, static=False, use_cache=False)
    _assert_greedy_equal(m, 7, got, ref)
    _assert_greedy_equal(m, 7, dyn, ref)
    np.testing.assert_array_equal(generate(m, prompt, 40, temperature=0, static=True, graph=False), got)


@pytest.mark.gpu
def test_static_engine_ragged_batch_equals_each_row_alone():
    import cupy
    m = _peaked(cupy)
    rows = [[5, 17, 200, 3, 9, 44, 120], [42, 7], [8, 8, 8, 100]]
    T = max(len(r) for r in rows)
    prompt = np.zeros((3, T), np.int64)
    mask = np.zeros((3, T), np.int64)
    for b, r in enumerate(rows):
        prompt[b, T - len(r):] = r
        mask[b, T - len(r):] = 1
    got = generate(m, prompt, 24, temperature=0, attention_mask=mask)
    for b, r in enumerate(rows):
        alone = generate(m, np.array([r]), 24, temperature=0)
        _assert_greedy_equal(m, len(r), np.concatenate([r, got[b, T:]])[None], alone)
    # the dynamic engine handles the same padded batch the same way
    dyn = generate(m, prompt, 24, temperature=0, attention_mask=mask, static=False)
    for b, r in enumerate(rows):
        _assert_greedy_equal(m, len(r), np.concatenate([r, dyn[b, T:]])[None], np.concatenate([r, got[b, T:]])[None])


@pytest.mark.gpu
def test_static_engine_sampling_is_reproducible_by_seed_and_stops_at_eos():
    import cupy
    m = _peaked(cupy)
    p = np.array([[5, 17, 200], [9, 9, 9]])
    kw = dict(temperature=1.0, top_k=50, top_p=0.95, repetition_penalty=1.1)
    a = generate(m, p, 30, seed=7, **kw)
    b = generate(m, p, 30, seed=7, **kw)
    c = generate(m, p, 30, seed=8, **kw)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    eos = int(a[0, 5])  # a token row 0 produces: it stops there, later tokens are eos
    e = generate(m, p, 30, seed=7, eos_token_id=eos, **kw)
    k = int(np.argmax(e[0, 3:] == eos))
    assert (e[0, 3 + k:] == eos).all()


@pytest.mark.gpu
def test_static_engine_matches_transformers_generate(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import cupy
    m = _peaked(cupy)
    m.save_pretrained(tmp_path / "hf", dtype=ck.bfloat16)
    ref = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.bfloat16).cuda()
    prompt = np.array([[5, 17, 200, 3, 9, 44, 120]])
    with torch.no_grad():
        theirs = ref.generate(torch.from_numpy(prompt).cuda(), max_new_tokens=32, do_sample=False,
                              pad_token_id=0).cpu().numpy()
    mine = ck.from_pretrained(tmp_path / "hf", xp=cupy, dtype=ck.bfloat16)
    got = generate(mine, prompt, 32, temperature=0)
    _assert_greedy_equal(mine, 7, got, theirs)


# ------------------------------------------------------------------ the fused decode step (nn.decode)
def _decode_logits(m, xp, prompt, steps, fast):
    """Prefill ``prompt`` into a static cache, then ``steps`` greedy decode steps as the static engine runs them;
    returns the logits of every decode step [steps, B, V] (fp32, host) and the tokens."""
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
            pos = xp.full((B, 1), T + s, dtype=np.int32)
            lg = m(ids, position_ids=pos, kv_cache=cache).data
            out.append(lg[:, -1].astype(np.float32))
    host = (lambda a: a.get()) if xp is not np else (lambda a: a)
    return np.stack([host(o) for o in out]), np.concatenate([host(t) for t in toks], 1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fused_decode_step_equals_the_generic_forward_numpy(family, monkeypatch):
    """On the NumPy references (every op's reference path): the fused per-block decode (packed q/k/v and gate/up
    GEMVs with the norms as prologues, rope + cache write in one op, residual adds as GEMV epilogues) gives the
    generic forward's logits within bf16 rounding and the same greedy tokens; the packed parameters are views of
    one buffer holding the same values, so the generic forward after it is unchanged."""
    monkeypatch.setattr(ck.settings, "decode_max_rows", 8)  # (the fused step is correct up to 8 rows; the engine's
    m = _peaked(np, family)                          # policy takes it at batch 1, where it is faster)
    before = {n: p.data.astype(np.float32).copy() for n, p in m.named_parameters()}
    prompt = np.random.default_rng(3).integers(0, 301, size=(3, 6))
    fast, tf = _decode_logits(m, np, prompt, 5, True)
    assert m.__dict__.get("_fast_decode_checked") is True  # the fused path was taken
    for n, p in m.named_parameters():
        np.testing.assert_array_equal(p.data.astype(np.float32), before[n], err_msg=n)
    slow, ts = _decode_logits(m, np, prompt, 5, False)
    np.testing.assert_array_equal(tf, ts)
    scale = np.abs(slow).max()
    np.testing.assert_allclose(fast, slow, atol=0.02 * scale, rtol=0)
    att = m.model.layers[0].self_attn if family == "llama" else m.transformer.h[0].attn
    assert "qkv" in att.__dict__["_decode_packed"]
    W = att.__dict__["_decode_packed"]["qkv"][0]
    datas = [p.data for p in att.parameters()]
    del att.__dict__["_decode_packed"]  # packing again finds the parameters already one after another: no copy
    lins = [att.c_attn] if family == "gpt2" else [att.q_proj, att.k_proj, att.v_proj]
    W2, _ = ck.nn.decode.packed(att, "qkv", lins)
    assert np.shares_memory(W, W2) and W2.shape == W.shape
    assert all(p.data is d for p, d in zip(att.parameters(), datas))
    if family == "llama":  # q/k/v now live one after another in one [(H + 2 Hkv) D, hidden] buffer
        q, k = att.q_proj.weight.data, att.k_proj.weight.data
        assert k.__array_interface__["data"][0] == q.__array_interface__["data"][0] + q.nbytes


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gpu_fused_decode_step_equals_the_generic_forward(family, monkeypatch):
    """The same on the kernels (ck.gemv, ck.rope_kv_write, ck.decode_attention), batch 1, 3 and 8 (B > 8 takes
    the generic forward), and the static engine's greedy tokens with the fused step equal those without it."""
    import cupy
    monkeypatch.setattr(ck.settings, "decode_max_rows", 8)
    m = _peaked(cupy, family)
    for B in (1, 3, 8):
        prompt = np.random.default_rng(B).integers(0, 301, size=(B, 9))
        fast, tf = _decode_logits(m, cupy, prompt, 6, True)
        slow, ts = _decode_logits(m, cupy, prompt, 6, False)
        scale = np.abs(slow).max()
        np.testing.assert_allclose(fast, slow, atol=0.02 * scale, rtol=0, err_msg=f"B={B}")
        _assert_greedy_equal(m, 0, tf, ts)
    prompt = np.array([[5, 17, 200, 3, 9, 44, 120], [1, 2, 3, 4, 5, 6, 7]])
    m.fast_decode = True
    got = generate(m, prompt, 30, temperature=0)
    m.fast_decode = False
    want = generate(m, prompt, 30, temperature=0)
    m.fast_decode = True
    _assert_greedy_equal(m, 7, got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gpu_fused_decode_is_bit_identical_with_and_without_pdl(family, monkeypatch):
    """The fused step's kernels under programmatic dependent launch (each starts its weight loads while the
    previous kernel finishes) give the very logits of plain launches, eagerly and in the captured engine."""
    import cupy
    from cukernels.ops import _launch

    m = _peaked(cupy, family)
    prompt = np.random.default_rng(11).integers(0, 301, size=(1, 9))
    on, t_on = _decode_logits(m, cupy, prompt, 6, True)
    got = generate(m, prompt, 24, temperature=0)
    monkeypatch.setattr(ck.settings, "pdl", False)
    off, t_off = _decode_logits(m, cupy, prompt, 6, True)
    want = generate(m, prompt, 24, temperature=0)
    np.testing.assert_array_equal(on, off)
    np.testing.assert_array_equal(t_on, t_off)
    np.testing.assert_array_equal(got, want)
