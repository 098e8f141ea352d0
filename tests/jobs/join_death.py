"""A worker dies half-way through joining MPI with another worker; the other goes on.

    python tests/jobs/join_death.py in_mpi|before_go

Worker A (a LocalCluster worker, under its Nanny) holds an array; worker B, started here as a plain
``distributed.Worker`` process, is asked to compute on it, so B connects to A and the two join their
MPI worlds.  B kills itself inside that join, after A told it the MPI port: ``in_mpi``, right after
its GO byte went out (A is then inside ``MPI_Comm_accept`` with a dead peer: its join fails);
``before_go``, before that byte (A never enters MPI).  The join is the real one, the death is
injected in the dying process only.  Prints one ``RESULT <json>`` line: the answers, whether A lives,
how a worker that joins afterwards talks to A, A's idle CPU, and a run_mpi call over A and that
worker (with retries).  A third worker, the waiter, connects to A at the moment B dies, while A's one
join slot is taken by that join: its connection must work (over TCP when A's join failed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import dask.array as da
import numpy as np
from _join_hook import worker_script
from distributed import Client, LocalCluster

import mpi4dask

DYING = worker_script("dying", """
def die():
    os.kill(os.getpid(), signal.SIGKILL)

def hook(what, bound, go):
    if sys.argv[2] in what:  # its join with worker A
        open(sys.argv[3], "w").close()  # the waiter connects to A now, while A waits in this join
        if sys.argv[4] == "before_go":
            die()
        with real(what, bound, lambda: (go(), die())):
            yield
        return
    with real(what, bound, go):
        yield
""")


WAITER = """
import asyncio, json, os, sys, time
from distributed import Worker
from distributed.comm.registry import get_backend
import mpi4dask
from mpi4dask import _mpi

async def main():
    sched, a, go, out = sys.argv[1:5]
    async with Worker(sched, nthreads=1, name="waiter"):
        while _mpi.initialized_world() is None or not os.path.exists(go):
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        try:
            # one attempt (distributed's connect() would retry a failed one, hiding it): it claims a
            # pair while A's only join slot is taken by the join that fails
            comm = await get_backend("mpi").get_connector().connect(a.split("://", 1)[1], deserialize=True)
            await comm.write(comm.handshake_info())  # distributed's own handshake, as connect() does it
            await comm.read()
            await comm.write({"op": "identity"})
            reply = await comm.read()
            result = {"ok": reply.get("type") == "Worker", "seconds": time.monotonic() - t0,
                      "links": sorted({c["transport"] for c in mpi4dask.connections() if c["peer"] == a}),
                      "unsafe": _mpi.joins_unsafe()}
            await comm.close()
        except Exception as e:
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        with open(out + ".part", "w") as f:
            json.dump(result, f)
        os.replace(out + ".part", out)  # whole, or not there: the job reads it as soon as it exists

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


def main(when):
    with LocalCluster(protocol="mpi", n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        (a,) = workers(client)
        pid_a = client.run(os.getpid)[a]
        x = client.submit(np.arange, 4_000_000, workers=[a], pure=False)  # 32 MB: it travels over MPI
        ref = float(np.arange(4_000_000).sum())
        go, waited = os.path.abspath("go"), os.path.abspath("waiter.json")
        waiter = subprocess.Popen([sys.executable, "-c", WAITER, cluster.scheduler_address, a, go, waited])
        client.wait_for_workers(2, timeout=60)
        dying = subprocess.Popen([sys.executable, "-c", DYING, cluster.scheduler_address, a, go, when])
        client.wait_for_workers(3, timeout=60)
        b = next(w for w in workers(client) if w != a and client.scheduler_info()["workers"][w]["name"] == "dying")
        t0 = time.monotonic()
        first = client.submit(np.sum, x, workers=[b], allow_other_workers=True, pure=False)
        rc = dying.wait(60)
        got1 = float(first.result(timeout=60))  # Dask ran it again on A
        first_s = time.monotonic() - t0
        deadline = time.monotonic() + 60
        while not os.path.exists(waited) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(waited) as f:
            waiter_result = json.load(f)
        waiter.kill()
        waiter.wait(30)
        while any(w["name"] == "waiter" for w in client.scheduler_info()["workers"].values()):
            time.sleep(0.05)
        cluster.scale(2)  # a worker that joins afterwards
        deadline = time.monotonic() + 60
        while len(workers(client)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        c = next(w for w in workers(client) if w not in (a, b))
        got2 = float(client.submit(np.sum, x, workers=[c], allow_other_workers=False, pure=False).result(60))
        out = {"dying_rc": rc, "waiter": waiter_result, "got1": got1, "got2": got2, "ref": ref, "first_s": first_s,
               "a_lives": client.run(os.getpid, workers=[a]).get(a) == pid_a,
               "c_to_a": client.run(links, a, workers=[c]).get(c),
               "a_unsafe": client.run(mpi4dask._mpi.joins_unsafe, workers=[a]).get(a)}
        c0 = client.run(cpu, workers=[a])[a]
        time.sleep(2.0)
        out["a_idle_cpu"] = client.run(cpu, workers=[a])[a] - c0
        names = sorted(w["name"] for w in client.scheduler_info()["workers"].values())
        y = da.ones((2000, 2000), chunks=(1000, 1000)).persist()
        r = mpi4dask.run_mpi(total, y, workers=names, retries=2)  # (in_mpi: A joins no world now: restarted, run again)
        out["run_mpi"] = {"sizes": [s for s, _ in r], "values": [v for _, v in r]}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] not in (["in_mpi"], ["before_go"]):
        sys.exit(f"usage: {sys.argv[0]} in_mpi|before_go (when the dying worker dies), not {sys.argv[1:]}")
    main(sys.argv[1])
