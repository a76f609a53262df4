"""Dropout layers with counter-based masks (``ck.dropout``: Philox keyed by a seed, counter by an offset).

A model owns one :class:`DropoutRNG`: a 32-bit base seed and a 0-d uint64 offset in device memory. Each training
forward runs inside ``rng.forward_pass()``, which advances the offset once (one tiny in-place add, captured like
any kernel: a replayed CUDA graph draws fresh masks) and hands the new value to every :class:`Dropout` of the
model; site ``k`` uses the key ``(base << 32) | k``, so sites are independent streams. The backward draws each
mask again from the same (seed, offset): nothing is stored. The offset is part of a checkpoint, so a resumed run
draws the masks an uninterrupted run would have.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import _backend as B
from .. import functional as F
from .module import Module, check_xp

_current = [None]  # the (rng, offset snapshot) of the forward pass being run


class DropoutRNG:
    """The model's dropout randomness: ``seed`` (an int, its low 32 bits used) and ``offset`` (0-d uint64 array on
    the model's module, advanced by one per training forward)."""

    def __init__(self, seed, xp=np):
        self.base = B.check_int("seed", seed, min=0) & 0xFFFFFFFF
        check_xp(xp)
        self.offset = xp.zeros((), dtype=np.uint64)
        self._sites = 0

    def new_site(self):
        self._sites += 1
        return self._sites

    def key(self, site):
        return (self.base << 32) | int(site)

    @contextlib.contextmanager
    def forward_pass(self):
        """Advance the offset once and make its new value the one every Dropout of this forward reads."""
        self.offset += 1  # in place: stays the same device array (graph-safe)
        prev = _current[0]
        _current[0] = (self, self.offset.copy())  # the backward reads this snapshot, whatever happens next
        try:
            yield
        finally:
            _current[0] = prev


def current():
    return _current[0]


class Dropout(Module):
    """``y = x * keep / (1 - p)`` while training (inside the owning model's ``forward_pass``), identity otherwise.
    ``site``: this layer's stream index (``rng.new_site()``)."""

    def __init__(self, p, site):
        self.p = B.check_real("p", p, min=0, max=1, max_open=True)  # (a string was a ValueError, "a" a site)
        self.site = B.check_int("site", site, min=0, max=2**32 - 1)  # the low word of the Philox key

    def active(self):
        return self.training and self.p > 0 and _current[0] is not None

    def forward(self, x):
        if not self.active():
            return x
        rng, off = _current[0]
        return F.dropout(x, self.p, seed=rng.key(self.site), offset=off)

    def add(self, x, residual):
        """``residual + self(x)`` (one kernel while active)."""
        if not self.active():
            return residual + x
        rng, off = _current[0]
        return F.dropout_add(x, residual, self.p, seed=rng.key(self.site), offset=off)

    def extra_repr(self):
        return f"p={self.p}"
