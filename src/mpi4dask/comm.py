"""The ``mpi://`` comm backend for ``distributed``.

Addresses are ``mpi://host:port``; ``host:port`` is a real TCP listening socket.  Every connection
has two channels:

* a **TCP control socket**, used for the handshake, as the doorbell that wakes the receiving event
  loop (one byte per message, so nothing polls while idle), for the goodbye on ``close()``, and to
  notice a peer that dies (the kernel closes its sockets);
* **MPI point-to-point** on ``MPI.COMM_WORLD`` for the payload, when both ends are ranks of the same
  MPI world.  Each side allocates its own receive tags for the connection (unique within the
  process) and tells the peer in the handshake, so a connection's matching space is (peer rank,
  tag): agreed explicitly, never inferred from connection order.

A message is one MPI *header* message (frame sizes, and all small frames inline) on the
connection's header tag, then each large frame, split into chunks of at most ``MAX_CHUNK`` bytes,
on its data tag, received straight into its own buffer.  Then the doorbell byte goes over TCP.

When the ends are not in one MPI world (a notebook client connecting to an ``mpiexec`` cluster, a
Nanny-spawned worker) the connection carries whole messages over its socket instead, and this is
logged once per process.  Whether two processes share a world is decided in the handshake: equal
world size and launcher job key, then proof over MPI itself (the listener sends a random nonce
over MPI to the rank the client claims to be; the client must receive it).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import json
import logging
import os
import socket
import struct
import sys
import threading
import time

import dask
import numpy as np
from distributed.comm.addressing import unparse_host_port
from distributed.comm.core import BaseListener, CommClosedError, Comm, Connector, FatalCommClosedError
from distributed.comm.registry import Backend
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames
from distributed.protocol.utils import host_array
from distributed.utils import ensure_ip, ensure_memoryview, get_ip, get_ipv6

from . import _mpi, _progress, _wire

logger = logging.getLogger("mpi4dask")

PROTOCOL_VERSION = 1
MAGIC = "mpi4dask"
MAX_CHUNK = 1 << 30  # bytes per MPI message: stays below the 2**31 count limit of every MPI
INLINE_MAX = 16 << 10  # frames up to this size travel inside the header message
INLINE_TOTAL_MAX = 64 << 10
VERIFY_TIMEOUT = 3.0  # seconds to wait for the MPI proof of a shared world
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


def _split_host_port(loc: str, *, listening: bool) -> tuple[str, int]:
    """Parse ``host:port`` (``[v6]:port`` too).  Listeners may leave out either part."""
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
    if not listening:
        if not host:
            raise ValueError(f"malformed address {full!r}: no host; {fix}")
        if not port_s:
            raise ValueError(f"malformed address {full!r}: no port; {fix}")
    if port_s:
        if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
            raise ValueError(f"malformed address {full!r}: port {port_s!r} is not a number in 0-65535; {fix}")
        port = int(port_s)
    else:
        port = 0
    if not listening and port == 0:
        raise ValueError(f"malformed address {full!r}: cannot connect to port 0; {fix}")
    return host, port


# --------------------------------------------------------------------------------------------
# Process-wide MPI resources: tags and the nonces of world proofs


class _Tags:
    """Hands out per-connection receive tags from the upper half of the MPI tag space."""

    def __init__(self, tag_ub: int):
        self.verify = tag_ub // 2
        self._first = self.verify + 1
        self._pairs = (tag_ub - self._first) // 2
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def allocate(self) -> int:
        """A header tag; the data tag is the next one."""
        with self._lock:
            return self._first + 2 * (next(self._counter) % self._pairs)


_tags: _Tags | None = None
_received_nonces: dict[int, set[bytes]] = collections.defaultdict(set)
_nonce_lock = threading.Lock()
_warned_socket_fallback = False
# (peer rank, receive tag) of closed MPI connections: messages the peer sent after we stopped
# listening are received and dropped, so none is left in MPI's queues at MPI_Finalize.
_closed_tags: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
_CLOSED_TAGS_MAX = 100_000


def _world_and_tags():
    global _tags
    w = _mpi.world()
    if _tags is None:
        _tags = _Tags(w.tag_ub)
        atexit.register(_drop_stale_messages, w, True)
    return w, _tags


def _drop_stale_messages(w, at_exit: bool = False) -> None:
    """Receive and discard what peers sent to connections that are closed."""
    MPI = w.MPI
    status = MPI.Status()
    for peer, tag in list(_closed_tags):
        for t in (tag, tag + 1):
            while True:
                m = w.comm.Improbe(peer, t, status)
                if m is None:
                    break
                m.Irecv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE]).Wait()
        if at_exit:
            del _closed_tags[(peer, tag)]


def _collect_nonces(w, source: int, tag: int) -> None:
    """Receive every proof nonce that ``source`` has sent us (they are 16-byte eager messages)."""
    MPI = w.MPI
    while True:
        msg = w.comm.Improbe(source, tag)
        if msg is None:
            return
        buf = bytearray(16)
        msg.Recv([buf, MPI.BYTE])
        with _nonce_lock:
            seen = _received_nonces[source]
            if len(seen) > 10000:  # stale proofs from some mistaken claim; never needed again
                seen.clear()
            seen.add(bytes(buf))


async def _await_nonce(w, source: int, tag: int, nonce: bytes, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    delay = 0.0
    while True:
        _collect_nonces(w, source, tag)
        with _nonce_lock:
            if nonce in _received_nonces[source]:
                _received_nonces[source].discard(nonce)
                return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(delay)
        delay = min(max(delay * 2, 1e-4), 0.02)


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


class _Channel(asyncio.BufferedProtocol):
    """The socket of one connection: handshake messages, then doorbells (or whole messages)."""

    def __init__(self, on_made=None):
        self.transport: asyncio.Transport | None = None
        self._on_made = on_made
        self._rbuf = bytearray(1 << 16)
        self._pending = bytearray()
        self._sink: memoryview | None = None  # direct receive target (socket mode frames)
        self._sink_pos = 0
        self._hs_waiter: asyncio.Future | None = None
        self.owner: MPIComm | None = None
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

    def get_buffer(self, sizehint):
        if self._sink is not None:
            return self._sink[self._sink_pos :]
        return self._rbuf

    def buffer_updated(self, nbytes):
        if self._sink is not None:
            self._sink_pos += nbytes
            if self._sink_pos == len(self._sink):
                self._sink = None
                if self.owner is not None:
                    self.owner._sink_filled()
            return
        self._pending += memoryview(self._rbuf)[:nbytes]
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
        if self.owner is not None:
            self.owner._on_lost()

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
        if self.owner is not None:
            self.owner._on_control()
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
        if n > 1 << 20:
            return FatalCommClosedError("peer is not an mpi4dask endpoint (bad handshake length)")
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


# --------------------------------------------------------------------------------------------
# The Comm


class MPIComm(Comm):
    """An established ``mpi://`` connection (payload over MPI, or over its socket as a fallback)."""

    def __init__(self, channel: _Channel, local_addr: str, peer_addr: str, deserialize: bool, *, use_mpi: bool,
                 world, peer_rank: int, send_tag: int, recv_tag: int):
        self._closed = False
        super().__init__(deserialize=deserialize)
        self._ch = channel
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._use_mpi = use_mpi
        self._w = world
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
        self._sock_sizes = None
        self._sock_index = 0
        self._extra: dict = {}
        channel.owner = self
        if channel.lost:
            self._on_lost()
        elif channel._pending:
            self._on_control()

    def __repr__(self):
        mode = "mpi" if self._use_mpi else "socket"
        state = "closed" if self._closed else "open"
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
        # like distributed's TCP comm, a connection whose socket is gone counts as closed
        return self._closed or self._peer_gone

    # -- reading
    async def read(self, deserializers=None):
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
        frames, fast = self._inbox.popleft()
        try:
            if fast and self.deserialize:
                return _wire.loads(frames, deserializers)  # zero-copy unpickling: nothing to offload
            return await from_frames(
                frames, deserialize=self.deserialize, deserializers=deserializers, allow_offload=self.allow_offload
            )
        except EOFError:
            self.abort()
            raise CommClosedError(f"{self!r}: truncated message")

    def _raise_if_unreadable(self):
        if self._closed:
            raise CommClosedError(f"{self!r} is closed")
        if self._peer_gone or self._peer_bye:
            if not (self._incoming or self._probed < self._announced or self._sock_frames is not None):
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
        if self._closed or self._peer_gone:
            raise CommClosedError(f"{self!r}: cannot write, the connection is closed")
        if self._peer_bye:
            # The peer said goodbye and reads nothing more; like a TCP socket whose peer has shut
            # down, the write is accepted and the bytes are dropped until the connection is gone.
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
        if self._closed or self._peer_gone:
            raise CommClosedError(f"{self!r}: cannot write, the connection is closed")
        if self._peer_bye:
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
            need = 1 + _U32.size + 8 * n
            if len(buf) < need:
                return
            sizes = struct.unpack_from(f"<{n}Q", buf, 1 + _U32.size)
            del buf[:need]
            self._sock_sizes = sizes
            self._sock_frames = [host_array(s) for s in sizes]
            self._sock_index = 0

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
        self._deliver(frames)
        return True

    def _sink_filled(self):
        self._on_control()

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
                frames.append(hbuf[pos : pos + size])
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

    def _fail_pending(self):
        """Stop all MPI work of this connection (it is closed or its peer is gone)."""
        if not self._use_mpi:
            self._sock_frames = None
            return
        MPI = self._w.MPI
        _closed_tags[(self._peer_rank, self._recv_tag)] = None
        while len(_closed_tags) > _CLOSED_TAGS_MAX:
            _closed_tags.popitem(last=False)
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
            self._progress.add(_Graveyard(MPI, reqs, keep))

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


def _hello(w, recv_tag: int, **extra) -> dict:
    return {
        "magic": MAGIC,
        "version": PROTOCOL_VERSION,
        "rank": w.rank,
        "size": w.size,
        "job": w.job_key,
        "host": w.host,
        "pid": w.pid,
        "tag": recv_tag,
        **extra,
    }


def _check_hello(msg: dict, peer: str) -> None:
    if msg.get("version") != PROTOCOL_VERSION:
        raise FatalCommClosedError(
            f"{peer} speaks mpi4dask protocol version {msg.get('version')!r}, this process speaks "
            f"{PROTOCOL_VERSION}: install the same mpi4dask version on both ends"
        )


def _same_process(w, peer: dict) -> bool:
    return peer["host"] == w.host and peer["pid"] == w.pid


def _may_share_world(w, peer: dict) -> bool:
    """Cheap checks; a True still needs the MPI proof (unless it is this very process)."""
    if _same_process(w, peer):
        return True
    if w.size == 1:
        return False  # a world of one holds only this process
    return (
        peer["size"] == w.size
        and peer["job"] == w.job_key
        and 0 <= peer["rank"] < w.size
        and peer["rank"] != w.rank
    )


def _note_socket_fallback(peer_addr: str, peer: dict, w) -> None:
    global _warned_socket_fallback
    detail = (
        f"peer is rank {peer.get('rank')} of an MPI world of {peer.get('size')} on {peer.get('host')}, "
        f"this process is rank {w.rank} of {w.size}"
    )
    if not _warned_socket_fallback:
        _warned_socket_fallback = True
        logger.warning(
            "mpi4dask: %s is outside this process's MPI world (%s); messages on such connections travel "
            "over TCP. Launch all Dask processes in one mpiexec job to use MPI. (Logged once.)",
            peer_addr,
            detail,
        )
    else:
        logger.debug("mpi4dask: socket fallback for %s (%s)", peer_addr, detail)


async def _client_handshake(ch: _Channel, w, tags: _Tags, local_addr: str, peer_addr: str, deserialize: bool) -> MPIComm:
    recv_tag = tags.allocate()
    ch.write_handshake(_hello(w, recv_tag))
    peer = await ch.read_handshake()
    _check_hello(peer, peer_addr)
    use_mpi = False
    if peer.get("proof") == "self":
        use_mpi = True
    elif peer.get("proof"):
        use_mpi = await _await_nonce(w, peer["rank"], tags.verify, bytes.fromhex(peer["proof"]), VERIFY_TIMEOUT)
        ch.write_handshake({"magic": MAGIC, "verdict": "mpi" if use_mpi else "socket"})
    if not use_mpi:
        _note_socket_fallback(peer_addr, peer, w)
    return MPIComm(ch, local_addr, peer_addr, deserialize, use_mpi=use_mpi, world=w, peer_rank=peer["rank"],
                   send_tag=peer["tag"], recv_tag=recv_tag)


async def _server_handshake(ch: _Channel, w, tags: _Tags, local_addr: str, peer_addr: str, deserialize: bool) -> MPIComm:
    peer = await ch.read_handshake()
    _check_hello(peer, peer_addr)
    recv_tag = tags.allocate()
    proof = None
    keep = None
    if _same_process(w, peer):
        proof = "self"
    elif _may_share_world(w, peer):
        nonce = os.urandom(16)
        keep = (nonce, w.comm.Isend([nonce, w.MPI.BYTE], peer["rank"], tags.verify))
        proof = nonce.hex()
    ch.write_handshake(_hello(w, recv_tag, proof=proof))
    use_mpi = proof == "self"
    if proof and proof != "self":
        verdict = await ch.read_handshake()
        use_mpi = verdict.get("verdict") == "mpi"
        _, req = keep
        if not req.Test():
            _progress.for_loop().add(_Graveyard(w.MPI, [req], keep))
    if not use_mpi:
        _note_socket_fallback(peer_addr, peer, w)
    return MPIComm(ch, local_addr, peer_addr, deserialize, use_mpi=use_mpi, world=w, peer_rank=peer["rank"],
                   send_tag=peer["tag"], recv_tag=recv_tag)


def _sockname(transport, key) -> str:
    addr = transport.get_extra_info(key)
    return "mpi://" + unparse_host_port(addr[0], addr[1])


# --------------------------------------------------------------------------------------------
# Connector, Listener, Backend


class MPIConnector(Connector):
    async def connect(self, address, deserialize=True, **connection_args):
        host, port = _split_host_port(address, listening=False)
        w, tags = _world_and_tags()
        loop = asyncio.get_running_loop()
        transport, ch = await loop.create_connection(_Channel, host, port)
        try:
            return await _client_handshake(
                ch, w, tags, _sockname(transport, "sockname"), "mpi://" + unparse_host_port(host, port), deserialize
            )
        except BaseException:
            transport.abort()
            raise


class MPIListener(BaseListener):
    prefix = "mpi://"

    def __init__(self, address, comm_handler, deserialize=True, allow_offload=True, default_host=None,
                 **connection_args):
        super().__init__()
        self.host, self.port = _split_host_port(address, listening=True)
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self.default_host = default_host
        self._server: asyncio.AbstractServer | None = None
        self._handshaking: set[_Channel] = set()
        self._tasks: set[asyncio.Task] = set()

    async def start(self):
        if not _mpi.launched_with_peers():
            # a process of its own: MPI_Init is local, so check MPI now and fail early if it is broken
            _world_and_tags()
        # else MPI_Init is collective over the launched ranks (a PMI barrier): it must not run before
        # this listener is reachable, or a scheduler that peers wait for (scheduler file) deadlocks
        # with them. It runs at the first connection instead.
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        backlog = int(dask.config.get("distributed.comm.socket-backlog"))
        sock = socket.create_server((self.host, self.port), family=family, backlog=backlog, reuse_port=False)
        sock.setblocking(False)
        self._server = await loop.create_server(lambda: _Channel(self._on_channel), sock=sock)

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
            w, tags = _world_and_tags()
        except _mpi.MPIUnavailableError as exc:
            logger.error("mpi4dask: refusing connection from %s: %s", peer_addr, exc)
            t.abort()
            self._handshaking.discard(ch)
            return
        try:
            timeout = dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "seconds")
            comm = await asyncio.wait_for(
                _server_handshake(ch, w, tags, local_addr, peer_addr, self.deserialize), timeout
            )
        except (Exception, asyncio.CancelledError) as exc:
            logger.debug("mpi4dask: handshake with %s failed: %r", peer_addr, exc)
            t.abort()
            return
        finally:
            self._handshaking.discard(ch)
        if self._server is None:
            comm.abort()
            return
        comm.allow_offload = self.allow_offload
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.info("Connection from %s closed before handshake completed", peer_addr)
            return
        await self.comm_handler(comm)

    def stop(self):
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for ch in list(self._handshaking):
            if ch.transport is not None:
                ch.transport.abort()
        self.abort_handshaking_comms()

    def get_host_port(self):
        if self._server is None or not self._server.sockets:
            raise ValueError("invalid operation on a non-started MPIListener")
        return self._server.sockets[0].getsockname()[:2]

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

    def get_address_host(self, loc):
        return _split_host_port(loc, listening=False)[0]

    def get_address_host_port(self, loc):
        return _split_host_port(loc, listening=False)

    def resolve_address(self, loc):
        host, port = _split_host_port(loc, listening=False)
        return unparse_host_port(ensure_ip(host), port)

    def get_local_address_for(self, loc):
        host, port = _split_host_port(loc, listening=False)
        host = ensure_ip(host)
        local = get_ipv6(host) if ":" in host else get_ip(host)
        return unparse_host_port(local, None)
