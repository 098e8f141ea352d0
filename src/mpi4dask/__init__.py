"""mpi4dask: Dask and MPI, joined in both directions.

* ``mpi://host:port`` addresses (``protocol="mpi"``): a ``distributed`` comm backend whose messages
  travel over MPI point-to-point (module :mod:`mpi4dask.comm`, registered as an entry point).
* :func:`initialize`: turn an ``mpiexec``-launched script into a Dask cluster.
* :func:`run_mpi` / :func:`map_blocks_mpi`: call an MPI function inside the workers, on the chunks of
  Dask collections they hold, with a communicator of just those workers (module :mod:`mpi4dask.handoff`).
* :func:`connections`: this process's ``mpi://`` connections, their transport and bytes moved.
* Any Dask cluster (``LocalCluster``, ``dask worker``...): a scheduler listening on ``mpi://`` (or
  :func:`run_mpi` on any scheduler) starts an MPI process-manager service through which its
  workers join MPI without ``mpiexec`` (module :mod:`mpi4dask.pm`).
* ``mpi4dask serve`` / ``mpi4dask bench``: the command line (``python -m mpi4dask --help``).

Importing this package does not initialise MPI; the first use of the ``mpi`` protocol does.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["initialize", "run_mpi", "map_blocks_mpi", "connections", "MPIJobError", "MPIUnavailableError",
           "__version__"]


def __getattr__(name):
    # lazy: `import mpi4dask` stays cheap and never touches MPI or starts distributed machinery
    if name == "initialize":
        from .launcher import initialize

        return initialize
    if name in ("run_mpi", "map_blocks_mpi", "MPIJobError"):
        from . import handoff

        return getattr(handoff, name)
    if name == "connections":
        from .comm import connections

        return connections
    if name == "MPIUnavailableError":
        from ._errors import MPIUnavailableError

        return MPIUnavailableError
    raise AttributeError(f"module 'mpi4dask' has no attribute {name!r}")
