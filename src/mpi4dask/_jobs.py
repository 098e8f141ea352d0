"""Running child processes with a hard bound (private): shared by ``mpi4dask bench`` and the tests.

:func:`run` runs a command (an ``mpiexec`` job or plain Python) in a session of its own, relays or
collects its output, and kills its whole process tree when the time is up (hydra starts each rank
in a session of its own, so a signal to ``mpiexec`` alone may leave ranks behind); first, every Python
process of the tree prints its threads' stacks, so a hung job's output says where each one waited.
:func:`bounded` waits for a call on a daemon thread, at most so long.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: The bin directory of this Python (its ``mpiexec``, its ``mpi4dask`` script).
BIN = Path(sys.executable).parent
#: The directory that holds the ``mpi4dask`` package in use, installed or not.
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


def default_mpiexec() -> str | None:
    """The ``mpiexec`` next to this Python (the MPI wheel's), else the one on ``PATH``, else None."""
    here = BIN / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec")


def job_env(extra: dict | None = None) -> dict:
    """The environment of a job: this Python's bin first on ``PATH``, this very mpi4dask importable
    (installed or not), unbuffered Python output, Python's fault handler on (every Python process of the
    job prints its threads' stacks on a fatal signal: a crash, or :func:`dump_stacks` at the time bound),
    no inherited ``DASK_SCHEDULER_ADDRESS``; then ``extra``."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    if _PACKAGE_PARENT not in {os.path.realpath(p) for p in sys.path if p}:  # found through the cwd
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    env.update(extra or {})
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants, and reap them."""
    import psutil  # a dependency of distributed

    try:
        root = psutil.Process(pid)
        kill_all([root, *root.children(recursive=True)])  # the parent first: it cannot react to its children
    except psutil.NoSuchProcess:
        pass


def kill_all(procs: list) -> None:
    """SIGKILL these psutil processes (those already gone are skipped) and reap them."""
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _stop(proc: subprocess.Popen) -> None:
    """Kill a child and its descendants; the child itself is left for ``proc.wait()`` to reap (its exit
    status stays known)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    proc.kill()
    kill_all(descendants)


STACKS_WAIT = 2.0  # seconds a timed-out job's Python processes get to print their stacks, in all
STACK_WAIT = 0.5  # seconds each of them gets (a stopped process never prints)
RELAY_WAIT = 0.5  # seconds its launchers then get to pass the output on


def dump_stacks(pid: int) -> None:
    """Have every Python process of the tree of process ``pid`` (a job's) print its threads' stacks to its
    stderr: SIGABRT, which the fault handler (on in every job: :func:`job_env`) answers with the stacks,
    then ends the process.

    One process at a time, each ended before the next is asked (processes that share a stderr, a rank and
    those it started, would interleave their lines), the deepest first (a worker ends at once when its
    parent does).  The other processes of the tree (``mpiexec``, hydra's proxies) are stopped meanwhile
    (SIGSTOP): seeing a rank end, ``mpiexec`` would kill the others before they printed; stopped, they
    keep the pipes that the ranks write to open, and relay what is in them once continued.  No core file
    is written (the limit is set to 0 first).  The caller then kills what is left (:func:`_stop`, :func:`kill_tree`)."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    pythons, launchers = [], []
    for p in tree:
        try:
            if os.path.basename(p.exe()).startswith("python"):  # (a console script's process is Python too)
                p.rlimit(psutil.RLIMIT_CORE, (0, 0))
                pythons.append(p)
            else:
                p.suspend()
                launchers.append(p)
        except (psutil.Error, OSError):  # gone meanwhile, or not ours to look at
            pass
    deadline = time.monotonic() + STACKS_WAIT
    for p in reversed(pythons):  # (psutil lists a process's children after it)
        try:
            p.send_signal(signal.SIGABRT)
        except psutil.Error:
            continue
        until = min(deadline, time.monotonic() + STACK_WAIT)
        while _running(p) and time.monotonic() < until:
            time.sleep(0.005)
    for p in launchers:
        try:
            p.resume()
        except psutil.Error:
            pass
    if launchers:
        time.sleep(RELAY_WAIT)


def _running(p) -> bool:
    """Whether a psutil process still runs (an ended one that its parent has not reaped does not)."""
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Finished:
    """How a command ended: exit status (negative: a signal), output, whether the bound stopped it."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    elapsed: float


def _pump(stream, sink: list, echo: Callable[[str], None] | None) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        if echo is not None:
            echo(line)
    stream.close()


@contextlib.contextmanager
def terminated_as_interrupted():
    """Within: SIGTERM (``timeout``, a batch system's end of a job, ``kill``) ends this process as Ctrl-C
    does, through the ``finally`` blocks that kill the process trees of its jobs (:func:`run`); the exit
    status is 143 (128 + SIGTERM), as the shell reports a process the signal ended.  Without it, the
    signal ended this process at once, and a job started in a session of its own ran on, orphaned."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the cleanup short
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(cmd: list[str], timeout: float, *, env: dict | None = None, cwd=None,
        echo: Callable[[str], None] | None = None, merge: bool = False) -> Finished:
    """Run ``cmd`` (environment :func:`job_env` plus ``env``) for at most ``timeout`` seconds.

    Each line of output is kept and, with ``echo``, handed to it as it comes; ``merge`` puts stderr
    into stdout.  At the bound, every Python process of the tree prints its stacks (:func:`dump_stacks`:
    they are in the output), then the whole tree is killed, as on an interrupt.  An ``OSError`` (the
    command cannot start) propagates.
    """
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True, errors="replace",
                            env=job_env(env), cwd=cwd, start_new_session=True)
    out: list[str] = []
    err: list[str] = []
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, out, echo), daemon=True)]
    if not merge:
        pumps.append(threading.Thread(target=_pump, args=(proc.stderr, err, echo), daemon=True))
    timed_out = False
    try:
        for t in pumps:
            t.start()
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        dump_stacks(proc.pid)
        _stop(proc)
    finally:
        # KeyboardInterrupt, SIGTERM (terminated_as_interrupted), also while the stacks were dumped (the
        # tree stopped then): leave nothing behind
        if proc.poll() is None:
            _stop(proc)
        proc.wait()
    for t in pumps:
        if t.ident is not None:
            t.join(timeout=5)
    return Finished(proc.returncode, "".join(out), "".join(err), timed_out, time.monotonic() - start)


def bounded(seconds: float | None, call: Callable, name: str, check: Callable[[], None] | None = None,
            every: float = 1.0) -> dict:
    """``call()`` on a daemon thread of its own (a hung call must not block the interpreter's exit, as a
    ``concurrent.futures`` worker would), waited for at most ``seconds`` (None: without bound).

    Every ``every`` seconds while it runs, ``check()`` (when given) may raise to stop waiting.  Returns
    ``{"value": result}``, ``{"error": exception}``, or ``{}`` when the bound passed first (the thread is
    left to itself).
    """
    box: dict = {}

    def target():
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=target, name=name, daemon=True)
    th.start()
    end = None if seconds is None else time.monotonic() + seconds
    while th.is_alive():
        left = every if end is None else min(every, end - time.monotonic())
        if left <= 0:
            break
        th.join(left)
        if th.is_alive() and check is not None:
            check()
    return dict(box)
