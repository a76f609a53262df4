"""A tiny tape autograd over CuPy or NumPy arrays.

``Tensor`` wraps an array (either module) with ``requires_grad``, ``.grad`` and ``.backward()``. A ``Function``
subclass defines ``forward(ctx, *arrays)`` on raw arrays and ``backward(ctx, grad)`` returning one gradient per
input (``None`` where there is none). ``Function.apply`` runs the forward and, when a gradient is needed, links
the output to its inputs; ``backward()`` walks that graph in reverse topological order.

Gradients of leaves are accumulated **in place** into an existing ``.grad`` array (``+=``), never rebound: the
optimizer hands every parameter a ``.grad`` view into one flat buffer and relies on it staying there. A
Function may also accumulate a leaf's gradient itself (``ctx.leaf_grad(i)`` gives the buffer, e.g. a weight-grad
GEMM with beta = 1 or a sparse-row embedding gradient) and return ``None`` for that input.

Gradient-ready hooks (:meth:`Tensor.register_grad_ready_hook`): ``fn(leaf)`` runs once per ``backward()``, as soon
as every Function of that backward that takes the leaf as an input (with a gradient wanted) has run its
backward -- whether it returned the leaf's gradient or wrote it into ``.grad`` / ``.sparse_grad`` itself. A
data-parallel optimizer starts reducing a bucket of gradients there while the rest of the backward runs. With no
hook registered anywhere the backward does no extra work.

Activation recompute (:mod:`cukernels.functional.recompute`) builds on two pieces here: :class:`collect_grad_inputs`
(which tensors requiring a gradient a block reads: its parameters) and :func:`backward_from` (back-propagate from a
block's outputs to its inputs inside an enclosing backward, the inputs' gradients handed back). The grad mode
(``no_grad`` / ``enable_grad``) is per thread.

The Functions themselves live in :mod:`cukernels.functional`, which also installs the Tensor's arithmetic
operators and methods (``+``, ``**``, ``@``, ``exp``, ``sum``, ``reshape``, indexing, ...): this module imports
nothing above the ops.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from . import _backend as B
from .settings import settings
from .ops.elementwise import add as _ck_add
from .ops.elementwise import cast as _ck_cast


class _Mode(threading.local):
    """Per thread, as autocast's state (amp.py) and torch's grad mode: ranks run as threads in the in-process
    FakeGroup, and one rank's ``no_grad`` (the no-recording forward of a recomputed block,
    :mod:`cukernels.functional.recompute`) must not switch off another rank's tape mid-forward."""

    enabled = True  # record on the tape
    sink = None     # {id: Tensor}: every Tensor requiring a gradient given to a Function (collect_grad_inputs)


_mode = _Mode()
_live_ready_hooks = 0  # gradient-ready hooks registered and not removed (0: backward skips the bookkeeping)
# Ranks in threads (the CPU tests of data parallelism) register hooks at once; re-entrant because a tensor's
# finalizer (_forget_hooks) may run from a garbage collection triggered inside a locked section. An update lost
# that way can only leave the count too high (bookkeeping done for nothing), never too low.
_hooks_lock = threading.RLock()


class no_grad:
    """Context manager (and decorator) that records nothing on the tape (in this thread)."""

    _enabled = False

    def __enter__(self):
        self._prev, _mode.enabled = _mode.enabled, self._enabled

    def __exit__(self, *exc):
        _mode.enabled = self._prev

    def __call__(self, fn):
        def wrapped(*a, **k):
            with type(self)():
                return fn(*a, **k)
        return wrapped


class enable_grad(no_grad):
    """Context manager (and decorator) that records on the tape again, even inside ``no_grad`` (a recomputed
    block's second forward runs inside the backward)."""

    _enabled = True


def is_grad_enabled() -> bool:
    return _mode.enabled


class collect_grad_inputs:
    """``with collect_grad_inputs() as found:`` -- ``found`` ({id: Tensor}) receives every Tensor requiring a
    gradient that a Function is applied to inside the block, leaf or not, recorded or not (under ``no_grad``
    too): what a recomputed block reads besides its explicit inputs (its parameters). Nests: an inner
    collection's Tensors are not seen by the outer one, except through the Functions the inner caller applies."""

    def __enter__(self):
        self._prev, _mode.sink = _mode.sink, {}
        return _mode.sink

    def __exit__(self, *exc):
        _mode.sink = self._prev


def _xp(a):
    return B._kind(a) or np


class Tensor:
    """An array (``numpy.ndarray`` or ``cupy.ndarray``) with a gradient: the unit of the tape autograd.

    ``ck.tensor([[1., 2.]], requires_grad=True)``; ``y = (x * x).sum(); y.backward(); x.grad``. Arithmetic
    (``+ - * / ** @``, unary ``-``), indexing, ``.T``, ``reshape``, ``transpose``, ``sum``, ``mean``, ``exp``,
    ``log``, ``tanh``, ``sigmoid``, ``astype`` record on the tape; the kernel ops are in ``ck.functional``
    (``ck.functional.rms_norm(x, w)``).

    Attributes: ``data`` (the array; the optimizer may replace it by a view of its flat buffer), ``grad``
    (None until a backward reaches it, then an array of ``data``'s shape, accumulated in place), ``requires_grad``,
    ``name`` (parameter name, for messages), ``shadow`` (a low-precision copy kept by the optimizer, read by
    autocast GEMMs), ``sparse_grad`` (a ``ck.SparseRowGrad`` for sparse-row embeddings).
    """

    __array_priority__ = 1000

    def __init__(self, data, requires_grad=False, name=None):
        if isinstance(data, Tensor):
            data = data.data
        if B._kind(data) is None:
            if isinstance(data, (str, bytes)):
                raise TypeError(f"Tensor: expected numeric data (an array, a number or nested lists of numbers); "
                                f"got {type(data).__name__} {data!r:.40}")
            data = np.asarray(data)
        dt = data.dtype
        if not (dt.kind in "biuf" or dt == B.bfloat16):
            raise TypeError(f"Tensor: expected a numeric dtype (float32, bfloat16, integers, bool); got {dt}")
        if requires_grad and not (dt.kind == "f" or dt == B.bfloat16):
            raise TypeError(f"Tensor: only floating-point tensors can require a gradient; got dtype {dt} "
                            f"(make it float32: ck.tensor(x.astype('float32'), requires_grad=True))")
        self.data = data
        self.requires_grad = B.check_bool("requires_grad", requires_grad)
        self.grad = None
        self.name = name
        self.shadow = None
        self.shadow_wait = None  # set by an optimizer while the shadow's update is in flight (amp.lowp_weight)
        self.fp8_owner = None  # the optimizer that keeps an FP8 copy on request (amp.fp8_weight)
        self.sparse_grad = None
        self.grad_stale = False  # .grad holds stale values that count as zero (AdamW.zero_grad(lazy=True))
        # Bumped by every zero_grad (nn.Module's, the optimizers'): a Function that wrote .grad during its forward
        # (the fused LM head) checks it in backward, so a zero_grad() between the two is an error, not a lost gradient.
        self.grad_epoch = 0
        self._node = None  # (Function class, ctx) for a non-leaf; _FREED once a backward released it
        self._ready_hooks = None  # gradient-ready hooks (register_grad_ready_hook), in registration order

    # -- array-like -----------------------------------------------------------------------------------------
    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    xp = property(lambda self: _xp(self.data))
    is_leaf = property(lambda self: self._node is None)

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        n = f", name={self.name!r}" if self.name else ""
        g = ", requires_grad=True" if self.requires_grad else ""
        fn = f", grad_fn={self._node[0].__name__}" if isinstance(self._node, tuple) else ""
        dev = "cpu" if self.xp is np else "cuda"
        body = np.array2string(self.numpy(), precision=4, threshold=20, edgeitems=2, prefix="Tensor(") \
            if self.size <= 1000 else f"<{self.shape}>"
        return f"Tensor({body}, dtype={self.dtype}, device={dev}{n}{g}{fn})"

    def numpy(self):
        """A host (NumPy) copy of the data."""
        return self.data.get() if hasattr(self.data, "get") else np.array(self.data)

    def item(self):
        """The value as a Python float (a device->host read: call it only when logging)."""
        return float(self.numpy())

    def detach(self):
        """The same array, off the tape."""
        return Tensor(self.data)

    def backward(self, grad=None, retain_graph=False):
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad`` (see :func:`backward`)."""
        backward(self, grad, retain_graph=retain_graph)

    def register_grad_ready_hook(self, fn):
        """Call ``fn(self)`` once per :func:`backward` that reaches this leaf, right after its gradient for that
        backward is complete: every recorded Function taking this tensor as an input (with a gradient wanted) has
        run its backward, including Functions that write the gradient straight into ``.grad`` (weight-grad GEMMs)
        or ``.sparse_grad`` (sparse-row embeddings). A leaf used by several Functions (a tied embedding, ``x * x``)
        fires once, after the last of them. Returns a handle whose ``remove()`` unregisters the hook.

        Raises TypeError when ``fn`` is not callable, RuntimeError on a tensor that is not a leaf requiring a
        gradient (only leaves keep a ``.grad``)."""
        global _live_ready_hooks
        if not callable(fn):
            raise TypeError(f"fn: expected a callable taking the tensor; got {type(fn).__name__}")
        if not self.requires_grad or self._node is not None:
            raise RuntimeError("register_grad_ready_hook: only a leaf tensor that requires a gradient has a .grad "
                               f"to wait for (this one: requires_grad={self.requires_grad}, leaf={self.is_leaf})")
        with _hooks_lock:
            if self._ready_hooks is None:
                self._ready_hooks = []
                # A tensor dropped with hooks still registered takes them out of the live count. The finalizer
                # holds only a one-int box: holding the hook list would keep alive what the hooks reference (an
                # optimizer, which references this tensor).
                self._ready_box = [0]
                weakref.finalize(self, _forget_hooks, self._ready_box)
            self._ready_hooks.append(fn)
            self._ready_box[0] += 1
            _live_ready_hooks += 1
        return _HookHandle(self, fn)


_FREED = "freed"  # a non-leaf whose saved arrays a backward released (retain_graph=False)


def _forget_hooks(box):
    global _live_ready_hooks
    with _hooks_lock:
        _live_ready_hooks -= box[0]
        box[0] = 0


class _HookHandle:
    """What :meth:`Tensor.register_grad_ready_hook` returns: ``remove()`` unregisters the hook (idempotent)."""

    __slots__ = ("_tensor", "_fn")

    def __init__(self, tensor, fn):
        self._tensor, self._fn = tensor, fn

    def remove(self):
        global _live_ready_hooks
        t, self._tensor = self._tensor, None
        if t is None:
            return
        with _hooks_lock:
            hooks = t._ready_hooks or []
            for i, h in enumerate(hooks):
                if h is self._fn:
                    del hooks[i]
                    t._ready_box[0] -= 1
                    _live_ready_hooks -= 1
                    break


class Context:
    """What a Function's forward leaves for its backward."""

    def __init__(self, inputs, needs_input_grad):
        self.inputs = inputs                       # the apply() arguments (Tensors and others)
        self.needs_input_grad = needs_input_grad   # per argument: a gradient is wanted
        self.saved_tensors = ()
        self.seed_one = False                      # backward's grad is the implicit ones of loss.backward()

    def save_for_backward(self, *arrays):
        self.saved_tensors = arrays

    def leaf_grad(self, i):
        """The existing ``.grad`` buffer of input i when it is a leaf that wants a gradient, else None.

        A Function can accumulate into it directly (and return None for that input)."""
        t = self.inputs[i]
        if isinstance(t, Tensor) and t.requires_grad and t._node is None:
            return t.grad
        return None

    def leaf_grad_write(self, i):
        """``(buffer, accumulate)`` for a Function that writes input i's gradient straight into its ``.grad``:
        ``accumulate`` is False when the buffer holds stale values (``grad_stale``, set by an optimizer's lazy
        ``zero_grad``), so the first write of a step overwrites (a GEMM with beta = 0: no zeroing pass and no
        read of the old gradient) and later ones add. ``(None, False)`` when there is no buffer."""
        buf = self.leaf_grad(i)
        if buf is None:
            return None, False
        t = self.inputs[i]
        acc = not t.grad_stale
        t.grad_stale = False
        return buf, acc


class Function:
    """Base class. Subclasses define ``forward(ctx, *args, **kw)`` and ``backward(ctx, grad)``."""

    @staticmethod
    def forward(ctx, *args, **kw):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args, **kw):
        sink = _mode.sink
        if sink is not None:
            for a in args:
                if isinstance(a, Tensor) and a.requires_grad:
                    sink[id(a)] = a
        needs = tuple(_mode.enabled and isinstance(a, Tensor) and a.requires_grad for a in args)
        ctx = Context(args, needs)
        raw = cls.forward(ctx, *[a.data if isinstance(a, Tensor) else a for a in args], **kw)
        out = Tensor(raw, requires_grad=any(needs))
        if out.requires_grad:
            out._node = (cls, ctx)
        return out


def _kernel_addable(x, y):
    """CuPy float32/bfloat16 arrays of one shape, both C-contiguous: what ``ck.add`` takes (16-byte vector
    kernel, ~4 TB/s; CuPy's own bf16 ``+`` runs at ~1.2 TB/s on the H200)."""
    return (B._kind(x) not in (None, np) and x.shape == y.shape and x.dtype in B.FLOATS and y.dtype in B.FLOATS
            and x.flags.c_contiguous and y.flags.c_contiguous)


def fast_add(x, y):
    """``x + y`` as a new array, through ``ck.add`` when :func:`_kernel_addable`, else ``+``. Never in place: a
    gradient array may be shared by several inputs (``Add.backward`` returns g twice)."""
    if _kernel_addable(x, y):
        return _ck_add(x, y, dtype=np.promote_types(x.dtype, y.dtype))
    return x + y


def _accumulate_leaf(t, g):
    if t.grad is None:
        dt = t.data.dtype if t.data.dtype.kind == "f" or t.data.dtype == B.bfloat16 else g.dtype
        t.grad = g.astype(dt, copy=True)  # own storage: g may be shared with another input
    elif t.grad_stale:  # logically zero (lazy zero_grad): overwrite instead of adding
        if settings.fast_cast and _kernel_addable(t.grad, g):  # (the A/B switch: --ab fast_cast=0)
            # ck.cast's 16-byte kernel: CuPy's own fp32 -> bf16 copy ran at ~1.3 TB/s on the H200 (the fused LM
            # head's 1.05 GB fp32 dW into a bf16 gradient buffer: 1.24 ms of the B8xT1024 step, session 11)
            _ck_cast(g, t.grad.dtype, out=t.grad)
        else:
            t.grad[...] = g
        t.grad_stale = False
    elif _kernel_addable(t.grad, g):
        _ck_add(t.grad, g, out=t.grad)  # in place: the optimizer's flat-buffer view stays bound
    else:
        t.grad += g


def _toposort(roots, stop=()):
    """The tensors reachable from ``roots`` (inputs before outputs); the history of a tensor in ``stop`` is not
    followed (a recomputed block's inputs: their gradients are handed back, not propagated)."""
    order, seen, stack = [], set(), [(r, False) for r in roots]
    while stack:
        t, done = stack.pop()
        if done:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        if isinstance(t._node, tuple) and id(t) not in stop:
            for a in t._node[1].inputs:
                if isinstance(a, Tensor) and a.requires_grad and id(a) not in seen:
                    stack.append((a, False))
    return order  # inputs before outputs


def _ready_counts(order, root):
    """``{id(leaf): number of pending contributions}`` for the hooked leaves of this backward: one per (Function,
    input slot) edge with a gradient wanted, plus one for a hooked root that is itself a leaf (its seed)."""
    pending = {}
    for t in order:
        if isinstance(t._node, tuple):
            ctx = t._node[1]
            for a, need in zip(ctx.inputs, ctx.needs_input_grad):
                if need and a._node is None and getattr(a, "_ready_hooks", None):
                    pending[id(a)] = pending.get(id(a), 0) + 1
    if root._node is None and getattr(root, "_ready_hooks", None):
        pending[id(root)] = pending.get(id(root), 0) + 1
    return pending


def _contributed(t, pending):
    """One contribution to leaf ``t`` is done; run its hooks when it was the last."""
    n = pending[id(t)] - 1
    pending[id(t)] = n
    if n == 0:
        for fn in list(t._ready_hooks or ()):
            fn(t)


def backward(root: Tensor, grad=None, retain_graph=False):
    """Accumulate d(root)/d(leaf) into every leaf that requires a gradient.

    ``grad`` defaults to ones for a root of one element (a 0-d loss; any other shape needs an explicit ``grad`` of
    its shape, RuntimeError otherwise, as PyTorch); no device->host read happens. Gradient-ready hooks of
    the leaves (:meth:`Tensor.register_grad_ready_hook`) run as each leaf's last contribution lands.
    """
    if not root.requires_grad:
        raise RuntimeError("backward(): the tensor does not require a gradient (was it computed under no_grad?)")
    if root._node is _FREED:
        raise RuntimeError("backward(): this graph was already released by an earlier backward(); call "
                           "backward(retain_graph=True) the first time to go through it twice")
    seeded = grad is None
    if seeded:
        if root.size != 1:  # PyTorch's rule: an implicit ones seed only for a scalar (it was silently all ones)
            raise RuntimeError(f"backward(): grad can be implicitly created only for scalar outputs; this tensor has "
                               f"shape {root.shape}: reduce it first (.sum(), .mean()) or pass grad= of that shape")
        grad = root.xp.ones(root.shape, dtype=root.dtype)
    else:
        if isinstance(grad, Tensor):
            grad = grad.data
        if B._kind(grad) is None:
            raise TypeError(f"grad: expected an array or a Tensor of shape {root.shape}; got {B._got(grad)}")
        if B._kind(grad) is not root.xp:
            raise TypeError(f"grad: is a {B._kind(grad).__name__} array but the tensor holds a {root.xp.__name__} "
                            "array")
        if tuple(grad.shape) != root.shape:
            raise ValueError(f"grad: expected shape {root.shape} (the tensor's); got {tuple(grad.shape)}")
    _run_backward([root], [grad], retain_graph, seed=root if seeded else None, hooks=True)


def _run_backward(roots, grads_in, retain_graph=False, *, seed=None, hooks=False, capture=None, expect=None):
    """The backward walk of :func:`backward` from one or several roots (``grads_in``: one gradient array each).

    ``seed``: the root whose gradient is the implicit ones of ``loss.backward()`` (``ctx.seed_one``).
    ``hooks``: count contributions and run gradient-ready hooks (only the outermost backward does). ``capture``:
    {id: Tensor} whose gradients are returned ({id: array}) instead of accumulated, their history not followed
    (:func:`backward_from`). ``expect``: None, or the ids of the only leaves this walk may write a gradient to
    (RuntimeError otherwise)."""
    grads = {}
    for r, g in zip(roots, grads_in):
        grads[id(r)] = fast_add(grads[id(r)], g) if id(r) in grads else g
    capture = capture or {}
    order = _toposort(roots, capture)
    # Hook bookkeeping only while some hook is registered: without one this loop is the plain backward.
    pending = _ready_counts(order, roots[0]) if hooks and _live_ready_hooks else None
    captured = {}
    for t in reversed(order):
        g = grads.pop(id(t), None)
        if id(t) in capture:
            if g is not None:
                captured[id(t)] = g
            continue
        if t._node is None:
            if g is not None:
                _accumulate_leaf(t, g)
                if pending and id(t) in pending:  # the root itself is a hooked leaf
                    _contributed(t, pending)
            continue
        if t._node is _FREED:
            if g is None:
                continue
            raise RuntimeError("backward(): part of this graph was already released by an earlier backward(); "
                               "call backward(retain_graph=True) the first time to go through it twice")
        fn, ctx = t._node
        if g is not None:
            ctx.seed_one = t is seed
            if expect is not None:
                _check_expected(ctx, capture, expect)
            gin = fn.backward(ctx, g)
            if not isinstance(gin, tuple):
                gin = (gin,)
            for a, need, ga in zip(ctx.inputs, ctx.needs_input_grad, gin):
                if not need or ga is None:
                    continue
                if a._node is None and id(a) not in capture:
                    _accumulate_leaf(a, ga)
                elif id(a) in grads:
                    grads[id(a)] = fast_add(grads[id(a)], ga)
                else:
                    grads[id(a)] = ga
            if not retain_graph:
                t._node = _FREED  # free the saved activations as we go
        if pending:
            # This Function is done with its inputs (a node no gradient reached contributes nothing, but is done
            # too): count it off every hooked leaf it takes, firing the hooks of leaves it completes.
            for a, need in zip(ctx.inputs, ctx.needs_input_grad):
                if need and a._node is None and id(a) in pending:
                    _contributed(a, pending)
    return captured


def _check_expected(ctx, capture, expect):
    for a, need in zip(ctx.inputs, ctx.needs_input_grad):
        if need and a._node is None and id(a) not in capture and id(a) not in expect:
            name = f" {a.name!r}" if a.name else ""
            raise RuntimeError(f"recompute: the second forward of a recomputed block used a tensor{name} of shape "
                               f"{a.shape} requiring a gradient that its first forward (under no_grad) did not use: "
                               f"the block must compute the same thing both times (no branch on is_grad_enabled())")


def backward_from(outputs, grads, inputs, retain_graph=False, expect=None):
    """Back-propagate ``grads`` (one array or None per tensor of ``outputs``) through the graph that recorded
    ``outputs``, stopping at ``inputs``: returns the gradient of each input (an array, or None where none
    reached it) instead of accumulating it, and does not walk the inputs' own history. Every other leaf reached
    gets its gradient accumulated into ``.grad`` as :func:`backward` does (in place, ``grad_stale`` honoured);
    gradient-ready hooks are not run (the enclosing backward runs them: a recomputed block's parameters are
    inputs of its node there). ``expect``: None, or the ids of the only leaves (other than ``inputs``) the walk
    may give a gradient to -- those the enclosing graph knows the block reads, whose hooks it counts; another is a
    RuntimeError. What :mod:`cukernels.functional.recompute` runs inside a backward."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and isinstance(o, Tensor) and o.requires_grad]
    if not pairs:
        return [None] * len(inputs)
    capture = {id(t): t for t in inputs}
    got = _run_backward([o for o, _ in pairs], [g for _, g in pairs], retain_graph, capture=capture, expect=expect)
    return [got.get(id(t)) for t in inputs]


def tensor(data, requires_grad=False, name=None, dtype=None):
    """A :class:`Tensor` from an array (NumPy or CuPy, kept as is: no copy), a number or nested lists.

    ``dtype`` converts first (a copy). Python floats and lists become float32 (not NumPy's float64, which the
    kernels do not take); integers stay integers (ids, targets) and cannot require a gradient.

    Example::

        >>> x = ck.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
        >>> (x ** 2).sum().backward(); x.grad
    """
    if isinstance(data, Tensor):
        data = data.data
    if B._kind(data) is None and not isinstance(data, (str, bytes)):
        a = np.asarray(data)
        if dtype is None and a.dtype == np.float64 and not isinstance(data, np.ndarray):
            dtype = np.float32
        data = a
    if dtype is not None:
        data = data.astype(dtype)
    return Tensor(data, requires_grad=requires_grad, name=name)
