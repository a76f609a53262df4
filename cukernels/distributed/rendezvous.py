"""A small TCP rendezvous: every rank hands rank 0 a few bytes, and every rank gets all of them back.

It is how the ranks agree on the NCCL unique id (rank 0's payload) before ``ncclCommInitRank``, and it is all a
CPU test needs to check a launcher. Rank 0 listens on ``MASTER_ADDR:MASTER_PORT``; the other ranks connect (with
retries: rank 0 may start later) and say who they are; once all ``world_size - 1`` have arrived rank 0 answers
each of them with every rank's payload, in rank order, and closes. Nothing waits forever: after ``timeout``
seconds rank 0 raises :class:`RendezvousTimeout` naming the address and which ranks arrived (and tells the ranks
that did arrive the same), and a rank that cannot reach rank 0 raises with the address and the last connection
error. Inconsistent ranks (another world size, a duplicate rank) end the rendezvous with a
:class:`RendezvousError` on every rank that is connected.

Wire format: one frame each way, a 4-byte big-endian length then UTF-8 JSON (payloads in hex); frames over 1 MiB
or without the magic string are refused (a port scanner or a stale client is dropped, not trusted).
"""
from __future__ import annotations

import ipaddress
import json
import selectors
import socket
import struct
import time

MAGIC = "cukernels-rendezvous-1"
MAX_FRAME = 1 << 20


class RendezvousError(RuntimeError):
    """The rendezvous failed: inconsistent ranks, rank 0 unable to listen, or rank 0 gone mid-way."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """Not every rank arrived (or rank 0 could not be reached) within the timeout."""


def _send(sock, obj):
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock, n, deadline):
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("timed out")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def _recv(sock, deadline):
    (n,) = struct.unpack("!I", _recv_exact(sock, 4, deadline))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes (more than {MAX_FRAME}): not a cukernels rendezvous peer")
    return json.loads(_recv_exact(sock, n, deadline).decode())


def _is_loopback(addr):
    try:
        infos = socket.getaddrinfo(addr, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _listen(addr, port):
    """Rank 0's server socket: on the loopback address itself when MASTER_ADDR is local (tests, one host),
    else on every interface (MASTER_ADDR is this host's name as the other hosts see it)."""
    try:
        if _is_loopback(addr):
            fam = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
            return socket.create_server((addr, port), family=fam, backlog=128)
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
        return socket.create_server(("", port), backlog=128)
    except OSError as e:
        raise RendezvousError(f"rendezvous: rank 0 could not listen on {addr}:{port}: {e} (is another run using "
                              f"this MASTER_PORT? pick another one)") from e


def rendezvous(rank, world_size, addr, port, payload=b"", *, timeout=300.0):
    """Exchange ``payload`` (bytes, at most a few hundred KiB) between ``world_size`` ranks through rank 0 at
    ``addr:port``. Returns the list of every rank's payload, index = rank, on every rank.

    Raises :class:`RendezvousTimeout` when not everyone arrived within ``timeout`` seconds (the message names
    the address, how many ranks arrived and which are missing) and :class:`RendezvousError` on inconsistent
    ranks. ``world_size == 1`` returns ``[payload]`` without touching the network.

    Example::

        >>> ids = rendezvous(rank, world, "127.0.0.1", 29500, payload=nccl_id if rank == 0 else b"")
        >>> nccl_id = ids[0]
    """
    if not isinstance(payload, (bytes, bytearray)):
        raise TypeError(f"payload: expected bytes; got {type(payload).__name__}")
    rank, world_size, port = int(rank), int(world_size), int(port)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank, world_size: expected 0 <= rank < world_size; got {rank}, {world_size}")
    if not timeout > 0:
        raise ValueError(f"timeout: expected a number of seconds > 0; got {timeout!r}")
    if world_size == 1:
        return [bytes(payload)]
    deadline = time.monotonic() + float(timeout)
    if rank == 0:
        return _serve(world_size, addr, port, bytes(payload), deadline, timeout)
    return _join(rank, world_size, addr, port, bytes(payload), deadline, timeout)


def _serve(world_size, addr, port, payload, deadline, timeout):
    server = _listen(addr, port)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ, None)
    arrived = {}  # rank -> (socket, payload)
    partial = {}  # socket -> (bytearray received so far)

    def fail(exc):
        for s, _ in arrived.values():
            try:
                _send(s, {"ok": False, "error": str(exc)})
            except OSError:
                pass
        raise exc

    try:
        while len(arrived) < world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(1, world_size) if r not in arrived]
                fail(RendezvousTimeout(
                    f"rendezvous on {addr}:{port} timed out after {timeout:g} s: {len(arrived) + 1} of {world_size} "
                    f"ranks arrived (rank 0{''.join(f', {r}' for r in sorted(arrived))}); missing rank(s) "
                    f"{', '.join(map(str, missing[:16]))}{' ...' if len(missing) > 16 else ''}. Did every rank start "
                    f"with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?"))
            for key, _ in sel.select(timeout=min(left, 0.5)):
                if key.data is None:  # a new connection
                    try:
                        conn, _ = server.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    partial[conn] = bytearray()
                    sel.register(conn, selectors.EVENT_READ, "peer")
                    continue
                conn = key.fileobj
                try:
                    chunk = conn.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                buf = partial.get(conn)
                if not chunk or buf is None:
                    sel.unregister(conn)
                    partial.pop(conn, None)
                    conn.close()  # a peer that left before saying who it is: forget it
                    continue
                buf += chunk
                if len(buf) < 4:
                    continue
                (n,) = struct.unpack("!I", bytes(buf[:4]))
                if n > MAX_FRAME:
                    sel.unregister(conn)
                    partial.pop(conn)
                    conn.close()
                    continue
                if len(buf) < 4 + n:
                    continue
                sel.unregister(conn)
                partial.pop(conn)
                try:
                    hello = json.loads(bytes(buf[4:4 + n]).decode())
                    ok = isinstance(hello, dict) and hello.get("magic") == MAGIC
                except (ValueError, UnicodeDecodeError):
                    ok = False
                if not ok:
                    conn.close()  # not one of ours
                    continue
                conn.setblocking(True)
                r, ws = hello.get("rank"), hello.get("world_size")
                if ws != world_size:
                    arrived[-1] = (conn, b"")
                    fail(RendezvousError(f"rendezvous on {addr}:{port}: rank {r} says WORLD_SIZE={ws}, rank 0 says "
                                         f"{world_size}; every rank must be started with the same world size"))
                if not isinstance(r, int) or not 1 <= r < world_size:
                    arrived[-1] = (conn, b"")
                    fail(RendezvousError(f"rendezvous on {addr}:{port}: a peer says it is rank {r!r}; expected "
                                         f"1..{world_size - 1}"))
                if r in arrived:
                    arrived[-1] = (conn, b"")
                    fail(RendezvousError(f"rendezvous on {addr}:{port}: rank {r} arrived twice; two processes were "
                                         f"given the same RANK"))
                arrived[r] = (conn, bytes.fromhex(hello.get("payload", "")))
        payloads = [payload] + [arrived[r][1] for r in range(1, world_size)]
        answer = {"ok": True, "payloads": [p.hex() for p in payloads]}
        for r in range(1, world_size):
            s = arrived[r][0]
            try:
                s.settimeout(max(1.0, deadline - time.monotonic()))
                _send(s, answer)
            except OSError as e:
                raise RendezvousError(f"rendezvous on {addr}:{port}: rank {r} left before it got the answer "
                                      f"({e})") from e
        return payloads
    finally:
        for s, _ in arrived.values():
            s.close()
        for s in partial:
            s.close()
        sel.close()
        server.close()


def _join(rank, world_size, addr, port, payload, deadline, timeout):
    last, delay = None, 0.05
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousTimeout(
                f"rendezvous: rank {rank} could not reach rank 0 at {addr}:{port} within {timeout:g} s (last "
                f"error: {last}). Is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?")
        try:
            sock = socket.create_connection((addr, port), timeout=min(left, 5.0))
            break
        except OSError as e:
            last = e
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        _send(sock, {"magic": MAGIC, "rank": rank, "world_size": world_size, "payload": payload.hex()})
        # Rank 0 answers when everyone arrived, or with its own timeout message: wait a little longer than it.
        try:
            answer = _recv(sock, deadline + 5.0)
        except socket.timeout:
            raise RendezvousTimeout(
                f"rendezvous: rank {rank} reached rank 0 at {addr}:{port} but got no answer within {timeout:g} s "
                f"(rank 0 is still waiting for the other ranks)") from None
        except (ConnectionError, OSError, ValueError) as e:
            raise RendezvousError(f"rendezvous: rank {rank} lost rank 0 at {addr}:{port} before the answer "
                                  f"({e}); did rank 0 fail?") from e
    finally:
        sock.close()
    if not answer.get("ok"):
        msg = answer.get("error", "unknown error")
        cls = RendezvousTimeout if "timed out" in msg else RendezvousError
        raise cls(f"rank {rank}: {msg}")
    payloads = [bytes.fromhex(h) for h in answer["payloads"]]
    if len(payloads) != world_size:
        raise RendezvousError(f"rendezvous: rank 0 at {addr}:{port} answered with {len(payloads)} payloads; expected "
                              f"{world_size}")
    return payloads
