"""The MPI side of ``mpi4dask bench comm`` (private).

``mpi4dask bench comm`` launches this module as ``mpiexec -n 2 python -m mpi4dask.bench.comm_job ...``.
Rank 0 drives every ping-pong and times it; rank 1 echoes.  The transports:

1. ``raw``: mpi4py ``Send``/``Recv`` of the payload bytes on a private duplicate of
   ``COMM_WORLD`` (the limit any MPI-based comm can approach; with ``--raw-buffers N`` the echo
   receives into N buffers in turn, as the Dask comms' echo must: :class:`_RawEcho`);
2. each Dask comm protocol (``tcp://``, ``mpi://``): rank 0 listens on ``<proto>://<host>:0``,
   broadcasts the contact address over MPI, rank 1 connects with :func:`distributed.comm.connect`,
   and the ranks exchange ``{"x": to_serialize(array)}`` with ``comm.write``/``comm.read``.

Every transport of a size sends the same payload array (:func:`_payload`).  All connections are open
at once, and **the transports take turns within each size**: each is
verified and warmed up, then the timed rounds run in ``--slices`` slices, raw MPI, tcp:// and mpi://
one slice each in turn (a different one going first in each slice), then each is verified again.
So a slow spell of the machine (a noisy VM, or the busy processes of ``--load`` holding the cores)
falls on every transport of a size alike, and the ratios compare the same moments; run one after the
other, a point measured tens of seconds after its counterpart swung the loaded 64 KiB ratio from
0.8x to 2.0x between runs.  A slice after another transport's starts with one untimed round.  An
idle ``mpi://`` or ``tcp://`` connection costs nothing meanwhile (no MPI call, no timer: ``bench
idle``).  The first Dask connection also carries rank 0's requests for raw MPI slices: rank 1
answers, then echoes raw MPI (blocking in MPI, as raw MPI is measured) until rank 0's stop message.
With ``--alone`` (or no Dask protocol to measure), each transport runs alone, one after the other,
each connection closed before the next opens: raw MPI, then ``tcp://``, then ``mpi://``.  Peak RSS
needs that (``bench idle`` measures memory so): in turns, a transport's peak also counts what the
others hold at the time (``mpi://``'s pooled receive buffers stay for a second after use).

Every point is checked: a full comparison of the echoed payload against the sent one in one
verification round before the warm-up and one after the timed rounds (with every byte of the
payload changed before each, so stale or truncated buffers cannot pass), and a per-round stamp
(the round number written into the first and last bytes) compared on every timed round.

Each rank also records its peak resident set size at each point (``VmHWM`` from
``/proc/self/status``, reset through ``/proc/self/clear_refs`` when each step of a point starts, the highest
of its steps kept; where that is not possible, ``ru_maxrss``, the peak of the whole process so
far).  For the Dask comms, rank 0 announces each step of a point to the echo side with a small
``{"op": "point"}`` message (untimed).

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


def _step(transport: str, size: int) -> None:
    """Progress: the point (transport, size) starts."""
    STATE.started += 1
    if STATE.rank == 0:
        step("comm", STATE.started, STATE.points, f"{'raw MPI' if transport == 'raw' else transport + '://'} "
             f"{format_size(size)}")


def _peak_start(transport: str, size: int) -> None:
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


_PAYLOADS: dict[tuple[int, int], Payload] = {}


def _payload(size: int, seed: int) -> Payload:
    """The payload of ``size``, one per size for all transports (the last size's let go).  Every transport
    sends the same bytes from the same memory: where a large array lies decides much of MPI's copy
    from it (its huge pages, its offset from a page; ~10-30% at 8-64 MiB on this project's VM), and a
    payload of its own per transport gave each a different draw of that."""
    key = (size, seed)
    if key not in _PAYLOADS:
        _PAYLOADS.clear()
        _PAYLOADS[key] = Payload(size, seed + size)
    return _PAYLOADS[key]


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
    """Timed rounds for about ``target`` seconds at the fastest warm-up round's pace: a point's first rounds pay
    for first touches (a receive buffer faulted in: 10-70 ms at 64 MiB), and planned from their median, mpi://'s
    64 MiB point got 13-17 rounds against raw MPI's 119-134, and a median of 4139-4687 us where 118 rounds gave
    3788 us (2026-11-30, this project's VM)."""
    if requested is not None:
        return requested
    per_round = min(warm_rtts) if warm_rtts else target
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
        "mpi_share": None,  # mpi:// (_DaskPoint): the share of its bytes that MPI carried
        "busy_socket_messages": None,
    }


def _progress(rec: dict) -> str:
    return (
        f"{rec['transport']:>4} {rec['size']:>10} B: {rec['iterations']} rounds (+{rec['warmup']} warm-up), "
        f"one-way median {rec['one_way_median_us']:.1f} us (min {rec['one_way_min_us']:.1f}), "
        f"{rec['throughput_GBps']:.3g} GB/s, payload verified"
    )


def _split(count: int, slices: int) -> list[int]:
    """``count`` timed rounds spread over ``slices`` slices as evenly as possible (the first get one more)."""
    q, r = divmod(count, slices)
    return [q + (k < r) for k in range(slices)]


class _Point:
    """One transport at one size on rank 0: a verification round, the warm-up, timed rounds in one or
    more slices (other transports' slices between them), a verification round, and the record.

    Subclasses give ``_round()``: one round trip, returning what came back and its seconds (timed
    around the exchange alone, so raw MPI's sub-microsecond rounds carry no coroutine's cost)."""

    transport = ""

    def __init__(self, size: int, payload: Payload):
        self.size = size
        self.p = payload
        self.n = 0  # round trips so far (the stamp of the next)
        self.warm: list[float] = []
        self.rtts: list[float] = []
        self.plan: list[int] = []
        self.slice_starts: list[float] = []  # when each slice's timed rounds began (perf_counter)
        self.elapsed = 0.0
        self.label = f"{'raw MPI' if self.transport == 'raw' else self.transport + '://'}, {size} B"

    async def begin(self, iterations, warmup, target, slices: int) -> None:
        """Verify, warm up, and plan the timed rounds (about ``target`` seconds, or ``iterations``) in slices."""
        t = time.perf_counter()
        STATE.transport, STATE.size, STATE.phase = self.transport, self.size, "verification before warm-up"
        await self._verify(f"{self.label}, verification round before warm-up")
        STATE.phase = "warm-up"
        while _warmup_rounds(self.warm, warmup, target):
            self.warm.append(await self._timed(f"warm-up round {len(self.warm) + 1}"))
        self.plan = [k for k in _split(_timed_rounds(self.warm, iterations, target), slices) if k]
        self.elapsed += time.perf_counter() - t

    async def slice(self, k: int, rewarm: bool) -> None:
        """The ``k``-th slice of timed rounds; ``rewarm``: another transport ran since this one's last round,
        so one untimed round first."""
        if k >= len(self.plan):
            return
        t = time.perf_counter()
        STATE.transport, STATE.size, STATE.phase = self.transport, self.size, f"timed rounds, slice {k + 1}"
        if rewarm:
            await self._timed("re-warm round")
        mark = self._mark()
        self.slice_starts.append(time.perf_counter())
        for _ in range(self.plan[k]):
            STATE.round = len(self.rtts)
            self.rtts.append(await self._timed(f"timed round {len(self.rtts)}"))
        self._count(mark)
        self.elapsed += time.perf_counter() - t

    async def finish(self) -> dict:
        t = time.perf_counter()
        STATE.transport, STATE.size, STATE.phase = self.transport, self.size, "verification after timed rounds"
        await self._verify(f"{self.label}, verification round after the timed rounds")
        self.elapsed += time.perf_counter() - t
        rec = _record(self.transport, self.size, len(self.warm), self.rtts, self.elapsed)
        rec["slices"] = len(self.plan)
        rec["slice_starts_s"] = self.slice_starts
        return rec

    def _mark(self):
        """What to count over a slice's timed rounds (``_count`` adds it up after them)."""

    def _count(self, mark) -> None:
        pass

    async def _timed(self, what: str) -> float:
        self.n += 1
        self.p.stamp(self.n)
        echo, rtt = await self._round()
        self.p.check_stamp(echo, f"{self.label}, {what}")
        return rtt

    async def _verify(self, where: str) -> None:
        self.p.change_all()
        self._clear()
        self.p.check_full((await self._round())[0], where)

    def _clear(self) -> None:
        """Before a verification round: nothing of an earlier round may pass for its echo."""


class _RawPoint(_Point):
    """Raw mpi4py ``Send``/``Recv`` on the benchmark's own communicator; rank 1 echoes (:class:`_RawEcho`)."""

    transport = "raw"

    def __init__(self, comm, size: int, payload: Payload):
        super().__init__(size, payload)
        self.rbuf = _receive_buffer(size)
        self.Send, self.Recv = comm.Send, comm.Recv

    async def _round(self):
        t0 = time.perf_counter()
        self.Send(self.p.buf, 1, _TAG_DATA)
        self.Recv(self.rbuf, 1, _TAG_DATA)
        return self.rbuf, time.perf_counter() - t0

    def _clear(self) -> None:
        self.rbuf.fill(0)


class _DaskPoint(_Point):
    """``{"x": to_serialize(array)}`` through ``Comm.write``/``Comm.read``; the peer echoes (:func:`_echo`)."""

    def __init__(self, comm, proto: str, size: int, payload: Payload):
        self.transport = proto
        super().__init__(size, payload)
        self.comm = comm
        self.routes = [0, 0, 0]  # mpi://: bytes over MPI, bytes on the socket, busy-socket messages (timed rounds)

    async def _round(self):
        from distributed.protocol import to_serialize

        t0 = time.perf_counter()
        await self.comm.write({"x": to_serialize(self.p.buf)})
        msg = await self.comm.read()
        return (msg.get("x") if isinstance(msg, dict) else msg), time.perf_counter() - t0

    def _mark(self):
        return _moved(self.comm)

    def _count(self, before) -> None:
        after = _moved(self.comm)
        if before is not None and after is not None:
            self.routes = [r + a - b for r, a, b in zip(self.routes, after, before)]

    async def finish(self) -> dict:
        rec = await super().finish()
        mpi, sock, busy = self.routes
        if _moved(self.comm) is not None:
            rec.update({"mpi_share": mpi / (mpi + sock) if mpi + sock else None, "busy_socket_messages": busy})
        return rec


async def _alone(point: _Point, iterations, warmup, target) -> dict:
    """``point`` measured in one slice, nothing between its warm-up and its timed rounds; its record."""
    await point.begin(iterations, warmup, target, 1)
    await point.slice(0, rewarm=False)
    return await point.finish()


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


class _RawEcho:
    """Rank 1's side of raw MPI: every message straight back, until the driver's stop message."""

    def __init__(self, comm, MPI, buffers: int = 1):
        self.comm, self.ANY_TAG, self.status = comm, MPI.ANY_TAG, MPI.Status()
        self.size, self.bufs, self.buffers = -1, [], buffers
        self.turn = 0  # the buffer the next message goes into: bufs[turn % buffers]

    def _buffer(self) -> np.ndarray:
        """The next receive buffer, in turn."""
        buf = self.bufs[self.turn % self.buffers]
        self.turn += 1
        return buf

    def _size(self, size: int) -> None:
        if size != self.size:
            self.bufs = []  # free the last size's buffers first
            self.bufs, self.size = [_receive_buffer(size) for _ in range(self.buffers)], size
            for buf in self.bufs:  # touched now, not in the rounds: the limit pays no first-touch page faults
                buf.fill(0)

    def _rounds(self) -> None:
        comm, status = self.comm, self.status
        while True:
            buf = self._buffer()
            comm.Recv(buf, source=0, tag=self.ANY_TAG, status=status)
            if status.Get_tag() == _TAG_STOP:
                return
            comm.Send(buf, dest=0, tag=_TAG_DATA)

    def run(self, size: int) -> None:
        """Echo one size's rounds (raw MPI alone: nothing else runs meanwhile)."""
        STATE.transport, STATE.size, STATE.phase = "raw", size, "echo"
        _peak_start("raw", size)
        self._size(size)
        self._rounds()
        _peak_stop()

    async def serve(self, size: int) -> None:
        """Echo one slice's rounds, entered from the event loop: the loop runs on (so that the reply which lets
        the driver start leaves this process) until the first message is in, then the echo blocks in MPI, as
        raw MPI is measured."""
        STATE.transport, STATE.size, STATE.phase = "raw", size, "echo"
        _peak_start("raw", size)
        self._size(size)
        buf = self._buffer()
        req = self.comm.Irecv(buf, source=0, tag=self.ANY_TAG)
        while not req.Test(self.status):
            await asyncio.sleep(0)
        if self.status.Get_tag() != _TAG_STOP:
            self.comm.Send(buf, dest=0, tag=_TAG_DATA)
            self._rounds()
        _peak_stop()


def run_raw(comm, MPI, sizes, iterations, warmup, target, seed, raw_buffers: int = 1) -> list[dict]:
    """Raw MPI alone (no Dask comm to interleave it with), size after size."""
    if comm.Get_rank() == 1:
        echo = _RawEcho(comm, MPI, raw_buffers)
        for size in sizes:
            echo.run(size)
        return []

    async def drive() -> list[dict]:
        records = []
        for size in sizes:
            _step("raw", size)
            _peak_start("raw", size)
            records.append(await _alone(_RawPoint(comm, size, _payload(size, seed)), iterations, warmup, target))
            comm.Send(np.empty(0, dtype=np.uint8), 1, _TAG_STOP)
            _peak_stop()
            _log(0, _progress(records[-1]))
        return records

    return asyncio.run(drive())


# ----------------------------------------------------------------------------------------------
# Dask comms
# ----------------------------------------------------------------------------------------------


async def _echo(comm, raw: _RawEcho | None = None, transport: str | None = None) -> None:
    """Echo every payload back until the driver's ``stop``.  With ``raw``, this is the connection that also
    carries the driver's requests for raw MPI: one hands this rank to raw MPI until the driver's stop message
    there.  ``transport``: the protocol (its peak RSS is recorded per point), by default ``STATE``'s."""
    from distributed.protocol import to_serialize

    while True:
        msg = await comm.read()
        if "x" in msg:
            await comm.write({"x": to_serialize(msg["x"])})
        elif msg.get("op") == "point":  # the driver starts a step of a point (untimed)
            _peak_start(transport or STATE.transport, int(msg["size"]))
            STATE.size = int(msg["size"])
            await comm.write({"op": "point-ok"})
        elif msg.get("op") == "raw" and raw is not None:
            await comm.write({"op": "raw-ok"})
            await raw.serve(int(msg["size"]))
        elif msg.get("op") == "stop":
            _peak_stop()
            await comm.write({"op": "stopped"})
            return
        else:
            raise BenchmarkError(f"echo side got an unexpected message: {str(msg)[:200]}")


async def _drive(comm, proto: str, sizes, iterations, warmup, target, seed) -> list[dict]:
    """The ping-pong of one Dask comm alone, size after size, each point in one slice (``bench pair``)."""
    records = []
    for size in sizes:
        records.append(await _alone(_DaskPoint(comm, proto, size, _payload(size, seed)), iterations, warmup,
                                     target))
        _log(0, _progress(records[-1]))
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


async def _ask(comm, msg: dict, reply: str) -> None:
    """Send the echo side a request (untimed) and check its reply."""
    await comm.write(msg)
    got = await comm.read()
    if got != {"op": reply}:
        raise BenchmarkError(f"expected the echo side's {reply!r}, got {str(got)[:200]}")


async def _connect(bench, protocols, host, connect_timeout) -> tuple[dict, list, asyncio.Event]:
    """One connection per Dask protocol between the two ranks, all open at once: (comms by protocol, rank 0's
    listeners, the event that releases rank 0's connection handlers)."""
    from distributed.comm import connect, listen

    comms, listeners, finished = {}, [], asyncio.Event()
    for proto in protocols:
        STATE.transport, STATE.size, STATE.phase, STATE.round = proto, 0, "connecting", 0
        if bench.Get_rank() == 0:
            incoming: asyncio.Queue = asyncio.Queue()

            async def handle(comm, incoming=incoming):
                await incoming.put(comm)
                await finished.wait()

            listener = listen(f"{scheme(proto)}://{host}:0", handle)
            await listener.start()
            listeners.append(listener)
            address = listener.contact_address
            _log(0, f"{proto}://: rank 0 listens at {address}")
            await asyncio.to_thread(bench.bcast, address, 0)
            try:
                comms[proto] = comm = await asyncio.wait_for(incoming.get(), connect_timeout)
            except asyncio.TimeoutError:
                raise BenchmarkError(
                    f"{proto}://: no connection from rank 1 reached the listener at {address} "
                    f"within {connect_timeout} s"
                ) from None
            _log(0, f"{proto}://: connected (local {comm.local_address}, peer {comm.peer_address})")
        else:
            address = await asyncio.to_thread(bench.bcast, None, 0)
            comms[proto] = await connect(address, timeout=connect_timeout)
    return comms, listeners, finished


async def _on(bench, control, point: _Point, action: str, *args):
    """One step of ``point`` (rank 0): rank 1 made ready for it, this rank's peak RSS recorded over it."""
    if isinstance(point, _DaskPoint):
        await _ask(point.comm, {"op": "point", "size": point.size}, "point-ok")
    else:
        await _ask(control, {"op": "raw", "size": point.size}, "raw-ok")
    _peak_start(point.transport, point.size)
    out = await getattr(point, action)(*args)
    _peak_stop()
    if not isinstance(point, _DaskPoint):
        bench.Send(np.empty(0, dtype=np.uint8), 1, _TAG_STOP)
    return out


async def run_interleaved(bench, MPI, protocols, host, sizes, iterations, warmup, target, slices, seed,
                          connect_timeout, with_raw: bool = True, raw_buffers: int = 1) -> list[dict]:
    """Raw MPI (``with_raw``) and every Dask comm of ``protocols``, each size's points interleaved in ``slices``
    slices (module docstring)."""
    comms, listeners, finished = await _connect(bench, protocols, host, connect_timeout)
    control = comms[protocols[0]]  # also carries rank 0's requests for raw MPI slices
    records: list[dict] = []
    if bench.Get_rank() == 1:
        raw = _RawEcho(bench, MPI, raw_buffers)
        STATE.phase = "echo"
        await asyncio.gather(*(_echo(comms[p], raw if comms[p] is control else None, p) for p in protocols))
    else:
        for size in sizes:
            payload = _payload(size, seed)  # one for every transport of the size: the same bytes from the same memory
            points: list[_Point] = [*([_RawPoint(bench, size, payload)] if with_raw else []),
                                    *(_DaskPoint(comms[p], p, size, payload) for p in protocols)]
            for point in points:
                _step(point.transport, size)
                await _on(bench, control, point, "begin", iterations, warmup, target, slices)
            last = points[-1]
            for k in range(slices):
                for point in points[k % len(points):] + points[: k % len(points)]:  # each goes first in turn
                    if k < len(point.plan):
                        await _on(bench, control, point, "slice", k, point is not last)
                        last = point
            for point in points:
                records.append(await _on(bench, control, point, "finish"))
                _log(0, _progress(records[-1]))
        STATE.phase, STATE.size = "closing", 0
        for p in protocols:
            await _ask(comms[p], {"op": "stop"}, "stopped")
    for comm in comms.values():
        await comm.close()
    finished.set()
    for listener in listeners:
        listener.stop()
    STATE.phase = "barrier after closing"
    await asyncio.to_thread(bench.Barrier)
    return records


async def run_alone(bench, MPI, protocols, host, sizes, iterations, warmup, target, seed,
                    connect_timeout) -> list[dict]:
    """Every Dask comm alone, one after the other, each connection closed before the next opens (``--alone``:
    each point's peak RSS is then its own, not also what another transport's connection holds)."""
    records = []
    for proto in protocols:
        records += await run_interleaved(bench, MPI, [proto], host, sizes, iterations, warmup, target, 1, seed,
                                         connect_timeout, with_raw=False)
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
        how = (args.host, sizes, args.iterations, args.warmup, args.target_time)
        if protocols and not args.alone:
            records = asyncio.run(run_interleaved(bench, MPI, protocols, *how, args.slices, args.seed,
                                                  args.connect_timeout, raw_buffers=args.raw_buffers))
        else:
            records = run_raw(bench, MPI, *how[1:], args.seed, args.raw_buffers)
            records += asyncio.run(run_alone(bench, MPI, protocols, *how, args.seed, args.connect_timeout))
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
                    "slices": 1 if args.alone else args.slices,
                    "alone": bool(args.alone or not protocols),
                    "host": args.host,
                    "raw_buffers": args.raw_buffers,
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
