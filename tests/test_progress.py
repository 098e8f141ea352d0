"""The loop's MPI progress schedule (mpi4dask._progress.Progress), with items that record when they were tested."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from mpi4dask import _progress

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """A Pollable in flight for ``seconds``: records the time of each test."""

    nbytes = 0

    def __init__(self, spin: bool, steady: bool, seconds: float):
        self.spin, self.steady = spin, steady
        self.until = time.perf_counter() + seconds
        self.times: list[float] = []

    def poll(self) -> bool:
        now = time.perf_counter()
        self.times.append(now)
        return now < self.until


def largest_gap(steady: bool) -> float:
    async def main():
        item = Recorder(spin=True, steady=steady, seconds=0.6)
        _progress.for_loop(asyncio.get_running_loop()).add(item)
        while time.perf_counter() < item.until + 0.1:
            await asyncio.sleep(0.05)
        return max(b - a for a, b in zip(item.times, item.times[1:]))

    return asyncio.run(main())


def test_items_in_flight_back_off_to_the_longest_gap():
    """An item whose MPI moves bytes on the receiver's calls alone is tested less and less often."""
    assert largest_gap(steady=False) >= _progress.BACKOFF_MAX * 0.9


def test_steady_items_are_tested_at_least_every_millisecond():
    """Intel MPI's joined worlds move bytes only while both ends make MPI calls: with the 50 ms back-off, a
    128 KiB move between two LocalCluster workers took 11-18 s; its requests are ``steady``."""
    gap = largest_gap(steady=True)
    assert gap < _progress.STEADY_BACKOFF_MAX + 0.02, gap  # a timer's lateness on a loaded machine aside
    assert _progress.STEADY_BACKOFF_MAX <= 1e-3


@pytest.mark.timeout(20)
def test_a_reply_poll_yields_to_the_loop_for_a_socket_to_write(monkeypatch):
    """A reader that polls for its reply in its own task (Progress.poll_here) while the loop has a socket
    to write (a request still in the socket's buffer, which the reply waits for) yields to the loop, whose
    writer then runs.  It once spun for ever on the socket's "writable" event (a worker of the hand-off
    tests' job hung in it).  The machine counts as idle here, so that the poll runs whatever else this
    machine is doing."""
    monkeypatch.setattr(_progress, "core_idle", lambda: True)
    monkeypatch.setattr(_progress, "REPLY_SPIN", 0.5)  # a budget no slow machine spends by chance

    async def main():
        loop = asyncio.get_running_loop()
        progress = _progress.Progress(loop)
        a, b = socket.socketpair()
        a.setblocking(False)
        wrote = []

        def writer():
            wrote.append(True)
            loop.remove_writer(a.fileno())

        loop.add_writer(a.fileno(), writer)  # writable at once
        progress.reply_budget()  # a busy exchange: the next read polls
        until = progress.reply_budget()
        t0 = time.perf_counter()
        assert progress.poll_here(until, lambda: False, None) is False  # no reply: it gives the loop its turn
        took = time.perf_counter() - t0
        assert progress.reply_stats["polls"] == 1, progress.reply_stats  # it polled
        assert took < 0.25, took  # ... and gave up at the writer's event, long before its budget was spent
        for _ in range(3):
            await asyncio.sleep(0)
        assert wrote
        a.close()
        b.close()

    asyncio.run(main())
