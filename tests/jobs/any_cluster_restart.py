"""Workers restarted by their Nanny (``client.restart``) join MPI again, as new processes
(tests/test_any_cluster.py, test_workers_restarted_by_their_nanny_join_mpi_again).

Prints one ``RESULT <json>`` line: a move before and after the restart, and the workers' pids.
"""

import json
import os

from _moves import move

if __name__ == "__main__":
    from distributed import Client, LocalCluster

    with LocalCluster(protocol="mpi", processes=True, n_workers=2, threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        A, B = sorted(client.scheduler_info()["workers"])
        first = move(client, A, B, 8 << 20, seed=7)
        pids = client.run(os.getpid)
        client.restart()
        client.wait_for_workers(2, timeout=60)
        A2, B2 = sorted(client.scheduler_info()["workers"])
        again = move(client, B2, A2, 24 << 20, seed=8)
        out = {"first": first, "again": again, "pids": list(pids.values()),
               "new_pids": list(client.run(os.getpid).values())}
    print("RESULT " + json.dumps(out), flush=True)
