"""Workers added by ``cluster.scale`` join MPI with the earlier ones (tests/test_any_cluster.py,
test_scale_up_new_workers_join_mpi).

A LocalCluster of 2 workers scaled to 4; payloads move old -> old, old -> new, new -> new and new -> old.
Prints one ``RESULT <json>`` line.
"""

import json

from _moves import conns, move

if __name__ == "__main__":
    from distributed import Client, LocalCluster

    with LocalCluster(protocol="mpi", processes=True, n_workers=2, threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        old = sorted(client.scheduler_info()["workers"])
        moves = [move(client, old[0], old[1], 8 << 20, seed=1)]
        cluster.scale(4)
        client.wait_for_workers(4, timeout=90)
        new = sorted(set(client.scheduler_info()["workers"]) - set(old))
        moves += [move(client, old[0], new[0], 16 << 20, seed=2),  # the new worker connects to an old one
                  move(client, new[0], new[1], 16 << 20, seed=3),  # two new ones
                  move(client, new[1], old[1], 16 << 20, seed=4)]  # an old worker connects to a new one
        out = {"old": old, "new": new, "moves": moves, "conns": client.run(conns)}
    print("RESULT " + json.dumps(out), flush=True)
