"""Real MPI work on Dask data, checked against NumPy.

    mpiexec -n 5 python examples/mpi_sort_and_dot.py

1. A distributed dot product ``X.T @ y`` of a dask array ``X`` (row blocks) with a vector ``y``:
   blocks with the same index are co-located, each worker multiplies its own, and ``Allreduce``
   sums over the workers.  Then ``map_blocks_mpi`` makes new blocks ``X * y[:, None]`` in place, as
   a dask array with ``X``'s chunks.
2. A parallel sample sort with ``Alltoallv``: every worker sends each value to the rank that owns its
   range, sorts what it receives, and the client checks the concatenation against ``np.sort``.
"""

import dask.array as da
import numpy as np
from distributed import Client

import mpi4dask


def xty(comm, X_parts, y_parts):
    """X.T @ y: each worker multiplies its row blocks (i, 0) of X with the blocks (i, 0) of y beside
    them, and an Allreduce over the participating workers sums the partial products."""
    from mpi4py import MPI

    ncols = comm.allreduce(max([b.shape[1] for b in X_parts.values()], default=0), op=MPI.MAX)
    partial = np.zeros(ncols)
    for index, block in X_parts.items():
        partial += block.T @ y_parts[index][:, 0]
    total = np.empty_like(partial)
    comm.Allreduce(partial, total)
    return total


def scale_rows(comm, X_parts, y_parts):
    """New blocks of X * y[:, None], one per block this worker was given (map_blocks_mpi)."""
    return {index: block * y_parts[index] for index, block in X_parts.items()}


def sample_sort(comm, parts):
    """Sort all values across ranks with one Alltoallv; rank r returns the r-th slice of the result."""
    from mpi4py import MPI

    local = np.concatenate([parts[i] for i in sorted(parts)]) if parts else np.empty(0)
    # splitters from a regular sample of every rank
    sample = np.quantile(local, np.linspace(0, 1, comm.size + 1)[1:-1]) if local.size else np.empty(0)
    samples = np.concatenate(comm.allgather(sample))
    splitters = np.quantile(samples, np.linspace(0, 1, comm.size + 1)[1:-1]) if samples.size else np.empty(0)
    dest = np.searchsorted(splitters, local, side="right")
    order = np.argsort(dest, kind="stable")
    sendbuf = local[order]
    sendcounts = np.bincount(dest, minlength=comm.size).astype(np.int64)
    recvcounts = np.empty(comm.size, dtype=np.int64)
    comm.Alltoall(sendcounts, recvcounts)
    recvbuf = np.empty(int(recvcounts.sum()), dtype=local.dtype)
    sdispl = np.concatenate([[0], np.cumsum(sendcounts)[:-1]])
    rdispl = np.concatenate([[0], np.cumsum(recvcounts)[:-1]])
    comm.Alltoallv([sendbuf, sendcounts, sdispl, MPI.DOUBLE], [recvbuf, recvcounts, rdispl, MPI.DOUBLE])
    return np.sort(recvbuf)


def main():
    mpi4dask.initialize()
    with Client():
        rng = np.random.default_rng(7)
        X_np = rng.standard_normal((6000, 40))
        y_np = rng.standard_normal(6000)
        X = da.from_array(X_np, chunks=(1000, 40)).persist()
        y = da.from_array(y_np, chunks=1000).persist()

        # X's blocks are indexed (i, 0) and y's (i,): give y the same 2-d index space
        y2 = y[:, None]
        got_xty = mpi4dask.run_mpi(xty, X, y2)
        for r in got_xty:
            np.testing.assert_allclose(r, X_np.T @ y_np, rtol=1e-10)
        scaled = mpi4dask.map_blocks_mpi(scale_rows, X, y2)
        assert scaled.chunks == X.chunks
        np.testing.assert_allclose(scaled.compute(), X_np * y_np[:, None], rtol=1e-12)
        print(f"dot product: X.T @ y over {len(got_xty)} ranks matches NumPy "
              f"(|X.T y| = {np.linalg.norm(got_xty[0]):.6f}); scaled blocks keep chunks {X.chunks[0]}", flush=True)

        values = da.from_array(rng.standard_normal(200_000), chunks=25_000).persist()
        pieces = mpi4dask.run_mpi(sample_sort, values)
        result = np.concatenate(pieces)
        assert np.array_equal(result, np.sort(values.compute())), "parallel sort differs from np.sort"
        print(f"sample sort: {result.size} values over {len(pieces)} ranks (sizes {[p.size for p in pieces]}) "
              f"match np.sort", flush=True)


if __name__ == "__main__":
    main()
