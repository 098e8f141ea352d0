"""The ``mpi://`` comm backend for ``distributed``.

Addresses are ``mpi://host:port``; ``host:port`` is a real TCP listening socket.  Every connection
has two channels:

* a **TCP control socket**, used for the handshake, as the doorbell that wakes the receiving event
  loop (one byte per message, so nothing polls while idle), for the goodbye on ``close()``, and to
  notice a peer that dies (the kernel closes its sockets);
* **MPI point-to-point** on ``MPI.COMM_WORLD`` for the payload, when both ends are ranks of the same
  MPI world.  Each side allocates its own receive tag pair for the connection (unique within the
  process, never reused) and hands it to the peer inside an MPI message, so a connection's matching
  space is (peer rank, tag): agreed explicitly, never inferred from connection order.

MPI itself is initialised on a thread of its own (:mod:`mpi4dask._mpi`): under ``mpiexec``,
``MPI_Init`` returns only when every rank has called it, so it must never block an event loop whose
listener the other ranks need.  A listener starts the initialisation when it starts listening, a
connector when it connects; both await it without blocking their loop.

Handshake (length-prefixed JSON over the socket, then MPI)
-----------------------------------------------------------
1. client -> server: ``hello`` (rank, world size, launcher job key, host, pid, a random nonce Nc).
2. server -> client: ``hello`` (the same of the server, its nonce Ns, and ``mpi``: whether its
   cheap checks allow a shared world: same size and job key, a valid rank other than its own, or
   this very process).
3. client: if both sides' cheap checks pass, it sends the **proof** ``Ns + its receive tag`` over
   MPI to the server's claimed rank (on the process-wide proof tag), then ``{"proof": "sent"}``;
   else ``{"proof": "none"}``.
4. server: on "sent" it receives the proof from the *claimed* rank (MPI's source field cannot be
   forged); only then does it send its own proof ``Nc + its receive tag`` to that rank and
   ``{"verdict": "mpi"}``.  Otherwise ``{"verdict": "socket"}``.
5. client: on "mpi" it takes the server's proof from the server's claimed rank.

So the listener sends nothing over MPI on a peer's behalf before the peer has proven its rank,
and the tags a connection sends on come from the peer's own MPI message.  Waits for a proof are not
timed guesses: when both sides know their launcher's job key (hydra, Open MPI, Slurm...), a peer of
another job is told apart at once, and a peer of the same job that does not prove its claim within
the connect timeout is refused (never silently demoted to the socket).  Proofs that arrive for no
handshake (a stranger's claim, a handshake that timed out) are received and dropped, also at exit,
so none is left unmatched at ``MPI_Finalize``.

A message is one MPI *header* message (frame sizes, and all small frames inline) on the
connection's header tag, then each large frame, split into chunks of at most ``MAX_CHUNK`` bytes,
on its data tag, received straight into its own buffer.  Then the doorbell byte goes over TCP.

When the ends are not in one MPI world (a notebook client connecting to an ``mpiexec`` cluster, a
Nanny-spawned worker) the connection carries whole messages over its socket instead (logged once
per process at INFO level).

Errors: any failure inside ``read``/``write`` aborts the connection (as distributed's TCP comm
does); what reaches the caller is a ``CommClosedError``, or the original exception when it was not
a connection problem (e.g. a serialisation error).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import errno
import itertools
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
import weakref

import dask
import numpy as np
from distributed.comm.addressing import unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector, FatalCommClosedError
from distributed.comm.registry import Backend
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames
from distributed.protocol.utils import host_array
from distributed.utils import ensure_ip, ensure_memoryview, get_ip

from . import _mpi, _progress, _wire

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAGIC = "mpi4dask"
MAX_CHUNK = 1 << 30  # bytes per MPI message: stays below the 2**31 count limit of every MPI
INLINE_MAX = 16 << 10  # frames up to this size travel inside the header message
INLINE_TOTAL_MAX = 64 << 10
UNKNOWN_JOB_PROOF_TIMEOUT = 3.0  # seconds to wait for a proof when no side knows its launcher's job
HANDSHAKE_MAX = 64 << 10  # bytes of one handshake message
MAX_FRAMES = 1 << 20  # frames of one message (socket mode), checked before anything is allocated
CLOSE_FLUSH_TIMEOUT = 30.0  # seconds close() waits for its writes to be received
REPLY_SPIN_AFTER_WRITE = 2e-3  # a read this soon after a write waits for a reply ...
REPLY_SPIN = 300e-6  # ... by watching MPI for this long before sleeping until the doorbell,
REPLY_SPIN_RATE = 2e9  # ... plus the time the peer needs to take in what was written, at this many bytes/s

_DOORBELL = b"M"
_ACK = b"A"  # "I have received one of your large messages": the sender's MPI send is (nearly) done
_BYE = b"B"
_FRAMES = b"F"  # socket mode: a whole message follows
_HS_LEN = struct.Struct("<I")
_U32 = struct.Struct("<I")
_FAST = 1 << 31  # header flag (high bit of the frame count): the frames come from _wire.dumps


# --------------------------------------------------------------------------------------------
# Addresses


def _split_host_port(loc: str, use: str) -> tuple[str, int]:
    """Parse ``host:port`` (``[v6]:port`` too) for ``use``:

    * ``"connect"``: both parts, and a port other than 0;
    * ``"listen"``: either part may be left out (the wildcard host, an ephemeral port);
    * ``"address"``: what distributed's address helpers take (as for tcp://): a port (0 too), any host.
    """
    full = f"mpi://{loc}"
    fix = "use mpi://HOST:PORT, e.g. mpi://10.0.0.5:8786"
    if not isinstance(loc, str):
        raise TypeError(f"mpi:// address must be a string, got {loc!r}")
    if loc.startswith("["):
        end = loc.find("]")
        if end < 0:
            raise ValueError(f"malformed address {full!r}: unclosed '[' in IPv6 host; {fix}")
        host, rest = loc[1:end], loc[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"malformed address {full!r}: unexpected {rest!r} after the host; {fix}")
        port_s = rest[1:] if rest else ""
    elif loc.count(":") > 1:
        raise ValueError(f"malformed address {full!r}: write IPv6 hosts in brackets, e.g. mpi://[::1]:8786")
    else:
        host, _, port_s = loc.partition(":")
    if use == "connect" and not host:
        raise ValueError(f"malformed address {full!r}: no host; {fix}")
    if use != "listen" and not port_s:
        raise ValueError(f"malformed address {full!r}: no port; {fix}")
    if port_s:
        if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
            raise ValueError(f"malformed address {full!r}: port {port_s!r} is not a number in 0-65535; {fix}")
        port = int(port_s)
    else:
        port = 0
    if use == "connect" and port == 0:
        raise ValueError(f"malformed address {full!r}: cannot connect to port 0; {fix}")
    return host, port


# --------------------------------------------------------------------------------------------
# Process-wide MPI resources: tags, proofs, and what is left at exit


class _Tags:
    """Hands out per-connection receive tag pairs from the upper half of the MPI tag space.

    The lowest tag of that half carries proofs (see the handshake); tags are never reused within
    a process, so a late message for a closed connection can never reach a newer one.
    """

    def __init__(self, tag_ub: int):
        self.proof = tag_ub // 2
        self._first = self.proof + 1
        self._pairs = (tag_ub - self._first) // 2
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def allocate(self) -> int:
        """A header tag; the data tag is the next one."""
        with self._lock:
            n = next(self._counter)
        if n >= self._pairs:
            raise FatalCommClosedError(f"mpi4dask: this process has used all {self._pairs} MPI tag pairs")
        return self._first + 2 * n


_PROOF = struct.Struct("<16sI")  # the peer's nonce, the sender's receive tag for the connection


class _Proofs:
    """MPI messages on the proof tag: "I am rank <source>, you sent me nonce N, send to my tag T"."""

    KEEP = 4096  # proofs received and not (yet) claimed by a handshake, kept at most

    def __init__(self, w, tag: int):
        self.w = w
        self.tag = tag
        self._got: collections.OrderedDict[tuple[int, bytes], int] = collections.OrderedDict()
        self._to_self: list = []  # (request, buffer) of proofs sent to this process, until received
        self._lock = threading.Lock()

    async def send(self, dest: int, nonce: bytes, tag: int) -> None:
        """Send a proof (16 bytes of the peer's nonce, our receive tag) to world rank ``dest``.

        Returns once the message has left (eager: at once, unless MPI's queues are full), so a
        socket message sent next cannot overtake it; a proof to this very process completes only
        when it is received, on this process's own side of the handshake.
        """
        buf = _PROOF.pack(nonce, tag)
        req = self.w.comm.Isend([buf, self.w.MPI.BYTE], dest, self.tag)
        if dest == self.w.rank:
            with self._lock:
                self._to_self = [(r, b) for r, b in self._to_self if not r.Test()] + [(req, buf)]
            return
        async for _ in _backoff(1e-4, 0.01):
            if req.Test():
                return

    def release(self) -> int:
        """At exit: receive what has arrived (return how many), free proof sends to this process
        that nobody took."""
        n = self.collect()
        with self._lock:
            for r, _ in self._to_self:
                if not r.Test():
                    r.Free()
            self._to_self = []
        return n

    def collect(self) -> int:
        """Receive every proof that has arrived, from any rank; return how many."""
        MPI, comm = self.w.MPI, self.w.comm
        status = MPI.Status()
        n = 0
        with self._lock:
            while True:
                m = comm.Improbe(MPI.ANY_SOURCE, self.tag, status)
                if m is None:
                    return n
                n += 1
                buf = bytearray(status.Get_count(MPI.BYTE))
                m.Recv([buf, MPI.BYTE])
                if len(buf) != _PROOF.size:
                    logger.warning("mpi4dask: dropped a malformed proof message from rank %d", status.Get_source())
                    continue
                nonce, tag = _PROOF.unpack(buf)
                self._got[(status.Get_source(), nonce)] = tag
                while len(self._got) > self.KEEP:
                    self._got.popitem(last=False)

    async def take(self, source: int, nonce: bytes, timeout: float) -> int | None:
        """The receive tag that rank ``source`` proved with ``nonce``, or None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        async for _ in _backoff(1e-4, 0.01):
            self.collect()
            with self._lock:
                tag = self._got.pop((source, nonce), None)
            if tag is not None or time.monotonic() > deadline:
                return tag


async def _backoff(first: float, most: float):
    """Yield at once, then after each of :func:`mpi4dask._mpi.delays` (for awaiting MPI)."""
    yield
    for delay in _mpi.delays(first, most):
        await asyncio.sleep(delay)
        yield


class _Endpoint:
    """This process's MPI resources for the transport (one per process, made once MPI is up)."""

    def __init__(self, w):
        self.w = w
        self.tags = _Tags(w.tag_ub)
        self.proofs = _Proofs(w, self.tags.proof)
        # (peer rank, receive tag) of closed MPI connections: messages the peer sent after we
        # stopped listening are received and dropped, so none is left in MPI's queues at exit
        self.closed_tags: collections.OrderedDict[tuple[int, int], float] = collections.OrderedDict()
        self.comms: weakref.WeakSet[MPIComm] = weakref.WeakSet()  # open MPI-mode comms
        self.other_ranks = False  # an MPI-mode comm with another process was made
        self.graves: weakref.WeakSet[_Graveyard] = weakref.WeakSet()
        atexit.register(self.release_at_exit)  # after mpi4py's MPI_Finalize hook: runs before it

    CLOSED_TAGS_MAX = 100_000
    EXIT_WAIT = 1.0  # seconds, in all, that requests left at exit get to finish before they are freed
    # At exit, peers may still be sending to this process until they notice its sockets close; a
    # message that arrives after the last drain is unmatched at MPI_Finalize, which then fails, and
    # hydra kills the whole job.  So the drain goes on until nothing came for EXIT_QUIET seconds.
    EXIT_QUIET = 0.25
    EXIT_DRAIN_MAX = 3.0
    RECENT = 30.0  # seconds: connections closed this recently may still receive late messages

    def closed(self, peer: int, tag: int) -> None:
        self.closed_tags[(peer, tag)] = time.monotonic()
        self.closed_tags.move_to_end((peer, tag))
        while len(self.closed_tags) > self.CLOSED_TAGS_MAX:
            self.closed_tags.popitem(last=False)

    def drop_stale_messages(self, since: float = 0.0) -> int:
        """Receive and discard what peers sent to connections closed at or after ``since``
        (monotonic time), and unclaimed proofs; return how many messages that was."""
        MPI, comm = self.w.MPI, self.w.comm
        status = MPI.Status()
        n = 0
        for (peer, tag), when in reversed(list(self.closed_tags.items())):  # newest first
            if when < since:
                break
            for t in (tag, tag + 1):
                while (m := comm.Improbe(peer, t, status)) is not None:
                    m.Irecv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE]).Wait()
                    n += 1
        return n + self.proofs.release()

    def release_at_exit(self) -> None:
        """Leave nothing of ours in MPI before ``MPI_Finalize``: no request pending, no message unmatched."""
        if self.w.MPI.Is_finalized():
            return
        try:
            for c in list(self.comms):
                c._fail_pending(at_exit=True)
            deadline = time.monotonic() + self.EXIT_WAIT
            for g in list(self.graves):
                g.release(deadline)
            self.drop_stale_messages()
            if self.other_ranks:
                start = quiet = time.monotonic()
                recent = start - self.RECENT
                while True:
                    now = time.monotonic()
                    if now - quiet >= self.EXIT_QUIET or now - start >= self.EXIT_DRAIN_MAX:
                        break
                    time.sleep(0.005)
                    if self.drop_stale_messages(since=recent):
                        quiet = time.monotonic()
        except Exception:  # noqa: BLE001 - exit goes on; MPI_Finalize reports what is left
            logger.debug("mpi4dask: releasing MPI state at exit failed", exc_info=True)


_endpoint: _Endpoint | None = None
_warned_slow_init = False
_warned_socket_fallback = False
INIT_WARN_AFTER = 5.0  # seconds of waiting for MPI_Init before saying why in the log


async def _get_endpoint(timeout: float) -> _Endpoint:
    """This process's endpoint, waiting (without blocking the loop) for MPI_Init to complete."""
    global _endpoint, _warned_slow_init
    if _endpoint is not None:
        return _endpoint
    fut = asyncio.wrap_future(_mpi.start())
    done, _ = await asyncio.wait({fut}, timeout=min(INIT_WARN_AFTER, timeout))
    if not done:
        if not _warned_slow_init:
            _warned_slow_init = True
            logger.warning(
                "mpi4dask: still waiting for MPI_Init after %.0f s. Under mpiexec it returns only once every "
                "rank of the job has initialised MPI: each rank must use mpi:// (or initialise MPI) for the "
                "others to go on.",
                INIT_WARN_AFTER,
            )
        done, _ = await asyncio.wait({fut}, timeout=max(timeout - INIT_WARN_AFTER, 0))
        if not done:
            raise OSError(
                f"mpi4dask: MPI_Init did not complete within {timeout:.0f} s (under mpiexec it waits for every "
                "rank of the job to initialise MPI)"
            )
    w = fut.result()  # MPIUnavailableError when MPI is broken
    with _mpi._lock:
        if _endpoint is None:
            _endpoint = _Endpoint(w)
    return _endpoint


def _connect_timeout() -> float:
    return dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "seconds")


# --------------------------------------------------------------------------------------------
# Receive buffers


class _BufferPool:
    """Reuses large receive buffers once nothing references them any more.

    Fresh memory costs the kernel a page fault and a zeroed page per 4 KiB (or 2 MiB) on first
    touch: a third of the time of a 64 MiB transfer.  A buffer is handed out again only when the
    pool holds its sole reference, so a frame that a deserialized object still uses is never reused.
    """

    MIN_SIZE = 1 << 20
    MAX_BYTES = 512 << 20  # kept while idle, over all sizes

    def __init__(self):
        self._free: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # event loops of several threads share the pool

    @staticmethod
    def size_class(size: int) -> int:
        """Round up to 4 classes per power of two (at most 25% unused), so similar sizes share buffers."""
        step = (1 << (size.bit_length() - 1)) >> 2
        return -(-size // step) * step

    def take(self, size: int) -> memoryview:
        if size < self.MIN_SIZE:
            return host_array(size)
        cls = self.size_class(size)
        with self._lock:
            for arr in self._free.get(cls, ()):
                if sys.getrefcount(arr) <= 3:  # the pool's list, the loop variable, the call's argument
                    self._free.move_to_end(cls)
                    return arr.data[:size]
            # a new size: first let go of idle buffers of other sizes (the working set has moved on)
            for other in [k for k in self._free if k != cls]:
                keep = []
                for arr in self._free[other]:
                    if sys.getrefcount(arr) <= 3:  # idle, as above
                        self._bytes -= arr.nbytes
                    else:
                        keep.append(arr)
                if keep:
                    self._free[other] = keep
                else:
                    del self._free[other]
            arr = np.empty(cls, dtype=np.uint8)
            self._free.setdefault(cls, []).append(arr)
            self._free.move_to_end(cls)
            self._bytes += cls
            while self._bytes > self.MAX_BYTES and len(self._free) > 1:
                _, evicted = self._free.popitem(last=False)  # the least recently used size class
                self._bytes -= sum(a.nbytes for a in evicted)
            return arr.data[:size]


_pool = _BufferPool()


# --------------------------------------------------------------------------------------------
# The TCP control channel


_scratch = threading.local()  # each event loop thread's receive buffer for its sockets


def _scratch_buffer() -> bytearray:
    # asyncio calls get_buffer() and buffer_updated() back to back on the loop's thread, so every
    # socket of that loop can share one buffer: a connection costs no buffer of its own
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = bytearray(1 << 16)
    return buf


class _Channel(asyncio.BufferedProtocol):
    """The socket of one connection: handshake messages, then doorbells (or whole messages)."""

    def __init__(self, on_made=None):
        self.transport: asyncio.Transport | None = None
        self._on_made = on_made
        self._pending = bytearray()
        self._sink: memoryview | None = None  # direct receive target (socket mode frames)
        self._sink_pos = 0
        self._hs_waiter: asyncio.Future | None = None
        self._owner: weakref.ref[MPIComm] | None = None  # weak: a comm dropped without close() is collected
        self.lost = False
        self.lost_exc: BaseException | None = None
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future] = []

    # asyncio callbacks
    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        if self._on_made is not None:
            self._on_made(self)

    @property
    def owner(self) -> MPIComm | None:
        return None if self._owner is None else self._owner()

    @owner.setter
    def owner(self, comm: MPIComm) -> None:
        self._owner = weakref.ref(comm)

    def get_buffer(self, sizehint):
        if self._sink is not None:
            return self._sink[self._sink_pos :]
        return _scratch_buffer()

    def buffer_updated(self, nbytes):
        if self._sink is not None:
            self._sink_pos += nbytes
            if self._sink_pos == len(self._sink):
                self._sink = None
                owner = self.owner
                if owner is not None:
                    owner._on_control()
            return
        self._pending += memoryview(_scratch_buffer())[:nbytes]
        self._dispatch()

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc):
        self.lost = True
        self.lost_exc = exc
        w, self._hs_waiter = self._hs_waiter, None
        if w is not None and not w.done():
            w.set_exception(CommClosedError(f"connection closed during the mpi4dask handshake: {exc}"))
        for f in self._drain_waiters:
            if not f.done():
                f.set_result(None)
        self._drain_waiters.clear()
        owner = self.owner
        if owner is not None:
            owner._on_lost()

    def pause_writing(self):
        self._write_paused = True

    def resume_writing(self):
        self._write_paused = False
        for f in self._drain_waiters:
            if not f.done():
                f.set_result(None)
        self._drain_waiters.clear()

    # our side
    def _dispatch(self):
        owner = self.owner
        if owner is not None:
            owner._on_control()
        elif self._owner is not None:  # its comm was dropped without close(): its finalizer closes us
            self._pending.clear()
        elif self._hs_waiter is not None:
            msg = self._pop_handshake()
            if msg is not None:
                w, self._hs_waiter = self._hs_waiter, None
                if not w.done():
                    w.set_result(msg)

    def _pop_handshake(self):
        if len(self._pending) < _HS_LEN.size:
            return None
        (n,) = _HS_LEN.unpack_from(self._pending)
        if n > HANDSHAKE_MAX:
            return FatalCommClosedError(
                f"peer is not an mpi4dask endpoint (it announced a handshake message of {n} bytes)"
            )
        if len(self._pending) < _HS_LEN.size + n:
            return None
        raw = bytes(self._pending[_HS_LEN.size : _HS_LEN.size + n])
        del self._pending[: _HS_LEN.size + n]
        try:
            msg = json.loads(raw)
        except ValueError:
            return FatalCommClosedError("peer is not an mpi4dask endpoint (bad handshake message)")
        if not isinstance(msg, dict) or msg.get("magic") != MAGIC:
            return FatalCommClosedError("peer is not an mpi4dask endpoint (bad handshake magic)")
        return msg

    async def read_handshake(self) -> dict:
        msg = self._pop_handshake()
        if msg is None:
            if self.lost:
                raise CommClosedError(f"connection closed during the mpi4dask handshake: {self.lost_exc}")
            self._hs_waiter = asyncio.get_running_loop().create_future()
            msg = await self._hs_waiter
        if isinstance(msg, Exception):
            raise msg
        return msg

    def write_handshake(self, msg: dict) -> None:
        raw = json.dumps(msg).encode()
        self.transport.write(_HS_LEN.pack(len(raw)) + raw)

    async def drain(self):
        if self._write_paused and not self.lost:
            f = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(f)
            await f

    def set_sink(self, view: memoryview) -> None:
        """Receive the next ``len(view)`` bytes straight into ``view`` (after what is buffered)."""
        n = min(len(self._pending), len(view))
        if n:
            view[:n] = self._pending[:n]
            del self._pending[:n]
        if n < len(view):
            self._sink, self._sink_pos = view, n
        # else: filled from the buffer; the caller goes on


# --------------------------------------------------------------------------------------------
# MPI transfers in flight


class _OutMessage:
    """Send requests of one written message; keeps its buffers alive until MPI is done with them."""

    __slots__ = ("reqs", "keep", "done")

    def __init__(self, reqs, keep):
        self.reqs = reqs
        self.keep = keep
        self.done = False

    def test(self, MPI) -> bool:
        if not self.done and MPI.Request.Testall(self.reqs):
            self.done = True
            self.keep = None
        return self.done


class _InMessage:
    """One incoming message: its header receive, then its data receives."""

    __slots__ = ("hbuf", "hreq", "frames", "reqs", "nbytes", "fast")

    def __init__(self, hbuf, hreq):
        self.fast = False
        self.hbuf = hbuf
        self.hreq = hreq
        self.frames = None
        self.reqs = None
        self.nbytes = len(hbuf)


class _Graveyard:
    """Requests of aborted connections: tested until MPI lets go of their buffers."""

    def __init__(self, MPI, reqs, keep):
        self.MPI = MPI
        self.reqs = reqs
        self.keep = keep
        self.nbytes = 0

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
# Bounds on what a peer may make this process do


def _max_message_bytes() -> int:
    """The largest message a peer may announce: one that could not fit in memory is refused."""
    from distributed.system import MEMORY_LIMIT

    return int(MEMORY_LIMIT)


def _stall_timeout() -> float:
    return dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.tcp"), "seconds")


def _close_dangling(loop, ch: _Channel, desc: str, ep: _Endpoint, peer_rank: int, recv_tag: int | None) -> None:
    """Finalizer of a comm collected without ``close()``: close its socket, forget its tags."""
    if ch.transport is not None and not ch.lost:
        logger.warning("mpi4dask: closing dangling comm %s", desc)
        try:
            loop.call_soon_threadsafe(ch.transport.abort)  # the collector may run on any thread
        except RuntimeError:  # the loop is closed, and so are its sockets
            pass
    if recv_tag is not None:
        ep.closed(peer_rank, recv_tag)


# --------------------------------------------------------------------------------------------
# The Comm


class MPIComm(Comm):
    """An established ``mpi://`` connection (payload over MPI, or over its socket as a fallback)."""

    def __init__(self, channel: _Channel, local_addr: str, peer_addr: str, deserialize: bool, *, use_mpi: bool,
                 endpoint: _Endpoint, peer_rank: int, send_tag: int = -1, recv_tag: int = -1):
        self._closed = False
        super().__init__(deserialize=deserialize)
        self._ch = channel
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._use_mpi = use_mpi
        self._ep = endpoint
        self._w = world = endpoint.w
        self._peer_rank = peer_rank
        self._send_tag = send_tag
        self._recv_tag = recv_tag
        self._loop = asyncio.get_running_loop()
        self._progress = _progress.for_loop(self._loop)
        self._peer_bye = False  # the peer closed gracefully: what it announced will still arrive
        self._peer_gone = False  # the socket is gone
        self._inbox: collections.deque = collections.deque()
        self._readers: collections.deque[asyncio.Future] = collections.deque()
        # MPI mode, receiving
        self._announced = 0
        self._probed = 0
        self._incoming: collections.deque[_InMessage] = collections.deque()
        self._in_progress = False  # registered with Progress
        self._status = world.MPI.Status() if use_mpi else None
        self._last_write = 0.0
        self._last_write_nbytes = 0
        self._spinning = False  # a _ReplySpin is registered
        self.nbytes = 0  # Pollable protocol (bytes in flight towards us)
        # MPI mode, sending
        self._outgoing: collections.deque[_OutMessage] = collections.deque()
        self._out_progress = False
        # socket mode, receiving
        self._sock_frames = None
        self._sock_index = 0
        self._sock_stall: asyncio.TimerHandle | None = None
        self._extra: dict = {}
        channel.owner = self
        if use_mpi:
            endpoint.comms.add(self)
            endpoint.other_ranks |= peer_rank != world.rank
        # like distributed's TCP comm: a comm dropped without close() closes its socket when collected
        self._finalizer = weakref.finalize(
            self, _close_dangling, self._loop, channel, repr(self), endpoint, peer_rank, recv_tag if use_mpi else None
        )
        self._finalizer.atexit = False
        if channel.lost:
            self._on_lost()
        elif channel._pending:
            self._on_control()

    def __repr__(self):
        mode = "mpi" if self._use_mpi else "socket"
        state = "closed" if self.closed() else "open"
        return f"<MPIComm {self._local_addr} -> {self._peer_addr} ({mode}, {state})>"

    # -- properties of the contract
    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def extra_info(self):
        return self._extra

    @property
    def uses_mpi(self) -> bool:
        """True when this connection's payloads travel over MPI point-to-point."""
        return self._use_mpi

    def closed(self) -> bool:
        # closed by this side (close(), abort(), a failed read or write), or the peer's socket is
        # gone (as distributed's TCP comm notices) -- after a goodbye, once every message the peer
        # sent has been read: until then it is still read, and writes are dropped
        if self._closed:
            return True
        return self._peer_gone and (not self._peer_bye or not (self._inbox or self._in_flight()))

    def _in_flight(self) -> bool:
        """Messages announced by the peer and not yet delivered to the inbox."""
        return bool(self._incoming or self._probed < self._announced or self._sock_frames is not None)

    # -- errors: the one place where a failure becomes the caller's exception
    def _failed(self, exc: BaseException) -> BaseException:
        """Abort the connection after ``exc`` (as distributed's TCP comm does: what was sent or
        received is unknown, so the connection cannot be used any more) and map it for the caller."""
        self.abort()
        if isinstance(exc, CommClosedError):
            return exc
        if isinstance(exc, EOFError):
            return CommClosedError(f"{self!r}: truncated message")
        if isinstance(exc, self._w.MPI.Exception):
            return CommClosedError(f"{self!r}: MPI error ({exc})")
        if isinstance(exc, OSError):
            return CommClosedError(f"{self!r}: {type(exc).__name__}: {exc}")
        return exc  # not a connection problem (serialisation, cancellation): the caller sees it as it is

    # -- reading
    async def read(self, deserializers=None):
        try:
            frames, fast = await self._receive()
        except BaseException as exc:
            raise self._failed(exc) from (None if isinstance(exc, CommClosedError) else exc)
        try:
            if fast and self.deserialize:
                return _wire.loads(frames, deserializers)  # zero-copy unpickling: nothing to offload
            return await from_frames(
                frames, deserialize=self.deserialize, deserializers=deserializers, allow_offload=self.allow_offload
            )
        except EOFError as exc:
            raise self._failed(exc) from exc
        # other decoding errors leave the connection usable: the whole message was taken in

    async def _receive(self):
        """The frames of the next message (and whether they come from :func:`_wire.dumps`)."""
        if not self._inbox and self._use_mpi and not self._spinning:
            if time.perf_counter() - self._last_write < REPLY_SPIN_AFTER_WRITE and not self._closed:
                # a reply is probably on its way: watch MPI for it instead of sleeping until its doorbell
                self._spinning = True
                self._progress.add(_ReplySpin(self))
        while not self._inbox:
            self._raise_if_unreadable()
            fut = self._loop.create_future()
            self._readers.append(fut)
            try:
                await fut
            finally:
                try:
                    self._readers.remove(fut)
                except ValueError:
                    pass
        return self._inbox.popleft()

    def _raise_if_unreadable(self):
        if self._closed:
            raise CommClosedError(f"{self!r} is closed")
        if self._peer_gone or self._peer_bye:
            if not self._in_flight():
                raise CommClosedError(f"{self!r}: the peer closed the connection")
            if self._peer_gone and not self._peer_bye:
                raise CommClosedError(f"{self!r}: the peer went away (connection lost)")

    def _wake_readers(self, exc: BaseException | None = None):
        for f in list(self._readers):
            if not f.done():
                if exc is None:
                    f.set_result(None)
                else:
                    f.set_exception(exc)
        self._readers.clear()

    def _deliver(self, frames, fast=False):
        self._inbox.append((frames, fast))
        self._wake_readers()

    # -- writing
    async def write(self, msg, serializers=None, on_error="message"):
        try:
            return await self._write(msg, serializers, on_error)
        except BaseException as exc:
            raise self._failed(exc) from (None if isinstance(exc, CommClosedError) else exc)

    def _writable(self) -> bool:
        """False: the peer said goodbye, and the message is dropped (as a TCP socket whose peer
        has shut down accepts writes; distributed's last messages of a shutdown go this way,
        without a traceback); raises once this side closed the comm (``close()``, ``abort()``, a
        failed read or write) or the peer went away without a goodbye."""
        if self._closed or (self._peer_gone and not self._peer_bye):
            raise CommClosedError(f"{self!r}: cannot write, the connection is closed")
        return not self._peer_bye

    async def _write(self, msg, serializers, on_error):
        if not self._writable():
            return 0
        frames = None
        if self._use_mpi and (serializers is None or "pickle" in serializers):
            opts = self.handshake_options
            if not opts.get("compression") and opts.get("pickle-protocol", 5) >= 5:
                frames = _wire.dumps(msg)
        fast = frames is not None
        if not fast:
            frames = await to_frames(
                msg,
                allow_offload=self.allow_offload,
                serializers=serializers,
                on_error=on_error,
                context={"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options},
            )
        if not self._writable():
            return 0
        views = [ensure_memoryview(f) for f in frames]
        total = sum(v.nbytes for v in views)
        if self._use_mpi:
            self._send_mpi(views, total, fast)
        else:
            t = self._ch.transport
            header = _FRAMES + _U32.pack(len(views)) + struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
            t.write(header)
            for v in views:
                if v.nbytes:
                    t.write(v)
            await self._ch.drain()
            if self._ch.lost:
                raise CommClosedError(f"{self!r}: the peer went away while writing")
        return total

    def _send_mpi(self, views, total: int, fast: bool):
        self._last_write = time.perf_counter()
        self._last_write_nbytes = total
        w = self._w
        MPI = w.MPI
        comm = w.comm
        n = len(views)
        inline = bytearray(n)
        inline_total = 0
        for i, v in enumerate(views):
            if v.nbytes <= INLINE_MAX and inline_total + v.nbytes <= INLINE_TOTAL_MAX:
                inline[i] = 1
                inline_total += v.nbytes
        header = b"".join(
            [_U32.pack(n | _FAST if fast else n), struct.pack(f"<{n}Q", *(v.nbytes for v in views)), bytes(inline)]
            + [v for i, v in enumerate(views) if inline[i] and v.nbytes]
        )
        dest, tag = self._peer_rank, self._send_tag
        reqs = [comm.Isend([header, MPI.BYTE], dest, tag)]
        for i, v in enumerate(views):
            if inline[i]:
                continue
            for start in range(0, v.nbytes, MAX_CHUNK):
                reqs.append(comm.Isend([v[start : start + MAX_CHUNK], MPI.BYTE], dest, tag + 1))
        self._ch.transport.write(_DOORBELL)
        out = _OutMessage(reqs, (header, views))
        if not out.test(MPI):
            self._outgoing.append(out)
            if not self._out_progress:
                self._out_progress = True
                self._progress.add(_OutPoller(self))
            else:
                self._progress.kick()  # sends get no byte-sized spin (see _OutPoller)

    def _poll_outgoing(self) -> bool:
        MPI = self._w.MPI
        q = self._outgoing
        if not all([m.test(MPI) for m in q]):  # test every message: later ones may finish first
            self._outgoing = collections.deque(m for m in q if not m.done)
        else:
            q.clear()
        if not self._outgoing:
            self._out_progress = False
            return False
        return True

    # -- the control channel
    def _on_control(self):
        ch = self._ch
        buf = ch._pending
        if self._use_mpi:
            if not buf:
                return
            data = bytes(buf)
            buf.clear()
            bells = data.count(_DOORBELL)
            if _BYE in data:
                self._peer_bye = True
            if _ACK in data and self._outgoing:
                # the peer has our data: test the sends now instead of waiting for a timer
                if self._poll_outgoing():
                    self._progress.kick()
            if bells:
                self._announced += bells
                if self._advance_incoming():
                    self._watch_incoming()
            if self._peer_bye:
                self._wake_readers()
            return
        # socket mode: parse whole messages
        while True:
            if self._sock_frames is not None:
                if not self._fill_socket_frames():
                    return
                continue
            if not buf:
                return
            kind = buf[:1]
            if kind == _BYE:
                del buf[:1]
                self._peer_bye = True
                self._wake_readers()
                continue
            if kind != _FRAMES:
                logger.error("mpi4dask: %r received garbage on its socket; aborting it", self)
                self.abort()
                return
            if len(buf) < 1 + _U32.size:
                return
            (n,) = _U32.unpack_from(buf, 1)
            if not self._announcement_ok(n, ()):
                return
            need = 1 + _U32.size + 8 * n
            if len(buf) < need:
                return
            sizes = struct.unpack_from(f"<{n}Q", buf, 1 + _U32.size)
            del buf[:need]
            if not self._announcement_ok(n, sizes):
                return
            self._sock_frames = [host_array(s) for s in sizes]
            self._sock_index = 0
            self._watch_stall(None)

    def _announcement_ok(self, n: int, sizes) -> bool:
        """Check what a peer announces before anything is allocated for it; abort if it is too much."""
        total = sum(sizes)
        if n <= MAX_FRAMES and total <= _max_message_bytes():
            return True
        logger.error(
            "mpi4dask: %r: the peer announced a message of %d frames and %d bytes, more than this process "
            "accepts (%d frames, %d bytes: the machine's memory); closing the connection",
            self, n, total, MAX_FRAMES, _max_message_bytes(),
        )
        self.abort()
        return False

    def _watch_stall(self, seen):
        """Abort a socket message whose bytes stop coming for ``distributed.comm.timeouts.tcp``."""
        self._sock_stall = None
        if self._sock_frames is None or self._closed:
            return
        now = (self._sock_index, self._ch._sink_pos)
        if now == seen:
            logger.error("mpi4dask: %r: no byte of the message in progress for %.0f s; closing the connection",
                         self, _stall_timeout())
            self.abort()
            return
        self._sock_stall = self._loop.call_later(_stall_timeout(), self._watch_stall, now)

    def _fill_socket_frames(self) -> bool:
        """Route socket bytes into the frames of the current message; True when it is complete."""
        ch = self._ch
        while self._sock_index < len(self._sock_frames):
            if ch._sink is not None:
                return False
            frame = self._sock_frames[self._sock_index]
            self._sock_index += 1
            if len(frame):
                ch.set_sink(frame)
        if ch._sink is not None:
            return False
        frames, self._sock_frames = self._sock_frames, None
        if self._sock_stall is not None:
            self._sock_stall.cancel()
            self._sock_stall = None
        self._deliver(frames)
        return True

    # -- MPI receiving
    def _advance_incoming(self) -> bool:
        """Probe announced headers, post data receives in order, deliver finished messages."""
        w = self._w
        MPI = w.MPI
        comm = w.comm
        status = self._status
        while True:  # headers may arrive before their doorbell (see _ReplySpin): take all there are
            m = comm.Improbe(self._peer_rank, self._recv_tag, status)
            if m is None:
                break
            hbuf = bytearray(status.Get_count(MPI.BYTE))
            self._incoming.append(_InMessage(hbuf, m.Irecv([hbuf, MPI.BYTE])))
            self._probed += 1
        nbytes = 0
        for im in self._incoming:
            if im.frames is None:
                if not im.hreq.Test():
                    break  # data receives must be posted in header order
                self._post_data(im)
            nbytes += im.nbytes
        q = self._incoming
        while q and q[0].frames is not None and MPI.Request.Testall(q[0].reqs):
            im = q.popleft()
            if im.reqs and not self._peer_gone:
                self._ch.transport.write(_ACK)  # its large frames came by rendezvous: tell the sender
            self._deliver(im.frames, im.fast)
        self.nbytes = nbytes
        return bool(q) or self._probed < self._announced

    def _watch_incoming(self):
        if not self._in_progress:
            self._in_progress = True
            self._progress.add(self)
        else:
            self._progress.kick(self.nbytes)

    def _post_data(self, im: _InMessage):
        MPI = self._w.MPI
        comm = self._w.comm
        hbuf = memoryview(im.hbuf)
        (n,) = _U32.unpack_from(hbuf)
        im.fast = bool(n & _FAST)
        n &= ~_FAST
        sizes = struct.unpack_from(f"<{n}Q", hbuf, _U32.size)
        pos = _U32.size + 8 * n
        inline = hbuf[pos : pos + n]
        pos += n
        frames = []
        reqs = []
        src, tag = self._peer_rank, self._recv_tag + 1
        for i, size in enumerate(sizes):
            if inline[i]:
                # a buffer of its own, as distributed gives every frame: objects of one message
                # never share memory (nor keep the whole header message alive)
                frame = host_array(size)
                frame[:] = hbuf[pos : pos + size]
                frames.append(frame)
                pos += size
            else:
                buf = _pool.take(size)
                for start in range(0, size, MAX_CHUNK):
                    reqs.append(comm.Irecv([buf[start : start + MAX_CHUNK], MPI.BYTE], src, tag))
                frames.append(buf)
        im.frames = frames
        im.reqs = reqs
        im.nbytes = sum(s for i, s in enumerate(sizes) if not inline[i])
        im.hbuf = None
        im.hreq = None

    def poll(self) -> bool:  # Pollable: the receiving side
        if self._closed or (self._peer_gone and not self._peer_bye):
            self._in_progress = False
            return False
        active = self._advance_incoming()
        if not active:
            self._in_progress = False
            if self._peer_bye:
                self._wake_readers()
        return active

    # -- closing
    def _on_lost(self):
        if self._peer_gone:
            return
        self._peer_gone = True
        if self._closed:
            return
        if self._peer_bye:
            # graceful: everything announced was sent completely; let it arrive, then readers fail
            if self._use_mpi and self._advance_incoming():
                self._watch_incoming()
            self._wake_readers()
            return
        self._fail_pending()
        self._wake_readers()

    def _fail_pending(self, at_exit: bool = False):
        """Stop all MPI work of this connection (it is closed or its peer is gone)."""
        if not self._use_mpi:
            self._sock_frames = None
            if self._sock_stall is not None:
                self._sock_stall.cancel()
                self._sock_stall = None
            return
        MPI = self._w.MPI
        self._ep.closed(self._peer_rank, self._recv_tag)
        self._ep.comms.discard(self)
        if at_exit:  # the peer learns at once that nothing more will be read here
            sock = self._ch.transport.get_extra_info("socket") if self._ch.transport is not None else None
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        reqs, keep = [], []
        for im in self._incoming:
            for r in [im.hreq] if im.frames is None else im.reqs:
                if r is not None:
                    try:
                        r.Cancel()
                    except Exception:
                        pass
                    reqs.append(r)
            keep.append(im)
        self._incoming.clear()
        self._announced = self._probed
        for out in self._outgoing:
            if not out.done:
                reqs.extend(out.reqs)
                keep.append(out.keep)
        self._outgoing.clear()
        if reqs and not MPI.Request.Testall(reqs):
            grave = _Graveyard(MPI, reqs, keep)
            self._ep.graves.add(grave)
            if not at_exit:  # at exit, release_at_exit releases it with the others
                self._progress.add(grave)

    async def close(self):
        if self._closed:
            return
        ch = self._ch
        if self._use_mpi and self._outgoing and not self._peer_gone:
            # flush: wait until the peer has received what we wrote
            deadline = time.monotonic() + CLOSE_FLUSH_TIMEOUT
            while self._outgoing and not self._peer_gone and time.monotonic() < deadline:
                self._poll_outgoing()
                if self._outgoing:
                    await asyncio.sleep(0.001)
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
            t = ch.transport
            if t is not None and not ch.lost:
                try:
                    t.write(_BYE)
                except Exception:
                    pass
                t.close()
            self._fail_pending()
            self._wake_readers(CommClosedError(f"{self!r} was closed"))

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        t = self._ch.transport
        if t is not None:
            t.abort()
        self._fail_pending()
        self._wake_readers(CommClosedError(f"{self!r} was aborted"))


class _ReplySpin:
    """Watches MPI for a reply for a short while after a write, so a request/response exchange
    does not pay for the event loop's sleep and wake-up on the doorbell (the doorbell still comes
    and finds the message already taken)."""

    __slots__ = ("comm", "deadline", "nbytes")

    def __init__(self, comm: MPIComm):
        self.comm = comm
        # the reply to a large message comes once the peer has taken it in: keep the loop spinning
        # (Progress sizes its window by nbytes) until then, instead of sleeping into a timer backoff
        self.nbytes = comm._last_write_nbytes
        self.deadline = time.perf_counter() + REPLY_SPIN + self.nbytes / REPLY_SPIN_RATE

    def poll(self) -> bool:
        c = self.comm
        if c._inbox or c._closed or c._peer_gone or time.perf_counter() > self.deadline:
            c._spinning = False
            return False
        if c._advance_incoming():
            c._watch_incoming()
        if c._inbox:
            c._spinning = False
            return False
        return True


class _OutPoller:
    """Progresses a comm's sends (a separate Pollable so sending and receiving back off apart)."""

    __slots__ = ("comm",)

    def __init__(self, comm: MPIComm):
        self.comm = comm

    # Sends do not need the sender's progress to move their bytes (the receiver copies them, or
    # the network does) and the receiver's ACK byte wakes the sender when they are done: so no spin
    # window sized to the bytes, which would also steal the GIL from (de)serialisation threads.
    nbytes = 0

    def poll(self) -> bool:
        c = self.comm
        if c._closed or c._peer_gone:
            c._out_progress = False
            return False
        return c._poll_outgoing()


# --------------------------------------------------------------------------------------------
# Handshake


def _hello(w, nonce: bytes, **extra) -> dict:
    return {
        "magic": MAGIC,
        "version": PROTOCOL_VERSION,
        "rank": w.rank,
        "size": w.size,
        "job": w.job_key,
        "host": w.host,
        "pid": w.pid,
        "nonce": nonce.hex(),
        **extra,
    }


def _check_hello(msg: dict, peer_addr: str) -> dict:
    """Validate a peer's hello; return it with its nonce as bytes."""
    if msg.get("version") != PROTOCOL_VERSION:
        raise FatalCommClosedError(
            f"{peer_addr} speaks mpi4dask protocol version {msg.get('version')!r}, this process speaks "
            f"{PROTOCOL_VERSION}: install the same mpi4dask version on both ends"
        )
    types = {"rank": int, "size": int, "job": str, "host": str, "pid": int, "nonce": str}
    try:
        if any(type(msg[k]) is not t for k, t in types.items()):
            raise ValueError
        nonce = bytes.fromhex(msg["nonce"])
        if len(nonce) != 16 or msg["size"] < 1:
            raise ValueError
    except (KeyError, ValueError):
        raise FatalCommClosedError(f"{peer_addr} sent a malformed mpi4dask handshake") from None
    return {**msg, "nonce": nonce}


def _same_process(w, peer: dict) -> bool:
    return peer["host"] == w.host and peer["pid"] == w.pid


def _may_share_world(w, peer: dict) -> bool:
    """Cheap checks of a peer's claims; a True still needs the proof over MPI."""
    if _same_process(w, peer):
        return peer["rank"] == w.rank
    if w.size == 1:
        return False  # a world of one holds only this process
    return (
        peer["size"] == w.size
        and peer["job"] == w.job_key
        and 0 <= peer["rank"] < w.size
        and peer["rank"] != w.rank
    )


def _proof_timeout(w, peer: dict) -> float | None:
    """How long to wait for a peer's proof; None: wait as long as the connection may take, and
    refuse the connection without it (the peer's claims were checked against a known job)."""
    known = bool(w.job_key) or _same_process(w, peer)
    return None if known else UNKNOWN_JOB_PROOF_TIMEOUT


def _valid_tag(ep: _Endpoint, tag) -> bool:
    return type(tag) is int and 0 <= tag < ep.w.tag_ub  # the data tag is tag + 1


class _Refused(FatalCommClosedError):
    """A peer claimed to be a rank of this MPI job and did not prove it."""


def _note_socket_fallback(peer_addr: str, peer: dict, w) -> None:
    global _warned_socket_fallback
    if w.size == 1 and peer["size"] == 1:
        why = "processes that were not launched together by mpiexec"
    else:
        why = (
            f"the peer is rank {peer['rank']} of an MPI world of {peer['size']} on {peer['host']}, outside this "
            f"process's world (rank {w.rank} of {w.size}); to use MPI, launch both in one mpiexec job"
        )
    if not _warned_socket_fallback:
        _warned_socket_fallback = True
        logger.info("mpi4dask: the connection with %s carries its messages over TCP: %s. (Logged once.)",
                    peer_addr, why)
    else:
        logger.debug("mpi4dask: socket fallback for %s: %s", peer_addr, why)


async def _read_verdict(ch: _Channel, peer_addr: str, key: str, allowed: tuple[str, ...]) -> str:
    value = (await ch.read_handshake()).get(key)
    if value not in allowed:
        raise FatalCommClosedError(f"{peer_addr} sent a malformed mpi4dask handshake ({key}={value!r})")
    return value


async def _client_handshake(ch: _Channel, ep: _Endpoint, local_addr: str, peer_addr: str, deserialize: bool) -> MPIComm:
    w = ep.w
    nonce = os.urandom(16)
    ch.write_handshake(_hello(w, nonce))
    peer = _check_hello(await ch.read_handshake(), peer_addr)
    if peer.get("mpi") is True and _may_share_world(w, peer):
        recv_tag = ep.tags.allocate()
        await ep.proofs.send(peer["rank"], peer["nonce"], recv_tag)
        ch.write_handshake({"magic": MAGIC, "proof": "sent"})
        if await _read_verdict(ch, peer_addr, "verdict", ("mpi", "socket")) == "mpi":
            send_tag = await ep.proofs.take(peer["rank"], nonce, _connect_timeout())
            if not _valid_tag(ep, send_tag):
                raise FatalCommClosedError(
                    f"{peer_addr} claims to be rank {peer['rank']} of this MPI job but sent no valid proof over MPI"
                )
            return MPIComm(ch, local_addr, peer_addr, deserialize, use_mpi=True, endpoint=ep,
                           peer_rank=peer["rank"], send_tag=send_tag, recv_tag=recv_tag)
    else:
        ch.write_handshake({"magic": MAGIC, "proof": "none"})
        await _read_verdict(ch, peer_addr, "verdict", ("socket",))
    _note_socket_fallback(peer_addr, peer, w)
    return MPIComm(ch, local_addr, peer_addr, deserialize, use_mpi=False, endpoint=ep, peer_rank=peer["rank"])


async def _server_handshake(ch: _Channel, ep: _Endpoint, local_addr: str, peer_addr: str, deserialize: bool,
                            accepting) -> MPIComm:
    w = ep.w
    peer = _check_hello(await ch.read_handshake(), peer_addr)
    nonce = os.urandom(16)
    candidate = _may_share_world(w, peer)
    ch.write_handshake(_hello(w, nonce, mpi=candidate))
    claim = await _read_verdict(ch, peer_addr, "proof", ("sent", "none"))
    send_tag = None
    if candidate and claim == "sent":
        timeout = _proof_timeout(w, peer)
        send_tag = await ep.proofs.take(peer["rank"], nonce, _connect_timeout() if timeout is None else timeout)
        if not _valid_tag(ep, send_tag):
            send_tag = None
            if timeout is None:
                raise _Refused(
                    f"it claims to be rank {peer['rank']} of this MPI job (pid {peer['pid']} on {peer['host']!r}) "
                    "but sent no valid proof over MPI"
                )
    if not accepting():
        raise CommClosedError("the listener was stopped during the mpi4dask handshake")
    if send_tag is not None:
        recv_tag = ep.tags.allocate()
        await ep.proofs.send(peer["rank"], peer["nonce"], recv_tag)
        ch.write_handshake({"magic": MAGIC, "verdict": "mpi"})
        return MPIComm(ch, local_addr, peer_addr, deserialize, use_mpi=True, endpoint=ep,
                       peer_rank=peer["rank"], send_tag=send_tag, recv_tag=recv_tag)
    ch.write_handshake({"magic": MAGIC, "verdict": "socket"})
    _note_socket_fallback(peer_addr, peer, w)
    return MPIComm(ch, local_addr, peer_addr, deserialize, use_mpi=False, endpoint=ep, peer_rank=peer["rank"])


def _sockname(transport, key) -> str:
    addr = transport.get_extra_info(key)
    return "mpi://" + unparse_host_port(addr[0], addr[1])


# --------------------------------------------------------------------------------------------
# Connector, Listener, Backend


class MPIConnector(Connector):
    async def connect(self, address, deserialize=True, **connection_args):
        host, port = _split_host_port(address, "connect")
        _mpi.start()  # under mpiexec MPI_Init waits for every rank: start it before anything else
        loop = asyncio.get_running_loop()
        transport, ch = await loop.create_connection(_Channel, host, port)
        try:
            ep = await _get_endpoint(_connect_timeout())
            return await _client_handshake(
                ch, ep, _sockname(transport, "sockname"), "mpi://" + unparse_host_port(host, port), deserialize
            )
        except CommClosedError as exc:
            transport.abort()
            if isinstance(exc, FatalCommClosedError):
                raise
            # the listener accepted and then dropped the connection (stopped, refused): like tcp://,
            # whose connect() fails in distributed's handshake then, this is not retried
            raise FatalCommClosedError(f"mpi://{unparse_host_port(host, port)} closed the connection: {exc}") from exc
        except BaseException:
            transport.abort()
            raise


def _bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for ``host:port``; a wildcard host listens on IPv4 and IPv6 (as tcp:// does)."""
    if host:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return [socket.create_server((host, port), family=family, backlog=backlog)]
    for attempt in range(5):
        socks = [socket.create_server(("0.0.0.0", port), family=socket.AF_INET, backlog=backlog)]
        if not socket.has_ipv6:
            return socks
        bound = socks[0].getsockname()[1]
        try:
            socks.append(socket.create_server(("::", bound), family=socket.AF_INET6, backlog=backlog))
            return socks
        except OSError as exc:
            socks[0].close()
            if port == 0 and exc.errno == errno.EADDRINUSE and attempt < 4:
                continue  # the IPv6 side of an ephemeral port is taken: pick another port
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):  # no IPv6 on this machine
                return [socket.create_server(("0.0.0.0", bound), family=socket.AF_INET, backlog=backlog)]
            raise
    raise AssertionError("unreachable")


def _listening_workers_default_host() -> str | None:
    """The ``default_host`` a listening :class:`distributed.Worker` gives tcp:// listeners only.

    ``Worker.start_unsafe`` passes ``default_host=get_ip(<scheduler host>)`` to its listener for
    tcp and tls alone, so that a worker listening on all interfaces advertises the one that
    reaches its scheduler.  An mpi:// listener made by a Worker finds it among its callers (the
    coroutine frames of ``Worker.start_unsafe`` -> ``Server.listen`` -> ``listen``) and derives the
    same host, so mpi:// workers advertise what tcp:// workers do.
    """
    from distributed import Worker
    from distributed.comm import get_address_host

    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return None
        worker = frame.f_locals.get("self")
        if isinstance(worker, Worker):
            address = getattr(worker.scheduler, "address", None)
            try:
                return get_ip(get_address_host(address)) if address else None
            except (ValueError, OSError):
                return None
        frame = frame.f_back
    return None


class MPIListener(BaseListener):
    prefix = "mpi://"

    def __init__(self, address, comm_handler, deserialize=True, allow_offload=True, default_host=None,
                 **connection_args):
        super().__init__()
        self.host, self.port = _split_host_port(address, "listen")
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        if default_host is None and not self.host:
            default_host = _listening_workers_default_host()
        self.default_host = default_host
        self._servers: list[asyncio.AbstractServer] = []
        self._sockets: list[socket.socket] = []
        self._handshaking: set[_Channel] = set()
        self._tasks: set[asyncio.Task] = set()

    async def start(self):
        # MPI_Init starts now, on its own thread: under mpiexec it completes once every rank has
        # called it, and peers may need this listener to get there (see mpi4dask._mpi)
        _mpi.start()
        if not _mpi.launched_with_peers():
            await _get_endpoint(_connect_timeout())  # local: fail early when MPI is broken
        loop = asyncio.get_running_loop()
        backlog = int(dask.config.get("distributed.comm.socket-backlog"))
        self._sockets = _bind(self.host, self.port, backlog)
        for sock in self._sockets:
            sock.setblocking(False)
            self._servers.append(await loop.create_server(lambda: _Channel(self._on_channel), sock=sock))

    def _on_channel(self, ch: _Channel):
        task = asyncio.ensure_future(self._accept(ch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, ch: _Channel):
        t = ch.transport
        peer_addr = _sockname(t, "peername")
        local_addr = _sockname(t, "sockname")
        self._handshaking.add(ch)
        try:
            timeout = _connect_timeout()
            ep = await _get_endpoint(timeout)
            comm = await asyncio.wait_for(  # a second more than the wait for a proof, which is refused
                _server_handshake(ch, ep, local_addr, peer_addr, self.deserialize, lambda: bool(self._servers)),
                timeout + 1,
            )
        except _Refused as exc:
            logger.warning("mpi4dask: refused the connection from %s: %s", peer_addr, exc)
            t.abort()
            return
        except _mpi.MPIUnavailableError as exc:
            logger.error("mpi4dask: refusing the connection from %s: %s", peer_addr, exc)
            t.abort()
            return
        except (Exception, asyncio.CancelledError) as exc:
            logger.debug("mpi4dask: handshake with %s failed: %r", peer_addr, exc)
            t.abort()
            return
        finally:
            self._handshaking.discard(ch)
        comm.allow_offload = self.allow_offload
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.info("Connection from %s closed before handshake completed", peer_addr)
            return
        await self.comm_handler(comm)

    def stop(self):
        # Like tcp://: stop accepting; a connection still in mpi4dask's own handshake is dropped (its
        # client's connect() has not returned), established ones stay (distributed's Server aborts
        # those still in its handshake itself, through abort_handshaking_comms)
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()
        for ch in list(self._handshaking):
            if ch.transport is not None:
                ch.transport.abort()

    def get_host_port(self):
        if not self._servers:
            raise ValueError("invalid operation on a non-started MPIListener")
        return self._sockets[0].getsockname()[:2]

    @property
    def listen_address(self):
        return self.prefix + unparse_host_port(*self.get_host_port())

    @property
    def contact_address(self):
        host, port = self.get_host_port()
        host = ensure_concrete_host(host, default_host=self.default_host)
        return self.prefix + unparse_host_port(host, port)


class MPIBackend(Backend):
    """``distributed`` backend for ``mpi://`` addresses (entry point ``distributed.comm.backends: mpi``)."""

    def get_connector(self):
        return MPIConnector()

    def get_listener(self, loc, handle_comm, deserialize, **connection_args):
        return MPIListener(loc, handle_comm, deserialize, **connection_args)

    # the address helpers parse as tcp:// does: port 0 and an empty (wildcard) host are addresses too
    def get_address_host(self, loc):
        return _split_host_port(loc, "address")[0]

    def get_address_host_port(self, loc):
        return _split_host_port(loc, "address")

    def resolve_address(self, loc):
        host, port = _split_host_port(loc, "address")
        return unparse_host_port(ensure_ip(host), port)

    def get_local_address_for(self, loc):
        host, _ = _split_host_port(loc, "address")
        return unparse_host_port(get_ip(ensure_ip(host)), None)
