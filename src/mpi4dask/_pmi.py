"""Joining MPI through a process manager (private): the PMI side of a world of one.

A process that no launcher started gets its MPI world from :mod:`mpi4dask._mpi`, which hands MPICH a
PMI connection (``PMI_FD``) to a relay (:class:`_Relay`) in this process.  The relay passes MPICH's
requests on to the cluster's MPI service (:mod:`mpi4dask.pm`, reached with the process's
credentials: :func:`join`), or answers them itself (:func:`local`) as a world of one
(:class:`World1`, which the service uses too).

Wire format (one TCP connection per joining process, lines of ``cmd=<name> key=value ...``)
---------------------------------------------------------------------------------------------
1. service -> process: ``cmd=mpi4dask-challenge service=<id> nonce=<32 hex>``
2. process -> service: ``cmd=mpi4dask-auth mac=<HMAC-SHA256(secret, nonce), hex>``
3. service -> process: ``cmd=mpi4dask-welcome kvsname=<name>`` (or it logs the refusal and closes)
4. then PMI-1, request and answer one line each, as MPICH's ``MPI_Init`` speaks it: ``init``,
   ``get_maxes``, ``get_appnum``, ``get_my_kvsname``, ``get_universe_size``, ``put``, ``get``
   (``PMI_process_mapping`` is a world of one), ``barrier_in``, ``finalize``, ``abort``.

The service's side is :meth:`mpi4dask.pm.PMService._serve`, the process's side :func:`join`.  Every
read on either side has a deadline (``STEP_TIMEOUT``); lines are at most ``LINE_MAX`` bytes.  The
process does not hand its socket to MPICH: the relay passes MPICH's lines on until ``MPI_Init`` has
returned, then closes the connection and answers what MPICH asks later (the barrier of
``MPI_Finalize``) itself, as a world of one needs no one else.  So a worker outlives its scheduler
cleanly.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import uuid

from ._credentials import Credentials
from ._errors import MPIServiceError

logger = logging.getLogger(__name__)

STEP_TIMEOUT = 30.0  # seconds any one wire step may take, on either side
LINE_MAX = 64 << 10  # bytes of one line
KVS_MAX = 4096  # keys one process may put


def parse(line: bytes | str) -> dict[str, str]:
    """One PMI line as a dict (``cmd`` and its key=value pairs)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    out = {}
    for item in line.split():
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


def format_line(cmd: str, **fields) -> bytes:
    """One PMI line (the inverse of :func:`parse`)."""
    return (" ".join([f"cmd={cmd}", *(f"{k}={v}" for k, v in fields.items())]) + "\n").encode()


class World1:
    """The PMI-1 answers for a world of one process (the key-value space it puts)."""

    def __init__(self, kvsname: str):
        self.kvsname = kvsname
        self.kvs: dict[str, str] = {}

    def answer(self, req: dict[str, str]) -> bytes | None:
        """The answer line to one request; None for ``abort`` (which has none)."""
        cmd = req.get("cmd", "")
        if cmd == "init":
            return format_line("response_to_init", pmi_version=1, pmi_subversion=1, rc=0)
        if cmd == "get_maxes":
            return format_line("maxes", rc=0, kvsname_max=256, keylen_max=256, vallen_max=1024)
        if cmd == "get_appnum":
            return format_line("appnum", rc=0, appnum=0)
        if cmd == "get_my_kvsname":
            return format_line("my_kvsname", rc=0, kvsname=self.kvsname)
        if cmd == "get_universe_size":
            return format_line("universe_size", rc=0, size=1)
        if cmd == "put":
            if len(self.kvs) >= KVS_MAX and req.get("key") not in self.kvs:
                return format_line("put_result", rc=-1, msg="too_many_keys")
            self.kvs[req.get("key", "")] = req.get("value", "")
            return format_line("put_result", rc=0)
        if cmd == "get":
            key = req.get("key", "")
            if key == "PMI_process_mapping":
                return format_line("get_result", rc=0, value="(vector,(0,1,1))")
            if key in self.kvs and req.get("kvsname") == self.kvsname:
                return format_line("get_result", rc=0, value=self.kvs[key])
            return format_line("get_result", rc=-1, msg="key_not_found")
        if cmd == "barrier_in":
            return format_line("barrier_out", rc=0)
        if cmd == "finalize":
            return format_line("finalize_ack", rc=0)
        if cmd == "abort":
            return None
        return format_line(cmd or "unknown", rc=-1, msg="unsupported")


# What each MPI asks its process manager after MPI_Init, answered ahead by _Relay.detach
MPICH_FINALIZE = format_line("barrier_out", rc=0) + format_line("finalize_ack", rc=0)
INTEL_MPI_FINALIZE = format_line("finalize_ack", rc=0)


# --------------------------------------------------------------------------------------------
# Joining: the relay between MPICH and the service (or the local responder)


class _Relay(threading.Thread):
    """MPICH's PMI file descriptor leads here (one end of a socketpair).  Until :meth:`detach`, each
    request line goes to the service (none: this world of one answers itself) and its answer back.

    After ``MPI_Init`` MPICH asks two more things: ``barrier_in`` in ``MPI_Finalize`` and
    ``finalize`` in a C exit handler, when no Python thread runs any more (and mpi4py's own
    ``MPI_Finalize`` runs holding the GIL); Intel MPI asks ``finalize`` only (measured: given a
    ``barrier_out`` first it prints ``expecting cmd=finalize_ack, got barrier_out``).  So :meth:`detach`
    writes those answers (``finalize_answers``) ahead, into the socket's buffer, and ends the thread: a
    process whose MPI is up runs no thread of ours (distributed's test utilities fail a test that leaves
    one behind).  The socketpair stays open for the life of the process, owned by no Python object:
    MPICH's last two lines land in our end's buffer, unread."""

    def __init__(self, upstream: socket.socket | None, kvsname: str, finalize_answers: bytes = MPICH_FINALIZE):
        super().__init__(name="mpi4dask-pmi", daemon=True)
        self._finalize_answers = finalize_answers
        self._mine, self.theirs = socket.socketpair()
        self._wake_r, self._wake_w = socket.socketpair()  # detach() -> run(): stop reading
        self._up = upstream
        self._up_file = upstream.makefile("rb") if upstream is not None else None
        self._world = World1(kvsname)
        self.kvsname = kvsname
        self._lock = threading.Lock()
        self._detached = False

    def detach(self) -> None:
        """``MPI_Init`` is over: let go of the service, answer the two questions to come, end the thread."""
        with self._lock:
            up, self._up = self._up, None
            up_file, self._up_file = self._up_file, None
            if self._detached:
                return
            self._detached = True
            self._mine.sendall(self._finalize_answers)
        for f in (up_file, up):  # the file first: a socket with a file open stays open (measured: the
            if f is not None:  # service waited 30 s on every worker, then logged it as silent)
                try:
                    f.close()
                except OSError:
                    pass
        self._wake_w.send(b"x")
        if threading.current_thread() is not self:
            self.join(STEP_TIMEOUT)
        for s in (self._wake_r, self._wake_w):
            s.close()
        # MPICH writes its last lines after Python has torn its modules down (mpi4py finalizes MPI in a C
        # exit hook): no Python object may own the socketpair then, or its collection closes MPICH's PMI_FD
        self._mine.detach()
        self.theirs.detach()

    def _ask_upstream(self, raw: bytes, req: dict) -> bytes | None:
        with self._lock:
            up, up_file = self._up, self._up_file
        if up is None:
            return None
        try:
            up.sendall(raw)
            if req.get("cmd") == "abort":
                return None
            answer = up_file.readline(LINE_MAX)
            if not answer:
                raise OSError("the MPI service closed the connection")
            return answer
        except OSError as exc:
            logger.warning("mpi4dask: lost the MPI service while MPI starts (%s); this process answers itself", exc)
            with self._lock:
                self._up = None
            return None

    def _lines(self):
        """MPICH's request lines, until :meth:`detach` (or MPICH closes its end)."""
        buf = bytearray()
        poller = select.poll()  # not select.select: a busy process's descriptors can be past FD_SETSIZE
        poller.register(self._mine, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        wake = self._wake_r.fileno()
        while True:
            if any(fd == wake for fd, _ in poller.poll()):
                return
            try:
                chunk = self._mine.recv(LINE_MAX)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while (end := buf.find(b"\n")) >= 0:
                yield bytes(buf[: end + 1])
                del buf[: end + 1]
            if len(buf) > LINE_MAX:
                logger.warning("mpi4dask: MPI sent its process manager a line of over %d bytes; ignored", LINE_MAX)
                buf.clear()

    def run(self) -> None:
        for raw in self._lines():
            req = parse(raw)
            local = self._world.answer(req)  # keeps this world's own puts either way
            answer = self._ask_upstream(raw, req) or local
            if answer is None:
                continue
            try:
                self._mine.sendall(answer)
            except OSError:
                return


def _refusal(creds: Credentials, why: str, fix: str) -> Exception:
    return MPIServiceError(f"cannot initialise MPI through the cluster's MPI service at {creds.address}: "
                           f"{why}. {fix}")


def join(creds: Credentials, timeout: float = STEP_TIMEOUT, finalize_answers: bytes = MPICH_FINALIZE) -> _Relay:
    """Authenticate to the service; return the started relay whose ``theirs`` socket MPICH uses
    (``finalize_answers``: see :class:`_Relay`)."""
    host, _, port = creds.address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except OSError as exc:
        raise _refusal(creds, f"unreachable ({exc})", "It listens on the scheduler's host, on a port of its own "
                       "(MPI4DASK_PM_PORT on the scheduler fixes it): this process must reach that port") from None
    try:
        sock.settimeout(timeout)
        f = sock.makefile("rb")
        hello = parse(f.readline(LINE_MAX))
        if hello.get("cmd") != "mpi4dask-challenge" or hello.get("service") != creds.service:
            raise _refusal(creds, f"the process there is not this cluster's MPI service (it said {hello!r:.120})",
                           "The scheduler may have restarted: reconnect to it")
        sock.sendall(format_line("mpi4dask-auth", mac=creds.mac(hello.get("nonce", "").encode())))
        welcome = parse(f.readline(LINE_MAX))
        if welcome.get("cmd") != "mpi4dask-welcome" or not welcome.get("kvsname"):
            raise _refusal(creds, "the service refused this process's secret",
                           "The credentials belong to another scheduler, or to an earlier run of this one")
    except TimeoutError:
        sock.close()
        raise _refusal(creds, f"no answer within {timeout:.0f} s", "Check that the scheduler is alive") from None
    except OSError as exc:
        sock.close()
        raise _refusal(creds, f"the connection failed ({exc})", "Check that the scheduler is alive") from None
    except BaseException:
        sock.close()
        raise
    relay = _Relay(sock, welcome["kvsname"], finalize_answers)
    relay.start()
    return relay


def local(finalize_answers: bytes = MPICH_FINALIZE) -> _Relay:
    """A relay with no service behind it: this process forms a world of one on its own."""
    relay = _Relay(None, f"mpi4dask-local-{uuid.uuid4().hex}", finalize_answers)
    relay.start()
    return relay
