"""Servers for tests/test_comm_hostile.py, which plays hostile and careless peers against them.

``echo ADDR_FILE``: a plain process (a world of one) listening on mpi://127.0.0.1:0, echoing.
``rank0_serves ADDR_FILE``: under ``mpiexec``, rank 0 runs ``echo``; the others wait.
``pair ADDR_FILE N``: under ``mpiexec -n 2``; rank 0 listens and echoes, rank 1 connects and makes N
slow round trips, checking that every reply is the answer to its own message.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from _echo import echo
from distributed.comm import connect, listen

logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")



def launcher_rank() -> int:
    """This rank, from the launcher's environment (hydra: PMI_RANK; Open MPI's prterun: OMPI_COMM_WORLD_RANK)."""
    return int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))

def publish(path: str, address: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(address)
    os.replace(path + ".tmp", path)


async def serve_echo(addr_file: str, seconds: str = "120"):
    listener = listen("mpi://127.0.0.1:0", echo)
    await listener.start()
    publish(addr_file, listener.contact_address)
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline and not os.path.exists(addr_file + ".stop"):
        await asyncio.sleep(0.1)
    listener.stop()


async def rank0_serves(addr_file: str):
    """Rank 0 serves echo until ADDR_FILE.stop exists; the other ranks are plain MPI ranks."""
    if launcher_rank() == 0:
        await serve_echo(addr_file)
        return
    from mpi4py import MPI  # noqa: F401 - MPI_Init: under mpiexec it waits for every rank

    while not os.path.exists(addr_file + ".stop"):
        await asyncio.sleep(0.1)


async def pair(addr_file: str, n: str):
    rank = launcher_rank()
    if rank == 0:
        await serve_echo(addr_file)
        print("RANK0 DONE", flush=True)
        return
    while not os.path.exists(addr_file):
        await asyncio.sleep(0.02)
    comm = await connect(open(addr_file).read(), timeout=30)
    assert comm.uses_mpi
    for i in range(int(n)):
        await comm.write({"rank1": i})
        reply = await comm.read()
        assert reply == {"rank1": i}, f"reply {reply!r} to message {i}"
        await asyncio.sleep(0.1)
    await comm.close()
    from mpi4dask import _endpoint

    ep = _endpoint.current()
    ep.proofs.collect()
    print(f"RANK1 OK replies={n} stray_proofs={len(ep.proofs._got)}", flush=True)
    open(addr_file + ".stop", "w").close()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    asyncio.run({"echo": serve_echo, "pair": pair, "rank0_serves": rank0_serves}[mode](*args))
