"""The error type that several of mpi4dask's modules raise (private): kept apart so that none of them
has to import another just for it."""

from __future__ import annotations


class MPIUnavailableError(RuntimeError):
    """MPI cannot be used in this process; the message says why and how to fix it."""
