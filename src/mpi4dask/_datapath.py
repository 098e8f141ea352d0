"""The data path of an ``mpi://`` connection (private): how its messages move once the handshake
(:mod:`mpi4dask._handshake`) has chosen the transport.

A connection (:class:`mpi4dask.comm.SocketComm`) owns

* a :class:`_Link` when its ends share MPI: the communicator, the peer's rank in it, and the receive
  tag each side chose; without one, every frame travels on the socket;
* a :class:`_Sender`: ``write()`` queues the message and returns.  The sender posts an ``Isend`` per
  MPI message (frames of ``MPI_MIN_FRAME`` bytes or more -- of ``_wire.BULK_FRAME`` or more in a bulk
  message: :func:`mpi4dask._wire.frame_routes` --, and the shards that follow such a frame; between
  ranks of one world on one node, small neighbours joined by :func:`mpi4dask._wire.mpi_runs`: ``_Link.joins``;
  pieces of at most ``MAX_CHUNK``) and writes the header record and
  the small frames on the socket (:class:`mpi4dask._channel._Channel`) -- every frame, where MPI's copy
  needs both ends' calls and every core is taken (:meth:`_Sender.send`);
* a :class:`_Receiver`: handed each header by the connection's dispatcher
  (:meth:`mpi4dask.comm.SocketComm._take_in`, which hands acknowledgements and nudges to the sender
  and the goodbye to the comm), it posts the ``Irecv`` of each MPI message into the buffers of the frames
  it carries (a buffer per frame, with its shards, from :data:`mpi4dask._endpoint._pool`; a joined message
  is scattered into several by a derived datatype), has the socket's small frames filled into buffers of their own
  (:meth:`mpi4dask._channel._Channel.set_sink`), and puts complete messages in its inbox, in header
  order, for ``read()``.

Flow control.  MPI has no kernel window, so the writer keeps one: the MPI bytes the peer has not yet
*read* stay within ``SEND_WINDOW`` (a larger message goes alone); each ``read()`` of a message with
MPI frames sends an acknowledgement (``A``, on the reader's next write or at the end of its loop
turn) that opens the window again.  A reader that does not read pauses its socket once ``INBOX_MAX``
socket bytes wait in its inbox.  MPI moves some messages only when the *sender* calls MPI, so a
reader whose MPI frames are late (``NUDGE_AFTER`` plus the bytes' time) nudges the writer (``N``),
which then tests its sends.  MPI requests still in flight are tested by the loop's
:class:`~mpi4dask._progress.Progress`; a reader waiting for a reply also takes the reply's first MPI
message off MPI before its header arrives (:meth:`_Receiver.poll_reply`).

Stopping.  :func:`_let_go` cancels what a closed or lost connection has in flight and hands what MPI
still holds to a graveyard (:class:`~mpi4dask._endpoint._Graveyard`); :func:`_close_dangling` does so
for a comm collected without ``close()``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import weakref
from typing import Protocol

import dask
import numpy as np
from distributed.protocol.utils import host_array
from distributed.utils import ensure_memoryview

from . import _metrics, _progress, _ucx, _wire
from ._channel import _Channel
from ._endpoint import _Endpoint, _Graveyard, _pool, backoff
from ._wire import WireError

logger = logging.getLogger(__name__)

MAX_CHUNK = 1 << 30  # bytes per MPI message: stays below the 2**31 count limit of every MPI
# Frames this large go over MPI; smaller ones ride on the socket, joined to their header (_wire.JOIN_MAX, the
# same size) and, in a fast message that is all in, taken in whole (WHOLE_MAX).  Below it, the socket's one
# send and one read beat MPI's second wake-up (the Irecv posted on the header, tested on a later loop turn),
# most of all while every core is busy; measured in docs/benchmark-log.md, "Where MPI takes over".
MPI_MIN_FRAME = _wire.JOIN_MAX
SEND_WINDOW = 16 << 20  # MPI bytes a writer may have sent and its peer not yet read (one larger message goes alone)
INBOX_MAX = 8 << 20  # socket bytes taken in and not yet read, beyond which the socket is paused
WHOLE_MAX = MPI_MIN_FRAME  # a fast socket-only message up to this size that is all here is taken in whole (_take_whole)
POLL_BURST = 200e-6  # seconds a receiver's progress test may repeat within one loop turn
NUDGE_AFTER = 2e-3  # seconds (plus the bytes' time at Progress's rate) before a waiting reader nudges the writer


class _Connection(Protocol):
    """What a connection's receiver and sender use of it (:class:`mpi4dask.comm.SocketComm`)."""

    stats: dict  # what moved, for mpi4dask.connections()
    _loop: asyncio.AbstractEventLoop
    _progress: _progress.Progress  # the loop's
    _peer_bye: bool  # the peer said goodbye

    def _take_in(self) -> None:
        """Parse the records waiting on the socket (after a paused socket resumed)."""

    def _raise_if_unreadable(self) -> None:
        """Raise when no message can come any more."""

    def _fail_from_callback(self, exc: BaseException) -> None:
        """Abort the connection after a failure found outside read()/write()."""


# --------------------------------------------------------------------------------------------
# The MPI side of a connection


class _Link:
    """Where a connection's MPI frames go and come from: a communicator (``MPI.COMM_WORLD``, or the
    intercommunicator of a pair of worlds, :class:`~mpi4dask._endpoint._Pairs`), the peer's rank in it, and the tags
    that each side chose for its receives in the handshake."""

    __slots__ = ("w", "route", "comm", "peer", "send_tag", "recv_tag", "_status", "peer_pid", "joins")

    def __init__(self, ep: _Endpoint, peer: int, send_tag: int, recv_tag: int, route: int = 0, peer_pid: int = 0):
        self.w, self.peer = ep.w, peer
        self.route, self.comm = route, ep.routes[route]
        self.send_tag, self.recv_tag = send_tag, recv_tag
        self._status = ep.w.MPI.Status()  # improbe's, reused: a reply poll probes on every turn
        self.peer_pid = peer_pid  # the peer process when it runs on this node, else 0 (see mpi4dask._ucx)
        # whether a message's small MPI frames are joined into few MPI messages (_wire.mpi_runs, JOINED), which
        # the reader scatters into the frames' buffers with a derived datatype: between ranks of one world on
        # one node, where MPI's shared-memory queue takes few sends at once and scatters at no cost; else every
        # frame goes alone.  Measured (2026-11-30, a worker fetching N arrays of 256 KiB from another in one
        # transfer, medians): in an mpiexec job 16 arrays 2.1 ms either way, 160 of them 27-28 ms joined against
        # 76 ms alone; between two worlds that Dask started (UCX) 160 of them 79 ms joined and scattered by a
        # datatype (UCX unpacks it piecewise), 32 ms alone (29-31 ms joined into one shared buffer); tcp:// 48 ms.
        self.joins = route == 0 and peer_pid != 0
        _ucx.watch(peer_pid)

    def isend(self, view: memoryview) -> list:
        """The sends of one run of frames (pieces of at most ``MAX_CHUNK`` bytes).  Never to a peer that
        died while MPI copied from it: UCX has marked its endpoint failed, and MPICH's send on a failed
        endpoint crashes this process (a NULL request written to; seen in CI, reproduced by
        tests/jobs/write_to_peer_dead_mid_copy.py)."""
        self._raise_if_peer_died()
        MPI, comm = self.w.MPI, self.comm
        return [
            comm.Isend([view[i : i + MAX_CHUNK], MPI.BYTE], self.peer, self.send_tag)
            for i in range(0, view.nbytes, MAX_CHUNK)
        ]

    def irecv_into(self, views: list, message=None):
        """The receive of one MPI message (at most ``MAX_CHUNK`` bytes; the next from the peer, or
        ``message``, matched by :meth:`improbe`) into ``views``, one after the other: the buffers of the
        frames it holds.  Several views are one derived datatype (their addresses from ``MPI_BOTTOM``), so
        MPI scatters the bytes itself, with no copy of ours: measured with raw mpi4py on this VM (MPICH 5,
        2026-11-30), a 4 MiB message into 16 buffers of 256 KiB 201-204 us against 193-293 us into one,
        copying out of one 392 us."""
        MPI = self.w.MPI
        if len(views) == 1:
            spec, dt = [views[0], MPI.BYTE], None
        else:
            dt = MPI.BYTE.Create_hindexed([v.nbytes for v in views], [MPI.Get_address(v) for v in views]).Commit()
            spec = [MPI.BOTTOM, 1, dt]
        try:
            if message is not None:
                return message.Irecv(spec)
            return self.comm.Irecv(spec, self.peer, self.recv_tag)
        finally:
            if dt is not None:
                dt.Free()  # (MPI frees it once the receive is done)

    def improbe(self) -> tuple | None:
        """The next MPI message from the peer, matched (``MPI_Improbe``) but not received, and its size."""
        status = self._status
        message = self.comm.Improbe(self.peer, self.recv_tag, status)
        return None if message is None else (message, status.Get_count(self.w.MPI.BYTE))

    def done(self, reqs: list) -> bool:
        """The requests completed; raises when the peer died while MPI copied from it (the bytes are partial)."""
        if not reqs:
            return True
        if not self.w.MPI.Request.Testall(reqs):
            return False
        self._raise_if_peer_died()
        return True

    def _raise_if_peer_died(self) -> None:
        if self.peer_pid in _ucx.failed:
            raise _ucx.PeerDiedMidCopy(f"the peer process {self.peer_pid} died while MPI copied a message from it")


def _mpi_pieces(mpi_sizes: list[int], joined: bool) -> list[int]:
    """The sizes of the MPI messages that carry frames of these sizes, in order: one per run of
    :func:`_wire.mpi_runs`, cut at ``MAX_CHUNK`` (as :meth:`_Link.isend` sends them)."""
    pieces = []
    for a, b in _wire.mpi_runs(mpi_sizes, MAX_CHUNK, joined):
        n = sum(mpi_sizes[a:b])
        pieces.extend(min(MAX_CHUNK, n - i) for i in range(0, n, MAX_CHUNK))
    return pieces


def _mpi_spans(sizes, via) -> list[list[int]]:
    """``[start, nbytes]`` of each receive buffer of a message's MPI frames, in their byte stream: one per
    ``VIA_MPI`` frame, with the ``VIA_MPI_SHARD`` frames that follow it."""
    spans: list[list[int]] = []
    pos = 0
    for size, v in zip(sizes, via):
        if v == _wire.VIA_MPI:
            spans.append([pos, size])
        elif v == _wire.VIA_MPI_SHARD:
            spans[-1][1] += size
        else:
            continue
        pos += size
    return spans


def _piece_views(spans, bufs, pieces) -> list[list[memoryview]]:
    """For each MPI message of a message (``pieces``: their sizes, in order), the parts of the buffers ``bufs``
    (laid out as ``spans``, :func:`_mpi_spans`) that its bytes go to, in order (one pass over both)."""
    out, k, pos = [], 0, 0
    for n in pieces:
        end, views = pos + n, []
        while pos < end:
            start, size = spans[k]
            if pos >= start + size:
                k += 1
                continue
            upto = min(end, start + size)
            views.append(bufs[k][pos - start : upto - start])
            pos = upto
        out.append(views)
    return out


def _shard_bytes() -> int:
    """distributed's shard size: frames larger than this are sent as consecutive shards that the reader joins."""
    return dask.utils.parse_bytes(dask.config.get("distributed.comm.shard"))


class _Ahead:
    """The first MPI message of a message whose header has not arrived yet (:meth:`_Receiver._probe_ahead`)."""

    __slots__ = ("message", "nbytes", "buf", "reqs")

    def __init__(self, message, nbytes: int):
        self.message = message  # matched, not yet received (None once received)
        self.nbytes = nbytes
        self.buf = None
        self.reqs: list = []


def _stall_timeout() -> float:
    return dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.tcp"), "seconds")


def _burst(test, until: float, comm: _Connection) -> bool:
    """Call ``test()`` (a connection's receiver or sender testing its MPI requests) until it returns False
    (nothing left in flight) or ``perf_counter()`` reaches ``until`` (at least once); what it raises (the
    peer died mid-copy, MPI failed) fails the connection.  True while something is still in flight."""
    try:
        while (active := test()) and time.perf_counter() < until:
            pass
    except Exception as exc:  # noqa: BLE001
        comm._fail_from_callback(exc)
        return False
    return active


# --------------------------------------------------------------------------------------------
# Receiving: one object owns everything a connection has taken in and not yet handed out


_UNDECODED = object()


class _InMessage:
    """A message being taken in: its frames, those the socket still owes bytes of, its MPI receives."""

    __slots__ = ("frames", "via", "fast", "sinks", "reqs", "mpi_bytes", "socket_bytes", "msg", "scatter")

    def __init__(self, frames, via, fast, sinks, reqs, mpi_bytes):
        self.frames = frames
        self.via = via  # each frame's route (_wire.VIA_SOCKET, _wire.VIA_MPI or _wire.VIA_MPI_SHARD)
        self.fast = fast
        self.sinks = sinks  # the socket frames the channel has still to fill, in reverse order
        self.reqs = reqs
        self.mpi_bytes = mpi_bytes
        self.socket_bytes = sum(len(f) for f in sinks)
        self.msg = _UNDECODED  # the message, decoded as soon as its socket frames are in (decode_early)
        self.scatter = None  # (buffer, views): a first MPI message received ahead of the header, for its frames

    def received(self) -> None:
        """Its MPI receives completed: copy what came ahead of the header into its frames' buffers."""
        self.reqs = []
        if self.scatter is not None:
            src, views = self.scatter
            self.scatter = None
            pos = 0
            for v in views:
                v[:] = src[pos : pos + v.nbytes]
                pos += v.nbytes

    def decode_early(self) -> None:
        """Decode a fast message (:func:`mpi4dask._wire.loads`) once its socket frames are in, while its
        MPI frames may still be on their way -- when those are only out-of-band buffers (an array's
        bytes), which the decoded objects merely point into (MPI receive buffers are writeable, so
        nothing is copied from them; a read-only frame of a message taken in whole is copied where the
        object must be writeable); a message whose msgpack, or an object's sub-header or pickle,
        travels over MPI (``MPI_MIN_FRAME`` or more) is decoded by ``read()``, once it is all in.  ``read()`` hands
        the decoded message out once the whole message is in; one that fails to decode is decoded again
        there, to raise."""
        via = self.via
        try:
            self.msg = _wire.loads(self.frames, arrived=lambda i: via[i] == _wire.VIA_SOCKET)
        except Exception:  # noqa: BLE001 - NotArrived, or an error that read() raises when it decodes again
            self.msg = _UNDECODED


class _Receiver:
    """Takes in the messages the peer sends (their headers and small frames on the socket, large
    frames over MPI) and holds finished messages until ``read()`` takes them.

    Flow, for one message: the connection's dispatcher (:meth:`mpi4dask.comm.SocketComm._take_in`) parses its header
    from the socket and hands it to :meth:`start_message`; MPI frames get their receives posted at
    once (into pooled buffers) and tested while the socket frames are filled into their own buffers; when
    both are complete, in header order, the message joins the inbox and a waiting reader wakes.
    MPI receives that do not complete at once are tested by the loop's
    :class:`~mpi4dask._progress.Progress` (this object is its ``Pollable``).

    Bounds: socket bytes waiting in the inbox over ``INBOX_MAX`` pause the socket (the peer's
    writes then wait, as over TCP); MPI bytes are bounded by the sender's window (``SEND_WINDOW``),
    which only reads free (:meth:`take` tells the comm to acknowledge them).
    """

    def __init__(self, comm: _Connection, ch: _Channel, link: _Link | None):
        self._comm = weakref.proxy(comm)  # weak: a comm dropped without close() is collected at once, as tcp's
        self._ch = ch
        self._link = link
        self._stopped = False  # cancel() was called: nothing more is taken in
        self._dropping = False  # drop_unread() was called: nothing is read any more
        self._incoming: collections.deque[_InMessage] = collections.deque()
        self._current: _InMessage | None = None  # the message whose socket frames are arriving
        self._ahead: _Ahead | None = None  # the next message's first MPI message, taken before its header
        self.goodbye = False  # the peer said goodbye (set by the connection): it announces nothing more
        self._inbox: collections.deque[_InMessage] = collections.deque()
        self._held_socket_bytes = 0  # socket bytes of messages whose socket frames are in, not yet read
        self._unread_mpi = 0  # MPI bytes of messages announced and not yet read (the peer's window)
        self._paused = False
        self._readers: collections.deque[asyncio.Future] = collections.deque()
        self._polled = False  # registered with Progress
        self._stall: asyncio.TimerHandle | None = None
        self.nbytes = 0  # Pollable: MPI bytes in flight towards us
        self.spin = True
        # receives in flight are tested at least every STEADY_BACKOFF_MAX, past their spin window too: the
        # receiver's calls move the bytes (MPICH 5's and Open MPI's single copy; UCX between joined worlds
        # copies one `_mpi.CMA_SEG_SIZE` segment per call), and backing off to 50 ms turned a 256 MiB move that
        # outlasted its window on busy cores into 5-10 s (tcp:// 0.2-0.4 s).  Only receives whose header came
        # are in flight (an idle connection has none); one whose peer stopped sending costs a test per 1 ms
        # (poll) until the bytes come or the connection ends.
        self.steady = link is not None
        self._waiting_since = 0.0  # when the MPI receives in flight started to be polled
        self._nudged = 0.0  # when we last asked the writer for progress
        # read once per connection, as a socket's options are: a dask.config lookup costs ~15 us, on the
        # path from an MPI message's arrival to its copy
        self._shard = _shard_bytes()
        self._stall_after = _stall_timeout()
        self._decode = comm.deserialize  # fast messages are decoded as they come in (_InMessage.decode_early)

    # -- state the comm asks about
    def has_messages(self) -> bool:
        return bool(self._inbox)

    def settled(self) -> bool:
        """The peer said goodbye and every message it announced is in: nothing more can arrive over MPI
        for this connection."""
        return self.goodbye and not self.in_flight()

    def in_flight(self) -> bool:
        """Something the peer sent is not in the inbox yet."""
        return bool(self._incoming or self._ch.pending)

    # -- the socket side
    def ready_for_record(self) -> bool:
        """Whether the connection may parse its socket's next record: the socket frames of the message
        being taken in are all there (what the socket brought is routed into them first), and this
        receiver is neither paused (its inbox is full) nor stopped."""
        if self._current is not None:
            if not self._fill_socket_frames():
                return False
            self._deliver_ready()
        return not (self._paused or self._stopped)

    def start_message(self, fast: bool, joined: bool, sizes, via) -> None:
        """A message's header arrived: post the receives of its MPI frames, and have the socket frames
        that follow the header received into their own buffers (or take a small message that is all
        here in whole: :meth:`_take_whole`)."""
        if _wire.VIA_MPI not in via:  # every frame on the socket (all small messages): the short way
            st = self._comm.stats
            st["messages_received"] += 1
            total = sum(sizes)
            st["socket_bytes_received"] += total
            if fast and total <= WHOLE_MAX and not self._incoming and len(self._ch.pending) >= total:
                self._take_whole(sizes, via, total)  # (the usual case: a small message in one socket read)
                return
            frames = [host_array(size) for size in sizes]
            self._begin(_InMessage(frames, via, fast, [f for f in reversed(frames) if len(f)], [], 0))
            return
        mpi_sizes = [size for size, v in zip(sizes, via) if v != _wire.VIA_SOCKET]
        mpi_bytes = sum(mpi_sizes)
        if mpi_bytes and self._link is None:
            raise WireError("the peer sent a frame over MPI on a connection without MPI")
        if mpi_bytes and self._unread_mpi and self._unread_mpi + mpi_bytes > SEND_WINDOW:
            raise WireError(
                f"the peer sent {self._unread_mpi + mpi_bytes} MPI bytes that were not read yet, more than "
                f"its window of {SEND_WINDOW}"
            )
        self._unread_mpi += mpi_bytes
        st = self._comm.stats
        st["messages_received"] += 1
        st["mpi_bytes_received"] += mpi_bytes
        st["socket_bytes_received"] += sum(sizes) - mpi_bytes
        pieces = _mpi_pieces(mpi_sizes, joined)  # the MPI messages, in the order the writer sent them
        ahead = None
        if pieces and self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            st["mpi_messages_ahead"] += 1
            if ahead.nbytes != pieces[0]:
                raise WireError(f"the peer's first MPI message has {ahead.nbytes} bytes, its header says "
                                     f"{pieces[0]}")
        # every MPI frame gets a buffer of its own, as distributed's tcp:// gives each: an object that lives
        # on keeps only its own bytes alive, not its message's (distributed's P2P rechunk tests it); but a
        # frame's shards (VIA_MPI_SHARD) follow it in its buffer, which distributed joins without a copy
        spans = _mpi_spans(sizes, via)
        early = ahead.buf if ahead is not None and ahead.buf is not None else None
        # a first MPI message received ahead of its header has a buffer of its own: it ends with a frame
        # (_probe_ahead), and when it is exactly one frame's buffer, it is that buffer; else its bytes are
        # copied into the buffers of the frames it holds once it is in (_InMessage.scatter)
        whole = early is not None and spans[0][1] == early.nbytes
        bufs = [early if whole and k == 0 else _pool.take(n) for k, (_, n) in enumerate(spans)]
        frames, sinks, k, at = [], [], -1, 0
        for size, v in zip(sizes, via):
            if v == _wire.VIA_SOCKET:
                # a buffer of its own, as distributed gives every frame: objects of one message never share memory
                buf = host_array(size)
                if size:
                    sinks.append(buf)
            else:
                if v == _wire.VIA_MPI:
                    k, at = k + 1, 0
                buf = bufs[k][at : at + size]
                at += size
            frames.append(buf)
        sinks.reverse()
        im = _InMessage(frames, via, fast, sinks, [], mpi_bytes)
        views = _piece_views(spans, bufs, pieces)
        if early is not None and not whole:
            im.scatter = (early, views[0])
        self._incoming.append(im)
        self._current = im
        # the small frames usually came with the header: fill them, and decode the message, before MPI
        # copies the large frames (a copy of megabytes evicts the caches that this Python runs from)
        if len(self._ch.pending) >= im.socket_bytes:
            self._fill_socket_frames()
        reqs, link = [], self._link
        for j, piece in enumerate(views):
            if j == 0 and ahead is not None:
                if early is not None:
                    reqs.extend(ahead.reqs)
                else:
                    reqs.append(link.irecv_into(piece, ahead.message))
            else:
                reqs.append(link.irecv_into(piece))
        im.reqs = reqs
        self._advance()

    def _take_whole(self, sizes, via, total: int) -> None:
        """A fast message (:func:`mpi4dask._wire.dumps`) of socket frames only, all of whose bytes are here,
        and none before it still being taken in: its frames become read-only views of one copy of those
        bytes, and it joins the inbox at once.  Whoever decodes it copies a buffer that an object keeps
        writeable (:func:`mpi4dask._wire.loads`, or distributed's ``pickle`` family for a reader that does
        not deserialize), so a writeable array keeps only its own bytes alive, as over tcp://; a read-only
        one keeps the message's (at most ``WHOLE_MAX``), as tcp:// keeps a message's first buffer with its
        small frames.  Only fast messages: distributed's own serialisation hands some buffers to
        ``pickle.loads`` as they are (``ToPickle``: a task's arguments), which would make them read-only.
        Measured (2026-11-28, valgrind, user-space instructions per round trip of the echo rank of an
        mpi:// ping-pong, polling off): a 1-byte array 285-288 k -> 240-256 k (2 pairs of runs), a plain
        dict 197 k -> 189 k (1 pair), against a buffer per frame filled through the channel's sinks."""
        with memoryview(self._ch.pending) as pending:
            data = pending[:total].tobytes()
        del self._ch.pending[:total]
        whole = memoryview(data)
        frames, pos = [], 0
        for n in sizes:
            frames.append(whole[pos : pos + n])
            pos += n
        im = _InMessage(frames, via, True, [], [], 0)
        im.socket_bytes = total
        self._held_socket_bytes += total
        if self._dropping:
            self._taken(im)
            return
        if self._decode:
            im.decode_early()
        self._inbox.append(im)
        self._pause_if_full()
        self.wake_readers()

    def _begin(self, im: _InMessage) -> None:
        self._incoming.append(im)
        self._current = im

    def poll_reply(self) -> bool:
        """While this side waits for a reply (the loop's :class:`~mpi4dask._progress.Progress` polls for
        it, maybe in the reader's own task): test the MPI receives of the messages whose headers came,
        and else (where the library allows it: ``_mpi.probes_ahead``) take the next MPI message off MPI
        before its header arrives (:meth:`_probe_ahead`).
        True when a message joined the inbox (or the connection failed: its readers were woken)."""
        if self._link is None or self._stopped:
            return False
        try:
            if self._incoming:
                had = len(self._inbox)
                self._advance()
                return len(self._inbox) > had
            if self._current is None and self._link.w.probes_ahead:
                self._probe_ahead()
        except Exception as exc:  # noqa: BLE001 - MPI failed: as in poll()
            self._comm._fail_from_callback(exc)
            return True
        return False

    def _probe_ahead(self) -> None:
        """Take the next MPI message of the connection off MPI before its header arrives on the
        socket, so its bytes move while the header's wake-up is on its way.

        Only when everything announced so far is received: the next MPI message on the link is then
        the first of the next message that has MPI frames (MPI keeps a pair's messages in order).
        One smaller than a shard and than ``MAX_CHUNK`` is received at once into a buffer of its own: it
        holds whole frames (the last piece of a run ends with the run's last frame), usually one frame's
        buffer, which it then becomes; when it holds several frames (a joined run), or the writer's shards
        are smaller than ours, its bytes are copied into their buffers once it is in (``_InMessage.scatter``).
        Where the peer joins frames (``_Link.joins``) only one of at most ``COALESCE_MAX`` bytes, so that copy
        stays small (a joined run of 160 frames of 256 KiB is 40 MiB).
        Any other is only matched, and received into the frames' buffers once the header says where: a
        piece of ``MAX_CHUNK`` bytes may be the head of a larger frame (1 GiB pieces, under a shard size
        configured larger).
        """
        a = self._ahead
        if a is None:
            found = self._link.improbe()
            if found is None:
                return
            message, n = found
            a = self._ahead = _Ahead(message, n)
            if n < self._shard and n < MAX_CHUNK and (n <= _wire.COALESCE_MAX or not self._link.joins):
                a.buf = _pool.take(n)
                a.reqs = [self._link.irecv_into([a.buf], message)]
                a.message = None
        if a.reqs and self._link.done(a.reqs):
            a.reqs = []

    def _fill_socket_frames(self) -> bool:
        """Route socket bytes into the current message's frames; True when they are all there."""
        ch, sinks = self._ch, self._current.sinks
        while sinks and not ch.sinking:
            ch.set_sink(sinks.pop())
        if ch.sinking:
            if self._stall is None:
                self._watch_stall(None)
            return False
        # held from now on: the message being taken in never counts towards pausing the socket, which
        # would stop its own frames (a message of more small frames than INBOX_MAX hung there)
        im, self._current = self._current, None
        self._held_socket_bytes += im.socket_bytes
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if im.fast and self._decode:
            im.decode_early()
        return True

    def _watch_stall(self, seen):
        """Abort a connection whose peer stops sending in the middle of a frame (for ``timeouts.tcp``)."""
        self._stall = None
        if self._current is None or self._stopped:
            return
        now = (id(self._current), len(self._current.sinks), self._ch.sink_position())
        if now == seen and not self._paused:  # a paused socket (our reader is slow) is not a stalled peer
            self._comm._fail_from_callback(
                WireError(f"no byte of the message in progress for {self._stall_after:.0f} s")
            )
            return
        self._stall = self._comm._loop.call_later(self._stall_after, self._watch_stall, now)

    # -- the MPI side
    def poll(self) -> bool:
        """Pollable: test the MPI receives; True while some are in flight."""
        if self._stopped:
            self._polled = False
            return False
        # a burst of tests per loop turn: UCX moves a large message between two joined worlds in
        # fragments, one per progress call, and a loop turn per fragment would cost more than the copy;
        # past the bytes' time (at Progress's rate), while every core is taken, one test per turn: a receive
        # that is late (a peer that stopped, a slow network) then costs a test every STEADY_BACKOFF_MAX
        now = time.perf_counter()
        late = now - self._waiting_since > _progress.spin_window(self.nbytes)
        burst = not late or _progress.core_idle()
        active = _burst(self._advance, now + POLL_BURST if burst else now, self._comm)
        if not active:
            self._polled = False
        return active

    def _advance(self) -> bool:
        """Deliver what is complete; have Progress test the rest; True while MPI bytes are in flight."""
        self._deliver_ready()
        pending = sum(im.mpi_bytes for im in self._incoming if im.reqs)
        self.nbytes = pending
        if pending:
            if not self._polled:
                self._polled = True
                self._waiting_since = time.perf_counter()
                self._comm._progress.add(self)
            else:
                self._nudge_if_late()
        return bool(pending)

    def _nudge_if_late(self) -> None:
        """Ask the writer to make MPI progress when our receives wait longer than the bytes need."""
        now = time.perf_counter()
        late = NUDGE_AFTER + self.nbytes / _progress.SPIN_RATE
        if now - self._waiting_since > late and now - self._nudged > late:
            self._nudged = now
            self._ch.write(_wire.NUDGE)
            self._comm._progress.kick(self.nbytes)  # and watch closely again while the writer moves them

    def _deliver_ready(self) -> None:
        q = self._incoming
        delivered = False
        while q:
            im = q[0]
            if im.reqs and not self._link.done(im.reqs):  # tested while its socket frames still arrive too
                break
            im.received()
            if im is self._current:
                break
            q.popleft()
            if self._dropping:
                self._taken(im)
                continue
            self._inbox.append(im)
            delivered = True
        if delivered and self._polled:
            self._waiting_since = time.perf_counter()  # lateness counts from the last arrival
        self._pause_if_full()
        if delivered:
            self.wake_readers()

    def _pause_if_full(self) -> None:
        if self._held_socket_bytes > INBOX_MAX and not self._paused and not self._dropping:
            self._paused = True
            self._ch.transport.pause_reading()

    # -- handing messages out
    async def take(self, reply: bool = False, behind: int = 0) -> _InMessage:
        """The next message, waiting for it; raises when none can come any more.

        ``reply``: the comm wrote a request since its last read began (a write while no read was under
        way), so what comes is likely the answer, and soon:
        while a core is idle, this task polls for it first (:meth:`~mpi4dask._progress.Progress.poll_here`),
        and goes on without a wake-up when it comes; then the loop polls for it between its other work
        rather than sleep (:meth:`~mpi4dask._progress.Progress.expect_reply`).  ``behind``: the MPI bytes of
        the comm's writes that the peer has not read yet (the answer comes no sooner: the poll lasts longer).
        """
        until = 0.0
        if reply and not self._inbox:
            progress, prober = self._comm._progress, self if self._link is not None else None
            until = progress.reply_budget(behind)
            if until and not self._stopped and progress.poll_here(until, self._news, prober):
                until = 0.0  # here already
        while not self._inbox:
            self._comm._raise_if_unreadable()
            fut = asyncio.get_running_loop().create_future()
            self._readers.append(fut)
            if until:
                progress.expect_reply(fut, prober, until)
                until = 0.0
            try:
                await fut
            finally:
                if fut.cancelled() and fut in self._readers:  # (woken readers were taken off the list)
                    self._readers.remove(fut)
        im = self._inbox.popleft()
        self._taken(im)
        if self._paused and self._held_socket_bytes <= INBOX_MAX // 2:
            self._resume()
        return im

    def drop_unread(self) -> None:
        """The connection was closed here: nothing reads it any more.  What the inbox holds, and each
        message that comes in whole from now on (its MPI bytes in: the peer's send completed), is dropped,
        and the socket is never paused (the peer's goodbye must still be read)."""
        self._dropping = True
        while self._inbox:
            self._taken(self._inbox.popleft())
        if self._paused:
            self._resume()

    def _taken(self, im: _InMessage) -> None:
        """``im`` left the inbox (read, or dropped): its bytes no longer count against the bounds."""
        self._held_socket_bytes -= im.socket_bytes
        self._unread_mpi -= im.mpi_bytes

    def _resume(self) -> None:
        """Read the socket again, taking in first what waited in its buffer."""
        self._paused = False
        if not self._ch.lost:
            self._ch.transport.resume_reading()
        self._comm._take_in()

    def _news(self) -> bool:
        """Something for a waiting reader: a message, or the end of the connection."""
        return bool(self._inbox) or self._stopped or self.settled()

    def wake_readers(self, exc: BaseException | None = None) -> None:
        for f in self._readers:
            if not f.done():
                if exc is None:
                    f.set_result(None)
                else:
                    f.set_exception(exc)
        self._readers.clear()

    def cancel(self) -> tuple[list, list]:
        """Stop taking in: cancel MPI receives; return (requests, buffers) MPI may still hold."""
        self._stopped = True
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        reqs, keep = [], []
        for im in self._incoming:
            for r in im.reqs:
                try:
                    r.Cancel()
                except Exception:  # noqa: BLE001 - already complete or freed
                    pass
                reqs.append(r)
            keep.append((im.frames, im.scatter))
        self._incoming.clear()
        self._current = None
        a, self._ahead = self._ahead, None
        if a is not None:
            if a.message is not None:  # matched: it must still be received, or MPI holds it for ever
                a.buf = np.empty(a.nbytes, dtype=np.uint8)
                a.reqs = [self._link.irecv_into([a.buf], a.message)]
            reqs.extend(a.reqs)
            keep.append(a.buf)
        return reqs, keep


# --------------------------------------------------------------------------------------------
# Sending


class _OutMessage:
    __slots__ = ("views", "via", "fast", "mpi_bytes")

    def __init__(self, views, via, fast, mpi_bytes):
        self.views, self.via, self.fast, self.mpi_bytes = views, via, fast, mpi_bytes


class _Sender:
    """Writes messages: the header and the small frames on the socket, large frames over MPI.

    As over distributed's tcp://, a write never waits for the peer: it queues the message and
    returns (the queue holds references to the frames, not copies).  What leaves the queue is
    bounded by the peer's reading: MPI bytes that the peer has not yet *read* stay within
    ``SEND_WINDOW`` (a larger message goes alone), and a message whose MPI frames would overflow
    the window waits, with every message after it, for the peer's acknowledgements.  So a slow
    reader never holds more than the window of this connection's MPI data.  The send requests
    complete once the peer has received the bytes; they are tested at each acknowledgement and by
    the loop's Progress, and ``close()`` waits for them (the flush).
    """

    def __init__(self, comm: _Connection, ch: _Channel, link: _Link | None):
        self._comm = weakref.proxy(comm)  # weak, as the receiver's
        self._ch = ch
        self._link = link
        self._stopped = False
        self._queue: collections.deque[_OutMessage] = collections.deque()  # not yet on the wire
        self._unread: collections.deque[int] = collections.deque()  # MPI bytes of each unacknowledged message
        self._unread_bytes = 0
        self._stalled = False  # the first queued message waits for the window (counted once per wait: metrics)
        self._sends: collections.deque[tuple[list, list]] = collections.deque()  # (requests, buffers)
        self._polled = False
        self._burst_until = 0.0  # until when poll() may test in a burst: the posted bytes' time (steady only)
        self._acks = 0  # messages of the peer read here and not yet acknowledged (see ack())
        self._ack_flush: asyncio.Handle | None = None  # the end of the loop turn that acknowledges them
        # Pollable: where the receiver moves the bytes (MPICH 5, Open MPI), sends are tested on timers only,
        # and the receiver's acknowledgement (a socket event) tests them when they are most likely done;
        # where the sender's MPI calls move them too (Intel MPI, MPICH 4: _mpi.sends_need_progress), on every
        # loop turn while they are in flight
        self.spin = self.steady = link is not None and link.w.sends_need_progress

    @property
    def nbytes(self) -> int:
        """Pollable: the MPI bytes sent and not yet read by the peer (sizes the spin window)."""
        return self._unread_bytes

    def send(self, frames, fast: bool) -> int:
        if self._stopped:  # (stopped at exit, from another thread's loop): nothing more goes out
            return 0
        views = [ensure_memoryview(f) for f in frames]
        # where a copy between processes of this node moves only while both ends make MPI calls (steady:
        # MPICH 4, Intel MPI) and every core is taken, the two ends seldom run at once and the copy crawls
        # (measured under MPICH 4.3.2 beside one busy process: 8 MiB 25-36 ms one way, tcp:// 4-5 ms): the
        # kernel's socket copy needs no such meeting
        link = self._link
        via = _wire.frame_routes(frames, views, link is not None, MPI_MIN_FRAME)
        if (self.steady and link.peer_pid and _wire.VIA_MPI in via
                and _progress.cores_taken(link.peer_pid)):
            via = [_wire.VIA_SOCKET] * len(views)
            _metrics.busy_socket_message()
        mpi_bytes = sum(v.nbytes for v, w in zip(views, via) if w != _wire.VIA_SOCKET)
        self._queue.append(_OutMessage(views, via, fast, mpi_bytes))
        self._pump()
        total = sum(v.nbytes for v in views)
        st = self._comm.stats
        st["messages_sent"] += 1
        st["mpi_bytes_sent"] += mpi_bytes
        st["socket_bytes_sent"] += total - mpi_bytes
        return total

    def _pump(self) -> None:
        """Put queued messages on the wire, in order, while the window allows."""
        q = self._queue
        while q:
            m = q[0]
            if m.mpi_bytes and self._unread_bytes and self._unread_bytes + m.mpi_bytes > SEND_WINDOW:
                if not self._stalled:  # counted once per wait, not per acknowledgement that did not end it
                    self._stalled = True
                    _metrics.window_stall()
                return  # the peer's acknowledgements call us again
            self._stalled = False
            q.popleft()
            joined = bool(m.mpi_bytes) and self._link.joins  # (the header says so: the reader cuts the same runs)
            if m.mpi_bytes:
                on_mpi = [v for v, w in zip(m.views, m.via) if w != _wire.VIA_SOCKET]
                reqs, keep = [], []
                for a, b in _wire.mpi_runs([v.nbytes for v in on_mpi], MAX_CHUNK, joined):
                    run = on_mpi[a] if b == a + 1 else memoryview(b"".join(on_mpi[a:b]))
                    keep.append(run)
                    reqs.extend(self._link.isend(run))
                self._unread.append(m.mpi_bytes)
                self._unread_bytes += m.mpi_bytes
                self._sends.append((reqs, keep))
                if self.steady:
                    now = max(time.perf_counter(), self._burst_until)
                    self._burst_until = now + _progress.spin_window(m.mpi_bytes)
                self._poll_later()
            header = self._take_acks() + _wire.pack_message(m.fast, m.views, m.via, joined)
            on_socket = [v for v, w in zip(m.views, m.via) if w == _wire.VIA_SOCKET and v.nbytes]
            for run in _wire.socket_writes(header, on_socket):
                self._ch.write(run)

    def ack(self) -> None:
        """One of the peer's MPI-carrying messages was read here: tell the peer (its send window grows back)
        with our next message, or at the end of this loop turn if we write none.  A reply written at once
        (a request answered, an echo) carries the acknowledgement in its own system call, so the peer is
        woken once, not twice (measured: one socket send costs ~20 us on this VM's loopback)."""
        self._acks += 1
        if self._acks == 1:
            self._ack_flush = asyncio.get_running_loop().call_soon(self._flush_acks)

    def _take_acks(self) -> bytes:
        n, self._acks = self._acks, 0
        if self._ack_flush is not None:  # (cancelled: the loop has nothing left to run for it, see Progress.poll_here)
            self._ack_flush.cancel()
            self._ack_flush = None
        return _wire.ACK * n

    def _flush_acks(self) -> None:
        self._ack_flush = None
        if self._acks:
            self._ch.write(self._take_acks())

    def acknowledged(self) -> None:
        """The peer read one of our MPI-carrying messages."""
        if not self._unread:
            raise WireError("the peer acknowledged a message that was never sent")
        self._unread_bytes -= self._unread.popleft()
        self._test()
        self._pump()

    def nudged(self) -> None:
        """The reader waits for our MPI frames: test the sends now (MPI moves them on) and keep
        testing them on every loop turn for a while."""
        if self._test():
            self._poll_later()
            self._comm._progress.kick(self._unread_bytes)  # on every loop turn for the bytes' time

    def _poll_later(self) -> None:
        if not self._polled:
            self._polled = True
            self._comm._progress.add(self)

    def _test(self) -> bool:
        """Release the sends MPI is done with; True while some are not."""
        if self._sends:  # test every message: later ones may finish first
            self._sends = collections.deque(s for s in self._sends if not self._link.done(s[0]))
        return bool(self._sends)

    def poll(self) -> bool:
        """Pollable: :meth:`_test`, until nothing is left or the comm is closed.  Where the sender's MPI calls
        move the bytes (``steady``: MPICH 4, Intel MPI), a burst of tests per loop turn, as the receiver's:
        each call moves one cell of MPI's shared-memory queue, and a loop turn per cell would pace the copy.
        Only for the bytes' time after they were posted (a peer that does not take them costs no spin
        after that) and while a core is idle (else the burst would hold the core the peer needs)."""
        if self._stopped:
            self._polled = False
            return False
        now = time.perf_counter()
        until = min(now + POLL_BURST, self._burst_until) if now < self._burst_until and _progress.core_idle() else 0.0
        active = _burst(self._test, until, self._comm)
        if not active:
            self._polled = False
        return active

    def busy(self) -> bool:
        return bool(self._queue or self._sends)

    async def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the peer has received everything written over MPI and the
        kernel has taken every socket byte (a process may end right after ``close()``, and what asyncio
        still held would be lost); False if some of it never left (the peer stopped reading): the caller
        must not say a clean goodbye."""
        deadline = time.monotonic() + timeout
        async for _ in backoff(1e-4, 5e-3):
            self._test()
            if not (self.busy() or self._ch.unsent()) or self._ch.lost or self._comm._peer_bye:
                return True
            if time.monotonic() > deadline:
                return False

    def drop_queued(self) -> None:
        self._queue.clear()

    def cancel(self) -> tuple[list, list]:
        """Stop sending; return (requests, buffers) MPI may still hold."""
        self._stopped = True
        self._queue.clear()
        reqs, keep = [], []
        for r, views in self._sends:
            reqs.extend(r)
            keep.append(views)
        self._sends.clear()
        return reqs, keep


# --------------------------------------------------------------------------------------------
# Stopping a connection's transfers


def _let_go(ep: _Endpoint, link: _Link | None, receiver: _Receiver, sender: _Sender, progress,
            at_exit: bool = False) -> _Graveyard | None:
    """Stop a connection's transfers: cancel its receives and sends, and hand the requests MPI still
    holds (with their buffers) to a graveyard that ``progress`` tests until MPI lets go of them (at exit
    the caller releases it).  Its tag is drained from then on (:meth:`~mpi4dask._endpoint._Endpoint.closed`),
    unless it is settled (:meth:`_Receiver.settled`): nothing more can come on it."""
    settled = receiver.settled()
    reqs, keep = receiver.cancel()
    sreqs, skeep = sender.cancel()
    if link is None:
        return None
    ep.let_go(link, settled)
    reqs += sreqs
    keep += skeep
    if not reqs or link.w.MPI.Request.Testall(reqs):
        return None
    grave = _Graveyard(link.w.MPI, reqs, keep)
    ep.graves.add(grave)
    if not at_exit:
        progress.add(grave)
    return grave


def _close_dangling(loop, ch: _Channel, desc: str, ep: _Endpoint, link: _Link | None, receiver: _Receiver,
                    sender: _Sender, progress) -> None:
    """Finalizer of a comm collected without ``close()`` (as distributed's TCP comm closes a dropped
    stream): abort its socket and let go of its MPI transfers, on its event loop."""
    receiver._stopped = sender._stopped = True  # no callback reaches for the comm any more

    def close():
        if ch.transport is not None and not ch.lost:
            logger.warning("mpi4dask: closing dangling comm %s", desc)
            ch.transport.abort()
        _let_go(ep, link, receiver, sender, progress)

    try:
        on_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_loop = False
    if on_loop:
        close()
        return
    try:
        loop.call_soon_threadsafe(close)  # the collector may run on any thread
    except RuntimeError:  # the loop is closed, and so are its sockets: what is sent to its tag is still drained
        if link is not None:
            ep.closed(link.route, link.peer, link.recv_tag)
