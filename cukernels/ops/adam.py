"""Optimizer ops: ``ck.adam_step``, ``ck.adam_step_rows``, ``ck.global_norm``, ``ck.clip_scale``,
``ck.zero_rows``, ``ck.adam_error``. Kernels: ``kernels_cu/adam.cu``.

Every op here is graph-capturable: values that change from step to step (learning rate, step count, gradient
scale, the count of touched rows) may be 0-d device arrays that the kernels read, so a captured training step
stays valid as they change. Nothing reads back to the host.

Hyperparameters get ``torch.optim.AdamW``'s ranges: lr >= 0, weight_decay >= 0, betas in [0, 1), eps > 0, all
finite, step an integer >= 1 (grad_scale finite and >= 0). Numbers and 0-d NumPy arrays are checked at the call
(TypeError / ValueError naming the argument). 0-d device arrays are checked by the kernels themselves: an
invalid value leaves params, moments and shadow untouched and sets a bit of the device error word, read (and
cleared) by :func:`adam_error` whenever a host sync is acceptable.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .. import _backend as B
from .._loader import get_function
from . import _launch as L
from . import fp8 as _fp8

FAMILY = "adam"
THREADS = 256
_STEP_KIND = {np.dtype(np.int32): 1, np.dtype(np.int64): 2, np.dtype(np.float32): 3}
_INT32 = np.dtype(np.int32)


# ---------------------------------------------------------------------------------------------- validation
def _ptr_range(a):
    if isinstance(a, np.ndarray):
        p = a.__array_interface__["data"][0]
    else:
        p = a.data.ptr
    return p, p + a.nbytes


def _check_disjoint(**arrays):
    """The kernels take every buffer as __restrict__: two of them overlapping would be a silent wrong answer."""
    items = [(k, _ptr_range(a)) for k, a in arrays.items() if a is not None and a.nbytes]
    for i in range(len(items)):
        for j in range(i + 1, len(items)):
            (n1, (a1, b1)), (n2, (a2, b2)) = items[i], items[j]
            if a1 < b2 and a2 < b1:
                raise ValueError(f"{n2}: overlaps {n1} in memory; the optimizer buffers must be distinct")


def _is_number(v):
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _scalar_array(name, v, dtypes):
    """Validate a 0-d array argument (device scalar on the CuPy path)."""
    B.check_dtype(name, v, dtypes)
    if v.ndim != 0:
        raise ValueError(f"{name}: expected a 0-d array (a device scalar); got shape {tuple(v.shape)}")


def _hyper(beta1, beta2, eps, weight_decay):
    """beta1, beta2 in [0, 1), eps > 0, weight_decay >= 0, all finite numbers (torch.optim.AdamW's ranges)."""
    B.check_real("beta1", beta1, min=0, max=1, max_open=True)
    B.check_real("beta2", beta2, min=0, max=1, max_open=True)
    B.check_real("eps", eps, min=0, min_open=True)
    if np.float32(eps) == 0:  # the kernels add eps as fp32: a value that rounds to 0 would divide 0 by 0
        raise ValueError(f"eps: expected a number > 0 in float32 (at least 1.4e-45); got {eps!r}")
    B.check_f32("weight_decay", weight_decay, min=0)


# Device error word bits (ADAM_ERR_* in adam.cu): what was wrong with a hyperparameter read on the device.
ADAM_ERR_LR, ADAM_ERR_STEP, ADAM_ERR_GRAD_SCALE = 1, 2, 4
ADAM_ERRORS = {ADAM_ERR_LR: "lr was NaN, inf or negative", ADAM_ERR_STEP: "step was not an integer >= 1",
               ADAM_ERR_GRAD_SCALE: "grad_scale was NaN, inf or negative"}
_STEP_TEXT = "the 1-based step number, an integer >= 1 (bias correction divides by 1 - beta**step; at most 2**53)"


def _step_ok(t) -> bool:
    """An integer in [1, 2^53] (the kernels take the step as a double; the device check uses the same bounds)."""
    try:
        t = float(t)
    except OverflowError:  # an int beyond the double range
        return False
    return 1 <= t <= 2.0**53 and t == math.floor(t)


def _check_lr_number(lr):
    B.check_f32("lr", lr, min=0)


def _check_step_number(step):
    """A positive integer: Python / NumPy integers, or a float holding one (2.0); not 1.5, inf, 0, -3, a bool."""
    if not _is_number(step):
        raise TypeError(f"step: expected {_STEP_TEXT}; got {B._got(step)}")
    if not _step_ok(step):
        raise ValueError(f"step: expected {_STEP_TEXT}; got {B._short(step)}")


def _check_grad_scale_number(gs):
    B.check_f32("grad_scale", gs, min=0)


def _lr_step_scale(lr, step, grad_scale):
    """Validate lr / step / grad_scale (numbers or 0-d arrays); returns the arrays among them by name."""
    arrays = {}
    if _is_number(lr):
        _check_lr_number(lr)
    elif B._kind(lr) is not None:
        _scalar_array("lr", lr, (np.float32,))
        arrays["lr"] = lr
    else:
        raise TypeError(f"lr: expected a number or a 0-d float32 array; got {type(lr).__name__}")
    if _is_number(step):
        _check_step_number(step)
    elif B._kind(step) is not None:
        _scalar_array("step", step, tuple(_STEP_KIND))
        arrays["step"] = step
    else:
        raise TypeError(f"step: expected {_STEP_TEXT} or a 0-d int32/int64/float32 array; got {type(step).__name__}")
    if grad_scale is not None:
        if _is_number(grad_scale):
            _check_grad_scale_number(grad_scale)
        elif B._kind(grad_scale) is not None:
            _scalar_array("grad_scale", grad_scale, (np.float32,))
            arrays["grad_scale"] = grad_scale
        else:
            raise TypeError(f"grad_scale: expected a 0-d float32 array or a number; got {type(grad_scale).__name__}")
    return arrays


def _check_host_arrays(arrays):
    """NumPy path: the values of 0-d NumPy hyperparameter arrays, checked now (the kernels check device ones)."""
    for name, a in arrays.items():
        v = float(a)
        ok = _step_ok(v) if name == "step" else (math.isfinite(v) and v >= 0)
        if not ok:
            want = _STEP_TEXT if name == "step" else "a finite number >= 0"
            raise ValueError(f"{name}: the 0-d array holds {a.item()!r}; expected {want}")


def _error_word(xp, error):
    """The device error word the kernels report bad device hyperparameters to (None on the NumPy path)."""
    if error is None:
        return None if xp is np else adam_error_word()
    _scalar_array("error", error, (np.int32,))
    B.check_writable("error", error)
    return error


def adam_error_word():
    """The module's device error word (0-d int32 CuPy array) for the current device: :func:`adam_step` and
    :func:`adam_step_rows` OR bits into it (``ADAM_ERRORS``) when a hyperparameter read on the device was
    invalid and the update was skipped, unless they were given an ``error=`` word of their own."""
    return B.error_word("adam")


def adam_error(*, clear=True) -> int:
    """The Adam error code of the current device, read (4 bytes, after the work queued on the current stream)
    and cleared: 0 when every :func:`adam_step` / :func:`adam_step_rows` since the last read found its device
    hyperparameters valid; else a bit per problem, ``ADAM_ERR_LR`` (1: lr NaN, inf or negative),
    ``ADAM_ERR_STEP`` (2: step not an integer >= 1), ``ADAM_ERR_GRAD_SCALE`` (4: grad_scale NaN, inf or
    negative); those updates left params, moments and shadow untouched. :func:`adam_error_message` spells a
    code out. Nothing else is synchronised; returns 0 without a GPU (the NumPy path raises at the call instead).

    Example::

        >>> opt_step()                      # a captured step: lr / step / grad_scale live on the device
        >>> if (code := ck.adam_error()):
        ...     raise FloatingPointError(ck.ops.adam.adam_error_message(code))
    """
    if not B.gpu_available():
        return 0
    w = adam_error_word()
    code = int(w)
    if code and clear:
        B.zero_(w)
    return code


def adam_error_message(code: int) -> str:
    """A sentence for an :func:`adam_error` code: which hyperparameters were invalid (the update was skipped)."""
    parts = [text for bit, text in ADAM_ERRORS.items() if code & bit]
    if not parts:
        return "no Adam error"
    return "AdamW update skipped (params and moments unchanged): " + "; ".join(parts)


def _check_buffers(param, grad, exp_avg, exp_avg_sq, shadow, same):
    """dtype, contiguity and size/shape agreement; ``same(name, a)`` checks the size or shape against param."""
    B.check_dtype("param", param, (np.float32,))
    B.check_dtype("grad", grad, B.FLOATS)
    B.check_dtype("exp_avg", exp_avg, (np.float32,))
    B.check_dtype("exp_avg_sq", exp_avg_sq, (np.float32,))
    if shadow is not None:
        B.check_dtype("shadow", shadow, (B.bfloat16,))
    for name, a in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                    ("shadow", shadow)):
        if a is None:
            continue
        B.check_contiguous(name, a)
        if name != "grad":
            B.check_writable(name, a)
        if name != "param":
            same(name, a)
    _check_disjoint(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, shadow=shadow)


# ---------------------------------------------------------------------------------------------- reference
def _f32(v):
    return float(np.float32(v))


def _host(v):
    """A number or a 0-d NumPy array as a Python float."""
    return float(v) if v is not None else None


def _adam_math(p, g, m, v, *, lr, step, beta1, beta2, eps, weight_decay, grad_scale):
    """float64 AdamW on flat copies; lr, eps and weight_decay taken as the fp32 values the kernel sees."""
    lr, eps, wd = _f32(lr), _f32(eps), _f32(weight_decay)
    t = float(step)
    g = g.astype(np.float64)
    if grad_scale is not None:
        g = g * _f32(grad_scale)
    m = beta1 * m.astype(np.float64) + (1.0 - beta1) * g
    v = beta2 * v.astype(np.float64) + (1.0 - beta2) * g * g
    bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
    p = p.astype(np.float64) * (1.0 - lr * wd) - (lr / bc1) * m / (np.sqrt(v) / np.sqrt(bc2) + eps)
    return p.astype(np.float32), m.astype(np.float32), v.astype(np.float32)


def _kernel_scalars(lr, step, grad_scale, beta1, beta2, eps, weight_decay, err):
    """The trailing ADAM_ARGS of every adam kernel: (pointer, value) pairs, the pointer wins when not null, and
    the error word."""
    lr_dev, st_dev = not _is_number(lr), not _is_number(step)
    gs_dev = grad_scale is not None and not _is_number(grad_scale)
    return (
        lr if lr_dev else B.NULL,
        np.float32(0.0 if lr_dev else lr),
        step if st_dev else B.NULL,
        np.int32(_STEP_KIND[step.dtype] if st_dev else 0),
        np.float64(0.0 if st_dev else step),
        grad_scale if gs_dev else B.NULL,
        np.float32(1.0 if grad_scale is None or gs_dev else grad_scale),
        np.float64(beta1),
        np.float64(beta2),
        np.float32(eps),
        np.float32(weight_decay),
        err,
    )


def _kernel(name):
    """(kernel, blocks in one wave of THREADS-thread blocks on this device)."""
    k = get_function(FAMILY, name)
    return k, L.wave(k, THREADS)


def _grid(wave, work_items):
    """Grid of ``wave`` blocks (a persistent wave, or a multiple of one), fewer when there is less work."""
    return min(max(1, -(-work_items // THREADS)), wave)


# ---------------------------------------------------------------------------------------------- FP8 shadows
class Fp8Shadow:
    """FP8 (E4M3) copies of matrices inside a flat float32 parameter buffer, each with its own per-tensor scale,
    written by :func:`adam_step` in its pass (``adam_step(..., fp8_shadow=)``) where the bf16 shadow would be: the
    FP8 linear layers then read the weight as the GEMM takes it, with no cast of their own (``autocast(ck.float8)``
    with ``ck.optim.AdamW(fp8_shadows=True)``).

    The scale of range k after an update is the one its previous amax gives (``fp8_quantize``'s delayed rule,
    history of one): ``s_k = 448 * 2**-margin / max|p_k|`` of the values before the update, written into
    ``scale_inv[k]`` as ``1 / s_k``; the update records the new max in ``history[k]`` in the same pass. A weight
    moves by about lr a step, so the scale is the current one to ~0.1 %; a value beyond the old max saturates at 448.
    :meth:`refresh` rescales from the present values (current scaling): call it after writing the parameters
    other than through :func:`adam_step` (a loaded checkpoint).

    Args:
        param: the 1-D float32 buffer :func:`adam_step` will update; the copies are made from its values now.
        ranges: ``[(offset, (rows, cols)), ...]``: row-major matrices in ``param`` at element offsets that are
            multiples of 16, sorted and disjoint, ``rows * cols`` a multiple of 16.
        margin: an integer in [0, 64]: the scale is divided by ``2**margin``.
        transpose: also keep ``qt[k] = q[k].T`` (the input-gradient GEMM's operand), rewritten after each update.

    Attributes (one entry per range): ``q`` ([rows, cols] uint8 E4M3 bits), ``qt`` ([cols, rows] or None),
    ``scale_inv`` (0-d float32), ``history`` (uint32[4], :func:`cukernels.fp8_history`'s layout).

    Example::

        >>> P = cp.zeros(2 * 4096, cp.float32); ...          # two 64 x 64 weights back to back
        >>> fs = ck.Fp8Shadow(P, [(0, (64, 64)), (4096, (64, 64))])
        >>> ck.adam_step(P, G, M, V, lr=1e-3, step=1, fp8_shadow=fs)
        >>> y = ck.matmul(xq, fs.q[0], trans_b=True, a_scale=sx, b_scale=fs.scale_inv[0], ...)
    """

    def __init__(self, param, ranges, *, margin=0, transpose=True, _reuse=None):
        xp = B.array_module(param=param)
        B.check_dtype("param", param, (np.float32,))
        B.check_contiguous("param", param)
        if param.ndim != 1:
            raise ValueError(f"param: expected the 1-D flat buffer adam_step updates; got shape {tuple(param.shape)}")
        self.margin = _fp8._check_margin(margin)
        self.transpose = B.check_bool("transpose", transpose)
        if not isinstance(ranges, (list, tuple)):
            raise TypeError(f"ranges: expected a list of (offset, (rows, cols)); got {type(ranges).__name__}")
        self.xp, self.param = xp, param
        self.offsets, self.shapes = [], []
        end = 0
        for i, r in enumerate(ranges):
            try:
                off, (rows, cols) = r
            except (TypeError, ValueError):
                raise TypeError(f"ranges[{i}]: expected (offset, (rows, cols)); got {r!r}") from None
            off = B.check_int(f"ranges[{i}] offset", off, min=0)
            rows = B.check_int(f"ranges[{i}] rows", rows, min=1)
            cols = B.check_int(f"ranges[{i}] cols", cols, min=1)
            if off % 16 or (rows * cols) % 16:
                raise ValueError(f"ranges[{i}]: the offset ({off}) and the size ({rows} x {cols}) must be multiples "
                                 "of 16 elements")
            if off < end:
                raise ValueError(f"ranges[{i}]: offset {off} overlaps or precedes the range before it (ends at "
                                 f"{end}); give the ranges sorted and disjoint")
            end = off + rows * cols
            if end > param.size:
                raise ValueError(f"ranges[{i}]: elements [{off}, {end}) run past param ({param.size} elements)")
            self.offsets.append(off)
            self.shapes.append((rows, cols))
        old = {}
        if _reuse is not None:
            old = {(o, s): k for k, (o, s) in enumerate(zip(_reuse.offsets, _reuse.shapes))}
        self.q, self.qt, self.scale_inv, self.history = [], [], [], []
        fresh = []
        for off, shp in zip(self.offsets, self.shapes):
            k = old.get((off, shp))
            if k is not None:  # the same range of the same buffer: keep its arrays (views handed out stay valid)
                for mine, theirs in ((self.q, _reuse.q), (self.qt, _reuse.qt), (self.scale_inv, _reuse.scale_inv),
                                     (self.history, _reuse.history)):
                    mine.append(theirs[k])
                continue
            fresh.append(len(self.q))
            self.q.append(xp.zeros(shp, np.uint8))
            self.qt.append(xp.zeros(shp[::-1], np.uint8) if self.transpose else None)
            self.scale_inv.append(xp.ones((), np.float32))
            self.history.append(xp.zeros((4,), np.uint32))
        if xp is not np:  # the kernel's tables: [lo, hi] and (q, history, scale_inv) pointers per range
            self._lohi = xp.asarray(np.array([(o, o + r * c) for o, (r, c) in zip(self.offsets, self.shapes)],
                                             np.int64).reshape(-1, 2))
            ptrs = [(q.data.ptr, h.data.ptr, s.data.ptr) for q, h, s in zip(self.q, self.history, self.scale_inv)]
            self._ptrs = xp.asarray(np.array(ptrs, np.uint64).reshape(-1, 3))
            self._ticket = xp.zeros((1,), np.uint32)
        for k in fresh:
            self._refresh(k)

    def __len__(self):
        return len(self.offsets)

    def with_range(self, offset, shape):
        """A new :class:`Fp8Shadow` of the same buffer with one more range; the existing ranges keep their arrays
        (and values), the new one is made from the parameter's present values."""
        ranges = sorted(list(zip(self.offsets, self.shapes)) + [(offset, tuple(shape))])
        return Fp8Shadow(self.param, ranges, margin=self.margin, transpose=self.transpose, _reuse=self)

    def _view(self, k):
        o, (r, c) = self.offsets[k], self.shapes[k]
        return self.param[o:o + r * c].reshape(r, c)

    def _refresh(self, k):
        x = self._view(k)
        h = self.history[k]
        h[...] = _fp8.fp8_history(x)
        _fp8.fp8_quantize(x, margin=self.margin, history=h, out=self.q[k], scale_inv=self.scale_inv[k])
        if self.transpose:
            _fp8.fp8_transpose(self.q[k], out=self.qt[k])

    def refresh(self):
        """Recompute every copy from the parameter's present values (current scaling: each range's scale from
        its own amax), e.g. after loading a checkpoint into the buffer."""
        for k in range(len(self)):
            self._refresh(k)

    def _transposes(self):
        if self.transpose:
            for q, qt in zip(self.q, self.qt):
                _fp8.fp8_transpose(q, out=qt)

    def _ref_update(self, p, shadow):
        """The NumPy reference of the kernel's FP8 part, on the updated flat ``p``: the codes, scale_inv and the
        history of every range, and the bf16 shadow outside the ranges."""
        if shadow is not None:
            keep = np.zeros(p.size, bool)
            for o, (r, c) in zip(self.offsets, self.shapes):
                keep[o:o + r * c] = True
            flat = shadow.reshape(-1)
            flat[~keep] = p[~keep].astype(B.bfloat16)
        for k, (o, (r, c)) in enumerate(zip(self.offsets, self.shapes)):  # fp8_quantize's delayed rule, as the kernel
            _fp8.fp8_quantize(p[o:o + r * c].reshape(r, c), margin=self.margin, history=self.history[k],
                              out=self.q[k], scale_inv=self.scale_inv[k])
        self._transposes()


_FP8_CHUNK = 8192  # elements a block takes at a time in adam_fp8_* (ADAM_CHUNK in adam.cu)


def _check_fp8_shadow(fs, param, xp):
    if not isinstance(fs, Fp8Shadow):
        raise TypeError(f"fp8_shadow: expected a ck.Fp8Shadow (made on param) or None; got {type(fs).__name__}")
    if fs.xp is not xp or _ptr_range(fs.param) != _ptr_range(param):
        raise ValueError("fp8_shadow: made on another buffer; build it with ck.Fp8Shadow(param, ranges) on the param "
                         "this step updates")


# ---------------------------------------------------------------------------------------------- adam_step
@B.interop
def adam_step(param, grad, exp_avg, exp_avg_sq, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0, shadow=None, grad_scale=None, error=None, occupancy=1.0, fp8_shadow=None):
    """One fused AdamW update, in place (decoupled weight decay, PyTorch's ``AdamW`` formula).

    With ``g = grad_scale * grad`` and ``t = step``::

        exp_avg    = beta1 * exp_avg + (1 - beta1) * g
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
        param      = param * (1 - lr * weight_decay)
                     - lr / (1 - beta1**t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**t) + eps)
        shadow     = bfloat16(param)                      (when shadow is given, in the same pass)

    The arrays are treated as flat: any shape, equal sizes, C-contiguous, not overlapping. The kernel uses
    16-byte accesses on every stream when all pointers are 16-byte aligned (8 elements per thread and
    iteration), element accesses otherwise; any length and alignment is correct. Arithmetic is fp32 with the
    bias corrections in double; lr, eps and weight_decay are used as fp32 values.

    Args:
        param, exp_avg, exp_avg_sq: float32, updated in place.
        grad: float32 or bfloat16, same size.
        lr: >= 0, a number or a 0-d float32 array (read on the device: a captured graph sees its current value).
        step: the 1-based step number, an integer >= 1: a number or a 0-d int32 / int64 / float32 array.
        beta1, beta2: numbers in [0, 1). eps: a number > 0. weight_decay: a number >= 0. All finite.
        shadow: optional bfloat16 array of the same size; receives the updated param rounded to bf16.
        grad_scale: optional 0-d float32 array (>= 0) multiplying the gradient first (clipping scale, inverse
            loss scale); a plain number is accepted for eager use.
        error: optional 0-d int32 device array for the kernel's error bits (default: :func:`adam_error_word`).
        fp8_shadow: optional :class:`Fp8Shadow` of ``param`` (made on this buffer): inside its ranges the
            updated values are written as E4M3 codes with their delayed scales (instead of to ``shadow``, whose
            elements there are left as they were), then the transposed copies. One launch for every range.
        occupancy: how many full waves of blocks the grid holds, a number in (0, 64] (default 1: one persistent
            wave, each block looping over its share). Below 1 every SM keeps room for another kernel's blocks
            while this one runs; above 1 the blocks are shorter-lived and the block scheduler hands each SM a new
            one as the last ends, so a kernel running beside it (an NCCL collective holding some SMs) delays only
            the blocks it displaces, not a fixed share of the work (a one-wave grid waits for its displaced
            blocks' whole share: the update then lasts as long as both kernels back to back). The result does
            not depend on it.

    Numbers and 0-d NumPy arrays out of range raise here (TypeError / ValueError naming the argument). 0-d
    device arrays are checked by the kernel: if lr or grad_scale is NaN, inf or negative, or step is not an
    integer >= 1, nothing is written (params, moments and shadow stay bit-identical) and the error word gets a
    bit per problem (:func:`adam_error`), with no host sync. So a NaN clipping scale (from a NaN gradient norm)
    skips the step instead of turning every parameter into NaN.

    Returns:
        None (everything is updated in place).

    Example::

        >>> p = cp.random.standard_normal(10**6, dtype=cp.float32); g = cp.ones_like(p)
        >>> m, v = cp.zeros_like(p), cp.zeros_like(p)
        >>> ck.adam_step(p, g, m, v, lr=3e-4, step=1, weight_decay=0.1)
    """
    scal = _lr_step_scale(lr, step, grad_scale)
    xp = B.array_module(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, shadow=shadow, **scal,
                        error=error)
    _hyper(beta1, beta2, eps, weight_decay)
    occupancy = B.check_f32("occupancy", occupancy, min=0, min_open=True, max=64)
    if xp is np:
        _check_host_arrays(scal)
    err = _error_word(xp, error)

    def same_size(name, a):
        if a.size != param.size:
            raise ValueError(f"{name}: expected {param.size} elements (the size of param); got {a.size} "
                             f"(shape {tuple(a.shape)})")

    _check_buffers(param, grad, exp_avg, exp_avg_sq, shadow, same_size)
    if fp8_shadow is not None:
        _check_fp8_shadow(fp8_shadow, param, xp)
    n = param.size
    if n == 0:
        return None
    if xp is np:
        p, m, v = _adam_math(param.reshape(-1), grad.reshape(-1), exp_avg.reshape(-1), exp_avg_sq.reshape(-1),
                             lr=_host(lr), step=_host(step), beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=weight_decay, grad_scale=_host(grad_scale))
        param[...] = p.reshape(param.shape)
        exp_avg[...] = m.reshape(param.shape)
        exp_avg_sq[...] = v.reshape(param.shape)
        if fp8_shadow is not None:
            fp8_shadow._ref_update(p, shadow)
        elif shadow is not None:
            shadow[...] = p.astype(B.bfloat16).reshape(shadow.shape)
        return None

    args = _kernel_scalars(lr, step, grad_scale, beta1, beta2, eps, weight_decay, err)
    sh = shadow if shadow is not None else B.NULL
    if fp8_shadow is not None and len(fp8_shadow):
        fs = fp8_shadow
        vec = B.aligned16(param, grad, exp_avg, exp_avg_sq, *([shadow] if shadow is not None else []), *fs.q)
        k, wave = _kernel(f"adam_fp8_{B.DTYPE_TAG[grad.dtype]}_{'v' if vec else 's'}")
        grid = _grid(max(1, int(wave * occupancy)), -(-n // (_FP8_CHUNK // THREADS)))
        k((grid,), (THREADS,), (param, grad, exp_avg, exp_avg_sq, sh, np.int64(n), np.int32(len(fs)), fs._lohi,
                                fs._ptrs, _fp8._fmax_m(B.float8_e4m3fn, fs.margin), fs._ticket, *args))
        fs._transposes()
        return None
    vec = n >= 8 and B.aligned16(*(a for a in (param, grad, exp_avg, exp_avg_sq, shadow) if a is not None))
    k, wave = _kernel(f"adam_{B.DTYPE_TAG[grad.dtype]}_{'v' if vec else 's'}")
    tail = (n % 8) if vec else n
    grid = _grid(max(1, int(wave * occupancy)), max(n // 8 if vec else 0, tail))
    k((grid,), (THREADS,), (param, grad, exp_avg, exp_avg_sq, sh, np.int64(n), *args))
    return None


# ---------------------------------------------------------------------------------------------- sparse rows
def _check_rows(rows, row_count):
    B.check_dtype("rows", rows, (np.int32,))
    if rows.ndim != 1:
        raise ValueError(f"rows: expected a 1-D int32 array (row indices); got shape {tuple(rows.shape)}")
    B.check_contiguous("rows", rows)
    _scalar_array("row_count", row_count, (np.int32,))
    if rows.size >= 2**31:
        raise ValueError(f"rows: at most 2**31 - 1 entries; got {rows.size}")


def _host_rows(rows, row_count, V):
    """NumPy path: the valid listed rows (first min(row_count, capacity), those in [0, V))."""
    count = min(max(int(row_count), 0), rows.size)
    idx = rows[:count].astype(np.int64)
    return idx[(idx >= 0) & (idx < V)]


def _host_rows_strict(rows, row_count, V):
    """NumPy path of :func:`adam_step_rows`: the listed rows, refused (ValueError naming the argument) when the
    count is outside ``[0, capacity]``, a listed row is outside ``[0, V)`` or a row is listed twice. The kernel
    cannot report these without a host sync: it clamps the count into ``[0, capacity]`` and skips rows outside
    ``[0, V)`` (it never writes outside the buffers), and a row listed twice is updated by two threads at once
    (undefined). :class:`cukernels.SparseRowGrad` lists each row once, within range, so it never meets them."""
    count = int(row_count)
    if not 0 <= count <= rows.size:
        raise ValueError(f"row_count: expected a count in [0, {rows.size}] (the capacity of rows); got {count}")
    idx = rows[:count].astype(np.int64)
    if idx.size:
        bad = (idx < 0) | (idx >= V)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"rows: rows[{i}] = {int(idx[i])} is outside [0, {V}) (param has {V} rows)")
        u, c = np.unique(idx, return_counts=True)
        if (c > 1).any():
            raise ValueError(f"rows: row {int(u[np.argmax(c > 1)])} is listed {int(c.max())} times in rows[:row_count];"
                             " each row must be listed once (an update applied twice)")
    return idx


def _rows_plan(units):
    """Block (TX, RY) for rows of ``units`` accesses: TX threads across a row (the power of two >= units, at
    most THREADS), RY = THREADS / TX rows per block."""
    tx = 1
    while tx < THREADS and tx < units:
        tx *= 2
    return tx, THREADS // tx


def _rows_grid(wave, capacity, ry):
    # Fixed from the capacity (host-known); blocks past the device-side count exit at once.
    return min(max(1, -(-capacity // ry)), wave)


@B.interop
def adam_step_rows(param, grad, exp_avg, exp_avg_sq, rows, row_count, *, lr, step, beta1=0.9, beta2=0.999,
                   eps=1e-8, weight_decay=0.0, shadow=None, grad_scale=None, error=None):
    """Sparse ("lazy") AdamW: the :func:`adam_step` update applied only to listed rows of a 2-D parameter.

    For ``r`` in ``rows[:row_count]`` the row ``param[r, :]`` (with ``grad[r]``, ``exp_avg[r]``,
    ``exp_avg_sq[r]`` and ``shadow[r]``) gets exactly the dense update. Every other row keeps param, moments
    and shadow bit-identical. This differs from dense Adam on the same (mostly zero) gradient: there the
    untouched rows' moments decay (``m *= beta1``, ``v *= beta2``), they keep moving on their old momentum,
    and they get weight decay; here they are frozen until a step touches them again. It is the usual
    trade-off for large embedding tables (TensorFlow's LazyAdam, PyTorch's SparseAdam).

    ``rows`` and ``row_count`` live on the device (written by the embedding backward): the kernel reads the
    count itself, on a fixed grid sized from ``rows.size`` (the capacity), so there is no host sync. Entries
    past the count are ignored. The count must lie in ``[0, capacity]`` and the listed rows in ``[0, V)``, each
    listed once: the NumPy path raises ValueError otherwise; the kernel, which cannot check without a host sync,
    clamps the count into ``[0, capacity]``, skips rows outside ``[0, V)`` (nothing outside the buffers is ever
    written) and updates a duplicated row twice concurrently (undefined values in that row).

    Args:
        param, exp_avg, exp_avg_sq: ``(V, D)`` float32, updated in place (touched rows only).
        grad: ``(V, D)`` float32 or bfloat16 (only the listed rows are read).
        rows: 1-D int32, capacity >= count.
        row_count: 0-d int32 array, the number of valid entries of ``rows``.
        lr, step, beta1, beta2, eps, weight_decay, shadow, grad_scale, error: as :func:`adam_step` (the same
            checks; device values are checked by the kernel, which then writes no row); shadow ``(V, D)``
            bfloat16.

    Returns:
        None.

    Example::

        >>> ck.adam_step_rows(emb, emb_grad, m, v, rows, count, lr=lr_dev, step=step_dev)
    """
    scal = _lr_step_scale(lr, step, grad_scale)
    xp = B.array_module(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, shadow=shadow, rows=rows,
                        row_count=row_count, **scal, error=error)
    _hyper(beta1, beta2, eps, weight_decay)
    if xp is np:
        _check_host_arrays(scal)
    err = _error_word(xp, error)
    if B.check_array("param", param).ndim != 2:
        raise ValueError(f"param: expected a 2-D (V, D) array; got shape {tuple(param.shape)}")

    def same_shape(name, a):
        B.check_shape(name, a, param.shape, " (the shape of param)")

    _check_buffers(param, grad, exp_avg, exp_avg_sq, shadow, same_shape)
    _check_rows(rows, row_count)
    V, D = param.shape
    if xp is np:
        idx = _host_rows_strict(rows, row_count, V)
        if idx.size == 0 or D == 0:
            return None
        p, m, v = _adam_math(param[idx], grad[idx], exp_avg[idx], exp_avg_sq[idx], lr=_host(lr),
                             step=_host(step), beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                             grad_scale=_host(grad_scale))
        param[idx], exp_avg[idx], exp_avg_sq[idx] = p, m, v
        if shadow is not None:
            shadow[idx] = p.astype(B.bfloat16)
        return None

    if rows.size == 0 or V == 0 or D == 0:
        return None
    vec = D % 8 == 0 and B.aligned16(*(a for a in (param, grad, exp_avg, exp_avg_sq, shadow) if a is not None))
    k, wave = _kernel(f"adam_rows_{B.DTYPE_TAG[grad.dtype]}_{'v' if vec else 's'}")
    tx, ry = _rows_plan(D // 8 if vec else D)
    grid = _rows_grid(wave, rows.size, ry)
    args = _kernel_scalars(lr, step, grad_scale, beta1, beta2, eps, weight_decay, err)
    k((grid,), (tx, ry, 1),
      (param, grad, exp_avg, exp_avg_sq, shadow if shadow is not None else B.NULL, rows, row_count,
       np.int32(rows.size), np.int64(V), np.int32(D), *args))
    return None


@B.interop
def zero_rows(buf, rows, row_count):
    """Zero the listed rows of a 2-D buffer: ``buf[r, :] = 0`` for ``r`` in ``rows[:row_count]``.

    For sparse gradients (an embedding's): only the rows the last step touched are cleared, instead of the
    whole ``(V, D)`` buffer. Same device-side count, fixed grid and row rules as :func:`adam_step_rows`
    (entries past the count ignored, rows outside ``[0, V)`` skipped). Dense buffers are zeroed with
    ``cudaMemsetAsync`` (``cukernels._backend.zero_``), not a kernel.

    Args:
        buf: ``(V, D)`` float32 or bfloat16, C-contiguous, zeroed in place (listed rows only).
        rows: 1-D int32; row_count: 0-d int32 array.

    Returns:
        ``buf``.

    Example::

        >>> ck.zero_rows(emb_grad, rows, count)
    """
    xp = B.array_module(buf=buf, rows=rows, row_count=row_count)
    B.check_dtype("buf", buf, B.FLOATS)
    if buf.ndim != 2:
        raise ValueError(f"buf: expected a 2-D (V, D) array; got shape {tuple(buf.shape)}")
    B.check_contiguous("buf", buf)
    B.check_writable("buf", buf)
    _check_rows(rows, row_count)
    V, D = buf.shape
    if xp is np:
        idx = _host_rows(rows, row_count, V)
        buf[idx] = 0
        return buf
    if rows.size == 0 or V == 0 or D == 0:
        return buf
    per = 16 // buf.itemsize
    vec = D % per == 0 and B.aligned16(buf)
    k, wave = _kernel(f"zero_rows_{B.DTYPE_TAG[buf.dtype]}_{'v' if vec else 's'}")
    tx, ry = _rows_plan(D // per if vec else D)
    grid = _rows_grid(wave, rows.size, ry)
    k((grid,), (tx, ry, 1), (buf, rows, row_count, np.int32(rows.size), np.int64(V), np.int32(D)))
    return buf


# ---------------------------------------------------------------------------------------------- norms
def _partial_blocks(n, itemsize, vec):
    work = (n // (16 // itemsize) + n % (16 // itemsize)) if vec else n
    # ~4 units per thread at least; at most 4 blocks per SM (one wave, few partials).
    return max(1, min(-(-work // (THREADS * 4)), B.sm_count() * 4))


def _as_list(arrays):
    if isinstance(arrays, (list, tuple)):
        arrs = list(arrays)
        if not arrs:
            raise ValueError("arrays: expected at least one array; got an empty list")
        return arrs
    return [arrays]


def _norm_plan(arrs, rows=None):
    """[(array, vec, blocks, first partial slot, rows entry)] for the non-empty arrays, and the number of
    partials. A rows entry (rows, count) reads only the listed rows: a fixed grid (the count is on the device)."""
    plan, total = [], 0
    for i, a in enumerate(arrs):
        if a.size == 0:
            continue
        r = rows[i] if rows is not None else None
        if r is not None:
            E = 16 // a.itemsize
            vec = a.shape[1] % E == 0 and B.aligned16(a)
            nb = max(1, min(a.shape[0], B.sm_count() * 2))
        else:
            vec = a.size >= 16 // a.itemsize and B.aligned16(a)
            nb = _partial_blocks(a.size, a.itemsize, vec)
        plan.append((a, vec, nb, total, r))
        total += nb
    return plan, total


def _check_norm_rows(arrs, rows):
    """``rows`` of global_norm: None, or one entry per array: None or ``(rows, count)`` for a 2-D array."""
    if rows is None:
        return None
    if not isinstance(rows, (list, tuple)) or len(rows) != len(arrs):
        raise ValueError(f"rows: expected a list with one entry per array ({len(arrs)}); got {rows!r:.80}")
    for i, (a, r) in enumerate(zip(arrs, rows)):
        if r is None:
            continue
        if not isinstance(r, (list, tuple)) or len(r) != 2:
            raise ValueError(f"rows[{i}]: expected None or a (rows, count) pair; got {type(r).__name__}")
        if a.ndim != 2:
            raise ValueError(f"rows[{i}]: listed rows need a 2-D (V, D) array; arrays[{i}] has shape {a.shape}")
        B.array_module(**{f"arrays[{i}]": a, f"rows[{i}][0]": r[0], f"rows[{i}][1]": r[1]})
        _check_rows(r[0], r[1])
    return list(rows)


@B.interop
def global_norm_workspace(arrays, rows=None):
    """A float32 buffer big enough for :func:`global_norm`'s per-block partials of ``arrays`` (and ``rows``,
    as passed to it) on their device. Allocate it once and pass it as ``workspace=`` to keep a captured graph
    free of temporaries."""
    arrs = _as_list(arrays)
    xp = B.array_module(**{f"arrays[{i}]": a for i, a in enumerate(arrs)})
    if xp is np:
        return np.empty((1,), dtype=np.float32)
    return xp.empty((max(1, _norm_plan(arrs, _check_norm_rows(arrs, rows))[1]),), dtype=np.float32)


@B.interop
def global_norm(arrays, *, out=None, workspace=None, rows=None):
    """Global L2 norm of one array or of a list of arrays, as a 0-d float32 array (no host sync).

    ``norm = sqrt(sum over arrays of sum(a**2))``, accumulated in fp32 per thread and block, double across
    blocks. Two stages, no atomics, so the result is bit-identical from run to run: one partial kernel per
    (non-empty) array writes its per-block sums into slots of one partials buffer, then one block reduces
    them in a fixed order. A list is never concatenated; pass the optimizer's flat gradient buffers to make
    it two or three launches for a whole model.

    Args:
        arrays: an array, or a list/tuple of arrays (float32 or bfloat16, any shape, C-contiguous).
        out: optional 0-d float32 output.
        workspace: optional 1-D float32 buffer for the partials (from :func:`global_norm_workspace`);
            without it a small pool temporary is used.
        rows: optional list with one entry per array: None, or ``(rows, count)`` (int32 row list, 0-d int32
            count on the device, as ``ck.SparseRowGrad`` keeps them) for a 2-D array that is zero outside the
            listed rows: only ``rows[0:count]`` are read (each row listed once; rows outside [0, V) skipped).

    Returns:
        0-d float32 array (``out`` when given); 0 for an empty total.

    Example::

        >>> norm = ck.global_norm([p.grad for p in params])
        >>> scale = ck.clip_scale(norm, 1.0)
    """
    arrs = _as_list(arrays)
    named = {f"arrays[{i}]": a for i, a in enumerate(arrs)}
    xp = B.array_module(out=out, workspace=workspace, **named)
    for name, a in named.items():
        B.check_dtype(name, a, B.FLOATS)
        B.check_contiguous(name, a)
    if out is not None:
        B.check_out("out", out, (), np.float32)
    rows = _check_norm_rows(arrs, rows)
    res = out if out is not None else xp.empty((), dtype=np.float32)
    if xp is np:
        total = 0.0
        for i, a in enumerate(arrs):
            if rows is not None and rows[i] is not None:
                a = a[_host_rows(rows[i][0], rows[i][1], a.shape[0])]
            total += float(np.sum(np.square(a.astype(np.float64))))
        res[...] = np.float32(np.sqrt(total))
        return res

    plan, total_parts = _norm_plan(arrs, rows)
    if workspace is not None:
        B.check_dtype("workspace", workspace, (np.float32,))
        if workspace.ndim != 1 or workspace.size < total_parts:
            raise ValueError(f"workspace: expected a 1-D float32 buffer of at least {total_parts} elements; got "
                             f"shape {tuple(workspace.shape)} (use global_norm_workspace(arrays))")
        B.check_contiguous("workspace", workspace)
        B.check_writable("workspace", workspace)
        part = workspace
    else:
        part = xp.empty((max(total_parts, 1),), dtype=np.float32)
    for a, vec, nb, off, r in plan:
        tag = f"{B.DTYPE_TAG[a.dtype]}_{'v' if vec else 's'}"
        if r is not None:
            get_function(FAMILY, f"sumsq_rows_partial_{tag}")(
                (nb,), (THREADS,), (a, r[0], r[1], np.int32(r[0].size), np.int32(a.shape[0]), np.int32(a.shape[1]),
                                    part[off:off + nb]))
            continue
        k = get_function(FAMILY, f"sumsq_partial_{tag}")
        k((nb,), (THREADS,), (a, np.int64(a.size), part[off:off + nb]))
    fin = get_function(FAMILY, "sumsq_final")
    fin((1,), (1024,), (part, np.int64(total_parts), res))
    return res


@B.interop
def clip_scale(norm, max_norm, *, out=None):
    """The gradient-clipping factor as a 0-d float32 array: ``min(1, max_norm / (norm + 1e-6))``.

    Computed in fp32 on the device (no host sync), ready to pass as ``grad_scale`` to :func:`adam_step` or
    ``AdamW.step``. A NaN norm gives a NaN scale (as ``torch.nn.utils.clip_grad_norm_``'s clamp), an inf
    norm gives 0.

    Args:
        norm: 0-d float32 array (from :func:`global_norm`).
        max_norm: a number > 0.
        out: optional 0-d float32 output.

    Returns:
        0-d float32 array.

    Example::

        >>> scale = ck.clip_scale(ck.global_norm(grads), 1.0)
    """
    xp = B.array_module(norm=norm, out=out)
    _scalar_array("norm", norm, (np.float32,))
    max_norm = B.check_f32("max_norm", max_norm, min=0, min_open=True)
    if out is not None:
        B.check_out("out", out, (), np.float32)
    res = out if out is not None else xp.empty((), dtype=np.float32)
    if xp is np:
        s = np.float32(max_norm) / (np.float32(norm) + np.float32(1e-6))
        res[...] = np.float32(1.0) if s > 1 else s
        return res
    get_function(FAMILY, "adam_clip_scale")((1,), (32,), (norm, res, np.float32(max_norm)))
    return res


def _check_schedule(schedule):
    """``(max_lr, min_lr, warmup, total)``: learning rates finite and >= 0, 0 <= warmup <= total integers."""
    if not isinstance(schedule, (tuple, list)) or len(schedule) != 4:
        raise TypeError(f"schedule: expected None or a (max_lr, min_lr, warmup, total) tuple; got {schedule!r:.80}")
    mx, mn, w, tot = schedule
    B.check_f32("schedule[0] (max_lr)", mx, min=0)  # checked as the kernel will take it, kept in float64 here
    B.check_f32("schedule[1] (min_lr)", mn, min=0)  # (the host schedule lr_at is float64: WarmupCosine docs)
    mx, mn = float(mx), float(mn)
    w = B.check_int("schedule[2] (warmup)", w, min=0, max=2**62)
    tot = B.check_int("schedule[3] (total)", tot, min=w, max=2**62)
    return mx, mn, w, tot


@B.interop
def tick(step, lr, *, increment=1, schedule=None):
    """Advance the optimizer's device clock: ``step += increment``; with ``schedule = (max_lr, min_lr, warmup,
    total)`` also ``lr = warmup_cosine(step)`` (see ``cukernels.optim.WarmupCosine``). One tiny launch,
    capturable. ``step``: 0-d int32 array; ``lr``: 0-d float32 array (both written in place). NumPy arrays: the
    same in Python. ``increment``: an integer >= 0; the schedule's rates finite and >= 0,
    ``0 <= warmup <= total`` integers."""
    xp = B.array_module(step=step, lr=lr)
    _scalar_array("step", step, (np.int32,))
    _scalar_array("lr", lr, (np.float32,))
    B.check_writable("step", step)
    B.check_writable("lr", lr)
    increment = B.check_int("increment", increment, min=0, max=2**31 - 1)
    if schedule is not None:
        schedule = _check_schedule(schedule)
    if xp is np:
        step[...] = step + np.int32(increment)
        if schedule is not None:
            lr[...] = np.float32(warmup_cosine(int(step), *schedule))
        return
    mx, mn, w, tot = schedule if schedule is not None else (0.0, 0.0, 0, 0)
    get_function(FAMILY, "adam_tick")(
        (1,), (32,), (step, lr, np.int32(increment), np.int32(schedule is not None), np.float64(mx),
                      np.float64(mn), np.int64(w), np.int64(tot)))


def warmup_cosine(t, max_lr, min_lr, warmup, total):
    """Linear warmup to ``max_lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at step ``total``
    (held there after). ``t`` is the 1-based step number (a number >= 0): the same formula as the ``adam_tick``
    kernel. ``max_lr``, ``min_lr``: finite, >= 0; ``0 <= warmup <= total``, integers."""
    t = B.check_real("t", t, min=0)
    max_lr, min_lr, warmup, total = _check_schedule((max_lr, min_lr, warmup, total))
    if warmup > 0 and t <= warmup:
        return max_lr * t / warmup
    span = total - warmup
    q = (t - warmup) / span if span > 0 else 1.0
    q = min(max(q, 0.0), 1.0)
    return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + np.cos(np.pi * q))


__all__ = ["Fp8Shadow", "adam_error", "adam_step", "adam_step_rows", "clip_scale", "global_norm", "zero_rows"]
