"""A client outside the job: computes on a cluster that ``mpi4dask serve`` (or dask's CLI) runs, then shuts it
down (tests/test_launcher.py: test_serve_with_external_client, test_dask_cli_mpmd_job*; tests/test_slurm.py:
test_serve_in_an_sbatch_job_with_a_client_outside).

Usage: serve_client.py SCHEDULER_FILE N_WORKERS [--wait]

``mpi4dask serve`` writes its scheduler file once all its workers have registered: the client counts them
at once.  dask's own ``dask scheduler --scheduler-file`` writes it as it starts, before any worker has
read it: with ``--wait`` the client waits for them, as a user of dask's CLI does.

Prints the CHECK line of ``_check.check`` and ``SHUTDOWN SENT``.
"""
import sys

from _check import check
from distributed import Client

client = Client(scheduler_file=sys.argv[1], timeout=60)
n = int(sys.argv[2])
if "--wait" in sys.argv[3:]:
    client.wait_for_workers(n, timeout=60)
assert len(client.scheduler_info()["workers"]) == n   # (serve writes the file once all are registered)
check(client, n)
client.shutdown()
print("SHUTDOWN SENT", flush=True)
