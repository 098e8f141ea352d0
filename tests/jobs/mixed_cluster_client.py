"""A client of an mpiexec cluster that gained a worker started outside the job (tests/test_mixed_cluster.py,
test_mpiexec_cluster_gains_an_outside_worker_over_mpi).

Usage: mixed_cluster_client.py SCHEDULER_FILE      (the outside worker is named "outside")

Payloads of 8 and 24 MiB move both ways between the job's worker and the outside one (digests compared), and
run_mpi runs over both.  Prints one ``MIXED <json>`` line: the digest checks, both sides' connections, the
run_mpi results.
"""
import hashlib
import json
import sys

import numpy as np
from distributed import Client

import mpi4dask


def make(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def digest(a):
    return hashlib.sha256(a.tobytes()).hexdigest()


def total(comm, parts):
    return comm.Get_size(), comm.allreduce(sum(float(v.sum()) for v in parts.values()))


with Client(scheduler_file=sys.argv[1], timeout=60) as client:
    client.wait_for_workers(2, timeout=60)
    info = client.scheduler_info()["workers"]
    job_worker = [a for a, w in info.items() if w["name"] != "outside"][0]
    outside = [a for a, w in info.items() if w["name"] == "outside"][0]
    out = {}
    for n, src, dst in ((8 << 20, job_worker, outside), (24 << 20, outside, job_worker)):
        a = client.submit(make, n, n, workers=[src], pure=False)
        here = client.submit(digest, a, workers=[src], pure=False).result()
        there = client.submit(digest, a, workers=[dst], pure=False, allow_other_workers=False).result()
        out[f"{n}"] = [here == digest(make(n, n)), there == here]
    conns = client.run(mpi4dask.connections)
    out["outside_to_job"] = [c for c in conns[outside] if c["peer"] == job_worker]
    out["job_to_outside"] = [c for c in conns[job_worker] if c["peer"] == outside]
    futures = [client.submit(np.full, 1000, float(i + 1), workers=[w], pure=False)
               for i, w in enumerate((job_worker, outside, job_worker, outside))]
    client.wait(futures) if hasattr(client, "wait") else None
    res = mpi4dask.run_mpi(total, futures, workers=[job_worker, outside])
    out["run_mpi"] = res
    print("MIXED " + json.dumps(out), flush=True)
