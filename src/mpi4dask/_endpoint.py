"""This process's MPI endpoint for the ``mpi://`` transport (private): what its connections share.

One :class:`_Endpoint` per process, made once MPI is up (:func:`get`), holds

* the **receive tags** (:class:`_Tags`): each side of a connection allocates its own, from the upper
  half of the MPI tag space, never reused within the process, so a late message for a closed
  connection can never reach a newer one;
* the **proofs** (:class:`_Proofs`): MPI messages on the lowest tag of that half, each the peer's
  16-byte nonce and the sender's receive tag (``<16sI``), with which the handshake
  (:mod:`mpi4dask._handshake`) checks that a peer is the rank it claims (MPI's source field cannot be
  forged) and learns the tag to send to.  Proofs that arrive for no handshake are received and
  dropped, so none is left unmatched at ``MPI_Finalize``;
* the **routes**, the communicators a connection's frames travel on: 0 is ``MPI.COMM_WORLD``, the
  others are intercommunicators with processes of other worlds (:class:`_Pairs`, which also joins
  them, one join at a time per process);
* what closed connections leave in MPI: their tags, drained of what peers still send for ``RECENT``
  seconds (:class:`_Ticker`), and their requests that MPI still holds (:class:`_Graveyard`);
* the **exit cleanup** (:meth:`_Endpoint.release_at_exit`): nothing of ours pending or unmatched
  at ``MPI_Finalize``, which would otherwise fail and take the whole job down.

The process's receive buffers (:class:`_BufferPool`, ``_pool``) are here too, shared by the event
loops of every thread, as is the pacing of every wait on MPI (:func:`backoff`).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import os
import socket
import struct
import sys
import threading
import time
import weakref

import numpy as np
from distributed.comm.core import CommClosedError, FatalCommClosedError

from . import _metrics, _mpi

logger = logging.getLogger(__name__)

# Seconds MPI_Comm_accept/connect may wait for the peer of a pair.  Meanwhile MPICH holds its lock (every MPI call of
# the process waits) and polls (a core is busy), so a peer that died half-way must not hold the process long.  The
# client enters MPI_Comm_connect right after its GO byte (the handshake's step 6p), and the server enters
# MPI_Comm_accept once it has that byte: the accept waits for MPICH's own work (milliseconds: at most 80 ms measured
# with 8 busy processes on 2 cores), the connect for the server's join thread too, which may wait that long for the
# GIL (a task holding it in C: pandas, numpy).
JOIN_TIMEOUT = {"accept": 1, "connect": 3}
INIT_WARN_AFTER = 5.0  # seconds of waiting for MPI_Init before saying why in the log


# --------------------------------------------------------------------------------------------
# Tags, proofs, and the pacing of waits on MPI


class _Tags:
    """Hands out per-connection receive tags from the upper half of the MPI tag space.

    The lowest tag of that half carries proofs (see the handshake); tags are never reused within
    a process, so a late message for a closed connection can never reach a newer one.
    """

    def __init__(self, tag_ub: int):
        self.proof = tag_ub // 2
        self._first = self.proof + 1
        self._count = tag_ub - self._first
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def allocate(self) -> int:
        with self._lock:
            n = next(self._counter)
        if n >= self._count:
            raise FatalCommClosedError(f"mpi4dask: this process has used all {self._count} MPI tags")
        return self._first + n


_PROOF = struct.Struct("<16sI")  # the peer's nonce, the sender's receive tag for the connection


class _Proofs:
    """MPI messages on the proof tag: "I am rank <source>, you sent me nonce N, send to my tag T".

    No step of the handshake waits for MPI to complete a proof: MPI may complete a send, even of 20
    bytes, only once the receiver has matched it (an MPI that uses its rendezvous or single-copy
    protocol for every size, e.g. MPICH with ``MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD=1``), and the
    receiver looks for the proof only once the sender's next socket message said it was sent.  So a
    proof is posted and left to complete on its own: the sender tests it on its loop, backing off
    (:attr:`_sender`, a :class:`_Ticker`), and the receiver takes it with a nonblocking receive that it
    tests while it waits (:meth:`take`), never blocking its loop on a sender that may have died.
    """

    KEEP = 4096  # proofs received and not (yet) claimed by a handshake, kept at most

    def __init__(self, w, tag: int):
        self.w = w
        self.tag = tag
        self._got: collections.OrderedDict[tuple[int, bytes], int] = collections.OrderedDict()
        self._sending: list = []  # (request, buffer) of proofs posted and not yet completed
        self._receiving: list = []  # (request, buffer, source) of proofs matched and not yet received
        self._sender = _Ticker(1e-4, self._test_sends, longest=0.05)  # tests _sending on a loop, backing off
        self._lock = threading.Lock()

    def send(self, dest: int, nonce: bytes, tag: int) -> None:
        """Post a proof (16 bytes of the peer's nonce, our receive tag) to world rank ``dest``; returns
        at once.  The socket message sent next may arrive before it: the peer's :meth:`take` waits for
        it.  A proof to this very process completes when this process's own :meth:`take` receives it."""
        buf = _PROOF.pack(nonce, tag)
        req = self.w.comm.Isend([buf, self.w.MPI.BYTE], dest, self.tag)
        if req.Test():
            return
        with self._lock:
            self._sending.append((req, buf))
        self._sender.start()

    def _test_sends(self) -> bool:
        """Test the posted proofs; True while MPI has not completed them all."""
        with self._lock:
            self._sending = [(r, b) for r, b in self._sending if not r.Test()]
            return bool(self._sending)

    def release(self) -> int:
        """At exit: receive what has arrived (return how many), and free the requests of proofs that
        MPI has not completed (sends that nobody took, receives from a sender that stopped)."""
        n = self.collect()
        with self._lock:
            for r, *_ in self._sending + self._receiving:
                if not r.Test():
                    r.Free()
            self._sending, self._receiving = [], []
        return n

    def collect(self) -> int:
        """Receive every proof that has arrived, from any rank; return how many were matched."""
        MPI, comm = self.w.MPI, self.w.comm
        status = MPI.Status()
        n = 0
        with self._lock:
            for m in matched(comm, MPI.ANY_SOURCE, self.tag, status):
                n += 1
                buf = bytearray(status.Get_count(MPI.BYTE))
                self._receiving.append((m.Irecv([buf, MPI.BYTE]), buf, status.Get_source()))
            receiving, self._receiving = self._receiving, []
            for req, buf, source in receiving:
                if not req.Test():
                    self._receiving.append((req, buf, source))
                elif len(buf) != _PROOF.size:
                    logger.warning("mpi4dask: dropped a malformed proof message from rank %d", source)
                else:
                    nonce, tag = _PROOF.unpack(buf)
                    self._got[(source, nonce)] = tag
            while len(self._got) > self.KEEP:
                self._got.popitem(last=False)
        return n

    async def take(self, source: int, nonce: bytes, timeout: float) -> int | None:
        """The receive tag that rank ``source`` proved with ``nonce``, or None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        async for _ in backoff(1e-4, 0.01):
            self.collect()
            with self._lock:
                tag = self._got.pop((source, nonce), None)
            if tag is not None or time.monotonic() > deadline:
                return tag


def matched(comm, source: int, tag: int, status):
    """The messages MPI holds from ``source`` on ``tag``, matched one by one (``MPI_Improbe``, each
    described by ``status`` when it is yielded) until none is left.  A probe that finds nothing is
    made once more before this ends: MPICH's probe moves a message that arrived while the process
    made no MPI call into its queues and still answers "none"; only the next probe matches it
    (measured with MPICH 5, a 20-byte message sent 1 ms before: two probes every time in 20 of 20).
    A handshake that waited for its proof after such a miss slept a backoff step: 0.3 ms of the
    client's 1.1 ms handshake."""
    missed = False
    while True:
        m = comm.Improbe(source, tag, status)
        if m is not None:
            missed = False
            yield m
        elif missed:
            return
        else:
            missed = True


async def backoff(first: float, most: float):
    """Yield at once, then after each of :func:`mpi4dask._mpi.delays` (for awaiting MPI)."""
    yield
    for delay in _mpi.delays(first, most):
        await asyncio.sleep(delay)
        yield


# --------------------------------------------------------------------------------------------
# The endpoint, and what closed connections leave in MPI


class _Ticker:
    """Calls ``tick()`` on one event loop for as long as it returns True: every ``interval`` s, or, given
    ``longest``, after :func:`mpi4dask._mpi.delays` (``interval`` doubling up to ``longest``).

    :meth:`start` says there is work: it arms the ticker on the running loop unless a live loop runs it
    already (when the loop that ran it has ended, an ``asyncio.run`` that returned, it moves); the tick
    already scheduled then runs at its time, and the backoff starts again from ``interval`` after it.  A
    start from another thread while ``tick()`` runs is not lost: a tick that returns False stops the
    ticker only when no start came since the tick began.
    """

    def __init__(self, interval: float, tick, longest: float | None = None):
        self.interval = interval
        self.longest = interval if longest is None else longest
        self._tick = tick
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False  # a start() came since the running tick began
        self._lock = threading.Lock()  # comms on several threads' loops may start it

    def start(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # e.g. a finalizer on another thread: a later start() arms it
            return
        with self._lock:
            self._started = True
            owner = self._loop
            if owner is not None and not owner.is_closed() and owner.is_running():
                return
            self._loop, self._started = loop, False  # its first tick sees the work
        delays = _mpi.delays(self.interval, self.longest)
        loop.call_later(next(delays), self._run, loop, delays)

    def _run(self, loop, delays) -> None:
        with self._lock:
            if self._loop is not loop:
                return  # another loop took over
            if self._started:
                delays = _mpi.delays(self.interval, self.longest)
            self._started = False
        try:
            more = self._tick()
        except Exception:  # noqa: BLE001 - a later start() arms it again
            logger.exception("mpi4dask: %r failed", self._tick)
            more = False
        with self._lock:
            if self._loop is not loop:
                return
            if (more or self._started) and not loop.is_closed():
                loop.call_later(next(delays), self._run, loop, delays)
                return
            self._loop = None


class _Endpoint:
    """This process's MPI resources for the transport (one per process, made once MPI is up)."""

    def __init__(self, w):
        self.w = w
        self.tags = _Tags(w.tag_ub)
        self.proofs = _Proofs(w, self.tags.proof)
        # (route, peer rank, receive tag) of closed MPI connections: messages the peer sent after we
        # stopped listening are received and dropped, so none is left in MPI's queues at exit
        self.closed_tags: collections.OrderedDict[tuple[int, int, int], float] = collections.OrderedDict()
        self.routes: dict[int, object] = {0: w.comm}  # route -> communicator (0: MPI.COMM_WORLD)
        self.pairs = _Pairs(self)
        self.comms: weakref.WeakSet = weakref.WeakSet()  # open MPI-mode comms (mpi4dask.comm.MPIComm)
        self.other_ranks = False  # an MPI-mode comm with another process was made
        self.graves: weakref.WeakSet[_Graveyard] = weakref.WeakSet()
        self.dropping: list = []  # (request, buffer) of drained messages still arriving
        self.handshakes = 0  # under way (handshaking()): their peers' proofs may still come
        self.handshake_failed = -1.0  # when one last failed (monotonic): its peer's proof may still come
        self._lingering: dict[tuple[int, int, int], object] = {}  # tag -> link: reading on until settled
        self._peer_pids: dict[tuple[int, int, int], int] = {}  # closed tags -> the peer's pid (0: unknown)
        self._exit_socks: dict[tuple[int, int, int], socket.socket] = {}  # at exit: unsettled tag -> its socket
        self._peers_done: set[tuple[int, int, int]] = set()  # at exit: tags whose peer closed its socket end
        self._drainer = _Ticker(self.DRAIN_EVERY, self._drain_recent)
        atexit.register(self.release_at_exit)  # after mpi4py's MPI_Finalize hook: runs before it

    CLOSED_TAGS_MAX = 100_000
    EXIT_WAIT = 1.0  # seconds, in all, that requests left at exit get to finish before they are freed
    # At exit, peers may still be sending to this process until they notice its sockets close; a
    # message that arrives after the last drain is unmatched at MPI_Finalize, which then fails, and
    # hydra kills the whole job.  So the drain goes on until nothing came for EXIT_QUIET seconds --
    # unless no peer can still send (_exit_quiet): every connection closed in the last RECENT s was
    # settled (goodbyes both ways, every announced message in: SocketComm.close), or its peer was this
    # process, as after a clean shutdown; peers that have ended, or closed their end of the connection
    # (see watch_at_exit), get EXIT_QUIET_ENDED.
    EXIT_QUIET = 0.25
    EXIT_QUIET_ENDED = 0.02  # the same, when every peer that may have sent has ended: only bytes in transit
    EXIT_DRAIN_MAX = 3.0
    RECENT = 30.0  # seconds: connections closed this recently may still receive late messages

    DRAIN_EVERY = 0.5  # seconds between drains of recently closed connections' tags, while there are any

    def lingering(self, link) -> None:
        """A connection on ``link`` ended (closed or aborted, here or by the peer) and reads on until it is
        settled (``SocketComm._start_linger``)."""
        self._lingering[_tag_key(link)] = link

    def let_go(self, link, settled: bool) -> None:
        """A connection on ``link`` stopped: unless it is settled (nothing more can arrive on it), its
        receive tag is drained from now on."""
        key = _tag_key(link)
        self._lingering.pop(key, None)
        if not settled:
            self._peer_pids[key] = link.peer_pid
            self.closed(*key)

    def watch_at_exit(self, link, fd: int) -> None:
        """At exit, a connection on ``link`` was stopped unsettled, its socket ``fd`` shut for writing: a
        duplicate of the socket shows when the peer closes its end (:meth:`_watch_peers_ending`)."""
        key = _tag_key(link)
        if key not in self.closed_tags or key in self._exit_socks:
            return
        dup = os.dup(fd)
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            raise
        sock.setblocking(False)
        self._exit_socks[key] = sock

    def _watch_peers_ending(self) -> bool:
        """At exit: read (and drop) what the watched sockets bring.  A peer that closed its end of one (an
        end of file, a reset) has stopped that connection: every MPI message it will send on it was posted
        before (a message's MPI sends are posted before its header is written), and only bytes may still
        be in transit.  True when some peer did since the last call."""
        news = False
        for key, sock in list(self._exit_socks.items()):
            try:
                while sock.recv(1 << 16):
                    pass
                ended = True
            except (BlockingIOError, InterruptedError):
                continue  # open still
            except (ConnectionResetError, BrokenPipeError):
                ended = True
            except OSError:  # cannot tell: the whole quiet
                ended = False
            sock.close()
            del self._exit_socks[key]
            if ended:
                self._peers_done.add(key)
                news = True
        return news

    def closed(self, route: int, peer: int, tag: int) -> None:
        self.closed_tags[(route, peer, tag)] = time.monotonic()
        self.closed_tags.move_to_end((route, peer, tag))
        while len(self.closed_tags) > self.CLOSED_TAGS_MAX:
            self._peer_pids.pop(self.closed_tags.popitem(last=False)[0], None)
        self._drainer.start()

    def _drop_closed(self, since: float) -> int:
        """Receive and discard what peers sent to connections closed at or after ``since``
        (monotonic time); return how many messages that was.  A peer's send to a connection we
        closed completes only so: until then it holds the peer's buffers."""
        MPI = self.w.MPI
        status = MPI.Status()
        n = 0
        for (route, peer, tag), when in reversed(list(self.closed_tags.items())):  # newest first
            if when < since:
                break
            comm = self.routes[route]
            for m in matched(comm, peer, tag, status):
                buf = bytearray(status.Get_count(MPI.BYTE))
                req = m.Irecv([buf, MPI.BYTE])
                if not req.Test():  # never wait here: a peer that died mid-message never sends the rest
                    self.dropping.append((req, buf))
                n += 1
        self.dropping = [(r, b) for r, b in self.dropping if not r.Test()]
        return n

    def _drain_recent(self) -> bool:
        """Drain the connections closed in the last RECENT s; True while there are any."""
        if self.w.MPI.Is_finalized():
            return False
        since = time.monotonic() - self.RECENT
        try:
            self._drop_closed(since)
        except Exception:  # noqa: BLE001 - exit drains again
            logger.debug("mpi4dask: draining closed connections failed", exc_info=True)
        return bool(self.dropping) or (bool(self.closed_tags) and next(reversed(self.closed_tags.values())) >= since)

    def _exit_quiet(self, since: float) -> float:
        """How long exit's drain must see nothing new before MPI_Finalize: EXIT_QUIET while a peer may
        still send us a message -- on a connection closed at or after ``since`` whose tag is not settled
        (its peer's goodbye did not come, or came before all its messages: see
        :meth:`mpi4dask.comm.SocketComm.close`), from another process that is alive or not on this node;
        while drained messages still arrive; while a handshake is under way or failed lately (its
        peer's proof).  EXIT_QUIET_ENDED when every such peer has ended or closed its end of the connection
        since (what it sent may still be in transit; a peer of another node is waited for all the same);
        0 when there is none, or only this very process."""
        if self.dropping or self.handshakes or self.handshake_failed >= since:
            return self.EXIT_QUIET
        quiet = 0.0
        for key, when in reversed(list(self.closed_tags.items())):  # newest first
            if when < since:
                break
            pid = self._peer_pids.get(key, 0)
            if pid != os.getpid():
                if _alive(pid) and (pid <= 0 or key not in self._peers_done):
                    return self.EXIT_QUIET
                quiet = self.EXIT_QUIET_ENDED
        return quiet

    def drop_stale_messages(self, since: float = 0.0) -> int:
        """At exit: receive and discard what peers sent to connections closed at or after ``since``
        (monotonic time), and unclaimed proofs; return how many messages that was."""
        return self._drop_closed(since) + self.proofs.release()

    def release_at_exit(self) -> None:
        """Leave nothing of ours in MPI before ``MPI_Finalize``: no request pending, no message unmatched.
        First the closers registered with :func:`close_first_at_exit` end what they own cleanly; the
        connections still open after them are stopped, their sockets shut down."""
        if self.w.MPI.Is_finalized():
            return
        try:
            for close in _close_first:
                try:
                    close()
                except Exception:  # noqa: BLE001 - the connections are stopped below anyway
                    logger.warning("mpi4dask: %r failed at exit", close, exc_info=True)
        finally:  # (also after a Ctrl-C in a closer: MPI_Finalize must find nothing of ours pending)
            self._release()

    def _release(self) -> None:
        try:
            # the graves of the comms stopped here have no other holder: keep them until released
            recent = time.monotonic() - self.RECENT
            stopped = [c._stop(at_exit=True) for c in list(self.comms)]
            for link in list(self._lingering.values()):  # lingering comms that were lost with their loop
                self.let_go(link, settled=False)
            deadline = time.monotonic() + self.EXIT_WAIT
            for g in {*self.graves, *filter(None, stopped)}:
                g.release(deadline)
            self.drop_stale_messages()
            self._watch_peers_ending()
            wait = self._exit_quiet(recent) if self.other_ranks else 0.0
            if wait:
                start = quiet = time.monotonic()
                while True:
                    if self._watch_peers_ending():
                        shorter = self._exit_quiet(recent)
                        if shorter < wait:  # counted from now
                            wait, quiet = shorter, time.monotonic()
                    now = time.monotonic()
                    if now - quiet >= wait or now - start >= self.EXIT_DRAIN_MAX:
                        break
                    time.sleep(0.005)
                    if self.drop_stale_messages(since=recent):
                        quiet = time.monotonic()
            # drained messages that will not complete (their sender died mid-message): let go of them
            _Graveyard(self.w.MPI, [r for r, _ in self.dropping], [b for _, b in self.dropping]).release(
                time.monotonic() + self.EXIT_WAIT)
            self.dropping = []
        except Exception:  # noqa: BLE001 - exit goes on; MPI_Finalize reports what is left
            logger.debug("mpi4dask: releasing MPI state at exit failed", exc_info=True)
        finally:
            for sock in self._exit_socks.values():
                sock.close()
            self._exit_socks.clear()


# --------------------------------------------------------------------------------------------
# Pairs of worlds


class _Pairs:
    """Intercommunicators with processes of other MPI worlds: a served world of one per Dask process
    started outside mpiexec (:mod:`mpi4dask.pm`), or another job's ranks.

    The first ``mpi://`` connection between two such processes joins them (``MPI_Open_port`` and
    ``MPI_Comm_accept`` on the listening side, ``MPI_Comm_connect`` on the other, after both proved
    they know the cluster's secret: the pair sub-protocol of :mod:`mpi4dask._handshake`); every later
    connection between the two reuses that pair, with tags of its own.  MPICH holds a process-wide
    lock while it joins (no other MPI call of the process goes on until the peer arrives), so both
    sides join only when each holds its *slot* (one join at a time per process): the client takes its
    own, then asks; a server whose slot is taken answers "busy" at once and the client retries after a
    random pause.  No process ever waits inside MPICH for a peer that waits for another.
    """

    def __init__(self, ep: _Endpoint):
        self.ep = ep
        self._by_peer: dict[str, dict[str, int]] = {}  # peer ident -> {pair id: route}
        self._routes = itertools.count(1)
        self._slot = threading.Lock()
        self._infos = None  # MPICH's join timeout (seconds) -> an MPI.Info saying it
        self._running = None  # the join thread's work (a concurrent future) of the latest join

    def ids(self, ident: str) -> list[str]:
        return list(self._by_peer.get(ident, {}))

    def route(self, ident: str, pair_id) -> int | None:
        return self._by_peer.get(ident, {}).get(pair_id) if isinstance(pair_id, str) else None

    def add(self, ident: str, pair_id: str, intercomm) -> int:
        route = next(self._routes)
        self.ep.routes[route] = intercomm
        self._by_peer.setdefault(ident, {})[pair_id] = route
        return route

    # -- the slot: one join at a time in this process
    def try_slot(self) -> bool:
        """Take the slot if it is free (never waits)."""
        if not self._slot.acquire(blocking=False):
            return False
        self._prepare()
        return True

    async def take_slot(self, deadline: float, peer_addr: str) -> None:
        async for _ in backoff(1e-3, 0.05):
            if self._slot.acquire(blocking=False):
                self._prepare()
                return
            if time.monotonic() > deadline:
                raise FatalCommClosedError(f"mpi4dask: could not start joining MPI with {peer_addr}: this process "
                                           "was busy joining others for the whole connect timeout")

    def release_slot(self) -> None:
        """Free the slot, or have the join thread free it once it is done: a handshake given up
        (cancelled) while its thread is still inside MPI leaves the slot held until then, so the
        next join never begins while MPICH holds its process-wide lock for that one."""
        running = self._running
        if running is not None and not running.done():
            running.add_done_callback(lambda _: self._slot.release())  # (at once if it is done by now)
        else:
            self._slot.release()

    def _prepare(self) -> None:
        """Make, once, what a join needs, while no peer waits for this process: the info objects with
        MPICH's timeout, the handle through which a join bounds other MPI waits.

        Once the peer may be inside MPI, a join must not let the GIL go before it enters accept/connect:
        a task holding the GIL in C (a pandas or numpy call) may keep it for the whole call, and the
        peer counts that time against MPICH's timeout.  Every mpi4py call lets the GIL go (finding the
        handle does: here, before any peer waits), and so does starting a thread (each join's thread
        starts before its side of the meeting: :meth:`join`)."""
        if self._infos is not None:
            return
        MPI = self.ep.w.MPI
        _mpi.prepare_joining()
        infos = {}
        for seconds in range(1, max(JOIN_TIMEOUT.values()) + 1):
            infos[seconds] = MPI.Info.Create()
            infos[seconds].Set("timeout", str(seconds))
        self._infos = infos

    async def join(self, how: str, port: str, deadline: float, peer_addr: str, go, keep, announce=None):
        """``MPI_Comm_accept``/``connect`` on a thread of its own, with MPICH's own timeout; the slot must
        be held.  On that thread ``go.meet()`` comes right before MPI: the two sides' meeting point
        (a :class:`mpi4dask._sockets.Signal`: :mod:`mpi4dask._handshake`, step 6p); an
        :class:`OSError` from it means the peer left before the join began.  ``announce()``, if
        given, runs on the loop once that thread is on its way.

        ``keep(intercomm)`` registers the pair.  This returns what it returns; when the handshake is
        given up (cancelled) while the thread is inside MPI, the thread still joins the two worlds, and
        ``keep`` then runs on the loop once it has: the peer, whose handshake may well have gone on,
        holds the pair too, and later connections between the two reuse it (not kept, this side's half
        of a pair the other side offers would be lost, and its MPI resources with it)."""
        MPI = self.ep.w.MPI
        seconds = max(1, int(min(JOIN_TIMEOUT[how], deadline - time.monotonic())))  # short: see JOIN_TIMEOUT
        info = self._infos[seconds]
        took = [None]  # seconds inside MPI_Comm_accept/connect (None: it did not start)

        def run():
            try:
                with _mpi.joining(f"MPI_Comm_{how} with {peer_addr}", seconds, go.meet):
                    t0 = time.monotonic()
                    try:
                        if how == "accept":
                            return MPI.COMM_SELF.Accept(port, info, 0)
                        return MPI.COMM_SELF.Connect(port, info, 0)
                    finally:
                        took[0] = time.monotonic() - t0
            finally:
                go.close()

        try:
            # a thread of its own, which ends with the join: a process keeps no thread for joins it made
            # (distributed's tests, and users', count threads left over after a cluster closes)
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mpi4dask-join")
            try:
                self._running = pool.submit(run)
            except BaseException:  # (at interpreter exit) run() never closes it
                go.close()
                raise
            finally:
                pool.shutdown(wait=False)
            if announce is not None:
                announce()
            try:
                intercomm = await _outcome(self._running)
            except asyncio.CancelledError:  # the handshake was given up: so is the join, unless it is in MPI
                go.abort()
                _outcome(self._running).add_done_callback(
                    lambda joined: _keep_late(joined, keep, f"MPI_Comm_{how} with {peer_addr}", peer_addr, took[0]))
                raise
        except MPI.Exception as exc:
            why = _mpi.error_text(exc)
            _metrics.join_failed("pair", "mpi_error", peer_addr, took[0])
            logger.warning("mpi4dask: MPI_Comm_%s with %s failed (the peer probably died half-way): %s. This "
                           "process's MPI connections go on; its new connections carry their messages over TCP until "
                           "it restarts (MPICH may crash on another join after this).", how, peer_addr, why)
            raise FatalCommClosedError(f"mpi4dask: MPI_Comm_{how} with {peer_addr} failed ({why})") from exc
        except RuntimeError as exc:  # (MPI.Exception is one too) an earlier join failed while this one was being set up
            _metrics.join_failed("pair", "joins_failed_before", peer_addr)
            raise FatalCommClosedError(str(exc)) from exc
        except OSError as exc:  # go.meet(): the peer closed the connection, or never came, before MPI
            _metrics.join_failed("pair", "peer_gone", peer_addr)
            raise CommClosedError(f"mpi4dask: {peer_addr} left before joining MPI with this process "
                                  f"({exc or type(exc).__name__})") from exc
        _metrics.joined("pair", peer_addr, took[0])
        return keep(intercomm)



def _keep_late(joined: asyncio.Future, keep, what: str, peer_addr: str, took: float | None) -> None:
    """A join whose handshake was given up while it was inside MPI has ended: keep the pair it made
    (:meth:`_Pairs.join`); nothing if it failed."""
    if joined.exception() is not None:
        return
    keep(joined.result())
    _metrics.joined("pair", peer_addr, took)
    logger.info("mpi4dask: %s completed after its handshake was given up; the pair is kept for later connections",
                what)


def _outcome(work) -> asyncio.Future:
    """An asyncio future with the outcome of ``work`` (a concurrent future of a thread); cancelling
    it leaves ``work`` alone (asyncio.wrap_future would cancel work that has not started)."""
    loop = asyncio.get_running_loop()
    out = loop.create_future()

    def settle():
        if not out.cancelled():
            exc = work.exception()
            out.set_result(work.result()) if exc is None else out.set_exception(exc)

    def done(_):
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits
            pass

    work.add_done_callback(done)
    return out


# --------------------------------------------------------------------------------------------
# Requests MPI still holds


class _Graveyard:
    """Requests of aborted connections: tested until MPI lets go of their buffers."""

    nbytes = 0
    spin = False
    steady = False

    def __init__(self, MPI, reqs, keep):
        self.MPI = MPI
        self.reqs = reqs
        self.keep = keep

    def poll(self) -> bool:
        return not self.MPI.Request.Testall(self.reqs)

    def release(self, deadline: float = 0.0) -> None:
        """At exit: let cancelled receives and pending sends finish until ``deadline`` (monotonic
        time), then free what is left."""
        while not self.MPI.Request.Testall(self.reqs) and time.monotonic() < deadline:
            time.sleep(0.001)
        for r in self.reqs:
            if r != self.MPI.REQUEST_NULL:
                r.Free()


# --------------------------------------------------------------------------------------------
# This process's endpoint


_current: _Endpoint | None = None
_warned_slow_init = False
_warned_no_service = False  # said once: MPI could not start through the cluster's MPI service (get())
_close_first: list = []  # see close_first_at_exit


def close_first_at_exit(close) -> None:
    """Have ``close()`` run at interpreter exit before this process's endpoint stops the connections that are
    still open (:meth:`_Endpoint.release_at_exit`), whatever the order the two were registered with
    :mod:`atexit` in: :func:`mpi4dask.launcher.shutdown` closes the client rank's Clients cleanly, where a
    socket shut down under a Client made the scheduler log a ``CommClosedError`` traceback and the Client
    reconnect, as the job ended (seen with ``initialize(comm=sub)``, 3 runs of 4).  ``close`` must be
    idempotent: :mod:`atexit` may call it too."""
    if close not in _close_first:
        _close_first.append(close)


def _tag_key(link) -> tuple[int, int, int]:
    """The key of ``link``'s receive tag (``closed_tags``, the exit's bookkeeping)."""
    return (link.route, link.peer, link.recv_tag)


def _alive(pid: int) -> bool:
    """Whether the process ``pid`` of this node may still run (0: a process of another node: it may)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@contextlib.contextmanager
def handshaking(ep: _Endpoint | None):
    """Count a connection's handshake (:mod:`mpi4dask._handshake`) while it is under way: a process that
    exits meanwhile drains the late messages of its peer (a proof, see :meth:`_Endpoint._exit_quiet`)."""
    if ep is None:
        yield
        return
    ep.handshakes += 1
    try:
        yield
    except BaseException:
        ep.handshake_failed = time.monotonic()
        raise
    finally:
        ep.handshakes -= 1


def current() -> _Endpoint | None:
    """This process's endpoint if it was made (never waits, never starts MPI)."""
    return _current


async def get(timeout: float) -> _Endpoint | None:
    """This process's endpoint, waiting (without blocking the loop) at most ``timeout`` s for MPI_Init
    to complete; None while this process may not start MPI yet (:func:`mpi4dask._mpi.may_start`), when the
    cluster's MPI service could not be reached or refused it (:func:`mpi4dask._mpi.service_refused`), or
    once the process has begun to exit: its connections then use their sockets."""
    global _current, _warned_slow_init, _warned_no_service
    if _current is not None:
        return _current
    if not _mpi.may_start():
        return None  # a Dask worker waiting for its cluster's MPI service (mpi4dask.pm): no MPI yet
    fut = asyncio.wrap_future(_mpi.start())
    done, _ = await asyncio.wait({fut}, timeout=min(INIT_WARN_AFTER, timeout))
    if not done and timeout > INIT_WARN_AFTER:
        if not _warned_slow_init:
            _warned_slow_init = True
            logger.warning(
                "mpi4dask: still waiting for MPI_Init after %.0f s (waiting up to %.0f s). Under mpiexec it "
                "returns only once every rank of the job has initialised MPI: each rank must use mpi:// (or "
                "initialise MPI) for the others to go on.",
                INIT_WARN_AFTER, timeout,
            )
        done, _ = await asyncio.wait({fut}, timeout=timeout - INIT_WARN_AFTER)
    if not done:
        raise OSError(
            f"mpi4dask: MPI_Init did not complete within {_seconds(timeout)} (under mpiexec it waits for every "
            "rank of the job to initialise MPI)"
        )
    refused = _mpi.service_refused()
    if refused:
        # a Dask-started process whose cluster's MPI service went away before it could join MPI (its
        # scheduler died): its connections go on over their sockets, as before it had the credentials,
        # so it can still reach its nanny, close, and be restarted (over tcp:// it would)
        if not _warned_no_service:
            _warned_no_service = True
            logger.warning("mpi4dask: %s. This process's mpi:// connections carry their messages over TCP "
                           "until it restarts.", refused)
        return None
    w = fut.result()  # MPIUnavailableError when MPI is broken
    if _mpi.exiting():
        return None  # (an endpoint made now would register its exit drain too late to be called)
    _current = _mpi.per_world("endpoint", _Endpoint, w)
    return _current


def _seconds(t: float) -> str:
    """A duration as people write it: ``0.01 s``, ``2.5 s``, ``30 s``."""
    return f"{t:.3g} s"


# --------------------------------------------------------------------------------------------
# Receive buffers


HUGE_PAGE = 2 << 20
PAGE = 4 << 10
BUFFER_OFFSET = 256  # bytes from a (huge) page boundary to a receive buffer's first byte: see _receive_buffer


def _receive_buffer(n: int) -> np.ndarray:
    """``n`` bytes to receive a message into: ``BUFFER_OFFSET`` bytes past a 2 MiB boundary when ``n`` is
    at least that large, else past a 4 KiB page boundary.

    The huge pages: transparent huge pages (numpy asks for them) back the 2 MiB pages that lie wholly
    inside an allocation, so a buffer that starts near a 2 MiB boundary lies on huge pages but for its
    last ``BUFFER_OFFSET`` bytes (an 8 MiB array from anywhere: 3 huge pages and 2 MiB of small ones),
    and MPI's single copy between processes (CMA) walks the pages it copies: measured with raw mpi4py
    on this VM, 8 MiB ping-pong 664 -> 590 us one way with aligned buffers.

    The offset: a copy runs 4-6x slower when its destination lies 16 bytes past its source modulo
    4 KiB, and up to ~12% slower for the rest of the first 64 (the CPU takes the loads for reads of
    the stores just made: "4K aliasing").  Measured on this VM, 2026-11-27: MPI's copy of 8 MiB from
    a sender's page-aligned array into a buffer 16 bytes past a page 3.7-4.8 ms against 0.7-0.8 ms
    at 0 or 64 bytes; numpy copying 16 received 8 MiB blocks into a larger array (dask's concatenate:
    row by row, a strided copy; a whole contiguous copy is not slowed) 60-79 ms from buffers on a page
    boundary against 17 ms from any other, since numpy's large arrays start 16 bytes past a page
    (glibc's mmap'd chunks).  256 bytes past the boundary keeps both copies, into this buffer and out
    of it, clear of that for senders and destinations at 0, 16 and 64 bytes past a page.

    The allocation is ``BUFFER_OFFSET`` plus 2 MiB (or 4 KiB) larger than ``n``; its unused head and
    tail are never touched by us.  Always a view of a larger array that owns the memory (``.base``):
    numpy points views of this view, and arrays made from buffers exported by it, at that owner,
    skipping the view.  So whoever tests whether a buffer is still used must count the references to
    both (:class:`_BufferPool` does)."""
    align = HUGE_PAGE if n >= HUGE_PAGE else PAGE
    base = np.empty(n + align + BUFFER_OFFSET, dtype=np.uint8)
    start = -base.ctypes.data % align + BUFFER_OFFSET
    return base[start : start + n]


class _BufferPool:
    """Reuses large receive buffers, and gives idle ones back to the system.

    Fresh memory costs the kernel a page fault and a zeroed page per 4 KiB (or 2 MiB) on first
    touch: a third of the time of a 64 MiB transfer.  A buffer is handed out again only when the
    pool holds its sole reference, so a frame that a deserialized object still uses is never reused.
    Buffers start just past a huge-page boundary (:func:`_receive_buffer`), so each is a view of the array
    that owns its memory, and both must be unreferenced: distributed's own numpy deserializer makes
    arrays whose base is that owner, not the view (tested).  ``MAX_BYTES`` counts the buffers' sizes,
    not the 2 MiB of slack each aligned one is allocated with: from 32 MiB up glibc maps every
    allocation afresh, so the slack is address space only; below, it may hold up to 2 MiB of heap
    memory that glibc had kept anyway.  (Counting the slack would also stop a 512 MiB gathered result
    from being kept: a fresh 512 MiB of page faults on every such gather.)
    A buffer that nobody uses for ``IDLE_SECONDS`` is freed (a timer on the taker's event loop
    looks while the pool holds any), so a process's memory returns to what it holds, as over tcp://.
    """

    # from the size of the smallest frame MPI carries alone (mpi4dask._datapath.MPI_MIN_FRAME; a bulk message's
    # frames from _wire.BULK_FRAME get fresh buffers), each a buffer of its own: measured (2026-11-30), a
    # worker fetching 16 arrays of 256 KiB at once from another of a cluster
    # that Dask started 1.5 ms with them pooled against 3.3 ms fresh, 160 of them 24 against 33 ms
    MIN_SIZE = 256 << 10
    CLASS_MAX = 64  # buffers kept per size class: take() looks at each, so a class whose buffers all stay in use
    # (the data a worker holds) costs a bounded look; a buffer beyond them is not kept
    MAX_BYTES = 512 << 20  # kept while idle, over all sizes
    IDLE_SECONDS = 1.0

    def __init__(self):
        self._free: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # event loops of several threads share the pool
        self._idle_since: dict[int, float] = {}  # id(buffer) -> when first seen unused
        self._trimmer = _Ticker(self.IDLE_SECONDS / 2, self._trim_while_holding)

    @staticmethod
    def size_class(size: int) -> int:
        """Round up to 4 classes per power of two (at most 25% unused), so similar sizes share buffers."""
        step = (1 << (size.bit_length() - 1)) >> 2
        return -(-size // step) * step

    def _idle(self) -> set[int]:
        """ids of the buffers that nobody but the pool references (lock held)."""
        idle = set()
        for arrs in self._free.values():
            for arr in arrs:
                if _unused(arr):
                    idle.add(id(arr))
        return idle

    def take(self, size: int) -> memoryview:
        if size < self.MIN_SIZE:
            return _receive_buffer(size).data
        cls = self.size_class(size)
        self._trimmer.start()  # (also on reuse: the loop that trimmed may have ended)
        with self._lock:
            for arr in self._free.get(cls, ()):
                if _unused(arr):
                    self._free.move_to_end(cls)
                    self._idle_since.pop(id(arr), None)
                    return arr.data[:size]
            # a new size: first let go of idle buffers of other sizes (the working set has moved on)
            idle = self._idle()
            self._drop(lambda k, arr: k != cls and id(arr) in idle)
            arr = _receive_buffer(cls)
            if self._bytes + cls > self.MAX_BYTES or len(self._free.get(cls, ())) >= self.CLASS_MAX:
                return arr.data[:size]  # the pool is full of buffers in use: this one is not kept
            self._free.setdefault(cls, []).append(arr)
            self._free.move_to_end(cls)
            self._bytes += cls
            while self._bytes > self.MAX_BYTES and len(self._free) > 1:
                _, evicted = self._free.popitem(last=False)  # the least recently used size class
                self._bytes -= sum(a.nbytes for a in evicted)
        return arr.data[:size]

    def _drop(self, doomed) -> None:
        """Forget the buffers for which ``doomed(size_class, buffer)`` is true (lock held)."""
        for k in list(self._free):
            keep = []
            for arr in self._free[k]:
                if doomed(k, arr):
                    self._bytes -= arr.nbytes
                    self._idle_since.pop(id(arr), None)
                else:
                    keep.append(arr)
            if keep:
                self._free[k] = keep
            else:
                del self._free[k]

    def trim(self, now: float | None = None) -> None:
        """Free the buffers unused for ``IDLE_SECONDS``; note when the others became unused."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = self._idle()
            seen = self._idle_since = {i: self._idle_since.get(i, now) for i in idle}
            self._drop(lambda k, arr: now - seen.get(id(arr), now) >= self.IDLE_SECONDS)

    def _trim_while_holding(self) -> bool:
        self.trim()
        with self._lock:
            return bool(self._free)


def _unused(arr) -> bool:
    """Whether only the pool references ``arr``, a buffer in one of its lists, and the array that owns
    its memory (both counts as :func:`_refs` reports them from the same place: see :func:`_idle_refs`)."""
    return sys.getrefcount(arr) <= _IDLE_REFS and sys.getrefcount(arr.base) <= _IDLE_BASE_REFS


def _refs(arr) -> tuple[int, int]:
    """What :func:`_unused` counts, in a frame of the same shape."""
    return sys.getrefcount(arr), sys.getrefcount(arr.base)


def _idle_refs() -> tuple[int, int]:
    """What :func:`_refs` reports when it is called, as the pool calls :func:`_unused`, from a loop over
    a list that is all that holds the buffer; measured, since interpreters count borrowed references
    differently (3.11: the list, the loop variable, the parameter, the call's argument: 4; the owner:
    the view's base pointer and the call's argument: 2).  Measured with tracing off: a tracer that reads
    ``frame.f_locals`` (debuggers do) adds a reference while it runs, and counts too high here would
    let the pool reuse buffers still in use."""
    tracer = sys.gettrace()
    sys.settrace(None)
    try:
        free = {0: [_receive_buffer(1)]}
        for arr in free.get(0, ()):
            return _refs(arr)
    finally:
        sys.settrace(tracer)
    raise AssertionError("unreachable")


_IDLE_REFS, _IDLE_BASE_REFS = _idle_refs()
_pool = _BufferPool()
