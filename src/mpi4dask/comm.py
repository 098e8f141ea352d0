"""The ``mpi://`` comm backend for ``distributed``.

Addresses are ``mpi://host:port``; ``host:port`` is a real TCP listening socket.  Every connection
has two channels:

* its **TCP socket**, for the handshake, then for every message's header and small frames (so the
  event that wakes the reader brings what it needs: nothing polls while idle, nothing waits on a
  timer for a header), the reader's acknowledgements, the goodbye on ``close()``, and to notice a
  peer that dies (the kernel closes its sockets);
* **MPI point-to-point** on ``MPI.COMM_WORLD`` for the bulk of large frames (``MPI_MIN_FRAME`` bytes
  or more), when both ends are ranks of the same MPI world.  Each side allocates its own receive
  tag for the connection (unique within the process, never reused) and hands it to the peer inside
  an MPI message, so a connection's matching space is (peer rank, tag): agreed explicitly, never
  inferred from connection order.

MPI itself is initialised on a thread of its own (:mod:`mpi4dask._mpi`): under ``mpiexec``,
``MPI_Init`` returns only when every rank has called it, so it must never block an event loop whose
listener the other ranks need.  A listener starts the initialisation when it starts listening, a
connector when it connects; both await it without blocking their loop.

Modules
-------
This module is what ``distributed`` sees: :class:`MPIBackend` (the entry point), :class:`MPIConnector`,
:class:`MPIListener`, the comms :class:`SocketComm` and :class:`MPIComm`, and :func:`connections`.
The rest of the transport is private, each module importing only the ones listed after it:

* :mod:`mpi4dask._handshake`: the handshake and its messages (hellos, proofs, verdicts, pairs of worlds);
* :mod:`mpi4dask._datapath`: a connection's MPI link, sender and receiver: how messages move;
* :mod:`mpi4dask._channel`: a connection's socket, as an asyncio protocol;
* :mod:`mpi4dask._endpoint`: what the process's connections share: receive tags, proofs, pairs of
  worlds, the receive buffers, and the cleanup after closed connections and at exit;
* :mod:`mpi4dask._wire` (the records on the socket), :mod:`mpi4dask._progress` (MPI requests tested
  from an event loop), :mod:`mpi4dask._mpi` (MPI's initialisation), :mod:`mpi4dask._credentials`
  (the cluster's credentials), :mod:`mpi4dask._metrics` (what moved and what happened, for ``/metrics``
  and the dashboard's MPI page, :mod:`mpi4dask._dashboard`).

Handshake (length-prefixed JSON over the socket, then MPI; details in :mod:`mpi4dask._handshake`)
-------------------------------------------------------------------------------------------------
1. client -> server: ``hello`` (rank, world size, launcher job key, host, pid, a random nonce Nc).
2. server -> client: ``hello`` (the same of the server, its nonce Ns, and whether its cheap checks
   allow a shared world).
3. client: if both sides' cheap checks pass, it sends the **proof** ``Ns + its receive tag`` over
   MPI to the server's claimed rank, then ``{"proof": "sent"}``; else ``{"proof": "none"}``.
4. server: on "sent" it receives the proof from the *claimed* rank (MPI's source field cannot be
   forged); only then does it send its own proof ``Nc + its receive tag`` to that rank and
   ``{"verdict": "mpi"}``.  Otherwise ``{"verdict": "socket"}``.
5. client: on "mpi" it takes the server's proof from the server's claimed rank.

When the ends are not in one MPI world but are processes of one cluster (Dask workers started
outside ``mpiexec``, which join MPI through their scheduler's service, :mod:`mpi4dask.pm`), the
handshake joins their two worlds instead (after both prove they know the cluster's secret,
``MPI_Comm_accept`` on the listening side, ``MPI_Comm_connect`` on the other), once per pair of
processes; the connection's frames then travel on that intercommunicator.  When neither applies (a
notebook client that is not of the cluster, a worker that has no MPI yet) the handshake makes a
:class:`SocketComm`, which carries every frame on its socket.

One message, top to bottom (the records are defined in :mod:`mpi4dask._wire`):

1. ``MPIComm.write`` serializes (:func:`mpi4dask._wire.dumps`, else distributed's ``to_frames``);
   the comm's :class:`~mpi4dask._datapath._Sender` waits while the peer has more than
   ``SEND_WINDOW`` MPI bytes unread, posts an ``Isend`` per large frame, and writes the header record
   and the small frames on the socket.
2. The peer's :class:`~mpi4dask._channel._Channel` wakes on the socket; its comm's dispatcher
   (:meth:`SocketComm._take_in`) parses the header and hands it to the comm's
   :class:`~mpi4dask._datapath._Receiver`, which posts the ``Irecv`` of every large frame (into a
   pooled buffer) and has the small frames filled into their own buffers as the socket brings them; MPI
   receives not complete at once are tested by the loop's Progress (:mod:`mpi4dask._progress`),
   spinning briefly and then backing off.
3. Complete messages join the inbox in order; ``read()`` takes one, acknowledges it (``A``) when it
   had MPI frames, which reopens the writer's window, and deserializes it.
4. The writer's dispatcher hands the acknowledgement to its sender; the send requests complete once
   the peer has received the bytes: tested at each acknowledgement, by Progress, and by ``close()``,
   which waits for them before its goodbye.
5. The goodbye (``B``): the peer answers it with its own at once; the closing side reads on until that
   answer and the MPI bytes of what the peer announced before it, so nothing more can arrive for the
   connection (its receive tag is *settled*), and the process's exit waits for no late message.

Backpressure is the same as over TCP: a reader that does not read stops its socket once
``INBOX_MAX`` socket bytes wait in its inbox, and holds back the writer's MPI frames by not
acknowledging them; a writer waits instead of queuing without bound.

Errors: any failure inside ``read``/``write``, or found by a socket or progress callback (a broken
record, an MPI error), aborts the connection (as distributed's TCP comm does) and is mapped in one
place, ``SocketComm._failed``: what reaches the caller is a ``CommClosedError``, or the original
exception when it was not a connection problem.  Two failures leave the connection as it is, as over
tcp://: a serialisation error (nothing was written yet) and a write long after the peer's goodbye
(what the peer sent before it can still be read).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
import weakref

import dask
from distributed.comm.addressing import unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector, FatalCommClosedError
from distributed.comm.registry import Backend, get_backend
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames
from distributed.system import MEMORY_LIMIT
from distributed.utils import ensure_ip, get_ip

from . import _endpoint, _handshake, _metrics, _mpi, _progress, _sockets, _wire, pm
from ._channel import _Channel
from ._datapath import _UNDECODED, MPI_MIN_FRAME, _close_dangling, _let_go, _Link, _Receiver, _Sender
from ._endpoint import _Endpoint, _Graveyard
from ._handshake import PROTOCOL_VERSION, _NotAnEndpoint, _Refused, connect_timeout
from ._wire import WireError

__all__ = ["MPIBackend", "MPIComm", "MPIConnector", "MPIListener", "MPI_MIN_FRAME", "PROTOCOL_VERSION",
           "SocketComm", "connections"]

logger = logging.getLogger(__name__)

MAX_FRAMES = 1 << 20  # frames of one message, checked before anything is allocated
MAX_MESSAGE_BYTES = int(MEMORY_LIMIT)  # the largest message a peer may announce: the machine's memory
CLOSE_FLUSH_TIMEOUT = 30.0  # seconds close() waits for its MPI sends to be received and its socket bytes sent
# seconds an MPI connection closed or aborted (here or by the peer) keeps reading its socket until it is settled
LINGER = 2.0
# seconds after the peer's goodbye during which writes are dropped silently; later ones raise.  Over tcp:// the
# first write after the peer's close goes out (the kernel takes it, the peer answers with a reset) and the next
# raises: a writer that never reads (distributed's ``feed``, which serves progress bars) stops there.  The grace
# keeps the writes of a shutdown's last moments (distributed's batched streams) quiet, as they were.
BYE_GRACE = 1.0
SETTLE_EVERY = 2e-3  # seconds between checks, while lingering, that the peer's announced MPI bytes are in
# seconds a listener's start waits for this process's own MPI_Init (a singleton's takes ~0.3 s here): starting
# MPI is not a connection, so the connect timeout (0.01 s in some of distributed's tests) does not bound it
INIT_TIMEOUT = 60.0


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
# The Comms: SocketComm (everything on the socket), MPIComm (large frames over MPI)


_open_comms: weakref.WeakSet[SocketComm] = weakref.WeakSet()  # every mpi:// comm of this process


def connections() -> list[dict]:
    """This process's open ``mpi://`` connections: who, over which transport, and what moved.

    Usable on every worker with ``client.run(mpi4dask.connections)``.

    Returns
    -------
    list of dict
        One dict per open connection, sorted by peer: ``local`` and ``peer`` (addresses),
        ``transport`` (``"mpi"``: frames of 256 KiB or more travel over MPI; ``"socket"``:
        everything on the TCP socket), ``mpi_route`` (``"world"``: ranks of one launched job;
        ``"pair"``: two worlds joined by connect/accept; ``None``), and the counts
        ``messages_sent``/``_received``, ``mpi_bytes_sent``/``_received``,
        ``socket_bytes_sent``/``_received``, ``mpi_messages_ahead`` (messages whose MPI bytes
        arrived before their header) and ``socket_reads`` (reads of the socket that brought bytes).
    """
    out = []
    for c in list(_open_comms):
        if c.closed():
            continue
        link = c._link
        out.append({
            "local": c.local_address,
            "peer": c.peer_address,
            "transport": "mpi" if link is not None else "socket",
            "mpi_route": None if link is None else ("world" if link.route == 0 else "pair"),
            **c.stats,
            "socket_reads": c._ch.reads,
        })
    return sorted(out, key=lambda d: (d["peer"], d["local"]))


class _AfterGoodbye(CommClosedError):
    """A write after the peer's goodbye, past ``BYE_GRACE``: the connection is not aborted for it."""


class SocketComm(Comm):
    """An established ``mpi://`` connection whose messages all travel on its socket.

    The handshake chooses it when the two ends are not ranks of one MPI world (a notebook client
    connecting to a cluster it is not part of, a worker before it has joined MPI); :class:`MPIComm`
    extends it.
    """

    uses_mpi = False  # True when large frames travel over MPI point-to-point

    def __init__(self, channel: _Channel, local_addr: str, peer_addr: str, deserialize: bool, *,
                 endpoint: _Endpoint, link: _Link | None = None):
        self._closed = False
        super().__init__(deserialize=deserialize)
        self._ch = channel
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._ep = endpoint
        self._link = link
        self._loop = asyncio.get_running_loop()
        self._progress = _progress.for_loop(self._loop)
        self._peer_bye = False  # the peer closed gracefully: what it sent before will still arrive
        self._bye_at = 0.0  # when (time.monotonic()) the peer's goodbye came
        # reading on until the connection is settled (close(), abort(), the peer's abort): _start_linger
        self._linger: asyncio.TimerHandle | None = None
        self._settling: asyncio.TimerHandle | None = None  # the next check that the peer's MPI bytes are in
        self._peer_aborted = False  # the peer aborted (its ``X``): lost to us, though it ends as a close does
        self._peer_gone = False  # the socket is gone
        self._stopped = False  # _stop() ran: its transfers were let go
        self._wrote = False  # written while no read waited: the next read likely waits for an answer
        self._reading = 0  # reads under way (a stream's reader waits in read() while its writes go out)
        self._receiver = _Receiver(self, channel, link)
        self._sender = _Sender(self, channel, link)
        self._extra: dict = {}
        # what moved, for mpi4dask.connections(): bytes announced in message headers, each way
        self.stats = {"messages_sent": 0, "messages_received": 0, "mpi_bytes_sent": 0, "mpi_bytes_received": 0,
                      "socket_bytes_sent": 0, "socket_bytes_received": 0,
                      "mpi_messages_ahead": 0}  # messages whose MPI bytes moved before their header came
        _open_comms.add(self)
        channel.owner = self
        # like distributed's TCP comm: a comm dropped without close() closes its socket when collected
        self._finalizer = weakref.finalize(self, _close_dangling, self._loop, channel, repr(self), endpoint, link,
                                           self._receiver, self._sender, self._progress)
        self._finalizer.atexit = False
        if channel.lost:
            self._on_lost()
        elif channel.pending:
            self._take_in()

    def __repr__(self):
        state = "closed" if self.closed() else "open"
        return f"<{type(self).__name__} {self._local_addr} -> {self._peer_addr} ({state})>"

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

    def closed(self) -> bool:
        # closed by this side (close(), abort(), a failed read or write), the peer aborted, or the
        # peer's socket is gone (as distributed's TCP comm notices) -- after a goodbye or the peer's
        # abort, once every message the peer sent before it has been read: until then it is still read
        if self._closed:
            return True
        r = self._receiver
        if self._peer_aborted:
            return not (r.has_messages() or r.in_flight())
        return self._peer_gone and (not self._peer_bye or not (r.has_messages() or r.in_flight()))

    # -- errors: the one place where a failure becomes the caller's exception
    def _failed(self, exc: BaseException, broken: bool = False) -> BaseException:
        """Abort the connection after ``exc`` (as distributed's TCP comm does: what was sent or
        received is unknown, so the connection cannot be used any more) and map it for the caller.
        The abort tells the peer (:meth:`abort`) unless the connection itself broke (``broken``, or a
        broken record, a socket or MPI error): a cancelled read, or one after the connection ended,
        leaves it whole."""
        if isinstance(exc, _AfterGoodbye):
            return exc  # nothing broke: what the peer sent before its goodbye can still be read
        mpi_error = self._link is not None and isinstance(exc, self._link.w.MPI.Exception)
        self._abort(broken or mpi_error or isinstance(exc, (EOFError, WireError, OSError)))
        if isinstance(exc, CommClosedError):
            return exc
        if isinstance(exc, EOFError):
            return CommClosedError(f"{self!r}: truncated message")
        if isinstance(exc, WireError):
            return CommClosedError(f"{self!r}: {exc}")
        if mpi_error:
            return CommClosedError(f"{self!r}: MPI error ({exc})")
        if isinstance(exc, OSError):
            return CommClosedError(f"{self!r}: {type(exc).__name__}: {exc}")
        return exc  # not a connection problem (serialisation, cancellation): the caller sees it as it is

    def _fail_from_callback(self, exc: BaseException) -> None:
        """A failure found outside read()/write() (in a socket or progress callback): log it, abort,
        and hand the mapped error to the readers waiting."""
        if self._closed:
            return
        logger.error("mpi4dask: %r: %s; closing the connection", self, exc)
        err = self._failed(exc, broken=True)
        self._receiver.wake_readers(err if isinstance(err, CommClosedError) else CommClosedError(str(err)))

    # -- reading
    async def read(self, deserializers=None):
        if self._closed:  # (what its inbox still holds was dropped with the connection, as over tcp://)
            raise CommClosedError(f"{self!r} is closed")
        reply, self._wrote = self._wrote, False
        self._reading += 1  # until the message is decoded too: a write meanwhile is no request (see write())
        try:
            try:
                im = await self._receiver.take(reply, self._sender.nbytes)
            except BaseException as exc:
                raise self._failed(exc) from (None if isinstance(exc, CommClosedError) else exc)
            if im.mpi_bytes:
                self._sender.ack()  # frees the peer's send window
            try:
                if im.fast and self.deserialize:
                    if im.msg is not _UNDECODED and _wire.decodes_alike(deserializers):
                        return im.msg  # decoded as it came in (_InMessage.decode_early)
                    return _wire.loads(im.frames, deserializers)  # zero-copy unpickling: nothing to offload
                return await from_frames(
                    im.frames, deserialize=self.deserialize, deserializers=deserializers,
                    allow_offload=self.allow_offload,
                )
            except EOFError as exc:
                raise self._failed(exc) from exc
            # other decoding errors leave the connection usable: the whole message was taken in
        finally:
            self._reading -= 1

    def _raise_if_unreadable(self):
        if self._closed:
            raise CommClosedError(f"{self!r} is closed")
        if self._peer_aborted and not self._receiver.in_flight():  # (what it sent before is read first)
            raise CommClosedError(f"{self!r}: the peer aborted the connection")
        if self._peer_gone and not self._peer_bye:
            raise CommClosedError(f"{self!r}: the peer went away (connection lost, no goodbye)")
        if self._peer_bye and not self._receiver.in_flight():
            raise CommClosedError(f"{self!r}: the peer closed the connection")

    # -- writing
    async def write(self, msg, serializers=None, on_error="message"):
        try:
            if not self._writable():
                return 0
        except BaseException as exc:
            raise self._failed(exc) from None
        # Serialisation writes nothing: what it raises (an object that cannot be pickled, a
        # cancellation while offloaded) reaches the caller and leaves the connection usable, as tcp://
        frames = None
        if self._link is not None and (serializers is None or "pickle" in serializers):
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
        try:
            if not self._writable():
                return 0
            # a request (an RPC, a ping-pong) is written with no read waiting; a stream (distributed's
            # BatchedSend) writes while its reader waits in read(), and its next message is no answer
            if not self._reading:
                self._wrote = True
            return self._sender.send(frames, fast)
        except BaseException as exc:
            raise self._failed(exc) from (None if isinstance(exc, CommClosedError) else exc)

    def _writable(self) -> bool:
        """False: the peer said goodbye less than ``BYE_GRACE`` ago, and the message is dropped (as a
        TCP socket whose peer has just closed takes a write; distributed's last messages of a shutdown
        go this way, without a traceback); raises once this side closed the comm (``close()``,
        ``abort()``, a failed read or write), the peer went away without a goodbye or aborted, or its
        goodbye is older than that."""
        self._raise_if_unwritable()
        return not self._peer_bye

    def _raise_if_unwritable(self):
        if self._closed:
            raise CommClosedError(f"{self!r}: cannot write, this side closed the connection")
        if self._peer_aborted:
            raise CommClosedError(f"{self!r}: cannot write, the peer aborted the connection")
        if self._peer_gone and not self._peer_bye:
            raise CommClosedError(f"{self!r}: cannot write, the peer went away (connection lost, no goodbye)")
        if self._peer_bye and time.monotonic() - self._bye_at > BYE_GRACE:
            raise _AfterGoodbye(f"{self!r}: cannot write, the peer closed the connection")

    # -- the socket's records, each to its owner
    def _take_in(self) -> None:
        """Parse what the socket brought, record by record and in order, and hand each to its owner: a
        message's header to the receiver, an acknowledgement or a nudge to the sender, the goodbye to this
        comm.  Parsing waits while the receiver cannot take the next record (socket frames of a message
        still arriving, a full inbox, a stopped receiver); the socket's next arrival, or the receiver once
        a read made room, calls this again.  A failure (a broken record, an MPI error) aborts the comm."""
        ch, receiver, sender = self._ch, self._receiver, self._sender
        try:
            while receiver.ready_for_record() and ch.pending:
                record = _wire.parse_record(ch.pending, MAX_FRAMES, MAX_MESSAGE_BYTES)
                if record is None:
                    return  # incomplete
                if record is _wire.ACK and self._closed:
                    pass  # closed here: nothing more is sent, the window no longer counts
                elif record is _wire.ACK:
                    sender.acknowledged()
                elif record is _wire.NUDGE:
                    sender.nudged()
                elif record is _wire.BYE:
                    self._peer_said_bye()
                elif record is _wire.ABORT:
                    self._peer_said_abort()
                else:
                    receiver.start_message(*record)
        except Exception as exc:  # noqa: BLE001 - the peer broke the protocol, or MPI failed
            self._fail_from_callback(exc)

    # -- events from the socket
    def _peer_said_bye(self) -> None:
        if not self._peer_bye:
            self._bye_at = time.monotonic()
        self._peer_bye = self._receiver.goodbye = True
        self._sender.drop_queued()  # nothing more is read there
        if self._closed:
            self._settle()  # the answer close() lingers for: the peer announced all it will ever send
            return
        if self._link is not None and not self._ch.writes_ended:
            # answer at once (see close()): every message we sent is announced before it, and nothing more
            # is written or read on the socket (what the peer announced still arrives over MPI)
            self._say(_wire.BYE)
            self._ch.close()
        self._receiver.wake_readers()

    def _peer_said_abort(self) -> None:
        """The peer aborted: to the user the connection is lost, as over tcp:// (writes raise, and reads
        once what the peer sent before is read).  Underneath it ends as a close does: the peer announces
        nothing more (a goodbye), ours answers it, and what the peer announced before still arrives
        over MPI; the connection stops once that is in (or at the linger's end)."""
        self._peer_aborted = True
        self._peer_said_bye()
        if not self._closed and self._linger is None:
            if self._link is not None:
                self._start_linger()
            else:  # (a connection without MPI: no peer of ours aborts it so)
                self._stop()

    def _on_lost(self):
        if self._peer_gone:
            return
        self._peer_gone = True
        if self._closed:
            if self._linger is not None and not self._peer_bye:
                self._end_linger()  # gone without an answer: what it sent may still be in MPI (drained)
            return  # (after its goodbye, _settle ends the linger: the MPI bytes still come without the socket)
        if not self._peer_bye:
            self._stop()
        self._receiver.wake_readers()

    # -- closing
    def _say(self, record: bytes) -> None:
        """Our goodbye (``BYE``) or abort (``ABORT``): the last record we write (``_ch.writes_ended`` after)."""
        self._ch.write(record)
        self._ch.end_writes()  # nothing follows it (no acknowledgement, no nudge)

    def _start_linger(self) -> None:
        """Read on (up to ``LINGER`` s, in the background) until the connection is settled: the peer's
        goodbye came and the MPI bytes of every message it announced are in; then stop it."""
        self._linger = self._loop.call_later(LINGER, self._end_linger)
        self._ep.lingering(self._link)  # (drained at exit should the linger never end: its loop closed)
        self._settle()

    def _settle(self) -> None:
        """End the linger once the connection is settled (checked again shortly while the peer's goodbye
        came but some MPI bytes of what it announced are not in, until the linger's end)."""
        self._settling = None
        if self._linger is None or not self._receiver.goodbye:
            return  # (the goodbye's arrival calls this again)
        if self._receiver.in_flight():
            self._settling = self._loop.call_later(SETTLE_EVERY, self._settle)
            return
        self._end_linger()

    def _end_linger(self, reset: bool = False) -> None:
        """End the linger: close the socket (reset it when the peer never answered, or ``reset``: a
        graceful close would wait for the peer to read) and stop; a reader of what was still in flight
        learns that nothing more comes."""
        if self._linger is None:
            return
        self._cancel_timers()
        if self._receiver.settled() and not reset:
            self._ch.close()
            self._stop()
        else:
            self._cut()
        self._receiver.wake_readers()

    def _cancel_timers(self) -> None:
        for h in (self._linger, self._settling):
            if h is not None:
                h.cancel()
        self._linger = self._settling = None

    def _cut(self) -> None:
        """Reset the socket and stop."""
        t = self._ch.transport
        if t is not None:
            t.abort()
        self._stop()

    def _stop(self, at_exit: bool = False) -> _Graveyard | None:
        """Stop all work of this connection (it is closed, or its peer is gone).  Its receive tag is
        *settled* when the peer said goodbye and every message it announced is in: nothing more can
        arrive on it, and exit need not wait for late messages (:meth:`_Endpoint._exit_quiet`)."""
        if self._stopped:
            return None
        self._stopped = True
        if self._link is not None:
            self._cancel_timers()  # (at exit, lingering: what is not in yet is drained)
            self._ep.comms.discard(self)
        grave = _let_go(self._ep, self._link, self._receiver, self._sender, self._progress, at_exit)
        if at_exit and self._link is not None and self._ch.transport is not None:
            # the peer learns at once that nothing more comes from here, and closes its end (with its loop
            # running), after which it sends nothing more over MPI either: exit watches for that
            sock = self._ch.transport.get_extra_info("socket")
            if sock is not None and sock.fileno() >= 0:
                try:
                    sock.shutdown(socket.SHUT_WR)
                    self._ep.watch_at_exit(self._link, sock.fileno())
                except OSError:
                    pass
        return grave

    async def close(self):
        """Close the connection: once the peer has read what we wrote, our goodbye (``B``), after which we
        write nothing.  An MPI connection then keeps reading its socket (up to ``LINGER`` s) for the
        peer's goodbye, which the peer writes as soon as it reads ours (:meth:`_peer_said_bye`), taking in
        (and dropping) what the peer sent before it; only then are the connection's MPI receives settled,
        and the process's exit skips its wait for late MPI messages.  (Already lingering after the peer's
        abort: that goes on.)"""
        if self._closed:
            return
        if not self._peer_gone and not await self._sender.flush(CLOSE_FLUSH_TIMEOUT):
            # the peer did not take in what we wrote: tell it the connection is lost, not closed cleanly
            logger.warning("mpi4dask: %r: the peer read nothing for %.0f s while closing; aborting",
                           self, CLOSE_FLUSH_TIMEOUT)
            self._abort(broken=True)
            return
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        if not self._ch.writes_ended:
            self._say(_wire.BYE)
        self._end(broken=False)
        self._receiver.wake_readers(CommClosedError(f"{self!r} was closed"))

    def abort(self) -> None:
        """Close the connection at once, dropping what was not sent yet.  The peer learns of it as of a
        lost connection (over MPI through our ``X``: its writes raise, and its reads once it has read what
        we sent before); an MPI connection then reads on, as after :meth:`close`, until it is settled
        (what was in flight still ends cleanly).  From another thread than the connection's loop (a
        dropped ``rpc``'s ``__del__``), the loop does it; a loop that no longer runs cannot read on."""
        if self._closed:
            return
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        if here or not self._loop.is_running():
            self._abort(broken=not here)
            return
        self._closed = True
        self._finalizer.detach()
        self._loop.call_soon_threadsafe(self._aborted, False)

    def _abort(self, broken: bool) -> None:
        """:meth:`abort` on the loop; ``broken``: the socket, its records or MPI failed, so nothing more is
        said or taken in (the socket is reset, what may still come over MPI is drained)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._aborted(broken)

    def _aborted(self, broken: bool) -> None:
        if not broken and not self._ch.writes_ended and self._may_settle():
            self._sender.drop_queued()
            self._say(_wire.ABORT)
        self._end(broken)
        self._receiver.wake_readers(CommClosedError(f"{self!r} was aborted"))

    def _end(self, broken: bool) -> None:
        """After close() or abort(): nothing is read here any more.  Read on until settled; else end now,
        gracefully where our goodbye (or answer) may still be on its way, with a reset where the
        connection broke or was aborted without a word."""
        self._receiver.drop_unread()
        if self._linger is not None:
            if broken:
                self._end_linger(reset=True)
        elif not broken and self._may_settle():
            self._start_linger()
        elif not broken and self._ch.writes_ended:
            self._ch.close()
            self._stop()
        else:
            self._cut()

    def _may_settle(self) -> bool:
        """Whether reading on can settle this connection: it is over MPI, not settled yet, and its peer
        did not vanish without a goodbye (then nothing tells when its MPI messages are all in)."""
        return (self._link is not None and not self._receiver.settled()
                and (self._peer_bye or not self._peer_gone))


class MPIComm(SocketComm):
    """An ``mpi://`` connection between ranks of one MPI world: headers and small frames on the
    socket, frames of ``MPI_MIN_FRAME`` bytes or more over MPI point-to-point."""

    uses_mpi = True

    def __init__(self, channel: _Channel, local_addr: str, peer_addr: str, deserialize: bool, *,
                 endpoint: _Endpoint, link: _Link):
        super().__init__(channel, local_addr, peer_addr, deserialize, endpoint=endpoint, link=link)
        endpoint.comms.add(self)
        endpoint.other_ranks |= link.route != 0 or link.peer != endpoint.w.rank


# --------------------------------------------------------------------------------------------
# Making the comms: after the handshake


def _sockname(transport, key) -> str:
    addr = transport.get_extra_info(key)
    return "mpi://" + unparse_host_port(addr[0], addr[1])


def _make_comm(ch: _Channel, ep: _Endpoint | None, link: _Link | None, local_addr: str, peer_addr: str,
               deserialize: bool, initiated: bool) -> SocketComm:
    """The comm that the handshake chose: large frames over ``link``, or every frame on the socket;
    counted by :mod:`mpi4dask._metrics` (by the peer's address too when this side ``initiated`` it)."""
    if link is not None:
        comm = MPIComm(ch, local_addr, peer_addr, deserialize, endpoint=ep, link=link)
        _metrics.track(comm, "mpi", "world" if link.route == 0 else "pair", initiated)
    else:
        comm = SocketComm(ch, local_addr, peer_addr, deserialize, endpoint=ep)
        _metrics.track(comm, "socket", "none", initiated)
    return comm


async def _accepted_comm(ch: _Channel, ep: _Endpoint | None, local_addr: str, peer_addr: str, deserialize: bool,
                         accepting) -> SocketComm:
    """The listening side's handshake, then its comm."""
    with _endpoint.handshaking(ep):
        link = await _handshake.server(ch, ep, peer_addr, accepting)
    return _make_comm(ch, ep, link, local_addr, peer_addr, deserialize, initiated=False)


# --------------------------------------------------------------------------------------------
# Connector, Listener, Backend


class MPIConnector(Connector):
    async def connect(self, address, deserialize=True, **connection_args):
        host, port = _split_host_port(address, "connect")
        _metrics.activate()
        if _mpi.may_start():
            _mpi.start()  # under mpiexec MPI_Init waits for every rank: start it before anything else
        loop = asyncio.get_running_loop()
        transport, ch = await loop.create_connection(_Channel, host, port)
        try:
            ep = await _endpoint.get(connect_timeout())
            local_addr, peer_addr = _sockname(transport, "sockname"), "mpi://" + unparse_host_port(host, port)
            with _endpoint.handshaking(ep):
                link = await _handshake.client(ch, ep, peer_addr)
            return _make_comm(ch, ep, link, local_addr, peer_addr, deserialize, initiated=True)
        except _NotAnEndpoint as exc:  # (a distributed error: its type shows in messages, e.g. a Nanny's reason)
            transport.abort()
            where = unparse_host_port(host, port)
            raise FatalCommClosedError(
                f"mpi://{where} is no mpi:// listener: {exc}.  Give the address with the protocol that listens "
                f"there (a tcp:// Dask server answers so: tcp://{where}), or start that server with protocol='mpi'"
            ) from None
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


def _listening_server():
    """The ``distributed`` Server (Scheduler, Worker, Nanny) creating this listener, if any: found
    among its callers (the frames of ``Server.listen`` -> ``listen`` -> the backend)."""
    from distributed.core import Server

    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, Server):
            return obj
        frame = frame.f_back
    return None


def _workers_default_host(worker) -> str | None:
    """The ``default_host`` a listening :class:`distributed.Worker` gives tcp:// listeners only.

    ``Worker.start_unsafe`` passes ``default_host=get_ip(<scheduler host>)`` to its listener for
    tcp and tls alone, so that a worker listening on all interfaces advertises the one that
    reaches its scheduler; mpi:// workers derive the same host, so they advertise what tcp:// ones do.
    """
    from distributed.comm import get_address_host

    address = getattr(worker.scheduler, "address", None)
    try:
        return get_ip(get_address_host(address)) if address else None
    except (ValueError, OSError):
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
        from distributed import Nanny, Scheduler, Worker

        server = _listening_server()
        self._scheduler = server if isinstance(server, Scheduler) else None
        self._deferring = isinstance(server, (Worker, Nanny))
        if default_host is None and not self.host and isinstance(server, Worker):
            default_host = _workers_default_host(server)
        self.default_host = default_host
        self._servers: list[asyncio.AbstractServer] = []
        self._sockets: list[socket.socket] = []
        self._handshaking: set[_Channel] = set()
        self._tasks: set[asyncio.Task] = set()
        self._warned_stranger = False  # a peer that speaks no mpi4dask was logged (_note_stranger)

    async def start(self):
        _metrics.activate()
        if self._scheduler is not None:
            # the cluster's MPI service: workers started outside mpiexec join MPI through it (mpi4dask.pm)
            await pm.install(self._scheduler, host=self.host)
        elif self._deferring:
            _mpi.defer_until_credentials()  # a worker (or nanny) joins MPI through its scheduler's service
        # MPI_Init starts now, on its own thread: under mpiexec it completes once every rank has
        # called it, and peers may need this listener to get there (see mpi4dask._mpi)
        if _mpi.may_start():
            _mpi.start()
            if not _mpi.launched_with_peers():  # local: fail early when MPI is broken (a cluster's MPI service
                # out of reach fails nothing: this process's connections use their sockets, _endpoint.get)
                await _endpoint.get(max(INIT_TIMEOUT, connect_timeout()))
        loop = asyncio.get_running_loop()
        backlog = int(dask.config.get("distributed.comm.socket-backlog"))
        self._sockets = _sockets.bind(self.host, self.port, backlog)
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
            timeout = connect_timeout()
            ep = await _endpoint.get(timeout)
            comm = await asyncio.wait_for(  # a second more than the wait for a proof, which is refused
                _accepted_comm(ch, ep, local_addr, peer_addr, self.deserialize, lambda: bool(self._servers)),
                timeout + 1,
            )
        except _Refused as exc:
            logger.warning("mpi4dask: refused the connection from %s: %s", peer_addr, exc)
            t.abort()
            return
        except _NotAnEndpoint as exc:
            self._note_stranger(peer_addr, exc)
            t.abort()
            return
        except _mpi.MPIUnavailableError as exc:
            logger.error("mpi4dask: refusing the connection from %s: %s", peer_addr, exc)
            t.abort()
            return
        except asyncio.CancelledError:  # (the listener stopped)
            t.abort()
            return
        except Exception as exc:  # noqa: BLE001 - as tcp:// logs a connection that closed before its handshake
            logger.info("mpi4dask: handshake with %s failed: %r", peer_addr, exc)
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
        except Exception as exc:  # noqa: BLE001 - a first message that distributed cannot read
            # (tcp:// lets it escape to tornado, which logs a traceback and leaves the stream to the collector)
            logger.warning("mpi4dask: closed the connection from %s: its first message is no distributed "
                           "handshake (%s: %s)", peer_addr, type(exc).__name__, exc)
            comm.abort()
            return
        await self.comm_handler(comm)

    def _note_stranger(self, peer_addr: str, exc: BaseException) -> None:
        """A peer that speaks no mpi4dask (its client only sees the connection closed): said once per
        listener, at WARNING -- most often a tcp:// client or worker given this listener's address."""
        try:
            ours = self.contact_address
        except ValueError:  # stopped meanwhile: nobody is to be told where to connect
            ours = None
        if self._warned_stranger or ours is None:
            logger.debug("mpi4dask: %s: %s", peer_addr, exc)
            return
        self._warned_stranger = True
        logger.warning("mpi4dask: the connection from %s to %s was closed: %s. A client or worker that connects "
                       "with tcp:// to an mpi:// listener gets only 'Stream is closed': give it the address %s. "
                       "(Logged once.)", peer_addr.split("://", 1)[-1], ours, exc, ours)

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
        # as tcp:// finds it, in every distributed release: IPv6 through get_ipv6 before 2025.11, get_ip since
        # (get_ipv6 is deprecated there, and get_ip of an IPv6 host warns and gives the host name before)
        host, _ = _split_host_port(loc, "address")
        return get_backend("tcp").get_local_address_for(unparse_host_port(ensure_ip(host), 0))
