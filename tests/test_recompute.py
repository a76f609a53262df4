"""Activation recompute (``ck.functional.recompute``, ``model.set_recompute``, the trainer's ``recompute`` key): the
gradients equal those of the plain tape.

Bit for bit on the NumPy path, every case here: the recompute runs the same Functions on the same values, and the
only sums whose order could change are those of a gradient with several contributions -- inside a block they are
summed by the same walk as without recompute (the second tape has the same shape), and a block's input gets its
whole gradient from one node either way (the next block's norm, or the recompute node in its place). GPU tests:
CuPy fp32 and bf16 autocast, eager and inside one captured CUDA graph (the trainer's ``graph: true``), compared the
same way; where a run against itself is not bit-identical on the device (a nondeterministic kernel), the
comparison falls back to that run-to-run difference.

Memory: what the tape keeps alive is counted on the CPU (:func:`kept_bytes`: every array a recorded node holds),
so the claim "a recomputed block keeps only its input" is checked without a GPU.
"""
import threading

import numpy as np
import pytest

import cukernels as ck
from cukernels import functional as F
from cukernels.autograd import Tensor, is_grad_enabled
from cukernels.distributed import FakeGroup
from cukernels.train import ConfigError, load_config, trainer

MODES = ("attention", "full")


# ------------------------------------------------------------------------------------------------ helpers
def llama(xp=np, fused=True, layers=3, **kw):
    c = dict(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
    c.update(kw)
    return ck.Llama(ck.LlamaConfig(**c), xp=xp, seed=3, fused=fused)


def gpt2(xp=np, fused=True, layers=3, pdrop=0.2, **kw):
    c = dict(vocab_size=53, n_positions=32, n_embd=32, n_layer=layers, n_head=4, resid_pdrop=pdrop,
             embd_pdrop=pdrop / 2, attn_pdrop=pdrop)
    c.update(kw)
    return ck.GPT2(ck.GPT2Config(**c), xp=xp, seed=3, fused=fused)


MODELS = {"llama": llama, "gpt2": gpt2}


def batch(rng, B=2, T=11, V=53, xp=np):
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    tgt = rng.integers(0, V, (B, T)).astype(np.int32)
    return xp.asarray(ids), xp.asarray(tgt)


def poison_stale(model):
    """Every .grad NaN and marked stale (an optimizer's lazy zero_grad): the first write must overwrite it all."""
    for p in model.parameters():
        p.grad = p.xp.full(p.shape, np.nan, dtype=p.dtype)
        p.grad_stale = True


def grads_of(model, ids, tgt, mode, *, dtype=None, micro=1):
    """(losses, {name: grad}) of ``micro`` forward + backward passes (the backward outside the autocast block, as
    the trainer runs it) into NaN-poisoned stale gradient buffers."""
    model.set_recompute(mode)
    poison_stale(model)
    losses = []
    for _ in range(micro):
        with ck.autocast(dtype, enabled=dtype is not None):
            loss = model(ids, tgt)
        loss.backward()
        losses.append(float(loss.data))
    return losses, {n: p.grad.copy() for n, p in model.named_parameters()}


def kept_bytes(root, model):
    """Bytes of the distinct arrays the recorded graph of ``root`` holds (the inputs of every node and what it
    saved), the model's parameters left out: the activations that stay alive until the backward."""
    seen_t, total, stack = set(), 0, [root]
    seen_a = {id(p.data) for p in model.parameters()}

    def add(a):
        nonlocal total
        if hasattr(a, "nbytes") and hasattr(a, "dtype") and id(a) not in seen_a:
            seen_a.add(id(a))
            total += a.nbytes
    while stack:
        t = stack.pop()
        if id(t) in seen_t or not isinstance(t._node, tuple):
            continue
        seen_t.add(id(t))
        ctx = t._node[1]
        for a in ctx.inputs:
            if isinstance(a, Tensor):
                if a._node is None and a.requires_grad:
                    continue  # parameters: not activations
                add(a.data)
                stack.append(a)
        for a in ctx.saved_tensors:
            add(a)
    return total


# ------------------------------------------------------------------------------------------------ the Function
def _two_outputs(x, w, c):
    h = (x @ w).tanh()
    return h * c, (h + x).exp()


def test_recompute_equals_the_plain_tape_with_two_outputs_and_a_closure(rng):
    """Two outputs, a parameter read through a closure, a non-leaf tensor closed over: every gradient (the
    input's, the closed-over tensor's history, the parameter's) bit for bit."""
    x0 = rng.standard_normal((5, 6)).astype(np.float32)
    w0 = rng.standard_normal((6, 6)).astype(np.float32) * 0.3
    a0 = rng.standard_normal((6,)).astype(np.float32)
    out = {}
    for rc in (False, True):
        x, w, a = (Tensor(v.copy(), requires_grad=True) for v in (x0, w0, a0))
        c = a * 2.0  # a non-leaf the block closes over: its gradient must flow on to a
        y = x * 1.5  # the block's input is a non-leaf too
        fn = lambda t: _two_outputs(t, w, c)  # noqa: E731
        o1, o2 = F.recompute(fn, y) if rc else fn(y)
        assert o1.requires_grad and o2.requires_grad
        ((o1 * o1).sum() + (o2 * 0.1).sum()).backward()
        out[rc] = (x.grad, w.grad, a.grad)
    for g_rc, g in zip(out[True], out[False]):
        np.testing.assert_array_equal(g_rc, g)


def test_an_unused_output_an_identity_and_a_retained_graph(rng):
    x0 = rng.standard_normal((4, 3)).astype(np.float32)
    res = {}
    for rc in (False, True):
        x = Tensor(x0.copy(), requires_grad=True)
        fn = lambda t: (t, (t * t).tanh(), t.exp())  # noqa: E731  (an identity, a used and an unused output)
        a, b, _ = F.recompute(fn, x) if rc else fn(x)
        loss = (a * 3.0).sum() + b.sum()
        loss.backward(retain_graph=True)
        loss.backward()  # twice through a retained graph: the block runs again each time
        res[rc] = x.grad
    # To fp rounding, not bit for bit: x has four consumers inside the block; recomputed, their contributions are
    # summed inside and handed on as one gradient, while the plain tape adds each into the leaf's .grad in turn.
    np.testing.assert_allclose(res[True], res[False], rtol=1e-6)


def test_an_input_given_twice_gets_its_gradient_once(rng):
    x0 = rng.standard_normal((4, 3)).astype(np.float32)
    res = {}
    for rc in (False, True):
        x = Tensor(x0.copy(), requires_grad=True)
        fn = lambda a, b: (a * b).tanh() + a  # noqa: E731
        (F.recompute(fn, x, x) if rc else fn(x, x)).sum().backward()
        res[rc] = x.grad
    np.testing.assert_allclose(res[True], res[False], rtol=1e-6)  # (summed inside, then handed on: see above)


def test_no_grad_and_constant_blocks_record_nothing(rng):
    x = Tensor(rng.standard_normal((3, 3)).astype(np.float32), requires_grad=True)
    with ck.no_grad():
        y = F.recompute(lambda t: t * 2.0, x)
    assert not y.requires_grad and y._node is None
    z = F.recompute(lambda t: t * 2.0, Tensor(x.data))  # nothing requires a gradient: a plain result
    assert not z.requires_grad and z._node is None


def test_bad_calls_say_what_to_do(rng):
    x = Tensor(rng.standard_normal((3, 3)).astype(np.float32), requires_grad=True)
    with pytest.raises(TypeError, match="fn: expected a callable"):
        F.recompute(x, x)
    with pytest.raises(TypeError, match="must return a Tensor or a tuple of Tensors; got ndarray"):
        F.recompute(lambda t: t.data * 2, x)
    w = Tensor(np.ones((3, 3), np.float32), requires_grad=True)
    # a block that reads a parameter only when recording: its hook would fire before its gradient existed
    y = F.recompute(lambda t: t @ w if is_grad_enabled() else t * 1.0, x)
    with pytest.raises(RuntimeError, match="must compute the same thing both times"):
        y.sum().backward()


def test_grad_mode_is_per_thread():
    """One thread's no_grad (a recomputed block's first forward on one FakeGroup rank) leaves another thread's
    tape recording."""
    inside, go, out = threading.Event(), threading.Event(), {}

    def quiet():
        with ck.no_grad():
            inside.set()
            go.wait(10)

    t = threading.Thread(target=quiet)
    t.start()
    inside.wait(10)
    x = Tensor(np.ones(3, np.float32), requires_grad=True)
    out["y"] = x * 2.0
    go.set()
    t.join()
    assert is_grad_enabled() and out["y"].requires_grad


# ------------------------------------------------------------------------------------------------ the models
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composite"])
@pytest.mark.parametrize("family", list(MODELS))
def test_model_gradients_equal_without_recompute(rng, family, fused, mode):
    """LLaMA (the pending residual pair between blocks) and GPT-2 with every dropout active (embedding, attention
    probabilities, both residual branches: the masks replayed from the forward's offset), fused kernels' reference
    paths and the composite: the loss and every gradient bit for bit, NaN-poisoned stale buffers overwritten."""
    ids, tgt = batch(rng)
    want = grads_of(MODELS[family](fused=fused), ids, tgt, "none")
    got = grads_of(MODELS[family](fused=fused), ids, tgt, mode)
    assert got[0] == want[0]
    for n, g in want[1].items():
        assert np.isfinite(got[1][n]).all(), n
        np.testing.assert_array_equal(got[1][n], g, err_msg=n)
    if family == "gpt2":  # (the dropout really was active)
        m = gpt2(fused=fused)
        with ck.no_grad():
            train_loss = float(m(ids, tgt).data)
            m.eval()
            assert float(m(ids, tgt).data) != train_loss


@pytest.mark.parametrize("mode", MODES)
def test_bf16_autocast_is_restored_in_the_backward(rng, mode):
    """The forward under ck.autocast(bf16), the backward outside it (as the trainer runs them): the second forward
    runs in bf16 again, so the gradients are those of the bf16 forward."""
    ids, tgt = batch(rng)
    want = grads_of(llama(), ids, tgt, "none", dtype=ck.bfloat16)
    got = grads_of(llama(), ids, tgt, mode, dtype=ck.bfloat16)
    assert got[0] == want[0]
    for n, g in want[1].items():
        np.testing.assert_array_equal(got[1][n], g, err_msg=n)
    fp32 = grads_of(llama(), ids, tgt, "none")  # (and autocast mattered: fp32 gives other gradients)
    n = "model.layers.0.mlp.up_proj.weight"
    assert not np.array_equal(fp32[1][n], want[1][n])


@pytest.mark.parametrize("mode", MODES)
def test_accumulation_into_lazily_zeroed_flat_buffers(rng, mode):
    """Two micro-batches into AdamW's flat gradient buffers after zero_grad(lazy=True) (the first write of the
    step overwrites, the second adds), then the update: gradients and updated weights bit for bit, and every
    parameter's .grad still a view of the flat buffer."""
    batches = [batch(rng) for _ in range(2)]
    res = {}
    for m_ in ("none", mode):
        model = llama().set_recompute(m_)
        opt = ck.optim.AdamW(model.parameters(), lr=1e-2)
        views = {n: p.grad for n, p in model.named_parameters()}
        for _ in range(2):
            opt.zero_grad(lazy=True)
            for ids, tgt in batches:
                model(ids, tgt).backward()
            grads = {n: p.grad.copy() for n, p in model.named_parameters()}
            opt.step()
        assert all(p.grad is views[n] for n, p in model.named_parameters())
        res[m_] = grads, {n: p.data.copy() for n, p in model.named_parameters()}
    for part in (0, 1):
        for n, a in res["none"][part].items():
            np.testing.assert_array_equal(res[mode][part][n], a, err_msg=n)


@pytest.mark.parametrize("mode", MODES)
def test_grad_ready_hooks_fire_once_with_the_final_gradient(rng, mode):
    """Each parameter's hook fires exactly once per backward, and when it fires the parameter's .grad already
    holds its final value (ZeRO starts the bucket's reduce-scatter there); a recomputed block's parameters become
    ready together, after the block's backward, before any earlier block's."""
    model = llama(layers=3).set_recompute(mode)
    ids, tgt = batch(rng)
    fired = []
    handles = [p.register_grad_ready_hook(lambda t, n=n: fired.append((n, t.grad.copy())))
               for n, p in model.named_parameters()]
    try:
        for _ in range(2):  # a second backward (accumulation) fires every hook once more
            fired.clear()
            model(ids, tgt).backward()
            names = [n for n, _ in fired]
            assert sorted(names) == sorted(n for n, _ in model.named_parameters())
            params = dict(model.named_parameters())
            for n, g in fired:
                np.testing.assert_array_equal(g, params[n].grad, err_msg=n)
            layer = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
            assert layer == sorted(layer, reverse=True), layer  # block by block, last block first
    finally:
        for h in handles:
            h.remove()


def test_the_fused_heads_zero_grad_check_still_fires(rng):
    model = llama().set_recompute("full")
    ids, tgt = batch(rng)
    model.zero_grad()
    model(ids, tgt).backward()  # .grad buffers exist now
    loss = model(ids, tgt)
    model.zero_grad()
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) ran between the forward and this backward"):
        loss.backward()


def test_generation_and_no_grad_forwards_are_unaffected(rng):
    ids, _ = batch(rng)
    model = llama()
    with ck.no_grad():
        want = model(ids).data
    model.set_recompute("full")
    with ck.no_grad():
        np.testing.assert_array_equal(model(ids).data, want)
    out = ck.generate(model, ids[:1, :4], 3, temperature=0)
    assert out.shape == (1, 7)


def test_set_recompute_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="recompute: expected one of \\['none', 'attention', 'full'\\]; got 'ful'"
                                         " \\(did you mean 'full'\\?\\)"):
        llama().set_recompute("ful")
    assert llama().recompute == "none" and llama().set_recompute().recompute == "full"


@pytest.mark.parametrize("family", list(MODELS))
def test_a_recomputed_block_keeps_only_its_input(rng, family):
    """The memory model of benchmarks/NOTES.md ("Activation recompute") on the tape itself: with ``full`` the
    graph holds per block only its input (LLaMA: the pending residual pair, 2 x hidden per token; GPT-2: the
    stream, 1 x hidden), so what it keeps grows by that per layer; ``attention`` keeps less than ``none``."""
    B, T, H = 2, 11, 32
    ids, tgt = batch(rng, B, T)
    kept = {}
    for layers in (2, 4):
        for mode in ("none",) + MODES:
            m = MODELS[family](layers=layers, **({"pdrop": 0.0} if family == "gpt2" else {})).set_recompute(mode)
            kept[layers, mode] = kept_bytes(m(ids, tgt), m)
    per_layer = {mode: (kept[4, mode] - kept[2, mode]) / 2 for mode in ("none",) + MODES}
    want_full = (2 if family == "llama" else 1) * B * T * H * 4  # fp32 on this path
    assert per_layer["full"] == want_full, per_layer
    assert per_layer["full"] < per_layer["attention"] < per_layer["none"], per_layer
    assert per_layer["none"] > 8 * per_layer["full"], per_layer


# ------------------------------------------------------------------------------------------------ the trainer
TINY = ["max_steps=4", "eval_every=2", "eval_steps=1", "log_every=1", "plot=false", "batch_size=2", "seq_len=16",
        "total_batch_size=64", "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "warmup_steps=1", "lr=0.01",
        "sample_chars=0", "device=cpu", "progress=lines"]


def _rows(rows):
    return [{k: v for k, v in r.items() if k not in ("ms_per_step", "tok_per_s")} for r in rows]


GPT2_TINY = [o for o in TINY if not o.startswith(("model.hidden", "model.interm", "model.num_"))] + [
    "model.n_embd=32", "model.n_layer=2", "model.n_head=4", "model.resid_pdrop=0.1", "model.attn_pdrop=0.1",
    "model.embd_pdrop=0.1"]


@pytest.mark.parametrize("config, overrides", [("tiny", TINY), ("tiny", TINY + ["autocast=bf16"]),
                                               ("gpt2-tiny", GPT2_TINY)], ids=["llama", "llama-bf16", "gpt2-dropout"])
def test_trainer_recompute_gives_the_same_rows(tmp_path, config, overrides):
    """``recompute: full`` / ``attention`` in the trainer (2 micro-batches a step, lazy zeroing, clipping, AdamW;
    GPT-2 with dropout): the same losses, grad norms and validation losses, bit for bit."""
    rows = {}
    for mode in ("none",) + MODES:
        cfg = load_config(config, overrides + [f"recompute={mode}", f"out_dir={tmp_path / mode}"])
        rows[mode] = _rows(trainer.train(cfg, quiet=True))
    assert [r["kind"] for r in rows["none"]].count("train") == 4
    for mode in MODES:
        assert rows[mode] == rows["none"], mode


def test_zero_ranks_with_hooks_and_buckets_give_the_same_rows(tmp_path):
    """Two FakeGroup ranks (threads: the grad mode is per thread), ZeRO-1 with small buckets whose reduce-scatters
    the gradient-ready hooks start during the backward, 2 micro-batches per rank (no_sync): ``recompute: full``
    logs what ``none`` logs, bit for bit."""
    common = TINY + ["total_batch_size=128", "zero.bucket_elems=2000", "zero.wire=fp32", "distributed=true"]
    rows = {}
    for mode in ("none", "full"):
        cfg = load_config("tiny", common + [f"recompute={mode}", f"out_dir={tmp_path / mode}"])
        outs = FakeGroup(2).run(lambda g: trainer.train(cfg, quiet=True, group=g))
        assert _rows(outs[1]) == _rows(outs[0])
        rows[mode] = _rows(outs[0])
    assert rows["full"] == rows["none"]


def test_config_key():
    assert load_config(None, ["recompute=full"])["recompute"] == "full"
    assert load_config(None)["recompute"] == "none"
    with pytest.raises(ConfigError, match="recompute: expected one of \\['none', 'attention', 'full'\\]; got "
                                          "'partial'"):
        load_config(None, ["recompute=partial"])
    from cukernels.train import config
    assert "recompute" in config.describe() and "recompute" in config.RESUME_FREE  # (gradients are the same)


# ------------------------------------------------------------------------------------------------ GPU
def _assert_same(got, want, control, what):
    """Bit for bit when the run repeated against itself is (``control``: the reference run twice); else within
    that run-to-run difference (a nondeterministic kernel), times 4."""
    for n, w in want.items():
        g, c = np.asarray(got[n], np.float64), np.asarray(control[n], np.float64)
        w = np.asarray(w, np.float64)
        assert np.isfinite(g).all(), f"{what} {n}: not finite"
        noise = np.abs(c - w).max()
        if noise == 0:
            np.testing.assert_array_equal(g, w, err_msg=f"{what} {n}")
        else:
            assert np.abs(g - w).max() <= 4 * noise, f"{what} {n}: {np.abs(g - w).max()} vs run-to-run {noise}"


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _gpu_grads(family, mode, dtype, rng_seed, fused=True, xp=None):
    if xp is None:
        import cupy as xp
    kw = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=200,
              vocab_size=1000, max_position_embeddings=256) if family == "llama" else \
        dict(n_embd=128, n_head=2, vocab_size=1000, n_positions=256)
    m = MODELS[family](xp=xp, fused=fused, layers=3, **kw)
    rng = np.random.default_rng(rng_seed)
    ids, tgt = batch(rng, B=3, T=97, V=1000, xp=xp)  # odd sizes; bf16 LLaMA: head_dim 64 -> flash attention
    if dtype is not None:
        opt = ck.optim.AdamW(m.parameters(), lr=1e-3, shadow_dtype=dtype)
        ck.amp.attach_shadows(m.parameters(), opt)
    losses, g = grads_of(m, ids, tgt, mode, dtype=dtype, micro=2)
    return losses, {n: _host(a) for n, a in g.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [None, ck.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(MODELS))
def test_gpu_model_gradients_equal_without_recompute(family, dtype):
    """CuPy kernels, fp32 and bf16 autocast (bf16 shadows; LLaMA's attention through flash attention, GPT-2's
    materialised under attention dropout), two micro-batches into NaN-poisoned stale buffers: every mode's
    gradients equal the plain tape's."""
    want = _gpu_grads(family, "none", dtype, 5)
    control = _gpu_grads(family, "none", dtype, 5)
    for mode in MODES:
        got = _gpu_grads(family, mode, dtype, 5)
        assert got[0] == want[0] or control[0] != want[0], (mode, got[0], want[0])
        _assert_same(got[1], want[1], control[1], f"{family} {mode}")


@pytest.mark.gpu
def test_gpu_strided_input(rng, xp=None):
    """ck kernels inside the block (RMSNorm, linear, packed SwiGLU) on a strided view input: gradients as the plain
    tape's, bit for bit."""
    if xp is None:
        import cupy as xp
    big = xp.asarray(rng.standard_normal((7, 2 * 130)).astype(np.float32))
    w0 = xp.asarray(rng.standard_normal((130,)).astype(np.float32))
    lin0 = xp.asarray((rng.standard_normal((2 * 96, 130)) * 0.1).astype(np.float32))
    out = {}
    for rc in (False, True):
        x = Tensor(big[:, ::2], requires_grad=True)  # a non-contiguous view
        w, lin = Tensor(w0.copy(), requires_grad=True), Tensor(lin0.copy(), requires_grad=True)

        def fn(t):
            return F.swiglu_packed(F.linear(F.rms_norm(F.contiguous(t), w), lin))
        y = F.recompute(fn, x) if rc else fn(x)
        (y * y).sum().backward()
        out[rc] = [_host(a) for a in (x.grad, w.grad, lin.grad)]
    for a, b in zip(out[True], out[False]):
        np.testing.assert_array_equal(a, b)


GPU_TRAIN = ["device=gpu", "fused=true", "max_steps=6", "eval_every=3", "eval_steps=1", "log_every=1",
             "plot=false", "batch_size=2", "seq_len=96", "total_batch_size=384", "warmup_steps=2", "lr=3e-3",
             "sample_chars=0", "progress=lines"]


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["autocast=bf16"], ["autocast=bf16", "grad_dtype=bfloat16",
                                                           "total_batch_size=192"]],
                         ids=["fp32", "bf16", "bf16-grads"])
def test_gpu_captured_graph_steps_equal(tmp_path, extra):
    """``graph: true``: the recomputing step is captured as one CUDA graph after two eager steps (two micro-batches
    a step, lazy zeroing, the fused head, clipping, AdamW on the device) and replayed: its rows equal the
    non-recomputing graph's."""
    rows = {}
    for i, mode in enumerate(("none", "none") + MODES):
        cfg = load_config("tiny", GPU_TRAIN + extra + ["graph=true", f"recompute={mode}",
                                                         f"out_dir={tmp_path / f'{mode}{i}'}"])
        rows[mode if i else "control"] = _rows(trainer.train(cfg, quiet=True))
    want, control = rows["none"], rows["control"]
    keys = [(r["step"], r["kind"]) for r in want]
    for mode in MODES:
        got = rows[mode]
        assert [(r["step"], r["kind"]) for r in got] == keys
        if control == want:
            assert got == want, mode
        else:
            for a, b, c in zip(got, want, control):
                for k in ("loss", "grad_norm"):
                    if k in b:
                        assert abs(a[k] - b[k]) <= 4 * abs(c[k] - b[k]) + 1e-7 * abs(b[k]), (mode, k, a, b)


# ------------------------------------------------------------------------------------------------ the benchmark
def _bench():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "bench_train_under_test", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("limit", [0, 1000, 5 * 1024, 37 * 1024 + 5, 64 * 1024, 10 ** 6])
def test_bench_longest_t_bisection(monkeypatch, capsys, limit):
    """``bench_train.py --max-t``: the cap first, then a bisection over multiples of 1024; the answer is the largest
    multiple that ran (a fake probe that runs out of memory above ``limit`` tokens), in at most 8 probes."""
    bench = _bench()
    tried = []

    def fake(B, T, mode, data):
        tried.append((T, mode))
        if T > limit:
            return None, "OOM"
        return dict(ms=T / 100, peak_gib=T / 1024), ""
    monkeypatch.setattr(bench, "probe", fake)
    t, probes = bench.longest_t("full", 1, 65536, "synthetic")
    assert t == min(65536, limit // 1024 * 1024) and tried[0] == (65536, "full") and len(tried) <= 8
    assert [p[0] for p in probes] == [T for T, _ in tried] and all((p[1] is None) == (p[0] > limit) for p in probes)
    assert ("recompute full: OOM" in capsys.readouterr().out) == (limit < 65536)


def test_bench_recompute_table_and_config_names(capsys):
    bench = _bench()
    assert bench.config_shape("b1t16384") == (1, 16384) and bench.config_shape("b2t24576") == (2, 24576)
    with pytest.raises(SystemExit, match="b1x4096"):
        bench.config_shape("b1x4096")
    rows = [dict(config="b1t8192", recompute="none", setting="", ms=100.0, tok_s=81920.0, peak_gib=40.0),
            dict(config="b1t8192", recompute="full", setting="", ms=128.0, tok_s=64000.0, peak_gib=31.0),
            dict(config="b1t65536", recompute="none", setting="", oom=True),
            dict(config="b1t65536", recompute="full", setting="", ms=1000.0, tok_s=65536.0, peak_gib=50.0)]
    bench.recompute_table(rows, ["none", "full"], 10)
    out = capsys.readouterr().out
    assert "b1t8192    full          128.00     64,000      31.0    1.28    0.78" in out
    assert "b1t65536   none             OOM" in out and "b1t65536   full         1000.00" in out
