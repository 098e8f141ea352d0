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
  answer costs almost no CPU -- except for ``steady`` items, tested at least every ``STEADY_BACKOFF_MAX``
  while in flight: receives (whose own calls move their bytes) and, where transfers move only while both
  ends make MPI calls (Intel MPI, MPICH 4), sends;
* stops entirely when nothing is in flight: an idle process makes no MPI call at all.

The same object decides how the loop waits for a **reply** (:meth:`Progress.expect_reply`): a
reader that sent a request and now waits for the answer would otherwise sleep in the loop's selector, and
on this kind of machine the wake-up costs more than the message (a loopback byte: ~25-35 us one
way when the reader sleeps, ~2-3 us when it polls).  So, when the loop has nothing else to do and
a core is idle (no more runnable processes than usable cores: the poll displaces no one), the loop
polls its own selector for up to ``REPLY_SPIN`` before it sleeps (longer after a request whose MPI bytes the
peer has not read yet: their time at ``REPLY_RATE`` more, for the answer comes no sooner than they are in): first in
the reader's own task
(:meth:`Progress.poll_here`: a reply taken in there needs no future, wake-up or loop turn), then, once
the loop has other work, between that work (:meth:`Progress.expect_reply`).  An event of the loop or a due
timer interrupts the poll (the selector is level-triggered: the loop's next select returns the
event at once), and the poll goes on after the loop ran it while the reader still waits; a process
that became runnable or the spent budget ends it; a loop whose replies keep missing the budget
stops polling for a while.  An idle process never polls: only a read that follows a request does (a
write made while no read was under way on the comm: an RPC, a ping-pong; as a rule not distributed's
streams, whose ``BatchedSend`` writes while the stream's reader waits, and whose next message answers
nothing), and
only in a busy exchange (the previous such read began less than ``REPLY_WARM`` before): the
heartbeats of an idle cluster, a request every half second, are waited for asleep, as over tcp://.
``MPI4DASK_REPLY_SPIN=0`` (seconds) turns the polling off, e.g. where a CPU quota, not the
machine's cores, bounds the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import time
import weakref
from typing import Protocol

from . import _settings

logger = logging.getLogger(__name__)

SPIN_MIN = 300e-6  # seconds of per-turn polling after any activity
SPIN_RATE = 1.0e9  # bytes/s assumed when sizing the spin window for bytes in flight
BACKOFF_MIN = 1e-3
BACKOFF_MAX = 50e-3
STEADY_BACKOFF_MAX = 1e-3  # the longest gap between tests while a ``steady`` item is in flight (see Pollable)


def spin_window(nbytes: int) -> float:
    """Seconds of per-turn testing that ``nbytes`` in flight get: ``SPIN_MIN`` plus their time at ``SPIN_RATE``."""
    return SPIN_MIN + nbytes / SPIN_RATE


# seconds an idle loop polls its selector for a reply before it sleeps
REPLY_SPIN = _settings.number(
    "MPI4DASK_REPLY_SPIN", 0.002, low=0, high=1,
    what="the seconds a reader may poll for a reply, from 0 (never) to 1; the default is 0.002")
# bytes per second at which a peer is assumed to take in what this side just sent it: a request whose
# MPI bytes the peer has not read yet is answered no sooner than they are in, so the poll for its answer
# lasts their time at this rate longer (:meth:`Progress.reply_budget`); MPI copies 17-29 GB/s between two
# processes of this project's VM (8-64 MiB), so an answer that keeps the peer no longer than the copy is polled for
REPLY_RATE = 4e9
REPLY_WARM = 20e-3  # a loop polls only while its reads that follow requests come this close together ...
REPLY_MISSES = 4  # replies in a row that miss their budget before the loop stops polling for them ...
REPLY_PAUSE = 0.1  # ... for this many seconds


class Pollable(Protocol):
    nbytes: int  # bytes in flight (sizes the spin window)
    spin: bool  # test on every loop turn for a while; False: on timers only
    steady: bool  # while in flight, never wait longer than STEADY_BACKOFF_MAX between tests

    def poll(self) -> bool:
        """Advance with nonblocking MPI calls; return True while still in flight."""


class Prober(Protocol):
    def poll_reply(self) -> bool:
        """Take in, with nonblocking MPI calls, the MPI bytes of the awaited reply (also before the socket
        announces them); True when a message became complete."""


class Progress:
    """Tests the in-flight MPI work of one event loop, spinning briefly and then backing off."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: list[Pollable] = []
        self._handle: asyncio.Handle | asyncio.TimerHandle | None = None
        self._spin_until = 0.0
        self._backoff = BACKOFF_MIN
        self._running = False
        self._reply_handle: asyncio.Handle | None = None
        self._reply_until = 0.0
        self._reply_misses = 0
        self._reply_paused_until = 0.0
        self._reply_last = -1.0  # when a read that followed a request last began to wait
        self._reply_polled = False  # the current wait has polled (a core was idle)
        selector = getattr(getattr(loop, "_selector", None), "_selector", None)  # selectors' epoll/poll object
        self._poll = selector.poll if _polls_selector(loop) and hasattr(selector, "poll") else None
        self._waiting: list[tuple[asyncio.Future, Prober | None]] = []  # readers waiting for a reply
        # waits for a reply that polled (a core was idle), and how they ended: the reply came (of those,
        # taken in by the reader's own task: "here"), none came within the budget, or a process needed the core
        self.reply_stats = {"polls": 0, "replies": 0, "here": 0, "misses": 0, "yielded": 0}

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
        self._spin_until = max(self._spin_until, time.perf_counter() + spin_window(nbytes))
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
            self._spin_until = max(self._spin_until, now + spin_window(inflight))
            self._backoff = BACKOFF_MIN
        if now < self._spin_until:
            self._handle = self._loop.call_soon(self._run)
        else:
            self._handle = self._loop.call_later(self._backoff, self._run)
            cap = STEADY_BACKOFF_MAX if any(i.steady for i in kept) else BACKOFF_MAX
            self._backoff = min(self._backoff * 2, cap)

    # -- waiting for a reply
    def reply_budget(self, behind: int = 0) -> float:
        """A read that follows a request is about to wait: until when (``perf_counter`` time) its loop may poll
        for the answer rather than sleep; 0 when it may not (polling is off, the exchange is not busy, or
        recent replies kept missing the budget).  ``behind``: the MPI bytes that this side sent and the peer
        has not read yet, whose time at ``REPLY_RATE`` the budget grows by."""
        if REPLY_SPIN <= 0 or not _polls_selector(self._loop):
            return 0.0
        now = time.perf_counter()
        warm, self._reply_last = now - self._reply_last <= REPLY_WARM, now
        if not warm or now < self._reply_paused_until:
            return 0.0  # the first request after a quiet spell (a heartbeat) is not worth a poll
        return now + REPLY_SPIN + behind / REPLY_RATE

    def poll_here(self, until: float, arrived, prober: Prober | None) -> bool:
        """Poll for a reply in the waiting reader's own task, before it sleeps: True once ``arrived()``
        (the reply was taken in here: the reader goes on without a future, a wake-up or a loop turn,
        which cost more than a small message when the Python runs cache-cold after a large copy).
        False when it has not: the loop has other work, a timer is due, a process needs the core or
        the budget is spent; the reader then waits with :meth:`expect_reply`, which polls on between
        the loop's other work for what is left of ``until``."""
        probers = [prober] if prober is not None else []
        if self._reply_handle is not None or self._poll is None or not self._loop_free(probers):
            return False  # another reader polls already, or other work first
        if not core_idle():
            return False  # expect_reply sees it too, and gives up at once
        self._reply_until = until
        self._reply_polled = True
        self.reply_stats["polls"] += 1
        while self._look(probers, until):
            if arrived():
                break
            if not self._loop_free(probers) or time.perf_counter() >= until:
                return False  # what arrived woke others: the loop runs them first
        else:
            if not arrived():  # (taken in by the probers' last look)
                return False
        self._replied()
        self.reply_stats["here"] += 1
        return True

    def expect_reply(self, waiter: asyncio.Future, prober: Prober | None = None, until: float = 0.0) -> None:
        """A reader that sent a request waits for the answer (``waiter`` is done when it came): poll the loop's
        selector until ``until`` (from :meth:`reply_budget`) before it sleeps, between the loop's other
        work, and ``prober`` (its connection's receiver, when it has MPI) for MPI bytes of the answer."""
        if not until:
            return
        self._waiting.append((waiter, prober))
        if self._reply_handle is None:
            if not self._reply_polled or self._reply_until != until:  # (else poll_here began this wait)
                self._reply_until = until
                self._reply_polled = False
            self._reply_handle = self._loop.call_soon(self._poll_for_reply)

    def _poll_for_reply(self) -> None:
        """Poll the selector until something arrives, a timer is due, a process needs the core or the
        budget is spent; then let the loop run what came, and look again while a reader still waits."""
        self._reply_handle = None
        loop, stats = self._loop, self.reply_stats
        if self._answered():
            return
        until = self._reply_until
        if time.perf_counter() >= until:
            self._waiting = []
            if self._reply_polled:
                self._missed()
            return
        if loop._ready:  # other work first; come back when the loop would sleep
            self._reply_handle = loop.call_soon(self._poll_for_reply)
            return
        # only while a core is idle, and the first look that finds none ends the polling: under load,
        # even a few tens of us of polling cost more than they save (measured with `bench comm --load 2`:
        # 1 B 85 -> 102 us, 64 KiB 135 -> 211 us when polling went on until a third look)
        if not core_idle():
            self._waiting = []
            stats["yielded"] += self._reply_polled
            self._reply_polled = False
            return
        if not self._reply_polled:
            self._reply_polled = True
            stats["polls"] += 1
        self._look([p for _, p in self._waiting if p is not None], until)
        if self._answered():  # read here: the reader's next wait, a new one, polls with a budget of its own
            return
        if self._reply_handle is None:  # (a reader run here may have started a wait of its own: one poll)
            self._reply_handle = loop.call_soon(self._poll_for_reply)

    def _look(self, probers: list, until: float) -> bool:
        """Poll the loop's selector, and ``probers`` for MPI bytes, until something arrives (True: the
        readers of its sockets ran here, as the loop's next turn would run them, one turn earlier for
        the waiting reader, or a prober completed a message), or the budget is spent, a timer is due, a
        process needs the core or the loop has an event to handle itself (False)."""
        loop = self._loop
        poll = self._poll
        scheduled = loop._scheduled
        n = 0
        while True:
            for p in probers:
                if p.poll_reply():
                    return True  # a message is in
            if poll is None:
                if loop._selector.select(0):
                    return False  # something arrived: the loop takes it in
            elif events := poll(0):
                return _read_now(loop, events)
            n += 1
            if n % 16 == 0:
                if time.perf_counter() >= until or (scheduled and scheduled[0].when() <= loop.time()):
                    return False
                if not core_idle():
                    return False  # the next look ends the polling

    def _loop_free(self, probers: list = ()) -> bool:
        """Whether the loop has nothing to run, but maybe this object's own turn when the only items it
        would test every turn are ``probers``, which the poll tests itself."""
        ready = self._loop._ready
        if not ready:
            return True
        mine = all(not i.spin or i in probers for i in self._items)
        return all(h._cancelled or (h is self._handle and mine) for h in ready)

    def _answered(self) -> bool:
        """Forget the readers whose reply came; True (the poll counted as answered) when none waits."""
        self._waiting = [(f, p) for f, p in self._waiting if not f.done()]
        if self._waiting:
            return False
        if self._reply_polled:
            self._replied()
        return True

    def _replied(self) -> None:
        self._reply_polled = False
        self.reply_stats["replies"] += 1
        self._reply_misses = 0

    def _missed(self) -> None:
        self._reply_polled = False
        self.reply_stats["misses"] += 1
        self._reply_misses += 1
        if self._reply_misses >= REPLY_MISSES:
            self._reply_misses = 0
            self._reply_paused_until = time.perf_counter() + REPLY_PAUSE


def _read_now(loop, events) -> bool:
    """Run the reader callbacks of the ready file descriptors ``events`` (``(fd, mask)`` from the
    loop's epoll/poll object) here, as the loop's turn would (``_process_events`` then the handle):
    the selector is level-triggered, so whatever these leave unread is reported to the loop again.
    False when some event is the loop's to handle (a socket ready for writing: its writer must run)."""
    keys = loop._selector.get_map()
    handled = True
    for fd, mask in events:
        key = keys.get(fd)
        if key is None:
            continue
        reader, writer = key.data
        if mask & _WRITABLE and writer is not None:
            handled = False  # the loop runs the writer
        if not mask & _READABLE:
            continue
        if reader is not None and not reader._cancelled:
            reader._run()
        else:
            handled = False  # an event no reader here takes: the loop's to handle
    return handled


# as selectors.EpollSelector/PollSelector map events: every event but "writable" wakes the reader, and
# every event but "readable" (errors, hang-ups included) the writer
_READABLE = ~getattr(select, "POLLOUT", 4)
_WRITABLE = ~getattr(select, "POLLIN", 1)


def _polls_selector(loop) -> bool:
    """Whether ``loop`` is asyncio's own selector loop, whose idle moments can be spent polling."""
    return hasattr(loop, "_ready") and hasattr(loop, "_selector") and hasattr(loop, "_scheduled")


_CORES = os.cpu_count() or 1  # /proc/loadavg counts the runnable processes of the whole machine
_loadavg_fd: int | None = None


def _runnable() -> int | None:
    """The runnable threads of the machine, this one included (``/proc/loadavg``); None without /proc."""
    global _loadavg_fd
    try:
        if _loadavg_fd is None:
            _loadavg_fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        return int(os.pread(_loadavg_fd, 128, 0).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


def core_idle() -> bool:
    """No more runnable threads (this one included) than usable cores: polling takes a core no one wants.
    False without /proc: never poll."""
    n = _runnable()
    return n is not None and n <= _CORES


def cores_taken(peer_pid: int) -> bool:
    """Every core is taken by threads other than the process ``peer_pid`` of this node: as many runnable as
    cores or more, this one included.  The peer's main thread, when it runs now (it waits for this
    process's message in a poll, or works), is left out: it already holds a core, beside this one, and a
    copy that needs both ends' MPI calls would move.  False without /proc."""
    n = _runnable()
    if n is None or n < _CORES:
        return False
    return n - _running(peer_pid) >= _CORES


def _running(pid: int) -> int:
    """1 if the main thread of process ``pid`` is running or runnable now (``/proc/<pid>/stat``), else 0."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.read(fd, 512)
        finally:
            os.close(fd)
        end = stat.rindex(b")")  # the state follows the command name, which may hold spaces and ")"
        return int(stat[end + 2 : end + 3] == b"R")
    except (OSError, ValueError):
        return 0


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Progress] = weakref.WeakKeyDictionary()


def for_loop(loop: asyncio.AbstractEventLoop | None = None) -> Progress:
    """The :class:`Progress` of ``loop`` (default: the running loop)."""
    loop = loop or asyncio.get_running_loop()
    p = _by_loop.get(loop)
    if p is None:
        p = _by_loop[loop] = Progress(loop)
    return p
