"""mpi:// between ranks of one mpiexec job.  Usage: comm_job.py MODE [ARG]

Every rank prints ``RANK <r> OK ...`` when its checks passed; the test asserts on those lines.
"""

import asyncio
import atexit
import hashlib
import itertools
import os
import select
import signal
import sys
import time

import numpy as np
from distributed.comm import CommClosedError, connect, listen
from distributed.protocol import to_serialize
from distributed.protocol.utils_test import get_host_array

from mpi4dask import _datapath, _endpoint, _mpi, _progress

mode = sys.argv[1]
if mode != "victim":
    w = _mpi.world()
    MPI, world, rank, size = w.MPI, w.comm, w.rank, w.size


def digest(a):
    return hashlib.sha256(memoryview(a).cast("B")).hexdigest()


def payload(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def echo(comm):
    try:
        while True:
            msg = await comm.read()
            await comm.write(msg)
    except CommClosedError:
        pass


def answer_until_closed(answer, finished: asyncio.Event):
    """A listener's handler that writes ``await answer(msg)`` back for every message (nothing when it
    is None) and sets ``finished`` once the peer closed the connection."""

    async def handler(comm):
        try:
            while True:
                reply = await answer(await comm.read())
                if reply is not None:
                    await comm.write(reply)
        except CommClosedError:
            finished.set()

    return handler


async def listen_on_rank0(handler):
    """Rank 0 listens with ``handler``; every rank gets the address (rank 0 also the listener)."""
    listener = None
    if rank == 0:
        listener = listen("mpi://127.0.0.1:0", handler)
        await listener.start()
    addr = world.bcast(listener.contact_address if listener else None, root=0)
    return listener, addr


async def pingpong():
    """Rank 0 listens; every other rank opens 3 connections and ping-pongs all sizes on each, at once."""
    sizes = [0, 1, 1000, 16 << 10, 70 << 10, 1 << 20, 9 << 20, 40 << 20]
    listener, addr = await listen_on_rank0(echo)
    if rank != 0:
        comms = [await connect(addr) for _ in range(3)]
        assert all(c.uses_mpi for c in comms), [repr(c) for c in comms]

        async def one(k, c):
            n_checked = 0
            for i, n in enumerate(sizes):
                a = payload(rank * 1000 + k * 100 + i, n)
                await c.write({"k": k, "i": i, "x": to_serialize(a), "d": digest(a)})
                back = await c.read()
                assert back["k"] == k and back["i"] == i and digest(back["x"]) == back["d"] == digest(a)
                n_checked += 1
            await c.close()
            return n_checked

        checked = await asyncio.gather(*(one(k, c) for k, c in enumerate(comms)))
        print(f"RANK {rank} OK checked={sum(checked)}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, world.Barrier)
    if rank == 0:
        listener.stop()
        print(f"RANK {rank} OK", flush=True)


async def both_ways():
    """Two ranks each listen and connect to the other, then both stream large messages at once."""
    n, count = 16 << 20, 6
    listener = listen("mpi://127.0.0.1:0", None)
    received = []
    done = asyncio.Event()

    async def sink(comm):
        for _ in range(count):
            msg = await comm.read()
            received.append((msg["i"], digest(msg["x"]) == msg["d"]))
        await comm.write("got all")
        done.set()

    listener.comm_handler = sink
    await listener.start()
    addrs = world.allgather(listener.contact_address)
    comm = await connect(addrs[1 - rank])
    assert comm.uses_mpi
    for i in range(count):
        a = payload(rank * 100 + i, n)
        await comm.write({"i": i, "x": to_serialize(a), "d": digest(a)})
    assert await comm.read() == "got all"
    await asyncio.wait_for(done.wait(), 60)
    assert received == [(i, True) for i in range(count)], received
    await asyncio.get_running_loop().run_in_executor(None, world.Barrier)
    await comm.close()
    listener.stop()
    print(f"RANK {rank} OK both-ways", flush=True)


async def serve_outsider(addr_file):
    """Rank 0 listens for a client outside the job; rank 1 also connects to it (over MPI)."""
    modes = []

    async def handler(comm):
        modes.append(comm.uses_mpi)
        await echo(comm)

    listener, addr = await listen_on_rank0(handler)
    if rank == 1:
        c = await connect(addr)
        a = payload(5, 3 << 20)
        await c.write({"x": to_serialize(a)})
        assert digest((await c.read())["x"]) == digest(a)
        assert c.uses_mpi
        await c.close()
    if rank == 0:
        with open(addr_file + ".tmp", "w") as f:
            f.write(addr)
        os.rename(addr_file + ".tmp", addr_file)
        t0 = time.monotonic()
        while len(modes) < 2 and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # let the outsider finish its exchange
        print(f"RANK 0 OK modes={sorted(modes)}", flush=True)
        listener.stop()
    await asyncio.get_running_loop().run_in_executor(None, world.Barrier)


async def killed_outsider(addr_file):
    """A process outside the job connects to rank 0 and is SIGKILLed while it streams messages.

    Rank 0's read and write on that connection must fail within seconds, and the job, which
    lost no rank, goes on using MPI and ends cleanly.
    """
    if rank == 0:
        got = asyncio.get_running_loop().create_future()
        listener = listen("mpi://127.0.0.1:0", lambda comm: got.set_result(comm))
        await listener.start()
        with open(addr_file + ".tmp", "w") as f:
            f.write(listener.contact_address)
        os.rename(addr_file + ".tmp", addr_file)
        comm = await asyncio.wait_for(got, 60)
        victim = (await comm.read())["pid"]
        for _ in range(20):
            await comm.read()
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            for _ in range(100000):  # what was sent before the kill may still arrive, then the error
                await asyncio.wait_for(comm.read(), 15)
            outcome = "no-error"
        except CommClosedError:
            outcome = "CommClosedError"
        except asyncio.TimeoutError:
            outcome = "hang"
        read_s = time.monotonic() - t0
        try:
            for _ in range(3):
                await comm.write({"x": to_serialize(payload(2, 1 << 20))})
            w_outcome = "no-error"
        except CommClosedError:
            w_outcome = "CommClosedError"
        print(f"RANK 0 OK read={outcome} after={read_s:.2f}s write={w_outcome}", flush=True)
        listener.stop()
    # the job itself is unharmed
    token = world.bcast(digest(payload(7, 1 << 20)) if rank == 0 else None, root=0)
    assert token == digest(payload(7, 1 << 20))
    if rank == 1:
        print("RANK 1 OK", flush=True)


async def victim(addr_file):
    """(Not under mpiexec.) Connect, then stream small messages until killed."""
    c = await connect(open(addr_file).read())
    await c.write({"pid": os.getpid()})
    for i in itertools.count():
        await c.write({"i": i, "x": to_serialize(payload(i, 1000))})
        await asyncio.sleep(0.001)


async def rank_dies():
    """Rank 1 SIGKILLs itself while ranks 0 and 2 talk over MPI: the job must end, not hang."""
    listener, addr = await listen_on_rank0(echo)
    if rank != 0:
        c = await connect(addr)
        if rank == 1:
            await asyncio.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            await c.write({"x": to_serialize(payload(1, 300_000))})
            await c.read()
    await asyncio.sleep(3600)


async def slow_reader(scheme, count):
    """Rank 1 writes ``count`` fresh 1 MiB arrays as fast as its writes return; rank 0 reads one
    every 5 ms.  Rank 0 reports how far its peak RSS rose above its RSS before the traffic, and the peak."""
    import resource

    count = int(count)
    got = []
    done = asyncio.Event()

    async def reader(comm):
        base = psutil_rss()
        for i in range(count):
            msg = await comm.read()
            assert msg["i"] == i and digest(msg["x"]) == digest(payload(i, 1 << 20)), i
            got.append(i)
            del msg
            await asyncio.sleep(0.005)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"RANK 0 OK scheme={scheme} read={len(got)} peak_rise_mib={(peak - base) / 2**20:.0f} "
              f"peak_mib={peak / 2**20:.0f}", flush=True)
        await comm.close()
        done.set()

    listener = None
    if rank == 0:
        listener = listen(f"{scheme}://127.0.0.1:0", reader)
        await listener.start()
    addr = world.bcast(listener.contact_address if listener else None, root=0)
    if rank == 1:
        comm = await connect(addr)
        for i in range(count):
            await comm.write({"i": i, "x": to_serialize(payload(i, 1 << 20))})
        from mpi4dask import _metrics

        # the sender's waits for its window, as its /metrics counts them (mpi4dask_send_window_stalls_total)
        print(f"RANK 1 OK wrote={count} stalls={_metrics.counts['window_stalls']}", flush=True)
        try:
            await comm.read()  # until the reader closes
        except CommClosedError:
            pass
    else:
        await done.wait()
        listener.stop()


async def many_frames():
    """Messages of 160 frames of 260 KB, each frame over MPI: more than MPICH's shared-memory queue
    holds at once, so most of them wait inside MPI for the sender's progress (which the reader's
    nudges and the writer's tests give).  Echoed back intact, three times."""
    listener, addr = await listen_on_rank0(echo)
    if rank == 1:
        comm = await connect(addr)
        assert comm.uses_mpi
        t0 = time.monotonic()
        for r in range(3):
            frames = [payload(1000 * r + i, 260_000) for i in range(160)]
            await comm.write({"r": r, "x": [to_serialize(f) for f in frames]})
            back = await comm.read()
            assert back["r"] == r and [digest(f) for f in back["x"]] == [digest(f) for f in frames], r
            # joined into few MPI messages, each scattered by MPI into the frames' buffers: none shares one
            assert len({id(get_host_array(f)) for f in back["x"]}) == len(frames), r
        print(f"RANK 1 OK many_frames {time.monotonic() - t0:.2f}s", flush=True)
        await comm.close()
    await asyncio.get_running_loop().run_in_executor(None, world.Barrier)
    if rank == 0:
        print("RANK 0 OK", flush=True)
        listener.stop()


async def ahead():
    """Ping-pong of messages whose MPI frames are laid out every way a header can announce them (one
    frame, frames joined into one MPI message, several MPI messages, none), so that the replies'
    MPI bytes are taken in before their headers arrive (the reader polls while it waits for a
    reply); every byte checked, and the count of messages taken in ahead printed."""
    finished = asyncio.Event()

    async def echo_arrays(msg):  # as distributed sends data: arrays marked for serialization
        return {**msg, "x": [to_serialize(a) for a in msg["x"]]}

    listener, addr = await listen_on_rank0(answer_until_closed(echo_arrays, finished))
    if rank == 1:
        comm = await connect(addr)
        assert comm.uses_mpi
        layouts = [[1 << 20], [5 << 20, 5 << 20], [300_000, 3 << 20], [10], [9 << 20], [400_000, 300_000, 6 << 20]]
        stats = comm._progress.reply_stats
        sock = comm._ch.transport.get_extra_info("socket")
        # replies with MPI frames that came while the reader polled, not already there when it began to
        # read: only those can have MPI bytes taken in ahead of their headers (on a machine with one
        # other busy process, most polled replies are: the reader lost its core while the reply came)
        waited = 0
        # made beforehand: the reader polls only in a busy exchange (its reads after requests come within
        # _progress.REPLY_WARM), which making 9 MB of payload between rounds is not
        rounds = [[payload(r * 10 + i, n) for i, n in enumerate(layouts[r % len(layouts)])] for r in range(40)]
        sums = [[digest(a) for a in arrays] for arrays in rounds]
        for r, arrays in enumerate(rounds):
            layout = layouts[r % len(layouts)]
            await comm.write({"r": r, "x": [to_serialize(a) for a in arrays], "d": sums[r]})
            before, there = stats["replies"], select.select([sock], [], [], 0)[0]
            back = await comm.read()
            if stats["replies"] > before and not there and max(layout) >= _datapath.MPI_MIN_FRAME:
                waited += 1
            got = [digest(a) for a in back["x"]]
            assert back["r"] == r and got == list(back["d"]) == sums[r], r
        print(f"RANK 1 OK ahead={comm.stats['mpi_messages_ahead']} of {comm.stats['messages_received']} "
              f"polls={stats['polls']} replies={stats['replies']} misses={stats['misses']} here={stats['here']} "
              f"waited={waited}", flush=True)
        await comm.close()
    else:  # not in MPI_Barrier meanwhile: a rank waiting there spins, and the reader would find no idle core
        await finished.wait()
    await asyncio.get_running_loop().run_in_executor(None, world.Barrier)
    if rank == 0:
        print("RANK 0 OK", flush=True)
        listener.stop()


async def pandas_frames():
    """Dataframes and series back and forth as a worker's ``get_data`` answers (``{"status": "OK",
    "data": {key: to_serialize(frame)}}``), two messages a round each way:

    * plain objects, which mpi4dask pickles itself (its fast path): a partition of two blocks (4 MB
      and 2 MB: each its own MPI message), 12 small partitions of two 80 KB blocks each (joined into
      one MPI message), a series with an int64 index, a small frame on the socket;
    * others, which distributed serializes: a frame with a string column, and a row slice of a
      two-block frame (its blocks are not contiguous).

    Every object is checked against a hash of its rows, index, column labels and dtypes; the writer's
    path for each message is counted on both sides.  The reader polls for the replies, so their
    headers come while it waits and the plain ones are decoded as their bytes arrive."""
    import pandas as pd

    from mpi4dask import _wire

    finished = asyncio.Event()
    paths = {"fast": 0, "distributed": 0}
    dumps = _wire.dumps

    def counted_dumps(msg):  # which path each message this process writes takes
        frames = dumps(msg)
        if isinstance(msg, dict) and "data" in msg:
            paths["fast" if frames is not None else "distributed"] += 1
        return frames

    _wire.dumps = counted_dumps

    async def answer(msg):
        return {"status": "OK", "data": {k: to_serialize(v) for k, v in msg["data"].items()}}

    def fingerprint(x):
        rows = pd.util.hash_pandas_object(x, index=True).to_numpy()
        labels = list(x.columns) if isinstance(x, pd.DataFrame) else [x.name]
        dtypes = list(x.dtypes) if isinstance(x, pd.DataFrame) else [x.dtype]
        return hashlib.sha256(rows.tobytes() + repr((labels, dtypes, x.index.dtype)).encode()).hexdigest()

    def plain(r):
        rng = np.random.default_rng(r)
        n = 250_000
        out = {
            "blocks": pd.DataFrame({"key": rng.integers(0, n, n), "id": np.arange(n), "v": rng.random(n)}),
            "series": pd.Series(rng.random(n // 2), name="s", index=pd.Index(rng.permutation(n // 2))),
            "small": pd.DataFrame({"a": rng.integers(0, 9, 100).astype("i2"), "b": rng.random(100) > 0.5}),
        }
        for i in range(12):
            out[f"piece{i}"] = pd.DataFrame({"k": rng.integers(0, n, 10_000), "v": rng.random(10_000)},
                                            index=pd.Index(rng.permutation(10_000) * (i + 1)))
        return out

    def others(r):
        rng = np.random.default_rng(1000 + r)
        n = 200_000
        whole = pd.DataFrame({"key": rng.integers(0, n, n), "id": np.arange(n), "v": rng.random(n)})
        return {
            "strings": pd.DataFrame({"s": [f"row{i}" for i in rng.integers(0, 1000, 20_000)], "v": rng.random(20_000)}),
            "sliced": whole.iloc[1000:150_000],
        }

    listener, addr = await listen_on_rank0(answer_until_closed(answer, finished))
    if rank == 1:
        comm = await connect(addr)
        assert comm.uses_mpi
        checked = 0
        for r in range(12):
            for sent in (plain(r), others(r)):
                await comm.write({"op": "get_data", "data": {k: to_serialize(v) for k, v in sent.items()}})
                back = await comm.read()
                assert back["status"] == "OK" and back["data"].keys() == sent.keys(), r
                for k, x in sent.items():
                    y = back["data"][k]
                    assert type(y) is type(x) and fingerprint(y) == fingerprint(x), (r, k)
                    checked += 1
        print(f"RANK 1 OK pandas checked={checked} mpi_bytes={comm.stats['mpi_bytes_received']} "
              f"socket_bytes={comm.stats['socket_bytes_received']} fast={paths['fast']} "
              f"distributed={paths['distributed']}", flush=True)
        await comm.close()
    else:
        await finished.wait()
    await asyncio.get_running_loop().run_in_executor(None, world.Barrier)
    if rank == 0:
        from mpi4dask import _metrics

        # replies whose MPI frames took the socket: where MPI's copy needs both ends' calls and every
        # core is taken (Intel MPI, MPICH 4)
        print(f"RANK 0 OK busy={_metrics.counts['busy_socket_messages']} fast={paths['fast']} "
              f"distributed={paths['distributed']}", flush=True)
        listener.stop()


async def slow_replies(delay):
    """A reader that waits for replies which come late (``delay`` seconds), then for one that never
    comes: the CPU it uses meanwhile (its loop polls for a reply only briefly, and less after misses)."""

    finished = asyncio.Event()

    async def late_echo(msg):
        if msg.get("answer", True):
            await asyncio.sleep(delay)
            return msg
        return None

    listener, addr = await listen_on_rank0(answer_until_closed(late_echo, finished))
    if rank == 1:
        comm = await connect(addr)
        assert comm.uses_mpi
        await comm.write({"i": -1, "x": to_serialize(payload(1, 300_000))})
        await comm.read()
        data = payload(2, 300_000)  # over MPI

        async def exchanges():
            t0, c0 = time.monotonic(), time.process_time()
            for i in range(150):
                await comm.write({"i": i, "x": to_serialize(data)})
                assert (await comm.read())["i"] == i
            return (time.process_time() - c0) / (time.monotonic() - t0)

        late = await exchanges()
        stats = dict(comm._progress.reply_stats)
        # the same exchanges with reply polling off: what they cost without it (the VM's speed of the day)
        spin, _progress.REPLY_SPIN = _progress.REPLY_SPIN, 0.0
        base = await exchanges()
        _progress.REPLY_SPIN = spin
        await comm.write({"answer": False})
        reader = asyncio.ensure_future(comm.read())  # a reply that never comes
        t0, c0 = time.monotonic(), time.process_time()
        await asyncio.sleep(3)
        never = (time.process_time() - c0) / (time.monotonic() - t0)
        print(f"RANK 1 OK late_cpu={late * 100:.2f}% base_cpu={base * 100:.2f}% never_cpu={never * 100:.2f}% "
              f"polls={stats['polls']} misses={stats['misses']}", flush=True)
        reader.cancel()
        await comm.close()
    else:
        await finished.wait()
    await asyncio.get_running_loop().run_in_executor(None, world.Barrier)
    if rank == 0:
        print("RANK 0 OK", flush=True)
        listener.stop()


def psutil_rss():
    import psutil

    return psutil.Process().memory_info().rss


async def idle_cpu(seconds):
    """Connections over MPI that sit idle must cost (almost) no CPU."""
    listener, addr = await listen_on_rank0(echo)
    if rank == 1:
        comms = [await connect(addr) for _ in range(4)]
        for c in comms:
            await c.write({"x": to_serialize(payload(1, 4 << 20))})
            await c.read()
        readers = [asyncio.ensure_future(c.read()) for c in comms]  # reads in flight, nothing coming
    t0, c0 = time.monotonic(), time.process_time()
    await asyncio.sleep(seconds)
    cpu = (time.process_time() - c0) / (time.monotonic() - t0)
    print(f"RANK {rank} OK idle_cpu={cpu * 100:.2f}%", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, world.Barrier)
    if rank == 1:
        for c in comms:
            await c.close()
        for r in readers:
            r.cancel()
    await asyncio.get_running_loop().run_in_executor(None, world.Barrier)
    if rank == 0:
        listener.stop()


keep = []


async def open_at_exit(peer_loop):
    """Rank 1 ends with its connection to rank 0 open, a 4 MiB message of rank 0's in flight on it.  At
    exit it shuts its socket for writing; rank 0, its loop ``running``, closes its end at once, and rank
    1 then waits only for bytes in transit (EXIT_QUIET_ENDED), not the 0.25 s quiet a peer that may
    still send gets -- as it does from rank 0 ``held`` (its loop blocked, so its end stays open).
    Rank 1 prints ``LAST <t>`` as its script's last act and ``EXITED <t>`` once the transport let go."""
    big = payload(7, 4 << 20)
    served, wrote = [], asyncio.Event()

    async def handler(comm):
        served.append(comm)
        msg = await comm.read()
        await comm.write({"x": to_serialize(msg["x"])})
        await comm.write({"x": to_serialize(big)})  # never read: in flight at rank 1's exit
        wrote.set()

    listener, addr = await listen_on_rank0(handler)
    loop = asyncio.get_running_loop()
    if rank == 1:
        assert _endpoint.current() is None
        # registered before the transport's exit hook (made with the first connection): runs after it
        atexit.register(lambda: print(f"RANK 1 EXITED {time.monotonic()} released={not keep[0]._ep.comms}",
                                      flush=True))
        c = await connect(addr)
        small = payload(3, 1 << 20)
        await c.write({"x": to_serialize(small)})
        assert digest((await c.read())["x"]) == digest(small)
        keep.append(c)
    else:
        await asyncio.wait_for(wrote.wait(), 30)
    await loop.run_in_executor(None, world.Barrier)
    if rank == 1:
        print(f"RANK 1 OK LAST {time.monotonic()}", flush=True)
        return
    if peer_loop == "running":
        deadline = time.monotonic() + 10
        while not served[0].closed() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert served[0].closed()
        await asyncio.sleep(1)
    else:
        time.sleep(1.5)  # the loop is held: rank 1's end of file is not read here until rank 1 has gone
    print("RANK 0 OK", flush=True)
    listener.stop()


if __name__ == "__main__":
    funcs = {"pingpong": pingpong, "both_ways": both_ways, "outsider": serve_outsider, "idle": idle_cpu,
             "open_at_exit": open_at_exit, "killed_outsider": killed_outsider, "victim": victim, "rank_dies": rank_dies,
             "slow_reader": slow_reader, "many_frames": many_frames, "ahead": ahead,
             "slow_replies": slow_replies, "pandas": pandas_frames}
    if mode == "outsider":
        import logging

        logging.basicConfig(level=logging.INFO)  # the socket fallback is reported at INFO level
    args = [float(a) if mode in ("idle", "slow_replies") else a for a in sys.argv[2:]]
    asyncio.run(asyncio.wait_for(funcs[mode](*args), 120 if mode != 'victim' else 600))
