"""A plain ``distributed.Worker`` process whose MPI joins go through a hook (late_join.py, join_death.py):
the fault or delay is injected in that process only, around the real join.

:func:`worker_script` gives the Python source to run with ``python -c SOURCE SCHEDULER [ARGS...]``.
``hook`` is the source of ``def hook(what, bound, go):``, a generator that wraps the real
``mpi4dask._mpi.joining(what, bound, go)`` (named ``real`` there) and yields once inside it; ``go`` is
the call that sends the GO byte to the peer.  ``sys.argv[2:]`` are the hook's own arguments."""

PROLOGUE = """
import asyncio, contextlib, os, signal, sys, time
from distributed import Worker
from mpi4dask import _mpi
real = _mpi.joining
"""

EPILOGUE = """
_mpi.joining = contextlib.contextmanager(hook)

async def main():
    async with Worker(sys.argv[1], nthreads=1, name={name!r}) as w:
        await w.finished()

asyncio.run(main())
"""


def worker_script(name: str, hook: str) -> str:
    """The source of a worker named ``name`` (in the scheduler's list) whose joins go through ``hook``."""
    return PROLOGUE + hook + EPILOGUE.format(name=name)
