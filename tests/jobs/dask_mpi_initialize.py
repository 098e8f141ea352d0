"""dask-mpi's own ``initialize(protocol="mpi")`` runs over mpi:// (tests/test_launcher.py,
test_dask_mpi_initialize_protocol_mpi).  Run with ``mpiexec -n 4``; prints the CHECK line of ``_check.check``.
"""

from _check import check

# isort: off
from mpi4py import MPI  # noqa: F401  (dask-mpi PR #100: MPI before distributed, which dask_mpi imports)
import dask_mpi
# isort: on

dask_mpi.initialize(protocol="mpi", dashboard=False, memory_limit="2GiB")
from distributed import Client  # noqa: E402  (what the client rank runs once initialize() returns)

with Client() as client:
    check(client, 2)
