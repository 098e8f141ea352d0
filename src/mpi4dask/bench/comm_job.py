"""The MPI side of ``mpi4dask bench comm`` (private).

``mpi4dask bench comm`` launches this module as ``mpiexec -n 2 python -m mpi4dask.bench.comm_job ...``.
Rank 0 drives every ping-pong and times it; rank 1 echoes.  Transports run one after the other:

1. ``raw``: mpi4py ``Send``/``Recv`` of the payload bytes on a private duplicate of
   ``COMM_WORLD`` (the limit any MPI-based comm can approach);
2. each Dask comm protocol (``tcp://``, then ``mpi://``): rank 0 listens on
   ``<proto>://<host>:0``, broadcasts the contact address over MPI, rank 1 connects with
   :func:`distributed.comm.connect`, and the ranks exchange ``{"x": to_serialize(array)}``
   with ``comm.write``/``comm.read``.

``tcp://`` runs before ``mpi://`` so that whatever progress machinery the ``mpi://`` backend
leaves running cannot slow the ``tcp://`` measurements.  All Dask-level work runs in one event
loop (a backend may bind state to the loop it first ran on).

Every point is checked: a full comparison of the echoed payload against the sent one in one
verification round before the warm-up and one after the timed rounds (with every byte of the
payload changed before each, so stale or truncated buffers cannot pass), and a per-round stamp
(the round number written into the first and last bytes) compared on every timed round.

Each rank also records its peak resident set size at each point (``VmHWM`` from
``/proc/self/status``, reset through ``/proc/self/clear_refs`` when a point starts; where that is
not possible, ``ru_maxrss``, the peak of the whole process so far).  For the Dask comms, rank 0
announces each point to the echo side with a small ``{"op": "point"}`` message (untimed).

Rank 0 writes the results as JSON to ``--result``.  On an error either rank prints it and aborts
the whole job; a watchdog ends each rank (after dumping its Python stacks and what it was doing)
when the deadline passes.
"""

from __future__ import annotations

import asyncio
import math
import os
import platform
import socket
import statistics
import sys
import time

import numpy as np

from .common import format_size
from .jobutil import (
    BenchmarkError,
    PeakRSS,
    abort_job,
    arm_watchdog,
    job_config,
    log,
    mpi_versions,
    scheme,
    step,
    two_rank_world,
    write_json,
)

# Tags on the private (duplicated) communicator of the raw benchmark.
_TAG_DATA = 1
_TAG_STOP = 2

#: Bounds on the adaptive number of timed rounds per point.
MIN_ITERATIONS = 5
MAX_ITERATIONS = 1_000_000
#: Bounds on the adaptive number of warm-up rounds per point.
MIN_WARMUP = 2
MAX_WARMUP = 200

DASK_PROTOCOL_ORDER = ("tcp", "mpi")
CONNECT_TIMEOUT = 30.0  # seconds for the two ranks of a protocol to connect


class _State:
    """What this rank is doing, for the watchdog's message (cheap to update in the hot loop)."""

    transport = "startup"
    size = 0
    phase = ""
    round = 0
    points = 0  # points (transport, size) in all, and started so far
    started = 0
    rank = 0

    def describe(self) -> str:
        if self.transport == "startup":
            return "start-up"
        return f"transport {self.transport}, size {self.size} B, {self.phase}, round {self.round}"

    def __str__(self) -> str:
        return "running " + self.describe()


STATE = _State()


PEAKS: PeakRSS | None = None


def _peak_start(transport: str, size: int) -> None:
    STATE.started += 1
    if STATE.rank == 0:
        step("comm", STATE.started, STATE.points, f"{'raw MPI' if transport == 'raw' else transport + '://'} "
             f"{format_size(size)}")
    if PEAKS is not None:
        PEAKS.start(transport, size)


def _peak_stop() -> None:
    if PEAKS is not None:
        PEAKS.stop()


def _log(rank: int, text: str) -> None:
    if rank == 0:
        log("comm", text)


# ----------------------------------------------------------------------------------------------
# Payload and round planning shared by all transports
# ----------------------------------------------------------------------------------------------


class Payload:
    """The send buffer of one size plus its integrity checks."""

    def __init__(self, size: int, seed: int):
        self.size = size
        rng = np.random.default_rng(seed)
        self.buf = rng.integers(0, 256, size=size, dtype=np.uint8)
        self.k = min(8, size)  # stamp width at each end
        self._stamp = np.zeros(1, dtype="<u8")
        self._stamp_bytes = self._stamp.view(np.uint8)

    def stamp(self, n: int) -> None:
        """Write round number ``n`` into the first and last bytes of the payload."""
        self._stamp[0] = n
        k = self.k
        self.buf[:k] = self._stamp_bytes[:k]
        self.buf[-k:] = self._stamp_bytes[:k]

    def check_stamp(self, echo, where: str) -> None:
        k = self.k
        if (
            not isinstance(echo, np.ndarray)
            or echo.shape != (self.size,)
            or echo[:k].tobytes() != self.buf[:k].tobytes()
            or echo[-k:].tobytes() != self.buf[-k:].tobytes()
        ):
            raise BenchmarkError(_mismatch(self.buf, echo, where))

    def change_all(self) -> None:
        """Change every byte, so a stale or partly written buffer cannot match the next echo."""
        np.add(self.buf, 1, out=self.buf)

    def check_full(self, echo, where: str) -> None:
        if (
            not isinstance(echo, np.ndarray)
            or echo.dtype != np.uint8
            or echo.shape != (self.size,)
            or not np.array_equal(echo, self.buf)
        ):
            raise BenchmarkError(_mismatch(self.buf, echo, where))


def _mismatch(sent, echo, where: str) -> str:
    if not isinstance(echo, np.ndarray):
        return f"{where}: echoed payload is a {type(echo).__name__}, not a numpy array"
    if echo.dtype != sent.dtype or echo.shape != sent.shape:
        return (
            f"{where}: echoed payload has dtype {echo.dtype} shape {echo.shape}, "
            f"sent dtype {sent.dtype} shape {sent.shape}"
        )
    bad = np.flatnonzero(echo != sent)
    first = int(bad[0]) if bad.size else -1
    return (
        f"{where}: echoed payload differs from the sent one in {bad.size} of {sent.size} bytes "
        f"(first at offset {first}: sent {int(sent[first])}, got {int(echo[first])})"
    )


def _warmup_rounds(rtts: list[float], requested: int | None, target: float) -> bool:
    """Whether another warm-up round is due, given the warm-up round trips so far."""
    n = len(rtts)
    if requested is not None:
        return n < requested
    if n < MIN_WARMUP:
        return True
    return n < MAX_WARMUP and sum(rtts) < 0.1 * target


def _timed_rounds(warm_rtts: list[float], requested: int | None, target: float) -> int:
    if requested is not None:
        return requested
    per_round = statistics.median(warm_rtts) if warm_rtts else target
    n = math.ceil(target / max(per_round, 1e-9))
    return max(MIN_ITERATIONS, min(MAX_ITERATIONS, n))


def _record(transport: str, size: int, warmup: int, rtts: list[float], elapsed: float) -> dict:
    one_way = np.asarray(rtts, dtype=float) / 2.0
    med = float(np.median(one_way))
    best = float(one_way.min())
    return {
        "transport": transport,
        "size": size,
        "iterations": len(rtts),
        "warmup": warmup,
        "one_way_median_us": med * 1e6,
        "one_way_min_us": best * 1e6,
        "one_way_mean_us": float(one_way.mean()) * 1e6,
        "one_way_p10_us": float(np.percentile(one_way, 10)) * 1e6,
        "one_way_p90_us": float(np.percentile(one_way, 90)) * 1e6,
        "throughput_GBps": size / med / 1e9,
        "peak_throughput_GBps": size / best / 1e9,
        "verified": True,
        "elapsed_s": elapsed,
        "mpi_share": None,  # mpi:// (_routes): the share of its bytes that MPI carried
        "busy_socket_messages": None,
    }


def _progress(rec: dict) -> str:
    return (
        f"{rec['transport']:>4} {rec['size']:>10} B: {rec['iterations']} rounds (+{rec['warmup']} warm-up), "
        f"one-way median {rec['one_way_median_us']:.1f} us (min {rec['one_way_min_us']:.1f}), "
        f"{rec['throughput_GBps']:.3g} GB/s, payload verified"
    )


# ----------------------------------------------------------------------------------------------
# Raw MPI
# ----------------------------------------------------------------------------------------------


def _receive_buffer(size: int) -> np.ndarray:
    """Raw MPI's receive buffers lie where mpi://'s do (its buffer pool: just past a huge-page boundary):
    the echo side sends from it, and MPI's single copy between processes runs ~10% faster from a
    huge-page-aligned buffer at 8 MiB, and 4-6x slower into a buffer 16 bytes past its source modulo
    4 KiB.  So raw MPI stays the limit of the same exchange, not a luckier or unluckier one."""
    from mpi4dask._endpoint import _receive_buffer as pooled_buffer

    return pooled_buffer(size)


def run_raw(comm, MPI, sizes, iterations, warmup, target, seed) -> list[dict]:
    rank = comm.Get_rank()
    STATE.transport = "raw"
    records = []
    if rank == 1:
        status = MPI.Status()
        for size in sizes:
            STATE.size, STATE.phase = size, "echo"
            _peak_start("raw", size)
            buf = _receive_buffer(size)
            while True:
                comm.Recv(buf, source=0, tag=MPI.ANY_TAG, status=status)
                if status.Get_tag() == _TAG_STOP:
                    break
                comm.Send(buf, dest=0, tag=_TAG_DATA)
            del buf
            _peak_stop()
        return records

    perf = time.perf_counter
    stop = np.empty(0, dtype=np.uint8)
    for size in sizes:
        STATE.size = size
        _peak_start("raw", size)
        start = perf()
        p = Payload(size, seed + size)
        rbuf = _receive_buffer(size)
        sbuf = p.buf
        Send, Recv = comm.Send, comm.Recv

        def verify(where: str, p=p, rbuf=rbuf, sbuf=sbuf, Send=Send, Recv=Recv) -> None:
            p.change_all()
            rbuf.fill(0)
            Send(sbuf, 1, _TAG_DATA)
            Recv(rbuf, 1, _TAG_DATA)
            p.check_full(rbuf, where)

        STATE.phase = "verification before warm-up"
        verify(f"raw MPI, {size} B, verification round before warm-up")
        STATE.phase = "warm-up"
        warm: list[float] = []
        n = 0
        while _warmup_rounds(warm, warmup, target):
            n += 1
            p.stamp(n)
            t0 = perf()
            Send(sbuf, 1, _TAG_DATA)
            Recv(rbuf, 1, _TAG_DATA)
            warm.append(perf() - t0)
            p.check_stamp(rbuf, f"raw MPI, {size} B, warm-up round {n}")
        count = _timed_rounds(warm, iterations, target)
        STATE.phase = "timed rounds"
        rtts = [0.0] * count
        for i in range(count):
            n += 1
            STATE.round = i
            p.stamp(n)
            t0 = perf()
            Send(sbuf, 1, _TAG_DATA)
            Recv(rbuf, 1, _TAG_DATA)
            rtts[i] = perf() - t0
            p.check_stamp(rbuf, f"raw MPI, {size} B, timed round {i}")
        STATE.phase = "verification after timed rounds"
        verify(f"raw MPI, {size} B, verification round after the timed rounds")
        comm.Send(stop, 1, _TAG_STOP)
        rec = _record("raw", size, len(warm), rtts, perf() - start)
        del p, rbuf, sbuf
        _peak_stop()
        records.append(rec)
        _log(0, _progress(rec))
    return records


# ----------------------------------------------------------------------------------------------
# Dask comms
# ----------------------------------------------------------------------------------------------


async def _echo(comm) -> None:
    from distributed.protocol import to_serialize

    while True:
        msg = await comm.read()
        if "x" in msg:
            await comm.write({"x": to_serialize(msg["x"])})
        elif msg.get("op") == "point":  # the driver starts a new point (untimed)
            _peak_start(STATE.transport, int(msg["size"]))
            STATE.size = int(msg["size"])
            await comm.write({"op": "point-ok"})
        elif msg.get("op") == "stop":
            _peak_stop()
            await comm.write({"op": "stopped"})
            return
        else:
            raise BenchmarkError(f"echo side got an unexpected message: {str(msg)[:200]}")


async def _drive(comm, proto: str, sizes, iterations, warmup, target, seed) -> list[dict]:
    from distributed.protocol import to_serialize

    perf = time.perf_counter
    records = []
    for size in sizes:
        STATE.size = size
        start = perf()
        p = Payload(size, seed + size)
        sbuf = p.buf
        label = f"{proto}://, {size} B"

        async def verify(where: str, p=p, sbuf=sbuf) -> None:
            p.change_all()
            await comm.write({"x": to_serialize(sbuf)})
            msg = await comm.read()
            p.check_full(msg.get("x") if isinstance(msg, dict) else msg, where)

        STATE.phase = "verification before warm-up"
        await verify(f"{label}, verification round before warm-up")
        STATE.phase = "warm-up"
        warm: list[float] = []
        n = 0
        while _warmup_rounds(warm, warmup, target):
            n += 1
            p.stamp(n)
            t0 = perf()
            await comm.write({"x": to_serialize(sbuf)})
            msg = await comm.read()
            warm.append(perf() - t0)
            p.check_stamp(msg.get("x"), f"{label}, warm-up round {n}")
        count = _timed_rounds(warm, iterations, target)
        STATE.phase = "timed rounds"
        before = _moved(comm)
        rtts = [0.0] * count
        for i in range(count):
            n += 1
            STATE.round = i
            p.stamp(n)
            t0 = perf()
            await comm.write({"x": to_serialize(sbuf)})
            msg = await comm.read()
            rtts[i] = perf() - t0
            p.check_stamp(msg.get("x"), f"{label}, timed round {i}")
        routes = _routes(before, _moved(comm))
        STATE.phase = "verification after timed rounds"
        await verify(f"{label}, verification round after the timed rounds")
        rec = _record(proto, size, len(warm), rtts, perf() - start)
        rec.update(routes)
        records.append(rec)
        _log(0, _progress(rec))
    return records


def _moved(comm) -> tuple[int, int, int] | None:
    """(bytes sent and received over MPI, on the socket, this process's messages that took the socket because
    every core was taken: mpi4dask_busy_socket_messages) so far on an mpi:// comm; None on another protocol."""
    from mpi4dask import _metrics

    st = getattr(comm, "stats", None)
    if not isinstance(st, dict) or "mpi_bytes_sent" not in st:
        return None
    return (st["mpi_bytes_sent"] + st["mpi_bytes_received"], st["socket_bytes_sent"] + st["socket_bytes_received"],
            _metrics.counts["busy_socket_messages"])


def _routes(before, after) -> dict:
    """What moved between two :func:`_moved` readings: the share of the bytes that MPI carried, and the
    driver's messages that took the socket because every core was taken (None on another protocol)."""
    if before is None or after is None:
        return {"mpi_share": None, "busy_socket_messages": None}
    mpi, sock = after[0] - before[0], after[1] - before[1]
    return {"mpi_share": mpi / (mpi + sock) if mpi + sock else None, "busy_socket_messages": after[2] - before[2]}


async def run_dask(bench, protocols, host, sizes, iterations, warmup, target, seed, connect_timeout) -> list[dict]:
    from distributed.comm import connect, listen

    rank = bench.Get_rank()
    records: list[dict] = []
    for proto in protocols:
        STATE.transport, STATE.size, STATE.phase, STATE.round = proto, 0, "connecting", 0
        if rank == 0:
            incoming: asyncio.Queue = asyncio.Queue()
            finished = asyncio.Event()

            async def handle(comm, incoming=incoming, finished=finished):
                await incoming.put(comm)
                await finished.wait()

            listener = listen(f"{scheme(proto)}://{host}:0", handle)
            await listener.start()
            address = listener.contact_address
            _log(0, f"{proto}://: rank 0 listens at {address}")
            await asyncio.to_thread(bench.bcast, address, 0)
            try:
                comm = await asyncio.wait_for(incoming.get(), connect_timeout)
            except asyncio.TimeoutError:
                raise BenchmarkError(
                    f"{proto}://: no connection from rank 1 reached the listener at {address} "
                    f"within {connect_timeout} s"
                ) from None
            _log(0, f"{proto}://: connected (local {comm.local_address}, peer {comm.peer_address})")
            for size in sizes:
                await comm.write({"op": "point", "size": size})
                reply = await comm.read()
                if reply != {"op": "point-ok"}:
                    raise BenchmarkError(f"{proto}://: expected the echo side's point reply, got {str(reply)[:200]}")
                _peak_start(proto, size)
                records += await _drive(comm, proto, [size], iterations, warmup, target, seed)
                _peak_stop()
            STATE.phase, STATE.size = "closing", 0
            await comm.write({"op": "stop"})
            reply = await comm.read()
            if reply != {"op": "stopped"}:
                raise BenchmarkError(f"{proto}://: expected the echo side's stop reply, got {str(reply)[:200]}")
            await comm.close()
            finished.set()
            listener.stop()
        else:
            address = await asyncio.to_thread(bench.bcast, None, 0)
            comm = await connect(address, timeout=connect_timeout)
            STATE.phase = "echo"
            await _echo(comm)
            STATE.phase = "closing"
            await comm.close()
        STATE.phase = "barrier after closing"
        await asyncio.to_thread(bench.Barrier)
    return records


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = job_config("mpi4dask.bench.comm_job", argv)
    args.connect_timeout = CONNECT_TIMEOUT
    arm_watchdog(args.deadline, "comm", STATE)
    sizes = list(args.sizes)
    requested = list(args.protocols)
    protocols = [p for p in DASK_PROTOCOL_ORDER if p in requested] + [
        p for p in requested if p not in DASK_PROTOCOL_ORDER
    ]

    w = two_rank_world("comm")
    if w is None:
        return 3

    MPI = w.MPI
    STATE.rank, STATE.points = w.rank, len(sizes) * (1 + len(protocols))
    global PEAKS
    PEAKS = PeakRSS()
    t_start = time.perf_counter()
    try:
        bench = w.comm.Dup()
        _log(w.rank, f"MPI world of 2 ready ({' '.join(MPI.Get_library_version().splitlines()[0].split())}, "
             f"thread level {MPI.Query_thread()})")
        records = run_raw(bench, MPI, sizes, args.iterations, args.warmup, args.target_time, args.seed)
        bench.Barrier()
        if protocols:
            records += asyncio.run(
                run_dask(
                    bench,
                    protocols,
                    args.host,
                    sizes,
                    args.iterations,
                    args.warmup,
                    args.target_time,
                    args.seed,
                    args.connect_timeout,
                )
            )
        STATE.transport, STATE.phase = "wrap-up", "gathering rank info"
        info = {"rank": w.rank, "host": socket.gethostname(), "pid": os.getpid(), "cpu_count": os.cpu_count(),
                "peak_rss_bytes": PEAKS.peaks, "peak_rss_method": PEAKS.method}
        try:
            info["affinity"] = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            pass
        ranks = bench.gather(info, root=0)
        if w.rank == 0:
            for rec in records:
                key = f"{rec['transport']}:{rec['size']}"
                rec["peak_rss_bytes"] = [r["peak_rss_bytes"].get(key) for r in ranks]
            for r in ranks:
                del r["peak_rss_bytes"]
            result = {
                "benchmark": "comm",
                "machine": {
                    "hostname": socket.gethostname(),
                    "cpu_count": os.cpu_count(),
                    "platform": platform.platform(),
                    "processes": w.size,
                    "ranks": ranks,
                    **mpi_versions(),
                },
                "config": {
                    "sizes": sizes,
                    "protocols": protocols,
                    "transports": ["raw", *protocols],
                    "iterations": args.iterations,
                    "warmup": args.warmup,
                    "target_time_s": args.target_time,
                    "host": args.host,
                    "message": '{"x": to_serialize(numpy uint8 array)} via Comm.write / Comm.read; raw: '
                    "mpi4py Comm.Send / Comm.Recv of the same bytes",
                    "one_way": "round trip / 2",
                    "peak_rss_method": PEAKS.method,
                    "peak_rss": "per record, [rank 0, rank 1] peak resident set size in bytes during that point",
                },
                "records": records,
                "job_elapsed_s": time.perf_counter() - t_start,
            }
            write_json(args.result, result)
        bench.Barrier()
        bench.Free()
    except BaseException:
        abort_job("comm", w, f"running {STATE.describe()}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
