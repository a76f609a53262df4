"""``CompositeAdamW``: AdamW as a chain of plain array operations -- the ``fused: false`` baseline of
:class:`cukernels.optim.AdamW`, with its interface (one rank) and its ``state_dict`` format."""
from __future__ import annotations

import contextlib

import numpy as np

from .. import _backend as B
from .adamw import WarmupCosine, _matcher, check_hyperparameters, check_lr
from .zero import check_state, full_state, host, make_shard


class CompositeAdamW:
    """AdamW as a chain of plain array operations: the ``fused: false`` baseline of ``ck.optim.AdamW``.

    ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (wd p + m_hat / (sqrt(v_hat) + eps))`` with bias
    corrections; ``grad_scale`` (a 0-d device array or a float) multiplies the gradients first (clipping and
    accumulation averaging without a host read). The interface the trainer uses of ``AdamW`` on one rank:
    ``zero_grad``, ``clip_grad_norm``, ``step``, ``set_lr`` / ``set_schedule`` (the lr computed on the host),
    ``state_dict`` / ``load_state_dict`` (the same format), and the no-ops of a world of one (``no_sync``,
    ``wait_gathers``, ``gather_params``, ``check_errors``). ``shadow_dtype=ck.bfloat16`` keeps a low-precision copy
    of every parameter, rewritten by a cast after each update (``shadow(p)``), so autocast reads it instead of
    casting per use (the ablation's "shadow" row).
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
        self.lr, self.betas, self.eps, self.weight_decay = lr, (b1, b2), eps, weight_decay
        self.m = [p.xp.zeros_like(p.data) for p in self.params]
        self.v = [p.xp.zeros_like(p.data) for p in self.params]
        self.t = 0
        self._schedule = None
        self._shadow = ({id(p): p.data.astype(shadow_dtype) for p in self.params}
                        if shadow_dtype is not None else {})

    def shadow(self, p):
        """The low-precision copy of ``p`` (KeyError without ``shadow_dtype``)."""
        return self._shadow[id(p)]

    def set_lr(self, lr):
        self.lr = check_lr(lr)

    def set_schedule(self, schedule):
        """Attach a :class:`~cukernels.optim.WarmupCosine` (or None): each ``step()`` sets the lr of its step
        number first, on the host."""
        if schedule is not None and not isinstance(schedule, WarmupCosine):
            raise TypeError(f"schedule: expected a WarmupCosine or None; got {type(schedule).__name__}")
        self._schedule = schedule

    def zero_grad(self, lazy=False):
        """Fill every gradient with 0 (``lazy`` is AdamW's; the baseline always zeroes)."""
        for p in self.params:
            if hasattr(p, "grad_epoch"):
                p.grad_epoch += 1
            if p.grad is not None:
                p.grad.fill(0)

    def clip_grad_norm(self, max_norm, *, prescale=1.0):
        """``(norm, scale)`` as ``AdamW.clip_grad_norm``, in plain array operations: ``norm`` the L2 norm of every
        gradient (a sparse embedding's ``sparse_grad`` buffer included) times ``prescale``, ``scale = min(1,
        max_norm / (norm + 1e-6)) * prescale`` (``max_norm`` None or 0: ``prescale``)."""
        xp = self.params[0].xp
        sq = xp.zeros((), np.float32)
        for p in self.params:
            sg = getattr(p, "sparse_grad", None)
            g = sg.grad if sg is not None else p.grad
            if g is not None:
                sq = sq + (g.astype(np.float32) ** 2).sum()
        norm = xp.sqrt(sq) * prescale
        scale = xp.minimum(1.0, max_norm / (norm + 1e-6)) if max_norm else xp.ones((), np.float32)
        return norm, scale * prescale

    def step(self, grad_scale=None):
        self.t += 1
        if self._schedule is not None:
            self.set_lr(self._schedule.lr_at(self.t))
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

    # ------------------------------------------------------------------ a world of one: nothing to send or wait for
    def no_sync(self):
        return contextlib.nullcontext()

    def wait_gathers(self):
        pass

    def gather_params(self):
        pass

    def check_errors(self):
        pass

    # ------------------------------------------------------------------ state
    def _names(self):
        return [getattr(p, "name", None) or f"param{i}" for i, p in enumerate(self.params)]

    def state_dict(self, copy=True):
        """The :meth:`cukernels.optim.AdamW.state_dict` format of a world of one (moments keyed by parameter
        name, in the parameters' shapes)."""
        take = (lambda a: a.get() if hasattr(a, "get") else a.copy()) if copy else (lambda a: a)
        state = {n: {"shape": list(p.data.shape), "start": 0, "stop": int(p.data.size), "param": take(p.data),
                     "exp_avg": take(m), "exp_avg_sq": take(v)}
                 for n, p, m, v in zip(self._names(), self.params, self.m, self.v)}
        return make_shard(0, 1, self.t, self.lr, self.betas, self.eps, self.weight_decay, state)

    def load_state_dict(self, state, params=None):
        """Restore moments, step and lr from either optimizer's state (one rank's, the list of every rank's, or the
        full format; matched by name, all checked before any write). The parameters stay (load the model), unless
        ``params`` gives ``{name: fp32 array}`` to write."""
        names = self._names()
        state, _ = full_state(state)
        step, lr, st = check_state(state, names)
        for n, p in zip(names, self.params) if params else ():
            if tuple(params[n].shape) != tuple(p.data.shape):
                raise ValueError(f"params[{n!r}]: expected shape {tuple(p.data.shape)}; got {tuple(params[n].shape)}")
        for n, m in zip(names, self.m):
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(st[n][key].shape) != tuple(m.shape):
                    raise ValueError(f"state_dict[{n!r}][{key!r}]: expected shape {tuple(m.shape)}; got "
                                     f"{tuple(st[n][key].shape)}")
        for n, m, v, p in zip(names, self.m, self.v, self.params):
            for key, dst in (("exp_avg", m), ("exp_avg_sq", v)):
                dst[...] = p.xp.asarray(host(st[n][key])).astype(dst.dtype, copy=False)
        for n, p in zip(names, self.params) if params else ():
            p.data[...] = p.xp.asarray(host(params[n])).astype(p.data.dtype, copy=False)
        self.t, self.lr = step, lr
        for p in self.params:
            if id(p) in self._shadow:
                self._shadow[id(p)][...] = p.data.astype(self._shadow[id(p)].dtype)
