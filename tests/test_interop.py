"""Other libraries' arrays through the public ops (``@interop`` in cukernels/_backend.py): zero copy in, the
caller's kind of array out.

CPU tests drive the detection and conversion logic with small stand-ins: a host DLPack object (what a CPU
torch tensor or a JAX CPU array looks like to the ops), a stand-in ``torch`` module whose tensors refuse
to export bfloat16 through DLPack as NumPy does, and objects that only claim a CUDA device. GPU tests use
PyTorch itself (skipped when it is not importable or has no CUDA) and a ``__cuda_array_interface__`` object.
"""
import sys
import types

import numpy as np
import pytest

import cukernels as ck
from cukernels import _backend as B
from cukernels.ops import adam as A
from helpers import DTYPES, assert_close, randn, to_host

F32, BF16 = np.float32, np.dtype(ck.bfloat16)


class HostDLPack:
    """A host array that only speaks DLPack (like a CPU torch tensor or a JAX CPU array)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class OnDevice:
    """Claims to live on DLPack device ``dev`` (never converted on a CPU machine)."""

    def __init__(self, dev):
        self.dev = dev

    def __dlpack__(self, **kw):
        raise AssertionError("must not be exported in this test")

    def __dlpack_device__(self):
        return self.dev


class CAIOnly:
    """Only ``__cuda_array_interface__`` (what a Numba device array offers)."""

    def __init__(self, cai):
        self._cai = cai

    @property
    def __cuda_array_interface__(self):
        return self._cai


# ---------------------------------------------------------------- CPU: detection
def test_detection_of_foreign_arrays():
    x = np.zeros(3, F32)
    assert B._foreign_kind(HostDLPack(x)) == "dlpack-cpu"
    assert B._foreign_kind(OnDevice((2, 0))) == "dlpack-gpu"  # kDLCUDA
    assert B._foreign_kind(OnDevice((13, 1))) == "dlpack-gpu"  # kDLCUDAManaged
    assert B._foreign_kind(OnDevice((4, 0))) == "dlpack-other"  # OpenCL: refused
    assert B._foreign_kind(CAIOnly({"shape": (3,), "typestr": "<f4", "data": (0, False), "version": 3})) == "cai"
    assert B._foreign_kind(object()) is None and B._foreign_kind([1, 2]) is None and B._foreign_kind(1.0) is None
    t = ck.Tensor(x, requires_grad=True)
    assert B.is_autograd_tensor(t) and not B.is_autograd_tensor(x) and not B.is_autograd_tensor(HostDLPack(x))


def test_numpy_arrays_and_plain_values_pass_through_untouched(monkeypatch):
    """No conversion object is built when every argument is a NumPy array or a plain value (the fast path)."""
    x, w = np.ones((2, 4), F32), np.ones(4, F32)
    ck.rms_norm(x, w)  # first call: any type met is now known
    assert B.as_array(x) is x

    def boom(*a, **k):
        raise AssertionError("the slow path ran for plain arguments")

    monkeypatch.setattr(B, "_Interop", boom)
    y = ck.rms_norm(x, w, eps=1e-5, return_rstd=False, out=np.empty_like(x))
    np.testing.assert_allclose(y, 1.0, rtol=1e-5)
    ck.adam_step(*(np.zeros(8, F32) for _ in range(4)), lr=1e-3, step=np.int64(2), beta1=0.9, shadow=None)


def test_every_public_op_is_decorated():
    """Every array op exported by the package (all of ck.* from cukernels.ops and blas, but the error-word
    readers, rope_cache, sample_workspace and the *_supported queries, which take no arrays) goes through
    @B.interop: found, not listed by hand."""
    import inspect
    exported = [v for n, v in vars(ck).items() if inspect.isfunction(v)
                and v.__module__.startswith(("cukernels.ops", "cukernels.blas"))
                and not n.endswith(("_error", "_supported")) and n not in ("rope_cache", "sample_workspace")]
    missing = [f.__qualname__ for f in exported if not getattr(f, "__interop__", False)]
    assert not missing, f"exported ops not decorated with @B.interop: {missing}"
    ops = [ck.rms_norm, ck.rms_norm_backward, ck.layer_norm, ck.layer_norm_backward, ck.softmax, ck.softmax_backward,
           ck.attn_softmax, ck.attn_softmax_backward, ck.cross_entropy, ck.cross_entropy_backward,
           ck.cross_entropy_fused, ck.embedding, ck.embedding_backward, ck.rope, ck.rope_backward, ck.gelu,
           ck.gelu_backward, ck.swiglu, ck.swiglu_backward, ck.swiglu_packed, ck.swiglu_packed_backward, ck.add,
           ck.mul, ck.cast, ck.adam_step, ck.adam_step_rows, ck.clip_scale, ck.global_norm, ck.zero_rows,
           ck.matmul, A.tick, A.global_norm_workspace, ck.SparseRowGrad.accumulate, ck.SparseRowGrad.__init__]
    missing = [f.__qualname__ for f in ops if not getattr(f, "__interop__", False)]
    assert not missing, f"not decorated with @B.interop: {missing}"
    assert ck.rms_norm.__wrapped__.__name__ == "rms_norm" and "Root-mean-square" in ck.rms_norm.__doc__


def test_host_dlpack_arrays_run_the_reference_without_a_copy(rng):
    x, w = randn(rng, (5, 16), F32), randn(rng, (16,), F32)
    out = np.full((5, 16), np.nan, F32)
    fx, fw, fo = HostDLPack(x), HostDLPack(w), HostDLPack(out)
    v = B.as_array(fx)
    assert isinstance(v, np.ndarray) and np.shares_memory(v, x), "a host DLPack array is viewed, not copied"
    got = ck.rms_norm(fx, fw, out=fo)
    assert got is fo, "an out= of another library comes back as the object passed"
    np.testing.assert_array_equal(out, ck.rms_norm(x, w))
    y = ck.gelu(fx)  # no torch tensor among the inputs: a NumPy result
    assert type(y) is np.ndarray
    np.testing.assert_array_equal(y, ck.gelu(x))
    # lists are looked into (global_norm's arrays)
    n = ck.global_norm([HostDLPack(x), w])
    np.testing.assert_allclose(float(n), np.sqrt((x.astype(np.float64) ** 2).sum() + (w.astype(np.float64) ** 2).sum()),
                               rtol=1e-6)
    # in place through a foreign view: adam_step writes the caller's memory
    p, g, m, vv = randn(rng, (8,), F32), randn(rng, (8,), F32), np.zeros(8, F32), np.zeros(8, F32)
    p0 = p.copy()
    ck.adam_step(HostDLPack(p), HostDLPack(g), HostDLPack(m), HostDLPack(vv), lr=1e-2, step=1)
    pr, mr, vr = p0.copy(), np.zeros(8, F32), np.zeros(8, F32)
    ck.adam_step(pr, g, mr, vr, lr=1e-2, step=1)
    assert np.array_equal(p, pr) and np.array_equal(m, mr) and not np.array_equal(p, p0)


def test_read_only_host_dlpack_out_is_refused():
    out = np.zeros(3, F32)
    out.flags.writeable = False  # NumPy exports it with DLPack's read-only flag; the view stays read-only
    with pytest.raises((ValueError, TypeError), match="^out:"):
        ck.gelu(np.zeros(3, F32), out=HostDLPack(out))


def test_refusals_name_the_argument():
    with pytest.raises(TypeError, match=r"^x: a .*OnDevice on DLPack device \(4, 0\); expected a CUDA or a CPU array"):
        ck.gelu(OnDevice((4, 0)))
    with pytest.raises(TypeError, match=r"^arrays\[1\]: got a cukernels autograd Tensor"):
        ck.global_norm([np.zeros(2, F32), ck.Tensor(np.zeros(2, F32))])
    with pytest.raises(TypeError, match=r"^x: expected a numpy\.ndarray or cupy\.ndarray, got object"):
        ck.gelu(object())


@pytest.mark.skipif(ck.gpu_available(), reason="checks the message on a machine without a GPU")
def test_gpu_arrays_without_a_gpu_are_refused_not_copied():
    with pytest.raises(TypeError, match=r"^x: a .*OnDevice lives on a GPU but CuPy sees no CUDA device"):
        ck.gelu(OnDevice((2, 0)))
    cai = CAIOnly({"shape": (3,), "typestr": "<f4", "data": (0, False), "version": 3})
    with pytest.raises(TypeError, match=r"^gate: a .*CAIOnly lives on a GPU"):
        ck.swiglu(cai, np.zeros(3, F32))


def test_plain_types_are_learned_once():
    class Opaque:  # not an array: the op reports it; its type is remembered as plain
        pass

    with pytest.raises(TypeError):
        ck.gelu(np.zeros(3, F32), out=Opaque())
    assert Opaque in B._PLAIN
    ck.gelu(HostDLPack(np.zeros(3, F32)))
    with pytest.raises(TypeError):
        ck.gelu(ck.Tensor(np.zeros(3, F32)))
    # array-like types and containers are never skipped
    with pytest.raises(TypeError, match="^x: got a cukernels autograd Tensor"):
        ck.gelu(ck.nn.Parameter(np.zeros(3, F32)))  # a Tensor subclass: recognised through its MRO
    assert HostDLPack not in B._PLAIN and ck.Tensor not in B._PLAIN and ck.nn.Parameter not in B._PLAIN
    assert list not in B._PLAIN and tuple not in B._PLAIN


# ---------------------------------------------------------------- CPU: the torch branch, with a stand-in torch
class _Dt:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"


def _fake_torch():
    """A stand-in ``torch`` module: just what the interop code touches, with torch's constraints (a bf16 tensor
    cannot go through NumPy's DLPack import, ``from_numpy`` does not know ml_dtypes' bfloat16)."""
    mod = types.ModuleType("torch")
    mod.float32, mod.bfloat16, mod.int16, mod.int32, mod.int64 = (_Dt(n) for n in ("float32", "bfloat16", "int16",
                                                                                     "int32", "int64"))
    np_of = {np.dtype(F32): mod.float32, np.dtype(np.int16): mod.int16, np.dtype(np.int32): mod.int32,
             np.dtype(np.int64): mod.int64, BF16: mod.bfloat16}

    class Tensor:
        def __init__(self, a, requires_grad=False):
            self._a, self.requires_grad, self.dtype = a, requires_grad, np_of[a.dtype]

        def view(self, dtype):
            target = {mod.int16: np.int16, mod.bfloat16: BF16, mod.float32: F32}[dtype]
            return Tensor(self._a.view(target), self.requires_grad)

        def __dlpack__(self, **kw):
            if self.dtype is mod.bfloat16:
                raise BufferError("bfloat16 is not supported by this consumer")  # NumPy's DLPack import
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return (1, 0)

        def numpy(self):
            return self._a

    Tensor.__module__ = "torch"

    def from_numpy(a):
        if a.dtype == BF16:
            raise TypeError("can't convert np.ndarray of type bfloat16")
        return Tensor(a)

    mod.Tensor, mod.from_numpy = Tensor, from_numpy
    return mod


@pytest.fixture
def fake_torch(monkeypatch):
    mod = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", mod)
    return mod


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_torch_branch_with_a_stand_in(rng, fake_torch, dtype):
    torch = fake_torch
    x, w = randn(rng, (3, 8), dtype), randn(rng, (8,), F32)
    ref = ck.rms_norm(x, w)
    y = ck.rms_norm(torch.Tensor(x), w)  # a torch tensor among the inputs: a torch tensor comes back
    assert type(y) is torch.Tensor and y.dtype is (torch.bfloat16 if dtype == BF16 else torch.float32)
    assert np.array_equal(y.numpy().view(np.uint8), ref.view(np.uint8))
    xt = torch.Tensor(x)
    assert np.shares_memory(B.as_array(xt), x) and B.as_array(xt).dtype == np.dtype(dtype), "bf16 via an int16 view"
    out = torch.Tensor(np.full((3, 8), np.nan, np.float32).astype(dtype))
    y2, rstd = ck.rms_norm(xt, torch.Tensor(w), out=out, return_rstd=True)
    assert y2 is out and type(rstd) is torch.Tensor and rstd.dtype is torch.float32
    assert np.array_equal(out.numpy().view(np.uint8), ref.view(np.uint8))
    with pytest.raises(TypeError, match=r"^x: a torch\.Tensor that requires grad; .*pass x\.detach\(\)"):
        ck.rms_norm(torch.Tensor(x, requires_grad=True), w)
    assert ck.adam_step(*(torch.Tensor(np.zeros(8, F32)) for _ in range(4)), lr=1e-3, step=1) is None


# ---------------------------------------------------------------- GPU: PyTorch CUDA tensors
def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    return torch


def _tdt(torch, dtype):
    return torch.bfloat16 if np.dtype(dtype) == BF16 else torch.float32


def _to_torch(torch, a):
    """A host array onto the GPU as a torch tensor (bf16 through float32: torch has no ml_dtypes)."""
    a = np.asarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.astype(F32)).cuda().to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _host(t):
    """A torch tensor to NumPy (bf16 read exactly through float32)."""
    return t.detach().float().cpu().numpy() if t.dtype.is_floating_point else t.detach().cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_torch_in_and_out_is_zero_copy(dtype):
    torch = _torch_cuda()
    import cupy as cp

    xt = torch.randn(37, 1000, device="cuda").to(_tdt(torch, dtype))
    v = B.as_array(xt)
    assert isinstance(v, cp.ndarray) and v.dtype == np.dtype(dtype)
    assert v.data.ptr == xt.data_ptr(), "the CuPy view must share the torch tensor's memory"
    c = cp.arange(12, dtype=cp.float32).astype(dtype)
    t = B.to_torch(c)
    assert t.data_ptr() == c.data.ptr and t.dtype == _tdt(torch, dtype) and t.device.type == "cuda"
    np.testing.assert_array_equal(_host(t), np.arange(12, dtype=F32).astype(dtype).astype(F32))


def _cases(rng, dtype):
    """(name, run(ck-args converter) -> result) pairs: each op on torch tensors and on NumPy, same values."""
    x = randn(rng, (37, 1000), dtype, scale=2.0)
    w = randn(rng, (1000,), dtype)
    b = randn(rng, (1000,), dtype)
    t = rng.integers(0, 1000, 37).astype(np.int64)
    t[3] = -100
    return {
        "rms_norm": lambda c: ck.rms_norm(c(x), c(w), eps=1e-5),
        "layer_norm": lambda c: ck.layer_norm(c(x), c(w), c(b)),
        "softmax": lambda c: ck.softmax(c(x)),
        "cross_entropy": lambda c: ck.cross_entropy(c(x), c(t), label_smoothing=0.1),
        "cross_entropy_none": lambda c: ck.cross_entropy(c(x), c(t), reduction="none"),
        "add": lambda c: ck.add(c(x), c(b), alpha=0.5),
        "gelu": lambda c: ck.gelu(c(x)),
        "rms_norm_with_rstd": lambda c: ck.rms_norm(c(x), c(w), return_rstd=True)[1],
    }


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax", "cross_entropy", "cross_entropy_none", "add",
                                "gelu", "rms_norm_with_rstd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_torch_results_match_reference(rng, op, dtype):
    torch = _torch_cuda()
    run = _cases(rng, dtype)[op]
    ref = run(lambda a: a)
    got = run(lambda a: _to_torch(torch, a))
    assert isinstance(got, torch.Tensor) and got.device.type == "cuda"
    assert got.dtype == ({BF16: torch.bfloat16, np.dtype(F32): torch.float32}[ref.dtype])
    assert tuple(got.shape) == ref.shape
    # the families' own GPU tests' tolerances: losses are fp32 sums over 1000 classes (kernel vs float64)
    tol = {"cross_entropy": (1e-4, 1e-5), "cross_entropy_none": (1e-4, 1e-5), "rms_norm_with_rstd": (1e-5, 0)}
    rt, at = tol.get(op, (None, None))
    assert_close(_host(got), ref.astype(F32), ref.dtype, rtol=rt, atol=at, what=op)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_torch_out_is_written_in_place(rng, dtype):
    torch = _torch_cuda()
    x, w = randn(rng, (199, 4097), dtype), randn(rng, (4097,), F32)
    out = torch.full((199, 4097), float("nan"), device="cuda").to(_tdt(torch, dtype))
    ptr = out.data_ptr()
    got = ck.rms_norm(_to_torch(torch, x), _to_torch(torch, w), out=out)
    assert got is out and out.data_ptr() == ptr
    assert_close(_host(out), ck.rms_norm(x, w).astype(F32), dtype, what="rms_norm out=")
    # elementwise in place on a torch residual stream: h += branch (bf16 into fp32)
    h = torch.zeros(199, 4097, device="cuda")
    hp = h.data_ptr()
    assert ck.add(h, _to_torch(torch, x), out=h) is h and h.data_ptr() == hp
    assert_close(_host(h), x.astype(F32), F32, what="add in place")
    loss = torch.full((), float("nan"), device="cuda")
    t = rng.integers(0, 4097, 199).astype(np.int64)
    assert ck.cross_entropy(_to_torch(torch, x), _to_torch(torch, t), out=loss) is loss
    assert_close(_host(loss), ck.cross_entropy(x, t), F32, rtol=1e-4, atol=1e-5, what="cross_entropy out=")


@pytest.mark.gpu
@pytest.mark.parametrize("gdt", DTYPES, ids=["g32", "gbf16"])
def test_gpu_torch_adam_step_in_place(rng, gdt):
    torch = _torch_cuda()
    n = 10**5 + 3
    p, g = randn(rng, (n,), F32), randn(rng, (n,), gdt, 0.3)
    m, v = randn(rng, (n,), F32, 0.05), (np.abs(randn(rng, (n,), F32, 0.05)) + 1e-4).astype(F32)
    tp, tg, tm, tv = (_to_torch(torch, a) for a in (p, g, m, v))
    tsh = torch.full((n,), float("nan"), device="cuda", dtype=torch.bfloat16)
    ptrs = [a.data_ptr() for a in (tp, tm, tv, tsh)]
    lr = torch.tensor(1e-2, device="cuda")  # device hyperparameters as 0-d torch tensors
    step = torch.tensor(3, device="cuda", dtype=torch.int32)
    assert ck.adam_step(tp, tg, tm, tv, lr=lr, step=step, weight_decay=0.1, shadow=tsh) is None
    assert [a.data_ptr() for a in (tp, tm, tv, tsh)] == ptrs
    ck.adam_step(p, g, m, v, lr=1e-2, step=3, weight_decay=0.1)
    np.testing.assert_allclose(_host(tp), p, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(_host(tm), m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_host(tv), v, rtol=1e-5, atol=1e-9)
    assert np.array_equal(_host(tsh).astype(BF16).view(np.uint16), _host(tp).astype(BF16).view(np.uint16))
    A.adam_error()
    lr.fill_(float("nan"))  # checked on the device: nothing written, the error word set
    before = _host(tp).copy()
    ck.adam_step(tp, tg, tm, tv, lr=lr, step=step)
    assert np.array_equal(_host(tp), before) and A.adam_error() == A.ADAM_ERR_LR


@pytest.mark.gpu
def test_gpu_torch_mixed_with_cupy_and_refusals(rng):
    torch = _torch_cuda()
    import cupy as cp

    q = randn(rng, (2, 16, 4, 64), ck.bfloat16)
    cos, sin = ck.rope_cache(32, 64, xp=cp)  # CuPy tables, torch activations: fine together
    y = ck.rope(_to_torch(torch, q), cos, sin)
    assert isinstance(y, torch.Tensor)
    assert_close(_host(y), ck.rope(q, to_host(cos), to_host(sin)).astype(F32), ck.bfloat16, what="rope")
    with pytest.raises(TypeError, match=r"^x: a torch\.Tensor that requires grad; .*x\.detach\(\)"):
        ck.gelu(torch.ones(3, device="cuda", requires_grad=True))
    with pytest.raises(ValueError, match=r"^x: expected a C-contiguous array"):  # no silent copy of a transpose
        ck.gelu(torch.ones(4, 3, device="cuda").t())
    with pytest.raises(TypeError, match=r"is a cupy array but .* is a numpy array|is a numpy array but .* is a cupy array"):
        ck.add(torch.ones(3), torch.ones(3, device="cuda"))  # a CPU tensor never goes to the GPU silently


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_torch_cpu_tensors_take_the_reference_path(rng, dtype):
    torch = _torch_cuda()
    x = randn(rng, (5, 64), dtype)
    xt = torch.from_numpy(x.astype(F32)).to(_tdt(torch, dtype))  # on the host
    y = ck.gelu(xt)
    assert isinstance(y, torch.Tensor) and y.device.type == "cpu" and y.dtype == xt.dtype
    assert np.array_equal(_host(y), ck.gelu(x).astype(F32))
    v = B.as_array(xt)
    assert isinstance(v, np.ndarray) and v.ctypes.data == xt.data_ptr()


@pytest.mark.gpu
def test_gpu_cuda_array_interface_only(rng):
    import cupy as cp

    x = cp.asarray(randn(rng, (33, 100), F32))
    cai = dict(x.__cuda_array_interface__)
    cai.pop("stream", None)  # no producer stream: nothing for CuPy to synchronise
    obj = CAIOnly(cai)
    v = B.as_array(obj)
    assert v.data.ptr == x.data.ptr and v.shape == x.shape
    y = ck.gelu(obj)
    assert type(y) is cp.ndarray, "no torch tensor among the inputs: a CuPy result"
    assert_close(y, ck.gelu(to_host(x)), F32)
    out = cp.full((33, 100), np.nan, F32)
    assert ck.gelu(x, out=CAIOnly(dict(out.__cuda_array_interface__))) is not None
    assert_close(out, ck.gelu(to_host(x)), F32, what="out= through the interface")
