"""``mpi4dask bench soak``: many connections, both directions at once, every message checked.

One MPI job ``mpiexec -n 2 python -m mpi4dask.bench.soak_job`` (see that module) runs the soak
over each protocol in turn.  Reports messages/s, GB/s and the counts of corrupted, lost,
duplicated and out-of-order messages; any non-zero count (or a job that fails) exits with 1.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from . import common as c

SOAK_TIMEOUT = 1800.0
DEFAULT_SEED = 20240601
SOAK_ALL_MESSAGES = 250  # `bench all` runs a short soak


def add_soak_arguments(p: argparse.ArgumentParser) -> None:
    c.add_protocols_argument(p)
    p.add_argument("--connections", type=c.positive_int, default=4, metavar="K",
                   help="connections between the two ranks (default: 4)")
    p.add_argument("--messages", type=c.positive_int, default=2000, metavar="N",
                   help="messages per direction per connection (default: 2000)")
    p.add_argument("--max-size", type=c.size_arg, default=32 << 20, metavar="SIZE",
                   help="largest message (all its frames together), binary units; sizes are log-uniform "
                   "in 0 B..SIZE (default: 32M)")
    p.add_argument("--max-frames", type=c.positive_int, default=8, metavar="F",
                   help="each message holds 1..F numpy arrays (default: 8)")
    p.add_argument("--runs", type=c.positive_int, default=1, metavar="N",
                   help="soaks per protocol (fresh connections each); the report gives median and min (default: 1)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the sizes and the payload")
    p.add_argument("--read-timeout", type=c.positive_float, default=60.0, metavar="S",
                   help="a connection silent for this long counts as stalled: its missing messages are lost "
                   "(default: 60)")
    p.add_argument("--host", default="127.0.0.1", help="host rank 0 listens on (default: 127.0.0.1)")
    c.add_output_argument(p, "soak.json, soak.md and soak.png")
    c.add_launch_arguments(p, SOAK_TIMEOUT, "the MPI job")


def add_all_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--soak-messages", type=c.positive_int, default=SOAK_ALL_MESSAGES, metavar="N",
                   help=f"soak messages per direction per connection (default: {SOAK_ALL_MESSAGES}; the stand-alone "
                   "soak's default is 2000)")
    p.add_argument("--soak-max-size", type=c.size_arg, default=32 << 20, metavar="SIZE",
                   help="largest soak message (default: 32M)")


def all_argv(args: argparse.Namespace) -> list[str]:
    return ["--messages", str(args.soak_messages), "--max-size", str(args.soak_max_size)]


COUNTS = ("corrupted", "lost", "duplicated", "out_of_order")


def collect_soak(args) -> dict:
    session = c.Session("soak", args)
    say = session.say
    order = session.run_order
    mean = args.max_size / max(1e-9, math.log(args.max_size + 1)) if args.max_size > 1 else args.max_size
    volume = 2 * args.connections * args.messages * len(order) * args.runs * mean
    say(f"{args.connections} connections x 2 directions x {args.messages} messages of "
        f"0 B..{c.format_size(args.max_size)} "
        f"per protocol and run (about {volume / 1e9:.1f} GB in all, each frame hashed at both ends); "
        f"protocols {', '.join(c.label(p) for p in order)}")
    job_args = ["--protocols", ",".join(order), "--connections", str(args.connections), "--messages",
                str(args.messages), "--max-size", str(args.max_size), "--max-frames", str(args.max_frames),
                "--runs", str(args.runs), "--seed", str(args.seed), "--read-timeout", repr(args.read_timeout),
                "--host", args.host]
    with session:
        job = session.run(2, "mpi4dask.bench.soak_job", job_args, keep_failed=True)
    result = session.result(job.get("machine"), job.get("config"), records=job.get("records", []),
                            job_failed=job.get("job_failed"), loadavg=job["loadavg"])
    result["ok"] = soak_ok(result)
    session.write(result, render_soak, plot_soak)
    return result


def soak_ok(result: dict) -> bool:
    recs = result.get("records") or []
    want = {(p, r) for p in result["config"]["protocols"] for r in range(result["config"].get("runs", 1))}
    have = {(r["protocol"], r["run"]) for r in recs}
    return (
        not result.get("job_failed")
        and want <= have
        and all(r["ok"] and not any(r[k] for k in COUNTS) for r in recs)
    )


def soak_failure(result: dict) -> str | None:
    if result["ok"]:
        return None
    return ("INTEGRITY FAILURE: corrupted, lost, duplicated or out-of-order messages (or a failed job); "
            "see the table")


def _mib(values) -> str:
    return " / ".join("?" if v is None else f"{v / 2**20:.0f}" for v in values or []) or "?"


def render_soak(result: dict) -> str:
    cfg = result["config"]
    recs = sorted(result["records"], key=lambda r: ([*c.DASK_PROTOCOLS].index(r["protocol"])
                                                     if r["protocol"] in c.DASK_PROTOCOLS else 9, r["run"]))
    header = ["protocol", "run", "messages", "GB", "seconds", "messages/s", "GB/s", "peak RSS MiB (ranks)",
              "RSS 2 s after, MiB", "corrupted", "lost", "duplicated", "out of order", "integrity"]
    rows = []
    for r in recs:
        rows.append([c.label(r["protocol"]), str(r["run"] + 1), str(r["messages"]), f"{r['bytes'] / 1e9:.2f}",
                     c.fmt_s(r["elapsed_s"]), f"{r['messages_per_s']:.0f}", c.fmt_gbps(r["GBps"]),
                     _mib(r.get("peak_rss")), _mib(r.get("rss_after")),
                     *(str(r[k]) for k in COUNTS), "ok" if r["ok"] else "**FAILED**"])
    lines = [c.header_line("soak", result), ""]
    lines.append(
        f"{cfg['connections']} Dask comm connections between 2 MPI ranks (2 processes shared "
        f"{result['machine'].get('cpu_count')} cores), both directions at once; {cfg['messages']} messages per "
        f"direction per connection, sizes log-uniform in 0 B..{c.format_size(cfg['max_size'])} split into "
        f"1..{cfg['max_frames']} numpy arrays (to_serialize), seeded; SHA-256 of every frame and a sequence "
        "number checked on receipt. Times include hashing at both ends."
    )
    lines.append("")
    lines += c.md_table(header, rows, left=1)
    med = {}
    for p in {r["protocol"] for r in recs}:
        med[p] = c.summary(r["GBps"] for r in recs if r["protocol"] == p)
    extra = []
    if "mpi" in med and "tcp" in med and med["tcp"].get("median"):
        extra.append(f"mpi/tcp throughput: {med['mpi']['median'] / med['tcp']['median']:.2f}x (median GB/s over "
                     f"mpi:// / over tcp://).")
    if result.get("ok"):
        extra.append("Integrity: every message arrived once, in order, intact.")
    else:
        extra.append("**INTEGRITY FAILURE**" + (f": {result['job_failed']}" if result.get("job_failed") else "")
                     + ". First problems: " + "; ".join(d for r in recs for d in r.get("details", [])[:3])[:1500])
        missing = [p for p in cfg["protocols"] if p not in {r["protocol"] for r in recs}]
        if missing:
            extra.append(f"No results for {', '.join(c.label(p) for p in missing)}.")
    lines += ["", " ".join(extra + c.run_notes(result))]
    return "\n".join(lines)


def plot_soak(result: dict, path: Path) -> None:
    plt = c.pyplot()
    recs = result["records"]
    protos = [p for p in c.DASK_PROTOCOLS if any(r["protocol"] == p for r in recs)]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4), constrained_layout=True)
    for ax, key, ylabel in ((a1, "GBps", "GB/s"), (a2, "messages_per_s", "messages/s")):
        vals = [c.summary(r[key] for r in recs if r["protocol"] == p) for p in protos]
        colors = [c.PROTOCOL_STYLE.get(p, ("grey",))[0] for p in protos]
        ax.bar([c.label(p) for p in protos], [v.get("median", 0) for v in vals], color=colors)
        ax.set_ylabel(f"{ylabel} (median over runs)")
        ax.grid(True, axis="y", alpha=0.3)
    cfg = result["config"]
    fig.suptitle(f"soak: {cfg['connections']} connections, both directions, {cfg['messages']} msgs/direction/conn, "
                 f"0..{c.format_size(cfg['max_size'])}; integrity {'ok' if result.get('ok') else 'FAILED'}",
                 fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_rows(result: dict) -> list[list[str]]:
    """``bench all``'s summary: throughput and the integrity counts."""
    rows = []
    med = {p: c.summary(r["GBps"] for r in result["records"] if r["protocol"] == p) for p in ("mpi", "tcp")}
    if med["mpi"].get("n") and med["tcp"].get("n"):
        rows.append(["soak", "GB/s (median)", c.fmt_gbps(med["mpi"]["median"]), c.fmt_gbps(med["tcp"]["median"]),
                     f"{c.ratio(med['mpi']['median'], med['tcp']['median'])} throughput"])
    bad = {p: sum(r[k] for r in result["records"] if r["protocol"] == p for k in COUNTS) for p in ("mpi", "tcp")}
    rows.append(["soak", "corrupted + lost + duplicated + out of order", str(bad["mpi"]), str(bad["tcp"]),
                 "ok" if result.get("ok") else "**FAILED**"])
    return rows
