"""Progress for nonblocking MPI requests driven from an asyncio event loop (private).

MPI progress happens only inside MPI calls, and a thread waiting inside MPI spins a core. So no
thread here ever waits in MPI.  Work arrives through the event loop (a header on the socket, a write), the
loop starts the MPI operations and tests them at once; only what is still in flight is handed to
the loop's :class:`Progress`, which

* re-tests on every loop turn for a short spin window (long enough for the bytes in flight to move at
  a conservative rate), so transfers that need several progress calls still run at full speed --
  only for items that ask for it (``spin``: receives, whose bytes are on their way); sends, whose
  completion the peer announces anyway, and cleanups are only tested on timers;
* then backs off to timer-driven tests (1 ms, doubling to 50 ms), so a peer that is slow to
  answer costs almost no CPU;
* stops entirely when nothing is in flight: an idle process makes no MPI call at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)

SPIN_MIN = 300e-6  # seconds of per-turn polling after any activity
SPIN_RATE = 1.0e9  # bytes/s assumed when sizing the spin window for bytes in flight
BACKOFF_MIN = 1e-3
BACKOFF_MAX = 50e-3


class Pollable(Protocol):
    nbytes: int  # bytes in flight (sizes the spin window)
    spin: bool  # test on every loop turn for a while; False: on timers only

    def poll(self) -> bool:
        """Advance with nonblocking MPI calls; return True while still in flight."""


class Progress:
    """Tests the in-flight MPI work of one event loop, spinning briefly and then backing off."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: list[Pollable] = []
        self._handle: asyncio.Handle | asyncio.TimerHandle | None = None
        self._spin_until = 0.0
        self._backoff = BACKOFF_MIN
        self._running = False

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Pollable) -> None:
        """Keep testing ``item`` until its ``poll()`` returns False (must be called on the loop)."""
        self._items.append(item)
        if item.spin:
            self.kick(item.nbytes)
        elif self._handle is None and not self._running:
            self._handle = self._loop.call_later(self._backoff, self._run)

    def kick(self, nbytes: int = 0) -> None:
        """Something happened: spin again for a while (must be called on the loop)."""
        if not self._items:
            return
        self._spin_until = max(self._spin_until, time.perf_counter() + SPIN_MIN + nbytes / SPIN_RATE)
        self._backoff = BACKOFF_MIN
        if self._running:
            return  # _run schedules the next turn itself
        if isinstance(self._handle, asyncio.TimerHandle):
            self._handle.cancel()
            self._handle = None
        if self._handle is None:
            self._handle = self._loop.call_soon(self._run)

    def _run(self) -> None:
        self._handle = None
        items, self._items = self._items, []
        kept = []
        finished = False
        self._running = True
        try:
            for item in items:
                try:
                    active = item.poll()
                except Exception:  # a broken item must not stop progress for the others
                    logger.exception("mpi4dask: error while progressing %r", item)
                    active = False
                if active:
                    kept.append(item)
                else:
                    finished = True
        finally:
            self._running = False
        kept.extend(self._items)  # added while polling
        self._items = kept
        if not kept:
            return
        now = time.perf_counter()
        if finished and any(i.spin for i in kept):
            inflight = sum(i.nbytes for i in kept if i.spin)
            self._spin_until = max(self._spin_until, now + SPIN_MIN + inflight / SPIN_RATE)
            self._backoff = BACKOFF_MIN
        if now < self._spin_until:
            self._handle = self._loop.call_soon(self._run)
        else:
            self._handle = self._loop.call_later(self._backoff, self._run)
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Progress] = weakref.WeakKeyDictionary()


def for_loop(loop: asyncio.AbstractEventLoop | None = None) -> Progress:
    """The :class:`Progress` of ``loop`` (default: the running loop)."""
    loop = loop or asyncio.get_running_loop()
    p = _by_loop.get(loop)
    if p is None:
        p = _by_loop[loop] = Progress(loop)
    return p
