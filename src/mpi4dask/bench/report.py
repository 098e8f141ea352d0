"""``mpi4dask bench all``: every other benchmark, one combined report.

Runs the benchmarks of the registry (:data:`mpi4dask.bench.BENCHMARKS`, in its order: ``tasks``
first) one after the other, each with its own MPI jobs and its own files in ``--output``, with the
options of ``all`` turned into each one's arguments (each benchmark says how: its ``all_argv``),
then writes ``report.md``, ``report.json`` and ``apps.png`` (application time against worker count;
``comm.png`` has latency and throughput against message size) and prints the report: the ``tasks``
table first, then a summary of mpi:// against tcp:// over every benchmark, then the transport's
performance targets checked on what was measured (:func:`target_rows`), then each benchmark's own
report.  A benchmark that fails is reported and the others still run; the command then exits
with 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

from . import apps
from . import common as c
from .anycluster import _form_workers

ALL_RUNS = 3
ALL_TIMEOUT = 600.0

# The transport's performance targets (docs/benchmarks.md, "Where each target stands"), as far as this
# command measures them (:func:`target_rows`); the comparison with the paper's own MPI4Dask comm needs
# that code's harness and is not made here.
RAW_SHARE = {8 << 20: 0.80, 64 << 20: 0.95}  # quiet ping-pong: mpi://'s one way at least this share of raw MPI's speed
LOADED_SPEEDUP = 2.0  # with --load 2 or more: mpi:// at least this much faster than tcp:// at every size
MOVING_WORKERS = 2  # the data-moving workloads, with this many workers, ...
MOVING_TIME = 0.8  # ... take at most this share of tcp://'s time
MOVING = ("gather", "transpose-sum", "merge", "set-index")  # (merge and set-index with every shuffle measured)
RATE_SPEEDUP = 2.0  # worker-to-worker transfer rate (transfer logs) over the workloads that log transfers
RATE_WORK = ("transpose-sum", "merge (tasks)", "set-index (tasks)")  # (P2P shuffles move data in RPCs: not logged)


class All:
    """``mpi4dask bench all`` over ``parts``: name -> registry entry, in the order they run."""

    def __init__(self, parts: dict):
        self.parts = parts

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        c.add_protocols_argument(p, with_ucx=True)
        p.add_argument("--runs", type=c.positive_int, default=ALL_RUNS, metavar="N",
                       help=f"timed runs per application and tasks measurement, after 1 warm-up, and form's warm "
                       f"calls (default: {ALL_RUNS}, fewer than the stand-alone commands' 5 so that `all` stays "
                       "short on 2 cores)")
        p.add_argument("--workers", type=c.int_list_arg, default=[1, 2, 4], metavar="LIST",
                       help="worker counts for tasks, transpose-sum, merge and set-index (default: 1,2,4)")
        p.add_argument("--form-workers", type=_form_workers, default=[2, 4], metavar="LIST",
                       help="form: worker counts (default: 2,4)")
        for part in self.parts.values():
            if part.options is not None:
                c.add_options(p, part.options, for_all=True)
        p.add_argument("--skip", type=c.choices_arg(self.parts, "benchmark(s)"), default=[], metavar="LIST",
                       help=f"benchmarks to leave out, from {','.join(self.parts)}")
        c.add_output_argument(p, "report.md, report.json, apps.png and every benchmark's own files")
        c.add_launch_arguments(p, ALL_TIMEOUT)

    def collect(self, args) -> dict:
        say = functools.partial(c.log, "all")
        c.launcher_command(args.mpiexec)  # fail early
        c.make_output_dir(args.output)
        protocols, notes = c.usable_protocols(args.protocols, say)
        if not protocols:
            raise c.BenchFailed("no protocol left to measure")
        parts = [part for name, part in self.parts.items() if name not in args.skip]
        steps = c.Steps("all", len(parts))
        args.protocols = protocols
        t0 = time.monotonic()
        results: dict = {}
        failed = []
        for part in parts:
            part_args = c.part_args(part.add_arguments, part.options, args, **part.for_all(args))
            steps.start(part.name)
            try:
                results[part.name] = res = part.collect(part_args)
            except c.BenchFailed as exc:
                say(f"{part.name} FAILED: {exc}")
                results[part.name] = {"benchmark": part.name, "error": str(exc)}
                failed.append(part.name)
                continue
            problem = part.failure(res) if part.failure is not None else None
            if problem:
                say(f"{part.name} FAILED: {problem}")
                failed.append(part.name)
        elapsed = time.monotonic() - t0
        config = {k: v for k, v in vars(args).items() if k not in ("func", "output", "mpiexec", "benchmark")}
        config["protocols"] = protocols
        machine = c.machine_info()
        for r in results.values():
            machine.update(
                {k: v for k, v in r.get("machine", {}).items() if k.startswith("mpi") or k in ("dask", "distributed")}
            )
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
            (args.output / "report.md").write_text(self.render(report) + "\n")
            written = [args.output / "report.json", args.output / "report.md"]
            app_results = [r for n, r in results.items() if n in apps.APPS and "error" not in r]
            if app_results:
                try:
                    apps.plot_apps(app_results, args.output / "apps.png")
                    written.append(args.output / "apps.png")
                except ImportError as exc:
                    say(f"warning: no plot written: matplotlib is not importable ({exc})")
            say(f"wrote {', '.join(str(p) for p in written)}")
        say(f"done in {elapsed / 60:.1f} min" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
        return report

    def summary_rows(self, report: dict) -> list[list[str]]:
        """| benchmark | measure | mpi:// | tcp:// | mpi vs tcp |, from every part that ran."""
        rows = []
        for name, res in report["parts"].items():
            if "error" not in res:
                rows += self.parts[name].summary_rows(res)
        return rows

    def render(self, report: dict) -> str:
        cfg = report["config"]
        lines = ["# mpi4dask bench all", "", c.header_line("all", report), ""]
        lines.append(
            f"Took {report['elapsed_s'] / 60:.1f} min. Protocols: {', '.join(c.label(p) for p in cfg['protocols'])}. "
            "Tasks and application measurements: median (min) of "
            + (f"{cfg['rounds']} rounds (protocols taking turns) x " if cfg.get("rounds", 1) > 1 else "")
            + f"{cfg['runs']} timed runs after 1 warm-up"
            + (" (the stand-alone commands default to 5)" if cfg["runs"] < 5 else "")
            + f", workers {','.join(map(str, cfg['workers']))}. "
            + " ".join(c.run_notes(report))
        )
        if report["failed"]:
            lines += ["", f"**FAILED: {', '.join(report['failed'])}** (details in their sections)."]

        def section(name: str) -> list[str]:
            res = report["parts"][name]
            body = f"**FAILED:** {res['error']}" if "error" in res else self.parts[name].render(res)
            return ["", f"## {name}", "", body]

        leads = [n for n in report["parts"] if self.parts[n].lead]
        for name in leads:
            lines += section(name)
        lines += ["", "## Summary: mpi:// against tcp://", ""]
        lines += c.md_table(["benchmark", "measure", "mpi://", "tcp://", "mpi vs tcp"], self.summary_rows(report),
                            left=2)
        lines += ["", "Speedup = tcp time / mpi time (above 1: mpi:// faster); `time`, `memory` and `CPU` ratios = "
                  "mpi / tcp (below 1: mpi:// better); throughput ratio = mpi GB/s / tcp GB/s."]
        targets = target_rows(report)
        if targets:
            lines += ["", "## Against the targets", ""]
            lines += c.md_table(["target", "measured", "held"], targets, left=2)
            lines += ["", "The transport's performance targets, each checked on this run (docs/benchmarks.md, "
                      "\"Where each target stands\"); a target this run did not measure (a size, a worker count, "
                      "`--load`) has no row.  The comparison with the paper's own MPI4Dask needs that code's "
                      "harness and is not made here."]
        for name in report["parts"]:
            if name not in leads:
                lines += section(name)
        return "\n".join(lines)

    @staticmethod
    def failure(report: dict) -> str | None:
        return f"FAILED: {', '.join(report['failed'])}" if report["failed"] else None


def _summaries(report: dict) -> dict:
    """(workload, workers) -> (kind, {protocol: its summary}), from the tasks and application parts that ran,
    each measurement whose results were all right; ``workload`` names it as the reports' rows do
    (``gather 8192x8192 (512 MiB)``, ``merge (p2p)``), ``kind`` is the tasks work or the application
    (``gather``, ``merge``)."""
    out: dict = {}
    for name, res in report["parts"].items():
        if "error" in res or name not in ("tasks", *apps.APPS):
            continue
        for s in res.get("summary", []):
            if s.get("ok") is False:
                continue
            if name == "tasks":
                work, kind = s["label"], s["work"]
            elif s.get("variant") in (None, name):
                work, kind = name, name
            else:
                work, kind = f"{name} ({s['variant']})", name
            out.setdefault((work, s["workers"]), (kind, {}))[1][s["protocol"]] = s
    return out


def target_rows(report: dict) -> list[list[str]]:
    """| target | measured | held |: each of the transport's targets (the constants above) that this run measured.
    A verdict is taken on the value shown, which has a digit more than the reports' ratios."""
    rows = []
    comm = report["parts"].get("comm", {})
    if "error" not in comm and comm.get("records"):
        by = {(r["transport"], r["size"]): r["one_way_median_us"] for r in comm["records"]}
        load = comm["config"].get("load", 0)
        if not load:
            for size, share in RAW_SHARE.items():
                raw, mpi = by.get(("raw", size)), by.get(("mpi", size))
                if raw and mpi:
                    got = round(100 * raw / mpi, 2)
                    rows.append([f"ping-pong {c.format_size(size)}: mpi:// at >= {share:.0%} of raw MPI's speed",
                                 f"{got:.2f}% (one way: mpi:// {mpi:.0f} us, raw MPI {raw:.0f} us)",
                                 _held(got >= 100 * share)])
        elif load >= 2:
            speedups = {size: round(by[("tcp", size)] / by[("mpi", size)], 3) for (t, size) in by
                        if t == "mpi" and ("tcp", size) in by}
            if speedups:
                low = min(speedups, key=speedups.get)
                rows.append([f"ping-pong with `--load {load}`: mpi:// >= {LOADED_SPEEDUP:g}x tcp:// at every size",
                             f"lowest {speedups[low]:.3f}x ({c.format_size(low)}); "
                             + ", ".join(f"{c.format_size(z)} {speedups[z]:.2f}x" for z in sorted(speedups)),
                             _held(speedups[low] >= LOADED_SPEEDUP)])
    load = report.get("config", {}).get("load", 0)
    loaded = f", `--load {load}`" if load else ""
    summaries = _summaries(report)
    ratios: dict = {}  # workers -> {workload: mpi's median time / tcp's}
    for (work, workers), (_, by_proto) in summaries.items():
        if "mpi" in by_proto and "tcp" in by_proto:
            ratios.setdefault(workers, {})[work] = round(by_proto["mpi"]["seconds"]["median"]
                                                         / by_proto["tcp"]["seconds"]["median"], 3)
    for workers in sorted(ratios):
        r = ratios[workers]
        worst = max(r, key=r.get)
        rows.append([f"no workload slower than tcp://, {workers} worker(s){loaded}",
                     f"slowest: {worst} {r[worst]:.3f}x"
                     + "".join(f"; {w} {x:.3f}x" for w, x in sorted(r.items()) if x > 1 and w != worst),
                     _held(r[worst] <= 1)])
    moving = {w: x for w, x in ratios.get(MOVING_WORKERS, {}).items()
              if summaries[(w, MOVING_WORKERS)][0] in MOVING}
    if moving:
        rows.append([f"data-moving work at <= {MOVING_TIME:g}x tcp://'s time, {MOVING_WORKERS} workers{loaded}",
                     ", ".join(f"{w} {x:.3f}x" for w, x in sorted(moving.items())),
                     _held(all(x <= MOVING_TIME for x in moving.values()))])
    rates: dict = {}  # workers -> the workloads of RATE_WORK whose transfers both protocols logged
    for (work, workers), (_, by_proto) in summaries.items():
        if work in RATE_WORK and all((by_proto.get(p) or {}).get("transfer_GBps") for p in ("mpi", "tcp")):
            rates.setdefault(workers, []).append((work, by_proto))
    for workers, works in sorted(rates.items()):
        speed = {}  # protocol -> bytes over the seconds of transfer, summed over the workloads
        for p in ("mpi", "tcp"):
            nbytes = sum(b[p]["transfer_bytes_per_run"] for _, b in works)
            seconds = sum(b[p]["transfer_bytes_per_run"] / (b[p]["transfer_GBps"] * 1e9) for _, b in works)
            speed[p] = nbytes / seconds / 1e9
        ratio = round(speed["mpi"] / speed["tcp"], 3)
        rows.append([f"transfer rate >= {RATE_SPEEDUP:g}x tcp:// ({', '.join(w for w, _ in works)}), "
                     f"{workers} worker(s){loaded}",
                     f"{ratio:.3f}x ({speed['mpi']:.3f} against {speed['tcp']:.3f} GB/s)",
                     _held(ratio >= RATE_SPEEDUP)])
    return rows


def _held(ok: bool) -> str:
    return "yes" if ok else "**no**"
