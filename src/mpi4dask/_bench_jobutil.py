"""Helpers shared by the MPI jobs of ``mpi4dask bench`` (private; no MPI or Dask at import)."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time


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


def mpi_versions() -> dict:
    """The MPI library of this (initialised) process and the library versions that matter."""
    import platform

    import dask
    import distributed
    import mpi4py
    import numpy as np
    from mpi4py import MPI

    lib = MPI.Get_library_version()
    first = " ".join(lib.strip().splitlines()[0].split()) if lib.strip() else "unknown MPI library"
    names = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    return {
        "mpi_library": first,
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi_thread_level": names.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "mpi4py": mpi4py.__version__,
        "distributed": distributed.__version__,
        "dask": dask.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), or None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        fields = text[text.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001 - psutil missing or the process is gone
        return None
