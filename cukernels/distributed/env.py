"""Where this process sits in a multi-process run, read from the environment its launcher set.

Understood, in this order of precedence (explicit arguments to :func:`from_environ` override all of them):

* ``python -m cukernels.run`` and ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (``LOCAL_WORLD_SIZE``).
* SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS`` (or ``SLURM_NPROCS``), ``SLURM_LOCALID``; without
  ``MASTER_ADDR`` the first host of ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` hosts rank 0.
* Open MPI (``mpirun``): ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``
  (``OMPI_COMM_WORLD_LOCAL_SIZE``); ``MASTER_ADDR`` must be set when the ranks span several hosts.
* none of these: a single process (rank 0 of 1).

``MASTER_ADDR`` / ``MASTER_PORT`` name the TCP rendezvous that rank 0 serves (default port 29500, as torchrun).
Nothing here imports CuPy or touches a GPU.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """Rank ``rank`` of ``world_size`` processes, GPU ``local_rank`` of its host, rendezvous at
    ``master_addr:master_port``; ``source`` says where the numbers came from (``"cukernels.run/torchrun"``,
    ``"slurm"``, ``"openmpi"``, ``"single"`` or ``"arguments"``). ``local_world_size`` is None when unknown."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world_size: int | None = None
    source: str = "single"


def _int(environ, name, *, min_value=0):
    raw = environ.get(name)
    if raw is None:
        return None
    try:
        v = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"{name}: expected an integer; got {raw!r}") from None
    if v < min_value:
        raise ValueError(f"{name}: expected an integer >= {min_value}; got {v}")
    return v


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM node list: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``, ``"a[1-2]-ib[3]"`` ->
    ``"a1-ib3"`` (every bracket expression replaced by its first element, zero padding kept)."""
    s = nodelist.strip()
    depth, end = 0, len(s)
    for i, ch in enumerate(s):  # the first comma outside brackets ends the first entry
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            end = i
            break
    entry = s[:end]

    def first(m):
        return re.split(r"[-,]", m.group(1))[0]

    host = re.sub(r"\[([^\]]*)\]", first, entry)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"SLURM node list: cannot read the first host of {nodelist!r}")
    return host


def from_environ(environ=None, *, rank=None, world_size=None, local_rank=None, master_addr=None,
                 master_port=None) -> DistEnv:
    """The :class:`DistEnv` of this process from ``environ`` (default ``os.environ``); keyword arguments that are
    not None override what the environment says. Bad values raise ValueError naming the variable."""
    env = os.environ if environ is None else environ
    source = "single"
    r = ws = lr = lws = None
    if env.get("RANK") is not None or env.get("WORLD_SIZE") is not None:
        source = "cukernels.run/torchrun"
        r, ws = _int(env, "RANK"), _int(env, "WORLD_SIZE", min_value=1)
        if r is None or ws is None:
            missing = "RANK" if r is None else "WORLD_SIZE"
            raise ValueError(f"{missing}: not set, but {'WORLD_SIZE' if r is None else 'RANK'} is (a launcher "
                             f"sets both)")
        lr = _int(env, "LOCAL_RANK")
        if lr is None:  # a generic launcher that sets RANK/WORLD_SIZE only: take the scheduler's local id
            lr = _int(env, "SLURM_LOCALID")
        if lr is None:
            lr = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        if lr is None:
            if ws != 1:
                raise ValueError("LOCAL_RANK: not set (RANK and WORLD_SIZE are); the launcher must say which GPU "
                                 "of this host the process uses")
            lr = 0
        lws = _int(env, "LOCAL_WORLD_SIZE", min_value=1)
    elif env.get("SLURM_PROCID") is not None and (env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")):
        source = "slurm"
        r = _int(env, "SLURM_PROCID")
        ws = _int(env, "SLURM_NTASKS" if env.get("SLURM_NTASKS") else "SLURM_NPROCS", min_value=1)
        lr = _int(env, "SLURM_LOCALID")
        if lr is None:
            raise ValueError("SLURM_LOCALID: not set (SLURM_PROCID is); run the script with srun")
    elif env.get("OMPI_COMM_WORLD_RANK") is not None:
        source = "openmpi"
        r = _int(env, "OMPI_COMM_WORLD_RANK")
        ws = _int(env, "OMPI_COMM_WORLD_SIZE", min_value=1)
        lr = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        lws = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", min_value=1)
        if ws is None or lr is None:
            raise ValueError("OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_LOCAL_RANK: not set (OMPI_COMM_WORLD_RANK is)")
    else:
        r, ws, lr = 0, 1, 0

    if any(v is not None for v in (rank, world_size, local_rank)):
        source = "arguments" if source == "single" else source + "+arguments"
    r = r if rank is None else int(rank)
    ws = ws if world_size is None else int(world_size)
    lr = lr if local_rank is None else int(local_rank)
    if ws < 1:
        raise ValueError(f"world_size: expected an integer >= 1; got {ws}")
    if not 0 <= r < ws:
        raise ValueError(f"rank: expected 0 <= rank < world_size ({ws}); got {r}")
    if lr < 0:
        raise ValueError(f"local_rank: expected an integer >= 0; got {lr}")

    addr = master_addr if master_addr is not None else env.get("MASTER_ADDR")
    if not addr:
        if ws == 1:
            addr = "127.0.0.1"
        elif source.startswith("slurm"):
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise ValueError("MASTER_ADDR: not set and no SLURM_JOB_NODELIST to take rank 0's host from")
            addr = first_host(nodelist)
        elif source.startswith("openmpi") and lws is not None and lws == ws:
            addr = "127.0.0.1"  # every rank on this host
        else:
            raise ValueError(f"MASTER_ADDR: not set; with {ws} ranks ({source}) it must name the host of rank 0")
    port = master_port if master_port is not None else _int(env, "MASTER_PORT", min_value=1)
    port = DEFAULT_PORT if port is None else int(port)
    if not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT: expected a TCP port in [1, 65535]; got {port}")
    return DistEnv(rank=r, world_size=ws, local_rank=lr, master_addr=str(addr), master_port=port,
                   local_world_size=lws, source=source)
