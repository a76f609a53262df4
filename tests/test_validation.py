"""Issue 36's silent results and unclear errors, one test each: every call here was accepted with a wrong or
undefined result, or raised something unclear, before the fix (NumPy path; the GPU behaviour is in comments)."""
import json

import numpy as np
import pytest

import cukernels as ck
from cukernels import functional as F
from cukernels import nn, optim
from cukernels.io import checkpoint as C

F32 = np.float32


def tiny_llama(**kw):
    return ck.Llama(ck.LlamaConfig(**dict(dict(vocab_size=16, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2,
                                               max_position_embeddings=32), **kw)))


# ------------------------------------------------------------------------------------------ token ids
@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32])
def test_wide_token_ids_do_not_wrap_around(dtype):
    m = tiny_llama()
    big = np.array([[2**32 + 3 if np.iinfo(dtype).max >= 2**32 + 3 else 2**31 + 3]], dtype)
    with pytest.raises(ValueError, match=r"^ids: token ids must be < vocab_size=16; got max \d+"):
        m(big)  # (it gave exactly the logits of id 3)
    with pytest.raises(ValueError, match="^ids: token ids must be < vocab_size=16"):
        ck.generate(m, big, 1)
    assert m(np.array([[3]], dtype)).shape == (1, 1, 16)  # in range: still fine in any integer dtype


def test_token_ids_int32_replaces_wide_out_of_range_values_without_a_host_read():
    """The device rule (on NumPy stand-ins for the CuPy branch's arithmetic): values outside [low, high) become the
    sentinel before the cast, so 2**32 + 3 can never alias 3."""
    from cukernels import _backend as B

    a = np.array([3, 2**32 + 3, -1, 15], np.int64)
    with pytest.raises(ValueError, match="max 4294967299"):
        B.token_ids_int32("ids", a, np, vocab_size=16)
    ok = (a < 16) & (a >= 0)
    assert np.where(ok, a, 16).astype(np.int32).tolist() == [3, 16, 16, 15]


def test_float_ids_and_targets_are_not_truncated():
    m = tiny_llama()
    with pytest.raises(TypeError, match="^ids: expected integer ids; got dtype float32"):
        m(np.array([[1.7]], F32))
    with pytest.raises(TypeError, match="^targets: expected integer ids"):
        m(np.array([[1]]), np.array([[1.5]]))
    with pytest.raises(TypeError, match="^ids: expected integer token ids"):
        ck.generate(m, [1.5, 2.0], 1)


def test_negative_position_ids_refused():
    m = tiny_llama()
    with pytest.raises(ValueError, match="^position_ids: token ids must be >= 0"):
        m(np.array([[1, 2]]), position_ids=np.array([0, -1]))  # (NumPy indexed the rope table from the end)


# ------------------------------------------------------------------------------------------ autograd
def test_nonscalar_backward_needs_a_gradient():
    t = ck.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        (t * 2).backward()  # (it seeded ones)
    (t * 2).backward(np.ones(2, F32))
    np.testing.assert_array_equal(t.grad, [2, 2])
    with pytest.raises(ValueError, match=r"^grad: expected shape \(2,\)"):
        (t * 2).backward(np.ones(3, F32))


def test_pow_differentiates_a_tensor_exponent():
    x = ck.tensor(np.array([1.5, 2.0, 3.0]), requires_grad=True)  # float64: exact
    u = ck.tensor(np.array([2.0, 0.5, -1.0]), requires_grad=True)
    (x ** u).sum().backward()
    np.testing.assert_allclose(x.grad, u.data * x.data ** (u.data - 1))
    np.testing.assert_allclose(u.grad, x.data ** u.data * np.log(x.data))  # (u got no gradient)
    v = ck.tensor(np.array([0.5, 1.0]), requires_grad=True)
    (2.0 ** v).sum().backward()  # (a TypeError before)
    np.testing.assert_allclose(v.grad, 2.0 ** v.data * np.log(2.0))


def test_composite_cross_entropy_validates_as_the_fused_one():
    x = ck.tensor(np.random.default_rng(0).standard_normal((3, 5)).astype(F32), requires_grad=True)
    t = np.array([0, 4, -100], np.int32)
    for fused in (True, False):
        with pytest.raises(ValueError, match="^reduction: expected one of"):
            F.cross_entropy(x, t, reduction="bogus", fused=fused)
        with pytest.raises(ValueError, match="^label_smoothing: expected a finite number in"):
            F.cross_entropy(x, t, label_smoothing=2, fused=fused)
        with pytest.raises(ValueError, match="^targets: value 7 is out of range"):
            F.cross_entropy(x, np.array([0, 7, 1], np.int32), fused=fused)
    for red in ("mean", "sum", "none"):  # 'none' was a mean on the composite path
        a = F.cross_entropy(x, t, reduction=red, fused=True).data
        b = F.cross_entropy(x, t, reduction=red, fused=False).data
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ ops
def test_linear_cross_entropy_refuses_a_nan_dloss():
    x, w, t = np.ones((2, 4), F32), np.ones((3, 4), F32), np.array([0, 1], np.int32)
    with pytest.raises(ValueError, match="^dloss: expected a finite number"):
        ck.linear_cross_entropy(x, w, t, dloss=float("nan"))
    with pytest.raises(ValueError, match="^dloss: expected finite values"):
        ck.linear_cross_entropy(x, w, t, dloss=np.array(np.nan, F32))
    with pytest.raises(ValueError, match="^dloss: expected finite values"):
        ck.cross_entropy_fused(np.ones((2, 3), F32), t, dloss=np.array(np.inf, F32))


def test_flash_attention_backward_refuses_a_nan_lse():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 2, 32)).astype(ck.bfloat16) for _ in range(3))
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    lse[0, 1, 2] = np.nan
    with pytest.raises(ValueError, match=r"^lse: expected the forward's log-sum-exp .* got nan at \(0, 1, 2\)"):
        ck.flash_attention_backward(q, q, k, v, o, lse)  # (it returned finite gradients)


def test_kv_cache_write_refuses_a_fractional_length():
    cache = np.zeros((1, 8, 2, 4), F32)
    with pytest.raises(TypeError, match="^cache_len: expected an int or a 0-d int32 array; got float"):
        ck.kv_cache_write(np.ones((1, 1, 2, 4), F32), cache, 3.7)  # (truncated to 3)
    with pytest.raises(ValueError, match="^cache_len: expected 0 <= cache_len <= max_len"):
        ck.kv_cache_write(np.ones((1, 1, 2, 4), F32), cache, 9)


def test_adam_step_rows_refuses_rows_it_would_write_wrongly():
    def call(rows, count):
        p = np.zeros((4, 3), F32)
        ck.adam_step_rows(p, np.ones((4, 3), F32), np.zeros_like(p), np.zeros_like(p), np.array(rows, np.int32),
                          np.array(count, np.int32), lr=1e-3, step=1)
        return p

    with pytest.raises(ValueError, match=r"^rows: row 2 is listed 2 times"):
        call([2, 0, 2], 3)
    with pytest.raises(ValueError, match=r"^rows: rows\[1\] = 4 is outside \[0, 4\)"):
        call([0, 4], 2)
    with pytest.raises(ValueError, match=r"^row_count: expected a count in \[0, 2\]"):
        call([0, 1], 3)
    p = call([2, 0, 2], 2)  # the duplicate past the count is not listed
    assert (p[[0, 2]] != 0).all() and not p[[1, 3]].any()


def test_huge_sizes_are_refused_before_allocation():
    with pytest.raises(ValueError, match="^seq_len: the rope tables' float64 work of shape .* more than the"):
        ck.rope_cache(2**30, 4096, xp=np)
    with pytest.raises(ValueError, match="^seq_len: expected an integer <= 2147483647"):
        ck.rope_cache(2**40, 8, xp=np)
    with pytest.raises(ValueError, match="^vocab_size: expected an integer <= 2147483647"):
        ck.SparseRowGrad(2**45, 8, xp=np)
    with pytest.raises(ValueError, match="^vocab_size: the .* gradient buffer of shape .* more than the"):
        ck.SparseRowGrad(2**30, 2**20, xp=np)


@pytest.mark.parametrize("call, name", [
    (lambda: ck.rms_norm(None, np.ones(4, F32)), "x"),
    (lambda: ck.adam_step_rows(None, *([np.zeros((2, 2), F32)] * 3), np.zeros(1, np.int32),
                               np.array(0, np.int32), lr=1e-3, step=1), "param"),
    (lambda: ck.kv_cache_write(np.zeros((1, 1, 4), F32), None, 1), "cache"),
    (lambda: ck.softmax(None), "x"),
    (lambda: ck.swiglu([1.0], [2.0]), "gate"),
])
def test_none_or_a_list_for_an_array_names_the_argument(call, name):
    with pytest.raises(TypeError, match=rf"^{name}: expected a numpy\.ndarray or cupy\.ndarray"):
        call()  # (an AttributeError from .dtype, or "no array arguments given")


# ------------------------------------------------------------------------------------------ layers
@pytest.mark.parametrize("make, match", [
    (lambda: nn.Attention(10, 3), "^n_heads: hidden \\(10\\) must be a multiple of n_heads \\(3\\)"),
    (lambda: nn.Attention(8, 2, 0), "^n_kv_heads: expected an integer >= 1"),  # (ZeroDivisionError)
    (lambda: nn.Linear(4, 3, std=-1), "^std: expected a finite number >= 0"),
    (lambda: nn.Linear(0, 3), "^in_features: expected an integer >= 1"),
    (lambda: nn.Linear(4.0, 3), "^in_features: expected an integer"),
    (lambda: nn.Embedding(0, 4), "^num_embeddings: expected an integer >= 1"),
    (lambda: nn.SwiGLUMLP(4, 0), "^ffn: expected an integer >= 1"),
    (lambda: nn.RMSNorm(4, eps=0), "^eps: expected a finite number > 0"),  # (refused only at the first forward)
    (lambda: nn.RMSNorm(4, eps="1e-6"), "^eps: expected a real number"),
    (lambda: nn.Dropout(0.1, site="a"), "^site: expected an integer"),
    (lambda: nn.Dropout("0.1", site=1), "^p: expected a real number"),
])
def test_layer_constructors_refuse_bad_arguments(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


def test_linear_refuses_a_float64_input_beside_float32_weights():
    lin = nn.Linear(4, 3)
    with pytest.raises(TypeError, match=r"^x: expected float32 \(the layer's weight dtype\) or bfloat16; got float64"):
        lin(ck.Tensor(np.ones((2, 4))))  # (promoted silently to a float64 product)
    with pytest.raises(ValueError, match="^x: expected a last axis of 4 features"):
        lin(ck.Tensor(np.ones((2, 5), F32)))
    assert nn.Linear(4, 3, dtype=np.float64)(ck.Tensor(np.ones((2, 4)))).dtype == np.float64


def test_late_config_errors_are_raised_at_construction():
    with pytest.raises(ValueError, match=r"^LlamaConfig\.rope_scaling\['factor'\]: expected a finite number > 0"):
        ck.LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 0})
    with pytest.raises(ValueError, match=r"^LlamaConfig\.rope_scaling: rope_type 'yarn' is not supported"):
        ck.LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match=r"^LlamaConfig\.rms_norm_eps: expected a finite number"):
        ck.LlamaConfig(rms_norm_eps=float("nan"))
    with pytest.raises(ValueError, match="^lr: expected a finite number >= 0"):
        optim.AdamW([("w", np.zeros(4, F32))], lr=-1e-3)  # (refused only at step())


# ------------------------------------------------------------------------------------------ optimizers
def test_optimizer_arguments():
    params = [("w", np.zeros(4, F32))]
    with pytest.raises(TypeError, match="^betas: expected a pair"):
        optim.AdamW(params, betas=(0.9,))
    with pytest.raises(TypeError, match="^no_decay: expected parameter names"):
        optim.AdamW(params, no_decay=[np.zeros(2)])
    opt = optim.AdamW(params)
    with pytest.raises(ValueError, match="^state_dict: missing the key 'state'"):
        opt.load_state_dict({"step": 1, "lr": 1e-3})
    with pytest.raises(ValueError, match="^lr: expected a finite number >= 0"):
        opt.set_lr(-1.0)
    for bad, exc, match in [("100", TypeError, "^total_steps: expected an integer"),
                            (100.7, TypeError, "^total_steps: expected an integer")]:
        with pytest.raises(exc, match=match):
            optim.WarmupCosine(1e-3, total_steps=bad)
    with pytest.raises(TypeError, match="^max_lr: expected a real number"):
        optim.WarmupCosine("1e-3", total_steps=100)
    with pytest.raises(ValueError, match=r"^total_steps: expected an integer >= warmup_steps \(10\)"):
        optim.WarmupCosine(1e-3, total_steps=5, warmup_steps=10)


# ------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("kw, exc, match", [
    (dict(temperature=float("nan")), ValueError, "^temperature: expected a finite number"),  # (garbage tokens)
    (dict(temperature="1"), TypeError, "^temperature: expected a real number"),
    (dict(top_k=-1), ValueError, "^top_k: expected an integer >= 0"),  # (treated as off)
    (dict(eos_token_id="</s>"), TypeError, "^eos_token_id: expected an int token id"),  # (an array of strings)
    (dict(eos_token_id=99), ValueError, r"^eos_token_id: expected an integer in \[0, 15\]"),
    (dict(max_new_tokens=-1), ValueError, "^max_new_tokens: expected an integer >= 0"),
    (dict(max_new_tokens=1.5), TypeError, "^max_new_tokens: expected an integer"),
    (dict(max_new_tokens=None), TypeError, "^max_new_tokens: expected an integer"),
    (dict(max_new_tokens=40), ValueError, "^max_new_tokens: the prompt's 3 tokens"),
    (dict(seed=-1), ValueError, "^seed: expected an integer"),
    (dict(attention_mask=np.ones((1, 2))), ValueError, r"^attention_mask: expected the shape of ids \(3,\)"),
    (dict(autocast="bf16"), TypeError, "^autocast: expected a dtype"),
    (dict(static=True), ValueError, "^static: the static engine runs on the GPU"),  # (a CUDA runtime error)
])
def test_generate_arguments(kw, exc, match):
    m = tiny_llama()
    kw = dict(dict(max_new_tokens=2), **kw)
    n = kw.pop("max_new_tokens")
    with pytest.raises(exc, match=match):
        ck.generate(m, [1, 2, 3], n, **kw)


def test_generate_stops_at_any_of_several_eos_ids():
    m = tiny_llama()
    free = ck.generate(m, [1, 2, 3], 6, temperature=0)
    first = int(free[3])
    out = ck.generate(m, [1, 2, 3], 6, temperature=0, eos_token_id=[15 if first != 15 else 14, first])
    assert out.tolist() == free[:4].tolist()


# ------------------------------------------------------------------------------------------ files
def test_checkpoint_save_refuses_what_it_cannot_store(tmp_path):
    with pytest.raises(TypeError, match=r"^arrays\['w'\]: expected a NumPy or CuPy array; got list"):
        C.save(tmp_path / "a.ckpt", {"w": [1, 2]})
    with pytest.raises(TypeError, match="^meta: not JSON-serialisable"):
        C.save(tmp_path / "a.ckpt", {"w": np.zeros(2, F32)}, {"s": {1, 2}})
    assert not (tmp_path / "a.ckpt").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="^path: .*file is a file, not a folder"):
        C.save(tmp_path / "file" / "a.ckpt", {"w": np.zeros(2, F32)})  # (FileExistsError)
    C.save(tmp_path / "ok.ckpt", {"w": np.zeros(2, F32)}, {"step": 3})
    arrays, meta = C.load(tmp_path / "ok.ckpt")
    assert meta == {"step": 3} and json.dumps(meta)


@pytest.mark.parametrize("call, exc, match", [
    (lambda T, fused: F.rms_norm(T(2, 4), T(4), -1.0, fused=fused), ValueError, "^eps: expected a finite number > 0"),
    (lambda T, fused: F.layer_norm(T(2, 4), T(4), T(4), 0.0, fused=fused), ValueError, "^eps: expected"),
    (lambda T, fused: F.rms_norm(T(2, 4), T(5), 1e-6, fused=fused), ValueError, r"^weight: expected shape \(4,\)"),
    (lambda T, fused: F.swiglu(T(4), T(5), fused=fused), ValueError, r"^up: expected shape \(4,\)"),
    (lambda T, fused: F.embedding(T(4, 3), np.array([-1]), fused=fused), ValueError, "^ids: value -1 is out of range"),
    (lambda T, fused: F.embedding(T(4, 3), np.array([1.5]), fused=fused), TypeError, "^ids: expected"),
    (lambda T, fused: F.rope(T(1, 2, 1, 8), *ck.rope_cache(4, 8, xp=np), positions=np.array([0, -1]), fused=fused),
     ValueError, "^positions: .*-1"),
])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composite"])
def test_composite_functions_validate_as_the_fused_ones(call, exc, match, fused):
    """fused=False accepted a negative eps (NaN rows), a negative id / position (NumPy indexes from the end),
    mismatched shapes (broadcast) -- the fused Functions refuse them, and so does the composite now."""
    def T(*s):
        return ck.Tensor(np.random.default_rng(0).standard_normal(s).astype(F32), requires_grad=True)

    with pytest.raises(exc, match=match):
        call(T, fused)


@pytest.mark.parametrize("zero", ["optimizer", "module", "lazy"])
def test_zero_grad_between_forward_and_backward_is_an_error(zero):
    """The fused LM head + loss writes the head weight's gradient during the forward; a zero_grad() before the
    backward used to discard it silently (the head never learned). Now the backward says what to do; the right
    order (zero_grad before the forward) still trains."""
    rng = np.random.default_rng(0)
    model = ck.Llama(ck.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, max_position_embeddings=32))
    opt = ck.optim.AdamW(model.parameters(), lr=1e-2)
    ids = rng.integers(0, 64, (2, 9))
    opt.zero_grad()
    model(ids[:, :-1], ids[:, 1:]).backward()  # the .grad buffers exist from here on
    opt.step()
    loss = model(ids[:, :-1], ids[:, 1:])
    {"optimizer": opt.zero_grad, "module": model.zero_grad, "lazy": lambda: opt.zero_grad(lazy=True)}[zero]()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) ran between the forward and this backward"):
        loss.backward()
    opt.zero_grad()
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    head = [p for p in model.parameters() if p.grad is not None and p.grad.shape == (64, 32)]
    assert head and all(np.abs(p.grad).sum() > 0 for p in head)
