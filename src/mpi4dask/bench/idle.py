"""``mpi4dask bench idle``: the CPU time an idle cluster burns, and the comm benchmark's memory.

Per protocol, one MPI job ``mpiexec -n 4 python -m mpi4dask.bench.idle_job`` (scheduler, client,
2 workers; see that module) stays idle for ``--seconds`` and reports the CPU time of the four
processes as a percentage of one core.  With ``--memory`` (the default) it then runs the comm
ping-pong at ``--memory-size`` (64 MiB) to report the peak RSS of both ranks per protocol.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from . import common as c
from .comm import add_comm_arguments, collect_comm, memory_line, memory_rows

IDLE_TIMEOUT = 300.0
RANK_KEYS = ("scheduler (rank 0)", "client (rank 1)", "worker (rank 2)", "worker (rank 3)")


@dataclass
class IdleOptions:
    seconds: float = c.option(10.0, "length of the idle benchmark's window", c.positive_float, "S", all="idle_seconds")
    settle: float = c.option(2.0, "seconds to wait after start-up before the window opens", c.positive_float, "S")
    runs: int = c.option(1, "idle windows per protocol; the report gives median and min", c.positive_int, "N")
    memory: bool = c.option(True, "also run the comm ping-pong at --memory-size and report both ranks' peak RSS "
                            "per protocol, each transport alone (comm --alone)")
    memory_size: int = c.option(64 << 20, "message size of that ping-pong", c.size_arg, "SIZE",
                                shown="64M")


def add_idle_arguments(p: argparse.ArgumentParser) -> None:
    c.add_options(p, IdleOptions)
    c.add_protocols_argument(p)
    c.add_output_argument(p, "idle.json, idle.md and idle.png")
    c.add_launch_arguments(p, IDLE_TIMEOUT)


def collect_idle(args) -> dict:
    session = c.Session("idle", args)
    order = session.run_order
    steps = c.Steps("idle", len(order) + (1 if args.memory else 0))
    jobs = []
    with session:
        for p in order:
            steps.start(f"{c.label(p)}: scheduler + client + 2 workers (4 processes on "
                        f"{c.machine_info()['cpu_count']} cores) idle for {args.seconds:g} s x {args.runs}")
            jobs.append(session.run(4, "mpi4dask.bench.idle_job", {**c.option_values(IdleOptions, args),
                                                                   "protocol": p}))
    memory = None
    if args.memory:  # a comm job of its own, with its own --load
        steps.start(f"peak RSS: comm ping-pong of {c.format_size(args.memory_size)} over raw MPI, "
                    f"{', '.join(c.label(p) for p in order)}")
        memory = collect_comm(c.part_args(add_comm_arguments, None, args, sizes=[args.memory_size],
                                          protocols=session.protocols, iterations=5, warmup=2,
                                          alone=True, output=None))  # (its result is in idle's files)
    result = session.result(jobs[0].get("machine"), summary=summarize(jobs), jobs=jobs, memory=memory)
    session.write(result, render_idle, plot_idle)
    return result


def summarize(jobs: list[dict]) -> list[dict]:
    rows = []
    for job in jobs:
        runs = job["runs"]
        per = {}
        for k in runs[0]["percent_of_one_core"]:
            vals = [r["percent_of_one_core"][k] for r in runs if r["percent_of_one_core"].get(k) is not None]
            per[k] = statistics.median(vals) if vals else None
        rows.append({
            "protocol": job["protocol"],
            "total_percent": c.summary(r["ranks_total_percent"] for r in runs),
            "launcher_percent": c.summary(r["launcher_total_percent"] for r in runs),
            "per_process_median_percent": per,
            "seconds": job["config"]["seconds"],
            "runs": len(runs),
        })
    return rows


def render_idle(result: dict) -> str:
    rows_by = {r["protocol"]: r for r in result["summary"]}
    protos = [p for p in c.DASK_PROTOCOLS if p in rows_by]
    header = ["protocol", "4 ranks total, % of one core", *RANK_KEYS, "launcher (mpiexec + hydra proxy)"]
    body = []
    for p in protos:
        r = rows_by[p]
        t = r["total_percent"]
        per = r["per_process_median_percent"]
        body.append([c.label(p), f"{t['median']:.2f} (min {t['min']:.2f})" if r["runs"] > 1 else f"{t['median']:.2f}",
                     *(f"{per[k]:.2f}" if per.get(k) is not None else "-" for k in RANK_KEYS),
                     f"{r['launcher_percent']['median']:.2f}"])
    cfg = result["config"]
    lines = [c.header_line("idle", result), ""]
    lines.append(
        f"Scheduler, client (connected) and 2 workers, one MPI job of 4 processes on "
        f"{result['machine'].get('cpu_count')} cores, left idle for {cfg['seconds']:g} s (after {cfg['settle']:g} s "
        f"to settle) x {cfg['runs']}; CPU time (user + system, all threads) from /proc/PID/stat, as % of one core"
        + (" (median over windows, min in parentheses)" if cfg["runs"] > 1 else "") + "."
    )
    lines.append("")
    lines += c.md_table(header, body, left=1)
    extra = []
    if "mpi" in rows_by and "tcp" in rows_by:
        a, b = rows_by["mpi"]["total_percent"]["median"], rows_by["tcp"]["total_percent"]["median"]
        extra.append(f"mpi/tcp idle CPU: {a / b:.2f}x." if b > 0 else f"mpi:// {a:.2f}% against tcp:// {b:.2f}%.")
    extra.append("Resolution: one clock tick (10 ms) per process over the window.")
    lines += ["", " ".join(extra + c.run_notes(result))]
    if result.get("memory"):
        mem = memory_line(result["memory"])
        if mem:
            lines += ["", mem + " From a comm ping-pong job (2 processes, 5 timed rounds per point)."]
    return "\n".join(lines)


def plot_idle(result: dict, path: Path) -> None:
    plt = c.pyplot()
    rows = [r for p in c.DASK_PROTOCOLS for r in result["summary"] if r["protocol"] == p]
    fig, ax = plt.subplots(figsize=(8, 4.2), constrained_layout=True)
    width = 0.8 / max(1, len(rows))
    keys = [*RANK_KEYS, "total"]
    for i, r in enumerate(rows):
        vals = [r["per_process_median_percent"].get(k) or 0 for k in RANK_KEYS] + [r["total_percent"]["median"]]
        color = c.PROTOCOL_STYLE.get(r["protocol"], ("grey",))[0]
        ax.bar([j + i * width for j in range(len(keys))], vals, width=width, color=color, label=c.label(r["protocol"]))
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([k.replace(" (", "\n(") for k in keys], fontsize=8)
    ax.set_ylabel("CPU, % of one core")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    ax.set_title(f"idle cluster, {result['config']['seconds']:g} s window", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_rows(result: dict) -> list[list[str]]:
    """``bench all``'s summary: the idle CPU of the 4 processes, and the comm ping-pong's peak RSS."""
    by = {r["protocol"]: r for r in result["summary"]}
    if "mpi" not in by or "tcp" not in by:
        return []
    a, b = by["mpi"]["total_percent"]["median"], by["tcp"]["total_percent"]["median"]
    rows = [["idle, 4 processes", "% of one core", f"{a:.2f}", f"{b:.2f}", f"{c.ratio(a, b)} CPU"]]
    return rows + (memory_rows(result["memory"]) if result.get("memory") else [])
