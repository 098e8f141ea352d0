"""An mpi:// Scheduler gets the cluster's MPI service (tests/test_dependencies.py,
test_distributed_scheduler_listener_is_found_and_serves_mpi).

Prints ``SERVICE True`` when the Scheduler has the mpi4dask extension.
"""

import asyncio

from distributed import Scheduler

from mpi4dask import pm


async def main():
    async with Scheduler(protocol="mpi", host="127.0.0.1", dashboard_address=None) as s:
        print("SERVICE", pm.EXTENSION in s.extensions)


asyncio.run(main())
