"""run_mpi on clusters that other launchers made, whose workers are MPI ranks but whose comm is tcp://
(tests/test_handoff.py, test_other_launchers).  Run with ``mpiexec -n 4``.

Usage: other_launchers.py dask-mpi|initialize-tcp

Prints ``OTHER LAUNCHER OK <results>`` when every rank's allreduce is right.
"""
import sys

import dask.array as da
import numpy as np

if sys.argv[1] == "dask-mpi":
    # isort: off
    from mpi4py import MPI  # noqa: F401  (dask-mpi PR #100: MPI before distributed, which dask_mpi imports)
    import dask_mpi
    # isort: on
    dask_mpi.initialize(dashboard=False, memory_limit="2GiB")
else:
    import mpi4dask
    mpi4dask.initialize(protocol="tcp")
from distributed import Client

import mpi4dask


def allreduce_sum(comm, parts):
    return comm.allreduce(sum(float(b.sum()) for b in parts.values())), comm.size


with Client() as client:
    client.wait_for_workers(2)
    x = da.arange(1000.0, chunks=100)
    res = mpi4dask.run_mpi(allreduce_sum, x, workers=list(client.scheduler_info()["workers"]))
    assert all(total == float(np.arange(1000.0).sum()) and size == 2 for total, size in res), res
    print("OTHER LAUNCHER OK", res, flush=True)
