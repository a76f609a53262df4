"""Activation recompute (gradient checkpointing) on the tape: :func:`recompute` runs a block's forward without
recording and keeps only its inputs; the backward runs the block's forward again, recording, and back-propagates
through that second tape at once.

Why: the tape keeps every input of every recorded Function alive until its backward (``ctx.inputs``) plus what it
saves, ~86 KiB per token per layer at the LLaMA-1B shape under bf16 autocast (benchmarks/NOTES.md, "Activation
recompute"); a recomputed block keeps its inputs only (the pending residual pair: 8 KiB per token) and pays one
more forward of the block in the backward.

How it sits on the tape (nothing here touches its internals: Function.apply, ctx and :func:`backward_from`):

* the first forward runs ``fn(*inputs)`` under ``no_grad`` inside :class:`~cukernels.autograd.collect_grad_inputs`,
  which sees every Tensor requiring a gradient that ``fn`` hands to a Function: the block's parameters (and any
  other tensor it closes over). :class:`RecomputeF` takes the explicit inputs *and* those as its inputs, so the
  enclosing backward knows the node reads the parameters: their gradient-ready hooks (ZeRO's bucketed
  reduce-scatter) fire once, after this node's backward, as for any Function that writes a weight's ``.grad``.
* ``fn`` may return several Tensors (a pre-norm block returns the pending residual add, two tensors): the node
  outputs a hidden *anchor* Tensor and :class:`RecomputePickF` picks each output, as ``AddRMSNormF`` / ``PickF``
  do (functional/rms_norm.py): the picks hand their gradients to the shared state, the first to run returns a
  token for the anchor, and the node's backward runs once, after every pick that got a gradient.
* the backward re-enters the forward's autocast dtype and grad mode (the trainer's backward runs outside its
  ``autocast`` block), calls ``fn(*inputs)`` again with the same Tensor objects, and calls
  :func:`~cukernels.autograd.backward_from`: the gradients of the explicit inputs (and of any non-leaf tensor fn
  closed over) come back and are returned to the enclosing tape; every parameter's gradient is accumulated in
  place into its ``.grad`` (the optimizer's flat-buffer view) by the same Functions as without recompute, so the
  lazy zeroing (``ctx.leaf_grad_write``: the first write of a step overwrites) holds. The second tape is freed as
  it is walked.

``fn`` must compute the same values both times. Dropout's masks are counter-based (``ck.dropout``: Philox from a
seed and a device offset), so replaying them needs only the forward pass's offset snapshot, which the caller
restores around ``fn`` (the models do: ``CausalLM._run``); autocast is restored here. Nothing is read to the host
and nothing is allocated outside the current memory pool, so a recomputed step captures as one CUDA graph
(cukernels/graph.py) like any other.
"""
from __future__ import annotations

import contextlib

from .. import amp
from ..autograd import Function, Tensor, backward_from, collect_grad_inputs, enable_grad, is_grad_enabled, no_grad


class _State:
    """What the node of one recomputed call and its picks share: ``fn``, the number of explicit inputs, the
    forward's autocast state, the outputs until picked, then the gradients the picks collected."""

    __slots__ = ("fn", "n_inputs", "autocast", "outs", "grads", "token_sent")

    def __init__(self, fn, n_inputs, autocast, outs):
        self.fn, self.n_inputs, self.autocast, self.outs = fn, n_inputs, autocast, outs
        self.grads = [None] * len(outs)
        self.token_sent = False


class RecomputeF(Function):
    """The node of one :func:`recompute` call: inputs are the explicit inputs, then the tensors ``fn`` read
    (parameters); its output is the hidden anchor (the first output's array) that :class:`RecomputePickF` picks
    from. Use :func:`recompute`."""

    @staticmethod
    def forward(ctx, *arrays, state):
        ctx.state = state
        return state.outs[0]

    @staticmethod
    def backward(ctx, token):
        st = ctx.state
        grads, st.grads = st.grads, [None] * len(st.grads)  # (ready for a second backward of a retained graph)
        st.token_sent = False
        inputs = ctx.inputs
        n = st.n_inputs
        # Gradients come back for the explicit inputs and for the non-leaf tensors fn closed over; the leaves it
        # read (parameters) get theirs accumulated in place, as without recompute.
        back = [t for i, t in enumerate(inputs) if i < n or t._node is not None]
        expect = {id(t) for t in inputs}
        with enable_grad(), _amp_restored(st.autocast):
            outs = _as_tuple(st.fn(*inputs[:n]), "fn (in the backward's second forward)")
        if len(outs) != len(grads):
            raise RuntimeError(f"recompute: fn returned {len(grads)} tensors in the forward and {len(outs)} when run "
                               f"again in the backward; it must compute the same thing both times")
        got = dict(zip(map(id, back), backward_from(outs, grads, back, expect=expect)))
        # a tensor given twice (recompute(fn, x, x)) has one gradient, the sum over its uses: returned once
        return tuple(got.pop(id(t), None) for t in inputs)


class RecomputePickF(Function):
    """Output ``slot`` of a :class:`RecomputeF` node; its backward hands the gradient to the node's state."""

    @staticmethod
    def forward(ctx, anchor, state, slot):
        ctx.state, ctx.slot = state, slot
        out = state.outs[slot]
        if slot:
            state.outs[slot] = None  # the pick owns it now (the anchor keeps slot 0's array)
        return out

    @staticmethod
    def backward(ctx, g):
        st = ctx.state
        st.grads[ctx.slot] = g
        if st.token_sent:
            return None, None, None
        st.token_sent = True
        return ctx.inputs[0].data, None, None  # the token: RecomputeF's backward ignores its value


def _amp_state():
    """This thread's autocast state (amp.py keeps it per thread): the dtype, and whatever else ``autocast`` sets
    (an FP8 recipe), all of it, so the second forward runs under exactly the first one's."""
    return dict(vars(amp._state))


@contextlib.contextmanager
def _amp_restored(state):
    local = vars(amp._state)
    prev = dict(local)
    local.clear()
    local.update(state)
    try:
        yield
    finally:
        local.clear()
        local.update(prev)


def _as_tuple(out, what):
    outs = out if isinstance(out, tuple) else (out,)
    if not outs or not all(isinstance(t, Tensor) for t in outs):
        got = ", ".join(type(t).__name__ for t in outs) or "nothing"
        raise TypeError(f"recompute: {what} must return a Tensor or a tuple of Tensors; got {got}")
    return outs


def recompute(fn, *inputs):
    """``fn(*inputs)`` with its activations recomputed in the backward instead of kept (gradient checkpointing).

    The forward runs ``fn`` without recording and keeps only ``inputs`` (and what ``fn`` closes over); the
    backward runs ``fn(*inputs)`` again, recording, under the forward's autocast dtype, and back-propagates
    through it: gradients equal those of ``fn(*inputs)`` recorded directly (the same Functions run on the same
    values; summation orders inside ``fn`` are those of a plain backward), for one more forward of ``fn``.
    Parameters ``fn`` reads get their gradients accumulated in place into ``.grad`` and their gradient-ready
    hooks fire once, after this node's backward. Without a gradient to record (``no_grad``) it is ``fn(*inputs)``.

    Args:
        fn: a function of Tensors returning a Tensor or a tuple of Tensors; it must compute the same values when
            called again (state it reads besides its inputs -- dropout's forward-pass offset -- is the caller's to
            restore around it; autocast is restored here), and must not depend on ``is_grad_enabled()``.
        *inputs: the Tensors (or arrays, or other values) passed to ``fn``.

    Returns:
        What ``fn`` returned: a Tensor, or a tuple of Tensors.

    Example::

        >>> y = ck.functional.recompute(lambda t: block(t), x)   # block's activations are not kept
        >>> y.sum().backward()                                  # block's forward runs again here
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable of Tensors; got {type(fn).__name__}")
    if not is_grad_enabled():
        return fn(*inputs)
    with collect_grad_inputs() as seen, no_grad():
        out = fn(*inputs)
    outs = _as_tuple(out, "fn")
    explicit = {id(t) for t in inputs if isinstance(t, Tensor)}
    extra = [t for k, t in seen.items() if k not in explicit]
    if not extra and not any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
        return out  # nothing to differentiate: computed under no_grad already, nothing kept
    state = _State(fn, len(inputs), _amp_state(), [t.data for t in outs])
    anchor = RecomputeF.apply(*inputs, *extra, state=state)
    picked = tuple(RecomputePickF.apply(anchor, state, i) for i in range(len(outs)))
    return picked if isinstance(out, tuple) else picked[0]


__all__ = ["RecomputeF", "RecomputePickF", "recompute"]
