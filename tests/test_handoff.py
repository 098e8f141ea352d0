"""run_mpi / map_blocks_mpi: on a real mpiexec cluster (tests/jobs/handoff_job.py), on clusters that are
not MPI jobs, and the examples."""

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import MPI_FAMILY, MPI_LIBRARY, only_with, run_command, run_mpiexec, served_worlds

HERE = Path(__file__).parent
ROOT = HERE.parent

SCENARIOS = [
    "array_parts", "unpersisted_array_is_persisted", "dataframe_parts", "bag_and_futures",
    "colocation_moves_fewest", "extra_workers_get_empty_parts", "error_with_rank_and_traceback",
    "queued_after_stuck_ranks_and_timeout", "concurrent_calls_queue", "event_loop_answers_while_fn_waits_in_mpi",
    "map_blocks_array_and_dataframe", "bad_workers_and_client", "blocks_that_do_not_line_up", "bad_input",
    "unsendable_result_is_named",
]

# the calls of handoff_job.WAIT_CALLS: lowercase and uppercase, collectives and point-to-point, derived communicators
WAIT_KINDS = [
    "allreduce", "reduce", "scan", "exscan", "bcast", "barrier", "recv", "irecv+wait", "pkl5.allgather",
    "Split+allreduce", "Dup+allreduce", "Barrier", "Allreduce", "Probe+Recv", "Irecv+Waitall", "Reduce_scatter",
]


@pytest.fixture(scope="module")
def handoff_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("handoff") / "result.json"
    rc, stdout, stderr = run_mpiexec(5, [sys.executable, HERE / "jobs" / "handoff_job.py", out], timeout=240)
    assert out.exists(), f"the job wrote no results (rc {rc})\n{stdout[-3000:]}\n{stderr[-5000:]}"
    results = json.loads(out.read_text())
    assert rc == 0, f"the job ended with {rc}\n{stderr[-5000:]}"
    for res in results.values():  # a failed scenario's traceback fails that scenario's test only
        stdout = stdout.replace(res["status"][:2000], "")
    assert "Traceback" not in stdout.replace("handoff_job", ""), stdout[-3000:]
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SCENARIOS)
def test_mpiexec_cluster(handoff_results, name):
    res = handoff_results.get(name)
    assert res is not None, f"scenario {name} did not run"
    assert res["status"] == "ok", res["status"]


def test_error_reaches_client_quickly(handoff_results):
    res = handoff_results["error_with_rank_and_traceback"]
    assert res["error_after_s"] < res["stuck_s"] - 0.5, res  # before the other ranks give up waiting in MPI


@pytest.mark.parametrize("kind", WAIT_KINDS)
def test_event_loop_answers_while_fn_waits_in_mpi(handoff_results, kind):
    """While rank 0 waits ~1 s (the job's SKEW) in ``kind`` for the last rank, its worker (and every other)
    still runs a function and hands over a block at once (in under half the wait): mpi4py never waits for
    another rank with the GIL held."""
    res = handoff_results["event_loop_answers_while_fn_waits_in_mpi"]
    assert res["status"] == "ok", res["status"]
    assert sorted(res["kinds"]) == sorted(WAIT_KINDS)
    got = res["kinds"][kind]
    assert got["rank0_waited_s"] >= 0.75 * res["skew_s"], got  # rank 0 really sat in MPI meanwhile
    took = got["max_answer_s"]
    assert took < 0.5 * res["skew_s"], f"a worker's event loop took {took} s to answer during {kind}"
    assert got["probes"] >= 3, got


def test_timeout_bounds_the_mpi_phase(handoff_results):
    # queued (up to the job's STUCK_S, 4 s) behind the ranks of the failed job, then a 1 s timeout on a 2.5 s function:
    # the bound keeps the slack it had when the ranks were stuck 8 s (< 15 s)
    stuck = handoff_results["error_with_rank_and_traceback"]["stuck_s"]
    assert 1.0 <= handoff_results["queued_after_stuck_ranks_and_timeout"]["timeout_after_s"] < stuck + 7


# -- clusters that are not one MPI job


@pytest.fixture
def local_cluster():
    from distributed import Client, LocalCluster

    def make(n):
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None)
        return cluster, Client(cluster)

    made = []

    def factory(n):
        c = make(n)
        made.append(c)
        return c

    yield factory
    for cluster, client in made:
        client.close()
        cluster.close()


def _hold(seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


def _block_sums(comm, parts):
    return comm.Get_size(), {i: float(b.sum()) for i, b in parts.items()}


def _formed_sets():
    from mpi4dask import handoff

    return len(handoff._formed)


@pytest.mark.timeout(180)
@served_worlds
def test_local_cluster_forms_mpi_on_demand(local_cluster):
    """A LocalCluster (tcp://, worker processes started by Nannies, no mpiexec): run_mpi joins the
    workers' MPI worlds through the scheduler's MPI service, reuses the communicator while the set of
    participants is unchanged, and takes workers added later into the next call."""
    import dask.array as da

    import mpi4dask

    cluster, client = local_cluster(3)
    x = da.arange(120.0, chunks=10).persist()
    expected = {(i,): float(np.arange(i * 10, i * 10 + 10).sum()) for i in range(12)}
    everyone = sorted(client.scheduler_info()["workers"])
    for _ in range(2):
        results = mpi4dask.run_mpi(_block_sums, x, workers=everyone)
        assert [size for size, _ in results] == [3, 3, 3]
        merged = {k: v for _, sums in results for k, v in sums.items()}
        assert merged == expected
    assert set(client.run(_formed_sets).values()) == {1}  # formed once, reused by the second call
    cluster.scale(4)
    client.wait_for_workers(4, timeout=60)
    everyone = sorted(client.scheduler_info()["workers"])
    results = mpi4dask.run_mpi(_block_sums, x, workers=everyone)
    assert [size for size, _ in results] == [4, 4, 4, 4]
    assert {k: v for _, sums in results for k, v in sums.items()} == expected
    formed = client.run(_formed_sets)
    assert sorted(formed.values()) == [1, 2, 2, 2]  # the old workers keep the 3-set, all have the 4-set


@pytest.mark.timeout(120)
def test_single_worker_cluster_works(local_cluster):
    import dask.array as da

    import mpi4dask

    _, client = local_cluster(1)
    x = da.arange(40.0, chunks=10)
    [(size, sums)] = mpi4dask.run_mpi(_block_sums, x)
    assert size == 1 and sums == {(i,): float(np.arange(i * 10, i * 10 + 10).sum()) for i in range(4)}


@pytest.mark.timeout(120)
def test_participant_that_dies_before_the_start(local_cluster):
    """The rank task cannot start (the worker's only thread is busy), then its worker is killed:
    a clear error within seconds, not a task waiting forever (distributed#8320)."""
    import mpi4dask

    _, client = local_cluster(1)
    [addr] = client.scheduler_info()["workers"]
    pid = client.run(os.getpid)[addr]
    data = client.submit(np.ones, 3, workers=[addr])
    data.result()
    busy = client.submit(_hold, 60, workers=[addr], pure=False)
    outcome = {}

    def call():
        t0 = time.monotonic()
        try:
            mpi4dask.run_mpi(_block_sums, [data])
        except BaseException as e:  # noqa: BLE001 - recorded and asserted below
            outcome["error"] = e
        outcome["took"] = time.monotonic() - t0

    t = threading.Thread(target=call)
    t.start()
    time.sleep(2)  # run_mpi is now waiting for its rank task to start
    assert t.is_alive(), f"run_mpi returned while the worker's thread was busy: {outcome}"
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive(), "run_mpi hangs on a dead participant"
    assert isinstance(outcome.get("error"), mpi4dask.MPIJobError), outcome
    err = outcome["error"]
    # killed while run_mpi waits for the rank task to start, or (on a slow machine, still setting the call
    # up when the 2 s are over) while it hands its workers the job: either says who, that nothing ran, and
    # the way on
    assert re.search(r"not in the cluster any more|died or left the cluster while the call was being set up",
                     str(err)), str(err)
    assert err.lost and err.worker == addr, (err.lost, err.worker, addr)
    assert "nothing ran" in str(err) and "retries=" in str(err), str(err)
    assert time.monotonic() - killed_at < 30
    del busy


# -- the examples


@pytest.mark.timeout(200)
@pytest.mark.parametrize("example, expect", [
    ("print_data_and_rank.py", r"print_data_and_rank: OK \(\d ranks, sum 276\)"),
    ("mpi_sort_and_dot.py", r"sample sort: 200000 values over \d ranks .* match np\.sort"),
])
def test_examples(example, expect):
    rc, out, err = run_mpiexec(5, [sys.executable, ROOT / "examples" / example], timeout=180)
    assert rc == 0, err[-4000:]
    assert re.search(expect, out), out[-3000:]
    if example == "print_data_and_rank.py":
        assert len(re.findall(r"rank \d of \d on \S+: block \(\d, \d\)", out)) == 4, out
    else:
        assert "dot product: X.T @ y over" in out and "matches NumPy" in out, out




@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", ["dask-mpi", "initialize-tcp"])
def test_other_launchers(launcher, tmp_path):
    """run_mpi needs the workers to be MPI ranks, not mpi://: dask-mpi and initialize(protocol="tcp") work."""
    script = Path(__file__).parent / "jobs" / "other_launchers.py"
    rc, out, err = run_mpiexec(4, [sys.executable, script, launcher], timeout=120)
    assert rc == 0, err[-4000:]
    assert "OTHER LAUNCHER OK" in out, out[-2000:]


def _import_mpi_as_a_user_would():
    from mpi4py import MPI  # mpi4py's defaults: MPI_Init at import, as a singleton

    return MPI.Is_initialized()


@pytest.mark.timeout(120)
@served_worlds
def test_worker_whose_mpi_cannot_join_is_named(local_cluster):
    """A worker whose MPI was started as a singleton (the user imported mpi4py.MPI there first) cannot
    connect/accept: run_mpi names that worker and the cause instead of hanging."""
    import dask.array as da

    import mpi4dask

    _, client = local_cluster(2)
    a, b = sorted(client.scheduler_info()["workers"])
    assert client.run(_import_mpi_as_a_user_would, workers=[b]) == {b: True}
    x = da.arange(40.0, chunks=10).persist()
    t0 = time.monotonic()
    with pytest.raises(mpi4dask.MPIUnavailableError, match=rf"worker {b} .*singleton"):
        mpi4dask.run_mpi(_block_sums, x, workers=[a, b])
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(150)
@served_worlds
def test_workers_sharing_one_process_are_named(tmp_path):
    """Workers inside one process (``Client(processes=False)``) are one MPI rank: run_mpi over two of them
    refuses at once, naming both and the fix (it failed inside MPICH with "Invalid communicator" or "Invalid
    port" before), and the cluster keeps computing; one in-process worker works."""
    rc, stdout, stderr = run_command([sys.executable, HERE / "jobs" / "run_mpi_in_process_workers.py"], timeout=120,
                                     cwd=tmp_path)
    results = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and len(results) == 1, f"rc {rc}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    got = json.loads(results[0])
    a, b = got["workers"]
    assert "two" not in got, got
    kind, text = got["two_error"]
    assert kind == "MPIUnavailableError", got["two_error"]
    assert f"workers {a} and {b} run in one process" in text and "processes=True" in text, text
    assert got["two_seconds"] < 30, got
    assert got["sum_after"] == float(np.arange(1000.0).sum())
    assert got["one"] == [[1, float(np.arange(1000.0).sum())]], got["one"]
    assert "Invalid communicator" not in stderr and "Invalid port" not in stderr, stderr[-4000:]


@pytest.mark.timeout(200)
@served_worlds
def test_cluster_closed_right_after_run_mpi_closes_quietly(tmp_path):
    """A script closes its cluster the moment run_mpi returns or raises: the per-worker locks of the call
    are released before that (distributed logged 'Release failed ... ConnectionPool is closed' with a
    traceback for each lock released after the client closed, after a failed call in 5 of 6 runs, over both
    protocols).  Over mpi://, but for Intel MPI, whose processes that joined over mpi:// hang in MPI_Finalize
    at exit (docs/mpi-support.md): over tcp:// there (the locks are the same)."""
    protocol = "tcp" if MPI_FAMILY == "intel" else "mpi"
    rc, stdout, stderr = run_command([sys.executable, HERE / "jobs" / "run_mpi_close_after.py", protocol],
                                     timeout=180, cwd=tmp_path)
    results = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and len(results) == 1, f"rc {rc}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    got = json.loads(results[0])
    assert got["ok"] == [6, 6, 6], got
    assert got["raises"] == ["MPIJobError", 1, "ValueError"], got
    assert got["unsendable"][0] == "MPIJobError" and got["unsendable"][2] == "TypeError", got
    assert "Release failed" not in stderr and "ConnectionPool is closed" not in stderr, stderr[-4000:]


@pytest.mark.timeout(120)
@only_with("openmpi", why="tests the error of the one MPI whose processes started apart cannot join (Open MPI)")
def test_open_mpi_on_a_cluster_dask_started_names_the_mpi_the_reason_and_the_fix(local_cluster):
    """Open MPI's singletons have no PMIx server and cannot connect/accept, and mpi4dask's PMI-1 service
    cannot serve them: run_mpi on a LocalCluster fails at once, naming the MPI, why, and what to do."""
    import dask.array as da

    import mpi4dask

    _, client = local_cluster(2)
    x = da.arange(40.0, chunks=10).persist()
    t0 = time.monotonic()
    with pytest.raises(mpi4dask.MPIUnavailableError) as info:
        mpi4dask.run_mpi(_block_sums, x, workers=sorted(client.scheduler_info()["workers"]))
    text = str(info.value)
    assert MPI_LIBRARY in text and "no PMIx server" in text and "MPICH" not in text.split("Fix:")[0], text
    assert "Fix: start this cluster under Open MPI's launcher" in text, text
    assert time.monotonic() - t0 < 60


@served_worlds
def test_remote_traceback_names_the_users_file_and_line(tmp_path):
    """A script's ``fn`` and the helper it gets in kwargs are pickled by value; whatever cloudpickle names
    their code on the workers (3.1.3: ``<dynamic-code>``), the error shows this script's file and lines."""
    script = HERE / "jobs" / "traceback_job.py"
    out = tmp_path / "tb.json"
    rc, stdout, stderr = run_command([sys.executable, script, out], timeout=150, cwd=tmp_path)
    assert rc == 0 and out.exists(), f"rc {rc}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    got = json.loads(out.read_text())
    lines = script.read_text().splitlines()
    failing = next(n for n, line in enumerate(lines, 1) if "FAILING LINE" in line)
    calling = next(n for n, line in enumerate(lines, 1) if "check(b)" in line)
    for where in ("remote", "text", "cause"):
        text = got.get(where, "")
        assert f'File "{script}", line {failing}, in check_block' in text, f"{where}:\n{text}"
        assert f'File "{script}", line {calling}, in ' in text, f"{where}:\n{text}"
        assert 'raise ValueError("a block over 1000 on purpose")' in text, f"{where}:\n{text}"
        assert "<dynamic-code>" not in text, f"{where}:\n{text}"
