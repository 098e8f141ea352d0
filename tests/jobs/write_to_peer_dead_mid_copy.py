"""A worker writes to a peer that died while MPI copied a message from it (tests/test_resilience.py,
test_a_write_to_a_peer_that_died_mid_copy_fails_the_connection_not_the_worker).

On one LocalCluster(protocol="mpi") of 2 workers, up to len(DELAYS) times: worker R opens two connections to
worker H (a fresh one each time, Dask's restart of the last) and asks for a 256 MiB array on the first; H
lends its sockets to a child process of its own that outlives it, so R's connections to H are not seen to
close when H dies; R kills H once the array's header is in, later into the move at each attempt, until the
kill cuts R's copy out of H's memory.  Then R writes a message with a 1 MiB frame on its second connection,
which goes to MPI as if H were there: the reply a worker sends to a request the dead worker made just before
dying (seen in CI: that worker died of a segfault inside MPICH's send once the copy had failed).

Prints one ``RESULT <json>`` line: per attempt, whether the copy was cut and what the read raised; what the
write raised; R's pid before and after; and a sum that R computes afterwards from an array of the new H,
moved over MPI (the bytes that moved, from mpi4dask.connections()).
"""

import asyncio
import json
import os
import signal
import subprocess
import time

import _holders
import numpy as np
from distributed import Client, LocalCluster
from distributed.comm import connect
from distributed.protocol import to_serialize

DELAYS = (0.0, 0.005, 0.01, 0.02, 0.04, 0.08)  # seconds from the header's arrival to the kill
N = 256 * 2**20 // 8  # float64 ones in the array H sends


def serve_big(dask_worker=None):
    """On H: a handler that answers with the array (made now, so that it goes at once)."""
    x = np.ones(N)

    def big():
        return {"x": to_serialize(x)}

    dask_worker.handlers["mpi4dask_test_big"] = big


def _sockets() -> list[int]:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                fds.append(int(fd))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return fds


def lend_sockets():
    """On H: a child process holds every socket of H open after H is gone (R ends it; else in 120 s)."""
    return subprocess.Popen(["sleep", "120"], pass_fds=_sockets()).pid


async def open_two(address, dask_worker=None):
    """On R: two connections to H, each used once (so both are set up, over MPI); kept on the worker."""
    comms = []
    for _ in range(2):
        comm = await connect(address)
        await comm.write({"op": "identity", "reply": True})
        await comm.read()
        comms.append(comm)
    dask_worker.mpi4dask_test_comms = comms


async def cut_and_write(pid_h, pid_lender, delay, dask_worker=None):
    """On R: ask H for the array on the first connection, kill H once its header is in (after ``delay``);
    if that cut R's copy, write on the second connection.  Then end the process that holds H's sockets."""
    import mpi4dask
    from mpi4dask import _ucx

    first, second = dask_worker.mpi4dask_test_comms
    await first.write({"op": "mpi4dask_test_big", "reply": True})
    read = asyncio.ensure_future(first.read())
    deadline = time.monotonic() + 60
    while not any(c["local"] == first.local_address and c["mpi_bytes_received"] for c in mpi4dask.connections()):
        if time.monotonic() > deadline:
            raise TimeoutError("the array's header did not come in 60 s")
        await asyncio.sleep(0)
    await asyncio.sleep(delay)
    os.kill(pid_h, signal.SIGKILL)
    await asyncio.wait([read], timeout=5)  # the copy fails (cut), ends, or waits for bytes that never come
    out = {"delay": delay, "cut": pid_h in _ucx.failed}
    if out["cut"]:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(second.write({"op": "identity", "pad": to_serialize(np.ones(1 << 17))}), 30)
            out.update(write="returned")
        except Exception as exc:  # noqa: BLE001 - reported
            out.update(write=type(exc).__name__, write_error=str(exc))
        out["write_s"] = time.monotonic() - t0
    os.kill(pid_lender, signal.SIGKILL)  # H's sockets close now: a read still waiting ends
    try:
        msg = await asyncio.wait_for(read, 60)
        out.update(read="message", sum=float(msg["x"].sum()))
    except Exception as exc:  # noqa: BLE001 - reported
        out.update(read=type(exc).__name__, read_error=str(exc))
    first.abort()
    second.abort()
    return out


def mpi_bytes_from(address):
    import mpi4dask

    return sum(c["mpi_bytes_received"] for c in mpi4dask.connections() if c["peer"] == address)


def ones():
    return np.ones(N)


def total(x):
    return float(x.sum())


if __name__ == "__main__":
    with LocalCluster(protocol="mpi", n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        R, pid_r = _holders.reader(client)
        attempts = []
        for delay, H, pid_h in _holders.holders(client, R, DELAYS):
            client.run(serve_big, workers=[H])
            client.run(open_two, H, workers=[R])
            lender = client.run(lend_sockets, workers=[H])[H]
            attempts.append(client.run(cut_and_write, pid_h, lender, delay, workers=[R])[R])
            if attempts[-1]["cut"]:
                break
        # R lived on, and still moves data over MPI: an array of the new H, summed on R
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the killed H gone, its Nanny's new worker in
            workers = client.scheduler_info()["workers"]
            if len(workers) == 2 and H not in workers or R not in workers:
                break
            time.sleep(0.1)
        after = None
        if R in workers:
            (H,) = [w for w in workers if w != R]
            big = client.submit(ones, workers=[H], pure=False)
            after = {"sum": client.submit(total, big, workers=[R], pure=False).result(timeout=60),
                     "mpi_bytes": client.run(mpi_bytes_from, H, workers=[R])[R]}
        out = {"n": N, "attempts": attempts, "reader_still_there": R in workers, "reader_pid": pid_r,
               "reader_pid_now": client.run(os.getpid, workers=[R])[R] if R in workers else None, "after": after}
    print("RESULT " + json.dumps(out), flush=True)
