"""cukernels.distributed and the launcher: environment parsing, the TCP rendezvous, ``python -m cukernels.run``
with real processes over loopback (token exchange, a killed rank, a failing rank, --quiet-others), the exact
collective math of FakeGroup and SingleGroup, and (GPU, two devices) NCCL collectives under the launcher.

This file is also the worker script the launcher tests start: ``python tests/test_distributed.py <worker>``.
"""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # as a worker script: the checkout's cukernels
    sys.path.insert(0, str(ROOT))

import cukernels as ck  # noqa: E402
from cukernels import distributed as dist  # noqa: E402
from cukernels.distributed import (DistributedError, FakeGroup, RendezvousError, RendezvousTimeout,  # noqa: E402
                                   SingleGroup, first_host, from_environ, rendezvous)
from cukernels.run import free_port  # noqa: E402

F32, BF16, F64 = np.dtype(np.float32), np.dtype(ck.bfloat16), np.dtype(np.float64)
THIS = Path(__file__).resolve()


def launch(*args, nproc=2, timeout=60, extra=()):
    """Run ``python -m cukernels.run --nproc-per-node nproc [extra] THIS args`` and return (rc, out, err, secs)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "cukernels.run", "--nproc-per-node", str(nproc), *extra, str(THIS), *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


# ---------------------------------------------------------------- CPU: environment
def test_env_torchrun_style():
    e = from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (3, 4, 1, 2)
    assert (e.master_addr, e.master_port) == ("node7", 1234)
    assert e.source.startswith("cukernels.run")


def test_env_slurm_and_nodelist():
    e = from_environ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                      "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1"})
    assert (e.rank, e.world_size, e.local_rank, e.source) == (5, 8, 1, "slurm")
    assert e.master_addr == "gpu07" and e.master_port == 29500
    assert first_host("a[1-2]-ib[3,5]") == "a1-ib3"
    assert first_host("single") == "single"
    assert first_host("n[001-004]") == "n001"  # zero padding kept


def test_env_openmpi():
    e = from_environ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.source) == (1, 2, 1, "127.0.0.1", "openmpi")
    with pytest.raises(ValueError, match="MASTER_ADDR"):  # ranks on several hosts: rank 0's host is needed
        from_environ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_env_precedence_and_defaults():
    assert from_environ({}).world_size == 1 and from_environ({}).rank == 0
    # the launcher's variables win over the scheduler's
    e = from_environ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "SLURM_PROCID": "7",
                      "SLURM_NTASKS": "9", "SLURM_LOCALID": "3"})
    assert (e.rank, e.world_size) == (0, 2)
    # RANK/WORLD_SIZE without LOCAL_RANK: the scheduler's local id
    e = from_environ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_LOCALID": "1", "MASTER_ADDR": "h"})
    assert e.local_rank == 1
    e = from_environ({}, rank=1, world_size=3, local_rank=0, master_addr="x", master_port=5)
    assert (e.rank, e.world_size, e.master_port, e.source) == (1, 3, 5, "arguments")


@pytest.mark.parametrize("env, match", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK: expected an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, "rank: expected 0 <= rank"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE: expected an integer >= 1"),
    ({"RANK": "1"}, "WORLD_SIZE: not set"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "LOCAL_RANK: not set"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "MASTER_ADDR: not set"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_LOCALID"),
])
def test_env_errors_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        from_environ(env)


# ---------------------------------------------------------------- CPU: rendezvous (threads in this process)
def _threads(fn, n):
    out = [None] * n

    def body(i):
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - inspected by the test
            out[i] = e

    ts = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def test_rendezvous_exchanges_every_payload():
    port = free_port()
    out = _threads(lambda r: rendezvous(r, 4, "127.0.0.1", port, f"tok{r}".encode() * (r + 1), timeout=20), 4)
    for r in range(4):
        assert out[r] == [f"tok{i}".encode() * (i + 1) for i in range(4)], out[r]
    assert rendezvous(0, 1, "127.0.0.1", 1, b"solo") == [b"solo"]  # a world of one touches no socket


def test_rendezvous_timeout_names_address_and_arrivals():
    port = free_port()

    def body(r):
        if r == 1:
            return rendezvous(1, 3, "127.0.0.1", port, b"", timeout=2.0)
        return rendezvous(0, 3, "127.0.0.1", port, b"", timeout=1.0)

    t0 = time.monotonic()
    out = _threads(body, 2)
    assert time.monotonic() - t0 < 8, "the rendezvous must not hang"
    for e in out:
        assert isinstance(e, RendezvousTimeout), e
        msg = str(e)
        assert f"127.0.0.1:{port}" in msg and "2 of 3 ranks arrived" in msg and "missing rank(s) 2" in msg, msg


def test_rendezvous_unreachable_rank0_is_a_clear_timeout():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeout, match=rf"could not reach rank 0 at 127.0.0.1:{port} within 0.5 s"):
        rendezvous(1, 2, "127.0.0.1", port, b"", timeout=0.5)
    assert time.monotonic() - t0 < 5


def test_rendezvous_inconsistent_world_size_fails_both_sides():
    port = free_port()
    out = _threads(lambda r: rendezvous(r, 2 if r == 0 else 3, "127.0.0.1", port, b"", timeout=10), 2)
    for e in out:
        assert isinstance(e, RendezvousError) and "WORLD_SIZE=3" in str(e), e


def test_rendezvous_ignores_strangers():
    """A connection that is not a rank (a port scanner, garbage) is dropped, and the real ranks still meet."""
    import socket
    port = free_port()

    def body(r):
        if r == 2:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=1)
                    s.sendall(b"\x00\x00\x00\x05hello")
                    s.close()
                    return "stranger done"
                except OSError:
                    time.sleep(0.05)
            return "no server"
        if r == 1:
            time.sleep(0.3)  # after the stranger
        return rendezvous(r, 2, "127.0.0.1", port, bytes([r]), timeout=10)

    out = _threads(body, 3)
    assert out[0] == out[1] == [b"\x00", b"\x01"], out


def test_rendezvous_bad_arguments():
    with pytest.raises(TypeError, match="payload: expected bytes"):
        rendezvous(0, 2, "127.0.0.1", 1, "text")
    with pytest.raises(ValueError, match="rank, world_size"):
        rendezvous(2, 2, "127.0.0.1", 1, b"")
    with pytest.raises(ValueError, match="timeout"):
        rendezvous(0, 2, "127.0.0.1", 1, b"", timeout=0)


# ---------------------------------------------------------------- CPU: the launcher (real processes)
def test_launcher_sets_env_and_ranks_exchange_a_token():
    rc, out, err, _ = launch("token", nproc=3)
    assert rc == 0, err
    for r in range(3):
        line = f"[rank {r}] tokens=tok0,tok1,tok2 world=3 local={r} nvls=0"
        assert line in out, out + err
    assert "[rank 1] hello on stderr" in err


def test_launcher_quiet_others():
    rc, out, err, _ = launch("token", nproc=2, extra=("--quiet-others",))
    assert rc == 0, err
    assert "[rank 0] tokens=" in out and "[rank 1]" not in out + err


def test_launcher_killed_rank_stops_the_run_within_seconds():
    rc, out, err, secs = launch("killed", nproc=3, extra=("--grace", "2"), timeout=60)
    # rank 2 kills itself with SIGKILL; ranks 0 and 1 would sleep for 120 s
    assert rc == 128 + 9, (rc, err)
    assert secs < 15, f"the launcher took {secs:.1f} s to stop the run"
    assert "rank 2" in err and "SIGKILL" in err and "stopping rank(s) 0, 1" in err, err


def test_launcher_failing_rank_exit_status_and_quiet_tail():
    """A rank that raises: its status is the launcher's, and with --quiet-others its last stderr lines are shown."""
    rc, out, err, secs = launch("fail", nproc=2, extra=("--quiet-others", "--grace", "1"))
    assert rc == 3, (rc, err)
    assert "rank 1" in err and "exited with status 3" in err
    assert "[rank 1] worker failing on purpose" in err, err  # the hidden rank's tail is printed on failure
    assert secs < 15


def test_launcher_runs_a_module_with_m():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(THIS.parent)]))
    p = subprocess.run([sys.executable, "-m", "cukernels.run", "--nproc-per-node", "2", "-m", THIS.stem, "token"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "[rank 1] tokens=tok0,tok1 world=2 local=1" in p.stdout


def test_launcher_passes_sigterm_on_and_stops_every_rank():
    import signal
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "cukernels.run", "--nproc-per-node", "2", "--grace", "2", str(THIS),
                          "sleep"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = 0
    for line in p.stdout:  # both ranks up and past the rendezvous
        ready += "ready" in line
        if ready == 2:
            break
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - t0 < 10 and "got SIGTERM; stopping 2 rank(s)" in err, err


def test_launcher_bad_arguments():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "cukernels.run", "--nproc-per-node", "0", str(THIS)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--nproc-per-node" in p.stderr
    p = subprocess.run([sys.executable, "-m", "cukernels.run", "--nnodes", "2", str(THIS)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--master-addr" in p.stderr
    p = subprocess.run([sys.executable, "-m", "cukernels.run", "no_such_script.py"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "no such script" in p.stderr


def test_launcher_leaves_the_scripts_own_options_alone():
    """Everything after the script's name is the script's: ``bench_train.py --nproc 2`` once matched the
    launcher's ``--nproc-per-node`` by abbreviation (session 4, on the H200), and ``--grace`` after the script
    is the script's ``--grace``."""
    from cukernels import run
    p = run._parser()
    for argv, want in ((["--nproc-per-node", "2", "--quiet-others", "x.py", "--nproc", "2", "--configs", "a"],
                        (2, 5.0, False, "x.py", ["--nproc", "2", "--configs", "a"])),
                       (["x.py"], (1, 5.0, False, "x.py", [])),
                       (["--grace=3", "-m", "mod", "--grace", "1"], (1, 3.0, True, "mod", ["--grace", "1"])),
                       (["--grace", "3", "x.py", "--", "a"], (1, 3.0, False, "x.py", ["--", "a"]))):
        ns = p.parse_args(run._launcher_part(p, argv))
        assert (ns.nproc_per_node, ns.grace, ns.module, ns.target, ns.args) == want, argv


# ---------------------------------------------------------------- CPU: FakeGroup / SingleGroup collectives
def _inputs(rank, n, dtype, seed=0):
    rng = np.random.default_rng(seed * 1000 + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, n).astype(dtype)
    return (rng.standard_normal(n) * 3).astype(np.float32).astype(dtype)


def _chain(arrays, dtype, op, world):
    """The documented reduction model, written out independently: rank order, one rounding per addition."""
    dt = np.dtype(dtype)
    if op == "max":
        return np.maximum.reduce(arrays)
    if op == "min":
        return np.minimum.reduce(arrays)
    if op == "avg":
        inv = np.float64(1.0 / world).astype(dt).astype(np.float64)
        arrays = [(a.astype(np.float64) * inv).astype(np.float32).astype(dt) if dt == BF16
                  else (a * np.asarray(inv).astype(dt)).astype(dt) for a in arrays]
    acc = arrays[0]
    for a in arrays[1:]:
        acc = (acc.astype(np.float64) + a.astype(np.float64)).astype(dt) if dt in (BF16, F32) else acc + a
    return acc


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [np.float32, ck.bfloat16, np.float64, np.int32])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_fake_all_reduce_is_exact(world, dtype, op):
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.skip("avg is for floating types")
    n = 1001
    ins = [_inputs(r, n, dtype) for r in range(world)]
    want = _chain(ins, dtype, op, world)

    def body(g):
        x = ins[g.rank].copy()
        g.all_reduce(x, op)  # in place
        out = np.full(n, -7, dtype=dtype)
        g.all_reduce(ins[g.rank], op, out=out)
        return x, out

    for x, out in FakeGroup(world).run(body):
        assert np.array_equal(x.view(np.uint8), want.view(np.uint8)), "bit-exact"
        assert np.array_equal(out, x)


def test_fake_bf16_sum_rounds_after_every_addition():
    """1 + 2^-8 + 2^-8 in bf16: each addition of 2^-8 to 1 rounds back to 1 (ties to even), a sum in fp32 would
    give 1 + 2^-7 -- the model of NCCL's ring is the former."""
    vals = [np.array([1.0], BF16), np.array([2.0 ** -8], BF16), np.array([2.0 ** -8], BF16)]
    out = FakeGroup(3).run(lambda g: g.all_reduce(vals[g.rank].copy()))
    assert float(out[0][0]) == 1.0


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [np.float32, ck.bfloat16])
def test_fake_reduce_scatter_and_all_gather(world, dtype):
    n = 67  # elements per rank: odd on purpose
    ins = [_inputs(r, world * n, dtype, seed=1) for r in range(world)]
    full = _chain(ins, dtype, "avg", world)

    def body(g):
        r = g.rank
        recv = np.full(n, np.nan, dtype=dtype)
        g.reduce_scatter(ins[r], recv, "avg")
        inplace = ins[r].copy()
        g.reduce_scatter(inplace, inplace[r * n:(r + 1) * n], "avg")  # NCCL's in-place layout
        gathered = np.full(world * n, np.nan, dtype=dtype)
        g.all_gather(recv, gathered)
        g.all_gather(inplace[r * n:(r + 1) * n], inplace)  # in place
        b = ins[r].copy()
        g.broadcast(b, root=world - 1)
        g.barrier()
        return recv, inplace, gathered, b

    for r, (recv, inplace, gathered, b) in enumerate(FakeGroup(world).run(body)):
        assert np.array_equal(recv, full[r * n:(r + 1) * n])
        assert np.array_equal(inplace, full) and np.array_equal(gathered, full)
        assert np.array_equal(b, ins[world - 1])


def test_fake_group_mismatch_and_failure_do_not_hang():
    def mismatch(g):
        x = np.zeros(4, np.float32)
        if g.rank == 0:
            g.all_reduce(x)
        else:
            g.all_gather(x[2:4], x)  # in place: rank 1 sends block 1

    with pytest.raises(DistributedError, match="different collectives"):
        FakeGroup(2).run(mismatch)

    def sizes(g):
        g.all_reduce(np.zeros(4 + g.rank, np.float32))

    with pytest.raises(DistributedError, match=r"rank [01] passed [45] float32 elements, this rank [54] float32"):
        FakeGroup(2).run(sizes)

    def one_fails(g):
        if g.rank == 1:
            raise KeyError("rank 1 broke")
        g.all_reduce(np.zeros(4, np.float32))

    t0 = time.monotonic()
    with pytest.raises(KeyError, match="rank 1 broke"):  # the real error, not the other rank's broken barrier
        FakeGroup(3, timeout=30).run(one_fails)
    assert time.monotonic() - t0 < 10

    def skipper(g):
        if g.rank == 0:
            g.all_reduce(np.zeros(4, np.float32))

    with pytest.raises(DistributedError, match="did not reach"):
        FakeGroup(2, timeout=0.5).run(skipper)


def test_collective_validation_names_the_argument():
    g = FakeGroup(2).rank(0)
    x = np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="x: expected dtype"):
        g.all_reduce(np.zeros(4, np.float16))
    with pytest.raises(ValueError, match="op: expected one of"):
        g.all_reduce(x, "mean")
    with pytest.raises(TypeError, match="op: 'avg' needs a floating dtype"):
        g.all_reduce(np.zeros(4, np.int32), "avg")
    with pytest.raises(ValueError, match=r"send: expected world_size \* recv.size = 2 \* 3 = 6"):
        g.reduce_scatter(x, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="recv: overlaps send without being block 0"):
        g.reduce_scatter(x, x[4:])
    with pytest.raises(ValueError, match=r"recv: expected world_size \* send.size"):
        g.all_gather(np.zeros(3, np.float32), x)
    with pytest.raises(ValueError, match="send: overlaps recv"):
        g.all_gather(x[4:], x)
    with pytest.raises(TypeError, match="recv: expected dtype float32"):
        g.all_gather(np.zeros(4, np.float32), np.zeros(8, np.float64))
    with pytest.raises(ValueError, match="x: expected a C-contiguous|x: .*contiguous"):
        g.all_reduce(np.zeros(8, np.float32)[::2])
    with pytest.raises(ValueError, match="root"):
        g.broadcast(x, root=2)
    with pytest.raises(TypeError, match="expected a numpy array"):
        g.all_reduce([1.0, 2.0])


def test_single_group_collectives_are_copies():
    g = SingleGroup(np)
    assert (g.rank, g.world_size) == (0, 1)
    x = np.arange(5, dtype=np.float32)
    out = np.zeros(5, np.float32)
    g.all_reduce(x, "avg", out=out)
    assert np.array_equal(out, x)
    recv = np.zeros(5, np.float32)
    g.reduce_scatter(x, recv)
    g.all_gather(recv, out)
    g.broadcast(out)
    g.barrier()
    assert np.array_equal(out, x)


def test_default_group_single_process():
    assert not dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
    with pytest.raises(DistributedError, match="init_process_group"):
        dist.get_group()
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    try:
        g = dist.init_process_group(backend="single")
        assert dist.get_group() is g and g.world_size == 1
        with pytest.raises(DistributedError, match="already initialised"):
            dist.init_process_group()
        x = g.xp.ones(3, dtype=np.float32)
        assert dist.all_reduce(x) is x
    finally:
        dist.destroy_process_group()
        os.environ.update(env)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="backend"):
        dist.init_process_group(backend="gloo")


# ---------------------------------------------------------------- GPU: NCCL under the launcher (2 devices)
def two_gpus():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() >= 2
    except Exception:
        return False


needs_two = pytest.mark.skipif(not (ck.gpu_available() and two_gpus()), reason="needs 2 CUDA devices")


@pytest.mark.gpu
@needs_two
def test_nccl_collectives_under_launcher():
    """bf16 / fp32 (/ fp64 / int32) all_reduce sum+avg+max, reduce_scatter, all_gather (in place and not, a
    misaligned view), broadcast, barrier and a captured graph of collectives, exact against NumPy on both ranks."""
    rc, out, err, _ = launch("nccl_collectives", nproc=2, timeout=300)
    assert rc == 0, out + err
    assert "[rank 0] OK nccl_collectives" in out and "[rank 1] OK nccl_collectives" in out, out + err


@pytest.mark.gpu
@needs_two
def test_nccl_live_graph_at_teardown_does_not_hang():
    """destroy_process_group() with a graph of collectives still alive: NCCL would wait for the graph forever;
    the group leaves the communicator to the process exit instead, says so, and both ranks exit 0 quickly."""
    rc, out, err, secs = launch("nccl_graph_alive", nproc=2, timeout=300)
    assert rc == 0, out + err
    assert "[rank 0] OK nccl_graph_alive" in out and "[rank 1] OK nccl_graph_alive" in out, out + err
    assert "left to the process exit" in err, err
    assert secs < 120, secs


@pytest.mark.gpu
@needs_two
def test_nccl_killed_rank_ends_the_run():
    """A rank SIGKILLed while the other waits in an all_reduce: the launcher stops the run within seconds."""
    rc, out, err, secs = launch("nccl_killed", nproc=2, extra=("--grace", "3"), timeout=300)
    assert rc == 128 + 9, out + err
    assert "rank 1" in err and "SIGKILL" in err
    assert secs < 120  # includes CUDA/NCCL start-up; the stop itself is the --grace


# ---------------------------------------------------------------- workers (run by the launcher)
def worker_token():
    e = from_environ()
    got = rendezvous(e.rank, e.world_size, e.master_addr, e.master_port, f"tok{e.rank}".encode(), timeout=30)
    print(f"tokens={','.join(g.decode() for g in got)} world={e.world_size} local={e.local_rank} "
          f"nvls={os.environ.get('NCCL_NVLS_ENABLE')}")
    print("hello on stderr", file=sys.stderr)


def worker_killed():
    import signal
    e = from_environ()
    rendezvous(e.rank, e.world_size, e.master_addr, e.master_port, b"", timeout=30)
    if e.rank == 2:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def worker_sleep():
    e = from_environ()
    rendezvous(e.rank, e.world_size, e.master_addr, e.master_port, b"", timeout=30)
    print("ready", flush=True)
    time.sleep(120)


def worker_fail():
    e = from_environ()
    rendezvous(e.rank, e.world_size, e.master_addr, e.master_port, b"", timeout=30)
    if e.rank == 1:
        print("worker failing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(120)


def worker_nccl_collectives():
    import cupy as cp

    g = dist.init_process_group()
    r, N = g.rank, g.world_size
    for dtype in (np.float32, ck.bfloat16, np.float64, np.int32):
        for n in (1, 3, 1000, 65537, (1 << 20) + 5):
            ins = [_inputs(k, n, dtype, seed=n) for k in range(N)]
            ops = ("sum", "max") if np.dtype(dtype).kind == "i" else ("sum", "avg", "max")
            for op in ops:
                want = _chain(ins, dtype, op, N)
                x = cp.asarray(ins[r])
                g.all_reduce(x, op)
                got = x.get()
                assert np.array_equal(got, want), f"all_reduce {op} {np.dtype(dtype)} n={n}"
                out = cp.full(n + 1, np.nan if np.dtype(dtype).kind == "f" else -1, dtype=dtype)[1:]  # misaligned
                g.all_reduce(cp.asarray(ins[r]), op, out=out)
                assert np.array_equal(out.get(), want), f"all_reduce(out=) {op} {np.dtype(dtype)} n={n}"
        for n in (1, 67, 4097):
            ins = [_inputs(k, N * n, dtype, seed=7 + n) for k in range(N)]
            want = _chain(ins, dtype, "sum", N)
            send = cp.asarray(ins[r])
            recv = cp.full(n, -1, dtype=dtype)
            g.reduce_scatter(send, recv)
            assert np.array_equal(recv.get(), want[r * n:(r + 1) * n]), f"reduce_scatter {np.dtype(dtype)} {n}"
            g.reduce_scatter(send, send[r * n:(r + 1) * n])  # in place
            assert np.array_equal(send[r * n:(r + 1) * n].get(), want[r * n:(r + 1) * n])
            gathered = cp.full(N * n, -1, dtype=dtype)
            g.all_gather(recv, gathered)
            assert np.array_equal(gathered.get(), want), f"all_gather {np.dtype(dtype)} {n}"
            g.all_gather(send[r * n:(r + 1) * n], send)  # in place
            assert np.array_equal(send.get(), want)
            b = cp.asarray(ins[r][:n])
            g.broadcast(b, root=1)
            assert np.array_equal(b.get(), ins[1][:n])
    g.barrier()
    # captured: the same all_reduce replayed from a CUDA graph sees new values each replay
    x = cp.zeros(4096, dtype=np.float32)
    y = cp.zeros(4096, dtype=np.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        g.all_reduce(x, out=y)  # warm-up (NCCL sets up its buffers outside the capture)
        s.synchronize()
        s.begin_capture()
        g.all_reduce(x, out=y)
        graph = s.end_capture()
    for k in range(3):
        x.fill(float(r + 10 * k))
        cp.cuda.get_current_stream().synchronize()
        graph.launch(s)
        s.synchronize()
        assert float(y[0].get()) == sum(q + 10 * k for q in range(N)), f"graph replay {k}"
    g.barrier()
    assert g.captured == 1, g.captured  # the captured all_reduce (the warm-up one ran eagerly)
    # NCCL destroys a communicator only once every graph that captured one of its collectives is gone (session 3
    # hung here for 60 s with the graph still alive): drop it first, then the teardown is prompt and complete.
    del graph
    t0 = time.monotonic()
    dist.destroy_process_group()
    assert not g.leaked and time.monotonic() - t0 < 30, (g.leaked, time.monotonic() - t0)
    print("OK nccl_collectives")


def worker_nccl_graph_alive():
    """A graph that captured a collective is still alive at destroy_process_group(): the communicator is left to
    the process exit with a note (no hang), and the process exits 0."""
    import cupy as cp

    g = dist.init_process_group()
    x = cp.ones(1024, dtype=np.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        g.all_reduce(x)
        s.synchronize()
        s.begin_capture()
        g.all_reduce(x)
        graph = s.end_capture()
    graph.launch(s)
    s.synchronize()
    assert float(x[0].get()) == g.world_size ** 2
    t0 = time.monotonic()
    dist.destroy_process_group()  # graph still referenced here
    assert g.leaked and time.monotonic() - t0 < 30
    graph.launch(s)  # the communicator was not destroyed: the graph still runs
    s.synchronize()
    assert float(x[0].get()) == g.world_size ** 3
    print("OK nccl_graph_alive")


def worker_nccl_killed():
    import signal

    import cupy as cp
    g = dist.init_process_group()
    x = cp.ones(1 << 20, dtype=np.float32)
    g.all_reduce(x)
    cp.cuda.get_current_stream().synchronize()
    if g.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(1000):  # rank 0 keeps calling collectives that can never complete
        g.all_reduce(x)
        cp.cuda.get_current_stream().synchronize()


if __name__ == "__main__":
    globals()["worker_" + sys.argv[1]]()
