"""A stranger claims the cluster's id in the mpi:// handshake but cannot prove the secret (tests/test_any_cluster.py,
test_stranger_with_the_cluster_id_but_not_its_secret_gets_no_mpi_port).

It gets no MPI port (the worker closes the connection), and the worker still moves payloads over MPI.
Prints one ``RESULT <json>`` line.
"""

import json
import os
import socket

from _moves import move
from _stranger import recv_hs, send_hs

if __name__ == "__main__":
    from distributed import Client, LocalCluster

    from mpi4dask.comm import PROTOCOL_VERSION

    with LocalCluster(protocol="mpi", processes=True, n_workers=2, threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        A, B = sorted(client.scheduler_info()["workers"])
        service = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.extensions["mpi4dask"]
                                          .credentials.service)
        host, port = A[len("mpi://"):].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=20)
        send_hs(sock, {"magic": "mpi4dask", "version": PROTOCOL_VERSION, "rank": 0, "size": 1, "job": "",
                       "host": "stranger", "pid": 1, "nonce": os.urandom(16).hex(), "up": True,
                       "cluster": service, "ident": "stranger-1"})
        server = recv_hs(sock)
        send_hs(sock, {"magic": "mpi4dask", "proof": "pair", "tag": 12345, "use": None, "mac": "00" * 32})
        try:
            after = recv_hs(sock)
        except (ConnectionError, OSError) as exc:
            after = {"closed": type(exc).__name__}
        sock.close()
        # the worker still serves its own cluster over MPI
        moved = move(client, A, B, 8 << 20, seed=9)
        out = {"server_hello": {k: server.get(k) for k in ("pair", "cluster", "links")}, "after": after,
               "moved": moved}
    print("RESULT " + json.dumps(out), flush=True)
