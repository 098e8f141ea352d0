"""``mpi4dask stress chaos``: workers killed, added and retired at random while Dask computations
and ``run_mpi`` calls go on, per protocol, every answer checked.

Per protocol one job, ``python -m mpi4dask.bench.chaos_job`` (see that module): a ``LocalCluster``
of worker processes that Dask starts (no mpiexec), a monkey that SIGKILLs a random worker or scales
the cluster to 2-4 workers every 1-3 s (``--scaling adapt``: ``cluster.adapt(2, 4)`` and kills
only), and, for ``--seconds``, ``(x + x.T).sum()`` computations alternating with
``run_mpi(..., retries=3)`` calls.  The report counts the calls right, failed with a clear error,
wrong and hung; any wrong or hung call, or a ``run_mpi`` call not answered, fails the command
(exit status 1).  tcp:// runs the same chaos (without ``run_mpi``'s transport, but with its MPI
formation and hand-off) as the reference.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from . import common as c

JOB = "mpi4dask.bench.chaos_job"
SLACK = 300.0  # seconds a job may take beyond --seconds (start-up, the last call, shutdown)
# the chaos (the job reads them from here: importing the job here would make runpy warn in every worker)
START_WORKERS = 3
SCALE_RANGE = (2, 4)
KILL_SHARE = 0.6
PAUSE_RANGE = (1.0, 3.0)  # seconds between two acts of the monkey
SIZES = (600, 1000, 1400)
RUN_MPI_RETRIES = 3
RUN_MPI_TIMEOUT = 60.0


@dataclass
class ChaosOptions:
    seconds: float = c.option(60.0, "length of the chaos per protocol", c.positive_float, "S")
    seed: int = c.option(2026, "seed of the random choices", int)
    scaling: str = c.option("scale", "scale: the monkey kills or calls cluster.scale(2..4); adapt: "
                            "cluster.adapt(2, 4) and the monkey only kills", choices=("scale", "adapt"))
    call_timeout: float = c.option(90.0, "a call that has not returned after S seconds counts as hung",
                                   c.positive_float, "S")


def add_chaos_arguments(p: argparse.ArgumentParser) -> None:
    c.add_options(p, ChaosOptions)
    c.add_protocols_argument(p)
    c.add_output_argument(p, "chaos.json and chaos.md")
    c.add_launch_arguments(p, SLACK, "each job beyond --seconds")


def collect_chaos(args: argparse.Namespace) -> dict:
    session = c.Session("chaos", args)
    session.timeout = args.seconds + args.timeout
    steps = c.Steps("chaos", len(session.run_order))
    jobs = []
    with session:
        for p in session.run_order:
            steps.start(f"{c.label(p)}: {args.seconds:g} s of chaos ({args.scaling}), seed {args.seed}")
            jobs.append(session.run(None, JOB, {**c.option_values(ChaosOptions, args), "protocol": p}))
    result = session.result(next((j["machine"] for j in jobs if j.get("machine")), None), jobs=jobs)
    session.write(result, render_chaos, None)
    return result


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def render_chaos(result: dict) -> str:
    by = {j["protocol"]: j for j in result["jobs"]}
    protos = [p for p in c.DASK_PROTOCOLS if p in by]
    header = ["protocol", "seconds", "calls", "kills", "scale steps", "workers", "right", "failed (clear error)",
              "wrong", "hung", "run_mpi answered", "median compute (s)", "median run_mpi (s)"]
    rows = []
    for p in protos:
        j = by[p]
        n = j["counts"]
        t = j["call_seconds"]
        rows.append([c.label(p), f"{j['elapsed_s']:.0f}", str(n["calls"]), str(n["kills"]), str(n["scales"]),
                     "{}-{}".format(*j.get("workers_seen", ["?", "?"])), str(n["right"]), str(n["failed"]),
                     str(n["wrong"]), str(n["hung"]),
                     f"{n['run_mpi_right']}/{n['run_mpi_calls']}",
                     c.fmt_s(_median(t["compute"])), c.fmt_s(_median(t["run_mpi"]))])
    cfg = result["config"]
    lo, hi = SCALE_RANGE
    lines = [c.header_line("chaos", result), "", *c.md_table(header, rows)]
    if "mpi" in by and "tcp" in by:
        ratios = []
        for kind in ("compute", "run_mpi"):
            a, b = _median(by["mpi"]["call_seconds"][kind]), _median(by["tcp"]["call_seconds"][kind])
            if a and b:
                ratios.append(f"{kind} {b / a:.2f}x")
        if ratios:
            lines += ["", "tcp:// median call time / mpi:// (above 1: mpi:// faster): " + ", ".join(ratios) + "."]
    errors = [f"{c.label(p)}: {e}" for p in protos for e in by[p]["errors"]]
    if errors:
        lines += ["", "Calls that failed, hung or were wrong (first ones):", ""]
        lines += [f"* {e}" for e in errors[:12]]
    lines += ["", " ".join([
        f"A LocalCluster of {START_WORKERS} worker processes (1 thread each) under Nannies, started by Dask (no "
        f"mpiexec); every {PAUSE_RANGE[0]:g}-{PAUSE_RANGE[1]:g} s the monkey "
        + (f"SIGKILLs a random worker ({100 * KILL_SHARE:.0f}%) or calls cluster.scale({lo}..{hi})"
           if cfg["scaling"] == "scale" else
           f"SIGKILLs a random worker, while cluster.adapt(minimum={lo}, maximum={hi}) scales")
        + f"; calls alternate (x + x.T).sum() and run_mpi(allreduce, x.persist(), retries={RUN_MPI_RETRIES}) on a "
        f"new n x n random array (n from {'/'.join(map(str, SIZES))}, 4 x 4 chunks), seed {cfg['seed']}, one at a "
        f"time; a call is hung after {cfg['call_timeout']:g} s. The client process (scheduler, client, nannies) and "
        f"{lo}-{hi} workers shared the "
        f"{result['machine'].get('cpu_count')} cores.",
        c.start_note(result),
        c.job_loadavg_note([(c.label(j["protocol"]), j) for j in result["jobs"]]),
        *c.run_notes(result)])]
    return "\n".join(lines)


def chaos_failure(result: dict) -> str | None:
    """A hung or wrong call, or a run_mpi call not answered (with retries every call must be)."""
    bad = []
    for j in result["jobs"]:
        n = j["counts"]
        if n["hung"] or n["wrong"] or n["run_mpi_right"] != n["run_mpi_calls"]:
            bad.append(f"{c.label(j['protocol'])}: {n['hung']} hung, {n['wrong']} wrong, "
                       f"{n['run_mpi_calls'] - n['run_mpi_right']} run_mpi calls not answered")
    return "; ".join(bad) or None

