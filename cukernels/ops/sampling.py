"""Token sampling on the device: ``sample_tokens`` (greedy, temperature, top-k, top-p, repetition penalty, a
counter-based uniform from seed / offset). Kernels: ``kernels_cu/sampling.cu``.

The NumPy reference computes the same integers the kernel does (fixed-point masses, Philox4x32-10 bits, the
same thresholds), so both paths pick the same token for the same logits, except where a kept-mass boundary lies
within a few fp32 ulps of the draw or of the top-p cut (``expf`` on the GPU and ``np.exp`` may differ in the
last ulp): see :func:`sample_tokens`.
"""
from __future__ import annotations

import numbers
import threading

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from . import _launch

FAMILY = "sampling"
THREADS = 512
MAX_VOCAB = (1 << 20) - 1  # fixed-point masses (2^44 each) sum below 2^64
MASS_SCALE = np.float32(2.0**44)
U64 = (1 << 64) - 1
SEED_DTYPES = (np.dtype(np.int64), np.dtype(np.uint64), np.dtype(np.int32))
_SEED_KIND = {np.dtype(np.int64): 8, np.dtype(np.uint64): 8, np.dtype(np.int32): 4}
# Greedy across blocks (sample_greedy_* in sampling.cu): a row is cut into slices of about
# ck.settings.greedy_slice_bytes
# (8 KB: S = 63 blocks at fp32 V = 128256, 32 at bf16, 25 at fp32 V = 50257; one 256-thread block reads its 8 KB
# in one round of 2 x 16-byte loads a thread), at most GREEDY_MAX_SPLITS a row. The partials live in a workspace
# of WS_SLOTS (key, index) pairs and WS_ROWS counters: B * S <= WS_SLOTS, so from B = 33 (fp32, V = 128256) the
# split shrinks (B = 64: S = 32, 2048 blocks of 16 KB, bandwidth-bound anyway) and from B = WS_ROWS + 1 a row is
# one block (S = 1: no workspace, the block writes the token). ck.settings.greedy_split = False: the
# one-block-per-row kernel (the A/B switch of benchmarks/cases/sampling.py).
GREEDY_THREADS = 256
GREEDY_MAX_SPLITS = 256
WS_SLOTS = 2048
WS_ROWS = WS_SLOTS // 2
WORKSPACE_INTS = 2 * WS_SLOTS + WS_ROWS  # 5120 int32 = 20 KB
# Documented tolerance of reference vs kernel: a row may pick a different token only when the draw's target
# or the top-p cut lies within this relative distance of a prefix sum of masses (CUDA's expf is within 2 ulp,
# NumPy's float32 exp within ~2.5 ulp: a sum of masses moves by < 5e-7 of itself).
NEAR_TIE = 2e-6


# ------------------------------------------------------------------------------------------ Philox4x32-10
def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC11; Random123's constants) on NumPy: ``counter`` four uint32 words (arrays
    broadcast together), ``key`` two. Returns the four output words as uint32 arrays. The kernel's generator."""
    mask = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & mask for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & mask for k in key)
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    for _ in range(10):
        p0, p1 = m0 * c0, m1 * c2  # 32 x 32 -> 64 bits: exact in uint64
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def draw_bits(rows: int, seed: int, offset: int) -> np.ndarray:
    """The 64-bit uniform integer of each row: words 0 and 1 of Philox4x32-10 with counter
    ``(row, 0, offset low, offset high)`` and key ``(seed low, seed high)``, as uint64."""
    r = np.arange(rows, dtype=np.uint64)
    w = philox4x32_10((r, 0, offset & 0xFFFFFFFF, offset >> 32), (seed & 0xFFFFFFFF, seed >> 32))
    return (w[0].astype(np.uint64) << np.uint64(32)) | w[1].astype(np.uint64)


# ------------------------------------------------------------------------------------------ validation
def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v):
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _scalar_array(name, v, dtypes, what):
    B.check_dtype(name, v, dtypes)
    if v.ndim != 0:
        raise ValueError(f"{name}: expected {what} or a 0-d array (a device scalar); got shape {tuple(v.shape)}")


def _seed_arg(name, v):
    """(array or None, host value): an int in [0, 2**64) or a 0-d int64 / uint64 / int32 array."""
    if _is_int(v):
        if not 0 <= int(v) <= U64:
            raise ValueError(f"{name}: expected an int in [0, 2**64); got {int(v)}")
        return None, int(v)
    if B._kind(v) is not None:
        _scalar_array(name, v, SEED_DTYPES, "an int")
        return v, None
    raise TypeError(f"{name}: expected an int or a 0-d int64 / uint64 / int32 array; got {type(v).__name__}")


def _host_u64(v):
    """A NumPy 0-d seed / offset array's value as the kernel reads it: 64-bit types as their 64 bits, int32
    sign-extended to 64 bits."""
    return int(np.asarray(v).astype(np.int64)) & U64 if v.dtype != np.uint64 else int(v)


def _validate(logits, temperature, top_k, top_p, repetition_penalty, prev_tokens, prev_len):
    B.check_dtype("logits", logits, B.FLOATS)
    if logits.ndim != 2:
        raise ValueError(f"logits: expected 2 dimensions [batch, vocab]; got shape {tuple(logits.shape)}")
    Bsz, V = (int(s) for s in logits.shape)
    if not 1 <= V <= MAX_VOCAB:
        raise ValueError(f"logits: the vocabulary axis must have 1 .. {MAX_VOCAB} entries; got {V}")
    if logits.size and V > 1 and logits.strides[1] != logits.itemsize:
        raise ValueError(f"logits: the last (vocabulary) axis must be contiguous; got strides {logits.strides}")
    if logits.size and logits.strides[0] % logits.itemsize:
        raise ValueError(f"logits: the row stride must be a whole number of elements; got {logits.strides}")
    if not _is_real(temperature) or not np.isfinite(temperature):
        raise ValueError(f"temperature: expected a finite number (<= 0: greedy); got {temperature!r}")
    if not _is_int(top_k) or int(top_k) < 0:
        raise ValueError(f"top_k: expected an int >= 0 (0: off); got {top_k!r}")
    if not _is_real(top_p) or not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p: expected a number in (0, 1] (1: off); got {top_p!r}")
    if not _is_real(repetition_penalty) or not (np.isfinite(repetition_penalty) and repetition_penalty > 0):
        raise ValueError(f"repetition_penalty: expected a finite number > 0 (1: off); got {repetition_penalty!r}")
    if prev_tokens is not None:
        B.check_dtype("prev_tokens", prev_tokens, (np.int32,))
        if prev_tokens.ndim != 2 or prev_tokens.shape[0] != Bsz:
            raise ValueError(f"prev_tokens: expected shape ({Bsz}, length); got {tuple(prev_tokens.shape)}")
        if prev_tokens.shape[1] > 1 and prev_tokens.strides[1] != 4:
            raise ValueError(f"prev_tokens: the last axis must be contiguous; got strides {prev_tokens.strides}")
        if prev_tokens.strides[0] % 4:
            raise ValueError(f"prev_tokens: the row stride must be a whole number of elements; got "
                             f"{prev_tokens.strides}")
    if prev_len is not None:
        if prev_tokens is None:
            raise ValueError("prev_len: given without prev_tokens")
        if _is_int(prev_len):
            if not 0 <= int(prev_len) <= prev_tokens.shape[1]:
                raise ValueError(f"prev_len: expected 0 <= prev_len <= {prev_tokens.shape[1]} (prev_tokens' "
                                 f"length); got {int(prev_len)}")
        elif B._kind(prev_len) is not None:
            _scalar_array("prev_len", prev_len, (np.int32,), "an int")
        else:
            raise TypeError(f"prev_len: expected an int or a 0-d int32 array; got {type(prev_len).__name__}")
    return Bsz, V


def _params(temperature, top_k, top_p, repetition_penalty, V):
    """The fp32 values both paths use: 1 / temperature, the penalty and its reciprocal, top_p."""
    greedy = float(temperature) <= 0.0
    inv_t = np.float32(1.0) if greedy else np.float32(1.0 / float(temperature))
    pen = np.float32(repetition_penalty)
    inv_pen = np.float32(1.0 / float(repetition_penalty))
    k = int(top_k) if 0 < int(top_k) < V else 0
    return greedy, inv_t, k, np.float32(top_p), pen, inv_pen


# ------------------------------------------------------------------------------------------ reference
def _keys(v):
    """Order-preserving uint32 keys of float32 values (NaN -> 0, the lowest; -0 and +0 -> one key)."""
    v = np.ascontiguousarray(v, dtype=np.float32)
    b = v.view(np.uint32)
    k = np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)).astype(np.uint32)
    mag = b & np.uint32(0x7FFFFFFF)  # NaN and +-0 tested on the bits, as the kernel's f2key does
    k = np.where(mag == 0, np.uint32(0x80000000), k)
    return np.where(mag > np.uint32(0x7F800000), np.uint32(0), k).astype(np.uint32)


def _key2f(k):
    """The float32 value of a key (inverse of _keys on non-NaN values)."""
    k = np.asarray(k, dtype=np.uint32)
    return np.where(k & np.uint32(0x80000000), k & np.uint32(0x7FFFFFFF), ~k).astype(np.uint32).view(np.float32)


def _reference(logits, greedy, inv_t, k, top_p, pen, inv_pen, prev_tokens, prev_len, seed, offset,
               details=False):
    """The kernel's arithmetic on NumPy, rows vectorised. With ``details``: also each row's relative margin: how
    far, relative to the sums compared, the draw's target lies from the prefix sums around it, and the top-p
    cut P from the nearest candidate's mass-above (a mass that is off by a few ulps moves each such sum by
    at most a few 1e-7 of itself); inf for greedy rows."""
    Bsz, V = logits.shape
    x = np.array(logits, dtype=np.float32, copy=True)
    if prev_tokens is not None and pen != np.float32(1.0):
        L = prev_tokens.shape[1] if prev_len is None else min(max(int(prev_len), 0), prev_tokens.shape[1])
        for b in range(Bsz):
            t = np.unique(prev_tokens[b, :L])
            t = t[(t >= 0) & (t < V)]
            xt = x[b, t]
            x[b, t] = np.where(xt > 0, xt * inv_pen, xt * pen).astype(np.float32)
    v = (x * inv_t).astype(np.float32)
    keys = _keys(v)
    argmax = keys.argmax(axis=1).astype(np.int32)  # first maximum: ties -> lowest index
    margin = np.full(Bsz, np.inf)
    maxkey = keys.max(axis=1)
    sampled = (maxkey >= 0x00800000) & (maxkey <= 0xFF7FFFFF) & (not greedy)  # finite row max
    tok = argmax.copy()
    if not sampled.any():
        return (tok, margin) if details else tok
    rows = np.nonzero(sampled)[0]
    v, keys = v[rows], keys[rows]
    m = _key2f(maxkey[rows])
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp((v - m[:, None]).astype(np.float32)).astype(np.float32)
        mass = np.where(np.isnan(v), np.uint64(0), np.where(np.isnan(e), 0, e * MASS_SCALE).astype(np.uint64))
    tau = np.zeros(len(rows), dtype=np.uint32)
    if k:
        tau = np.sort(keys, axis=1)[:, V - k]  # the k-th largest key
    pmargin = np.full(len(rows), np.inf)
    if top_p < np.float32(1.0):
        keptk = keys >= tau[:, None]
        order = np.argsort(~keys, axis=1, kind="stable")  # descending keys
        ks = np.take_along_axis(keys, order, 1)
        ms = np.take_along_axis(np.where(keptk, mass, np.uint64(0)), order, 1)
        Z = ms.sum(axis=1, dtype=np.uint64)
        P = np.maximum((float(top_p) * Z.astype(np.float64)).astype(np.uint64), np.uint64(1))
        excl = np.cumsum(ms, axis=1, dtype=np.uint64) - ms
        pos = np.arange(V)[None, :]
        first = np.maximum.accumulate(np.where(np.diff(ks, axis=1, prepend=~ks[:, :1]) != 0, pos, 0), axis=1)
        above = np.take_along_axis(excl, first, 1)  # mass of kept tokens with a strictly larger key
        keep = (ks >= tau[:, None]) & (above < P[:, None])
        if details:  # how close any candidate's mass-above comes to the cut P, relative to the larger of the two
            a, pp = above.astype(np.float64), P[:, None].astype(np.float64)
            d = np.abs(a - pp) / np.maximum(np.maximum(a, pp), 1.0)
            pmargin = np.where(ks >= tau[:, None], d, np.inf).min(axis=1)
        tau = np.where(keep, ks, np.uint32(0xFFFFFFFF)).min(axis=1).astype(np.uint32)
    kept = np.where(keys >= tau[:, None], mass, np.uint64(0))
    cs = np.cumsum(kept, axis=1, dtype=np.uint64)
    Z = cs[:, -1]
    r = draw_bits(Bsz, seed, offset)[rows]
    target = np.array([(int(z) * int(rr)) >> 64 for z, rr in zip(Z, r)], dtype=np.uint64)
    pick = (cs > target[:, None]).argmax(axis=1)
    tok[rows] = pick.astype(np.int32)
    if details:
        before = np.where(pick > 0, cs[np.arange(len(rows)), pick - 1], np.uint64(0)).astype(np.float64)
        after = cs[np.arange(len(rows)), pick].astype(np.float64)
        t = target.astype(np.float64)
        dmargin = np.minimum((t - before) / np.maximum(t, 1.0), (after - t) / np.maximum(after, 1.0))
        margin[rows] = np.minimum(dmargin, pmargin)
        return tok, margin
    return tok


def reference_margins(logits, *, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, prev_tokens=None,
                      prev_len=None, seed=0, offset=0):
    """NumPy only (for tests): ``(tokens, margins)`` of :func:`sample_tokens` on host arrays, where margins[b] is
    row b's relative distance from the nearest boundary that a last-ulp difference of exp could cross (inf for
    greedy rows). Rows with a margin above ``NEAR_TIE`` must match the kernel."""
    sa, sv = _seed_arg("seed", seed)
    oa, ov = _seed_arg("offset", offset)
    Bsz, V = _validate(logits, temperature, top_k, top_p, repetition_penalty, prev_tokens, prev_len)
    greedy, inv_t, k, tp, pen, inv_pen = _params(temperature, top_k, top_p, repetition_penalty, V)
    use_pen = prev_tokens is not None and pen != np.float32(1.0)
    return _reference(np.asarray(logits), greedy, inv_t, k, tp, pen, inv_pen, prev_tokens if use_pen else None,
                      None if prev_len is None else int(prev_len), sv if sa is None else _host_u64(sa),
                      ov if oa is None else _host_u64(oa), details=True)


# ------------------------------------------------------------------------------------------ greedy plan
def greedy_splits(batch: int, V: int, itemsize: int, slice_bytes: int | None = None) -> int:
    """Blocks per row of the greedy kernel: slices of about ``slice_bytes`` (ck.settings.greedy_slice_bytes), at most
    GREEDY_MAX_SPLITS, and B * S within the workspace's WS_SLOTS partials (1 from B = WS_ROWS + 1 on)."""
    E = 16 // itemsize
    packs = (V + 2 * E - 2) // E  # a row's 16-byte packs at the worst alignment
    per = max(1, (settings.greedy_slice_bytes if slice_bytes is None else int(slice_bytes)) // 16)
    S = min(-(-packs // per), GREEDY_MAX_SPLITS, WS_SLOTS // max(1, batch))
    return max(1, S)


def greedy_smem(V: int, itemsize: int, S: int) -> int:
    """Dynamic shared memory of a greedy block with the penalty on: one bit per token of its slice (at most
    ceil(packs / S) packs of E tokens; bit i - first token of the slice)."""
    E = 16 // itemsize
    packs = (V + 2 * E - 2) // E
    return ((-(-packs // S)) * E + 31) // 32 * 4


def sample_workspace():
    """A zeroed int32 workspace of WORKSPACE_INTS entries for greedy :func:`sample_tokens` on the current device
    (``workspace=``): the per-row counters must start at 0; each launch leaves them at 0 again. Any batch size
    can use it; one workspace must not be used by two kernels at once (two streams in flight)."""
    import cupy

    return cupy.zeros(WORKSPACE_INTS, dtype=np.int32)


# Workspaces of calls without workspace=: one per (device, stream). Kernels on one stream run in order, so a
# stream's workspace is never used by two kernels at once (with PDL too: the next greedy kernel's pdl_wait()
# waits for the previous one to complete). Taken from the default memory pool (never freed: 20 KB a stream,
# a captured graph may hold its address) and zeroed by a memset on that stream, ordered before its first use.
_workspaces: dict = {}


def _stream_workspace():
    """The current stream's cached workspace, or None while the stream is capturing a graph and has none yet
    (the memset that zeroes a new one would run only inside the graph's replays, not before the eager calls
    that follow: such a call takes the one-block-per-row kernel, which needs no workspace)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    # (cudaStreamPerThread, handle 2, is a different stream in each host thread)
    key = (cupy.cuda.runtime.getDevice(), stream.ptr) + ((threading.get_ident(),) if stream.ptr == 2 else ())
    ws = _workspaces.get(key)
    if ws is None:
        if stream.is_capturing():
            return None
        mem = cupy.get_default_memory_pool().malloc(WORKSPACE_INTS * 4)
        ws = B.zero_(cupy.ndarray((WORKSPACE_INTS,), dtype=np.int32, memptr=mem))
        _workspaces[key] = ws
    return ws


def _check_workspace(workspace, xp):
    if B._kind(workspace) is None:
        raise TypeError(f"workspace: expected an int32 device array from sample_workspace(); got "
                        f"{type(workspace).__name__}")
    B.check_dtype("workspace", workspace, (np.int32,))
    if workspace.ndim != 1 or workspace.shape[0] < WORKSPACE_INTS:
        raise ValueError(f"workspace: expected a 1-D int32 array of at least {WORKSPACE_INTS} entries "
                         f"(sample_workspace()); got shape {tuple(workspace.shape)}")
    B.check_contiguous("workspace", workspace)
    B.check_writable("workspace", workspace)


# ------------------------------------------------------------------------------------------ the op


def _greedy_kernel(dtype):
    # room for the penalty bitmap of the largest vocabulary in one block (S = 1)
    return _launch.with_smem(get_function(FAMILY, f"sample_greedy_{B.DTYPE_TAG[np.dtype(dtype)]}"),
                             greedy_smem(MAX_VOCAB, 2, 1))


def _kernel(dtype):
    # room for the penalty bitmap of the largest vocabulary
    return _launch.with_smem(get_function(FAMILY, f"sample_tokens_{B.DTYPE_TAG[np.dtype(dtype)]}"),
                             (MAX_VOCAB + 31) // 32 * 4)


@B.interop
def sample_tokens(logits, *, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, prev_tokens=None,
                  prev_len=None, seed=0, offset=0, out=None, workspace=None):
    """Pick one token per row of ``logits`` on the device: greedy, or a draw from the tempered, filtered softmax.

    Per row (Hugging Face's order: repetition penalty, temperature, top-k, top-p, then the draw):

    * ``repetition_penalty`` (1: off): each distinct token of ``prev_tokens[b, :prev_len]`` (ids outside
      ``[0, vocab)`` ignored) has its logit multiplied by ``float32(1 / penalty)`` if positive, else by
      ``penalty``.
    * ``temperature <= 0``: greedy, the argmax (ties -> the lowest index; NaN logits never win unless the row is
      all NaN). Else ``v = logit * float32(1 / temperature)``. A row whose max ``v`` is not finite (+inf, or
      every logit -inf / NaN) also returns its argmax.
    * ``top_k`` (0 or >= vocab: off): keep tokens whose ``v`` is at least the k-th largest (ties kept).
    * ``top_p`` (1: off): keep the smallest set of most probable tokens (of those top-k kept) whose probability
      reaches ``top_p``: a token is kept iff the kept tokens strictly more probable than it hold less than
      ``top_p`` of the mass (ties at the boundary kept; the most probable token always).
    * The draw: one 64-bit uniform integer per row from Philox4x32-10 (counter ``(row, 0, offset)``, key
      ``seed``); inverse CDF over the kept tokens in vocabulary order. Probabilities are the fixed-point masses
      ``floor(exp(v - max v) * 2**44)`` (exact integer sums: the same token on every run and block shape; a
      token more than 30.5 nats below the max is never drawn).

    Same (seed, offset, row, logits) -> same token. ``ck.sample_tokens`` on NumPy arrays computes the same
    integers; it may pick a different token than the kernel only when the draw's target or the top-p cut lies
    within a relative ``2e-6`` of a prefix sum of masses (``expf`` vs ``np.exp`` in the last ulps).

    Every parameter is one value per call (not per row). No host sync; no allocation beyond ``out``;
    ``seed``, ``offset`` and ``prev_len`` may be 0-d device arrays, so a captured decode step can advance
    ``offset`` (or pass its cache length) on the device.

    Greedy rows are split over up to 63 blocks each (fp32, vocabulary 128256; :func:`greedy_splits`), whose
    partial results meet in a small workspace with a counter per row that every launch leaves at 0: pass
    ``workspace=sample_workspace()`` (allocated once, before a graph capture) to own it; without it each
    (device, stream) gets a cached one on first use (a capture on a stream that has none yet takes the
    one-block-per-row kernel instead). A workspace must not serve two streams in flight at once. Greedy is
    launched with programmatic dependent launch inside ``ops._launch.pdl_scope()`` (it reads nothing before
    its predecessor completes).

    Args:
        logits: ``[batch, vocab]`` float32 or bfloat16, last axis contiguous (any row stride, any alignment).
        temperature: a finite number; <= 0 is greedy.
        top_k: an int >= 0.
        top_p: a number in (0, 1].
        repetition_penalty: a finite number > 0.
        prev_tokens: optional ``[batch, length]`` int32 (last axis contiguous): tokens seen so far.
        prev_len: the number of valid leading entries of ``prev_tokens`` (default: all): an int or a 0-d int32
            array (clamped to ``[0, length]`` on the device).
        seed, offset: ints in ``[0, 2**64)`` or 0-d int64 / uint64 / int32 arrays (int32: sign-extended).
        out: optional int32 ``[batch]`` output.
        workspace: optional int32 device array from :func:`sample_workspace` (greedy only; ignored otherwise).

    Returns:
        int32 ``[batch]`` token ids.

    Example::

        >>> tok = ck.sample_tokens(logits, temperature=0.8, top_k=50, top_p=0.95, seed=1234, offset=step)
    """
    sa, sv = _seed_arg("seed", seed)
    oa, ov = _seed_arg("offset", offset)
    pl_arr = prev_len if (prev_len is not None and B._kind(prev_len) is not None) else None
    xp = B.array_module(logits=logits, prev_tokens=prev_tokens, out=out, prev_len=pl_arr, seed=sa, offset=oa,
                        workspace=workspace)
    Bsz, V = _validate(logits, temperature, top_k, top_p, repetition_penalty, prev_tokens, prev_len)
    if workspace is not None:
        _check_workspace(workspace, xp)
    greedy, inv_t, k, tp, pen, inv_pen = _params(temperature, top_k, top_p, repetition_penalty, V)
    res = B.empty(xp, (Bsz,), np.int32, out)
    use_pen = prev_tokens is not None and pen != np.float32(1.0)
    if xp is np:
        s = sv if sa is None else _host_u64(sa)
        o = ov if oa is None else _host_u64(oa)
        res[...] = _reference(logits, greedy, inv_t, k, tp, pen, inv_pen, prev_tokens if use_pen else None,
                              prev_len, s, o)
        return res
    if Bsz == 0:
        return res
    if greedy and settings.greedy_split and _greedy(logits, res, Bsz, V, pen, inv_pen, use_pen, prev_tokens, prev_len,
                                                    pl_arr, workspace):
        return res
    kern = _kernel(logits.dtype)
    L = int(prev_tokens.shape[1]) if use_pen else 0
    if use_pen and L:  # the kernel builds a V-bit set of the penalised tokens in shared memory
        smem = (V + 31) // 32 * 4
        host_len = L if prev_len is None or pl_arr is not None else int(prev_len)
        pen_args = (prev_tokens, np.int64(prev_tokens.strides[0] // 4), np.int32(L),
                    pl_arr if pl_arr is not None else B.NULL, np.int32(host_len))
    else:  # penalty off, or an empty history
        smem = 0
        pen_args = (B.NULL, np.int64(0), np.int32(0), B.NULL, np.int32(0))
    seed_args = (sa if sa is not None else B.NULL, np.int32(_SEED_KIND[sa.dtype] if sa is not None else 0),
                 np.uint64(sv if sa is None else 0))
    off_args = (oa if oa is not None else B.NULL, np.int32(_SEED_KIND[oa.dtype] if oa is not None else 0),
                np.uint64(ov if oa is None else 0))
    kern((Bsz,), (THREADS, 1, 1),
         (logits, np.int64(logits.strides[0] // logits.itemsize), np.int32(V), res, inv_t, np.bool_(greedy),
          np.int32(k), tp, pen, inv_pen, *pen_args, *seed_args, *off_args), shared_mem=smem)
    return res


def _greedy(logits, res, Bsz, V, pen, inv_pen, use_pen, prev_tokens, prev_len, pl_arr, workspace):
    """Launch the split-row greedy kernel; False when it cannot run (no workspace while capturing)."""
    S = greedy_splits(Bsz, V, logits.itemsize)
    ws = B.NULL
    if S > 1:
        w = workspace if workspace is not None else _stream_workspace()
        if w is None:
            return False
        ws = _launch.ptr(w)
    L = int(prev_tokens.shape[1]) if use_pen else 0
    if use_pen and L:
        smem = greedy_smem(V, logits.itemsize, S)
        host_len = L if prev_len is None or pl_arr is not None else int(prev_len)
        pen_args = (_launch.ptr(prev_tokens), np.int64(prev_tokens.strides[0] // 4), np.int32(L),
                    _launch.ptr(pl_arr) if pl_arr is not None else B.NULL, np.int32(host_len))
    else:
        smem = 0
        pen_args = (B.NULL, np.int64(0), np.int32(0), B.NULL, np.int32(0))
    _launch.launch(_greedy_kernel(logits.dtype), (Bsz * S,), (GREEDY_THREADS,),
                   (_launch.ptr(logits), np.int64(logits.strides[0] // logits.itemsize), np.int32(V), _launch.ptr(res),
                    ws, np.int32(WS_SLOTS), np.int32(S), pen, inv_pen, *pen_args), smem, pdl=True)
    return True


__all__ = ["sample_tokens", "sample_workspace"]
