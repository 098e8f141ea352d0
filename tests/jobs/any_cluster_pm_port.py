"""``MPI4DASK_PM_PORT`` fixes the port of a scheduler's MPI service, and a bad value is named
(tests/test_any_cluster.py, test_pm_port_fixes_the_service_port_and_bad_values_are_named).

Usage: any_cluster_pm_port.py VALUE   (the variable's value for this scheduler)

Starts a scheduler on ``mpi://`` with ``MPI4DASK_PM_PORT=VALUE``; where it starts, connects to its MPI service
as a worker would and reads the challenge.  Prints one ``RESULT <json>`` line: the service's address and
challenge, or the error that stopped the scheduler (with its cause).
"""

import asyncio
import json
import os
import sys

from distributed import Scheduler


async def main():
    os.environ["MPI4DASK_PM_PORT"] = sys.argv[1]
    try:
        async with Scheduler(protocol="mpi", host="127.0.0.1", port=0, dashboard_address=None) as s:
            creds = s.extensions["mpi4dask"].credentials
            host, _, port = creds.address.rpartition(":")
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 10)
            hello = (await asyncio.wait_for(reader.readline(), 10)).decode()
            writer.close()
            return {"address": creds.address, "hello": hello}
    except Exception as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        return {"start_error": f"{type(cause).__name__}: {cause}"}


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(asyncio.wait_for(main(), 60))), flush=True)
