"""The MPI side of ``mpi4dask bench idle`` (private).

``mpiexec -n 4 python -m mpi4dask.bench.idle_job --config FILE --result FILE`` runs
``mpi4dask.initialize(protocol=P)`` (rank 0 scheduler, ranks 2 and 3 workers) and, on rank 1, a
connected :class:`distributed.Client`.  After ``--settle`` seconds (start-up work dies down), rank 1
reads the CPU time (user + system, all threads, psutil) of the
four rank processes and of the launcher processes above it (the hydra proxy and ``mpiexec``),
sleeps ``--seconds`` without touching the cluster, reads them again, and reports the difference
as a percentage of one core.  ``--runs`` repeats the idle window.
"""

from __future__ import annotations

import os
import sys
import time

from .jobutil import (
    BenchmarkError,
    Doing,
    connect_client,
    job_config,
    log,
    proc_cpu_seconds,
    start_cluster,
    write_cluster_result,
)

doing = Doing()


def _pid() -> int:
    return os.getpid()


def _launcher_pids() -> dict:
    """The hydra proxy and mpiexec above this rank, when they are visible."""
    import psutil

    out = {}
    proc = psutil.Process().parent()
    for role in ("launcher: hydra proxy", "launcher: mpiexec"):
        if proc is None:
            break
        out[role] = {"pid": proc.pid, "name": proc.name()}
        proc = proc.parent()
    return out


def client_main(args) -> int:
    with connect_client(doing, 2) as client:
        t0 = time.perf_counter()
        workers = client.run(_pid)
        info = client.scheduler_info(n_workers=-1)["workers"]
        procs = {"scheduler (rank 0)": {"pid": client.run_on_scheduler(_pid)},
                 "client (rank 1)": {"pid": os.getpid()}}
        for addr in sorted(workers, key=lambda a: str(info.get(a, {}).get("name", a))):
            procs[f"worker (rank {info.get(addr, {}).get('name', '?')})"] = {"pid": workers[addr]}
        launchers = _launcher_pids()
        doing(f"settling for {args.settle} s")
        time.sleep(args.settle)
        runs = []
        for i in range(args.runs):
            doing(f"idle window {i + 1}/{args.runs}")
            cpu0 = {k: proc_cpu_seconds(v["pid"]) for k, v in {**procs, **launchers}.items()}
            t0 = time.monotonic()
            time.sleep(args.seconds)
            wall = time.monotonic() - t0
            cpu1 = {k: proc_cpu_seconds(v["pid"]) for k, v in {**procs, **launchers}.items()}
            per = {
                k: (100.0 * (cpu1[k] - cpu0[k]) / wall if cpu0[k] is not None and cpu1[k] is not None else None)
                for k in cpu0
            }
            if any(per[k] is None for k in procs):
                raise BenchmarkError(f"could not read the CPU time of every rank process: {per}")
            total = sum(per[k] for k in procs)
            launcher_total = sum(v for k, v in per.items() if k in launchers and v is not None)
            runs.append({"wall_s": wall, "percent_of_one_core": per, "ranks_total_percent": total,
                         "launcher_total_percent": launcher_total})
            log(
                "idle",
                f"{args.protocol}://: idle window {i + 1}/{args.runs} ({wall:.1f} s): the 4 ranks used "
                f"{total:.2f}% of one core in total ("
                + ", ".join(f"{k} {per[k]:.2f}%" for k in procs)
                + f"); launcher {launcher_total:.2f}%",
            )
        write_cluster_result("idle", args, {"pids": {**procs, **launchers}, "runs": runs}, [],
                             time.perf_counter() - t0)
    return 0


def main(argv=None) -> int:
    args = job_config("mpi4dask.bench.idle_job", argv)
    args.workers = start_cluster("idle", args, doing)  # only rank 1 returns
    if args.workers != 2:
        raise BenchmarkError(f"the idle benchmark runs with mpiexec -n 4, not {args.workers + 2}")
    return client_main(args)


if __name__ == "__main__":
    from mpi4dask.bench.idle_job import main as _main  # functions pickle by their importable name

    sys.exit(_main())
