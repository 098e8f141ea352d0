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

Workers always run in the rank's own process (never under a Nanny): a process forked by a rank
inherits the rank's launcher environment (``PMI_*`` ...) and cannot be that MPI rank.

Coordination between ranks (the scheduler's address, "all workers are registered", "the client
is done") goes through MPI itself, on a private duplicate of ``MPI.COMM_WORLD``.  Ranks that run
an event loop never block in MPI: they post non-blocking barriers and test them from the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

logger = logging.getLogger("mpi4dask.launcher")

#: Seconds between two tests of a pending control barrier (startup).
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

_CLIENT_RANK = 1
_SCHEDULER_RANK = 0


class _ClientState:
    """What rank 1 needs to end the job (see :func:`shutdown`)."""

    def __init__(self, ctl, address: str):
        self.ctl = ctl
        self.address = address
        self.lock = threading.Lock()
        self.done = False


_state: _ClientState | None = None
_initialized = False


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
    except ValueError as exc:
        raise ValueError(
            f"unknown protocol {protocol!r}: distributed has no comm backend of that name ({exc}); "
            "use 'mpi' (mpi4dask's transport) or 'tcp'"
        ) from None
    return name


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


def _abort(msg: str | None = None, exc: BaseException | None = None, code: int = 1) -> None:
    """Print what went wrong and end the whole MPI job (every rank) with a non-zero status."""
    from ._mpi import initialized_world

    try:
        if exc is not None:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        if msg:
            print(f"mpi4dask: {msg}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(ABORT_DELAY)
    finally:
        w = initialized_world()
        if w is not None:
            w.comm.Abort(code)
        os._exit(code)


def _wait_blocking(req, timeout: float | None = None, what: str = "") -> None:
    """Wait for a non-blocking MPI request without spinning a core (MPICH's Wait busy-polls)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.001
    while not req.Test():
        if deadline is not None and time.monotonic() > deadline:
            _abort(f"rank gave up waiting {timeout:.0f} s for {what}; aborting the job")
        time.sleep(delay)
        delay = min(delay * 2, POLL_INTERVAL)


async def _wait_async(req, timeout: float | None = None, what: str = "") -> None:
    """Wait for a non-blocking MPI request from an event loop, by testing it between loop turns."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.001
    while not req.Test():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, POLL_INTERVAL)


def _run_rank(main, role: str):
    """Run ``main()`` (an event loop); any failure prints its traceback and aborts the whole job."""
    try:
        return asyncio.run(main())
    except BaseException as exc:  # noqa: BLE001 - a rank that fails must not leave the others hanging
        from ._mpi import initialized_world

        w = initialized_world()
        rank = w.rank if w is not None else "?"
        _abort(f"the {role} on MPI rank {rank} failed ({type(exc).__name__}: {exc}); aborting the job", exc)


async def _start_scheduler(protocol, interface, dashboard, dashboard_address):
    from distributed import Scheduler

    scheduler = Scheduler(
        protocol=protocol,
        interface=interface,
        dashboard=dashboard,
        # Without the dashboard the scheduler still serves HTTP (health, metrics): on a free port,
        # so that jobs sharing a node do not fight over 8787.
        dashboard_address=dashboard_address if dashboard else ":0",
    )
    await asyncio.wait_for(scheduler.start(), STARTUP_TIMEOUT)
    scheduler.add_plugin(_quiet_close_plugin(), name="mpi4dask-quiet-close")
    return scheduler


def _quiet_close_plugin():
    """A scheduler plugin that silences the scheduler's logs as soon as it starts closing, however
    the close was asked for (the launcher, ``client.shutdown()``, a signal)."""
    from distributed.diagnostics.plugin import SchedulerPlugin

    class QuietClose(SchedulerPlugin):
        async def before_close(self):
            _quiet_distributed_logs()

    return QuietClose()


async def _start_worker(cls, address, rank, protocol, interface, nthreads, memory_limit, local_directory):
    worker = cls(
        address,
        name=rank,
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


async def _until(server, req) -> bool:
    """Wait until ``server`` has finished or the MPI request ``req`` completed; True in the latter case."""
    finished = asyncio.ensure_future(server.finished())
    delay = 0.001
    try:
        while not finished.done():
            if req.Test():
                return True
            await asyncio.wait({finished}, timeout=delay)
            delay = min(delay * 2, IDLE_POLL_INTERVAL)
        return False
    finally:
        finished.cancel()


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

    MPI is initialised (thread level ``MPI_THREAD_MULTIPLE``, through :func:`mpi4dask._mpi.world`)
    before any distributed object starts, and the scheduler's address reaches the other ranks by
    ``MPI.COMM_WORLD.bcast``.

    Ending the job: when the script on rank 1 ends normally (or calls ``sys.exit``), an exit hook
    closes the clients the script left open, then tells the other ranks over MPI that the client is
    done (a barrier, no thread or event loop is created at exit, which Python >= 3.12 forbids); the
    scheduler then closes, closing the workers, and with ``exit=True`` ranks 0 and >= 2 leave their
    process with status 0.  distributed's loggers are silenced while the job ends, so a normal end
    prints no connection-closed noise.  The script may call :func:`shutdown` itself to end the
    cluster earlier.  Calling ``client.shutdown()`` also stops the cluster; the ranks then wait
    for the script on rank 1 to end.

    When the script on rank 1 dies of an uncaught exception, its traceback is printed and the whole
    job is aborted (``MPI_Abort``, non-zero status) at once.  A scheduler or worker that fails to
    start aborts the job the same way, so the job never hangs waiting for a rank that is gone.

    Parameters
    ----------
    protocol
        The comm protocol of the scheduler and workers: ``"mpi"`` (mpi4dask's MPI transport, the
        default) or any other distributed backend that connects processes, e.g. ``"tcp"``.
    nthreads
        Threads per worker.
    memory_limit
        Memory limit per worker (bytes, a fraction of system memory, a string such as ``"4GiB"``,
        ``"auto"`` or ``None``), as for :class:`distributed.Worker`.
    local_directory
        Directory for the workers' scratch files (default: dask's temporary directory).
    dashboard
        Whether the scheduler serves its dashboard (needs bokeh).
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
        On fewer than 3 ranks, for an unknown protocol, or for a Nanny ``worker_class``
        (raised on every rank alike, so the job ends with an error rather than hanging).
    RuntimeError
        When called a second time in one process.
    mpi4dask._mpi.MPIUnavailableError
        When MPI cannot be initialised.
    """
    global _initialized, _state
    if _initialized:
        raise RuntimeError("mpi4dask.launcher.initialize() was already called in this process")

    protocol = _check_protocol(protocol)
    cls = _worker_class(worker_class)
    if lean:
        _lean_housekeeping()

    from ._mpi import world

    w = world()  # MPI first, distributed objects second (dask-mpi PR #100)
    if w.size < 3:
        raise ValueError(
            f"mpi4dask.initialize() needs at least 3 MPI ranks (scheduler, client, one worker), but this "
            f"job has {w.size}: run it with `mpiexec -n 3` or more (e.g. `mpiexec -n 4 python script.py`)"
        )
    _initialized = True

    import dask

    comm = w.comm
    ctl = comm.Dup()  # private communicator for the launcher's own barriers
    rank = w.rank

    if rank == _SCHEDULER_RANK:

        async def scheduler_main():
            scheduler = await _start_scheduler(protocol, interface, dashboard, dashboard_address)
            comm.bcast(scheduler.address, root=_SCHEDULER_RANK)
            await _wait_async(ctl.Ibarrier(), STARTUP_TIMEOUT, "the workers to register")
            done = ctl.Ibarrier()  # completes when rank 1 has finished with the cluster
            if await _until(scheduler, done):
                _quiet_distributed_logs()
                await scheduler.close(reason="mpi4dask: the client rank finished")
            else:  # closed by a client (client.shutdown()): wait for the script on rank 1 to end
                _quiet_distributed_logs()
            return done

        _ignore_sigint()
        done = _run_rank(scheduler_main, "scheduler")
        _wait_blocking(done)
        return _leave(ctl, exit)

    address = comm.bcast(None, root=_SCHEDULER_RANK)

    if rank == _CLIENT_RANK:
        dask.config.set({"scheduler-address": address})
        _wait_blocking(ctl.Ibarrier(), STARTUP_TIMEOUT + 10, "the scheduler and workers to start")
        _state = _ClientState(ctl, address)
        _install_excepthook()
        atexit.register(shutdown)
        return True

    async def worker_main():
        worker = await _start_worker(cls, address, rank, protocol, interface, nthreads, memory_limit, local_directory)
        await _wait_async(ctl.Ibarrier(), STARTUP_TIMEOUT, "the other workers to register")
        done = ctl.Ibarrier()
        if await _until(worker, done):
            _quiet_distributed_logs()
            await _close_within(worker, "mpi4dask: the client rank finished", CLOSE_GRACE)
        else:
            _quiet_distributed_logs()
        return done

    _ignore_sigint()
    done = _run_rank(worker_main, "worker")
    _wait_blocking(done)
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
            print(
                "mpi4dask: the client script on MPI rank 1 raised an uncaught exception; aborting the job",
                file=sys.stderr,
            )
            sys.stdout.flush()
            sys.stderr.flush()
            time.sleep(ABORT_DELAY)
        finally:
            from ._mpi import initialized_world

            w = initialized_world()
            if w is not None:
                w.comm.Abort(1)
            os._exit(1)

    sys.excepthook = excepthook


def shutdown(timeout: float = 10.0) -> None:
    """End the cluster started by :func:`initialize`; call it on rank 1 (no-op elsewhere, idempotent).

    Closes the :class:`distributed.Client` objects of this process that are still open (waiting at
    most ``timeout`` seconds for each), then tells the other ranks over MPI that the client is done:
    the scheduler closes and closes the workers.  It creates no thread and no event loop, so it is
    safe at interpreter exit, where :func:`initialize` registers it with :mod:`atexit`.
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
    _wait_blocking(st.ctl.Ibarrier())
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
    nthreads: int = 1,
    memory_limit: int | float | str | None = "auto",
    local_directory: str | None = None,
    dashboard: bool = False,
    dashboard_address: str = ":8787",
    interface: str | None = None,
    lean: bool = True,
) -> int:
    """Run this MPI job as a Dask cluster until a client shuts it down; return the exit status.

    Under ``mpiexec -n N`` (N >= 2): rank 0 runs the scheduler, ranks >= 1 each run an in-process
    worker.  Once every worker is registered, rank 0 writes the scheduler file (atomically) so
    clients outside the job connect with ``Client(scheduler_file=scheduler_file)``.  The job ends,
    with status 0 on every rank, when a client calls ``client.shutdown()`` or when ``mpiexec``
    receives SIGTERM or SIGINT (which it forwards to the ranks); the scheduler file is removed.
    ``lean`` slows distributed's idle housekeeping as in :func:`initialize`.
    """
    protocol = _check_protocol(protocol)
    if lean:
        _lean_housekeeping()
    from ._mpi import world

    w = world()
    if w.size < 2:
        print(
            f"mpi4dask serve: needs at least 2 MPI ranks (a scheduler and a worker), but this job has "
            f"{w.size}: run it with `mpiexec -n 2` or more (e.g. `mpiexec -n 4 mpi4dask serve "
            f"--scheduler-file {scheduler_file}`)",
            file=sys.stderr,
        )
        return 2
    comm = w.comm
    ctl = comm.Dup()
    rank = w.rank
    scheduler_file = os.path.abspath(scheduler_file)

    def on_signal(loop, server, stop):
        def handler(signum):
            _quiet_distributed_logs()
            if not stop.done():
                stop.set_result(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, handler, sig)

    if rank == _SCHEDULER_RANK:

        async def scheduler_main():
            scheduler = await _start_scheduler(protocol, interface, dashboard, dashboard_address)
            loop = asyncio.get_running_loop()
            stop = loop.create_future()
            on_signal(loop, scheduler, stop)
            comm.bcast(scheduler.address, root=_SCHEDULER_RANK)
            await _wait_async(ctl.Ibarrier(), STARTUP_TIMEOUT, "the workers to register")
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
        address = comm.bcast(None, root=_SCHEDULER_RANK)

        async def worker_main():
            worker = await _start_worker(
                _worker_class(None), address, rank, protocol, interface, nthreads, memory_limit, local_directory
            )
            loop = asyncio.get_running_loop()
            stop = loop.create_future()
            on_signal(loop, worker, stop)
            await _wait_async(ctl.Ibarrier(), STARTUP_TIMEOUT, "the other workers to register")
            finished = asyncio.ensure_future(worker.finished())
            await asyncio.wait({finished, stop}, return_when=asyncio.FIRST_COMPLETED)
            _quiet_distributed_logs()
            if not finished.done():  # signalled: the scheduler (signalled too) closes us
                await _close_within(worker, f"mpi4dask serve: signal {stop.result()}", CLOSE_GRACE)
            await finished

        _run_rank(worker_main, "worker")

    # Every rank leaves MPI together: no rank finalizes while another still talks to it.
    _wait_blocking(ctl.Ibarrier(), FINISH_TIMEOUT, "the other ranks to finish")
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
    parser.add_argument("--nthreads", type=int, default=1, help="threads per worker (default 1)")
    parser.add_argument(
        "--memory-limit",
        default="auto",
        help="memory limit per worker: bytes, a fraction, e.g. 4GiB, 'auto' (default) or 0 for none",
    )
    parser.add_argument("--local-directory", default=None, help="directory for the workers' scratch files")
    parser.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve the scheduler's dashboard (default: no)",
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


def _parse_memory_limit(value: str):
    if value is None:
        return None
    text = str(value).strip()
    if text.lower() in ("auto", "none", ""):
        return None if text.lower() in ("none", "") else "auto"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def serve_main(args: argparse.Namespace) -> int:
    """Entry point of ``mpi4dask serve``: run :func:`serve` with the parsed options."""
    try:
        return serve(
            args.scheduler_file,
            args.protocol,
            nthreads=args.nthreads,
            memory_limit=_parse_memory_limit(args.memory_limit),
            local_directory=args.local_directory,
            dashboard=args.dashboard,
            dashboard_address=args.dashboard_address,
            interface=args.interface,
            lean=args.lean,
        )
    except ValueError as exc:
        print(f"mpi4dask serve: {exc}", file=sys.stderr)
        return 2
