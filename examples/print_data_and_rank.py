"""Every worker prints the chunks it holds and its MPI rank: the classic "Dask to MPI" hand-off.

    mpiexec -n 5 python examples/print_data_and_rank.py

Rank 0 of the job runs the scheduler, rank 1 this script, ranks 2-4 the workers.  ``run_mpi`` calls
``print_data_and_rank`` once in each worker that holds chunks of ``x``, with a communicator of just
those workers, on the chunks already in that worker's memory.
"""

import dask.array as da
import numpy as np
from distributed import Client

import mpi4dask


def print_data_and_rank(comm, parts):
    """Runs inside each participating worker: ``parts`` is {block index: numpy chunk}."""
    from mpi4py import MPI

    name = MPI.Get_processor_name()
    for index, chunk in sorted(parts.items()):
        print(f"rank {comm.rank} of {comm.size} on {name}: block {index}, shape {chunk.shape}, "
              f"sum {chunk.sum():g}", flush=True)
    total = comm.allreduce(sum(float(c.sum()) for c in parts.values()))  # a collective over the workers
    return comm.rank, sorted(parts), total


def main():
    mpi4dask.initialize()  # ranks 0 and 2+ serve the cluster and return only at exit
    with Client():
        x = da.arange(24.0, chunks=4).reshape(4, 6).rechunk((2, 3)).persist()
        results = mpi4dask.run_mpi(print_data_and_rank, x)
        expected = float(np.arange(24.0).sum())
        for rank, blocks, total in results:
            print(f"client: rank {rank} had blocks {blocks}; allreduce over the workers = {total:g}")
            assert total == expected, (total, expected)
        assert sorted(b for _, bs, _ in results for b in bs) == [(i, j) for i in range(2) for j in range(2)]
        print(f"print_data_and_rank: OK ({len(results)} ranks, sum {expected:g})", flush=True)


if __name__ == "__main__":
    main()
