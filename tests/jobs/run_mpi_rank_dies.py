"""A run_mpi participant dies in the MPI phase (tests/test_resilience.py,
test_run_mpi_participant_dies_in_the_mpi_phase).

Usage: run_mpi_rank_dies.py PROTOCOL      (mpi or tcp: the LocalCluster's)

Rank 1 of fn SIGKILLs its own worker once per mark file (written in the current directory) while the others
wait in the allreduce: the call must raise MPIJobError(lost=True) quickly, the next call must answer right,
and ``retries=1`` must answer right after such a death; the workers' metrics count the retry.  Each death
replaces exactly the 3 workers of the call (the dead one, the 2 ranks ended): no Nanny restarts a worker twice.
Prints one ``RESULT <json>`` line.
"""

import json
import os
import signal
import sys
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import mpi4dask


def fn(comm, parts, mark):
    local = sum(float(np.asarray(b).sum()) for b in parts.values())
    if comm.Get_rank() == 1 and not os.path.exists(mark):
        time.sleep(0.5)  # the other ranks wait in the allreduce by now
        with open(mark, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    return comm.Get_size(), comm.allreduce(local)


def churn(client, since: float) -> dict:
    """How many workers joined and left the cluster since ``since`` (time.time()), as the scheduler logged it."""
    events = [e for t, e in client.get_events("all") if t >= since]
    return {"joined": sum(e.get("action") == "add-worker" for e in events),
            "left": sum(e.get("action") == "remove-worker" for e in events)}


def scraped():
    """This worker's mpi4dask samples, as its /metrics serves them (prometheus_client's global registry)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    return [[s.name, s.labels, s.value] for f in text_string_to_metric_families(generate_latest().decode())
            for s in f.samples if s.name.startswith("mpi4dask_run_mpi")]


if __name__ == "__main__":
    with LocalCluster(protocol=sys.argv[1], n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        names = sorted(w["name"] for w in client.scheduler_info()["workers"].values())
        x = da.random.default_rng(0).random((3000, 3000), chunks=(1000, 1000)).persist()
        ref = float(np.asarray(x).sum())
        out = {}
        t0, since = time.monotonic(), time.time()
        try:
            mpi4dask.run_mpi(fn, x, mark="first", workers=names)
            out["first"] = None
        except mpi4dask.MPIJobError as e:
            out["first"] = {"lost": e.lost, "rank": e.rank, "worker": e.worker, "message": str(e),
                            "kill_to_error": time.time() - float(open("first").read()),
                            "call": time.monotonic() - t0}
        client.wait_for_workers(3, timeout=60)
        r = mpi4dask.run_mpi(fn, x, mark="first", workers=names)  # no death this time
        out["next"] = {"sizes": [s for s, _ in r], "right": all(abs(v - ref) <= 1e-9 * ref for _, v in r)}
        out["next"]["churn"] = churn(client, since)
        t0, since = time.monotonic(), time.time()
        r = mpi4dask.run_mpi(fn, x, mark="second", workers=names, retries=1)  # dies once, runs again
        out["retried"] = {"sizes": [s for s, _ in r], "right": all(abs(v - ref) <= 1e-9 * ref for _, v in r),
                          "kill_to_answer": time.time() - float(open("second").read())}
        client.wait_for_workers(3, timeout=60)
        r = mpi4dask.run_mpi(fn, x, mark="second", workers=names)
        out["after"] = {"sizes": [s for s, _ in r], "right": all(abs(v - ref) <= 1e-9 * ref for _, v in r)}
        out["after"]["churn"] = churn(client, since)
        out["metrics"] = client.run(scraped)  # the workers now alive: those of the retry and of the last call
    print("RESULT " + json.dumps(out), flush=True)
