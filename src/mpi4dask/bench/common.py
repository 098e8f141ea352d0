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
import collections
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from .jobutil import proc_cpu_seconds

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


def protocols_arg(text: str) -> list[str]:
    """``"tcp,mpi"`` -> ``["mpi", "tcp"]`` (display order); argparse type of ``--protocols``."""
    names = [p.strip().lower().removesuffix("://") for p in text.split(",")]
    names = ["ucx" if n == "ucxx" else n for n in names]
    bad = [n for n in names if n not in DASK_PROTOCOLS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"invalid protocol(s) {', '.join(repr(b) for b in bad) or repr(text)} in {text!r}: "
            f"choose from {', '.join(DASK_PROTOCOLS)} (ucx needs distributed_ucxx installed)"
        )
    return [p for p in DASK_PROTOCOLS if p in names]


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


class BenchFailed(Exception):
    """The benchmark could not produce results, or found a wrong result; the message says why."""


def sayer(name: str) -> Callable[[str], None]:
    def say(text: str) -> None:
        print(f"[bench {name}] {text}", file=sys.stderr, flush=True)

    return say


def _fmt_duration(s: float) -> str:
    if s >= 90:
        return f"{s / 60:.1f} min"
    return f"{s:.0f} s"


class Steps:
    """Numbered progress lines on stderr: ``[bench NAME] (2/6, 0:41 elapsed) what``."""

    def __init__(self, name: str, total: int):
        self.say = sayer(name)
        self.total = total
        self.done = 0
        self.t0 = time.monotonic()

    def start(self, what: str) -> None:
        self.done += 1
        self.say(f"({self.done}/{self.total}, {_fmt_duration(time.monotonic() - self.t0)} elapsed) {what}")


# ----------------------------------------------------------------------------------------------
# Launching MPI jobs
# ----------------------------------------------------------------------------------------------


def default_mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec")


def launcher_command(mpiexec: str | None) -> list[str]:
    """The launcher as a command list, checked; raise :class:`BenchFailed` when unusable."""
    launcher = mpiexec if mpiexec is not None else default_mpiexec()
    if not launcher:
        raise BenchFailed("no mpiexec found next to the Python executable or on PATH; pass --mpiexec CMD")
    cmd = shlex.split(launcher)
    if not cmd:
        raise BenchFailed("--mpiexec is empty")
    if shutil.which(cmd[0]) is None:
        raise BenchFailed(f"mpiexec {cmd[0]!r} (from --mpiexec or the default) is not an executable command")
    return cmd


def job_env() -> dict:
    """The jobs' environment: they must import this very mpi4dask, installed or not."""
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parent.parent.parent)
    if pkg_parent not in {os.path.realpath(p) for p in sys.path if p}:  # found through the cwd
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    return env


def make_output_dir(output: Path | None) -> None:
    if output is not None:
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BenchFailed(f"cannot create --output directory {str(output)!r}: {exc}") from None


def _relay(stream, tail: collections.deque) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line)
        sys.stderr.write(line)
        sys.stderr.flush()
    stream.close()


def launch(cmd: list[str], env: dict, timeout: float) -> None:
    """Run the MPI job, relaying its output to stderr; raise :class:`BenchFailed` on failure."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
        )
    except OSError as exc:
        raise BenchFailed(f"could not start the MPI job `{shlex.join(cmd)}`: {exc}") from None
    tail: collections.deque = collections.deque(maxlen=20)
    reader = threading.Thread(target=_relay, args=(proc.stdout, tail), daemon=True)
    reader.start()
    timed_out = False
    try:
        # The ranks' own watchdog ends them at the deadline (with their stacks); give them a moment.
        rc = proc.wait(timeout=timeout + 5)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.send_signal(signal.SIGTERM)  # mpiexec (hydra) forwards it to the ranks
        try:
            rc = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    except BaseException:  # KeyboardInterrupt: do not leave the job behind
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    reader.join(timeout=2)
    elapsed = time.monotonic() - start
    if timed_out or (rc != 0 and elapsed >= timeout):
        raise BenchFailed(
            f"the MPI job did not finish within --timeout {timeout:g} s and was stopped "
            f"(exit status {rc}); its output is above. Command: {shlex.join(cmd)}"
        )
    if rc != 0:
        raise BenchFailed(
            f"the MPI job failed with exit status {rc} after {elapsed:.1f} s; its output is above. "
            f"Command: {shlex.join(cmd)}"
        )


def read_result(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------
# Machine load
# ----------------------------------------------------------------------------------------------


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, from Linux /proc/stat; else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user time
    return (total - idle) / tick, total / tick


def busy_fraction(interval: float = 0.5) -> float | None:
    """Fraction of all CPU time the machine spent busy over the next ``interval`` seconds."""
    a = cpu_times()
    time.sleep(interval)
    b = cpu_times()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def children_cpu() -> float | None:
    try:
        import resource
    except ImportError:  # pragma: no cover (not on Linux)
        return None
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def loadavgs() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (os.getloadavg()), or None where unknown."""
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def loadavg() -> float | None:
    avgs = loadavgs()
    return avgs[0] if avgs else None


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
        if self.seconds is not None and None not in (self.cpu0, cpu1, self.children0, children1, self.ours0, ours1):
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
    load = loadavg()
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


def versions() -> dict:
    """Library versions, without importing MPI (the driver never initialises MPI)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("distributed", "dask", "mpi4py", "numpy", "pandas", "pyarrow", "mpich", "distributed-ucxx-cu13"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


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
        f"**mpi4dask bench {name}** on {m.get('hostname', '?')}: {cores} cores (os.cpu_count()){shared}; "
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
        self.say = sayer(name)
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
        backend leaves running cannot slow it."""
        return sorted(self.protocols, key=lambda p: p != "tcp")

    def run(self, n: int | None, module: str, args: list[str], keep_failed: bool = False) -> dict:
        """``mpiexec -n N python -m MODULE ARGS --deadline T --result F``; return the JSON result,
        with the 1-, 5- and 15-minute load averages before and after the job (``"loadavg"``).
        ``n`` None: no launcher (a job whose processes Dask starts: a ``LocalCluster``).

        A job that fails raises :class:`BenchFailed`, unless ``keep_failed`` and it wrote a result:
        that result is returned with ``"job_failed"`` saying how the job ended.
        """
        with tempfile.TemporaryDirectory(prefix="mpi4dask-bench-") as tmp:
            result_file = os.path.join(tmp, "result.json")
            deadline = time.time() + self.timeout
            launcher = [*self.launcher, "-n", str(n)] if n is not None else []
            cmd = [*launcher, sys.executable, "-m", module, *args,
                   "--deadline", repr(deadline), "--result", result_file]
            self.commands.append(shlex.join(cmd))
            loadavg_before = loadavgs()
            failed = None
            try:
                with self.foreign:
                    launch(cmd, job_env(), self.timeout)
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


def namespace(add_arguments: Callable[[argparse.ArgumentParser], None], argv: list[str]) -> argparse.Namespace:
    """The arguments of a benchmark as its sub-command would parse ``argv`` (for one benchmark that runs
    another)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def run_benchmark(name: str, collect: Callable[[argparse.Namespace], dict], render: Callable[[dict], str],
                  failure: Callable[[dict], str | None] | None, args: argparse.Namespace) -> int:
    """A benchmark's sub-command: collect, print the report; exit status 1 when the benchmark could not
    run or ``failure(result)`` names a failure (a wrong result), 0 otherwise."""
    try:
        result = collect(args)
    except BenchFailed as exc:
        print(f"mpi4dask bench {name}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(render(result), flush=True)
    problem = failure(result) if failure is not None else None
    if problem:
        print(f"mpi4dask bench {name}: {problem}", file=sys.stderr, flush=True)
        return 1
    return 0
