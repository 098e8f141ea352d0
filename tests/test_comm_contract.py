"""distributed's comm contract, as its own tests check it, in one process (issue #9, section 3).

Each test states what distributed's TCP comm does, checks it of tcp:// too where that is cheap
(so the expectation is the contract, not this backend's habit), and then of mpi://.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import socket
import subprocess
import sys
import time
import warnings
import weakref
from pathlib import Path

import numpy as np
import pytest
from distributed.comm import CommClosedError, connect, listen, parse_address
from distributed.comm.registry import get_backend
from distributed.protocol import to_serialize

from conftest import echo, run

pytestmark = pytest.mark.timeout(120)
JOBS = Path(__file__).parent / "jobs"


async def closes_by_itself(comm, seconds: float = 2.0) -> bool:
    """Whether ``comm.closed()`` turns True within ``seconds``, with no read or write."""
    for _ in range(int(seconds / 0.01)):
        if comm.closed():
            return True
        await asyncio.sleep(0.01)
    return comm.closed()


@contextlib.contextmanager
def log_records(name: str):
    """The records that logger ``name`` gets while the block runs, in a list that fills as they come."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger(name)
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
def test_after_the_peer_closed_a_failed_read_closes_the_comm(scheme):
    async def main():
        async def server(comm):
            await comm.close()

        listener = listen(f"{scheme}://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        with pytest.raises(CommClosedError):
            await comm.read()
        assert comm.closed()
        assert "closed" in repr(comm) or scheme == "tcp"  # the repr of tcp:// says nothing of its state
        with pytest.raises(CommClosedError):
            await comm.write({"x": 1})  # at once: no write succeeds after a failed read
        listener.stop()

    run(main())


@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
def test_cancelled_read_aborts_the_comm(scheme):
    async def main():
        listener = listen(f"{scheme}://127.0.0.1:0", echo)
        await listener.start()
        comm = await connect(listener.contact_address)
        reader = asyncio.ensure_future(comm.read())
        await asyncio.sleep(0.1)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert comm.closed()
        listener.stop()

    run(main())


@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
@pytest.mark.parametrize("how", ["beside_an_array", "serialized"])
def test_an_object_that_cannot_be_serialized_raises_and_leaves_the_comm_usable(scheme, how):
    """Serialisation comes before anything is written: distributed's TCP comm raises what it raised and
    stays usable (its write aborts only once it has begun to send).  ``beside_an_array``: the bad object
    in a message whose array mpi4dask would encode itself (the object sends the message on to
    distributed's serialisation); ``serialized``: a ``to_serialize`` of the bad object."""

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this on purpose")

    async def main():
        listener = listen(f"{scheme}://127.0.0.1:0", echo)
        await listener.start()
        comm = await connect(listener.contact_address)
        bad = {"x": Unpicklable()} if how == "beside_an_array" else {"x": to_serialize(Unpicklable())}
        if how == "beside_an_array":
            bad["a"] = to_serialize(np.arange(10))
        with pytest.raises(TypeError, match="on purpose|Could not serialize object of type Unpicklable"):
            await comm.write(bad, on_error="raise")
        assert not comm.closed()
        a = np.random.default_rng(7).integers(0, 255, 3 << 20, dtype=np.uint8)  # large: MPI carries it
        await comm.write({"x": to_serialize(a)})
        got = await comm.read()
        assert hashlib.sha256(np.asarray(got["x"]).tobytes()).digest() == hashlib.sha256(a.tobytes()).digest()
        await comm.close()
        listener.stop()

    run(main())


@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
def test_a_writer_that_never_reads_finds_out_that_the_peer_closed(scheme):
    """distributed's scheduler serves a ``feed`` (a progress bar's) by writing at an interval and never
    reading, until a write raises; then it runs the feed's teardown.  Over tcp:// a write raises once
    the peer has closed (the second after its close: the first draws the peer's reset).  Over mpi://
    writes after the peer's goodbye were dropped for ever: the loop, and what it held, lived on."""

    async def main():
        ended = asyncio.get_running_loop().create_future()

        async def feed(comm):
            await comm.read()
            i = 0
            try:
                while True:
                    await comm.write({"i": i, "x": to_serialize(np.full(1 << 18, i % 251, dtype=np.uint8))})
                    i += 1
                    await asyncio.sleep(0.01)
            except CommClosedError as exc:
                ended.set_result((time.monotonic(), exc))

        listener = listen(f"{scheme}://127.0.0.1:0", feed)
        await listener.start()
        comm = await connect(listener.contact_address)
        await comm.write({"op": "feed"})
        for i in range(3):
            got = await comm.read()
            assert got["i"] == i and np.all(np.asarray(got["x"]) == i % 251)
        await comm.close()
        closed = time.monotonic()
        when, exc = await asyncio.wait_for(ended, 10)
        assert when - closed < 2.0, when - closed
        listener.stop()

    run(main())


def test_comm_dropped_without_close_is_collected_and_closes_its_socket(caplog):
    async def main():
        ended = asyncio.Event()

        async def server(comm):
            await echo(comm)  # returns when the client's socket goes away
            ended.set()

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        assert comm.uses_mpi  # its receiver and sender moved MPI frames
        big = np.arange(1 << 20, dtype="u8")
        await comm.write(["hello", to_serialize(big)])
        got = await comm.read()
        assert got[0] == "hello" and (got[1] == big).all()
        ref = weakref.ref(comm)
        del comm
        # as tcp://'s: collected when the last reference goes, with no cycle left for a garbage collection
        # (distributed's gen_test finds a comm still open at the end of a test and fails it)
        assert ref() is None, gc.get_referrers(ref())
        await asyncio.wait_for(ended.wait(), 10)  # the server saw the socket close
        listener.stop()

    gc.disable()
    try:
        with caplog.at_level("WARNING", logger="mpi4dask._datapath"):
            run(main())
    finally:
        gc.enable()
    assert "closing dangling comm" in caplog.text


def test_listener_stop_leaves_established_comms_alone():
    """distributed's ``check_listener_stop``-like race: a client whose connect() returned keeps its
    connection when the listener stops right then (tcp://: 0 lost in 50)."""

    async def main():
        lost = 0
        for _ in range(50):
            listener = listen("mpi://127.0.0.1:0", echo)
            await listener.start()
            comm = await connect(listener.contact_address)
            listener.stop()
            try:
                await comm.write("still here")
                assert await asyncio.wait_for(comm.read(), 5) == "still here"
            except CommClosedError:
                lost += 1
            await comm.close()
        assert lost == 0, f"{lost} of 50 connections lost"

    run(main(), timeout=90)


@pytest.mark.skipif(not _has_ipv6(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("address", ["mpi://", "mpi://:0"])
def test_wildcard_listener_accepts_ipv4_and_ipv6(address):
    async def main():
        listener = listen(address, echo)
        await listener.start()
        port = listener.get_host_port()[1]
        for host in ("127.0.0.1", "[::1]"):
            comm = await connect(f"mpi://{host}:{port}", timeout=5)
            await comm.write(host)
            assert await comm.read() == host
            await comm.close()
        listener.stop()

    run(main())


@pytest.mark.skipif(not _has_ipv6(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
def test_server_listen_reaches_ipv6_as_tcp_does(scheme):
    """The IPv6 half of distributed's test_server_listen, whose helpers (distributed.utils_test's
    assert_can_connect_from_everywhere_4[_6]) fail on any machine with IPv6 (a deprecated get_ipv6 under
    warnings-as-errors, then ``list.extend`` given two arguments), for tcp:// as for mpi://: distributed's
    Linux CI runs them with DISABLE_IPV6=1 (distributed#4514), so this project checks that half itself."""
    from distributed.core import Server
    from distributed.utils import get_ip

    ip6 = get_ip("2001:4860:4860::8888")  # the machine's IPv6 address (distributed's get_ipv6, not deprecated)

    async def reaches(address) -> bool:
        try:
            comm = await connect(address, timeout=2)
        except OSError:
            return False
        comm.abort()
        return True

    async def main():
        for listen_on, v4, v6 in [(f"{scheme}://:0", True, True), (f"{scheme}://0.0.0.0:0", True, False)]:
            server = Server({})
            await server.listen(listen_on)
            try:
                port = server.port
                for host in ("127.0.0.1", get_ip()):
                    assert await reaches(f"{scheme}://{host}:{port}") == v4, (listen_on, host)
                for host in ("::1", ip6):
                    assert await reaches(f"{scheme}://[{host}]:{port}") == v6, (listen_on, host)
            finally:
                server.stop()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(main())


def test_address_helpers_take_what_tcp_takes():
    mpi, tcp = get_backend("mpi"), get_backend("tcp")
    for loc in ("127.0.0.1:0", "[::1]:0", ":8786", "127.0.0.1:8786"):
        assert mpi.get_address_host_port(loc) == tcp.get_address_host_port(loc), loc
        assert mpi.get_address_host(loc) == tcp.get_address_host(loc), loc
        assert mpi.resolve_address(loc) == tcp.resolve_address(loc), loc
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # distributed's get_ipv6 is deprecated: no warning from us
        assert mpi.get_local_address_for("[::1]:8786") == tcp.get_local_address_for("[::1]:8786")
        assert mpi.get_local_address_for("127.0.0.1:8786") == tcp.get_local_address_for("127.0.0.1:8786")


def test_worker_dashboard_binds_to_the_workers_host():
    """With host='127.0.0.1' a worker's HTTP server listens on 127.0.0.1 only, as over tcp://."""
    out = subprocess.run([sys.executable, str(JOBS / "worker_http_host.py")], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr
    assert "HTTP ['127.0.0.1']" in out.stdout, out.stdout + out.stderr


def test_many_connections_leave_nothing_pending_in_mpi_at_exit():
    """Connections aborted with large messages in flight, reads cancelled, others still echoing at
    exit: MPICH reports no request left pending (it did: "has pending 40 references")."""
    out = subprocess.run([sys.executable, str(JOBS / "connections_pending_at_exit.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "DONE 20" in out.stdout, out.stdout + out.stderr
    assert "pending" not in out.stderr and "unmatched" not in out.stderr, out.stderr


def test_tcp_address_parser_refuses_nothing_the_listener_announces():
    """The contact address of an ephemeral wildcard listener round-trips through the helpers."""

    async def main():
        listener = listen("mpi://", echo)
        await listener.start()
        host, port = get_backend("mpi").get_address_host_port(parse_address(listener.contact_address)[1])
        assert port == listener.get_host_port()[1] and host
        listener.stop()

    run(main())


@pytest.mark.parametrize("scheme", ["tcp", "mpi", "mpi-alone"])
@pytest.mark.parametrize("how", ["each_serialized", "one_list"])
@pytest.mark.parametrize("sizes", [[16, 16], [256 << 10] * 16, [200_000] * 8, [300 << 10, 1 << 20, (5 << 20) + 3],
                                   [8 << 20] * 2], ids=["small", "16x256KiB", "8x200KB", "mixed", "2x8MiB"])
def test_objects_of_one_message_do_not_share_buffers(scheme, how, sizes):
    """distributed's ``test_do_not_share_buffers`` and P2P rechunk's
    ``test_rechunk_in_memory_shards_dont_share_buffer``: the arrays of one message arrive in buffers of
    their own, so one that lives on keeps only its own bytes alive.  Over mpi:// they once shared one:
    the small ones the header's message, then the large ones, which MPI carries (a run of frames joined
    into one MPI message included: 16 x 256 KiB), one receive buffer per message.  Through mpi4dask's
    fast path (arrays each in ``to_serialize``) and distributed's (one list in ``to_serialize``); over
    mpi:// with frames joined into few MPI messages (ranks of one world on one node, as here) and each
    alone (``mpi-alone``: as between worlds that Dask started, or across nodes)."""
    from distributed.protocol.utils_test import get_host_array

    rng = np.random.default_rng(len(sizes))
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]

    async def main():
        async def server(comm):
            if scheme == "mpi-alone":
                comm._link.joins = False
            await comm.read()
            if how == "each_serialized":
                await comm.write({"data": [to_serialize(a) for a in arrays]})
            else:
                await comm.write({"data": to_serialize(arrays)})
            await comm.close()

        listener = listen(f"{scheme.split('-')[0]}://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        await comm.write({"op": "ping"})
        msg = await comm.read()
        await comm.close()
        listener.stop()
        got = list(msg["data"])
        assert [hashlib.sha256(g).hexdigest() for g in got] == [hashlib.sha256(a).hexdigest() for a in arrays]
        hosts = [get_host_array(g) for g in got]
        assert len({id(h) for h in hosts}) == len(got), [type(h) for h in hosts]
        for g, h in zip(got, hosts):  # each holds its own bytes (and no more than a receive buffer's slack:
            held = memoryview(h).nbytes
            assert held <= g.nbytes * 1.25 + (2 << 20) + (64 << 10), (g.nbytes, held)  # _BufferPool)

    run(main())


@pytest.mark.parametrize("scheme", ["tcp", "mpi", "mpi-alone"])
def test_shards_of_one_large_frame_arrive_whole(scheme, monkeypatch, over_mpi_whatever_the_load):
    """distributed sends a frame larger than ``distributed.comm.shard`` as shards, and joins them at the
    reader, without a copy where they lie one after the other in one buffer.  Over mpi:// they do: its
    reader lays a frame's shards out in one receive buffer (the writer marks them, the last and short one
    too, which would otherwise ride the socket), whether the writer joins MPI frames or sends each alone;
    tcp:// reads each into a buffer of its own, and distributed copies them into one.  A 5 MiB + 3 B
    array, shards of 1 MiB (distributed reads the shard size once, at import: set here as it would be
    then), beside a second array."""
    from distributed.comm.tcp import TCP
    from distributed.protocol import utils as protocol_utils
    from distributed.protocol.utils_test import get_host_array

    from mpi4dask import _wire

    monkeypatch.setattr(protocol_utils, "BIG_BYTES_SHARD_SIZE", 1 << 20)
    monkeypatch.setattr(TCP, "max_shard_size", 1 << 20)
    routed = []
    frame_routes = _wire.frame_routes
    monkeypatch.setattr(_wire, "frame_routes", lambda *a: routed.append(frame_routes(*a)) or routed[-1])
    rng = np.random.default_rng(5)
    big, other = rng.integers(0, 256, (5 << 20) + 3, dtype=np.uint8), rng.integers(0, 256, 1 << 20, dtype=np.uint8)

    async def main():
        async def server(comm):
            if scheme == "mpi-alone":
                comm._link.joins = False
            await comm.read()
            await comm.write({"data": to_serialize([big, other])})
            await comm.close()

        listener = listen(f"{scheme.split('-')[0]}://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        await comm.write({"op": "ping"})
        msg = await comm.read()
        stats = getattr(comm, "stats", None)
        await comm.close()
        listener.stop()
        a, b = msg["data"]
        assert hashlib.sha256(a).digest() == hashlib.sha256(big).digest()
        assert hashlib.sha256(b).digest() == hashlib.sha256(other).digest()
        assert get_host_array(a) is not get_host_array(b)
        if scheme != "tcp":
            # sent as shards (the reply's routes: the 5 MiB one's first shard, 5 more, the other array) ...
            assert [r for r in routed if _wire.VIA_MPI_SHARD in r] == [
                [_wire.VIA_SOCKET, _wire.VIA_SOCKET, _wire.VIA_MPI] + [_wire.VIA_MPI_SHARD] * 5 + [_wire.VIA_MPI]
            ], routed
            # ... all of it over MPI (the short last shard too), and received in place: the array lies in one
            # of mpi4dask's receive buffers (aligned: larger than what it holds), not in a copy distributed made
            assert stats["mpi_bytes_received"] == big.nbytes + other.nbytes, stats
            assert get_host_array(a).nbytes > a.nbytes

    run(main())


@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
def test_listener_stopped_during_accept_fails_connect_at_once(scheme):
    """distributed's ``test_stop_listener_during_handle_stream``-like check: a listener stopped
    while it accepts drops the connection, and connect() raises CommClosedError at once (no
    retrying until the connect timeout)."""

    async def main():
        listener = listen(f"{scheme}://127.0.0.1:0", echo)
        await listener.start()
        if scheme == "tcp":
            orig = listener._handle_stream

            async def stop_then(stream, address):
                listener.stop()
                await orig(stream, address)

            listener.tcp_server.handle_stream = stop_then
        else:
            orig = listener._accept

            async def stop_then(ch):
                listener.stop()
                await orig(ch)

            listener._accept = stop_then
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(connect(listener.contact_address, timeout=30), 5)

    run(main())


@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
def test_worker_without_host_advertises_the_interface_that_reaches_its_scheduler(scheme):
    """distributed passes a Worker's listener ``default_host`` only for tcp/tls; an mpi:// worker
    started without a host still advertises the interface towards its scheduler (127.0.0.1 here),
    not the machine's default route (distributed's ``test_unrunnable_task_runs`` depends on it)."""
    out = subprocess.run([sys.executable, str(JOBS / "worker_default_host.py"), scheme], capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert f"WORKER {scheme}://127.0.0.1:" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
def test_a_peer_that_aborts_closes_the_comm_and_writes_raise(scheme):
    """The peer aborts (no goodbye): ``closed()`` turns True by itself and writes raise."""

    async def main():
        async def server(comm):
            comm.abort()

        listener = listen(f"{scheme}://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        assert await closes_by_itself(comm)
        with pytest.raises(CommClosedError):
            await comm.write({"x": 1})
        listener.stop()

    run(main())


@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
def test_closed_turns_true_by_itself_after_the_peer_closes(scheme):
    """A pooled comm whose peer closed it must look closed without a read (distributed's
    ConnectionPool drops such comms instead of reusing them), once nothing is left to read."""

    async def main():
        async def server(comm):
            await comm.write("last words")
            await comm.close()

        listener = listen(f"{scheme}://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        assert await comm.read() == "last words"  # what was sent before the goodbye is read
        assert await closes_by_itself(comm)
        with pytest.raises(CommClosedError):
            await comm.read()
        listener.stop()

    run(main())


def test_a_batched_write_racing_an_abort_is_logged_as_tcp_logs_it():
    """distributed's ``BatchedSend`` starts its write as a task; a comm aborted before that task runs
    (the scheduler aborts a worker's stream when the worker's 'close-stream' arrives) makes the write
    raise, and distributed logs "Batched Comm Closed" with a traceback at INFO.  tcp:// does so at
    the same loop turn as mpi:// (so a shutdown log showing it is distributed's race, not mpi://'s)."""

    from distributed.batched import BatchedSend

    async def one(scheme: str, turns: int) -> bool:
        async def drain(comm):
            try:
                while True:
                    await comm.read()
            except CommClosedError:
                pass

        listener = listen(f"{scheme}://127.0.0.1:0", drain)
        await listener.start()
        comm = await connect(listener.contact_address)
        batched = BatchedSend(interval="1ms")
        batched.start(comm)
        await asyncio.sleep(0.05)
        batched.send({"op": "x"})
        for _ in range(turns):
            await asyncio.sleep(0)
        batched.abort()
        await asyncio.sleep(0.05)
        logged = [r for r in records if r.getMessage().startswith("Batched Comm Closed")]
        records.clear()
        await comm.close()
        listener.stop()
        assert all(r.exc_info and issubclass(r.exc_info[0], CommClosedError) for r in logged), logged
        return bool(logged)

    with log_records("distributed.batched") as records:
        raced = {scheme: [run(one(scheme, turns)) for turns in range(5)] for scheme in ("tcp", "mpi")}
    assert any(raced["tcp"]), f"the race was not reproduced on tcp://: {raced}"
    assert raced["mpi"] == raced["tcp"], raced


@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
def test_a_heartbeat_in_flight_when_the_scheduler_closes_is_logged_as_tcp_logs_it(scheme):
    """A worker's heartbeat that the scheduler has not answered when it closes: the scheduler's
    ``Server.close`` cancels the handler and aborts the comm the heartbeat came on, the worker's read
    raises ``CommClosedError`` and distributed logs "Failed to communicate with scheduler during
    heartbeat." with its traceback at ERROR -- on tcp:// as on mpi:// (a worker of a job whose client
    shuts the cluster down can log it: a shutdown log showing it is distributed's race, not mpi://'s).
    The scheduler holds its answer here, so the race is taken every time."""

    from distributed import Scheduler, Worker

    async def main() -> list[logging.LogRecord]:
        s = await Scheduler(protocol=scheme, host="127.0.0.1", port=0, dashboard_address=":0")
        w = await Worker(s.address, nthreads=1, dashboard_address=":0")
        held = asyncio.Event()

        async def hold(**_):
            held.set()
            await asyncio.sleep(60)

        s.handlers["heartbeat_worker"] = hold
        beat = asyncio.ensure_future(w.heartbeat())
        await asyncio.wait_for(held.wait(), 10)
        await s.close()
        await asyncio.wait_for(beat, 10)  # logged, not raised
        await w.close()
        return [r for r in records if r.getMessage().startswith("Failed to communicate with scheduler")]

    with log_records("distributed.worker") as records:
        logged = run(main())
    assert logged, f"the race was not reproduced on {scheme}://"
    assert all(r.exc_info and issubclass(r.exc_info[0], CommClosedError) for r in logged), logged


@pytest.mark.parametrize("scheme", ["tcp", "mpi"])
def test_a_heartbeat_connecting_when_its_worker_closes_is_logged_as_tcp_logs_it(scheme):
    """A worker's heartbeat whose connection to the scheduler is still being made when the worker closes:
    the worker's ``ConnectionPool.close`` cancels the connect, the pool raises ``CommClosedError:
    ConnectionPool closing.`` and distributed logs "Failed to communicate with scheduler during heartbeat."
    with its traceback at ERROR -- on tcp:// as on mpi:// (a `dask worker` sent SIGTERM during a
    heartbeat logged it in CI).  The heartbeat goes to a listener that accepts the TCP connection and
    never answers, so the connect is in flight every time."""

    from distributed import Scheduler, Worker

    async def main() -> list[logging.LogRecord]:
        accepted = asyncio.Event()
        held: list = []

        async def silent(reader, writer):
            held.append(writer)  # never answers: the handshake waits
            accepted.set()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        s = await Scheduler(protocol=scheme, host="127.0.0.1", port=0, dashboard_address=":0")
        w = await Worker(s.address, nthreads=1, dashboard_address=":0")
        try:
            w.scheduler = w.rpc(f"{scheme}://127.0.0.1:{port}")  # the heartbeat's next connection goes there
            beat = asyncio.ensure_future(w.heartbeat())
            await asyncio.wait_for(accepted.wait(), 10)
            await asyncio.sleep(0.2)  # the connect waits for the handshake's answer
            assert not beat.done()
            await asyncio.wait_for(w.close(), 30)
            await asyncio.wait_for(beat, 10)  # logged, not raised
        finally:
            await s.close()
            for writer in held:
                writer.close()
            server.close()
        return [r for r in records if r.getMessage().startswith("Failed to communicate with scheduler")]

    with log_records("distributed.worker") as records:
        logged = run(main())
    assert logged, f"the race was not reproduced on {scheme}://"
    for r in logged:
        assert r.exc_info and issubclass(r.exc_info[0], CommClosedError), logged
        assert "ConnectionPool closing" in str(r.exc_info[1]), r.exc_info
