"""Gradient checks of every autograd Function against float64 central finite differences (NumPy path).

Plain-array Functions (and the composite layers built from them) are checked in float64 directly. Kernel-family
Functions take fp32 (the ops accept fp32/bf16): their analytic gradient (the op's backward reference) is
compared with finite differences of an independent float64 formula of the same forward (the composite path).
"""
import numpy as np
import pytest

import cukernels as ck
from cukernels import functional as F
from cukernels.autograd import Tensor


def _needs(*ops):
    """Documents which kernel ops a test exercises (all are exported by cukernels; a missing one fails)."""
    missing = [o for o in ops if not hasattr(ck, o)]
    assert not missing, f"cukernels lacks {missing}"
    return lambda f: f


def numgrad(f, a, eps=1e-6):
    """d f / d a by central differences; f() -> float reads a (modified in place)."""
    g = np.zeros(a.shape, dtype=np.float64)
    for idx in np.ndindex(a.shape):
        old = a[idx]
        a[idx] = old + eps
        fp = f()
        a[idx] = old - eps
        fm = f()
        a[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


def gradcheck(fn, arrays, rng, rtol=1e-5, atol=1e-7, wrt=None):
    """fn(*Tensors) -> Tensor; checks every float input (or those in wrt) against finite differences."""
    arrays = [np.array(a) for a in arrays]
    ts = [Tensor(a, requires_grad=True) if a.dtype.kind == "f" else a for a in arrays]
    out = fn(*ts)
    R = rng.standard_normal(out.shape)
    (out * R).sum().backward()
    wrt = range(len(arrays)) if wrt is None else wrt

    def f():
        return float((fn(*[Tensor(a) if a.dtype.kind == "f" else a for a in arrays]).data * R).sum())

    for i in wrt:
        if arrays[i].dtype.kind != "f":
            continue
        num = numgrad(f, arrays[i])
        np.testing.assert_allclose(ts[i].grad, num, rtol=rtol, atol=atol, err_msg=f"input {i}")


def r64(rng, *shape, lo=None):
    a = rng.standard_normal(shape)
    return np.abs(a) + lo if lo is not None else a


# ----------------------------------------------------------------------------------------- primitives
@pytest.mark.parametrize("name,fn,shapes", [
    ("add", lambda a, b: a + b, [(3, 4), (4,)]),
    ("add_bcast", lambda a, b: a + b, [(2, 3, 4), (2, 1, 4)]),
    ("sub", lambda a, b: a - b, [(3, 4), (3, 1)]),
    ("mul", lambda a, b: a * b, [(3, 4), (1, 4)]),
    ("div", lambda a, b: a / b, [(3, 4), (3, 4)]),
    ("scalar_ops", lambda a: (2.0 * a - 1.0) * 0.5 + 3.0, [(5,)]),
    ("pow", lambda a: F.pow(a, 3), [(3, 4)]),
    ("exp", lambda a: F.exp(a), [(3, 4)]),
    ("sigmoid", lambda a: F.sigmoid(a), [(3, 4)]),
    ("tanh", lambda a: F.tanh(a), [(3, 4)]),
    ("sum_axis", lambda a: F.sum(a, axis=1), [(2, 3, 4)]),
    ("sum_keep", lambda a: F.sum(a, axis=-1, keepdims=True), [(2, 3, 4)]),
    ("mean", lambda a: F.mean(a, axis=(0, 2)), [(2, 3, 4)]),
    ("reshape", lambda a: F.reshape(a, (4, 6)) * 1.0, [(2, 3, 4)]),
    ("transpose", lambda a: F.transpose(a, (2, 0, 1)), [(2, 3, 4)]),
    ("contiguous", lambda a: F.contiguous(F.transpose(a, (1, 0))), [(3, 4)]),
    ("getitem", lambda a: a[:, 1:3], [(3, 4)]),
    ("concat", lambda a, b: F.concat([a, b], axis=1), [(2, 3), (2, 2)]),
    ("matmul", lambda a, b: F.matmul(a, b), [(2, 3, 4), (2, 4, 5)]),
    ("matmul_tb", lambda a, b: F.matmul(a, b, trans_b=True), [(2, 3, 4), (2, 5, 4)]),
    ("linear", lambda x, w: F.linear(x, w), [(2, 3, 4), (5, 4)]),
    ("silu", lambda a: F.silu(a), [(3, 4)]),
])
def test_primitive_grad(name, fn, shapes, rng):
    gradcheck(fn, [r64(rng, *s) for s in shapes], rng)


def test_positive_domain_grads(rng):
    gradcheck(lambda a: F.log(a), [r64(rng, 3, 4, lo=0.5)], rng)
    gradcheck(lambda a: F.rsqrt(a), [r64(rng, 3, 4, lo=0.5)], rng)


def test_cast_masked_fill_take_pick(rng):
    a = Tensor(r64(rng, 3), requires_grad=True)
    g = rng.standard_normal(3).astype(np.float32)
    (F.cast(a, np.float32) * g).sum().backward()  # cast's gradient: the upstream one, back in the source dtype
    assert a.grad.dtype == np.float64
    np.testing.assert_array_equal(a.grad, g.astype(np.float64))
    mask = rng.random((3, 4)) < 0.4
    gradcheck(lambda a: F.masked_fill(a, mask, -7.0), [r64(rng, 3, 4)], rng)
    ids = np.array([[0, 2, 2], [4, 0, 1]])
    gradcheck(lambda t: F.Take.apply(t, ids), [r64(rng, 5, 3)], rng)
    tg = np.array([1, 0, 3])
    gradcheck(lambda x: F.PickLast.apply(x, tg), [r64(rng, 3, 4)], rng)


# ------------------------------------------------------------------------------------ composite layers
def test_composite_layer_grads(rng):
    C = 6
    gradcheck(lambda x, w: F.rms_norm(x, w, 1e-5, fused=False), [r64(rng, 2, 3, C), r64(rng, C)], rng)
    gradcheck(lambda x, g, b: F.layer_norm(x, g, b, 1e-5, fused=False), [r64(rng, 3, C), r64(rng, C), r64(rng, C)], rng)
    gradcheck(lambda x: F.softmax(x, fused=False), [r64(rng, 3, C)], rng)
    km = np.array([[True, True, False, True], [False, False, False, False]])
    gradcheck(lambda s: F.attn_softmax(s, causal=True, scale=0.7, key_mask=km, fused=False),
              [r64(rng, 2, 2, 3, 4)], rng)
    gradcheck(lambda a, b: F.swiglu(a, b, fused=False), [r64(rng, 3, 4), r64(rng, 3, 4)], rng)
    gradcheck(lambda a: F.swiglu_packed(a, fused=False), [r64(rng, 3, 8)], rng)
    gradcheck(lambda a: F.gelu(a, fused=False), [r64(rng, 3, 4)], rng)
    cos, sin = ck.rope_cache(5, 4, theta=10000.0, scaling=None, xp=np)
    gradcheck(lambda x: F.rope(x, cos.astype(np.float64), sin.astype(np.float64), fused=False),
              [r64(rng, 2, 3, 2, 4)], rng)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_composite_cross_entropy(smoothing, rng):
    t = np.array([1, -100, 3, 0])
    gradcheck(lambda x: F.cross_entropy(x, t, label_smoothing=smoothing, fused=False), [r64(rng, 4, 5)], rng)
    x = r64(rng, 4, 5)
    lse = np.log(np.exp(x).sum(-1))
    logp = x - lse[:, None]
    v = t != -100
    nll = -logp[np.arange(4), np.where(v, t, 0)]
    ref = ((1 - smoothing) * nll + smoothing * -logp.mean(-1))[v].mean()
    got = F.cross_entropy(Tensor(x), t, label_smoothing=smoothing, fused=False).data
    np.testing.assert_allclose(got, ref, rtol=1e-12)


def test_composite_attn_softmax_values(rng):
    s = r64(rng, 1, 2, 3, 5)
    p = F.attn_softmax(Tensor(s), causal=True, scale=0.5, fused=False).data
    Tq, Tk = 3, 5
    ref = np.zeros_like(s)
    for i in range(Tq):
        k = i + Tk - Tq + 1
        e = np.exp(0.5 * s[..., i, :k] - (0.5 * s[..., i, :k]).max(-1, keepdims=True))
        ref[..., i, :k] = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(p, ref, rtol=1e-12)
    km = np.zeros((1, 5), bool)
    p0 = F.attn_softmax(Tensor(s), key_mask=km, fused=False).data
    assert np.all(p0 == 0)  # fully masked rows give zeros


# ------------------------------------------------------------------------- kernel-family Functions
def fused_check(fused_fn, ref_fn, arrays, rng, rtol=2e-4, atol=2e-5, wrt=None):
    """Kernel Function on fp32 inputs vs a float64 composite reference: forward values, and the analytic
    gradient vs finite differences of the float64 reference."""
    a32 = [a.astype(np.float32) if a.dtype.kind == "f" else a for a in arrays]
    a64 = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in a32]
    ts = [Tensor(a, requires_grad=True) if a.dtype.kind == "f" else a for a in a32]
    out = fused_fn(*ts)
    ref = ref_fn(*[Tensor(a) if a.dtype.kind == "f" else a for a in a64]).data
    np.testing.assert_allclose(out.data, ref, rtol=rtol, atol=atol, err_msg="forward")
    R = rng.standard_normal(out.shape)
    (out * R.astype(np.float32)).sum().backward()

    def f():
        return float((ref_fn(*[Tensor(a) if a.dtype.kind == "f" else a for a in a64]).data * R).sum())

    for i in (range(len(arrays)) if wrt is None else wrt):
        if a64[i].dtype.kind != "f":
            continue
        num = numgrad(f, a64[i])
        np.testing.assert_allclose(ts[i].grad, num, rtol=rtol * 10, atol=atol * 10, err_msg=f"grad of input {i}")


@_needs("rms_norm")
def test_rms_norm_function(rng):
    fused_check(lambda x, w: F.rms_norm(x, w, 1e-5), lambda x, w: F.rms_norm(x, w, 1e-5, fused=False),
                [r64(rng, 2, 3, 8), r64(rng, 8)], rng)


@_needs("layer_norm")
def test_layer_norm_function(rng):
    fused_check(lambda x, g, b: F.layer_norm(x, g, b, 1e-5), lambda x, g, b: F.layer_norm(x, g, b, 1e-5, fused=False),
                [r64(rng, 3, 8), r64(rng, 8), r64(rng, 8)], rng)


@_needs("softmax")
def test_softmax_function(rng):
    fused_check(lambda x: F.softmax(x), lambda x: F.softmax(x, fused=False), [r64(rng, 3, 7)], rng)


@_needs("attn_softmax")
@pytest.mark.parametrize("causal", [False, True])
def test_attn_softmax_function(causal, rng):
    fused_check(lambda s: F.attn_softmax(s, causal=causal, scale=0.6),
                lambda s: F.attn_softmax(s, causal=causal, scale=0.6, fused=False), [r64(rng, 2, 2, 3, 5)], rng)


@_needs("cross_entropy_fused", "cross_entropy_backward")
@pytest.mark.parametrize("fused_backward", [True, False])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_function(fused_backward, smoothing, rng):
    t = np.array([1, -100, 3, 0, 4], dtype=np.int32)
    kw = dict(label_smoothing=smoothing)
    # seeded backward (loss.backward()): the dlogits of the fused forward pass straight through
    x = r64(rng, 5, 6).astype(np.float32)
    xt = Tensor(x.copy(), requires_grad=True)
    loss = F.cross_entropy(xt, t, fused_backward=fused_backward, **kw)
    ref = F.cross_entropy(Tensor(x.astype(np.float64)), t, fused=False, **kw)
    np.testing.assert_allclose(loss.data, ref.data, rtol=1e-5)
    loss.backward()
    a64 = x.astype(np.float64)
    num = numgrad(lambda: float(F.cross_entropy(Tensor(a64), t, fused=False, **kw).data), a64)
    np.testing.assert_allclose(xt.grad, num, rtol=2e-4, atol=2e-6)
    # a non-unit upstream gradient (loss * 3 -> backward) scales dlogits
    fused_check(lambda z: F.cross_entropy(z, t, fused_backward=fused_backward, **kw) * 3.0,
                lambda z: F.cross_entropy(z, t, fused=False, **kw) * 3.0, [x], rng)


@_needs("cross_entropy_fused")
def test_cross_entropy_inplace_overwrites_logits_only_when_asked(rng):
    x = r64(rng, 4, 6).astype(np.float32)
    t = np.array([0, 1, 2, 3], dtype=np.int32)
    xt = Tensor(x.copy(), requires_grad=True)
    F.cross_entropy(xt, t).backward()
    np.testing.assert_array_equal(xt.data, x)


@_needs("embedding", "embedding_backward")
def test_embedding_function(rng):
    ids = np.array([[0, 3, 3], [1, 0, 4]], dtype=np.int32)
    fused_check(lambda tb: F.embedding(tb, ids), lambda tb: F.embedding(tb, ids, fused=False), [r64(rng, 5, 4)], rng)
    # accumulation straight into an existing .grad buffer (identity kept)
    tb = Tensor(r64(rng, 5, 4).astype(np.float32), requires_grad=True)
    buf = np.ones((5, 4), np.float32)
    tb.grad = buf
    g = rng.standard_normal((2, 3, 4)).astype(np.float32)
    (F.embedding(tb, ids) * g).sum().backward()
    ref = np.ones((5, 4))
    np.add.at(ref, ids.reshape(-1), g.reshape(-1, 4))
    assert tb.grad is buf
    np.testing.assert_allclose(buf, ref, rtol=1e-6)


@_needs("embedding", "SparseRowGrad")
def test_sparse_embedding_function(rng):
    ids = np.array([[0, 3, 3], [1, 0, 4]], dtype=np.int32)
    tb = Tensor(r64(rng, 6, 4).astype(np.float32), requires_grad=True)
    g = rng.standard_normal((2, 3, 4)).astype(np.float32)
    (F.embedding(tb, ids, sparse=True) * g).sum().backward()
    assert tb.grad is None and tb.sparse_grad is not None
    ref = np.zeros((6, 4))
    np.add.at(ref, ids.reshape(-1), g.reshape(-1, 4))
    sg = tb.sparse_grad.grad
    sg = sg.get() if hasattr(sg, "get") else sg
    np.testing.assert_allclose(sg, ref, rtol=1e-6, atol=1e-7)


@_needs("rope", "rope_backward")
def test_rope_function(rng):
    cos, sin = ck.rope_cache(7, 8, theta=10000.0, scaling=None, xp=np)
    fused_check(lambda x: F.rope(x, cos, sin), lambda x: F.rope(x, cos.astype(np.float64), sin.astype(np.float64),
                                                                fused=False), [r64(rng, 2, 5, 3, 8)], rng)


@_needs("swiglu", "swiglu_backward", "swiglu_packed", "swiglu_packed_backward")
def test_swiglu_functions(rng):
    fused_check(lambda a, b: F.swiglu(a, b), lambda a, b: F.swiglu(a, b, fused=False),
                [r64(rng, 3, 5), r64(rng, 3, 5)], rng)
    fused_check(lambda a: F.swiglu_packed(a), lambda a: F.swiglu_packed(a, fused=False), [r64(rng, 3, 10)], rng)


@_needs("gelu", "gelu_backward")
def test_gelu_function(rng):
    fused_check(lambda a: F.gelu(a), lambda a: F.gelu(a, fused=False), [r64(rng, 3, 7)], rng)


# ------------------------------------------------------------------------------------ tape semantics
def test_accumulates_in_place_into_existing_grad(rng):
    w = Tensor(rng.standard_normal((3, 4)), requires_grad=True)
    buf = np.full((3, 4), 2.0)
    w.grad = buf
    x = rng.standard_normal((5, 4))
    g = rng.standard_normal((5, 3))
    (F.linear(x, w) * g).sum().backward()
    assert w.grad is buf
    np.testing.assert_allclose(buf, 2.0 + g.T @ x, rtol=1e-12)
    (F.linear(x, w) * g).sum().backward()
    np.testing.assert_allclose(buf, 2.0 + 2 * g.T @ x, rtol=1e-12)


def test_shared_input_and_fresh_grad_is_a_copy(rng):
    a = Tensor(rng.standard_normal(4), requires_grad=True)
    (a * a + a).sum().backward()
    np.testing.assert_allclose(a.grad, 2 * a.data + 1)
    b = Tensor(rng.standard_normal(4), requires_grad=True)
    y = b + 0.0
    y.sum().backward()
    g0 = b.grad.copy()
    (b + 0.0).sum().backward()
    np.testing.assert_allclose(b.grad, 2 * g0)


def test_no_grad_and_errors(rng):
    a = Tensor(rng.standard_normal(3), requires_grad=True)
    with ck.no_grad():
        y = a * 2.0
    assert not y.requires_grad
    with pytest.raises(RuntimeError, match="does not require a gradient"):
        y.sum().backward()
    z = (a * 2.0).sum()
    z.backward()
    np.testing.assert_allclose(a.grad, 2.0)


# ------------------------------------------------------------------------------ a friendlier Tensor
@pytest.mark.parametrize("data,kw,err,match", [
    ("abc", {}, TypeError, "expected numeric data"),
    (np.array([object()]), {}, TypeError, "expected a numeric dtype"),
    (np.arange(3), {"requires_grad": True}, TypeError, "only floating-point tensors can require a gradient"),
])
def test_tensor_refuses_what_it_cannot_differentiate(data, kw, err, match):
    with pytest.raises(err, match=match):
        ck.tensor(data, **kw)


def test_tensor_defaults_to_float32_and_backward_twice_raises():
    x = ck.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    assert x.dtype == np.float32
    y = (x ** 2).sum()
    y.backward()
    np.testing.assert_array_equal(x.grad, 2 * x.data)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.backward()
    z = (x * 3).sum()
    z.backward(retain_graph=True)
    z.backward()  # allowed: the first call kept the graph
    np.testing.assert_array_equal(x.grad, 2 * x.data + 6)


def test_tensor_methods_match_numpy_and_differentiate():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4)) + 3.0
    x = ck.tensor(a, requires_grad=True)  # float64 NumPy array kept as is: gradient checks
    for f, ref in [(lambda t: t.exp(), np.exp), (lambda t: t.log(), np.log), (lambda t: t.T, np.transpose),
                   (lambda t: t ** 3, lambda v: v ** 3), (lambda t: t[1:, ::2], lambda v: v[1:, ::2]),
                   (lambda t: t.reshape(2, 6), lambda v: v.reshape(2, 6)), (lambda t: t.mean(axis=0),
                                                                            lambda v: v.mean(axis=0)),
                   (lambda t: -t / 2.0, lambda v: -v / 2.0), (lambda t: 1.0 / t, lambda v: 1.0 / v)]:
        np.testing.assert_allclose(f(x).data, ref(a))
    y = (x.exp() * x.log()).sum()
    y.backward()
    np.testing.assert_allclose(x.grad, np.exp(a) * np.log(a) + np.exp(a) / a, rtol=1e-12)
    r = repr(x)
    assert r.startswith("Tensor([[") and "requires_grad=True" in r and "device=cpu" in r


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("gdt", ["f32", "bf16"])
def test_gpu_stale_gradient_overwrite_casts_like_astype(monkeypatch, fast, gdt):
    """A lazily zeroed (stale) .grad overwritten by an fp32 gradient: through ck.cast (ck.settings.fast_cast) into a
    bf16 or fp32 buffer, bit for bit what CuPy's assignment gives (round to nearest even), the view kept bound; a second
    backward adds."""
    import cupy as cp

    monkeypatch.setattr(ck.settings, "fast_cast", fast)
    dt = ck.bfloat16 if gdt == "bf16" else np.float32
    rng = np.random.default_rng(0)
    x = Tensor(cp.asarray(rng.standard_normal((37, 129)).astype(np.float32)), requires_grad=True)
    flat = cp.full(37 * 129 + 5, np.nan, dtype=dt)
    x.grad = flat[:37 * 129].reshape(37, 129)
    view = x.grad
    x.grad_stale = True
    w = cp.asarray(rng.standard_normal((37, 129)).astype(np.float32) * 3.7)
    (x * w).sum().backward()
    assert x.grad is view and not x.grad_stale
    assert np.array_equal(cp.asnumpy(view).view(np.uint8), cp.asnumpy(w.astype(dt)).view(np.uint8))
    (x * w).sum().backward()
    np.testing.assert_allclose(cp.asnumpy(view).astype(np.float32), 2 * cp.asnumpy(w.astype(dt)).astype(np.float32),
                               rtol=1e-2 if gdt == "bf16" else 1e-6)
    assert np.isnan(cp.asnumpy(flat[37 * 129:]).astype(np.float32)).all()  # nothing written past the view
