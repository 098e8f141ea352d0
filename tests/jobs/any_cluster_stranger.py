"""Strangers to the cluster's MPI service are refused, silent peers dropped (tests/test_any_cluster.py,
test_strangers_are_refused).

(a) wrong answers to the service's challenge, (b) processes initialising MPI with forged credentials or another
cluster's, (c) peers that say nothing; meanwhile a worker added later still joins MPI.  Prints one
``RESULT <json>`` line.
"""

import hashlib
import hmac
import json
import os
import socket
import time

from _moves import join_in_subprocess, move

import mpi4dask._pmi


def scheduler_attr(client, name):
    return client.run_on_scheduler(lambda dask_scheduler: getattr(dask_scheduler.extensions["mpi4dask"], name))


def raw(address, send=None, authenticate_with=None, read_timeout=15):
    # one raw TCP connection to the service: read the challenge, answer it (or not), read to the end
    host, _, port = address.rpartition(":")
    t = time.monotonic()
    with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as sock:
        sock.settimeout(read_timeout)
        local = "{}:{}".format(*sock.getsockname()[:2])
        f = sock.makefile("rb")
        hello = f.readline().decode()
        nonce = mpi4dask._pmi.parse(hello).get("nonce", "")
        if authenticate_with is not None:
            mac = hmac.new(authenticate_with, nonce.encode(), hashlib.sha256).hexdigest()
            send = f"cmd=mpi4dask-auth mac={mac}\n"
        if send is not None:
            sock.sendall(send.encode())
        rest, closed = b"", False
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    closed = True
                    break
                rest += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            closed = True
    return {"local": local, "hello": hello, "rest": rest.decode(errors="replace"), "closed": closed,
            "elapsed": time.monotonic() - t}


if __name__ == "__main__":
    from distributed import Client, LocalCluster

    out = {}
    with LocalCluster(protocol="mpi", processes=True, n_workers=1, threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.wait_for_workers(1, timeout=60)
        creds = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.extensions["mpi4dask"].credentials)
        address = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.extensions["mpi4dask"].credentials.address)
        out["address"], out["service"] = address, creds.service
        # (a) wrong answers to the challenge
        refused0 = scheduler_attr(client, "refused")
        out["wrong"] = [
            raw(address, send="cmd=mpi4dask-auth mac=%s\n" % ("00" * 32)),
            raw(address, authenticate_with=os.urandom(32)),
            raw(address, send="cmd=init pmi_version=1 pmi_subversion=1\n"),
        ]
        out["refused"] = [refused0, scheduler_attr(client, "refused")]
        # the cluster still works, and a worker that joins after the strangers gets MPI
        cluster.scale(2)
        client.wait_for_workers(2, timeout=90)
        W0, W1 = sorted(client.scheduler_info()["workers"])
        out["moves"] = [move(client, W0, W1, 1 << 20, seed=11), move(client, W1, W0, 1 << 20, seed=12)]
        # (c) silent peers are dropped after STEP_TIMEOUT (the service reads it at each step)
        mpi4dask._pmi.STEP_TIMEOUT = 1.0
        out["silent"] = [raw(address), raw(address, authenticate_with=creds.secret)]
        mpi4dask._pmi.STEP_TIMEOUT = 30.0
        # (b) processes with forged credentials, or another cluster's, initialise MPI through them
        with LocalCluster(protocol="mpi", processes=True, n_workers=0, dashboard_address=None) as other, \
                Client(other) as other_client:
            theirs = other_client.run_on_scheduler(
                lambda dask_scheduler: dask_scheduler.extensions["mpi4dask"].credentials)
        refused1 = scheduler_attr(client, "refused")
        out["forged"] = join_in_subprocess(address, os.urandom(32), creds.service)
        out["other_clusters_secret"] = join_in_subprocess(address, theirs.secret, creds.service)
        out["other_clusters_service"] = join_in_subprocess(address, creds.secret, theirs.service)
        out["refused_b"] = [refused1, scheduler_attr(client, "refused")]
        out["genuine"] = join_in_subprocess(address, creds.secret, creds.service)
        out["secrets"] = [creds.secret.hex(), theirs.secret.hex()]
    print("RESULT " + json.dumps(out), flush=True)
