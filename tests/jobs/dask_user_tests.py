"""A Dask user's own tests of code on ``mpi://``, written with distributed's test utilities (``gen_test``,
``gen_cluster``), which fail a test that leaks a thread, leaves a comm open or warns.  Each test runs as
the first of a fresh process (tests/test_distributed_utils.py), so it is the one that starts MPI."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import dask
from distributed import Nanny, Scheduler
from distributed.comm import connect, listen
from distributed.protocol import Serialized, serialize, to_serialize
from distributed.utils_test import gen_cluster, gen_test, inc


@gen_test()
async def test_listener_starts_whatever_the_connect_timeout():
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("mpi4dask").addHandler(handler)
    try:
        with dask.config.set({"distributed.comm.timeouts.connect": 0.01}):
            t0 = time.monotonic()
            listener = await listen("mpi://127.0.0.1:0", lambda comm: None)  # MPI starts here
            took = time.monotonic() - t0
        listener.stop()
    finally:
        logging.getLogger("mpi4dask").removeHandler(handler)
    assert not [m for m in said if "MPI_Init" in m], said  # no "still waiting ... after 5 s" when it was not
    assert took < 30, took


@gen_test()
async def test_dropped_comms_are_closed():
    # distributed's check_deserialize_roundtrip: two pairs of comms, used, then dropped without close()
    payload = os.urandom(4 << 20)
    msg = {"op": "update", "x": payload, "to_ser": [to_serialize(payload)], "ser": Serialized(*serialize(payload))}
    got = []

    async def handle(comm):
        got.append(comm)

    for deserialize in (True, False):
        listener = await listen("mpi://127.0.0.1:0", handle, deserialize=deserialize)
        a = await connect(listener.contact_address, deserialize=deserialize)
        while not got:
            await asyncio.sleep(0.01)
        b = got.pop()
        await a.write(msg)
        echo = await b.read()
        await b.write(echo)
        back = await a.read()
        assert back["x"] == payload
        listener.stop()
    # gen_test fails the test when a comm of the process is still open now


@gen_cluster(client=True, scheduler_kwargs={"protocol": "mpi"}, nthreads=[("127.0.0.1", 1)] * 2)
async def test_cluster_on_mpi(c, s: Scheduler, a, b):
    assert s.address.startswith("mpi://")
    futures = c.map(inc, range(20))
    assert sum(await c.gather(futures)) == sum(range(1, 21))


@gen_cluster(client=True, Worker=Nanny, scheduler_kwargs={"protocol": "mpi"}, nthreads=[("127.0.0.1", 1)] * 2)
async def test_nanny_cluster_on_mpi(c, s: Scheduler, a, b):
    """Workers in processes of their own (as LocalCluster's): the client here gathers straight from them,
    and this process joins each worker's MPI world (a pair join, on a thread of its own that must end with
    the join: gen_cluster fails the test for a thread left over)."""
    import hashlib

    import numpy as np

    from mpi4dask import connections

    def block(i):
        return np.random.default_rng(i).integers(0, 255, 4 << 20, dtype=np.uint8)

    def over_mpi_whatever_the_load():
        """(tests/conftest.py's fixture, in a worker: under MPICH 4 a worker that finds both cores taken
        sends its blocks on the socket, and this test runs the whole cluster: it failed so in 1 of 4 runs
        here, the machine idle)"""
        from mpi4dask import _progress

        _progress.cores_taken = lambda pid: False

    await c.run(over_mpi_whatever_the_load)  # (through the scheduler: no connection to a worker from here)
    futures = c.map(block, range(4), workers=[a.worker_address, b.worker_address])
    got = await c.gather(futures, direct=True)
    for i, x in enumerate(got):
        assert hashlib.sha256(x.tobytes()).digest() == hashlib.sha256(block(i).tobytes()).digest()
    assert any(info["mpi_route"] == "pair" and info["mpi_bytes_received"] for info in connections()), connections()


@gen_cluster(client=True, scheduler_kwargs={"protocol": "mpi"}, nthreads=[("127.0.0.1", 1)])
async def test_a_feed_ends_when_its_reader_closes(c, s: Scheduler, a):
    """The scheduler's ``feed`` (what distributed's progress bars read) writes until a write raises, then
    runs its teardown.  Over mpi:// writes after the reader's goodbye were dropped for ever: the feed, and
    the plugin a progress bar leaves on the scheduler, never ended."""
    from distributed.protocol.pickle import dumps

    def setup(scheduler):
        scheduler.feeds_running = getattr(scheduler, "feeds_running", 0) + 1
        return 0

    def function(scheduler, state):
        return {"tasks": len(scheduler.tasks)}

    def teardown(scheduler, state):
        scheduler.feeds_running -= 1

    comm = await connect(s.address)
    await comm.write({"op": "feed", "setup": dumps(setup), "function": dumps(function),
                      "teardown": dumps(teardown), "interval": 0.01})
    for _ in range(3):
        assert (await comm.read()) == {"tasks": 0}
    assert s.feeds_running == 1
    await comm.close()
    start = time.monotonic()
    while s.feeds_running:
        await asyncio.sleep(0.01)
        assert time.monotonic() - start < 5, "the feed still runs after its reader closed"
