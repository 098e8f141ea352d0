"""A chaos run: for SECONDS, random worker kills, joins and departures (scale up and down) while Dask
computations and run_mpi calls go on, on a LocalCluster whose MPI Dask formed itself.

    python tests/jobs/chaos.py SECONDS SEED [PROTOCOL]

Every answer is checked against NumPy.  Counts: right, failed with a clear error (an exception
naming what went wrong: KilledWorker after repeated deaths, ...), wrong, hung (a call that did not
return within CALL_TIMEOUT).  Prints one ``RESULT <json>`` line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time

import numpy as np

CALL_TIMEOUT = 90.0


def total(comm, parts):
    local = sum(float(np.asarray(b).sum()) for b in parts.values())
    return comm.allreduce(local)


def _call(kind: str, x, result: dict) -> None:
    import mpi4dask

    try:
        if kind == "compute":
            result["value"] = float((x + x.T).sum().compute())
        else:
            r = mpi4dask.run_mpi(total, x.persist(), retries=3, timeout=60)
            result["value"] = r[0] if len(set(r)) == 1 else float("nan")
    except Exception as e:  # noqa: BLE001 - counted and shown
        result["error"] = f"{type(e).__name__}: {e}"


def main(seconds: float, seed: int, protocol: str) -> dict:
    import dask.array as da
    from distributed import Client, LocalCluster

    rng = random.Random(seed)
    counts = {"right": 0, "failed": 0, "wrong": 0, "hung": 0, "kills": 0, "scales": 0,
              "run_mpi_right": 0, "run_mpi_calls": 0, "compute_right": 0, "compute_calls": 0}
    errors: list[str] = []
    times = {"run_mpi": [], "compute": []}
    with LocalCluster(protocol=protocol, n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        stop = threading.Event()

        def chaos():
            while not stop.wait(rng.uniform(1.0, 3.0)):
                try:
                    workers = client.scheduler_info()["workers"]
                    if rng.random() < 0.6 and len(workers) >= 2:
                        victim = rng.choice(sorted(workers))
                        pid = client.run(os.getpid, workers=[victim]).get(victim)
                        if pid:
                            os.kill(pid, signal.SIGKILL)
                            counts["kills"] += 1
                    else:
                        cluster.scale(rng.randint(2, 4))
                        counts["scales"] += 1
                except Exception as e:  # noqa: BLE001 - the cluster is in flux: try again later
                    errors.append(f"chaos: {type(e).__name__}: {e}"[:200])

        monkey = threading.Thread(target=chaos, daemon=True)
        monkey.start()
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            i += 1
            n = rng.choice([600, 1000, 1400])
            x = da.random.default_rng(seed + i).random((n, n), chunks=(n // 4, n // 4))
            ref = None
            kind = "run_mpi" if i % 2 else "compute"
            result: dict = {}

            t0 = time.monotonic()
            th = threading.Thread(target=_call, args=(kind, x, result), daemon=True)
            th.start()
            th.join(CALL_TIMEOUT)
            counts[f"{kind}_calls"] += 1
            if th.is_alive():
                import faulthandler

                counts["hung"] += 1
                errors.append(f"{kind} call {i} hung")
                faulthandler.dump_traceback(all_threads=True)  # where it hangs, for the report
                break
            times[kind].append(time.monotonic() - t0)
            a = np.asarray(x.compute(scheduler="sync"))
            ref = float((a + a.T).sum()) if kind == "compute" else float(a.sum())
            if "error" in result:
                counts["failed"] += 1
                errors.append(f"{kind} call {i}: {result['error']}"[:300])
            elif abs(result["value"] - ref) <= 1e-9 * abs(ref):
                counts["right"] += 1
                counts[f"{kind}_right"] += 1
            else:
                counts["wrong"] += 1
                errors.append(f"{kind} call {i}: got {result['value']}, expected {ref}")
        stop.set()
        monkey.join(10)
    med = {k: (sorted(v)[len(v) // 2] if v else None) for k, v in times.items()}
    return {"counts": counts, "errors": errors[:20], "median_seconds": med}


if __name__ == "__main__":
    secs, seed = float(sys.argv[1]), int(sys.argv[2])
    proto = sys.argv[3] if len(sys.argv) > 3 else "mpi"
    out = main(secs, seed, proto)
    print("RESULT " + json.dumps(out), flush=True)
