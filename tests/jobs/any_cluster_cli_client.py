"""A client of a cluster started as ``dask scheduler`` / ``dask worker`` commands (tests/test_any_cluster.py,
test_dask_scheduler_and_workers_commands).

Usage: any_cluster_cli_client.py SCHEDULER_FILE

32 MiB payloads move both ways between the two workers; prints one ``RESULT <json>`` line with the moves, the
workers' connections and the scheduler's address.
"""

import json
import sys

from _moves import conns, move

if __name__ == "__main__":
    from distributed import Client

    with Client(scheduler_file=sys.argv[1], timeout=60) as client:
        client.wait_for_workers(2, timeout=60)
        W0, W1 = sorted(client.scheduler_info()["workers"])
        moves = [move(client, W0, W1, 32 << 20, seed=7), move(client, W1, W0, 32 << 20, seed=8)]
        out = {"workers": [W0, W1], "moves": moves, "conns": client.run(conns),
               "scheduler": client.scheduler.address}
    print("RESULT " + json.dumps(out), flush=True)
