"""ck.adam_step / adam_step_rows / global_norm / clip_scale / zero_rows: reference vs float64, kernel vs reference."""
import numpy as np
import pytest

import cukernels as ck
from cukernels.ops import adam as A
from helpers import device_copy, randn, to_host

F32 = np.float32
BF16 = np.dtype(ck.bfloat16)


# ---------------------------------------------------------------- an independent float64 AdamW (textbook form)
def textbook_adamw(p, grads, *, lr, wd, b1=0.9, b2=0.999, eps=1e-8, scale=1.0, m=None, v=None, t0=0):
    """Loshchilov & Hutter's AdamW with bias-corrected moments, all float64; returns (p, m, v)."""
    p = p.astype(np.float64)
    m = np.zeros_like(p) if m is None else m.astype(np.float64)
    v = np.zeros_like(p) if v is None else v.astype(np.float64)
    for k, g in enumerate(grads):
        t = t0 + k + 1
        g = g.astype(np.float64) * scale
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        p = p - lr * wd * p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p, m, v


def _state(rng, shape, grad_dtype=F32, nsteps=1):
    p = randn(rng, shape, F32)
    grads = [randn(rng, shape, grad_dtype, scale=0.3) for _ in range(nsteps)]
    return p, grads


# ---------------------------------------------------------------- CPU: reference vs float64
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("shadow", [False, True])
@pytest.mark.parametrize("scale", [None, 0.5])
@pytest.mark.parametrize("gdt", [F32, ck.bfloat16], ids=["g32", "gbf16"])
def test_reference_matches_float64_over_steps(rng, wd, shadow, scale, gdt):
    lr = 2.0 ** -7  # exactly representable in fp32: the reference rounds lr to fp32, the textbook does not
    p0, grads = _state(rng, (37, 19), gdt, nsteps=6)
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    sh = np.full(p0.shape, np.nan, dtype=BF16) if shadow else None
    gs = None if scale is None else np.array(scale, dtype=F32)
    for t, g in enumerate(grads, 1):
        ck.adam_step(p, g, m, v, lr=lr, step=t, weight_decay=wd, shadow=sh, grad_scale=gs)
    pe, me, ve = textbook_adamw(p0, grads, lr=lr, wd=wd, scale=1.0 if scale is None else scale)
    np.testing.assert_allclose(p, pe, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(m, me, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v, ve, rtol=1e-5, atol=1e-9)
    if shadow:
        assert np.array_equal(sh.view(np.uint16), p.astype(BF16).view(np.uint16))
    # The update actually moved the parameter, and weight decay pulls toward 0 when on.
    assert not np.allclose(p, p0)


def test_reference_weight_decay_is_decoupled(rng):
    """A zero gradient with wd > 0 only scales the parameter by (1 - lr * wd): no moment contribution."""
    p = randn(rng, (100,), F32)
    p0 = p.copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    ck.adam_step(p, np.zeros_like(p), m, v, lr=0.125, step=1, weight_decay=0.5)
    np.testing.assert_allclose(p, p0 * (1 - 0.125 * 0.5), rtol=1e-7)
    assert not m.any() and not v.any()


@pytest.mark.parametrize("sdt", [np.int32, np.int64, np.float32])
def test_reference_array_scalars_equal_numbers(rng, sdt):
    p0, (g,) = _state(rng, (64,))
    m0, v0 = randn(rng, (64,), F32, 0.1), np.abs(randn(rng, (64,), F32, 0.1))
    outs = []
    for lr, step in ((1e-3, 7), (np.array(1e-3, F32), np.array(7, sdt))):
        p, m, v = p0.copy(), m0.copy(), v0.copy()
        ck.adam_step(p, g, m, v, lr=lr, step=step, weight_decay=0.01)
        outs.append((p, m, v))
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_reference_rows_match_float64_and_leave_other_rows(rng, wd):
    V, D = 50, 12
    p0 = randn(rng, (V, D), F32)
    rows = np.array([3, 17, 49, 0, 99, -2, 8, 8], dtype=np.int32)  # entries past count ignored
    count = np.array(4, dtype=np.int32)
    touched = np.array([3, 17, 49, 0])
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    sh = p0.astype(BF16)
    sh0 = sh.copy()
    grads = [randn(rng, (V, D), F32) for _ in range(3)]
    for t, g in enumerate(grads, 1):
        ck.adam_step_rows(p, g, m, v, rows, count, lr=1e-2, step=t, weight_decay=wd, shadow=sh)
    pe, me, ve = textbook_adamw(p0[touched], [g[touched] for g in grads], lr=float(np.float32(1e-2)), wd=wd)
    np.testing.assert_allclose(p[touched], pe, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(m[touched], me, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v[touched], ve, rtol=1e-5, atol=1e-9)
    other = np.setdiff1d(np.arange(V), touched)
    assert np.array_equal(p[other], p0[other]) and not m[other].any() and not v[other].any()
    assert np.array_equal(sh[other].view(np.uint16), sh0[other].view(np.uint16))
    assert np.array_equal(sh[touched].view(np.uint16), p[touched].astype(BF16).view(np.uint16))


def test_reference_rows_differ_from_dense_as_documented(rng):
    """Lazy Adam: an untouched row keeps its moments; dense Adam on the same zero-gradient row decays them."""
    V, D = 4, 8
    p, m, v = randn(rng, (V, D), F32), randn(rng, (V, D), F32), np.abs(randn(rng, (V, D), F32))
    g = np.zeros((V, D), F32)
    g[1] = 1.0
    rows, count = np.array([1], np.int32), np.array(1, np.int32)
    pl, ml, vl = p.copy(), m.copy(), v.copy()
    ck.adam_step_rows(pl, g, ml, vl, rows, count, lr=1e-2, step=5)
    pd, md, vd = p.copy(), m.copy(), v.copy()
    ck.adam_step(pd, g, md, vd, lr=1e-2, step=5)
    assert np.array_equal(pl[1], pd[1]) and np.array_equal(ml[1], md[1])
    assert np.array_equal(ml[0], m[0]) and not np.allclose(md[0], m[0])


def test_reference_zero_rows():
    buf = np.arange(40, dtype=F32).reshape(8, 5) + 1
    ck.zero_rows(buf, np.array([6, 2, 100, 5], np.int32), np.array(3, np.int32))
    assert not buf[[2, 6]].any()
    assert buf[[0, 1, 3, 4, 5, 7]].all()


def test_reference_global_norm_and_clip(rng):
    arrs = [randn(rng, (7, 3), F32), randn(rng, (5,), ck.bfloat16), np.zeros((0, 4), F32)]
    ref = np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in arrs))
    n = ck.global_norm(arrs)
    assert n.shape == () and n.dtype == F32
    np.testing.assert_allclose(float(n), ref, rtol=1e-7)
    np.testing.assert_allclose(float(ck.global_norm(arrs[0])), np.linalg.norm(arrs[0].astype(np.float64)), rtol=1e-7)
    for norm, mx, want in ((4.0, 1.0, 1.0 / (4.0 + 1e-6)), (0.5, 1.0, 1.0), (np.inf, 1.0, 0.0)):
        s = ck.clip_scale(np.array(norm, F32), mx)
        assert s.shape == () and s.dtype == F32
        np.testing.assert_allclose(float(s), want, rtol=1e-6)
    assert np.isnan(ck.clip_scale(np.array(np.nan, F32), 1.0))


def test_warmup_cosine_formula():
    f = lambda t: A.warmup_cosine(t, 1.0, 0.1, 10, 110)  # noqa: E731
    assert f(5) == 0.5 and f(10) == 1.0
    np.testing.assert_allclose(f(60), 0.55)
    np.testing.assert_allclose([f(110), f(500)], [0.1, 0.1])
    assert A.warmup_cosine(1, 1.0, 0.0, 0, 0) == 0.0  # total reached at once: min_lr


def test_reference_tick():
    step, lr = np.array(0, np.int32), np.array(0.5, F32)
    A.tick(step, lr)
    assert int(step) == 1 and float(lr) == 0.5
    A.tick(step, lr, schedule=(1.0, 0.1, 10, 110))
    assert int(step) == 2 and float(lr) == np.float32(0.2)


# ---------------------------------------------------------------- CPU: bad inputs
def _bufs(n=8, gdt=F32):
    return np.zeros(n, F32), np.zeros(n, gdt), np.zeros(n, F32), np.zeros(n, F32)


@pytest.mark.parametrize("mutate, exc, msg", [
    (lambda b: (b[0].astype(np.float64),) + b[1:], TypeError, "param: expected dtype float32"),
    (lambda b: (b[0], b[1].astype(np.float16)) + b[2:], TypeError, "grad: expected dtype"),
    (lambda b: b[:3] + (np.zeros(9, F32),), ValueError, "exp_avg_sq: expected 8 elements"),
    (lambda b: (np.zeros(16, F32)[::2],) + b[1:], ValueError, "param: expected a C-contiguous"),
    (lambda b: (b[0], b[1], b[0], b[3]), ValueError, "exp_avg: overlaps param"),
])
def test_bad_buffers(mutate, exc, msg):
    with pytest.raises(exc, match=msg):
        ck.adam_step(*mutate(_bufs()), lr=1e-3, step=1)


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(lr=np.nan, step=1), ValueError, "lr: expected a finite number"),
    (dict(lr=np.array(1e-3, np.float64), step=1), TypeError, "lr: expected dtype float32"),
    (dict(lr=np.array([1e-3], F32), step=1), ValueError, "lr: expected a 0-d array"),
    (dict(lr="0.1", step=1), TypeError, "lr: expected a number or a 0-d"),
    (dict(lr=1e-3, step=0), ValueError, "step: expected the 1-based step number"),
    (dict(lr=1e-3, step=np.array(1, np.int16)), TypeError, "step: expected dtype"),
    (dict(lr=1e-3, step=1, beta2=1.0), ValueError, r"beta2: expected a finite number in \[0, 1\)"),
    (dict(lr=1e-3, step=1, eps=-1.0), ValueError, "eps: expected a finite number"),
    (dict(lr=1e-3, step=1, grad_scale=np.array(1.0, np.float64)), TypeError, "grad_scale: expected dtype"),
    (dict(lr=1e-3, step=1, shadow=np.zeros(8, F32)), TypeError, "shadow: expected dtype bfloat16"),
])
def test_bad_scalars(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        ck.adam_step(*_bufs(), **kw)


def test_bad_rows_and_norm_inputs():
    p = np.zeros((4, 3), F32)
    rows, cnt = np.zeros(2, np.int32), np.array(1, np.int32)
    with pytest.raises(ValueError, match="param: expected a 2-D"):
        ck.adam_step_rows(*_bufs(12), rows, cnt, lr=1e-3, step=1)
    with pytest.raises(ValueError, match=r"grad: expected shape \(4, 3\)"):
        ck.adam_step_rows(p, np.zeros((3, 4), F32), p.copy(), p.copy(), rows, cnt, lr=1e-3, step=1)
    with pytest.raises(TypeError, match="rows: expected dtype int32"):
        ck.adam_step_rows(p, p.copy(), p.copy(), p.copy(), rows.astype(np.int64), cnt, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="row_count: expected a 0-d array"):
        ck.zero_rows(p, rows, np.array([1], np.int32))
    with pytest.raises(ValueError, match="arrays: expected at least one array"):
        ck.global_norm([])
    with pytest.raises(TypeError, match=r"arrays\[1\]: expected dtype"):
        ck.global_norm([p, np.zeros(3, np.float64)])
    with pytest.raises(ValueError, match="max_norm: expected a finite number > 0"):
        ck.clip_scale(np.array(1.0, F32), 0.0)


@pytest.mark.gpu
def test_mixing_modules_is_a_type_error():
    import cupy as cp

    with pytest.raises(TypeError, match="grad: is a cupy array but param is a numpy array"):
        ck.adam_step(np.zeros(4, F32), cp.zeros(4, F32), np.zeros(4, F32), np.zeros(4, F32), lr=1e-3, step=1)
    with pytest.raises(TypeError, match="lr: is a numpy array but param is a cupy array"):
        ck.adam_step(*(cp.zeros(4, F32) for _ in range(4)), lr=np.array(1e-3, F32), step=1)


# ---------------------------------------------------------------- GPU: kernel against the reference
SIZES = [1, 3, 8, 1023, 4097, 10**6 + 3]


def _gpu_case(rng, n, gdt, misalign, shadow, scale):
    p = randn(rng, (n,), F32)
    g = randn(rng, (n,), gdt, scale=0.3)
    m = randn(rng, (n,), F32, scale=0.05)
    v = (np.abs(randn(rng, (n,), F32, scale=0.05)) + 1e-4).astype(F32)
    host = [p, g, m, v]
    dev = [device_copy(a, misalign) for a in host]
    sh_h = np.zeros(n, BF16) if shadow else None
    sh_d = None
    if shadow:
        import cupy as cp

        sh_d = cp.full(n + 1, np.nan, dtype=F32).astype(BF16)[1:] if misalign else \
            cp.full(n, np.nan, dtype=F32).astype(BF16)
    gs_h = None if scale is None else np.array(scale, F32)
    gs_d = None if scale is None else device_copy(gs_h)
    return host, dev, sh_h, sh_d, gs_h, gs_d


def _check_adam(dev, host, sh_d, what=""):
    for name, d, h, rtol, atol in (("param", dev[0], host[0], 2e-6, 1e-6), ("exp_avg", dev[2], host[2], 1e-5, 1e-7),
                                   ("exp_avg_sq", dev[3], host[3], 1e-5, 1e-9)):
        got = to_host(d)
        assert not np.isnan(got).any(), f"{what} {name}: NaN"
        np.testing.assert_allclose(got, h, rtol=rtol, atol=atol, err_msg=f"{what} {name}")
    if sh_d is not None:
        # The shadow is exactly the kernel's own fp32 param rounded to nearest-even bf16.
        assert np.array_equal(to_host(sh_d).view(np.uint16), to_host(dev[0]).astype(BF16).view(np.uint16)), \
            f"{what} shadow != bf16(param)"


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gdt", [F32, ck.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("shadow", [False, True], ids=["noshadow", "shadow"])
def test_gpu_adam_matches_reference(rng, n, gdt, misalign, shadow):
    scale = 0.75 if shadow else None
    wd = 0.1 if misalign else 0.0
    host, dev, sh_h, sh_d, gs_h, gs_d = _gpu_case(rng, n, gdt, misalign, shadow, scale)
    for t in (1, 2, 3):
        ck.adam_step(*host, lr=1e-2, step=t, weight_decay=wd, shadow=sh_h, grad_scale=gs_h)
        ck.adam_step(*dev, lr=1e-2, step=t, weight_decay=wd, shadow=sh_d, grad_scale=gs_d)
    _check_adam(dev, host, sh_d, f"n={n}")
    if shadow:
        np.testing.assert_allclose(to_host(sh_d).astype(F32), sh_h.astype(F32), rtol=8e-3, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("sdt", [np.int32, np.int64, np.float32])
def test_gpu_device_scalars_equal_numbers(rng, sdt):
    """lr / step / grad_scale read from device memory give bit-identical results to Python numbers."""
    import cupy as cp

    host, dev, _, _, _, _ = _gpu_case(rng, 4099, F32, False, False, None)
    a = [d.copy() for d in dev]
    b = [d.copy() for d in dev]
    ck.adam_step(*a, lr=3e-3, step=11, weight_decay=0.05, grad_scale=0.5)
    ck.adam_step(*b, lr=cp.array(3e-3, F32), step=cp.array(11, sdt), weight_decay=0.05,
                 grad_scale=cp.array(0.5, F32))
    for x, y in zip(a, b):
        assert np.array_equal(to_host(x), to_host(y))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [2048, 100, 8], ids=["D2048", "D100", "D8"])
@pytest.mark.parametrize("gdt", [F32, ck.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_rows_match_reference_and_leave_other_rows(rng, D, gdt, misalign):
    import cupy as cp

    V = 3001
    p = randn(rng, (V, D), F32)
    g = randn(rng, (V, D), gdt)
    m = randn(rng, (V, D), F32, scale=0.05)
    v = (np.abs(randn(rng, (V, D), F32, scale=0.05)) + 1e-4).astype(F32)
    sh = p.astype(BF16)
    cap = 700
    rows = rng.permutation(V)[:cap].astype(np.int32)
    rows[5], rows[9] = V + 3, -1  # out of range: skipped
    count = np.array(517, np.int32)
    host = [p.copy(), g, m.copy(), v.copy()]
    dev = [device_copy(a, misalign) for a in (p, g, m, v)]
    sh_h, sh_d = sh.copy(), device_copy(sh, misalign)
    rows_d, count_d = device_copy(rows), device_copy(count)
    lr_d, step_d = cp.array(1e-2, F32), cp.array(4, np.int32)
    touched = np.unique(rows[:517][(rows[:517] >= 0) & (rows[:517] < V)])
    # the NumPy path refuses out-of-range rows (issue 36): its reference gets the rows the kernel keeps
    ck.adam_step_rows(*host, touched.astype(np.int32), np.array(touched.size, np.int32), lr=1e-2, step=4,
                      weight_decay=0.1, shadow=sh_h)
    ck.adam_step_rows(*dev, rows_d, count_d, lr=lr_d, step=step_d, weight_decay=0.1, shadow=sh_d)
    other = np.setdiff1d(np.arange(V), touched)
    for d, orig in ((dev[0], p), (dev[2], m), (dev[3], v)):
        assert np.array_equal(to_host(d)[other], orig[other]), "an untouched row changed"
    assert np.array_equal(to_host(sh_d)[other].view(np.uint16), sh[other].view(np.uint16))
    _check_adam(dev, host, sh_d, f"rows D={D}")
    # Changing the device count alone changes what the same launch does (no host involvement).
    count_d.fill(0)
    before = to_host(dev[0])
    ck.adam_step_rows(*dev, rows_d, count_d, lr=lr_d, step=step_d, shadow=sh_d)
    assert np.array_equal(to_host(dev[0]), before)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [F32, ck.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("D", [64, 7])
def test_gpu_zero_rows(rng, dt, D):
    V = 257
    buf = (np.abs(randn(rng, (V, D), F32)) + 1).astype(dt)
    rows = rng.permutation(V)[:40].astype(np.int32)
    rows[3] = 10**6
    count = np.array(33, np.int32)
    ref = ck.zero_rows(buf.copy(), rows, count)
    for mis in (False, True):
        d = device_copy(buf, mis)
        ck.zero_rows(d, device_copy(rows), device_copy(count))
        assert np.array_equal(to_host(d).astype(F32), ref.astype(F32))


@pytest.mark.gpu
def test_gpu_global_norm_matches_reference_and_is_deterministic(rng):
    import cupy as cp

    shapes = [(1,), (3,), (1023,), (4097, 3), (0,), (10**6 + 3,), (7, 9)]
    host = [randn(rng, s, F32 if i % 2 == 0 else ck.bfloat16, scale=2.0) for i, s in enumerate(shapes)]
    dev = [device_copy(a, misalign=(i % 3 == 1 and a.size > 0)) for i, a in enumerate(host)]
    ref = float(ck.global_norm(host))
    out = cp.full((), np.nan, F32)
    n1 = ck.global_norm(dev, out=out)
    assert n1 is out
    np.testing.assert_allclose(float(n1), ref, rtol=1e-5)
    n2 = ck.global_norm(dev, workspace=A.global_norm_workspace(dev))
    assert to_host(n1).tobytes() == to_host(n2).tobytes(), "global_norm must be bit-identical run to run"
    big = cp.random.standard_normal(3 * 10**7, dtype=cp.float32)
    a, b = ck.global_norm(big), ck.global_norm(big)
    assert to_host(a).tobytes() == to_host(b).tobytes()
    np.testing.assert_allclose(float(a), float(cp.sqrt((big.astype(cp.float64) ** 2).sum())), rtol=1e-5)
    for norm in (0.0, 0.5, 3.0, np.inf, np.nan):
        got = to_host(ck.clip_scale(cp.array(norm, F32), 1.0))
        want = ck.clip_scale(np.array(norm, F32), 1.0)
        assert got.tobytes() == want.tobytes() or (np.isnan(got) and np.isnan(want))


@pytest.mark.gpu
def test_gpu_adam_captures_with_device_lr_and_step(rng):
    """Captured once; lr, step and grad_scale change between replays through device memory."""
    import cupy as cp

    n = 5003
    host, dev, sh_h, sh_d, _, _ = _gpu_case(rng, n, ck.bfloat16, False, True, None)
    lr_d, step_d, gs_d = cp.array(0.0, F32), cp.array(0, np.int64), cp.array(1.0, F32)
    ck.adam_step(*[d.copy() for d in dev], lr=1e-3, step=1, shadow=sh_d.copy(), grad_scale=gs_d)  # compile
    cp.cuda.Device().synchronize()  # the non-blocking capture stream does not wait for the default stream
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.adam_step(*dev, lr=lr_d, step=step_d, weight_decay=0.1, shadow=sh_d, grad_scale=gs_d)
        graph = s.end_capture()
    for t, (lr, gs) in enumerate(((1e-2, 1.0), (5e-3, 0.5), (2e-2, 0.25)), 1):
        with s:
            lr_d.fill(lr)
            step_d.fill(t)
            gs_d.fill(gs)
        graph.launch(s)
        s.synchronize()
        ck.adam_step(*host, lr=lr, step=t, weight_decay=0.1, shadow=sh_h, grad_scale=np.array(gs, F32))
        _check_adam(dev, host, sh_d, f"replay {t}")


def test_reference_global_norm_over_listed_rows(rng):
    """rows=: only rows[0:count] of a (V, D) matrix count (out-of-range entries skipped, count clamped)."""
    g = randn(rng, (50, 7), F32)
    dense = randn(rng, (11,), ck.bfloat16)
    rows, count = np.array([4, 17, 60, 3, 9, 9], np.int32), np.array(4, np.int32)  # 60 skipped, 9s past count
    n = ck.global_norm([dense, g], rows=[None, (rows, count)])
    want = np.sqrt((dense.astype(np.float64) ** 2).sum() + (g[[4, 17, 3]].astype(np.float64) ** 2).sum())
    np.testing.assert_allclose(float(n), want, rtol=1e-7)
    with pytest.raises(ValueError, match="rows: expected a list with one entry per array"):
        ck.global_norm([dense, g], rows=[None])
    with pytest.raises(ValueError, match=r"rows\[0\]: listed rows need a 2-D"):
        ck.global_norm([dense, g], rows=[(rows, count), None])
    with pytest.raises(TypeError, match="rows: expected dtype int32"):
        ck.global_norm([g], rows=[(rows.astype(np.int64), count)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D", [(F32, 2048), (F32, 7), (ck.bfloat16, 64), (ck.bfloat16, 13)])
def test_gpu_global_norm_over_listed_rows(rng, dtype, D):
    import cupy as cp

    V = 3001
    g = randn(rng, (V, D), dtype)
    rows = rng.permutation(V).astype(np.int32)
    rows[5] = V + 3  # skipped
    for count in (0, 1, 257, V, V + 10):
        c = np.array(count, np.int32)
        ref = float(ck.global_norm([g], rows=[(rows, c)]))
        dv = [device_copy(g)]
        r = [(cp.asarray(rows), cp.asarray(c))]
        got = ck.global_norm(dv, rows=r, workspace=A.global_norm_workspace(dv, r))
        np.testing.assert_allclose(float(got), ref, rtol=1e-5, atol=1e-30)


def test_occupancy_is_validated():
    p = np.zeros(16, np.float32)
    for bad in (0, -0.5, 64.5, float("nan")):
        with pytest.raises(ValueError, match="occupancy"):
            ck.adam_step(p, p.copy(), p.copy(), p.copy(), lr=0.1, step=1, occupancy=bad)
    with pytest.raises(TypeError, match="occupancy"):
        ck.adam_step(p, p.copy(), p.copy(), p.copy(), lr=0.1, step=1, occupancy="half")


@pytest.mark.gpu
@pytest.mark.parametrize("occupancy", [0.05, 0.5, 0.88, 3.0, 8.0, 64.0])
def test_gpu_occupancy_changes_the_grid_not_the_result(occupancy):
    """A smaller persistent grid (ZeroAdamW leaves SMs to NCCL) or several waves of shorter blocks walk the same
    elements: bit-identical."""
    import cupy as cp
    rng = np.random.default_rng(3)
    n = 3 * 2**20 + 5
    host = [rng.standard_normal(n).astype(np.float32) for _ in range(3)] + [rng.random(n).astype(np.float32)]
    outs = []
    for occ in (1.0, occupancy):
        p, g, m, v = (cp.asarray(a) for a in host)
        s = cp.full(n, np.nan, dtype=ck.bfloat16)
        ck.adam_step(p, g, m, v, lr=1e-3, step=3, weight_decay=0.1, shadow=s, occupancy=occ)
        outs.append([a.get() for a in (p, m, v, s)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# ---------------------------------------------------------------- FP8 shadows (adam_step(fp8_shadow=))
E4 = np.dtype(ck.float8_e4m3fn)
# Ranges that start and end inside the kernel's 8192-element chunks, two adjacent, one spanning three chunks (the
# middle one wholly inside it: the uniform path), then elements outside every range.
FP8_RANGES = [(16, (8, 48)), (400, (16, 16)), (656, (64, 96)), (6800, (32, 32)), (7824, (16, 32)), (9008, (128, 128))]
FP8_N = 30000


def _fp8_expect(p, fs_offsets, fs_shapes, amax_before, margin=0):
    """q, scale_inv and the new amax of each range from the updated p and the amax each range had before."""
    out = []
    for o, (r, c), a in zip(fs_offsets, fs_shapes, amax_before):
        x = p[o:o + r * c].reshape(r, c)
        s = A._fp8.ref_scale(a, E4, margin)
        out.append((A._fp8.ref_cast(x, s, E4), np.float32(1) / s, np.float32(np.abs(x).max())))
    return out


def test_reference_fp8_shadow_writes_codes_with_the_previous_amax(rng):
    p, g = randn(rng, (FP8_N,), F32), randn(rng, (FP8_N,), F32, scale=0.3)
    m, v = np.zeros(FP8_N, F32), np.zeros(FP8_N, F32)
    sh = np.full(FP8_N, np.nan, F32).astype(BF16)
    fs = ck.Fp8Shadow(p, FP8_RANGES)
    inside = np.zeros(FP8_N, bool)
    for o, (r, c) in FP8_RANGES:
        inside[o:o + r * c] = True
    for k, (o, (r, c)) in enumerate(FP8_RANGES):  # made from the present values, current scaling
        x = p[o:o + r * c].reshape(r, c)
        s = A._fp8.ref_scale(np.abs(x).max(), E4)
        assert np.array_equal(fs.q[k], A._fp8.ref_cast(x, s, E4)) and np.array_equal(fs.qt[k], fs.q[k].T)
    for t in (1, 2):
        before = [np.float32(np.abs(p[o:o + r * c]).max()) for o, (r, c) in FP8_RANGES]
        ck.adam_step(p, g, m, v, lr=0.05, step=t, shadow=sh, fp8_shadow=fs)
        for k, (q, si, amax) in enumerate(_fp8_expect(p, fs.offsets, fs.shapes, before)):
            assert np.array_equal(fs.q[k], q), f"step {t} range {k}"
            assert np.array_equal(fs.qt[k], q.T)
            assert fs.scale_inv[k] == si and fs.history[k][0] == A._fp8._as_bits(amax)
            assert not fs.history[k][1:].any()
        assert np.isnan(sh[inside].astype(F32)).all()  # no bf16 copy inside the ranges
        assert np.array_equal(sh[~inside].view(np.uint16), p[~inside].astype(BF16).view(np.uint16))
    # the dequantised copy is the weight to E4M3's precision (values beyond the old amax saturate)
    o, (r, c) = FP8_RANGES[2]
    deq = fs.q[2].view(E4).astype(np.float64) * float(fs.scale_inv[2])
    np.testing.assert_allclose(deq, p[o:o + r * c].reshape(r, c), rtol=0.07, atol=float(fs.scale_inv[2]) * 2 ** -9)
    fs2 = fs.with_range(8400, (16, 16))
    assert len(fs2) == 7 and fs2.q[0] is fs.q[0] and fs2.offsets[-2] == 8400


@pytest.mark.parametrize("ranges, exc, msg", [
    ([(8, (4, 4))], ValueError, r"ranges\[0\]: the offset \(8\) and the size \(4 x 4\) must be multiples of 16"),
    ([(0, (4, 3))], ValueError, "must be multiples of 16"),
    ([(32, (16, 16)), (0, (16, 16))], ValueError, r"ranges\[1\]: offset 0 overlaps or precedes"),
    ([(0, (16, 16)), (128, (16, 16))], ValueError, r"ranges\[1\]: offset 128 overlaps or precedes"),
    ([(4096, (16, 16))], ValueError, r"run past param \(4100 elements\)"),
    ([(0, 16)], TypeError, r"ranges\[0\]: expected \(offset, \(rows, cols\)\)"),
    ((0, (16, 16)), TypeError, r"ranges\[0\]: expected"),
    ("x", TypeError, "ranges: expected a list"),
])
def test_fp8_shadow_bad_ranges(ranges, exc, msg):
    with pytest.raises(exc, match=msg):
        ck.Fp8Shadow(np.zeros(4100, F32), ranges)


def test_fp8_shadow_bad_arguments():
    p, g, m, v = (np.zeros(64, F32) for _ in range(4))
    with pytest.raises(ValueError, match="param: expected the 1-D flat buffer"):
        ck.Fp8Shadow(p.reshape(8, 8), [])
    with pytest.raises(TypeError, match="fp8_shadow: expected a ck.Fp8Shadow"):
        ck.adam_step(p, g, m, v, lr=1e-3, step=1, fp8_shadow=object())
    with pytest.raises(ValueError, match="fp8_shadow: made on another buffer"):
        ck.adam_step(p, g, m, v, lr=1e-3, step=1, fp8_shadow=ck.Fp8Shadow(np.zeros(64, F32), [(0, (4, 4))]))
    with pytest.raises(ValueError, match="margin"):
        ck.Fp8Shadow(p, [], margin=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("gdt", [F32, ck.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("shadow", [False, True], ids=["noshadow", "shadow"])
def test_gpu_fp8_shadow_matches_reference(rng, gdt, misalign, shadow):
    """The codes are the reference cast of the kernel's own updated values with the previous amax's scale, bit for
    bit; scale_inv, the rolled history and q^T too; the bf16 shadow is written outside the ranges only; over three
    steps (the ticket and the histories reset for the next launch)."""
    import cupy as cp

    host, dev, _, sh_d, _, _ = _gpu_case(rng, FP8_N, gdt, misalign, shadow, None)
    if shadow:
        sh_d.fill(np.nan)
    fs = ck.Fp8Shadow(dev[0], FP8_RANGES)
    inside = np.zeros(FP8_N, bool)
    for o, (r, c) in FP8_RANGES:
        inside[o:o + r * c] = True
    for k in range(len(fs)):  # poison: every code must be rewritten by the update
        fs.q[k].fill(0x7f)
        fs.qt[k].fill(0x7f)
    for t in (1, 2, 3):
        p_before = to_host(dev[0])
        before = [np.float32(np.abs(p_before[o:o + r * c]).max()) for o, (r, c) in FP8_RANGES]
        ck.adam_step(*host, lr=1e-2, step=t, weight_decay=0.1)
        ck.adam_step(*dev, lr=1e-2, step=t, weight_decay=0.1, shadow=sh_d, fp8_shadow=fs)
        _check_adam(dev, host, None, f"step {t}")
        p = to_host(dev[0])
        for k, (q, si, amax) in enumerate(_fp8_expect(p, fs.offsets, fs.shapes, before)):
            got = to_host(fs.q[k])
            assert np.array_equal(got, q), f"step {t} range {k}: {np.sum(got != q)} codes differ"
            assert np.array_equal(to_host(fs.qt[k]), q.T), f"step {t} range {k}: q^T"
            assert to_host(fs.scale_inv[k]) == si, f"step {t} range {k}: scale_inv"
            h = to_host(fs.history[k])
            assert h[0] == A._fp8._as_bits(amax) and not h[1:3].any(), f"step {t} range {k}: history {h}"
        assert to_host(fs._ticket)[0] == 0
        if shadow:
            s = to_host(sh_d)
            assert np.isnan(s[inside].astype(F32)).all()
            assert np.array_equal(s[~inside].view(np.uint16), p[~inside].astype(BF16).view(np.uint16))
    cp.cuda.Device().synchronize()


@pytest.mark.gpu
def test_gpu_fp8_shadow_large_and_captured(rng):
    """Two 1024 x 1024 weights and a bf16 tail in a captured update, replayed: the bits of the eager reference cast
    of the kernel's values (many blocks on each range: the block maxima and the last block's roll)."""
    import cupy as cp

    n = 2 * 1024 * 1024 + 5000
    _, dev, _, sh_d, _, _ = _gpu_case(rng, n, ck.bfloat16, False, True, None)
    ranges = [(0, (1024, 1024)), (1024 * 1024, (1024, 1024))]
    fs = ck.Fp8Shadow(dev[0], ranges)
    lr_d, step_d = cp.array(1e-2, F32), cp.array(1, np.int32)
    warm = [d.copy() for d in dev]
    ck.adam_step(*warm, lr=lr_d, step=step_d, shadow=sh_d.copy(),
                 fp8_shadow=ck.Fp8Shadow(warm[0], ranges))  # compile outside the capture
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.adam_step(*dev, lr=lr_d, step=step_d, shadow=sh_d, fp8_shadow=fs)
        graph = s.end_capture()
    for t in (1, 2, 3):
        before = [np.float32(np.abs(to_host(dev[0])[o:o + r * c]).max()) for o, (r, c) in ranges]
        with s:
            step_d.fill(t)
        graph.launch(s)
        s.synchronize()
        p = to_host(dev[0])
        for k, (q, si, amax) in enumerate(_fp8_expect(p, fs.offsets, fs.shapes, before)):
            assert np.array_equal(to_host(fs.q[k]), q), f"replay {t} range {k}"
            assert np.array_equal(to_host(fs.qt[k]), q.T)
            assert to_host(fs.scale_inv[k]) == si and to_host(fs.history[k])[0] == A._fp8._as_bits(amax)
        tail = slice(2 * 1024 * 1024, n)
        assert np.array_equal(to_host(sh_d)[tail].view(np.uint16), p[tail].astype(BF16).view(np.uint16))
