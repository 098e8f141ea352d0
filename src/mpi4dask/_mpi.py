"""Lazy, checked access to MPI (private).

``import distributed`` and ``import mpi4dask`` never touch MPI.  MPI is initialised the first time
something needs it (the ``mpi://`` backend, :func:`mpi4dask.initialize`), and a missing or broken
MPI stack gives an :class:`MPIUnavailableError` that says what to do.

Initialisation runs on a thread of its own, never on an event loop
------------------------------------------------------------------
Under a launcher (``mpiexec``) ``MPI_Init`` is collective: it returns only once every rank of the
job has called it.  The ranks of one job reach it in any order, and often only after talking to
each other over the network: a worker reads the scheduler file, then connects; the scheduler's
listener must answer that connection.  A rank that called ``MPI_Init`` on its event loop would
stop answering, and its peers would wait for it forever.  A thread alone is not enough: mpi4py's
own ``MPI_Init`` (at import, or ``MPI.Init_thread``) holds the GIL while it waits, which stops every
thread of the process.  So :func:`start` imports ``mpi4py.MPI`` without initialising it and calls
``MPI_Init_thread`` through ctypes (which releases the GIL) on a dedicated daemon thread, and
returns a future; the ``mpi://`` backend starts it as soon as a process listens or connects, and
awaits the future only where it needs MPI, without blocking its loop.  Code that is not on an event loop (the
launcher, a worker thread) calls :func:`world`, which waits for the same future.

Joining other worlds (``MPI_Comm_accept``/``connect``) when the peer may die
--------------------------------------------------------------------------
Measured with this MPICH (5.0.2, ch4:ucx): a join whose peer dies half-way can wait in MPICH
longer than its ``timeout`` hint (a worker spun in ``MPI_Comm_accept`` for minutes), and after a
join that failed half-way a later join in the same process can crash it (SIGSEGV; 6 of 7 small
runs; likely a receive MPICH leaves posted after the timeout, not confirmed).
So every join runs inside :func:`joining`: MPI waits that begin there fail after a bound
(``MPIR_CVAR_PROGRESS_TIMEOUT``, set through the MPI tool interface) unless ``run_mpi`` code is
running in this process (:func:`user_code`, whose waits must never be timed); and a join that
fails marks the process (:func:`joins_unsafe`): it joins no other world again, its new
connections carry their messages over TCP, until it restarts.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass

from . import _credentials, _pmi, _ucx
from ._errors import MPIServiceError, MPIUnavailableError

logger = logging.getLogger(__name__)

# Environment variables through which launchers (hydra, PMIx/PRRTE, Open MPI, Slurm) hand a rank
# its identity.  A process spawned by a rank (a Nanny's worker, a multiprocessing child) inherits
# them but is not that rank: it must not initialise MPI as if it were.
_LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "PRTE_", "HYDRA_", "HYDI_", "MPI_LOCAL", "I_MPI_HYDRA_")

_INSTALL_HINT = (
    "Get an MPI one of two ways: the embedded default, `pip install \"mpi4dask[mpich]\"` (the MPICH wheel), or "
    "your site's MPI (e.g. `module load mpi`; mpi4py's wheel finds an MPICH- or Open MPI-compatible libmpi on "
    "LD_LIBRARY_PATH, or build it against that MPI with `pip install --no-binary mpi4py mpi4py` and its mpicc on "
    "PATH; see the mpi4dask README, section 'Using a system MPI')."
)


@dataclass(frozen=True)
class World:
    """This process's place in its MPI world, as the transport sees it."""

    MPI: object  # the mpi4py.MPI module
    comm: object  # MPI.COMM_WORLD: transport traffic uses its point-to-point tags
    rank: int
    size: int
    job_key: str  # launcher job identity from the environment, "" when the launcher gives none
    host: str
    pid: int
    tag_ub: int
    served: str = ""  # the PMI kvsname when mpi4dask formed this world (mpi4dask.pm), else ""
    dynamic: bool = False  # MPI_Comm_connect/accept work here (a launched or served world, not a singleton)
    alone: str = ""  # when not dynamic: why, naming the MPI library and the fix
    # a large send completes only if the sender, too, makes MPI calls while it moves (see sends_need_progress)
    sends_need_progress: bool = False
    # a reader waiting for a reply may match its MPI message before the header comes (see probes_ahead)
    probes_ahead: bool = True

    @property
    def ident(self) -> str:
        """This process among all MPI processes: its served world, else its place in its launched job."""
        return self.served or f"{self.job_key}|{self.rank}|{self.host}|{self.pid}"


_lock = threading.Lock()
_world: World | None = None


def _hydra_job_key() -> str:
    """The job identity of MPICH's hydra: the ``--control-port`` (and process group) of the
    ``hydra_pmi_proxy`` that started this process, an ancestor of every rank of one ``mpiexec``.
    Hydra puts nothing in the ranks' environment that tells two jobs apart."""
    if "PMI_RANK" not in os.environ or "HYDI_CONTROL_FD" not in os.environ:
        return ""
    pid = os.getppid()
    for _ in range(8):  # the rank, or a wrapper (a shell, `python -m mpi4py`) a few levels below
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return ""
        if argv and os.path.basename(argv[0]) == b"hydra_pmi_proxy":
            opts = dict(zip(argv[1::2], argv[2::2]))
            port, pgid = opts.get(b"--control-port"), opts.get(b"--pgid", b"0")
            return f"hydra={port.decode()}/{pgid.decode()}" if port else ""
        if ppid <= 1:
            return ""
        pid = ppid
    return ""


def _launcher_job_key() -> str:
    """An identity of the launch that every rank of one job shares, where the launcher gives one."""
    env = os.environ
    for names in (
        ("PMIX_NAMESPACE",),
        ("OMPI_MCA_ess_base_jobid",),
        ("I_MPI_HYDRA_UUID",),  # Intel MPI's hydra (MPICH's names no job: see _hydra_job_key)
        ("SLURM_JOB_ID", "SLURM_STEP_ID"),
        ("PBS_JOBID",),
        ("LSB_JOBID",),
    ):
        if all(n in env for n in names):
            return "|".join(f"{n}={env[n]}" for n in names)
    return _hydra_job_key()


def launched_with_peers() -> bool:
    """True when a launcher started this process as one of several ranks (MPI_Init is collective then)."""
    import multiprocessing

    if _world is not None:
        return _world.size > 1
    if multiprocessing.parent_process() is not None:
        return False  # a rank's child: it will run as a world of its own
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value) > 1
    return False


def srun_without_pmi(size: int) -> str | None:
    """Why a world of ``size`` is too small when ``srun`` started more tasks, or None.

    ``srun`` sets ``SLURM_STEP_NUM_TASKS`` in every task of a step (a batch script itself is no step).
    With no PMI plugin (``MpiDefault=none``, a common site default, and no ``--mpi=``) every task's MPI
    starts as a world of its own, so a job of N tasks looks like N jobs of one.
    """
    n = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if not n.isdigit() or int(n) <= size:
        return None
    from mpi4py import MPI

    plugin = "pmix" if MPI.Get_library_version().startswith("Open MPI") else "pmi2"
    return (
        f"srun started {n} tasks (SLURM_STEP_NUM_TASKS={n}) and MPI sees a world of {size} in each: this "
        f"srun gave MPI no process-management interface (the site's MpiDefault is none, or not one this MPI "
        f"speaks). Run it with `srun --mpi={plugin} -n {n} ...` (or `export SLURM_MPI_TYPE={plugin}`); "
        "`srun --mpi=list` shows the plugins the site has"
    )


def _strip_inherited_launcher_env() -> bool:
    """In a child process of a rank, drop the rank's launcher variables so MPI starts as a singleton."""
    import multiprocessing

    if multiprocessing.parent_process() is None:
        return False
    keys = [k for k in os.environ if k.startswith(_LAUNCHER_ENV_PREFIXES)]
    for k in keys:
        del os.environ[k]
    return bool(keys)


def _launcher_env() -> bool:
    """A launcher (or a served parent's leftovers, already stripped in children) set this process up."""
    return any(k in os.environ for k in ("PMI_SIZE", "PMI_FD", "PMI_PORT", "PMIX_NAMESPACE", "OMPI_COMM_WORLD_SIZE"))


_deferred = False


def defer_until_credentials() -> None:
    """This process (a Dask worker or nanny started outside any launcher) initialises MPI only once
    its scheduler's MPI service has handed it credentials (:mod:`mpi4dask.pm`): a world formed
    before would not be the cluster's."""
    global _deferred
    _deferred = True


def may_start() -> bool:
    """False while MPI should not be initialised yet (see :func:`defer_until_credentials`)."""
    if _init_future is not None or _world is not None or not _deferred:
        return True
    return _launcher_env() or _credentials.credentials() is not None


_init_future: concurrent.futures.Future | None = None
_relayed = False  # MPI_Init runs, or ran, through this process's PMI relay (mpi4dask._pmi)
_exiting = False  # the process's exit handlers reached _init_over_at_exit: no MPI_Init begins any more
# Seconds a process's exit waits for an MPI_Init under way through its relay (usually milliseconds).
EXIT_INIT_WAIT = 10.0


def start() -> concurrent.futures.Future:
    """Start initialising MPI on a daemon thread (once per process); the future yields the :class:`World`.

    Never blocks.  The future fails with :class:`MPIUnavailableError` when MPI cannot be used.
    """
    global _init_future
    with _lock:
        if _init_future is None:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_running_or_notify_cancel()  # no waiter that gives up may cancel it for the others
            _init_future = fut
            if _world is not None:
                fut.set_result(_world)
            else:
                atexit.register(_init_over_at_exit)
                threading.Thread(target=_init_thread, args=(fut,), name="mpi4dask-mpi-init", daemon=True).start()
        return _init_future


def _init_over_at_exit() -> None:
    """At exit, let an ``MPI_Init`` under way through this process's relay finish (Python's exit handlers
    run while daemon threads still do).  Its thread detaches the relay once ``MPI_Init`` returns, which
    answers ahead what ``MPI_Finalize`` will ask; a process exiting mid-init froze that thread before the
    detach, and mpi4py's ``MPI_Finalize`` (a C exit hook, after these) then waited for answers for ever:
    seen as a Dask worker closed right after it started (its nanny killed it after 4 s; without one
    it hung).  Under a launcher its process manager answers, and nothing waits here.

    From here on no ``MPI_Init`` begins (an init still joining the service gives up before it), and the
    UCX log handler that an init pushed meanwhile is popped here: exit handlers registered after the
    exit began are never called."""
    global _exiting
    with _lock:  # (_init decides under it whether MPI_Init goes ahead through the relay)
        _exiting = True
        fut, relayed = _init_future, _relayed
    if fut is not None and not fut.done() and relayed:
        try:
            fut.exception(timeout=EXIT_INIT_WAIT)
        except concurrent.futures.TimeoutError:
            logger.warning("mpi4dask: MPI_Init was still under way %.0f s after this process began to exit",
                           EXIT_INIT_WAIT)
    with _lock:
        _ucx.uninstall()


def service_refused() -> str | None:
    """Why MPI could not start here, when the cluster's MPI service could not be reached or refused this
    process (:class:`~mpi4dask._errors.MPIServiceError`); else None."""
    fut = _init_future
    if fut is None or not fut.done():
        return None
    exc = fut.exception()
    return str(exc) if isinstance(exc, MPIServiceError) else None


def exiting() -> bool:
    """This process has begun to exit (its exit handlers reached mpi4dask's): no MPI_Init begins."""
    return _exiting


def _init_thread(fut: concurrent.futures.Future) -> None:
    try:
        result = _init()
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for MPI
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _libmpi_paths() -> list[str]:
    """The files of the MPI libraries loaded in this process (Linux; else none)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "/libmpi" in line})
    except OSError:
        return []


def _loaded_libmpi():
    """The MPI libraries loaded in this process, as ctypes handles (whose calls release the GIL)."""
    import ctypes

    try:
        yield ctypes.CDLL(None)
    except OSError:
        pass
    for path in _libmpi_paths():
        try:
            yield ctypes.CDLL(path)
        except OSError:
            continue


def _libmpi_init_thread():
    """``MPI_Init_thread`` of the MPI library that mpi4py loaded, as a ctypes function, or None."""
    for lib in _loaded_libmpi():
        fn = getattr(lib, "MPI_Init_thread", None)
        if fn is not None:
            return fn
    return None


def _init_thread_level_multiple(MPI) -> None:
    """``MPI_Init_thread(MPI_THREAD_MULTIPLE)`` without holding the GIL, then what mpi4py's own
    initialisation would set up: errors raise exceptions instead of aborting the job."""
    import ctypes

    init = _libmpi_init_thread()
    if init is None:  # not on Linux: mpi4py's call holds the GIL while it waits for the other ranks
        logger.debug("mpi4dask: libmpi not found among the loaded libraries; MPI_Init runs through mpi4py")
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        return
    init.restype = ctypes.c_int
    init.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    provided = ctypes.c_int(-1)
    err = init(None, None, MPI.THREAD_MULTIPLE, ctypes.byref(provided))
    if err != 0:
        raise MPIUnavailableError(f"MPI_Init_thread failed with error code {err}")
    for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
        comm.Set_errhandler(MPI.ERRORS_RETURN)


def library_name(version: str) -> str:
    """The MPI library, as the first line of its ``MPI_Get_library_version`` text names it."""
    lines = version.strip().splitlines()
    return " ".join(lines[0].split(",")[0].split()) if lines else "an unknown MPI library"


def family_of(version: str) -> str:
    """``"mpich"``, ``"intel"`` (Intel MPI, MPICH-derived), ``"openmpi"`` or ``"other"``, from the
    ``MPI_Get_library_version`` text."""
    for prefix, name in (("MPICH", "mpich"), ("Intel(R) MPI", "intel"), ("Open MPI", "openmpi")):
        if version.startswith(prefix):
            return name
    return "other"


def sends_need_progress(version: str) -> bool:
    """Whether a large message moves only while *both* ends make MPI calls, from the
    ``MPI_Get_library_version`` text (then :mod:`mpi4dask._progress` tests both ends' requests
    steadily while in flight, not on timers that back off).

    MPICH 5 (single-copy CMA, on by default) and Open MPI (its single-copy smsc) copy on the receiver's
    calls alone.  MPICH 4 moves a large message between processes of a node through its shared-memory
    queue, 16 KiB cells filled and drained one per progress call of each side (measured with 4.3.2: an
    800 KB round trip took 55 ms with both sides testing every 1 ms, 2.3 ms under 5.0.2; with sends tested
    on timers, ``bench comm`` took 200 ms one way at 1 MiB and 1.8 s at 8 MiB).  Intel MPI's shared memory
    needs both sides too (``bench comm`` at 8 MiB: 176 ms with sends tested on timers, 0.7 ms raw), and so
    do its joined worlds (ofi over libfabric 1.17's tcp: a 128 KiB move between two LocalCluster workers
    took 11-18 s with both ends' tests backing off to 50 ms, ~0.45 s with a 1 ms cap)."""
    family = family_of(version)
    if family == "openmpi":
        return False
    if family == "mpich":
        first = version.strip().splitlines()[0] if version.strip() else ""
        major = first.split(":", 1)[-1].strip().split(".")[0]
        return not (major.isdigit() and int(major) >= 5)
    return True


def probes_ahead(version: str) -> bool:
    """Whether a reader that waits for a reply should match the reply's first MPI message before its
    header arrives (``_datapath._Receiver._probe_ahead``), from the ``MPI_Get_library_version`` text.

    Not under Intel MPI: a large message that its progress finds with no receive posted is copied whole
    into a buffer of the library's own (malloc'd) before a probe can match it, and again into the
    reader's buffer after.  Measured with impi-rt 2021.19 (2 ranks, quiet; raw mpi4py, a 5 MiB Isend
    against a loop of Improbe): matched 0.1 ms after the send, received 1.1 ms after it (a receive posted
    at once: 1.0 ms); in a process with glibc's trim threshold set, as distributed's Nanny sets it for
    every worker (``MALLOC_TRIM_THRESHOLD_=65536``: every large malloc is fresh pages), matched only
    4-5 ms after the send, received at 5-6 ms (a receive posted at once: 0.7-1.0 ms; ~1 ms per MiB,
    and the same with Iprobe).  ``bench comm`` mpi:// one way with probing / without, 1 MiB and 8 MiB:
    1339 / 427 us and 5336 / 1102 us with that setting, 649 / 480 us and 2377 / 1006 us without.
    MPICH 4 and 5 and Open MPI match without copying (with the setting, MPICH 4.3.2: 811 / 915 us and
    5830 / 6990 us, probing ahead faster; MPICH 5 and Open MPI: equal within the run's noise)."""
    return family_of(version) != "intel"


def library(MPI) -> str:
    """The MPI library mpi4py loaded (:func:`library_name`)."""
    return library_name(MPI.Get_library_version())


def _family(MPI) -> str:
    """The family of the MPI library mpi4py loaded (:func:`family_of`)."""
    return family_of(MPI.Get_library_version())


# Why a world of one that mpi4dask could not serve cannot join others, and the fix, by family
_OPENMPI_ALONE = (
    "{lib} starts a process that no launcher started as a singleton with no PMIx server, and Open MPI "
    "singletons cannot MPI_Comm_connect/accept (measured with Open MPI 5.0.11: MPI_ERR_INTERN on both "
    "sides); mpi4dask's MPI service speaks PMI-1, which Open MPI does not use, so it cannot serve it. "
    "Fix: start this cluster under Open MPI's launcher (`mpiexec -n N python script.py` with "
    "mpi4dask.initialize(), or `mpiexec -n N mpi4dask serve`), or give clusters that Dask starts MPICH "
    "(`pip install \"mpi4dask[mpich]\"`) or Intel MPI (`pip install impi-rt`) in place of Open MPI"
)
_SINGLETON = (
    "its MPI ({lib}) was initialised as a singleton before mpi4dask could serve it (e.g. `from mpi4py "
    "import MPI` at import, with mpi4py.rc.initialize left on), and singletons of this MPI cannot "
    "connect or accept. Fix: let mpi4dask start MPI in workers (import mpi4py.MPI only inside the "
    "function you pass to run_mpi)"
)
_UNSERVED = (
    "{lib} is not one that mpi4dask's MPI service can serve (it serves MPICH and Intel MPI over PMI-1), "
    "so this process runs as a singleton, which cannot connect or accept. Fix: start this cluster "
    "under that MPI's launcher (`mpiexec -n N python script.py` with mpi4dask.initialize()), or use "
    "MPICH (`pip install \"mpi4dask[mpich]\"`) or Intel MPI (`pip install impi-rt`)"
)


def _alone_reason(MPI, family: str, served: bool) -> str:
    """Why this process's MPI cannot join other worlds ("" when it can), naming the MPI and the fix."""
    text = _OPENMPI_ALONE if family == "openmpi" else _SINGLETON if family in ("mpich", "intel") else _UNSERVED
    return "" if served else text.format(lib=library(MPI))


def _check_intel_fabric() -> None:
    """Intel MPI joins other worlds over libfabric (OFI) only: its shared-memory fabric refuses with
    "shm fabric does not support Spawns".  Without a loadable libfabric ``MPI_Init`` aborts the
    process, so say so first."""
    import ctypes

    name = os.environ.get("I_MPI_OFI_LIBRARY", "libfabric.so.1")
    candidates = [name] + [os.path.join(os.path.dirname(path), name) for path in _libmpi_paths()]
    why = ""
    for candidate in candidates:
        try:
            ctypes.CDLL(candidate)
            return
        except OSError as exc:
            why = why or str(exc)
    raise MPIUnavailableError(
        f"Intel MPI needs libfabric to join other MPI processes (its fabric shm:ofi), and {name} cannot be "
        f"loaded ({why}). Install it (`pip install libfabric`, which the impi-rt wheel asks for), or point "
        "I_MPI_OFI_LIBRARY at a libfabric.so.1 (with its dependencies on LD_LIBRARY_PATH)"
    )


# The bytes UCX copies (CMA, ``process_vm_readv``) per progress call of the receiver, where worlds that are not
# one job meet on one host (a Dask-started cluster's workers: LocalCluster, ``dask worker``, dask-jobqueue).
# UCX's own 512 KiB (its TX quota: one segment per call) needs 600 calls of the receiver for 300 MB, and a
# receiver between calls waits for its loop: measured 2026-11-28, a 256 MiB move between the two workers of a
# LocalCluster beside 2 busy processes took 5-10 s in 2 runs of 4 (tcp:// 0.2-0.4 s).  8 MiB: one call copies
# in 1-3 ms (the loop is not held for long), and 38 calls move 300 MB.  Inside one ``mpiexec`` job MPICH copies
# between its own ranks without UCX, one call per message.
CMA_SEG_SIZE = "8m"


def _cma_usable() -> bool:
    """Whether UCX's single copy (CMA) can work here, as UCX itself finds out: no Yama restriction on
    ``ptrace`` (``kernel.yama.ptrace_scope`` absent or 0), and ``process_vm_readv`` allowed (a seccomp
    filter, as a container's, may refuse it).  Where it cannot, UCX never opens its CMA transport and prints
    ``UCX WARN unused environment variable: UCX_CMA_SEG_SIZE`` in every process (seen with
    ``UCX_TLS=^sm``), so mpi4dask sets the variable only where this is true."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() != "0":
                return False
    except FileNotFoundError:
        pass
    except OSError:
        return False
    import ctypes

    class _IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    try:
        readv = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return False
    src, dst = ctypes.create_string_buffer(b"cma", 8), ctypes.create_string_buffer(8)
    remote, local = _IoVec(ctypes.addressof(src), 8), _IoVec(ctypes.addressof(dst), 8)
    readv.restype = ctypes.c_ssize_t
    return readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 8 and dst.value == b"cma"


def _serve_world(MPI, version: str):
    """Before ``MPI_Init`` outside any launcher: give MPICH or Intel MPI a PMI connection to the
    cluster's MPI service (or, knowing none, to a responder in this process), so the world of one it
    forms can connect to others (:mod:`mpi4dask.pm`).  Returns the relay, or None under a launcher or
    with another MPI (which then starts as a singleton: see :func:`_alone_reason`).  ``version``: the
    ``MPI_Get_library_version`` text."""
    family = family_of(version)
    if family == "mpich" and "ch4:ucx" in version:
        # worlds that are not one job meet through the network module: UCX moves bytes between them at
        # shared-memory speed on one host (ofi: about half), and every side of a mixed cluster must agree
        os.environ.setdefault("MPICH_CH4_NETMOD", "ucx")
        if "UCX_TLS" not in os.environ and _cma_usable():  # (else UCX warns of a variable it never reads)
            os.environ.setdefault("UCX_CMA_SEG_SIZE", CMA_SEG_SIZE)
    if _launcher_env() or family not in ("mpich", "intel"):
        return None
    if family == "intel":
        # Intel MPI gives a world on one host its shm fabric alone, which cannot connect or accept
        os.environ.setdefault("I_MPI_FABRICS", "shm:ofi")
        if os.environ["I_MPI_FABRICS"] != "shm":
            _check_intel_fabric()
    answers = _pmi.INTEL_MPI_FINALIZE if family == "intel" else _pmi.MPICH_FINALIZE
    creds = _credentials.credentials()
    relay = _pmi.join(creds, finalize_answers=answers) if creds is not None else _pmi.local(answers)
    os.environ.update(PMI_FD=str(relay.theirs.fileno()), PMI_RANK="0", PMI_SIZE="1")
    return relay


def world() -> World:
    """Initialise MPI if needed (thread level MULTIPLE) and describe this process's world.

    Blocks until ``MPI_Init`` has returned: under ``mpiexec`` that is when every rank has called
    it.  Never call it on an event loop (use :func:`start` and await the future there).

    Raises :class:`MPIUnavailableError` when mpi4py or the MPI library cannot be loaded, or when
    MPI was already initialised without ``MPI_THREAD_MULTIPLE``.
    """
    if _world is not None:
        return _world
    return start().result()


def _init() -> World:
    """The body of the initialisation thread (see the module docstring)."""
    global _world, _relayed
    stripped = _strip_inherited_launcher_env()
    try:
        import mpi4py
    except ImportError as exc:
        raise MPIUnavailableError(f"mpi4dask needs mpi4py, which is not importable ({exc}). {_INSTALL_HINT}") from exc
    if "mpi4py.MPI" not in sys.modules:
        # mpi4py would call MPI_Init at import, holding the GIL while it waits for the other ranks:
        # every thread of this process, its event loops too, would stop. Import it without init.
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True  # mpi4py still finalizes MPI at exit
    mpi4py.rc.thread_level = "multiple"
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:
        raise MPIUnavailableError(
            f"mpi4dask could not load or initialise the MPI library through mpi4py {mpi4py.__version__} "
            f"({type(exc).__name__}: {exc}). {_INSTALL_HINT}"
        ) from exc
    version = MPI.Get_library_version()  # (callable before MPI_Init)
    family = family_of(version)
    relay = None
    try:
        if not MPI.Is_initialized():
            relay = _serve_world(MPI, version)
            with _lock:  # against _init_over_at_exit: either it waits for this MPI_Init, or none begins
                if _exiting:
                    raise MPIUnavailableError("this process began to exit before MPI_Init")
                _relayed = relay is not None
            _init_thread_level_multiple(MPI)
        level = MPI.Query_thread()
    except MPIUnavailableError:
        raise
    except Exception as exc:  # MPI.Exception and friends
        raise MPIUnavailableError(
            f"MPI failed to initialise ({type(exc).__name__}: {exc}). If this process was started by "
            "mpiexec, check that mpiexec belongs to the same MPI as mpi4py "
            f"({library(MPI)}). "
            f"{_INSTALL_HINT}"
        ) from exc
    finally:
        if relay is not None:
            relay.detach()  # MPI_Init is over: the service is not needed any more (see mpi4dask._pmi)
            for k in ("PMI_FD", "PMI_RANK", "PMI_SIZE"):
                os.environ.pop(k, None)  # read by MPICH; a child process must not take them for its own
    if level < MPI.THREAD_MULTIPLE:
        names = {
            MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
            MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
            MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
        }
        raise MPIUnavailableError(
            f"MPI runs at thread level {names.get(level, level)}, but mpi4dask needs MPI_THREAD_MULTIPLE "
            "(Dask calls MPI from its event loops and worker threads). Let mpi4py initialise MPI with its "
            "default `mpi4py.rc.thread_level = 'multiple'`, and use an MPI library built with thread support."
        )
    comm = MPI.COMM_WORLD
    tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
    dynamic = relay is not None or bool(_launcher_job_key()) or comm.Get_size() > 1
    _world = World(
        MPI=MPI,
        comm=comm,
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        job_key=_launcher_job_key(),
        host=socket.gethostname(),
        pid=os.getpid(),
        tag_ub=int(tag_ub),
        served=relay.kvsname if relay is not None else "",
        dynamic=dynamic,
        alone=_alone_reason(MPI, family, dynamic),
        sends_need_progress=sends_need_progress(version),
        probes_ahead=probes_ahead(version),
    )
    with _lock:
        if not _exiting:  # (else its pop, an exit handler, would never be called)
            _ucx.install()
    if _world.size == 1:
        _unlink_own_shm()
    if stripped:
        logger.info(
            "mpi4dask: process %d was spawned by an MPI rank (e.g. by a Nanny); it runs as its own "
            "MPI world of one, so its connections use TCP. Run workers in-process (--no-nanny, or "
            "mpi4dask.initialize) to keep them on MPI.",
            os.getpid(),
        )
    return _world


def _unlink_own_shm() -> None:
    """Remove the name of this world's shared-memory file, which MPICH (``/dev/shm/mpich_shm_*``, 1 MiB)
    removes only in ``MPI_Finalize``: a process killed before (SIGKILL; SIGTERM, which the Nanny sends
    a worker over its memory limit) left it behind, in the RAM-backed ``/dev/shm``, for good.  In a world
    of one process (every worker of a Dask cluster that did not come from mpiexec) no other process
    opens it by name, so the name can go now: the mapping stays, the kernel frees the memory with the
    process however it ends, and MPICH's own removal at finalize finds nothing to do (measured: silent)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[-1].strip() for line in f if "/dev/shm/mpich_shm_" in line}
    except OSError:  # no /proc: nothing to do
        return
    for path in sorted(paths):
        if path.endswith(" (deleted)"):
            continue
        try:
            os.unlink(path)
        except OSError as exc:
            logger.debug("mpi4dask: could not remove %s: %s", path, exc)


def delays(first: float, longest: float):
    """Sleeps between two tests of something MPI is doing: ``first`` seconds, doubling up to
    ``longest``, forever.  The one pacing of every wait on MPI in this package: a wait that ends
    at once costs little, a long one a test per ``longest`` seconds instead of a spinning core
    (MPICH's blocking waits busy-poll)."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, longest)


def initialized_by_others() -> bool:
    """MPI is up in this process, and not through mpi4dask (dask-mpi, the user's code).

    False while mpi4dask's own initialisation is under way: ``mpi4py.MPI`` may then be a module
    still being imported on the initialisation thread (measured: ``AttributeError`` from a probe of
    a partly imported module)."""
    if _init_future is not None:
        return False
    mpi = sys.modules.get("mpi4py.MPI")
    probe, done = getattr(mpi, "Is_initialized", None), getattr(mpi, "Is_finalized", None)
    return probe is not None and done is not None and probe() and not done()


def initialized_world() -> World | None:
    """The world if MPI was already set up by mpi4dask, else None (never initialises MPI)."""
    return _world


_per_world: dict[str, object] = {}  # per_world()'s objects, by key


def per_world(key: str, make, w: World):
    """The object ``make(w)`` for this process's world ``w``, made once per process for ``key`` (under
    this module's lock, whichever thread asks first) and kept for the life of MPI: the ``mpi://``
    transport's endpoint (:func:`mpi4dask._endpoint.get`), which event loops of several threads may ask
    for at once."""
    with _lock:
        obj = _per_world.get(key)
        if obj is None:
            obj = _per_world[key] = make(w)
    return obj


# --------------------------------------------------------------------------------------------
# joining other worlds safely (see the module docstring)

JOIN_GRACE = 5.0  # seconds past MPICH's own join timeout before MPI waits inside a join fail (MPICH may overrun it)
_joins_unsafe = ""  # why this process must not join another world again ("" while it may)
_user_code = 0  # run_mpi functions running in this process now
_bound_lock = threading.Lock()
_bound_handle = None  # the MPI_T handle of MPIR_CVAR_PROGRESS_TIMEOUT (False: none to be had)
_bounded = False  # MPI waits that begin now are bounded (a join is under way)


def error_text(exc: BaseException) -> str:
    """The telling part of an exception's text (MPICH's error stacks end with it)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1].removeprefix("(unknown)(): ") if lines else type(exc).__name__


def joins_unsafe() -> str:
    """Why this process must not join another world again, or "" while it may."""
    return _joins_unsafe


def running_user_code() -> bool:
    """A ``run_mpi`` function runs in this process now (see :func:`user_code`)."""
    return _user_code > 0


@contextlib.contextmanager
def user_code():
    """Around a ``run_mpi`` function: its MPI waits are never bounded by :func:`joining`."""
    global _user_code, _bounded
    with _bound_lock:
        _user_code += 1
        _unbound(world().MPI)  # a join is under way: from now on its waits go unbounded, not this code's
    try:
        yield
    finally:
        with _bound_lock:
            _user_code -= 1


def _progress_timeout_handle(MPI):
    """MPICH's ``MPIR_CVAR_PROGRESS_TIMEOUT`` through MPI_T (ctypes), or False where there is none."""
    global _bound_handle
    if _bound_handle is None:
        _bound_handle = False
        if _family(MPI) == "mpich":
            import ctypes

            for lib in _loaded_libmpi():
                if getattr(lib, "MPI_T_cvar_handle_alloc", None) is None:
                    continue
                provided, index, handle, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p(), ctypes.c_int()
                if (lib.MPI_T_init_thread(3, ctypes.byref(provided)) == 0
                        and lib.MPI_T_cvar_get_index(b"MPIR_CVAR_PROGRESS_TIMEOUT", ctypes.byref(index)) == 0
                        and lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) == 0):
                    # written while holding the GIL (a PyDLL call): the write takes microseconds, and a join
                    # that let the GIL go here could wait for a task holding it before it enters MPI
                    write = ctypes.PyDLL(lib._name, handle=lib._handle).MPI_T_cvar_write
                    _bound_handle = (write, handle)
                break
    return _bound_handle


def _set_progress_timeout(MPI, seconds: int) -> bool:
    import ctypes

    found = _progress_timeout_handle(MPI)
    if not found:
        return False
    write, handle = found
    value = ctypes.c_int(seconds)
    return write(handle, ctypes.byref(value)) == 0


def _unbound(MPI) -> None:
    """MPI waits that begin from now on are not bounded by a join any more (hold ``_bound_lock``)."""
    global _bounded
    if _bounded:
        _bounded = not _set_progress_timeout(MPI, 0)


def prepare_joining() -> None:
    """Find, ahead of any join, what :func:`joining` calls (the MPI_T handle): finding it lets the GIL go."""
    _progress_timeout_handle(world().MPI)


@contextlib.contextmanager
def joining(what: str, timeout: float, first=None):
    """Around ``MPI_Comm_accept``/``connect`` with another world (see the module docstring);
    ``timeout`` is the one given to MPICH (info key "timeout").

    Raises :class:`RuntimeError` at once in a process that must not join again; then runs ``first()``
    (the last step before MPI: what it raises is no failed join); marks the process when the join
    fails; MPI waits that begin inside fail after ``timeout + JOIN_GRACE`` seconds (none while
    ``run_mpi`` code runs here)."""
    global _joins_unsafe, _bounded
    if _joins_unsafe:
        raise RuntimeError(f"mpi4dask: this process no longer joins other MPI worlds: {_joins_unsafe}")
    MPI = world().MPI
    with _bound_lock:
        _bounded = _user_code == 0 and _set_progress_timeout(MPI, max(1, int(timeout + JOIN_GRACE)))
    if first is not None:  # last: once the peer may be in MPI, nothing but the MPI call follows
        try:
            first()
        except BaseException:
            with _bound_lock:
                _unbound(MPI)
            raise
    try:
        yield
    except BaseException as exc:
        _joins_unsafe = (f"{what} failed ({error_text(exc)}); "
                         f"with this MPI ({library(MPI)}) another join could crash the process, so it joins none "
                         "until it restarts")
        raise
    finally:
        with _bound_lock:
            _unbound(MPI)
