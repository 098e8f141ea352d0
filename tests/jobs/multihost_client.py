"""A client of a cluster whose scheduler and two workers run on simulated hosts (tests/test_multihost.py,
test_workers_on_other_hosts_join_mpi_through_the_scheduler).

Usage: multihost_client.py SCHEDULER_ADDRESS

Payloads of 1 and 32 MiB move between the two workers (digests compared) and run_mpi runs over both.  Prints
one ``HOSTS <json>`` line: the workers' hosts, the digest checks, both sides' connections, the run_mpi results.
"""
import hashlib
import json
import socket
import sys

import numpy as np
from distributed import Client

import mpi4dask


def make(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def digest(a):
    return hashlib.sha256(a.tobytes()).hexdigest()


def where():
    return socket.gethostname()


def total(comm, parts):
    local = sum(float(v.sum()) for v in parts.values())
    return comm.Get_rank(), comm.Get_size(), socket.gethostname(), comm.allreduce(local)


with Client(sys.argv[1], timeout=60) as client:
    client.wait_for_workers(2, timeout=60)
    a_addr, b_addr = sorted(client.scheduler_info()["workers"])
    out = {"hosts": client.run(where)}
    for n, src, dst in ((1 << 20, a_addr, b_addr), (32 << 20, b_addr, a_addr)):
        x = client.submit(make, n, n, workers=[src], pure=False)
        there = client.submit(digest, x, workers=[dst], pure=False, allow_other_workers=False).result()
        out[str(n)] = there == digest(make(n, n))
    conns = client.run(mpi4dask.connections)
    out["a_to_b"] = [c for c in conns[a_addr] if c["peer"] == b_addr]
    out["b_to_a"] = [c for c in conns[b_addr] if c["peer"] == a_addr]
    futures = [client.submit(np.full, 100, float(i + 1), workers=[w], pure=False)
               for i, w in enumerate((a_addr, b_addr))]
    out["run_mpi"] = mpi4dask.run_mpi(total, futures)
    print("HOSTS " + json.dumps(out), flush=True)
