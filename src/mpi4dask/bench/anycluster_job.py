"""The cluster side of ``mpi4dask bench pair`` and ``mpi4dask bench form`` (private).

Unlike the other jobs, this one is not launched by ``mpiexec``: ``python -m
mpi4dask.bench.anycluster_job --config FILE --result FILE`` (``what``: pair or form) is a plain
process that starts a ``LocalCluster(protocol=P, processes=True, threads_per_worker=1)``: the scheduler, the
client and the nannies live in this process, every worker is a process of its own that Dask
spawned, and no two of them were launched together.  Where they use MPI, each initialises it as a
*served* world of one through the scheduler's MPI service (:mod:`mpi4dask.pm`).

``pair``
    Two workers, A and B.  B listens on ``P://127.0.0.1:0`` and echoes (``comm_job._echo``); A
    connects with :func:`distributed.comm.connect` and runs the ping-pong of ``mpi4dask bench comm``
    (``comm_job._drive``: the same payloads, per-round stamps, full verification before and after
    the timed rounds, adaptive rounds) on its event loop, through ``client.run`` of a coroutine
    function.  Over ``mpi://`` the two workers must be two worlds of one, and A's connection must be
    an MPI pair (``mpi4dask.connections()``: transport ``"mpi"``, ``mpi_route`` ``"pair"``), with its
    large frames counted as MPI bytes; otherwise the job fails.  Then the same ping-pong from a plain
    process that this job starts (``what``: outside), not a member of the cluster: over ``mpi://`` its
    connection must carry every frame on the socket (transport ``"socket"``), as any client's does that
    no MPI world shares with the worker (a client outside an ``mpiexec`` job, workers under Open MPI).
    Last, fresh payloads (``--move-sizes``, ``--moves`` of each) moved between A and B as Dask moves a
    task's dependency (:func:`_moves`), each checked by checksum on both workers.
``form``
    ``--workers N`` workers and a persisted ``int64`` dask array of N chunks.  Timed from the
    client: the MPI service's start (``pm.install_on_scheduler``), MPI initialisation in every worker
    (``client.run(handoff._worker_mpi_info)``), the first :func:`mpi4dask.run_mpi` call over all
    workers (forming their communicator), ``--repeat`` warm calls (reusing it), then
    ``cluster.scale(N + 1)``: the new worker's MPI initialisation and the first call over the N + 1
    (a new participant set: formed anew).  The function does ``comm.allreduce`` of the sums of
    the chunks it got; every rank's answer must equal the NumPy sum, and the ranks and sizes must be
    right.  The workers' table of formed communicators must grow only with new participant sets.

The result is JSON in ``--result`` (with ``"error"`` when a check failed, and then exit status 1);
a watchdog ends the process at ``--deadline``, with its Python stacks.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from contextlib import contextmanager

from .. import _jobs
from .comm_job import _drive, _echo
from .jobutil import (
    BenchmarkError,
    Doing,
    arm_watchdog,
    job_config,
    log,
    mpi_versions,
    quiet_distributed_logs,
    read_result,
    scheme,
    write_json,
)

MODULE = "mpi4dask.bench.anycluster_job"
CONNECT_TIMEOUT = 30.0
START_TIMEOUT = 180.0  # seconds for a LocalCluster's workers to come up (16 processes on 2 cores take a while)

doing = Doing()
_listeners: list = []  # the echo listeners of this worker process (pair)


# ----------------------------------------------------------------------------------------------
# Worker side (shipped by reference: this module is importable in the workers)
# ----------------------------------------------------------------------------------------------


async def _echo_connection(comm) -> None:
    try:
        await _echo(comm)
    finally:
        await comm.close()


async def start_echo(protocol: str) -> str:
    """On worker B: listen on ``P://127.0.0.1:0``, echo every connection; return the contact address."""
    from distributed.comm import listen

    listener = listen(f"{scheme(protocol)}://127.0.0.1:0", _echo_connection)
    await listener.start()
    _listeners.append(listener)
    return listener.contact_address


def stop_echo() -> int:
    for listener in _listeners:
        listener.stop()
    n = len(_listeners)
    _listeners.clear()
    return n


async def ping(address: str, protocol: str, sizes: list[int], iterations, warmup, target: float, seed: int) -> dict:
    """On worker A: the ping-pong of ``bench comm`` with the echo at ``address``; the records, and
    this connection as ``mpi4dask.connections()`` describes it (``mpi://`` only)."""
    from distributed.comm import connect

    comm = await connect(address, timeout=CONNECT_TIMEOUT)
    try:
        records = await _drive(comm, protocol, sizes, iterations, warmup, target, seed)
        link = None
        if protocol == "mpi":
            import mpi4dask

            mine = [c for c in mpi4dask.connections() if c["local"] == comm.local_address]
            link = mine[0] if mine else {"error": f"mpi4dask.connections() does not list {comm.local_address}"}
        await comm.write({"op": "stop"})
        reply = await comm.read()
        if reply != {"op": "stopped"}:
            raise BenchmarkError(f"expected the echo side's stop reply, got {str(reply)[:200]}")
    finally:
        await comm.close()
    return {"records": records, "connection": link, "local": comm.local_address, "peer": comm.peer_address}


def _outsider(args, address: str) -> dict:
    """Run :func:`ping` to ``address`` in a plain process of its own (this module, ``what``: outside)."""
    import tempfile

    # its watchdog fires 10 s before this job's, so that its stacks and exit status are reported here
    deadline = None if args.deadline is None else args.deadline - 10.0
    with tempfile.TemporaryDirectory(prefix="mpi4dask-bench-outsider-") as tmp:
        config, result = os.path.join(tmp, "config.json"), os.path.join(tmp, "result.json")
        write_json(config, {**{k: v for k, v in vars(args).items() if k != "result"}, "what": "outside",
                            "address": address, "deadline": deadline})
        left = None if deadline is None else max(1.0, deadline - time.time() + 5.0)
        done = _jobs.run([sys.executable, "-m", MODULE, "--config", config, "--result", result], left,
                         echo=sys.stderr.write, merge=True)
        out = read_result(result) or {"error": "it wrote no result (its output is above)"}
    if done.timed_out:
        raise BenchmarkError(f"the outside process did not end within {left:.0f} s (killed)")
    if done.returncode or "error" in out:
        raise BenchmarkError(f"the outside process failed (exit status {done.returncode}): {out.get('error')}")
    return out


def run_outside(me, args) -> dict:
    import asyncio

    return asyncio.run(ping(args.address, args.protocol, list(args.sizes), args.iterations, args.warmup,
                            args.target_time, args.seed))


def make_bytes(n: int, seed: int):
    """``n`` random bytes (a uint8 array): a payload made on the worker that runs this."""
    import numpy as np

    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8)


def digest(a) -> str:
    import hashlib

    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(a).data).hexdigest()


def transfer_of(key: str, dask_worker=None) -> dict | None:
    """The entry of this worker's ``transfer_incoming_log`` (distributed's log of the data it fetched)
    that brought ``key``: its duration and bytes."""
    for d in reversed(dask_worker.transfer_incoming_log):
        if key in d["keys"]:
            return {"duration": d["duration"], "total": d["total"], "who": d["who"]}
    return None


def mpi_bytes_from(peer: str) -> int:
    """Bytes this worker's open connections to ``peer`` received over MPI."""
    import mpi4dask

    return sum(d["mpi_bytes_received"] for d in mpi4dask.connections() if d["peer"] == peer)


def allreduce_sum(comm, parts) -> tuple[int, int, int, float]:
    """``run_mpi``'s function: (rank, size, the allreduce of the sums of the chunks this rank got, the
    seconds that allreduce took)."""
    local = sum(int(block.sum()) for block in parts.values())
    t0 = time.perf_counter()
    total = comm.allreduce(local)
    return comm.Get_rank(), comm.Get_size(), total, time.perf_counter() - t0


def formed_count() -> int:
    from mpi4dask import handoff

    return len(handoff._formed)


# ----------------------------------------------------------------------------------------------
# Client side
# ----------------------------------------------------------------------------------------------


@contextmanager
def local_cluster(name: str, protocol: str, n: int):
    """``LocalCluster(protocol=P, n_workers=n, threads_per_worker=1, processes=True)`` and its client."""
    from distributed import Client, LocalCluster

    doing(f"starting a LocalCluster of {n} {protocol}:// workers")
    t0 = time.perf_counter()
    with LocalCluster(protocol=scheme(protocol), n_workers=n, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(n, timeout=START_TIMEOUT)
        log(name, f"LocalCluster({protocol}://) of {n} workers up in {time.perf_counter() - t0:.1f} s")
        yield cluster, client
        doing("closing the LocalCluster")


def _worlds(client, workers: list[str]) -> dict:
    """Each worker's MPI world (starting MPI where it is not up), checked to be a served world of one."""
    from mpi4dask import handoff

    info = client.run(handoff._worker_mpi_info, workers=workers)
    for addr in workers:
        i = info.get(addr, {"error": "no answer"})
        if "error" in i:
            raise BenchmarkError(f"worker {addr} cannot use MPI: {i['error']}")
        if i["size"] != 1 or not i["dynamic"]:
            raise BenchmarkError(f"worker {addr} is in an MPI world of {i['size']} (dynamic: {i['dynamic']}); "
                                 "expected a served world of one")
    return info


def _move_once(me, client, src: str, dst: str, protocol: str, size: int, seed: int) -> dict:
    """One fresh payload of ``size`` random bytes, made by a task on ``src`` and then needed by a task
    pinned to ``dst``, which fetches it as Dask fetches any dependency (``gather_dep``, a pooled
    worker-to-worker connection): the fetching task's wall time from the client and the transfer's
    duration from the receiver's transfer log, the payload's checksum compared on both workers.
    Over ``mpi://`` the bytes must arrive over MPI."""
    x = client.submit(me.make_bytes, size, seed, workers=[src], allow_other_workers=False, pure=False)
    at_src = client.submit(me.digest, x, workers=[src], allow_other_workers=False, pure=False).result()
    before = client.run(me.mpi_bytes_from, src, workers=[dst])[dst] if protocol == "mpi" else 0
    t0 = time.perf_counter()
    at_dst = client.submit(me.digest, x, workers=[dst], allow_other_workers=False, pure=False).result()
    wall = time.perf_counter() - t0
    if at_dst != at_src:
        raise BenchmarkError(f"move of {size} B from {src} to {dst}: checksum {at_dst} there, {at_src} at the source")
    log_entry = client.run(me.transfer_of, x.key, workers=[dst])[dst]
    if log_entry is None or log_entry["total"] < size:
        raise BenchmarkError(f"move of {size} B from {src} to {dst}: {dst}'s transfer log has no transfer of it "
                             f"({log_entry}); was it fetched?")
    if protocol == "mpi":
        over_mpi = client.run(me.mpi_bytes_from, src, workers=[dst])[dst] - before
        if over_mpi < size:
            raise BenchmarkError(f"move of {size} B from {src} to {dst}: only {over_mpi} B arrived over MPI")
    return {"size": size, "src": src, "dst": dst, "wall_s": wall, "transfer_s": log_entry["duration"],
            "checked": True}


def _moves(me, client, a: str, b: str, protocol: str, sizes: list[int], count: int, seed: int) -> list[dict]:
    """``count`` fresh payloads per size (:func:`_move_once`), alternately A to B and B to A, after one
    untimed move each way (the workers' own connections to each other are new: their first fetch would
    time the connection's set-up)."""
    for src, dst in ((a, b), (b, a)):
        doing(f"warming the connection {dst} -> {src} with one untimed move")
        _move_once(me, client, src, dst, protocol, sizes[0], seed - 1)
    out = []
    for size in sizes:
        for i in range(count):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            doing(f"move {i + 1} of {count} of {size} B, {src} -> {dst}")
            out.append(_move_once(me, client, src, dst, protocol, size, seed + i))
    return out


def run_pair(me, args) -> dict:
    sizes = list(args.sizes)
    with local_cluster("pair", args.protocol, 2) as (_, client):
        a, b = sorted(client.scheduler_info()["workers"])
        pids = client.run(os.getpid)
        worlds, machine = None, {}
        if args.protocol == "mpi":
            doing("checking the workers' MPI worlds")
            worlds = _worlds(client, [a, b])
            if worlds[a]["ident"] == worlds[b]["ident"]:
                raise BenchmarkError(f"workers {a} and {b} report the same MPI world {worlds[a]['ident']!r}")
            machine = client.run(mpi_versions, workers=[a])[a]
        doing(f"starting the echo listener on worker B ({b})")
        address = client.run(me.start_echo, args.protocol, workers=[b])[b]
        log("pair", f"{args.protocol}://: worker B ({b}, pid {pids[b]}) echoes at {address}; worker A ({a}, pid "
                    f"{pids[a]}) drives")
        doing(f"ping-pong from worker A ({a}) to {address}")
        out = client.run(me.ping, address, args.protocol, sizes, args.iterations, args.warmup, args.target_time,
                         args.seed, workers=[a])[a]
        doing(f"ping-pong from a process outside the cluster to {address}")
        outside = _outsider(args, address)
        client.run(me.stop_echo, workers=[b])
        moves = _moves(me, client, a, b, args.protocol, list(args.move_sizes), args.moves, args.seed)
    conn = out["connection"]
    min_frame = None
    if args.protocol == "mpi":
        from mpi4dask.comm import MPI_MIN_FRAME as min_frame

        if not conn or conn.get("transport") != "mpi" or conn.get("mpi_route") != "pair":
            raise BenchmarkError(f"worker A's mpi:// connection to worker B is not an MPI pair: {conn}")
        big = [s for s in sizes if s >= min_frame]
        if big and not conn.get("mpi_bytes_sent", 0) >= sum(big):
            raise BenchmarkError(f"worker A sent only {conn.get('mpi_bytes_sent')} bytes over MPI, less than one "
                                 f"message of each size of {min_frame} bytes or more: {conn}")
    if args.protocol == "mpi" and (outside["connection"] or {}).get("transport") != "socket":
        raise BenchmarkError(f"the outsider's mpi:// connection to worker B is not socket-only: "
                             f"{outside['connection']}")
    return {"records": out["records"], "connection": conn, "driver": {"address": a, "pid": pids[a]},
            "outsider": {"records": outside["records"], "connection": outside["connection"]},
            "echo": {"address": b, "pid": pids[b], "listening": address}, "worlds": worlds, "moves": moves,
            "processes": 3, "machine": machine, "mpi_min_frame": min_frame}


def _timed_call(me, client, x, workers: list[str], reference: int, what: str) -> dict:
    import mpi4dask

    doing(f"run_mpi over {len(workers)} workers ({what})")
    t0 = time.perf_counter()
    res = mpi4dask.run_mpi(me.allreduce_sum, x, workers=workers, client=client, timeout=START_TIMEOUT)
    seconds = time.perf_counter() - t0
    want = [(r, len(workers), reference) for r in range(len(workers))]
    got = [tuple(r[:3]) for r in res]
    if got != want:
        raise BenchmarkError(f"{what}: run_mpi returned {got[:4]}{'...' if len(got) > 4 else ''}, expected "
                             f"(rank, {len(workers)}, {reference}) on every rank (NumPy sum {reference})")
    return {"seconds": seconds, "ranks": len(workers), "value": reference, "ok": True,
            "allreduce_s": max(r[3] for r in res)}


def run_form(me, args) -> dict:
    import dask.array as da
    import numpy as np
    from distributed import wait

    from mpi4dask import pm

    n = args.workers
    reference = int(np.arange(n * args.chunk, dtype=np.int64).sum())
    with local_cluster("form", args.protocol, n) as (cluster, client):
        x = da.arange(n * args.chunk, chunks=args.chunk, dtype=np.int64).persist()
        wait(x)
        everyone = sorted(client.scheduler_info()["workers"])
        holders = {a for keys in client.who_has(x).values() for a in keys}
        doing("starting the MPI service")
        t0 = time.perf_counter()
        client.run_on_scheduler(pm.install_on_scheduler)
        service_s = time.perf_counter() - t0
        doing(f"MPI initialisation in {n} workers")
        t0 = time.perf_counter()
        _worlds(client, everyone)
        init_s = time.perf_counter() - t0
        machine = client.run(mpi_versions, workers=everyone[:1])[everyone[0]]
        log("form", f"{n} workers: MPI service {service_s:.3f} s, MPI init in the workers {init_s:.2f} s")
        first = _timed_call(me, client, x, everyone, reference, "first call")
        log("form", f"{n} workers: first run_mpi call {first['seconds']:.2f} s")
        warm = [_timed_call(me, client, x, everyone, reference, f"warm call {i + 1}") for i in range(args.repeat)]
        shown = ", ".join(f"{w['seconds'] * 1e3:.0f}" for w in warm)
        log("form", f"{n} workers: warm calls {shown} ms")
        formed = client.run(me.formed_count)
        if sorted(set(formed.values())) != [1]:
            raise BenchmarkError(f"after the warm calls the workers hold {formed} formed communicators; expected "
                                 "1 each (warm calls must reuse the first one)")
        doing(f"scaling to {n + 1} workers")
        cluster.scale(n + 1)
        client.wait_for_workers(n + 1, timeout=START_TIMEOUT)
        new = sorted(set(client.scheduler_info()["workers"]) - set(everyone))
        if len(new) != 1:
            raise BenchmarkError(f"scaling to {n + 1} workers added {new}")
        t0 = time.perf_counter()
        _worlds(client, new)
        new_init_s = time.perf_counter() - t0
        scaled = _timed_call(me, client, x, sorted(everyone + new), reference, "first call after scale-up")
        log("form", f"{n} -> {n + 1} workers: new worker's MPI init {new_init_s:.2f} s, first call "
                    f"{scaled['seconds']:.2f} s")
        formed_after = client.run(me.formed_count)
        if formed_after.get(new[0]) != 1 or any(formed_after[a] != 2 for a in everyone):
            raise BenchmarkError(f"after the scale-up the workers hold {formed_after} formed communicators; expected "
                                 "2 on the old workers (a new set: formed anew), 1 on the new one")
    return {
        "workers": n,
        "processes": n + 1,
        "chunks": n,
        "chunk": args.chunk,
        "workers_holding_chunks": len(holders),
        "reference": reference,
        "service_s": service_s,
        "mpi_init_s": init_s,
        "first_call": first,
        "warm_calls": warm,
        "scale_up": {"workers": n + 1, "new_worker_mpi_init_s": new_init_s, "first_call": scaled},
        "formed_after_warm": sorted(formed.values()),
        "formed_after_scale_up": sorted(formed_after.values()),
        "machine": machine,
    }


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = job_config(MODULE, argv)
    arm_watchdog(args.deadline, args.what, doing)
    # before distributed is imported: the workers Dask spawns read it from their environment too
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    # the scheduler's HTTP server (metrics) falls back to another port when another cluster holds 8787
    warnings.filterwarnings("ignore", message="Port .* is already in use")
    quiet_distributed_logs()
    # functions sent to the workers must be pickled by reference (this module), not by value (__main__)
    from mpi4dask.bench import anycluster_job as me

    t0 = time.perf_counter()
    try:
        body = {"pair": me.run_pair, "form": me.run_form, "outside": me.run_outside}[args.what](me, args)
    except BaseException as exc:  # noqa: BLE001 - reported in the result and on stderr
        traceback.print_exc()
        write_json(args.result, {"benchmark": args.what, "protocol": args.protocol,
                                 "error": f"{doing}: {type(exc).__name__}: {exc}"})
        return 1
    result = {"benchmark": args.what, "protocol": args.protocol, "cpu_count": os.cpu_count(),
              "config": {k: v for k, v in vars(args).items() if k not in ("result", "deadline")},
              **body, "elapsed_s": time.perf_counter() - t0}
    write_json(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
