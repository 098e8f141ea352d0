"""Runs on a simulated host (tests/test_netns_harness.py, test_hosts_reach_each_other_and_root): prints the
hostname, then TCP-connects to every address given and checks an echo through each; prints ``ok``.

Usage: netns_echo_client.py HOST:PORT...
"""
import socket
import sys

print(socket.gethostname(), flush=True)
for addr in sys.argv[1:]:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"ping " + host.encode())
        assert s.recv(100) == b"pong " + host.encode(), addr
print("ok", flush=True)
