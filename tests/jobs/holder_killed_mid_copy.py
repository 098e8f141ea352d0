"""A worker SIGKILLed while another worker copies a large result out of it over MPI (tests/test_resilience.py,
test_a_worker_killed_mid_copy_fails_the_move_not_its_reader).

On one LocalCluster(protocol="mpi") of 2 workers, up to len(DELAYS) times: worker H (the holder; a fresh one
each time, Dask's restart of the last) makes a 512 MiB array; worker R (the reader, the same process
throughout) is asked for its sum; as soon as R has the array in flight, H is killed.  MPICH moves such a message
with one copy that R makes out of H's memory; a kill during that copy makes the copy fail.

Prints one ``RESULT <json>`` line: per attempt, whether R and H were joined over MPI before the move, whether
R's copy was cut (R's mpi4dask._ucx.failed holds H's pid) and the sum Dask returned (recomputed elsewhere);
R's address and pid before and after.
"""

import json
import os
import signal
import time

import _holders
import numpy as np
from distributed import Client, LocalCluster, wait

DELAYS = (0.0, 0.01, 0.02, 0.04, 0.08, 0.16)  # seconds from "in flight" to the kill, one per attempt
N = 512 * 2**20 // 8  # float64 ones: the sum is N


def ones():
    return np.ones(N)


def total(x):
    return float(x.sum())


def in_flight(key, dask_worker=None):
    ts = dask_worker.state.tasks.get(key)
    return ts is not None and ts.state == "flight"


def small():
    return np.ones(10)


def mpi_peers():
    import mpi4dask

    return sorted({c["peer"] for c in mpi4dask.connections() if c["transport"] == "mpi"})


def cut_copies():
    from mpi4dask import _ucx

    return sorted(_ucx.failed)


if __name__ == "__main__":
    with LocalCluster(protocol="mpi", n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        R, pid_r = _holders.reader(client)
        attempts = []
        for delay, H, pid_h in _holders.holders(client, R, DELAYS):
            # a first move joins R and H over MPI (a kill during that join would test the join, not the copy)
            client.submit(total, client.submit(small, workers=[H], pure=False), workers=[R], pure=False).result()
            over_mpi = H in client.run(mpi_peers, workers=[R])[R]
            big = client.submit(ones, workers=[H], allow_other_workers=True, pure=False)
            wait(big)
            got = client.submit(total, big, workers=[R], pure=False)
            deadline = time.monotonic() + 30
            while not client.run(in_flight, big.key, workers=[R])[R] and time.monotonic() < deadline:
                pass
            time.sleep(delay)  # later into the move at each attempt, until one kill cuts a copy
            os.kill(pid_h, signal.SIGKILL)
            s = got.result(timeout=60)
            cut = pid_h in client.run(cut_copies, workers=[R])[R]
            attempts.append({"holder_pid": pid_h, "delay": delay, "over_mpi": over_mpi, "cut": cut, "sum": s})
            del big, got
            if cut:
                break
        workers = client.scheduler_info()["workers"]
        out = {"n": N, "attempts": attempts, "reader_still_there": R in workers,
               "reader_pid": pid_r, "reader_pid_now": client.run(os.getpid, workers=[R])[R] if R in workers else None}
    print("RESULT " + json.dumps(out), flush=True)
