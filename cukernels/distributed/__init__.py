"""Several processes, one GPU each: the process group, its collectives, and the launcher's environment.

::

    # python -m cukernels.run --nproc-per-node 2 train.py      (or torchrun, srun, mpirun)
    import cukernels.distributed as dist
    g = dist.init_process_group()          # RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
    g.all_reduce(grads, op="avg")          # NCCL on the current CuPy stream: bf16 / fp32, graph-capturable
    dist.destroy_process_group()

:func:`init_process_group` reads the environment (:mod:`.env`: the launcher's variables, SLURM's or Open MPI's),
sets ``NCCL_NVLS_ENABLE=0`` (NVLink multicast stays off), selects CUDA device ``LOCAL_RANK``, has rank 0 make
the NCCL unique id and hands it to the other ranks through a TCP rendezvous on ``MASTER_ADDR:MASTER_PORT``
(:mod:`.rendezvous`; a timeout is an error naming the address and how many ranks arrived), then creates one
``cupy.cuda.nccl.NcclCommunicator`` per process. A world of one needs no NCCL (:class:`SingleGroup`); an
in-process :class:`FakeGroup` stands in for N ranks on NumPy arrays in tests.

This package sits next to the ops (it imports only ``_backend`` and CuPy), so the optimizer layer can use it.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading

import numpy as np

from .env import DistEnv, first_host, from_environ
from .group import (DistributedError, FakeGroup, NcclGroup, ProcessGroup, SingleGroup, make_nccl_comm,
                    unique_id_bytes)
from .rendezvous import RendezvousError, RendezvousTimeout, rendezvous

__all__ = ["init_process_group", "destroy_process_group", "get_group", "is_initialized", "get_rank",
           "get_world_size", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "ProcessGroup",
           "NcclGroup", "SingleGroup", "FakeGroup", "DistEnv", "from_environ", "first_host", "rendezvous",
           "DistributedError", "RendezvousError", "RendezvousTimeout"]

_group = None


def init_process_group(*, backend="auto", rank=None, world_size=None, local_rank=None, master_addr=None,
                       master_port=None, timeout=300.0, watchdog=True) -> ProcessGroup:
    """Join the run this process belongs to and make it the default group; returns the :class:`ProcessGroup`.

    Args:
        backend: ``"nccl"`` (CUDA device ``local_rank``, one NCCL communicator), ``"single"`` (a world of one,
            no NCCL; on CuPy when a GPU is visible, else NumPy), or ``"auto"``: NCCL when ``world_size > 1``,
            else single.
        rank, world_size, local_rank, master_addr, master_port: override the environment (see :mod:`.env`).
        timeout: seconds for the rendezvous (every rank must arrive) and again for NCCL's communicator setup;
            past it the call raises (rendezvous) or ends the process with a message on stderr (a communicator
            setup that does not return means a rank died after the rendezvous; nothing else can unblock it).
        watchdog: poll NCCL's asynchronous error state once a second and fail the process on an error.

    Raises:
        RendezvousTimeout / RendezvousError: the ranks did not all arrive, or disagree.
        DistributedError: no GPU for ``local_rank``, NCCL missing, or communicator setup failed.
    """
    global _group
    if _group is not None:
        raise DistributedError(f"init_process_group: already initialised ({_group!r}); call "
                               f"destroy_process_group() first")
    if backend not in ("auto", "nccl", "single"):
        raise ValueError(f"backend: expected 'auto', 'nccl' or 'single'; got {backend!r}")
    if not timeout > 0:
        raise ValueError(f"timeout: expected a number of seconds > 0; got {timeout!r}")
    env = from_environ(rank=rank, world_size=world_size, local_rank=local_rank, master_addr=master_addr,
                       master_port=master_port)
    if backend == "single" or (backend == "auto" and env.world_size == 1):
        if env.world_size != 1:
            raise ValueError(f"backend: 'single' is a world of one; the environment says world_size "
                             f"{env.world_size} ({env.source})")
        g = SingleGroup(local_rank=env.local_rank)
        if g.xp is not np:  # the GPU of LOCAL_RANK, as with NCCL (a 1-process launcher run sets it to 0)
            g.xp.cuda.Device(env.local_rank).use()
            g.device = env.local_rank
        _group = g
        return _group
    _group = _init_nccl(env, timeout, watchdog)
    return _group


def _init_nccl(env, timeout, watchdog):
    # NVLink SHARP / multicast (NVLS) stays off on every rank: the machines this runs on forbid multicast objects,
    # and NCCL reads the variable once, when the first communicator is made -- so set it before anything NCCL.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    from .. import _backend as B
    cp = B._cupy()
    if cp is None or not B.gpu_available():
        raise DistributedError(f"rank {env.rank}: world_size {env.world_size} needs NCCL and one GPU per rank; CuPy "
                               f"sees no CUDA device")
    n_dev = cp.cuda.runtime.getDeviceCount()
    if env.local_rank < n_dev:
        device = env.local_rank
    elif n_dev == 1:
        device = 0  # the scheduler gave each process its own GPU (srun --gpus-per-task=1): it is device 0
    else:
        raise DistributedError(f"rank {env.rank}: LOCAL_RANK {env.local_rank} but this process sees {n_dev} GPUs "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); start at "
                               f"most {n_dev} processes per host")
    cp.cuda.Device(device).use()
    uid = unique_id_bytes() if env.rank == 0 else b""
    uid = rendezvous(env.rank, env.world_size, env.master_addr, env.master_port, uid, timeout=timeout)[0]

    # ncclCommInitRank blocks until every rank joins; a rank that died after the rendezvous would leave the others
    # there forever. A timer turns that into a failed process (the launcher then stops the run and names it).
    def stuck():
        sys.stderr.write(f"cukernels.distributed: rank {env.rank}: NCCL communicator setup did not finish within "
                         f"{timeout:g} s (world_size {env.world_size}, GPU {device}); another rank probably "
                         f"died after the rendezvous. Exiting.\n")
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(timeout, stuck)
    timer.daemon = True
    timer.start()
    try:
        comm = make_nccl_comm(env.world_size, uid, env.rank)
    except Exception as e:
        raise DistributedError(f"rank {env.rank}: NCCL communicator setup failed (world_size {env.world_size}, GPU "
                               f"{device}): {e}") from e
    finally:
        timer.cancel()
    return NcclGroup(comm, env.rank, env.world_size, env.local_rank, device=device, watchdog=watchdog)


def destroy_process_group():
    """Release the default group's communicator (waits for this GPU's queued work first). Idempotent."""
    global _group
    g, _group = _group, None
    if g is not None:
        g.destroy()


atexit.register(destroy_process_group)


def is_initialized() -> bool:
    return _group is not None


def get_group() -> ProcessGroup:
    """The default group (:func:`init_process_group`)."""
    if _group is None:
        raise DistributedError("no process group: call cukernels.distributed.init_process_group() first")
    return _group


def get_rank() -> int:
    """This process's rank (0 when no group is initialised)."""
    return _group.rank if _group is not None else 0


def get_world_size() -> int:
    """The number of ranks (1 when no group is initialised)."""
    return _group.world_size if _group is not None else 1


def _g(group):
    return get_group() if group is None else group


def all_reduce(x, op="sum", *, out=None, group=None):
    """``group.all_reduce`` on the default group (see :class:`ProcessGroup`)."""
    return _g(group).all_reduce(x, op, out=out)


def reduce_scatter(send, recv, op="sum", *, group=None):
    return _g(group).reduce_scatter(send, recv, op)


def all_gather(send, recv, *, group=None):
    return _g(group).all_gather(send, recv)


def broadcast(x, root=0, *, group=None):
    return _g(group).broadcast(x, root)


def barrier(*, group=None):
    return _g(group).barrier()
