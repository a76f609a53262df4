"""The model layer above the kernels: attention_mask / position_ids with Hugging Face's meanings, ids in any
layout a user holds, config validation, ck.from_pretrained dispatch, inference dtype, and (GPU) the same logits
as transformers with a padding mask through both attention paths."""
import json
import sys

import numpy as np
import pytest

import cukernels as ck


def _config(**kw):
    d = dict(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
    d.update(kw)
    return ck.LlamaConfig(**d)


def _logits(model, ids, **kw):
    with ck.no_grad():
        return model(ids, **kw).data


def _left_padded(rng, lens, T, V):
    """A left-padded batch: (ids [B, T], mask [B, T], position_ids [B, T], the sequences)."""
    seqs = [rng.integers(0, V, n).astype(np.int32) for n in lens]
    ids = np.zeros((len(lens), T), np.int32)
    mask = np.zeros((len(lens), T), np.int32)
    for b, s in enumerate(seqs):
        ids[b, T - len(s):] = s
        mask[b, T - len(s):] = 1
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int32)
    return ids, mask, pos, seqs


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ref", "composite"])
def test_left_padded_batch_equals_each_sequence_alone(rng, fused):
    m = ck.Llama(_config(), seed=3, fused=fused)
    ids, mask, pos, seqs = _left_padded(rng, [9, 4, 1], 9, 53)
    got = _logits(m, ids, attention_mask=mask, position_ids=pos)
    assert np.isfinite(got).all()  # padded query rows see no key: zeros, never NaN
    for b, s in enumerate(seqs):
        alone = _logits(m, s[None])
        np.testing.assert_allclose(got[b, -len(s):], alone[0], rtol=1e-5, atol=1e-5, err_msg=f"row {b}")


def test_right_padding_and_loss_ignore_padded_targets(rng):
    m = ck.Llama(_config(), seed=4, fused=True)
    T = 7
    seqs = [rng.integers(0, 53, n).astype(np.int32) for n in (7, 3)]
    ids = np.zeros((2, T), np.int32)
    mask = np.zeros((2, T), np.int32)
    tgt = np.full((2, T), -100, np.int32)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
        mask[b, :len(s)] = 1
        tgt[b, :len(s) - 1] = s[1:]
    got = _logits(m, ids, attention_mask=mask)
    for b, s in enumerate(seqs):
        np.testing.assert_allclose(got[b, :len(s)], _logits(m, s[None])[0], rtol=1e-5, atol=1e-5)
    # the loss over the padded batch = the token-weighted mean of the two sequences' losses
    loss = m(ids, tgt, attention_mask=mask)
    loss.backward()
    per = [float(m(s[None, :-1], s[None, 1:]).data) for s in seqs]
    want = (per[0] * 6 + per[1] * 2) / 8
    assert abs(float(loss.data) - want) < 1e-5
    assert all(np.isfinite(p.grad).all() for p in m.parameters())


def test_ids_in_any_layout_and_dtype(rng):
    m = ck.Llama(_config(), seed=1)
    batch = rng.integers(0, 53, (2, 10)).astype(np.int64)
    want = _logits(m, np.ascontiguousarray(batch[:, :-1]).astype(np.int32))
    np.testing.assert_array_equal(_logits(m, batch[:, :-1]), want)           # an int64 slice
    np.testing.assert_array_equal(_logits(m, batch[:, :-1].tolist()), want)  # a Python list
    np.testing.assert_array_equal(_logits(m, ck.tensor(batch[:, :-1])), want)
    np.testing.assert_allclose(_logits(m, batch[0, :-1]), want[:1], rtol=1e-5, atol=1e-5)  # 1-D: batch of one
    loss = m(batch[:, :-1], batch[:, 1:])
    assert np.isfinite(float(loss.data))


@pytest.mark.parametrize("bad,err,match", [
    (np.zeros((2, 0), np.int32), ValueError, "ids: expected a non-empty"),
    (np.zeros((1, 65), np.int32), ValueError, "ids: 65 positions exceed max_position_embeddings = 64"),
    (np.zeros((1, 3), np.float32), TypeError, "ids: expected integer ids"),
    (np.zeros((1, 2, 3), np.int32), ValueError, r"ids: expected \[batch, seq\]"),
    (np.full((1, 3), 53, np.int32), ValueError, r"ids: token ids must be < vocab_size=53; got max 53"),
    (np.array([[2**32 + 3]], np.int64), ValueError, r"ids: token ids must be < vocab_size=53; got max 4294967299"),
    (np.array([[2**63 + 3]], np.uint64), ValueError, r"ids: token ids must be < vocab_size=53; got max 9223372036854775811"),
    (np.array([[-1]], np.int64), ValueError, r"ids: token ids must be >= 0; got min -1"),
    ([[1.7, 2.0]], TypeError, r"ids: expected integer ids; got dtype float64 \(float ids are not truncated"),
    ("abc", TypeError, "ids: expected integer"),
])
def test_bad_ids_are_one_line_errors(bad, err, match):
    m = ck.Llama(_config())
    with pytest.raises(err, match=match):
        m(bad)


def test_bad_mask_and_positions_shapes():
    m = ck.Llama(_config())
    ids = np.zeros((2, 5), np.int32)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(2, 5\)"):
        m(ids, attention_mask=np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"position_ids: expected shape \(5,\) or \(2, 5\)"):
        m(ids, position_ids=np.arange(6))
    with pytest.raises(ValueError, match=r"targets: expected the shape of ids"):
        m(ids, np.zeros((2, 4), np.int32))


@pytest.mark.parametrize("kw,err,match", [
    (dict(hidden_size=15, num_attention_heads=2), ValueError, "hidden_size \\(15\\) must be a multiple"),
    (dict(vocab_size=0), ValueError, "vocab_size: expected an integer >= 1; got 0"),
    (dict(intermediate_size=0), ValueError, "intermediate_size"),
    (dict(num_hidden_layers=-1), ValueError, "num_hidden_layers"),
    (dict(hidden_size="16"), TypeError, "hidden_size: expected an integer; got str"),
    (dict(num_attention_heads=4, num_key_value_heads=3), ValueError, "multiple of num_key_value_heads"),
    (dict(rms_norm_eps=0.0), ValueError, "rms_norm_eps"),
    (dict(tie_word_embeddings="yes"), TypeError, "tie_word_embeddings"),
])
def test_config_validated_at_construction(kw, err, match):
    with pytest.raises(err, match=match):
        _config(**kw)


def test_config_from_dict_names_unknown_keys():
    with pytest.raises(ValueError, match="unknown key 'num_layers' \\(did you mean 'num_hidden_layers'\\?\\)"):
        ck.LlamaConfig.from_dict(dict(vocab_size=10, num_layers=2))


def test_from_pretrained_dispatches_on_model_type_and_bf16_holds_no_fp32(tmp_path, rng):
    src = ck.Llama(_config(tie_word_embeddings=True), seed=2, fused=False)
    src.save_pretrained(tmp_path / "hf")
    m = ck.from_pretrained(tmp_path / "hf", fused=False)
    assert isinstance(m, ck.Llama)
    ids = rng.integers(0, 53, (2, 6)).astype(np.int32)
    np.testing.assert_array_equal(_logits(m, ids), _logits(src, ids))
    mb = ck.from_pretrained(tmp_path / "hf", dtype=ck.bfloat16)
    assert {p.dtype for p in mb.parameters()} == {np.dtype(ck.bfloat16)}
    cj = tmp_path / "hf" / "config.json"
    cj.write_text(json.dumps(dict(json.loads(cj.read_text()), model_type="mamba")))
    with pytest.raises(ck.io.HFFormatError, match="model_type 'mamba' is not supported; supported: \\['gpt2', 'llama', "
                                                       "'mistral', 'qwen2', 'qwen3'\\]"):
        ck.from_pretrained(tmp_path / "hf")


def test_model_to_dtype_and_repr():
    m = ck.Llama(_config())
    assert "Llama(params=" in repr(m) and "(q_proj): Linear(32, 32, bias=False)" in repr(m)
    m.to(ck.bfloat16)
    assert {p.dtype for p in m.parameters()} == {np.dtype(ck.bfloat16)}
    with pytest.raises(TypeError, match="to: parameters are float32 or bfloat16"):
        m.to(np.int32)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("path", ["materialised-fp32", "materialised-bf16", "flash-bf16"])
def test_padded_batch_matches_transformers(tmp_path, rng, path):
    """Left padding + attention_mask + position_ids: our logits on the real positions equal
    transformers.LlamaForCausalLM's with the same mask (fp32: 1e-4; bf16 autocast: bf16 tolerance), through the
    materialised attention (GEMM + attn_softmax) and the fused flash kernel (key-padding mask in the kernel)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import cupy as cp

    cfg = _config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
                  max_position_embeddings=128, vocab_size=97, initializer_range=0.05)  # head_dim 64: flash's
    src = ck.Llama(cfg, seed=5, fused=False)
    src.save_pretrained(tmp_path / "hf")
    ref = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    ids, mask, pos, seqs = _left_padded(rng, [40, 17, 1, 33], 40, 97)
    with torch.no_grad():
        theirs = ref(torch.from_numpy(ids.astype(np.int64)), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                     position_ids=torch.from_numpy(pos.astype(np.int64))).logits.numpy()
    m = ck.from_pretrained(tmp_path / "hf", xp=cp)
    for mod in m.modules():
        if isinstance(mod, ck.nn.Attention):
            mod.flash = path.startswith("flash")
    bf16 = path.endswith("bf16")
    with ck.autocast(ck.bfloat16, enabled=bf16):
        got = _logits(m, cp.asarray(ids), attention_mask=cp.asarray(mask), position_ids=cp.asarray(pos))
    got = cp.asnumpy(got.astype(cp.float32))
    assert np.isfinite(got).all()
    for b, s in enumerate(seqs):
        g, t = got[b, -len(s):], theirs[b, -len(s):]
        if not bf16:
            np.testing.assert_allclose(g, t, atol=1e-4, rtol=0, err_msg=f"row {b}")
            continue
        # bf16 activations through 2 layers vs an fp32 reference: errors scale with the logits (~2^-8 per
        # rounding); a wrong mask or wrong positions would be O(1) relative, far outside this.
        scale = np.abs(t).max()
        assert np.abs(g - t).max() < 0.06 * scale and np.abs(g - t).mean() < 0.01 * scale, (b, np.abs(g - t).max())


# ------------------------------------------------------------------ issue 17: the fused head + loss
from cukernels.functional.cross_entropy import CrossEntropyF  # noqa: E402
from cukernels.functional.linear_cross_entropy import LinearCrossEntropyF  # noqa: E402

HEAD_MODELS = ["llama-untied", "llama-tied", "gpt2-tied", "gpt2-untied"]


def _head_model(which, xp=np, seed=0, V=None):
    """Tiny models whose vocabulary is not a multiple of 64 (on CuPy the fused path pads the head weight)."""
    family, tie = which.split("-")
    if family == "llama":
        c = _config(tie_word_embeddings=tie == "tied", vocab_size=V or 53)
        return ck.Llama(c, xp=xp, seed=seed)
    c = ck.GPT2Config(vocab_size=V or 67, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2, tie_word_embeddings=tie == "tied")
    return ck.GPT2(c, xp=xp, seed=seed)


def _batch(rng, model, B=3, T=9, ignore_frac=0.25):
    V = model.config.vocab_size
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    tgt = rng.integers(0, V, (B, T)).astype(np.int32)
    tgt[rng.random((B, T)) < ignore_frac] = -100
    tgt[0, 0] = -100  # always some ignored targets
    return ids, tgt


def _loss_and_grads(model, ids, tgt, fused_head, scale=None, expect=None):
    """One forward + backward; returns (loss, {name: grad copy}). ``expect``: the Function the loss must come from."""
    model.fused_head_loss = fused_head
    loss = model(ids, tgt)
    if expect is not None:
        assert loss._node[0] is expect, f"the loss came from {loss._node[0].__name__}, expected {expect.__name__}"
    (loss if scale is None else loss * scale).backward()
    grads = {n: np.array(p.grad, dtype=np.float64) for n, p in model.named_parameters() if p.grad is not None}
    return float(np.asarray(loss.data)), grads


def _assert_grads_equal(got, ref, rtol=1e-5, atol=1e-6, what=""):
    assert set(got) == set(ref), f"{what}: gradients of {sorted(set(got) ^ set(ref))} only on one side"
    for n in ref:
        np.testing.assert_allclose(got[n], ref[n], rtol=rtol, atol=atol * max(1.0, np.abs(ref[n]).max()),
                                   err_msg=f"{what}: {n}")


@pytest.mark.parametrize("which", HEAD_MODELS)
def test_fused_head_loss_equals_logits_path(rng, which):
    """NumPy models, no optimizer (.grad None at first): loss and every gradient, the tied table's included
    (head dW from the forward + the embedding's rows from the backward), equal the logits + cross-entropy path."""
    ids, tgt = _batch(rng, _head_model(which))
    ref = _loss_and_grads(_head_model(which), ids, tgt, False, expect=CrossEntropyF)
    got = _loss_and_grads(_head_model(which), ids, tgt, True, expect=LinearCrossEntropyF)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    _assert_grads_equal(got[1], ref[1], what=which)


@pytest.mark.parametrize("which", HEAD_MODELS)
def test_fused_head_loss_with_lazy_zero_and_accumulation(rng, which):
    """AdamW's flat gradient views with garbage in them and zero_grad(lazy=True): the head's dW written during the
    forward overwrites (beta = 0) and clears grad_stale, so a tied embedding then adds; a second micro-batch adds
    to both (accumulate = True)."""
    (ids1, tgt1), (ids2, tgt2) = _batch(rng, _head_model(which)), _batch(rng, _head_model(which))
    ref_model = _head_model(which)
    _, r1 = _loss_and_grads(ref_model, ids1, tgt1, False)
    _, r12 = _loss_and_grads(ref_model, ids2, tgt2, False)  # .grad accumulates: micro-batch 1 + 2
    m = _head_model(which)
    opt = ck.optim.AdamW(m.parameters(), lr=0.0, shadow_dtype=None)
    for p in m.parameters():
        p.grad[...] = 7.0  # stale values a lazy zero must never add
    opt.zero_grad(lazy=True)
    _, g1 = _loss_and_grads(m, ids1, tgt1, True, expect=LinearCrossEntropyF)
    _assert_grads_equal(g1, r1, what=f"{which} first micro-batch")
    _, g12 = _loss_and_grads(m, ids2, tgt2, True, expect=LinearCrossEntropyF)
    _assert_grads_equal(g12, r12, what=f"{which} accumulated")


@pytest.mark.parametrize("which", ["llama-untied", "gpt2-tied"])
def test_fused_head_loss_writes_a_bf16_grad_directly(rng, which, monkeypatch):
    """AdamW(grad_dtype=bf16), lazy zero: the head's dW (one chunk) goes straight into the bf16 .grad, the fp32
    dW rounded once -- bit-identical to rounding the fp32 path's head gradient when untied; a tied table then adds
    its rows (one more rounding). A second micro-batch falls back to an fp32 dW added by the autograd."""
    ids, tgt = _batch(rng, _head_model(which))
    _, ref = _loss_and_grads(_head_model(which), ids, tgt, False)
    m = _head_model(which)
    opt = ck.optim.AdamW(m.parameters(), lr=0.0, shadow_dtype=None, grad_dtype=ck.bfloat16)
    head = m.output_weight()[1]
    buf = head.grad
    buf[...] = np.nan  # stale garbage a lazy zero must never read
    opt.zero_grad(lazy=True)
    lce_f = sys.modules["cukernels.functional.linear_cross_entropy"]  # (F.linear_cross_entropy: the function)
    seen, lce = [], lce_f._lce
    monkeypatch.setattr(lce_f, "_lce", lambda *a, grad_weight=None, **k: (seen.append(grad_weight),
                                                                          lce(*a, grad_weight=grad_weight, **k))[1])
    _, got = _loss_and_grads(m, ids, tgt, True, expect=LinearCrossEntropyF)
    assert head.grad is buf and buf.dtype == np.dtype(ck.bfloat16) and seen[-1] is buf
    if which == "llama-untied":
        want = ref[head.name].astype(np.float32).astype(ck.bfloat16).astype(np.float64)
        np.testing.assert_array_equal(got[head.name], want)
    _assert_grads_equal(got, ref, rtol=2**-7, atol=2**-8, what=which)
    _, got2 = _loss_and_grads(m, ids, tgt, True, expect=LinearCrossEntropyF)  # .grad not stale: adds
    assert seen[-1] is None  # a fresh fp32 dW
    np.testing.assert_allclose(got2[head.name], 2 * ref[head.name], rtol=2**-6,
                               atol=2**-7 * np.abs(ref[head.name]).max())


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_fused_head_loss_chunks_follow_head_workspace(rng, monkeypatch, grad_dtype):
    """The model's head picks its chunk rows from ck.settings.head_workspace (here shrunk, with 4-row quanta, so tiny
    models take several chunks): fp32 .grad -> chunk_rows_for(N, V, s, head_workspace); a stale bf16 .grad -> one
    chunk straight into .grad while the logits fit head_workspace + the V x H x 4 bytes of an fp32 dW, else the
    same chunks into a fresh fp32 dW. Loss and gradients equal the logits path's either way."""
    lce_f = sys.modules["cukernels.functional.linear_cross_entropy"]  # (F.linear_cross_entropy: the function)
    from cukernels.ops import linear_cross_entropy as lce_mod
    which = "llama-untied"
    V, H = _config().vocab_size, _config().hidden_size
    monkeypatch.setattr(lce_mod, "ROW_QUANTUM", 4)
    monkeypatch.setattr(ck.settings, "head_workspace", 8 * V * 4)  # 8 fp32 rows of logits a chunk
    seen, lce = [], lce_f._lce
    monkeypatch.setattr(lce_f, "_lce", lambda *a, **k: (seen.append(k), lce(*a, **k))[1])
    bf16 = grad_dtype == "bfloat16"
    for B, one_chunk in ((3, True), (6, False)):  # 27 rows: 27 V 4 <= 8 V 4 + V H 4; 54 rows: above it
        m = _head_model(which)
        ids, tgt = _batch(rng, m, B=B)
        N = ids.size
        _, ref = _loss_and_grads(_head_model(which), ids, tgt, False)
        opt = ck.optim.AdamW(m.parameters(), lr=0.0, shadow_dtype=None,
                             grad_dtype=ck.bfloat16 if bf16 else np.float32)
        buf = m.output_weight()[1].grad
        opt.zero_grad(lazy=True)
        _, got = _loss_and_grads(m, ids, tgt, True, expect=LinearCrossEntropyF)
        k = seen[-1]
        if bf16 and one_chunk:
            assert k["chunk_rows"] == N and k["grad_weight"] is buf
        else:
            assert k["chunk_rows"] == 8 and -(-N // 8) >= 4  # several chunks of the shrunk workspace
            assert k["grad_weight"] is (None if bf16 else buf)
        tol = dict(rtol=2**-7, atol=2**-8) if bf16 else {}
        _assert_grads_equal(got, ref, what=f"{grad_dtype}, {N} rows", **tol)


@pytest.mark.parametrize("which", ["llama-tied", "gpt2-untied"])
def test_fused_head_loss_scaled_backward(rng, which):
    """loss * s: dx and dW scaled when dW is the buffer's first write of the step (or a fresh array); on top of an
    earlier gradient dW cannot be rescaled: RuntimeError naming the fix."""
    ids, tgt = _batch(rng, _head_model(which))
    _, ref = _loss_and_grads(_head_model(which), ids, tgt, False, scale=0.25)
    _, got = _loss_and_grads(_head_model(which), ids, tgt, True, scale=0.25)  # fresh dW, returned scaled
    _assert_grads_equal(got, ref, what="fresh dW")
    m = _head_model(which)
    opt = ck.optim.AdamW(m.parameters(), lr=0.0, shadow_dtype=None)
    opt.zero_grad(lazy=True)
    _, got = _loss_and_grads(m, ids, tgt, True, scale=0.25)  # dW overwrote .grad: rescaled in place
    _assert_grads_equal(got, ref, what="lazily zeroed .grad")
    m.fused_head_loss = True
    with pytest.raises(RuntimeError, match="unscaled loss"):
        (m(ids, tgt) * 0.25).backward()  # .grad already holds a gradient: dW was added to it


@pytest.mark.parametrize("which", ["llama-untied", "gpt2-tied"])
def test_fused_head_loss_eval_and_return_logits(rng, which):
    """Under no_grad the fused path computes the loss only (no gradient written anywhere); return_logits=True
    takes the logits path and returns (loss, logits) with the logits of model(ids)."""
    m = _head_model(which)
    ids, tgt = _batch(rng, m)
    m.fused_head_loss = False
    with ck.no_grad():
        ref = float(np.asarray(m(ids, tgt).data))
    m.fused_head_loss = True
    with ck.no_grad():
        got = m(ids, tgt)
    np.testing.assert_allclose(float(np.asarray(got.data)), ref, rtol=1e-6)
    assert all(p.grad is None for p in m.parameters())
    loss, logits = m(ids, tgt, return_logits=True)
    np.testing.assert_allclose(float(np.asarray(loss.data)), ref, rtol=1e-6)
    np.testing.assert_allclose(logits.data, _logits(m, ids), rtol=1e-6, atol=1e-6)
    assert loss._node[0] is CrossEntropyF


def test_fused_head_loss_not_used_when_unfused_or_disabled(rng):
    m = _head_model("llama-untied")
    ids, tgt = _batch(rng, m)
    m.set_fused(False)
    assert m(ids, tgt)._node[0] is not LinearCrossEntropyF  # the composite path
    m.set_fused(True)
    m.lm_head.fused = False  # the head Linear composite (per-use cast on the tape): logits path
    assert m(ids, tgt)._node[0] is CrossEntropyF
    m.lm_head.fused = True
    assert m(ids, tgt)._node[0] is LinearCrossEntropyF


def _grad_rel_err(got, ref):
    worst = 0.0
    for n in ref:
        d = np.linalg.norm(got[n] - ref[n]) / max(np.linalg.norm(ref[n]), 1e-30)
        worst = max(worst, d)
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("which", HEAD_MODELS + ["llama-untied-v128"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_gpu_fused_head_loss_equals_logits_path(rng, which, precision):
    """CuPy, AdamW flat buffers, lazy zero: loss and every gradient of the fused head + loss equal the logits path
    (vocabularies 53 / 67: the padded-weight path with num_classes; 128: unpadded). bf16 autocast reads the
    shadows; the two paths differ only in GEMM summation order, which bf16 activations carry back through the
    layers (tolerance on each gradient's relative L2 error)."""
    import cupy as cp

    V = 128 if which.endswith("v128") else None
    which = which.replace("-v128", "")
    ids, tgt = _batch(rng, _head_model(which, V=V), B=4, T=16)
    out = {}
    for fused_head in (False, True):
        m = _head_model(which, xp=cp, V=V)
        bf16 = precision != "fp32"
        opt = ck.optim.AdamW(m.parameters(), lr=0.0, shadow_dtype=ck.bfloat16 if bf16 else None)
        if bf16:
            ck.amp.attach_shadows(m.parameters(), opt)
        for p in m.parameters():
            p.grad.fill(np.nan)  # stale: a lazily zeroed step must overwrite, never read them
        opt.zero_grad(lazy=True)
        m.fused_head_loss = fused_head
        with ck.autocast(ck.bfloat16, enabled=bf16):
            loss = m(cp.asarray(ids), cp.asarray(tgt))
        assert loss._node[0] is (LinearCrossEntropyF if fused_head else CrossEntropyF)
        loss.backward()
        opt.flush_stale()
        out[fused_head] = (float(loss.data), {n: cp.asnumpy(p.grad).astype(np.float64)
                                              for n, p in m.named_parameters()})
    (lr, gr), (lf, gf) = out[False], out[True]
    assert all(np.isfinite(g).all() for g in gf.values())
    np.testing.assert_allclose(lf, lr, rtol=1e-5 if precision == "fp32" else 2e-3)
    err = _grad_rel_err(gf, gr)
    assert err < (1e-4 if precision == "fp32" else 3e-2), f"worst relative L2 gradient error {err:.2e}"
