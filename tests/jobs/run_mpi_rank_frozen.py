"""A run_mpi participant dies while another one's worker is frozen (tests/test_resilience.py,
test_run_mpi_frozen_rank_is_restarted_by_its_nanny).

Usage: run_mpi_rank_frozen.py PROTOCOL      (mpi or tcp: the LocalCluster's)

Once rank 1 tells it that it is past the allgather, rank 2 of fn stops rank 0's worker process
(SIGSTOP: its event loop answers nothing, as a worker whose MPI holds its lock), then rank 1 SIGKILLs
its own worker.  The call must raise MPIJobError(lost=True); rank 0's worker cannot end itself, so its
Nanny must replace it; each of the 3 workers is replaced exactly once and the next call answers right.
Prints one ``RESULT <json>`` line.
"""

import json
import os
import signal
import sys
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster
from run_mpi_rank_dies import churn  # (this directory is the script's: sys.path[0])

import mpi4dask


def fn(comm, parts, mark):
    local = sum(float(np.asarray(b).sum()) for b in parts.values())
    pids = comm.allgather(os.getpid())
    if not os.path.exists(mark):
        # rank 0 is stopped only once ranks 1 and 2 are both past the allgather: stopped inside it, rank 0
        # could still owe rank 1 its part, which then waited there for ever and never died (2 runs of 17 hung so)
        if comm.Get_rank() == 2:
            comm.recv(source=1)
            os.kill(pids[0], signal.SIGSTOP)
        if comm.Get_rank() == 1:
            comm.send("past the allgather", dest=2)
            time.sleep(0.5)  # rank 0 is stopped, rank 2 waits in the allreduce by now
            with open(mark, "w") as f:
                f.write(json.dumps({"t": time.time(), "frozen": pids[0]}))
            os.kill(os.getpid(), signal.SIGKILL)
    return comm.Get_size(), comm.allreduce(local)


if __name__ == "__main__":
    with LocalCluster(protocol=sys.argv[1], n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        names = sorted(w["name"] for w in client.scheduler_info()["workers"].values())
        x = da.random.default_rng(0).random((3000, 3000), chunks=(1000, 1000)).persist()
        ref = float(np.asarray(x).sum())
        out = {}
        since = time.time()
        try:
            mpi4dask.run_mpi(fn, x, mark="mark", workers=names)
            out["first"] = None
        except mpi4dask.MPIJobError as e:
            marked = json.loads(open("mark").read())
            out["first"] = {"lost": e.lost, "rank": e.rank, "message": str(e),
                            "kill_to_error": time.time() - marked["t"]}
            try:
                os.kill(marked["frozen"], 0)
                out["frozen_alive"] = True
            except ProcessLookupError:
                out["frozen_alive"] = False
        client.wait_for_workers(3, timeout=60)
        r = mpi4dask.run_mpi(fn, x, mark="mark", workers=names)
        out["next"] = {"sizes": [s for s, _ in r], "right": all(abs(v - ref) <= 1e-9 * ref for _, v in r),
                       "churn": churn(client, since)}
    print("RESULT " + json.dumps(out), flush=True)
