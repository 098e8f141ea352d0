"""A client outside an mpiexec job connects to a listener of rank 0 over mpi:// (tests/test_comm_mpi.py,
test_client_outside_the_mpi_world_falls_back_to_socket).

Usage: comm_outsider_client.py ADDRESS_FILE

Sends 3 MiB + 5 bytes of random data, then a message of frames of mixed sizes (small ones, which the
socket's reads fill through the shared buffer, between frames of 64 KiB and more, received straight
into their buffers; a tuple of arrays, whose large frames follow each other), reads the echoes,
prints ``OUTSIDER <uses_mpi> <same sha256>``; logs at INFO level, where the fallback to the socket
is reported.
"""

import asyncio
import hashlib
import logging
import sys

import numpy as np

logging.basicConfig(level=logging.INFO)  # the fallback is reported at INFO level
from distributed.comm import connect  # noqa: E402  (logging configured first)
from distributed.protocol import to_serialize  # noqa: E402


async def main():
    c = await connect(open(sys.argv[1]).read())
    a = np.random.default_rng(9).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    await c.write({'x': to_serialize(a)})
    b = (await c.read())['x']
    same = hashlib.sha256(a).digest() == hashlib.sha256(memoryview(b).cast('B')).digest()
    rng = np.random.default_rng(10)
    sizes = [3000] * 20 + [65535, 65536, 1, 200_001, 5] + [3000] * 20 + [(1 << 20) + 3, 70_000, 64]
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    # a tuple serializes into adjacent frames (as a DataFrame's blocks do): two large ones in a row
    await c.write({'parts': [to_serialize(p) for p in parts], 'tuple': to_serialize(tuple(parts[-3:]))})
    back = await c.read()
    digests = [hashlib.sha256(p).digest() for p in parts]
    same = same and digests == [hashlib.sha256(memoryview(q).cast('B')).digest() for q in back['parts']]
    same = same and digests[-3:] == [hashlib.sha256(memoryview(q).cast('B')).digest() for q in back['tuple']]
    print('OUTSIDER', c.uses_mpi, same)
    await c.close()


asyncio.run(main())
