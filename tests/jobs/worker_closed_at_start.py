"""Dask workers, each in a process of its own without a nanny, closed a few milliseconds after they start,
against a scheduler on mpi:// (which gives every worker its cluster's credentials, so each starts MPI
through the scheduler's MPI service as it registers).  A worker process whose exit came while its MPI_Init
was under way hung for ever in MPI_Finalize (its nanny, when it had one, killed it after 4 s).

Usage: worker_closed_at_start.py            (the driver: a scheduler here, the workers as subprocesses)
       worker_closed_at_start.py worker ADDRESS DELAY

Prints ``RESULT <json>``: for each worker its delay, exit status and the seconds from its start to its
exit (None: it did not exit within EXIT_LIMIT s, and was killed).
"""

import asyncio
import json
import subprocess
import sys
import time

EXIT_LIMIT = 20.0  # seconds from the worker's start (a hang is for ever; a slow start on busy cores is not)
# the window that hung is a few ms wide, tens of ms after a worker starts (0.06 s on the project's VM):
# delays from 0 to 0.15 s, 5 ms apart, cross it on a slower or faster machine too
DELAYS = [i * 0.005 for i in range(31)]

if len(sys.argv) > 1 and sys.argv[1] == "worker":
    from distributed import Worker

    async def worker():
        async with Worker(sys.argv[2], nthreads=1, dashboard_address=":0"):
            await asyncio.sleep(float(sys.argv[3]))

    asyncio.run(worker())
    sys.exit(0)


async def main() -> list:
    from distributed import Scheduler

    # two workers at a time (each delay counts from its own worker's start): the scheduler's MPI service
    # serves joins that overlap, as it does for any cluster, and the sweep takes half as long
    running = asyncio.Semaphore(2)

    async def one(address, delay):
        async with running:
            t = time.monotonic()
            p = await asyncio.create_subprocess_exec(sys.executable, __file__, "worker", address, str(delay),
                                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                await asyncio.wait_for(p.wait(), EXIT_LIMIT)
                return {"delay": delay, "rc": p.returncode, "s": time.monotonic() - t}
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
                return {"delay": delay, "rc": None, "s": None}

    async with Scheduler(protocol="mpi", dashboard_address=":0") as s:
        return list(await asyncio.gather(*(one(s.address, delay) for delay in DELAYS)))


print("RESULT " + json.dumps(asyncio.run(main())), flush=True)
