"""ck.optim.AdamW: flat-buffer layout, the update against float64 AdamW, sparse rows, state round trip, schedule,
clipping, and (GPU) kernel path vs NumPy path and graph capture of a whole step."""
import numpy as np
import pytest

import cukernels as ck
from cukernels.optim import ALIGN, AdamW, WarmupCosine
from helpers import randn, to_host
from test_adam import textbook_adamw

F32 = np.float32
BF16 = np.dtype(ck.bfloat16)


class Param:
    """The duck type an autograd Tensor offers: .name, .data, .grad."""

    def __init__(self, name, data):
        self.name, self.data, self.grad = name, data, None


SHAPES = {"tok_emb": (40, 16), "w1": (16, 24), "norm": (16,), "w2": (24, 16), "bias": (7,)}
SPARSE = {"tok_emb"}
NO_DECAY = lambda name, a: a.ndim < 2  # noqa: E731


def make_params(rng, xp=np):
    host = {n: randn(rng, s, F32) for n, s in SHAPES.items()}
    return [Param(n, xp.asarray(a)) for n, a in host.items()], host


def grads_for(rng, rows=None):
    g = {n: randn(rng, s, F32, scale=0.5) for n, s in SHAPES.items()}
    if rows is not None:  # a sparse gradient: only the touched rows are nonzero
        mask = np.zeros(SHAPES["tok_emb"][0], bool)
        mask[rows] = True
        g["tok_emb"][~mask] = 0
    return g


def write_grads(params, g, xp=np):
    for p in params:
        p.grad += xp.asarray(g[p.name])  # in place, as a backward accumulates


# ---------------------------------------------------------------- CPU: layout
def test_layout_replaces_data_with_flat_views(rng):
    params, host = make_params(rng)
    old = [p.data for p in params]
    opt = AdamW(params, lr=1e-3, weight_decay=0.1, no_decay=NO_DECAY)
    assert len(opt._groups) == 2  # decay, no-decay: two launches for the whole model
    for p, o in zip(params, old):
        assert p.data is not o and np.array_equal(p.data, host[p.name])
        assert p.grad is not None and p.grad.shape == p.data.shape and not p.grad.any()
        assert p.data.base is not None, "param must be a view into a flat buffer"
        off = p.data.__array_interface__["data"][0] - p.data.base.__array_interface__["data"][0]
        assert off % (ALIGN * 4) == 0, "every view starts on a 256-byte boundary of its flat buffer"
        assert np.array_equal(opt.shadow(p).view(np.uint16), p.data.astype(BF16).view(np.uint16))
        assert opt.param(p.name) is p.data and opt.grad(p) is p.grad
    # the grad view really is the flat buffer: writing it shows up in the flat buffer
    params[1].grad[...] = 3.0
    assert sum(float(g.sum()) for g in opt.flat_grads) == 3.0 * params[1].data.size
    assert len(AdamW(make_params(rng)[0], lr=1e-3)._groups) == 1  # no weight decay: one group


def test_pairs_are_copied_and_viewed(rng):
    a, b = randn(rng, (5, 3), F32), randn(rng, (4,), F32)
    opt = AdamW([("a", a), ("b", b)], lr=0.1)
    assert np.array_equal(opt.param("a"), a) and opt.param("a") is not a
    assert [n for n, _ in opt.named_parameters()] == ["a", "b"]
    opt.grad("a")[...] = 1.0
    opt.step()
    assert not np.array_equal(opt.param("a"), a) and np.array_equal(opt.param("b"), b)
    assert np.array_equal(a, a.copy())  # the caller's array is untouched


@pytest.mark.parametrize("xp_name", ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def test_bf16_gradient_buffers_update_as_fp32_on_rounded_gradients(rng, xp_name):
    """grad_dtype=bf16: the dense groups' gradient buffers are bf16 (the sparse table keeps fp32 rows), clipping
    and the update read them, and the result is bit for bit the fp32-buffer optimizer fed the same gradients
    rounded to bf16 (the update widens them in registers)."""
    import importlib

    xp = importlib.import_module(xp_name)
    _, host = make_params(rng)
    pa = [Param(n, xp.asarray(a)) for n, a in host.items()]
    pb = [Param(n, xp.asarray(a)) for n, a in host.items()]
    kw = dict(lr=2.0 ** -6, weight_decay=0.1, no_decay=NO_DECAY, sparse=SPARSE)
    opt_a, opt_b = AdamW(pa, grad_dtype=ck.bfloat16, **kw), AdamW(pb, **kw)
    assert [str(g.dtype) for g in opt_a.flat_grads] == ["bfloat16", "bfloat16", "float32"]
    assert opt_a.grad("w1").dtype == BF16 and opt_a.grad("tok_emb").dtype == F32
    for _ in range(3):
        g = grads_for(rng)
        for p, q in zip(pa, pb):
            r = g[p.name] if p.name in SPARSE else g[p.name].astype(BF16).astype(F32)
            p.grad[...] = xp.asarray(g[p.name]).astype(p.grad.dtype)
            q.grad[...] = xp.asarray(r)
        for opt in (opt_a, opt_b):
            _, scale = opt.clip_grad_norm(1.0)
            opt.step(grad_scale=scale)
            opt.zero_grad()
    for a, b in zip(pa, pb):
        assert np.array_equal(to_host(a.data), to_host(b.data)), a.name


def test_grad_dtype_must_be_fp32_or_bf16(rng):
    params, _ = make_params(rng)
    for bad in (np.float16, "nonsense", np.int32):
        with pytest.raises(TypeError, match="grad_dtype: expected float32 or ck.bfloat16"):
            AdamW(params, grad_dtype=bad)


# ---------------------------------------------------------------- CPU: the update
def run_reference(rng, nsteps=3, *, clip=None):
    """Optimizer on the NumPy path, and the float64 textbook per parameter; returns both and the optimizer."""
    params, host = make_params(rng)
    wd, lr = 0.1, 2.0 ** -6
    opt = AdamW(params, lr=lr, weight_decay=wd, no_decay=NO_DECAY, sparse=SPARSE)
    rows = np.array([2, 9, 31, 5, 0, 0], np.int32)
    count = np.array(4, np.int32)
    opt.set_rows("tok_emb", rows, count)
    all_g = []
    for _ in range(nsteps):
        g = grads_for(rng, rows[:4])
        all_g.append(g)
        write_grads(params, g)
        scale = None
        if clip is not None:
            norm, scale = opt.clip_grad_norm(clip)
            ref_norm = np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in g.values()))
            np.testing.assert_allclose(float(norm), ref_norm, rtol=1e-6)
        opt.step(grad_scale=scale)
        opt.zero_grad()
    return params, host, all_g, opt, rows[:4]


@pytest.mark.parametrize("clip", [None, 0.5])
def test_step_matches_float64_adamw(rng, clip):
    params, host, all_g, opt, rows = run_reference(rng, clip=clip)
    lr, wd = 2.0 ** -6, 0.1
    scales = [1.0] * len(all_g)
    if clip is not None:
        scales = [min(1.0, clip / (np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in g.values())) + 1e-6))
                  for g in all_g]
    by = {p.name: p for p in params}
    for name, p0 in host.items():
        w = 0.0 if p0.ndim < 2 else wd
        sel = rows if name in SPARSE else slice(None)
        ref = p0.copy().astype(np.float64)
        # textbook with a per-step scale: run one step at a time, carrying m and v
        m = v = None
        for t, (g, s) in enumerate(zip(all_g, scales)):
            ref_sel, m, v = textbook_adamw(ref[sel], [g[name][sel]], lr=lr, wd=w, scale=s, m=m, v=v, t0=t)
            ref[sel] = ref_sel
        np.testing.assert_allclose(by[name].data, ref, rtol=2e-6, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(opt.shadow(name).view(np.uint16), by[name].data.astype(BF16).view(np.uint16))
    # lazy Adam: untouched embedding rows are bit-identical, their moments still zero
    other = np.setdiff1d(np.arange(SHAPES["tok_emb"][0]), rows)
    assert np.array_equal(by["tok_emb"].data[other], host["tok_emb"][other])
    assert not opt.exp_avg("tok_emb")[other].any()
    assert opt.step_count == 3


def test_zero_grad_sparse_zeroes_only_listed_rows(rng):
    params, _ = make_params(rng)
    opt = AdamW(params, lr=1e-3, sparse=SPARSE)
    emb = next(p for p in params if p.name == "tok_emb")
    opt.set_rows(emb, np.array([1, 4], np.int32), np.array(2, np.int32))
    for p in params:
        p.grad += 1.0
    opt.step()
    opt.zero_grad()
    assert not emb.grad[[1, 4]].any() and (emb.grad[[0, 2, 3]] == 1).all()  # rows not listed left alone
    assert all(not p.grad.any() for p in params if p is not emb)  # dense: whole flat buffer memset
    opt.set_rows(emb, None, None)  # back to dense updates and whole-buffer zeroing
    opt.step()
    opt.zero_grad()
    assert not emb.grad.any()


def test_rebound_data_and_grad_are_copied_back(rng):
    params, _ = make_params(rng)
    opt = AdamW(params, lr=0.1)
    w1 = next(p for p in params if p.name == "w1")
    view_d, view_g = w1.data, w1.grad
    new = np.full(w1.data.shape, 2.0, F32)
    w1.data = new
    w1.grad = np.ones(w1.data.shape, F32)  # a backward that rebinds instead of accumulating in place
    opt.step()
    assert w1.data is view_d and w1.grad is view_g
    assert np.all(w1.data < 2.0)  # updated from the rebound values
    assert np.array_equal(opt.shadow(w1).view(np.uint16), w1.data.astype(BF16).view(np.uint16))
    w1.grad = None
    opt.step()
    assert w1.grad is view_g and not w1.grad.any()


def test_state_dict_round_trip(rng):
    params, _ = make_params(rng)
    opt = AdamW(params, lr=1e-2, weight_decay=0.1, no_decay=NO_DECAY, sparse=SPARSE)
    opt.set_rows("tok_emb", np.array([3, 7], np.int32), np.array(2, np.int32))
    for _ in range(2):
        write_grads(params, grads_for(rng, [3, 7]))
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    assert sd["step"] == 2 and isinstance(sd["state"]["w1"]["exp_avg"], np.ndarray)
    clones = [Param(p.name, p.data.copy()) for p in params]
    opt2 = AdamW(clones, lr=123.0, weight_decay=0.1, no_decay=NO_DECAY, sparse=SPARSE)
    opt2.set_rows("tok_emb", np.array([3, 7], np.int32), np.array(2, np.int32))
    opt2.load_state_dict(sd)
    assert opt2.step_count == 2 and opt2.get_lr() == opt.get_lr()
    g = grads_for(rng, [3, 7])
    write_grads(params, g)
    write_grads(clones, g)
    opt.step()
    opt2.step()
    for a, b in zip(params, clones):
        assert np.array_equal(a.data, b.data), a.name
    bad = dict(sd, state={k: v for k, v in sd["state"].items() if k != "w1"})
    with pytest.raises(KeyError, match="missing parameters \\['w1'\\]"):
        opt2.load_state_dict(bad)


def test_one_state_format_for_every_optimizer(rng):
    """AdamW's state in a world of one is the one shard format with every slice whole (in the parameters' shapes);
    the full format (consolidate_state's, and AdamW's own before issue 34) and CompositeAdamW's state load into it
    and back, the same moments bit for bit."""
    from cukernels.optim import CompositeAdamW, consolidate_state
    params, host = make_params(rng)
    opt = AdamW(params, lr=1e-2, weight_decay=0.1, no_decay=NO_DECAY, sparse=SPARSE)
    write_grads(params, grads_for(rng))
    opt.step()
    sd = opt.state_dict()
    assert (sd["kind"], sd["rank"], sd["world_size"], sd["step"]) == ("AdamW.shard", 0, 1, 1)
    for n, e in sd["state"].items():
        assert (e["start"], e["stop"], tuple(e["shape"])) == (0, host[n].size, SHAPES[n])
        assert e["exp_avg"].shape == e["param"].shape == SHAPES[n]
    full, _ = consolidate_state([sd])
    assert full["kind"] == "AdamW" and set(full["state"]) == set(SHAPES)
    comp = CompositeAdamW([ck.nn.Parameter(a.copy(), name=n) for n, a in host.items()], lr=0.5)
    comp.load_state_dict(sd)
    assert comp.t == 1 and comp.lr == opt.get_lr()
    again = AdamW([Param(n, a.copy()) for n, a in host.items()], lr=0.5, sparse=SPARSE)
    for state in (full, comp.state_dict(), [comp.state_dict()]):
        again.load_state_dict(state, params=False)
        for n in SHAPES:
            assert np.array_equal(again.exp_avg_sq(n), opt.exp_avg_sq(n)), n
    assert all(np.array_equal(again.param(n), host[n]) for n in SHAPES)  # params=False: the values stay


def test_set_lr_and_schedule(rng):
    params, _ = make_params(rng)
    opt = AdamW(params, lr=1e-3)
    opt.set_lr(5e-4)
    assert opt.get_lr() == np.float32(5e-4) and opt.lr_array.shape == ()
    sched = WarmupCosine(1e-3, total_steps=20, warmup_steps=4, min_lr=1e-4)
    opt.set_schedule(sched)
    for t in range(1, 25):
        opt.step()
        assert opt.get_lr() == np.float32(sched.lr_at(t)), t
    assert opt.get_lr() == np.float32(1e-4)


def test_bad_construction(rng):
    with pytest.raises(ValueError, match="empty parameter list"):
        AdamW([], lr=1e-3)
    with pytest.raises(ValueError, match="appears twice"):
        AdamW([("a", np.zeros(3, F32)), ("a", np.zeros(3, F32))])
    with pytest.raises(TypeError, match=r"params\['a'\]: expected dtype float32"):
        AdamW([("a", np.zeros(3, BF16))])
    with pytest.raises(ValueError, match="sparse parameters must be 2-D"):
        AdamW([("a", np.zeros(3, F32))], sparse={"a"})
    with pytest.raises(TypeError, match="no_decay: expected a set of names"):
        AdamW([("a", np.zeros(3, F32))], no_decay="a")
    with pytest.raises(ValueError, match="shadow_dtype=None"):
        AdamW([("a", np.zeros(3, F32))], shadow_dtype=None).shadow("a")
    with pytest.raises(ValueError, match="not a sparse parameter"):
        AdamW([("a", np.zeros((3, 2), F32))]).set_rows("a", np.zeros(1, np.int32), np.array(1, np.int32))


# ---------------------------------------------------------------- GPU
def _run(params, opt, grads, xp, rows_h, count_h, capture=False):
    rows = xp.asarray(rows_h)
    count = xp.asarray(count_h)
    opt.set_rows("tok_emb", rows, count)
    opt.set_schedule(WarmupCosine(1e-2, total_steps=10, warmup_steps=2, min_lr=1e-3))
    for g in grads:
        write_grads(params, g, xp)
        _, scale = opt.clip_grad_norm(2.0)
        opt.step(grad_scale=scale)
        opt.zero_grad()


@pytest.mark.gpu
def test_gpu_optimizer_matches_numpy_path(rng):
    import cupy as cp

    params_h, host = make_params(rng)
    params_d = [Param(n, cp.asarray(a)) for n, a in host.items()]
    kw = dict(lr=1e-3, weight_decay=0.1, no_decay=NO_DECAY, sparse=SPARSE)
    opt_h, opt_d = AdamW(params_h, **kw), AdamW(params_d, **kw)
    # The device list holds an out-of-range row (77), which the kernel skips; the NumPy path refuses one, so it
    # gets the same list without it.
    rows, count = np.array([2, 9, 31, 5, 77, 0], np.int32), np.array(5, np.int32)
    grads = [grads_for(rng, rows[:4]) for _ in range(4)]
    _run(params_h, opt_h, grads, np, rows[:4].copy(), np.array(4, np.int32))
    _run(params_d, opt_d, grads, cp, rows, count)
    assert opt_d.step_count == 4
    np.testing.assert_allclose(opt_d.get_lr(), opt_h.get_lr(), rtol=1e-6)
    for a, b in zip(params_d, params_h):
        np.testing.assert_allclose(to_host(a.data), b.data, rtol=2e-6, atol=1e-6, err_msg=a.name)
        assert not to_host(a.grad).any()
        sh = to_host(opt_d.shadow(a))
        assert np.array_equal(sh.view(np.uint16), to_host(a.data).astype(BF16).view(np.uint16))
        np.testing.assert_allclose(to_host(opt_d.exp_avg_sq(a)), opt_h.exp_avg_sq(b.name), rtol=1e-5, atol=1e-9)
    sd = opt_d.state_dict()
    opt_d.load_state_dict(sd)
    sd2 = opt_d.state_dict()
    assert sd2["step"] == 4 and all(np.array_equal(sd["state"][n]["exp_avg"], sd2["state"][n]["exp_avg"])
                                    for n in sd["state"])


@pytest.mark.gpu
def test_gpu_optimizer_step_captures(rng):
    """clip_grad_norm + step captured once and replayed: bit-identical to the same steps run eagerly."""
    import cupy as cp

    _, host = make_params(rng)
    kw = dict(lr=1e-3, weight_decay=0.1, no_decay=NO_DECAY, sparse=SPARSE)
    pe = [Param(n, cp.asarray(a)) for n, a in host.items()]
    pg = [Param(n, cp.asarray(a)) for n, a in host.items()]
    oe, og = AdamW(pe, **kw), AdamW(pg, **kw)
    rows, count = cp.asarray(np.array([2, 9, 31, 5], np.int32)), cp.asarray(np.array(4, np.int32))
    sched = WarmupCosine(1e-2, total_steps=10, warmup_steps=2, min_lr=1e-3)
    for o in (oe, og):
        o.set_rows("tok_emb", rows, count)
        o.set_schedule(sched)
    grads = [grads_for(rng, [2, 9, 31, 5]) for _ in range(4)]

    def one(o):
        _, scale = o.clip_grad_norm(1.0)
        o.step(grad_scale=scale)

    # step 1 eagerly on both (compiles, allocates the norm buffers), then capture the graph's step on og
    write_grads(pe, grads[0], cp)
    write_grads(pg, grads[0], cp)
    one(oe)
    one(og)
    oe.zero_grad()
    og.zero_grad()
    cp.cuda.Device().synchronize()  # the non-blocking capture stream does not wait for the default stream
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        one(og)
        graph = s.end_capture()
    for g in grads[1:]:
        write_grads(pe, g, cp)
        one(oe)
        oe.zero_grad()
        with s:
            write_grads(pg, g, cp)
        s.synchronize()
        graph.launch(s)
        s.synchronize()
        with s:
            og.zero_grad()
        s.synchronize()
    assert og.step_count == oe.step_count == 4
    for a, b in zip(pe, pg):
        assert np.array_equal(to_host(a.data), to_host(b.data)), a.name
        assert np.array_equal(to_host(oe.shadow(a)).view(np.uint16), to_host(og.shadow(b)).view(np.uint16))


def test_lazy_zero_grad_gives_bit_identical_training():
    """zero_grad(lazy=True): the first backward write overwrites (GEMM beta=0, embedding backward without
    accumulate, leaf gradients assigned) instead of adding to a zeroed buffer -- the same numbers, bit for bit,
    over several steps with two micro-batches each."""
    cfg = ck.LlamaConfig(vocab_size=17, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, 17, (2, 8)).astype(np.int32), rng.integers(0, 17, (2, 8)).astype(np.int32))
               for _ in range(6)]
    finals = []
    for lazy in (False, True):
        model = ck.Llama(cfg, xp=np, seed=1)
        params = model.parameters()
        opt = ck.optim.AdamW(params, lr=1e-2, weight_decay=0.1, shadow_dtype=None)
        for step in range(3):
            opt.zero_grad(lazy=lazy)
            for x, y in batches[2 * step: 2 * step + 2]:
                model(x, y).backward()
            norm, scale = opt.clip_grad_norm(1.0)
            opt.step(grad_scale=scale)
        finals.append([p.data.copy() for p in params])
    for a, b in zip(*finals):
        assert np.array_equal(a, b)
