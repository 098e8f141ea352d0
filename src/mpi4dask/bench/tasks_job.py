"""The MPI side of ``mpi4dask bench tasks`` (private).

``mpiexec -n W+2 python -m mpi4dask.bench.tasks_job --config FILE --result FILE`` runs
``mpi4dask.initialize(protocol=P, nthreads=1)``: rank 0 scheduler, ranks 2.. W workers with one
thread each, and rank 1 (the client) times three pieces of real Dask work, each ``--warmup``
untimed and ``--repeat`` timed times, checking every result and recording the CPU time every process of
the job used over each run (:func:`~mpi4dask.bench.jobutil.cpu_used`):

``map``
    ``client.gather(client.map(inc, range(n), pure=False))`` (n = ``--map-tasks``): n fresh tasks
    each time (``pure=False``: new keys, nothing cached); the result must be ``[1, ..., n]``.
``sum``
    ``x.sum().compute()`` of ``x = da.random.default_rng(seed).random((s, s), chunks=ch)``
    (``--sum-size``, ``--sum-chunk``): the random blocks are made and reduced on the workers.  The
    result must equal the same sum computed on the client by the synchronous scheduler (the same
    seeded blocks; relative tolerance 1e-9), after the timed runs so as not to compete with them.
``gather``
    ``y.compute()`` of ``y = da.random.default_rng(seed + 1).random((m, m), chunks=ceil(m / 8))``
    (m = ``--gather-side``), persisted on the workers first: a worker concatenates the 64 blocks
    (fetching those it lacks) and the whole array travels to the client.  The result must have
    shape (m, m) and the sum ``y.sum().compute()`` found on the workers (relative tolerance 1e-9).

Before every run the client waits until the scheduler has forgotten the previous run's tasks, so
that no run reuses another's results.  Rank 1 writes the JSON result (with ``"error"`` when a
result is wrong, and then fails the job).
"""

from __future__ import annotations

import math
import sys
import time

from .jobutil import (
    BenchmarkError,
    Doing,
    cluster_label,
    connect_client,
    cpu_used,
    job_config,
    job_cpu,
    log,
    start_cluster,
    write_cluster_result,
)

SETTLE_TIMEOUT = 60.0
GATHER_BLOCKS = 8  # the gathered array is GATHER_BLOCKS x GATHER_BLOCKS blocks

doing = Doing()


def inc(x: int) -> int:
    return x + 1


def _task_count(dask_scheduler) -> int:
    return len(dask_scheduler.tasks)


def _settle(client, baseline: int) -> None:
    """Wait until the scheduler holds no more than ``baseline`` tasks (the previous run's are forgotten)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    delay = 0.005
    while (n := client.run_on_scheduler(_task_count)) > baseline:
        if time.monotonic() > deadline:
            raise BenchmarkError(
                f"the scheduler still holds {n} tasks (want {baseline}) {SETTLE_TIMEOUT:g} s after the last run"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _measure(client, args, label: str, work: dict, run_once, baseline: int = 0) -> dict:
    """``--warmup`` + ``--repeat`` runs of ``run_once() -> (seconds, value, problem or None)``."""
    runs = []
    for i in range(args.warmup + args.repeat):
        timed = i >= args.warmup
        name = f"run {i - args.warmup + 1}/{args.repeat}" if timed else f"warm-up {i + 1}/{args.warmup}"
        doing(f"{label}: {work['work']}: settling before {name}")
        _settle(client, baseline)
        doing(f"{label}: {work['work']}: {name}")
        cpu = job_cpu(client)
        seconds, value, problem = run_once()
        cpu = cpu_used(cpu, job_cpu(client))
        runs.append({"timed": timed, "seconds": seconds, "value": value, "ok": problem is None, "error": problem,
                     "cpu": cpu})
        rate = work["amount"] / seconds
        shown = f"{rate:,.0f} tasks/s" if work["unit"] == "tasks" else f"{rate / 1e9:.3g} GB/s"
        log("tasks", f"{label}: {work['work']} {name}: {seconds:.3f} s ({shown}), result "
                     + ("ok" if problem is None else f"WRONG: {problem}"))
    return {**work, "runs": runs}


def run_map(client, args, label: str) -> dict:
    n = args.map_tasks
    expected = list(range(1, n + 1))

    def once():
        t0 = time.perf_counter()
        futures = client.map(inc, range(n), pure=False)
        out = client.gather(futures)
        seconds = time.perf_counter() - t0
        del futures
        if out == expected:
            return seconds, n, None
        wrong = next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), min(len(out), n))
        return seconds, len(out), f"map gave {len(out)} results, want {n}; first wrong at index {wrong}"

    work = {"work": "map", "label": f"map {n} tasks", "amount": n, "unit": "tasks",
            "check": "the gathered list equals [1, ..., n]"}
    return _measure(client, args, label, work, once)


def run_sum(client, args, label: str) -> dict:
    import dask.array as da

    s, ch = args.sum_size, args.sum_chunk
    expr = da.random.default_rng(args.seed).random((s, s), chunks=ch).sum()

    def once():
        t0 = time.perf_counter()
        value = float(expr.compute())
        return time.perf_counter() - t0, value, None

    work = {"work": "sum", "label": f"sum {s}x{s} ({s * s * 8 / 1e6:.0f} MB)", "amount": s * s * 8,
            "unit": "bytes", "check": "equals the same seeded sum computed on the client by the synchronous "
            "scheduler (relative tolerance 1e-9)"}
    result = _measure(client, args, label, work, once)
    doing(f"{label}: sum: reference on the client")
    reference = float(expr.compute(scheduler="sync"))
    for r in result["runs"]:
        if not math.isclose(r["value"], reference, rel_tol=1e-9):
            r["ok"], r["error"] = False, f"x.sum() = {r['value']!r}, reference {reference!r}"
    result["reference"] = reference
    return result


def run_gather(client, args, label: str) -> dict:
    import dask.array as da
    import numpy as np
    from distributed import futures_of, wait

    m = args.gather_side
    chunk = math.ceil(m / GATHER_BLOCKS)
    doing(f"{label}: gather: persisting y")
    y = da.random.default_rng(args.seed + 1).random((m, m), chunks=chunk).persist()
    wait(y)
    blocks = len(futures_of(y))
    expected = float(y.sum().compute())

    def once():
        t0 = time.perf_counter()
        arr = y.compute()
        seconds = time.perf_counter() - t0
        if not isinstance(arr, np.ndarray) or arr.shape != (m, m) or arr.dtype != np.float64:
            got = f"{type(arr).__name__} {getattr(arr, 'shape', '')} {getattr(arr, 'dtype', '')}"
            return seconds, None, f"y.compute() gave {got}, want float64 ({m}, {m})"
        total = float(arr.sum())
        del arr
        if not math.isclose(total, expected, rel_tol=1e-9):
            return seconds, total, f"sum of the gathered array {total!r}, on the workers {expected!r}"
        return seconds, total, None

    work = {"work": "gather", "label": f"gather {m}x{m} ({m * m * 8 / 2**20:.0f} MiB)", "amount": m * m * 8,
            "unit": "bytes", "check": "shape (m, m) float64 and the sum y.sum() computed on the workers "
            "(relative tolerance 1e-9)", "expected_sum": expected, "blocks": blocks}
    result = _measure(client, args, label, work, once, baseline=blocks)
    client.cancel(y)
    return result


def client_main(args) -> int:
    label = cluster_label(args)
    with connect_client(doing, args.workers) as client:
        t0 = time.perf_counter()
        works = [run(client, args, label) for run in (run_map, run_sum, run_gather)]
        bad = [r["error"] for w in works for r in w["runs"] if not r["ok"]]
        write_cluster_result("tasks", args, {"works": works}, bad, time.perf_counter() - t0)
    return 0


def main(argv=None) -> int:
    args = job_config("mpi4dask.bench.tasks_job", argv)
    args.workers = start_cluster("tasks", args, doing)  # only rank 1 returns
    return client_main(args)


if __name__ == "__main__":
    from mpi4dask.bench.tasks_job import main as _main  # functions pickle by their importable name

    sys.exit(_main())
