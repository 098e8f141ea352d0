"""What every ``mpi4dask bench`` sub-command shares (private).

Sizes and argument types, the protocols to compare (``mpi``, ``tcp`` and, when
``distributed_ucxx`` is importable, ``ucx``), the options every benchmark takes (``--mpiexec``,
``--timeout``, ``--load``), and one :class:`Session` per run of a benchmark: it launches the MPI
jobs with a timeout (relaying their output to stderr) and collects their JSON results, keeps the
``--load`` background processes busy while it measures, records the machine's load, and writes
the result files.  :func:`run_benchmark` turns a benchmark's collect and render functions into its
sub-command; the rest formats reports (markdown tables, notes) and plots.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, field, fields
from pathlib import Path

import psutil

from .. import _jobs
from .jobutil import CPU_PARTS, STATUS, log, proc_cpu_seconds, read_result, versions

# ----------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------

DEFAULT_SIZES = "1,1K,64K,1M,8M,64M"
MAX_SIZE = 1 << 30  # each rank holds a few copies of the payload

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str, minimum: int = 1) -> int:
    """``"64K"`` -> 65536.  Units are binary: K/KiB, M/MiB, G/GiB (case-insensitive), or B/none."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: expected a byte count such as 1, 512, 1K, 64K, 1M, 64M or 1G "
            "(K/M/G are binary: 1K = 1024 B)"
        )
    value = int(m.group(1)) * _UNITS[unit]
    if not minimum <= value <= MAX_SIZE:
        raise ValueError(
            f"invalid size {text!r}: must be between {format_size(minimum)} and {format_size(MAX_SIZE)}"
        )
    return value


def parse_sizes(text: str) -> list[int]:
    """``"1,1K,64K"`` -> ``[1, 1024, 65536]`` (sorted, duplicates dropped)."""
    parts = [p for p in text.split(",")]
    if not text.strip() or any(not p.strip() for p in parts):
        raise ValueError(f"invalid size list {text!r}: expected comma-separated sizes such as {DEFAULT_SIZES}")
    return sorted({parse_size(p) for p in parts})


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# ----------------------------------------------------------------------------------------------
# Protocols
# ----------------------------------------------------------------------------------------------

#: Display order of the Dask protocols a benchmark can compare.
DASK_PROTOCOLS = ("mpi", "tcp", "ucx")
#: How reports name each (distributed-ucxx registers the ``ucxx://`` scheme; the jobs map ucx to it).
LABELS = {"raw": "raw MPI", "mpi": "mpi://", "tcp": "tcp://", "ucx": "ucxx://"}
DEFAULT_PROTOCOLS = ("mpi", "tcp")


def label(protocol: str) -> str:
    return LABELS.get(protocol, f"{protocol}://")


def choices_arg(choices: Iterable[str], what: str, hint: str = "", aliases: dict | None = None) -> Callable:
    """The argparse type of a comma-separated list of ``choices`` (returned in their order, duplicates
    dropped); ``aliases`` maps other spellings to choices; a bad name is named with the choices."""
    choices = tuple(choices)

    def parse(text: str) -> list[str]:
        names = [p.strip().lower() for p in text.split(",") if p.strip()]
        names = [(aliases or {}).get(n, n) for n in names]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"invalid {what} {', '.join(map(repr, bad)) or repr(text)} in {text!r}: "
                                             f"choose from {', '.join(choices)}{hint}")
        return [c for c in choices if c in names]

    return parse


#: ``"tcp,mpi"`` -> ``["mpi", "tcp"]`` (display order): the argparse type of ``--protocols``.
protocols_arg = choices_arg(DASK_PROTOCOLS, "protocol(s)", " (ucx needs distributed_ucxx installed)",
                            {"ucxx": "ucx", "ucxx://": "ucx", **{f"{p}://": p for p in DASK_PROTOCOLS}})
protocols_arg.__name__ = "protocol list"


def ucx_available() -> bool:
    try:
        return importlib.util.find_spec("distributed_ucxx") is not None
    except (ImportError, ValueError):
        return False


def usable_protocols(requested: list[str], say: Callable[[str], None]) -> tuple[list[str], list[str]]:
    """Drop ``ucx`` (with a note) when distributed_ucxx is not importable; return (usable, notes)."""
    notes = []
    usable = list(requested)
    if "ucx" in usable and not ucx_available():
        usable.remove("ucx")
        note = (
            "ucx skipped: distributed_ucxx is not importable in this Python "
            "(pip install distributed-ucxx-cu13 to compare ucxx://)"
        )
        notes.append(note)
        say(note)
    return usable, notes


# ----------------------------------------------------------------------------------------------
# Options: each benchmark declares its own once, as a dataclass of option() fields
# ----------------------------------------------------------------------------------------------

#: The seed of every benchmark's random data, unless ``--seed`` says otherwise.
SEED = 20240601


def option(default, help: str, type: Callable | None = None, metavar: str | None = None, all: str | None = None,
           shown: str | None = None, **argparse_kw):
    """A field of a benchmark's options dataclass: ``--NAME`` of its sub-command (NAME: the field's name,
    ``_`` as ``-``) with this default, type and help, the default (or ``shown``) appended to the help.
    ``all``: the option of ``bench all`` that sets it (None: ``all`` leaves it at its default)."""
    meta = {"help": help, "type": type, "metavar": metavar, "all": all, "shown": shown, "kw": argparse_kw}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _default(f):
    return f.default_factory() if f.default is MISSING else f.default


def _shown(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "adaptive" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def add_options(p: argparse.ArgumentParser, options, for_all: bool = False) -> None:
    """The options of a benchmark's sub-command from its ``options`` dataclass; ``for_all``: those that
    ``bench all`` takes for it (under their ``all`` names; one already added by another part is shared)."""
    for f in fields(options):
        m = f.metadata
        name = m["all"] if for_all else f.name
        flag = "--" + (name or "").replace("_", "-")
        if name is None or flag in p._option_string_actions:
            continue
        kw = {"type": m["type"]} if m["type"] is not None else {}
        default = _default(f)
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        p.add_argument(flag, dest=name, default=default, metavar=m["metavar"],
                       help=f"{m['help']} (default: {m['shown'] or _shown(default)})", **kw, **m["kw"])


def option_values(options, args: argparse.Namespace) -> dict:
    """The values of the fields of ``options`` in ``args``, by field name (a job's configuration)."""
    return {f.name: getattr(args, f.name) for f in fields(options)}


def part_args(add_arguments: Callable, options, all_args: argparse.Namespace, **fixed) -> argparse.Namespace:
    """The arguments of a benchmark as ``bench all`` runs it: its own defaults, the values of ``all``'s
    options for it, ``all``'s launch options, then ``fixed``."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    if options is not None:
        for f in fields(options):
            if f.metadata["all"]:
                setattr(args, f.name, getattr(all_args, f.metadata["all"]))
    for k in ("protocols", "timeout", "load", "mpiexec", "output"):
        setattr(args, k, getattr(all_args, k))
    vars(args).update(fixed)
    return args


# ----------------------------------------------------------------------------------------------
# Argument types and options shared by the sub-commands
# ----------------------------------------------------------------------------------------------


def sizes_arg(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected {expected}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: must be at least {minimum}")
    return value


def positive_int(text: str) -> int:
    return _count(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _count(text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}: expected seconds, e.g. 0.3") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}: must be positive")
    return value


def int_list_arg(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (positive, sorted, duplicates dropped)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = sorted({int(p) for p in parts})
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"invalid list {text!r}: expected comma-separated positive integers such as 1,2,4"
        )
    return values


def add_launch_arguments(p: argparse.ArgumentParser, timeout: float, what: str = "each MPI job") -> None:
    """``--mpiexec``, ``--timeout`` and ``--load``: every benchmark takes them."""
    p.add_argument(
        "--mpiexec",
        default=None,
        metavar="CMD",
        help="MPI launcher command, split like a shell would (default: the mpiexec next to the Python "
        "executable, else the one on PATH)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=timeout,
        metavar="S",
        help=f"give up on {what} after this many seconds (default: {timeout:g})",
    )
    cores = os.cpu_count() or 1
    p.add_argument(
        "--load",
        type=nonnegative_int,
        nargs="?",
        const=cores,
        default=0,
        metavar="N",
        help="run N busy background processes (pure-Python loops, one core each) while measuring, to mimic "
        f"workers computing; --load alone means one per core ({cores}) (default: 0)",
    )


def add_protocols_argument(p: argparse.ArgumentParser, extra: str = "", with_ucx: bool = False) -> None:
    """``--protocols``; ``with_ucx``: the default includes ucx when distributed_ucxx is importable."""
    default = [*DEFAULT_PROTOCOLS, *(["ucx"] if with_ucx and ucx_available() else [])]
    p.add_argument(
        "--protocols",
        type=protocols_arg,
        default=default,
        metavar="LIST",
        help="Dask comm protocols to compare, from mpi,tcp,ucx (default: mpi,tcp"
        + (", and ucx when distributed_ucxx is importable" if with_ucx else "")
        + f"; ucx needs distributed_ucxx, otherwise it is skipped with a note){extra}",
    )


def add_output_argument(p: argparse.ArgumentParser, files: str) -> None:
    p.add_argument("--output", type=Path, default=None, metavar="DIR", help=f"write {files} here")


# ----------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------


#: The benchmarks of ``mpi4dask stress`` (they measure correctness and survival, not speed).
STRESS = ("soak", "chaos")


def command(name: str) -> str:
    """The command that runs benchmark ``name``: ``mpi4dask bench comm``, ``mpi4dask stress soak``."""
    return f"mpi4dask {'stress' if name in STRESS else 'bench'} {name}"


class BenchFailed(Exception):
    """The benchmark could not produce results, or found a wrong result; the message says why."""


def _fmt_duration(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


class Steps:
    """Progress through the ``total`` steps of one benchmark on stderr: on a terminal a bar redrawn in
    place (``[bench NAME] [####------] 2/6 0:41 what``), otherwise one line per step
    (``[bench NAME] (2/6, 41 s elapsed) what``).  Jobs report their own steps (a size of comm) as
    ``[bench NAME] step I/N: what`` lines, which :func:`relay` shows the same way."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.done = name, total, 0
        self.t0 = time.monotonic()

    def start(self, what: str) -> None:
        self.done += 1
        self.show(self.done, self.total, what)

    def show(self, i: int, n: int, what: str) -> None:
        elapsed = time.monotonic() - self.t0
        if STATUS.tty:
            full = round(20 * (i - 1) / max(n, 1))
            STATUS.bar(f"[bench {self.name}] [{'#' * full}{'-' * (20 - full)}] {i}/{n} "
                       f"{int(elapsed // 60)}:{int(elapsed % 60):02d} {what}")
        else:
            log(self.name, f"({i}/{n}, {_fmt_duration(elapsed)} elapsed) {what}")


_JOB_STEP = re.compile(r"^\[bench ([\w-]+)\] step (\d+)/(\d+): (.*)$")


def relay(line: str, steps: dict) -> None:
    """A line of a job's output to stderr; its step lines (``[bench NAME] step I/N: what``) as progress."""
    m = _JOB_STEP.match(line.rstrip("\n"))
    if m is None:
        STATUS.line(line.rstrip("\n"))
        return
    name, i, n, what = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    steps.setdefault(name, Steps(name, n)).show(i, n, what)


# ----------------------------------------------------------------------------------------------
# Launching MPI jobs
# ----------------------------------------------------------------------------------------------


def launcher_command(mpiexec: str | None) -> list[str]:
    """The launcher as a command list, checked; raise :class:`BenchFailed` when unusable."""
    launcher = mpiexec if mpiexec is not None else _jobs.default_mpiexec()
    if not launcher:
        raise BenchFailed("no mpiexec found next to the Python executable or on PATH; pass --mpiexec CMD")
    cmd = shlex.split(launcher)
    if not cmd:
        raise BenchFailed("--mpiexec is empty")
    if shutil.which(cmd[0]) is None:
        raise BenchFailed(f"mpiexec {cmd[0]!r} (from --mpiexec or the default) is not an executable command")
    return cmd


def make_output_dir(output: Path | None) -> None:
    if output is not None:
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BenchFailed(f"cannot create --output directory {str(output)!r}: {exc}") from None


def launch(cmd: list[str], timeout: float) -> None:
    """Run a job, relaying its output to stderr; raise :class:`BenchFailed` on failure."""
    steps: dict = {}
    try:
        # The ranks' own watchdog ends them at the deadline (with their stacks); give them a moment.
        done = _jobs.run(cmd, timeout + 5, echo=lambda line: relay(line, steps), merge=True)
    except OSError as exc:
        raise BenchFailed(f"could not start the MPI job `{shlex.join(cmd)}`: {exc}") from None
    finally:
        STATUS.clear()
    rc = done.returncode
    if done.timed_out or (rc != 0 and done.elapsed >= timeout):
        raise BenchFailed(
            f"the MPI job did not finish within --timeout {timeout:g} s and was stopped "
            f"(exit status {rc}); its output is above. Command: {shlex.join(cmd)}"
        )
    if rc != 0:
        raise BenchFailed(
            f"the MPI job failed with exit status {rc} after {done.elapsed:.1f} s; its output is above. "
            f"Command: {shlex.join(cmd)}"
        )


# ----------------------------------------------------------------------------------------------
# Machine load
# ----------------------------------------------------------------------------------------------


def cpu_times() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (psutil)."""
    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


def busy_fraction(interval: float = 0.5) -> float:
    """Fraction of all CPU time the machine spent busy over the next ``interval`` seconds."""
    return psutil.cpu_percent(interval) / 100


def children_cpu() -> float:
    """CPU seconds of this process's reaped children."""
    t = psutil.Process().cpu_times()
    return t.children_user + t.children_system


def loadavgs() -> list[float]:
    """The 1-, 5- and 15-minute load averages."""
    return list(psutil.getloadavg())


class ForeignLoad:
    """CPU seconds that processes other than the benchmark jobs (and the ``--load`` processes, whose
    CPU seconds ``ours()`` gives) used while the jobs ran.

    Re-entrant: several jobs (one ``with`` block each) add up.
    """

    def __init__(self, ours: Callable[[], float | None] = lambda: 0.0):
        self.seconds: float | None = 0.0
        self.wall = 0.0
        self.ours = ours

    def __enter__(self):
        self.cpu0 = cpu_times()
        self.children0 = children_cpu()
        self.ours0 = self.ours()
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.wall += time.monotonic() - self.t0
        cpu1, children1, ours1 = cpu_times(), children_cpu(), self.ours()
        if self.seconds is not None and None not in (self.ours0, ours1):
            # Our own process sleeps in wait(); the job's CPU time is in the reaped children's rusage.
            busy = cpu1[0] - self.cpu0[0]
            self.seconds += max(0.0, busy - (children1 - self.children0) - (ours1 - self.ours0))
        else:
            self.seconds = None
        return False

    def fraction(self) -> float | None:
        """Foreign CPU seconds per wall-clock second per core."""
        if self.seconds is None or self.wall <= 0:
            return None
        return self.seconds / (self.wall * (os.cpu_count() or 1))


def load_before(say: Callable[[str], None]) -> dict:
    """The machine's load just before a benchmark, with a warning when it is busy."""
    load = loadavgs()[0]
    busy = busy_fraction()
    cores = os.cpu_count() or 1
    if busy is not None and busy > 0.25:
        say(
            f"warning: the CPUs were {100 * busy:.0f}% busy just before starting (1-minute load average "
            f"{load:.2f} on {cores} cores); other work on the machine will distort the numbers"
        )
    return {"loadavg_1min_before": load, "cpu_busy_fraction_before": busy}


def load_during(foreign: ForeignLoad, say: Callable[[str], None]) -> dict:
    other = foreign.fraction()
    if other is not None and other > 0.05:
        say(
            f"warning: other processes used {foreign.seconds:.1f} CPU seconds ({100 * other:.0f}% of "
            f"{os.cpu_count()} cores) during the {foreign.wall:.0f} s of MPI jobs; the numbers are distorted"
        )
    return {"foreign_cpu_seconds_during_run": foreign.seconds, "foreign_cpu_fraction_during_run": other}


def foreign_note(machine: dict) -> str:
    other = machine.get("foreign_cpu_fraction_during_run")
    if other is None:
        return ""
    return f"Other processes used {100 * other:.0f}% of the machine's CPU time during the run" + (
        " (numbers distorted)." if other > 0.05 else "."
    )


def machine_info() -> dict:
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        **versions(),
    }


# ----------------------------------------------------------------------------------------------
# Statistics and formatting
# ----------------------------------------------------------------------------------------------


def summary(values: Iterable[float]) -> dict:
    vals = list(values)
    if not vals:
        return {"n": 0}
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "mean": statistics.fmean(vals),
    }


def cpu_summary(timed: list[dict], cores: int) -> dict | None:
    """Median CPU seconds per run (the ``cpu`` of each timed run, :func:`~mpi4dask.bench.jobutil.cpu_used`),
    in all and by part, and the median share of the cores that the job's processes kept busy (CPU seconds
    / (seconds x cores)); None for results without the measurement."""
    runs = [r for r in timed if "cpu" in r]
    if not runs:
        return None
    totals = [sum(r["cpu"].values()) for r in runs]
    return {
        "total": statistics.median(totals),
        "parts": {k: statistics.median(r["cpu"].get(k, 0.0) for r in runs) for k in CPU_PARTS},
        "cores_busy": statistics.median(t / (r["seconds"] * cores) for t, r in zip(totals, runs)),
    }


def cpu_table(result: dict, lead: list[str], rows: list[tuple[list[str], str, dict]], tasks: str) -> list[str]:
    """A report's second table, where each run's CPU time went: one row per ``(lead cells, protocol,
    summary row with "seconds" and "cpu")`` (rows without the measurement are left out), headed by
    ``lead``; ``tasks`` says what the workers' task threads computed."""
    body = [
        cells + [label(p), fmt_s(r["seconds"]["median"]), fmt_s(r["cpu"]["total"]), f"{r['cpu']['cores_busy']:.0%}"]
        + [fmt_s(r["cpu"]["parts"][part]) for part in CPU_PARTS]
        for cells, p, r in rows if r.get("cpu")
    ]
    if not body:
        return []
    header = lead + ["protocol", "s", "CPU s", "cores busy"] + [f"{part} CPU s" for part in CPU_PARTS]
    note = (
        "Where the CPU time of a run went: CPU seconds (user + system) of all the job's processes from the "
        "start to the end of each timed run, median per run (each column its own median). `worker tasks`: the "
        f"workers' task threads ({tasks}: the same work whatever the protocol); `worker loops`: their "
        "event-loop threads, where distributed runs the comms (the transport itself, and the (de)serialisation "
        "of what moves, below distributed's offload threshold), the worker's state machine and `sizeof` of "
        "every result; `worker other`: the workers' other threads (offloaded (de)serialisation, P2P's comm and "
        "disk threads); `scheduler`, `client`: those processes. `cores busy` = CPU s / (s x cores), median "
        "per run: near 100% a run is bound by the cores, and a transport can shorten it by no more than the "
        "CPU time it saves."
    )
    return ["", f"**CPU per run** ({result['machine'].get('cpu_count')} cores)", ""] + md_table(
        header, body, left=len(lead) + 1) + ["", note]


def rounds_option():
    """``--rounds`` of the benchmarks that time real work (a field of their options dataclass)."""
    return option(1, "rounds of jobs: each protocol's job runs N times, the protocols taking turns (tcp, mpi, mpi, "
                  "tcp, tcp, ...: a slow spell of a noisy machine falls on both, and neither always goes first), and "
                  "each cell is the median of the timed runs of all rounds", positive_int, "N", all="rounds")


def in_rounds(session: Session, workers: list[int], rounds: int) -> Iterator[tuple[int, int, str]]:
    """The jobs of a real-work benchmark, in the order they run: ``(round, workers, protocol)``; for each
    worker count its rounds back to back, each round one job per protocol, in :attr:`Session.run_order`
    and in reverse on odd rounds (tcp, mpi, mpi, tcp, ...: neither protocol always runs first)."""
    for w in workers:
        for k in range(rounds):
            for p in session.run_order[:: -1 if k % 2 else 1]:
                yield k, w, p


def round_note(k: int, rounds: int) -> str:
    return f", round {k + 1} of {rounds}" if rounds > 1 else ""


def pool_rounds(jobs: list[dict], parts: str) -> list[dict]:
    """One job per (workers, protocol) from the jobs of every round (each marked ``"round"``): the runs of
    each of its ``parts`` (``"works"``, ``"variants"``: lists of measurements with ``"runs"``, in the same
    order in every round's job) in round order, each run marked with its round."""
    pooled: dict[tuple, dict] = {}
    for job in jobs:
        k = job.get("round", 0)
        for part in job[parts]:
            for r in part["runs"]:
                r["round"] = k
        key = (job["workers"], job["protocol"])
        if key not in pooled:
            pooled[key] = {**job, parts: [{**part, "runs": list(part["runs"])} for part in job[parts]]}
        else:
            for mine, theirs in zip(pooled[key][parts], job[parts], strict=True):
                mine["runs"] += theirs["runs"]
    return list(pooled.values())


def round_medians(runs: list[dict]) -> list[float | None]:
    """The median seconds of the timed ``runs`` of each round, by round number (None: no timed run)."""
    by: dict[int, list[float]] = {}
    for r in runs:
        if r["timed"]:
            by.setdefault(r.get("round", 0), []).append(r["seconds"])
    return [statistics.median(by[k]) if k in by else None for k in range(max(by, default=-1) + 1)]


def runs_phrase(cfg: dict, runs_key: str) -> str:
    """How many timed runs a real-work report's medians pool, for its text."""
    runs, warmup, rounds = cfg[runs_key], cfg["warmup"], cfg.get("rounds", 1)
    if rounds <= 1:
        return f"{runs} timed runs after {warmup} warm-up run(s)"
    return (f"{rounds} x {runs} timed runs ({rounds} rounds of jobs, the protocols taking turns, tcp://'s job "
            f"first in the 1st, 3rd, ... round and mpi://'s in the others, each job {warmup} warm-up run(s) first; "
            "`P/tcp by round`: the ratio of the medians of each round)")


def round_ratios(a: dict | None, b: dict | None) -> str:
    """The ratios of two summary rows' per-round medians (``"round_medians"``), round by round ("-" for a
    round that either lacks)."""
    if not a or not b:
        return "-"
    x, y = a["round_medians"], b["round_medians"]
    return ", ".join(f"{x[k] / y[k]:.2f}" if k < len(x) and k < len(y) and x[k] and y[k] else "-"
                     for k in range(max(len(x), len(y))))


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def fmt_us(x: float) -> str:
    """Microseconds: ``"1,234"``, ``"567"``, ``"8.9"``."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def fmt_gbps(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.001:
        return f"{x:.3g}"
    return f"{x:.1e}"


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``"1.23x"``, ``"-"`` when either is missing."""
    return f"{a / b:.2f}x" if a is not None and b else "-"


def time_summary_row(name: str, mpi: dict, tcp: dict) -> list[str]:
    """A row of ``bench all``'s summary comparing the median seconds of two summary records."""
    a, b = mpi["seconds"]["median"], tcp["seconds"]["median"]
    return [name, "s (median)", fmt_s(a), fmt_s(b), f"{ratio(a, b)} time"]


def md_table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join(["---"] * left + ["---:"] * (len(header) - left)) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def write_outputs(output: Path | None, name: str, result: dict, markdown: str, plot: Callable | None,
                  say: Callable[[str], None]) -> list[Path]:
    """``NAME.json``, ``NAME.md`` and (with matplotlib) ``NAME.png`` in ``output``."""
    if output is None:
        return []
    (output / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (output / f"{name}.md").write_text(markdown + "\n")
    written = [output / f"{name}.json", output / f"{name}.md"]
    if plot is not None:
        try:
            plot(result, output / f"{name}.png")
            written.append(output / f"{name}.png")
        except ImportError as exc:
            say(f"warning: no plot written: matplotlib is not importable ({exc}); pip install 'mpi4dask[bench]'")
    say(f"wrote {', '.join(str(p) for p in written)}")
    return written


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PROTOCOL_STYLE = {"raw": ("k", "s", "--"), "mpi": ("tab:blue", "o", "-"), "tcp": ("tab:orange", "^", "-"),
                  "ucx": ("tab:green", "D", "-")}




def header_line(name: str, result: dict, processes: int | None = None) -> str:
    """The first line of every report: the machine and the versions that matter."""
    m = result["machine"]
    cores = m.get("cpu_count")
    shared = f", {processes} processes shared {cores} cores" if processes else ""
    return (
        f"**{command(name)}** on {m.get('hostname', '?')}: {cores} cores (os.cpu_count()){shared}; "
        f"{m.get('mpi_library', '?')} (thread level {m.get('mpi_thread_level', '?')}); distributed "
        f"{m.get('distributed', '?')}; dask {m.get('dask', '?')}; mpi4py {m.get('mpi4py', '?')}; "
        f"Python {m.get('python', '?')}"
    )


def load_note(result: dict) -> str:
    n = result.get("config", {}).get("load") or 0
    if not n:
        return "No background load (`--load 0`)."
    return (
        f"Background load: {n} busy process{'es' if n > 1 else ''} (pure-Python loops, `--load {n}`) ran on the "
        f"{result.get('machine', {}).get('cpu_count', '?')} cores throughout the measurements."
    )


def start_note(result: dict) -> str:
    """The machine's load when the benchmark started, as a sentence."""
    m = result["machine"]
    load, busy = m.get("loadavg_1min_before"), m.get("cpu_busy_fraction_before")
    if load is None:
        return ""
    return (f"At the start the 1-minute load average was {load:.2f} on {m.get('cpu_count')} cores"
            + (f" ({100 * busy:.0f}% busy over 0.5 s)." if busy is not None else "."))


def job_loadavg_note(jobs: list[tuple[str, dict]]) -> str:
    """The 1-minute load average before and after each ``(what, job result)``, as a sentence."""
    parts = [f"{what} {la['before'][0]:.2f} → {la['after'][0]:.2f}" for what, job in jobs
             if (la := job.get("loadavg") or {}).get("before") and la.get("after")]
    if not parts:
        return ""
    return "1-minute load average (os.getloadavg()) before → after each job: " + "; ".join(parts) + "."


def run_notes(result: dict) -> list[str]:
    """The notes every report ends with: the background load, other processes' CPU use, skipped protocols."""
    notes = [load_note(result)]
    foreign = foreign_note(result.get("machine", {}))
    if foreign:
        notes.append(foreign)
    return notes + [n[0].upper() + n[1:] + "." for n in result.get("notes", [])]


# ----------------------------------------------------------------------------------------------
# Running a benchmark
# ----------------------------------------------------------------------------------------------

#: Each ``--load`` process: a pure-Python loop that ends by itself when the benchmark process dies.
_BUSY_LOOP = """\
import os
parent = os.getppid()
while os.getppid() == parent:
    sum(i * i for i in range(100_000))
"""


class BackgroundLoad:
    """``--load N``: N busy processes while a benchmark measures (a :class:`Session` starts them and
    kills them when it ends, errors included)."""

    def __init__(self, n: int, say: Callable[[str], None]):
        self.n = n
        self.say = say
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        try:
            for _ in range(self.n):
                self.procs.append(
                    subprocess.Popen([sys.executable, "-c", _BUSY_LOOP], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                )
        except OSError as exc:
            self.stop()
            raise BenchFailed(f"could not start the --load processes: {exc}") from None
        if self.procs:
            self.say(f"background load: {self.n} busy process(es) (pids {', '.join(str(p.pid) for p in self.procs)}) "
                     "until the measurements end")

    def cpu_seconds(self) -> float | None:
        """CPU seconds the load processes have used so far."""
        times = [proc_cpu_seconds(p.pid) for p in self.procs]
        return None if None in times else sum(times)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


#: Arguments that are not part of a result's configuration.
_NOT_CONFIG = ("func", "output", "mpiexec", "benchmark")


class Session:
    """One run of one benchmark.

    Creating it checks the launcher, the protocols (``--protocols``, less ucx where
    distributed_ucxx is not importable) and ``--output``, and records the machine's load; inside
    ``with`` the ``--load`` processes run; :meth:`run` launches one MPI job and returns its JSON
    result; :meth:`result` assembles what every result holds (machine, config, notes, commands)
    and :meth:`write` writes the output files.
    """

    def __init__(self, name: str, args: argparse.Namespace, need_protocol: bool = True):
        self.name = name
        self.args = args
        self.say = functools.partial(log, name)
        self.launcher = launcher_command(args.mpiexec)
        self.timeout = args.timeout
        self.protocols, self.notes = usable_protocols(args.protocols, self.say)
        if need_protocol and not self.protocols:
            raise BenchFailed("no protocol left to measure")
        make_output_dir(args.output)
        self.before = load_before(self.say)
        self.load = BackgroundLoad(args.load, self.say)
        self.foreign = ForeignLoad(self.load.cpu_seconds)
        self.commands: list[str] = []

    def __enter__(self) -> Session:
        self.load.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.load.stop()
        return False

    @property
    def run_order(self) -> list[str]:
        """The protocols in the order the jobs run them: tcp:// first, so that whatever the mpi://
        backend leaves running cannot slow it (a benchmark in rounds reverses it every other round:
        :func:`in_rounds`)."""
        return sorted(self.protocols, key=lambda p: p != "tcp")

    def run(self, n: int | None, module: str, config: dict, keep_failed: bool = False) -> dict:
        """``mpiexec -n N python -m MODULE --config C --result F``, C holding ``config`` and the deadline
        (``--timeout`` from now); return the JSON result F, with the 1-, 5- and 15-minute load averages
        before and after the job (``"loadavg"``).  ``n`` None: no launcher (a job whose processes Dask
        starts: a ``LocalCluster``).

        A job that fails raises :class:`BenchFailed`, unless ``keep_failed`` and it wrote a result:
        that result is returned with ``"job_failed"`` saying how the job ended.
        """
        with tempfile.TemporaryDirectory(prefix="mpi4dask-bench-") as tmp:
            result_file, config_file = os.path.join(tmp, "result.json"), os.path.join(tmp, "config.json")
            with open(config_file, "w") as f:
                json.dump({**config, "deadline": time.time() + self.timeout}, f)
            launcher = [*self.launcher, "-n", str(n)] if n is not None else []
            cmd = [*launcher, sys.executable, "-m", module, "--config", config_file, "--result", result_file]
            self.commands.append(shlex.join(cmd))
            loadavg_before = loadavgs()
            failed = None
            try:
                with self.foreign:
                    launch(cmd, self.timeout)
            except BenchFailed as exc:
                failed = exc
            result = read_result(result_file)
        if failed is not None:
            if result is not None and keep_failed:
                result["job_failed"] = str(failed)
            elif result and result.get("error"):
                raise BenchFailed(f"{result['error']} ({failed})") from None
            else:
                raise failed
        elif result is None:
            raise BenchFailed(f"the {'MPI ' if n is not None else ''}job exited cleanly but left no readable results. "
                              f"Command: {shlex.join(cmd)}")
        result["loadavg"] = {"before": loadavg_before, "after": loadavgs()}
        return result

    def result(self, machine: dict | None = None, config: dict | None = None, **fields) -> dict:
        """The result's common fields: ``machine`` (this machine, ``machine`` from a job, the load),
        ``config`` (the arguments, the protocols measured, and ``config`` from a job), ``notes``,
        ``commands``; then ``fields``."""
        cfg = {k: v for k, v in vars(self.args).items() if k not in _NOT_CONFIG}
        cfg["protocols"] = self.protocols
        return {
            "benchmark": self.name,
            "machine": {**machine_info(), **(machine or {}), **self.before, **load_during(self.foreign, self.say)},
            "config": {**(config or {}), **cfg},
            "notes": self.notes,
            "commands": self.commands,
            **fields,
        }

    def write(self, result: dict, render: Callable[[dict], str], plot: Callable | None) -> list[Path]:
        return write_outputs(self.args.output, self.name, result, render(result), plot, self.say)


def run_benchmark(name: str, collect: Callable[[argparse.Namespace], dict], render: Callable[[dict], str],
                  failure: Callable[[dict], str | None] | None, args: argparse.Namespace) -> int:
    """A benchmark's sub-command: collect, print the report; exit status 1 when the benchmark could not
    run or ``failure(result)`` names a failure (a wrong result), 0 otherwise."""
    try:
        result = collect(args)
    except BenchFailed as exc:
        print(f"{command(name)}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(render(result), flush=True)
    problem = failure(result) if failure is not None else None
    if problem:
        print(f"{command(name)}: {problem}", file=sys.stderr, flush=True)
        return 1
    return 0
