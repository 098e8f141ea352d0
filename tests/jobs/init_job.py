"""Jobs for tests/test_mpi_init.py: plain distributed programs under mpiexec, as users write them.

Nothing here initialises MPI or imports mpi4py first: the mpi:// backend must manage on its own.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time


def rank() -> int:
    """This rank, from the launcher's environment (hydra: PMI_RANK; Open MPI's prterun: OMPI_COMM_WORLD_RANK)."""
    return int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))


def size() -> int:
    return int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "0")))


async def wait_for_file(path: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not (os.path.exists(path) and open(path).read().strip()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        await asyncio.sleep(0.02)
    return open(path).read().strip()


async def listen_connect(listener_rank: str, addr_file: str):
    """One rank listens, the other connects (MPI_Init is collective: neither may block the other)."""
    from distributed.comm import CommClosedError, connect, listen

    if rank() == int(listener_rank):
        done = asyncio.Event()

        async def handler(comm):
            try:
                while True:
                    msg = await comm.read()
                    await comm.write({"echo": msg, "mpi": comm.uses_mpi})
            except CommClosedError:
                done.set()

        listener = listen("mpi://127.0.0.1:0", handler)
        await listener.start()
        with open(addr_file + ".tmp", "w") as f:
            f.write(listener.contact_address)
        os.replace(addr_file + ".tmp", addr_file)
        await asyncio.wait_for(done.wait(), 60)
        listener.stop()
        print(f"LISTENER rank={rank()} OK", flush=True)
    else:
        address = await wait_for_file(addr_file)
        t0 = time.monotonic()
        comm = await connect(address, timeout=30)
        for i in range(20):
            await comm.write(i)
            reply = await comm.read()
            assert reply == {"echo": i, "mpi": True}, reply
        assert comm.uses_mpi
        await comm.close()
        print(f"CONNECTOR rank={rank()} OK mpi={comm.uses_mpi} {time.monotonic() - t0:.2f}s", flush=True)


async def one_script(sched_file: str):
    """A Scheduler on rank 0, Workers on the other ranks, each with ``async with``."""
    from distributed import Client, Scheduler, Worker

    if rank() == 0:
        async with Scheduler(protocol="mpi", host="127.0.0.1", dashboard_address=":0") as s:
            with open(sched_file + ".tmp", "w") as f:
                f.write(s.address)
            os.replace(sched_file + ".tmp", sched_file)
            async with Client(s.address, asynchronous=True) as c:
                await c.wait_for_workers(size() - 1, timeout=60)
                total = sum(await c.gather(c.map(lambda x: x * 2, range(300))))
                assert total == 2 * sum(range(300)), total
                modes = await c.run(lambda dask_worker: sorted({
                    getattr(comm, "uses_mpi", None)
                    for comms in dask_worker.rpc.available.values() for comm in comms
                } | {getattr(dask_worker.batched_stream.comm, "uses_mpi", None)}))
                print("RESULT", total, "MODES", sorted({m for v in modes.values() for m in v}), flush=True)
                await c.shutdown()
    else:
        address = await wait_for_file(sched_file)
        async with Worker(address, nthreads=1, host="127.0.0.1") as w:
            await w.finished()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    asyncio.run(asyncio.wait_for({"listen_connect": listen_connect, "one_script": one_script}[mode](*args), 120))
