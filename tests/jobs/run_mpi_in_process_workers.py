"""run_mpi on a cluster whose workers run inside this process (``Client(processes=False)``)
(tests/test_handoff.py, test_workers_sharing_one_process_are_named).

With 2 in-process workers (one process, so one MPI rank), run_mpi must refuse at once, naming both and
the fix; the cluster keeps computing; with 1 in-process worker run_mpi works.  Prints one ``RESULT <json>``
line.
"""

import json
import time


def _size_and_sum(comm, parts):
    return [comm.Get_size(), sum(float(b.sum()) for b in parts.values())]


if __name__ == "__main__":
    import dask.array as da
    from distributed import Client

    import mpi4dask

    out = {}
    with Client(processes=False, protocol="mpi", n_workers=2, threads_per_worker=1, dashboard_address=None) as client:
        out["workers"] = sorted(client.scheduler_info()["workers"])
        x = da.arange(1000.0, chunks=100).persist()
        t0 = time.monotonic()
        try:
            out["two"] = mpi4dask.run_mpi(lambda comm, parts: comm.Get_size(), x)
        except Exception as e:  # noqa: BLE001 - the test checks what it was
            out["two_error"] = [type(e).__name__, str(e)]
        out["two_seconds"] = time.monotonic() - t0
        out["sum_after"] = float(x.sum().compute())
    with Client(processes=False, protocol="mpi", n_workers=1, threads_per_worker=1, dashboard_address=None) as client:
        x = da.arange(1000.0, chunks=100).persist()
        out["one"] = mpi4dask.run_mpi(_size_and_sum, x)
    print("RESULT " + json.dumps(out), flush=True)
