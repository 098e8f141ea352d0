"""MPI initialisation under mpiexec never deadlocks, and jobs exit cleanly (issue #9, sections 1-2).

Under hydra ``MPI_Init`` is collective: it returns once every rank has called it.  These jobs are
plain distributed programs, as a user writes them: no rank initialises MPI or imports mpi4py first,
and no client connects before the checks are made.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from conftest import BIN, MPIEXEC, Background, only_with, run_command, without_shutdown_races

JOBS = Path(__file__).parent / "jobs"
JOB = str(JOBS / "init_job.py")
DASK = str(BIN / "dask")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("listener_rank", [1, 0])
def test_one_rank_listens_the_other_connects(listener_rank, tmp_path):
    """Rank 1 (or 0) listens, the other connects: it used to hang forever, the connector spinning
    in MPI_Init before its TCP connect while the listener waited for a connection to start MPI."""
    rc, out, err = run_command(
        [MPIEXEC, "-n", "2", sys.executable, JOB, "listen_connect", str(listener_rank), str(tmp_path / "addr")],
        timeout=60,
    )
    assert rc == 0, out + err
    assert f"LISTENER rank={listener_rank} OK" in out, out + err
    assert "CONNECTOR" in out and "mpi=True" in out, out + err


def _wait_for_log(job: Background, pattern: str, count: int, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        out, err = job.output()
        if len(re.findall(pattern, err)) >= count:
            return time.monotonic() - t0
        if job.proc.poll() is not None:
            break
        time.sleep(0.2)
    out, err = job.output()
    pytest.fail(f"{count} x {pattern!r} not seen in {timeout} s\n--- stdout\n{out}\n--- stderr\n{err}")




@pytest.mark.timeout(150)
def test_mpmd_dask_cli_job_registers_its_workers_without_a_client(tmp_path):
    """``mpiexec -n 1 dask scheduler --protocol mpi : -n 2 dask worker --no-nanny``: the workers
    register within seconds although nothing outside the job has connected; the job then serves a
    client over MPI and ends with status 0 and no traceback."""
    sf = tmp_path / "scheduler.json"
    cmd = [
        MPIEXEC,
        "-n", "1", DASK, "scheduler", "--protocol", "mpi", "--scheduler-file", sf, "--no-dashboard",
        ":",
        "-n", "2", DASK, "worker", "--no-nanny", "--nthreads", "1", "--scheduler-file", sf,
    ]  # fmt: skip
    with Background(list(map(str, cmd)), cwd=tmp_path) as job:
        took = _wait_for_log(job, r"Register worker addr: mpi://", 2, timeout=60)
        assert took < 45, took
        rc, out, err = run_command([sys.executable, str(JOBS / "mpmd_client.py"), str(sf)], timeout=60)
        assert rc == 0 and "CLIENT OK 125250" in out, out + err
        assert job.wait(60) == 0, job.output()
        jout, jerr = job.output()
    assert "Traceback" not in without_shutdown_races(jerr) and "Batched Comm Closed" not in jerr, jerr


@pytest.mark.timeout(240)
def test_scheduler_and_workers_in_one_script_exit_zero(tmp_path):
    """A Scheduler on rank 0 and Workers on ranks 1-2 (``async with``), run several times: every run
    computes the right answer over MPI and exits 0 (rank 0 used to leave without MPI_Finalize)."""
    runs = 4
    for i in range(runs):
        sched = tmp_path / f"sched{i}"
        rc, out, err = run_command([MPIEXEC, "-n", "3", sys.executable, JOB, "one_script", str(sched)], timeout=60)
        assert rc == 0, f"run {i}: status {rc}\n{out}\n{err}"
        assert "RESULT 89700 MODES [True]" in out, out + err




@pytest.mark.timeout(120)
def test_a_rank_of_another_job_of_the_same_size_is_told_apart_at_once(tmp_path):
    """Two mpiexec jobs of 2 ranks: rank 1 of one connects to the listener of rank 0 of the other.  Their claims
    match but for the launcher's job, so the connection uses the socket at once (it used to wait
    3 s per connection for an MPI proof that could not come)."""
    addr = tmp_path / "addr"
    server = [MPIEXEC, "-n", "2", sys.executable, str(JOBS / "hostile_job.py"),
              "rank0_serves", str(addr)]
    with Background(server) as job:
        deadline = time.monotonic() + 60
        while not addr.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        client = [MPIEXEC, "-n", "2", sys.executable, str(JOBS / "other_job_connects.py"), str(addr)]
        rc, out, err = run_command(client, timeout=60)
        assert rc == 0, out + err
        assert job.wait(60) == 0, job.output()
    times = [float(t) for t in re.findall(r"OTHER JOB mpi=False connect=([\d.]+)s", out)]
    assert len(times) == 3, out + err
    assert max(times) < 1.5, times




@pytest.mark.timeout(120)
@only_with("intel", why="tests what Intel MPI needs to form a world that can join others (libfabric)")
def test_intel_mpi_served_world_and_missing_libfabric(tmp_path):
    """A process no launcher started: Intel MPI forms a served world of one (shm:ofi); with no libfabric to
    load, mpi4dask says so before MPI_Init (which would abort the process) and names the fix."""
    script = JOBS / "served_world.py"
    rc, out, err = run_command([sys.executable, str(script)], 60, cwd=tmp_path)
    assert rc == 0 and "SERVED mpi4dask-local-" in out, out + err
    rc, out, err = run_command([sys.executable, str(script)], 60, cwd=tmp_path,
                               env={"I_MPI_OFI_LIBRARY": str(tmp_path / "libfabric.so.1")})
    assert rc == 0 and "REFUSED Intel MPI needs libfabric" in out, out + err
    assert "I_MPI_OFI_LIBRARY" in out and "pip install libfabric" in out, out
