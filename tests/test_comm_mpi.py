"""mpi:// between processes: real mpiexec jobs, processes outside the job, dying peers, real clusters."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from mpijob import JOBS, mpiexec, run, run_job

pytestmark = pytest.mark.timeout(180)


def ok_lines(result, n_ranks):
    lines = [line for line in result.stdout.splitlines() if re.match(r"RANK \d+ OK", line)]
    assert result.returncode == 0 and len(lines) == n_ranks, str(result)
    return lines


def test_pingpong_between_ranks_three_connections_each():
    lines = ok_lines(run_job(3, "comm_job.py", "pingpong", timeout=120), 3)
    assert sum(int(m) for m in re.findall(r"checked=(\d+)", "\n".join(lines))) == 2 * 3 * 8


def test_both_directions_at_once_between_ranks():
    ok_lines(run_job(2, "comm_job.py", "both_ways", timeout=120), 2)


def test_client_outside_the_mpi_world_falls_back_to_socket(tmp_path):
    addr_file = str(tmp_path / "addr")
    job = subprocess.Popen(
        [mpiexec(), "-n", "2", sys.executable, str(JOBS / "comm_job.py"), "outsider", addr_file],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(addr_file):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        code = (
            "import asyncio, hashlib, numpy as np\n"
            "from distributed.comm import connect\n"
            "from distributed.protocol import to_serialize\n"
            "async def main():\n"
            f"    c = await connect(open({addr_file!r}).read())\n"
            "    a = np.random.default_rng(9).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)\n"
            "    await c.write({'x': to_serialize(a)})\n"
            "    b = (await c.read())['x']\n"
            "    same = hashlib.sha256(a).digest() == hashlib.sha256(memoryview(b).cast('B')).digest()\n"
            "    print('OUTSIDER', c.uses_mpi, same)\n"
            "    await c.close()\n"
            "asyncio.run(main())\n"
        )
        outsider = run([sys.executable, "-c", code], timeout=60)
        assert "OUTSIDER False True" in outsider.stdout, str(outsider)
        assert "outside this process's MPI world" in outsider.stderr
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
    assert job.returncode == 0, out + err
    assert "RANK 0 OK modes=[False, True]" in out, out + err
    assert err.count("outside this process's MPI world") == 1, err  # logged once


def test_killed_peer_fails_reads_and_writes_within_seconds(tmp_path):
    addr_file = str(tmp_path / "addr")
    job = subprocess.Popen(
        [mpiexec(), "-n", "2", sys.executable, str(JOBS / "comm_job.py"), "killed_outsider", addr_file],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    victim = None
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(addr_file):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        victim = subprocess.Popen([sys.executable, str(JOBS / "comm_job.py"), "victim", addr_file],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        out, err = job.communicate(timeout=90)
        assert victim.wait(timeout=30) == -9  # it was SIGKILLed by rank 0
    finally:
        for p in (job, victim):
            if p is not None and p.poll() is None:
                p.kill()
    m = re.search(r"RANK 0 OK read=(\w+) after=([\d.]+)s write=(\w+)", out)
    assert job.returncode == 0 and m and "RANK 1 OK" in out, out + err
    assert m.group(1) == "CommClosedError" and float(m.group(2)) < 5 and m.group(3) == "CommClosedError", m.group(0)


def test_killed_rank_ends_the_job_instead_of_hanging():
    # Without fault tolerance in MPI, a rank that dies takes the job down; it must not hang.
    t0 = time.monotonic()
    result = run_job(3, "comm_job.py", "rank_dies", timeout=60)
    assert result.returncode != 0, str(result)
    assert time.monotonic() - t0 < 45


def test_idle_connections_do_not_burn_cpu():
    result = run_job(2, "comm_job.py", "idle", "4", timeout=90)
    usage = [float(x) for x in re.findall(r"idle_cpu=([\d.]+)%", result.stdout)]
    assert len(usage) == 2, str(result)
    assert max(usage) < 2.0, usage


CLUSTER_CODE = """
import hashlib, numpy as np, dask.array as da, distributed
from distributed import Client, LocalCluster

def uses(dask_worker):
    return sorted({type(c).__name__ + ':' + str(getattr(c, 'uses_mpi', None))
                   for comms in dask_worker.rpc.available.values() for c in comms})

if __name__ == '__main__':
    with LocalCluster(protocol='mpi', n_workers=2, threads_per_worker=1, processes={processes},
                      dashboard_address=None) as cluster, Client(cluster) as client:
        assert cluster.scheduler_address.startswith('mpi://'), cluster.scheduler_address
        x = da.random.default_rng(0).random((2000, 2000), chunks=(500, 500))
        got = (x + x.T).sum().compute()
        ref = np.asarray(x); ref = (ref + ref.T).sum()
        assert abs(got - ref) < 1e-6 * abs(ref), (got, ref)
        print('RESULT OK', got)
        print('WORKER COMMS', client.run(uses))
"""


@pytest.mark.parametrize("processes", [False, True])
def test_localcluster_protocol_mpi(processes, tmp_path):
    script = tmp_path / "cluster.py"
    script.write_text(CLUSTER_CODE.replace("{processes}", str(processes)))
    result = run([sys.executable, str(script)], timeout=120)
    assert result.returncode == 0 and "RESULT OK" in result.stdout, str(result)
    if not processes:
        # threads of one process share its MPI world: everything goes over MPI
        assert "MPIComm:False" not in result.stdout, result.stdout
        assert "outside this process's MPI world" not in result.stderr
    else:
        # Nanny-spawned workers are not ranks of the parent's world: they connect, over TCP
        assert "outside this process's MPI world" in result.stderr
