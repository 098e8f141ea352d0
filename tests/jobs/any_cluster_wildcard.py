"""Schedulers listening on all interfaces hand out an MPI service address that answers (tests/test_any_cluster.py,
test_service_reachable_when_scheduler_listens_on_all_interfaces).

Starts 8 schedulers on ``mpi://`` with no host, connects to each one's service as a worker would and reads its
challenge; prints one ``RESULT <json>`` line.
"""

import asyncio
import json

from distributed import Scheduler


async def main():
    out = []
    for _ in range(8):
        try:
            async with Scheduler(protocol="mpi", port=0, dashboard_address=None) as s:
                creds = s.extensions["mpi4dask"].credentials
                host, _, port = creds.address.rpartition(":")
                try:  # as a worker would, but on this loop: the service runs on it
                    connecting = asyncio.open_connection(host.strip("[]"), int(port))
                    reader, writer = await asyncio.wait_for(connecting, 10)
                    hello = (await asyncio.wait_for(reader.readline(), 10)).decode()
                    writer.close()
                    out.append({"address": s.address, "service": creds.service, "hello": hello})
                except (OSError, asyncio.TimeoutError) as exc:
                    out.append({"address": s.address, "service": creds.service, "error": repr(exc)})
        except Exception as exc:
            out.append({"start_error": f"{type(exc).__name__}: {exc} / {exc.__cause__!r}"})
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(main())), flush=True)
