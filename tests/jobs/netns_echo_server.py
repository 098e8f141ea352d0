"""Runs on a simulated host (tests/test_netns_harness.py, test_hosts_reach_each_other_and_root): an echo
server on the address given; prints its port, then serves N connections.

Usage: netns_echo_server.py ADDRESS N
"""
import socket
import sys

s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
for _ in range(int(sys.argv[2])):
    c, _ = s.accept()
    with c:
        c.sendall(b"pong " + c.recv(100)[5:])
