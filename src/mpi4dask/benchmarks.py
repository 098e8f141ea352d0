"""``mpi4dask bench``: benchmarks of the ``mpi://`` transport against ``tcp://`` and raw MPI.

Each benchmark is one entry in :data:`BENCHMARKS` (name, help, argument adder, runner), one
sub-command of ``mpi4dask bench`` each; every one launches its own MPI jobs (with timeouts), prints
a markdown report on stdout and progress on stderr, and with ``--output DIR`` writes JSON, markdown
and PNG plots:

* ``comm``: ping-pongs a message holding one numpy ``uint8`` array between two MPI ranks at the
  Dask comm level (``Comm.write`` / ``Comm.read``) over ``mpi://`` and ``tcp://``, plus raw mpi4py
  ``Send``/``Recv`` of the same bytes as the limit, in one job (``mpiexec -n 2 python -m
  mpi4dask._bench_job``); also the peak RSS of both ranks at each point.  Defined here.
* ``transpose-sum`` and ``merge`` (:mod:`mpi4dask.bench.apps`): Dask applications on an
  ``mpi4dask.initialize()`` cluster, timed and checked against NumPy / pandas.
* ``soak`` (:mod:`mpi4dask.bench.soak`): many connections, both directions at once, every message
  checksummed; any corrupted, lost, duplicated or out-of-order message fails the command.
* ``idle`` (:mod:`mpi4dask.bench.idle`): the CPU time an idle cluster burns.
* ``all`` (:mod:`mpi4dask.bench.report`): all of the above, one combined report.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .bench import common as _c
from .bench.common import (  # noqa: F401 - re-exported: the public names of earlier versions
    DEFAULT_SIZES,
    MAX_SIZE,
    BenchFailed,
    ForeignLoad,
    format_size,
    label,
    parse_size,
    parse_sizes,
)

DASK_PROTOCOLS = _c.DASK_PROTOCOLS  # display order; the job runs tcp:// before mpi://
DEFAULT_TIMEOUT = 300.0
DEFAULT_TARGET_TIME = 0.3

# ----------------------------------------------------------------------------------------------
# CLI structure
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Benchmark:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Give ``mpi4dask bench`` one sub-command per entry of :data:`BENCHMARKS`."""
    parser.description = "Benchmarks of the mpi:// Dask transport against tcp:// and raw MPI."
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for bench in BENCHMARKS.values():
        p = sub.add_parser(bench.name, help=bench.help, description=bench.help)
        bench.add_arguments(p)
        p.set_defaults(func=bench.run)

    def _no_benchmark(args: argparse.Namespace) -> int:  # only reached if argparse lets it through
        parser.print_usage(sys.stderr)
        print(f"mpi4dask bench: choose a benchmark: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2

    parser.set_defaults(func=_no_benchmark)


def add_comm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        type=_c.sizes_arg,
        default=parse_sizes(DEFAULT_SIZES),
        metavar="LIST",
        help=f"comma-separated message sizes, binary units: 1K = 1024 B (default: {DEFAULT_SIZES})",
    )
    _c.add_protocols_argument(p, "; raw MPI Send/Recv is always measured")
    p.add_argument(
        "--iterations",
        type=_c.positive_int,
        default=None,
        metavar="N",
        help="timed round trips per point (default: adaptive, about --target-time seconds per point, "
        "at least 5)",
    )
    p.add_argument(
        "--warmup",
        type=_c.positive_int,
        default=None,
        metavar="N",
        help="untimed round trips before each point (default: adaptive, 2 to 200)",
    )
    p.add_argument(
        "--target-time",
        type=_c.positive_float,
        default=DEFAULT_TARGET_TIME,
        metavar="S",
        help=f"seconds of timed round trips per point when --iterations is not given (default: {DEFAULT_TARGET_TIME})",
    )
    _c.add_output_argument(p, "comm.json, comm.md and comm.png")
    p.add_argument("--host", default="127.0.0.1", help="host rank 0 listens on for the Dask comms (default: 127.0.0.1)")
    _c.add_launch_arguments(p, DEFAULT_TIMEOUT, "the MPI job")


# ----------------------------------------------------------------------------------------------
# Running the job
# ----------------------------------------------------------------------------------------------

_say = _c.sayer("comm")


def run_comm(args: argparse.Namespace) -> int:
    try:
        result = collect_comm(args)
    except BenchFailed as exc:
        print(f"mpi4dask bench comm: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(render_comm_table(result), flush=True)
    return 0


def collect_comm(args: argparse.Namespace) -> dict:
    """Run the comm job; return its results (and write the output files, with ``--output``)."""
    launcher_cmd = _c.launcher_command(args.mpiexec)
    output: Path | None = args.output
    _c.make_output_dir(output)
    protocols, notes = _c.usable_protocols(args.protocols, _say)
    before = _c.load_before(_say)

    with tempfile.TemporaryDirectory(prefix="mpi4dask-bench-") as tmp:
        result_file = os.path.join(tmp, "result.json")
        deadline = time.time() + args.timeout
        cmd = [
            *launcher_cmd,
            "-n",
            "2",
            sys.executable,
            "-m",
            "mpi4dask._bench_job",
            "--sizes",
            ",".join(str(s) for s in args.sizes),
            "--protocols",
            ",".join(protocols),
            "--target-time",
            repr(args.target_time),
            "--host",
            args.host,
            "--deadline",
            repr(deadline),
            "--result",
            result_file,
        ]
        if args.iterations is not None:
            cmd += ["--iterations", str(args.iterations)]
        if args.warmup is not None:
            cmd += ["--warmup", str(args.warmup)]
        _say(
            f"sizes {', '.join(format_size(s) for s in args.sizes)}; transports raw, "
            f"{', '.join(label(p) for p in protocols)}; launching: {shlex.join(cmd)}"
        )
        foreign = ForeignLoad()
        with foreign:
            _c.launch(cmd, _c.job_env(), args.timeout)
        result = _c.read_result(result_file)
        if result is None:
            raise BenchFailed("the MPI job exited cleanly but left no readable results")

    _check_complete(result, args.sizes, ["raw", *protocols])
    result["config"]["command"] = shlex.join(cmd)
    result["config"]["notes"] = notes
    result["machine"].update(before)
    result["machine"].update(_c.load_during(foreign, _say))
    _c.write_outputs(output, "comm", result, render_comm_table(result), plot_comm, _say)
    return result


def _check_complete(result: dict, sizes: list[int], transports: list[str]) -> None:
    have = {(r["transport"], r["size"]) for r in result.get("records", [])}
    missing = [f"{t} {format_size(s)}" for t in transports for s in sizes if (t, s) not in have]
    if missing:
        raise BenchFailed(f"the MPI job's results lack {', '.join(missing)}")


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------

_TRANSPORT_LABEL = _c.LABELS


def _fmt_us(x: float) -> str:
    if x >= 1000:
        return f"{x:,.0f}"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}"


def _fmt_gbps(x: float) -> str:
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.001:
        return f"{x:.3g}"
    return f"{x:.1e}"


def machine_line(result: dict) -> str:
    m = result["machine"]
    cores = m.get("cpu_count")
    return (
        f"**mpi4dask bench comm** on {m.get('hostname', '?')}: {cores} cores (os.cpu_count()), "
        f"{m.get('processes', 2)} processes shared {cores} cores; {m.get('mpi_library', '?')} "
        f"(thread level {m.get('mpi_thread_level', '?')}); distributed {m.get('distributed', '?')}; "
        f"mpi4py {m.get('mpi4py', '?')}; Python {m.get('python', '?')}"
    )


def render_comm_table(result: dict) -> str:
    """The markdown report: machine line, table, notes."""
    transports = result["config"]["transports"]
    protos = [p for p in DASK_PROTOCOLS if p in transports]
    shown = ["raw", *protos]
    by = {(r["transport"], r["size"]): r for r in result["records"]}
    sizes = sorted({r["size"] for r in result["records"]})

    header = ["size"]
    for t in shown:
        header += [f"{_TRANSPORT_LABEL[t]} us (min)", f"{_TRANSPORT_LABEL[t]} GB/s"]
    both = "mpi" in protos and "tcp" in protos
    if both:
        header.append("mpi/tcp speedup (= tcp/mpi us = mpi/tcp GB/s)")
    for p in protos:
        header.append(f"{_TRANSPORT_LABEL[p]} % of raw")
    header.append("rounds " + "/".join(t for t in shown))

    rows = []
    for s in sizes:
        row = [format_size(s)]
        for t in shown:
            r = by.get((t, s))
            if r is None:
                row += ["-", "-"]
            else:
                row += [
                    f"{_fmt_us(r['one_way_median_us'])} ({_fmt_us(r['one_way_min_us'])})",
                    _fmt_gbps(r["throughput_GBps"]),
                ]
        if both:
            m, t = by.get(("mpi", s)), by.get(("tcp", s))
            row.append(f"{t['one_way_median_us'] / m['one_way_median_us']:.2f}x" if m and t else "-")
        raw = by.get(("raw", s))
        for p in protos:
            r = by.get((p, s))
            row.append(f"{100 * raw['one_way_median_us'] / r['one_way_median_us']:.1f}%" if r and raw else "-")
        row.append("/".join(str(by[(t, s)]["iterations"]) if (t, s) in by else "-" for t in shown))
        rows.append(row)

    lines = [machine_line(result), ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [
        "",
        "One-way time = round trip / 2, median over the timed rounds (minimum in parentheses); "
        "GB/s = 10^9 bytes / median one-way time. Message: {'x': to_serialize(numpy uint8 array)} via "
        "Comm.write/Comm.read; raw MPI: mpi4py Send/Recv of the same bytes. Every point's payload was "
        "verified (full comparison before and after the timed rounds, a per-round stamp on each).",
    ]
    other = result["machine"].get("foreign_cpu_fraction_during_run")
    if other is not None:
        lines[-1] += (
            f" Other processes used {100 * other:.0f}% of the machine's CPU time during the run"
            + (" (numbers distorted)." if other > 0.05 else ".")
        )
    notes = result["config"].get("notes") or []
    if notes:
        lines[-1] += " " + " ".join(n[0].upper() + n[1:] + "." for n in notes)
    memory = memory_line(result)
    if memory:
        lines += ["", memory]
    return "\n".join(lines)


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 20):.0f}"


def memory_line(result: dict) -> str:
    """Peak RSS of both ranks during the largest point, per transport (empty without the data)."""
    recs = [r for r in result["records"] if r.get("peak_rss_bytes")]
    if not recs:
        return ""
    size = max(r["size"] for r in recs)
    by = {r["transport"]: r["peak_rss_bytes"] for r in recs if r["size"] == size}
    transports = result["config"]["transports"]
    shown = [t for t in ["raw", *[p for p in DASK_PROTOCOLS if p in transports]] if t in by]
    parts = [f"{_TRANSPORT_LABEL.get(t, t)} {_mib(by[t][0])} / {_mib(by[t][1])}" for t in shown]
    text = (
        f"**Memory:** peak RSS (MiB) of rank 0 (driver) / rank 1 (echo) during the {format_size(size)} "
        f"point: {'; '.join(parts)}"
    )
    if "mpi" in by and "tcp" in by and None not in (*by["mpi"], *by["tcp"]):
        text += f"; mpi/tcp {sum(by['mpi']) / sum(by['tcp']):.2f}x (both ranks together)"
    method = result["config"].get("peak_rss_method", "")
    if method == "vmhwm":
        text += ". Peak = VmHWM, reset (/proc/self/clear_refs) at the start of each point."
    elif method:
        text += f". Peak = {method}: the peak of the whole job so far, not of this point alone."
    return text


def plot_comm(result: dict, path: Path) -> None:
    """One-way latency and throughput against size, log-log, one line per transport."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    transports = result["config"]["transports"]
    shown = ["raw", *[p for p in DASK_PROTOCOLS if p in transports]]
    style = _c.PROTOCOL_STYLE
    fig, (ax_l, ax_t) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    sizes_all: set[int] = set()
    for t in shown:
        recs = sorted((r for r in result["records"] if r["transport"] == t), key=lambda r: r["size"])
        if not recs:
            continue
        xs = [r["size"] for r in recs]
        sizes_all.update(xs)
        color, marker, ls = style.get(t, (None, "x", "-"))
        label = _TRANSPORT_LABEL.get(t, t)
        ax_l.plot(xs, [r["one_way_median_us"] for r in recs], color=color, marker=marker, ls=ls, label=label)
        ax_t.plot(xs, [r["throughput_GBps"] for r in recs], color=color, marker=marker, ls=ls, label=label)
    ticks = sorted(sizes_all)
    for ax in (ax_l, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(s).replace(" ", "") for s in ticks])
        ax.set_xlabel("message size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_l.set_ylabel("one-way time (us, median)")
    ax_l.set_title("latency")
    ax_t.set_ylabel("throughput (GB/s)")
    ax_t.set_title("throughput")
    m = result["machine"]
    fig.suptitle(
        f"Dask comm ping-pong, 2 processes on {m.get('cpu_count')} cores; {m.get('mpi_library', '')}; "
        f"distributed {m.get('distributed', '')}, mpi4py {m.get('mpi4py', '')}",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _benchmarks() -> dict[str, Benchmark]:
    from .bench import apps, idle, report, soak

    return {
        b.name: b
        for b in (
            Benchmark(
                "comm",
                "ping-pong one numpy array between 2 MPI ranks over mpi://, tcp:// and raw MPI Send/Recv; "
                "also the peak RSS of both ranks",
                add_comm_arguments,
                run_comm,
            ),
            Benchmark(
                "transpose-sum",
                "time (x + x.T).sum() of a persisted N x N dask array on an mpi4dask.initialize() cluster per "
                "protocol and worker count, checked against NumPy",
                apps.add_transpose_arguments,
                apps.run_transpose,
            ),
            Benchmark(
                "merge",
                "time a dask.dataframe merge (tasks and p2p shuffles) per protocol and worker count, checked "
                "against pandas",
                apps.add_merge_arguments,
                apps.run_merge,
            ),
            Benchmark(
                "soak",
                "many connections between 2 ranks, both directions at once, thousands of checksummed messages; "
                "fails on any corrupted, lost, duplicated or out-of-order message",
                soak.add_soak_arguments,
                soak.run_soak,
            ),
            Benchmark(
                "idle",
                "CPU time of an idle scheduler + client + 2 workers per protocol, and the peak RSS of the "
                "64 MiB comm ping-pong",
                idle.add_idle_arguments,
                idle.run_idle,
            ),
            Benchmark(
                "all",
                "comm, transpose-sum, merge, soak (short) and idle, with one combined report",
                report.add_all_arguments,
                report.run_all,
            ),
        )
    }


BENCHMARKS: dict[str, Benchmark] = _benchmarks()


def main(argv: list[str] | None = None) -> int:
    """``python -m mpi4dask.benchmarks BENCHMARK ...`` (the same as ``mpi4dask bench BENCHMARK ...``)."""
    parser = argparse.ArgumentParser(prog="mpi4dask bench")
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
