"""``mpi4dask stress soak``: many connections, both directions at once, every message checked.

One MPI job ``mpiexec -n 2 python -m mpi4dask.bench.soak_job`` (see that module) runs the soak
over each protocol in turn.  Reports messages/s, GB/s and the counts of corrupted, lost,
duplicated and out-of-order messages; any non-zero count (or a job that fails) exits with 1.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from . import common as c

SOAK_TIMEOUT = 1800.0


@dataclass
class SoakOptions:
    connections: int = c.option(4, "connections between the two ranks", c.positive_int, "K")
    messages: int = c.option(2000, "messages per direction per connection", c.positive_int, "N")
    max_size: int = c.option(32 << 20, "largest message (all its frames together), binary units; sizes are "
                             "log-uniform in 0 B..SIZE", c.size_arg, "SIZE", shown="32M")
    max_frames: int = c.option(8, "each message holds 1..F numpy arrays", c.positive_int, "F")
    runs: int = c.option(1, "soaks per protocol (fresh connections each); the report gives median and min",
                         c.positive_int, "N")
    seed: int = c.option(c.SEED, "seed of the sizes and the payload", int)
    read_timeout: float = c.option(60.0, "a connection silent for this long counts as stalled: its missing "
                                   "messages are lost", c.positive_float, "S")
    host: str = c.option("127.0.0.1", "host rank 0 listens on")


def add_soak_arguments(p: argparse.ArgumentParser) -> None:
    c.add_options(p, SoakOptions)
    c.add_protocols_argument(p)
    c.add_output_argument(p, "soak.json, soak.md and soak.png")
    c.add_launch_arguments(p, SOAK_TIMEOUT, "the MPI job")


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
    with session:
        job = session.run(2, "mpi4dask.bench.soak_job", {**c.option_values(SoakOptions, args), "protocols": order},
                          keep_failed=True)
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
