"""adapt() scales a LocalCluster up and down while computations and run_mpi calls go on (tests/test_resilience.py,
test_adaptive_cluster_scales_up_and_down_while_work_and_run_mpi_go_on).

Usage: adaptive_cluster.py PROTOCOL

Prints one ``RESULT <json>`` line: calls made and answered right, errors, worker counts, run_mpi sizes, the
(transport, route) of the links that moved MPI bytes, a block moved between every two workers once adapt
started some (its digest at both ends, and the links from the receiver to the sender), and the phase reached
(up, drain, down, done).
"""

import hashlib
import json
import sys
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import mpi4dask


def total(comm, parts):
    return comm.Get_size(), comm.allreduce(sum(float(np.asarray(b).sum()) for b in parts.values()))


def nap(i):
    time.sleep(0.5)  # known durations, no CPU: adapt's estimate does not depend on the machine's load
    return i


def links():
    return sorted({(c["transport"], c["mpi_route"]) for c in mpi4dask.connections()
                   if c["mpi_bytes_received"] + c["mpi_bytes_sent"] > 0})


def block(seed):
    return np.random.default_rng(seed).random(1 << 17)  # 1 MiB


def digest(b):
    return hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest()


def links_to(peer):
    """This worker's connections to ``peer``: (transport, route, MPI bytes received)."""
    return [(c["transport"], c["mpi_route"], c["mpi_bytes_received"]) for c in mpi4dask.connections()
            if c["peer"] == peer]


def move_between_every_two(client):
    """A 1 MiB block made on each worker, fetched by each other one (distributed's own transfer of a
    dependency): whether it arrived intact, and how the receiver is connected to the sender."""
    ws = sorted(client.scheduler_info()["workers"])
    moves = []
    for k, (src, dst) in enumerate((s, d) for s in ws for d in ws if s != d):
        made = client.submit(block, k, workers=[src], pure=False)
        got = client.submit(digest, made, workers=[dst], pure=False).result(timeout=60)
        moves.append({"src": src, "dst": dst, "intact": got == digest(block(k)),
                      "links": client.run(links_to, src, workers=[dst])[dst]})
    return moves


if __name__ == "__main__":
    with LocalCluster(protocol=sys.argv[1], n_workers=1, threads_per_worker=2, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        cluster.adapt(minimum=1, maximum=3, interval="200ms", wait_count=5, target_duration="2s")
        load = client.map(nap, range(200), pure=False)  # 100 s of naps: adapt wants 3 workers
        out = {"calls": 0, "right": 0, "workers": [], "run_mpi_sizes": [], "errors": []}
        phase, t0, i = "up", time.monotonic(), 0
        while time.monotonic() - t0 < 150:
            i += 1
            x = da.random.default_rng(i).random((1200, 1200), chunks=(300, 300))
            a = np.asarray(x.compute(scheduler="sync"))
            try:
                y = (x + x.T).persist()
                got = float(y.sum().compute())
                out["calls"] += 1
                out["right"] += abs(got - float((a + a.T).sum())) <= 1e-9 * abs(got)
                r = mpi4dask.run_mpi(total, y, retries=3, timeout=60)
                out["calls"] += 1
                out["right"] += all(abs(v - got) <= 1e-9 * abs(got) for _, v in r)
                out["run_mpi_sizes"].append(r[0][0])
                del y
            except Exception as e:  # counted: the test fails on any
                out["errors"].append(f"{type(e).__name__}: {e}"[:300])
            n = len(client.scheduler_info()["workers"])
            out["workers"].append(n)
            if phase == "up" and n >= 2 and max(out["run_mpi_sizes"], default=0) >= 2:
                out["links"] = client.run(links)  # the workers adapt added moved bytes over MPI
                out["moves"] = move_between_every_two(client)
                out["up_after"] = time.monotonic() - t0
                phase = "drain"
            if phase == "drain" and all(f.done() for f in load):
                out["naps_right"] = client.gather(load) == list(range(200))
                del load
                phase, down_from = "down", time.monotonic()
            if phase == "down" and n == 1:
                out["down_after"] = time.monotonic() - down_from
                phase = "done"
                break
            if phase == "down":
                # the load falls: calls go on, 1 s apart.  (Under back-to-back calls adapt picks a
                # different idle worker to retire every interval and takes 40-90 s to settle, as
                # much over tcp:// as over mpi://, measured.)
                time.sleep(1.0)
        out["phase"] = phase
        out["iterations"] = i
    print("RESULT " + json.dumps(out), flush=True)
