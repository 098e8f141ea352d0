"""Connections aborted with large messages in flight, reads cancelled, others still echoing at exit
(tests/test_comm_contract.py, test_many_connections_leave_nothing_pending_in_mpi_at_exit).

Prints ``DONE <connections kept open>``; MPICH must report no request left pending at exit.
"""

import asyncio

import numpy as np
from _echo import echo
from distributed.comm import connect, listen
from distributed.protocol import to_serialize

keep = []


async def main():
    listener = listen("mpi://127.0.0.1:0", echo)
    await listener.start()
    big = np.ones(4 << 20, dtype=np.uint8)
    for i in range(60):
        c = await connect(listener.contact_address)
        await c.write({"i": i, "x": to_serialize(big)})
        if i % 3 == 0:
            c.abort()  # a large message in flight both ways
        elif i % 3 == 1:
            r = asyncio.ensure_future(c.read())
            await asyncio.sleep(0)
            r.cancel()
        else:
            keep.append(c)  # open at exit, its echo in flight
    print("DONE", len(keep))


asyncio.run(main())
