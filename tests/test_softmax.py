import numpy as np
import pytest

import cukernels as ck
from helpers import DTYPES, TOL, assert_close, device_copy, poisoned, randn, to_host

F, BF = np.float32, ck.bfloat16


def f64_softmax(z):
    """Independent float64 softmax; -inf entries are masked; all-masked rows are zeros."""
    z = np.asarray(z, np.float64)
    out = np.zeros_like(z)
    for idx in np.ndindex(z.shape[:-1]):
        row = z[idx]
        live = ~np.isneginf(row)
        if live.any():
            e = np.exp(row[live] - row[live].max())
            out[idx][live] = e / e.sum()
    return out


def f64_attn(scores, key_mask, causal, scale, window=None):
    """From the definition: query i (position i + K - Q) sees keys j <= its position (causal) and, with a window
    W, j > its position - W (Hugging Face's kv_idx > q_idx - sliding_window)."""
    B, H, Q, K = scores.shape
    z = scores.astype(np.float64) * float(np.float32(scale))
    if key_mask is not None:
        if key_mask.dtype == np.bool_:
            z = np.where(key_mask[:, None, None, :], z, -np.inf)
        else:
            z = z + key_mask.astype(np.float64)[:, None, None, :]
    if causal:
        for i in range(Q):
            z[:, :, i, i + (K - Q) + 1:] = -np.inf
            if window is not None:
                z[:, :, i, :max(0, i + (K - Q) + 1 - window)] = -np.inf
    return f64_softmax(z)


def f64_softmax_grad_fd(x, dy):
    """d/dx of sum(softmax(x) * dy) by central differences (tiny shapes)."""
    h = 1e-6
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp_, xm_ = x.copy(), x.copy()
        xp_[i] += h
        xm_[i] -= h
        g[i] = ((f64_softmax(xp_) * dy).sum() - (f64_softmax(xm_) * dy).sum()) / (2 * h)
    return g


# ---------------------------------------------------------------- CPU: the reference against float64 math
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 130), (0, 16), (4, 4097), (3, 0)])
def test_reference_softmax_matches_f64(rng, shape):
    x = randn(rng, shape, F, scale=3.0)
    y = ck.softmax(x)
    np.testing.assert_allclose(y, f64_softmax(x), rtol=1e-6, atol=1e-7)
    assert y.dtype == F and y.shape == shape


def test_reference_softmax_large_inputs_and_bf16(rng):
    x = randn(rng, (4, 33), F, scale=1e4)
    y = ck.softmax(x)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-6)
    xb = randn(rng, (5, 64), BF)
    yb = ck.softmax(xb)
    assert yb.dtype == BF
    np.testing.assert_allclose(yb.astype(np.float64), f64_softmax(xb.astype(np.float64)), rtol=2**-8, atol=1e-6)


def test_reference_softmax_backward_matches_finite_differences(rng):
    x = rng.standard_normal((3, 6))
    dy = rng.standard_normal((3, 6))
    y = ck.softmax(x.astype(F))
    dx = ck.softmax_backward(y, dy.astype(F))
    np.testing.assert_allclose(dx, f64_softmax_grad_fd(x, dy), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask_kind", [None, "bool", "f32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_attn_matches_f64(rng, mask_kind, causal):
    B, H, Q, K = 2, 3, 5, 9
    dt = BF if mask_kind == "bf16" else F
    s = randn(rng, (B, H, Q, K), dt, scale=2.0)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((B, K)) > 0.3
        mask[1] = False  # batch 1: every key masked -> zeros
    elif mask_kind is not None:
        mask = np.where(rng.random((B, K)) > 0.3, 0.0, -np.inf).astype(F if mask_kind == "f32" else BF)
        mask[0, :3] = -1.5  # finite additive values too
    p = ck.attn_softmax(s, key_mask=mask, causal=causal, scale=0.7)
    ref = f64_attn(s, mask, causal, 0.7)
    rt, at = (1e-6, 1e-7) if dt == F else (2**-8, 1e-6)
    np.testing.assert_allclose(p.astype(np.float64), ref, rtol=rt, atol=at)
    assert np.isfinite(p.astype(np.float64)).all()
    if mask_kind == "bool":
        assert (p[1] == 0).all()
    if causal:
        assert (p[:, :, 0, K - Q + 1:] == 0).all()


def test_reference_attn_backward_matches_finite_differences(rng):
    s = rng.standard_normal((1, 2, 3, 5))
    dp = rng.standard_normal(s.shape)
    scale = 0.5
    mask = np.array([[True, True, False, True, True]])
    p = ck.attn_softmax(s.astype(F), key_mask=mask, causal=True, scale=scale)
    ds = ck.attn_softmax_backward(p, dp.astype(F), scale=scale)
    h = 1e-6
    fd = np.zeros_like(s)
    for i in np.ndindex(s.shape):
        sp, sm = s.copy(), s.copy()
        sp[i] += h
        sm[i] -= h
        fd[i] = ((f64_attn(sp, mask, True, scale) * dp).sum() - (f64_attn(sm, mask, True, scale) * dp).sum()) / (2 * h)
    np.testing.assert_allclose(ds, fd, rtol=1e-4, atol=1e-5)
    assert (ds[..., 2] == 0).all()  # a masked key gets zero gradient


def test_in_place_and_out(rng):
    s = randn(rng, (1, 2, 4, 4), F)
    ref = ck.attn_softmax(s.copy(), causal=True)
    p = ck.attn_softmax(s, causal=True, out=s)
    assert p is s
    np.testing.assert_array_equal(s, ref)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ck.softmax(np.ones((2, 4), np.float64)), TypeError, "x: expected dtype"),
        (lambda: ck.softmax(np.ones((2, 4), F), axis=0), ValueError, "axis: only the last axis"),
        (lambda: ck.softmax(np.ones((4, 2), F).T), ValueError, "x: expected a C-contiguous"),
        (lambda: ck.softmax(np.ones((2, 4), F), out=np.ones((2, 4), BF)), TypeError, "out: expected dtype"),
        (lambda: ck.softmax(np.ones((2, 4), F), out=np.ones((2, 5), F)), ValueError, "out: expected shape"),
        (lambda: ck.softmax_backward(np.ones((2, 4), F), np.ones((2, 5), F)), ValueError, "dy: expected shape"),
        (lambda: ck.softmax_backward(np.ones((2, 4), F), np.ones((2, 4), BF)), TypeError, "dy: expected dtype"),
        (lambda: ck.attn_softmax(np.ones((2, 4, 4), F)), ValueError, r"scores: expected shape \[batch, heads, q_len, k_len\]"),
        (lambda: ck.attn_softmax(np.ones((2, 1, 4, 4), F), key_mask=np.ones((2, 5), bool)), ValueError, r"key_mask: expected shape \(2, 4\)"),
        (lambda: ck.attn_softmax(np.ones((2, 1, 4, 4), F), key_mask=np.ones((1, 4), bool)), ValueError, r"key_mask: expected shape \(2, 4\)"),
        (lambda: ck.attn_softmax(np.ones((2, 1, 4, 4), F), key_mask=np.ones((2, 4), np.int32)), TypeError, "key_mask: expected dtype"),
        (lambda: ck.attn_softmax(np.ones((2, 1, 4, 4), F), key_mask=np.ones((2, 4), BF)), TypeError, "key_mask: expected dtype"),
        (lambda: ck.attn_softmax(np.ones((2, 1, 5, 4), F), causal=True), ValueError, "q_len 5 > k_len 4"),
        (lambda: ck.attn_softmax(np.ones((2, 1, 4, 4), F), scale=float("nan")), ValueError, "scale"),
        (lambda: ck.attn_softmax(np.ones((2, 1, 4, 4), F), scale="x"), TypeError, "scale"),
        (lambda: ck.attn_softmax_backward(np.ones((2, 1, 4, 4), F), np.ones((2, 1, 4, 3), F)), ValueError, "dprobs: expected shape"),
    ],
)
def test_bad_input_messages(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.gpu
def test_mixing_numpy_and_cupy_is_a_type_error():
    import cupy as cp

    with pytest.raises(TypeError, match="key_mask: is a numpy array but scores is a cupy array"):
        ck.attn_softmax(cp.ones((2, 1, 4, 4), cp.float32), key_mask=np.ones((2, 4), bool))


# ---------------------------------------------------------------- GPU: kernel against the reference
# 1..16: rows share a warp; 1000/1024: one warp per row; 4097: element path; 8192/16384: block per row in
# registers; 32768: the wide kernels (raw packs in registers); 65536: on sm_90 the cluster kernels (both dtypes,
# both ways; fp32 32768 backward too), elsewhere the wide (bf16 forward) and loop kernels; every misaligned row past
# 16384: the online (running max/sum) loop kernels.
COLS = [1, 3, 16, 127, 1000, 1024, 4097, 16384, 32768, 65536]


@pytest.mark.gpu
@pytest.mark.parametrize("C", COLS)
@pytest.mark.parametrize("rows", [0, 1, 199])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
def test_gpu_softmax_matches_reference(rng, rows, C, dtype, misalign):
    if rows * C > 199 * 4096:
        rows = 7 if misalign else 23
    x = randn(rng, (rows, C), dtype, scale=3.0)
    dy = randn(rng, (rows, C), dtype)
    y_ref = ck.softmax(x)
    xd, dyd = device_copy(x, misalign), device_copy(dy, misalign)
    out = poisoned(x.shape, dtype, misalign)
    y = ck.softmax(xd, out=out)
    assert y is out
    # Probabilities are <= 1: an absolute tolerance scaled to the row's typical value 1/C.
    rt, at = TOL[np.dtype(dtype)]
    assert_close(y, y_ref, dtype, rtol=rt, atol=at / max(1, C ** 0.5), what="y")
    dx_ref = ck.softmax_backward(to_host(y), dy)
    dxo = poisoned(x.shape, dtype, misalign)
    dx = ck.softmax_backward(y, dyd, out=dxo)
    assert dx is dxo
    assert_close(dx, dx_ref, dtype, what="dx")


def _mask(rng, kind, Bn, K, dtype):
    if kind is None:
        return None
    keep = rng.random((Bn, K)) > 0.25
    keep[-1] = False  # the last batch has every key masked: its rows must be zeros
    if kind == "bool":
        return keep
    m = np.where(keep, rng.standard_normal((Bn, K)), -np.inf)
    return m.astype(F if kind == "f32" else dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 3, 5, 9), (2, 2, 64, 64), (3, 2, 37, 1000), (2, 1, 17, 4097), (2, 1, 3, 32768)])
@pytest.mark.parametrize("mask_kind", [None, "bool", "f32", "same"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_attn_matches_reference(rng, shape, mask_kind, causal, dtype):
    Bn, H, Q, K = shape
    s = randn(rng, shape, dtype, scale=3.0)
    mask = _mask(rng, mask_kind, Bn, K, dtype)
    scale = 0.35
    p_ref = ck.attn_softmax(s, key_mask=mask, causal=causal, scale=scale)
    out = poisoned(shape, dtype)
    p = ck.attn_softmax(device_copy(s), key_mask=None if mask is None else device_copy(mask), causal=causal,
                        scale=scale, out=out)
    rt, at = TOL[np.dtype(dtype)]
    assert_close(p, p_ref, dtype, rtol=rt, atol=at / max(1, K ** 0.5), what="probs")
    ph = to_host(p).astype(np.float64)
    assert np.isfinite(ph).all()
    if mask_kind is not None:
        assert (ph[-1] == 0).all(), "an all-masked row must be zeros"
    if causal:
        tri = np.arange(K)[None, :] > np.arange(Q)[:, None] + (K - Q)
        assert (ph[:, :, tri] == 0).all()
    dp = randn(rng, shape, dtype)
    ds_ref = ck.attn_softmax_backward(to_host(p), dp, scale=scale)
    ds = ck.attn_softmax_backward(p, device_copy(dp), scale=scale, out=poisoned(shape, dtype))
    assert_close(ds, ds_ref, dtype, what="dscores")
    if mask_kind is not None:
        assert (to_host(ds).astype(np.float64)[-1] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("K", [64, 1000, 32768])
def test_gpu_attn_misaligned_and_in_place(rng, dtype, K):
    shape = (2, 2, 3, K)
    s = randn(rng, shape, dtype, scale=2.0)
    keep = rng.random((2, K)) > 0.5
    p_ref = ck.attn_softmax(s, key_mask=keep, causal=True, scale=1.5)
    sd = device_copy(s, misalign=True)
    p = ck.attn_softmax(sd, key_mask=device_copy(keep, misalign=True), causal=True, scale=1.5, out=sd)
    assert p is sd
    rt, at = TOL[np.dtype(dtype)]
    assert_close(p, p_ref, dtype, rtol=rt, atol=at / K ** 0.5, what="probs misaligned in place")
    sd = device_copy(s)
    ck.attn_softmax(sd, key_mask=device_copy(keep), causal=True, scale=1.5, out=sd)
    assert_close(sd, p_ref, dtype, rtol=rt, atol=at / K ** 0.5, what="probs in place")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("K", [128, 1024, 65536])
def test_gpu_large_magnitudes_stay_finite(rng, dtype, K):
    s = randn(rng, (1, 2, 4, K), dtype, scale=1e4)
    s[0, 0, 0] = 1e4  # a row of equal large values: uniform
    s[0, 1, 1] = -1e4
    p = to_host(ck.attn_softmax(device_copy(s), causal=True)).astype(np.float64)
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=2e-2 if dtype == BF else 1e-5)
    assert_close(p, ck.attn_softmax(s, causal=True), dtype, what="probs")
    y = to_host(ck.softmax(device_copy(s.reshape(-1, K)))).astype(np.float64)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y[0], 1.0 / K, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_causal_q_shorter_than_k(rng):
    s = randn(rng, (1, 2, 5, 131), F)
    p = ck.attn_softmax(device_copy(s), causal=True)
    assert_close(p, ck.attn_softmax(s, causal=True), F)
    ph = to_host(p)
    assert (ph[:, :, 0, 127:] == 0).all() and (ph[:, :, 0, 126] > 0).all()


@pytest.mark.gpu
def test_gpu_runs_on_current_stream_and_captures(rng):
    """Forward and backward are graph-capturable: no host sync, no H2D copy, launches on the current stream."""
    import cupy as cp

    s = device_copy(randn(rng, (2, 4, 64, 256), BF))
    keep = device_copy(rng.random((2, 256)) > 0.2)
    dp = device_copy(randn(rng, (2, 4, 64, 256), BF))
    p, ds = cp.empty_like(s), cp.empty_like(s)
    ck.attn_softmax(s, key_mask=keep, causal=True, scale=0.125, out=p)  # compile + warm up outside capture
    ck.attn_softmax_backward(p, dp, scale=0.125, out=ds)
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        st.begin_capture()
        ck.attn_softmax(s, key_mask=keep, causal=True, scale=0.125, out=p)
        ck.attn_softmax_backward(p, dp, scale=0.125, out=ds)
        g = st.end_capture()
    p.fill(np.nan)
    ds.fill(np.nan)
    cp.cuda.Device().synchronize()  # (the poison ran on the legacy stream: the replay must not race it)
    g.launch(st)
    st.synchronize()
    p_ref = ck.attn_softmax(to_host(s), key_mask=to_host(keep), causal=True, scale=0.125)
    assert_close(p, p_ref, BF)
    assert_close(ds, ck.attn_softmax_backward(to_host(p), to_host(dp), scale=0.125), BF)


# ---------------------------------------------------------------- wide rows (sm_fwd_wide_*, issue 17)
def test_wide_plan_thresholds():
    """Which kernel each long row gets: the register kernels' plan is pinned elsewhere (test_rms_norm); the wide
    kernel takes what they leave, without a mask, up to 8 packs (16-byte path) / 16 values a thread at 1024."""
    from cukernels.ops import softmax as SM

    def kind(C, isz, vec):
        if SM._plan(C, isz, vec, backward=False) is not None:
            return "reg"
        w = SM._wide_plan(C, isz, vec)
        return "loop" if w is None else f"wide{w}"

    assert kind(16384, 2, True) == "reg" and kind(16392, 2, True) == "wide512"
    assert kind(32768, 2, True) == "wide512" and kind(32776, 2, True) == "wide1024"
    assert kind(65536, 2, True) == "wide1024" and kind(65544, 2, True) == "loop"
    assert kind(16384, 4, True) == "reg" and kind(16388, 4, True) == "wide1024"
    assert kind(32768, 4, True) == "wide1024" and kind(32772, 4, True) == "loop"
    assert kind(8192, 2, False) == "reg" and kind(8193, 2, False) == "wide1024"
    assert kind(16384, 4, False) == "wide1024" and kind(16385, 4, False) == "loop"
    assert kind(32769, 2, False) == "loop"


# Around every threshold of the wide kernel (see test_wide_plan_thresholds): 16-byte path bf16 512 -> 1024 threads
# at 32768 and the loop past 65536, fp32 the loop past 32768; element path (odd C or misaligned) 8193..16384.
WIDE_COLS = [8193, 16392, 24576, 32760, 32768, 32769, 32776, 65528, 65536, 65544]


@pytest.mark.gpu
@pytest.mark.parametrize("C", WIDE_COLS)
@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("cluster", [1, 0], ids=["cluster", "nocluster"])
def test_gpu_softmax_wide_rows(rng, rows, C, dtype, misalign, cluster, monkeypatch):
    """Rows past the register kernels: the cluster kernel (sm_90, 16-byte rows), and with softmax_cluster off the wide /
    loop kernels that sm_80 and the element path run."""
    from cukernels.ops import softmax as SM

    monkeypatch.setattr(ck.settings, "softmax_cluster", bool(cluster))
    x = randn(rng, (rows, C), dtype, scale=3.0)
    if rows >= 5:
        x[1] = -np.inf  # every key -inf: a row of zeros, never NaN
        x[2, ::2] = -np.inf  # half the keys -inf, scattered over every thread's packs
        x[3] = (randn(rng, (C,), np.float32, scale=1e4)).astype(dtype)  # large magnitudes: one key dominates
        x[4, -1] = 80.0  # the max in the last element (the scalar tail of the last thread / pack)
    y_ref = ck.softmax(x)
    xd = device_copy(x, misalign)
    out = poisoned(x.shape, dtype, misalign)
    y = ck.softmax(xd, out=out)
    assert y is out
    rt, at = TOL[np.dtype(dtype)]
    assert_close(y, y_ref, dtype, rtol=rt, atol=at / C ** 0.5, what="y")
    yh = to_host(y).astype(np.float64)
    assert np.isfinite(yh).all()
    if rows >= 5:
        assert (yh[1] == 0).all(), "an all -inf row must be zeros"
        assert (yh[2, ::2] == 0).all()
        np.testing.assert_allclose(yh[[0, 2, 3, 4]].sum(-1), 1.0, rtol=2e-2 if dtype == BF else 1e-4)
    again = ck.softmax(xd, out=poisoned(x.shape, dtype, misalign))
    assert np.array_equal(to_host(again).view(np.uint8), to_host(y).view(np.uint8)), "rerun not bit-identical"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("K", [16392, 40000, 65536])
@pytest.mark.parametrize("cluster", [1, 0], ids=["cluster", "nocluster"])
def test_gpu_long_causal_scale_and_in_place(rng, dtype, K, cluster, monkeypatch):
    """Unmasked attention rows past the register kernels, on the cluster kernels (sm_90) and with softmax_cluster off on
    the wide / loop kernels: causal rows skip the masked tail (written as zeros, never read; whole CTAs of a cluster
    with nothing live), scale in both directions, out=scores in place (each thread reads its packs before any write),
    and short q_len = k_len rows whose first query has one live key."""
    from cukernels.ops import softmax as SM

    monkeypatch.setattr(ck.settings, "softmax_cluster", bool(cluster))
    shape = (1, 2, 3, K)
    s = randn(rng, shape, dtype, scale=2.0)
    p_ref = ck.attn_softmax(s, causal=True, scale=0.7)
    sd = device_copy(s)
    p = ck.attn_softmax(sd, causal=True, scale=0.7, out=sd)
    assert p is sd
    rt, at = TOL[np.dtype(dtype)]
    assert_close(p, p_ref, dtype, rtol=rt, atol=at / K ** 0.5, what="causal probs in place")
    dp = randn(rng, shape, dtype)
    ds = ck.attn_softmax_backward(p, device_copy(dp), scale=0.7, out=poisoned(shape, dtype))
    assert_close(ds, ck.attn_softmax_backward(to_host(p), dp, scale=0.7), dtype, what="dscores")
    s2 = randn(rng, (1, 1, 4, K), dtype)
    p2 = ck.attn_softmax(device_copy(s2), causal=True, out=poisoned(s2.shape, dtype))
    assert_close(p2, ck.attn_softmax(s2, causal=True), dtype, rtol=rt, atol=at / K ** 0.5, what="q_len = k_len")
    x = randn(rng, (3, K), dtype)
    xd = device_copy(x)
    ck.softmax(xd, out=xd)
    assert_close(xd, ck.softmax(x), dtype, rtol=rt, atol=at / K ** 0.5, what="softmax in place")


# ---------------------------------------------------------------- rows over a thread-block cluster (sm_90)
def test_cluster_plan_and_routes():
    """Which kernel each long 16-byte-pack row gets on sm_90 (cc 90) and on sm_80 (never a cluster kernel), and the
    (cluster size, threads a CTA, packs a CTA) the cluster kernels are launched with."""
    from cukernels.ops import softmax as SM

    def fwd(C, isz, vec=True, masked=False, cc=90):
        kind, plan = SM._fwd_route(C, isz, vec, masked, cc)
        return kind if kind in ("loop", "reg") else (kind, plan)

    def bwd(C, isz, vec=True, cc=90):
        kind, plan = SM._bwd_route(C, isz, vec, cc)
        return kind if kind in ("loop", "reg") else (kind, plan)

    # forward: the cluster kernel takes the 16-byte rows past the register kernels (16384 columns; softmax_cluster_fwd_from_*)
    assert fwd(32768, 2) == ("cluster", (2, 512, 2048)) and fwd(32768, 4) == ("cluster", (2, 512, 4096))
    assert fwd(16392, 2) == ("cluster", (2, 288, 1025)) and fwd(16384, 2) == "reg" and fwd(16384, 4) == "reg"
    assert fwd(32768, 2, cc=80) == ("wide", 512) and fwd(32768, 4, cc=80) == ("wide", 1024)
    # just past it two CTAs would need 544 threads: four of 288
    assert fwd(32776, 2) == ("cluster", (4, 288, 1025)) and fwd(32772, 4) == ("cluster", (4, 288, 2049))
    assert fwd(65536, 2) == ("cluster", (4, 512, 2048)) and fwd(65536, 4) == ("cluster", (4, 512, 4096))
    assert fwd(131072, 2) == ("cluster", (8, 512, 2048)) and fwd(131072, 4) == ("cluster", (8, 512, 4096))
    assert fwd(262144, 4) == ("cluster", (8, 1024, 8192)) and fwd(262152, 2) == "loop"
    assert fwd(65536, 2, vec=False) == "loop" and fwd(65536, 2, masked=True) == "loop"
    assert fwd(65536, 2, cc=80) == ("wide", 1024) and fwd(65536, 4, cc=80) == "loop"
    # backward: past the register kernel (bf16 32768, fp32 16384 columns)
    assert bwd(32768, 2) == "reg" and bwd(16384, 4) == "reg"
    assert bwd(32776, 2) == ("cluster", (4, 288, 1025)) and bwd(16388, 4) == ("cluster", (4, 288, 1025))
    assert bwd(65536, 2) == ("cluster", (4, 512, 2048)) and bwd(32768, 4) == ("cluster", (4, 512, 2048))
    assert bwd(131072, 2) == ("cluster", (8, 512, 2048)) and bwd(65536, 4) == ("cluster", (8, 512, 2048))
    assert bwd(131072, 4) == ("cluster", (8, 1024, 4096)) and bwd(131076, 4) == "loop"
    assert bwd(65536, 2, vec=False) == "loop" and bwd(65536, 2, cc=80) == "loop"


def test_cluster_plan_covers_every_row(monkeypatch):
    """For every row the plan accepts: n CTAs x upc packs cover the row, each CTA's warps (32 x packs a thread each)
    cover its slice, whole warps, <= 1024 threads, the preferred thread count whenever some n in (2, 4, 8) fits it."""
    from cukernels.ops import softmax as SM

    for pref in (256, 512, 1024):
        monkeypatch.setattr(ck.settings, "softmax_cluster_threads", pref)
        for isz in (4, 2):
            E = 16 // isz
            for backward in (False, True):
                vpt = SM.CLUSTER_BWD_VPT if backward else SM.CLUSTER_FWD_VALUES // E
                for C in list(range(E, 300000, 1000 * E)) + [2**p + d * E for p in range(14, 19) for d in (-1, 0, 1)]:
                    plan = SM._cluster_plan(C, isz, backward)
                    units = C // E
                    if plan is None:
                        assert -(-units // 8) > 32 * 32 * vpt, (C, isz, backward)
                        continue
                    n, threads, upc = plan
                    assert n in SM.CLUSTER_SIZES and n * upc >= units and upc == -(-units // n)
                    assert threads % 32 == 0 and 32 <= threads <= 1024 and threads // 32 * 32 * vpt >= upc
                    if threads > pref:  # only when no cluster size fits the preferred CTA
                        assert all(-(-(-(-units // m)) // (32 * vpt)) * 32 > pref for m in SM.CLUSTER_SIZES)
    assert SM._cluster_plan(65537, 2, False) is None  # not a whole number of 16-byte packs


def test_cluster_switch_off_keeps_the_old_kernels(monkeypatch):
    from cukernels.ops import softmax as SM

    monkeypatch.setattr(ck.settings, "softmax_cluster", False)
    assert SM._fwd_route(65536, 2, True, False, 90) == ("wide", 1024)
    assert SM._fwd_route(65536, 4, True, False, 90) == ("loop", None)
    assert SM._bwd_route(65536, 2, True, 90) == ("loop", None)


def test_cluster_kernels_compile_for_sm90_only():
    """The cluster kernels exist in the sm_90 build (every size and dtype the launcher names) and not in the sm_80
    one, where the launcher never asks for them."""
    from cukernels import _loader, _nvrtc

    if not _nvrtc.available():
        pytest.skip("libnvrtc not installed")
    want = {f"sm_{d}_cluster{n}_{t}{'_none' if d == 'fwd' else ''}_v" for d in ("fwd", "bwd") for n in (2, 4, 8)
            for t in ("f32", "bf16")}
    e90 = set(_loader.list_entries("softmax", "sm_90"))
    e80 = set(_loader.list_entries("softmax", "sm_80"))
    assert want <= e90, sorted(want - e90)
    assert not {e for e in e80 if "cluster" in e}


def _sm90():
    if not ck.gpu_available():
        return False
    from cukernels import _backend as B

    return B.capability() >= 90


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (thread-block clusters)")


def _special_rows(rng, x, C, dtype):
    if x.shape[0] >= 5:
        x[1] = -np.inf  # every key -inf: a row of zeros, never NaN
        x[2, ::2] = -np.inf  # half the keys -inf, scattered over every CTA's slice
        x[3] = (randn(rng, (C,), np.float32, scale=1e4)).astype(dtype)  # large magnitudes: one key dominates
        x[4, -1] = 80.0  # the max in the last element (the last CTA's last pack)
    if x.shape[0] >= 6:
        x[5, : C // 2] = -np.inf  # the first half of the cluster holds nothing live


def _check_cluster_rows(rng, rows, C, dtype, *, bwd_cluster=True):
    """Forward and backward of `rows` rows of C columns against the reference (the forward on the cluster kernel;
    the backward too unless bwd_cluster is False: then whichever kernel holds it), poisoned outputs, reruns."""
    from cukernels.ops import softmax as SM

    isz = np.dtype(dtype).itemsize
    assert SM._fwd_route(C, isz, True, False, 90)[0] == "cluster", "the forward must take the cluster kernel here"
    if bwd_cluster:
        assert SM._bwd_route(C, isz, True, 90)[0] == "cluster", "the backward must take the cluster kernel here"
    x = randn(rng, (rows, C), dtype, scale=3.0)
    _special_rows(rng, x, C, dtype)
    y_ref = ck.softmax(x)
    xd = device_copy(x)
    y = ck.softmax(xd, out=poisoned(x.shape, dtype))
    rt, at = TOL[np.dtype(dtype)]
    assert_close(y, y_ref, dtype, rtol=rt, atol=at / C ** 0.5, what="y")
    yh = to_host(y).astype(np.float64)
    assert np.isfinite(yh).all()
    if rows >= 5:
        assert (yh[1] == 0).all(), "an all -inf row must be zeros"
        assert (yh[2, ::2] == 0).all()
        live = [0, 2, 3, 4] + ([5] if rows >= 6 else [])
        np.testing.assert_allclose(yh[live].sum(-1), 1.0, rtol=2e-2 if dtype == BF else 1e-4)
    again = ck.softmax(xd, out=poisoned(x.shape, dtype))
    assert np.array_equal(to_host(again).view(np.uint8), to_host(y).view(np.uint8)), "forward rerun not bit-identical"
    dy = randn(rng, (rows, C), dtype)
    yh_t = to_host(y)
    dx_ref = ck.softmax_backward(yh_t, dy)
    dyd = device_copy(dy)
    dx = ck.softmax_backward(y, dyd, out=poisoned(x.shape, dtype))
    assert_close(dx, dx_ref, dtype, what="dx")
    dx2 = ck.softmax_backward(y, dyd, out=poisoned(x.shape, dtype))
    assert np.array_equal(to_host(dx2).view(np.uint8), to_host(dx).view(np.uint8)), "backward rerun not bit-identical"


# The default plan's points: n 4 (32776: 288 threads a CTA; 40000, 65536: 320 / 512) and n 8 (98304, 131072) both
# ways, fp32 backward 131072: n 8 x 1024 threads. n 2 only comes with other settings (test_gpu_cluster_forced_configs).
CLUSTER_COLS = [32776, 40000, 65536, 98304, 131072]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("C", CLUSTER_COLS)
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_cluster_rows(rng, rows, C, dtype):
    _check_cluster_rows(rng, rows, C, dtype)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("threads", [256, 512, 1024])
@pytest.mark.parametrize("C", [16392, 24576, 65536])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_cluster_forced_configs(rng, monkeypatch, threads, C, dtype):
    """Other (cluster size, threads) points than the default plan's: rows from 16392 forced onto the cluster
    kernels, CTAs of up to 256 / 512 / 1024 threads (n = 2 at 16392 .. n = 8 at 65536 x 256)."""
    from cukernels.ops import softmax as SM

    monkeypatch.setattr(ck.settings, "softmax_cluster_fwd_from_f32", 16384)
    monkeypatch.setattr(ck.settings, "softmax_cluster_fwd_from_bf16", 16384)
    monkeypatch.setattr(ck.settings, "softmax_cluster_threads", threads)
    _check_cluster_rows(rng, 7, C, dtype, bwd_cluster=False)  # bf16 below 32768: the register backward


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("clusters", [1, 2, 3])
def test_gpu_cluster_rows_strided(rng, monkeypatch, dtype, clusters):
    """Fewer clusters than rows: each cluster walks several rows, so the two exchange slots and their mbarrier
    phases are reused (rows 0, 2, 4, ... share a slot); 11 rows is a multiple of nothing."""
    from cukernels.ops import softmax as SM

    C = 65536
    monkeypatch.setattr(ck.settings, "softmax_cluster_max_grid", clusters * 8)  # 8 // n x clusters clusters (n 4, 8)
    for backward in (False, True):
        n = SM._cluster_plan(C, np.dtype(dtype).itemsize, backward)[0]
        assert SM._cluster_grid(11, n) == clusters * 8
    _check_cluster_rows(rng, 11, C, dtype)


@pytest.mark.gpu
@needs_sm90
def test_gpu_cluster_many_rows(rng):
    _check_cluster_rows(rng, 199, 65536, BF)


@pytest.mark.gpu
@needs_sm90
def test_gpu_cluster_captures(rng):
    """The cluster kernels are plain launches on the current stream: they capture into a graph."""
    import cupy as cp

    x = device_copy(randn(rng, (5, 65536), BF))
    dy = device_copy(randn(rng, (5, 65536), BF))
    y, dx = cp.empty_like(x), cp.empty_like(x)
    ck.softmax(x, out=y)
    ck.softmax_backward(y, dy, out=dx)
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        st.begin_capture()
        ck.softmax(x, out=y)
        ck.softmax_backward(y, dy, out=dx)
        g = st.end_capture()
    y.fill(np.nan)
    dx.fill(np.nan)
    cp.cuda.Device().synchronize()  # (the poison ran on the legacy stream: the replay must not race it)
    g.launch(st)
    st.synchronize()
    assert_close(y, ck.softmax(to_host(x)), BF, rtol=TOL[np.dtype(BF)][0], atol=TOL[np.dtype(BF)][1] / 256)
    assert_close(dx, ck.softmax_backward(to_host(y), to_host(dy)), BF)


# ---------------------------------------------------------------- sliding windows (issue 37: Mistral, Qwen)
def window_keep(Q, K, W):
    """[Q, K]: key j visible to query i: 0 <= (i + K - Q) - j < W (W None: causal only)."""
    d = (np.arange(Q)[:, None] + (K - Q)) - np.arange(K)[None, :]
    return (d >= 0) & (d < (W if W is not None else K + 1))


@pytest.mark.parametrize("mask_kind", [None, "bool", "f32", "bf16"])
@pytest.mark.parametrize("QK", [(5, 9), (9, 9), (1, 7)], ids=["q5k9", "q9k9", "q1k7"])
@pytest.mark.parametrize("W", [1, 2, 3, 6, 9, 40])
def test_reference_attn_window_matches_f64(rng, mask_kind, QK, W):
    Q, K = QK
    B, H = 2, 3
    dt = BF if mask_kind == "bf16" else F
    s = randn(rng, (B, H, Q, K), dt, scale=2.0)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((B, K)) > 0.3
        mask[1, :K // 2] = False  # left padding: early queries of small windows see nothing
    elif mask_kind is not None:
        mask = np.where(rng.random((B, K)) > 0.3, 0.0, -np.inf).astype(F if mask_kind == "f32" else BF)
        mask[0, :3] = -1.5
    p = ck.attn_softmax(s, key_mask=mask, causal=True, scale=0.7, window=W)
    ref = f64_attn(s, mask, True, 0.7, window=W)
    rt, at = (1e-6, 1e-7) if dt == F else (2**-8, 1e-6)
    np.testing.assert_allclose(p.astype(np.float64), ref, rtol=rt, atol=at)
    pf = p.astype(np.float64)
    assert np.isfinite(pf).all()
    assert (pf[..., ~window_keep(Q, K, W)] == 0).all(), "keys outside the window must be exactly 0"
    assert ((pf != 0).sum(-1) <= W).all(), "a query sees at most W keys"
    if W >= K:  # a window of >= k_len keys is no window: the same bits
        np.testing.assert_array_equal(p, ck.attn_softmax(s, key_mask=mask, causal=True, scale=0.7))


def test_reference_attn_window_one_is_the_diagonal(rng):
    """W = 1: each query sees itself alone -> probability 1 on its diagonal key (unless masked: zeros)."""
    s = randn(rng, (2, 2, 4, 6), F, scale=3.0)
    keep = np.ones((2, 6), bool)
    keep[1, 3] = False
    p = ck.attn_softmax(s, key_mask=keep, causal=True, window=1)
    want = np.zeros_like(p)
    for i in range(4):
        want[:, :, i, i + 2] = 1.0
    want[1, :, 1, 3] = 0.0  # query 1 of batch 1: its only key is masked
    np.testing.assert_array_equal(p, want)


def test_reference_attn_window_backward_matches_finite_differences(rng):
    s = rng.standard_normal((1, 2, 4, 6))
    dp = rng.standard_normal(s.shape)
    scale, W = 0.5, 3
    mask = np.array([[True, True, False, True, True, True]])
    p = ck.attn_softmax(s.astype(F), key_mask=mask, causal=True, scale=scale, window=W)
    ds = ck.attn_softmax_backward(p, dp.astype(F), scale=scale)
    h = 1e-6
    fd = np.zeros_like(s)
    for i in np.ndindex(s.shape):
        sp, sm = s.copy(), s.copy()
        sp[i] += h
        sm[i] -= h
        fd[i] = ((f64_attn(sp, mask, True, scale, W) * dp).sum() - (f64_attn(sm, mask, True, scale, W) * dp).sum()) / (
            2 * h)
    np.testing.assert_allclose(ds, fd, rtol=1e-4, atol=1e-5)
    assert (ds[..., ~window_keep(4, 6, W)] == 0).all()  # keys outside the window get zero gradient


@pytest.mark.parametrize("W", [None, 1, 2, 4])
def test_functional_attn_softmax_window(rng, W):
    """AttnSoftmaxF (fused) against the composite (fused=False) path: values, and the fused gradient against
    finite differences of the float64 composite."""
    from cukernels import functional as Fn
    from cukernels.autograd import Tensor

    s64 = rng.standard_normal((2, 2, 3, 5))
    km = np.array([[True, True, True, False, True], [False, True, True, True, True]])
    kw = dict(causal=True, scale=0.5, key_mask=km, window=W)
    st = Tensor(s64.astype(F), requires_grad=True)
    out = Fn.attn_softmax(st, **kw)
    ref = Fn.attn_softmax(Tensor(s64), fused=False, **kw).data
    np.testing.assert_allclose(out.data, ref, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(ref, f64_attn(s64, km, True, 0.5, W), rtol=1e-12, atol=1e-15)
    R = rng.standard_normal(out.shape)
    (out * R.astype(F)).sum().backward()
    num = np.zeros_like(s64)
    for i in np.ndindex(s64.shape):
        a, b = s64.copy(), s64.copy()
        a[i] += 1e-6
        b[i] -= 1e-6
        num[i] = ((Fn.attn_softmax(Tensor(a), fused=False, **kw).data * R).sum()
                  - (Fn.attn_softmax(Tensor(b), fused=False, **kw).data * R).sum()) / 2e-6
    np.testing.assert_allclose(st.grad, num, rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(window=0, causal=True), ValueError, "window: expected an integer >= 1"),
        (dict(window=-3, causal=True), ValueError, "window: expected an integer >= 1"),
        (dict(window=2**40, causal=True), ValueError, "window: expected an integer <= 2147483647"),
        (dict(window=2.0, causal=True), TypeError, "window: expected an integer >= 1 .* or None; got"),
        (dict(window=True, causal=True), TypeError, "window: expected an integer"),
        (dict(window="3", causal=True), TypeError, "window: expected an integer"),
        (dict(window=3), ValueError, "window: a sliding window .* needs causal=True"),
        (dict(window=3, causal=False), ValueError, "window: a sliding window .* needs causal=True"),
    ],
)
def test_window_bad_input_messages(kw, exc, match):
    with pytest.raises(exc, match=match):
        ck.attn_softmax(np.ones((2, 1, 4, 4), F), **kw)
    from cukernels import functional as Fn
    from cukernels.autograd import Tensor

    with pytest.raises(exc, match=match):
        Fn.attn_softmax(Tensor(np.ones((2, 1, 4, 4))), fused=False, **kw)


# GPU: every forward route with a window. (K, forced route) -> which kernel: reg rows (9 .. 16384: one or more rows a
# warp / block), the element path (4097, odd), and past 16384 columns the cluster kernel (sm_90, 16-byte rows, no
# mask), the wide kernel (softmax_cluster off, or sm_80) and the loop kernel (a key mask, or misaligned rows).
WINDOW_SHAPES = [(2, 3, 5, 9), (2, 2, 64, 64), (2, 2, 37, 1000), (1, 2, 17, 4097), (1, 1, 6, 16384),
                 (1, 1, 5, 32768), (1, 1, 3, 65536)]


def _windows(K):
    """1, a few keys (fewer than a 16-byte pack), not a multiple of the pack (13, 1000 + 3), half the row, k_len - 1,
    k_len (= no window) and past it."""
    return sorted({1, 3, 13, min(1003, K), max(1, K // 2), max(1, K - 1), K, K + 5})


@pytest.mark.gpu
@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask_kind", [None, "bool", "f32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("route", ["default", "nocluster", "misaligned"])
def test_gpu_attn_window_matches_reference(rng, shape, mask_kind, dtype, route, monkeypatch):
    """Kernel vs reference at every window size, every forward route; outputs poisoned with NaN; the scores
    outside each query's window set to NaN on the device (a live key never reads them: the packs before the
    window are not loaded, the straddling pack is masked per element); W >= k_len bit-identical to no window."""
    Bn, H, Q, K = shape
    if route == "nocluster":
        monkeypatch.setattr(ck.settings, "softmax_cluster", False)
    mis = route == "misaligned"
    s = randn(rng, shape, dtype, scale=3.0)
    mask = _mask(rng, mask_kind, Bn, K, dtype)
    scale = 0.35
    rt, at = TOL[np.dtype(dtype)]
    dmask = None if mask is None else device_copy(mask, mis)
    for W in _windows(K):
        keep = window_keep(Q, K, W)
        s_nan = s.copy()
        s_nan[:, :, ~keep] = np.nan
        p_ref = ck.attn_softmax(s, key_mask=mask, causal=True, scale=scale, window=W)
        p = ck.attn_softmax(device_copy(s_nan, mis), key_mask=dmask, causal=True, scale=scale, window=W,
                            out=poisoned(shape, dtype, mis))
        what = f"W={W}"
        assert_close(p, p_ref, dtype, rtol=rt, atol=at / max(1, K ** 0.5), what=what)
        ph = to_host(p).astype(np.float64)
        assert np.isfinite(ph).all(), what
        assert (ph[:, :, ~keep] == 0).all(), f"{what}: keys outside the window must be 0"
        if mask_kind is not None:
            assert (ph[-1] == 0).all(), f"{what}: an all-masked batch must be zeros"
        if W >= K:
            p0 = ck.attn_softmax(device_copy(s, mis), key_mask=dmask, causal=True, scale=scale,
                                 out=poisoned(shape, dtype, mis))
            assert np.array_equal(to_host(p0).view(np.uint8), to_host(p).view(np.uint8)), \
                f"{what}: W >= k_len must equal no window bit for bit"
    # the backward needs nothing new (probs outside the window are 0): one check on the last window's probs
    W = max(1, K // 2)
    p = ck.attn_softmax(device_copy(s, mis), key_mask=dmask, causal=True, scale=scale, window=W)
    dp = randn(rng, shape, dtype)
    ds = ck.attn_softmax_backward(p, device_copy(dp, mis), scale=scale, out=poisoned(shape, dtype, mis))
    assert_close(ds, ck.attn_softmax_backward(to_host(p), dp, scale=scale), dtype, what="dscores")
    assert (to_host(ds).astype(np.float64)[:, :, ~window_keep(Q, K, W)] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_attn_window_in_place_large_magnitudes_and_capture(rng, dtype):
    """out=scores in place with a window (every thread reads its packs before writing them; packs before the
    window are written zeros, never read), large scores, and a captured graph."""
    import cupy as cp

    shape = (2, 4, 64, 4096)
    s = randn(rng, shape, dtype, scale=1e3)
    keep = rng.random((2, 4096)) > 0.2
    p_ref = ck.attn_softmax(s, key_mask=keep, causal=True, scale=0.125, window=300)
    sd, kd = device_copy(s), device_copy(keep)
    p = ck.attn_softmax(sd, key_mask=kd, causal=True, scale=0.125, window=300, out=sd)
    assert p is sd
    rt, at = TOL[np.dtype(dtype)]
    assert_close(p, p_ref, dtype, rtol=rt, atol=at / 64, what="in place")
    sd, out = device_copy(s), cp.empty(shape, dtype)
    ck.attn_softmax(sd, key_mask=kd, causal=True, scale=0.125, window=300, out=out)
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        st.begin_capture()
        ck.attn_softmax(sd, key_mask=kd, causal=True, scale=0.125, window=300, out=out)
        g = st.end_capture()
    with st:  # the poison on the replay's stream: a fill on the legacy stream races a non-blocking stream
        out.fill(np.nan)
        g.launch(st)
    st.synchronize()
    assert_close(out, p_ref, dtype, rtol=rt, atol=at / 64, what="graph replay")
