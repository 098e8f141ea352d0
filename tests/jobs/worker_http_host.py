"""An mpi:// worker started with host="127.0.0.1" serves HTTP on 127.0.0.1 only, as over tcp://
(tests/test_comm_contract.py, test_worker_dashboard_binds_to_the_workers_host).

Prints ``HTTP [<the hosts its HTTP server's sockets listen on>]``.
"""

import asyncio

from distributed import Scheduler, Worker


async def main():
    async with Scheduler(protocol="mpi", host="127.0.0.1", dashboard_address=":0") as s:
        async with Worker(s.address, host="127.0.0.1", nthreads=1) as w:
            hosts = {sock.getsockname()[0] for sock in w.http_server._sockets.values()}
            print("HTTP", sorted(hosts))


asyncio.run(main())
