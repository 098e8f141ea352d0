"""The socket of an ``mpi://`` connection, as an asyncio protocol (private).

:class:`_Channel` buffers what the socket brings, or fills it into a frame's buffer,
and hands every arrival to whoever reads the connection at that point: the handshake
(:mod:`mpi4dask._handshake`), then the comm that owns the channel.  It knows nothing of what the
bytes mean.
"""

from __future__ import annotations

import asyncio
import socket
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

    def connection_lost(self, exc):
        self.lost = True
        self.lost_exc = exc
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

    def write(self, data) -> None:
        """Queue bytes on the socket (dropped once it is gone: the caller learns of that elsewhere)."""
        if not self.lost and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

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
