"""Hostile and careless peers (issue #9, section 3b).

The test process plays the peer with a raw socket, speaking the handshake of mpi4dask.comm
(length-prefixed JSON) as a stranger would after reading its docstring; the servers are real
processes (tests/jobs/hostile_job.py), under mpiexec where the attack needs a job.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import MPIEXEC, Background
from jobs._stranger import recv_hs, send_hs
from mpi4dask.comm import PROTOCOL_VERSION

JOB = str(Path(__file__).parent / "jobs" / "hostile_job.py")

pytestmark = pytest.mark.timeout(150)


def wait_for(path: Path, job: Background, timeout: float = 60) -> tuple[str, int]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if job.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no address from {job.cmd}: {job.output()}")
        time.sleep(0.05)
    host, port = path.read_text().removeprefix("mpi://").rsplit(":", 1)
    return host, int(port)


def hello(**claims) -> dict:
    msg = {"magic": "mpi4dask", "version": PROTOCOL_VERSION, "rank": 0, "size": 1, "job": "", "host": "stranger",
           "pid": 1, "nonce": os.urandom(16).hex(), "up": True, "cluster": "", "ident": "stranger"}
    msg.update(claims)
    return msg


def closed_by_peer(sock: socket.socket, timeout: float, *, silent: bool = True) -> float:
    """Seconds until the peer closes ``sock``; fails if it stays open, or with ``silent`` if it
    sends anything (else what it sends, such as distributed's own handshake, is read and dropped)."""
    t0 = time.monotonic()
    while True:
        sock.settimeout(max(t0 + timeout - time.monotonic(), 0.01))
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            data = b""
        except TimeoutError:
            pytest.fail(f"the server kept the connection open for {timeout} s")
        if not data:
            return time.monotonic() - t0
        assert not silent, f"the server answered {data!r}"


def test_impostor_claiming_a_rank_of_the_job_gets_nothing_over_mpi(tmp_path):
    """A stranger learns the job's identity, claims to be rank 1 and says it sent its proof: the
    listener sends nothing over MPI on its behalf, refuses it (logged), and the real rank 1's
    connection gets exactly its own replies (it used to read the server's handshake and every
    later reply one message late)."""
    addr = tmp_path / "addr"
    env = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "4s"}
    with Background([MPIEXEC, "-n", "2", sys.executable, JOB, "pair", str(addr), "40"], env=env) as job:
        host, port = wait_for(addr, job)
        with socket.create_connection((host, port), timeout=20) as probe:  # anyone may learn this
            send_hs(probe, hello())
            server = recv_hs(probe)
        assert server["size"] == 2 and server["rank"] == 0 and server["job"], server
        with socket.create_connection((host, port), timeout=20) as s:
            send_hs(s, hello(rank=1, size=2, job=server["job"], host=server["host"], pid=4242))
            reply = recv_hs(s)
            assert reply["mpi"] is True  # the claims pass the cheap checks: only MPI can tell
            send_hs(s, {"magic": "mpi4dask", "proof": "sent"})
            took = closed_by_peer(s, timeout=30)
        assert took < 15, took
        assert job.wait(90) == 0, job.output()
        out, err = job.output()
    assert "RANK1 OK replies=40 stray_proofs=0" in out, out + err
    assert "refused the connection" in err and "claims to be rank 1 of this MPI job" in err, err


def _socket_mode_peer(host: str, port: int) -> socket.socket:
    s = socket.create_connection((host, port), timeout=20)
    send_hs(s, hello())
    assert recv_hs(s)["mpi"] is False  # a world of one elsewhere: the socket carries the messages
    send_hs(s, {"magic": "mpi4dask", "proof": "none"})
    assert recv_hs(s)["verdict"] == "socket"
    return s


def _frame_header(*sizes: int, fast: bool = False) -> bytes:
    """A message record (mpi4dask._wire) whose frames all follow on the socket; ``fast``: in mpi4dask's own
    format (the FAST bit)."""
    count = len(sizes) | (1 << 31 if fast else 0)
    return b"F" + struct.pack("<I", count) + struct.pack(f"<{len(sizes)}Q", *sizes) + bytes(len(sizes))


def _serves_on_then_stops(host: str, port: int, srv: Background, addr: Path) -> tuple[str, str]:
    """Check that the echo server answers a new peer's hello, stop it, and return its (stdout, stderr)."""
    with socket.create_connection((host, port), timeout=20) as s:
        send_hs(s, hello())
        assert recv_hs(s)["magic"] == "mpi4dask"
    Path(f"{addr}.stop").touch()
    srv.wait(30)
    return srv.output()


def test_announced_sizes_are_bounded_before_anything_is_allocated(tmp_path):
    """1 TiB announced: refused at once with a clear log, no MemoryError; 8 GiB announced and then
    nothing sent: closed after distributed.comm.timeouts.tcp; the listener serves on."""
    addr = tmp_path / "addr"
    env = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "2s"}
    with Background([sys.executable, JOB, "echo", str(addr)], env=env) as srv:
        host, port = wait_for(addr, srv)
        proc = psutil.Process(srv.proc.pid)
        with _socket_mode_peer(host, port) as s:
            s.sendall(_frame_header(1 << 40))
            assert closed_by_peer(s, timeout=10, silent=False) < 5
        with _socket_mode_peer(host, port) as s:
            s.sendall(_frame_header(8 << 30) + b"x" * 1000)
            assert 1.5 < closed_by_peer(s, timeout=20, silent=False) < 12
        with _socket_mode_peer(host, port) as s:
            s.sendall(b"F" + struct.pack("<I", 0x7FFFFFFF))  # 2 billion frames: 16 GiB of sizes to follow
            assert closed_by_peer(s, timeout=10, silent=False) < 5
        assert proc.memory_info().rss < 500 << 20
        out, err = _serves_on_then_stops(host, port, srv, addr)
    assert "announced a message of 1 frames and 1099511627776 bytes" in err, err
    assert "announced a message of 1073741823 frames" in err, err  # 0x7FFFFFFF less the FAST and JOINED bits
    assert "no byte of the message in progress for 2 s" in err, err
    assert "MemoryError" not in err and "Traceback" not in err, err


def test_silent_connections_cost_little_and_give_it_back(tmp_path):
    """500 connections that never say a word (each pending handshake used to hold a 64 KiB buffer:
    35 MB, and 24 MB stayed after they were dropped)."""
    addr = tmp_path / "addr"
    with Background([sys.executable, JOB, "echo", str(addr)]) as srv:
        host, port = wait_for(addr, srv)
        proc = psutil.Process(srv.proc.pid)
        with socket.create_connection((host, port), timeout=20) as s:  # warm up: MPI and asyncio set up
            send_hs(s, hello())
            recv_hs(s)
        time.sleep(0.5)
        before = proc.memory_info().rss
        socks = [socket.create_connection((host, port), timeout=20) for _ in range(500)]
        time.sleep(2)
        during = proc.memory_info().rss
        for s in socks:
            s.close()
        time.sleep(2)
        after = proc.memory_info().rss
        (tmp_path / "addr.stop").touch()
        srv.wait(30)
    mib = 1 << 20
    assert during - before < 10 * mib, f"500 silent connections cost {(during - before) / mib:.1f} MiB"
    assert after - before < 5 * mib, f"{(after - before) / mib:.1f} MiB stayed after they were dropped"


def test_a_first_message_that_is_no_distributed_handshake_closes_the_connection_with_one_line(tmp_path):
    """After mpi4dask's handshake, distributed's comes: a peer whose first message is no message of
    distributed's (no frames at all, or frames of garbage, in mpi4dask's fast format and in distributed's)
    has its connection closed at once, with one line in the log that names it and what was wrong; no
    asyncio "Task exception was never retrieved" (what a message of no frames and undecodable frames each
    left), and the listener serves on."""
    addr = tmp_path / "addr"
    with Background([sys.executable, JOB, "echo", str(addr)]) as srv:
        host, port = wait_for(addr, srv)
        rng = np.random.default_rng(3)
        garbage = rng.integers(0, 256, 300, dtype=np.uint8).tobytes()
        for record in (
            _frame_header(),  # a message of no frames
            _frame_header(len(garbage)) + garbage,
            _frame_header(len(garbage), fast=True) + garbage,
            _frame_header(10, len(garbage)) + b"\x92\x01" + bytes(8) + garbage,  # msgpack that says more follows
        ):
            with _socket_mode_peer(host, port) as s:
                s.sendall(record)
                assert closed_by_peer(s, timeout=10, silent=False) < 5
        out, err = _serves_on_then_stops(host, port, srv, addr)
    assert "never retrieved" not in err, err
    assert err.count("the peer sent a message record of no frames; closing the connection") == 1, err
    assert err.count("its first message is no distributed handshake") == 3, err
