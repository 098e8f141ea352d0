"""The socket of an ``mpi://`` connection, as an asyncio protocol (private).

:class:`_Channel` buffers what the socket brings, or fills it into a frame's buffer,
and hands every arrival to whoever reads the connection at that point: the handshake
(:mod:`mpi4dask._handshake`), then the comm that owns the channel.  It knows nothing of what the
bytes mean.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import sys
import threading
import weakref
from typing import Protocol

from distributed.comm.core import CommClosedError

_scratch = threading.local()  # each event loop thread's receive buffer for its sockets
SCRATCH_BYTES = 256 << 10  # bytes one socket read may bring (asyncio's own read size for plain protocols)
# A frame's buffer this large takes the socket's bytes straight (no copy); a smaller one is filled from
# the shared buffer.  asyncio reads a socket once per loop turn, so a message of 33 small frames read
# one frame per read took 33 loop turns, each ending in a GIL release (measured in a dask merge on 2
# workers: 130 KB of socket frames arrived 3-20 ms after their header, behind the compute thread).
DIRECT_MIN = 64 << 10
# Before Python 3.12, asyncio's socket transport copies whatever one write() leaves unsent (all of it
# while earlier bytes still wait) into a bytearray; 3.12 keeps the caller's buffer.  On those versions
# a channel hands the transport at most FEED_BYTES at a time, and the next piece only once the
# transport's buffer is empty, so at most FEED_BYTES of a large frame is ever copied (measured on
# 3.11, an mpi:// connection carrying every frame on the socket: 64 MiB one way 89 ms against
# tcp://'s 33 ms, and 34 against 32 ms on 3.13).
FEED_BYTES = 256 << 10 if sys.version_info < (3, 12) else 0


def _scratch_buffer() -> memoryview:
    # asyncio calls get_buffer() and buffer_updated() back to back on the loop's thread, so every
    # socket of that loop can share one buffer: a connection costs no buffer of its own
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = memoryview(bytearray(SCRATCH_BYTES))
    return buf


class _Owner(Protocol):
    """What a channel calls on the connection that owns it (:class:`mpi4dask.comm.SocketComm`)."""

    def _take_in(self) -> None:
        """The socket brought bytes: parse the records in ``pending``."""

    def _on_lost(self) -> None:
        """The socket is gone."""


class _Channel(asyncio.BufferedProtocol):
    """The socket of one connection: handshake messages, then the records of :mod:`mpi4dask._wire`.

    Bytes go to ``pending``, or into a frame's buffer (:meth:`set_sink`).  Until the
    connection has an owner, the handshake (:mod:`mpi4dask._handshake`) reads ``pending`` itself,
    waking at each arrival (:meth:`arrival`); then every arrival goes to the owner, whose dispatcher
    parses the records (:meth:`mpi4dask.comm.SocketComm._take_in`).
    """

    def __init__(self, on_made=None):
        self.transport: asyncio.Transport | None = None
        self._on_made = on_made
        self.pending = bytearray()
        self._sink: memoryview | None = None  # the buffer of the frame the socket's bytes go to (see set_sink)
        self._sink_pos = 0
        self._waiter: asyncio.Future | None = None  # the handshake, waiting for bytes
        self._owner: weakref.ref[_Owner] | None = None  # weak: a comm dropped without close() is collected
        self.lost = False
        self.lost_exc: BaseException | None = None
        self.reads = 0  # socket reads that brought bytes (buffer_updated calls): mpi4dask.connections()
        self._fd = -1  # the socket's, for sending a large piece straight (see _feed)
        self._out: collections.deque[memoryview] = collections.deque()  # bytes not yet handed to the transport
        self._write_paused = False  # the transport's buffer holds bytes (FEED_BYTES only: see write())
        self._close_after_out = False  # close() came while _out held bytes
        self.writes_ended = False  # end_writes(): whatever is written later is dropped

    # asyncio callbacks
    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._fd = sock.fileno()
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        if FEED_BYTES:
            transport.set_write_buffer_limits(high=0)  # pause_writing() as soon as it holds a byte
        if self._on_made is not None:
            self._on_made(self)

    @property
    def owner(self) -> _Owner | None:
        return None if self._owner is None else self._owner()

    @owner.setter
    def owner(self, comm: _Owner) -> None:
        self._owner = weakref.ref(comm)

    def get_buffer(self, sizehint):
        sink = self._sink
        if sink is not None and len(sink) - self._sink_pos >= DIRECT_MIN:
            return sink[self._sink_pos :]
        return _scratch_buffer()

    def buffer_updated(self, nbytes):
        self.reads += 1
        sink = self._sink
        if sink is not None and len(sink) - self._sink_pos >= DIRECT_MIN:  # read straight into it
            self._sink_pos += nbytes
            if self._sink_pos < len(sink):
                return
            self._sink = None
        else:
            got = _scratch_buffer()[:nbytes]
            if sink is not None:  # a small frame: its bytes first, the rest waits in pending
                n = min(nbytes, len(sink) - self._sink_pos)
                sink[self._sink_pos : self._sink_pos + n] = got[:n]
                self._sink_pos += n
                got = got[n:]
                if self._sink_pos < len(sink):
                    return
                self._sink = None
            self.pending += got
        self._dispatch()

    def eof_received(self):
        return False  # close our side too

    def pause_writing(self):
        self._write_paused = True

    def resume_writing(self):
        self._write_paused = False
        self._feed()

    def connection_lost(self, exc):
        self.lost = True
        self.lost_exc = exc
        self._out.clear()
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_exception(CommClosedError(f"connection closed during the mpi4dask handshake: {exc}"))
        owner = self.owner
        if owner is not None:
            owner._on_lost()

    # our side
    def _dispatch(self):
        owner = self.owner
        if owner is not None:
            owner._take_in()
        elif self._owner is not None:  # its comm was dropped without close(): its finalizer closes us
            self.pending.clear()
        elif self._waiter is not None:
            w, self._waiter = self._waiter, None
            if not w.done():
                w.set_result(None)

    async def arrival(self) -> None:
        """Wait for the socket's next bytes (the handshake, before the connection has an owner)."""
        if self.lost:
            raise CommClosedError(f"connection closed during the mpi4dask handshake: {self.lost_exc}")
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    def all_sent(self) -> bool:
        """Everything written so far is on the socket (none waits here or in the transport)."""
        return not self._out and (self.transport is None or self.transport.get_write_buffer_size() == 0)

    def write(self, data) -> None:
        """Queue bytes on the socket (dropped once it is gone: the caller learns of that elsewhere).
        ``data`` (bytes or a contiguous buffer) must stay unchanged until it is sent, as for MPI's sends."""
        if (self.lost or self.transport is None or self.transport.is_closing() or self._close_after_out
                or self.writes_ended):
            return
        if not FEED_BYTES:  # Python 3.12+: the transport keeps the caller's buffer
            self.transport.write(data)
            return
        v = memoryview(data)
        if not self._out and not self._write_paused and v.nbytes <= FEED_BYTES:
            self.transport.write(data)  # the transport copies at most FEED_BYTES of it
            return
        self._out.append(v if v.format == "B" and v.ndim == 1 else v.cast("B"))
        self._feed()

    def _feed(self) -> None:
        """Hand the transport the queued bytes, FEED_BYTES at a time, while its buffer is empty: each
        write() then sends at once, and only the remainder of the last piece is copied.  Small pieces
        (acknowledgements, small messages written meanwhile) are joined into one send.  A larger piece
        first goes to the socket itself, whole, as tornado's streams (distributed's tcp://) send: the kernel
        takes what its buffer holds in one call, where 256 KiB pieces cost a transport write and a send
        each (measured: a 64 MiB frame on the socket between two processes of this project's VM 21-25 ms
        one way in pieces, tcp:// 15-18 ms)."""
        out, t = self._out, self.transport
        while out and not self._write_paused:
            if t.is_closing():  # a send failed (the peer is gone): connection_lost follows
                out.clear()
                return
            v = out.popleft()
            if len(v) > FEED_BYTES and self._fd >= 0:
                try:  # (the transport's buffer is empty: not paused) -- an error is left to its own write below
                    sent = os.writev(self._fd, [v])
                except OSError:
                    sent = 0
                if sent == len(v):
                    continue
                v = v[sent:]
            if len(v) > FEED_BYTES:
                out.appendleft(v[FEED_BYTES:])
                v = v[:FEED_BYTES]
            elif out and len(v) + len(out[0]) <= FEED_BYTES:
                run = [v]
                n = len(v)
                while out and n + len(out[0]) <= FEED_BYTES:
                    n += len(out[0])
                    run.append(out.popleft())
                v = b"".join(run)
            t.write(v)  # may call pause_writing()
        if not out and self._close_after_out and not t.is_closing():
            # not from inside the transport's own write callback (resume_writing), which would then
            # report the connection lost a second time
            asyncio.get_running_loop().call_soon(t.close)

    def unsent(self) -> int:
        """Bytes written here that the kernel has not taken yet."""
        t = self.transport
        return sum(len(v) for v in self._out) + (t.get_write_buffer_size() if t is not None else 0)

    def end_writes(self) -> None:
        """Drop whatever is written from now on (the socket stays open for reading)."""
        self.writes_ended = True

    def close(self) -> None:
        """Close the socket once every queued byte is sent (as ``transport.close()`` does for its own)."""
        if self.transport is None:
            return
        if self._out and not self.lost:
            self._close_after_out = True
        else:
            self.transport.close()

    @property
    def sinking(self) -> bool:
        return self._sink is not None

    def set_sink(self, view: memoryview) -> None:
        """Receive the next ``len(view)`` bytes into ``view`` (after what is buffered): straight from the
        socket when it is ``DIRECT_MIN`` bytes or more, else through the shared read buffer, so that one
        read fills many small frames."""
        n = min(len(self.pending), len(view))
        if n:
            view[:n] = self.pending[:n]
            del self.pending[:n]
        if n < len(view):
            self._sink, self._sink_pos = view, n
        # else: filled from the buffer; the caller goes on

    def sink_position(self) -> int:
        return self._sink_pos if self._sink is not None else -1
