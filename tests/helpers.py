"""Shared test helpers: tolerances per dtype, poisoned outputs, misaligned device views."""
import numpy as np

import cukernels as ck

# (rtol, atol) for kernel vs NumPy reference. Both compute in fp32 and round once to the output dtype, so
# fp32 differs only by summation order and bf16 by at most one rounding step (2^-8 relative).
TOL = {np.dtype(np.float32): (2e-5, 2e-5), np.dtype(ck.bfloat16): (1.6e-2, 1.6e-2)}
DTYPES = [np.float32, ck.bfloat16]


def cp():
    import cupy

    return cupy


def to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def assert_close(got, ref, dtype=None, rtol=None, atol=None, what=""):
    got, ref = to_host(got), to_host(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    d = np.dtype(dtype if dtype is not None else ref.dtype)
    r, a = TOL.get(d, (1e-6, 1e-6))
    rtol = r if rtol is None else rtol
    atol = a if atol is None else atol
    g, e = got.astype(np.float64), ref.astype(np.float64)
    assert not np.isnan(g).any() or np.array_equal(np.isnan(g), np.isnan(e)), f"{what}: NaN in output (unwritten?)"
    np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=what)


def randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def device_copy(a, misalign=False):
    """Copy a host array to the GPU; with misalign=True the result is a C-contiguous view whose data pointer is
    one element past a 256-byte-aligned allocation (so no 16-byte vector path can be taken)."""
    c = cp()
    a = np.asarray(a, order="C")  # (ascontiguousarray would turn a 0-d array into shape (1,))
    if not misalign:
        return c.asarray(a)
    buf = c.empty(a.size + 1, dtype=a.dtype)
    v = buf[1:].reshape(a.shape)
    v.set(a)
    return v


def poisoned(shape, dtype, misalign=False):
    """A device output buffer filled with NaN (or -1 for signed ints, the largest value for unsigned ones: FP8 bits in
    uint8 then read as NaN) so an unwritten element fails the check."""
    c = cp()
    d = np.dtype(dtype)
    n = int(np.prod(shape))
    buf = c.empty(n + (1 if misalign else 0), dtype=d)
    buf.fill(np.nan if d.kind == "f" or d == np.dtype(ck.bfloat16) else np.iinfo(d).max if d.kind == "u" else -1)
    return (buf[1:] if misalign else buf).reshape(shape)
