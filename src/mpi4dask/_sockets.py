"""Sockets (private): listening ones, shared by the ``mpi://`` listener (:mod:`mpi4dask.comm`) and the MPI
service (:mod:`mpi4dask.pm`), so that a wildcard host listens alike for both; and the one-byte signal
with which the two sides of a pair join meet (:mod:`mpi4dask._handshake`, step 6p).

The signal is sent and read while holding the GIL (``ctypes.PyDLL`` calls with ``MSG_DONTWAIT``, which
never block): a plain ``socket.send`` lets the GIL go, and a thread that lets it go may wait, before it
gets it back, for the whole of a task that holds it in C (a pandas or numpy call of a second or more).
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import time

_libc = None


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


def _c():
    """libc's send and recv, called without letting the GIL go."""
    global _libc
    if _libc is None:
        lib = ctypes.PyDLL(None, use_errno=True)
        for name in ("send", "recv"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_ssize_t
        _libc = lib
    return _libc


def _given_up() -> OSError:
    return OSError(errno.ECANCELED, "the join was given up before it began")


def _error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


class Signal:
    """One byte between the two sides of a pair join (:mod:`mpi4dask._handshake`, step 6p): sent by one
    side's join thread, awaited by the other's.  It uses its own duplicate of the connection's socket
    descriptor, so a thread that comes late never writes to or reads from another connection that
    took over the descriptor's number.  :meth:`abort` gives the meeting up (from the event loop: the
    handshake was cancelled); :meth:`close` it when the join is over."""

    def __init__(self, sock, byte: bytes, deadline: float | None = None):
        self._fd = os.dup(sock.fileno())
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # abort() wakes a wait
        self._aborted = False
        self.byte = byte
        self.deadline = deadline  # None: this side sends; else it waits for the byte until then (monotonic)

    def abort(self) -> None:
        """Give the meeting up: a send not made yet is never made, a wait ends (:class:`OSError`)."""
        self._aborted = True
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass  # full: a wake-up is pending already

    def meet(self) -> None:
        """Send the byte, or wait for it; :class:`OSError` when it cannot go at once, or the peer
        closed the connection, sent another byte, or nothing until the deadline, or it was aborted."""
        if self._aborted:  # (checked and sent under one holding of the GIL: abort() cannot come between)
            raise _given_up()
        if self.deadline is None:
            # a peer that closed the connection (died) since it sent the port gets no byte: the sender
            # would wait for it inside MPI (the peer's bytes are never read here: MSG_PEEK)
            if _c().recv(self._fd, ctypes.create_string_buffer(1), 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == 0:
                raise ConnectionResetError("the peer closed the connection")
            n = _c().send(self._fd, self.byte, 1, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            if n != 1:
                raise _error("sending the join signal")
            return
        got = self._wait()
        if got != self.byte:
            raise (ConnectionError(f"the peer sent {got!r} instead of {self.byte!r}") if got
                   else ConnectionResetError("the peer closed the connection"))

    def _wait(self) -> bytes:
        """The next byte (b"" when the peer closed the connection), by the deadline.  The wait lets the
        GIL go (once: poll's); the read holds it."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        buf = ctypes.create_string_buffer(1)
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no join signal by the connect timeout")
            if not poller.poll(left * 1000):
                continue
            if self._aborted:
                raise _given_up()
            n = _c().recv(self._fd, buf, 1, socket.MSG_DONTWAIT)
            if n == 1:
                return buf.raw
            if n == 0:
                return b""
            if ctypes.get_errno() not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                raise _error("waiting for the join signal")

    def close(self) -> None:
        fds = [fd for fd in (self._fd, self._wake_r, self._wake_w) if fd >= 0]
        self._fd = self._wake_r = self._wake_w = -1
        for fd in fds:
            os.close(fd)
