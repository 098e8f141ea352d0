"""A worker SIGKILLed during a computation over mpi:// (tests/test_resilience.py,
test_worker_killed_during_a_computation_over_mpi).

Prints one ``RESULT <json>`` line: whether the answer is right, how long the survivors took to close their
connections to the dead worker, the CPU they use while idle afterwards, and the shared-memory files of
MPICH's that the dead worker mapped and that are still there.
"""

import json
import os
import signal
import threading
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import mpi4dask


def peers():
    return [c["peer"] for c in mpi4dask.connections()]


def mpich_shm_files():
    """The shared-memory files of MPICH's that this process maps (``(deleted)``: their names are gone)."""
    with open("/proc/self/maps") as f:
        return sorted({line.split(maxsplit=5)[-1].strip() for line in f if "/dev/shm/mpich_shm_" in line})


def cpu():
    """This process's CPU seconds, and each thread's (by name), so that a survivor that burns CPU while
    idle says which of its threads did."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                rest = f.read().rpartition(b")")[2].split()
        except OSError:
            continue  # the thread ended
        name = names.get(int(tid), f"native {tid}")
        threads[name] = threads.get(name, 0.0) + (int(rest[11]) + int(rest[12])) / tick  # utime + stime
    return {"total": time.process_time(), "threads": threads}


if __name__ == "__main__":
    with LocalCluster(protocol="mpi", n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        A, B, C = sorted(client.scheduler_info()["workers"])
        rng = da.random.default_rng(42)
        x = rng.random((8000, 8000), chunks=(1000, 1000)).persist()
        a = np.asarray(x)
        ref = float((a + a.T).sum())
        pid_b = client.run(os.getpid, workers=[B])[B]
        shm_b = client.run(mpich_shm_files, workers=[B])[B]
        pids = client.run(os.getpid, workers=[A, C])
        before = client.run(peers, workers=[A, C])
        timer = threading.Timer(0.15, os.kill, (pid_b, signal.SIGKILL))
        killed_at = time.monotonic() + 0.15
        watched = {}

        def watch():
            """How long until no survivor lists a connection to the dead worker any more: watched while the
            computation goes on (measured after it, this would count the computation's own time)."""
            time.sleep(0.15)
            while True:
                try:
                    listed = client.run(peers, workers=[A, C])
                except Exception as exc:  # noqa: BLE001 - a survivor is gone: reported, the test fails on it
                    watched.update(error=f"{type(exc).__name__}: {exc}", left={}, closed_after=None)
                    return
                left = {w: [p for p in ps if p == B] for w, ps in listed.items()}
                if not any(left.values()) or time.monotonic() - killed_at > 20:
                    watched.update(left=left, closed_after=time.monotonic() - killed_at)
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        timer.start()
        watcher.start()
        t0 = time.monotonic()
        got = float((x + x.T).sum().compute())
        compute_s = time.monotonic() - t0
        watcher.join(30)
        if watched.get("error"):  # a survivor stopped answering: say so, and end (the test fails on it)
            print("RESULT " + json.dumps({"watch_error": watched["error"], "right": abs(got - ref) <= 1e-9 * abs(ref),
                                          "workers": sorted(client.scheduler_info()["workers"])}), flush=True)
            raise SystemExit(0)
        left, closed_after = watched["left"], watched["closed_after"]
        time.sleep(1.0)
        survivors = [A, C]
        c0 = client.run(cpu, workers=survivors)
        time.sleep(2.0)
        c1 = client.run(cpu, workers=survivors)
        out = {"right": abs(got - ref) <= 1e-9 * abs(ref), "got": got, "ref": ref,
               "had_b": {w: B in ps for w, ps in before.items()}, "left": left, "closed_after": closed_after,
               "watch_error": None,
               "shm_b": shm_b, "shm_b_left": [p for p in shm_b if os.path.exists(p.removesuffix(" (deleted)"))],
               "idle_cpu": [c1[w]["total"] - c0[w]["total"] for w in survivors],
               "idle_cpu_by_thread": [{t: round(s - c0[w]["threads"].get(t, 0.0), 3)
                                       for t, s in c1[w]["threads"].items() if s - c0[w]["threads"].get(t, 0.0) > 0}
                                      for w in survivors],
               "workers_now": len(client.scheduler_info()["workers"]), "compute_s": compute_s,
               "survivors_pids": [pids[w] for w in survivors],
               "survivors_pids_now": [client.run(os.getpid, workers=[w]).get(w) for w in survivors]}
    print("RESULT " + json.dumps(out), flush=True)
