"""A client of an MPMD ``dask scheduler`` / ``dask worker`` job over mpi:// (tests/test_mpi_init.py,
test_mpmd_dask_cli_job_registers_its_workers_without_a_client).

Usage: mpmd_client.py SCHEDULER_FILE

Checks that both workers registered, that 500 tasks sum right and that every worker's batched stream uses MPI;
prints ``CLIENT OK <total>`` and shuts the cluster down.
"""
import sys

from distributed import Client

with Client(scheduler_file=sys.argv[1], timeout=30) as c:
    assert len(c.scheduler_info()["workers"]) == 2
    total = sum(c.gather(c.map(lambda x: x + 1, range(500))))
    assert total == sum(range(1, 501)), total
    modes = c.run(lambda dask_worker: dask_worker.batched_stream.comm.uses_mpi)
    assert set(modes.values()) == {True}, modes
    print("CLIENT OK", total)
    c.shutdown()
