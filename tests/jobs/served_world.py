"""A process no launcher started forms its MPI world through mpi4dask (tests/test_mpi_init.py,
test_intel_mpi_served_world_and_missing_libfabric).

Prints ``SERVED <name> <size>``, or ``REFUSED <the error>`` when mpi4dask refuses to start MPI.
"""
import mpi4dask
from mpi4dask import _mpi

try:
    w = _mpi.world()
    print("SERVED", w.served, w.size, flush=True)
except mpi4dask.MPIUnavailableError as exc:
    print("REFUSED", exc, flush=True)
