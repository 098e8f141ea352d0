"""``mpi4dask bench tasks``: real Dask work over ``mpi://`` and ``tcp://`` side by side.

For every worker count W of ``--workers`` and every protocol (``mpi``, ``tcp``, and ``ucx`` when
distributed_ucxx is importable), one MPI job ``mpiexec -n W+2 python -m mpi4dask.bench.tasks_job``
(see that module), launched the same way for every protocol: ``mpi4dask.initialize(protocol=P)``
makes rank 0 the scheduler, rank 1 the client and ranks 2.. W workers with one thread each.  The
client times task throughput (``client.map`` of 1000 tiny tasks), a reduction
(``da.random.random((8000, 8000), chunks=500).sum()``) and a large gather (a persisted 512 MiB
array computed to the client), each ``--repeat`` times after a warm-up, checking every result.  A
wrong result fails the command.  The report gives the median (min) time per protocol, the ratio to
tcp://, the processes that shared the cores and the load averages before and after every job, and a
second table of where each run's CPU time went (the workers' task threads and event loops, the
scheduler, the client).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

from . import common as c

TASKS_TIMEOUT = 600.0
DEFAULT_REPEAT = 5


def gather_side(mib: int) -> int:
    """The side of the square float64 array of ``mib`` MiB (512 -> 8192)."""
    return math.isqrt(mib * (1 << 20) // 8)


@dataclass
class TasksOptions:
    workers: list[int] = c.option([1, 2], "worker counts to compare, e.g. 1,2,6; each runs as mpiexec -n W+2 "
                                  "(scheduler, client, W workers with 1 thread each)", c.int_list_arg, "LIST",
                                  all="workers")
    repeat: int = c.option(DEFAULT_REPEAT, "timed runs of each piece of work; the report gives median and min",
                           c.positive_int, "N", all="runs")
    warmup: int = c.option(1, "untimed (but checked) runs before the timed ones", c.nonnegative_int, "N")
    map_tasks: int = c.option(1000, "tasks per client.map", c.positive_int, "N", all="map_tasks")
    sum_size: int = c.option(8000, "the summed random array is N x N float64 (8000: 512 MB)", c.positive_int, "N",
                             all="sum_size")
    sum_chunk: int = c.option(500, "the summed array's chunks are C x C", c.positive_int, "C", all="sum_chunk")
    gather_mb: int = c.option(512, "the gathered array is square float64 of this many MiB, in 8 x 8 blocks "
                              "(512: 8192 x 8192)", c.positive_int, "MIB", all="gather_mb")
    seed: int = c.option(c.SEED, "seed of the random arrays", int)
    rounds: int = c.rounds_option()


def add_tasks_arguments(p: argparse.ArgumentParser) -> None:
    c.add_options(p, TasksOptions)
    c.add_protocols_argument(p, with_ucx=True)
    c.add_output_argument(p, "tasks.json, tasks.md and tasks.png")
    c.add_launch_arguments(p, TASKS_TIMEOUT)


def collect_tasks(args: argparse.Namespace) -> dict:
    session = c.Session("tasks", args)
    cores = os.cpu_count() or 1
    load = f" + {args.load} load" if args.load else ""
    steps = c.Steps("tasks", len(args.workers) * len(session.protocols) * args.rounds)
    config = {**c.option_values(TasksOptions, args), "gather_side": gather_side(args.gather_mb)}
    jobs = []
    with session:
        for k, w, p in c.in_rounds(session, args.workers, args.rounds):
            steps.start(f"{c.label(p)}: {w} worker(s) + scheduler + client{load} = {w + 2 + args.load} "
                        f"processes on {cores} cores{c.round_note(k, args.rounds)}")
            job = session.run(w + 2, "mpi4dask.bench.tasks_job", {**config, "protocol": p, "workers": w})
            jobs.append({**job, "round": k})
    result = session.result(jobs[0].get("machine"), summary=summarize(c.pool_rounds(jobs, "works"), args.load),
                            jobs=jobs)
    session.write(result, render_tasks, plot_tasks)
    return result


def summarize(jobs: list[dict], load: int) -> list[dict]:
    """One row per (work, workers, protocol): statistics over the timed runs (of all rounds: see
    :func:`~mpi4dask.bench.common.pool_rounds`)."""
    rows = []
    for job in jobs:
        for work in job["works"]:
            timed = [r for r in work["runs"] if r["timed"]]
            secs = [r["seconds"] for r in timed]
            stats = c.summary(secs)
            rows.append({
                "work": work["work"],
                "label": work["label"],
                "workers": job["workers"],
                "protocol": job["protocol"],
                "processes": job["processes"],
                "load_processes": load,
                "cpu_count": job["cpu_count"],
                "seconds": stats,
                "round_medians": c.round_medians(work["runs"]),
                "unit": work["unit"],
                "rate_per_s": work["amount"] / stats["median"] if secs else None,
                "runs_checked": len(work["runs"]),
                "ok": all(r["ok"] for r in work["runs"]),
                "cpu": c.cpu_summary(timed, job["cpu_count"]),
            })
    return rows


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------


def _rate(row: dict | None) -> str:
    if not row or row["rate_per_s"] is None:
        return "-"
    if row["unit"] == "tasks":
        return f"{row['rate_per_s']:,.0f} tasks/s"
    return f"{c.fmt_gbps(row['rate_per_s'] / 1e9)} GB/s"


def _protocols(result: dict) -> list[str]:
    return [p for p in c.DASK_PROTOCOLS if p in result["config"]["protocols"]]


def _by(result: dict) -> dict:
    return {(r["work"], r["workers"], r["protocol"]): r for r in result["summary"]}


def render_tasks(result: dict) -> str:
    cfg = result["config"]
    protocols = _protocols(result)
    by = _by(result)
    works = list(dict.fromkeys((r["work"], r["label"]) for r in result["summary"]))
    workers = sorted({r["workers"] for r in result["summary"]})
    ratios = [p for p in protocols if p != "tcp"] if "tcp" in protocols else []
    rounds = cfg.get("rounds", 1)
    by_round = ratios if rounds > 1 else []

    header = ["work", "workers", "processes on cores", *(f"{c.label(p)} s" for p in protocols),
              *(f"{p}/tcp time" for p in ratios), *(f"{p}/tcp by round" for p in by_round),
              *(f"{c.label(p)} rate" for p in protocols), "result"]
    body = []
    for work, label in works:
        for w in workers:
            cells = [by[(work, w, p)] for p in protocols if (work, w, p) in by]
            if not cells:
                continue
            first = cells[0]
            load = f" + {first['load_processes']} load" if first["load_processes"] else ""
            row = [label, str(w), f"{first['processes']}{load} on {first['cpu_count']}"]
            for p in protocols:
                s = by[(work, w, p)]["seconds"] if (work, w, p) in by else None
                row.append(f"{c.fmt_s(s['median'])} ({c.fmt_s(s['min'])})" if s and s.get("n") else "-")
            for p in ratios:
                a, b = by.get((work, w, p)), by.get((work, w, "tcp"))
                row.append(c.ratio(a["seconds"]["median"], b["seconds"]["median"]) if a and b else "-")
            row += [c.round_ratios(by.get((work, w, p)), by.get((work, w, "tcp"))) for p in by_round]
            row += [_rate(by.get((work, w, p))) for p in protocols]
            ok = all(x["ok"] for x in cells)
            row.append(f"ok ({sum(x['runs_checked'] for x in cells)} runs checked)" if ok else "**WRONG**")
            body.append(row)

    cores = result["machine"].get("cpu_count")
    m = gather_side(cfg["gather_mb"])
    lines = [c.header_line("tasks", result), ""]
    lines.append(
        "Real Dask work on `mpi4dask.initialize(protocol=...)` clusters, the same `mpiexec -n W+2` launch for every "
        "protocol: rank 0 scheduler, rank 1 client, W workers with 1 thread each (W+2 processes"
        + (f" and {cfg['load']} --load processes" if cfg.get("load") else "")
        + f" shared {cores} cores). Median (min) of {c.runs_phrase(cfg, 'repeat')}. "
        f"**map**: `client.gather(client.map(inc, range({cfg['map_tasks']}), pure=False))`; **sum**: "
        f"`da.random.default_rng(seed).random(({cfg['sum_size']}, {cfg['sum_size']}), chunks={cfg['sum_chunk']})"
        f".sum().compute()`; **gather**: `y.compute()` of a persisted {m}x{m} float64 random array in 8x8 blocks "
        "(a worker concatenates them, the whole array travels to the client)."
    )
    lines.append("")
    lines += c.md_table(header, body, left=3)
    notes = [
        "`P/tcp time` = median time over P / median time over tcp:// (below 1: P is faster). Rate: tasks per "
        "second, or bytes of the array per second.",
        "Checks, on every run: map: the gathered list equals [1..n]; sum: equals the same seeded sum computed on "
        "the client by the synchronous scheduler (relative tolerance 1e-9); gather: shape and dtype, and the sum "
        "computed on the workers.",
    ]
    loads = c.job_loadavg_note([(f"{c.label(j['protocol'])} {j['workers']} worker(s)"
                                 f"{c.round_note(j.get('round', 0), rounds)}", j) for j in result["jobs"]])
    if loads:
        notes.append(loads)
    lines += ["", " ".join(notes + c.run_notes(result))]
    cpu_rows = [([label, str(w)], p, by[(work, w, p)])
                for work, label in works for w in workers for p in protocols if (work, w, p) in by]
    lines += c.cpu_table(result, ["work", "workers"], cpu_rows, "the tasks, NumPy's random blocks and sums")
    return "\n".join(lines)


def summary_rows(result: dict) -> list[list[str]]:
    """``bench all``'s summary: the median time per work and worker count."""
    by = _by(result)
    rows = []
    for (work, w, p), r in by.items():
        t = by.get((work, w, "tcp"))
        if p == "mpi" and t:
            rows.append(c.time_summary_row(f"tasks: {r['label']}, {w} worker(s)", r, t))
    return rows


def plot_tasks(result: dict, path: Path) -> None:
    """Median time (bars) and min (dots) per worker count, one panel per work, one bar per protocol."""
    plt = c.pyplot()
    protocols = _protocols(result)
    by = _by(result)
    works = list(dict.fromkeys((r["work"], r["label"]) for r in result["summary"]))
    workers = sorted({r["workers"] for r in result["summary"]})
    fig, axes = plt.subplots(1, len(works), figsize=(4.6 * len(works), 4.2), constrained_layout=True, squeeze=False)
    width = 0.8 / max(1, len(protocols))
    for ax, (work, label) in zip(axes[0], works):
        for i, p in enumerate(protocols):
            xs = [j + i * width for j, w in enumerate(workers) if (work, w, p) in by]
            rows = [by[(work, w, p)] for w in workers if (work, w, p) in by]
            color = c.PROTOCOL_STYLE.get(p, ("grey",))[0]
            ax.bar(xs, [r["seconds"]["median"] for r in rows], width=width, color=color, label=f"{c.label(p)} median")
            ax.plot(xs, [r["seconds"]["min"] for r in rows], "k.", ms=5)
        ax.set_xticks([j + width * (len(protocols) - 1) / 2 for j in range(len(workers))])
        ax.set_xticklabels([str(w) for w in workers])
        ax.set_xlabel(f"workers (+ scheduler + client; {result['machine'].get('cpu_count')} cores)")
        ax.set_ylabel("time (s); dots: min")
        ax.set_title(label, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"Dask work per protocol; {m.get('mpi_library', '')}; distributed {m.get('distributed', '')}"
                 + (f"; --load {result['config']['load']}" if result["config"].get("load") else ""), fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
