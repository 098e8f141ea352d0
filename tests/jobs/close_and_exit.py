"""A LocalCluster of processes computes with moves between its workers, then closes, and the script ends
(tests/test_comm_mpi.py, test_a_cluster_closes_and_its_script_exits_as_fast_as_over_tcp).

Usage: close_and_exit.py PROTOCOL

Prints one ``RESULT <json>`` line, as the script's last act: whether the sum was right, how long
``cluster.close()`` took, how long its exit will wait for late MPI messages (None without MPI), and the
time (``time.monotonic()``, one clock for every process of the machine) when it printed.
"""

import json
import sys
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

if __name__ == "__main__":
    cluster = LocalCluster(protocol=sys.argv[1], n_workers=2, threads_per_worker=1, processes=True,
                           dashboard_address=None)
    client = Client(cluster)
    x = da.random.default_rng(0).random((2000, 2000), chunks=(500, 500))  # 2 MB blocks, moved between workers
    a = np.asarray(x.compute(scheduler="sync"))
    got = float((x + x.T).sum().compute())
    client.close()
    t0 = time.monotonic()
    cluster.close()
    close_s = time.monotonic() - t0

    from mpi4dask import _endpoint

    ep = _endpoint.current()
    quiet = None if ep is None else ep._exit_quiet(time.monotonic() - ep.RECENT)
    out = {"right": abs(got - float((a + a.T).sum())) <= 1e-9 * abs(got), "close_s": close_s,
           "exit_quiet": quiet}
    print("RESULT " + json.dumps({**out, "end": time.monotonic()}), flush=True)
