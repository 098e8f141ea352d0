"""Run a Dask cluster inside an MPI job.

Two ways to start one:

* :func:`initialize`, called at the top of a script run with ``mpiexec -n N python script.py``
  (N >= 3): rank 0 runs the scheduler, rank 1 goes on with the script (the client), ranks >= 2
  run workers.  The same contract as ``dask_mpi.initialize``, with a shutdown that is quiet and
  does not depend on what the interpreter still allows at exit.
* ``mpiexec -n N mpi4dask serve --scheduler-file F`` (N >= 2, see :func:`serve`): rank 0 runs the
  scheduler and writes ``F``, ranks >= 1 run workers; clients outside the job connect with
  ``Client(scheduler_file=F)`` and end the job with ``client.shutdown()`` (or SIGTERM/SIGINT to
  ``mpiexec``).

Both take a communicator (``comm=``, default ``MPI.COMM_WORLD``): the ranks named above are ranks
of that communicator, and ranks outside it take no part, so Dask can run in part of a larger MPI
program.  (The ``mpi://`` transport itself still addresses its peers by their ``MPI.COMM_WORLD``
rank; every process of a communicator is in ``MPI.COMM_WORLD``.)

Workers always run in the rank's own process (never under a Nanny): a process forked by a rank
inherits the rank's launcher environment (``PMI_*`` ...) and cannot be that MPI rank.

Coordination between ranks (the scheduler's address, "all workers are registered", "the client
is done") goes through MPI itself, on a private duplicate of the launcher's communicator, in the
steps listed in the section "cross-rank steps" below.  Ranks that run an event loop never block
in MPI: they post non-blocking collectives and test them from the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import hashlib
import json
import logging
import numbers
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from array import array
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds before the first test of a pending cross-rank step; each wait doubles it from there.
FIRST_POLL_INTERVAL = 0.001
#: Longest wait between two tests of a pending cross-rank step (startup, shutdown).
POLL_INTERVAL = 0.02
#: Longest wait between two tests of the "client is done" barrier while the cluster runs: the
#: bound on how late a rank notices that the job ends, and what an idle rank pays to notice it.
IDLE_POLL_INTERVAL = 0.25
#: Seconds a rank may take to start its scheduler or worker (and register it) before the job aborts.
STARTUP_TIMEOUT = 120.0
#: Seconds a worker waits for the scheduler to close it, once the job is ending, before closing itself.
CLOSE_GRACE = 20.0
#: Seconds the ranks of a finished job wait for each other before aborting the job.
FINISH_TIMEOUT = 60.0
#: Seconds a rank lets mpiexec forward what it printed before it aborts the job (an abort kills the
#: forwarding too, and a traceback still in the pipe would be lost).
ABORT_DELAY = 0.3

# Roles, as ranks of the launcher's communicator.
_SCHEDULER_RANK = 0
_CLIENT_RANK = 1


class _ClientState:
    """What the client rank needs to end the job (see :func:`shutdown`)."""

    def __init__(self, ctl):
        self.ctl = ctl
        self.lock = threading.Lock()
        self.done = False


_state: _ClientState | None = None
_initialized = False


# --------------------------------------------------------------------------------------------
# argument checks: local and deterministic, so every rank raises the same error before any MPI
# collective, and the job ends with that error instead of hanging


def _check_protocol(protocol: str) -> str:
    """Normalise ``protocol`` ("mpi", "mpi://" -> "mpi") and check that distributed knows it."""
    from distributed.comm.registry import get_backend

    if not isinstance(protocol, str) or not protocol.strip():
        raise ValueError(f"protocol must be a name such as 'mpi' or 'tcp', not {protocol!r}")
    name = protocol.strip()
    if name.endswith("://"):
        name = name[:-3]
    if name == "inproc":
        raise ValueError(
            "protocol 'inproc' only connects objects inside one process; the ranks of an MPI job are "
            "separate processes: use protocol='mpi' or 'tcp'"
        )
    try:
        get_backend(name)
    except ValueError:
        known = _known_backends()
        if name in known:
            raise  # the backend exists and failed to load (a bad setting of its own): its own message
        raise ValueError(
            f"unknown protocol {protocol!r}: distributed has no comm backend of that name (it knows "
            f"{', '.join(known)}); use 'mpi' (mpi4dask's transport) or 'tcp'"
        ) from None
    return name


def _known_backends() -> list[str]:
    """The comm backends distributed knows: loaded, or entry points it would load (mpi4dask's among them)."""
    from importlib.metadata import entry_points

    from distributed.comm.registry import backends

    return sorted(set(backends) | {ep.name for ep in entry_points(group="distributed.comm.backends")})


def _worker_class(worker_class) -> type:
    from distributed import Nanny, Worker
    from distributed.utils import import_term

    if worker_class is None:
        return Worker
    cls = import_term(worker_class) if isinstance(worker_class, str) else worker_class
    if isinstance(cls, type) and issubclass(cls, Nanny):
        raise ValueError(
            f"worker_class={worker_class!r} is a Nanny: a process forked by an MPI rank inherits the "
            "rank's launcher environment and cannot be an MPI rank. mpi4dask runs workers in the rank's "
            "own process; pass a distributed.Worker subclass (or None)"
        )
    return cls


def _check_scheduler_file(path) -> None:
    """The scheduler file must be a path (every rank, before MPI starts); where it goes is checked by the
    rank that writes it (:func:`_scheduler_file_problem`, in :func:`_step_refuse_local_problems`)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ValueError(f"scheduler file {path!r} is not a path: give the file the scheduler writes its "
                         "address to, e.g. --scheduler-file scheduler.json")


def _check_interface(interface) -> str | None:
    """Return ``interface``: None (also for an empty name, as distributed reads it) or a name (every
    rank, before MPI starts); whether this host has it is checked once MPI runs
    (:func:`_interface_problem`), as hosts differ."""
    if interface is None or isinstance(interface, str) and not interface.strip():
        return None
    if not isinstance(interface, str):
        raise TypeError(f"interface={interface!r} is not the name of a network interface: pass one such as "
                        "'ib0' or 'eth0', or None for the default")
    return interface


def _scheduler_file_problem(path) -> str | None:
    """What keeps the scheduler's rank from creating the scheduler file (its directory does not exist
    there), or None.  Only that rank looks: in a job over several nodes the others may not see its
    directory (a node-local one)."""
    where = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(where):
        return (f"scheduler file {str(path)!r}: its directory {where} does not exist; create it, or give "
                "a path in an existing directory (one that the clients can read)")
    return None


def _interface_problem(interface: str | None) -> str | None:
    """What keeps this rank's scheduler or worker from listening on ``interface`` (this host has no such
    interface, or it has no IPv4 address), or None: distributed's own check, with the host named."""
    if interface is None:
        return None
    import socket

    from distributed.utils import get_ip_interface

    try:
        get_ip_interface(interface)
    except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must reach the collective with it
        why = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        return (f"network interface {interface!r} on host {socket.gethostname()}: {why}; pass an interface "
                "that every host of the job has (with an IPv4 address), or none for distributed's default")
    return None


def _check_nthreads(nthreads, name: str = "nthreads=") -> int:
    """Return ``nthreads`` (threads per worker) as an int: a whole number >= 1, else TypeError or ValueError.

    ``name`` prefixes the value in the message: ``"nthreads="`` for Python callers, ``"--nthreads "``
    for the command line.
    """
    problem = f"{name}{nthreads!r} is not a number of threads per worker: pass a whole number >= 1 (e.g. {name}1)"
    if not isinstance(nthreads, numbers.Integral) or isinstance(nthreads, bool):
        raise TypeError(problem)
    if nthreads < 1:
        raise ValueError(problem)
    return int(nthreads)


# parse_memory_limit warns about limits above the node's memory; the workers give that warning
# themselves, and the check on every rank must not repeat it: this logger drops it.
_SILENT = logging.getLogger("mpi4dask.launcher.memory-limit-check")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False


def _check_memory_limit(memory_limit, name: str = "memory_limit="):
    """Check a per-worker memory limit as :class:`distributed.Worker` reads it; return it unchanged.

    Accepted: ``None`` or ``0`` (no limit), ``"auto"``, a positive whole number of bytes (an int, a
    float or a string such as ``"4GiB"`` or ``"4e9"``), or a fraction ``0 < f <= 1`` of the node's
    memory.  Anything else raises TypeError (not a number or string) or ValueError, naming the value
    (``name`` prefixes it, as in :func:`_check_nthreads`): distributed would accept some of it and
    fail later, on the workers (``"lots"``, ``[1]``) or in every task (a negative limit).
    """
    from distributed.worker_memory import parse_memory_limit

    if memory_limit is None or memory_limit == "auto":
        return memory_limit
    fix = (
        "pass a number of bytes (e.g. 4e9 or '4GiB'), a fraction 0 < f <= 1 of the node's memory, "
        "'auto' (the node's memory shared among its workers), or None or 0 for no limit"
    )
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (numbers.Real, str)):
        raise TypeError(f"{name}{memory_limit!r} is not a memory size: {fix}")
    try:
        number = float(memory_limit)  # as distributed reads it: numbers and numeric strings
    except ValueError:
        number = None  # a size with a unit, e.g. "4GiB"
    if number is not None and number > 1 and not number.is_integer():
        raise ValueError(
            f"{name}{memory_limit!r} is neither a fraction (0 < f <= 1) nor a whole number of bytes: {fix}"
        )
    try:
        nbytes = parse_memory_limit(memory_limit, 1, 1, logger=_SILENT)
    except (ValueError, TypeError, OverflowError):
        raise ValueError(f"{name}{memory_limit!r} is not a memory size: {fix}") from None
    if nbytes is not None and nbytes < 0:
        raise ValueError(f"{name}{memory_limit!r} is negative: {fix}")
    return memory_limit


# The launch lines that _check_comm's error shows when a job has too few ranks.  Named here, not spelled
# out at the calls: Python 3.13's tracebacks print the whole failing statement, and a launch line for
# mpiexec there misleads a job that srun started without a PMI (its error names `srun --mpi=pmi2`).
_INITIALIZE_EXAMPLE = "`mpiexec -n 4 python script.py`"
_SERVE_EXAMPLE = "`mpiexec -n 4 mpi4dask serve --scheduler-file {}`"


def _check_comm(comm, least: int, call: str, roles: str, example: str):
    """Return the launcher's communicator: ``comm`` once checked, or ``MPI.COMM_WORLD`` for None.

    ``comm`` must be an mpi4py intracommunicator of at least ``least`` ranks that this rank belongs
    to.  ``call`` (the function checked, e.g. ``"initialize()"``), ``roles`` (what the ranks run)
    and ``example`` (a command line) word the messages.  Call it after :func:`mpi4dask._mpi.world`
    (MPI is initialised by then).
    """
    from mpi4py import MPI

    from ._mpi import srun_without_pmi

    if comm is None:
        comm = MPI.COMM_WORLD
    elif not isinstance(comm, MPI.Comm):
        raise TypeError(
            f"comm={comm!r} is not an MPI communicator: pass an mpi4py intracommunicator, e.g. "
            "MPI.COMM_WORLD.Split(color), or None for MPI.COMM_WORLD"
        )
    elif comm == MPI.COMM_NULL:
        raise ValueError(
            f"comm is MPI.COMM_NULL, so this rank is not part of it: call {call} only on the ranks of "
            "the communicator (the ones that did not pass MPI.UNDEFINED to Split)"
        )
    elif comm.Is_inter():
        raise TypeError(
            f"comm={comm!r} is an intercommunicator: pass an intracommunicator (e.g. the one "
            "comm.Merge() makes of it)"
        )
    size = comm.Get_size()
    if size < least:
        if size == MPI.COMM_WORLD.Get_size():
            fix = srun_without_pmi(size) or (
                f"this job has {size}: run it with `mpiexec -n {least}` or more (e.g. {example})"
            )
        else:
            fix = f"the communicator passed as comm= has {size}: pass one of {least} ranks or more"
        raise ValueError(f"{call} needs at least {least} MPI ranks ({roles}), but {fix}")
    return comm


# --------------------------------------------------------------------------------------------
# helpers


# distributed's periodic housekeeping, which wakes every idle process many times a second: the
# event-loop tick (20 ms; it only feeds the "event loop was unresponsive for N s" warning, limit 3 s)
# and the workers' statistical profiler (a sample every 10 ms).  Together they cost an idle cluster
# of a scheduler and 2 workers ~7% of a core on this project's VM; at these values, ~2.7%.
LEAN_HOUSEKEEPING = {
    "distributed.admin.tick.interval": ("20ms", "1s"),
    "distributed.worker.profile.interval": ("10ms", "100ms"),
}


def _lean_housekeeping() -> dict:
    """Slow distributed's housekeeping timers down, where the configuration still has their defaults."""
    import dask
    from dask.utils import parse_timedelta

    changes = {}
    for key, (default, lean) in LEAN_HOUSEKEEPING.items():
        current = dask.config.get(key, default=None)
        if current is not None and parse_timedelta(current) == parse_timedelta(default):
            changes[key] = lean
    if changes:
        dask.config.set(changes)
    return changes


def _auto_memory_limit(workers_on_node: int) -> int:
    """``memory_limit="auto"`` for a worker that shares its node with ``workers_on_node - 1`` others of
    the job: an even share of the node's memory as distributed measures it (physical memory, capped
    by the cgroup's limit and ``RLIMIT_RSS``: ``distributed.system.MEMORY_LIMIT``)."""
    from distributed.system import MEMORY_LIMIT

    return MEMORY_LIMIT // workers_on_node


_saved_levels: dict[str, int] | None = None


def _quiet_distributed_logs() -> None:
    """Silence distributed's (and tornado's) loggers: the job is ending, broken-stream reports are expected."""
    global _saved_levels
    names = ["distributed", "tornado", "asyncio"]
    names += [
        name
        for name, obj in list(logging.root.manager.loggerDict.items())
        if isinstance(obj, logging.Logger) and name.startswith(("distributed.", "tornado."))
    ]
    saved = {}
    for name in names:
        lg = logging.getLogger(name)
        saved[name] = lg.level
        lg.setLevel(logging.CRITICAL + 1)
    if _saved_levels is None:
        _saved_levels = saved


def _restore_logs() -> None:
    """Undo :func:`_quiet_distributed_logs` (for ranks that go on running code, ``exit=False``)."""
    global _saved_levels
    if _saved_levels is not None:
        for name, level in _saved_levels.items():
            logging.getLogger(name).setLevel(level)
        _saved_levels = None


def _world_rank():
    """This process's rank in ``MPI.COMM_WORLD`` (what mpiexec and MPI_Abort report), or "?"."""
    from ._mpi import initialized_world

    w = initialized_world()
    return w.rank if w is not None else "?"


def _say(line: str) -> None:
    """Write one line to stderr in a single write call.

    ``print`` to stderr writes the text and its newline separately (stderr is write-through), so the
    lines of several ranks that mpiexec merges into one stream could run together.
    """
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _abort(msg: str | None = None, exc: BaseException | None = None, code: int = 1) -> None:
    """Print what went wrong and end the whole MPI job (every rank) with a non-zero status."""
    from ._mpi import initialized_world

    if _goodbye is not None:
        _goodbye()  # this rank ends the job on purpose: it did not die
    try:
        if exc is not None:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        if msg:
            _say(f"mpi4dask: {msg}")
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(ABORT_DELAY)
    finally:
        w = initialized_world()
        if w is not None:
            w.comm.Abort(code)
        os._exit(code)


def _run_rank(main, role: str):
    """Run ``main()`` (an event loop); any failure prints its traceback and aborts the whole job."""
    try:
        return asyncio.run(main())
    except BaseException as exc:  # noqa: BLE001 - a rank that fails must not leave the others hanging
        _abort(
            f"the {role} on MPI rank {_world_rank()} failed ({type(exc).__name__}: {exc}); aborting the job", exc
        )


# --------------------------------------------------------------------------------------------
# waiting for a cross-rank step


def _backoff(req, what: str, timeout: float | None = None, longest: float = POLL_INTERVAL):
    """Pace every wait for a cross-rank step: yield how long to sleep before testing ``req`` again.

    The sleeps start at :data:`FIRST_POLL_INTERVAL` and double up to ``longest`` seconds, so a step
    that completes at once costs a millisecond and a long wait costs one test per ``longest``
    seconds instead of a spinning core (MPICH's ``MPI_Wait`` busy-polls).  The generator ends when
    ``req`` has completed and raises :class:`TimeoutError` (naming ``what``) once ``timeout``
    seconds have passed.
    """
    from ._mpi import delays

    deadline = None if timeout is None else time.monotonic() + timeout
    for delay in delays(FIRST_POLL_INTERVAL, longest):
        if req.Test():
            return
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        yield delay


def _wait(req, what: str, timeout: float | None = None) -> None:
    """Wait for ``req`` outside an event loop; after ``timeout`` s, abort the job (a rank is gone)."""
    try:
        for delay in _backoff(req, what, timeout):
            time.sleep(delay)
    except TimeoutError as exc:
        _abort(f"MPI rank {_world_rank()} gave up: {exc}; aborting the job")


async def _wait_async(req, what: str, timeout: float | None = None, *, server=None) -> bool:
    """Wait for ``req`` from an event loop, which goes on running between the tests.

    With ``server`` (a Scheduler or Worker) the wait also ends when that server has finished, and
    tests ``req`` at most every :data:`IDLE_POLL_INTERVAL` seconds (a cluster's lifetime is long).
    Returns True when ``req`` completed, False when ``server`` finished first.  Raises
    :class:`TimeoutError` after ``timeout`` seconds.
    """
    if server is None:
        for delay in _backoff(req, what, timeout):
            await asyncio.sleep(delay)
        return True
    finished = asyncio.ensure_future(server.finished())
    try:
        for delay in _backoff(req, what, timeout, IDLE_POLL_INTERVAL):
            await asyncio.wait({finished}, timeout=delay)
            if finished.done():
                return False
        return True
    finally:
        finished.cancel()


# --------------------------------------------------------------------------------------------
# cross-rank steps
#
# Every rank of the launcher's communicator takes the same MPI collectives in the same order, on
# the launcher's private duplicate of it (``ctl``).  Each step is one function, or one pair of
# functions for the two sides of a broadcast, called by every role, so a call on the scheduler,
# the client or a worker can be matched with the others by its name:
#
#   initialize():  _step_refuse_local_problems, _step_count_node_workers, _step_address_send/_recv,
#                  _step_workers_registered, _step_client_done
#   serve():       _step_refuse_local_problems, _step_count_node_workers, _step_address_send/_recv,
#                  _step_workers_registered, _step_job_finished
#
# The non-blocking steps return the MPI request; each rank waits for it with _wait (outside an
# event loop) or _wait_async (from one).


def _step_refuse_local_problems(ctl, problem: str | None) -> None:
    """Every rank: raise ValueError on all alike with the lowest rank's ``problem`` (what that rank alone can
    check: its host's network interface, the scheduler file's directory), so one rank's bad setting ends
    the job at once with one line per rank, not that rank alone with a traceback once the others wait."""
    first = next((p for p in ctl.allgather(problem) if p), None)
    if first:
        raise ValueError(first)


def _step_count_node_workers(ctl, is_worker: bool) -> int:
    """Every rank: how many ranks of ``ctl`` that run a worker share this rank's node (blocking).

    Taken when every rank has just entered the launcher (after the local checks); it sizes
    ``memory_limit="auto"``.
    """
    from mpi4py import MPI

    node = ctl.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.allreduce(int(is_worker), op=MPI.SUM)
    finally:
        node.Free()


async def _step_address_send(ctl, address: str) -> None:
    """The scheduler's side of the address broadcast: its length, then its bytes."""
    data = bytearray(address.encode())
    size = array("q", [len(data)])  # (buffers stay referenced until their broadcast completes)
    await _wait_async(ctl.Ibcast(size, root=_SCHEDULER_RANK), "the address broadcast")
    await _wait_async(ctl.Ibcast(data, root=_SCHEDULER_RANK), "the address broadcast")


def _step_address_recv(ctl) -> str:
    """Every other rank's side of the address broadcast: the scheduler's address.

    No timeout: a scheduler that fails to start aborts the job itself.
    """
    size = array("q", [0])
    _wait(ctl.Ibcast(size, root=_SCHEDULER_RANK), "the scheduler's address")
    data = bytearray(size[0])
    _wait(ctl.Ibcast(data, root=_SCHEDULER_RANK), "the scheduler's address")
    return data.decode()


def _step_workers_registered(ctl):
    """Every rank: a barrier that completes once every worker is registered with the scheduler.

    The scheduler posts it once it has sent its address, each worker once it has started (which
    includes registering), the client rank at once.
    """
    return ctl.Ibarrier()


def _step_client_done(ctl):
    """Every rank (:func:`initialize`): a barrier that completes once the client rank is done.

    The scheduler and the workers post it as soon as the cluster is up and wait for it while they
    serve; the client rank posts it in :func:`shutdown`.
    """
    return ctl.Ibarrier()


def _step_job_finished(ctl):
    """Every rank (:func:`serve`): a barrier that completes once every rank's server has finished,
    so that no rank finalises MPI while another still talks to it."""
    return ctl.Ibarrier()


# --------------------------------------------------------------------------------------------
# scheduler and workers


def _without_http_server(cls: type) -> type:
    """A subclass of the distributed server class ``cls`` (a Scheduler or Worker) that opens no HTTP server.

    distributed's scheduler and workers always serve HTTP (health, metrics and JSON routes; the
    dashboard too where asked for and bokeh is installed) on a port of their own, logged as
    "dashboard at: ...", whatever their ``dashboard`` argument says; ``start_http_server`` is
    where they open it.  The class keeps ``cls``'s name, which distributed reports.
    """

    def start_http_server(self, routes, dashboard_address, default_port=0, ssl_options=None):
        """Open no HTTP server (the launcher's ``dashboard=False``)."""

    return type(cls.__name__, (cls,), {"start_http_server": start_http_server})


async def _start_scheduler(protocol, interface, dashboard, dashboard_address):
    from distributed import Scheduler

    cls = Scheduler if dashboard else _without_http_server(Scheduler)
    scheduler = cls(protocol=protocol, interface=interface, dashboard=dashboard, dashboard_address=dashboard_address)
    await asyncio.wait_for(scheduler.start(), STARTUP_TIMEOUT)
    scheduler.add_plugin(_quiet_close_plugin(), name="mpi4dask-quiet-close")
    return scheduler


_goodbye = None  # say_goodbye() of this rank's death notice, once armed


def _death_notice() -> None:
    """Under mpiexec: a small child process that says which rank died, should this one be killed.

    Hydra SIGKILLs every rank as soon as one dies, and names only a pid; no rank can speak after
    the death.  So each rank forks, before MPI starts, a child in a session of its own (hydra's
    cleanup does not reach it) that holds nothing but the read end of a pipe and stderr.  A rank
    that ends on its own (a normal exit, any status, or an abort it chose) first claims the job's
    marker file (so that the ranks mpiexec kills next are not taken for dead ones) and then says
    goodbye on the pipe.  A read that ends without the goodbye means the rank was killed: the first
    child of the job to claim the marker writes one line naming its rank; the others stay silent.
    The child keeps a copy of its rank's PMI connection (``PMI_FD``) until then: hydra ends the job
    when that connection closes, so the ranks it kills die only after the first dead rank's child
    has claimed the marker (without it, which child claims first is a race: hydra kills the others
    about 3 ms after the death, measured).  Every child closes its ends of mpiexec's pipes and the
    PMI connection before it lingers to remove the marker.

    Under ``srun`` (``--mpi=pmi2``) nobody ends the step when a task dies: srun waits for the
    others, which may wait for the dead one for ever.  So there the child that names the dead
    rank also ends the step as hydra would (``scancel --signal=KILL JOB.STEP``); the children go
    with it, and a marker they leave behind is taken as stale after ``MARKER_STALE`` seconds.
    """
    global _goodbye
    rank = os.environ.get("PMI_RANK")
    if rank is None or not hasattr(os, "fork") or _goodbye is not None:
        return
    from ._mpi import _launcher_job_key

    key = _launcher_job_key() or f"ppid={os.getppid()}"
    # srun kills the step's leftovers, lingering children included, so a marker may outlive its step:
    # srun's own port (new with each srun) keeps a later step with the same ids from finding it
    key += "|" + os.environ.get("SLURM_SRUN_COMM_PORT", "")
    marker = os.path.join(tempfile.gettempdir(), "mpi4dask-died-" + hashlib.sha256(key.encode()).hexdigest()[:16])
    pmi_fd = _inherited_fd(os.environ.get("PMI_FD"))
    parent = os.getpid()
    job, stepid = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    step = f"{job}.{stepid}" if job and stepid else None
    launch, ender = (f"srun step {step}", f"mpi4dask ends the step (scancel --signal=KILL {step})") if step else (
        "mpiexec job", "mpiexec ends the job")
    notice = (f"mpi4dask: rank {rank} of this {launch} (pid {parent}) died; MPI cannot go on without one of its "
              f"ranks, so {ender}\n").encode()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os calls from here on, then _exit
        try:
            os.setsid()
            for low, high in _ranges_without((r, pmi_fd), 3, 1 << 16):
                os.closerange(low, high)
            killed = os.read(r, 1) == b""  # the rank ended without saying goodbye
            claimed = False
            if killed:
                claimed = _claim(marker)  # False: a rank died or ended first; the launcher killed this one
            if claimed:
                os.write(2, notice)
                if step is not None:
                    _run_and_wait(["scancel", "--signal=KILL", step])
            for fd in (0, 1, 2, pmi_fd):  # mpiexec waits for every holder of its pipes before it exits
                if fd is not None:
                    os.close(fd)
            time.sleep(MARKER_LINGER)  # the job's other ranks end meanwhile; then the marker goes
            try:
                os.unlink(marker)
            except OSError:
                pass
        except BaseException:  # noqa: BLE001 - nothing may escape the child
            pass
        os._exit(0)
    os.close(r)

    def say_goodbye() -> None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_WRONLY, 0o600))
            os.write(w, b"k")
        except OSError:
            pass

    _goodbye = say_goodbye
    atexit.register(say_goodbye)


MARKER_LINGER = 10.0  # seconds a death-notice child keeps the job's marker after its rank ended
MARKER_STALE = 120.0  # a marker this old is a leftover of an earlier job with the same key (a Slurm restarted)


def _claim(marker: str) -> bool:
    """Create the job's marker file, which must not exist (or be a stale leftover); os calls only."""
    for _ in range(2):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                if time.time() - os.stat(marker).st_mtime < MARKER_STALE:
                    return False
                os.unlink(marker)
            except OSError:
                return False
        except OSError:
            return False
    return False


def _run_and_wait(argv: list[str]) -> None:
    """Run a command from a forked child (os calls only) and wait for it; it shares our stdout and stderr."""
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    os.waitpid(pid, 0)


def _inherited_fd(text: str | None) -> int | None:
    """The descriptor a launcher passed in the environment (``PMI_FD``), if it is open here."""
    try:
        fd = int(text or "")
        os.fstat(fd)
    except (ValueError, OSError):
        return None
    return fd if fd > 2 else None


def _ranges_without(keep, low: int, high: int):
    """``[low, high)`` less the descriptors in ``keep`` (None ignored), as ranges for os.closerange."""
    for fd in sorted(k for k in keep if k is not None and low <= k < high):
        yield low, fd
        low = fd + 1
    yield low, high


def _quiet_close_plugin():
    """A scheduler plugin that silences the scheduler's logs as soon as it starts closing, however
    the close was asked for (the launcher, ``client.shutdown()``, a signal)."""
    from distributed.diagnostics.plugin import SchedulerPlugin

    class QuietClose(SchedulerPlugin):
        async def before_close(self):
            _quiet_distributed_logs()

    return QuietClose()


async def _start_worker(cls, address, name, protocol, interface, nthreads, memory_limit, local_directory, dashboard):
    if not dashboard:
        cls = _without_http_server(cls)
    worker = cls(
        address,
        name=name,
        protocol=protocol,
        interface=interface,
        nthreads=nthreads,
        memory_limit=memory_limit,
        local_directory=local_directory,
    )
    _quiet_on_close_message(worker)
    await asyncio.wait_for(worker.start(), STARTUP_TIMEOUT)
    return worker


def _quiet_on_close_message(worker) -> None:
    """Silence the worker's logs when the scheduler tells it to close, before its streams break.

    When the scheduler closes, it sends each worker ``close`` and then drops the connection; the
    worker's own writes to the dropped stream would then be logged (with tracebacks) as errors.
    """
    original = worker.stream_handlers.get("close")
    if original is None:  # pragma: no cover - distributed changed
        return

    async def close(**kwargs):
        _quiet_distributed_logs()
        return await original(**kwargs)

    worker.stream_handlers["close"] = close


async def _close_within(server, reason: str, grace: float) -> None:
    """Wait ``grace`` seconds for ``server`` to be closed by its peers, then close it ourselves."""
    try:
        await asyncio.wait_for(server.finished(), grace)
    except asyncio.TimeoutError:
        await server.close(reason=reason)


# --------------------------------------------------------------------------------------------
# initialize


def initialize(
    protocol: str = "mpi",
    *,
    comm=None,
    nthreads: int = 1,
    memory_limit: int | float | str | None = "auto",
    local_directory: str | None = None,
    dashboard: bool = False,
    dashboard_address: str = ":8787",
    interface: str | None = None,
    worker_class: str | type | None = None,
    exit: bool = True,
    lean: bool = True,
) -> bool:
    """Turn the ranks of this MPI job into a Dask cluster and return on rank 1 only.

    Call it at the top of a script run with ``mpiexec -n N python script.py`` (N >= 3)::

        from mpi4dask.launcher import initialize
        initialize()                      # ranks 0, 2, 3, ... never get past this line
        from distributed import Client
        client = Client()                 # connects to this job's scheduler
        ...                               # the script's end ends the whole job

    * Rank 0 runs a :class:`distributed.Scheduler` listening on ``protocol``.
    * Rank 1 returns ``True`` and runs the rest of the script.  By then every worker is registered
      with the scheduler, and dask's ``scheduler-address`` is set, so ``distributed.Client()`` with
      no arguments connects to this job's scheduler.
    * Ranks >= 2 each run one in-process :class:`distributed.Worker` (named by its rank) with
      ``nthreads`` threads.  There is no Nanny: a process forked by a rank cannot be an MPI rank.

    The ranks are those of ``comm`` (default ``MPI.COMM_WORLD``): to run Dask in part of a larger
    MPI program, call ``initialize(comm=sub)`` on the ranks of a communicator ``sub`` (e.g. made
    with ``MPI.COMM_WORLD.Split``, at least 3 ranks) and nowhere else; the other ranks are free to
    do their own MPI work (on communicators of their own: the ``mpi://`` transport uses
    point-to-point messages on ``MPI.COMM_WORLD``).

    MPI is initialised (thread level ``MPI_THREAD_MULTIPLE``, through :func:`mpi4dask._mpi.world`)
    before any distributed object starts, and the scheduler's address reaches the other ranks by
    a broadcast on ``comm``.

    Ending the job: when the script on rank 1 ends normally (or calls ``sys.exit``), an exit hook
    closes the clients the script left open, then tells the other ranks over MPI that the client is
    done (a barrier, no thread or event loop is created at exit, which Python >= 3.12 forbids); the
    scheduler then closes, closing the workers, and with ``exit=True`` ranks 0 and >= 2 leave their
    process with status 0.  distributed's loggers are silenced while the job ends, so a normal end
    prints no connection-closed noise.  The script may call :func:`shutdown` itself to end the
    cluster earlier.  Calling ``client.shutdown()`` also stops the cluster; the ranks then wait
    for the script on rank 1 to end.

    When the script on rank 1 dies of an uncaught exception, its traceback is printed and the whole
    job (every rank of ``MPI.COMM_WORLD``) is aborted (``MPI_Abort``, non-zero status) at once.  A
    scheduler or worker that fails to start aborts the job the same way, so the job never hangs
    waiting for a rank that is gone.

    Parameters
    ----------
    protocol
        The comm protocol of the scheduler and workers: ``"mpi"`` (mpi4dask's MPI transport, the
        default) or any other distributed backend that connects processes, e.g. ``"tcp"``.
    comm
        The mpi4py intracommunicator whose ranks make the cluster (at least 3 of them); ``None``
        (the default) for ``MPI.COMM_WORLD``.  The roles above are ranks of ``comm``, and workers
        are named by their rank in ``comm``.
    nthreads
        Threads per worker, a whole number >= 1.
    memory_limit
        Memory limit per worker: ``"auto"`` (the default) shares the node's memory evenly among the
        job's workers on that node (physical memory, or the cgroup's limit where lower);
        a number of bytes (``4e9``, ``"4GiB"``); a fraction ``0 < f <= 1`` of the node's memory for
        each worker (as in :class:`distributed.Worker`); ``None`` or ``0`` for no limit.
    local_directory
        Directory for the workers' scratch files (default: dask's temporary directory).
    dashboard
        With ``True`` the scheduler serves its dashboard at ``dashboard_address`` (needs bokeh;
        without it, distributed's plain HTTP pages), and the workers their HTTP pages on ports of
        their own.  With ``False`` (the default) no rank opens an HTTP port at all; the client's
        ``Client.dashboard_link`` then has no port to point to.
    dashboard_address
        Address of the dashboard, when ``dashboard`` is true.
    interface
        Network interface for the scheduler and workers, e.g. ``"ib0"``; ``None`` picks the default.
    worker_class
        A :class:`distributed.Worker` subclass (or its dotted name) to run on ranks >= 2.
        Nanny classes are refused.
    exit
        With ``True`` (the default) ranks 0 and >= 2 call ``sys.exit(0)`` once the cluster has
        closed, so the rest of the script runs on rank 1 only.  With ``False`` they return
        ``False`` instead (after rank 1 has ended the cluster) and the script must branch on the
        result.
    lean
        With ``True`` (the default) distributed's housekeeping timers that still have their
        default values are slowed down for this job, so an idle cluster costs little CPU (HPC
        nodes run many ranks): the event-loop tick from 20 ms to 1 s (it feeds only the
        "event loop was unresponsive" warning, whose limit is 3 s) and the workers' profiler
        sampling from 10 ms to 100 ms.  Values set in your dask configuration are kept.
        ``False`` keeps distributed's defaults.

    Returns
    -------
    bool
        ``True`` on rank 1 (the client rank); ``False`` on the other ranks, only with ``exit=False``.

    Raises
    ------
    ValueError
        For an unknown protocol, a Nanny ``worker_class``, a bad ``nthreads`` or ``memory_limit``,
        ``comm=MPI.COMM_NULL``, or fewer than 3 ranks.  These are checked before any MPI collective
        and raised on every rank alike, so the job ends with the error rather than hanging.  An
        ``interface`` that the host of a scheduler or worker rank lacks is found by that rank as the
        job starts, and raised on every rank alike too.
    TypeError
        When ``comm`` is not an mpi4py intracommunicator, or ``interface`` is not a name.
    RuntimeError
        When called a second time in one process.
    mpi4dask.MPIUnavailableError
        When MPI cannot be initialised (the message says why and how to fix it).
    """
    global _initialized, _state
    if _initialized:
        raise RuntimeError("mpi4dask.launcher.initialize() was already called in this process")

    protocol = _check_protocol(protocol)
    cls = _worker_class(worker_class)
    nthreads = _check_nthreads(nthreads)
    memory_limit = _check_memory_limit(memory_limit)
    interface = _check_interface(interface)

    from ._mpi import world

    _death_notice()  # before MPI starts: a fork then is safe
    world()  # MPI first, distributed objects second (dask-mpi PR #100)
    comm = _check_comm(comm, 3, "initialize()", "scheduler, client, one worker", _INITIALIZE_EXAMPLE)
    if lean:
        _lean_housekeeping()
    _initialized = True

    ctl = comm.Dup()  # private communicator for the launcher's own steps
    rank = ctl.Get_rank()
    try:
        _step_refuse_local_problems(ctl, _interface_problem(interface) if rank != _CLIENT_RANK else None)
    except ValueError:  # on every rank alike: the script may call initialize() again, corrected
        ctl.Free()
        _initialized = False
        raise
    workers_on_node = _step_count_node_workers(ctl, rank not in (_SCHEDULER_RANK, _CLIENT_RANK))

    if rank == _SCHEDULER_RANK:

        async def scheduler_main():
            scheduler = await _start_scheduler(protocol, interface, dashboard, dashboard_address)
            await _step_address_send(ctl, scheduler.address)
            await _wait_async(_step_workers_registered(ctl), "the workers to register", STARTUP_TIMEOUT)
            done = _step_client_done(ctl)
            if await _wait_async(done, "the client rank", server=scheduler):
                _quiet_distributed_logs()
                await scheduler.close(reason="mpi4dask: the client rank finished")
            else:  # closed by a client (client.shutdown()): wait for the script on rank 1 to end
                _quiet_distributed_logs()
            return done

        _ignore_sigint()
        done = _run_rank(scheduler_main, "scheduler")
        _wait(done, "the client rank")
        return _leave(ctl, exit)

    address = _step_address_recv(ctl)

    if rank == _CLIENT_RANK:
        import dask

        dask.config.set({"scheduler-address": address})
        _wait(_step_workers_registered(ctl), "the scheduler and workers to start", STARTUP_TIMEOUT + 10)
        _state = _ClientState(ctl)
        _install_excepthook()
        atexit.register(shutdown)
        from ._endpoint import close_first_at_exit

        close_first_at_exit(shutdown)  # before the transport stops the connections left open (the Clients')
        return True

    if memory_limit == "auto":
        memory_limit = _auto_memory_limit(workers_on_node)

    async def worker_main():
        worker = await _start_worker(
            cls, address, rank, protocol, interface, nthreads, memory_limit, local_directory, dashboard
        )
        await _wait_async(_step_workers_registered(ctl), "the other workers to register", STARTUP_TIMEOUT)
        done = _step_client_done(ctl)
        if await _wait_async(done, "the client rank", server=worker):
            _quiet_distributed_logs()
            await _close_within(worker, "mpi4dask: the client rank finished", CLOSE_GRACE)
        else:
            _quiet_distributed_logs()
        return done

    _ignore_sigint()
    done = _run_rank(worker_main, "worker")
    _wait(done, "the client rank")
    return _leave(ctl, exit)


def _ignore_sigint() -> None:
    # Ctrl-C reaches every rank; let the client rank (the user's script) decide what it means.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _leave(ctl, exit: bool) -> bool:
    ctl.Free()
    sys.stdout.flush()
    sys.stderr.flush()
    if exit:
        sys.exit(0)
    _restore_logs()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return False


def _install_excepthook() -> None:
    previous = sys.excepthook

    def excepthook(etype, value, tb):
        try:
            previous(etype, value, tb)
            _say(
                f"mpi4dask: the client script on MPI rank {_world_rank()} raised an uncaught exception; "
                "aborting the job"
            )
            sys.stdout.flush()
            sys.stderr.flush()
            time.sleep(ABORT_DELAY)
        finally:
            from ._mpi import initialized_world

            if _goodbye is not None:
                _goodbye()  # this rank ends the job on purpose: it did not die
            w = initialized_world()
            if w is not None:
                w.comm.Abort(1)
            os._exit(1)

    sys.excepthook = excepthook


def shutdown(timeout: float = 10.0) -> None:
    """End the cluster started by :func:`initialize`; call it on the client rank (no-op elsewhere, idempotent).

    Closes the :class:`distributed.Client` objects of this process that are still open (waiting at
    most ``timeout`` seconds for each), then tells the other ranks over MPI that the client is done:
    the scheduler closes and closes the workers.  It creates no thread and no event loop, so it is
    safe at interpreter exit, where :func:`initialize` registers it with :mod:`atexit`.

    Parameters
    ----------
    timeout : float
        Seconds to wait for each open client to close (default 10).
    """
    st = _state
    if st is None:
        return
    with st.lock:
        if st.done:
            return
        st.done = True
    _quiet_distributed_logs()
    _close_clients(timeout)
    _wait(_step_client_done(st.ctl), "the scheduler and workers")
    st.ctl.Free()


def _close_clients(timeout: float) -> None:
    """Close the synchronous Clients that the script left open, on their own (running) loop threads."""
    try:
        from distributed.client import _global_clients
    except ImportError:  # pragma: no cover - distributed internals moved
        return
    for client in list(_global_clients.values()):
        try:
            if client.asynchronous or client.status in ("closed", "closing"):
                continue
            client.close(timeout=timeout)
        except Exception:  # noqa: BLE001 - a client that cannot close cleanly is dropped by the exit
            pass


# --------------------------------------------------------------------------------------------
# serve


def serve(
    scheduler_file: str,
    protocol: str = "mpi",
    *,
    comm=None,
    nthreads: int = 1,
    memory_limit: int | float | str | None = "auto",
    local_directory: str | None = None,
    dashboard: bool = False,
    dashboard_address: str = ":8787",
    interface: str | None = None,
    lean: bool = True,
) -> int:
    """Run this MPI job as a Dask cluster until a client shuts it down; return the exit status (0).

    Under ``mpiexec -n N`` (N >= 2): rank 0 runs the scheduler, ranks >= 1 each run an in-process
    worker.  Once every worker is registered, rank 0 writes the scheduler file (atomically) so
    clients outside the job connect with ``Client(scheduler_file=scheduler_file)``.  The job ends,
    with status 0 on every rank, when a client calls ``client.shutdown()`` or when ``mpiexec``
    receives SIGTERM or SIGINT (which it forwards to the ranks); the scheduler file is removed.

    This is what ``mpiexec -n N mpi4dask serve --scheduler-file F`` runs.

    Parameters
    ----------
    scheduler_file : str
        Path of the JSON file the scheduler writes once all workers are registered.
    protocol : str
        ``"mpi"`` (the default) or another distributed backend that connects processes, e.g. ``"tcp"``.
    comm : mpi4py.MPI.Intracomm, optional
        The ranks that serve (at least 2), as in :func:`initialize`; default ``MPI.COMM_WORLD``.
    nthreads, memory_limit, local_directory, dashboard, dashboard_address, interface, lean
        As in :func:`initialize`.

    Returns
    -------
    int
        0, on every rank, once the cluster has ended.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, as in :func:`initialize`: on every rank alike, before any MPI collective, or
        as the job starts for what one rank alone can check (the scheduler file's directory, the
        ``interface`` of its host); ``mpi4dask serve`` turns them into exit status 2 and a one-line
        message.
    """
    protocol = _check_protocol(protocol)
    nthreads = _check_nthreads(nthreads)
    memory_limit = _check_memory_limit(memory_limit)
    _check_scheduler_file(scheduler_file)
    interface = _check_interface(interface)
    from ._mpi import world

    _death_notice()  # before MPI starts: a fork then is safe
    world()
    comm = _check_comm(comm, 2, "serve()", "a scheduler and a worker", _SERVE_EXAMPLE.format(scheduler_file))
    if lean:
        _lean_housekeeping()
    ctl = comm.Dup()
    rank = ctl.Get_rank()
    _step_refuse_local_problems(ctl, (_scheduler_file_problem(scheduler_file) if rank == _SCHEDULER_RANK else None)
                                or _interface_problem(interface))
    scheduler_file = os.path.abspath(scheduler_file)
    workers_on_node = _step_count_node_workers(ctl, rank != _SCHEDULER_RANK)

    def stop_on_signal() -> asyncio.Future:
        """A future that SIGTERM or SIGINT resolves (to the signal's number), quieting the logs first."""
        loop = asyncio.get_running_loop()
        stop = loop.create_future()

        def handler(signum):
            _quiet_distributed_logs()
            if not stop.done():
                stop.set_result(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, handler, sig)
        return stop

    if rank == _SCHEDULER_RANK:

        async def scheduler_main():
            scheduler = await _start_scheduler(protocol, interface, dashboard, dashboard_address)
            stop = stop_on_signal()
            await _step_address_send(ctl, scheduler.address)
            await _wait_async(_step_workers_registered(ctl), "the workers to register", STARTUP_TIMEOUT)
            _write_scheduler_file(scheduler_file, scheduler.identity())
            finished = asyncio.ensure_future(scheduler.finished())
            await asyncio.wait({finished, stop}, return_when=asyncio.FIRST_COMPLETED)
            _quiet_distributed_logs()
            _remove_scheduler_file(scheduler_file, scheduler.address)
            if not finished.done():
                await scheduler.close(reason=f"mpi4dask serve: signal {stop.result()}")
            await finished

        _run_rank(scheduler_main, "scheduler")
    else:
        address = _step_address_recv(ctl)
        if memory_limit == "auto":
            memory_limit = _auto_memory_limit(workers_on_node)

        async def worker_main():
            worker = await _start_worker(
                _worker_class(None), address, rank, protocol, interface, nthreads, memory_limit, local_directory,
                dashboard,
            )  # fmt: skip
            stop = stop_on_signal()
            await _wait_async(_step_workers_registered(ctl), "the other workers to register", STARTUP_TIMEOUT)
            finished = asyncio.ensure_future(worker.finished())
            await asyncio.wait({finished, stop}, return_when=asyncio.FIRST_COMPLETED)
            _quiet_distributed_logs()
            if not finished.done():  # signalled: the scheduler (signalled too) closes us
                await _close_within(worker, f"mpi4dask serve: signal {stop.result()}", CLOSE_GRACE)
            await finished

        _run_rank(worker_main, "worker")

    _wait(_step_job_finished(ctl), "the other ranks to finish", FINISH_TIMEOUT)
    ctl.Free()
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def _write_scheduler_file(path: str, identity: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(identity, f, indent=2)
    os.replace(tmp, path)


def _remove_scheduler_file(path: str, address: str) -> None:
    try:
        with open(path) as f:
            if json.load(f).get("address") != address:
                return  # another scheduler's file now: leave it
        os.remove(path)
    except (OSError, ValueError):
        pass


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``mpi4dask serve`` to ``parser`` and make :func:`serve_main` its handler."""
    parser.add_argument(
        "--scheduler-file",
        required=True,
        metavar="FILE",
        help="JSON file the scheduler writes once all workers are registered; clients connect with "
        "Client(scheduler_file=FILE)",
    )
    parser.add_argument(
        "--protocol", default="mpi", help="comm protocol of scheduler and workers: mpi (default) or tcp"
    )
    parser.add_argument(
        "--nthreads", type=_parse_nthreads, default=1, metavar="N", help="threads per worker (default 1)"
    )
    parser.add_argument(
        "--memory-limit",
        type=_parse_memory_limit,
        default="auto",
        help="memory limit per worker: bytes (e.g. 4e9 or 4GiB), a fraction 0 < f <= 1 of the node's "
        "memory, 'auto' (default: the node's memory shared among its workers) or 0 for none",
    )
    parser.add_argument("--local-directory", default=None, help="directory for the workers' scratch files")
    parser.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve the scheduler's dashboard (default: no, and no rank opens an HTTP port)",
    )
    parser.add_argument("--dashboard-address", default=":8787", help="dashboard address (default :8787)")
    parser.add_argument("--interface", default=None, help="network interface, e.g. ib0 (default: automatic)")
    parser.add_argument(
        "--lean",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="slow distributed's idle housekeeping where it has its defaults: event-loop tick 1 s, "
        "profiler 100 ms (default: yes)",
    )
    parser.set_defaults(func=serve_main)


def _parse_nthreads(text: str):
    """``--nthreads``: an int where the text is one, else the text (which :func:`serve_main` refuses)."""
    try:
        return int(text)
    except ValueError:
        return text


def _parse_memory_limit(text: str):
    """``--memory-limit``: None for "none"/"", "auto", an int or float where the text is one, else the text."""
    lowered = text.strip().lower()
    if lowered in ("none", ""):
        return None
    if lowered == "auto":
        return "auto"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def serve_main(args: argparse.Namespace) -> int:
    """Entry point of ``mpi4dask serve``: run :func:`serve` with the parsed options.

    A bad option ends every rank with exit status 2 and a one-line message naming the value.
    """
    try:
        return serve(
            args.scheduler_file,
            args.protocol,
            nthreads=_check_nthreads(args.nthreads, "--nthreads "),
            memory_limit=_check_memory_limit(args.memory_limit, "--memory-limit "),
            local_directory=args.local_directory,
            dashboard=args.dashboard,
            dashboard_address=args.dashboard_address,
            interface=args.interface,
            lean=args.lean,
        )
    except (TypeError, ValueError) as exc:
        _say(f"mpi4dask serve: {exc}")
        return 2
