"""Layers: Linear (bias or not), Embedding (dense or sparse-row gradient), RMSNorm, LayerNorm.

Every layer has ``fused`` (default True): True runs the kernel-family Functions (``ck.rms_norm``, ...), False a
composite of plain array operations (RMSNorm as pow/mean/rsqrt/mul, per-use weight casts), so each kernel's gain
can be measured. Under ``ck.autocast(ck.bfloat16)`` the GEMM layers read the optimizer's bf16 shadow weights; under
``ck.autocast(ck.float8)`` the fused Linear layers (and their packs) run their GEMMs in FP8 (:func:`fp8_recipe`).
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .. import amp
from .. import functional as F
from ..autograd import Tensor
from ..settings import settings
from .module import Module, check_eps, check_param_args, new_param


def autocast_input(x):
    """x cast to the autocast dtype when one is active (on the tape)."""
    dt = amp.get_autocast_dtype()
    if dt is not None and x.dtype != dt:
        return F.cast(x, dt)
    return x


def weight_for_gemm(module, w):
    """``(weight tensor to differentiate, low-precision array to read or None)`` under the active autocast.

    Fused layers read the optimizer's shadow (no per-use cast; Linear casts once per call without one); the
    composite path records a cast on the tape. One place for every GEMM layer and for tied output heads."""
    dt = amp.get_autocast_dtype()
    if dt is None or w.dtype == dt:
        return w, None
    if module.fused:
        return w, amp.lowp_weight(w, dt)
    return F.cast(w, dt), None


def project(module, x, w, bias=None, *, pad_rows=False):
    """``x @ w.T (+ bias)`` with autocast handled as :class:`Linear` does (tied heads reuse it). Fused: the bias
    add and its gradient live in the GEMM Function (``pad_rows``: see ``functional.linear``); composite: a
    separate broadcast add on the tape."""
    x = autocast_input(x)
    wt, wl = weight_for_gemm(module, w)
    if module.fused:
        return F.linear(x, wt, wl, bias, pad_rows=pad_rows)
    y = F.linear(x, wt, wl)
    if bias is not None:
        y = y + (F.cast(bias, y.dtype) if bias.dtype != y.dtype else bias)
    return y


# Fused modules run the bias-free projections that read one input (LLaMA's q / k / v, gate / up) as one
# PackedLinear: one GEMM each way when the optimizer's flat buffers hold their weights back to back (session 11:
# LLaMA-1B B4xT64 15.60 -> 14.82 ms; NOTES). ck.settings.pack_projections = False: one Linear call each (the A/B
# switch).


def packable(module, linears):
    """Whether :func:`project_packed` takes these Linears of a fused ``module``: no bias, one input width."""
    return (settings.pack_projections and module.fused and all(lin.bias is None for lin in linears)
            and len({lin.in_features for lin in linears}) == 1)


def project_packed(module, x, linears):
    """``concat([lin(x) for lin in linears], axis=-1)`` as one :func:`functional.packed_linear` (autocast as
    :func:`project`: the GEMMs read the bf16 shadows). For :func:`packable` Linears."""
    hook = next((lin.project_packed for lin in linears if hasattr(lin, "project_packed")), None)
    if hook is not None:  # a LoRA adapter (nn/lora.py) among them: its Function runs the packed GEMMs
        return hook(module, x, linears)
    x = autocast_input(x)
    ws, lows = zip(*(weight_for_gemm(module, lin.weight) for lin in linears))
    r = fp8_recipe(module, x, linears[0].in_features, sum(lin.out_features for lin in linears))
    if r is not None:  # autocast(ck.float8): the pack's GEMMs in FP8, one joined weight and scale
        return F.fp8_packed_linear(x, ws, lows, recipe=r, state=fp8_state(module, "_fp8_packed_state"),
                                   w_fp8=amp.fp8_weight([lin.weight for lin in linears]))
    return F.packed_linear(x, ws, lows)


def fp8_recipe(module, x, in_features, out_features):
    """The active :class:`amp.Float8Recipe` when this fused layer's GEMMs run in FP8 (``autocast(ck.float8)`` and
    shapes cuBLASLt's FP8 GEMMs take: :func:`functional.fp8_ok`), else None (the bf16 path). Only the Linear
    layers and their packs ask: the LM head (``models.base`` calls :func:`project`), embeddings and attention
    stay bf16."""
    r = amp.get_fp8_recipe()
    if r is None or not module.fused:
        return None
    return r if F.fp8_ok(in_features, out_features, x.data if isinstance(x, Tensor) else x) else None


def fp8_state(module, attr="_fp8_state"):
    """The module's :class:`functional.Fp8State` under ``attr`` (made at the first FP8 call)."""
    st = module.__dict__.get(attr)
    if st is None:
        st = F.Fp8State()
        setattr(module, attr, st)
    return st


def check_input(x, weight, width, name="x"):
    """A layer's input: a float Tensor / array whose last axis is ``width``, of the weight's dtype, or float32 /
    bfloat16 beside float32 / bfloat16 weights (autocast). A float64 input beside float32 weights was promoted
    silently (a float64 GEMM and float64 activations): refused, as the kernel ops refuse it."""
    d = x.data if isinstance(x, Tensor) else x
    if B._kind(d) is None:
        raise TypeError(f"{name}: expected a Tensor or an array; got {B._got(x)}")
    dt, wdt = d.dtype, weight.dtype
    if dt != wdt and not (dt in B.FLOATS and wdt in B.FLOATS):
        hint = f" (cast it: {name}.astype(numpy.float32))" if dt.kind == "f" else ""
        raise TypeError(f"{name}: expected {wdt} (the layer's weight dtype){' or bfloat16' if wdt in B.FLOATS else ''}"
                        f"; got {dt}{hint}")
    if d.ndim < 1 or d.shape[-1] != width:
        raise ValueError(f"{name}: expected a last axis of {width} features; got shape {tuple(d.shape)}")


class Linear(Module):
    """``y = x W^T (+ b)``; W is [out_features, in_features] (PyTorch's and Hugging Face's layout)."""

    def __init__(self, in_features, out_features, bias=False, *, xp=np, rng=None, std=0.02, dtype=None):
        in_features, out_features = check_param_args(in_features=in_features, out_features=out_features, std=std,
                                                     dtype=dtype, xp=xp)
        bias = B.check_bool("bias", bias)
        self.in_features, self.out_features = in_features, out_features
        self.weight = new_param(xp, (out_features, in_features), std=std, rng=rng, dtype=dtype)
        self.bias = new_param(xp, (out_features,), init="zeros", dtype=dtype) if bias else None

    def forward(self, x):
        check_input(x, self.weight, self.in_features)
        r = fp8_recipe(self, x, self.in_features, self.out_features)
        if r is not None:  # autocast(ck.float8): the three GEMMs on FP8 tensor cores (functional/fp8.py)
            x = autocast_input(x)
            wt, wl = weight_for_gemm(self, self.weight)
            return F.fp8_linear(x, wt, wl, self.bias, recipe=r, state=fp8_state(self),
                                w_fp8=amp.fp8_weight([self.weight]))
        return project(self, x, self.weight, self.bias)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """Rows of a [num_embeddings, dim] table. ``sparse=True``: the gradient goes to ``weight.sparse_grad``
    (a ``ck.SparseRowGrad``; only the rows seen are updated by the optimizer) instead of a dense ``.grad``."""

    def __init__(self, num_embeddings, dim, *, sparse=False, xp=np, rng=None, std=0.02, dtype=None):
        num_embeddings, dim = check_param_args(num_embeddings=num_embeddings, dim=dim, std=std, dtype=dtype, xp=xp)
        sparse = B.check_bool("sparse", sparse)
        self.num_embeddings, self.dim, self.sparse = num_embeddings, dim, sparse
        self.weight = new_param(xp, (num_embeddings, dim), std=std, rng=rng, dtype=dtype)

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else ids
        dt = amp.get_autocast_dtype()
        lowp = amp.lowp_weight(self.weight, dt) if (dt is not None and self.fused) else None
        y = F.embedding(self.weight, ids, fused=self.fused, table_lowp=lowp, sparse=self.sparse)
        if dt is not None and y.dtype != dt:
            y = F.cast(y, dt)
        return y

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.dim}" + (", sparse=True" if self.sparse else "")


class Residual:
    """A residual stream whose last add is still pending: ``h + branch``. A pre-norm block returns one so that
    the next block's RMSNorm adds and normalises in one kernel (``ck.add_rms_norm``: h written once, read
    never, and in the backward h's own gradient is added into dx in the norm's pass: two adds fewer per
    block). ``value()`` does the add (what a consumer that needs the plain stream calls)."""

    __slots__ = ("h", "branch")

    def __init__(self, h, branch):
        self.h, self.branch = h, branch

    def value(self):
        return self.h + self.branch

    def map(self, fn):
        """The same pending add over ``fn`` of both parts (fn elementwise-compatible: slicing rows)."""
        return Residual(fn(self.h), fn(self.branch))


class RMSNorm(Module):
    def __init__(self, dim, eps=1e-6, *, xp=np, dtype=None):
        (dim,) = check_param_args(dim=dim, dtype=dtype, xp=xp)
        self.eps = check_eps(eps)  # (refused here, not at the first forward)
        self.weight = new_param(xp, (dim,), init="ones", dtype=dtype)

    def forward(self, x):
        """``rms_norm(x)``; for a :class:`Residual` x, ``(rms_norm(x.h + x.branch), x.h + x.branch)``."""
        if isinstance(x, Residual):
            return F.add_rms_norm(x.h, x.branch, self.weight, self.eps, fused=self.fused)
        return F.rms_norm(x, self.weight, self.eps, fused=self.fused)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(Module):
    def __init__(self, dim, eps=1e-5, *, xp=np, dtype=None):
        (dim,) = check_param_args(dim=dim, dtype=dtype, xp=xp)
        self.eps = check_eps(eps)
        self.weight = new_param(xp, (dim,), init="ones", dtype=dtype)
        self.bias = new_param(xp, (dim,), init="zeros", dtype=dtype)

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps, fused=self.fused)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"
