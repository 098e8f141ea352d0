"""A worker started without a host advertises the interface towards its scheduler (tests/test_comm_contract.py,
test_worker_without_host_advertises_the_interface_that_reaches_its_scheduler).

Usage: worker_default_host.py SCHEME      (tcp or mpi)

Prints ``WORKER <the worker's address>``.
"""

import asyncio
import sys

from distributed import Scheduler, Worker


async def main():
    async with Scheduler(protocol=sys.argv[1], host="127.0.0.1", dashboard_address=":0") as s:
        async with Worker(s.address, nthreads=1) as w:
            print("WORKER", w.address)


asyncio.run(main())
