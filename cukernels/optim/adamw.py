"""``ck.optim.AdamW``: AdamW over flat buffers, with bf16 shadow weights, sparse-row updates for embeddings, a
device-side step counter and learning rate, and a warmup + cosine schedule that runs on the device.

Layout. At construction every dense parameter is copied into a flat fp32 buffer of its group (weight decay /
no weight decay), next to flat buffers for its gradient, both moments and its bf16 shadow, at the same
offsets (each parameter starts on a 64-element = 256-byte boundary, so every view is 16-byte aligned for the
vector paths of the other kernels; the padding is zero and stays zero). The dense update is then one
:func:`cukernels.adam_step` launch per group, one or two for the whole model. Parameters named in ``sparse``
(2-D embedding tables) keep their own buffers and are updated with :func:`cukernels.adam_step_rows` on the
rows the step touched.

What this means for the caller:

* Objects with ``.data`` (e.g. autograd Tensors): the optimizer **replaces** ``p.data`` by a view into its
  flat buffer (same values, same shape) and sets ``p.grad`` to a zeroed view into the flat gradient buffer.
  The backward must then accumulate into ``p.grad`` **in place** (``p.grad += g`` on the array, or
  ``xp.add(p.grad, g, out=p.grad)``), so gradients land in the flat buffer with no copy. Arrays the caller
  held before construction are no longer the parameters. As a safety net, ``step()`` / ``zero_grad()`` check
  identity: a ``p.data`` or ``p.grad`` that was rebound to another array is copied into the flat buffer and
  the view is put back (one extra copy per rebinding; ``p.grad = None`` counts as a zero gradient -- the
  parameter is still updated, unlike PyTorch which skips it).
* ``(name, array)`` pairs: the values are copied; use :meth:`AdamW.param` / :meth:`AdamW.grad` (or
  :meth:`AdamW.named_parameters`) to get the views the model must use from then on.
* :meth:`AdamW.shadow` gives a parameter's bf16 copy, rewritten by every ``step()`` in the same pass as the
  update: autocast reads it instead of casting the fp32 weight every forward. After writing parameter values
  by other means (loading a checkpoint into ``p.data``), call :meth:`AdamW.refresh_shadows`.

Graph capture. ``lr`` and the step count live in 0-d device arrays (:attr:`AdamW.lr_array`,
:attr:`AdamW.step_array`); ``step()`` advances the step (and, with a schedule, computes the lr from it) in one
tiny kernel, then runs the update kernels that read both from device memory, so a captured training step
stays valid replay after replay. ``set_lr`` writes the device lr outside the graph.

The NumPy path is the same object on NumPy arrays (same math through the reference ops).
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from ..ops import adam as _A
from ..ops.embedding import SparseRowGrad

ALIGN = 64  # elements: every parameter view starts on a 256-byte boundary of its fp32 buffer


# ------------------------------------------------------------------------------ argument checks (every optimizer)
def check_lr(lr, name="lr"):
    """A learning rate: a finite number >= 0 that stays finite in float32 (the device lr), refused when it is
    given (at construction, ``set_lr``), not at the first ``step()``."""
    B.check_f32(name, lr, min=0)
    return float(lr)  # (the value as given: the host schedule computes in float64)


def check_hyperparameters(lr, betas, eps, weight_decay):
    """``(lr, beta1, beta2, eps, weight_decay)`` as floats after torch.optim.AdamW's checks (lr >= 0, betas a pair
    in [0, 1), eps > 0, weight_decay >= 0, all finite): TypeError / ValueError naming the argument."""
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise TypeError(f"betas: expected a pair (beta1, beta2) of numbers in [0, 1); got {B._got(betas)}")
    beta1, beta2 = betas
    _A._hyper(beta1, beta2, eps, weight_decay)
    return check_lr(lr), float(beta1), float(beta2), float(eps), float(weight_decay)


def check_state(state, names, what="state_dict"):
    """An optimizer ``state_dict`` to load: a dict with ``step`` (an integer >= 0), ``lr`` (a number >= 0) and
    ``state`` ({name: {"exp_avg", "exp_avg_sq"}} covering exactly ``names``, arrays): every problem a TypeError /
    ValueError naming the key (a missing "state" was a bare KeyError). Returns ``(step, lr, state["state"])``."""
    if not isinstance(state, dict):
        raise TypeError(f"{what}: expected a dict (an optimizer's state_dict()); got {B._got(state)}")
    for k in ("state", "step", "lr"):
        if k not in state:
            raise ValueError(f"{what}: missing the key {k!r} (the keys of an optimizer's state_dict(): kind, step, "
                             f"lr, betas, eps, weight_decay, state); got keys {sorted(map(str, state))}")
    st = state["state"]
    if not isinstance(st, dict):
        raise TypeError(f"{what}['state']: expected a dict {{parameter name: moments}}; got {B._got(st)}")
    missing, unexpected = set(names) - set(st), set(st) - set(names)
    if missing or unexpected:
        raise KeyError(f"state_dict: missing parameters {sorted(missing)}, unexpected {sorted(unexpected)}")
    for n in names:
        e = st[n]
        if not isinstance(e, dict) or not {"exp_avg", "exp_avg_sq"} <= set(e):
            raise ValueError(f"{what}['state'][{n!r}]: expected a dict with 'exp_avg' and 'exp_avg_sq'; got "
                             f"{B._short(e)}")
        for key in ("exp_avg", "exp_avg_sq"):
            if not hasattr(e[key], "shape"):
                raise TypeError(f"{what}['state'][{n!r}][{key!r}]: expected an array; got {B._got(e[key])}")
    step = B.check_int(f"{what}['step']", state["step"], min=0, max=2**31 - 1)  # (the device step is int32)
    lr = check_lr(state["lr"], f"{what}['lr']")
    return step, lr, st


class WarmupCosine:
    """Linear warmup from 0 to ``max_lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at
    ``total_steps`` (held at ``min_lr`` after). Attach with :meth:`AdamW.set_schedule`; each ``step()`` then
    computes the lr of its (1-based) step number on the device from the device step counter.

    ``lr(t) = max_lr * t / warmup`` for ``t <= warmup``, else
    ``min_lr + (max_lr - min_lr) * (1 + cos(pi * (t - warmup) / (total - warmup))) / 2``.

    Example::

        >>> opt.set_schedule(ck.optim.WarmupCosine(3e-4, total_steps=10000, warmup_steps=200, min_lr=3e-5))
    """

    def __init__(self, max_lr, total_steps, warmup_steps=0, min_lr=0.0):
        # Integers, not "100" or 100.7 (both were accepted: int() truncated or parsed them), within the schedule
        # kernel's bounds (the step counts of ops.adam.tick's schedule tuple).
        max_lr, min_lr = check_lr(max_lr, "max_lr"), check_lr(min_lr, "min_lr")
        warmup_steps = B.check_int("warmup_steps", warmup_steps, min=0, max=2**62)
        total_steps = B.check_int("total_steps", total_steps, min=0, max=2**62)
        if total_steps < warmup_steps:
            raise ValueError(f"total_steps: expected an integer >= warmup_steps ({warmup_steps}); got {total_steps}")
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.warmup_steps, self.total_steps = int(warmup_steps), int(total_steps)

    def lr_at(self, t):
        """The lr of step number ``t`` (1-based), in float64 on the host."""
        return _A.warmup_cosine(t, self.max_lr, self.min_lr, self.warmup_steps, self.total_steps)

    def as_tuple(self):
        return (self.max_lr, self.min_lr, self.warmup_steps, self.total_steps)

    def __repr__(self):
        return (f"WarmupCosine(max_lr={self.max_lr}, total_steps={self.total_steps}, "
                f"warmup_steps={self.warmup_steps}, min_lr={self.min_lr})")


class _Slot:
    """One parameter: its name, the caller's object (or None for a pair) and its views."""

    __slots__ = ("name", "obj", "shape", "group", "data", "grad", "exp_avg", "exp_avg_sq", "shadow")


class _Group:
    """Flat buffers updated by one launch: dense (1-D, several parameters) or sparse (one 2-D parameter)."""

    def __init__(self, wd, sparse):
        self.wd, self.sparse = wd, sparse
        self.slots = []
        self.P = self.G = self.M = self.V = self.S = None
        self.rows = self.row_count = None  # sparse: device rows / count registered with set_rows
        self.last_rows = False  # sparse: the last step updated only the listed rows
        self.sparse_grad = None  # sparse: the ck.SparseRowGrad over G (attach_sparse)


def _matcher(spec, what):
    """A predicate (name, array) -> bool from None, a callable, or a collection of names."""
    if spec is None:
        return lambda name, a: False
    if callable(spec):
        return lambda name, a: bool(spec(name, a))
    if isinstance(spec, str):
        raise TypeError(f"{what}: expected a set of names or a callable(name, array); got the string {spec!r}")
    try:
        items = list(spec)
    except TypeError:
        raise TypeError(f"{what}: expected a set of names or a callable(name, array); got {B._got(spec)}") from None
    bad = [x for x in items if not isinstance(x, str)]
    if bad:  # a set of Tensors would silently match nothing (and a list of arrays is unhashable)
        raise TypeError(f"{what}: expected parameter names (str) or a callable(name, array); got "
                        f"{type(bad[0]).__name__} elements (pass {{p.name for p in ...}})")
    names = set(items)
    return lambda name, a: name in names


class AdamW:
    """AdamW over flat buffers (see the module docstring for the layout and what it does to ``.data``).

    Args:
        params: a list of ``(name, array)`` pairs, or of objects with ``.data`` (a float32 array), ``.grad``
            (array or None) and optionally ``.name``; all NumPy or all CuPy.
        lr: initial learning rate (device scalar; change with :meth:`set_lr` or a schedule).
        betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        shadow_dtype: ``ck.bfloat16`` (default) to keep a bf16 copy of every parameter, or None.
        no_decay: names (set) or ``callable(name, array) -> bool`` of parameters without weight decay
            (e.g. ``lambda n, a: a.ndim < 2`` for norms and biases). Default: every parameter decays.
        sparse: names or ``callable(name, array) -> bool`` of 2-D parameters updated on listed rows only
            (lazy Adam, see :func:`cukernels.adam_step_rows`) once rows are registered with :meth:`set_rows`;
            without registered rows they get the dense update.
        grad_dtype: float32 (default) or ``ck.bfloat16``: the dtype of the dense groups' gradient buffers (sparse
            parameters keep fp32 rows). bf16 is what bf16 autocast produces anyway -- a weight-gradient GEMM of
            bf16 operands rounded once to bf16 (PyTorch's autocast casts that bf16 result up to its fp32 .grad) --
            written straight into the buffer, and it halves the gradient's bytes: the GEMM's write, the norm's
            and the update's reads (issue 17: ~7.4 GB a LLaMA-1B step, NOTES.md). Every further write to a
            parameter's gradient in the same step (gradient accumulation, a tied weight's second use) rounds to
            bf16 again: use it with one micro-batch.

    Example::

        >>> opt = ck.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
        ...                      no_decay=lambda n, a: a.ndim < 2, sparse={"tok_emb.weight"})
        >>> opt.set_rows(model.tok_emb.weight, rows, row_count)   # device buffers the embedding backward fills
        >>> loss.backward(); norm, scale = opt.clip_grad_norm(1.0); opt.step(grad_scale=scale); opt.zero_grad()
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 shadow_dtype=B.bfloat16, no_decay=None, sparse=None, grad_dtype=np.float32):
        lr, beta1, beta2, eps, weight_decay = check_hyperparameters(lr, betas, eps, weight_decay)
        if shadow_dtype is not None:
            B.check_dtype_arg("shadow_dtype", shadow_dtype, (B.bfloat16,))
        try:
            gdt = np.dtype(grad_dtype)
        except TypeError:
            gdt = None
        if gdt not in (np.dtype(np.float32), np.dtype(B.bfloat16)):
            raise TypeError(f"grad_dtype: expected float32 or ck.bfloat16; got {grad_dtype!r}")
        self.grad_dtype = gdt
        self.betas = (float(beta1), float(beta2))
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.shadow_dtype = None if shadow_dtype is None else B.bfloat16

        entries = self._normalise(params)
        if not entries:
            raise ValueError("params: got an empty parameter list")
        xp = B.array_module(**{f"params[{name!r}]": a for name, _, a in entries})
        self.xp = xp
        is_nd, is_sparse = _matcher(no_decay, "no_decay"), _matcher(sparse, "sparse")

        dense, sparse_groups = {}, []  # dense: weight decay -> [(name, obj, array)], in the order given
        self._by_name, self._by_id = {}, {}
        for name, obj, a in entries:
            B.check_dtype(f"params[{name!r}]", a, (np.float32,))
            wd = 0.0 if is_nd(name, a) else self.weight_decay
            if is_sparse(name, a):
                if a.ndim != 2:
                    raise ValueError(f"params[{name!r}]: sparse parameters must be 2-D (V, D); got shape "
                                     f"{tuple(a.shape)}")
                sparse_groups.append(self._build([(name, obj, a)], wd, sparse=True))
            else:
                dense.setdefault(wd, []).append((name, obj, a))
        # One launch per distinct weight decay (one in all when weight_decay == 0), then the sparse ones.
        self._groups = [self._build(dense[wd], wd, sparse=False) for wd in sorted(dense, reverse=True)]
        self._groups += sparse_groups
        self._by_name = {name: self._by_name[name] for name, _, _ in entries}  # the order given

        self._step = xp.zeros((), dtype=np.int32)
        self._lr = xp.zeros((), dtype=np.float32)
        self.set_lr(lr)
        self._schedule = None
        self._norm = self._scale = self._norm_ws = None  # grad_norm outputs, made once
        # This optimizer's device error word: the update kernels OR a bit into it (and write nothing) when the lr,
        # step or grad_scale they read from device memory is invalid (a NaN clip scale after a NaN loss, say).
        # Read at the next synchronising call (check_errors, step_count, get_lr, state_dict): no sync is added to
        # the step itself, so a captured step stays capturable.
        self._err = None if xp is np else xp.zeros((), dtype=np.int32)

    # ------------------------------------------------------------------------------------------ layout
    @staticmethod
    def _normalise(params):
        out, seen = [], set()
        for i, p in enumerate(params):
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                name, obj, a = p[0], None, p[1]
            elif hasattr(p, "data"):
                name, obj, a = getattr(p, "name", None) or f"param{i}", p, p.data
            else:
                raise TypeError(f"params[{i}]: expected a (name, array) pair or an object with .data; got "
                                f"{type(p).__name__}")
            if B._kind(a) is None:
                raise TypeError(f"params[{name!r}]: expected a numpy.ndarray or cupy.ndarray; got {type(a).__name__}")
            if name in seen:
                raise ValueError(f"params: the name {name!r} appears twice; parameter names must be unique")
            seen.add(name)
            out.append((name, obj, a))
        return out

    def _build(self, items, wd, sparse):
        xp = self.xp
        g = _Group(wd, sparse)
        if sparse:
            (name, obj, a), = items
            g.P = xp.array(a, dtype=np.float32, order="C")  # a copy: the optimizer owns its buffers
            offsets = [0]
            zeros = lambda dt: xp.zeros(a.shape, dtype=dt)  # noqa: E731
        else:
            offsets, total = [], 0
            for _, _, a in items:
                offsets.append(total)
                total += -(-a.size // ALIGN) * ALIGN
            g.P = xp.zeros((total,), dtype=np.float32)
            for (_, _, a), off in zip(items, offsets):
                g.P[off:off + a.size] = a.reshape(-1)
            zeros = lambda dt: xp.zeros((total,), dtype=dt)  # noqa: E731
        g.G, g.M, g.V = zeros(np.float32 if sparse else self.grad_dtype), zeros(np.float32), zeros(np.float32)
        g.S = g.P.astype(B.bfloat16) if self.shadow_dtype is not None else None
        for (name, obj, a), off in zip(items, offsets):
            s = _Slot()
            s.name, s.obj, s.shape, s.group = name, obj, tuple(a.shape), g

            def view(buf, off=off, a=a):
                if buf is None:
                    return None
                return buf if sparse else buf[off:off + a.size].reshape(a.shape)

            s.data, s.grad, s.exp_avg, s.exp_avg_sq, s.shadow = (view(g.P), view(g.G), view(g.M), view(g.V),
                                                                  view(g.S))
            if obj is not None:
                old_grad = getattr(obj, "grad", None)
                if old_grad is not None and B._kind(old_grad) is xp and tuple(old_grad.shape) == s.shape:
                    s.grad[...] = old_grad  # keep a gradient that was already accumulated
                obj.data = s.data
                obj.grad = s.grad
                self._by_id[id(obj)] = s
            self._by_name[name] = s
            g.slots.append(s)
        return g

    def _slot(self, p):
        if isinstance(p, str):
            s = self._by_name.get(p)
        else:
            s = self._by_id.get(id(p))
            if s is None:  # a view handed out by param()/grad()
                s = next((t for t in self._by_name.values() if t.data is p), None)
        if s is None:
            raise KeyError(f"{p if isinstance(p, str) else type(p).__name__}: not a parameter of this optimizer")
        return s

    def _zero(self, a):
        if self.xp is np:
            a.fill(0)
        else:
            B.zero_(a)

    def _sync(self):
        """Put back views the caller's objects lost (rebound .data / .grad): copy their values in first."""
        for s in self._by_id.values():
            obj = s.obj
            d = obj.data
            if d is not s.data:
                B.check_shape(f"{s.name}.data", d, s.shape, " (the parameter's shape)")
                s.data[...] = d
                if s.shadow is not None:
                    s.shadow[...] = s.data.astype(B.bfloat16)
                obj.data = s.data
            g = getattr(obj, "grad", None)
            if g is not s.grad:
                if g is None:
                    self._zero(s.grad)
                else:
                    B.check_shape(f"{s.name}.grad", g, s.shape, " (the parameter's shape)")
                    s.grad[...] = g
                obj.grad = s.grad

    # ------------------------------------------------------------------------------------------ access
    def named_parameters(self):
        """``[(name, param view)]`` in the order given."""
        return [(n, s.data) for n, s in self._by_name.items()]

    def param(self, p):
        """The parameter's array (a view into the flat buffer). ``p``: name, object or view."""
        return self._slot(p).data

    def grad(self, p):
        """The parameter's gradient view (backward accumulates into it in place)."""
        return self._slot(p).grad

    def shadow(self, p):
        """The parameter's bf16 shadow (a view), rewritten by every ``step()``; for autocast."""
        s = self._slot(p)
        if s.shadow is None:
            raise ValueError("shadow: this optimizer was built with shadow_dtype=None")
        return s.shadow

    def exp_avg(self, p):
        return self._slot(p).exp_avg

    def exp_avg_sq(self, p):
        return self._slot(p).exp_avg_sq

    @property
    def flat_grads(self):
        """The gradient buffers, one per launch group (flat for dense groups, (V, D) for sparse ones)."""
        return [g.G for g in self._groups]

    @property
    def lr_array(self):
        """The 0-d float32 device array the update kernels read the lr from."""
        return self._lr

    @property
    def step_array(self):
        """The 0-d int32 device array holding the number of steps taken."""
        return self._step

    def check_errors(self):
        """Raise FloatingPointError if an update since the last check found an invalid device lr, step or
        grad_scale (that update was skipped: parameters and moments are unchanged). A host sync: call it where
        you read the loss anyway (the trainer does, on logging steps)."""
        if self._err is None:
            return
        code = int(self._err)
        if code:
            self._err.fill(0)
            raise FloatingPointError(_A.adam_error_message(code) + " (a NaN/inf loss or gradient gives a NaN "
                                     "clip scale; lower the lr, check the data)")

    @property
    def step_count(self):
        """Steps taken (reads the device counter: a host sync; raises if an update was refused)."""
        self.check_errors()
        return int(self._step)

    def get_lr(self):
        """The current lr (reads the device scalar: a host sync; raises if an update was refused)."""
        self.check_errors()
        return float(self._lr)

    def set_lr(self, lr):
        """Write the device lr (asynchronous; outside a captured graph). A schedule overrides it at the next
        step."""
        lr = check_lr(lr)  # (a negative lr was accepted here and refused only by the next step())
        if self.xp is np:
            self._lr[...] = np.float32(lr)
        else:
            self._lr.fill(np.float32(lr))

    def set_schedule(self, schedule):
        """Attach a :class:`WarmupCosine` (or None to detach): each ``step()`` then sets the device lr to
        ``schedule.lr_at(t)`` for its step number t, on the device."""
        if schedule is not None and not isinstance(schedule, WarmupCosine):
            raise TypeError(f"schedule: expected a WarmupCosine or None; got {type(schedule).__name__}")
        self._schedule = schedule

    def set_rows(self, p, rows, row_count):
        """Register the device buffers listing the rows of sparse parameter ``p`` that each step touches.

        ``rows`` (1-D int32, capacity >= count) and ``row_count`` (0-d int32) are read by the kernels at every
        ``step()`` and ``zero_grad()``: keep filling the same buffers (the embedding backward's outputs) and a
        captured step stays valid. ``set_rows(p, None, None)`` goes back to dense updates.
        """
        s = self._slot(p)
        g = s.group
        if not g.sparse:
            raise ValueError(f"{s.name}: not a sparse parameter (name it in AdamW(..., sparse=...))")
        self._norm_ws = None  # grad_norm's partials layout depends on which groups have rows
        if rows is None and row_count is None:
            g.rows = g.row_count = None
            return
        B.array_module(param=g.P, rows=rows, row_count=row_count)
        _A._check_rows(rows, row_count)
        g.rows, g.row_count = rows, row_count

    def attach_sparse(self, p):
        """Give sparse parameter ``p`` a ``ck.SparseRowGrad`` over this optimizer's gradient buffer of it
        (``p.sparse_grad``): the embedding backward accumulates the touched rows there and lists them on the
        device, ``step()`` updates only those rows, and ``zero_grad()`` clears only them (and resets the row
        list). Returns the SparseRowGrad."""
        s = self._slot(p)
        g = s.group
        if not g.sparse or len(s.shape) != 2:
            raise ValueError(f"{s.name}: not a 2-D sparse parameter (name it in AdamW(..., sparse=...))")
        self._zero(g.G)
        sg = SparseRowGrad(s.shape[0], s.shape[1], xp=self.xp, grad=g.G)
        self.set_rows(p, sg.rows, sg.count)
        g.sparse_grad = sg
        if s.obj is not None:
            s.obj.sparse_grad = sg
        return sg

    # ------------------------------------------------------------------------------------------ the step
    def step(self, grad_scale=None):
        """One AdamW step for every parameter: advance the device step (and the scheduled lr), then one
        ``adam_step`` launch per dense group and one ``adam_step_rows`` (or dense) launch per sparse parameter.

        Args:
            grad_scale: optional 0-d float32 device array multiplying every gradient (e.g. from
                :meth:`clip_grad_norm`, or an inverse loss scale).
        """
        self._sync()
        self.flush_stale()
        _A.tick(self._step, self._lr, increment=1,
                schedule=self._schedule.as_tuple() if self._schedule is not None else None)
        b1, b2 = self.betas
        kw = dict(lr=self._lr, step=self._step, beta1=b1, beta2=b2, eps=self.eps, grad_scale=grad_scale)
        if self._err is not None:
            kw["error"] = self._err
        for g in self._groups:
            if g.sparse and g.rows is not None:
                _A.adam_step_rows(g.P, g.G, g.M, g.V, g.rows, g.row_count, weight_decay=g.wd, shadow=g.S, **kw)
                g.last_rows = True
            else:
                _A.adam_step(g.P, g.G, g.M, g.V, weight_decay=g.wd, shadow=g.S, **kw)
                g.last_rows = False

    def zero_grad(self, lazy=False):
        """Zero every gradient: ``cudaMemsetAsync`` of each flat gradient buffer; a sparse parameter whose last
        step was a row update gets only its listed rows zeroed (``zero_rows``), so call this before the next
        backward overwrites the rows buffer.

        ``lazy=True`` (parameters given as autograd Tensors): dense gradients are not touched, only marked
        ``grad_stale``; the first backward write of the step then overwrites instead of adding (the weight-
        gradient GEMM runs with beta = 0), which saves the zeroing pass and one read of every gradient. A
        gradient nothing wrote is zeroed by :meth:`flush_stale`, which :meth:`grad_norm` and :meth:`step` call.
        """
        self._sync()
        for g in self._groups:
            if lazy and not g.sparse and all(s.obj is not None for s in g.slots):
                for s in g.slots:
                    s.obj.grad_stale = True
                continue
            if getattr(g, "sparse_grad", None) is not None:
                g.sparse_grad.zero()  # clears the listed rows, empties the list, new generation
            elif g.sparse and g.last_rows and g.rows is not None:
                _A.zero_rows(g.G, g.rows, g.row_count)
            else:
                self._zero(g.G)

    def flush_stale(self):
        """Zero the gradients still marked stale by a lazy :meth:`zero_grad` (parameters no backward wrote),
        so every gradient buffer holds this step's gradient. Called by :meth:`grad_norm` and :meth:`step`;
        call it before reading gradients any other way."""
        for g in self._groups:
            for s in g.slots:
                if s.obj is not None and getattr(s.obj, "grad_stale", False):
                    self._zero(s.grad)
                    s.obj.grad_stale = False

    def grad_norm(self):
        """Global L2 norm of all gradients (0-d float32 device array): one partial launch per flat buffer plus
        one final reduce. A sparse parameter with registered rows (``set_rows`` / ``attach_sparse``) is read
        on its listed rows only -- the rows ``step()`` updates; its buffer is zero elsewhere. The result and
        the partials live in buffers the optimizer allocates once, so the same array comes back every call
        (safe inside a captured graph; copy it if you keep values across steps)."""
        self.flush_stale()
        rows = [(g.rows, g.row_count) if g.sparse and g.rows is not None else None for g in self._groups]
        rows = rows if any(r is not None for r in rows) else None
        if self._norm is None:
            self._norm = self.xp.zeros((), dtype=np.float32)
            self._scale = self.xp.ones((), dtype=np.float32)
        if self._norm_ws is None:  # sized for the registered rows; set_rows drops it
            self._norm_ws = _A.global_norm_workspace(self.flat_grads, rows)
        return _A.global_norm(self.flat_grads, out=self._norm, workspace=self._norm_ws, rows=rows)

    def clip_grad_norm(self, max_norm):
        """``(norm, scale)`` device scalars with ``scale = min(1, max_norm / (norm + 1e-6))``; pass ``scale``
        to :meth:`step` as ``grad_scale``. No host sync, no allocation after the first call (capturable)."""
        norm = self.grad_norm()
        return norm, _A.clip_scale(norm, max_norm, out=self._scale)

    def refresh_shadows(self):
        """Recompute every bf16 shadow from the fp32 parameters (after writing parameter values directly)."""
        if self.shadow_dtype is None:
            return
        for g in self._groups:
            g.S[...] = g.P.astype(B.bfloat16)

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self, copy=True):
        """``{"kind": "AdamW", "step", "lr", "betas", "eps", "weight_decay", "state": {name: {"exp_avg",
        "exp_avg_sq"}}}`` -- the one format of every ``cukernels.optim`` optimizer. ``copy=True``: NumPy copies (a
        host sync); ``copy=False``: the optimizer's own moment buffers (views, on its module), for a checkpoint
        writer that streams them one at a time. Parameter values are not included (save the model)."""
        self.check_errors()
        host = (lambda a: a.copy()) if self.xp is np else (lambda a: a.get())
        take = host if copy else (lambda a: a)
        return {
            "kind": "AdamW",
            "step": int(self._step),
            "lr": float(self._lr),
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "state": {n: {"exp_avg": take(s.exp_avg), "exp_avg_sq": take(s.exp_avg_sq)}
                      for n, s in self._by_name.items()},
        }

    def load_state_dict(self, state):
        """Restore moments, step and lr from a :meth:`state_dict` (of this class or ``CompositeAdamW``: the same
        format; matched by parameter name; hyperparameters stay those given to the constructor). Everything is
        checked before anything is written. Shadows are refreshed from the current parameters."""
        step, lr, st = check_state(state, list(self._by_name))
        for n, s in self._by_name.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(st[n][key].shape) != s.shape:
                    raise ValueError(f"state_dict[{n!r}][{key!r}]: expected shape {s.shape}; got "
                                     f"{tuple(st[n][key].shape)}")
        for n, s in self._by_name.items():
            for key, dst in (("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq)):
                src = st[n][key]
                if B._kind(src) is not self.xp:
                    src = np.asarray(src.get() if hasattr(src, "get") else src)
                dst[...] = self.xp.asarray(src).astype(np.float32, copy=False)
        if self.xp is np:
            self._step[...] = np.int32(step)
        else:
            self._step.fill(np.int32(step))
        self.set_lr(lr)
        self.refresh_shadows()

    def __repr__(self):
        groups = ", ".join(f"{'sparse' if g.sparse else 'dense'}(wd={g.wd}, n={len(g.slots)})" for g in self._groups)
        return (f"AdamW(betas={self.betas}, eps={self.eps}, weight_decay={self.weight_decay}, "
                f"shadow={self.shadow_dtype is not None}, groups=[{groups}])")
