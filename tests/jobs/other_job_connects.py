"""Rank 1 of this mpiexec job connects three times to a listener of another job of the same size
(tests/test_mpi_init.py, test_a_rank_of_another_job_of_the_same_size_is_told_apart_at_once).

Usage: mpiexec -n 2 python other_job_connects.py ADDRESS_FILE

Every rank initialises MPI (an MPI program).  Prints ``OTHER JOB mpi=.. connect=..s`` per connection, then
creates ADDRESS_FILE.stop to end the other job.
"""
import asyncio
import sys
import time

# isort: off
from mpi4py import MPI  # an MPI program: every rank initialises MPI (before distributed, as such programs do)
from distributed.comm import connect
# isort: on


async def main():
    if MPI.COMM_WORLD.rank != 1:  # rank 1 of this job, connecting to rank 0 of the other
        return
    address = open(sys.argv[1]).read()
    for i in range(3):
        t0 = time.monotonic()
        comm = await connect(address, timeout=30)
        took = time.monotonic() - t0
        await comm.write({"other": i})
        assert await comm.read() == {"other": i}
        print(f"OTHER JOB mpi={comm.uses_mpi} connect={took:.3f}s", flush=True)
        await comm.close()
    open(sys.argv[1] + ".stop", "w").close()


asyncio.run(main())
MPI.COMM_WORLD.Barrier()
