"""Helpers shared by the MPI jobs of ``mpi4dask bench`` (the ``mpi4dask.bench.*_job`` modules run
under ``mpiexec``; private; no MPI or Dask at import), and the progress lines they share with the
drivers (:func:`log`, :data:`STATUS`).

Every job takes ``--config FILE`` (its options, as JSON from the driver, with ``deadline``: a
watchdog ends the rank at that wall-clock time, with its Python stacks) and ``--result FILE`` (the
JSON file it writes), read by :func:`job_config`; the cluster jobs (``apps_job``, ``idle_job``,
``tasks_job``) turn the ranks into a Dask cluster with :func:`start_cluster` (rank 0 scheduler,
rank 1 the client, ranks 2.. workers with one thread each) and connect with :func:`connect_client`.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager

#: distributed's scheme of a protocol name, where they differ (distributed-ucxx registers ucxx://).
_SCHEMES = {"ucx": "ucxx"}


def scheme(protocol: str) -> str:
    return _SCHEMES.get(protocol, protocol)


class BenchmarkError(RuntimeError):
    """The benchmark found something wrong (a wrong result, a protocol violation)."""


class Doing:
    """What this rank is doing, for the watchdog's message."""

    def __init__(self, what: str = "start-up"):
        self.what = what

    def __call__(self, what: str) -> None:
        self.what = what

    def __str__(self) -> str:
        return self.what


def arm_watchdog(deadline: float | None, name: str, doing: object) -> None:
    """``doing``: anything whose ``str()`` says what the rank is doing when the time runs out."""
    if deadline is None:
        return
    remaining = max(0.1, deadline - time.time())

    def fire() -> None:
        try:
            rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
            sys.stderr.write(
                f"\nmpi4dask bench {name} job, rank {rank} (pid {os.getpid()}): time limit exceeded while "
                f"{doing}; Python stacks follow.\n"
            )
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:
            os._exit(124)

    timer = threading.Timer(remaining, fire)
    timer.daemon = True
    timer.start()
    # Backstop in case the Python thread cannot run (a C call holding the GIL).
    faulthandler.dump_traceback_later(remaining + 5, exit=True)


def quiet_distributed_logs() -> None:
    """Keep distributed's INFO chatter (and P2P's per-shuffle warnings) out of the progress display."""
    import distributed  # noqa: F401 - configures distributed's loggers first, so ours stick

    logging.getLogger("distributed").setLevel(logging.WARNING)
    for name in ("distributed.shuffle._scheduler_plugin", "distributed.shuffle._worker_plugin"):
        logging.getLogger(name).setLevel(logging.ERROR)


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def read_result(path: str) -> dict | None:
    """A job's result (:func:`write_json`), or None where it wrote none."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def versions() -> dict:
    """The Python version and those of the libraries that matter (package metadata: no import)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("distributed", "dask", "mpi4py", "numpy", "pandas", "pyarrow", "mpich", "distributed-ucxx-cu13"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def mpi_versions() -> dict:
    """:func:`versions`, and the MPI library of this (initialised) process and its thread level."""
    from mpi4py import MPI

    lib = MPI.Get_library_version()
    first = " ".join(lib.strip().splitlines()[0].split()) if lib.strip() else "unknown MPI library"
    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized",
             MPI.THREAD_MULTIPLE: "multiple"}
    return {
        **versions(),
        "mpi_library": first,
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi_thread_level": names.get(MPI.Query_thread(), str(MPI.Query_thread())),
    }


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), or None when it is gone."""
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


#: Where a run's CPU time goes, as :func:`cpu_used` splits it (and the reports' columns, in this order).
CPU_PARTS = ("worker tasks", "worker loops", "worker other", "scheduler", "client")


def _scheduler_cpu(dask_scheduler) -> float:
    """CPU seconds the scheduler's process has used."""
    return time.process_time()


def _worker_cpu(dask_worker) -> dict:
    """CPU seconds a worker's process has used (all threads, the ended ones included), and how much of it
    its task threads and its event loop's thread (this function runs on it) used (psutil: /proc, clock ticks)."""
    import psutil

    used = {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
    pool = dask_worker.executors.get("default")
    tasks = sum(used.get(t.native_id, 0.0) for t in list(getattr(pool, "_threads", ())))  # (ended: in total)
    return {"total": time.process_time(), "tasks": tasks, "loop": used[threading.get_native_id()]}


def job_cpu(client) -> dict:
    """CPU seconds used so far by a cluster job's processes (a snapshot for :func:`cpu_used`): the
    workers' (all threads), their task threads', their event loops', the scheduler's and the client's."""
    workers = client.run(_worker_cpu).values()
    return {
        "workers": sum(w["total"] for w in workers),
        "tasks": sum(w["tasks"] for w in workers),
        "loops": sum(w["loop"] for w in workers),
        "scheduler": client.run_on_scheduler(_scheduler_cpu),
        "client": time.process_time(),
    }


def cpu_used(before: dict, after: dict) -> dict:
    """The CPU seconds a cluster job's processes used between two :func:`job_cpu` snapshots, by part
    (:data:`CPU_PARTS`): the workers' task threads, the workers' event loops (where distributed runs the
    comms, the (de)serialisation of what moves up to its offload threshold and the worker's bookkeeping),
    the workers' other threads, the scheduler, the client."""
    d = {k: after[k] - before[k] for k in after}
    other = max(0.0, d["workers"] - d["tasks"] - d["loops"])  # (threads in whole clock ticks: may exceed the total)
    return dict(zip(CPU_PARTS, (d["tasks"], d["loops"], other, d["scheduler"], d["client"]), strict=True))


class _Status:
    """stderr, with at most one progress bar at its bottom, redrawn in place on a terminal."""

    def __init__(self):
        self.shown = ""

    @property
    def tty(self) -> bool:
        return sys.stderr.isatty()

    def bar(self, text: str) -> None:
        width = shutil.get_terminal_size().columns - 1
        self.shown = text[:width]
        sys.stderr.write("\r\x1b[K" + self.shown)
        sys.stderr.flush()

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            self.shown = ""

    def line(self, text: str) -> None:
        """A line above the bar (the bar is redrawn below it)."""
        shown = self.shown
        self.clear()
        sys.stderr.write(text + "\n")
        if shown:
            self.bar(shown)
        sys.stderr.flush()


STATUS = _Status()


def log(name: str, text: str) -> None:
    """A ``[bench NAME] text`` line on stderr (the drivers' and the jobs' progress)."""
    STATUS.line(f"[bench {name}] {text}")


def step(name: str, i: int, n: int, what: str) -> None:
    """Step ``i`` of ``n`` of a job (a size of comm): the driver shows it as progress."""
    log(name, f"step {i}/{n}: {what}")


def job_config(module: str, argv: list[str] | None = None):
    """A job's configuration, as attributes: the JSON of ``--config FILE`` (written by the driver from
    the benchmark's options, with ``deadline``: the wall-clock time to give up), and ``result``: the
    JSON file the job writes (``--result FILE``)."""
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m {module}")
    p.add_argument("--config", required=True, help="the JSON file of the job's configuration")
    p.add_argument("--result", required=True, help="the JSON file this job writes")
    a = p.parse_args(argv)
    with open(a.config) as f:
        return argparse.Namespace(**{"deadline": None, **json.load(f), "result": a.result})


def start_cluster(name: str, args, doing: Doing) -> int:
    """Arm the watchdog and run ``mpi4dask.initialize(protocol=args.protocol, nthreads=1)``: only rank 1
    (the client) returns, with the number of workers (the ranks beyond 0 and 1)."""
    arm_watchdog(args.deadline, name, doing)
    quiet_distributed_logs()
    import mpi4dask

    mpi4dask.initialize(protocol=scheme(args.protocol), nthreads=1)
    from .._mpi import world

    return world().size - 2


@contextmanager
def connect_client(doing: Doing, workers: int):
    """A :class:`distributed.Client` of this job's cluster, checked to have ``workers`` workers; closed
    at the end."""
    from distributed import Client

    doing("connecting the client")
    client = Client()
    try:
        have = len(client.nthreads())
        if have != workers:
            raise BenchmarkError(f"expected {workers} workers, the scheduler has {have}")
        yield client
    finally:
        doing("closing the client")
        client.close()


def cluster_label(args) -> str:
    """How a cluster job's log lines name it: ``mpi://, 2 workers``."""
    return f"{args.protocol}://, {args.workers} worker{'' if args.workers == 1 else 's'}"


def write_cluster_result(name: str, args, body: dict, problems: list[str], elapsed: float) -> None:
    """Write a cluster job's JSON result: what every one holds, then ``body``; with ``problems`` (wrong
    results) also ``"error"``, and then fail the job."""
    result = {
        "benchmark": name,
        "protocol": args.protocol,
        "workers": args.workers,
        "processes": args.workers + 2,
        "cpu_count": os.cpu_count(),
        "nthreads": 1,
        "machine": mpi_versions(),
        "config": {k: v for k, v in vars(args).items() if k not in ("result", "deadline")},
        **body,
        "elapsed_s": elapsed,
    }
    if problems:
        result["error"] = f"wrong result in {len(problems)} run(s): {problems[0]}"
    write_json(args.result, result)
    if problems:
        raise BenchmarkError(result["error"])


def two_rank_world(name: str):
    """This job's MPI world (:func:`mpi4dask._mpi.world`) when it has exactly 2 ranks; otherwise None,
    after saying why on stderr."""
    from .._mpi import MPIUnavailableError, world

    try:
        w = world()
    except MPIUnavailableError as exc:
        print(f"mpi4dask bench {name} job: {exc}", file=sys.stderr, flush=True)
        return None
    if w.size != 2:
        print(
            f"mpi4dask bench {name} job (pid {os.getpid()}): needs exactly 2 MPI ranks but this rank is "
            f"rank {w.rank} of {w.size}. A world of 1 usually means the mpiexec that launched the job "
            f"does not belong to the MPI library mpi4py uses ({w.MPI.Get_library_version().splitlines()[0].strip()}).",
            file=sys.stderr,
            flush=True,
        )
        return None
    return w


def abort_job(name: str, w, what: str) -> None:
    """In an ``except`` block: print the error and what this rank was doing, then abort the whole job."""
    import traceback

    sys.stderr.write(f"\nmpi4dask bench {name} job, rank {w.rank} (pid {os.getpid()}): failed while {what}:\n")
    traceback.print_exc()
    sys.stderr.flush()
    time.sleep(0.3)  # let the other rank's message out too
    w.comm.Abort(1)


class PeakRSS:
    """This process's peak resident set size per benchmark point."""

    def __init__(self):
        self.method = "vmhwm" if self._clear() and self._vmhwm() is not None else "ru_maxrss"
        self.peaks: dict[str, int] = {}
        self._current: str | None = None

    @staticmethod
    def _clear() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            return True
        except OSError:
            return False

    @staticmethod
    def _vmhwm() -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def peak(self) -> int | None:
        if self.method == "vmhwm":
            return self._vmhwm()
        try:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        except (ImportError, OSError):
            return None

    def start(self, transport: str, size: int) -> None:
        self.stop()
        if self.method == "vmhwm":
            self._clear()
        self._current = f"{transport}:{size}"

    def stop(self) -> None:
        if self._current is not None:  # a point measured in slices: its highest
            known = [p for p in (self.peaks.get(self._current), self.peak()) if p is not None]
            self.peaks[self._current] = max(known, default=None)
            self._current = None

    @staticmethod
    def current() -> int:
        """This process's resident set size now."""
        import psutil

        return psutil.Process().memory_info().rss
