"""Large payloads moved between the 2 workers of a LocalCluster while busy processes take every core
(tests/test_any_cluster.py, test_large_moves_between_local_workers_keep_up_with_tcp_on_busy_cores).

``python any_cluster_busy_moves.py PROTOCOL``: a LocalCluster of that protocol and ``MOVES`` payloads of
``SIZE`` random bytes, each made on one worker and digested there, then fetched and digested by the other
(alternately) while ``BUSY`` busy pure-Python processes take every core (as work elsewhere on
the node would; started once, they spin only while the other worker fetches).  Prints one
``RESULT <json>`` line: the moves (:func:`_moves.move`) and the duration of each payload's transfer
from the receiving worker's transfer log (distributed's ``transfer_incoming_log``).
"""

import contextlib
import json
import multiprocessing
import os
import sys
import time

from _moves import move

SIZE = 128 << 20
MOVES = 8
BUSY = max(4, 2 * len(os.sched_getaffinity(0)))  # busy processes: two per usable core


def _busy(go, spinning, idle, quit):
    """Spin while ``go`` is set; otherwise wait for it (no CPU).  Says when it starts and stops spinning."""
    while True:
        go.wait()
        if quit.is_set():
            return
        spinning.release()
        while go.is_set() and not quit.is_set():
            for _ in range(10_000):
                pass
        idle.release()


class BusyCores:
    """``BUSY`` processes, started once, that take every core while a :meth:`spinning_while` block runs."""

    def __init__(self):
        spawn = multiprocessing.get_context("spawn")  # not forks of a process with threads and MPI
        self.go, self.quit = spawn.Event(), spawn.Event()
        self.spinning, self.idle = spawn.Semaphore(0), spawn.Semaphore(0)
        self.procs = [spawn.Process(target=_busy, args=(self.go, self.spinning, self.idle, self.quit), daemon=True)
                      for _ in range(BUSY)]
        for p in self.procs:
            p.start()

    def _each(self, said, what: str, timeout: float = 60.0) -> None:
        """Wait until every busy process said it (released ``said``)."""
        deadline = time.monotonic() + timeout
        for _ in self.procs:
            if not said.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"a busy process did not {what} within {timeout} s")

    @contextlib.contextmanager
    def spinning_while(self):
        """Every busy process spins from before the block starts until it ends."""
        self.go.set()
        try:
            self._each(self.spinning, "start spinning")
            yield
        finally:
            self.go.clear()
        self._each(self.idle, "stop spinning")  # (after a block that raised, close() stops them)

    def close(self):
        """Stop the busy processes, spinning or not; those that do not stop in 10 s are terminated."""
        self.quit.set()
        self.go.set()
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)


def transfers(dask_worker):
    return [{"total": d["total"], "duration": d["duration"]} for d in dask_worker.transfer_incoming_log]


if __name__ == "__main__":
    from distributed import Client, LocalCluster

    protocol = sys.argv[1]
    with LocalCluster(protocol=protocol, processes=True, n_workers=2, threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        A, B = sorted(client.scheduler_info()["workers"])
        busy = BusyCores()
        try:
            moves = [move(client, *((A, B) if i % 2 == 0 else (B, A)), SIZE, seed=200 + i,
                          while_fetching=busy.spinning_while) for i in range(MOVES)]
        finally:
            busy.close()
        logs = client.run(transfers)
        durations = sorted(d["duration"] for log in logs.values() for d in log if d["total"] >= SIZE)
        out = {"workers": [A, B], "busy": BUSY, "moves": moves, "durations": durations}
    print("RESULT " + json.dumps(out), flush=True)
