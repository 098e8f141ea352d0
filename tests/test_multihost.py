"""MPI between hosts without mpiexec: a scheduler on one simulated host (a network namespace, made by
the test: tests/netns.py), ``dask worker`` processes on two others, a client on a fourth.  The
workers join MPI through the scheduler's MPI service across the network; payloads between the
workers travel over MPI (MPICH's UCX network module over the hosts' eth0), and run_mpi over both
workers forms one communicator across the hosts."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from netns import netns_network_fixture, requires_netns  # noqa: F401  (provides fixture netns_network)

from conftest import BIN, job_env


@requires_netns
@pytest.mark.timeout(240)
def test_workers_on_other_hosts_join_mpi_through_the_scheduler(netns_network, tmp_path: Path):
    net = netns_network(4)
    sched_host, wa, wb, client_host = net.hosts
    env = job_env({"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "30s"})
    logs = {}

    def start(host, name, argv):
        f = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed below
        logs[name] = f
        return host.popen(argv, env=env, stdout=f, stderr=f, cwd=tmp_path)

    def log_text():
        return "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()}" for n in logs)

    sched_file = tmp_path / "sched.json"
    try:
        start(sched_host, "scheduler", [BIN / "dask", "scheduler", "--protocol", "mpi", "--host", sched_host.addr,
                                        "--port", "0", "--scheduler-file", sched_file, "--no-dashboard"])
        deadline = time.monotonic() + 60
        while not sched_file.exists():
            assert time.monotonic() < deadline, log_text()
            time.sleep(0.2)
        address = json.loads(sched_file.read_text())["address"]
        assert address.startswith(f"mpi://{sched_host.addr}:"), address
        for host, name in ((wa, "worker-a"), (wb, "worker-b")):
            start(host, name, [BIN / "dask", "worker", address, "--host", host.addr, "--nthreads", "1",
                               "--no-dashboard"])
        script = Path(__file__).parent / "jobs" / "multihost_client.py"
        res = client_host.run([sys.executable, script, address], timeout=150, env=env, cwd=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr + log_text()
        [found] = [line[6:] for line in res.stdout.splitlines() if line.startswith("HOSTS ")]
        got = json.loads(found)
    finally:
        for host in net.hosts:
            host.kill_all()
        for f in logs.values():
            f.close()
    assert sorted(got["hosts"].values()) == sorted([wa.hostname, wb.hostname]), got
    assert got[str(1 << 20)] is True and got[str(32 << 20)] is True, got
    for side in ("a_to_b", "b_to_a"):
        assert got[side] and all(c["transport"] == "mpi" and c["mpi_route"] == "pair" for c in got[side]), got
    received = sum(c["mpi_bytes_received"] for c in got["a_to_b"] + got["b_to_a"])
    assert received >= (1 << 20) + (32 << 20), got  # both payloads crossed between the hosts over MPI
    ranks = sorted(r[:2] for r in got["run_mpi"])
    assert ranks == [[0, 2], [1, 2]] and {r[3] for r in got["run_mpi"]} == {300.0}, got
    assert {r[2] for r in got["run_mpi"]} == {wa.hostname, wb.hostname}, got
    text = log_text()
    assert "Fatal error" not in text and "UCX  ERROR" not in text, text
