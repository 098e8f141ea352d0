"""The error type that several of mpi4dask's modules raise (private): kept apart so that none of them
has to import another just for it."""

from __future__ import annotations


class MPIUnavailableError(RuntimeError):
    """MPI cannot be used in this process; the message says why and how to fix it."""


class MPIServiceError(MPIUnavailableError):
    """The cluster's MPI service (in the scheduler: :mod:`mpi4dask.pm`) could not be reached, or refused
    this process, before ``MPI_Init``: a Dask-started worker whose scheduler went away.  Its ``mpi://``
    connections then carry their messages on their sockets, as before it had the cluster's credentials."""
