"""``mpi4dask bench``: benchmarks of the ``mpi://`` transport against ``tcp://`` and raw MPI.

``mpi4dask bench comm`` ping-pongs a message holding one numpy ``uint8`` array between two MPI
ranks at the Dask comm level (``Comm.write`` / ``Comm.read``) over ``mpi://`` and ``tcp://``, plus raw
mpi4py ``Send``/``Recv`` of the same bytes as the limit, in one MPI job that the command launches
itself (``mpiexec -n 2 python -m mpi4dask._bench_job``).  It prints a markdown table on stdout,
progress on stderr, and with ``--output DIR`` writes ``comm.json``, ``comm.md`` and ``comm.png``.

Each benchmark is one entry in :data:`BENCHMARKS` (name, help, argument adder, runner), so
``transpose-sum``, ``merge``, ``soak`` and ``all`` can be added as further sub-commands.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# ----------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------

DEFAULT_SIZES = "1,1K,64K,1M,8M,64M"
MAX_SIZE = 1 << 30  # each rank holds a few copies of the payload
DASK_PROTOCOLS = ("mpi", "tcp")  # display order; the job runs tcp:// before mpi://
DEFAULT_TIMEOUT = 300.0
DEFAULT_TARGET_TIME = 0.3

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536.  Units are binary: K/KiB, M/MiB, G/GiB (case-insensitive), or B/none."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: expected a byte count such as 1, 512, 1K, 64K, 1M, 64M or 1G "
            "(K/M/G are binary: 1K = 1024 B)"
        )
    value = int(m.group(1)) * _UNITS[unit]
    if not 1 <= value <= MAX_SIZE:
        raise ValueError(f"invalid size {text!r}: must be between 1 B and {format_size(MAX_SIZE)}")
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


def _sizes_arg(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _protocols_arg(text: str) -> list[str]:
    names = [p.strip().lower().removesuffix("://") for p in text.split(",")]
    bad = [n for n in names if n not in DASK_PROTOCOLS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"invalid protocol(s) {', '.join(repr(b) for b in bad) or repr(text)} in {text!r}: "
            f"choose from {', '.join(DASK_PROTOCOLS)} (raw MPI is always measured)"
        )
    return [p for p in DASK_PROTOCOLS if p in names]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: must be at least 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}: expected seconds, e.g. 0.3") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}: must be positive")
    return value


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


def _default_mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec")


def add_comm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        type=_sizes_arg,
        default=parse_sizes(DEFAULT_SIZES),
        metavar="LIST",
        help=f"comma-separated message sizes, binary units: 1K = 1024 B (default: {DEFAULT_SIZES})",
    )
    p.add_argument(
        "--protocols",
        type=_protocols_arg,
        default=list(DASK_PROTOCOLS),
        metavar="LIST",
        help="Dask comm protocols to measure, from mpi,tcp (default: both; raw MPI Send/Recv is always measured)",
    )
    p.add_argument(
        "--iterations",
        type=_positive_int,
        default=None,
        metavar="N",
        help="timed round trips per point (default: adaptive, about --target-time seconds per point, "
        "at least 5)",
    )
    p.add_argument(
        "--warmup",
        type=_positive_int,
        default=None,
        metavar="N",
        help="untimed round trips before each point (default: adaptive, 2 to 200)",
    )
    p.add_argument(
        "--target-time",
        type=_positive_float,
        default=DEFAULT_TARGET_TIME,
        metavar="S",
        help=f"seconds of timed round trips per point when --iterations is not given (default: {DEFAULT_TARGET_TIME})",
    )
    p.add_argument("--output", type=Path, default=None, metavar="DIR", help="write comm.json, comm.md and comm.png here")
    p.add_argument(
        "--mpiexec",
        default=None,
        metavar="CMD",
        help="MPI launcher command, split like a shell would (default: the mpiexec next to the Python "
        "executable, else the one on PATH)",
    )
    p.add_argument("--host", default="127.0.0.1", help="host rank 0 listens on for the Dask comms (default: 127.0.0.1)")
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"give up on the MPI job after this many seconds (default: {DEFAULT_TIMEOUT:g})",
    )


# ----------------------------------------------------------------------------------------------
# Running the job
# ----------------------------------------------------------------------------------------------


class BenchFailed(Exception):
    """The benchmark could not produce results; the message says why."""


def _say(text: str) -> None:
    print(f"[bench comm] {text}", file=sys.stderr, flush=True)


def _relay(stream, tail: collections.deque) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line)
        sys.stderr.write(line)
        sys.stderr.flush()
    stream.close()


def _launch(cmd: list[str], env: dict, timeout: float) -> None:
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


def run_comm(args: argparse.Namespace) -> int:
    try:
        result = _run_comm(args)
    except BenchFailed as exc:
        print(f"mpi4dask bench comm: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(render_comm_table(result), flush=True)
    return 0


def _run_comm(args: argparse.Namespace) -> dict:
    launcher = args.mpiexec if args.mpiexec is not None else _default_mpiexec()
    if not launcher:
        raise BenchFailed("no mpiexec found next to the Python executable or on PATH; pass --mpiexec CMD")
    launcher_cmd = shlex.split(launcher)
    if not launcher_cmd:
        raise BenchFailed("--mpiexec is empty")
    exe = launcher_cmd[0]
    if shutil.which(exe) is None:
        raise BenchFailed(f"mpiexec {exe!r} (from --mpiexec or the default) is not an executable command")

    output: Path | None = args.output
    if output is not None:
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BenchFailed(f"cannot create --output directory {str(output)!r}: {exc}") from None

    load = _loadavg()
    busy = _busy_fraction()
    cores = os.cpu_count() or 1
    if busy is not None and busy > 0.25:
        _say(
            f"warning: the CPUs were {100 * busy:.0f}% busy just before starting (1-minute load average "
            f"{load:.2f} on {cores} cores); other work on the machine will distort the numbers"
        )

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
            ",".join(args.protocols),
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
        env = dict(os.environ)
        # The job must import this very mpi4dask, installed or not.
        pkg_parent = str(Path(__file__).resolve().parent.parent)
        if pkg_parent not in {os.path.realpath(p) for p in sys.path if p}:  # found through the cwd
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        _say(
            f"sizes {', '.join(format_size(s) for s in args.sizes)}; transports raw, "
            f"{', '.join(p + '://' for p in args.protocols)}; launching: {shlex.join(cmd)}"
        )
        with _ForeignLoad() as foreign:
            _launch(cmd, env, args.timeout)
        try:
            with open(result_file) as f:
                result = json.load(f)
        except (OSError, ValueError) as exc:
            raise BenchFailed(f"the MPI job exited cleanly but left no readable results ({exc})") from None

    _check_complete(result, args.sizes, ["raw", *args.protocols])
    result["config"]["command"] = shlex.join(cmd)
    result["machine"]["loadavg_1min_before"] = load
    result["machine"]["cpu_busy_fraction_before"] = busy
    other = foreign.fraction()
    result["machine"]["foreign_cpu_seconds_during_run"] = foreign.seconds
    result["machine"]["foreign_cpu_fraction_during_run"] = other
    if other is not None and other > 0.05:
        _say(
            f"warning: other processes used {foreign.seconds:.1f} CPU seconds ({100 * other:.0f}% of "
            f"{os.cpu_count()} cores) during the {foreign.wall:.0f} s run; the numbers are distorted"
        )

    if output is not None:
        (output / "comm.json").write_text(json.dumps(result, indent=2) + "\n")
        (output / "comm.md").write_text(render_comm_table(result) + "\n")
        written = [output / "comm.json", output / "comm.md"]
        try:
            plot_comm(result, output / "comm.png")
            written.append(output / "comm.png")
        except ImportError as exc:
            _say(f"warning: no plot written: matplotlib is not importable ({exc}); pip install 'mpi4dask[bench]'")
        _say(f"wrote {', '.join(str(p) for p in written)}")
    return result


def _cpu_times() -> tuple[float, float] | None:
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


def _busy_fraction(interval: float = 0.5) -> float | None:
    """Fraction of all CPU time the machine spent busy over the next ``interval`` seconds."""
    a = _cpu_times()
    time.sleep(interval)
    b = _cpu_times()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


class _ForeignLoad:
    """CPU seconds that processes other than the benchmark job used while it ran."""

    def __enter__(self):
        self.cpu0 = _cpu_times()
        self.children0 = _children_cpu()
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.wall = time.monotonic() - self.t0
        cpu1, children1 = _cpu_times(), _children_cpu()
        self.seconds = None
        if self.cpu0 is not None and cpu1 is not None and self.children0 is not None:
            # Our own process sleeps in wait(); the job's CPU time is in the reaped children's rusage.
            self.seconds = max(0.0, (cpu1[0] - self.cpu0[0]) - (children1 - self.children0))
        return False

    def fraction(self) -> float | None:
        """Foreign CPU seconds per wall-clock second per core."""
        if self.seconds is None or self.wall <= 0:
            return None
        return self.seconds / (self.wall * (os.cpu_count() or 1))


def _children_cpu() -> float | None:
    try:
        import resource
    except ImportError:  # pragma: no cover (not on Linux)
        return None
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _check_complete(result: dict, sizes: list[int], transports: list[str]) -> None:
    have = {(r["transport"], r["size"]) for r in result.get("records", [])}
    missing = [f"{t} {format_size(s)}" for t in transports for s in sizes if (t, s) not in have]
    if missing:
        raise BenchFailed(f"the MPI job's results lack {', '.join(missing)}")


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------

_TRANSPORT_LABEL = {"raw": "raw MPI", "mpi": "mpi://", "tcp": "tcp://"}


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
    return "\n".join(lines)


def plot_comm(result: dict, path: Path) -> None:
    """One-way latency and throughput against size, log-log, one line per transport."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    transports = result["config"]["transports"]
    shown = ["raw", *[p for p in DASK_PROTOCOLS if p in transports]]
    style = {"raw": ("k", "s", "--"), "mpi": ("tab:blue", "o", "-"), "tcp": ("tab:orange", "^", "-")}
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


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "comm",
            "ping-pong one numpy array between 2 MPI ranks over mpi://, tcp:// and raw MPI Send/Recv",
            add_comm_arguments,
            run_comm,
        ),
    )
}


def main(argv: list[str] | None = None) -> int:
    """``python -m mpi4dask.benchmarks comm ...`` (the same as ``mpi4dask bench comm ...``)."""
    parser = argparse.ArgumentParser(prog="mpi4dask bench")
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
