"""``mpi4dask bench transpose-sum`` and ``mpi4dask bench merge``: Dask applications per protocol.

For every worker count W of ``--workers`` and every protocol, one MPI job
``mpiexec -n W+2 python -m mpi4dask._bench_app_job`` (rank 0 scheduler, rank 1 client, W workers
with one thread each, see that module) creates and persists the data, places it on the workers
by a seeded assignment, and times ``--runs`` computations after ``--warmup`` untimed ones, checking
every result against NumPy / pandas on the client.  A wrong result fails the command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import common as c

APP_TIMEOUT = 600.0
DEFAULT_RUNS = 5
DEFAULT_SEED = 20240601
SHUFFLES = ("tasks", "p2p")


def _shuffles_arg(text: str) -> list[str]:
    names = [p.strip().lower() for p in text.split(",")]
    bad = [n for n in names if n not in SHUFFLES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"invalid shuffle method(s) {', '.join(repr(b) for b in bad) or repr(text)} in {text!r}: "
            f"choose from {', '.join(SHUFFLES)}"
        )
    return [s for s in SHUFFLES if s in names]


def _add_common(p: argparse.ArgumentParser, app: str) -> None:
    c.add_protocols_argument(p)
    p.add_argument(
        "--workers",
        type=c.int_list_arg,
        default=[2],
        metavar="LIST",
        help="worker counts to compare, e.g. 1,2,4 (default: 2); each runs as mpiexec -n W+2 "
        "(scheduler, client, W workers with 1 thread each)",
    )
    p.add_argument("--runs", type=c.positive_int, default=DEFAULT_RUNS, metavar="N",
                   help=f"timed runs per measurement; the report gives median and min (default: {DEFAULT_RUNS})")
    p.add_argument("--warmup", type=c.nonnegative_int, default=1, metavar="N",
                   help="untimed (but checked) runs before the timed ones (default: 1)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the data and of its placement")
    c.add_output_argument(p, f"{app}.json, {app}.md and {app}.png")
    c.add_launch_arguments(p, APP_TIMEOUT)


def add_transpose_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=c.positive_int, default=8000, metavar="N",
                   help="the array is N x N float64 (default: 8000, 512 MB)")
    p.add_argument("--chunk", type=c.positive_int, default=1000, metavar="C",
                   help="chunks are C x C (default: 1000)")
    _add_common(p, "transpose-sum")


def add_merge_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=c.positive_int, default=2_000_000, metavar="N",
                   help="rows of each of the two frames (default: 2000000)")
    p.add_argument("--partitions", type=c.positive_int, default=8, metavar="P",
                   help="partitions of each frame (default: 8)")
    p.add_argument("--shuffle", type=_shuffles_arg, default=list(SHUFFLES), metavar="LIST",
                   help="shuffle methods to time, from tasks,p2p (default: both; p2p needs pyarrow)")
    _add_common(p, "merge")


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def _job_args(app: str, protocol: str, args) -> list[str]:
    out = ["--app", app, "--protocol", protocol, "--runs", str(args.runs), "--warmup", str(args.warmup),
           "--seed", str(args.seed)]
    if app == "transpose-sum":
        out += ["--n", str(args.n), "--chunk", str(args.chunk)]
    else:
        out += ["--rows", str(args.rows), "--partitions", str(args.partitions), "--shuffle", ",".join(args.shuffle)]
    return out


def _describe(app: str, config: dict) -> str:
    if app == "transpose-sum":
        n, ch = config["n"], config["chunk"]
        return (f"`(x + x.T).sum()` of an {n}x{n} float64 array ({n * n * 8 / 1e6:.0f} MB) in {ch}x{ch} chunks, "
                "x persisted on the workers first")
    return (f"dask.dataframe merge of two {config['rows']:,}-row frames ({config['partitions']} partitions each, "
            "random int64 keys, seeded) on the key, reduced to per-partition checksums")


def collect_app(app: str, args) -> dict:
    say = c.sayer(app)
    if app == "merge" and "p2p" in args.shuffle:
        import importlib.util

        if importlib.util.find_spec("pyarrow") is None:
            raise c.BenchFailed("the p2p shuffle needs pyarrow (pip install pyarrow), or pass --shuffle tasks")
    runner = c.JobRunner(app, args.mpiexec, args.timeout)
    protocols, notes = c.usable_protocols(args.protocols, say)
    if not protocols:
        raise c.BenchFailed("no protocol left to measure")
    c.make_output_dir(args.output)
    before = c.load_before(say)
    cores = os.cpu_count() or 1
    steps = c.Steps(app, len(args.workers) * len(protocols))
    jobs = []
    for w in args.workers:
        for p in sorted(protocols, key=lambda p: p != "tcp"):  # tcp:// first, as in comm
            steps.start(f"{c.label(p)}: {w} worker(s) + scheduler + client = {w + 2} processes on {cores} cores")
            jobs.append(runner.run(w + 2, "mpi4dask._bench_app_job", _job_args(app, p, args)))
    config = {k: v for k, v in vars(args).items() if k not in ("func", "output", "mpiexec", "benchmark")}
    config["protocols"] = protocols
    machine = {**c.machine_info(), **jobs[0].get("machine", {}), **before, **c.load_during(runner.foreign, say)}
    result = {
        "benchmark": app,
        "machine": machine,
        "config": config,
        "notes": notes,
        "commands": runner.commands,
        "summary": summarize(jobs),
        "jobs": jobs,
    }
    c.write_outputs(args.output, app, result, render_app(result), plot_apps, say)
    return result


def summarize(jobs: list[dict]) -> list[dict]:
    """One row per (variant, workers, protocol): statistics over the timed runs."""
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
                    "transfer_bytes_per_run": inc_b / len(timed) if timed else None,
                    "transfers_per_run": (sum(r["transfers"].get("incoming_count", 0) for r in timed) / len(timed)
                                          if timed else None),
                    "transfer_GBps": (inc_b / inc_s / 1e9) if inc_s > 0 else None,
                    "runs_checked": len(var["runs"]),
                    "ok": all(r["ok"] for r in var["runs"]),
                }
            )
    return rows


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------


def header_line(name: str, result: dict) -> str:
    m = result["machine"]
    cores = m.get("cpu_count")
    return (
        f"**mpi4dask bench {name}** on {m.get('hostname', '?')}: {cores} cores (os.cpu_count()); "
        f"{m.get('mpi_library', '?')} (thread level {m.get('mpi_thread_level', '?')}); distributed "
        f"{m.get('distributed', '?')}; dask {m.get('dask', '?')}; mpi4py {m.get('mpi4py', '?')}; "
        f"Python {m.get('python', '?')}"
    )


def render_app(result: dict) -> str:
    app = result["benchmark"]
    cfg = result["config"]
    protocols = [p for p in c.DASK_PROTOCOLS if p in cfg["protocols"]]
    rows_by = {(r["variant"], r["workers"], r["protocol"]): r for r in result["summary"]}
    variants = list(dict.fromkeys(r["variant"] for r in result["summary"]))
    workers = sorted({r["workers"] for r in result["summary"]})

    header = (["shuffle"] if app == "merge" else []) + ["workers", "processes on cores"]
    header += [f"{c.label(p)} s" for p in protocols]
    ratios = [p for p in protocols if p != "tcp"] if "tcp" in protocols else []
    header += [f"{p}/tcp time" for p in ratios]
    for p in protocols:
        header += [f"{c.label(p)} MB moved/run", f"{c.label(p)} transfer GB/s"]
    header.append("result")

    body = []
    for v in variants:
        for w in workers:
            cells = [r for r in (rows_by.get((v, w, p)) for p in protocols) if r]
            if not cells:
                continue
            row = ([v] if app == "merge" else []) + [str(w), f"{cells[0]['processes']} on {cells[0]['cpu_count']}"]
            for p in protocols:
                r = rows_by.get((v, w, p))
                s = r["seconds"] if r else None
                row.append(f"{c.fmt_s(s['median'])} ({c.fmt_s(s['min'])})" if s and s.get("n") else "-")
            for p in ratios:
                a, b = rows_by.get((v, w, p)), rows_by.get((v, w, "tcp"))
                row.append(f"{a['seconds']['median'] / b['seconds']['median']:.2f}x" if a and b else "-")
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
    lines = [header_line(app, result), ""]
    lines.append(
        f"{_describe(app, cfg)}; 1 thread per worker; W workers + scheduler + client = W+2 processes shared "
        f"{cores} cores; median (min) of {cfg['runs']} timed runs after {cfg['warmup']} warm-up run(s)."
    )
    lines.append("")
    lines += c.md_table(header, body, left=3 if app == "merge" else 2)
    notes = [
        "`P/tcp time` = median time over P / median time over tcp:// (below 1: P is faster).",
        "MB moved/run and transfer GB/s come from the workers' `transfer_incoming_log` over the timed runs: "
        "bytes (`total`) and `duration` of every worker-to-worker dependency transfer; GB/s = sum of bytes / "
        "sum of durations (a per-transfer rate; transfers overlap and include request round trips).",
        "The persisted data is placed on the workers by a seeded balanced assignment (the same for every "
        "protocol) and restored before every run; the Active Memory Manager is off in these jobs.",
    ]
    if app == "merge":
        notes.append("P2P shuffles move their data through shuffle RPCs, which the transfer logs do not count (n/a).")
        notes.append("Every run's result (row count, key and row-id sums, pairing checksum) equals a pandas merge "
                     "of the same frames on the client.")
    else:
        notes.append("Every run's result equals NumPy's `(xn + xn.T).sum()` of the same seeded array, generated "
                     "on the client (relative tolerance 1e-9).")
    foreign = c.foreign_note(result["machine"])
    if foreign:
        notes.append(foreign)
    notes += [n[0].upper() + n[1:] + "." for n in result.get("notes", [])]
    lines += ["", " ".join(notes)]
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
        title = "transpose-sum" if res["benchmark"] == "transpose-sum" else f"merge, shuffle {v}"
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    m = results[0]["machine"]
    fig.suptitle(f"Dask applications: time vs workers; {m.get('mpi_library', '')}; distributed "
                 f"{m.get('distributed', '')}", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _runner(app: str):
    def run(args: argparse.Namespace) -> int:
        try:
            result = collect_app(app, args)
        except c.BenchFailed as exc:
            print(f"mpi4dask bench {app}: error: {exc}", file=sys.stderr, flush=True)
            return 1
        print(render_app(result), flush=True)
        return 0

    return run


run_transpose = _runner("transpose-sum")
run_merge = _runner("merge")
