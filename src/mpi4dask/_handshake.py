"""The handshake of an ``mpi://`` connection (private): how its two ends agree on a transport.

Right after the TCP connection is made, the ends exchange handshake messages on its socket: each a
JSON object prefixed by its length (``<I``, at most ``HANDSHAKE_MAX`` bytes), whose first key is
``"magic": "mpi4dask"``.  The outcome is a :class:`~mpi4dask._datapath._Link` (the connection's
large frames travel over MPI) or none (everything travels on the socket); :mod:`mpi4dask.comm`
then makes the comm.

Steps
-----
1. client -> server: ``hello`` (rank, world size, launcher job key, host, pid, a random nonce Nc).
2. server -> client: ``hello`` (the same of the server, its nonce Ns, and ``mpi``: whether its
   cheap checks allow a shared world: same size and job key, a valid rank other than its own, or
   this very process).
3. client: if both sides' cheap checks pass, it sends the **proof** ``Ns + its receive tag`` over
   MPI to the server's claimed rank (on the process-wide proof tag, :class:`~mpi4dask._endpoint._Proofs`),
   then ``proof_sent``; else ``proof_none``.
4. server: on "sent" it receives the proof from the *claimed* rank (MPI's source field cannot be
   forged); only then does it send its own proof ``Nc + its receive tag`` to that rank and
   ``verdict_mpi``.  Otherwise ``verdict_socket``.
5. client: on "mpi" it takes the server's proof from the server's claimed rank.

So the listener sends nothing over MPI on a peer's behalf before the peer has proven its rank,
and the tags a connection sends on come from the peer's own MPI message.  Waits for a proof are not
timed guesses: when both sides know their launcher's job key (hydra, Open MPI, Slurm...), a peer of
another job is told apart at once, and a peer of the same job that does not prove its claim within
the connect timeout is refused (never silently demoted to the socket).  Proofs that arrive for no
handshake (a stranger's claim, a handshake that timed out) are received and dropped, also at exit,
so none is left unmatched at ``MPI_Finalize``.

Pairs of worlds
---------------
When the ends are not in one MPI world but are processes of one cluster (Dask workers started
outside ``mpiexec``, which join MPI through their scheduler's service, :mod:`mpi4dask.pm`), the
server's hello says ``pair`` (and ``links``: the pairs it already has with this client), and the
handshake joins their two worlds instead (``MPI_Comm_accept`` on the server, ``MPI_Comm_connect``
on the client), once per pair of processes (:class:`~mpi4dask._endpoint._Pairs`); the connection's
frames then travel on that intercommunicator.  Each side proves that it knows the cluster's secret
with ``mac``: HMAC-SHA256(secret, ``mpi4dask-pair|client|Ns|Nc``) from the client,
``mpi4dask-pair|server|Nc|Ns`` from the server (raw nonces).

3p. client: it takes its join slot (unless it can reuse a pair the server offered), then claims
    with ``proof_pair``: its receive tag, the pair to reuse (``use``, or null), its ``mac``.
4p. server: a wrong ``mac`` is refused (the connection is closed, nothing answered).  A pair it has
    as ``use``: ``verdict_pair`` with its tag, its ``mac`` and that ``id``.  Else, if its own slot is
    free: ``verdict_pair`` with a new ``id`` and the ``port`` it then accepts on.  Else
    ``verdict_busy``, and it reads the client's next claim (``proof_pair`` again, or ``proof_none``).
5p. client: on "busy" it claims again after a random pause (until the connect timeout); on "pair"
    it checks the server's ``mac``, then connects to ``port`` (taking its slot if it did not hold
    it) or reuses the pair ``id``.
6p. the join (a new pair only): the client's join thread sends the single byte ``GO`` on the socket
    and enters ``MPI_Comm_connect``; the server's join thread, which stopped reading the socket
    before it sent the verdict, waits for that byte and enters ``MPI_Comm_accept``.  So neither
    side waits inside MPI (where MPICH polls, holds its process-wide lock, and counts the join's
    short timeout) while the other side's event loop gets round to the handshake: a task holding
    the GIL in C delays an event loop by the whole task.  Between the byte and MPI each side lets
    the GIL go at most once (:mod:`mpi4dask._sockets`).  A server whose client closes the
    connection instead, or sends nothing within the connect timeout, does not join (no MPI call).
    A handshake given up meanwhile (distributed cancels a connect attempt after a fifth of its
    timeout) gives the join up too, unless it is inside MPI already: a byte not sent yet is never
    sent, and a wait for it ends.  A join already inside MPI goes on, and the pair it makes is kept
    on both sides for later connections (the other side's handshake may have gone on).

A side whose joins failed while the connection waited for its turn to join
(:func:`mpi4dask._mpi.joins_unsafe`) answers ``proof_none`` (client) or ``verdict_socket`` (server)
instead, and the connection carries its frames on its socket, as new connections of that process
do.  When neither a shared world nor a pair applies (a notebook client that is not of the cluster,
a worker that has no MPI yet) the connection carries every frame on its socket (logged once per
process at INFO level).

Messages
--------
One constructor each; every one starts with ``"magic": MAGIC``.  After the hellos, the key
``"proof"`` (the client's) or ``"verdict"`` (the server's) says what a message is.

==================  ======  =====================================================================  ======
constructor         sender  fields after ``magic``                                                 step
==================  ======  =====================================================================  ======
``hello``           client  ``version`` (``PROTOCOL_VERSION``), ``rank``, ``size``, ``job``,       1
                            ``host``, ``pid``, ``nonce`` (32 hex digits), ``up`` (MPI is up),
                            ``cluster`` (its service id, or ""), ``ident`` (its world, or "")
``server_hello``    server  those of ``hello``, then ``mpi``, ``pair`` (bools), ``links`` (ids)    2
``proof_sent``      client  ``proof``: "sent"                                                      3
``proof_none``      client  ``proof``: "none"                                                      3, 3p
``proof_pair``      client  ``proof``: "pair", ``tag``, ``use``, ``mac``                           3p
``verdict_mpi``     server  ``verdict``: "mpi"                                                     4
``verdict_socket``  server  ``verdict``: "socket"                                                  4, 4p
``verdict_busy``    server  ``verdict``: "busy"                                                    4p
``verdict_pair``    server  ``verdict``: "pair", ``tag``, ``mac``, ``id``, and ``port`` when new    4p
==================  ======  =====================================================================  ======
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import json
import logging
import os
import random
import socket
import struct
import time

import dask
from distributed.comm.core import CommClosedError, FatalCommClosedError

from . import _credentials, _metrics, _mpi, _sockets
from ._channel import _Channel
from ._datapath import _Link
from ._endpoint import _Endpoint, backoff

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 8  # 2: headers on the socket, MPI frames joined into runs; 3: pairs of worlds (proof_pair);
# 4: the pair join's go byte (step 6p); 5: a record's few large MPI frames each an MPI message (_wire.mpi_runs);
# 6: a goodbye over MPI is answered, the abort record X (_wire); 7: a buffer per MPI frame, shards marked
# (_wire.frame_routes), the JOINED bit; 8: frames from 64 KiB over MPI in a bulk message (_wire.BULK_FRAME)
MAGIC = "mpi4dask"
GO = b"G"  # step 6p: the client is entering MPI_Comm_connect
HANDSHAKE_MAX = 64 << 10  # bytes of one handshake message
UNKNOWN_JOB_PROOF_TIMEOUT = 3.0  # seconds to wait for a proof when no side knows its launcher's job

_warned_socket_fallback = False


# --------------------------------------------------------------------------------------------
# The messages


PROOF = "proof"
VERDICT = "verdict"


class Proof:
    """What the client's ``"proof"`` says (step 3)."""

    SENT = "sent"  # its proof is on its way over MPI
    NONE = "none"  # it offers none: the connection carries its messages on the socket
    PAIR = "pair"  # it asks to join (or reuse) a pair of worlds


class Verdict:
    """What the server's ``"verdict"`` says (step 4, and the pair sub-protocol)."""

    MPI = "mpi"  # the client's proof arrived, the server's is on its way: frames go over MPI
    SOCKET = "socket"  # the connection carries its messages on the socket
    PAIR = "pair"  # the pair of worlds to use (and, for a new one, the port to connect to)
    BUSY = "busy"  # the server is joining another process: claim again later


def hello(w, nonce: bytes) -> dict:
    """Step 1, and the first part of step 2: our side of the hello; ``w`` is None while this process
    has no MPI yet (a Dask worker waiting for its cluster's credentials, see :mod:`mpi4dask.pm`)."""
    creds = _credentials.credentials()
    return {
        "magic": MAGIC,
        "version": PROTOCOL_VERSION,
        "rank": w.rank if w else 0,
        "size": w.size if w else 1,
        "job": w.job_key if w else "",
        "host": w.host if w else socket.gethostname(),
        "pid": w.pid if w else os.getpid(),
        "nonce": nonce.hex(),
        "up": w is not None,
        # may join through MPI_Comm_connect/accept: a launched or served world, and the cluster it is in
        "cluster": creds.service if (w is not None and w.dynamic and creds is not None) else "",
        "ident": w.ident if w else "",
    }


def server_hello(w, nonce: bytes, mpi: bool, pair: bool, links: list[str]) -> dict:
    """Step 2: the server's hello, and what its cheap checks allow: a shared world (``mpi``), a pair of
    worlds (``pair``), and the ids of the pairs it already has with the client (``links``)."""
    return {**hello(w, nonce), "mpi": mpi, "pair": pair, "links": links}


def proof_sent() -> dict:
    return {"magic": MAGIC, PROOF: Proof.SENT}


def proof_none() -> dict:
    return {"magic": MAGIC, PROOF: Proof.NONE}


def proof_pair(tag: int, use: str | None, mac: str) -> dict:
    """The client's claim of a pair: its receive tag, the pair it would reuse (None: a new one), and its
    proof that it knows the cluster's secret."""
    return {"magic": MAGIC, PROOF: Proof.PAIR, "tag": tag, "use": use, "mac": mac}


def verdict_mpi() -> dict:
    return {"magic": MAGIC, VERDICT: Verdict.MPI}


def verdict_socket() -> dict:
    return {"magic": MAGIC, VERDICT: Verdict.SOCKET}


def verdict_busy() -> dict:
    return {"magic": MAGIC, VERDICT: Verdict.BUSY}


def verdict_pair(tag: int, mac: str, pair_id: str, port: str | None = None) -> dict:
    """The server's answer to a pair claim: its receive tag, its proof that it knows the cluster's
    secret, the pair's id, and for a new pair the MPI port to connect to."""
    msg = {"magic": MAGIC, VERDICT: Verdict.PAIR, "tag": tag, "mac": mac, "id": pair_id}
    if port is not None:
        msg["port"] = port
    return msg


_HS_LEN = struct.Struct("<I")


def _pop_message(pending: bytearray) -> dict | Exception | None:
    """Take one whole handshake message off the front of ``pending``: the message, an exception when the
    peer is not an mpi4dask endpoint, or None while the message is incomplete."""
    if len(pending) < _HS_LEN.size:
        return None
    (n,) = _HS_LEN.unpack_from(pending)
    if n > HANDSHAKE_MAX:
        return _NotAnEndpoint(f"peer is not an mpi4dask endpoint (it announced a handshake message of {n} bytes)")
    if len(pending) < _HS_LEN.size + n:
        return None
    raw = bytes(pending[_HS_LEN.size : _HS_LEN.size + n])
    del pending[: _HS_LEN.size + n]
    try:
        msg = json.loads(raw)
    except ValueError:
        return _NotAnEndpoint("peer is not an mpi4dask endpoint (bad handshake message)")
    if not isinstance(msg, dict) or msg.get("magic") != MAGIC:
        return _NotAnEndpoint("peer is not an mpi4dask endpoint (bad handshake magic)")
    return msg


async def _read_message(ch: _Channel) -> dict:
    """The peer's next handshake message, waiting for it."""
    while (msg := _pop_message(ch.pending)) is None:
        await ch.arrival()
    if isinstance(msg, Exception):
        raise msg
    return msg


def _write_message(ch: _Channel, msg: dict) -> None:
    raw = json.dumps(msg).encode()
    ch.write(_HS_LEN.pack(len(raw)) + raw)


def connect_timeout() -> float:
    """distributed's connect timeout, in seconds: what a handshake's waits may take in all."""
    return dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "seconds")


# --------------------------------------------------------------------------------------------
# What each side checks


def _check_hello(msg: dict, peer_addr: str) -> dict:
    """Validate a peer's hello; return it with its nonce as bytes."""
    if msg.get("version") != PROTOCOL_VERSION:
        raise FatalCommClosedError(
            f"{peer_addr} speaks mpi4dask protocol version {msg.get('version')!r}, this process speaks "
            f"{PROTOCOL_VERSION}: install the same mpi4dask version on both ends"
        )
    types = {"rank": int, "size": int, "job": str, "host": str, "pid": int, "nonce": str, "up": bool,
             "cluster": str, "ident": str}
    try:
        if any(type(msg[k]) is not t for k, t in types.items()):
            raise ValueError
        nonce = bytes.fromhex(msg["nonce"])
        if len(nonce) != 16 or msg["size"] < 1 or len(msg["ident"]) > 512:
            raise ValueError
    except (KeyError, ValueError):
        raise FatalCommClosedError(f"{peer_addr} sent a malformed mpi4dask handshake") from None
    return {**msg, "nonce": nonce}


def _same_process(w, peer: dict) -> bool:
    return peer["host"] == w.host and peer["pid"] == w.pid


def _local_pid(w, peer: dict) -> int:
    """The peer's pid when it runs on this node (MPI may copy from its memory), else 0."""
    return peer["pid"] if peer["host"] == w.host else 0


def _may_share_world(w, peer: dict) -> bool:
    """Cheap checks of a peer's claims; a True still needs the proof over MPI."""
    if w is None or not peer["up"]:
        return False
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


def _may_pair(w, peer: dict) -> bool:
    """Both ends can join their worlds (connect/accept) and say they are of one cluster; a True still
    needs each side's proof that it knows the cluster's secret."""
    creds = _credentials.credentials()
    return (
        w is not None and w.dynamic and not _mpi.joins_unsafe() and creds is not None and peer["up"]
        and peer["cluster"] == creds.service and bool(peer["ident"]) and not _may_share_world(w, peer)
    )


def _proof_timeout(w, peer: dict) -> float | None:
    """How long to wait for a peer's proof; None: wait as long as the connection may take, and
    refuse the connection without it (the peer's claims were checked against a known job)."""
    known = bool(w.job_key) or _same_process(w, peer)
    return None if known else UNKNOWN_JOB_PROOF_TIMEOUT


def _valid_tag(ep: _Endpoint, tag) -> bool:
    return type(tag) is int and 0 <= tag < ep.w.tag_ub


class _Refused(FatalCommClosedError):
    """A peer claimed to be a rank of this MPI job, or of this cluster, and did not prove it."""


class _NotAnEndpoint(FatalCommClosedError):
    """The peer's first bytes are no mpi4dask handshake (a tcp:// client given an mpi:// listener's port, a
    scanner, another service)."""


def _note_socket_fallback(peer_addr: str, peer: dict, w) -> None:
    global _warned_socket_fallback
    creds = _credentials.credentials()
    if _mpi.joins_unsafe():
        why, reason = _mpi.joins_unsafe(), "joins_failed"
    elif w is None and (refused := _mpi.service_refused()):
        why, reason = refused, "no_service"
    elif w is None or not peer["up"]:
        reason = "mpi_not_up"
        why = "MPI is not up on both ends yet (a Dask worker starts MPI once its scheduler's MPI service lets it in)"
    elif peer["cluster"] or (creds is not None and w.dynamic):
        reason = "other_cluster"
        why = ("the two processes are not of one cluster's MPI service (mpi4dask.pm): only the scheduler's own "
               "workers, and processes of the same mpiexec job, share MPI")
    elif w.size == 1 and peer["size"] == 1:
        reason = "not_launched_together"
        why = ("processes that were not launched together by mpiexec, and have no scheduler's MPI service in common "
               "(it starts with any scheduler listening on mpi://, or with run_mpi)")
    else:
        reason = "other_world"
        why = (
            f"the peer is rank {peer['rank']} of an MPI world of {peer['size']} on {peer['host']}, outside this "
            f"process's world (rank {w.rank} of {w.size}); to use MPI, launch both in one mpiexec job"
        )
    _metrics.fallback(reason, peer_addr)
    if not _warned_socket_fallback:
        _warned_socket_fallback = True
        logger.info("mpi4dask: the connection with %s carries its messages over TCP: %s. (Logged once.)",
                    peer_addr, why)
    else:
        logger.debug("mpi4dask: socket fallback for %s: %s", peer_addr, why)


async def _read_kind(ch: _Channel, peer_addr: str, key: str, allowed: tuple[str, ...]) -> dict:
    msg = await _read_message(ch)
    if msg.get(key) not in allowed:
        raise FatalCommClosedError(f"{peer_addr} sent a malformed mpi4dask handshake ({key}={msg.get(key)!r})")
    return msg


async def _read_proof(ch: _Channel, peer_addr: str, allowed: tuple[str, ...]) -> dict:
    """The client's next message, a proof of one of the kinds ``allowed`` (the server's side)."""
    return await _read_kind(ch, peer_addr, PROOF, allowed)


async def _read_verdict(ch: _Channel, peer_addr: str, allowed: tuple[str, ...]) -> dict:
    """The server's next message, a verdict of one of the kinds ``allowed`` (the client's side)."""
    return await _read_kind(ch, peer_addr, VERDICT, allowed)


async def _settle_on_socket(ch: _Channel, peer_addr: str) -> None:
    """The client offers no proof and takes the server's socket verdict."""
    _write_message(ch, proof_none())
    await _read_verdict(ch, peer_addr, (Verdict.SOCKET,))


def _pair_mac(side: bytes, first: bytes, second: bytes) -> str:
    return _credentials.credentials().mac(b"mpi4dask-pair", side, first, second)


# --------------------------------------------------------------------------------------------
# The two sides


async def client(ch: _Channel, ep: _Endpoint | None, peer_addr: str) -> _Link | None:
    """The connecting side: the link over which the connection's MPI frames travel, or None when all
    of them travel on its socket."""
    w = ep.w if ep is not None else None
    nonce = os.urandom(16)
    _write_message(ch, hello(w, nonce))
    peer = _check_hello(await _read_message(ch), peer_addr)
    if peer.get("mpi") is True and _may_share_world(w, peer):
        recv_tag = ep.tags.allocate()
        ep.proofs.send(peer["rank"], peer["nonce"], recv_tag)
        _write_message(ch, proof_sent())
        if (await _read_verdict(ch, peer_addr, (Verdict.MPI, Verdict.SOCKET)))[VERDICT] == Verdict.MPI:
            send_tag = await ep.proofs.take(peer["rank"], nonce, connect_timeout())
            if not _valid_tag(ep, send_tag):
                raise FatalCommClosedError(
                    f"{peer_addr} claims to be rank {peer['rank']} of this MPI job but sent no valid proof over MPI"
                )
            return _Link(ep, peer["rank"], send_tag, recv_tag, peer_pid=_local_pid(w, peer))
    elif peer.get("pair") is True and _may_pair(w, peer):
        link = await _pair_client(ep, ch, peer_addr, peer, nonce)
        if link is not None:
            return link
    else:
        await _settle_on_socket(ch, peer_addr)
    _note_socket_fallback(peer_addr, peer, w)
    return None


async def server(ch: _Channel, ep: _Endpoint | None, peer_addr: str, accepting) -> _Link | None:
    """The listening side: the link over which the connection's MPI frames travel, or None when all of
    them travel on its socket.  ``accepting()`` is False once the listener was stopped."""
    w = ep.w if ep is not None else None
    peer = _check_hello(await _read_message(ch), peer_addr)
    nonce = os.urandom(16)
    candidate = _may_share_world(w, peer)
    pair = _may_pair(w, peer)
    _write_message(ch, server_hello(w, nonce, candidate, pair, ep.pairs.ids(peer["ident"]) if pair else []))
    claim = await _read_proof(ch, peer_addr, (Proof.SENT, Proof.NONE, Proof.PAIR))
    send_tag = None
    if candidate and claim[PROOF] == Proof.SENT:
        timeout = _proof_timeout(w, peer)
        send_tag = await ep.proofs.take(peer["rank"], nonce, connect_timeout() if timeout is None else timeout)
        if not _valid_tag(ep, send_tag):
            send_tag = None
            if timeout is None:
                raise _Refused(
                    f"it claims to be rank {peer['rank']} of this MPI job (pid {peer['pid']} on {peer['host']!r}) "
                    "but sent no valid proof over MPI"
                )
    elif pair and claim[PROOF] == Proof.PAIR:
        link = await _pair_server(ep, ch, peer_addr, peer, nonce, claim, accepting)
        if link is not None:
            return link
    elif claim[PROOF] == Proof.PAIR:
        raise _Refused(f"it asked to join MPI as a process of cluster {peer['cluster']!r}, which this process "
                       "is not in")
    if not accepting():
        raise CommClosedError("the listener was stopped during the mpi4dask handshake")
    if send_tag is not None:
        recv_tag = ep.tags.allocate()
        ep.proofs.send(peer["rank"], peer["nonce"], recv_tag)
        _write_message(ch, verdict_mpi())
        return _Link(ep, peer["rank"], send_tag, recv_tag, peer_pid=_local_pid(w, peer))
    _write_message(ch, verdict_socket())
    _note_socket_fallback(peer_addr, peer, w)
    return None


# --------------------------------------------------------------------------------------------
# The pair sub-protocol


async def _flushed_socket(ch: _Channel, deadline: float, peer_addr: str):
    """The channel's socket, once everything written on the channel is on it (step 6p's byte goes
    straight to the socket, after them)."""
    async for _ in backoff(1e-4, 0.01):
        if ch.lost:
            raise CommClosedError(f"connection to {peer_addr} closed during the mpi4dask handshake: {ch.lost_exc}")
        if ch.all_sent():
            return ch.transport.get_extra_info("socket")
        if time.monotonic() > deadline:
            raise FatalCommClosedError(f"mpi4dask: {peer_addr} did not read this side's handshake messages for the "
                                       "connect timeout")
    raise AssertionError("unreachable")


async def _pair_client(ep: _Endpoint, ch: _Channel, peer_addr: str, peer: dict, nonce: bytes) -> _Link | None:
    """The connecting side of a pair (steps 3p and 5p); None when the connection is to carry its messages
    over TCP after all (one side's joins failed while this one waited for its turn)."""
    pairs = ep.pairs
    recv_tag = ep.tags.allocate()
    deadline = time.monotonic() + connect_timeout()
    offered = peer.get("links") if isinstance(peer.get("links"), list) else []
    for attempt in itertools.count():
        if attempt:
            await asyncio.sleep(random.uniform(0.002, 0.01) * 2 ** min(attempt, 5))
        reuse = next((i for i in pairs.ids(peer["ident"]) if i in offered), None)
        holding = reuse is None
        if holding:
            await pairs.take_slot(deadline, peer_addr)
        try:
            if holding and _mpi.joins_unsafe():  # a join failed while this one waited for the slot
                await _settle_on_socket(ch, peer_addr)
                return None
            _write_message(ch, proof_pair(recv_tag, reuse, _pair_mac(b"client", peer["nonce"], nonce)))
            reply = await _read_verdict(ch, peer_addr, (Verdict.PAIR, Verdict.BUSY, Verdict.SOCKET))
            if reply[VERDICT] == Verdict.SOCKET:  # the server's joins failed meanwhile
                return None
            if reply[VERDICT] == Verdict.BUSY:
                if time.monotonic() > deadline:
                    raise FatalCommClosedError(f"{peer_addr} was busy joining other MPI processes for the whole "
                                               "connect timeout")
                continue
            if not hmac.compare_digest(str(reply.get("mac", "")), _pair_mac(b"server", nonce, peer["nonce"])):
                raise _Refused(f"{peer_addr} did not prove that it knows this cluster's secret")
            send_tag = reply.get("tag")
            if not _valid_tag(ep, send_tag) or not isinstance(reply.get("id"), str):
                raise FatalCommClosedError(f"{peer_addr} sent a malformed mpi4dask handshake (pair)")
            if isinstance(reply.get("port"), str):
                if not holding:  # it no longer had the pair we offered: a new join needs our slot too
                    await pairs.take_slot(deadline, peer_addr)
                    holding = True
                go = _sockets.Signal(await _flushed_socket(ch, deadline, peer_addr), GO)
                route = await pairs.join("connect", reply["port"], deadline, peer_addr, go,
                                         functools.partial(pairs.add, peer["ident"], reply["id"]))
            else:
                route = pairs.route(peer["ident"], reply["id"])
                if route is None:
                    raise FatalCommClosedError(f"{peer_addr} chose an MPI pair this process does not have")
            return _Link(ep, 0, send_tag, recv_tag, route, _local_pid(ep.w, peer))
        finally:
            if holding:
                pairs.release_slot()
    raise AssertionError("unreachable")


async def _pair_server(ep: _Endpoint, ch: _Channel, peer_addr: str, peer: dict, nonce: bytes, claim: dict,
                       accepting) -> _Link | None:
    """The listening side of a pair claim (step 4p); None when the connection is to carry its messages
    over TCP after all (one side's joins failed while this one waited): the caller says so."""
    pairs, MPI = ep.pairs, ep.w.MPI
    recv_tag = ep.tags.allocate()
    deadline = time.monotonic() + connect_timeout()
    while True:
        if not hmac.compare_digest(str(claim.get("mac", "")), _pair_mac(b"client", nonce, peer["nonce"])):
            raise _Refused(f"it claims to be a process of this cluster (pid {peer['pid']} on {peer['host']!r}) "
                           "but did not prove that it knows the cluster's secret")
        send_tag = claim.get("tag")
        if not _valid_tag(ep, send_tag):
            raise FatalCommClosedError(f"{peer_addr} sent a malformed mpi4dask handshake (pair tag)")
        if not accepting():
            raise CommClosedError("the listener was stopped during the mpi4dask handshake")
        mac = _pair_mac(b"server", peer["nonce"], nonce)
        route = pairs.route(peer["ident"], claim.get("use"))
        if route is not None:
            _write_message(ch, verdict_pair(recv_tag, mac, claim["use"]))
            return _Link(ep, 0, send_tag, recv_tag, route, _local_pid(ep.w, peer))
        if pairs.try_slot():
            break
        _write_message(ch, verdict_busy())
        claim = await _read_proof(ch, peer_addr, (Proof.PAIR, Proof.NONE))
        if claim[PROOF] == Proof.NONE:  # the client's joins failed while it waited
            return None
    try:
        if _mpi.joins_unsafe():  # this process's joins failed while the client waited
            return None
        port = MPI.Open_port()
        try:
            pair_id = os.urandom(8).hex()
            verdict = verdict_pair(recv_tag, mac, pair_id, port)
            go = _sockets.Signal(await _flushed_socket(ch, deadline, peer_addr), GO, deadline)
            ch.transport.pause_reading()  # the client's GO is for the join thread
            try:
                route = await pairs.join("accept", port, deadline, peer_addr, go,
                                         functools.partial(pairs.add, peer["ident"], pair_id),
                                         lambda: _write_message(ch, verdict))
            finally:
                ch.transport.resume_reading()
        finally:
            MPI.Close_port(port)
        return _Link(ep, 0, send_tag, recv_tag, route, _local_pid(ep.w, peer))
    finally:
        pairs.release_slot()
