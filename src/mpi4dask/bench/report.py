"""``mpi4dask bench all``: every other benchmark, one combined report.

Runs the benchmarks of the registry (:data:`mpi4dask.bench.BENCHMARKS`, in its order: ``tasks``
first) one after the other, each with its own MPI jobs and its own files in ``--output``, with the
options of ``all`` turned into each one's arguments (each benchmark says how: its ``all_argv``),
then writes ``report.md``, ``report.json`` and ``apps.png`` (application time against worker count;
``comm.png`` has latency and throughput against message size) and prints the report: the ``tasks``
table first, then a summary of mpi:// against tcp:// over every benchmark, then each benchmark's
own report.  A benchmark that fails is reported and the others still run; the command then exits
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
        for name in report["parts"]:
            if name not in leads:
                lines += section(name)
        return "\n".join(lines)

    @staticmethod
    def failure(report: dict) -> str | None:
        return f"FAILED: {', '.join(report['failed'])}" if report["failed"] else None
