"""A pair join that completes after its handshake was given up is kept, on both sides, and used.

    python tests/jobs/late_join.py

Worker C (a LocalCluster worker; connect timeout 5 s, so distributed gives up each connect attempt
after 1 s) fetches an array from worker S (a plain ``distributed.Worker`` process started here),
which joins their two MPI worlds.  S's first ``MPI_Comm_accept`` starts 1.5 s after C's GO byte
came (injected in S only: a task holding the GIL delays a join so): C's attempt is given up while
its join thread waits inside ``MPI_Comm_connect`` (MPICH's 3 s timeout), and that connect then
completes.  distributed retries, and the retry joins the two again.  Prints one ``RESULT <json>``
line: the fetched sum, each side's pairs with the other (ids) and pair joins, and a new connection
from C to S: the pair it used and the checksum of a 16 MiB echo over it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

import dask
import numpy as np
from _join_hook import worker_script
from distributed import Client, LocalCluster

SLOW_ACCEPT = worker_script("server", """
delayed = []

def hook(what, bound, go):
    if what.startswith("MPI_Comm_accept") and not delayed:
        delayed.append(what)
        meet = lambda: (go(), time.sleep(1.5))  # the GO byte came; accept 1.5 s later
    else:
        meet = go
    with real(what, bound, meet):
        yield
""")


def pairs():
    """This worker's world ident, its pairs by peer ident (ids), and its pair joins."""
    from mpi4dask import _endpoint, _metrics, _mpi

    ep = _endpoint.current()
    by_peer = {} if ep is None else {k: list(v) for k, v in ep.pairs._by_peer.items()}  # in the order joined
    return {"ident": _mpi.initialized_world().ident, "pairs": by_peer, "joins": _metrics.joins["pair"]}


async def echo_over_new_connection(address: str) -> dict:
    """On C: a new connection to S (not from the pool), a 16 MiB echo over it, and the pair it used."""
    from distributed.comm import connect

    from mpi4dask import _endpoint

    data = np.random.default_rng(7).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes()
    comm = await connect(address, timeout=30)
    try:
        route = comm._link.route if comm._link is not None else None
        await comm.write({"op": "echo", "data": data, "reply": True})
        back = await comm.read()
        ep = _endpoint.current()
        used = [pid for v in ep.pairs._by_peer.values() for pid, r in v.items() if r == route]
        return {"sha_sent": hashlib.sha256(data).hexdigest(), "sha_back": hashlib.sha256(back).hexdigest(),
                "pair": used[0] if used else None, "mpi_bytes": comm.stats["mpi_bytes_received"]}
    finally:
        await comm.close()


def main():
    dask.config.set({"distributed.comm.timeouts.connect": "5s"})  # attempts of 1 s (a fifth), as the workers get it
    with LocalCluster(protocol="mpi", n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        (c,) = client.scheduler_info()["workers"]
        server = subprocess.Popen([sys.executable, "-c", SLOW_ACCEPT, cluster.scheduler_address])
        try:
            client.wait_for_workers(2, timeout=60)
            s = next(w for w in client.scheduler_info()["workers"] if w != c)
            x = client.submit(np.arange, 4_000_000, workers=[s], pure=False)  # 32 MB: it travels over MPI
            t0 = time.monotonic()
            got = float(client.submit(np.sum, x, workers=[c], allow_other_workers=False, pure=False).result(60))
            fetch_s = time.monotonic() - t0
            time.sleep(0.5)  # (both joins are long done: the late one ended at ~1.5 s)
            info = client.run(pairs, workers=[c, s])
            info["scheduler"] = client.run_on_scheduler(pairs)
            echo = client.run(echo_over_new_connection, s, workers=[c])[c]
            out = {"got": got, "ref": float(np.arange(4_000_000).sum()), "fetch_s": fetch_s,
                   "c": info[c], "s": info[s], "scheduler": info["scheduler"], "echo": echo}
        finally:
            server.kill()
            server.wait(30)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
