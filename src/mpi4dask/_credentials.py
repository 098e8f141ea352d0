"""This process's cluster credentials (private): what a scheduler's MPI service (:mod:`mpi4dask.pm`)
hands its processes, to join MPI through it and to prove to each other that they are of one cluster.

Kept apart from the service because three layers read them: MPI's initialisation (:mod:`mpi4dask._mpi`,
whether and through which service a world forms), the service and its worker plugin that set them, and
the ``mpi://`` handshake (:mod:`mpi4dask._handshake`, the hello and the pair proofs).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from typing import NamedTuple


class Credentials(NamedTuple):
    """What a process needs to initialise MPI through a cluster's service and to prove membership."""

    address: str  # host:port of the service
    secret: bytes  # the cluster's secret (never logged, never put on the wire)
    service: str  # public id of the service (tells clusters apart)

    def mac(self, *parts: bytes) -> str:
        return hmac.new(self.secret, b"|".join(parts), hashlib.sha256).hexdigest()

    def __repr__(self):  # keep the secret out of logs and tracebacks
        return f"Credentials(address={self.address!r}, service={self.service!r})"


_credentials: Credentials | None = None
_cred_lock = threading.Lock()


def set_credentials(creds: Credentials) -> None:
    global _credentials
    with _cred_lock:
        if _credentials is None or _credentials.service != creds.service:
            _credentials = creds


def forget_credentials(service: str) -> None:
    """The service ``service`` closed: a process that still holds its credentials forgets them, so that
    MPI started later here does not ask a service that is gone (it forms a world of its own instead)."""
    global _credentials
    with _cred_lock:
        if _credentials is not None and _credentials.service == service:
            _credentials = None


def credentials() -> Credentials | None:
    """This process's cluster credentials, if a service has given it some."""
    return _credentials
