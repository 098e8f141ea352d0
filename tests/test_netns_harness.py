"""The simulated-host harness (tests/netns.py): hosts reach each other and the root namespace; teardown is complete."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

import pytest
from netns import BOOT_ID, Network, netns_network_fixture, requires_netns  # noqa: F401  (provides fixture netns_network)

JOBS = Path(__file__).parent / "jobs"
# Run on a host: prints the hostname, then checks an echo through each address given (netns_echo_client.py);
# an echo server on the host's address that prints its port and serves N connections (netns_echo_server.py)
CLIENT = str(JOBS / "netns_echo_client.py")
SERVER = str(JOBS / "netns_echo_server.py")


def _echo_server(addr: str, n: int) -> tuple[int, threading.Thread]:
    srv = socket.create_server((addr, 0))
    srv.settimeout(10)

    def serve():
        with srv:
            for _ in range(n):
                c, _ = srv.accept()
                with c:
                    c.sendall(b"pong " + c.recv(100)[5:])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv.getsockname()[1], t


@requires_netns
def test_hosts_reach_each_other_and_root(netns_network, tmp_path):
    net = netns_network(2)
    a, b = net.hosts
    assert a.addr != b.addr and net.gateway.endswith(".254")

    # A server in the root namespace listening on the bridge address, and one on host a.
    root_port, root_thread = _echo_server(net.gateway, 2)
    srv = a.popen([sys.executable, SERVER, a.addr, "2"], stdout=-1, text=True)
    a_port = int(srv.stdout.readline())

    # host b -> root and host b -> host a
    res = b.run(
        [sys.executable, CLIENT, f"{net.gateway}:{root_port}", f"{a.addr}:{a_port}"], timeout=20, check=True
    )
    assert res.stdout.split() == [b.hostname, "ok"]
    # host a -> root (by address) ...
    res = a.run([sys.executable, CLIENT, f"{net.gateway}:{root_port}"], timeout=20, check=True)
    assert res.stdout.split() == [a.hostname, "ok"]
    # ... and root -> host a
    with socket.create_connection((a.addr, a_port), timeout=5) as s:
        s.sendall(b"ping x")
        assert s.recv(100) == b"pong x"
    assert srv.wait(10) == 0
    root_thread.join(10)

    # hostnames resolve on every host (via /etc/netns/<ns>/hosts)
    res = a.run(
        [sys.executable, "-c", f"import socket; print(socket.gethostbyname({b.hostname!r}))"], timeout=10, check=True
    )
    assert res.stdout.strip() == b.addr

    # each host looks like a machine of its own: hostname, boot id (what UCX keys "same machine" on), machine-id
    ident = "import socket; print(socket.gethostname(), open('{}').read().strip(), open('/etc/machine-id').read())"
    seen = [
        tuple(h.run([sys.executable, "-c", ident.format(BOOT_ID)], timeout=10, check=True).stdout.split())
        for h in (a, b)
    ]
    root = (socket.gethostname(), open(BOOT_ID).read().strip(), open("/etc/machine-id").read().strip())
    assert [s[0] for s in seen] == [a.hostname, b.hostname]
    for i in (1, 2):
        assert len({seen[0][i], seen[1][i], root[i]}) == 3, (seen, root)


@requires_netns
def test_teardown_leaves_nothing_and_kills_processes():
    with Network(2, hostnames=False, machine_ids=False) as net:
        assert net.hosts[0].hostname is None
        res = net.hosts[0].run(["cat", BOOT_ID], timeout=10, check=True)
        assert res.stdout == open(BOOT_ID).read()
        sleeper = net.hosts[0].popen(["sleep", "300"])
        # an orphan not started through the helper: only `ip netns pids` can find it
        net.hosts[1].run(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 < /dev/null &"], timeout=10, check=True)
        assert len(net.hosts[1].pids()) == 1
        assert net.leftovers()
    assert net.leftovers() == []
    assert sleeper.returncode is not None
    net.down()  # idempotent


@requires_netns
def test_run_timeout_fails_and_kills(netns_network):
    (h,) = netns_network(1).hosts
    with pytest.raises(pytest.fail.Exception, match="timed out after 0.5 s"):
        h.run(["sh", "-c", "echo started; sleep 300"], timeout=0.5)
    assert h.pids() == []
