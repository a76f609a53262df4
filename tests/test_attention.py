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


def f64_attention(q, k, v, causal, scale):
    """Per (batch, head) loops in float64: o and lse, written independently of the reference."""
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
def test_gpu_model_flash_path_matches_materialised(rng):
    """A small LLaMA under bf16 autocast: loss and every parameter gradient with flash attention against the
    GEMM + attn_softmax + GEMM path (same weights, same batch)."""
    cfg = ck.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ids = cp().asarray(rng.integers(0, 128, (2, 200)).astype(np.int32))
    res = []
    for flash in (False, True):
        m = ck.Llama(cfg, xp=cp(), seed=3)
        for mod in m.modules():
            if isinstance(mod, ck.nn.CausalSelfAttention):
                mod.flash = flash
        with ck.autocast(BF16):
            loss = m(ids, ids)
        loss.backward()
        res.append((float(loss.data), {n: to_host(p.grad) for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = res
    assert abs(l0 - l1) < 2e-3 * abs(l0)
    for n in g0:
        a, b = g0[n].astype(np.float64), g1[n].astype(np.float64)
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12)
        assert rel < 3e-2, (n, rel)
