"""Listen on mpi:// with an MPI library that cannot be loaded (tests/test_comm.py,
test_broken_mpi_library_gives_actionable_error, which sets MPI4PY_LIBMPI to a missing file).

Must fail with MPIUnavailableError and the fix.
"""

import asyncio

from distributed.comm import listen


async def main():
    listener = listen('mpi://127.0.0.1:0', lambda c: None)
    await listener.start()


asyncio.run(main())
