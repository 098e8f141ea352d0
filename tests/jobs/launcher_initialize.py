"""``mpi4dask.launcher.initialize`` under mpiexec or srun, then a scenario on the client rank
(tests/test_launcher.py and tests/test_slurm.py).

Usage: launcher_initialize.py PROTOCOL SCENARIO [--memory-limit LIMIT]

Scenarios (the code after ``initialize()``, which runs on the client rank only):

* ``computes``: prints BODY, ``Client()`` with no address finds the job's cluster, ``check(client, 2)``;
  the client is left open on purpose (the exit hook closes it).
* ``raises``: computes one task, prints COMPUTED, then raises RuntimeError("boom-from-rank-1").
* ``no_thread``: ``check(client, 1)``, then an exit hook that runs before the launcher's (atexit is LIFO)
  refuses new threads, as Python >= 3.12 does at shutdown (dask-mpi #87).
* ``client_shutdown``: ``check(client, 2)``, ``client.shutdown()``, then the script goes on (AFTER-SHUTDOWN).
* ``exit_false``: ``initialize(PROTOCOL, exit=False)`` instead: rank 1 gets True, checks, ends the cluster
  with ``shutdown()``; every rank then prints ``AFTER rank=R client=True|False``.
"""

import _thread
import argparse
import atexit
import sys
import threading
import time

from _check import check

from mpi4dask.launcher import initialize, shutdown


def computes():
    from distributed import Client  # after initialize(), as a user's script does

    print("BODY", flush=True)
    client = Client()  # no address: the job's scheduler, via dask config
    check(client, 2)
    # left open on purpose: the exit hook closes it
    return client


def raises():
    from distributed import Client

    client = Client()
    assert client.submit(sum, [1, 2, 3]).result() == 6
    print("COMPUTED", flush=True)
    raise RuntimeError("boom-from-rank-1")


def no_thread():
    from distributed import Client

    client = Client()
    check(client, 1)

    def refuse(*args, **kwargs):
        print("THREAD REFUSED", file=sys.stderr, flush=True)
        raise RuntimeError("can't create new thread at interpreter shutdown")

    def forbid_threads():
        threading._start_new_thread = refuse
        _thread.start_new_thread = refuse
        threading.Thread.start = refuse

    atexit.register(forbid_threads)  # runs before the launcher's hook (atexit is LIFO)
    return client


def client_shutdown():
    from distributed import Client

    client = Client()
    check(client, 2)
    client.shutdown()
    time.sleep(1.0)
    print("AFTER-SHUTDOWN", flush=True)


def exit_false(protocol, kwargs):
    from mpi4py import MPI

    is_client = initialize(protocol, exit=False, **kwargs)
    if is_client:
        from distributed import Client

        with Client() as client:
            check(client, 2)
        shutdown()
    print(f"AFTER rank={MPI.COMM_WORLD.Get_rank()} client={is_client}", flush=True)


SCENARIOS = {f.__name__: f for f in (computes, raises, no_thread, client_shutdown)}

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("protocol")
parser.add_argument("scenario", choices=[*SCENARIOS, "exit_false"])
parser.add_argument("--memory-limit")
args = parser.parse_args()
kwargs = {} if args.memory_limit is None else {"memory_limit": args.memory_limit}
if args.scenario == "exit_false":
    exit_false(args.protocol, kwargs)
else:
    initialize(args.protocol, **kwargs)
    kept = SCENARIOS[args.scenario]()  # a client left open stays referenced until the exit hook runs
