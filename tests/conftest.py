"""Helpers to run real ``mpiexec`` jobs from tests, with hard timeouts that never leave processes behind."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from jobs._echo import answering, echo  # noqa: F401 - comm handlers that answer every message (the job scripts' too)
from mpi4dask import _jobs
from mpi4dask._jobs import BIN, dump_stacks, job_env, kill_all, kill_tree  # noqa: F401 - the tests' helpers
from mpi4dask._mpi import family_of, library_name

MPIEXEC = _jobs.default_mpiexec() or "mpiexec"


def _mpi_version() -> str:
    """The MPI_Get_library_version text of the library mpi4py loads in this venv, read in a child
    process: the pytest process never touches MPI."""
    try:
        out = subprocess.run([sys.executable, "-c", "import mpi4py; mpi4py.rc.initialize = False; from mpi4py "
                              "import MPI; print(MPI.Get_library_version().splitlines()[0])"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout


_VERSION = _mpi_version()
MPI_VERSION = _VERSION  # the first line of MPI_Get_library_version (for mpi4dask._mpi's library checks)
MPI_LIBRARY = library_name(_VERSION) if _VERSION.strip() else "no MPI library"
MPI_FAMILY = family_of(_VERSION)

# Tests of MPI in clusters that Dask starts (no mpiexec): mpi4dask.pm serves MPICH and Intel MPI only
served_worlds = pytest.mark.skipif(
    MPI_FAMILY not in ("mpich", "intel"),
    reason=f"{MPI_LIBRARY}: processes that no launcher started cannot join each other (Open MPI singletons have "
           "no PMIx server); see docs/mpi-support.md")


# Measured with Intel MPI 2021.19 on libfabric 1.17 (Debian's: the impi-rt wheel asks for PyPI's libfabric>=2.6,
# which CI's index lacks): a script whose LocalCluster(protocol="mpi") moved data between its workers computes
# right (test_local_cluster_moves_payloads_over_mpi: every checksum equal) and then hangs at exit, in MPI_Finalize
# inside libfabric; each move between workers takes 0.3-0.5 s (11-18 s before _progress.STEADY_BACKOFF_MAX)
slow_served_transport = pytest.mark.skipif(
    MPI_FAMILY == "intel",
    reason=f"{MPI_LIBRARY}: with libfabric 1.17, processes that Dask started and that joined over mpi:// hang in "
           "MPI_Finalize at exit (the work itself computes right), and each move takes 0.3-0.5 s; see "
           "docs/mpi-support.md")


def only_with(*families: str, why: str):
    """Skip a test under the MPIs not named, saying which MPI runs it and why it depends on that MPI."""
    return pytest.mark.skipif(MPI_FAMILY not in families, reason=f"{MPI_LIBRARY}: {why}")


def _command(n, script, tmpdir) -> list[str]:
    if isinstance(script, str):
        path = Path(tmpdir) / "job.py"
        path.write_text(script)
        return [MPIEXEC, "-n", str(n), sys.executable, str(path)]
    return [MPIEXEC, "-n", str(n), *map(str, script)]


def run_mpiexec(n, script, timeout, env=None, cwd=None):
    """Run ``mpiexec -n N python <script text>`` (or ``mpiexec -n N <args...>`` for a list).

    Kills the whole process tree and fails the test when ``timeout`` seconds pass.
    Returns ``(returncode, stdout, stderr)``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        return run_command(_command(n, script, tmp), timeout, env=env, cwd=cwd or tmp)


def run_command(cmd, timeout, env=None, cwd=None):
    """Run a command with a hard timeout (killing its whole process tree); return (rc, out, err)."""
    done = _jobs.run(cmd, timeout, env=env, cwd=cwd)
    if done.timed_out:
        pytest.fail(f"timed out after {timeout} s: {cmd}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    return done.returncode, done.stdout, done.stderr


class Background:
    """A command running in the background (e.g. ``mpiexec ... mpi4dask serve``), killed on exit."""

    def __init__(self, cmd, env=None, cwd=None):
        self.cmd = cmd
        self._out = tempfile.TemporaryFile("w+")
        self._err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            cmd, stdout=self._out, stderr=self._err, text=True, env=job_env(env), cwd=cwd, start_new_session=True
        )

    def wait(self, timeout):
        """Wait for the command to end; after ``timeout`` s, have its Python processes print their stacks
        (they end), kill its tree and fail the test."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            out, err = self.output()
            pytest.fail(f"timed out after {timeout} s: {self.cmd}\n--- stdout\n{out}\n--- stderr\n{err}")
        return rc

    def stop(self) -> None:
        """End the job that was given up on: its Python processes print their stacks (into its output), then
        its tree is killed, as ``_jobs.run`` does at its bound."""
        dump_stacks(self.proc.pid)
        kill_tree(self.proc.pid)
        self.proc.wait()

    def wait_for_file(self, path: Path, timeout: float) -> None:
        """Wait until the job has written ``path``; fail at once if it ends first, or after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"{self.cmd} ended (rc={self.proc.returncode}) before writing {path}: {self.output()}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"no {path} after {timeout} s: {self.output()}")
            time.sleep(0.05)

    def output(self):
        self._out.seek(0)
        self._err.seek(0)
        return self._out.read(), self._err.read()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()
        self._out.close()
        self._err.close()


def run(coro, timeout=60):
    """Run ``coro`` in a fresh event loop, failing it after ``timeout`` seconds."""

    async def guarded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


@pytest.fixture
def over_mpi_whatever_the_load(monkeypatch):
    """Large frames go over MPI even while every core of the machine is taken.  Under an MPI whose copy
    needs both ends' calls (MPICH 4, Intel MPI), a writer that finds every core taken sends a message's
    frames on the socket instead (``_Sender.send``; test_comm_mpi's loaded test checks that route); a test
    of what MPI frames do must not depend on what else runs (two tests failed so in CI under MPICH 4.3.2;
    two more here, with 3 busy processes on the 2 cores).  Both ends of these tests are one process,
    which the check would count."""
    from mpi4dask import _progress

    monkeypatch.setattr(_progress, "cores_taken", lambda pid: False)


@pytest.fixture
def mpiexec():
    """The :func:`run_mpiexec` helper, as a fixture."""
    return run_mpiexec


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A private single-node Slurm for the session (``tests/slurm.py``).  Skips where it cannot run
    (not root, packages missing) unless ``MPI4DASK_REQUIRE_SLURM=1`` (CI), where that is a failure."""
    from slurm import SLURM_SKIP_REASON, Slurm

    if SLURM_SKIP_REASON:
        if os.environ.get("MPI4DASK_REQUIRE_SLURM") == "1":
            pytest.fail(f"MPI4DASK_REQUIRE_SLURM=1 but {SLURM_SKIP_REASON}")
        pytest.skip(SLURM_SKIP_REASON)
    s = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


# distributed's own log records of its shutdown races, each with a traceback ending in CommClosedError,
# which it logs on tcp:// as on mpi:// (tests/test_comm_contract.py reproduces each on both):
_SHUTDOWN_RACES = (
    # a scheduler's batched write to a worker racing the abort of that worker's stream
    # (test_a_batched_write_racing_an_abort_is_logged_as_tcp_logs_it)
    " - distributed.batched - INFO - Batched Comm Closed ",
    # a worker's heartbeat in flight when the scheduler closes and aborts the comm it came on
    # (test_a_heartbeat_in_flight_when_the_scheduler_closes_is_logged_as_tcp_logs_it), or whose connection
    # is still being made when its own worker closes and the worker's connection pool cancels it
    # (test_a_heartbeat_connecting_when_its_worker_closes_is_logged_as_tcp_logs_it)
    " - distributed.worker - ERROR - Failed to communicate with scheduler during heartbeat.",
)
_POOL_CLOSING = "distributed.comm.core.CommClosedError: ConnectionPool closing."


def without_shutdown_races(err: str) -> str:
    """``err`` less distributed's records of its shutdown races (``_SHUTDOWN_RACES``), each with its
    traceback up to the ``CommClosedError`` it ends in: the batched write's always; the heartbeat's in a
    log where the scheduler closed or told the worker so, or where the worker was stopping and the
    traceback ends in its connection pool's own "ConnectionPool closing.".  Every other traceback stays."""
    scheduler_closed = "Closing scheduler" in err or "Reason: scheduler-close" in err
    out: list[str] = []
    block: list[str] = []  # a race's record and traceback, until its CommClosedError line decides it
    stopping = False  # the log's worker said it stops, before the record
    for line in err.splitlines(keepends=True):
        if block:
            block.append(line)
            if line.startswith("distributed.comm.core.CommClosedError"):
                race = block[0]
                dropped = ("batched" in race or scheduler_closed
                           or (stopping and line.rstrip("\n") == _POOL_CLOSING))
                if not dropped:
                    out.extend(block)
                block = []
            continue
        if " - distributed.worker - INFO - Stopping worker at " in line:
            stopping = True
        if any(race in line for race in _SHUTDOWN_RACES):
            block = [line]
        else:
            out.append(line)
    out.extend(block)  # a race's record that no CommClosedError ended stays
    return "".join(out)
