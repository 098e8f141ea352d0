"""The loop's MPI progress schedule (mpi4dask._progress.Progress), with items that record when they were tested."""

from __future__ import annotations

import asyncio
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
