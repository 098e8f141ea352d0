"""``initialize()`` with its defaults (tests/test_launcher.py,
test_initialize_defaults_share_memory_open_no_http_port_and_idle_quietly).  Run with ``mpiexec -n 5``.

Usage: initialize_defaults.py DASHBOARD_ADDRESS

Prints one ``DEFAULTS <json>`` line: the workers' memory limits, the ports each rank opened while starting
(against those its server and MPI service own), whether anything listens on DASHBOARD_ADDRESS, and the CPU
seconds each rank used in 2 s of idling.
"""
import json
import socket
import sys
import time

import psutil
from mpi4py import MPI  # noqa: F401  (MPI first, dask-mpi PR #100: MPI's own sockets are open already)


def listening():
    return {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


BEFORE = listening()
from mpi4dask.launcher import initialize  # noqa: E402  (the ports open before it are not counted)

initialize(dashboard_address=sys.argv[1])        # defaults otherwise: memory_limit="auto", no dashboard
from distributed import Client  # noqa: E402  (what the client rank runs once initialize() returns)


def ports(dask_worker=None, dask_scheduler=None):
    import __main__  # that rank's own script, stopped in initialize()
    server = dask_worker or dask_scheduler
    pm = server.extensions.get("mpi4dask") if dask_scheduler is not None else None  # the MPI service
    return {"services": server.service_ports, "opened": sorted(__main__.listening() - __main__.BEFORE),
            "own": int(server.address.rsplit(":", 1)[1]),
            "pm": int(pm.credentials.address.rsplit(":", 1)[1]) if pm is not None else None}


def cpu():
    return time.process_time()


with Client() as client:
    client.wait_for_workers(3, timeout=30)
    workers = client.scheduler_info()["workers"].values()
    memory = [w["memory_limit"] for w in workers]
    servers = [client.run_on_scheduler(ports)] + list(client.run(ports).values())
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1].rsplit(":", 1)[1])), timeout=5).close()
        dashboard_port = "open"
    except ConnectionRefusedError:
        dashboard_port = "refused"
    time.sleep(0.5)
    before = [client.run_on_scheduler(cpu)] + list(client.run(cpu).values())
    time.sleep(2.0)
    after = [client.run_on_scheduler(cpu)] + list(client.run(cpu).values())
    idle = [b - a for a, b in zip(before, after)]
print("DEFAULTS " + json.dumps({"memory": memory, "servers": servers, "dashboard_port": dashboard_port,
                                "idle_cpu_seconds": idle}), flush=True)
