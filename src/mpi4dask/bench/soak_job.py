"""The MPI side of ``mpi4dask stress soak`` (private).

``mpiexec -n 2 python -m mpi4dask.bench.soak_job --config FILE --result FILE``.  For each protocol (and each
run): rank 0 listens on ``<proto>://<host>:0``, sends the address to rank 1 over MPI, rank 1 opens
``--connections`` Dask comms to it.  After a barrier, on every connection both ranks send
``--messages`` messages *and* receive the peer's at the same time (one sender and one receiver task
per connection per rank), then an ``end`` message.

A message is ``{"op": "msg", "run", "conn", "dir", "seq", "sizes", "digests", "frames"}`` where
``frames`` is a list of 1..``--max-frames`` numpy ``uint8`` arrays (``to_serialize``; slices of a
random pool) whose total size is log-uniform in 0..``--max-size`` bytes (the plan of sizes is
seeded, so the receiver knows it too), and ``digests`` holds the SHA-256 of every frame.

The receiver checks every message and counts, per connection and direction:

* corrupted: a frame whose SHA-256 differs from the sent digest, sizes or frame count other than
  the plan's, a malformed message, or one that belongs to another connection, direction or run;
* duplicated: a sequence number received twice;
* out of order: a sequence number lower than one already received;
* lost: a sequence number never received by the time ``end`` arrives (or the connection stalls
  for ``--read-timeout`` seconds, or breaks).

Rank 0 writes the JSON result (per protocol and run: counts, messages/s, GB/s, the first problems
seen); the job exits with status 1 when any count is non-zero, 0 otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import sys
import time

import numpy as np

from .jobutil import (
    Doing,
    PeakRSS,
    abort_job,
    arm_watchdog,
    job_config,
    log,
    mpi_versions,
    quiet_distributed_logs,
    scheme,
    two_rank_world,
    write_json,
)

#: Messages whose frames hold more bytes than this are hashed in a thread (hashlib drops the GIL).
HASH_IN_THREAD = 256 << 10
#: Problems described in detail per connection and direction (the counts are always complete).
MAX_DETAILS = 5
CONNECT_TIMEOUT = 30.0  # seconds for the two ranks of a protocol to connect

doing = Doing()


# ----------------------------------------------------------------------------------------------
# Plan and payload
# ----------------------------------------------------------------------------------------------


def pool_size(max_size: int) -> int:
    return max(2 * max_size, 1 << 20)


def make_pool(max_size: int, seed: int, rank: int) -> np.ndarray:
    return np.random.default_rng([seed, 7, rank]).integers(0, 256, size=pool_size(max_size), dtype=np.uint8)


def plan(seed: int, run: int, conn: int, direction: int, n: int, max_size: int, max_frames: int):
    """The (frame sizes, pool offsets) of every message on one connection in one direction."""
    rng = np.random.default_rng([seed, run, conn, direction])
    top = math.log2(max_size + 1)
    span = pool_size(max_size)
    out = []
    for _ in range(n):
        total = min(max_size, int(2 ** rng.uniform(0, top)) - 1)  # log-uniform in 0..max_size
        k = int(rng.integers(1, max_frames + 1))
        cuts = np.sort(rng.integers(0, total + 1, size=k - 1))
        sizes = np.diff(np.concatenate(([0], cuts, [total]))).astype(int).tolist()
        offsets = [int(rng.integers(0, span - s + 1)) for s in sizes]
        out.append((sizes, offsets))
    return out


def digests(frames) -> list[str]:
    return [hashlib.sha256(memoryview(np.ascontiguousarray(f)).cast("B")).hexdigest() for f in frames]


async def digests_async(frames, nbytes: int) -> list[str]:
    if nbytes > HASH_IN_THREAD:
        return await asyncio.to_thread(digests, frames)
    return digests(frames)


# ----------------------------------------------------------------------------------------------
# One connection, one direction
# ----------------------------------------------------------------------------------------------


class Counts:
    def __init__(self, conn: int, direction: int, expected: int):
        self.conn = conn
        self.direction = direction
        self.expected = expected
        self.received = 0
        self.bytes = 0
        self.corrupted = 0
        self.duplicated = 0
        self.out_of_order = 0
        self.lost = 0
        self.end_seen = False
        self.details: list[str] = []

    def problem(self, kind: str, text: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.details) < MAX_DETAILS:
            self.details.append(f"conn {self.conn} dir {self.direction}: {kind}: {text}")

    def as_dict(self) -> dict:
        return {
            "conn": self.conn,
            "direction": self.direction,
            "expected": self.expected,
            "received": self.received,
            "bytes": self.bytes,
            "corrupted": self.corrupted,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "out_of_order": self.out_of_order,
            "end_seen": self.end_seen,
            "details": self.details,
        }


async def send_all(comm, pool, msgs, conn: int, direction: int, run: int) -> int:
    from distributed.protocol import to_serialize

    sent = 0
    for seq, (sizes, offsets) in enumerate(msgs):
        frames = [pool[o:o + s] for o, s in zip(offsets, sizes)]
        digs = await digests_async(frames, sum(sizes))
        await comm.write(
            {
                "op": "msg",
                "run": run,
                "conn": conn,
                "dir": direction,
                "seq": seq,
                "sizes": sizes,
                "digests": digs,
                "frames": [to_serialize(f) for f in frames],
            }
        )
        sent += sum(sizes)
    await comm.write({"op": "end", "run": run, "conn": conn, "dir": direction, "count": len(msgs)})
    return sent


async def receive_all(comm, msgs, conn: int, direction: int, run: int, read_timeout: float) -> Counts:
    from distributed.comm.core import CommClosedError

    n = len(msgs)
    c = Counts(conn, direction, n)
    seen: set[int] = set()
    highest = -1
    while True:
        try:
            msg = await asyncio.wait_for(comm.read(), read_timeout)
        except asyncio.TimeoutError:
            c.details.append(f"conn {conn} dir {direction}: stalled: no message for {read_timeout:g} s "
                             f"after {len(seen)} of {n}")
            break
        except (CommClosedError, OSError) as exc:
            c.details.append(f"conn {conn} dir {direction}: connection broke after {len(seen)} of {n}: {exc!r}")
            break
        if not isinstance(msg, dict):
            c.problem("corrupted", f"message is a {type(msg).__name__}, not a dict")
            continue
        op = msg.get("op")
        if op == "end":
            if (msg.get("conn"), msg.get("dir"), msg.get("run"), msg.get("count")) != (conn, direction, run, n):
                c.problem("corrupted", f"end message for another stream or count: {str(msg)[:200]}")
                continue
            c.end_seen = True
            break
        seq = msg.get("seq")
        if op != "msg" or not isinstance(seq, int) or not 0 <= seq < n:
            c.problem("corrupted", f"malformed message: {str(msg)[:200]}")
            continue
        if (msg.get("conn"), msg.get("dir"), msg.get("run")) != (conn, direction, run):
            c.problem("corrupted", f"seq {seq} belongs to conn {msg.get('conn')} dir {msg.get('dir')} "
                                   f"run {msg.get('run')} (misrouted)")
            continue
        # Ordering and duplicates.
        if seq in seen:
            c.problem("duplicated", f"seq {seq} received again")
            continue
        seen.add(seq)
        if seq < highest:
            c.problem("out_of_order", f"seq {seq} arrived after seq {highest}")
        highest = max(highest, seq)
        # Content.
        sizes = msgs[seq][0]
        frames = msg.get("frames")
        bad = None
        header_sizes = msg.get("sizes")  # msgpack gives sequences back as tuples
        if not isinstance(header_sizes, (list, tuple)) or list(header_sizes) != sizes:
            bad = f"seq {seq}: header sizes {header_sizes} != planned {sizes}"
        elif not isinstance(frames, (list, tuple)) or len(frames) != len(sizes):
            bad = (f"seq {seq}: {len(frames) if isinstance(frames, (list, tuple)) else type(frames).__name__} "
                   f"frames, planned {len(sizes)}")
        elif any(
            not isinstance(f, np.ndarray) or f.dtype != np.uint8 or f.shape != (s,) for f, s in zip(frames, sizes)
        ):
            got = [(getattr(f, "dtype", type(f).__name__), getattr(f, "shape", None)) for f in frames]
            bad = f"seq {seq}: frames {got} do not match the planned uint8 sizes {sizes}"
        else:
            got = await digests_async(frames, sum(sizes))
            want = msg.get("digests")
            want = list(want) if isinstance(want, (list, tuple)) else want
            if got != want:
                which = [i for i, (a, b) in enumerate(zip(got, want)) if a != b] if isinstance(want, list) else "all"
                bad = f"seq {seq}: SHA-256 mismatch in frame(s) {which} of sizes {sizes}"
        if bad:
            c.problem("corrupted", bad)
            continue
        c.received += 1
        c.bytes += sum(sizes)
    c.lost = n - len(seen)
    if c.lost and len(c.details) < MAX_DETAILS:
        missing = sorted(set(range(n)) - seen)
        c.details.append(f"conn {conn} dir {direction}: lost: {c.lost} seq(s) never arrived, first {missing[:10]}")
    return c


# ----------------------------------------------------------------------------------------------
# One protocol, one run
# ----------------------------------------------------------------------------------------------


async def soak_once(bench, proto: str, run: int, args, rank: int, pool) -> dict | None:
    from distributed.comm import connect, listen

    k = args.connections
    mine = 0 if rank == 0 else 1  # direction this rank sends: 0 = rank 0 -> 1, 1 = rank 1 -> 0
    theirs = 1 - mine
    send_plans = [plan(args.seed, run, c, mine, args.messages, args.max_size, args.max_frames) for c in range(k)]
    recv_plans = [plan(args.seed, run, c, theirs, args.messages, args.max_size, args.max_frames) for c in range(k)]

    listener = None
    finished = asyncio.Event()
    doing(f"{proto}:// run {run}: connecting")
    if rank == 0:
        incoming: asyncio.Queue = asyncio.Queue()

        async def handle(comm):
            hello = await comm.read()
            await incoming.put((hello, comm))
            await finished.wait()

        listener = listen(f"{scheme(proto)}://{args.host}:0", handle)
        await listener.start()
        await asyncio.to_thread(bench.bcast, listener.contact_address, 0)
        comms: dict[int, object] = {}
        deadline = time.monotonic() + args.connect_timeout
        while len(comms) < k:
            try:
                hello, comm = await asyncio.wait_for(incoming.get(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise RuntimeError(
                    f"{proto}://: only {len(comms)} of {k} connections from rank 1 arrived within "
                    f"{args.connect_timeout} s"
                ) from None
            if not isinstance(hello, dict) or hello.get("op") != "hello" or hello.get("conn") in comms:
                raise RuntimeError(f"{proto}://: unexpected first message on a new connection: {str(hello)[:200]}")
            comms[hello["conn"]] = comm
    else:
        address = await asyncio.to_thread(bench.bcast, None, 0)
        opened = await asyncio.gather(*(connect(address, timeout=args.connect_timeout) for _ in range(k)))
        comms = dict(enumerate(opened))
        for c, comm in comms.items():
            await comm.write({"op": "hello", "conn": c})

    await asyncio.to_thread(bench.Barrier)
    doing(f"{proto}:// run {run}: exchanging messages on {k} connections, both directions")
    peaks = PeakRSS()
    rss_before = peaks.current()
    peaks.start(proto, run)
    t0 = time.perf_counter()
    sends = [send_all(comms[c], pool, send_plans[c], c, mine, run) for c in range(k)]
    recvs = [receive_all(comms[c], recv_plans[c], c, theirs, run, args.read_timeout) for c in range(k)]
    results = await asyncio.gather(*sends, *recvs)
    elapsed = time.perf_counter() - t0
    peak = peaks.peak()
    sent_bytes = sum(results[:k])
    counts = [r.as_dict() for r in results[k:]]

    doing(f"{proto}:// run {run}: closing")
    await asyncio.to_thread(bench.Barrier)
    await asyncio.gather(*(comm.close() for comm in comms.values()), return_exceptions=True)
    finished.set()
    if listener is not None:
        listener.stop()
    await asyncio.sleep(2.0)  # idle: what the process keeps once the traffic is over
    mine_report = {"rank": rank, "elapsed_s": elapsed, "sent_bytes": sent_bytes,
                   "sent_messages": k * args.messages, "received": counts,
                   "rss_before": rss_before, "peak_rss": peak, "rss_after": peaks.current()}
    reports = await asyncio.to_thread(bench.gather, mine_report, 0)
    if rank != 0:
        return None
    streams = [c for r in reports for c in r["received"]]
    total = {key: sum(s[key] for s in streams) for key in ("corrupted", "lost", "duplicated", "out_of_order")}
    wall = max(r["elapsed_s"] for r in reports)
    msgs = sum(r["sent_messages"] for r in reports)
    nbytes = sum(r["sent_bytes"] for r in reports)
    rec = {
        "protocol": proto,
        "run": run,
        "connections": k,
        "messages": msgs,
        "bytes": nbytes,
        "received_ok": sum(s["received"] for s in streams),
        "elapsed_s": wall,
        "messages_per_s": msgs / wall,
        "GBps": nbytes / wall / 1e9,
        **total,
        "all_ends_seen": all(s["end_seen"] for s in streams),
        # per rank: RSS before the exchange, its peak during it, and 2 s after the connections closed
        "rss_before": [r["rss_before"] for r in reports],
        "peak_rss": [r["peak_rss"] for r in reports],
        "rss_after": [r["rss_after"] for r in reports],
        "ok": not any(total.values()) and all(s["end_seen"] for s in streams),
        "details": [d for s in streams for d in s["details"]],
        "streams": streams,
    }
    log(
        "soak",
        f"{proto}:// run {run}: {msgs} messages ({nbytes / 1e9:.2f} GB) in {wall:.1f} s: "
        f"{rec['messages_per_s']:.0f} msg/s, {rec['GBps']:.3g} GB/s; corrupted {total['corrupted']}, "
        f"lost {total['lost']}, duplicated {total['duplicated']}, out of order {total['out_of_order']}"
        + ("" if rec["ok"] else " -- INTEGRITY FAILURE: " + "; ".join(rec["details"][:5]))
    )
    return rec


async def soak(bench, protocols, args, rank) -> list[dict]:
    pool = make_pool(args.max_size, args.seed, rank)
    records = []
    for proto in protocols:
        for run in range(args.runs):
            rec = await soak_once(bench, proto, run, args, rank, pool)
            if rec is not None:
                records.append(rec)
    return records


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = job_config("mpi4dask.bench.soak_job", argv)
    args.connect_timeout = CONNECT_TIMEOUT
    arm_watchdog(args.deadline, "soak", doing)
    quiet_distributed_logs()
    requested = list(args.protocols)
    w = two_rank_world("soak")
    if w is None:
        return 3
    bench = w.comm.Dup()
    try:
        t0 = time.perf_counter()
        records = asyncio.run(soak(bench, requested, args, w.rank))
        ok = bench.bcast(all(r["ok"] for r in records) if w.rank == 0 else None, root=0)
        if w.rank == 0:
            result = {
                "benchmark": "soak",
                "machine": {"cpu_count": os.cpu_count(), "processes": 2, **mpi_versions()},
                "config": {
                    "protocols": requested,
                    "connections": args.connections,
                    "messages_per_direction_per_connection": args.messages,
                    "max_size": args.max_size,
                    "max_frames": args.max_frames,
                    "runs": args.runs,
                    "seed": args.seed,
                    "hash": "sha256 of every frame",
                    "sizes": "message total log-uniform in 0..max_size bytes, split into 1..max_frames numpy "
                             "uint8 arrays at uniform cut points",
                },
                "records": records,
                "ok": ok,
                "job_elapsed_s": time.perf_counter() - t0,
            }
            write_json(args.result, result)
        bench.Barrier()
        bench.Free()
    except BaseException:
        abort_job("soak", w, doing.what)
        return 1
    if not ok:
        if w.rank == 0:
            print("mpi4dask stress soak job: INTEGRITY FAILURE (see the counts above)", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from mpi4dask.bench.soak_job import main as _main  # functions pickle by their importable name

    sys.exit(_main())
