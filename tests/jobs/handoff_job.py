"""mpiexec -n 5 python handoff_job.py RESULT.json: run_mpi scenarios in one cluster (3 workers x 2 threads).

Rank 0 is the scheduler, rank 1 this script, ranks 2-4 the workers.  Every scenario records "ok" or
its traceback (and numbers) in RESULT.json; tests/test_handoff.py asserts on each.
"""

import hashlib
import json
import re
import sys
import threading
import time
import traceback

import mpi4dask

mpi4dask.initialize(protocol="mpi", nthreads=2, memory_limit=0)

import dask.array as da  # noqa: E402
import dask.bag as db  # noqa: E402
import dask.dataframe as dd  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from distributed import Client, wait  # noqa: E402
from mpi4py import MPI  # noqa: E402

RESULTS: dict = {}
STUCK_S = 4.0  # seconds the ranks of a failed job go on waiting in MPI for the rank that raised


def scenario(fn):
    t0 = time.monotonic()
    try:
        extra = fn() or {}
        RESULTS[fn.__name__] = {"status": "ok", **extra}
    except BaseException:
        RESULTS[fn.__name__] = {"status": traceback.format_exc()}
    RESULTS[fn.__name__]["seconds"] = round(time.monotonic() - t0, 2)
    print(f"handoff_job: {fn.__name__}: {RESULTS[fn.__name__]['status'][:2000]}", flush=True)
    return fn


def sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).reshape(-1)).hexdigest()


# -- functions that run inside the workers


def report_parts(comm, parts, key_name=None):
    """What a rank sees: its comm, its blocks (checksums) and whether they are the worker's own objects."""
    from distributed import get_worker
    from mpi4py import MPI

    w = get_worker()
    same = None
    if key_name is not None:
        same = all(w.data[(key_name, *idx)] is chunk for idx, chunk in parts.items())
    return {
        "rank": comm.Get_rank(), "size": comm.Get_size(), "world_rank": MPI.COMM_WORLD.Get_rank(),
        "worker": w.address, "blocks": {repr(i): sha(c) for i, c in parts.items()}, "same_objects": same,
        "main_thread": threading.current_thread() is threading.main_thread(),  # the event loop's thread
        "allreduce": comm.allreduce(len(parts)),
    }


def worker_address(comm):
    from distributed import get_worker

    return get_worker().address


def hash_frames(comm, parts):
    return {i: int(pd.util.hash_pandas_object(df, index=True).sum()) % (1 << 61) for i, df in parts.items()}


def two_collections(comm, X_parts, y_parts):
    from distributed import get_worker

    assert X_parts.keys() == y_parts.keys(), (sorted(X_parts), sorted(y_parts))
    return {"worker": get_worker().address, "indexes": sorted(X_parts),
            "sums": {repr(i): float(X_parts[i].sum() + y_parts[i].sum()) for i in X_parts}}


def fail_on_rank_1(comm, parts):
    if comm.rank == 1:
        raise ValueError("bad block on purpose")
    # the other ranks wait for rank 1 in MPI (a receive that never comes), up to STUCK_S
    req = comm.irecv(source=1, tag=7)
    deadline = time.monotonic() + STUCK_S
    while time.monotonic() < deadline:
        done, _ = req.test()
        if done:
            return "unexpected"
        time.sleep(0.01)
    req.Cancel()
    return "gave up waiting"


def lock_on_rank_1(comm, parts, lock=True):
    total = comm.allreduce(sum(float(b.sum()) for b in parts.values()))
    if comm.rank == 1 and lock:
        return {"total": total, "guard": threading.Lock()}  # nothing Dask can send to the client
    return {"total": total, "array": np.full(1 << 20, float(comm.rank))}  # 8 MiB, sent out of band


def sleep_then_allreduce(comm, parts, seconds=0.0):
    t0 = time.time()
    total = comm.allreduce(1)
    time.sleep(seconds)
    total += comm.allreduce(1)
    from distributed import get_worker

    return {"worker": get_worker().address, "start": t0, "end": time.time(), "total": total}


# -- calls that wait for the last rank: the event loop of a rank waiting in one must go on answering

SKEW = 1.0  # seconds the last rank computes before it makes the call that the others wait in


def _from_last(comm, send, recv):
    """Point-to-point: the last rank sends to every other, which waits in ``recv``."""
    last = comm.size - 1
    if comm.rank == last:
        for r in range(last):
            send(r)
    else:
        recv(last)


def _reduce_scatter(comm):
    out = np.empty(1)
    comm.Reduce_scatter(np.ones(comm.size), out)  # no recvcounts: mpi4py gathers them first


def _probe_recv(comm, src):
    buf = np.empty(4)
    comm.Probe(source=src, tag=5)
    comm.Recv(buf, source=src, tag=5)


def _irecv_waitall(comm, src):
    buf = np.empty(4)
    MPI.Request.Waitall([comm.Irecv(buf, source=src, tag=5)])


def _pkl5_allgather(comm):
    from mpi4py.util import pkl5

    pkl5.Intracomm(comm).allgather(1)


# name -> the call every rank makes, given (comm, a communicator derived from it or None)
WAIT_CALLS = {
    "allreduce": lambda c, d: c.allreduce(1),
    "reduce": lambda c, d: c.reduce(1, root=0),
    "scan": lambda c, d: c.scan(1),
    "exscan": lambda c, d: c.exscan(1),
    "bcast": lambda c, d: c.bcast(c.rank, root=c.size - 1),
    "barrier": lambda c, d: c.barrier(),
    "recv": lambda c, d: _from_last(c, lambda r: c.send(r, dest=r, tag=5), lambda s: c.recv(source=s, tag=5)),
    "irecv+wait": lambda c, d: _from_last(c, lambda r: c.send(r, dest=r, tag=5),
                                          lambda s: c.irecv(source=s, tag=5).wait()),
    "pkl5.allgather": lambda c, d: _pkl5_allgather(c),
    "Split+allreduce": lambda c, d: d.allreduce(1),
    "Dup+allreduce": lambda c, d: d.allreduce(1),
    "Barrier": lambda c, d: c.Barrier(),
    "Allreduce": lambda c, d: c.Allreduce(np.ones(4), np.empty(4)),
    "Probe+Recv": lambda c, d: _from_last(c, lambda r: c.Send(np.ones(4), dest=r, tag=5), lambda s: _probe_recv(c, s)),
    "Irecv+Waitall": lambda c, d: _from_last(c, lambda r: c.Send(np.ones(4), dest=r, tag=5),
                                             lambda s: _irecv_waitall(c, s)),
    "Reduce_scatter": lambda c, d: _reduce_scatter(c),
}


def wait_for_last_rank(comm, kind):
    """Every rank makes the call ``kind``; the last one SKEW seconds after the others (which wait in it)."""
    from distributed import get_worker

    derived = None  # made before the skew, as a program would: making it is collective
    if kind == "Split+allreduce":
        derived = comm.Split(0, comm.rank)
    elif kind == "Dup+allreduce":
        derived = comm.Dup()
    comm.Barrier()
    if comm.rank == comm.size - 1:
        time.sleep(SKEW)
    start = time.time()
    WAIT_CALLS[kind](comm, derived)
    end = time.time()
    if derived is not None:
        derived.Free()
    return {"rank": comm.rank, "worker": get_worker().address, "start": start, "end": end}


def new_blocks(comm, parts):
    return {i: b * 2 + comm.rank * 0 for i, b in parts.items()}


def wrong_blocks(comm, parts):
    return {i: b[:1] for i, b in parts.items()}


def main():
    out = sys.argv[1]
    with Client() as client:
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        assert len(workers) == 3, workers

        @scenario
        def array_parts():
            x = da.random.random((60, 40), chunks=(20, 20)).persist()
            wait(x)
            who_before = client.who_has(x)
            res = mpi4dask.run_mpi(report_parts, x, key_name=x.name)
            who_after = client.who_has(x)
            xn = x.compute()
            expected = {repr(idx): sha(xn[idx[0] * 20:(idx[0] + 1) * 20, idx[1] * 20:(idx[1] + 1) * 20])
                        for idx in np.ndindex(*x.numblocks)}
            holders = {w for ws in who_before.values() for w in ws}
            assert [r["rank"] for r in res] == list(range(len(res))), "results in rank order"
            assert all(r["size"] == len(holders) for r in res), (res, holders)
            assert [r["world_rank"] for r in res] == sorted(r["world_rank"] for r in res), "ranks follow world ranks"
            got = {}
            for r in res:
                got.update(r["blocks"])
                mine = {repr(tuple(k[1:])) for k, ws in who_before.items() if r["worker"] in ws}
                assert set(r["blocks"]) == mine, (r["worker"], sorted(r["blocks"]), sorted(mine))
                assert r["allreduce"] == len(expected)
                assert r["same_objects"] is True, "chunks must be the worker's own objects"
                assert r["main_thread"] is False, "fn must run on a worker thread, not the event loop"
            assert got == expected, "block checksums"
            assert {k: sorted(v) for k, v in who_after.items()} == {k: sorted(v) for k, v in who_before.items()}, \
                "no chunk moved"
            return {"ranks": len(res)}

        @scenario
        def unpersisted_array_is_persisted():
            x = da.arange(100, chunks=10) * 3  # never persisted
            res = mpi4dask.run_mpi(report_parts, x)
            got = {}
            for r in res:
                got.update(r["blocks"])
            expected = {repr((i,)): sha(np.arange(i * 10, i * 10 + 10) * 3) for i in range(10)}
            assert got == expected

        @scenario
        def dataframe_parts():
            pdf = pd.DataFrame({"a": np.arange(1000), "b": np.random.default_rng(1).random(1000)})
            df = dd.from_pandas(pdf, npartitions=7).persist()
            res = mpi4dask.run_mpi(hash_frames, df)
            got = {}
            for r in res:
                got.update(r)
            assert sorted(got) == list(range(7)), sorted(got)
            parts = [df.get_partition(i).compute() for i in range(7)]
            expected = {i: int(pd.util.hash_pandas_object(p, index=True).sum()) % (1 << 61)
                        for i, p in enumerate(parts)}
            assert got == expected

        @scenario
        def bag_and_futures():
            b = db.from_sequence(range(40), npartitions=5)
            res = mpi4dask.run_mpi(lambda comm, parts: {i: sum(p) for i, p in parts.items()}, b)
            got = {k: v for r in res for k, v in r.items()}
            assert got == {i: sum(range(i * 8, i * 8 + 8)) for i in range(5)}, got
            futs = [client.submit(np.full, 3, i, pure=False) for i in range(6)]
            res = mpi4dask.run_mpi(lambda comm, parts: {i: p.tolist() for i, p in parts.items()}, futs)
            got = {k: v for r in res for k, v in r.items()}
            assert got == {i: [i] * 3 for i in range(6)}, got

        @scenario
        def colocation_moves_fewest():
            w0, w1, w2 = workers
            # X blocks 0..5 all on w0; y blocks 0..2 on w0, 3..5 on w1: only y's 3..5 must move (to w0)
            X = [client.submit(np.full, 4, float(i), key=f"X-{i}", workers=[w0]) for i in range(6)]
            y = [client.submit(np.full, 4, 10.0 * i, key=f"y-{i}", workers=[w0 if i < 3 else w1]) for i in range(6)]
            wait(X + y)
            res = mpi4dask.run_mpi(two_collections, X, y)
            got = {i: r["worker"] for r in res for i in r["indexes"]}
            assert sorted(got) == list(range(6)), res
            assert all(got[i] == w0 for i in range(3)), "indexes 0-2: both blocks on w0, nothing moves"
            assert all(got[i] in (w0, w1) for i in range(3, 6)), "indexes 3-5 go to a holder of one of their blocks"
            sums = {k: v for r in res for k, v in r["sums"].items()}
            assert sums == {repr(i): 4 * (i + 10.0 * i) for i in range(6)}, sums
            # What moved, from the workers' own transfer logs (who_has after the call is no measure:
            # the active memory manager drops the extra replicas again every 2 s).
            keys = {f.key for f in X + y}
            logs = client.run(lambda dask_worker: [k for t in dask_worker.transfer_incoming_log
                                                   for k in t["keys"]])
            fetched = sorted(k for got_keys in logs.values() for k in got_keys if k in keys)
            # one block of each index 3-5 moves (X's to w1 or y's to w0: both hold one of the two)
            assert sorted(k.split("-")[1] for k in fetched) == ["3", "4", "5"], \
                f"{fetched} moved, one block of each index 3-5 needed: {logs}"
            moved = len(fetched)
            # now X spread over w1/w2 and y on w2: indexes go to the holder of most blocks
            X2 = [client.submit(np.full, 4, 1.0, key=f"X2-{i}", workers=[w1 if i % 2 else w2]) for i in range(4)]
            y2 = [client.submit(np.full, 4, 2.0, key=f"y2-{i}", workers=[w2]) for i in range(4)]
            wait(X2 + y2)
            res = mpi4dask.run_mpi(two_collections, X2, y2)
            by_worker = {r["worker"]: r["indexes"] for r in res}
            assert by_worker == {w2: [0, 2], w1: [1, 3]}, by_worker
            return {"moved": moved}

        @scenario
        def extra_workers_get_empty_parts():
            x = client.submit(np.arange, 5, workers=[workers[0]])
            res = mpi4dask.run_mpi(report_parts, [x], workers=[workers[1], workers[2]])
            assert len(res) == 3 and all(r["size"] == 3 for r in res), res
            assert sorted(len(r["blocks"]) for r in res) == [0, 0, 1]
            assert all(r["allreduce"] == 1 for r in res)

        @scenario
        def error_with_rank_and_traceback():
            x = da.ones(30, chunks=10).persist()
            t0 = time.monotonic()
            try:
                mpi4dask.run_mpi(fail_on_rank_1, x)
            except mpi4dask.MPIJobError as e:
                took = time.monotonic() - t0
                msg = str(e)
                assert e.rank == 1 and "rank 1" in msg and "bad block on purpose" in msg, msg
                assert "fail_on_rank_1" in e.remote_traceback and "raise ValueError" in e.remote_traceback, msg
                assert f'File "{__file__}"' in e.remote_traceback, msg  # this script's file, whatever cloudpickle does
                assert isinstance(e.__cause__, ValueError)
                assert took < STUCK_S - 0.5, f"the error took {took:.1f} s to reach the client"
                return {"error_after_s": round(took, 2), "stuck_s": STUCK_S}
            raise AssertionError("no MPIJobError")

        @scenario
        def queued_after_stuck_ranks_and_timeout():
            # the ranks of the failed job above still wait (<= STUCK_S) in MPI; this call queues behind them
            x = da.ones(30, chunks=10).persist()
            t0 = time.monotonic()
            try:
                mpi4dask.run_mpi(sleep_then_allreduce, x, seconds=2.5, timeout=1.0)
            except TimeoutError as e:
                took = time.monotonic() - t0
                assert "timeout=1.0" in str(e) and "ranks [" in str(e), str(e)
            else:
                raise AssertionError("no TimeoutError")
            return {"timeout_after_s": round(took, 2)}

        @scenario
        def concurrent_calls_queue():
            x = da.ones(30, chunks=10).persist()
            out = {}

            def call(name):
                out[name] = mpi4dask.run_mpi(sleep_then_allreduce, x, seconds=0.5)

            threads = [threading.Thread(target=call, args=(n,)) for n in ("a", "b", "c")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert sorted(out) == ["a", "b", "c"], out.keys()
            spans: dict = {}
            for res in out.values():
                assert all(r["total"] == 2 * len(res) for r in res)
                for r in res:
                    spans.setdefault(r["worker"], []).append((r["start"], r["end"]))
            for w, s in spans.items():
                s.sort()
                for (_, a1), (b0, _) in zip(s, s[1:]):
                    assert b0 >= a1 - 0.01, f"two MPI jobs overlapped on {w}: {s}"

        @scenario
        def event_loop_answers_while_fn_waits_in_mpi():
            """One run_mpi call per kind of wait; meanwhile every worker is asked, again and again, to run a
            function and to hand over a block it holds (both served by its event loop)."""
            held = {w: client.submit(np.arange, 100_000, workers=[w], pure=False) for w in workers}
            wait(list(held.values()))
            calls: dict = {}
            errors: list = []

            def run_all():
                try:
                    for kind in WAIT_CALLS:
                        calls[kind] = mpi4dask.run_mpi(wait_for_last_rank, workers=workers, kind=kind, timeout=60)
                except BaseException:  # noqa: BLE001 - reported below
                    errors.append(traceback.format_exc())

            runner = threading.Thread(target=run_all)
            runner.start()
            probes = []  # (worker, asked at, seconds to answer)
            while runner.is_alive():
                for w in workers:
                    t0 = time.time()
                    client.run(lambda: 1, workers=[w])
                    block = client.gather(held[w])
                    probes.append((w, t0, time.time() - t0))
                    assert int(block.sum()) == sum(range(100_000))
                time.sleep(0.05)
            runner.join()
            assert not errors, errors[0]
            out = {}
            for kind, ranks in calls.items():
                waiter = ranks[0]  # rank 0 waits for the last rank in every kind
                during = [s for w, t, s in probes if t <= waiter["end"] and t + s >= waiter["start"]]  # overlapping
                out[kind] = {"rank0_waited_s": round(waiter["end"] - waiter["start"], 2), "probes": len(during),
                             "max_answer_s": round(max(during, default=float("nan")), 3)}
            return {"skew_s": SKEW, "kinds": out}

        @scenario
        def map_blocks_array_and_dataframe():
            x = da.random.random((50, 30), chunks=(20, 10)).persist()
            y = mpi4dask.map_blocks_mpi(new_blocks, x)
            assert y.chunks == x.chunks
            assert sha(y.compute()) == sha(x.compute() * 2)
            try:
                mpi4dask.map_blocks_mpi(wrong_blocks, x).compute()
            except mpi4dask.MPIJobError as e:
                assert "must have shape" in str(e), str(e)
            else:
                raise AssertionError("a wrong block shape was accepted")
            pdf = pd.DataFrame({"a": np.arange(100)})
            df = dd.from_pandas(pdf, npartitions=4)
            out = mpi4dask.map_blocks_mpi(lambda comm, parts: {i: p.assign(r=comm.rank) for i, p in parts.items()}, df)
            assert out.npartitions == 4
            got = out.compute()
            assert got["a"].tolist() == list(range(100)) and set(got.columns) == {"a", "r"}

        @scenario
        def bad_workers_and_client():
            x = da.ones(33, chunks=11)  # not persisted: a call that rejects its arguments must not compute it
            info = client.scheduler_info(n_workers=-1)["workers"]
            for kwargs, error, match in [
                ({"workers": 5}, ValueError, r"workers= names 5, which is not a worker.*not a number of workers"),
                ({"workers": 5.0}, TypeError, r"workers=5\.0 is a float; give a worker's address or name"),
                ({"workers": [workers[0], None]}, TypeError, r"workers= holds None, a NoneType"),
                ({"workers": True}, TypeError, r"workers=True is a bool"),
                ({"client": "x"}, TypeError, r"client='x' is a str, not a distributed\.Client"),
            ]:
                try:
                    mpi4dask.run_mpi(report_parts, x, **kwargs)
                except error as e:
                    assert re.search(match, str(e)), (kwargs, str(e))
                else:
                    raise AssertionError(f"accepted {kwargs}")
            held = client.run_on_scheduler(lambda dask_scheduler: [str(k) for k in dask_scheduler.tasks])
            assert not [k for k in held if x.name in k], held  # nothing was computed for the rejected calls
            # one worker by address, one by name (the launcher names workers by rank), or a mapping of them
            for chosen, expect in [(workers[1], [workers[1]]), (info[workers[2]]["name"], [workers[2]]),
                                   (info, workers)]:
                res = mpi4dask.run_mpi(worker_address, workers=chosen)
                assert sorted(res) == expect, (chosen, res)

        @scenario
        def blocks_that_do_not_line_up():
            X = da.ones((60, 4), chunks=(20, 4))
            df4 = dd.from_pandas(pd.DataFrame({"a": range(40)}), npartitions=4)
            df3 = dd.from_pandas(pd.DataFrame({"a": range(40)}), npartitions=3)
            futs = [client.submit(np.ones, 2, pure=False) for _ in range(3)]
            wait(futs)
            held_before = set(client.who_has())
            for cols, match in [
                ((X, da.ones(60, chunks=20)), r"numblocks \(3, 1\), collection 1 .*numblocks \(3,\).*y\[:, None\]"),
                ((da.ones(60, chunks=20), da.ones(60, chunks=15)), r"numblocks \(3,\).*numblocks \(4,\)"),
                ((da.ones(60, chunks=(10, 20, 30)), da.ones(60, chunks=20)),
                 r"along axis 0 \(length 60 in both\) collection 0 has chunks \(10, 20, 30\), "
                 r"collection 1 \(20, 20, 20\)"),
                ((df4, df3), r"dask dataframe with 4 partitions, collection 1 a dask dataframe with 3 partitions"),
                ((df4, db.from_sequence(range(6), npartitions=3)), r"4 partitions, collection 1 a dask bag with 3"),
                ((df4, futs), r"collection 1 a list of 3 Futures.*keyword argument"),
                ((da.ones(40, chunks=10), df4), r"tuples \(i, j, \.\.\.\), the others' partition numbers"),
            ]:
                for call in (mpi4dask.run_mpi, mpi4dask.map_blocks_mpi):
                    try:
                        call(two_collections, *cols)
                    except ValueError as e:
                        assert re.search(match, str(e)), (match, str(e))
                    else:
                        raise AssertionError(f"{call.__name__} accepted blocks that do not line up: {match}")
            assert set(client.who_has()) <= held_before, "a rejected collection was computed"
            # chunk sizes may differ along axes of different lengths: X's 4 columns beside y[:, None]'s 1
            y = da.arange(60.0, chunks=20)
            res = mpi4dask.run_mpi(two_collections, X, y[:, None])
            sums = {k: v for r in res for k, v in r["sums"].items()}
            assert sums == {repr((i, 0)): 80.0 + float(np.arange(i * 20, i * 20 + 20).sum()) for i in range(3)}, sums

        @scenario
        def bad_input():
            for bad, match in [(lambda: mpi4dask.run_mpi(report_parts, np.ones(3)), "numpy.ndarray"),
                               (lambda: mpi4dask.run_mpi(report_parts, [1, 2]), "Futures only"),
                               (lambda: mpi4dask.run_mpi(report_parts, workers=["nobody"]), "'nobody'"),
                               (lambda: mpi4dask.run_mpi(42, da.ones(3)), "callable"),
                               (lambda: mpi4dask.run_mpi(report_parts, da.ones(3), timeout=-1), "timeout=-1")]:
                try:
                    bad()
                except (TypeError, ValueError) as e:
                    assert match in str(e), (match, str(e))
                else:
                    raise AssertionError(f"accepted: {match}")

        @scenario
        def unsendable_result_is_named():
            x = da.ones(30, chunks=10).persist()
            try:
                mpi4dask.run_mpi(lock_on_rank_1, x, workers=workers, timeout=60)
            except mpi4dask.MPIJobError as e:
                msg = str(e)
                assert e.rank == 1 and "lock_on_rank_1 returned a builtins.dict on rank 1" in msg, msg
                assert "Dask cannot send back to the client" in msg and "return plain data" in msg, msg
                assert "cannot pickle '_thread.lock' object" in msg and "type lock" in msg, msg
            else:
                raise AssertionError("no MPIJobError")
            # the same call without the lock: every rank's result arrives, its 8 MiB array intact
            res = mpi4dask.run_mpi(lock_on_rank_1, x, workers=workers, lock=False, timeout=60)
            assert [r["total"] for r in res] == [30.0] * 3, res
            assert [sha(r["array"]) for r in res] == [sha(np.full(1 << 20, float(i))) for i in range(3)]

    with open(out, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
