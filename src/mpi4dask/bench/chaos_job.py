"""The cluster side of ``mpi4dask stress chaos`` (private).

Not launched by ``mpiexec``: ``python -m mpi4dask.bench.chaos_job --config FILE
--result FILE`` is a plain process that starts a ``LocalCluster(protocol=P, processes=True,
n_workers=3, threads_per_worker=1)`` (the workers are processes Dask spawned, under Nannies) and,
for ``--seconds``:

* **the monkey** (a thread): every 1-3 s, with probability 0.6 it SIGKILLs the process of a random
  worker (its Nanny starts a new one, which joins MPI afresh), otherwise it calls
  ``cluster.scale(k)`` with k in 2..4 (workers join or retire).  With ``--scaling adapt`` the
  cluster runs ``cluster.adapt(minimum=2, maximum=4)`` instead and the monkey only kills.
* **the calls** (one at a time, alternating): ``(x + x.T).sum().compute()`` and
  ``run_mpi(allreduce of the chunk sums, x.persist(), retries=3, timeout=60)``, on a new random
  ``n x n`` array each time (n in 600/1000/1400, 4 x 4 chunks).  Every answer is checked against
  NumPy.

Each call is counted once: **right**, **failed** (it raised; the message is kept: Dask's
``KilledWorker`` after repeated deaths of the workers computing one task is the clear error
expected), **wrong** (an answer that differs from NumPy's), or **hung** (no return within
``--call-timeout``: the stacks of this process and of every worker that still answers go to
stderr, and the run stops there).  The random choices come from ``--seed``; the kills' timing
against the calls depends on the machine, so two runs with one seed are alike, not identical.

The result is JSON in ``--result``; a watchdog ends the process at ``--deadline``, with its stacks.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
import warnings

from .._jobs import bounded
from .chaos import JOB, KILL_SHARE, PAUSE_RANGE, RUN_MPI_RETRIES, RUN_MPI_TIMEOUT, SCALE_RANGE, SIZES, START_WORKERS
from .jobutil import Doing, arm_watchdog, job_config, mpi_versions, quiet_distributed_logs, write_json

doing = Doing()
STACKS_TIMEOUT = 10.0  # seconds to wait for the workers' stacks after a hang


def chunk_total(comm, parts):
    """The ``run_mpi`` function: every rank returns the sum over all chunks."""
    import numpy as np

    local = sum(float(np.asarray(b).sum()) for b in parts.values())
    return comm.allreduce(local)


def _call(kind: str, x) -> float:
    """One call: the computation's answer, or the value every rank of the run_mpi call agrees on."""
    import mpi4dask

    if kind == "compute":
        return float((x + x.T).sum().compute())
    values = mpi4dask.run_mpi(chunk_total, x.persist(), retries=RUN_MPI_RETRIES, timeout=RUN_MPI_TIMEOUT)
    return values[0] if len(set(values)) == 1 else float("nan")


def versions_if_mpi() -> dict | None:
    """On a worker: :func:`~.jobutil.mpi_versions` where this process has initialised MPI, else None."""
    from mpi4dask import _mpi

    return mpi_versions() if _mpi.initialized_world() is not None else None


def _machine(client) -> dict:
    """The MPI library and versions, from a worker that has used MPI (run_mpi calls made it); {}
    when none answers within STACKS_TIMEOUT (the report then says "?")."""
    from . import chaos_job as me

    found = bounded(STACKS_TIMEOUT, lambda: client.run(me.versions_if_mpi), "chaos-versions").get("value", {})
    return next((v for v in found.values() if v), {})


def _dump_stacks(client) -> None:
    """After a hang: this process's stacks, and those of every worker that still answers."""
    sys.stderr.write("\nmpi4dask stress chaos: a call hung; the client process's stacks:\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def ask():
        pids = client.run(os.getpid)
        client.run(faulthandler.dump_traceback, all_threads=True)  # on each worker's stderr
        return pids

    got = bounded(STACKS_TIMEOUT, ask, "chaos-stacks")
    answer = (repr(got["error"]) if "error" in got else "all answered" if got
              else f"no answer within {STACKS_TIMEOUT:g} s")
    sys.stderr.write(f"\nworkers' stacks above (workers: {got.get('value')}; {answer})\n")
    _py_spy_children()
    sys.stderr.flush()


def _py_spy_children() -> None:
    """Where py-spy is installed: the Python and native stacks of every process this one started
    (a frozen worker answers no client.run)."""
    import shutil
    import subprocess

    import psutil

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        sys.stderr.write("(install py-spy for the stacks of workers that do not answer)\n")
        return
    for child in psutil.Process().children(recursive=True):
        try:
            out = subprocess.run([spy, "dump", "--native", "--pid", str(child.pid)], capture_output=True,
                                 text=True, timeout=STACKS_TIMEOUT)
            sys.stderr.write(f"\npy-spy dump --native --pid {child.pid} ({' '.join(child.cmdline())[:100]}):\n"
                             f"{out.stdout}{out.stderr}")
        except (subprocess.SubprocessError, psutil.Error, OSError) as exc:
            sys.stderr.write(f"\npy-spy of {child.pid}: {exc!r}\n")


class Monkey(threading.Thread):
    """Kills a random worker's process, or scales the cluster, every 1-3 s until stopped."""

    def __init__(self, client, cluster, rng: random.Random, scale: bool):
        super().__init__(name="chaos-monkey", daemon=True)
        self.client, self.cluster, self.rng, self.scale = client, cluster, rng, scale
        self.stop = threading.Event()
        self.kills = 0
        self.scales = 0
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(*PAUSE_RANGE)):
            try:
                workers = sorted(self.client.scheduler_info()["workers"])
                if (not self.scale or self.rng.random() < KILL_SHARE) and len(workers) >= 2:
                    victim = self.rng.choice(workers)
                    pid = self.client.run(os.getpid, workers=[victim]).get(victim)
                    if pid:
                        os.kill(pid, signal.SIGKILL)
                        self.kills += 1
                elif self.scale:
                    self.cluster.scale(self.rng.randint(*SCALE_RANGE))
                    self.scales += 1
            except Exception as e:  # noqa: BLE001 - the cluster is in flux: counted, then tried again
                self.errors.append(f"{type(e).__name__}: {e}"[:200])


def run_chaos(args, publish) -> dict:
    """The chaos run; ``publish(body)`` is called with the counts as soon as the calls end, before
    the cluster closes (a cluster frozen by a hang may not close before the deadline)."""
    import dask.array as da
    import numpy as np
    from distributed import Client, LocalCluster

    rng = random.Random(args.seed)
    counts = {"calls": 0, "right": 0, "failed": 0, "wrong": 0, "hung": 0,
              "compute_calls": 0, "compute_right": 0, "run_mpi_calls": 0, "run_mpi_right": 0}
    errors: list[str] = []
    seconds: dict[str, list[float]] = {"compute": [], "run_mpi": []}
    sizes: list[int] = []  # workers in the cluster after each call
    doing("starting the LocalCluster")
    with LocalCluster(protocol=args.protocol, n_workers=START_WORKERS, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        if args.scaling == "adapt":
            cluster.adapt(minimum=SCALE_RANGE[0], maximum=SCALE_RANGE[1], interval="500ms", wait_count=4)
        monkey = Monkey(client, cluster, rng, scale=args.scaling == "scale")
        monkey.start()
        t_start = time.monotonic()
        deadline = t_start + args.seconds
        i = 0
        while time.monotonic() < deadline:
            i += 1
            n = rng.choice(SIZES)
            x = da.random.default_rng(args.seed + i).random((n, n), chunks=(n // 4, n // 4))
            kind = "run_mpi" if i % 2 else "compute"
            doing(f"call {i} ({kind}, n={n})")
            t0 = time.monotonic()
            out = bounded(args.call_timeout, functools.partial(_call, kind, x), f"call-{i}")
            counts["calls"] += 1
            counts[f"{kind}_calls"] += 1
            if not out:
                counts["hung"] += 1
                errors.append(f"{kind} call {i} hung (no return in {args.call_timeout:g} s)")
                _dump_stacks(client)
                break
            seconds[kind].append(time.monotonic() - t0)
            sizes.append(len(client.scheduler_info()["workers"]))
            a = np.asarray(x.compute(scheduler="sync"))
            ref = float((a + a.T).sum()) if kind == "compute" else float(a.sum())
            if "error" in out:
                counts["failed"] += 1
                errors.append(f"{kind} call {i}: {type(out['error']).__name__}: {out['error']}"[:300])
            elif abs(out["value"] - ref) <= 1e-9 * abs(ref):
                counts["right"] += 1
                counts[f"{kind}_right"] += 1
            else:
                counts["wrong"] += 1
                errors.append(f"{kind} call {i}: got {out['value']!r}, expected {ref!r}")
        elapsed = time.monotonic() - t_start
        doing("stopping the monkey")
        monkey.stop.set()
        monkey.join(10)
        counts.update(kills=monkey.kills, scales=monkey.scales)
        body = {"counts": counts, "errors": errors[:50], "monkey_errors": monkey.errors[:20], "elapsed_s": elapsed,
                "call_seconds": {k: sorted(v) for k, v in seconds.items()},
                "workers_seen": [min(sizes, default=0), max(sizes, default=0)]}
        publish(body)
        if not counts["hung"]:
            body["machine"] = _machine(client)
        doing("closing the cluster")
    return body


def main(argv=None) -> int:
    args = job_config(JOB, argv)
    arm_watchdog(args.deadline, "chaos", doing)
    # before distributed is imported: the workers Dask spawns read it from their environment too
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
    warnings.filterwarnings("ignore", message="Port .* is already in use")
    quiet_distributed_logs()
    # every kill makes the scheduler and the nannies warn (lost tasks, restarts): the report counts them
    logging.getLogger("distributed").setLevel(logging.ERROR)
    # functions sent to the workers must be pickled by reference (this module), not by value (__main__)
    from mpi4dask.bench import chaos_job as me

    def publish(body: dict) -> None:
        write_json(args.result, {"benchmark": "chaos", "protocol": args.protocol, "cpu_count": os.cpu_count(),
                                 "config": {k: v for k, v in vars(args).items() if k not in ("result", "deadline")},
                                 **body})

    try:
        publish(me.run_chaos(args, publish))
    except BaseException as exc:  # noqa: BLE001 - reported in the result and on stderr
        traceback.print_exc()
        write_json(args.result, {"benchmark": "chaos", "protocol": args.protocol,
                                 "error": f"{doing}: {type(exc).__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
