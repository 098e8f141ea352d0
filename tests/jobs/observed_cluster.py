"""A LocalCluster(protocol="mpi") with a workload, kept running for tests/test_observability.py.

Usage: ``python observed_cluster.py DIR NBYTES``.  Two worker processes; NBYTES made on one worker and summed on
the other; one ``run_mpi``; a client of another process (whose connection to the scheduler falls back to the
socket).  Then it writes DIR/ready.json (the scheduler's and workers' HTTP addresses, who sent, the run_mpi
answer, the pids) and keeps the cluster up until DIR/done exists.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import mpi4dask


def make(n):
    return np.ones(n, dtype=np.uint8)


def total(a):
    return int(a.sum(dtype=np.uint64))


def allreduce(comm, parts):
    return comm.allreduce(comm.Get_rank() + 1)


if __name__ == "__main__":
    import dask.array as da
    from distributed import Client, LocalCluster

    here, nbytes = Path(sys.argv[1]), int(sys.argv[2])
    with LocalCluster(protocol="mpi", processes=True, n_workers=2, threads_per_worker=1,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        info = client.scheduler_info()
        a, b = sorted(info["workers"])
        x = client.submit(make, nbytes, workers=[a], pure=False)
        s = client.submit(total, x, workers=[b], allow_other_workers=False).result()
        assert s == nbytes, s
        arr = da.ones((4,), chunks=2).persist()
        out = mpi4dask.run_mpi(allreduce, arr)
        # a client of another process, not of this cluster: its connection to the scheduler falls back
        stranger = subprocess.run(
            [sys.executable, "-c", "import sys; from distributed import Client; "
             "c = Client(sys.argv[1], timeout=30); c.scheduler_info(); c.close()", cluster.scheduler_address],
            capture_output=True, text=True, timeout=60)
        assert stranger.returncode == 0, stranger.stderr
        ready = {
            "scheduler": cluster.scheduler_address,
            "scheduler_http": f"http://127.0.0.1:{cluster.scheduler.http_server.port}",
            "workers": {w: f"http://127.0.0.1:{info['workers'][w]['services']['dashboard']}" for w in (a, b)},
            "sender": a, "receiver": b, "run_mpi": out, "pids": client.run(os.getpid),
        }
        (here / "ready.json.tmp").write_text(json.dumps(ready))
        os.replace(here / "ready.json.tmp", here / "ready.json")
        while not (here / "done").exists():
            time.sleep(0.1)
    print("RESULT done", flush=True)
