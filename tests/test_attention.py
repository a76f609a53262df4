"""ck.flash_attention / ck.flash_attention_backward: the NumPy reference against an independent float64
formula (CPU), the kernels against the reference (GPU), the model's flash path against its materialised one."""
import math

import numpy as np
import pytest

import cukernels as ck
from helpers import cp, to_host

BF16 = ck.bfloat16


def qkv(rng, Bsz, Tq, Tk, H, Hkv, D, scale=1.0):
    f = lambda *s: (rng.standard_normal(s) * scale).astype(np.float32).astype(BF16)  # noqa: E731
    return f(Bsz, Tq, H, D), f(Bsz, Tk, Hkv, D), f(Bsz, Tk, Hkv, D)


def f64_attention(q, k, v, causal, scale, key_mask=None, window=None):
    """Per (batch, head) loops in float64: o and lse, written independently of the reference. Each query's
    visible keys are listed explicitly (causal rule, the sliding window, then the padding mask); none visible:
    o = 0, lse = -inf."""
    Bsz, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    o = np.zeros((Bsz, Tq, H, D))
    lse = np.full((Bsz, H, Tq), -np.inf)
    for b in range(Bsz):
        for h in range(H):
            j = h // (H // Hkv)
            for i in range(Tq):
                n = np.arange(Tk)
                if causal:
                    n = n[n <= i + Tk - Tq]
                if window is not None:  # Hugging Face's sliding_window_overlay: kv_idx > q_idx - window
                    n = n[n > i + Tk - Tq - window]
                if key_mask is not None:
                    n = n[np.asarray(key_mask)[b, n] != 0]
                if n.size == 0:
                    continue
                s = scale * (k[b, n, j].astype(np.float64) @ q[b, i, h].astype(np.float64))
                m = s.max()
                e = np.exp(s - m)
                lse[b, h, i] = m + math.log(e.sum())
                o[b, i, h] = (e / e.sum()) @ v[b, n, j].astype(np.float64)
    return o, lse


def close(got, ref, tol=2e-2, what=""):
    got, ref = to_host(got).astype(np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten?)"
    err = np.abs(got - ref).max() if got.size else 0.0
    lim = tol * max(1.0, np.abs(ref).max() if ref.size else 0.0)
    assert err <= lim, f"{what}: max error {err:.4g} > {lim:.4g}"


CASES = [  # (B, Tq, Tk, H, Hkv, D, causal)
    (2, 16, 16, 4, 2, 32, True),
    (1, 9, 9, 2, 1, 64, True),
    (1, 7, 12, 2, 2, 64, True),   # Tq < Tk: causal mask aligned at the end
    (1, 12, 5, 2, 1, 64, True),   # Tq > Tk: the first rows see no key
    (2, 5, 11, 4, 4, 128, False),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_f64(rng, case):
    Bsz, Tq, Tk, H, Hkv, D, causal = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    o, lse = ck.flash_attention(q, k, v, causal=causal, return_lse=True)
    o64, lse64 = f64_attention(q, k, v, causal, 1 / math.sqrt(D))
    close(o, o64, 1e-2, "o")
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse64))
    fin = np.isfinite(lse64)
    np.testing.assert_allclose(lse[fin], lse64[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_reference_backward_matches_finite_differences(rng, case):
    """d/dx of sum(w * o) by central differences of the float64 forward, against the reference backward."""
    Bsz, Tq, Tk, H, Hkv, D, causal = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    scale = 1 / math.sqrt(D)
    o, lse = ck.flash_attention(q, k, v, causal=causal, return_lse=True)
    w = rng.standard_normal(o.shape).astype(np.float32).astype(BF16)
    dq, dk, dv = ck.flash_attention_backward(w, q, k, v, o, lse, causal=causal)
    for name, arr, got in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
        x64 = arr.astype(np.float64)
        num = np.zeros_like(x64)
        idx = list(np.ndindex(arr.shape))
        for ix in [idx[i] for i in rng.choice(len(idx), size=min(12, len(idx)), replace=False)]:
            vals = []
            for sgn in (1, -1):
                xs = {"q": q.astype(np.float64), "k": k.astype(np.float64), "v": v.astype(np.float64)}
                xs[name] = x64.copy()
                xs[name][ix] += sgn * 1e-4
                oo, _ = f64_attention(xs["q"], xs["k"], xs["v"], causal, scale)
                vals.append((oo * w.astype(np.float64)).sum())
            num[ix] = (vals[0] - vals[1]) / 2e-4
            # o (and so delta) enters the reference rounded to bf16: allow that and dS's bf16 inputs.
            assert abs(float(got[ix]) - num[ix]) <= 2e-2 * (1 + abs(num[ix])), (name, ix, float(got[ix]), num[ix])


def test_validation():
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 1, 4, 4, 2, 1, 64)
    with pytest.raises(TypeError, match="q: expected dtype bfloat16"):
        ck.flash_attention(q.astype(np.float32), k, v)
    with pytest.raises(ValueError, match="q: head_dim must be one of"):
        ck.flash_attention(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(ValueError, match="kv_heads"):
        k2 = np.concatenate([k, k], 2)
        ck.flash_attention(np.concatenate([q, q[:, :, :1]], 2), k2, k2)
    with pytest.raises(ValueError, match="k: expected shape"):
        ck.flash_attention(q, k[:, :, :, :32], v)
    with pytest.raises(ValueError, match="v: expected shape"):
        ck.flash_attention(q, k, v[:, :3])
    with pytest.raises(TypeError, match="causal"):
        ck.flash_attention(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="scale: expected a finite number > 0"):
        ck.flash_attention(q, k, v, scale=-0.5)
    with pytest.raises(ValueError, match="q: expected 4 dimensions"):
        ck.flash_attention(q[0], k, v)
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse: expected shape"):
        ck.flash_attention_backward(o, q, k, v, o, lse[:, :1])
    with pytest.raises(TypeError, match="out: expected dtype bfloat16"):
        ck.flash_attention_backward(o, q, k, v, o.astype(np.float32), lse)


# ------------------------------------------------------------------------------------------ key-padding masks
def make_key_mask(rng, kind, Bsz, Tk):
    """A [Bsz, Tk] bool keep mask (True = real key). left / right: row 0 unpadded, the others padded by a random
    count in [1, Tk); left64: pads of whole 64-key tiles (the kernels' skip boundary); holes: random gaps;
    rowmasked: holes, and the last row all padding (every query of that row sees no key)."""
    m = np.ones((Bsz, Tk), dtype=bool)
    for b in range(1, Bsz):
        pad = int(rng.integers(1, Tk)) if Tk > 1 else 0
        if kind == "left":
            m[b, :pad] = False
        elif kind == "right":
            m[b, Tk - pad:] = False
        elif kind == "left64":
            m[b, :min(64 * b, Tk - 1)] = False
    if kind in ("holes", "rowmasked"):
        m = rng.random((Bsz, Tk)) > 0.35
    if kind == "rowmasked":
        m[-1] = False
    return m


MASK_CASES = [  # (B, Tq, Tk, H, Hkv, D, causal, kind)
    (3, 9, 9, 2, 1, 64, True, "left"),
    (3, 9, 9, 2, 1, 64, False, "right"),
    (2, 7, 12, 2, 2, 32, True, "holes"),      # Tq < Tk
    (2, 12, 5, 2, 1, 64, True, "left"),       # Tq > Tk: rows that see no key from both masks
    (3, 5, 11, 4, 2, 128, False, "rowmasked"),
    (2, 1, 1, 2, 1, 64, True, "rowmasked"),
]


@pytest.mark.parametrize("case", MASK_CASES)
def test_reference_with_key_mask_matches_f64(rng, case):
    Bsz, Tq, Tk, H, Hkv, D, causal, kind = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    m = make_key_mask(rng, kind, Bsz, Tk)
    o, lse = ck.flash_attention(q, k, v, causal=causal, key_mask=m, return_lse=True)
    o64, lse64 = f64_attention(q, k, v, causal, 1 / math.sqrt(D), key_mask=m)
    close(o, o64, 1e-2, "o")
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse64))
    fin = np.isfinite(lse64)
    np.testing.assert_allclose(lse[fin], lse64[fin], rtol=1e-5, atol=1e-5)
    # A query that sees no key: exactly o = 0, lse = -inf.
    dead = ~fin.transpose(0, 2, 1)  # [B, Tq, H]
    assert (o.astype(np.float32)[dead] == 0).all()
    if kind == "rowmasked":
        assert np.isneginf(lse[-1]).all()


@pytest.mark.parametrize("case", MASK_CASES)
def test_reference_backward_with_key_mask_matches_finite_differences(rng, case):
    """Central differences of the float64 forward (masked keys left out of each query's key list) against the
    reference backward; padding keys get exactly dk = dv = 0 and queries that see no key exactly dq = 0."""
    Bsz, Tq, Tk, H, Hkv, D, causal, kind = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    m = make_key_mask(rng, kind, Bsz, Tk)
    scale = 1 / math.sqrt(D)
    o, lse = ck.flash_attention(q, k, v, causal=causal, key_mask=m, return_lse=True)
    w = rng.standard_normal(o.shape).astype(np.float32).astype(BF16)
    dq, dk, dv = ck.flash_attention_backward(w, q, k, v, o, lse, causal=causal, key_mask=m)
    for a in (dq, dk, dv):
        assert np.isfinite(a.astype(np.float32)).all()
    assert (dk.astype(np.float32)[~m] == 0).all() and (dv.astype(np.float32)[~m] == 0).all()
    assert (dq.astype(np.float32)[np.isneginf(lse).transpose(0, 2, 1)] == 0).all()
    for name, arr, got in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
        x64 = arr.astype(np.float64)
        idx = list(np.ndindex(arr.shape))
        for ix in [idx[i] for i in rng.choice(len(idx), size=min(12, len(idx)), replace=False)]:
            vals = []
            for sgn in (1, -1):
                xs = {"q": q.astype(np.float64), "k": k.astype(np.float64), "v": v.astype(np.float64)}
                xs[name] = x64.copy()
                xs[name][ix] += sgn * 1e-4
                oo, _ = f64_attention(xs["q"], xs["k"], xs["v"], causal, scale, key_mask=m)
                vals.append((oo * w.astype(np.float64)).sum())
            num = (vals[0] - vals[1]) / 2e-4
            assert abs(float(got[ix]) - num) <= 2e-2 * (1 + abs(num)), (name, ix, float(got[ix]), num)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_all_ones_key_mask_equals_no_mask(rng, causal):
    q, k, v = qkv(rng, 2, 13, 17, 4, 2, 64)
    o0, l0 = ck.flash_attention(q, k, v, causal=causal, return_lse=True)
    for m in (np.ones((2, 17), bool), np.full((2, 17), 3, np.int64)):
        o1, l1 = ck.flash_attention(q, k, v, causal=causal, key_mask=m, return_lse=True)
        np.testing.assert_array_equal(o1.view(np.uint16), o0.view(np.uint16))
        np.testing.assert_array_equal(l1, l0)
        g0 = ck.flash_attention_backward(o0, q, k, v, o0, l0, causal=causal)
        g1 = ck.flash_attention_backward(o0, q, k, v, o0, l0, causal=causal, key_mask=m)
        for a, b in zip(g0, g1):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_reference_key_mask_integer_dtypes_mean_nonzero(rng):
    """Any nonzero entry keeps the key (256 and 2**40 have a zero low byte; -1 is negative)."""
    q, k, v = qkv(rng, 2, 6, 6, 2, 1, 64)
    m = make_key_mask(rng, "holes", 2, 6)
    ref = ck.flash_attention(q, k, v, key_mask=m)
    for dt, val in ((np.uint8, 2), (np.int8, -1), (np.int16, 256), (np.int32, 256), (np.int64, 2**40),
                    (np.uint64, 2**63)):
        mm = np.where(m, val, 0).astype(dt)
        np.testing.assert_array_equal(ck.flash_attention(q, k, v, key_mask=mm).view(np.uint16), ref.view(np.uint16))


def test_key_mask_scale_causal_validation():
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, 2, 4, 6, 2, 1, 64)
    m = np.ones((2, 6), bool)
    with pytest.raises(TypeError, match="key_mask: expected dtype bool or an integer dtype"):
        ck.flash_attention(q, k, v, key_mask=m.astype(np.float32))
    with pytest.raises(ValueError, match=r"key_mask: expected shape \(2, 6\)"):
        ck.flash_attention(q, k, v, key_mask=m[:1])
    with pytest.raises(ValueError, match=r"key_mask: expected shape \(2, 6\)"):
        ck.flash_attention(q, k, v, key_mask=m[:, :4])
    with pytest.raises(ValueError, match=r"key_mask: expected shape \(2, 6\)"):
        ck.flash_attention(q, k, v, key_mask=m[0])
    with pytest.raises(ValueError, match="key_mask: the last axis"):
        ck.flash_attention(q, k, v, key_mask=np.ones((6, 2), np.int32).T)
    with pytest.raises(ValueError, match="key_mask: the last axis"):
        ck.flash_attention(q, k, v, key_mask=np.ones((2, 12), np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="key_mask: expected a numpy.ndarray"):
        ck.flash_attention(q, k, v, key_mask=[[1] * 6] * 2)
    # a row slice of a longer mask is accepted (row stride != seq_k)
    ck.flash_attention(q, k, v, key_mask=np.ones((2, 10), np.int64)[:, 2:8])
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="key_mask: expected shape"):
        ck.flash_attention_backward(o, q, k, v, o, lse, key_mask=m[:, :5])
    with pytest.raises(TypeError, match="key_mask: expected dtype"):
        ck.flash_attention_backward(o, q, k, v, o, lse, key_mask=m.astype(np.float64))
    for bad in (True, "0.5", None.__class__, [0.5], np.array([0.5])):
        with pytest.raises(TypeError, match="scale: expected a real number"):
            ck.flash_attention(q, k, v, scale=bad)
    # 1e-60 and 1e60 are fine doubles but 0 and inf in float32, which the kernels take
    for bad in (0, -1.0, float("inf"), float("nan"), 1e-60, 1e60):
        with pytest.raises(ValueError, match="scale: expected a (finite )?number"):
            ck.flash_attention(q, k, v, scale=bad)
        with pytest.raises(ValueError, match="scale: expected a (finite )?number"):
            ck.flash_attention_backward(o, q, k, v, o, lse, scale=bad)
    ck.flash_attention(q, k, v, scale=np.float64(0.1))
    ck.flash_attention(q, k, v, scale=2)
    for bad in (1, None, "yes", np.array(True)):
        with pytest.raises(TypeError, match="causal: expected True or False"):
            ck.flash_attention(q, k, v, causal=bad)


# ------------------------------------------------------------------------------------------ sliding window
WINDOW_CASES = [  # (B, Tq, Tk, H, Hkv, D, window)
    (2, 16, 16, 4, 2, 32, 1),     # each query sees itself only
    (1, 9, 9, 2, 1, 64, 3),
    (1, 7, 12, 2, 2, 64, 4),      # Tq < Tk: positions i + 5
    (1, 12, 5, 2, 1, 64, 2),      # Tq > Tk: the first rows see no key
    (2, 20, 20, 8, 2, 128, 7),    # GQA 4
    (1, 10, 10, 2, 2, 64, 10),    # W = Tk: no window
    (1, 6, 9, 2, 1, 32, 50),      # W > Tk
]


@pytest.mark.parametrize("case", WINDOW_CASES)
@pytest.mark.parametrize("kind", [None, "left", "holes"])
def test_reference_window_matches_f64(rng, case, kind):
    """The sliding window (alone and with a key mask) against per-row float64 loops over each query's explicit key
    list; a query that sees no key (Tq > Tk, or only padding in its window) gets o = 0, lse = -inf."""
    Bsz, Tq, Tk, H, Hkv, D, W = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    m = None if kind is None else make_key_mask(rng, kind, Bsz, Tk)
    o, lse = ck.flash_attention(q, k, v, causal=True, key_mask=m, window=W, return_lse=True)
    o64, lse64 = f64_attention(q, k, v, True, 1 / math.sqrt(D), key_mask=m, window=W)
    close(o, o64, 1e-2, "o")
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse64))
    fin = np.isfinite(lse64)
    np.testing.assert_allclose(lse[fin], lse64[fin], rtol=1e-5, atol=1e-5)
    assert (o.astype(np.float32)[~fin.transpose(0, 2, 1)] == 0).all()


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_reference_window_backward_matches_finite_differences(rng, case):
    """Central differences of the float64 forward with the window against the reference backward."""
    Bsz, Tq, Tk, H, Hkv, D, W = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    scale = 1 / math.sqrt(D)
    o, lse = ck.flash_attention(q, k, v, window=W, return_lse=True)
    w = rng.standard_normal(o.shape).astype(np.float32).astype(BF16)
    dq, dk, dv = ck.flash_attention_backward(w, q, k, v, o, lse, window=W)
    for name, arr, got in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
        x64 = arr.astype(np.float64)
        idx = list(np.ndindex(arr.shape))
        for ix in [idx[i] for i in rng.choice(len(idx), size=min(12, len(idx)), replace=False)]:
            vals = []
            for sgn in (1, -1):
                xs = {"q": q.astype(np.float64), "k": k.astype(np.float64), "v": v.astype(np.float64)}
                xs[name] = x64.copy()
                xs[name][ix] += sgn * 1e-4
                oo, _ = f64_attention(xs["q"], xs["k"], xs["v"], True, scale, window=W)
                vals.append((oo * w.astype(np.float64)).sum())
            num = (vals[0] - vals[1]) / 2e-4
            assert abs(float(got[ix]) - num) <= 2e-2 * (1 + abs(num)), (name, ix, float(got[ix]), num)


def test_reference_window_one_is_v_of_the_own_position(rng):
    """W = 1: query i sees key i + Tk - Tq only, so o is that row of v (rounded to bf16: exact) and dv its dO."""
    q, k, v = qkv(rng, 2, 5, 8, 4, 2, 64)
    o, lse = ck.flash_attention(q, k, v, window=1, return_lse=True)
    want = np.repeat(v[:, 3:], 2, axis=2)  # heads 2j, 2j + 1 read K/V head j
    np.testing.assert_array_equal(o.view(np.uint16), want.view(np.uint16))
    w = qkv(rng, 2, 5, 8, 4, 2, 64)[0]
    dq, dk, dv = ck.flash_attention_backward(w, q, k, v, o, lse, window=1)
    for g in (dq, dk):  # P = 1: dS = dP - delta = <dO, v> - <dO, o> = 0 up to the two sums' rounding
        np.testing.assert_allclose(g.astype(np.float32), 0, atol=1e-4)
    np.testing.assert_allclose(dv[:, 3:].astype(np.float32),
                               w.astype(np.float32).reshape(2, 5, 2, 2, 64).sum(3), rtol=1e-2, atol=1e-2)
    assert (dv[:, :3].astype(np.float32) == 0).all()  # keys no query sees


@pytest.mark.parametrize("W", [13, 14, 2**31 - 1, np.int64(20)])
def test_reference_window_at_least_seq_k_is_no_window(rng, W):
    """W >= seq_k hides nothing: o, lse and the gradients equal the no-window call bit for bit."""
    q, k, v = qkv(rng, 2, 9, 13, 4, 2, 64)
    w = qkv(rng, 2, 9, 13, 4, 2, 64)[0]
    o0, l0 = ck.flash_attention(q, k, v, return_lse=True)
    o1, l1 = ck.flash_attention(q, k, v, window=W, return_lse=True)
    np.testing.assert_array_equal(o1.view(np.uint16), o0.view(np.uint16))
    np.testing.assert_array_equal(l1, l0)
    for a, b in zip(ck.flash_attention_backward(w, q, k, v, o0, l0),
                    ck.flash_attention_backward(w, q, k, v, o0, l0, window=W)):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_window_validation():
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 1, 4, 6, 2, 1, 64)
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    calls = (lambda **kw: ck.flash_attention(q, k, v, **kw),
             lambda **kw: ck.flash_attention_backward(o, q, k, v, o, lse, **kw))
    for call in calls:
        with pytest.raises(ValueError, match=r"^window: a sliding window .* needs causal=True"):
            call(causal=False, window=3)
        with pytest.raises(ValueError, match=r"^window: a sliding window"):  # refused even where it hides nothing
            call(causal=False, window=100)
        for bad in (True, np.bool_(False), 2.0, "3", [3], np.array(3.5)):
            with pytest.raises(TypeError, match=r"^window: expected an integer >= 1 .* or None"):
                call(window=bad)
        for bad in (0, -1, np.int32(-5)):
            with pytest.raises(ValueError, match=r"^window: expected an integer >= 1"):
                call(window=bad)
        with pytest.raises(ValueError, match=r"^window: expected an integer <= 2147483647"):
            call(window=2**40)
        call(window=np.int32(2))
        call(window=None, causal=False)


# The sliding window's tile ranges in kernels_cu/attention.cu, modelled (CPU; the GPU tests run the kernels): fwd /
# dq start the key loop at tile window_first(q0) / BN, dkdv ends the query loop after the last query tile that sees
# the block's last key; a tile skips the element mask only when every pair in it is visible.
CU = __import__("pathlib").Path(__file__).resolve().parent.parent / "kernels_cu" / "attention.cu"


def _visible(i, n, Tq, Tk, W):
    off = Tk - Tq
    return (i < Tq) & (n < Tk) & (n <= i + off) & (i + off - n < W)


def _check_fwd_model(Tq, Tk, BN, W):
    """attn_fwd / attn_bwd_dq with SW: blocks of 64 query rows (warps of 16), key tiles of BN."""
    off = Tk - Tq
    for q0 in range(0, Tq, 64):
        kend = min(Tk, q0 + 64 + off)
        nkb = -(-kend // BN) if kend > 0 else 0
        jb0 = min(nkb, max(0, q0 + off - W + 1) // BN)
        rows = np.arange(q0, min(q0 + 64, Tq))
        for i in rows:  # coverage: every visible key lies in the loop's tiles
            n = np.arange(Tk)[_visible(i, np.arange(Tk), Tq, Tk, W)]
            assert n.size == 0 or (n.min() >= jb0 * BN and n.max() < nkb * BN), (Tq, Tk, BN, W, i)
        for jb in range(jb0, nkb):
            n0 = jb * BN
            for w in range(4):
                r0 = q0 + 16 * w
                masked = n0 + BN > Tk or n0 + BN - 1 > r0 + off or r0 + 15 + off - n0 >= W
                i = np.arange(r0, min(r0 + 16, Tq))[:, None]
                if not masked and i.size:  # unmasked: every pair of real rows must be visible
                    assert _visible(i, np.arange(n0, n0 + BN)[None, :], Tq, Tk, W).all(), (Tq, Tk, BN, W, r0, n0)


def _check_dkdv_model(Tq, Tk, BQ, W):
    """attn_bwd_dkdv with SW: blocks of 64 keys (warps of 16), query tiles of BQ (queries >= Tq have p = 0 and keys
    >= Tk are never stored, so only real pairs count)."""
    off, nqb = Tk - Tq, -(-Tq // BQ)
    for k0 in range(0, Tk, 64):
        qstart = max(0, k0 - off) // BQ
        qend = min(nqb, (max(-1, min(k0 + 64, Tk) - 1 - off + W - 1) + BQ) // BQ)
        for n in range(k0, min(k0 + 64, Tk)):
            i = np.arange(Tq)[_visible(np.arange(Tq), n, Tq, Tk, W)]
            assert i.size == 0 or (i.min() // BQ >= qstart and i.max() // BQ < qend), (Tq, Tk, BQ, W, n)
        for qi in range(qstart, qend):
            r = qi * BQ
            for w in range(4):
                kw = k0 + 16 * w
                masked = r + off < kw + 15 or r + BQ - 1 + off - kw >= W
                n = np.arange(kw, min(kw + 16, Tk))[:, None]
                if not masked and n.size:
                    assert _visible(np.arange(r, min(r + BQ, Tq))[None, :], n, Tq, Tk, W).all(), (Tq, Tk, W, kw, r)


@pytest.mark.parametrize("Tq,Tk", [(1, 1), (130, 130), (200, 200), (70, 190), (190, 70), (333, 333)])
def test_window_tile_ranges_cover_every_visible_pair(Tq, Tk):
    """Model of attention.cu's sliding-window loops for every head_dim's tiles (TILES) and windows below, across and
    above the tile sizes: each visible pair is in a computed tile, and a tile left unmasked holds visible pairs only."""
    from cukernels.ops.attention import TILES

    src = CU.read_text()
    assert "const int jb0 = SW ? min(nkb, window_first(q0, off, W) / BN) : 0;" in src
    assert "if (SW) qend = min(qend, (window_last_query(min(k0 + BM, Tk) - 1, off, W) + BQ) / BQ);" in src
    assert "const bool cut = SW && window_cuts(q0 + warp * 16 + 15, n0, off, W);" in src
    assert "(SW && window_cuts(r + BQ - 1, k0 + warp * 16, off, W))" in src
    for W in sorted({1, 5, 31, 32, 33, 64, 65, 100, 129, max(1, Tk - 1)}):
        if W >= Tk:
            continue
        for bn_fwd, bn_dq, bq in TILES.values():
            _check_fwd_model(Tq, Tk, bn_fwd, W)
            _check_fwd_model(Tq, Tk, bn_dq, W)
            _check_dkdv_model(Tq, Tk, bq, W)


def test_functional_window_reaches_forward_and_backward(rng):
    """F.flash_attention / F.flash_attention_packed pass ``window`` to the forward and the backward: outputs and
    gradients equal the ops' windowed calls (NumPy path)."""
    from cukernels import functional as F
    from cukernels.autograd import Tensor

    Bsz, T, H, Hkv, D, W = 2, 11, 4, 2, 32, 3
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    g = qkv(rng, Bsz, T, T, H, Hkv, D)[0]
    o, lse = ck.flash_attention(q, k, v, window=W, return_lse=True)
    ref = ck.flash_attention_backward(g, q, k, v, o, lse, window=W)
    ts = [Tensor(x.copy(), requires_grad=True) for x in (q, k, v)]
    out = F.flash_attention(*ts, window=W)
    np.testing.assert_array_equal(out.data.view(np.uint16), o.view(np.uint16))
    out.backward(g)
    for t, r in zip(ts, ref):
        np.testing.assert_array_equal(t.grad.astype(np.float32), r.astype(np.float32))
    qkv_ = Tensor(np.concatenate([q, k, v], axis=2), requires_grad=True)
    out = F.flash_attention_packed(qkv_, H, Hkv, window=W)
    np.testing.assert_array_equal(out.data.view(np.uint16), o.view(np.uint16))
    out.backward(g)
    for got, r in zip((qkv_.grad[:, :, :H], qkv_.grad[:, :, H:H + Hkv], qkv_.grad[:, :, H + Hkv:]), ref):
        np.testing.assert_array_equal(got.astype(np.float32), r.astype(np.float32))


# ================================================================================================ GPU
GPU_CASES = CASES + [
    (2, 64, 64, 4, 2, 64, True),
    (1, 1, 1, 2, 1, 64, True),
    (2, 100, 100, 4, 4, 32, True),
    (1, 257, 257, 8, 2, 128, True),
    (2, 77, 77, 4, 1, 64, False),
    (1, 30, 95, 4, 2, 64, True),
    (1, 130, 70, 2, 1, 64, False),
    (1, 50, 20, 2, 2, 64, True),
    (2, 1000, 1000, 4, 2, 64, True),
    (1, 333, 333, 2, 1, 128, False),
]


def _dev(*arrs):
    return [cp().asarray(a) for a in arrs]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_forward_backward_match_reference(rng, case):
    Bsz, Tq, Tk, H, Hkv, D, causal = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    w = qkv(rng, Bsz, Tq, Tq, H, Hkv, D)[0]
    ro, rl = ck.flash_attention(q, k, v, causal=causal, return_lse=True)
    dq_, dk_, dv_ = _dev(q, k, v)
    out = cp().full(q.shape, np.nan, dtype=BF16)  # poisoned: every element must be written
    o, lse = ck.flash_attention(dq_, dk_, dv_, causal=causal, out=out, return_lse=True)
    assert o is out
    close(o, ro, 2e-2, "o")
    lh = to_host(lse)
    np.testing.assert_array_equal(np.isinf(lh), np.isinf(rl))
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lh[fin], rl[fin], rtol=1e-4, atol=1e-4)
    # Backward from the reference's own o / lse so both sides see the same inputs.
    rq, rk, rv = ck.flash_attention_backward(w, q, k, v, ro, rl, causal=causal)
    gq, gk, gv = ck.flash_attention_backward(cp().asarray(w), dq_, dk_, dv_, cp().asarray(ro), cp().asarray(rl),
                                             causal=causal)
    close(gq, rq, 3e-2, "dq")
    close(gk, rk, 3e-2, "dk")
    close(gv, rv, 3e-2, "dv")


@pytest.mark.gpu
def test_gpu_strided_views_are_read_in_place(rng):
    """q, k, v as slices of one fused [B, T, H + 2 Hkv, D] projection and dO as a transposed view."""
    Bsz, T, H, Hkv, D = 2, 150, 4, 2, 64
    qkv_ = (rng.standard_normal((Bsz, T, H + 2 * Hkv, D))).astype(np.float32).astype(BF16)
    q, k, v = qkv_[:, :, :H], qkv_[:, :, H:H + Hkv], qkv_[:, :, H + Hkv:]
    # dO laid out [B, H, T, D] and passed as a [B, T, H, D] view
    do = np.ascontiguousarray(rng.standard_normal((Bsz, H, T, D)).astype(np.float32).astype(BF16))
    ro, rl = ck.flash_attention(q, k, v, return_lse=True)
    rq, rk, rv = ck.flash_attention_backward(do.transpose(0, 2, 1, 3), q, k, v, ro, rl)
    G = cp().asarray(qkv_)
    o, lse = ck.flash_attention(G[:, :, :H], G[:, :, H:H + Hkv], G[:, :, H + Hkv:], return_lse=True)
    close(o, ro, 2e-2, "o")
    gq, gk, gv = ck.flash_attention_backward(cp().asarray(do).transpose(0, 2, 1, 3), G[:, :, :H],
                                             G[:, :, H:H + Hkv], G[:, :, H + Hkv:], o, lse)
    close(gq, rq, 3e-2, "dq")
    close(gk, rk, 3e-2, "dk")
    close(gv, rv, 3e-2, "dv")


def test_reference_grads_out_packed_slices(rng):
    """``grads_out``: the gradients written into the head slices of one packed dqkv, equal to the returned ones;
    bad buffers are named."""
    Bsz, T, H, Hkv, D = 2, 9, 4, 2, 32
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    w = qkv(rng, Bsz, T, T, H, Hkv, D)[0]
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    ref = ck.flash_attention_backward(w, q, k, v, o, lse)
    dqkv = np.full((Bsz, T, H + 2 * Hkv, D), np.nan, dtype=BF16)
    outs = (dqkv[:, :, :H], dqkv[:, :, H:H + Hkv], dqkv[:, :, H + Hkv:])
    got = ck.flash_attention_backward(w, q, k, v, o, lse, grads_out=outs)
    assert all(g is b for g, b in zip(got, outs))
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g.astype(np.float32), r.astype(np.float32))
    with pytest.raises(TypeError, match="grads_out: expected a tuple"):
        ck.flash_attention_backward(w, q, k, v, o, lse, grads_out=dqkv)
    with pytest.raises(ValueError, match=r"grads_out\[dk\]: expected shape"):
        ck.flash_attention_backward(w, q, k, v, o, lse, grads_out=(outs[0], outs[0], outs[2]))
    with pytest.raises(TypeError, match=r"grads_out\[dv\]: expected dtype"):
        ck.flash_attention_backward(w, q, k, v, o, lse, grads_out=(*outs[:2], np.zeros(k.shape, np.float32)))


def test_reference_rope_grads(rng):
    """``rope=(cos, sin, positions)``: dq and dk are the plain gradients put through ck.rope_backward (dv as is);
    seq_q != seq_k and a bad tuple are named errors."""
    Bsz, T, H, Hkv, D = 2, 7, 4, 2, 32
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    w = qkv(rng, Bsz, T, T, H, Hkv, D)[0]
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    cos, sin = ck.rope_cache(T + 3, D, xp=np)
    pos = rng.integers(0, T + 3, (Bsz, T)).astype(np.int32)
    plain = ck.flash_attention_backward(w, q, k, v, o, lse)
    got = ck.flash_attention_backward(w, q, k, v, o, lse, rope=(cos, sin, pos))
    for g, r in zip(got[:2], plain[:2]):
        want = ck.rope_backward(r, cos, sin, positions=pos)
        np.testing.assert_array_equal(g.astype(np.float32), want.astype(np.float32))
    np.testing.assert_array_equal(got[2].astype(np.float32), plain[2].astype(np.float32))
    with pytest.raises(TypeError, match="rope: expected a tuple"):
        ck.flash_attention_backward(w, q, k, v, o, lse, rope=cos)
    q2 = q[:, :5]
    o2, l2 = ck.flash_attention(q2, k, v, return_lse=True)
    with pytest.raises(ValueError, match="rope: q and k must be rotated at the same positions"):
        ck.flash_attention_backward(w[:, :5], q2, k, v, o2, l2, rope=(cos, sin, None))


@pytest.mark.gpu
@pytest.mark.parametrize("pos_kind", ["none", "1d_i32", "2d_i32", "2d_i64"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_rope_grads_fused_in_the_store(rng, pos_kind, D, packed):
    """The sm_90 kernels' fused rope backward (dq, dk rotated in fp32 before the store) against flash backward +
    ck.rope_backward on the GPU: within one bf16 rounding (the separate path rounds twice); dv bit-identical; into
    the packed dqkv's head slices too; int64 positions take the separate rope after."""
    Bsz, T, H, Hkv = 2, 300, 4, 2
    q, k, v = _dev(*qkv(rng, Bsz, T, T, H, Hkv, D))
    w = _dev(qkv(rng, Bsz, T, T, H, Hkv, D)[0])[0]
    o, lse = ck.flash_attention(q, k, v, return_lse=True)
    L = T + 5
    cos, sin = (cp().asarray(a) for a in ck.rope_cache(L, D, xp=np))
    pos = {"none": None, "1d_i32": rng.integers(0, L + 3, T).astype(np.int32),  # (some clamped into the table)
           "2d_i32": rng.integers(0, L, (Bsz, T)).astype(np.int32),
           "2d_i64": rng.integers(0, L, (Bsz, T)).astype(np.int64)}[pos_kind]
    pos = None if pos is None else cp().asarray(pos)
    plain = ck.flash_attention_backward(w, q, k, v, o, lse)
    ref = [to_host(ck.rope_backward(g, cos, sin, positions=pos)) for g in plain[:2]] + [to_host(plain[2])]
    outs = None
    if packed:
        dqkv = cp().full((Bsz, T, H + 2 * Hkv, D), np.nan, dtype=BF16)
        outs = (dqkv[:, :, :H], dqkv[:, :, H:H + Hkv], dqkv[:, :, H + Hkv:])
    got = ck.flash_attention_backward(w, q, k, v, o, lse, grads_out=outs, rope=(cos, sin, pos))
    for g, r, n in zip(got[:2], ref[:2], ("dq", "dk")):
        gh, rf = to_host(g).astype(np.float32), r.astype(np.float32)
        scale = np.abs(rf).max()
        np.testing.assert_allclose(gh, rf, rtol=2 ** -7, atol=scale * 2 ** -7, err_msg=n)  # <= 4 half-ulps apart
    assert np.array_equal(to_host(got[2]).view(np.uint16), ref[2].view(np.uint16))
    again = ck.flash_attention_backward(w, q, k, v, o, lse, rope=(cos, sin, pos))
    for a, b in zip(again, got):
        assert np.array_equal(to_host(a).view(np.uint16), to_host(b).view(np.uint16)), "rerun not bit-identical"


@pytest.mark.gpu
@pytest.mark.parametrize("key_mask", [False, True])
@pytest.mark.parametrize("D", [64, 128, 32])
def test_gpu_grads_out_packed_slices(rng, key_mask, D):
    """grads_out = the head slices of one packed dqkv (poisoned): the sm_90 kernels store there through their
    output strides (D 64 / 128, no key mask); the mma.sync path (key mask, D 32) copies in. Equal to the returned
    arrays of a plain call, bit for bit; a dv view with strides other than dk's goes through a copy."""
    Bsz, T, H, Hkv = 2, 200, 4, 2
    q, k, v = _dev(*qkv(rng, Bsz, T, T, H, Hkv, D))
    w = _dev(qkv(rng, Bsz, T, T, H, Hkv, D)[0])[0]
    km = cp().asarray(make_key_mask(rng, "left", Bsz, T)) if key_mask else None
    kw = {"key_mask": km} if key_mask else {}
    o, lse = ck.flash_attention(q, k, v, return_lse=True, **kw)
    ref = [to_host(a) for a in ck.flash_attention_backward(w, q, k, v, o, lse, **kw)]
    dqkv = cp().full((Bsz, T, H + 2 * Hkv, D), np.nan, dtype=BF16)
    outs = (dqkv[:, :, :H], dqkv[:, :, H:H + Hkv], dqkv[:, :, H + Hkv:])
    got = ck.flash_attention_backward(w, q, k, v, o, lse, grads_out=outs, **kw)
    assert all(g is b for g, b in zip(got, outs))
    for g, r, n in zip(got, ref, ("dq", "dk", "dv")):
        assert np.array_equal(to_host(g).view(np.uint16), r.view(np.uint16)), n
    other = cp().full((Bsz, Hkv, T, D), np.nan, dtype=BF16).transpose(0, 2, 1, 3)  # dv laid out [B, Hkv, T, D]
    got = ck.flash_attention_backward(w, q, k, v, o, lse, grads_out=(*outs[:2], other), **kw)
    assert got[2] is other and np.array_equal(to_host(other).view(np.uint16), ref[2].view(np.uint16))


@pytest.mark.gpu
def test_gpu_misaligned_view_is_refused(rng):
    q, k, v = _dev(*qkv(rng, 1, 8, 8, 2, 1, 64))
    buf = cp().zeros(q.size + 1, dtype=BF16)
    qm = buf[1:].reshape(q.shape)
    with pytest.raises(ValueError, match="q: the kernels read 16-byte chunks"):
        ck.flash_attention(qm, k, v)
    with pytest.raises(ValueError, match="k: the last axis"):
        ck.flash_attention(q, cp().asfortranarray(k), v)


@pytest.mark.gpu
def test_gpu_large_scores_and_determinism(rng):
    """Scores of +-1e3 (q, k scaled by 40): the online softmax must not overflow; two runs are bit-identical."""
    Bsz, T, H, Hkv, D = 2, 300, 4, 2, 64
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    q, k = (q.astype(np.float32) * 40).astype(BF16), (k.astype(np.float32) * 40).astype(BF16)
    ro, rl = ck.flash_attention(q, k, v, return_lse=True)
    Q, K, V = _dev(q, k, v)
    o1, l1 = ck.flash_attention(Q, K, V, return_lse=True)
    o2, l2 = ck.flash_attention(Q, K, V, return_lse=True)
    close(o1, ro, 2e-2, "o")
    np.testing.assert_array_equal(to_host(o1).view(np.uint16), to_host(o2).view(np.uint16))
    np.testing.assert_array_equal(to_host(l1), to_host(l2))
    do = cp().asarray(qkv(rng, Bsz, T, T, H, Hkv, D)[0])
    a = ck.flash_attention_backward(do, Q, K, V, o1, l1)
    b = ck.flash_attention_backward(do, Q, K, V, o1, l1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(to_host(x).view(np.uint16), to_host(y).view(np.uint16))
        assert np.isfinite(to_host(x).astype(np.float32)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_model_flash_path_matches_materialised(rng, padded):
    """A small LLaMA under bf16 autocast: loss and every parameter gradient with flash attention against the
    GEMM + attn_softmax + GEMM path (same weights, same batch). padded: a Hugging Face attention_mask (row 1
    left-padded, row 2 right-padded; padded targets ignored) through both paths: key_mask in the flash kernels,
    the [B, H, T, T] masked softmax in the other."""
    cfg = ck.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    nb = 3 if padded else 2
    ids_h = rng.integers(0, 128, (nb, 200)).astype(np.int32)
    ids = cp().asarray(ids_h)
    kw, targets = {}, ids
    if padded:
        mask = np.ones((nb, 200), np.int64)
        mask[1, :57] = 0
        mask[2, 150:] = 0
        kw = dict(attention_mask=cp().asarray(mask))
        targets = cp().asarray(np.where(mask != 0, ids_h, -100).astype(np.int32))
    res = []
    for flash in (False, True):
        m = ck.Llama(cfg, xp=cp(), seed=3)
        for mod in m.modules():
            if isinstance(mod, ck.nn.Attention):
                mod.flash = flash
        with ck.autocast(BF16):
            loss = m(ids, targets, **kw)
        loss.backward()
        res.append((float(loss.data), {n: to_host(p.grad) for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = res
    assert abs(l0 - l1) < 2e-3 * abs(l0)
    for n in g0:
        a, b = g0[n].astype(np.float64), g1[n].astype(np.float64)
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12)
        assert rel < 3e-2, (n, rel)


# ------------------------------------------------------------------------------------------ GPU: key-padding masks
def _poison_pool(*specs):
    """Best effort: leave NaN-filled blocks of these (shape, dtype) sizes free in CuPy's memory pool, so that the
    buffers an op allocates itself (lse, dq, dk, dv) most likely start as NaN and an unwritten element fails."""
    bufs = [cp().full(shape, np.nan, dtype=dt) for shape, dt in specs]
    cp().cuda.get_current_stream().synchronize()
    del bufs


GPU_MASK_CASES = [  # (B, Tq, Tk, H, Hkv, D, causal, kind, mask dtype)
    (2, 16, 16, 4, 2, 32, True, "left", np.bool_),
    (3, 7, 7, 2, 1, 64, True, "right", np.uint8),
    (3, 7, 7, 2, 1, 64, False, "holes", np.int64),
    (2, 1, 1, 2, 1, 64, True, "rowmasked", np.int32),
    (2, 1, 1, 2, 2, 128, False, "rowmasked", np.bool_),
    (3, 127, 127, 4, 2, 64, True, "left", np.int64),
    (3, 127, 127, 4, 2, 64, False, "holes", np.bool_),
    (2, 127, 200, 4, 1, 128, True, "left", np.uint8),      # Tq < Tk
    (2, 50, 300, 2, 2, 32, False, "right", np.int8),       # Tq < Tk
    (2, 30, 12, 2, 1, 64, True, "left", np.bool_),         # Tq > Tk
    (2, 7, 1000, 4, 2, 64, True, "holes", np.bool_),       # a few queries against a long key row
    (3, 300, 300, 4, 4, 32, True, "left64", np.bool_),     # padding of whole key tiles (skipped)
    (3, 257, 257, 8, 2, 128, True, "rowmasked", np.int64),
    (2, 333, 333, 2, 1, 128, False, "rowmasked", np.uint8),
    (2, 1000, 1000, 4, 2, 64, True, "left", np.int64),
    (2, 1000, 1000, 4, 1, 64, False, "right", np.bool_),
    (2, 1000, 1000, 2, 1, 128, True, "holes", np.uint8),
    (3, 1000, 1000, 2, 2, 32, True, "left64", np.int32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_MASK_CASES)
def test_gpu_key_mask_matches_reference(rng, case):
    """Kernels vs reference under a key mask: o (poisoned out=), lse (-inf pattern exact), dq / dk / dv; exact
    zeros where nothing is seen (o and dq of queries that see no key, dk and dv of padding keys); no NaN."""
    Bsz, Tq, Tk, H, Hkv, D, causal, kind, mdt = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    w = qkv(rng, Bsz, Tq, Tq, H, Hkv, D)[0]
    m = make_key_mask(rng, kind, Bsz, Tk)
    mh = m.astype(mdt)
    ro, rl = ck.flash_attention(q, k, v, causal=causal, key_mask=mh, return_lse=True)
    Q, K, V, M = _dev(q, k, v, mh)
    out = cp().full(q.shape, np.nan, dtype=BF16)
    _poison_pool(((Bsz, H, Tq), np.float32))
    o, lse = ck.flash_attention(Q, K, V, causal=causal, key_mask=M, out=out, return_lse=True)
    assert o is out
    close(o, ro, 2e-2, "o")
    lh = to_host(lse)
    np.testing.assert_array_equal(np.isneginf(lh), np.isneginf(rl))
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lh[fin], rl[fin], rtol=1e-4, atol=1e-4)
    dead = ~fin.transpose(0, 2, 1)  # [B, Tq, H]: queries that see no key
    assert (to_host(o).astype(np.float32)[dead] == 0).all()
    rq, rk, rv = ck.flash_attention_backward(w, q, k, v, ro, rl, causal=causal, key_mask=mh)
    _poison_pool((q.shape, BF16), (k.shape, BF16), (k.shape, BF16), ((Bsz, H, Tq), np.float32))
    gq, gk, gv = ck.flash_attention_backward(cp().asarray(w), Q, K, V, cp().asarray(ro), cp().asarray(rl),
                                             causal=causal, key_mask=M)
    close(gq, rq, 3e-2, "dq")
    close(gk, rk, 3e-2, "dk")
    close(gv, rv, 3e-2, "dv")
    assert (to_host(gq).astype(np.float32)[dead] == 0).all()
    assert (to_host(gk).astype(np.float32)[~m] == 0).all()
    assert (to_host(gv).astype(np.float32)[~m] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 100, 100, 4, 2, 32), (2, 200, 200, 4, 1, 64), (1, 70, 130, 2, 2, 128)])
def test_gpu_all_ones_key_mask_is_bit_identical_to_no_mask(rng, causal, shape, monkeypatch):
    """The *_km kernels with nothing masked do the unmasked mma.sync kernels' arithmetic in the same order (on
    Hopper an unmasked call at head_dim 64/128 runs the wgmma kernels instead: switched off here)."""
    from cukernels.ops import attention as A
    monkeypatch.setattr(ck.settings, "attention_wgmma", False)
    Bsz, Tq, Tk, H, Hkv, D = shape
    Q, K, V, W = _dev(*qkv(rng, Bsz, Tq, Tk, H, Hkv, D), qkv(rng, Bsz, Tq, Tq, H, Hkv, D)[0])
    o0, l0 = ck.flash_attention(Q, K, V, causal=causal, return_lse=True)
    o1, l1 = ck.flash_attention(Q, K, V, causal=causal, key_mask=cp().ones((Bsz, Tk), dtype=bool), return_lse=True)
    np.testing.assert_array_equal(to_host(o1).view(np.uint16), to_host(o0).view(np.uint16))
    np.testing.assert_array_equal(to_host(l1), to_host(l0))
    g0 = ck.flash_attention_backward(W, Q, K, V, o0, l0, causal=causal)
    g1 = ck.flash_attention_backward(W, Q, K, V, o0, l0, causal=causal, key_mask=cp().ones((Bsz, Tk), np.int64))
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(to_host(a).view(np.uint16), to_host(b).view(np.uint16))


@pytest.mark.gpu
def test_gpu_key_mask_dtypes_huge_padded_scores_and_determinism(rng):
    """Every mask dtype gives bit-identical results (any nonzero entry keeps: 256 and 2**40 have a zero low
    byte), reruns are bit-identical, and padding keys with scores ~1e3 (K scaled by 300 there) change nothing:
    the dkdv kernel computes padding rows unmasked (p overflows to inf, dS to NaN) and must store zeros."""
    Bsz, T, H, Hkv, D = 3, 200, 4, 2, 64
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    m = make_key_mask(rng, "holes", Bsz, T)
    k = np.where(m[:, :, None, None], k.astype(np.float32), k.astype(np.float32) * 300).astype(BF16)
    w = qkv(rng, Bsz, T, T, H, Hkv, D)[0]
    ro, rl = ck.flash_attention(q, k, v, key_mask=m, return_lse=True)
    rg = ck.flash_attention_backward(w, q, k, v, ro, rl, key_mask=m)
    Q, K, V, W = _dev(q, k, v, w)
    base = None
    for dt, val in ((np.bool_, True), (np.bool_, True), (np.uint8, 2), (np.int8, -1), (np.int16, 256),
                    (np.int32, 256), (np.int64, 2**40), (np.uint64, np.uint64(2**63))):
        M = cp().asarray(np.where(m, val, 0).astype(dt))
        o, lse = ck.flash_attention(Q, K, V, key_mask=M, return_lse=True)
        g = ck.flash_attention_backward(W, Q, K, V, o, lse, key_mask=M)
        got = [to_host(o).view(np.uint16), to_host(lse)] + [to_host(x).view(np.uint16) for x in g]
        if base is None:
            base = got
            close(o, ro, 2e-2, "o")
            for name, x, r in zip(("dq", "dk", "dv"), g, rg):
                close(x, r, 3e-2, name)
            assert (to_host(g[1]).astype(np.float32)[~m] == 0).all()
            assert (to_host(g[2]).astype(np.float32)[~m] == 0).all()
        for a, b in zip(got, base):
            np.testing.assert_array_equal(a, b, err_msg=str(dt))


@pytest.mark.gpu
def test_gpu_key_mask_strided_views_and_sliced_mask(rng):
    """q, k, v slices of one fused QKV buffer, dO a transposed view, the mask a column slice of a wider int64
    array (row stride T + 37) and the same mask through a negative row stride: read in place, same results."""
    Bsz, T, H, Hkv, D = 3, 150, 4, 2, 64
    qkv_ = rng.standard_normal((Bsz, T, H + 2 * Hkv, D)).astype(np.float32).astype(BF16)
    q, k, v = qkv_[:, :, :H], qkv_[:, :, H:H + Hkv], qkv_[:, :, H + Hkv:]
    do = np.ascontiguousarray(rng.standard_normal((Bsz, H, T, D)).astype(np.float32).astype(BF16))
    m = make_key_mask(rng, "left", Bsz, T)
    big = np.zeros((Bsz, T + 37), np.int64)
    big[:, 5:5 + T] = m
    ro, rl = ck.flash_attention(q, k, v, key_mask=big[:, 5:5 + T], return_lse=True)
    rq, rk, rv = ck.flash_attention_backward(do.transpose(0, 2, 1, 3), q, k, v, ro, rl, key_mask=big[:, 5:5 + T])
    G = cp().asarray(qkv_)
    Qv, Kv, Vv = G[:, :, :H], G[:, :, H:H + Hkv], G[:, :, H + Hkv:]
    dOv = cp().asarray(do).transpose(0, 2, 1, 3)
    for M in (cp().asarray(big)[:, 5:5 + T], cp().asarray(np.ascontiguousarray(big[::-1]))[::-1][:, 5:5 + T]):
        assert M.strides[0] in (8 * (T + 37), -8 * (T + 37))
        o, lse = ck.flash_attention(Qv, Kv, Vv, key_mask=M, return_lse=True)
        close(o, ro, 2e-2, "o")
        np.testing.assert_array_equal(np.isneginf(to_host(lse)), np.isneginf(rl))
        gq, gk, gv = ck.flash_attention_backward(dOv, Qv, Kv, Vv, o, lse, key_mask=M)
        close(gq, rq, 3e-2, "dq")
        close(gk, rk, 3e-2, "dk")
        close(gv, rv, 3e-2, "dv")


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_padded_batch_matches_each_sequence_alone(rng, D):
    """A causal batch of sequences padded on the left or the right to T: on the real positions, o and lse equal
    each sequence run alone without padding, and so do dq, dk, dv when dO is 0 at padding positions (as the
    loss makes it: padded positions carry no target). Padding keys get dk = dv = 0; left-padding queries see no
    key (o = 0, lse = -inf, dq = 0)."""
    T, H, Hkv = 300, 4, 2
    lens, sides = [300, 211, 64, 1, 129], ["left", "right", "left", "right", "left"]
    Bsz = len(lens)
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    do = qkv(rng, Bsz, T, T, H, Hkv, D)[0]
    m = np.zeros((Bsz, T), np.int64)
    real = []
    for b, (L, side) in enumerate(zip(lens, sides)):
        sl = slice(T - L, T) if side == "left" else slice(0, L)
        m[b, sl] = 1
        real.append(sl)
    do = np.where(m[:, :, None, None] != 0, do.astype(np.float32), 0).astype(BF16)
    Q, K, V, dO, M = _dev(q, k, v, do, m)
    o, lse = ck.flash_attention(Q, K, V, key_mask=M, return_lse=True)
    gq, gk, gv = ck.flash_attention_backward(dO, Q, K, V, o, lse, key_mask=M)
    oh, lh, gqh, gkh, gvh = (to_host(x) for x in (o, lse, gq, gk, gv))
    for b, sl in enumerate(real):
        o1, l1 = ck.flash_attention(Q[b:b + 1, sl], K[b:b + 1, sl], V[b:b + 1, sl], return_lse=True)
        q1, k1, v1 = ck.flash_attention_backward(dO[b:b + 1, sl], Q[b:b + 1, sl], K[b:b + 1, sl], V[b:b + 1, sl],
                                                 o1, l1)
        close(oh[b:b + 1, sl], to_host(o1), 2e-2, f"o row {b}")
        np.testing.assert_allclose(lh[b:b + 1, :, sl], to_host(l1), rtol=1e-4, atol=1e-4)
        close(gqh[b:b + 1, sl], to_host(q1), 3e-2, f"dq row {b}")
        close(gkh[b:b + 1, sl], to_host(k1), 3e-2, f"dk row {b}")
        close(gvh[b:b + 1, sl], to_host(v1), 3e-2, f"dv row {b}")
        pad = np.ones(T, bool)
        pad[sl] = False
        assert (gkh[b, pad].astype(np.float32) == 0).all() and (gvh[b, pad].astype(np.float32) == 0).all()
        if sides[b] == "left":
            assert (oh[b, pad].astype(np.float32) == 0).all() and np.isneginf(lh[b][:, pad]).all()
            assert (gqh[b, pad].astype(np.float32) == 0).all()
    assert np.isfinite(oh.astype(np.float32)).all()
    for x in (gqh, gkh, gvh):
        assert np.isfinite(x.astype(np.float32)).all()


# ------------------------------------------------------------------------------------------ GPU: sliding window
GPU_WINDOW_CASES = [  # (B, Tq, Tk, H, Hkv, D, window, key-mask kind or None)
    (2, 1, 1, 2, 1, 64, 1, None),           # (W >= Tk: the plain kernels)
    (2, 127, 127, 4, 2, 64, 1, None),       # each query sees itself only
    (2, 127, 127, 4, 2, 32, 17, None),      # W below a tile
    (1, 300, 300, 4, 1, 128, 100, None),    # W not a multiple of the tiles
    (2, 1000, 1000, 4, 2, 64, 300, None),   # W across several tiles
    (1, 1000, 1000, 2, 2, 128, 129, None),
    (1, 257, 257, 8, 2, 64, 64, None),      # W = a whole tile
    (1, 130, 700, 8, 2, 64, 200, None),     # Tq < Tk
    (1, 300, 130, 4, 2, 64, 50, None),      # Tq > Tk: the first 170 rows see no key
    (1, 4097, 4097, 2, 1, 64, 1000, None),  # long rows: most key tiles skipped
    (1, 4097, 4097, 2, 1, 128, 4096, None),  # the last query alone loses key 0
    (3, 200, 200, 4, 2, 64, 40, "left"),    # with a key mask: the *_km_sw kernels
    (3, 1000, 1000, 4, 1, 128, 250, "left"),
    (3, 127, 127, 2, 2, 32, 9, "holes"),
    (2, 300, 300, 4, 4, 64, 70, "rowmasked"),
    (3, 333, 500, 2, 1, 64, 64, "left64"),   # padding of whole tiles, Tq < Tk
    (2, 77, 77, 4, 2, 128, 3, "right"),
]


@pytest.fixture(params=["dispatch", "mma"])
def backend(request, monkeypatch):
    """"dispatch": ck.flash_attention's own choice (the wgmma kernels on Hopper without a key mask); "mma": the
    mma.sync kernels everywhere (ck.settings.attention_wgmma off)."""
    if request.param == "mma":
        monkeypatch.setattr(ck.settings, "attention_wgmma", False)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_WINDOW_CASES,
                         ids=lambda c: "B%dTq%dTk%dH%d/%dD%dW%d%s" % (*c[:7], "" if c[7] is None else c[7]))
def test_gpu_window_matches_reference(rng, backend, case):
    """Kernels vs reference under a sliding window (with a key mask too): o into a poisoned out=, the lse (its -inf
    pattern exactly), dq / dk / dv into poisoned pool blocks; exact zeros where nothing is seen or nothing sees."""
    Bsz, Tq, Tk, H, Hkv, D, W, kind = case
    q, k, v = qkv(rng, Bsz, Tq, Tk, H, Hkv, D)
    w = qkv(rng, Bsz, Tq, Tq, H, Hkv, D)[0]
    m = None if kind is None else make_key_mask(rng, kind, Bsz, Tk)
    ro, rl = ck.flash_attention(q, k, v, key_mask=m, window=W, return_lse=True)
    Q, K, V = _dev(q, k, v)
    M = None if m is None else cp().asarray(m)
    out = cp().full(q.shape, np.nan, dtype=BF16)
    _poison_pool(((Bsz, H, Tq), np.float32))
    o, lse = ck.flash_attention(Q, K, V, key_mask=M, window=W, out=out, return_lse=True)
    assert o is out
    close(o, ro, 2e-2, "o")
    lh = to_host(lse)
    np.testing.assert_array_equal(np.isneginf(lh), np.isneginf(rl))
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lh[fin], rl[fin], rtol=1e-4, atol=1e-4)
    dead = ~fin.transpose(0, 2, 1)
    assert (to_host(o).astype(np.float32)[dead] == 0).all()
    rq, rk, rv = ck.flash_attention_backward(w, q, k, v, ro, rl, key_mask=m, window=W)
    _poison_pool((q.shape, BF16), (k.shape, BF16), (k.shape, BF16), ((Bsz, H, Tq), np.float32))
    gq, gk, gv = ck.flash_attention_backward(cp().asarray(w), Q, K, V, cp().asarray(ro), cp().asarray(rl),
                                             key_mask=M, window=W)
    close(gq, rq, 3e-2, "dq")
    close(gk, rk, 3e-2, "dk")
    close(gv, rv, 3e-2, "dv")
    assert (to_host(gq).astype(np.float32)[dead] == 0).all()
    # keys no query sees (padding, or Tq < Tk: keys behind every query's window): dk = dv = 0 exactly
    seen = np.zeros((Bsz, Tk), bool)
    off = Tk - Tq
    for b in range(Bsz):
        for i in range(Tq):
            lo, hi = max(0, i + off - W + 1), i + off
            if hi >= 0:
                seen[b, lo:hi + 1] = True
    if m is not None:
        seen &= m
    assert (to_host(gk).astype(np.float32)[~seen] == 0).all()
    assert (to_host(gv).astype(np.float32)[~seen] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 200, 200, 4, 2, 64), (1, 300, 130, 4, 1, 128), (2, 100, 260, 4, 4, 32)])
def test_gpu_window_at_least_seq_k_is_no_window_bit_for_bit(rng, backend, shape):
    Bsz, Tq, Tk, H, Hkv, D = shape
    Q, K, V, G = _dev(*qkv(rng, Bsz, Tq, Tk, H, Hkv, D), qkv(rng, Bsz, Tq, Tq, H, Hkv, D)[0])
    o0, l0 = ck.flash_attention(Q, K, V, return_lse=True)
    g0 = ck.flash_attention_backward(G, Q, K, V, o0, l0)
    for W in (Tk, Tk + 7):
        o1, l1 = ck.flash_attention(Q, K, V, window=W, return_lse=True)
        np.testing.assert_array_equal(to_host(o1).view(np.uint16), to_host(o0).view(np.uint16))
        np.testing.assert_array_equal(to_host(l1), to_host(l0))
        for a, b in zip(ck.flash_attention_backward(G, Q, K, V, o0, l0, window=W), g0):
            np.testing.assert_array_equal(to_host(a).view(np.uint16), to_host(b).view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 700, 700, 4, 2, 64, 300), (1, 600, 900, 4, 1, 128, 500),
                                   (2, 500, 500, 4, 4, 32, 260), (1, 1000, 1000, 8, 2, 64, 700)])
def test_gpu_window_leaves_what_it_does_not_hide_bit_identical(rng, backend, shape):
    """The windowed kernels do the plain kernels' arithmetic wherever the window hides nothing: the queries whose
    whole causal range fits in the window (i + Tk - Tq < W: o, lse and dq) and the keys of every 128-key block from
    Tk - W on (no query loses them: dk, dv) equal the no-window call bit for bit (same tiles, same order)."""
    Bsz, Tq, Tk, H, Hkv, D, W = shape
    Q, K, V, G = _dev(*qkv(rng, Bsz, Tq, Tk, H, Hkv, D), qkv(rng, Bsz, Tq, Tq, H, Hkv, D)[0])
    o0, l0 = ck.flash_attention(Q, K, V, return_lse=True)
    o1, l1 = ck.flash_attention(Q, K, V, window=W, return_lse=True)
    rows = slice(0, W - (Tk - Tq))  # queries i with i + Tk - Tq < W
    np.testing.assert_array_equal(to_host(o1)[:, rows].view(np.uint16), to_host(o0)[:, rows].view(np.uint16))
    np.testing.assert_array_equal(to_host(l1)[:, :, rows], to_host(l0)[:, :, rows])
    assert not np.array_equal(to_host(o1).view(np.uint16), to_host(o0).view(np.uint16))  # (the window does act)
    a = [to_host(x) for x in ck.flash_attention_backward(G, Q, K, V, o0, l0, window=W)]
    b = [to_host(x) for x in ck.flash_attention_backward(G, Q, K, V, o0, l0)]
    np.testing.assert_array_equal(a[0][:, rows].view(np.uint16), b[0][:, rows].view(np.uint16))
    keys = slice(-(-(Tk - W) // 128) * 128, Tk)
    for x, y, n in zip(a[1:], b[1:], ("dk", "dv")):
        np.testing.assert_array_equal(x[:, keys].view(np.uint16), y[:, keys].view(np.uint16), err_msg=n)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 32])
def test_gpu_window_strided_views_packed_grads_and_rope(rng, backend, D):
    """q, k, v as head slices of one fused projection, dO a transposed view, the gradients into the head slices of one
    packed dqkv (poisoned), and the rope's backward fused into the store (sm_90) or applied after: against the
    reference with the window."""
    Bsz, T, H, Hkv, W = 2, 333, 4, 2, 90
    qkv_ = rng.standard_normal((Bsz, T, H + 2 * Hkv, D)).astype(np.float32).astype(BF16)
    hq, hk, hv = qkv_[:, :, :H], qkv_[:, :, H:H + Hkv], qkv_[:, :, H + Hkv:]
    do = np.ascontiguousarray(rng.standard_normal((Bsz, H, T, D)).astype(np.float32).astype(BF16))
    ro, rl = ck.flash_attention(hq, hk, hv, window=W, return_lse=True)
    ref = ck.flash_attention_backward(do.transpose(0, 2, 1, 3), hq, hk, hv, ro, rl, window=W)
    G = cp().asarray(qkv_)
    q, k, v = G[:, :, :H], G[:, :, H:H + Hkv], G[:, :, H + Hkv:]
    dO = cp().asarray(do).transpose(0, 2, 1, 3)
    o, lse = ck.flash_attention(q, k, v, window=W, return_lse=True)
    close(o, ro, 2e-2, "o")
    dqkv = cp().full((Bsz, T, H + 2 * Hkv, D), np.nan, dtype=BF16)
    outs = (dqkv[:, :, :H], dqkv[:, :, H:H + Hkv], dqkv[:, :, H + Hkv:])
    got = ck.flash_attention_backward(dO, q, k, v, o, lse, window=W, grads_out=outs)
    assert all(x is y for x, y in zip(got, outs))
    for x, y, n in zip(got, ref, ("dq", "dk", "dv")):
        close(x, y, 3e-2, n)
    cos, sin = (cp().asarray(a) for a in ck.rope_cache(T, D, xp=np))
    plain = ck.flash_attention_backward(dO, q, k, v, o, lse, window=W)
    roped = ck.flash_attention_backward(dO, q, k, v, o, lse, window=W, rope=(cos, sin, None))
    for g, r, n in zip(roped[:2], plain[:2], ("dq", "dk")):
        want = to_host(ck.rope_backward(r, cos, sin)).astype(np.float32)
        np.testing.assert_allclose(to_host(g).astype(np.float32), want, rtol=2 ** -7,
                                   atol=np.abs(want).max() * 2 ** -7, err_msg=n)
    assert np.array_equal(to_host(roped[2]).view(np.uint16), to_host(plain[2]).view(np.uint16))


@pytest.mark.gpu
def test_gpu_window_large_scores_and_determinism(rng, backend):
    """Scores of +-1e3 under a window: no overflow, finite gradients; reruns bit-identical."""
    Bsz, T, H, Hkv, D, W = 2, 700, 4, 2, 64, 150
    q, k, v = qkv(rng, Bsz, T, T, H, Hkv, D)
    q, k = (q.astype(np.float32) * 40).astype(BF16), (k.astype(np.float32) * 40).astype(BF16)
    ro, rl = ck.flash_attention(q, k, v, window=W, return_lse=True)
    Q, K, V = _dev(q, k, v)
    o1, l1 = ck.flash_attention(Q, K, V, window=W, return_lse=True)
    o2, l2 = ck.flash_attention(Q, K, V, window=W, return_lse=True)
    close(o1, ro, 2e-2, "o")
    np.testing.assert_array_equal(to_host(o1).view(np.uint16), to_host(o2).view(np.uint16))
    np.testing.assert_array_equal(to_host(l1), to_host(l2))
    do = cp().asarray(qkv(rng, Bsz, T, T, H, Hkv, D)[0])
    a = ck.flash_attention_backward(do, Q, K, V, o1, l1, window=W)
    b = ck.flash_attention_backward(do, Q, K, V, o1, l1, window=W)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(to_host(x).view(np.uint16), to_host(y).view(np.uint16))
        assert np.isfinite(to_host(x).astype(np.float32)).all()
