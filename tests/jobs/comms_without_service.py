"""A Dask-started process that holds its cluster's credentials, whose MPI service went away before it
could join MPI (its scheduler died: distributed's test_nanny.py::test_scheduler_crash_doesnt_restart on
mpi://).  Its mpi:// listener and connections must go on over their sockets, so that it can still reach
its nanny and close; MPI itself stays unavailable, with the reason.

Usage: comms_without_service.py SERVICE_ADDRESS (one where nothing listens)

Prints ``RESULT <json>``: the echoed payload's digests, the comm's kind, what mpi4dask logged, and the
error that asking for MPI gives.
"""

import asyncio
import hashlib
import json
import logging
import sys

import numpy as np
from distributed.comm import connect, listen
from distributed.protocol import to_serialize

import mpi4dask
from mpi4dask import _metrics, _mpi, pm

said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(f"{record.levelname} {record.getMessage()}")
logging.getLogger("mpi4dask").addHandler(handler)

pm.set_credentials(pm.Credentials(sys.argv[1], b"\x01" * 32, "0123456789abcdef"))


async def main() -> dict:
    async def echo(comm):
        await comm.write(await comm.read())
        await comm.close()

    listener = listen("mpi://127.0.0.1:0", echo)
    await listener.start()
    payload = np.random.default_rng(3).integers(0, 255, 3 << 20, dtype=np.uint8)
    out = {"sent": hashlib.sha256(payload.tobytes()).hexdigest()}
    for _ in range(2):
        comm = await connect(listener.contact_address)
        out["kind"] = type(comm).__name__
        await comm.write({"x": to_serialize(payload)})
        out["echoed"] = hashlib.sha256(np.asarray((await comm.read())["x"]).tobytes()).hexdigest()
        await comm.close()
    listener.stop()
    return out


out = asyncio.run(main())
try:
    _mpi.world()
    out["mpi"] = "up"
except mpi4dask.MPIUnavailableError as exc:
    out["mpi"] = str(exc)
out["said"] = said
out["fallbacks"] = dict(_metrics.fallbacks)  # what the metrics (and the dashboard) say of these connections
print("RESULT " + json.dumps(out), flush=True)
