"""``initialize(comm=...)``: Dask in part of a larger MPI program (tests/test_launcher.py,
test_initialize_on_a_subcommunicator).  Run with ``mpiexec -n 5``.

World rank 0 stays out of the cluster and does its own point-to-point work with the client rank meanwhile
(prints ``OUTSIDER ok=..``); the other four make the cluster from a Split, their roles by their rank in it.
The client rank prints ``CLUSTER <json>`` (who is client, scheduler and workers, their names and memory);
every cluster rank prints ``AFTER rank=R client=..``.
"""
import json

import numpy as np
from mpi4py import MPI

world = MPI.COMM_WORLD
me = world.Get_rank()
side = world.Dup()  # world rank 0's own channel to the client rank (Dup is collective: every rank)
# world rank 0 stays out; the others make the cluster, in reverse order: sub ranks 0, 1, 2, 3 are
# world ranks 4 (scheduler), 3 (client), 2 and 1 (workers)
sub = world.Split(MPI.UNDEFINED if me == 0 else 0, key=-me)

if me == 0:  # its own MPI work, while the cluster runs: data to the client rank, the answer back
    a = np.random.default_rng(7).standard_normal(100_000)
    side.Send(a, dest=3, tag=11)
    answer = np.empty(1)
    side.Recv(answer, source=3, tag=12)
    print(f"OUTSIDER ok={bool(np.isclose(answer[0], (a * a).sum(), rtol=1e-12))}", flush=True)
else:
    from mpi4dask.launcher import initialize, shutdown
    is_client = initialize(comm=sub, exit=False)
    if is_client:
        import dask.array as da
        from distributed import Client
        from distributed.system import MEMORY_LIMIT

        a = np.empty(100_000)
        side.Recv(a, source=0, tag=11)
        with Client() as client:
            x = da.from_array(a, chunks=10_000)
            total = float((x * x).sum().compute())
            workers = client.scheduler_info()["workers"].values()
            report = {
                "client": me,
                "scheduler": client.run_on_scheduler(lambda: MPI.COMM_WORLD.Get_rank()),
                "workers": sorted(client.run(lambda: MPI.COMM_WORLD.Get_rank()).values()),
                "names": sorted(str(w["name"]) for w in workers),
                "memory": sorted(w["memory_limit"] for w in workers),
                "share": MEMORY_LIMIT // 2,
            }
        side.Send(np.array([total]), dest=0, tag=12)
        print("CLUSTER " + json.dumps(report), flush=True)
        shutdown()
    print(f"AFTER rank={me} client={is_client}", flush=True)
