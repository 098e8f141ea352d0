"""A cluster closed right after a run_mpi call, as a script does (tests/test_handoff.py,
test_cluster_closed_right_after_run_mpi_closes_quietly).

Usage: run_mpi_close_after.py PROTOCOL

Three LocalClusters (worker processes), each closed the moment run_mpi returned or raised: after a
call that succeeded, after one whose fn raised on one rank while the others were still running,
and after one whose result cannot be sent back.  Prints one ``RESULT <json>`` line: what each call
gave (stderr is the test's to read: nothing there may say a release failed).
"""

import json
import sys
import threading
import time

from distributed import Client, LocalCluster

import mpi4dask


def total(comm):
    return comm.allreduce(comm.Get_rank() + 1)


def raises_on_one(comm):
    if comm.Get_rank() == 1:
        raise ValueError("bad on rank 1")
    time.sleep(1)
    return 0


def unsendable(comm):
    return threading.Lock()


if __name__ == "__main__":
    out = {}
    for name, fn in (("ok", total), ("raises", raises_on_one), ("unsendable", unsendable)):
        with LocalCluster(protocol=sys.argv[1], n_workers=3, threads_per_worker=1, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            workers = sorted(client.scheduler_info()["workers"])
            try:
                out[name] = mpi4dask.run_mpi(fn, workers=workers, timeout=60)
            except mpi4dask.MPIJobError as e:
                out[name] = ["MPIJobError", e.rank, type(e.__cause__).__name__]
    print("RESULT " + json.dumps(out), flush=True)
