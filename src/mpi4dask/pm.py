"""Process management: MPI without ``mpiexec``, for any Dask cluster.

A process can initialise MPI once in its life, and MPICH chooses how at ``MPI_Init``: from a
launcher's environment (hydra sets ``PMI_SIZE``/``PMI_FD``), else as a *singleton*.  Singletons of
MPICH 5.0 cannot ``MPI_Comm_connect``/``MPI_Comm_accept`` (pmods/mpich#7805), so processes that Dask
started (``LocalCluster``, ``dask worker``, dask-jobqueue, Kubernetes, a Nanny's restart) could
never share MPI.  This module gives every such process a *served* world of one instead: MPICH talks
the PMI-1 wire protocol to a file descriptor (``PMI_FD``), behind which sits

* the **service** (:class:`PMService`), a scheduler extension: a PMI-1 server listening on the
  scheduler's host, next to the scheduler's own port.  Workers reach it with credentials
  (address, secret, service id) that the scheduler hands them over their Dask connection, as a
  worker plugin (:class:`_JoinPlugin`), to every worker that joins, now or later;
* or, in a process that knows no service (a test, a notebook, a client), a **local responder**
  answering the same protocol inside the process.

Worlds formed either way can join each other with ``MPI_Comm_connect``/``MPI_Comm_accept``: the
``mpi://`` transport does so per pair of processes (:mod:`mpi4dask.comm`), :func:`mpi4dask.run_mpi`
per set of participants (:mod:`mpi4dask.handoff`).  Who may join is decided by the cluster's
secret: the service refuses (and logs) a connection that cannot prove it knows it, and so do
``mpi://`` peers before they open an MPI port for each other.

Wire format (one TCP connection per joining process, lines of ``cmd=<name> key=value ...``)
---------------------------------------------------------------------------------------------
1. service -> process: ``cmd=mpi4dask-challenge service=<id> nonce=<32 hex>``
2. process -> service: ``cmd=mpi4dask-auth mac=<HMAC-SHA256(secret, nonce), hex>``
3. service -> process: ``cmd=mpi4dask-welcome kvsname=<name>`` (or it logs the refusal and closes)
4. then PMI-1, request and answer one line each, as MPICH's ``MPI_Init`` speaks it: ``init``,
   ``get_maxes``, ``get_appnum``, ``get_my_kvsname``, ``get_universe_size``, ``put``, ``get``
   (``PMI_process_mapping`` is a world of one), ``barrier_in``, ``finalize``, ``abort``.

Every read on either side has a deadline (``STEP_TIMEOUT``); lines are at most ``LINE_MAX``
bytes.  The process does not hand its socket to MPICH: a relay thread (:class:`_Relay`) passes
MPICH's lines on until ``MPI_Init`` has returned, then closes the connection and answers what
MPICH asks later (the barrier of ``MPI_Finalize``) itself, as a world of one needs no one else.
So a worker outlives its scheduler cleanly.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import select
import socket
import threading
import uuid

from ._credentials import Credentials, credentials, set_credentials
from ._errors import MPIUnavailableError
from ._sockets import bind

logger = logging.getLogger(__name__)

STEP_TIMEOUT = 30.0  # seconds any one wire step may take, on either side
LINE_MAX = 64 << 10  # bytes of one line
KVS_MAX = 4096  # keys one process may put
PLUGIN_NAME = "mpi4dask-pm"
EXTENSION = "mpi4dask"

__all__ = ["Credentials", "PMService", "credentials"]


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


def _line(cmd: str, **fields) -> bytes:
    return (" ".join([f"cmd={cmd}", *(f"{k}={v}" for k, v in fields.items())]) + "\n").encode()


class _World1:
    """The PMI-1 answers for a world of one process (the key-value space it puts)."""

    def __init__(self, kvsname: str):
        self.kvsname = kvsname
        self.kvs: dict[str, str] = {}

    def answer(self, req: dict[str, str]) -> bytes | None:
        """The answer line to one request; None for ``abort`` (which has none)."""
        cmd = req.get("cmd", "")
        if cmd == "init":
            return _line("response_to_init", pmi_version=1, pmi_subversion=1, rc=0)
        if cmd == "get_maxes":
            return _line("maxes", rc=0, kvsname_max=256, keylen_max=256, vallen_max=1024)
        if cmd == "get_appnum":
            return _line("appnum", rc=0, appnum=0)
        if cmd == "get_my_kvsname":
            return _line("my_kvsname", rc=0, kvsname=self.kvsname)
        if cmd == "get_universe_size":
            return _line("universe_size", rc=0, size=1)
        if cmd == "put":
            if len(self.kvs) >= KVS_MAX and req.get("key") not in self.kvs:
                return _line("put_result", rc=-1, msg="too_many_keys")
            self.kvs[req.get("key", "")] = req.get("value", "")
            return _line("put_result", rc=0)
        if cmd == "get":
            key = req.get("key", "")
            if key == "PMI_process_mapping":
                return _line("get_result", rc=0, value="(vector,(0,1,1))")
            if key in self.kvs and req.get("kvsname") == self.kvsname:
                return _line("get_result", rc=0, value=self.kvs[key])
            return _line("get_result", rc=-1, msg="key_not_found")
        if cmd == "barrier_in":
            return _line("barrier_out", rc=0)
        if cmd == "finalize":
            return _line("finalize_ack", rc=0)
        if cmd == "abort":
            return None
        return _line(cmd or "unknown", rc=-1, msg="unsupported")


# --------------------------------------------------------------------------------------------
# The service, in the scheduler


class PMService:
    """The scheduler's process-manager service (see the module docstring).

    ``scheduler.extensions["mpi4dask"]`` once installed by :func:`install`.  It also keeps the
    rendezvous values (MPI port names) that :func:`mpi4dask.run_mpi` exchanges while it forms a
    communicator: the handlers ``mpi4dask_kv_put`` and ``mpi4dask_kv_get``.
    """

    def __init__(self, host: str = "", port: int = 0):
        self.host, self.port = host, port
        self.credentials: Credentials | None = None
        self.joined: dict[str, dict] = {}  # kvsname -> {"peer": ..., "pid": ...}
        self.refused = 0
        self._servers: list[asyncio.AbstractServer] = []
        self._counter = itertools.count()
        self._kv: dict[str, str] = {}
        self._kv_waiters: dict[str, asyncio.Event] = {}

    async def start(self) -> PMService:
        from distributed.utils import get_ip

        socks = bind("" if self.host in ("0.0.0.0", "::") else self.host, self.port, 128)
        self._servers = [await asyncio.start_server(self._serve, sock=sock, limit=LINE_MAX) for sock in socks]
        port = socks[0].getsockname()[1]
        host = self.host if self.host not in ("", "0.0.0.0", "::") else get_ip()  # as a wildcard tcp:// listener
        host = f"[{host}]" if ":" in host else host
        self.credentials = Credentials(f"{host}:{port}", os.urandom(32), uuid.uuid4().hex[:16])
        return self

    async def close(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        who = f"{peer[0]}:{peer[1]}" if peer else "?"
        creds = self.credentials
        last = "the challenge"  # the last step heard of, for the log
        try:
            nonce = os.urandom(16).hex()
            writer.write(_line("mpi4dask-challenge", service=creds.service, nonce=nonce))
            auth = parse(await asyncio.wait_for(reader.readline(), STEP_TIMEOUT))
            if auth.get("cmd") != "mpi4dask-auth" or not hmac.compare_digest(
                    auth.get("mac", ""), creds.mac(nonce.encode())):
                self.refused += 1
                logger.warning("mpi4dask: the MPI service refused a connection from %s: it did not prove it knows "
                               "this cluster's secret (not one of this cluster's processes)", who)
                return
            world = _World1(f"mpi4dask-{creds.service}-{next(self._counter)}")
            self.joined[world.kvsname] = {"peer": who}
            writer.write(_line("mpi4dask-welcome", kvsname=world.kvsname))
            logger.debug("mpi4dask: %s joins MPI as %s", who, world.kvsname)
            while True:
                raw = await asyncio.wait_for(reader.readline(), STEP_TIMEOUT)
                if not raw:
                    return
                req = parse(raw)
                last = req.get("cmd", "?")
                if req.get("cmd") == "abort":
                    logger.error("mpi4dask: %s (%s) aborted MPI: %s", world.kvsname, who, raw.decode(errors="replace"))
                    return
                writer.write(world.answer(req))
                await writer.drain()
        except asyncio.CancelledError:  # the scheduler's loop is ending
            return
        except (asyncio.TimeoutError, TimeoutError):
            logger.warning("mpi4dask: the MPI service dropped %s: silent for %.0f s in the middle of joining "
                           "(after %s)", who, STEP_TIMEOUT, last)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:  # ValueError: a line over LINE_MAX
            logger.info("mpi4dask: the MPI service dropped %s: %s", who, exc)
        finally:
            writer.close()

    # -- rendezvous values for run_mpi (handlers on the scheduler)
    def kv_put(self, key: str, value: str) -> None:
        self._kv[key] = value
        ev = self._kv_waiters.pop(key, None)
        if ev is not None:
            ev.set()

    async def kv_get(self, key: str, timeout: float) -> str | None:
        if key not in self._kv:
            ev = self._kv_waiters.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), timeout)
            except (asyncio.TimeoutError, TimeoutError):
                return None
        return self._kv.get(key)

    def kv_drop(self, prefix: str) -> None:
        for k in [k for k in self._kv if k.startswith(prefix)]:
            del self._kv[k]


async def install(scheduler, host: str | None = None) -> PMService:
    """Start the service on ``scheduler`` (once; later calls return it) and hand its credentials to
    every worker, current and future, as a worker plugin."""
    from distributed.protocol import pickle

    svc = scheduler.extensions.get(EXTENSION)
    if svc is not None:
        return svc
    if host is None:
        from distributed.comm import get_address_host

        host = get_address_host(scheduler.address)
    svc = PMService(host, int(os.environ.get("MPI4DASK_PM_PORT", "0") or 0))
    await svc.start()
    scheduler.extensions[EXTENSION] = svc
    scheduler.handlers.update({
        "mpi4dask_kv_put": lambda key, value: svc.kv_put(key, value),
        "mpi4dask_kv_get": lambda key, timeout: svc.kv_get(key, timeout),
        "mpi4dask_kv_drop": lambda prefix: svc.kv_drop(prefix),
    })
    scheduler.add_plugin(_ServicePlugin(svc), name="mpi4dask-pm-service")  # closes it with the scheduler
    set_credentials(svc.credentials)  # the scheduler's own process joins through it too
    scheduler.worker_plugins[PLUGIN_NAME] = pickle.dumps(_JoinPlugin(svc.credentials))  # for workers to come
    logger.info("mpi4dask: MPI service for this cluster at %s (id %s)", svc.credentials.address,
                svc.credentials.service)
    return svc


def _scheduler_plugin_base():
    from distributed.diagnostics.plugin import SchedulerPlugin

    return SchedulerPlugin


class _ServicePlugin(_scheduler_plugin_base()):
    def __init__(self, svc: PMService):
        self.svc = svc

    async def close(self) -> None:
        await self.svc.close()


async def _register_plugin(scheduler, svc: PMService) -> None:
    """Hand the credentials to the workers already registered (future ones get them on registration)."""
    from distributed.protocol import pickle

    if scheduler.workers:
        await scheduler.register_worker_plugin(None, pickle.dumps(_JoinPlugin(svc.credentials)), PLUGIN_NAME,
                                               idempotent=False)


async def install_on_scheduler(dask_scheduler=None) -> dict:
    """For ``client.run_on_scheduler``: install the service on a running scheduler (any protocol)."""
    svc = await install(dask_scheduler)
    await _register_plugin(dask_scheduler, svc)
    return {"address": svc.credentials.address, "service": svc.credentials.service}


# --------------------------------------------------------------------------------------------
# The worker side


def _worker_plugin_base():
    from distributed.diagnostics.plugin import WorkerPlugin

    return WorkerPlugin


class _JoinPlugin(_worker_plugin_base()):
    """Carries the cluster's credentials to a worker (over its Dask connection to the scheduler)."""

    name = PLUGIN_NAME

    def __init__(self, creds: Credentials):
        self.creds = creds

    def setup(self, worker):
        set_credentials(self.creds)
        listener = getattr(worker, "listeners", [None])[0] if getattr(worker, "listeners", None) else None
        if listener is not None and getattr(listener, "prefix", "") == "mpi://":
            from . import _mpi

            _mpi.start()  # its mpi:// connections can use MPI once it is up


# --------------------------------------------------------------------------------------------
# Joining: the relay between MPICH and the service (or the local responder)


class _Relay(threading.Thread):
    """MPICH's PMI file descriptor leads here (one end of a socketpair).  Until :meth:`detach`, each
    request line goes to the service (none: this world of one answers itself) and its answer back.

    After ``MPI_Init`` MPICH asks two more things: ``barrier_in`` in ``MPI_Finalize`` and
    ``finalize`` in a C exit handler, when no Python thread runs any more (and mpi4py's own
    ``MPI_Finalize`` runs holding the GIL).  So :meth:`detach` writes both answers ahead, into the
    socket's buffer, and ends the thread: a process whose MPI is up runs no thread of ours (distributed's
    test utilities fail a test that leaves one behind).  The socketpair stays open for the life of the
    process, owned by no Python object: MPICH's last two lines land in our end's buffer, unread."""

    def __init__(self, upstream: socket.socket | None, kvsname: str):
        super().__init__(name="mpi4dask-pmi", daemon=True)
        self._mine, self.theirs = socket.socketpair()
        self._wake_r, self._wake_w = socket.socketpair()  # detach() -> run(): stop reading
        self._up = upstream
        self._up_file = upstream.makefile("rb") if upstream is not None else None
        self._world = _World1(kvsname)
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
            self._mine.sendall(_line("barrier_out", rc=0) + _line("finalize_ack", rc=0))
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
    return MPIUnavailableError(f"cannot initialise MPI through the cluster's MPI service at {creds.address}: "
                               f"{why}. {fix}")


def join(creds: Credentials, timeout: float = STEP_TIMEOUT) -> _Relay:
    """Authenticate to the service; return the started relay whose ``theirs`` socket MPICH uses."""
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
        sock.sendall(_line("mpi4dask-auth", mac=creds.mac(hello.get("nonce", "").encode())))
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
    relay = _Relay(sock, welcome["kvsname"])
    relay.start()
    return relay


def local() -> _Relay:
    """A relay with no service behind it: this process forms a world of one on its own."""
    relay = _Relay(None, f"mpi4dask-local-{uuid.uuid4().hex}")
    relay.start()
    return relay
