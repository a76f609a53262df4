"""ops/_launch.with_smem, and every kernel getter that raises a kernel's dynamic shared memory limit through it
(run on the CPU with a stand-in for the compiled kernel: the GPU tests launch the real ones)."""
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
