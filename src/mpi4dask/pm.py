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
  answering the same protocol inside the process (:func:`mpi4dask._pmi.local`).

Worlds formed either way can join each other with ``MPI_Comm_connect``/``MPI_Comm_accept``: the
``mpi://`` transport does so per pair of processes (:mod:`mpi4dask._handshake`), :func:`mpi4dask.run_mpi`
per set of participants (:mod:`mpi4dask.handoff`).  Who may join is decided by the cluster's
secret: the service refuses (and logs) a connection that cannot prove it knows it, and so do
``mpi://`` peers before they open an MPI port for each other.

Wire format: :mod:`mpi4dask._pmi`, which also holds the joining side (the relay between MPICH and
this service, :func:`mpi4dask._pmi.join`) and the world-of-one answers that both sides give.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import uuid

from . import _dashboard, _metrics, _mpi, _pmi, _settings
from ._credentials import Credentials, credentials, forget_credentials, set_credentials
from ._pmi import LINE_MAX, World1, format_line, parse
from ._sockets import bind

logger = logging.getLogger(__name__)

PLUGIN_NAME = "mpi4dask-pm"
EXTENSION = "mpi4dask"

__all__ = ["Credentials", "PMService", "credentials"]


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
        """One joining process: the service's side of the wire format (:mod:`mpi4dask._pmi`)."""
        peer = writer.get_extra_info("peername")
        who = f"{peer[0]}:{peer[1]}" if peer else "?"
        creds = self.credentials
        last = "the challenge"  # the last step heard of, for the log
        try:
            nonce = os.urandom(16).hex()
            writer.write(format_line("mpi4dask-challenge", service=creds.service, nonce=nonce))
            auth = parse(await asyncio.wait_for(reader.readline(), _pmi.STEP_TIMEOUT))
            if auth.get("cmd") != "mpi4dask-auth" or not hmac.compare_digest(
                    auth.get("mac", ""), creds.mac(nonce.encode())):
                self.refused += 1
                _metrics.join_failed("service", "refused", who)
                logger.warning("mpi4dask: the MPI service refused a connection from %s: it did not prove it knows "
                               "this cluster's secret (not one of this cluster's processes)", who)
                return
            world = World1(f"mpi4dask-{creds.service}-{next(self._counter)}")
            self.joined[world.kvsname] = {"peer": who}
            writer.write(format_line("mpi4dask-welcome", kvsname=world.kvsname))
            _metrics.joined("service", who)
            logger.debug("mpi4dask: %s joins MPI as %s", who, world.kvsname)
            while True:
                raw = await asyncio.wait_for(reader.readline(), _pmi.STEP_TIMEOUT)
                if not raw:
                    return
                req = parse(raw)
                last = req.get("cmd", "?")
                if req.get("cmd") == "abort":
                    _metrics.join_failed("service", "aborted", who)
                    logger.error("mpi4dask: %s (%s) aborted MPI: %s", world.kvsname, who, raw.decode(errors="replace"))
                    return
                writer.write(world.answer(req))
                await writer.drain()
        except asyncio.CancelledError:  # the scheduler's loop is ending
            return
        except (asyncio.TimeoutError, TimeoutError):
            _metrics.join_failed("service", "timeout", who)
            logger.warning("mpi4dask: the MPI service dropped %s: silent for %.0f s in the middle of joining "
                           "(after %s)", who, _pmi.STEP_TIMEOUT, last)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:  # ValueError: a line over LINE_MAX
            if last == "the challenge":
                _metrics.join_failed("service", "dropped", who)
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
    _metrics.activate()
    _dashboard.install(scheduler)  # the dashboard's MPI page, /mpi
    if host is None:
        from distributed.comm import get_address_host

        host = get_address_host(scheduler.address)
    port = int(_settings.number(
        "MPI4DASK_PM_PORT", 0, low=0, high=65535, integer=True,
        what="the port of the cluster's MPI service on the scheduler's host, an integer from 1 to 65535 "
             "(0, or unset, for a random port)"))
    svc = PMService(host, port)
    try:
        await svc.start()
    except OSError as exc:
        if not port:
            raise
        raise OSError(exc.errno, f"the cluster's MPI service cannot listen on port {port} of {host} "
                                 f"(MPI4DASK_PM_PORT={port}): {exc.strerror or exc}; set MPI4DASK_PM_PORT to a "
                                 "free port, or unset it for a random one") from exc
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
        forget_credentials(self.svc.credentials.service)


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
        _metrics.activate()
        if hasattr(worker, "handlers"):
            worker.handlers["mpi4dask_report"] = _dashboard.worker_report  # for the dashboard's MPI page
        set_credentials(self.creds)
        listener = getattr(worker, "listeners", [None])[0] if getattr(worker, "listeners", None) else None
        if listener is not None and getattr(listener, "prefix", "") == "mpi://":
            _mpi.start()  # its mpi:// connections can use MPI once it is up
