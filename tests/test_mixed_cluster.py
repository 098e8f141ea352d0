"""A cluster started under mpiexec that later gains a worker started elsewhere (issue: "a cluster can
mix both").  ``mpiexec -n 2 mpi4dask serve`` runs the scheduler (rank 0) and one worker (rank 1); a
plain ``dask worker`` process joins through the scheduler file.  Payloads between the job's worker
and the outside worker must travel over MPI (the two worlds joined by connect/accept), and
``run_mpi`` over both must form one communicator."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from conftest import BIN, MPIEXEC, Background, run_command


@pytest.mark.timeout(180)
def test_mpiexec_cluster_gains_an_outside_worker_over_mpi(tmp_path: Path):
    sched = tmp_path / "sched.json"
    client_py = Path(__file__).parent / "jobs" / "mixed_cluster_client.py"
    serve = [MPIEXEC, "-n", "2", str(BIN / "mpi4dask"), "serve", "--scheduler-file", str(sched)]
    with Background(serve, cwd=tmp_path) as job:
        deadline = time.monotonic() + 90
        while not sched.exists():
            assert job.proc.poll() is None, job.output()
            assert time.monotonic() < deadline, job.output()
            time.sleep(0.2)
        worker = [str(BIN / "dask"), "worker", "--scheduler-file", str(sched), "--nthreads", "1",
                  "--no-dashboard", "--name", "outside"]
        with Background(worker, cwd=tmp_path) as outside:
            rc, out, err = run_command([sys.executable, str(client_py), str(sched)], timeout=120, cwd=tmp_path)
            assert rc == 0, out + err + "\n--- job\n" + "\n".join(job.output()) + "\n--- outside\n" + \
                "\n".join(outside.output())
            [found] = [line[6:] for line in out.splitlines() if line.startswith("MIXED ")]
            got = json.loads(found)
            outside_err = outside.output()[1]
    assert got[str(8 << 20)] == [True, True] and got[str(24 << 20)] == [True, True], got
    for side in ("outside_to_job", "job_to_outside"):
        assert got[side] and all(c["transport"] == "mpi" and c["mpi_route"] == "pair" for c in got[side]), got
    # each side fetched its payload over a connection it opened to the other's address: over MPI
    got_outside = sum(c["mpi_bytes_received"] for c in got["outside_to_job"])
    got_job = sum(c["mpi_bytes_received"] for c in got["job_to_outside"])
    assert got_outside >= 8 << 20 and got_job >= 24 << 20, got
    assert all(c["socket_bytes_received"] < 1 << 20 for c in got["outside_to_job"] + got["job_to_outside"]), got
    assert [r[0] for r in got["run_mpi"]] == [2, 2] and {r[1] for r in got["run_mpi"]} == {10000.0}, got
    assert "Fatal error" not in outside_err and "Abort" not in outside_err, outside_err
