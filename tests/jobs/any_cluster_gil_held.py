"""Workers join their MPI worlds while their tasks hold the GIL for seconds at a time
(tests/test_any_cluster.py, test_workers_whose_tasks_hold_the_gil_still_join_over_mpi).

``python any_cluster_gil_held.py``: a LocalCluster of ``WORKERS`` mpi:// workers, each running
``HOGS`` tasks back to back that hold the GIL in C for ``HOLD`` seconds of CPU each (``sum(range(n))``,
as a long pandas or numpy call does), while every worker fetches a payload of random bytes from every
other one: the workers join their worlds pair by pair while their event loops and join threads wait
for the GIL.  Prints one ``RESULT <json>`` line: each fetch's digests at both ends and the script's own,
each worker's connections, and each worker's joins and failed joins (``mpi4dask`` metrics) and whether
it still joins other worlds.
"""

import json
import time

from _moves import conns, digest, make, sha
from distributed import Client, LocalCluster, wait

WORKERS = 4
HOGS = 4
HOLD = 1.0  # seconds of CPU per task, on a quiet core
NBYTES = 1 << 20


def hog(n):
    return sum(range(n))  # holds the GIL for the whole call


def joins():
    from mpi4dask import _metrics, _mpi

    return {"ok": dict(_metrics.joins), "failed": [f"{k}/{r}" for (k, r), n in _metrics.join_failures.items() for _ in
                                                    range(n)], "unsafe": _mpi.joins_unsafe()}


def per_second() -> int:
    """sum(range(n)) terms per second of CPU here."""
    n = 3_000_000
    t = time.process_time()
    hog(n)
    return int(n / max(time.process_time() - t, 1e-3))


def main():
    n = int(HOLD * per_second())
    with LocalCluster(protocol="mpi", n_workers=WORKERS, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(WORKERS, timeout=60)
        ws = sorted(client.scheduler_info()["workers"])
        payloads = {w: client.submit(make, NBYTES, i, workers=[w], pure=False) for i, w in enumerate(ws)}
        wait(list(payloads.values()))  # made before any worker holds the GIL
        t0 = time.monotonic()
        hogs = [client.submit(hog, n, workers=[w], pure=False) for w in ws for _ in range(HOGS)]
        time.sleep(0.5)  # every worker is in its first hog
        digests = {(s, d): client.submit(digest, payloads[s], workers=[d], pure=False)
                   for s in ws for d in ws if s != d}
        fetched = {f"{s} -> {d}": f.result(timeout=120) for (s, d), f in digests.items()}
        client.gather(hogs)
        out = {"seconds": time.monotonic() - t0, "workers": ws, "hold": HOLD,
               "expected": {w: digest(make(NBYTES, i)) for i, w in enumerate(ws)}, "fetched": fetched,
               "at_src": {w: client.submit(sha, payloads[w], workers=[w], pure=False).result(60) for w in ws},
               "conns": client.run(conns), "joins": client.run(joins)}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
