"""A script as README's example is written, in part of a larger MPI program (tests/test_launcher.py,
test_a_client_left_open_ends_with_the_job_without_reconnecting).  Run with ``mpiexec -n 6``.

World ranks 4 and 5 do their own MPI work on their own communicator and end; ranks 0-3 make the cluster
with ``initialize(comm=sub)`` (the default ``exit=True``), and the client rank leaves its ``Client()``
open: the job ends when the script does (``atexit``).  Prints ``OUTSIDE sum=..`` on ranks 4-5 and
``RESULT <json>`` on the client rank.
"""
import json

from mpi4py import MPI

world = MPI.COMM_WORLD
inside = world.Get_rank() < 4
sub = world.Split(0 if inside else 1, world.Get_rank())

if inside:
    import mpi4dask

    mpi4dask.initialize(comm=sub)

    import dask.array as da
    from distributed import Client

    client = Client()  # left open, as README's example leaves it
    x = da.arange(100, chunks=10).persist()
    total = int(x.sum().compute())
    ranks = mpi4dask.run_mpi(lambda comm, parts: comm.allreduce(sum(int(b.sum()) for b in parts.values())), x)
    print("RESULT " + json.dumps({"sum": total, "run_mpi": ranks, "id": client.id}), flush=True)
else:
    print(f"OUTSIDE sum={sub.allreduce(world.Get_rank())}", flush=True)
