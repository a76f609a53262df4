"""``CompositeAdamW``: AdamW as a chain of plain array operations -- the ``fused: false`` baseline of
:class:`cukernels.optim.AdamW`, with the same ``state_dict`` format."""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .adamw import _matcher, check_hyperparameters, check_lr, check_state


class CompositeAdamW:
    """AdamW as a chain of plain array operations: the ``fused: false`` baseline of ``ck.optim.AdamW``.

    ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (wd p + m_hat / (sqrt(v_hat) + eps))`` with bias
    corrections; ``grad_scale`` (a 0-d device array or a float) multiplies the gradients first (clipping and
    accumulation averaging without a host read). Same interface subset: step, zero_grad, set_lr, state_dict.
    ``shadow_dtype=ck.bfloat16`` keeps a low-precision copy of every parameter, rewritten by a cast after each
    update (``shadow(p)``), so autocast reads it instead of casting per use (the ablation's "shadow" row).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, no_decay=(),
                 shadow_dtype=None):
        lr, b1, b2, eps, weight_decay = check_hyperparameters(lr, betas, eps, weight_decay)
        self.params = list(params)
        if not self.params:
            raise ValueError("params: got an empty parameter list")
        for i, p in enumerate(self.params):
            if not hasattr(p, "data") or B._kind(getattr(p, "data", None)) is None:
                raise TypeError(f"params[{i}]: expected a Tensor / Parameter (an object with an array .data); got "
                                f"{B._got(p)}")
        if shadow_dtype is not None:
            shadow_dtype = B.check_dtype_arg("shadow_dtype", shadow_dtype, B.FLOATS)
        if callable(no_decay) or isinstance(no_decay, str):
            is_nd = _matcher(no_decay, "no_decay")
            nd = {id(p) for i, p in enumerate(self.params) if is_nd(getattr(p, "name", None) or f"param{i}", p.data)}
        else:
            no_decay = list(no_decay or ())
            if no_decay and all(isinstance(n, str) for n in no_decay):  # parameter names, as AdamW takes them
                nd = {id(p) for p in self.params if getattr(p, "name", None) in set(no_decay)}
            else:
                nd = {id(p) for p in no_decay}
        self.wd = [0.0 if id(p) in nd else weight_decay for p in self.params]
        self.lr, self.betas, self.eps = lr, (b1, b2), eps
        self.m = [p.xp.zeros_like(p.data) for p in self.params]
        self.v = [p.xp.zeros_like(p.data) for p in self.params]
        self.t = 0
        self._shadow = ({id(p): p.data.astype(shadow_dtype) for p in self.params}
                        if shadow_dtype is not None else {})

    def shadow(self, p):
        """The low-precision copy of ``p`` (KeyError without ``shadow_dtype``)."""
        return self._shadow[id(p)]

    def set_lr(self, lr):
        self.lr = check_lr(lr)

    def zero_grad(self):
        for p in self.params:
            if p.grad is not None:
                p.grad.fill(0)

    def step(self, grad_scale=None):
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        for p, m, v, wd in zip(self.params, self.m, self.v, self.wd):
            if p.grad is None:
                continue
            xp = p.xp
            g = p.grad if grad_scale is None else p.grad * grad_scale
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * (g * g)
            if wd:
                p.data *= 1.0 - self.lr * wd
            p.data -= self.lr * (m / bc1) / (xp.sqrt(v / bc2) + self.eps)
            if id(p) in self._shadow:
                self._shadow[id(p)][...] = p.data.astype(self._shadow[id(p)].dtype)

    def _names(self):
        return [getattr(p, "name", None) or f"param{i}" for i, p in enumerate(self.params)]

    def state_dict(self, copy=True):
        """The :meth:`cukernels.optim.AdamW.state_dict` format (moments keyed by parameter name)."""
        take = (lambda a: a.get() if hasattr(a, "get") else a.copy()) if copy else (lambda a: a)
        return {"kind": "CompositeAdamW", "step": self.t, "lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.wd[0] if self.wd else 0.0,
                "state": {n: {"exp_avg": take(m), "exp_avg_sq": take(v)}
                          for n, m, v in zip(self._names(), self.m, self.v)}}

    def load_state_dict(self, state):
        """Restore from either optimizer's ``state_dict`` (matched by name, all checked before any write)."""
        names = self._names()
        step, lr, st = check_state(state, names)
        for n, m in zip(names, self.m):
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(st[n][key].shape) != tuple(m.shape):
                    raise ValueError(f"state_dict[{n!r}][{key!r}]: expected shape {tuple(m.shape)}; got "
                                     f"{tuple(st[n][key].shape)}")
        for n, m, v, p in zip(names, self.m, self.v, self.params):
            for key, dst in (("exp_avg", m), ("exp_avg_sq", v)):
                src = st[n][key]
                if p.xp is np:
                    src = src.get() if hasattr(src, "get") else np.asarray(src)
                dst[...] = p.xp.asarray(src).astype(dst.dtype, copy=False)
        self.t, self.lr = step, lr
        for p in self.params:
            if id(p) in self._shadow:
                self._shadow[id(p)][...] = p.data.astype(self._shadow[id(p)].dtype)
