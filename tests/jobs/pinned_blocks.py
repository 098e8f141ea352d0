"""run_mpi over blocks pinned (``workers=``, strict) to a worker that then restarts (new address).

The blocks are lost with it and distributed can run them on no worker: run_mpi must say so, at
once, not wait for ever.  Prints one ``RESULT <json>`` line.
"""

import json
import time

import numpy as np
from distributed import Client, LocalCluster

import mpi4dask


def make(i):
    return np.full(1000, i, dtype=np.int64)


def total(comm, parts):
    return comm.allreduce(sum(int(b.sum()) for b in parts.values()))


if __name__ == "__main__":
    with LocalCluster(protocol="mpi", n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        A, B = sorted(client.scheduler_info()["workers"])
        blocks = [client.submit(make, i, workers=[A], pure=False) for i in range(4)]
        out = {"before": mpi4dask.run_mpi(total, blocks, timeout=60)}
        client.restart_workers([A])  # A's Nanny starts a new worker, at a new address: the blocks are lost
        t0 = time.monotonic()
        try:
            mpi4dask.run_mpi(total, blocks, timeout=60)
            out["after"] = None
        except mpi4dask.MPIJobError as e:
            out["after"] = {"message": str(e), "lost": e.lost}
        out["seconds"] = time.monotonic() - t0
    print("RESULT " + json.dumps(out), flush=True)
