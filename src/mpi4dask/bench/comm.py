"""``mpi4dask bench comm``: ping-pong of one numpy array over ``mpi://``, ``tcp://`` and raw MPI.

One MPI job, ``mpiexec -n 2 python -m mpi4dask.bench.comm_job`` (see that module), ping-pongs a
message holding one numpy ``uint8`` array between its two ranks at the Dask comm level
(``Comm.write`` / ``Comm.read``) over each protocol, plus raw mpi4py ``Send``/``Recv`` of the same
bytes as the limit, the transports taking turns within each size, and records the peak RSS of both
ranks at each point.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from . import common as c
from .common import DEFAULT_SIZES, format_size, parse_sizes

DEFAULT_TIMEOUT = 300.0
DEFAULT_TARGET_TIME = 0.3
DEFAULT_SLICES = 4


@dataclass
class CommOptions:
    sizes: list[int] = c.option(parse_sizes(DEFAULT_SIZES), "comma-separated message sizes, binary units: 1K = "
                                "1024 B", c.sizes_arg, "LIST", all="sizes", shown=DEFAULT_SIZES)
    iterations: int | None = c.option(None, "timed round trips per point; adaptive: about --target-time seconds "
                                      "per point, at least 5", c.positive_int, "N")
    warmup: int | None = c.option(None, "untimed round trips before each point; adaptive: 2 to 200",
                                  c.positive_int, "N")
    target_time: float = c.option(DEFAULT_TARGET_TIME, "seconds of timed round trips per point when --iterations "
                                  "is not given", c.positive_float, "S")
    slices: int = c.option(DEFAULT_SLICES, "the transports take turns within each size: each point's timed "
                           "rounds in this many slices, the other transports' slices between them", c.positive_int,
                           "N")
    alone: bool = c.option(False, "each transport alone instead, one after the other (its connection closed "
                           "before the next opens): each point's peak RSS its own")
    host: str = c.option("127.0.0.1", "host rank 0 listens on for the Dask comms")
    raw_buffers: int = c.option(1, "raw MPI's echo receives into this many buffers in turn: with 2, it meets the "
                                "caches that the Dask comms' echo does (a read returns a new buffer while the "
                                "last message is still held)", c.positive_int, "N")


def add_comm_arguments(p: argparse.ArgumentParser) -> None:
    c.add_options(p, CommOptions)
    c.add_protocols_argument(p, "; raw MPI Send/Recv is always measured")
    c.add_output_argument(p, "comm.json, comm.md and comm.png")
    c.add_launch_arguments(p, DEFAULT_TIMEOUT, "the MPI job")


def collect_comm(args: argparse.Namespace) -> dict:
    """Run the comm job; return its results (and write the output files, with ``--output``)."""
    session = c.Session("comm", args, need_protocol=False)
    session.say(
        f"sizes {', '.join(format_size(s) for s in args.sizes)}; transports raw, "
        f"{', '.join(c.label(p) for p in session.protocols)}"
    )
    with session:
        job = session.run(2, "mpi4dask.bench.comm_job", {**c.option_values(CommOptions, args), "seed": c.SEED,
                                                         "protocols": session.protocols})
    _check_complete(job, args.sizes, ["raw", *session.protocols])
    result = session.result(job["machine"], job["config"], records=job["records"], loadavg=job["loadavg"],
                            job_elapsed_s=job.get("job_elapsed_s"))
    session.write(result, render_comm_table, plot_comm)
    return result


def _check_complete(result: dict, sizes: list[int], transports: list[str]) -> None:
    have = {(r["transport"], r["size"]) for r in result.get("records", [])}
    missing = [f"{t} {format_size(s)}" for t in transports for s in sizes if (t, s) not in have]
    if missing:
        raise c.BenchFailed(f"the MPI job's results lack {', '.join(missing)}")


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------


def _shown(result: dict) -> tuple[list[str], list[str]]:
    """(the Dask protocols measured, in display order; the same after raw MPI)."""
    transports = result["config"]["transports"]
    protos = [p for p in c.DASK_PROTOCOLS if p in transports]
    return protos, ["raw", *protos]


def _raw_buffers(result: dict) -> str:
    """What follows raw MPI's name in a report: the buffers its echo received into, when more than one."""
    n = result["config"].get("raw_buffers", 1)
    return "" if n == 1 else f" ({n} echo buffers)"


def render_comm_table(result: dict) -> str:
    """The markdown report: machine line, table, notes."""
    protos, shown = _shown(result)
    raw_label = c.label("raw") + _raw_buffers(result)
    by = {(r["transport"], r["size"]): r for r in result["records"]}
    sizes = sorted({r["size"] for r in result["records"]})

    header = ["size"]
    for t in shown:
        name = raw_label if t == "raw" else c.label(t)
        header += [f"{name} us (min)", f"{name} GB/s"]
    both = "mpi" in protos and "tcp" in protos
    if both:
        header.append("mpi/tcp speedup (= tcp/mpi us = mpi/tcp GB/s)")
    for p in protos:
        header.append(f"{c.label(p)} % of raw{_raw_buffers(result)}")
    shares = "mpi" in protos and any(r.get("mpi_share") is not None for r in result["records"])
    if shares:
        header.append(f"{c.label('mpi')} bytes over MPI")
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
                    f"{c.fmt_us(r['one_way_median_us'])} ({c.fmt_us(r['one_way_min_us'])})",
                    c.fmt_gbps(r["throughput_GBps"]),
                ]
        if both:
            m, t = by.get(("mpi", s)), by.get(("tcp", s))
            row.append(f"{t['one_way_median_us'] / m['one_way_median_us']:.2f}x" if m and t else "-")
        raw = by.get(("raw", s))
        for p in protos:
            r = by.get((p, s))
            row.append(f"{100 * raw['one_way_median_us'] / r['one_way_median_us']:.1f}%" if r and raw else "-")
        if shares:
            share = (by.get(("mpi", s)) or {}).get("mpi_share")
            row.append("-" if share is None else f"{100 * share:.0f}%")
        row.append("/".join(str(by[(t, s)]["iterations"]) if (t, s) in by else "-" for t in shown))
        rows.append(row)

    lines = [c.header_line("comm", result, processes=result["machine"].get("processes", 2)), ""]
    lines += c.md_table(header, rows, left=1)
    from mpi4dask._datapath import MPI_MIN_FRAME

    notes = [
        "One-way time = round trip / 2, median over the timed rounds (minimum in parentheses); "
        "GB/s = 10^9 bytes / median one-way time. Message: {'x': to_serialize(numpy uint8 array)} via "
        "Comm.write/Comm.read; raw MPI: mpi4py Send/Recv of the same bytes from the same array"
        f"{_raw_buffers_note(result)}. Every point's payload was "
        "verified (full comparison before and after the timed rounds, a per-round stamp on each). "
        "Bytes over MPI: the share of mpi://'s bytes (both ways, timed rounds) that MPI carried, the rest "
        f"the socket (frames under {c.format_size(MPI_MIN_FRAME)}, headers; every frame where MPI's copy needs "
        "both ends' calls and every core is taken).",
        *c.run_notes(result),
    ]
    lines += ["", " ".join(notes)]
    memory = memory_line(result)
    if memory:
        lines += ["", memory]
    return "\n".join(lines)


def _raw_buffers_note(result: dict) -> str:
    """The report's note on raw MPI's echo buffers, when more than one."""
    if not _raw_buffers(result):
        return ""
    n = result["config"]["raw_buffers"]
    return (f", its echo receiving into {n} buffers in turn (as the Dask comms' echo does: each read returns a "
            "new buffer while the last message is still held)")


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 20):.0f}"


def memory_line(result: dict) -> str:
    """Peak RSS of both ranks during the largest point, per transport (empty without the data)."""
    recs = [r for r in result["records"] if r.get("peak_rss_bytes")]
    if not recs:
        return ""
    size = max(r["size"] for r in recs)
    by = {r["transport"]: r["peak_rss_bytes"] for r in recs if r["size"] == size}
    shown = [t for t in _shown(result)[1] if t in by]
    parts = [f"{c.label(t)} {_mib(by[t][0])} / {_mib(by[t][1])}" for t in shown]
    text = (
        f"**Memory:** peak RSS (MiB) of rank 0 (driver) / rank 1 (echo) during the {format_size(size)} "
        f"point: {'; '.join(parts)}"
    )
    if "mpi" in by and "tcp" in by and None not in (*by["mpi"], *by["tcp"]):
        text += f"; mpi/tcp {sum(by['mpi']) / sum(by['tcp']):.2f}x (both ranks together)"
    method = result["config"].get("peak_rss_method", "")
    if method == "vmhwm":
        text += ". Peak = VmHWM, reset (/proc/self/clear_refs) at the start of each point"
        if not result["config"].get("alone", True):
            text += (" (of each slice, the highest kept; the transports took turns, so each peak also counts what"
                     " the others' connections held then: --alone measures each by itself)")
        text += "."
    elif method:
        text += f". Peak = {method}: the peak of the whole job so far, not of this point alone."
    return text


def summary_rows(result: dict) -> list[list[str]]:
    """``bench all``'s summary: the smallest and largest sizes, and the memory at the largest (measured with
    ``--alone`` only: ``bench idle`` gives it otherwise)."""
    by = {(r["transport"], r["size"]): r for r in result["records"]}
    sizes = sorted({r["size"] for r in result["records"]})
    rows = []
    for s in [sizes[0], sizes[-1]] if len(sizes) > 1 else sizes:
        m, t, raw = by.get(("mpi", s)), by.get(("tcp", s)), by.get(("raw", s))
        if m and t:
            rows.append([f"comm {format_size(s)}", "one-way us (median)", f"{m['one_way_median_us']:.1f}",
                         f"{t['one_way_median_us']:.1f}",
                         f"{t['one_way_median_us'] / m['one_way_median_us']:.2f}x speedup"])
            rows.append([f"comm {format_size(s)}", f"% of raw MPI{_raw_buffers(result)}",
                         f"{100 * raw['one_way_median_us'] / m['one_way_median_us']:.1f}%" if raw else "-",
                         f"{100 * raw['one_way_median_us'] / t['one_way_median_us']:.1f}%" if raw else "-", ""])
    if result["config"].get("alone", True):  # in turns, each peak also counts the other transports' memory
        rows += memory_rows(result)
    return rows


def memory_rows(result: dict) -> list[list[str]]:
    """The summary row of both ranks' peak RSS at the largest size, mpi:// against tcp:// (none without it)."""
    by = {(r["transport"], r["size"]): r for r in result["records"]}
    big = max((r["size"] for r in result["records"]), default=None)
    m, t = by.get(("mpi", big)), by.get(("tcp", big))
    if not (m and t and m.get("peak_rss_bytes") and t.get("peak_rss_bytes")) or None in (
        *m["peak_rss_bytes"], *t["peak_rss_bytes"]
    ):
        return []
    a, b = sum(m["peak_rss_bytes"]), sum(t["peak_rss_bytes"])
    return [[f"comm {format_size(big)}", "peak RSS, both ranks (MiB)", f"{a / 2**20:.0f}", f"{b / 2**20:.0f}",
             f"{c.ratio(a, b)} memory"]]


def plot_comm(result: dict, path: Path) -> None:
    """One-way latency and throughput against size, log-log, one line per transport."""
    plt = c.pyplot()
    shown = _shown(result)[1]
    fig, (ax_l, ax_t) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    sizes_all: set[int] = set()
    for t in shown:
        recs = sorted((r for r in result["records"] if r["transport"] == t), key=lambda r: r["size"])
        if not recs:
            continue
        xs = [r["size"] for r in recs]
        sizes_all.update(xs)
        color, marker, ls = c.PROTOCOL_STYLE.get(t, (None, "x", "-"))
        name = c.label(t)
        ax_l.plot(xs, [r["one_way_median_us"] for r in recs], color=color, marker=marker, ls=ls, label=name)
        ax_t.plot(xs, [r["throughput_GBps"] for r in recs], color=color, marker=marker, ls=ls, label=name)
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
