"""A worker dies half-way through joining MPI with another worker; the other goes on.

    python tests/jobs/join_death.py

Worker A (a LocalCluster worker, under its Nanny) holds an array; worker B, started here as a plain
``distributed.Worker`` process, is asked to compute on it, so B connects to A and the two join their
MPI worlds.  B kills itself inside that join, after A told it the MPI port and before it connects:
the join is the real one, the death is injected in the dying process only.  Prints one
``RESULT <json>`` line: the answers, whether A lives, how a worker that joins afterwards talks to A,
A's idle CPU, and a run_mpi call over A and that worker (with retries).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import mpi4dask

DYING = """
import asyncio, contextlib, os, signal, sys
from distributed import Worker
from mpi4dask import _mpi
real = _mpi.joining

@contextlib.contextmanager
def dying(what, bound):
    if sys.argv[2] in what:  # its join with worker A
        os.kill(os.getpid(), signal.SIGKILL)
    with real(what, bound):
        yield

_mpi.joining = dying

async def main():
    async with Worker(sys.argv[1], nthreads=1, name="dying") as w:
        await w.finished()

asyncio.run(main())
"""


def total(comm, parts):
    return comm.Get_size(), comm.allreduce(sum(float(np.asarray(b).sum()) for b in parts.values()))


def links(peer):
    return sorted({c["transport"] for c in mpi4dask.connections() if c["peer"] == peer})


def cpu():
    return time.process_time()


def workers(client):
    return list(client.scheduler_info()["workers"])


def main():
    with LocalCluster(protocol="mpi", n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        (a,) = workers(client)
        pid_a = client.run(os.getpid)[a]
        x = client.submit(np.arange, 4_000_000, workers=[a], pure=False)  # 32 MB: it travels over MPI
        ref = float(np.arange(4_000_000).sum())
        dying = subprocess.Popen([sys.executable, "-c", DYING, cluster.scheduler_address, a])
        client.wait_for_workers(2, timeout=60)
        b = next(w for w in workers(client) if w != a)
        t0 = time.monotonic()
        first = client.submit(np.sum, x, workers=[b], allow_other_workers=True, pure=False)
        rc = dying.wait(60)
        got1 = float(first.result(timeout=60))  # Dask ran it again on A
        first_s = time.monotonic() - t0
        cluster.scale(2)  # a worker that joins afterwards
        deadline = time.monotonic() + 60
        while len(workers(client)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        c = next(w for w in workers(client) if w not in (a, b))
        got2 = float(client.submit(np.sum, x, workers=[c], allow_other_workers=False, pure=False).result(60))
        out = {"dying_rc": rc, "got1": got1, "got2": got2, "ref": ref, "first_s": first_s,
               "a_lives": client.run(os.getpid, workers=[a]).get(a) == pid_a,
               "c_to_a": client.run(links, a, workers=[c]).get(c)}
        c0 = client.run(cpu, workers=[a])[a]
        time.sleep(2.0)
        out["a_idle_cpu"] = client.run(cpu, workers=[a])[a] - c0
        names = sorted(w["name"] for w in client.scheduler_info()["workers"].values())
        y = da.ones((2000, 2000), chunks=(1000, 1000)).persist()
        r = mpi4dask.run_mpi(total, y, workers=names, retries=2)  # A joins no world now: restarted, run again
        out["run_mpi"] = {"sizes": [s for s, _ in r], "values": [v for _, v in r]}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
