"""run_mpi with a function defined in this script's ``__main__`` (pickled by value, as most users' are):
the MPIJobError names this file and its failing line, in its text and in its cause's traceback.
Writes what it saw as JSON to argv[1]."""

import json
import sys
import traceback

import dask.array as da
from distributed import Client, LocalCluster

import mpi4dask


def check_block(block):
    if block.sum() > 1000:
        raise ValueError("a block over 1000 on purpose")  # FAILING LINE
    return block


def sum_blocks(comm, parts, check):
    total = sum(float(check(b).sum()) for b in parts.values())
    return comm.allreduce(total)


if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        x = da.arange(100, chunks=25).persist()
        assert mpi4dask.run_mpi(sum_blocks, x, check=lambda b: b)[0] == sum(range(100))
        try:
            mpi4dask.run_mpi(sum_blocks, x * 100, check=check_block)
        except mpi4dask.MPIJobError as e:
            out = {"text": str(e), "remote": e.remote_traceback,
                   "cause": "".join(traceback.format_exception(e.__cause__))}
        else:
            out = {"text": "no MPIJobError"}
    json.dump(out, open(sys.argv[1], "w"))
