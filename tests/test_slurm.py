"""Slurm, as users run it: ``srun``, ``sbatch`` and dask-jobqueue on a private single-node Slurm.

The Slurm is real (``slurmctld``, ``slurmd``, ``munged`` from Debian's packages; ``tests/slurm.py``),
started once for the session by the ``slurm`` fixture with ``MpiDefault=none``, as many sites have.
Every job's result is checked against NumPy or sha256 digests; every wait has a timeout.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import run_command
from test_launcher import SERVE_CLIENT, assert_check, assert_quiet, initialize_job

pytestmark = pytest.mark.timeout(240)

JOBS = Path(__file__).parent / "jobs"


def srun(slurm, n: int, args, timeout: float, mpi: str | None = "pmi2", cwd=None):
    cmd = ["srun", "-n", str(n), *([f"--mpi={mpi}"] if mpi else []), *map(str, args)]
    return slurm.run(cmd, timeout, cwd=cwd)


def sbatch(slurm, script: str, path: Path, n: int) -> str:
    path.write_text("#!/bin/bash\n" + textwrap.dedent(script))
    rc, out, err = slurm.run(["sbatch", "--parsable", "-n", str(n), "-o", f"{path}.out", str(path)], 30,
                             cwd=path.parent)
    assert rc == 0, (out, err)
    return out.strip().split(";")[0]


def wait_until_gone(slurm, job: str, timeout: float) -> float:
    t0 = time.monotonic()
    while any(line.split()[:1] == [job] and "RUNNING" in line for line in slurm.squeue()):
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"job {job} still running after {timeout} s: {slurm.squeue()}\n{slurm.logs()}")
        time.sleep(0.2)
    return time.monotonic() - t0


def wait_for_file(path: Path, slurm, job: str, timeout: float) -> None:
    t0 = time.monotonic()
    while not path.exists():
        if not any(line.split()[:1] == [job] for line in slurm.squeue()):
            out = Path(f"{path.parent / 'job.sh'}.out")
            pytest.fail(f"job {job} ended before writing {path}: {out.read_text() if out.exists() else ''}")
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"no {path} after {timeout} s: {slurm.squeue()}")
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# srun


def test_initialize_under_srun_with_pmi2(slurm, tmp_path):
    """``srun -n 4 --mpi=pmi2 python script.py``: the script's ranks become a cluster over mpi://,
    results match NumPy, the step ends with status 0 and nothing noisy."""
    t0 = time.monotonic()
    rc, out, err = srun(slurm, 4, initialize_job("mpi", "computes"), 120, cwd=tmp_path)
    assert rc == 0, (out, err)
    assert_check(out, "2,3", "mpi")
    assert_quiet(out, err)
    assert time.monotonic() - t0 < 60


def test_srun_without_pmi_names_the_fix(slurm, tmp_path):
    """``srun -n 4`` on a site without a default PMI: every task is a world of one; the error says
    what it saw (SLURM_STEP_NUM_TASKS against the world size) and names ``srun --mpi=pmi2``."""
    t0 = time.monotonic()
    rc, out, err = srun(slurm, 4, initialize_job("mpi", "computes"), 120, mpi=None, cwd=tmp_path)
    assert rc != 0, (out, err)
    assert "BODY" not in out
    assert "srun started 4 tasks (SLURM_STEP_NUM_TASKS=4) and MPI sees a world of 1 in each" in err, err
    assert "`srun --mpi=pmi2 -n 4 ...`" in err, err
    assert "mpiexec -n" not in err, err  # not the advice for mpiexec
    assert time.monotonic() - t0 < 60


# --------------------------------------------------------------------------------------------
# sbatch


def test_serve_in_an_sbatch_job_with_a_client_outside(slurm, tmp_path):
    """``sbatch`` of ``srun --mpi=pmi2 -n 3 mpi4dask serve``; a plain client outside the job
    computes (checked against NumPy) and calls shutdown(); the step ends with status 0, quietly,
    and removes its scheduler file."""
    sf = tmp_path / "scheduler.json"
    job = sbatch(slurm, f"srun --mpi=pmi2 -n 3 {sys.executable} -m mpi4dask serve --scheduler-file {sf}\n"
                        "echo srun-rc=$?\n", tmp_path / "job.sh", 3)
    wait_for_file(sf, slurm, job, 90)
    assert json.loads(sf.read_text())["address"].startswith("mpi://")
    rc, out, err = run_command([sys.executable, SERVE_CLIENT, str(sf), "2"], timeout=120)
    assert rc == 0, (out, err)
    assert_check(out, "1,2", "mpi")
    wait_until_gone(slurm, job, 60)
    log = (tmp_path / "job.sh.out").read_text()
    assert "srun-rc=0" in log, log
    assert_quiet(log)
    assert not sf.exists()


def test_a_dead_rank_is_named_and_ends_the_srun_step(slurm, tmp_path):
    """A worker rank of an ``srun`` step SIGKILLed: one line names its rank, and the step ends
    within seconds (srun alone would wait for the others for ever)."""
    import os
    import signal

    sf = tmp_path / "scheduler.json"
    job = sbatch(slurm, f"srun --mpi=pmi2 -n 4 {sys.executable} -m mpi4dask serve --scheduler-file {sf}\n"
                        "echo srun-rc=$?\n", tmp_path / "job.sh", 4)
    wait_for_file(sf, slurm, job, 90)
    rc, out, err = run_command([sys.executable, str(JOBS / "worker_pid_by_name.py"), str(sf)], timeout=90)
    assert rc == 0, (out, err)
    [found] = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
    os.kill(json.loads(found)["pid"], signal.SIGKILL)
    ended = wait_until_gone(slurm, job, 60)
    log = (tmp_path / "job.sh.out").read_text()
    assert ended < 30, ended
    assert log.count("mpi4dask: rank 2 of this srun step") == 1 and " died" in log, log
    assert log.count(" died; MPI cannot go on") == 1, log  # the ranks ended after it are not taken for dead
    assert "srun-rc=0" not in log, log


# --------------------------------------------------------------------------------------------
# dask-jobqueue


def run_jobqueue(slurm, tmp_path, scenario: str, timeout: float) -> tuple[dict, str]:
    rc, out, err = slurm.run([sys.executable, str(JOBS / "jobqueue_cluster.py"), scenario, tmp_path / "logs"],
                             timeout, cwd=tmp_path)
    found = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((tmp_path / "logs").glob("*")))
    assert rc == 0 and len(found) == 1, f"rc={rc}\n--- stdout\n{out}\n--- stderr\n{err[-8000:]}\n{logs}"
    return json.loads(found[0]), err + logs


@pytest.mark.timeout(400)
def test_slurmcluster_workers_pair_over_mpi_run_mpi_and_scale(slurm, tmp_path):
    """SLURMCluster(protocol="mpi"), 3 one-core batch jobs: 8 MiB moves between them go over MPI
    pairs, run_mpi spans the 3 jobs with every block intact, then scale(1) and adapt(1..3) under
    load with run_mpi calls answering right throughout."""
    got, logs = run_jobqueue(slurm, tmp_path, "pairs", 360)
    assert "--protocol mpi" in got["job_script"] and "#SBATCH" in got["job_script"], got["job_script"]
    jobs = got["jobs"]
    assert len(set(jobs.values())) == 3 and all(jobs.values()), jobs  # three batch jobs, one worker each
    for m in got["moves"]:
        assert m["at_src"]["sha"] == m["at_dst"]["sha"] == m["expected"], m
        assert m["at_src"]["job"] != m["at_dst"]["job"], m
        assert m["routes"] == [["mpi", "pair"]], m
        assert m["mpi_received"] >= 8 << 20 and m["mpi_sent"] >= 8 << 20, m
    assert abs(got["array"]["sum"] - got["array"]["np_sum"]) <= 1e-9 * got["array"]["np_sum"], got["array"]
    r = got["run_mpi"]
    assert r["sizes"] == [3, 3, 3] and r["ranks"] == [0, 1, 2], r
    assert r["jobs"] == sorted(jobs.values()), r
    assert r["blocks_right"] is True and r["totals_right"] is True, r
    # links a worker opened to another (the accepting end lists the peer's ephemeral port, not its address)
    opened = {w: links for w, links in got["worker_links"].items() if links}
    assert len(opened) >= 2, got["worker_links"]  # at least the two that fetched from the first
    assert all(links == [["mpi", "pair"]] for links in opened.values()), got["worker_links"]
    assert len(got["queue_after_down"]) == 1, got["queue_after_down"]  # scale(1) cancelled two batch jobs
    a = got["adapt"]
    assert a["right"] == a["calls"] >= 2, a
    assert max(a["workers_seen"]) >= 2 and max(a["run_mpi_sizes"]) >= 2, a  # adapt submitted jobs
    assert got["naps_right"] is True
    assert a["workers_after"] == 1, a  # and cancelled them once the load was gone
    for word in ("Abort", "Fatal error"):
        assert word not in logs, logs[-5000:]


@pytest.mark.timeout(300)
def test_slurmcluster_scancel_during_run_mpi_is_lost_and_retried(slurm, tmp_path):
    """One worker's batch job scancel-ed while run_mpi waits on it: MPIJobError(lost=True) within
    seconds; with retries=2 the call runs again on the workers left and answers right."""
    got, _ = run_jobqueue(slurm, tmp_path, "scancel", 260)
    first = got["first"]
    assert first is not None, "the call whose rank 1's job was cancelled returned"
    assert first["lost"] is True and first["rank"] == 1, first
    assert first["cancel_to_error"] < 30, first
    assert got["retried"]["right"] is True and 1 <= got["retried"]["sizes"][0] <= 3, got


