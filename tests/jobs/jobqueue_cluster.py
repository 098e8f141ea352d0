"""dask-jobqueue's SLURMCluster(protocol="mpi") on a real Slurm, as a user runs it.

Usage: jobqueue_cluster.py SCENARIO LOGDIR      (SLURM_CONF in the environment names the Slurm)

Scenarios, each printing one ``RESULT <json>`` line:

* ``pairs``: scale(3); 8 MiB payloads made on one batch-job worker and digested on the two others
  (the bytes must travel over MPI pairs: ``mpi4dask.connections()`` before and after), a dask array
  computation checked against NumPy, and ``run_mpi`` across the three jobs (each rank's blocks
  digested; the allreduce checked against the client's sum); then scale(1) and adapt(1..3) under a
  load of naps, with run_mpi calls going on.
* ``scancel``: scale(3); during a run_mpi call, the test's own ``scancel`` of one worker's batch job
  (from inside fn on rank 1, once: the job id comes from the worker's SLURM_JOB_ID) must give
  ``MPIJobError(lost=True)``; then ``retries=2`` gives the right answer.
"""

import json
import os
import subprocess
import sys
import time

import dask.array as da
import numpy as np
from _moves import conns, link_ends, made_and_fetched, make, sha
from dask_jobqueue import SLURMCluster
from distributed import Client

import mpi4dask

SIZE = 8 << 20


def digest(a):
    return {"sha": sha(a), "nbytes": int(a.nbytes), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID")}


def mpi_bytes(client, a, b):
    """MPI bytes received by b on its connections to a, and sent by a on those connections."""
    recv, send = link_ends(client, a, b)
    return {"routes": sorted({(d["transport"], d["mpi_route"]) for d in recv + send}),
            "received": sum(d["mpi_bytes_received"] for d in recv), "sent": sum(d["mpi_bytes_sent"] for d in send)}


def move(client, src, dst, seed):
    before = mpi_bytes(client, src, dst)
    at_src, at_dst = made_and_fetched(client, src, dst, SIZE, seed, digest=digest, timeout=60)
    after = mpi_bytes(client, src, dst)
    return {"expected": sha(make(SIZE, seed)), "at_src": at_src, "at_dst": at_dst, "routes": after["routes"],
            "mpi_received": after["received"] - before["received"], "mpi_sent": after["sent"] - before["sent"]}


def blocks_digest(comm, parts):
    """Every rank: its blocks' digests, its job id, and the allreduce of the blocks' sums."""
    local = sum(float(np.asarray(b).sum(dtype=np.uint64)) for b in parts.values())
    return {"rank": comm.Get_rank(), "size": comm.Get_size(), "job": os.environ.get("SLURM_JOB_ID"),
            "blocks": {repr(k): sha(v) for k, v in parts.items()}, "total": comm.allreduce(local)}


def total(comm, parts):
    return comm.Get_size(), comm.allreduce(sum(float(np.asarray(b).sum()) for b in parts.values()))


def cancel_own_job_once(comm, parts, mark):
    """Rank 1 scancels its own batch job (once: the mark file), the others wait in the allreduce."""
    local = sum(float(np.asarray(b).sum(dtype=np.uint64)) for b in parts.values())
    if comm.Get_rank() == 1 and not os.path.exists(mark):
        time.sleep(0.5)  # the other ranks wait in the allreduce by now
        with open(mark, "w") as f:
            f.write(repr(time.time()))
        subprocess.run(["scancel", os.environ["SLURM_JOB_ID"]], check=True)
        time.sleep(60)  # scancel ends this process
    return comm.Get_size(), comm.allreduce(local)


def nap(i):
    time.sleep(0.5)
    return i


def workers_by_address(client):
    return sorted(client.scheduler_info()["workers"])


def wait_for_n(client, n, timeout):
    t0 = time.monotonic()
    while len(client.scheduler_info()["workers"]) != n:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{len(client.scheduler_info()['workers'])} workers, not {n}, after {timeout} s")
        time.sleep(0.2)
    return time.monotonic() - t0


def jobs_in_queue():
    r = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, check=True)
    return [line.split() for line in r.stdout.splitlines() if line.strip()]


def pairs(client, cluster, out):
    A, B, C = workers_by_address(client)
    out["jobs"] = client.run(lambda: os.environ.get("SLURM_JOB_ID"))
    out["moves"] = [move(client, A, dst, seed) for seed, dst in enumerate((B, C))]
    x = da.random.default_rng(7).random((3000, 3000), chunks=(1000, 1000)).persist()
    a = np.asarray(x)
    out["array"] = {"sum": float((x + x.T).sum().compute()), "np_sum": float((a + a.T).sum())}
    # 9 blocks made on the 3 workers in turn: every batch job holds 3 of them
    futures = [client.submit(make, 1 << 20, 100 + i, workers=[(A, B, C)[i % 3]], allow_other_workers=False,
                             pure=False) for i in range(9)]
    r = mpi4dask.run_mpi(blocks_digest, futures, timeout=60)
    expected = {repr(i): sha(make(1 << 20, 100 + i)) for i in range(9)}
    reference = float(sum(make(1 << 20, 100 + i).sum(dtype=np.uint64) for i in range(9)))
    got = {}
    for rank in r:
        got.update(rank["blocks"])
    out["run_mpi"] = {"sizes": [rank["size"] for rank in r], "ranks": [rank["rank"] for rank in r],
                      "jobs": sorted(rank["job"] for rank in r), "blocks_right": got == expected,
                      "totals_right": all(rank["total"] == reference for rank in r)}
    out["worker_links"] = {w: sorted({(d["transport"], d["mpi_route"]) for d in ds
                                      if d["peer"] in out["jobs"]})
                           for w, ds in client.run(conns).items()}
    # scale down, then adapt under load, with run_mpi calls going on
    cluster.scale(1)
    out["down_s"] = wait_for_n(client, 1, 60)
    t0 = time.monotonic()
    while len(jobs_in_queue()) > 1 and time.monotonic() - t0 < 60:
        time.sleep(0.5)
    out["queue_after_down"] = jobs_in_queue()
    cluster.adapt(minimum=1, maximum=3, interval="500ms", wait_count=6, target_duration="2s")
    load = client.map(nap, range(120), pure=False)
    seen, sizes, right, calls, t0 = [], [], 0, 0, time.monotonic()
    while time.monotonic() - t0 < 120:
        y = da.random.default_rng(calls).random((1200, 1200), chunks=(300, 300)).persist()
        ref = float(np.asarray(y).sum())
        n, v = mpi4dask.run_mpi(total, y, retries=3, timeout=60)[0]
        calls += 1
        right += abs(v - ref) <= 1e-9 * ref
        sizes.append(n)
        seen.append(len(client.scheduler_info()["workers"]))
        # on until a call spanned workers that adapt added: while the naps fill the workers, a persisted
        # array can land on one worker alone (seen in CI: two calls of size 1 with 3 workers up, and the
        # naps done); the workers stay 3 s idle before adapt lets them go, and the next array spreads
        if all(f.done() for f in load) and max(sizes) >= 2:
            break
    out["naps_right"] = client.gather(load) == list(range(120))
    del load
    t1 = time.monotonic()
    while len(client.scheduler_info()["workers"]) > 1 and time.monotonic() - t1 < 90:
        time.sleep(0.5)
    out["adapt"] = {"workers_seen": seen, "run_mpi_sizes": sizes, "calls": calls, "right": right,
                    "workers_after": len(client.scheduler_info()["workers"]), "down_after_s": time.monotonic() - t1}


def scancel(client, cluster, out):
    names = workers_by_address(client)
    # blocks as users make them (no worker restrictions: those lost with a worker are computed again anywhere)
    x = da.from_array(np.frombuffer(np.random.default_rng(3).bytes(9 << 20), dtype=np.uint8), chunks=1 << 20)
    x = x.persist()
    ref = float(np.frombuffer(np.random.default_rng(3).bytes(9 << 20), dtype=np.uint8).sum(dtype=np.uint64))
    t0 = time.monotonic()
    try:
        mpi4dask.run_mpi(cancel_own_job_once, x, mark="first", workers=names, timeout=90)
        out["first"] = None
    except mpi4dask.MPIJobError as e:
        out["first"] = {"lost": e.lost, "rank": e.rank, "message": str(e)[:2000],
                        "cancel_to_error": time.time() - float(open("first").read()), "call": time.monotonic() - t0}
    t0 = time.monotonic()
    r = mpi4dask.run_mpi(cancel_own_job_once, x, mark="second", retries=2, timeout=90)
    out["retried"] = {"sizes": [s for s, _ in r], "right": all(v == ref for _, v in r),
                      "call": time.monotonic() - t0}


if __name__ == "__main__":
    scenario, logdir = sys.argv[1], sys.argv[2]
    t0 = time.monotonic()
    with SLURMCluster(cores=1, processes=1, memory="2GB", protocol="mpi", walltime="00:20:00",
                      log_directory=logdir, scheduler_options={"dashboard_address": ":0"}) as cluster, \
            Client(cluster) as client:
        cluster.scale(3)
        client.wait_for_workers(3, timeout=90)
        out = {"scheduler": client.scheduler.address, "up_s": time.monotonic() - t0,
               "job_script": cluster.job_script()}
        {"pairs": pairs, "scancel": scancel}[scenario](client, cluster, out)
    print("RESULT " + json.dumps(out), flush=True)
