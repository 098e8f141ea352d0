"""A process whose cluster served MPI (run_mpi on a tcp:// LocalCluster: the scheduler in this process
started its MPI service) and closed, then uses mpi:// on its own, as a notebook does from one cluster to
the next: MPI must not ask the closed service.  Prints ``RESULT <json>``."""

import asyncio
import json

import numpy as np
from distributed import Client, LocalCluster
from distributed.comm import connect, listen
from distributed.protocol import to_serialize

import mpi4dask


def size(comm):
    return comm.Get_size()


async def echo_over_mpi():
    async def echo(comm):
        await comm.write(await comm.read())
        await comm.close()

    listener = listen("mpi://127.0.0.1:0", echo)
    await listener.start()
    a = np.arange(1 << 18, dtype=np.int64)
    comm = await connect(listener.contact_address, timeout=30)
    await comm.write({"x": to_serialize(a)})
    got = await comm.read()
    await comm.close()
    listener.stop()
    return bool(np.array_equal(got["x"], a))


if __name__ == "__main__":
    with LocalCluster(protocol="tcp", n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        sizes = mpi4dask.run_mpi(size, workers=list(client.scheduler_info()["workers"]), timeout=60)
    print("RESULT " + json.dumps({"sizes": sizes, "right": asyncio.run(echo_over_mpi())}), flush=True)
