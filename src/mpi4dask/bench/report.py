"""``mpi4dask bench all``: every benchmark, one combined report.

Runs ``comm``, ``transpose-sum``, ``merge``, ``soak`` (short) and ``idle`` one after the other,
each with its own MPI jobs and its own files in ``--output``, then writes ``report.md``,
``report.json`` and ``apps.png`` (application time against worker count; ``comm.png`` has latency
and throughput against message size) and prints the report.  A benchmark that fails is reported
and the others still run; the command then exits with 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import common as c

PARTS = ("comm", "transpose-sum", "merge", "soak", "idle")
ALL_RUNS = 3
ALL_TIMEOUT = 600.0
SOAK_MESSAGES = 250


def _parts_arg(text: str) -> list[str]:
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in PARTS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"invalid benchmark(s) {', '.join(map(repr, bad))}: choose from {', '.join(PARTS)}"
        )
    return names


def add_all_arguments(p: argparse.ArgumentParser) -> None:
    c.add_protocols_argument(p)
    p.add_argument("--runs", type=c.positive_int, default=ALL_RUNS, metavar="N",
                   help=f"timed runs per application measurement, after 1 warm-up (default: {ALL_RUNS}, fewer "
                   "than the stand-alone commands' 5 so that `all` stays under ~10 minutes on 2 cores)")
    p.add_argument("--workers", type=c.int_list_arg, default=[1, 2, 4], metavar="LIST",
                   help="worker counts for transpose-sum and merge (default: 1,2,4)")
    p.add_argument("--sizes", type=c.sizes_arg, default=c.parse_sizes(c.DEFAULT_SIZES), metavar="LIST",
                   help=f"comm message sizes (default: {c.DEFAULT_SIZES})")
    p.add_argument("--n", type=c.positive_int, default=8000, help="transpose-sum array size N (default: 8000)")
    p.add_argument("--chunk", type=c.positive_int, default=1000, help="transpose-sum chunk size (default: 1000)")
    p.add_argument("--rows", type=c.positive_int, default=2_000_000, help="merge rows per frame (default: 2000000)")
    p.add_argument("--partitions", type=c.positive_int, default=8, help="merge partitions (default: 8)")
    p.add_argument("--soak-messages", type=c.positive_int, default=SOAK_MESSAGES, metavar="N",
                   help=f"soak messages per direction per connection (default: {SOAK_MESSAGES}; the stand-alone "
                   "soak's default is 2000)")
    p.add_argument("--soak-max-size", type=c.size_arg, default=32 << 20, metavar="SIZE",
                   help="largest soak message (default: 32M)")
    p.add_argument("--idle-seconds", type=c.positive_float, default=10.0, metavar="S",
                   help="idle window (default: 10)")
    p.add_argument("--skip", type=_parts_arg, default=[], metavar="LIST",
                   help=f"benchmarks to leave out, from {','.join(PARTS)}")
    c.add_output_argument(p, "report.md, report.json, apps.png and every benchmark's own files")
    c.add_launch_arguments(p, ALL_TIMEOUT)


def _namespace(add_arguments, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def _part_argv(name: str, args, protocols: list[str]) -> list[str]:
    common = ["--protocols", ",".join(protocols), "--timeout", repr(args.timeout)]
    if args.mpiexec is not None:
        common += ["--mpiexec", args.mpiexec]
    if args.output is not None:
        common += ["--output", str(args.output)]
    if name == "comm":
        return common + ["--sizes", ",".join(map(str, args.sizes))]
    if name in ("transpose-sum", "merge"):
        argv = common + ["--workers", ",".join(map(str, args.workers)), "--runs", str(args.runs)]
        if name == "transpose-sum":
            return argv + ["--n", str(args.n), "--chunk", str(args.chunk)]
        return argv + ["--rows", str(args.rows), "--partitions", str(args.partitions)]
    if name == "soak":
        return common + ["--messages", str(args.soak_messages), "--max-size", str(args.soak_max_size)]
    return common + ["--seconds", repr(args.idle_seconds), "--no-memory"]  # comm reports the memory


def _collect(name: str, argv: list[str]):
    from .. import benchmarks
    from . import apps, idle, soak

    if name == "comm":
        return benchmarks.collect_comm(_namespace(benchmarks.add_comm_arguments, argv))
    if name == "transpose-sum":
        return apps.collect_app(name, _namespace(apps.add_transpose_arguments, argv))
    if name == "merge":
        return apps.collect_app(name, _namespace(apps.add_merge_arguments, argv))
    if name == "soak":
        return soak.collect_soak(_namespace(soak.add_soak_arguments, argv))
    return idle.collect_idle(_namespace(idle.add_idle_arguments, argv))


def collect_all(args) -> dict:
    say = c.sayer("all")
    c.launcher_command(args.mpiexec)  # fail early
    c.make_output_dir(args.output)
    protocols, notes = c.usable_protocols(args.protocols, say)
    if not protocols:
        raise c.BenchFailed("no protocol left to measure")
    parts = [p for p in PARTS if p not in args.skip]
    steps = c.Steps("all", len(parts))
    t0 = time.monotonic()
    results: dict = {}
    for name in parts:
        argv = _part_argv(name, args, protocols)
        steps.start(f"{name}: mpi4dask bench {name} {' '.join(argv)}")
        try:
            results[name] = _collect(name, argv)
        except c.BenchFailed as exc:
            say(f"{name} FAILED: {exc}")
            results[name] = {"benchmark": name, "error": str(exc)}
    elapsed = time.monotonic() - t0
    config = {k: v for k, v in vars(args).items() if k not in ("func", "output", "mpiexec", "benchmark")}
    config["protocols"] = protocols
    machine = c.machine_info()
    for r in results.values():
        machine.update(
            {k: v for k, v in r.get("machine", {}).items() if k.startswith("mpi") or k in ("dask", "distributed")}
        )
    failed = [n for n, r in results.items() if "error" in r or (n == "soak" and not r.get("ok"))]
    report = {
        "benchmark": "all",
        "machine": machine,
        "config": config,
        "notes": notes,
        "elapsed_s": elapsed,
        "ok": not failed,
        "failed": failed,
        "parts": results,
    }
    if args.output is not None:
        (args.output / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.output / "report.md").write_text(render_all(report) + "\n")
        written = [args.output / "report.json", args.output / "report.md"]
        app_results = [results[n] for n in ("transpose-sum", "merge") if n in results and "error" not in results[n]]
        if app_results:
            try:
                from .apps import plot_apps

                plot_apps(app_results, args.output / "apps.png")
                written.append(args.output / "apps.png")
            except ImportError as exc:
                say(f"warning: no plot written: matplotlib is not importable ({exc})")
        say(f"wrote {', '.join(str(p) for p in written)}")
    say(f"done in {elapsed / 60:.1f} min" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return report


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def summary_rows(report: dict) -> list[list[str]]:
    """| benchmark | measure | mpi:// | tcp:// | mpi vs tcp |."""
    parts = report["parts"]
    rows = []
    comm = parts.get("comm")
    if comm and "error" not in comm:
        by = {(r["transport"], r["size"]): r for r in comm["records"]}
        sizes = sorted({r["size"] for r in comm["records"]})
        for s in [sizes[0], sizes[-1]] if len(sizes) > 1 else sizes:
            m, t, raw = by.get(("mpi", s)), by.get(("tcp", s)), by.get(("raw", s))
            if m and t:
                rows.append([f"comm {c.format_size(s)}", "one-way us (median)", f"{m['one_way_median_us']:.1f}",
                             f"{t['one_way_median_us']:.1f}",
                             f"{t['one_way_median_us'] / m['one_way_median_us']:.2f}x speedup"])
                rows.append([f"comm {c.format_size(s)}", "% of raw MPI",
                             f"{100 * raw['one_way_median_us'] / m['one_way_median_us']:.1f}%" if raw else "-",
                             f"{100 * raw['one_way_median_us'] / t['one_way_median_us']:.1f}%" if raw else "-", ""])
        big = sizes[-1] if sizes else None
        m, t = by.get(("mpi", big)), by.get(("tcp", big))
        both = m and t and m.get("peak_rss_bytes") and t.get("peak_rss_bytes")
        if both and None not in (*m["peak_rss_bytes"], *t["peak_rss_bytes"]):
            a, b = sum(m["peak_rss_bytes"]), sum(t["peak_rss_bytes"])
            rows.append([f"comm {c.format_size(big)}", "peak RSS, both ranks (MiB)", f"{a / 2**20:.0f}",
                         f"{b / 2**20:.0f}", f"{_ratio(a, b)} memory"])
    for app in ("transpose-sum", "merge"):
        res = parts.get(app)
        if not res or "error" in res:
            continue
        by = {(r["variant"], r["workers"], r["protocol"]): r for r in res["summary"]}
        variants = list(dict.fromkeys(r["variant"] for r in res["summary"]))  # tasks before p2p
        for (v, w, p), r in sorted(by.items(), key=lambda kv: (variants.index(kv[0][0]), kv[0][1])):
            if p != "mpi" or (v, w, "tcp") not in by:
                continue
            t = by[(v, w, "tcp")]
            name = app if app == "transpose-sum" else f"merge ({v})"
            rows.append([f"{name}, {w} worker(s)", "s (median)", c.fmt_s(r["seconds"]["median"]),
                         c.fmt_s(t["seconds"]["median"]),
                         f"{_ratio(r['seconds']['median'], t['seconds']['median'])} time"])
    soak = parts.get("soak")
    if soak and "error" not in soak:
        med = {p: c.summary(r["GBps"] for r in soak["records"] if r["protocol"] == p) for p in ("mpi", "tcp")}
        if med["mpi"].get("n") and med["tcp"].get("n"):
            rows.append(["soak", "GB/s (median)", c.fmt_gbps(med["mpi"]["median"]), c.fmt_gbps(med["tcp"]["median"]),
                         f"{_ratio(med['mpi']['median'], med['tcp']['median'])} throughput"])
        kinds = ("corrupted", "lost", "duplicated", "out_of_order")
        bad = {p: sum(r[k] for r in soak["records"] if r["protocol"] == p for k in kinds)
               for p in ("mpi", "tcp")}
        rows.append(["soak", "corrupted + lost + duplicated + out of order", str(bad["mpi"]), str(bad["tcp"]),
                     "ok" if soak.get("ok") else "**FAILED**"])
    idle = parts.get("idle")
    if idle and "error" not in idle:
        by = {r["protocol"]: r for r in idle["summary"]}
        if "mpi" in by and "tcp" in by:
            a, b = by["mpi"]["total_percent"]["median"], by["tcp"]["total_percent"]["median"]
            rows.append(["idle, 4 processes", "% of one core", f"{a:.2f}", f"{b:.2f}", f"{_ratio(a, b)} CPU"])
    return rows


def render_all(report: dict) -> str:
    from .. import benchmarks
    from .apps import header_line, render_app
    from .idle import render_idle
    from .soak import render_soak

    cfg = report["config"]
    lines = ["# mpi4dask bench all", "", header_line("all", report), ""]
    lines.append(
        f"Took {report['elapsed_s'] / 60:.1f} min. Protocols: {', '.join(c.label(p) for p in cfg['protocols'])}. "
        f"Application measurements: median (min) of {cfg['runs']} timed runs after 1 warm-up"
        + (" (the stand-alone commands default to 5)" if cfg["runs"] < 5 else "")
        + f", workers {','.join(map(str, cfg['workers']))}; soak: {cfg['soak_messages']} messages per direction "
        f"per connection (short; `mpi4dask bench soak` defaults to 2000)."
        + "".join(" " + n[0].upper() + n[1:] + "." for n in report.get("notes", []))
    )
    if report["failed"]:
        lines += ["", f"**FAILED: {', '.join(report['failed'])}** (details in their sections)."]
    lines += ["", "## Summary: mpi:// against tcp://", ""]
    lines += c.md_table(["benchmark", "measure", "mpi://", "tcp://", "mpi vs tcp"], summary_rows(report), left=2)
    lines += ["", "Speedup = tcp time / mpi time (above 1: mpi:// faster); `time`, `memory` and `CPU` ratios = "
              "mpi / tcp (below 1: mpi:// better); throughput ratio = mpi GB/s / tcp GB/s."]
    renderers = {"comm": benchmarks.render_comm_table, "transpose-sum": render_app, "merge": render_app,
                 "soak": render_soak, "idle": render_idle}
    for name, res in report["parts"].items():
        lines += ["", f"## {name}", ""]
        if "error" in res:
            lines.append(f"**FAILED:** {res['error']}")
        else:
            lines.append(renderers[name](res))
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> int:
    try:
        report = collect_all(args)
    except c.BenchFailed as exc:
        print(f"mpi4dask bench all: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(render_all(report), flush=True)
    if not report["ok"]:
        print(f"mpi4dask bench all: FAILED: {', '.join(report['failed'])}", file=sys.stderr, flush=True)
        return 1
    return 0
