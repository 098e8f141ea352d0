"""A LocalCluster of 3 worker processes over mpi:// (tests/test_any_cluster.py,
test_local_cluster_moves_payloads_over_mpi).

Payloads of 300 KiB, 8 MiB and 64 MiB made on one worker are digested there and on the two others (the
bytes must travel over MPI pairs), and a dask array computation is checked against NumPy's on the same
data.  Prints one ``RESULT <json>`` line.
"""

import json

from _moves import conns, move, sha

SIZES = [300 << 10, 8 << 20, 64 << 20]

if __name__ == "__main__":
    import dask.array as da
    from distributed import Client, LocalCluster

    with LocalCluster(protocol="mpi", processes=True, n_workers=3, threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=60)
        A, B, C = sorted(client.scheduler_info()["workers"])
        moves = [move(client, A, dst, n, seed=100 + i) for i, n in enumerate(SIZES) for dst in (B, C)]
        x = da.random.default_rng(1234).random((4000, 4000), chunks=(1000, 1000))
        y = x + x.T
        a = x.compute()
        array = {"sum": float(y.sum().compute()), "np_sum": float((a + a.T).sum()),
                 "sha": sha(y.compute()), "np_sha": sha(a + a.T), "x_sha": sha(x.compute()), "a_sha": sha(a)}
        out = {"workers": [A, B, C], "moves": moves, "array": array, "conns": client.run(conns)}
    print("RESULT " + json.dumps(out), flush=True)
