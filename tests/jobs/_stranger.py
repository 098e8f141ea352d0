"""A stranger's side of the ``mpi://`` handshake (length-prefixed JSON records on a plain socket), for the tests
that play a hostile or foreign peer: tests/test_comm_hostile.py and any_cluster_pair_stranger.py."""

import json
import socket
import struct


def send_hs(sock: socket.socket, msg: dict) -> None:
    raw = json.dumps(msg).encode()
    sock.sendall(struct.pack("<I", len(raw)) + raw)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def recv_hs(sock: socket.socket) -> dict:
    (n,) = struct.unpack("<I", recv_exact(sock, 4))
    return json.loads(recv_exact(sock, n))
