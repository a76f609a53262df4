import math

import numpy as np
import pytest

import cukernels as ck
from helpers import DTYPES, assert_close, device_copy, poisoned, randn, to_host

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def hf_llama3_inv_freq(head_dim, theta, sc):
    """An independent float64 transcription of transformers' _compute_llama3_parameters, one frequency at a
    time with the three cases spelled out."""
    out = []
    lo_wl = sc["original_max_position_embeddings"] / sc["low_freq_factor"]
    hi_wl = sc["original_max_position_embeddings"] / sc["high_freq_factor"]
    for i in range(head_dim // 2):
        f = 1.0 / theta ** (2 * i / head_dim)
        wl = 2 * math.pi / f
        if wl < hi_wl:
            out.append(f)
        elif wl > lo_wl:
            out.append(f / sc["factor"])
        else:
            smooth = (sc["original_max_position_embeddings"] / wl - sc["low_freq_factor"]) / (
                sc["high_freq_factor"] - sc["low_freq_factor"])
            out.append((1 - smooth) * f / sc["factor"] + smooth * f)
    return np.array(out)


def f64_rope(x, inv_freq, pos, interleaved, inverse=False):
    """RoPE as complex multiplication: pair (a, b) -> (a + ib) * e^(i p f) (e^(-i p f) for the inverse)."""
    x = x.astype(np.float64)
    D = x.shape[-1]
    ang = pos.astype(np.float64)[..., None] * inv_freq  # (1 or B, S, D/2)
    rot = np.exp((-1j if inverse else 1j) * ang)[:, :, None, :]
    if interleaved:
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., : D // 2] + 1j * x[..., D // 2:]
    r = z * rot
    y = np.empty_like(x)
    if interleaved:
        y[..., 0::2], y[..., 1::2] = r.real, r.imag
    else:
        y[..., : D // 2], y[..., D // 2:] = r.real, r.imag
    return y


def hf_rotate_half_rope(x, cos_half, sin_half, pos):
    """Hugging Face's literal formula: q * cos + rotate_half(q) * sin with cos = cat(freqs, freqs).cos()."""
    x = x.astype(np.float64)
    cos = np.concatenate([cos_half, cos_half], -1).astype(np.float64)[pos][:, :, None, :]
    sin = np.concatenate([sin_half, sin_half], -1).astype(np.float64)[pos][:, :, None, :]
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


# ---------------------------------------------------------------- CPU: rope_cache
def test_cache_plain_matches_formula():
    cos, sin = ck.rope_cache(37, 16, theta=10000.0, xp=np)
    assert cos.dtype == np.float32 and cos.shape == (37, 8) and sin.shape == (37, 8)
    for p in (0, 1, 5, 36):
        for i in range(8):
            a = p * 10000.0 ** (-2 * i / 16)
            assert cos[p, i] == np.float32(math.cos(a)) and sin[p, i] == np.float32(math.sin(a))


@pytest.mark.parametrize("head_dim, theta", [(64, 500000.0), (128, 500000.0), (32, 10000.0)])
def test_cache_llama3_matches_hf_transcription(head_dim, theta):
    from cukernels.ops.rope import _inv_freq

    ref = hf_llama3_inv_freq(head_dim, theta, LLAMA3)
    got = _inv_freq(head_dim, theta, LLAMA3)
    np.testing.assert_allclose(got, ref, rtol=1e-14, atol=0)
    # The three regimes are all present at these sizes: unchanged, divided by factor, interpolated.
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    assert got[0] == plain[0]
    assert np.isclose(got[-1], plain[-1] / 32.0, rtol=1e-14)
    mid = (~np.isclose(got, plain, rtol=1e-14)) & (~np.isclose(got, plain / 32, rtol=1e-14))
    if head_dim >= 64:
        assert mid.any()
        assert np.all((got[mid] < plain[mid]) & (got[mid] > plain[mid] / 32))
    seq = 300
    cos, sin = ck.rope_cache(seq, head_dim, theta, LLAMA3, xp=np)
    ang = np.arange(seq)[:, None] * ref[None, :]
    np.testing.assert_allclose(cos, np.cos(ang), rtol=0, atol=1e-7)
    np.testing.assert_allclose(sin, np.sin(ang), rtol=0, atol=1e-7)


def test_cache_default_and_linear_scaling():
    c0, s0 = ck.rope_cache(10, 8, 10000.0, xp=np)
    c1, s1 = ck.rope_cache(10, 8, 10000.0, {"rope_type": "default"}, xp=np)
    assert np.array_equal(c0, c1) and np.array_equal(s0, s1)
    c2, _ = ck.rope_cache(10, 8, 10000.0, {"type": "linear", "factor": 4.0}, xp=np)
    inv = 10000.0 ** (-np.arange(0, 8, 2) / 8) / 4.0
    np.testing.assert_allclose(c2, np.cos(np.arange(10)[:, None] * inv), atol=1e-7)


# ---------------------------------------------------------------- CPU: the reference against float64 math
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("pos_kind", ["none", "1d", "2d"])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_reference_matches_complex_formula(rng, interleaved, pos_kind, scaling):
    Bsz, S, H, D, L = 2, 9, 3, 16, 40
    x = randn(rng, (Bsz, S, H, D), np.float32)
    cos, sin = ck.rope_cache(L, D, 500000.0, scaling, xp=np)
    from cukernels.ops.rope import _inv_freq

    inv = _inv_freq(D, 500000.0, scaling)
    if pos_kind == "none":
        pos, posarg = np.arange(S)[None, :], None
    elif pos_kind == "1d":
        posarg = rng.integers(0, L, S).astype(np.int32)
        pos = posarg[None, :]
    else:
        posarg = rng.integers(0, L, (Bsz, S)).astype(np.int64)
        pos = posarg
    y = ck.rope(x, cos, sin, positions=posarg, interleaved=interleaved)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, f64_rope(x, inv, pos, interleaved), rtol=1e-5, atol=1e-6)
    dx = ck.rope_backward(x, cos, sin, positions=posarg, interleaved=interleaved)
    np.testing.assert_allclose(dx, f64_rope(x, inv, pos, interleaved, inverse=True), rtol=1e-5, atol=1e-6)
    if not interleaved:
        np.testing.assert_allclose(y, hf_rotate_half_rope(x, cos, sin, pos), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_reference_backward_is_the_adjoint(rng, interleaved):
    x = randn(rng, (2, 7, 3, 24), np.float32)
    yv = randn(rng, (2, 7, 3, 24), np.float32)
    cos, sin = ck.rope_cache(64, 24, 10000.0, xp=np)
    pos = rng.integers(0, 64, (2, 7)).astype(np.int32)
    lhs = np.sum(ck.rope(x, cos, sin, positions=pos, interleaved=interleaved).astype(np.float64) * yv)
    rhs = np.sum(x.astype(np.float64) * ck.rope_backward(yv, cos, sin, positions=pos, interleaved=interleaved))
    assert abs(lhs - rhs) <= 1e-5 * (abs(lhs) + np.abs(x).sum() / 100)
    # orthogonal: the backward undoes the forward
    back = ck.rope_backward(ck.rope(x, cos, sin, positions=pos, interleaved=interleaved), cos, sin, positions=pos,
                            interleaved=interleaved)
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)


def test_reference_bf16_and_in_place(rng):
    x = randn(rng, (1, 5, 2, 8), ck.bfloat16)
    cos, sin = ck.rope_cache(5, 8, xp=np)
    ref = ck.rope(x, cos, sin)
    assert ref.dtype == ck.bfloat16
    np.testing.assert_allclose(ref.astype(np.float64), f64_rope(x, 1.0 / 500000.0 ** (np.arange(0, 8, 2) / 8),
                                                                np.arange(5)[None], False), rtol=2**-8, atol=1e-6)
    xi = x.copy()
    y = ck.rope(xi, cos, sin, out=xi)
    assert y is xi and np.array_equal(xi.view(np.uint16), ref.view(np.uint16))


def test_reference_packed_heads_in_place(rng):
    """The q and k heads of a packed [B, T, H + 2 Hkv, D] projection, rotated in place through the token-strided
    view: equal to rotating contiguous copies; the v heads untouched."""
    H, Hkv, D = 4, 2, 8
    qkv = randn(rng, (2, 5, H + 2 * Hkv, D), np.float32)
    cos, sin = ck.rope_cache(5, D, xp=np)
    ref = ck.rope(np.ascontiguousarray(qkv[:, :, :H + Hkv]), cos, sin)
    a = qkv.copy()
    qk = a[:, :, :H + Hkv]
    assert ck.rope(qk, cos, sin, out=qk) is qk
    np.testing.assert_array_equal(a[:, :, :H + Hkv], ref)
    np.testing.assert_array_equal(a[:, :, H + Hkv:], qkv[:, :, H + Hkv:])
    back = a.copy()
    ck.rope_backward(back[:, :, :H + Hkv], cos, sin, out=back[:, :, :H + Hkv])
    np.testing.assert_allclose(back, qkv, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- bad input
def _x(shape=(1, 4, 2, 8), dt=np.float32):
    return np.zeros(shape, dt)


_C, _S = ck.rope_cache(4, 8, xp=np)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ck.rope(np.zeros((4, 2, 8), np.float32), _C, _S), ValueError, r"x: expected 4 dimensions"),
        (lambda: ck.rope(_x((1, 4, 2, 7)), *ck.rope_cache(4, 8, xp=np)), ValueError, "x: head_dim .* even"),
        (lambda: ck.rope(_x(dt=np.float64), _C, _S), TypeError, "x: expected dtype"),
        (lambda: ck.rope(_x(), _C[:, :3], _S), ValueError, r"cos: expected shape \(L, 4\)"),
        (lambda: ck.rope(_x(), _C, _S[:3]), ValueError, "sin: expected shape"),
        (lambda: ck.rope(_x(), _C.astype(np.float64), _S), TypeError, "cos: expected dtype float32"),
        (lambda: ck.rope(_x((1, 5, 2, 8)), _C, _S), ValueError, "cos: has 4 positions but x has seq = 5"),
        (lambda: ck.rope(_x(), _C, _S, positions=np.zeros(4, np.float32)), TypeError, "positions: expected dtype"),
        (lambda: ck.rope(_x(), _C, _S, positions=np.zeros(3, np.int32)), ValueError, r"positions: expected shape \(4,\)"),
        (lambda: ck.rope(_x(), _C, _S, positions=np.array([0, 1, 2, 4], np.int32)), ValueError, r"positions: values must lie in \[0, 4\)"),
        (lambda: ck.rope(_x(), _C, _S, out=np.zeros((1, 4, 2, 8), ck.bfloat16)), TypeError, "out: expected dtype"),
        (lambda: ck.rope(np.zeros((1, 8, 4, 4), np.float32)[:, :, ::2], _C[:, :2], _S[:, :2]), ValueError,
         r"x: expected \[batch, seq, heads, head_dim\] with heads and head_dim contiguous"),
        (lambda: ck.rope_backward(_x((2, 4, 2, 8)), _C, _S, positions=np.zeros((1, 4), np.int64)), ValueError, r"positions: expected shape \(4,\) or \(2, 4\)"),
        (lambda: ck.rope_backward(np.zeros((1, 4, 2, 8), np.int32), _C, _S), TypeError, "dy: expected dtype"),
        (lambda: ck.rope_cache(0, 8, xp=np), ValueError, "seq_len"),
        (lambda: ck.rope_cache(4, 7, xp=np), ValueError, "head_dim: expected an even integer"),
        (lambda: ck.rope_cache(4, 8, theta=-1.0, xp=np), ValueError, "theta"),
        (lambda: ck.rope_cache(4, 8, scaling={"rope_type": "yarn", "factor": 2.0}, xp=np), ValueError, "rope_type 'yarn' is not supported"),
        (lambda: ck.rope_cache(4, 8, scaling={"rope_type": "llama3", "factor": 8.0}, xp=np), ValueError, "missing"),
        (lambda: ck.rope_cache(4, 8, scaling=2.0, xp=np), TypeError, "scaling: expected None or a dict"),
    ],
)
def test_bad_input_messages(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# ---------------------------------------------------------------- GPU: kernel against the reference
SHAPES = [(1, 1, 1, 2), (2, 3, 5, 6), (2, 7, 4, 64), (1, 5, 3, 128), (0, 4, 2, 8), (3, 17, 2, 10), (2, 9, 7, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("pos_kind", ["none", "1d_i32", "2d_i64"])
def test_gpu_matches_reference(rng, shape, dtype, misalign, interleaved, pos_kind):
    Bsz, S, H, D = shape
    L = S + 3
    x = randn(rng, shape, dtype, scale=2.0)
    dy = randn(rng, shape, dtype)
    cos, sin = ck.rope_cache(L, D, 500000.0, LLAMA3 if D >= 32 else None, xp=np)
    pos = None
    if pos_kind == "1d_i32":
        pos = rng.integers(0, L, S).astype(np.int32)
    elif pos_kind == "2d_i64":
        pos = rng.integers(0, L, (Bsz, S)).astype(np.int64)
    kw = dict(positions=pos, interleaved=interleaved)
    y_ref = ck.rope(x, cos, sin, **kw)
    dx_ref = ck.rope_backward(dy, cos, sin, **kw)

    dev = lambda a: device_copy(a, misalign)
    cd, sd = dev(cos), dev(sin)
    kwd = dict(positions=None if pos is None else dev(pos), interleaved=interleaved)
    out = poisoned(shape, dtype, misalign)
    y = ck.rope(dev(x), cd, sd, out=out, **kwd)
    assert y is out
    assert_close(y, y_ref, dtype, what="y")
    dxo = poisoned(shape, dtype, misalign)
    dx = ck.rope_backward(dev(dy), cd, sd, out=dxo, **kwd)
    assert dx is dxo
    assert_close(dx, dx_ref, dtype, what="dx")
    # in place
    xi = dev(x)
    assert ck.rope(xi, cd, sd, out=xi, **kwd) is xi
    assert_close(xi, y_ref, dtype, what="in place")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("shape", [(2, 7, 4, 2, 64), (1, 33, 32, 8, 64), (3, 5, 3, 1, 6), (2, 4, 2, 2, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_packed_heads_token_strided(rng, dtype, interleaved, shape):
    """The q / k heads of a packed qkv [B, T, H + 2 Hkv, D] (tokens (H + 2 Hkv) D apart) in place, forward and
    backward, and a token-strided input into a fresh output: equal to the reference on contiguous copies (both
    the vector path, D a multiple of the pack, and the element path, D = 6); the v heads keep their bits."""
    Bsz, T, H, Hkv, D = shape
    qkv = randn(rng, (Bsz, T, H + 2 * Hkv, D), dtype)
    cos, sin = ck.rope_cache(T + 2, D, xp=np)
    pos = rng.integers(0, T + 2, (Bsz, T)).astype(np.int32)
    kw = dict(positions=pos, interleaved=interleaved)
    ref = ck.rope(np.ascontiguousarray(qkv[:, :, :H + Hkv]), cos, sin, **kw)
    dref = ck.rope_backward(np.ascontiguousarray(qkv[:, :, :H + Hkv]), cos, sin, **kw)
    cp = pytest.importorskip("cupy")
    kwd = dict(positions=cp.asarray(pos), interleaved=interleaved)
    cd, sd = cp.asarray(cos), cp.asarray(sin)
    for fn, want in ((ck.rope, ref), (ck.rope_backward, dref)):
        a = cp.asarray(qkv)
        qk = a[:, :, :H + Hkv]
        assert fn(qk, cd, sd, out=qk, **kwd) is qk
        assert_close(qk, want, dtype, what=f"{fn.__name__} in place")
        assert np.array_equal(np.ascontiguousarray(to_host(a[:, :, H + Hkv:])).view(np.uint8),
                              np.ascontiguousarray(qkv[:, :, H + Hkv:]).view(np.uint8))
        y = fn(cp.asarray(qkv)[:, :, :H + Hkv], cd, sd, **kwd)
        assert y.flags.c_contiguous
        assert_close(y, want, dtype, what=f"{fn.__name__} strided -> contiguous")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_gpu_large_grid_stride(rng, dtype, interleaved):
    """Enough (token, pack) units that every thread of a full wave loops several times; LLaMA-3 scaled cache."""
    shape = (8, 8192, 2, 64)
    x = randn(rng, shape, dtype)
    cos, sin = ck.rope_cache(8192, 64, 500000.0, LLAMA3, xp=np)
    y = ck.rope(device_copy(x), device_copy(cos), device_copy(sin), interleaved=interleaved)
    assert_close(y, ck.rope(x, cos, sin, interleaved=interleaved), dtype)


@pytest.mark.gpu
def test_gpu_positions_out_of_range_are_clamped(rng):
    import cupy as cp

    x = randn(rng, (1, 3, 2, 16), np.float32)
    cos, sin = ck.rope_cache(6, 16, 10000.0, xp=np)
    y = ck.rope(device_copy(x), device_copy(cos), device_copy(sin),
                positions=cp.asarray(np.array([-7, 2, 1 << 40], np.int64)))
    assert_close(y, ck.rope(x, cos, sin, positions=np.array([0, 2, 5], np.int64)), np.float32)


@pytest.mark.gpu
def test_gpu_cache_on_device_and_mixing_is_a_type_error():
    import cupy as cp

    cos, sin = ck.rope_cache(16, 8)
    assert isinstance(cos, cp.ndarray) and cos.dtype == np.float32 and cos.shape == (16, 4)
    with pytest.raises(TypeError, match="cos: is a cupy array but x is a numpy array"):
        ck.rope(np.zeros((1, 4, 1, 8), np.float32), cos, sin)


@pytest.mark.gpu
def test_gpu_runs_on_current_stream_and_captures(rng):
    import cupy as cp

    x = device_copy(randn(rng, (2, 64, 4, 64), ck.bfloat16))
    cos, sin = ck.rope_cache(64, 64, xp=cp)
    pos = cp.asarray(rng.integers(0, 64, (2, 64)).astype(np.int32))
    y = cp.empty_like(x)
    ck.rope(x, cos, sin, positions=pos, out=y)  # compile + warm up outside capture
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        ck.rope(x, cos, sin, positions=pos, out=y)
        g = s.end_capture()
    y.fill(np.nan)
    cp.cuda.Device().synchronize()  # (the poison ran on the legacy stream: the replay must not race it)
    g.launch(s)
    s.synchronize()
    assert_close(y, ck.rope(to_host(x), to_host(cos), to_host(sin), positions=to_host(pos)), ck.bfloat16)
