"""The mpi:// Comm contract, in one process (MPI self-messages; a world of one).

These follow distributed's own generic comm checks (distributed/comm/tests/test_comms.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import dask
import numpy as np
import pytest
from distributed.comm import CommClosedError, connect, listen, parse_address
from distributed.comm.core import FatalCommClosedError
from distributed.comm.registry import get_backend
from distributed.protocol import Serialized, deserialize, to_serialize

from conftest import answering, echo, run, run_command
from mpi4dask import _datapath, _endpoint, _progress
from mpi4dask import comm as mpicomm

pytestmark = pytest.mark.timeout(120)


def digest(a) -> str:
    return hashlib.sha256(memoryview(a).cast("B")).hexdigest()


def test_entry_point_registers_backend():
    assert isinstance(get_backend("mpi"), mpicomm.MPIBackend)


def test_import_distributed_does_not_initialise_mpi():
    code = (
        "import sys, distributed, mpi4dask, mpi4dask.comm; "
        "from distributed.comm.registry import get_backend; get_backend('mpi'); "
        "assert 'mpi4py.MPI' not in sys.modules, 'MPI imported'; print('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr


def test_broken_mpi_library_gives_actionable_error():
    env = {"MPI4PY_LIBMPI": "/nonexistent/libmpi.so.12", "PATH": "/usr/bin:/bin"}
    job = Path(__file__).parent / "jobs" / "listen_broken_mpi.py"
    out = subprocess.run([sys.executable, str(job)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0
    assert "MPIUnavailableError" in out.stderr, out.stderr
    assert 'pip install "mpi4dask[mpich]"' in out.stderr and "your site's MPI" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "address",
    ["mpi://", "mpi://host", "mpi://host:notaport", "mpi://:8786", "mpi://host:99999", "mpi://::1:80"],
)
def test_malformed_address_raises_valueerror_naming_it(address):
    with pytest.raises(ValueError) as info:
        run(connect(address, timeout=1))
    assert address in str(info.value) and "mpi://HOST:PORT" in str(info.value) or "brackets" in str(info.value)
    loc = parse_address(address)[1]
    if address == "mpi://:8786":
        # distributed's address helpers take a wildcard host, as tcp:// does (connect() does not)
        assert get_backend("mpi").resolve_address(loc) == get_backend("tcp").resolve_address(loc)
        return
    with pytest.raises(ValueError, match="malformed address"):
        get_backend("mpi").resolve_address(loc)


def test_listener_wildcard_and_contact_address():
    async def main():
        listener = listen("mpi://", echo)
        await listener.start()
        try:
            assert listener.listen_address.startswith("mpi://0.0.0.0:")
            host, port = get_backend("mpi").get_address_host_port(parse_address(listener.contact_address)[1])
            assert host != "0.0.0.0" and port > 0
            comm = await connect(listener.contact_address)
            assert comm.peer_address == listener.contact_address
            await comm.write({"op": "ping"})
            assert await comm.read() == {"op": "ping"}
            await comm.close()
        finally:
            listener.stop()

    run(main())


def test_ping_pong_payload_integrity_all_sizes():
    sizes = [0, 1, 7, 16 << 10, (16 << 10) + 1, 1 << 20, 33 << 20]

    async def main():
        listener = listen("mpi://127.0.0.1:0", echo)
        await listener.start()
        comm = await connect(listener.contact_address)
        assert comm.uses_mpi, "a connection inside one process must use MPI"
        assert comm.peer_address == listener.contact_address
        rng = np.random.default_rng(0)
        for n in sizes:
            a = rng.integers(0, 256, n, dtype=np.uint8)
            await comm.write({"x": to_serialize(a), "n": n, "sum": digest(a)})
            back = await comm.read()
            assert back["n"] == n and digest(back["x"]) == digest(a) == back["sum"]
        await comm.close()
        listener.stop()

    run(main())


@pytest.mark.parametrize("spin", [_progress.REPLY_SPIN, 0.0])
def test_messages_whose_msgpack_travels_over_mpi_are_read_whole(spin, monkeypatch, over_mpi_whatever_the_load):
    """A message of plain bytes (no array) is one msgpack frame, over MPI when it is MPI_MIN_FRAME or more: it is
    decoded once its bytes are in, never from its buffer before.  Same-sized messages of other contents,
    one after the other, reuse the same pooled buffers: decoded early, a read returned the message that
    the buffer held before (with nothing polling for replies, as under load: spin 0)."""
    monkeypatch.setattr(_progress, "REPLY_SPIN", spin)
    n = 2 << 20

    async def answer(msg):  # a reply of the request's size, other bytes
        return {"d": bytes([128 + msg["r"]]) * n, "r": msg["r"]}

    async def main():
        listener = listen("mpi://127.0.0.1:0", answering(answer))
        await listener.start()
        comm = await connect(listener.contact_address)
        assert comm.uses_mpi
        for r in range(8):
            await comm.write({"d": bytes([r]) * n, "r": r})
            back = await comm.read()
            assert back["r"] == r and back["d"] == bytes([128 + r]) * n, (r, back["r"], back["d"][:1])
        await comm.close()
        listener.stop()

    run(main())


def test_streams_do_not_poll_for_replies_requests_do(monkeypatch):
    """A reader polls for a reply only after a request: a read that follows a write made while no read
    was under way (an RPC, a ping-pong).  distributed's streams (``BatchedSend`` writing while the
    stream's reader waits in ``read()``: the scheduler's and workers' task messages) get no replies, and
    polling there spent CPU for nothing: six 1000-task maps over mpi:// polled ~380 times in the
    scheduler and ~275 in each worker, ~130 of them spinning their whole 2 ms budget (the rule before
    fails this test).  The machine counts as idle here, so that the polling decision is made whatever
    else it is doing, and the budget is set (``MPI4DASK_REPLY_SPIN`` may be 0 where the tests run)."""
    from distributed.batched import BatchedSend

    monkeypatch.setattr(_progress, "core_idle", lambda: True)
    monkeypatch.setattr(_progress, "REPLY_SPIN", 0.05)
    n = 60

    async def stream(comm, got):  # as distributed's handle_stream: always a read under way
        try:
            while True:
                got.extend(await comm.read())
        except CommClosedError:
            pass

    async def served(comm):  # the peer's stream answers every batch it reads with its own BatchedSend
        out = BatchedSend(interval="1ms")
        out.start(comm)
        try:
            while True:
                for msg in await comm.read():
                    out.send({"i": msg["i"], "sum": digest(msg["x"])})
        except CommClosedError:
            pass

    def send(out, i, sums):
        x = np.full(100, i, dtype=np.uint8)
        sums[i] = digest(x)
        out.send({"i": i, "x": x.tobytes()})

    async def main():
        listener = listen("mpi://127.0.0.1:0", served)
        await listener.start()
        comm = await connect(listener.contact_address)
        stats = _progress.for_loop().reply_stats
        got: list = []
        reader = asyncio.create_task(stream(comm, got))
        out = BatchedSend(interval="1ms")
        out.start(comm)
        sums: dict = {}
        send(out, 0, sums)  # a first exchange: both handshakes (a request and its reply each) are over
        while not got:
            await asyncio.sleep(0.01)
        before = stats["polls"]
        for i in range(1, n):
            send(out, i, sums)
            await asyncio.sleep(0.002)
        while len(got) < n:
            await asyncio.sleep(0.01)
        assert {m["i"]: m["sum"] for m in got} == sums
        assert stats["polls"] == before, stats  # nothing read here was an answer to a request
        # requests and their replies, on a comm of its own: the reader polls for them (the control)
        rpc = await connect(listener.contact_address)
        for i in range(10):
            if i == 1:
                before = stats["polls"]  # (after the first round trip: the handshakes' reads are over)
            await rpc.write([{"i": i, "x": bytes([i]) * 100}])
            back = await rpc.read()
            assert list(back) == [{"i": i, "sum": digest(bytes([i]) * 100)}], back
        assert stats["polls"] > before, stats
        await out.close()
        await rpc.close()
        await comm.close()
        await reader
        listener.stop()

    run(main())


def test_a_reader_polls_longer_for_the_answer_to_a_large_request(monkeypatch, over_mpi_whatever_the_load):
    """The answer to a request whose MPI bytes the peer has not read yet comes no sooner than the peer took
    them in: the reader polls for it their time at ``REPLY_RATE`` beyond ``REPLY_SPIN`` (a 64 MiB
    ping-pong's answer comes ~4 ms after its request on this VM, beyond the 2 ms budget: every reader
    then slept, and woke 50-100 us later than a poll sees the answer).  Here the answers come ~30 ms
    late, beyond ``REPLY_SPIN`` and within the time of a 2 MiB request at the rate set here (0.2 s): a
    2 MiB request's answer is polled for until it comes, a 100-byte request's is missed (the control;
    before, both were missed).  The machine counts as idle, so that the poll runs whatever else it is doing."""
    monkeypatch.setattr(_progress, "core_idle", lambda: True)
    monkeypatch.setattr(_progress, "REPLY_SPIN", 0.005)
    monkeypatch.setattr(_progress, "REPLY_RATE", 1e7)  # 2 MiB: 0.21 s more
    late = 0.03

    async def answer(msg):
        await asyncio.sleep(late)  # the peer works on the request before it answers
        return {"i": msg["i"], "sum": digest(msg["x"])}

    async def main():
        listener = listen("mpi://127.0.0.1:0", answering(answer))
        await listener.start()
        comm = await connect(listener.contact_address)
        assert comm.uses_mpi
        stats = _progress.for_loop().reply_stats
        rng = np.random.default_rng(7)
        counts = {}
        for n in (2 << 20, 100):
            before = dict(stats)
            for i in range(4):
                x = rng.integers(0, 256, n, dtype=np.uint8)
                await comm.write({"i": i, "x": to_serialize(x)})
                back = await comm.read()
                assert back == {"i": i, "sum": digest(x)}, (n, i, back)
            counts[n] = {k: stats[k] - before[k] for k in ("polls", "replies", "misses")}
        # (the first exchange after a quiet spell is not polled for: _progress.REPLY_WARM)
        assert counts[2 << 20]["replies"] >= 3 and counts[2 << 20]["misses"] == 0, counts
        assert counts[100]["misses"] >= 3 and counts[100]["replies"] == 0, counts
        await comm.close()
        listener.stop()

    run(main())


def inc(x):
    return x + 1


def test_a_cluster_over_mpi_polls_only_for_its_requests(monkeypatch):
    """The same, as a user runs it: a scheduler, a worker and a client over mpi:// (in one process, so one
    event loop's polls are counted, from the cluster's start), a map of 300 tasks.  Polling after any
    write made the loop poll 113-145 times (the worker's and the client's streams); after requests
    only, twice (the registrations and the client's gather are requests)."""
    from distributed import Client, Scheduler, Worker

    monkeypatch.setattr(_progress, "core_idle", lambda: True)
    monkeypatch.setattr(_progress, "REPLY_SPIN", 0.05)

    async def main():
        stats = _progress.for_loop().reply_stats
        async with Scheduler(protocol="mpi", dashboard_address=":0") as s, Worker(s.address, nthreads=1):
            async with Client(s.address, asynchronous=True) as c:
                results = await c.gather(c.map(inc, range(300), pure=False))
                assert results == list(range(1, 301))
                assert stats["polls"] <= 20, stats

    run(main())


def bump(x):
    x += 1  # in place: a task may write into its arguments, as over tcp://
    return x


def test_a_task_may_write_into_its_array_arguments_over_mpi():
    """A user's task gets its small NumPy arguments writeable, as over tcp://: they travel inside the task's
    spec (distributed pickles it, ``ToPickle``, with the arrays' buffers out of band) in small messages,
    which mpi:// may take in from one read-only copy of their bytes.  Taking distributed's own messages in
    that way handed such arrays to the task read-only: ``ValueError: output array is read-only``."""
    from distributed import Client, Scheduler, Worker

    async def main():
        async with Scheduler(protocol="mpi", dashboard_address=":0") as s, Worker(s.address, nthreads=1):
            async with Client(s.address, asynchronous=True) as c:
                a = np.arange(100)
                got = await c.submit(bump, a, pure=False)
                assert (got == np.arange(1, 101)).all() and (a == np.arange(100)).all()
                parts = [np.full(10, i) for i in range(20)]
                got = await c.gather(c.map(bump, parts, pure=False))
                assert all((g == i + 1).all() for i, g in enumerate(got))

    run(main())


def test_many_frames_and_empty_frames():
    async def main():
        listener = listen("mpi://127.0.0.1:0", echo)
        await listener.start()
        comm = await connect(listener.contact_address)
        rng = np.random.default_rng(1)
        parts = [rng.integers(0, 256, int(s), dtype=np.uint8) for s in rng.integers(0, 200_000, 300)]
        parts += [np.zeros(0, dtype=np.uint8)] * 50
        await comm.write({"parts": [to_serialize(p) for p in parts]})
        back = await comm.read()
        assert [digest(p) for p in back["parts"]] == [digest(p) for p in parts]
        await comm.close()
        listener.stop()

    run(main())


def connection_entry(comm) -> dict:
    """``comm``'s entry in :func:`mpi4dask.comm.connections` (its counters)."""
    (entry,) = [c for c in mpicomm.connections() if c["local"] == comm.local_address and c["peer"] == comm.peer_address]
    return entry


def test_a_message_of_many_small_socket_frames_takes_few_socket_reads():
    """A message whose 48 frames under 64 KiB ride the socket (beside 3 that go over MPI) arrives intact in a
    handful of socket reads.  asyncio reads a socket once per loop turn; when each small frame was
    read on its own, this message took ~50 loop turns, and in a busy worker every turn waits for
    the GIL (dask merges: socket frames 3-20 ms behind their header)."""
    served = []

    async def handler(comm):
        served.append(comm)
        await echo(comm)

    def reads(comm):
        return connection_entry(comm)["socket_reads"]

    async def main():
        listener = listen("mpi://127.0.0.1:0", handler)
        await listener.start()
        comm = await connect(listener.contact_address)
        assert comm.uses_mpi
        rng = np.random.default_rng(3)
        edge = _datapath.MPI_MIN_FRAME
        sizes = [3000] * 40 + [1, edge - 1, edge, 1 << 20, 7, 40_000] + [3000] * 4
        parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        await comm.write({"warm": 1})  # the handshake's and the first message's reads are not counted
        await comm.read()
        (server,) = served
        before = reads(server)
        await comm.write({"parts": [to_serialize(p) for p in parts]})
        back = await comm.read()
        assert [digest(p) for p in back["parts"]] == [digest(p) for p in parts]
        taken = reads(server) - before
        assert 1 <= taken <= 12, f"the server took the message in {taken} socket reads"  # one per frame: ~50
        await comm.close()
        listener.stop()

    run(main())


@pytest.mark.parametrize("decode", [True, False], ids=["reader", "scheduler"])
def test_small_messages_taken_in_whole_give_every_object_memory_of_its_own(decode, monkeypatch,
                                                                          over_mpi_whatever_the_load):
    """A fast-path message of socket frames only whose bytes are all in when its header is parsed is taken
    in whole: its frames are read-only views of one copy of the bytes (``_Receiver._take_whole``).  Every
    writeable array a reader gets must still own its memory (writeable, keeping only its own bytes alive)
    and a read-only one stay read-only, for a reader that deserializes and for one that keeps objects
    serialized (a scheduler's, ``deserialize=False``) and deserializes them later.  Messages of
    distributed's own serialisation are not taken whole: ``ToPickle`` hands its buffers to
    ``pickle.loads`` as they are (a task's arguments), and they must arrive writeable.  A small message
    written right after one whose MPI frames are still on their way is read after it."""
    pd = pytest.importorskip("pandas")
    from distributed.protocol import ToPickle

    whole = []  # (receiver, bytes) of the messages taken in whole
    take_whole = _datapath._Receiver._take_whole

    def counted(self, sizes, via, total):
        whole.append((self, total))
        return take_whole(self, sizes, via, total)

    monkeypatch.setattr(_datapath._Receiver, "_take_whole", counted)
    held = [False]  # while True, the MPI receives of the server's connection do not complete
    done = _datapath._Link.done
    monkeypatch.setattr(_datapath._Link, "done", lambda self, reqs: False if held[0] and reqs else done(self, reqs))
    rng = np.random.default_rng(9)
    a = rng.integers(0, 256, 1000, dtype=np.uint8)
    b = rng.integers(0, 256, 1000, dtype=np.uint8)
    ro = rng.integers(0, 256, 300, dtype=np.uint8)
    ro.flags.writeable = False
    df = pd.DataFrame({"k": np.arange(50), "v": rng.random(50)})
    big = rng.integers(0, 256, 1 << 20, dtype=np.uint8)  # over MPI

    def kept_alive(x) -> int:
        """The size of the memory that array ``x`` keeps referenced."""
        while isinstance(x, np.ndarray) and x.base is not None:
            x = x.base
        while isinstance(x, (memoryview, pickle.PickleBuffer)):
            x = x.obj if isinstance(x, memoryview) else x.raw().obj
        return memoryview(x).nbytes

    def objects(msg):
        if not decode:
            msg = {k: deserialize(v.header, v.frames) if isinstance(v, Serialized) else v for k, v in msg.items()}
        return msg

    async def main():
        got: asyncio.Queue = asyncio.Queue()
        served = []

        async def server(comm):
            served.append(comm)
            try:
                while True:
                    await got.put(await comm.read())
            except CommClosedError:
                pass

        listener = listen("mpi://127.0.0.1:0", server, deserialize=decode)
        await listener.start()
        comm = await connect(listener.contact_address)
        assert comm.uses_mpi

        def taken_whole():
            (receiver,) = [c._receiver for c in served]
            return [n for r, n in whole if r is receiver]

        await comm.write({"a": to_serialize(a), "b": to_serialize(b), "ro": to_serialize(ro)})
        back = objects(await asyncio.wait_for(got.get(), 10))
        # taken whole (after distributed's handshake message, which may be too)
        n = len(taken_whole())
        assert taken_whole()[-1] >= a.nbytes + b.nbytes + ro.nbytes, taken_whole()
        assert digest(back["a"]) == digest(a) and digest(back["b"]) == digest(b)
        assert back["a"].flags.writeable and back["b"].flags.writeable
        # memory of their own: no more than their own bytes kept alive (as distributed's tcp:// reads an
        # array's buffer into memory of its own, so that each can be freed as soon as it is unused)
        assert kept_alive(back["a"]) == a.nbytes and kept_alive(back["b"]) == b.nbytes
        assert not back["ro"].flags.writeable and digest(back["ro"]) == digest(ro)
        assert kept_alive(back["ro"]) <= _datapath.WHOLE_MAX

        # distributed's own serialisation (a DataFrame makes the message not fast; ToPickle as a task's
        # arguments): read as before, every buffer writeable
        await comm.write({"a": to_serialize(a), "df": to_serialize(df), "t": ToPickle({"b": b})})
        back = await asyncio.wait_for(got.get(), 10)
        assert len(taken_whole()) == n, taken_whole()
        if decode:
            pd.testing.assert_frame_equal(back["df"], df)
            assert back["a"].flags.writeable and kept_alive(back["a"]) == a.nbytes
            assert back["t"]["b"].flags.writeable and digest(back["t"]["b"]) == digest(b)

        # header order: a small message behind one whose MPI receive has not completed is not taken whole
        held[0] = True
        await comm.write({"big": to_serialize(big)})
        await comm.write({"small": to_serialize(a)})
        await asyncio.sleep(0.3)  # both headers parsed meanwhile (one process, one loop)
        assert got.empty(), "a message was read before the one written ahead of it"
        held[0] = False
        first = objects(await asyncio.wait_for(got.get(), 10))
        second = objects(await asyncio.wait_for(got.get(), 10))
        assert digest(first["big"]) == digest(big) and digest(second["small"]) == digest(a)
        assert len(taken_whole()) == n, taken_whole()
        await comm.close()
        listener.stop()

    run(main())


@pytest.mark.parametrize("count, over_mpi", [(8, True), (4, False), (1, False)])
def test_mid_sized_frames_go_over_mpi_in_bulk(count, over_mpi, over_mpi_whatever_the_load):
    """Frames of 200 KB (under MPI_MIN_FRAME) ride the socket alone or a few at a time, but go over MPI when a
    message carries a megabyte or more of them (_wire.BULK_BYTES: a worker's dataframe pieces); either way
    each arrives intact, and the connection's counters say which path the bytes took."""
    def counters(comm):
        entry = connection_entry(comm)
        return entry["mpi_bytes_sent"], entry["socket_bytes_sent"]

    async def main():
        listener = listen("mpi://127.0.0.1:0", echo)
        await listener.start()
        comm = await connect(listener.contact_address)
        assert comm.uses_mpi
        rng = np.random.default_rng(count)
        parts = [rng.integers(0, 256, 200_000, dtype=np.uint8) for _ in range(count)]
        mpi0, sock0 = counters(comm)
        await comm.write({"parts": [to_serialize(p) for p in parts]})
        back = await comm.read()
        assert [digest(p) for p in back["parts"]] == [digest(p) for p in parts]
        mpi1, sock1 = counters(comm)
        mpi_sent, sock_sent = mpi1 - mpi0, sock1 - sock0
        if over_mpi:
            assert mpi_sent == 200_000 * count and sock_sent < 10_000, (mpi_sent, sock_sent)
        else:
            assert mpi_sent == 0 and sock_sent >= 200_000 * count, (mpi_sent, sock_sent)
        await comm.close()
        listener.stop()

    run(main())


def test_a_message_of_more_small_frames_than_the_inbox_holds_arrives(over_mpi_whatever_the_load):
    """One message whose frames under MPI_MIN_FRAME (they ride the socket) add up to more than the reader's
    inbox bound (INBOX_MAX), beside a frame over MPI: the reader must not pause its socket on the
    very message it is taking in (it paused, and never resumed: a hang)."""

    async def main():
        listener = listen("mpi://127.0.0.1:0", echo)
        await listener.start()
        comm = await connect(listener.contact_address)
        assert comm.uses_mpi
        rng = np.random.default_rng(4)
        n_small = _datapath.INBOX_MAX // 60_000 + 20
        parts = [rng.integers(0, 256, 1 << 20, dtype=np.uint8)]
        parts += [rng.integers(0, 256, 60_000, dtype=np.uint8) for _ in range(n_small)]
        await comm.write({"parts": [to_serialize(p) for p in parts]})
        back = await asyncio.wait_for(comm.read(), 30)
        assert [digest(p) for p in back["parts"]] == [digest(p) for p in parts]
        await comm.close()
        listener.stop()

    run(main())


def test_a_tcp_client_at_an_mpi_listener_is_named_once_on_the_listener(caplog):
    """distributed's tcp:// client given an mpi:// listener's port sees only 'Stream is closed'; the
    listener says why, and which address to use, once (not once per attempt: a scanner or a retrying
    client would flood the log)."""
    import logging

    where = {}

    async def main():
        listener = listen("mpi://127.0.0.1:0", echo)
        await listener.start()
        port = where["port"] = parse_address(listener.contact_address)[1].rsplit(":", 1)[1]
        for _ in range(3):
            with pytest.raises(CommClosedError):
                comm = await connect(f"tcp://127.0.0.1:{port}", timeout=5)
                await comm.write({"op": "ping"})
                await comm.read()
        comm = await connect(listener.contact_address)  # the listener still serves its own kind
        await comm.write({"x": 1})
        assert await comm.read() == {"x": 1}
        await comm.close()
        listener.stop()

    with caplog.at_level(logging.DEBUG, logger="mpi4dask"):
        run(main())
    said = [r for r in caplog.records if r.levelno == logging.WARNING and "tcp://" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    msg = said[0].getMessage()
    assert "not an mpi4dask endpoint" in msg and f"give it the address mpi://127.0.0.1:{where['port']}" in msg, msg


def test_frames_are_chunked_into_several_mpi_messages(monkeypatch):
    # the same path that carries frames > 2 GiB, exercised with a small chunk size
    monkeypatch.setattr(_datapath, "MAX_CHUNK", 1 << 20)

    async def main():
        listener = listen("mpi://127.0.0.1:0", echo)
        await listener.start()
        comm = await connect(listener.contact_address)
        a = np.random.default_rng(2).integers(0, 256, (5 << 20) + 12345, dtype=np.uint8)
        await comm.write({"x": to_serialize(a)})
        back = await comm.read()
        assert digest(back["x"]) == digest(a)
        await comm.close()
        listener.stop()

    run(main())


@pytest.mark.parametrize("layout", [[(3 << 20) + 5], [100_000, 200_000, (2 << 20) + 7], [300_000] * 9, [300_000]])
def test_a_first_piece_taken_in_ahead_of_its_header_lands_in_its_frame(monkeypatch, layout, over_mpi_whatever_the_load):
    """A reader waiting for a reply takes the reply's first MPI message in before its header arrives,
    into a buffer of its own when it is smaller than a shard.  A frame larger than ``MAX_CHUNK`` (1 GiB;
    here 1 MiB) travels as several MPI messages, and its first piece is only part of the frame: the
    frame must still arrive whole.  Nine frames of 300 kB travel as three MPI messages of three
    frames each (joined: _wire.mpi_runs), the first taken in ahead: its frames must still end up in
    buffers of their own.  One frame of 300 kB taken in ahead is received into the buffer it keeps.
    Deterministic: the echo, in the same process, makes the reader look
    for the reply's MPI message right after writing the reply, before the loop parses its header."""
    from distributed.protocol.utils_test import get_host_array

    monkeypatch.setattr(_datapath, "MAX_CHUNK", 1 << 20)
    client = {}
    looks = []

    async def echo_then_look(comm):
        try:
            while True:
                msg = await comm.read()
                await comm.write({"x": [to_serialize(a) for a in msg["x"]]})
                looks.append(client["comm"]._receiver.poll_reply())
        except CommClosedError:
            pass

    async def main():
        listener = listen("mpi://127.0.0.1:0", echo_then_look)
        await listener.start()
        comm = client["comm"] = await connect(listener.contact_address)
        rng = np.random.default_rng(7)
        for r in range(3):
            arrays = [rng.integers(0, 256, n + r, dtype=np.uint8) for n in layout]
            await comm.write({"x": [to_serialize(a) for a in arrays]})
            back = await asyncio.wait_for(comm.read(), 30)
            assert [len(b) for b in back["x"]] == [len(a) for a in arrays]
            assert [digest(b) for b in back["x"]] == [digest(a) for a in arrays]
            assert len({id(get_host_array(b)) for b in back["x"]}) == len(arrays)
        # (not under Intel MPI, whose messages are not matched ahead: _mpi.probes_ahead)
        assert comm.stats["mpi_messages_ahead"] == (3 if comm._link.w.probes_ahead else 0), comm.stats
        await comm.close()
        listener.stop()

    run(main())


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_frame_larger_than_2_gib():
    n = (2 << 30) + 4099

    async def main():
        got = {}

        async def receive(comm):
            msg = await comm.read()
            x = msg["x"]
            got["len"] = len(x)
            got["head"], got["tail"] = digest(x[:1 << 20]), digest(x[-(1 << 20):])
            got["sum"] = int(np.asarray(x)[:: 4096].astype(np.uint64).sum())
            await comm.write("done")

        listener = listen("mpi://127.0.0.1:0", receive)
        await listener.start()
        comm = await connect(listener.contact_address)
        a = np.empty(n, dtype=np.uint8)
        a[:: 4096] = np.arange(len(a[:: 4096])) % 251
        a[-(1 << 20):] = 7
        await comm.write({"x": to_serialize(a)})
        assert await comm.read() == "done"
        assert got["len"] == n
        assert got["head"] == digest(a[:1 << 20]) and got["tail"] == digest(a[-(1 << 20):])
        assert got["sum"] == int(a[:: 4096].astype(np.uint64).sum())
        await comm.close()
        listener.stop()

    run(main(), timeout=240)


def test_both_directions_at_once_large_messages():
    n = 24 << 20

    async def main():
        rng = np.random.default_rng(3)
        sa = rng.integers(0, 256, n, dtype=np.uint8)
        sb = rng.integers(0, 256, n, dtype=np.uint8)
        result = {}

        async def server(comm):
            # writes before reading: both ends write large messages at the same time
            await asyncio.gather(*(comm.write({"i": i, "x": to_serialize(sb)}) for i in range(3)))
            result["server"] = [await comm.read() for _ in range(3)]
            await comm.write("bye")

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        await asyncio.gather(*(comm.write({"i": i, "x": to_serialize(sa)}) for i in range(3)))
        got = [await comm.read() for _ in range(3)]
        assert await comm.read() == "bye"
        assert [m["i"] for m in got] == [0, 1, 2] and all(digest(m["x"]) == digest(sb) for m in got)
        assert [m["i"] for m in result["server"]] == [0, 1, 2]
        assert all(digest(m["x"]) == digest(sa) for m in result["server"])
        await comm.close()
        listener.stop()

    run(main())


def test_handshake_both_sides_write_before_read():
    async def main():
        async def server(comm):
            await comm.write({"from": "server"})
            assert await comm.read() == {"from": "client"}
            await comm.close()

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        await comm.write({"from": "client"})
        assert await comm.read() == {"from": "server"}
        with pytest.raises(CommClosedError):
            await comm.read()
        listener.stop()

    run(main())


def test_twenty_concurrent_clients_interleaved():
    N = 20

    async def main():
        async def server(comm):
            first = await comm.read()
            second = await comm.read()
            await comm.write((first, second, comm.peer_address))
            await comm.close()

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()

        async def client(i):
            comm = await connect(listener.contact_address)
            await comm.write({"i": i, "k": 1})
            await asyncio.sleep(0.001 * (i % 3))
            await comm.write({"i": i, "k": 2, "pad": b"x" * (i * 5000)})
            first, second, seen_as = await comm.read()
            assert first == {"i": i, "k": 1} and second["i"] == i and second["k"] == 2
            assert len(second["pad"]) == i * 5000
            assert seen_as == comm.local_address
            await comm.close()
            return i

        assert sorted(await asyncio.gather(*(client(i) for i in range(N)))) == list(range(N))
        listener.stop()

    run(main())


def test_peer_close_makes_read_and_write_raise():
    async def main():
        async def server(comm):
            await comm.close()

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        with pytest.raises(CommClosedError):
            await comm.read()
        # as with TCP, writes after the peer's goodbye are dropped, and raise once it is gone
        deadline = time.monotonic() + 2
        with pytest.raises(CommClosedError):
            while time.monotonic() < deadline:
                await comm.write({"x": 1})
                await asyncio.sleep(0.01)
        listener.stop()

    run(main())


def test_messages_written_before_close_are_delivered():
    async def main():
        payload = np.arange(3 << 20, dtype=np.uint8)

        async def server(comm):
            for i in range(5):
                await comm.write({"i": i, "x": to_serialize(payload)})
            await comm.close()

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        for i in range(5):
            msg = await comm.read()
            assert msg["i"] == i and digest(msg["x"]) == digest(payload)
        with pytest.raises(CommClosedError):
            await comm.read()
        listener.stop()

    run(main())


def test_close_fails_reads_in_flight_on_both_ends():
    async def main():
        server_read = asyncio.get_running_loop().create_future()

        async def server(comm):
            try:
                await comm.read()
            except CommClosedError as e:
                server_read.set_result(e)

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        reader = asyncio.ensure_future(comm.read())
        await asyncio.sleep(0.05)
        assert not reader.done()
        await comm.close()
        assert comm.closed()
        with pytest.raises(CommClosedError):
            await reader
        assert isinstance(await asyncio.wait_for(server_read, 5), CommClosedError)
        listener.stop()

    run(main())


def _tag(comm):
    link = comm._link
    return (link.route, link.peer, link.recv_tag)


def test_a_clean_close_settles_both_ends_so_exit_has_nothing_to_wait_for():
    """A close answered by the peer's goodbye (written as soon as the peer reads ours, whether or not
    anything reads that connection: an idle pooled one) leaves nothing that can still arrive over MPI on
    either end: neither tag is left for the exit's drain, which then does not wait (it waited 0.25 s
    after every clean shutdown).  The closing side takes in, before it lets go, the MPI bytes of what
    the peer sent before its answer."""
    payload = np.arange(3 << 20, dtype=np.uint8)

    async def main():
        served = []

        async def server(comm):  # answers one request, then writes one more message nobody reads
            served.append(comm)
            msg = await comm.read()
            await comm.write({"x": to_serialize(msg["x"])})
            await comm.write({"late": to_serialize(payload)})

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        ep = _endpoint.current()
        comm = await connect(listener.contact_address)
        await comm.write({"x": to_serialize(payload)})
        assert digest((await comm.read())["x"]) == digest(payload)
        (peer,) = served
        await asyncio.sleep(0.05)  # the late message's header is here, its MPI bytes may be too
        await comm.close()
        assert comm.closed()
        deadline = time.monotonic() + 5
        while (comm._linger is not None or not peer.closed()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert comm._linger is None and comm._peer_bye, "the peer did not answer the goodbye"
        assert peer.closed()  # its goodbye came and it has nothing to read: as a closed socket
        await peer.close()
        assert _tag(comm) not in ep.closed_tags and _tag(peer) not in ep.closed_tags
        listener.stop()

    run(main())


def test_a_close_the_peer_does_not_answer_is_drained_at_exit():
    """A peer whose event loop is held (a task keeps the GIL, a debugger) answers no goodbye: the closing
    side lingers ``LINGER`` s, then lets go and leaves its tag to the drain (late MPI messages of that
    peer are received and dropped, also at exit)."""

    async def main():
        other = asyncio.new_event_loop()
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(other)
            other.call_soon(ready.set)
            other.run_forever()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        ready.wait(10)

        async def start():
            listener = listen("mpi://127.0.0.1:0", echo)
            await listener.start()
            return listener

        listener = asyncio.run_coroutine_threadsafe(start(), other).result(10)
        ep = _endpoint.current()
        comm = await connect(listener.contact_address)
        await comm.write({"x": to_serialize(np.ones(1 << 20, dtype=np.uint8))})
        await comm.read()
        held = mpicomm.LINGER + 1.0
        other.call_soon_threadsafe(time.sleep, held)  # the peer's loop is held
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await comm.close()
        while comm._linger is not None and time.monotonic() - t0 < held + 5:
            await asyncio.sleep(0.01)
        waited = time.monotonic() - t0
        assert comm._linger is None and not comm._peer_bye
        assert mpicomm.LINGER - 0.1 <= waited < held, waited
        assert _tag(comm) in ep.closed_tags  # left to the drain
        other.call_soon_threadsafe(listener.stop)
        other.call_soon_threadsafe(other.stop)
        thread.join(10)

    run(main())


def test_abort_is_immediate_and_peer_notices():
    async def main():
        server_read = asyncio.get_running_loop().create_future()

        async def server(comm):
            try:
                while True:
                    await comm.read()
            except CommClosedError as e:
                server_read.set_result(e)

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        await comm.write({"x": to_serialize(np.ones(8 << 20, dtype=np.uint8))})
        comm.abort()
        assert comm.closed()
        with pytest.raises(CommClosedError):
            await comm.write("more")
        assert isinstance(await asyncio.wait_for(server_read, 5), CommClosedError)
        listener.stop()

    run(main())


def test_an_abort_is_answered_so_both_ends_settle():
    """distributed aborts the comms whose reads it cancels when a server stops (a worker's handlers of
    its peers' pooled connections): a LocalCluster's worker then waited 0.25 s at exit for late MPI
    messages of the still running scheduler process, and LocalCluster.close() took 0.39 s against tcp://'s
    0.14 (CI, 2026-11-30).  The abort now tells the peer (``X``): the peer sees a lost connection (reads
    and writes raise, as over tcp://), answers with its goodbye, and both ends take in what was in flight
    -- here a message each way -- so neither tag is left for the exit's drain."""
    payload = np.arange(3 << 20, dtype=np.uint8)

    async def main():
        served, reading = [], asyncio.get_running_loop().create_future()

        async def server(comm):  # a handler reading its peer's next request, as distributed's
            served.append(comm)
            reading.set_result(asyncio.current_task())
            await comm.read()

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        ep = _endpoint.current()
        comm = await connect(listener.contact_address)
        handler = await asyncio.wait_for(reading, 5)
        (peer,) = served
        await peer.write({"late": to_serialize(payload)})  # in flight towards the client, never read there
        handler.cancel()  # the server stops: its read is cancelled and the comm aborted
        with pytest.raises(asyncio.CancelledError):
            await handler
        assert peer.closed()
        # what the peer wrote before its abort is read, intact (as over a socket), then the abort
        assert digest((await asyncio.wait_for(comm.read(), 5))["late"]) == digest(payload)
        with pytest.raises(CommClosedError, match="peer aborted"):
            await asyncio.wait_for(comm.read(), 5)
        assert comm.closed()
        with pytest.raises(CommClosedError):  # (the failed read closed this side, as over tcp://)
            await comm.write({"x": to_serialize(payload)})
        deadline = time.monotonic() + 5
        while (peer._linger is not None or comm._linger is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert peer._linger is None and peer._peer_bye, "the aborted comm's peer did not answer"
        assert comm._linger is None and not comm._receiver.in_flight()
        assert _tag(comm) not in ep.closed_tags and _tag(peer) not in ep.closed_tags
        await comm.close()  # (as distributed closes what it finds broken): nothing more to do
        assert _tag(comm) not in ep.closed_tags
        listener.stop()

    run(main())


def test_an_abort_whose_message_is_in_flight_lets_the_peer_read_it_first(over_mpi_whatever_the_load):
    """A message written just before the writer's abort (its header, then the abort's ``X``, on the
    socket; its 8 MiB over MPI, still moving) is read by the peer, intact, before the abort ends the
    peer's reads; its writes raise.  Neither end is left with a tag that exit must wait for."""
    payload = np.arange(8 << 20, dtype=np.uint8)

    async def main():
        served, got = [], []
        ended = asyncio.get_running_loop().create_future()

        async def server(comm):
            served.append(comm)
            got.append(digest((await comm.read())["x"]))
            deadline = time.monotonic() + 5
            while not comm.closed() and time.monotonic() < deadline:  # the abort came; nothing else to read
                await asyncio.sleep(0.01)
            try:
                await comm.write("more")
            except CommClosedError as e:
                ended.set_result(e)

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        ep = _endpoint.current()
        comm = await connect(listener.contact_address)
        await comm.write({"x": to_serialize(payload)})
        comm.abort()
        assert "peer aborted" in str(await asyncio.wait_for(ended, 10))
        assert got == [digest(payload)]
        (peer,) = served
        deadline = time.monotonic() + 5
        while (comm._linger is not None or peer._linger is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert comm._linger is None and peer._linger is None
        assert _tag(comm) not in ep.closed_tags and _tag(peer) not in ep.closed_tags
        listener.stop()

    run(main())


def test_a_close_reads_on_past_a_full_inbox_to_the_peers_answer():
    """A closed connection reads no message any more, yet must read on to the peer's answering goodbye.
    Its inbox, full of socket messages nobody read (over ``INBOX_MAX``), had paused its socket: the
    answer behind them was never parsed, the linger ran its 2 s out, and the tag was left to exit's
    drain.  Now what was not read is dropped at the close and the socket never pauses again."""
    block = np.arange(200_000, dtype=np.uint8)  # socket frames (under MPI_MIN_FRAME)

    async def main():
        served = []

        async def server(comm):
            served.append(comm)
            for i in range(60):  # 12 MB the client never reads
                await comm.write({"i": i, "x": to_serialize(block)})

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        ep = _endpoint.current()
        comm = await connect(listener.contact_address)
        deadline = time.monotonic() + 5
        while not comm._receiver._paused and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert comm._receiver._paused, "the unread messages did not fill the inbox"
        t0 = time.monotonic()
        await comm.close()
        while comm._linger is not None and time.monotonic() < t0 + 5:
            await asyncio.sleep(0.01)
        assert time.monotonic() - t0 < mpicomm.LINGER / 2 and comm._peer_bye, "no answer read"
        assert _tag(comm) not in ep.closed_tags
        listener.stop()

    run(main())


def test_read_after_this_side_closed_raises_even_with_messages_waiting():
    """As over tcp://: a comm closed (or aborted) here reads nothing more, though messages had arrived."""

    async def main():
        served = []

        async def server(comm):
            served.append(comm)
            await comm.write("one")
            await comm.write("two")

        listener = listen("mpi://127.0.0.1:0", server)
        await listener.start()
        for end in ("close", "abort"):
            comm = await connect(listener.contact_address)
            assert await comm.read() == "one"
            deadline = time.monotonic() + 5
            while not comm._receiver.has_messages() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert comm._receiver.has_messages()
            if end == "close":
                await comm.close()
            else:
                comm.abort()
            with pytest.raises(CommClosedError):
                await comm.read()
        listener.stop()

    run(main())


def test_connect_to_nothing_times_out_close_to_timeout():
    async def main():
        listener = listen("mpi://127.0.0.1:0", echo)
        await listener.start()
        addr = listener.contact_address
        listener.stop()
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(OSError):
            await connect(addr, timeout=0.15)
        return time.monotonic() - t0

    elapsed = run(main())
    assert elapsed < 0.8, elapsed


def test_hundred_listeners_in_one_process():
    async def main():
        listeners = [listen("mpi://127.0.0.1:0", echo) for _ in range(100)]
        for lst in listeners:
            await lst.start()
        addresses = {lst.contact_address for lst in listeners}
        assert len(addresses) == 100
        comms = [await connect(lst.contact_address) for lst in listeners[::10]]
        for i, c in enumerate(comms):
            await c.write(i)
        assert [await c.read() for c in comms] == list(range(10))
        for c in comms:
            await c.close()
        for lst in listeners:
            lst.stop()

    run(main())


def test_deserialize_false_yields_serialized():
    async def main():
        got = asyncio.get_running_loop().create_future()

        async def server(comm):
            got.set_result(await comm.read())

        listener = listen("mpi://127.0.0.1:0", server, deserialize=False)
        await listener.start()
        comm = await connect(listener.contact_address)
        a = np.arange(1000)
        await comm.write({"x": to_serialize(a), "y": 1})
        msg = await asyncio.wait_for(got, 10)
        assert isinstance(msg["x"], Serialized) and msg["y"] == 1
        assert (deserialize(msg["x"].header, msg["x"].frames) == a).all()
        await comm.close()
        listener.stop()

    run(main())


@pytest.mark.parametrize("proto", ["mpi", "tcp"])
def test_a_read_decodes_with_its_own_deserializers(proto):
    """mpi:// decodes a message as it comes in (before read()); a read that names its deserializers gets
    them all the same, as over tcp://: an array pickled for the wire is refused to a msgpack-only read
    (the connection stays usable), and the next plain read gets its message whole."""
    async def main():
        got = asyncio.get_running_loop().create_future()
        a = np.arange(100_000)  # over MPI on mpi://

        async def server(comm):
            try:
                first = await comm.read(deserializers=["msgpack"])
                with pytest.raises(TypeError, match="msgpack"):
                    await comm.read(deserializers=["msgpack"])
                third = await comm.read()
                got.set_result((first, third))
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                got.set_exception(exc)

        listener = listen(f"{proto}://127.0.0.1:0", server)
        await listener.start()
        comm = await connect(listener.contact_address)
        await comm.write({"y": 1})
        await comm.write({"x": to_serialize(a)})
        await comm.write({"x": to_serialize(a), "y": 3})
        first, third = await asyncio.wait_for(got, 20)
        assert first == {"y": 1}
        assert third["y"] == 3 and digest(third["x"]) == digest(a)
        await comm.close()
        listener.stop()

    run(main())


def test_unknown_keyword_arguments_are_ignored():
    async def main():
        listener = listen("mpi://127.0.0.1:0", echo, allow_offload=False, some_future_option=3, ssl_context=None)
        await listener.start()
        comm = await connect(listener.contact_address, handshake_overrides={"x": 1}, another_option="y",
                             ssl_context=None, require_encryption=False)
        await comm.write("hi")
        assert await comm.read() == "hi"
        await comm.close()
        listener.stop()

    run(main())


def test_connecting_to_a_non_mpi4dask_server_fails_cleanly():
    async def main():
        async def garbage(reader, writer):
            writer.write(b"\xff" * 64)
            await writer.drain()
            await asyncio.sleep(1)
            writer.close()

        server = await asyncio.start_server(garbage, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(OSError) as info:
            await connect(f"mpi://127.0.0.1:{port}", timeout=2)
        server.close()
        # distributed's own error type (a Nanny's reason names it), the address, and the fix
        assert type(info.value) is FatalCommClosedError, repr(info.value)
        assert f"mpi://127.0.0.1:{port} is no mpi:// listener" in str(info.value), str(info.value)
        assert f"tcp://127.0.0.1:{port}" in str(info.value), str(info.value)
        return time.monotonic() - t0

    assert run(main()) < 5


def test_a_client_given_mpi_for_a_tcp_scheduler_is_told_the_address_to_use():
    """A user who gives a tcp:// scheduler's address with mpi:// gets distributed's FatalCommClosedError at
    once, naming the address and the one to use (a Nanny's failure-to-start reason showed mpi4dask's
    private error class instead)."""
    from distributed import Client, Scheduler

    async def main():
        async with Scheduler(protocol="tcp", dashboard_address=":0") as s:
            wrong = s.address.replace("tcp://", "mpi://")
            t0 = time.monotonic()
            with pytest.raises(FatalCommClosedError) as info:
                async with Client(wrong, asynchronous=True, timeout=10):
                    pass
            assert time.monotonic() - t0 < 5  # not retried until the timeout
            assert type(info.value) is FatalCommClosedError, repr(info.value)
            assert f"{wrong} is no mpi:// listener" in str(info.value) and s.address in str(info.value), str(info.value)

    run(main())


@pytest.mark.parametrize("serializers", [None, ["dask"]], ids=["mpi4dask-fast-path", "distributed-dask-serializer"])
def test_receive_buffers_are_reused_only_when_released(serializers, monkeypatch, over_mpi_whatever_the_load):
    """Large frames land in pooled buffers, reused once released, never while referenced; each starts
    just past a 2 MiB (huge-page) boundary, which MPI's single copy between processes needs for full
    speed, and not just before a new numpy array's place in its page.  Both
    ways a numpy array is (de)serialized: mpi4dask's pickle-5 fast path, and distributed's own "dask"
    serializer, whose arrays reference the memory's owner rather than the pool's buffer (a pool that
    looked only at the buffer handed such memory out again while a gathered result still used it).
    The frames go over MPI whatever the machine's load (``over_mpi_whatever_the_load``)."""
    n = 3 << 20

    async def echo_arrays(comm):
        try:
            while True:
                msg = await comm.read()
                await comm.write({"x": to_serialize(msg["x"])}, serializers=serializers)
        except CommClosedError:
            pass

    async def main():
        listener = listen("mpi://127.0.0.1:0", echo_arrays)
        await listener.start()
        comm = await connect(listener.contact_address)
        rng = np.random.default_rng(5)
        first = rng.integers(0, 256, n, dtype=np.uint8)
        await comm.write({"x": to_serialize(first)}, serializers=serializers)
        kept = (await comm.read())["x"]  # still referenced: its buffer must not be handed out again
        kept_digest = digest(kept)
        addresses = set()
        # where a new large numpy array starts (64 MiB: glibc always maps it afresh, so 16 bytes past a page)
        fresh = np.empty(64 << 20, np.uint8).__array_interface__["data"][0]
        for _ in range(4):
            a = rng.integers(0, 256, n, dtype=np.uint8)
            await comm.write({"x": to_serialize(a)}, serializers=serializers)
            got = (await comm.read())["x"]
            assert digest(got) == digest(a)
            assert not np.shares_memory(got, kept)
            address = got.__array_interface__["data"][0]
            assert address % (2 << 20) == _endpoint.BUFFER_OFFSET, f"a receive buffer at {address:#x}"
            # a copy of it into a new large array (dask's concatenate of blocks) must not start 1-64
            # bytes past it modulo 4 KiB, where the CPU's 4K aliasing makes copies 4x slower
            assert not 0 < (fresh - address) % 4096 <= 64, (hex(address), hex(fresh))
            addresses.add(address)
            del got  # released: the next message may reuse its buffer
        assert digest(kept) == kept_digest == digest(first)
        assert len(addresses) < 4, "released receive buffers were never reused"
        await comm.close()
        listener.stop()

    run(main())


def test_buffer_pool_lets_go_of_idle_buffers_of_other_sizes():
    """A new size class frees the pool's idle buffers of other sizes (peak memory like tcp://), never
    a buffer that is still referenced."""
    pool = _endpoint._BufferPool()
    small = pool.take(2 << 20)
    held = pool.take(2 << 20)  # stays referenced
    small_cls = pool.size_class(2 << 20)
    assert len(pool._free[small_cls]) == 2
    del small
    big = pool.take(40 << 20)
    assert len(pool._free[small_cls]) == 1, "the idle 2 MiB buffer must be freed, the referenced one kept"
    assert pool._free[small_cls][0].nbytes == pool.size_class(2 << 20)
    assert np.shares_memory(np.frombuffer(held, np.uint8), pool._free[small_cls][0])
    assert pool._bytes == pool.size_class(2 << 20) + pool.size_class(40 << 20)
    again = pool.take(40 << 20)  # same class, first one referenced: a second buffer
    assert not np.shares_memory(np.frombuffer(big, np.uint8), np.frombuffer(again, np.uint8))
    del big
    reuse = pool.take(40 << 20)
    assert len(pool._free[pool.size_class(40 << 20)]) == 2, "an idle buffer of the same size is reused"
    del reuse, again, held


def test_work_started_from_another_thread_while_the_last_tick_runs_is_not_lost():
    """The shared tickers (the buffer pool's trimmer, the drain of closed connections, the test of posted
    proofs) run on one thread's loop and are started by comms on any thread's loop.  A start from another
    thread that comes while the owner's tick is deciding that nothing is left must still get its work
    ticked: here the tick that empties the queue is the moment another thread's loop adds work and calls
    start() (the owner's loop is alive, so that start() arms nothing itself)."""
    queue, ticked = ["first"], []

    def add_from_another_thread():
        async def other_loop():
            queue.append("second")
            ticker.start()

        thread = threading.Thread(target=asyncio.run, args=(other_loop(),))
        thread.start()
        thread.join()

    def tick():
        ticked.append(queue.pop(0))
        more = bool(queue)
        if ticked == ["first"]:
            add_from_another_thread()  # after this tick saw the queue empty, before it returns
        return more

    ticker = _endpoint._Ticker(0.001, tick)

    async def main():
        ticker.start()
        for _ in range(400):
            await asyncio.sleep(0.005)
            if ticked == ["first", "second"] and ticker._loop is None:
                break

    asyncio.run(main())
    assert ticked == ["first", "second"], f"ticked {ticked}: the work added during the last tick was never ticked"
    assert ticker._loop is None, "the ticker goes on after its work is done"


def test_buffer_pool_counts_arrays_that_reference_the_memory_s_owner():
    """numpy makes an array built on a buffer the pool handed out (``np.ndarray(buffer=...)``, as
    distributed's numpy deserializer does) reference the allocation under the pool's aligned view, not
    the view: the pool must not hand that memory out again while such an array lives."""
    pool = _endpoint._BufferPool()
    n = 3 << 20
    x = np.ndarray((n,), np.uint8, buffer=pool.take(n))
    x[:] = 7
    other = np.frombuffer(pool.take(n), np.uint8)
    assert not np.shares_memory(x, other), "memory still used by an array was handed out again"
    assert (x == 7).all()
    address = x.__array_interface__["data"][0]
    del x, other
    again = np.frombuffer(pool.take(n), np.uint8)
    assert again.__array_interface__["data"][0] == address, "a released buffer must be reused"


def test_a_reader_busy_for_longer_than_the_stall_timeout_keeps_its_connection():
    """The reader does not read for 3 s while 80 MB arrive, MPI frames and socket-borne frames mixed:
    its socket is paused (bounded memory), possibly in the middle of a frame, and the pause is not
    mistaken for a stalled peer (timeouts.tcp = 1 s); then every message is read intact, in order."""

    async def main():
        got = asyncio.get_running_loop().create_future()

        async def handler(comm):
            got.set_result(comm)
            await asyncio.sleep(60)

        listener = listen("mpi://127.0.0.1:0", handler)
        await listener.start()
        writer = await connect(listener.contact_address)
        reader = await got
        sent = []
        for i in range(30):
            big = np.full(1 << 20, i % 251, dtype=np.uint8)  # over MPI
            small = [np.full(60_000, (i + k) % 251, dtype=np.uint8) for k in range(40)]  # on the socket
            sent += [("big", i, digest(big)), ("small", i, [digest(a) for a in small])]
            await writer.write({"big": i, "x": to_serialize(big)})
            await writer.write({"small": i, "x": [to_serialize(a) for a in small]})
        await asyncio.sleep(3)
        assert not reader.closed() and not writer.closed()
        for kind, i, d in sent:
            msg = await reader.read()
            assert msg[kind] == i
            assert (digest(msg["x"]) if kind == "big" else [digest(a) for a in msg["x"]]) == d
        await writer.close()
        listener.stop()

    with dask.config.set({"distributed.comm.timeouts.tcp": "1s"}):
        run(main())


@pytest.mark.parametrize("protocol", ["mpi", "tcp"])
def test_a_socket_only_writer_whose_reader_is_killed_mid_message_fails_soon(protocol):
    """The same two processes; the reader is killed while a 256 MiB message is still going out (its handler
    waits, so the socket is full and the writer has handed the kernel part of the frame straight, the rest
    queued): the writer's read and its next write raise CommClosedError within seconds, and its process goes
    on.  tcp:// is run the same way, as the reference."""
    script = Path(__file__).parent / "jobs" / "socket_writer_memory.py"
    rc, out, err = run_command([sys.executable, str(script), protocol, "killed"], 120)
    assert rc == 0 and "KILLED " in out, (out, err[-5000:])
    took, read_error, write_error = out.split("KILLED ", 1)[1].split()[:3]
    assert read_error == "CommClosedError" and write_error == "CommClosedError", out
    assert float(took) < 10, out


def test_mpi_works_in_a_process_whose_scheduler_closed(tmp_path):
    """A scheduler's MPI service (here: run_mpi on a tcp:// LocalCluster) closes with it; MPI started later
    in that process forms a world of its own instead of asking the service that is gone (before:
    MPIUnavailableError, connection refused)."""
    script = Path(__file__).parent / "jobs" / "after_scheduler.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    results = [line[len("RESULT "):] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and results, (out.stdout, out.stderr[-5000:])
    assert json.loads(results[0]) == {"sizes": [2, 2], "right": True}


@pytest.mark.parametrize("protocol", ["mpi", "tcp"])
def test_socket_only_writes_hold_no_copy_of_large_frames_and_close_delivers_them(protocol):
    """Two processes of no common MPI world (an outside client, a Nanny's worker and its scheduler): every
    frame takes the socket.  A 256 MiB array written to a reader whose handler waits 1 s raises the writer's peak
    RSS by no copy of it (before Python 3.12, asyncio's transport copied what one write left unsent: +378
    MiB), and a 64 MiB array written right before ``close()``, with the event loop ending at once, still
    arrives whole (before: it was lost with the loop's buffer, and the reader waited for it).  tcp:// is
    run the same way, as the reference."""
    script = Path(__file__).parent / "jobs" / "socket_writer_memory.py"
    rc, out, err = run_command([sys.executable, str(script), protocol], 150)  # kills the reader too on timeout
    assert rc == 0 and "READER True True" in out, (out, err[-5000:])
    grew, uses_mpi = out.split("WRITER ", 1)[1].split()[:2]
    assert float(grew) < 32, f"the writer's peak RSS rose by {grew} MiB over its 256 MiB array"
    assert uses_mpi == {"mpi": "False", "tcp": "None"}[protocol], out
