"""Listening sockets (private): shared by the ``mpi://`` listener (:mod:`mpi4dask.comm`) and the MPI
service (:mod:`mpi4dask.pm`), so that a wildcard host listens alike for both."""

from __future__ import annotations

import errno
import socket


def bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for ``host:port``; a wildcard host listens on IPv4 and IPv6 (as tcp:// does)."""
    if host:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return [socket.create_server((host, port), family=family, backlog=backlog)]
    for attempt in range(5):
        socks = [socket.create_server(("0.0.0.0", port), family=socket.AF_INET, backlog=backlog)]
        if not socket.has_ipv6:
            return socks
        bound = socks[0].getsockname()[1]
        try:
            socks.append(socket.create_server(("::", bound), family=socket.AF_INET6, backlog=backlog))
            return socks
        except OSError as exc:
            socks[0].close()
            if port == 0 and exc.errno == errno.EADDRINUSE and attempt < 4:
                continue  # the IPv6 side of an ephemeral port is taken: pick another port
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):  # no IPv6 on this machine
                return [socket.create_server(("0.0.0.0", bound), family=socket.AF_INET, backlog=backlog)]
            raise
    raise AssertionError("unreachable")
