"""``python -m cukernels.run``: start one process per GPU with the environment of a distributed run, as torchrun.

::

    python -m cukernels.run --nproc-per-node 2 examples/train.py --config examples/configs/small.yaml
    python -m cukernels.run --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr node01 --master-port 29500 train.py

Each process gets ``RANK`` (= node_rank * nproc_per_node + local rank), ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node rank), ``MASTER_ADDR``, ``MASTER_PORT``, ``NCCL_NVLS_ENABLE=0``
(NVLink multicast stays off) and ``PYTHONUNBUFFERED=1``; :func:`cukernels.distributed.init_process_group` reads
them. On several hosts run the same command on each with its own ``--node-rank`` (same ``--master-addr``: the
host of node 0, reachable from the others, and the same ``--master-port``).

Output: every line a process writes is shown with a ``[rank k]`` prefix (stdout to stdout, stderr to stderr);
``--quiet-others`` shows only this node's first rank, and keeps the last lines of the others' stderr to print if
one of them fails.

Failure: the launcher polls its children every 50 ms. When one exits with a non-zero status (or is killed by a
signal), it says which rank failed and how, sends SIGTERM to every other process (each runs in its own process
group, so their children go too), sends SIGKILL to what is left after ``--grace`` seconds, and exits with the
failed rank's status (128 + signal number for a signal). SIGINT / SIGTERM to the launcher are passed on the same
way. A rank stuck in a collective with a dead peer therefore never keeps the run alive.

Only the standard library: the launcher itself never imports CuPy or touches a GPU.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time

POLL_S = 0.05
TAIL_LINES = 40


def free_port(host="127.0.0.1"):
    """A TCP port nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m cukernels.run", allow_abbrev=False,
        description="Start N processes per host with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set "
                    "(as torchrun); stop them all when one fails.")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N",
                   help="processes on this host, one per GPU (default 1)")
    p.add_argument("--nnodes", type=int, default=1, metavar="M", help="hosts in the run (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="K",
                   help="this host's index in [0, nnodes) (default 0)")
    p.add_argument("--master-addr", "--master_addr", default=None, metavar="HOST",
                   help="host of rank 0 (default 127.0.0.1; required with --nnodes > 1)")
    p.add_argument("--master-port", "--master_port", type=int, default=None, metavar="P",
                   help="rendezvous port on the master host (default: a free port on one host, 29500 on several)")
    p.add_argument("--quiet-others", action="store_true",
                   help="show only this host's first rank (the others' last stderr lines are shown if they fail)")
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping the ranks (default 5)")
    p.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m target)")
    p.add_argument("target", metavar="script.py", help="the script (or module with -m) every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _launcher_part(p, argv):
    """``argv`` with a ``--`` inserted after the script's name, so that argparse never reads the script's own
    options as the launcher's (``bench_train.py --nproc 2`` once matched ``--nproc-per-node`` by abbreviation)."""
    takes_value = {s for a in p._actions if a.nargs is None and a.option_strings for s in a.option_strings}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv
        if a.startswith("-") and a != "-":
            i += 1 if ("=" in a or a not in takes_value) else 2
            continue
        return argv[:i + 1] + ["--"] + argv[i + 1:]  # argv[i] is the script
    return argv


def _check(p, ns):
    if ns.nproc_per_node < 1:
        p.error(f"--nproc-per-node: expected an integer >= 1; got {ns.nproc_per_node}")
    if ns.nnodes < 1:
        p.error(f"--nnodes: expected an integer >= 1; got {ns.nnodes}")
    if not 0 <= ns.node_rank < ns.nnodes:
        p.error(f"--node-rank: expected an integer in [0, {ns.nnodes}); got {ns.node_rank}")
    if ns.nnodes > 1 and not ns.master_addr:
        p.error("--master-addr: required with --nnodes > 1 (the host of node 0, as the other hosts reach it)")
    if ns.master_port is not None and not 1 <= ns.master_port <= 65535:
        p.error(f"--master-port: expected a TCP port in [1, 65535]; got {ns.master_port}")
    if not ns.grace >= 0:
        p.error(f"--grace: expected a number of seconds >= 0; got {ns.grace}")
    if not ns.module and not os.path.exists(ns.target):
        p.error(f"{ns.target}: no such script (use -m for a module)")


class _Output:
    """Copies a child's stdout / stderr to ours line by line with a ``[rank k]`` prefix (one lock: lines of
    different ranks never interleave mid-line); a hidden rank's stderr lines go to a short ring buffer."""

    def __init__(self):
        self.lock = threading.Lock()
        self.threads = []

    def pump(self, pipe, dest, prefix, show, tail):
        def run():
            try:
                for line in iter(pipe.readline, b""):
                    if not line.endswith(b"\n"):
                        line += b"\n"
                    if show:
                        with self.lock:
                            dest.write(prefix + line)
                            dest.flush()
                    elif tail is not None:
                        tail.append(line)
            except (OSError, ValueError):
                pass
            finally:
                pipe.close()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def say(self, text):
        with self.lock:
            sys.stderr.write(f"cukernels.run: {text}\n")
            sys.stderr.flush()

    def join(self, timeout):
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))


def _describe(rc):
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"was killed by {name}", 128 - rc
    return f"exited with status {rc}", rc


def _stop(procs, grace, out):
    """SIGTERM to every live child's process group, SIGKILL to what is left after ``grace`` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + grace
    while time.monotonic() < end and any(p.poll() is None for p in live):
        time.sleep(POLL_S)
    left = [p for p in live if p.poll() is None]
    if left:
        out.say(f"sending SIGKILL to {len(left)} process(es) still running after {grace:g} s")
    for p in live:  # the group too: a child's own children may outlive it
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in left:
        p.wait()


def launch(ns):
    """Start the ranks of ``ns`` (parsed arguments), watch them, return the exit status."""
    nproc, world = ns.nproc_per_node, ns.nnodes * ns.nproc_per_node
    addr = ns.master_addr or "127.0.0.1"
    port = ns.master_port if ns.master_port is not None else (free_port() if ns.nnodes == 1 else 29500)
    cmd = [sys.executable, "-u"] + (["-m", ns.target] if ns.module else [ns.target]) + list(ns.args)
    out = _Output()
    procs, ranks, tails = [], [], {}
    stop_signal = []

    def on_signal(signum, frame):
        stop_signal.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for local in range(nproc):
            rank = ns.node_rank * nproc + local
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(ns.node_rank), MASTER_ADDR=addr,
                       MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
            p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)
            procs.append(p)
            ranks.append(rank)
            show = not ns.quiet_others or local == 0
            prefix = f"[rank {rank}] ".encode()
            tails[rank] = None if show else collections.deque(maxlen=TAIL_LINES)
            out.pump(p.stdout, sys.stdout.buffer, prefix, show, None)
            out.pump(p.stderr, sys.stderr.buffer, prefix, show, tails[rank])
        start = time.monotonic()
        status = None
        while status is None:
            if stop_signal:
                name = signal.Signals(stop_signal[0]).name
                out.say(f"got {name}; stopping {len(procs)} rank(s)")
                _stop(procs, ns.grace, out)
                status = 128 + stop_signal[0]
                break
            done = 0
            for p, rank in zip(procs, ranks):
                rc = p.poll()
                if rc is None:
                    continue
                if rc == 0:
                    done += 1
                    continue
                how, status = _describe(rc)
                others = [r for q, r in zip(procs, ranks) if q.poll() is None]
                out.say(f"rank {rank} (local rank {rank - ns.node_rank * nproc}, pid {p.pid}) {how} after "
                        f"{time.monotonic() - start:.1f} s; stopping "
                        + (f"rank(s) {', '.join(map(str, others))} (SIGTERM, SIGKILL after {ns.grace:g} s)"
                           if others else "nothing (no other rank is running)"))
                _stop(procs, ns.grace, out)
                out.join(2.0)
                tail = tails.get(rank)
                if tail:
                    out.say(f"last lines of rank {rank}'s stderr:")
                    with out.lock:
                        for line in tail:
                            sys.stderr.buffer.write(f"[rank {rank}] ".encode() + line)
                        sys.stderr.flush()
                out.say(f"rank {rank} failed ({how}); exit status {status}")
                break
            else:
                if done == len(procs):
                    status = 0
                    break
                time.sleep(POLL_S)
        out.join(2.0)
        return status
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:  # never leave a child behind, whatever happened above
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def main(argv=None):
    p = _parser()
    ns = p.parse_args(_launcher_part(p, sys.argv[1:] if argv is None else list(argv)))
    _check(p, ns)
    return launch(ns)


if __name__ == "__main__":
    sys.exit(main())
