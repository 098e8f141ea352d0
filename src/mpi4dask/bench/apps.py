"""``mpi4dask bench transpose-sum``, ``merge`` and ``set-index``: Dask applications per protocol.

* ``transpose-sum``: ``(x + x.T).sum()`` of a persisted N x N dask array, checked against NumPy.
* ``merge``: a dask.dataframe merge of two frames on a random key, per shuffle method (tasks, p2p),
  checked against ``pandas.merge``.
* ``set-index``: ``df.set_index("key")`` of one frame by a random key (a sort: each row goes to a
  random partition, so with W workers about (W-1)/W of the rows change worker), per shuffle method,
  every partition checked against pandas and for its order.

For every worker count W of ``--workers`` and every protocol, one MPI job
``mpiexec -n W+2 python -m mpi4dask.bench.apps_job`` (rank 0 scheduler, rank 1 client, W workers
with one thread each, see that module) creates and persists the data, places it on the workers
by a seeded assignment, and times ``--runs`` computations after ``--warmup`` untimed ones, checking
every result against NumPy / pandas on the client.  A wrong result fails the command.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from . import common as c

APP_TIMEOUT = 600.0
DEFAULT_RUNS = 5
SHUFFLES = ("tasks", "p2p")
#: The benchmarks of this module (``bench all`` plots them together in apps.png).
APPS = ("transpose-sum", "merge", "set-index")
#: Those that time dask.dataframe shuffles, one variant per ``--shuffle`` method.
SHUFFLE_APPS = ("merge", "set-index")


@dataclass
class _AppOptions:
    workers: list[int] = c.option([2], "worker counts to compare, e.g. 1,2,4; each runs as mpiexec -n W+2 "
                                  "(scheduler, client, W workers with 1 thread each)", c.int_list_arg, "LIST",
                                  all="workers")
    runs: int = c.option(DEFAULT_RUNS, "timed runs per measurement; the report gives median and min",
                         c.positive_int, "N", all="runs")
    warmup: int = c.option(1, "untimed (but checked) runs before the timed ones", c.nonnegative_int, "N")
    seed: int = c.option(c.SEED, "seed of the data and of its placement", int)
    rounds: int = c.rounds_option()


@dataclass
class TransposeOptions(_AppOptions):
    n: int = c.option(8000, "the transpose-sum array is N x N float64 (8000: 512 MB)", c.positive_int, "N", all="n")
    chunk: int = c.option(1000, "the transpose-sum array's chunks are C x C", c.positive_int, "C", all="chunk")


@dataclass
class FrameOptions(_AppOptions):
    rows: int = c.option(2_000_000, "rows of the frame of set-index, of each of the two frames of merge",
                         c.positive_int, "N", all="rows")
    partitions: int = c.option(8, "partitions of each frame (merge, set-index)", c.positive_int, "P",
                               all="partitions")
    shuffle: list[str] = c.option(list(SHUFFLES), "shuffle methods to time, from tasks,p2p (p2p needs pyarrow)",
                                  c.choices_arg(SHUFFLES, "shuffle method(s)"), "LIST")


def add_app_arguments(app: str, p: argparse.ArgumentParser) -> None:
    c.add_options(p, OPTIONS[app])
    c.add_protocols_argument(p)
    c.add_output_argument(p, f"{app}.json, {app}.md and {app}.png")
    c.add_launch_arguments(p, APP_TIMEOUT)


#: Each application's options.
OPTIONS = {"transpose-sum": TransposeOptions, "merge": FrameOptions, "set-index": FrameOptions}
add_transpose_arguments = partial(add_app_arguments, "transpose-sum")
add_merge_arguments = partial(add_app_arguments, "merge")
add_set_index_arguments = partial(add_app_arguments, "set-index")


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def _describe(app: str, config: dict) -> str:
    if app == "transpose-sum":
        n, ch = config["n"], config["chunk"]
        return (f"`(x + x.T).sum()` of an {n}x{n} float64 array ({n * n * 8 / 1e6:.0f} MB) in {ch}x{ch} chunks, "
                "x persisted on the workers first")
    if app == "set-index":
        return (f"dask.dataframe `set_index(\"key\")` of a {config['rows']:,}-row frame ({config['partitions']} "
                "partitions, random int64 keys, seeded; given divisions: the key's exact quantiles) reduced to "
                "per-partition checksums")
    return (f"dask.dataframe merge of two {config['rows']:,}-row frames ({config['partitions']} partitions each, "
            "random int64 keys, seeded) on the key, reduced to per-partition checksums")


def collect_app(app: str, args) -> dict:
    if app in SHUFFLE_APPS and "p2p" in args.shuffle:
        import importlib.util

        if importlib.util.find_spec("pyarrow") is None:
            raise c.BenchFailed("the p2p shuffle needs pyarrow (pip install pyarrow), or pass --shuffle tasks")
    session = c.Session(app, args)
    cores = os.cpu_count() or 1
    steps = c.Steps(app, len(args.workers) * len(session.protocols) * args.rounds)
    jobs = []
    with session:
        for k, w, p in c.in_rounds(session, args.workers, args.rounds):
            steps.start(f"{c.label(p)}: {w} worker(s) + scheduler + client = {w + 2} processes on {cores} "
                        f"cores{c.round_note(k, args.rounds)}")
            job = session.run(w + 2, "mpi4dask.bench.apps_job", {
                **c.option_values(OPTIONS[app], args), "app": app, "protocol": p, "workers": w})
            jobs.append({**job, "round": k})
    result = session.result(jobs[0].get("machine"), summary=summarize(c.pool_rounds(jobs, "variants")), jobs=jobs)
    session.write(result, render_app, plot_apps)
    return result


collect_transpose = partial(collect_app, "transpose-sum")
collect_merge = partial(collect_app, "merge")
collect_set_index = partial(collect_app, "set-index")


def summarize(jobs: list[dict]) -> list[dict]:
    """One row per (variant, workers, protocol): statistics over the timed runs (of all rounds: see
    :func:`~mpi4dask.bench.common.pool_rounds`)."""
    rows = []
    for job in jobs:
        for var in job["variants"]:
            timed = [r for r in var["runs"] if r["timed"]]
            secs = [r["seconds"] for r in timed]
            inc_b = sum(r["transfers"].get("incoming_bytes", 0) for r in timed)
            inc_s = sum(r["transfers"].get("incoming_seconds", 0.0) for r in timed)
            rows.append(
                {
                    "app": job["benchmark"],
                    "variant": var["variant"],
                    "workers": job["workers"],
                    "processes": job["processes"],
                    "cpu_count": job["cpu_count"],
                    "protocol": job["protocol"],
                    "seconds": c.summary(secs),
                    "round_medians": c.round_medians(var["runs"]),
                    "transfer_bytes_per_run": inc_b / len(timed) if timed else None,
                    "transfers_per_run": (sum(r["transfers"].get("incoming_count", 0) for r in timed) / len(timed)
                                          if timed else None),
                    "transfer_GBps": (inc_b / inc_s / 1e9) if inc_s > 0 else None,
                    "runs_checked": len(var["runs"]),
                    "ok": all(r["ok"] for r in var["runs"]),
                    "cpu": c.cpu_summary(timed, job["cpu_count"]),
                }
            )
    return rows


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------


def render_app(result: dict) -> str:
    app = result["benchmark"]
    cfg = result["config"]
    protocols = [p for p in c.DASK_PROTOCOLS if p in cfg["protocols"]]
    rows_by = {(r["variant"], r["workers"], r["protocol"]): r for r in result["summary"]}
    variants = list(dict.fromkeys(r["variant"] for r in result["summary"]))
    workers = sorted({r["workers"] for r in result["summary"]})

    shuffles = app in SHUFFLE_APPS
    header = (["shuffle"] if shuffles else []) + ["workers", "processes on cores"]
    header += [f"{c.label(p)} s" for p in protocols]
    ratios = [p for p in protocols if p != "tcp"] if "tcp" in protocols else []
    header += [f"{p}/tcp time" for p in ratios]
    by_round = ratios if cfg.get("rounds", 1) > 1 else []
    header += [f"{p}/tcp by round" for p in by_round]
    for p in protocols:
        header += [f"{c.label(p)} MB moved/run", f"{c.label(p)} transfer GB/s"]
    header.append("result")

    body = []
    for v in variants:
        for w in workers:
            cells = [r for r in (rows_by.get((v, w, p)) for p in protocols) if r]
            if not cells:
                continue
            row = ([v] if shuffles else []) + [str(w), f"{cells[0]['processes']} on {cells[0]['cpu_count']}"]
            for p in protocols:
                r = rows_by.get((v, w, p))
                s = r["seconds"] if r else None
                row.append(f"{c.fmt_s(s['median'])} ({c.fmt_s(s['min'])})" if s and s.get("n") else "-")
            for p in ratios:
                a, b = rows_by.get((v, w, p)), rows_by.get((v, w, "tcp"))
                row.append(f"{a['seconds']['median'] / b['seconds']['median']:.2f}x" if a and b else "-")
            row += [c.round_ratios(rows_by.get((v, w, p)), rows_by.get((v, w, "tcp"))) for p in by_round]
            for p in protocols:
                r = rows_by.get((v, w, p))
                mb = r["transfer_bytes_per_run"] if r else None
                if v == "p2p":  # P2P moves its data outside the transfer logs
                    row += ["n/a", "n/a"]
                else:
                    row += ["-" if mb is None else f"{mb / 1e6:.0f}", c.fmt_gbps(r["transfer_GBps"]) if r else "-"]
            ok = all(x["ok"] for x in cells)
            row.append(f"ok ({sum(x['runs_checked'] for x in cells)} runs checked)" if ok else "**WRONG**")
            body.append(row)

    cores = result["machine"].get("cpu_count")
    lines = [c.header_line(app, result), ""]
    lines.append(
        f"{_describe(app, cfg)}; 1 thread per worker; W workers + scheduler + client = W+2 processes shared "
        f"{cores} cores; median (min) of {c.runs_phrase(cfg, 'runs')}."
    )
    lines.append("")
    lines += c.md_table(header, body, left=3 if shuffles else 2)
    notes = [
        "`P/tcp time` = median time over P / median time over tcp:// (below 1: P is faster).",
        "MB moved/run and transfer GB/s come from the workers' `transfer_incoming_log` over the timed runs: "
        "bytes (`total`) and `duration` of every worker-to-worker dependency transfer; GB/s = sum of bytes / "
        "sum of durations (a per-transfer rate; transfers overlap and include request round trips).",
        "The persisted data is placed on the workers by a seeded balanced assignment (the same for every "
        "protocol) and restored before every run; the Active Memory Manager is off in these jobs.",
    ]
    if shuffles:
        notes.append("P2P shuffles move their data through shuffle RPCs, which the transfer logs do not count (n/a).")
    if app == "merge":
        notes.append("Every run's result (row count, key and row-id sums, pairing checksum) equals a pandas merge "
                     "of the same frames on the client.")
    elif app == "set-index":
        notes.append("Timed: `df.set_index(\"key\", divisions=D, shuffle_method=S)` reduced on the workers to one "
                     "summary row per partition, with `.compute()`. D is the key's exact quantiles (P+1 order "
                     "statistics of the same frame generated on the client): equal partitions, the same for every "
                     "protocol and worker count; so a run is the shuffle, the sort of each partition and the "
                     "summaries, without the quantile pass that `set_index` makes when it is given no divisions "
                     "(dask's estimate, from sampled quantiles, differs from job to job).")
        notes.append("Every run's result is checked: each partition sorted, its keys inside its division range, the "
                     "partitions' key ranges in order without overlap, and each partition's rows, key and row-id "
                     "sums, checksum of every row's (id, key, v), min and max key equal to pandas' for the rows "
                     "of the same frame (generated on the client) whose keys fall in that range.")
    else:
        notes.append("Every run's result equals NumPy's `(xn + xn.T).sum()` of the same seeded array, generated "
                     "on the client (relative tolerance 1e-9).")
    lines += ["", " ".join(notes + c.run_notes(result))]
    cpu_rows = [(([v] if shuffles else []) + [str(w)], p, rows_by[(v, w, p)])
                for v in variants for w in workers for p in protocols if (v, w, p) in rows_by]
    lines += c.cpu_table(result, (["shuffle"] if shuffles else []) + ["workers"], cpu_rows,
                         "pandas" if shuffles else "NumPy")
    return "\n".join(lines)


def plot_apps(results, path: Path) -> None:
    """Time against worker count: one panel per (app, variant), one line per protocol."""
    if isinstance(results, dict):
        results = [results]
    plt = c.pyplot()
    panels = []
    for res in results:
        for v in dict.fromkeys(r["variant"] for r in res["summary"]):
            panels.append((res, v))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.5, 5.2 * len(panels)), 4.4), constrained_layout=True,
                             squeeze=False)
    for ax, (res, v) in zip(axes[0], panels):
        rows = [r for r in res["summary"] if r["variant"] == v and r["seconds"].get("n")]
        for p in [p for p in c.DASK_PROTOCOLS if any(r["protocol"] == p for r in rows)]:
            pr = sorted((r for r in rows if r["protocol"] == p), key=lambda r: r["workers"])
            xs = [r["workers"] for r in pr]
            color, marker, ls = c.PROTOCOL_STYLE.get(p, (None, "x", "-"))
            ax.plot(xs, [r["seconds"]["median"] for r in pr], color=color, marker=marker, ls=ls,
                    label=f"{c.label(p)} median")
            ax.plot(xs, [r["seconds"]["min"] for r in pr], color=color, marker=marker, ls=":", alpha=0.5,
                    label=f"{c.label(p)} min")
        ws = sorted({r["workers"] for r in rows})
        ax.set_xticks(ws)
        ax.set_xlabel(f"workers (+ scheduler + client; {res['machine'].get('cpu_count')} cores)")
        ax.set_ylabel("time (s)")
        ax.set_ylim(bottom=0)
        title = "transpose-sum" if res["benchmark"] == "transpose-sum" else f"{res['benchmark']}, shuffle {v}"
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    m = results[0]["machine"]
    fig.suptitle(f"Dask applications: time vs workers; {m.get('mpi_library', '')}; distributed "
                 f"{m.get('distributed', '')}", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_rows(result: dict) -> list[list[str]]:
    """``bench all``'s summary: the median time per variant and worker count."""
    app = result["benchmark"]
    by = {(r["variant"], r["workers"], r["protocol"]): r for r in result["summary"]}
    variants = list(dict.fromkeys(r["variant"] for r in result["summary"]))  # tasks before p2p
    rows = []
    for (v, w, p), r in sorted(by.items(), key=lambda kv: (variants.index(kv[0][0]), kv[0][1])):
        if p != "mpi" or (v, w, "tcp") not in by:
            continue
        name = app if app == "transpose-sum" else f"{app} ({v})"
        rows.append(c.time_summary_row(f"{name}, {w} worker(s)", r, by[(v, w, "tcp")]))
    return rows
