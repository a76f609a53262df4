"""Module, Parameter, ModuleList, and how parameters are first filled.

Parameters are created through :func:`new_param`, which honours :func:`init_context`: ``from_pretrained`` builds
its model inside ``init_context(empty=True, dtype=...)`` so no random numbers are drawn and no fp32 copy is made
for a model about to be overwritten by loaded weights (a 1B model in bf16 never exists in fp32).
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import _backend as B
from ..autograd import Tensor

_init = {"empty": False, "dtype": None}


@contextlib.contextmanager
def init_context(*, empty=False, dtype=None):
    """Inside: parameters are allocated uninitialised (``empty=True``) and/or in ``dtype`` instead of float32."""
    prev = dict(_init)
    _init.update(empty=bool(empty), dtype=None if dtype is None else np.dtype(dtype))
    try:
        yield
    finally:
        _init.update(prev)


PARAM_DTYPES = (np.dtype(np.float32), B.bfloat16, np.dtype(np.float16), np.dtype(np.float64))


def check_xp(xp):
    """The array module a layer is built on: numpy or cupy (TypeError otherwise)."""
    if xp is np or (xp is not None and xp is B._cupy()):
        return xp
    raise TypeError(f"xp: expected numpy or cupy; got {B._got(xp)}")


def check_param_args(*, std=0.02, dtype=None, xp=np, **sizes):
    """The constructor arguments every layer shares, checked at construction (TypeError / ValueError naming the
    argument): sizes (integers >= 1, at most 2**31 - 1), ``std`` (a finite number >= 0), ``dtype`` (None or a
    float dtype: float32, bfloat16, float16, float64 -- the last two for the composite reference path) and
    ``xp``. Returns the sizes as ints, in the order given."""
    out = [B.check_size(k, v) for k, v in sizes.items()]
    B.check_real("std", std, min=0)
    if dtype is not None:
        B.check_dtype_arg("dtype", dtype, PARAM_DTYPES)
    check_xp(xp)
    return out


def check_eps(eps):
    """A norm's epsilon: a number > 0 that stays finite and > 0 in float32 (the kernels add it as fp32)."""
    e = B.check_f32("eps", eps, min=0, min_open=True)
    if e == 0:
        raise ValueError(f"eps: expected a number > 0 that stays > 0 in float32; got {eps!r}")
    return float(eps)


def new_param(xp, shape, *, init="normal", std=0.02, rng=None, dtype=None, name=None):
    """A :class:`Parameter` of ``shape``: ``init`` "normal" (mean 0, ``std``), "ones" or "zeros"."""
    dt = np.dtype(dtype if dtype is not None else (_init["dtype"] or np.float32))
    if _init["empty"]:
        return Parameter(xp.empty(shape, dtype=dt), name=name)
    if init == "ones":
        a = xp.ones(shape, dtype=dt)
    elif init == "zeros":
        a = xp.zeros(shape, dtype=dt)
    else:
        rng = rng if rng is not None else (np.random.default_rng(0) if xp is np else xp.random.default_rng(0))
        if xp is np:
            a = (rng.standard_normal(shape) * std).astype(dt)
        else:  # a NumPy Generator beside xp=cupy draws on the host: moved, so the parameter is on xp's device
            a = xp.asarray((rng.standard_normal(shape, dtype=np.float32) * std).astype(dt))
    return Parameter(a, name=name)


class Parameter(Tensor):
    def __init__(self, data, name=None):
        super().__init__(data, requires_grad=True, name=name)


class Module:
    """Base of every layer and model: parameters are found by attribute (their names are the attribute paths,
    Hugging Face's when the attributes are named like theirs)."""

    training = True
    fused = True

    def __call__(self, *a, **k):
        return self.forward(*a, **k)

    def named_parameters(self, prefix=""):
        for k, v in self.__dict__.items():
            if isinstance(v, Parameter):
                yield prefix + k, v
            elif isinstance(v, Module):
                yield from v.named_parameters(prefix + k + ".")

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def named_modules(self, prefix=""):
        yield prefix.rstrip("."), self
        for k, v in self.__dict__.items():
            if isinstance(v, Module):
                yield from v.named_modules(prefix + k + ".")

    def modules(self):
        for _, m in self.named_modules():
            yield m

    def num_parameters(self):
        return int(sum(p.size for p in self.parameters()))

    @property
    def xp(self):
        ps = self.parameters()
        return ps[0].xp if ps else np

    def extra_repr(self):
        return ""

    def __repr__(self):
        kids = [(k, v) for k, v in self.__dict__.items() if isinstance(v, Module)]
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not kids:
            return head + ")"
        lines = [head]
        for k, v in kids:
            lines.append("  (" + k + "): " + repr(v).replace("\n", "\n  "))
        return "\n".join(lines) + "\n)"

    def state_dict(self):
        """{name: array} (the arrays themselves, not copies)."""
        return {n: p.data for n, p in self.named_parameters()}

    def load_state_dict(self, sd, strict=True):
        """Copy arrays into the parameters in place (an optimizer's views stay bound), one tensor at a time:
        NumPy, CuPy or memory-mapped sources, any float dtype (cast to the parameter's).

        Everything is checked before anything is copied: a missing/unexpected name or a shape mismatch raises
        ValueError and leaves the model untouched."""
        params = dict(self.named_parameters())
        missing = [n for n in params if n not in sd]
        unexpected = [n for n in sd if n not in params]
        if strict and (missing or unexpected):
            raise ValueError(f"load_state_dict: missing {missing[:8]}, unexpected {unexpected[:8]}")
        for n, p in params.items():
            if n in sd and tuple(sd[n].shape) != p.shape:
                raise ValueError(f"load_state_dict: {n}: expected shape {p.shape}; got {tuple(sd[n].shape)}")
        for n, p in params.items():
            if n not in sd:
                continue
            v = sd[n]
            if p.xp is np:
                v = v.get() if hasattr(v, "get") else np.asarray(v)
                p.data[...] = v.astype(p.dtype, copy=False)
            else:
                if B._kind(v) is None:  # host: cast on the host (half the bytes over PCIe for bf16 targets)
                    v = np.ascontiguousarray(np.asarray(v).astype(p.dtype, copy=False))
                p.data[...] = p.xp.asarray(v).astype(p.dtype, copy=False)
        return self

    def train(self, mode=True):
        for m in self.modules():
            m.training = mode
        return self

    def eval(self):
        return self.train(False)

    def set_fused(self, fused=True):
        for m in self.modules():
            m.fused = bool(fused)
        return self

    def zero_grad(self):
        for p in self.parameters():
            p.grad_epoch += 1
            if p.grad is not None:
                p.grad[...] = 0
            if p.sparse_grad is not None:
                p.sparse_grad.zero()

    def to(self, target):
        """``"cpu"`` (NumPy) / ``"gpu"`` (CuPy) moves the parameters; a dtype (``ck.bfloat16``, ``np.float32``)
        converts them, one at a time (inference weights: ``model.to(ck.bfloat16)`` keeps no fp32 copy). Either
        drops gradients, shadows and optimizer views."""
        if isinstance(target, str) and target in ("cpu", "gpu", "cuda"):
            for p in self.parameters():
                if target == "cpu":
                    p.data = p.data.get() if hasattr(p.data, "get") else p.data
                else:
                    import cupy
                    p.data = cupy.asarray(p.data)
                p.grad = p.shadow = p.sparse_grad = None
            return self
        try:
            dt = np.dtype(target)
        except TypeError:
            raise TypeError(f"to: expected 'cpu', 'gpu' or a dtype; got {target!r}") from None
        if dt not in B.FLOATS:
            raise TypeError(f"to: parameters are float32 or bfloat16; got {dt}")
        for p in self.parameters():
            if p.dtype != dt:
                p.data = p.data.astype(dt)
            p.grad = p.shadow = p.sparse_grad = None
        return self


class ModuleList(Module):
    def __init__(self, mods):
        self._list = list(mods)
        for i, m in enumerate(self._list):
            setattr(self, str(i), m)

    def __iter__(self):
        return iter(self._list)

    def __len__(self):
        return len(self._list)

    def __getitem__(self, i):
        return self._list[i]

    def __repr__(self):
        if not self._list:
            return "ModuleList()"
        first = repr(self._list[0]).replace("\n", "\n  ")
        same = all(type(m) is type(self._list[0]) for m in self._list)
        if same and len(self._list) > 1:
            return f"ModuleList(\n  ({0}-{len(self._list) - 1}): {len(self._list)} x {first}\n)"
        return "ModuleList(\n" + "\n".join(f"  ({i}): " + repr(m).replace("\n", "\n  ")
                                           for i, m in enumerate(self._list)) + "\n)"
