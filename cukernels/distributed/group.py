"""Process groups and their collectives: NCCL between processes (one GPU each), a single-process group, and an
in-process stand-in for N ranks on NumPy arrays.

Every group offers the same five collectives, each validated before anything is queued (TypeError / ValueError
naming the argument):

* ``all_reduce(x, op="sum", *, out=None)`` -- ``out = op over ranks of x`` (in place by default);
* ``reduce_scatter(send, recv, op="sum")`` -- ``recv = op over ranks of send[rank*n:(rank+1)*n]``, n = recv.size;
* ``all_gather(send, recv)`` -- ``recv[r*n:(r+1)*n] = send of rank r``, n = send.size;
* ``broadcast(x, root=0)`` -- ``x = x of rank root``;
* ``barrier()`` -- every rank has reached it (a host barrier: not for use inside a captured graph).

``op`` is ``"sum"``, ``"avg"`` (floating types), ``"max"`` or ``"min"``. Arrays are C-contiguous, flat in
meaning (any shape; the element count is what matters), float32, bfloat16, float64, int32 or int64. In-place use
is NCCL's: ``reduce_scatter`` with ``recv`` the rank's own slice of ``send``, ``all_gather`` with ``send`` the
rank's own slice of ``recv``; any other overlap is refused.

:class:`NcclGroup` (made by :func:`cukernels.distributed.init_process_group`) queues the NCCL call on the
current CuPy stream and returns at once: no host synchronisation, nothing allocated, so the collectives can be
captured into a CUDA graph (NCCL >= 2.9 supports capture). A failing NCCL call aborts the communicator and
raises :class:`DistributedError` naming the rank and the collective; a watchdog thread polls
``ncclCommGetAsyncError`` once a second and, on an asynchronous error (a peer lost over the network, ...), aborts
the communicator, says so on stderr and ends the process, so a run never hangs on a dead communicator.

Teardown and CUDA graphs. NCCL >= 2.26 does not destroy (nor abort) a communicator while a CUDA graph that
captured one of its collectives is alive: ``ncclCommDestroy`` polls until every such graph has been destroyed
(``commDestroySync``: "keep polling until all graphs referencing us die"), and CuPy calls it holding the GIL. So
delete captured graphs (``del graph``, ``del stepper``) before :meth:`NcclGroup.destroy`. The group counts the
collectives it queues while the stream captures; at destroy, if it captured any and a ``cupy.cuda.Graph`` is
still alive after a garbage collection, it leaves the communicator to the process exit (saying so on stderr)
instead of hanging -- a run that ends with its step graph alive still exits cleanly.

Reduction order. NCCL sums in its ring / tree order, rounding to the element type after every addition (bf16
sums are bf16 adds of fp32-widened operands); ``avg`` on floating types is NCCL's pre-multiplied sum: each input
times ``1/world_size`` (rounded to the element type), then the sum. For two ranks every order is the same one
addition, so results are exact and identical on both ranks. :class:`FakeGroup` follows the same model in rank
order (0, 1, ..., N-1), so a CPU test can predict every bit.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import sys
import threading

import numpy as np

from .. import _backend as B

OPS = ("sum", "avg", "max", "min")
DTYPES = (np.dtype(np.float32), B.bfloat16, np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))
_FLOAT = (np.dtype(np.float32), B.bfloat16, np.dtype(np.float64))


class DistributedError(RuntimeError):
    """A collective failed or the communicator is unusable; the message names the rank and the collective."""


# ---------------------------------------------------------------------------------------------- validation
def _ptr(a):
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def _check_array(name, a, xp, writable=False):
    if B._kind(a) is None:
        raise TypeError(f"{name}: expected a {xp.__name__} array; got {type(a).__name__}")
    if B._kind(a) is not xp:
        raise TypeError(f"{name}: expected a {xp.__name__} array (this group's arrays); got a "
                        f"{B._kind(a).__name__} array")
    if a.dtype not in DTYPES:
        raise TypeError(f"{name}: expected dtype float32, bfloat16, float64, int32 or int64; got {a.dtype}")
    B.check_contiguous(name, a)
    if writable:
        B.check_writable(name, a)


def _check_op(op, dtype):
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(map(repr, OPS))}; got {op!r}")
    if op == "avg" and dtype not in _FLOAT:
        raise TypeError(f"op: 'avg' needs a floating dtype (float32, bfloat16, float64); got {dtype}")


def _overlap(a, b):
    if a.nbytes == 0 or b.nbytes == 0:
        return False
    pa, pb = _ptr(a), _ptr(b)
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def _same_dtype(name, a, ref_name, ref):
    if a.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {ref.dtype} (the dtype of {ref_name}); got {a.dtype}")


def _in_place_slice(whole, part, rank):
    """True when ``part`` is exactly element block ``rank`` of ``whole`` (NCCL's in-place layout)."""
    return part.nbytes > 0 and _ptr(part) == _ptr(whole) + rank * part.nbytes


# ---------------------------------------------------------------------------------------------- base
class ProcessGroup:
    """A set of ``world_size`` ranks and the collectives between them (see the module docstring).

    Attributes: ``rank``, ``world_size``, ``local_rank``, ``xp`` (numpy or cupy: the arrays it takes),
    ``device`` (the CUDA device id of a CuPy group, else None), ``backend`` (``"nccl"``, ``"single"``,
    ``"fake"``).
    """

    backend = "?"

    def __init__(self, rank, world_size, local_rank, xp, device=None):
        self.rank, self.world_size, self.local_rank = int(rank), int(world_size), int(local_rank)
        self.xp, self.device = xp, device

    # -- public collectives: validate, then the backend's _all_reduce / ... --------------------------------
    def all_reduce(self, x, op="sum", *, out=None):
        """``out = op(x over ranks)``; ``out`` defaults to ``x`` (in place). Returns ``out``."""
        _check_array("x", x, self.xp)
        _check_op(op, x.dtype)
        if out is None:
            out = x
        else:
            _check_array("out", out, self.xp, writable=True)
            _same_dtype("out", out, "x", x)
            if out.size != x.size:
                raise ValueError(f"out: expected {x.size} elements (the size of x); got {out.size}")
            if out is not x and _overlap(out, x) and _ptr(out) != _ptr(x):
                raise ValueError("out: overlaps x without being x; pass out=None (in place) or a separate buffer")
        B.check_writable("x" if out is x else "out", out)
        self._device_check(x, out)
        self._all_reduce(x, out, op)
        return out

    def reduce_scatter(self, send, recv, op="sum"):
        """``recv = op over ranks of send[rank * n:(rank + 1) * n]`` with ``n = recv.size``; ``send`` holds
        ``world_size * n`` elements. In place when ``recv`` is the rank's own block of ``send``. Returns recv."""
        _check_array("send", send, self.xp)
        _check_array("recv", recv, self.xp, writable=True)
        _same_dtype("recv", recv, "send", send)
        _check_op(op, send.dtype)
        if send.size != self.world_size * recv.size:
            raise ValueError(f"send: expected world_size * recv.size = {self.world_size} * {recv.size} = "
                             f"{self.world_size * recv.size} elements; got {send.size}")
        if _overlap(send, recv) and not _in_place_slice(send, recv, self.rank):
            raise ValueError(f"recv: overlaps send without being block {self.rank} (this rank's) of it; in-place "
                             f"reduce_scatter needs recv = send[rank*n:(rank+1)*n]")
        self._device_check(send, recv)
        self._reduce_scatter(send, recv, op)
        return recv

    def all_gather(self, send, recv):
        """``recv[r * n:(r + 1) * n] = send of rank r`` with ``n = send.size``. In place when ``send`` is the
        rank's own block of ``recv``. Returns recv."""
        _check_array("send", send, self.xp)
        _check_array("recv", recv, self.xp, writable=True)
        _same_dtype("recv", recv, "send", send)
        if recv.size != self.world_size * send.size:
            raise ValueError(f"recv: expected world_size * send.size = {self.world_size} * {send.size} = "
                             f"{self.world_size * send.size} elements; got {recv.size}")
        if _overlap(send, recv) and not _in_place_slice(recv, send, self.rank):
            raise ValueError(f"send: overlaps recv without being block {self.rank} (this rank's) of it; in-place "
                             f"all_gather needs send = recv[rank*n:(rank+1)*n]")
        self._device_check(send, recv)
        self._all_gather(send, recv)
        return recv

    def broadcast(self, x, root=0):
        """``x = x of rank root`` on every rank (in place). Returns x."""
        _check_array("x", x, self.xp, writable=True)
        root = B.check_int("root", root, min=0, max=self.world_size - 1)
        self._device_check(x)
        self._broadcast(x, root)
        return x

    def barrier(self):
        """Return once every rank has called it (host-side: it synchronises the current stream)."""
        self._barrier()

    def destroy(self):
        """Release the communicator (idempotent)."""

    def _device_check(self, *arrays):
        if self.device is None:
            return
        for a in arrays:
            if a.device.id != self.device:
                raise ValueError(f"array on GPU {a.device.id}; this rank's communicator is on GPU {self.device} "
                                 f"(LOCAL_RANK)")

    def __repr__(self):
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}"
                f", backend={self.backend!r})")


def _copy_into(xp, out, x):
    if out is x or (x.size and _ptr(out) == _ptr(x)):
        return
    out.reshape(-1)[...] = x.reshape(-1)


class SingleGroup(ProcessGroup):
    """A world of one: every collective is a copy (or nothing when in place). For 1-GPU runs of code written for
    several, and for tests; no NCCL. ``xp``: numpy or cupy (default: cupy when a GPU is visible)."""

    backend = "single"

    def __init__(self, xp=None, *, local_rank=0):
        if xp is None:
            xp = B._cupy() if B.gpu_available() else np
        super().__init__(0, 1, local_rank, xp, None)

    def _all_reduce(self, x, out, op):
        _copy_into(self.xp, out, x)  # sum / max / min of one; avg multiplies by 1/1 = 1 (exact)

    def _reduce_scatter(self, send, recv, op):
        _copy_into(self.xp, recv, send)

    def _all_gather(self, send, recv):
        _copy_into(self.xp, recv, send)

    def _broadcast(self, x, root):
        pass

    def _barrier(self):
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()


# ---------------------------------------------------------------------------------------------- NCCL
def _nccl():
    from cupy.cuda import nccl  # noqa: PLC0415 - CuPy only on the GPU path
    if not getattr(nccl, "available", True):
        raise DistributedError("NCCL is not available to CuPy (pip install nvidia-nccl-cu12, or -cu13 for a CUDA-13 "
                               "CuPy); several GPUs need it")
    return nccl


def _nccl_dtype(nccl, dt):
    return {np.dtype(np.float32): nccl.NCCL_FLOAT32, B.bfloat16: nccl.NCCL_BFLOAT16,
            np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int32): nccl.NCCL_INT32,
            np.dtype(np.int64): nccl.NCCL_INT64}[np.dtype(dt)]


def _nccl_op(nccl, op):
    return {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_AVG, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}[op]


@contextlib.contextmanager
def _backstop(seconds):
    """Exit the process (status 1, Python tracebacks on stderr) if the block does not end within ``seconds``.

    faulthandler's watchdog is a C thread that needs no GIL: CuPy holds the GIL inside ``ncclCommDestroy`` /
    ``ncclCommAbort``, so a ``threading.Timer`` could never fire while one of them hangs. (It replaces any
    ``faulthandler.dump_traceback_later`` the program armed itself.)"""
    armed = False
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
        armed = True
    except Exception:  # no usable stderr file descriptor: run unguarded
        pass
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def live_cuda_graphs():
    """How many ``cupy.cuda.Graph`` objects are alive in this process (after nothing: call ``gc.collect()``
    first to drop unreachable ones). CuPy's Graph is garbage-collector tracked, so ``gc.get_objects`` sees it."""
    try:
        from cupy.cuda.graph import Graph  # noqa: PLC0415
    except Exception:
        return 0
    return sum(1 for o in gc.get_objects() if type(o) is Graph)


_PINNED = []  # communicators left to the process exit (see NcclGroup.destroy)


def _pin(obj):
    """Keep ``obj`` alive for the rest of the process, through interpreter shutdown too: CuPy's communicator
    calls ``ncclCommDestroy`` when deallocated, which would block on a live graph just the same."""
    import ctypes  # noqa: PLC0415
    _PINNED.append(obj)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class _Watchdog(threading.Thread):
    """Polls ``ncclCommGetAsyncError`` every ``interval`` seconds (host memory only: safe while the main thread
    captures a graph in CuPy's default relaxed mode). On an error: stderr names the rank, the communicator is
    aborted (pending NCCL kernels return), the main thread gets a KeyboardInterrupt, and the process exits with
    status 1 after ``grace`` seconds if it is still alive -- a hang becomes a failed rank the launcher reports."""

    def __init__(self, group, interval=1.0, grace=5.0):
        super().__init__(name=f"cukernels-nccl-watchdog-{group.rank}", daemon=True)
        self.group, self.interval, self.grace = group, interval, grace
        self.stop = threading.Event()

    def run(self):
        import _thread
        g = self.group
        while not self.stop.wait(self.interval):
            comm = g._comm
            if comm is None:
                return
            try:
                comm.check_async_error()
            except Exception as e:  # NcclError
                if self.stop.is_set():
                    return
                g._failed = (f"rank {g.rank}/{g.world_size}: NCCL reported an asynchronous error: {e}; the "
                             f"communicator was aborted")
                sys.stderr.write(f"cukernels.distributed: {g._failed}\n")
                sys.stderr.flush()
                # Armed before the abort: ncclCommAbort can block (a live graph that captured a collective, see
                # the module docstring) while holding the GIL, where no Python timer runs.
                try:
                    faulthandler.dump_traceback_later(self.grace + 5.0, exit=True, file=sys.__stderr__)
                except Exception:
                    pass
                g._abort()
                _thread.interrupt_main()
                timer = threading.Timer(self.grace, os._exit, (1,))
                timer.daemon = True
                timer.start()
                return


class NcclGroup(ProcessGroup):
    """One NCCL communicator per process, on CUDA device ``local_rank``. Made by :func:`init_process_group`.

    Collectives are queued on the current CuPy stream (graph-capturable: no host sync, no allocation)."""

    backend = "nccl"

    def __init__(self, comm, rank, world_size, local_rank, *, device=None, watchdog=True):
        cp = B._cupy()
        super().__init__(rank, world_size, local_rank, cp, local_rank if device is None else int(device))
        self._nccl = _nccl()
        self._comm = comm
        self._failed = None
        self._lock = threading.Lock()
        self._scratch = None  # barrier's one-element buffer
        self.captured = 0  # collectives queued into a CUDA graph capture (see destroy)
        self.leaked = False  # destroy() left the communicator to the process exit (a captured graph was alive)
        self._watchdog = _Watchdog(self) if watchdog else None
        if self._watchdog is not None:
            self._watchdog.start()

    def _abort(self):
        with self._lock:
            comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # already gone
                pass

    def _call(self, what, fn, *args):
        if self._failed is not None:
            raise DistributedError(self._failed)
        if self._comm is None:
            raise DistributedError(f"rank {self.rank}: {what}: the process group was destroyed")
        try:
            fn(*args)
        except Exception as e:
            self._failed = f"rank {self.rank}/{self.world_size}: NCCL {what} failed: {e}"
            self._abort()
            raise DistributedError(self._failed) from e

    def _stream(self):
        s = self.xp.cuda.get_current_stream()
        # Count captured collectives: destroy() must know whether a graph may hold this communicator. The legacy
        # stream (ptr 0) cannot capture, and querying it while another stream captures is itself an error.
        if s.ptr != 0:
            try:
                if s.is_capturing():
                    self.captured += 1
            except Exception:  # a query refused mid-capture: the capture is what matters, count it
                self.captured += 1
        return s.ptr

    @staticmethod
    def _what(name, a):
        return f"{name} of {a.size} {a.dtype} elements"

    def _all_reduce(self, x, out, op):
        if x.size == 0:
            return
        n = self._nccl
        self._call(self._what(f"all_reduce({op})", x), lambda *a: self._comm.allReduce(*a), _ptr(x), _ptr(out),
                   x.size, _nccl_dtype(n, x.dtype), _nccl_op(n, op), self._stream())

    def _reduce_scatter(self, send, recv, op):
        if recv.size == 0:
            return
        n = self._nccl
        self._call(self._what(f"reduce_scatter({op})", send), lambda *a: self._comm.reduceScatter(*a), _ptr(send),
                   _ptr(recv), recv.size, _nccl_dtype(n, send.dtype), _nccl_op(n, op), self._stream())

    def _all_gather(self, send, recv):
        if send.size == 0:
            return
        n = self._nccl
        self._call(self._what("all_gather", recv), lambda *a: self._comm.allGather(*a), _ptr(send), _ptr(recv),
                   send.size, _nccl_dtype(n, send.dtype), self._stream())

    def _broadcast(self, x, root):
        if x.size == 0:
            return
        n = self._nccl
        self._call(self._what(f"broadcast(root={root})", x), lambda *a: self._comm.broadcast(*a), _ptr(x),
                   _ptr(x), x.size, _nccl_dtype(n, x.dtype), root, self._stream())

    def _barrier(self):
        cp = self.xp
        if self._scratch is None:
            with cp.cuda.Device(self.device):
                self._scratch = cp.zeros((1,), dtype=np.int32)
        self.all_reduce(self._scratch)
        cp.cuda.get_current_stream().synchronize()

    def destroy(self, timeout=60.0):
        """Wait for this GPU's queued work, then free the communicator. A communicator that failed is aborted
        instead. If the wait does not end within ``timeout`` seconds (a peer died with a collective in flight),
        the process says so on stderr and exits with status 1 rather than hang.

        CUDA graphs: NCCL waits for every graph that captured a collective of this communicator to be destroyed
        before it destroys (or aborts) the communicator. Delete such graphs first. If this group queued a
        collective into a capture and a ``cupy.cuda.Graph`` is still alive after ``gc.collect()``, the
        communicator is not destroyed: a note on stderr, ``self.leaked = True``, and the process exit reclaims
        it (a hang would be the alternative)."""
        if self._watchdog is not None:
            self._watchdog.stop.set()
            self._watchdog.join(timeout=5.0)
        if self._failed is not None:
            with _backstop(timeout):
                self._abort()
            return
        with self._lock:
            comm, self._comm = self._comm, None
        if comm is None:
            return

        def stuck():
            sys.stderr.write(f"cukernels.distributed: rank {self.rank}: destroying the process group: the GPU's "
                             f"queued work did not finish within {timeout:g} s (a collective whose peer is gone?); "
                             f"exiting\n")
            sys.stderr.flush()
            os._exit(1)

        timer = threading.Timer(timeout, stuck)
        timer.daemon = True
        timer.start()
        try:
            try:
                self.xp.cuda.Device(self.device).synchronize()  # (releases the GIL: the timer can fire)
            except Exception:  # a sticky CUDA error: nothing to wait for; still free the communicator
                pass
        finally:
            timer.cancel()
        if self.captured:
            gc.collect()  # graphs only reachable from garbage (a finished trainer's step) go now
            live = live_cuda_graphs()
            if live:
                self.leaked = True
                _pin(comm)
                sys.stderr.write(f"cukernels.distributed: rank {self.rank}: {live} CUDA graph(s) still alive and "
                                 f"{self.captured} collective(s) of this group were captured into graphs; NCCL "
                                 f"would wait for those graphs forever, so the communicator is left to the "
                                 f"process exit (delete captured graphs before destroy_process_group())\n")
                sys.stderr.flush()
                return
        with _backstop(timeout):  # ncclCommDestroy holds the GIL: only a C-level watchdog can end a hang there
            comm.destroy()


def make_nccl_comm(world_size, unique_id, rank):
    """``nccl.NcclCommunicator`` from a unique id received as bytes: CuPy >= 14 takes the 128 bytes, older CuPy a
    tuple of signed chars (its ``get_unique_id`` format)."""
    nccl = _nccl()
    try:
        return nccl.NcclCommunicator(world_size, bytes(unique_id), rank)
    except TypeError:  # CuPy < 14: commId is a tuple
        return nccl.NcclCommunicator(world_size, tuple(b - 256 if b > 127 else b for b in unique_id), rank)


def unique_id_bytes():
    """A fresh NCCL unique id as 128 bytes (whatever type CuPy's ``get_unique_id`` returns)."""
    uid = _nccl().get_unique_id()
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(int(b) & 0xFF for b in uid)


# ---------------------------------------------------------------------------------------------- fake
def _as_f32(a):
    return a.astype(np.float32) if a.dtype == B.bfloat16 else a


def _reduce_exact(arrays, op, dtype, world):
    """The model of NCCL's reduction in rank order: one rounding to ``dtype`` per addition (bf16 added in fp32
    then rounded, as a bf16 ``__hadd``); ``avg`` pre-multiplies each input by ``dtype(1/world)``."""
    dt = np.dtype(dtype)
    if op in ("max", "min"):
        f = np.maximum if op == "max" else np.minimum
        acc = arrays[0].copy()
        for a in arrays[1:]:
            acc = f(acc, a)
        return acc
    if op == "avg":
        s = np.asarray(1.0 / world, dtype=np.float64).astype(dt)
        arrays = [(_as_f32(a) * _as_f32(s)).astype(dt) for a in arrays]
    acc = arrays[0].copy()
    with np.errstate(over="ignore", invalid="ignore"):
        for a in arrays[1:]:
            acc = (_as_f32(acc) + _as_f32(a)).astype(dt)
    return acc


class FakeGroup:
    """``world_size`` ranks inside one process, for CPU tests of distributed code on NumPy arrays.

    ``world.rank(r)`` is rank r's :class:`ProcessGroup`; :meth:`run` calls ``fn(group, *args)`` for every rank,
    each in its own thread, and returns the results in rank order. A collective waits for all ranks to call it
    (a barrier), checks that they called the same collective with matching arrays, then every rank computes its
    output from all the inputs in rank order (see :func:`_reduce_exact`): results are exact and reproducible.
    A rank that raises, or a collective not reached by every rank within ``timeout`` seconds, fails every rank
    with a :class:`DistributedError` instead of hanging.

    Example::

        >>> world = FakeGroup(3)
        >>> world.run(lambda g: g.all_reduce(np.full(4, g.rank, np.float32)))   # three arrays of 0+1+2
    """

    def __init__(self, world_size, *, timeout=60.0):
        self.world_size = B.check_int("world_size", world_size, min=1)
        self.timeout = float(timeout)
        self._barrier = threading.Barrier(self.world_size)
        self._slots = [None] * self.world_size
        self._ranks = [_FakeRank(self, r) for r in range(self.world_size)]

    def rank(self, r):
        return self._ranks[B.check_int("r", r, min=0, max=self.world_size - 1)]

    @property
    def ranks(self):
        return list(self._ranks)

    def run(self, fn, *args):
        """``[fn(rank 0's group, *args), fn(rank 1's group, *args), ...]`` with each rank in a thread; re-raises
        the first rank's exception (the one that did not merely see another rank fail)."""
        results = [None] * self.world_size
        errors = [None] * self.world_size

        def body(r):
            try:
                results[r] = fn(self._ranks[r], *args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors[r] = e
                self._barrier.abort()  # the others fail at their next collective instead of waiting

        self._barrier.reset()
        threads = [threading.Thread(target=body, args=(r,), name=f"fake-rank-{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._barrier.reset()
        real = [e for e in errors if e is not None and not isinstance(e, _Broken)]
        if real:
            raise real[0]
        if any(e is not None for e in errors):
            raise next(e for e in errors if e is not None)
        return results

    def _exchange(self, rank, item, what):
        """Deposit ``item`` and return every rank's, after checking they agree."""
        self._slots[rank] = item
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise _Broken(f"rank {rank}: {what}: another rank failed or did not reach this collective within "
                          f"{self.timeout:g} s") from None
        # Read before anyone can deposit again: a rank deposits its next item only after the _after() barrier of
        # this collective, which every rank reaches after this line.
        items = list(self._slots)
        kinds = {it[0] for it in items}
        if len(kinds) != 1:
            raise DistributedError(f"rank {rank}: {what}: the ranks called different collectives: "
                                   f"{[it[0] for it in items]}")
        return items


class _Broken(DistributedError):
    """A rank saw another rank fail."""


class _FakeRank(ProcessGroup):
    backend = "fake"

    def __init__(self, world, rank):
        super().__init__(rank, world.world_size, rank, np, None)
        self.world = world

    def _collect(self, kind, a, what):
        items = self.world._exchange(self.rank, (kind, a.dtype, a.size, a), what)
        for r, (_, dt, n, _) in enumerate(items):
            if dt != a.dtype or n != a.size:
                raise DistributedError(f"rank {self.rank}: {what}: rank {r} passed {n} {dt} elements, this rank "
                                       f"{a.size} {a.dtype}")
        return [it[3].reshape(-1) for it in items]

    def _all_reduce(self, x, out, op):
        ins = self._collect(("all_reduce", op), x, f"all_reduce({op})")
        res = _reduce_exact(ins, op, x.dtype, self.world_size)
        self._after()
        out.reshape(-1)[...] = res

    def _reduce_scatter(self, send, recv, op):
        ins = self._collect(("reduce_scatter", op), send, f"reduce_scatter({op})")
        n = recv.size
        res = _reduce_exact([a[self.rank * n:(self.rank + 1) * n] for a in ins], op, send.dtype, self.world_size)
        self._after()
        recv.reshape(-1)[...] = res

    def _all_gather(self, send, recv):
        ins = self._collect(("all_gather",), send, "all_gather")
        res = np.concatenate([a.copy() for a in ins])
        self._after()
        recv.reshape(-1)[...] = res

    def _broadcast(self, x, root):
        ins = self._collect(("broadcast", root), x, f"broadcast(root={root})")
        res = ins[root].copy()
        self._after()
        x.reshape(-1)[...] = res

    def _barrier(self):
        self.world._exchange(self.rank, (("barrier",),), "barrier")
        self._after()

    def _after(self):
        """Outputs are written only once every rank has read every input (in-place collectives stay exact)."""
        try:
            self.world._barrier.wait(self.world.timeout)
        except threading.BrokenBarrierError:
            raise _Broken(f"rank {self.rank}: another rank failed during a collective") from None
