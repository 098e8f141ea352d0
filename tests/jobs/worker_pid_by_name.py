"""Print the pid of the worker named 2 of a cluster, which the test then kills (tests/test_resilience.py,
test_under_mpiexec_a_dead_rank_ends_the_job_naming_it; tests/test_slurm.py,
test_a_dead_rank_is_named_and_ends_the_srun_step).

Usage: worker_pid_by_name.py SCHEDULER_FILE

Prints one ``RESULT {"pid": N}`` line.
"""

import json
import os
import sys

from distributed import Client

with Client(scheduler_file=sys.argv[1], timeout=60) as client:
    client.wait_for_workers(3, timeout=60)
    pids = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
    pid = client.run(os.getpid, workers=[pids[2]])[pids[2]]
    print("RESULT " + json.dumps({"pid": pid}), flush=True)
