"""ops/_launch.with_smem, and every kernel getter that raises a kernel's dynamic shared memory limit through it
(run on the CPU with a stand-in for the compiled kernel: the GPU tests launch the real ones)."""
import numpy as np
import pytest

from cukernels.ops import _launch as L
from cukernels.ops import attention, attention_sm90, decode_attention, gemv, layer_norm, rms_norm, sampling


class FakeKernel:
    def __init__(self, name):
        self.name = name
        self.sets = []

    @property
    def max_dynamic_shared_size_bytes(self):
        return self.sets[-1] if self.sets else 0

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, v):
        self.sets.append(v)


def test_with_smem_sets_once_and_only_grows():
    k = FakeKernel("k")
    assert L.with_smem(k, 70000) is k and k.sets == [70000]
    L.with_smem(k, 70000)
    L.with_smem(k, 1000)  # a smaller launch fits under the limit already set
    assert k.sets == [70000]
    L.with_smem(k, 90000)
    assert k.sets == [70000, 90000] and k.max_dynamic_shared_size_bytes == 90000


@pytest.fixture
def fake_functions(monkeypatch):
    made = {}

    def get_function(family, name):
        return made.setdefault((family, name), FakeKernel(name))

    for mod in (attention, attention_sm90, decode_attention, gemv, layer_norm, rms_norm, sampling):
        monkeypatch.setattr(mod, "get_function", get_function)
    return made


def test_kernel_getters_raise_the_limit_to_their_shared_memory(fake_functions):
    k, smem = attention._kernel("fwd", 64)
    assert k.name == "attn_fwd_d64" and k.sets == [smem] == [attention._smem("fwd", 64)]
    k, smem = attention._kernel("dkdv", 128, masked=True)
    assert k.name == "attn_bwd_dkdv_d128_km" and k.sets == [smem]
    k, smem = attention_sm90._kernel(64, "", "fwd")
    assert k.sets == [smem] == [attention_sm90.smem_bytes(64)]
    k, smem = decode_attention._split_kernel(64, 1)
    assert k.sets == [smem] == [decode_attention._smem(64, 1)]
    k = sampling._kernel("float32")
    assert k.sets == [(sampling.MAX_VOCAB + 31) // 32 * 4]


# ------------------------------------------------------------------ programmatic dependent launch
class CallKernel:
    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block, args, shared_mem))


def test_launch_outside_a_pdl_scope_is_the_plain_launch(monkeypatch):
    """pdl=True alone never reaches the driver: only inside pdl_scope() (whose opener vouches that no kernel of
    the block writes what the kernels read before pdl_wait), and the scope nests and restores."""
    k = CallKernel()
    monkeypatch.setattr(L, "pdl_enabled", lambda: (_ for _ in ()).throw(AssertionError("asked outside scope")))
    L.launch(k, (3,), (256, 1, 1), (np.int32(1),), 128, pdl=True)
    assert k.calls == [((3,), (256, 1, 1), (np.int32(1),), 128)]
    assert not getattr(L._scope, "on", False)
    with L.pdl_scope():
        assert L._scope.on
        with L.pdl_scope():
            assert L._scope.on
        assert L._scope.on
        monkeypatch.setattr(L, "pdl_enabled", lambda: False)  # (a CPU machine / pre-Hopper: plain launch)
        L.launch(k, (1,), (32, 1, 1), (), 0, pdl=True)
    assert not L._scope.on and len(k.calls) == 2


@pytest.mark.gpu
def test_gpu_pdl_chain_is_bit_identical_eager_and_captured():
    """A chain of dependent GEMVs (each reads the previous one's output and updates a residual in place) under
    programmatic dependent launch, eagerly and replayed from a CUDA graph, equals the same chain launched plainly
    bit for bit: the kernels wait for their predecessor before touching x, out or the residual."""
    import cupy as cp

    import cukernels as ck
    from cukernels.graph import CapturedStep

    if not L.pdl_enabled():
        pytest.skip("programmatic dependent launch needs sm_90")
    rng = cp.random.default_rng(0)
    K = 2048
    ws = [(rng.standard_normal((K, K), dtype=cp.float32) * K ** -0.5).astype(ck.bfloat16) for _ in range(6)]
    nw = cp.ones(K, dtype=cp.float32)
    x0 = rng.standard_normal((1, K), dtype=cp.float32).astype(ck.bfloat16)

    def chain(x, h):
        for i, w in enumerate(ws):
            ck.gemv(x, w, norm="rms", norm_weight=nw, out=h)
            ck.gemv(h, ws[-1 - i], residual=x, out=x)
        return x

    x_ref, h_ref = x0.copy(), cp.empty_like(x0)
    chain(x_ref, h_ref)
    x1, h1 = x0.copy(), cp.empty_like(x0)
    with L.pdl_scope():
        chain(x1, h1)
    cp.testing.assert_array_equal(x1.view(cp.uint16), x_ref.view(cp.uint16))
    x2, h2 = x0.copy(), cp.empty_like(x0)

    def step():
        with L.pdl_scope():
            chain(x2, h2)

    cs = CapturedStep(step, warmup=0)
    for _ in range(3):
        x2[...] = x0
        cs()
        cp.cuda.get_current_stream().synchronize()
        cp.testing.assert_array_equal(x2.view(cp.uint16), x_ref.view(cp.uint16))
