"""Bad ``comm=`` arguments to initialize() and serve() are refused on each rank before any collective
(tests/test_launcher.py, test_initialize_refuses_bad_communicators).  Run with ``mpiexec -n 3``.

Each rank prints one ``ERRORS <json> END`` line: its rank and the error each bad communicator gave.
"""
import json

from mpi4py import MPI

from mpi4dask.launcher import initialize, serve

world = MPI.COMM_WORLD
me = world.Get_rank()
pair = world.Split(0 if me < 2 else 1, me)                  # sizes 2 (ranks 0, 1) and 1 (rank 2)
half = world.Split(0 if me < 2 else MPI.UNDEFINED, me)      # COMM_NULL on rank 2
inter = pair.Create_intercomm(0, world, 2 if me < 2 else 0, tag=5)
errors = {"rank": me}
for label, call in [
    ("string", lambda: initialize(comm="world")),
    ("null", lambda: initialize(comm=MPI.COMM_NULL)),
    ("small", lambda: initialize(comm=pair)),
    ("inter", lambda: initialize(comm=inter)),
    ("serve-small", lambda: serve("s.json", comm=MPI.COMM_SELF)),
] + ([("undefined", lambda: initialize(comm=half))] if me == 2 else []):
    try:
        call()
    except (TypeError, ValueError) as exc:
        errors[label] = f"{type(exc).__name__}: {exc}"
print("ERRORS " + json.dumps(errors) + " END", flush=True)
