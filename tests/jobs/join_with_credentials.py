"""Initialise MPI through an MPI service with the credentials given, as a worker does (tests/test_any_cluster.py:
test_strangers_are_refused runs it through _moves.join_in_subprocess, test_unreachable_service_gives_clear_error
directly).

Usage: join_with_credentials.py SERVICE_ADDRESS SECRET_HEX SERVICE_ID

Prints one ``RESULT <json>`` line: ok, the world formed or the error (``wrong_type`` when it is not
MPIUnavailableError), and the seconds it took.
"""

import json
import sys
import time

import mpi4dask
from mpi4dask import _mpi, pm

pm.set_credentials(pm.Credentials(sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3]))
t = time.monotonic()
try:
    w = _mpi.world()
    out = {"ok": True, "served": w.served, "size": w.size}
except mpi4dask.MPIUnavailableError as exc:
    out = {"ok": False, "error": str(exc)}
except Exception as exc:
    out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "wrong_type": True}
out["elapsed"] = time.monotonic() - t
print("RESULT " + json.dumps(out), flush=True)
