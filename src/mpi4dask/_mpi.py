"""Lazy, checked access to MPI (private).

``import distributed`` and ``import mpi4dask`` never touch MPI.  MPI is initialised the first time
something needs it (the ``mpi://`` backend, :func:`mpi4dask.initialize`), and a missing or broken
MPI stack gives an :class:`MPIUnavailableError` that says what to do.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass

logger = logging.getLogger("mpi4dask")

# Environment variables through which launchers (hydra, PMIx/PRRTE, Open MPI, Slurm) hand a rank
# its identity.  A process spawned by a rank (a Nanny's worker, a multiprocessing child) inherits
# them but is not that rank: it must not initialise MPI as if it were.
_LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "PRTE_", "HYDRA_", "HYDI_", "MPI_LOCAL")

_INSTALL_HINT = (
    "Install the embedded default with `pip install mpi4py mpich`, or build mpi4py against your "
    "system MPI (`pip install --no-binary mpi4py mpi4py` with that MPI's mpicc on PATH; see the "
    "mpi4dask README, section 'Using a system MPI')."
)


class MPIUnavailableError(RuntimeError):
    """MPI cannot be used in this process; the message says why and how to fix it."""


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


_lock = threading.Lock()
_world: World | None = None


def _launcher_job_key() -> str:
    """An identity of the launch that every rank of one job shares, where the launcher gives one."""
    env = os.environ
    for names in (
        ("PMIX_NAMESPACE",),
        ("OMPI_MCA_ess_base_jobid",),
        ("SLURM_JOB_ID", "SLURM_STEP_ID"),
        ("PBS_JOBID",),
        ("LSB_JOBID",),
    ):
        if all(n in env for n in names):
            return "|".join(f"{n}={env[n]}" for n in names)
    return ""


def launched_with_peers() -> bool:
    """True when a launcher started this process as one of several ranks (MPI_Init is collective then)."""
    import multiprocessing

    if _world is not None:
        return _world.size > 1
    if multiprocessing.parent_process() is not None:
        return False  # a rank's child: it will run as a world of its own
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value) > 1
    return False


def _strip_inherited_launcher_env() -> bool:
    """In a child process of a rank, drop the rank's launcher variables so MPI starts as a singleton."""
    import multiprocessing

    if multiprocessing.parent_process() is None:
        return False
    keys = [k for k in os.environ if k.startswith(_LAUNCHER_ENV_PREFIXES)]
    for k in keys:
        del os.environ[k]
    return bool(keys)


def world() -> World:
    """Initialise MPI if needed (thread level MULTIPLE) and describe this process's world.

    Raises :class:`MPIUnavailableError` when mpi4py or the MPI library cannot be loaded, or when
    MPI was already initialised without ``MPI_THREAD_MULTIPLE``.
    """
    global _world
    if _world is not None:
        return _world
    with _lock:
        if _world is not None:
            return _world
        stripped = _strip_inherited_launcher_env()
        try:
            import mpi4py
        except ImportError as exc:
            raise MPIUnavailableError(f"mpi4dask needs mpi4py, which is not importable ({exc}). {_INSTALL_HINT}") from exc
        mpi4py.rc.thread_level = "multiple"
        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError, OSError) as exc:
            raise MPIUnavailableError(
                f"mpi4dask could not load or initialise the MPI library through mpi4py {mpi4py.__version__} "
                f"({type(exc).__name__}: {exc}). {_INSTALL_HINT}"
            ) from exc
        try:
            if not MPI.Is_initialized():
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
            level = MPI.Query_thread()
        except Exception as exc:  # MPI.Exception and friends
            raise MPIUnavailableError(
                f"MPI failed to initialise ({type(exc).__name__}: {exc}). If this process was started by "
                f"mpiexec, check that mpiexec belongs to the same MPI as mpi4py ({MPI.Get_library_version().splitlines()[0]}). "
                f"{_INSTALL_HINT}"
            ) from exc
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
        _world = World(
            MPI=MPI,
            comm=comm,
            rank=comm.Get_rank(),
            size=comm.Get_size(),
            job_key=_launcher_job_key(),
            host=socket.gethostname(),
            pid=os.getpid(),
            tag_ub=int(tag_ub),
        )
        if stripped:
            logger.info(
                "mpi4dask: process %d was spawned by an MPI rank (e.g. by a Nanny); it runs as its own "
                "MPI world of one, so its connections use TCP. Run workers in-process (--no-nanny, or "
                "mpi4dask.initialize) to keep them on MPI.",
                os.getpid(),
            )
        return _world


def initialized_world() -> World | None:
    """The world if MPI was already set up by mpi4dask, else None (never initialises MPI)."""
    return _world
