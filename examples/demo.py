"""A Dask computation whose messages travel over MPI.

Run it with (4 ranks: scheduler, this script, 2 workers):

    mpiexec -n 4 python examples/demo.py            # over mpi://
    mpiexec -n 4 python examples/demo.py tcp        # the same over tcp://, to compare

Rank 0 becomes the scheduler, ranks 2 and 3 workers; only rank 1 runs the code after initialize().
"""

import sys
import time

import mpi4dask

mpi4dask.initialize(protocol=sys.argv[1] if len(sys.argv) > 1 else "mpi")

import dask.array as da  # noqa: E402
import numpy as np  # noqa: E402
from distributed import Client  # noqa: E402

with Client() as client:
    workers = client.scheduler_info()["workers"]
    print(f"scheduler {client.scheduler.address}, {len(workers)} workers: {', '.join(workers)}")

    # 16 random chunks of 8 MB, made on the workers and kept there
    x = da.random.default_rng(0).standard_normal((4000, 4000), chunks=(1000, 1000)).persist()
    a = x.compute()  # a numpy copy, gathered to this rank, to check the result against

    t0 = time.perf_counter()
    result = (x + x.T).sum(axis=0).compute()  # x.T pairs chunks held by different workers
    elapsed = time.perf_counter() - t0

    expected = (a + a.T).sum(axis=0)
    ok = np.allclose(result, expected, rtol=1e-12, atol=1e-9)
    print(f"(x + x.T).sum(axis=0) on 4000x4000 float64: {elapsed:.3f} s, max |error| "
          f"{np.abs(result - expected).max():.2e}")
    if not ok:
        sys.exit("demo FAILED: result differs from numpy")
    print("demo OK")
