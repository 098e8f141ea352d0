"""``mpi4dask.initialize(lean=...)`` sets distributed's housekeeping intervals unless the user set them
(tests/test_launcher.py, test_lean_housekeeping).  Run with ``mpiexec -n 4``.

Usage: initialize_lean.py lean|default

Prints one ``LEAN <json>`` line: the tick and profile intervals on the scheduler and on each worker (and the
interval the workers' profile callback really uses).
"""
import json
import sys

import mpi4dask

mpi4dask.initialize(lean=(sys.argv[1] == "lean"))
from distributed import Client  # noqa: E402  (what the client rank runs once initialize() returns)


def settings():
    import dask
    from dask.utils import parse_timedelta
    return {k: parse_timedelta(dask.config.get(k)) for k in ("distributed.admin.tick.interval",
                                                            "distributed.worker.profile.interval")}


def worker_settings(dask_worker):
    out = settings()
    out["profile_callback_ms"] = dask_worker.periodic_callbacks["profile"].callback_time  # what it really uses
    return out


with Client() as client:
    print("LEAN " + json.dumps({"scheduler": client.run_on_scheduler(settings),
                                "workers": list(client.run(worker_settings).values())}), flush=True)
