"""Workers die, the MPI work goes on (clusters whose MPI Dask formed itself: no hydra to end them).

Each scenario is a fresh script (``tests/jobs/``) with its own LocalCluster of worker processes
(Nannies), run the way a user runs it; it prints one ``RESULT <json>`` line that the assertions
check.  Workers are killed with SIGKILL, from outside (the transport) or by the MPI function itself on
one rank (run_mpi).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import MPI_FAMILY, only_with, run_command

JOBS = Path(__file__).parent / "jobs"


def run_script(tmp_path: Path, name: str, timeout: float, *args) -> tuple[dict, str]:
    """Run the job script ``tests/jobs/<name>`` in ``tmp_path``; return its RESULT (parsed) and its stderr."""
    rc, out, err = run_command([sys.executable, str(JOBS / name), *map(str, args)], timeout, cwd=tmp_path)
    found = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and len(found) == 1, f"rc={rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    for word in ("Abort", "Fatal error"):
        assert word not in out + err, err
    return json.loads(found[0]), err


# --------------------------------------------------------------------------------------------
# run_mpi: a participant dies in the MPI phase


@pytest.mark.timeout(150)
@pytest.mark.parametrize("protocol", ["mpi", "tcp"])
def test_run_mpi_participant_dies_in_the_mpi_phase(protocol, tmp_path):
    got, _ = run_script(tmp_path, "run_mpi_rank_dies.py", 120, protocol)
    first = got["first"]
    assert first is not None, "the call whose rank 1 died returned"
    assert first["lost"] is True and first["rank"] == 1, first
    assert first["worker"] in first["message"] and "died or left" in first["message"], first
    assert first["kill_to_error"] < 5.0, first  # the bound; measured ~0.5 s
    assert "were ended, their Nannies start new workers" in first["message"], first  # blocked ranks released
    # the cluster serves the next call; the death replaced the dead worker and the 2 ended ranks, each once
    # (a Nanny told to restart after its worker ended itself ends the new one too: the 4th join seen before the fix)
    assert got["next"] == {"sizes": [3, 3, 3], "right": True, "churn": {"joined": 3, "left": 3}}, got
    assert got["retried"]["sizes"] == [3, 3, 3] and got["retried"]["right"] is True, got
    assert got["retried"]["kill_to_answer"] < 30, got
    assert got["after"] == {"sizes": [3, 3, 3], "right": True, "churn": {"joined": 3, "left": 3}}, got
    # the workers of the retried call and of the last one (the others were ended) count both calls on rank 0's
    # worker, the retry among them, and 6 rank tasks that ended well (Prometheus samples, as /metrics serves them)
    samples = [s for ss in got["metrics"].values() for s in ss]

    def total(name, **labels):
        return sum(v for n, ls, v in samples if n == name and labels.items() <= ls.items())

    assert total("mpi4dask_run_mpi_calls_total") == 2, samples
    assert total("mpi4dask_run_mpi_retries_total") == 1, samples
    assert total("mpi4dask_run_mpi_rank_tasks_total", outcome="ok") == 6, samples
    assert total("mpi4dask_run_mpi_rank_tasks_total", outcome="failed") == 0, samples


@pytest.mark.timeout(150)
def test_run_mpi_frozen_rank_is_restarted_by_its_nanny(tmp_path):
    """A rank whose worker answers nothing (stopped) cannot end itself after a death: its Nanny replaces it,
    once, and the next call finds the cluster whole."""
    got, _ = run_script(tmp_path, "run_mpi_rank_frozen.py", 120, "mpi")
    first = got["first"]
    assert first is not None and first["lost"] is True and first["rank"] == 1, got
    assert "were ended, their Nannies start new workers" in first["message"], got
    assert got["frozen_alive"] is False, got  # its Nanny killed the frozen process before the error came
    assert first["kill_to_error"] < 15, got  # END_ASK, then the Nanny's kill (4 s for a graceful stop)
    assert got["next"] == {"sizes": [3, 3, 3], "right": True, "churn": {"joined": 3, "left": 3}}, got


# --------------------------------------------------------------------------------------------
# the transport: a worker dies during a computation over mpi://


@pytest.mark.timeout(150)
def test_worker_killed_during_a_computation_over_mpi(tmp_path):
    got, _ = run_script(tmp_path, "worker_dies_mid_compute.py", 120)
    assert got["watch_error"] is None, got  # both survivors answered throughout (in CI once, one segfaulted)
    assert got["right"] is True, got  # Dask recomputed what was lost, over mpi://
    assert got["compute_s"] > 0.15, got  # the kill came during the computation
    assert not any(got["left"].values()), got  # the survivors' connections to it are closed ...
    assert got["closed_after"] < 5.0, got  # ... within 5 s of the kill
    # in 2 s: nobody spins on the dead peer (the message names the threads that used the CPU)
    assert all(s < 0.3 for s in got["idle_cpu"]), (f"idle CPU {got['idle_cpu']} s, by thread "
                                                    f"{got['idle_cpu_by_thread']}; {json.dumps(got)}")
    assert got["survivors_pids_now"] == got["survivors_pids"], got  # the survivors lived on (none restarted)
    # MPICH's shared-memory file of the killed worker (1 MiB in /dev/shm, removed only by MPI_Finalize) is not
    # left behind: mpi4dask removed its name at MPI init (a world of one process; mpi4dask._mpi._unlink_own_shm)
    if MPI_FAMILY == "mpich":
        assert got["shm_b"] and not got["shm_b_left"], got


@pytest.mark.timeout(200)
@only_with("mpich", why="tests the copy of MPICH's UCX (CMA), whose failure UCX would make fatal (mpi4dask._ucx)")
def test_a_worker_killed_mid_copy_fails_the_move_not_its_reader(tmp_path):
    got, err = run_script(tmp_path, "holder_killed_mid_copy.py", 170)
    attempts = got["attempts"]
    assert all(a["over_mpi"] for a in attempts), got  # each move was to go over MPI
    assert attempts and attempts[-1]["cut"], got  # a kill did land in the middle of the reader's copy ...
    assert got["reader_still_there"] and got["reader_pid_now"] == got["reader_pid"], got  # ... and it lived on
    assert all(a["sum"] == got["n"] for a in attempts), got  # every answer right (recomputed), none from a partial copy
    assert "died while MPI copied a message from it" in err, err


@pytest.mark.timeout(200)
@only_with("mpich", why="tests MPICH's send to a peer whose UCX endpoint failed in a cut copy (mpi4dask._ucx)")
def test_a_write_to_a_peer_that_died_mid_copy_fails_the_connection_not_the_worker(tmp_path):
    got, err = run_script(tmp_path, "write_to_peer_dead_mid_copy.py", 170)
    last = got["attempts"][-1]
    assert last["cut"], got  # a kill did cut the reader's copy ...
    # ... and its write to the dead peer, on a connection not yet seen to close, failed that connection
    assert last["write"] == "CommClosedError" and "died while MPI copied a message from it" in last["write_error"], got
    assert last["write_s"] < 1.0, got  # at once, not after a timeout
    assert got["reader_still_there"] and got["reader_pid_now"] == got["reader_pid"], got  # no crash, no restart
    assert got["after"] == {"sum": got["n"], "mpi_bytes": 8 * got["n"]}, got  # it still moves data over MPI, whole


# --------------------------------------------------------------------------------------------
# under mpiexec nothing survives a rank's death: the job ends, and says which rank died


@pytest.mark.timeout(120)
def test_under_mpiexec_a_dead_rank_ends_the_job_naming_it(tmp_path):
    import os
    import signal
    import time

    from conftest import BIN, MPIEXEC, Background

    sched = tmp_path / "sched.json"
    with Background([MPIEXEC, "-n", "4", str(BIN / "mpi4dask"), "serve", "--scheduler-file", str(sched)],
                    cwd=tmp_path) as job:
        job.wait_for_file(sched, 60)
        got, _ = run_script(tmp_path, "worker_pid_by_name.py", 60, sched)
        os.kill(got["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        rc = job.wait(timeout=60)
        ended_after = time.monotonic() - t0
        out, err = job.output()
    assert rc != 0, (out, err)
    assert ended_after < 30, ended_after
    assert err.count("mpi4dask: rank 2 of this mpiexec job") == 1 and " died" in err, err
    assert err.count("of this mpiexec job (pid") == 1, err  # only the rank that died is named, not those mpiexec killed


# --------------------------------------------------------------------------------------------
# chaos: random kills, joins and departures while computations and run_mpi calls go on

@pytest.mark.timeout(300)
@pytest.mark.slow
def test_chaos_short_run(tmp_path):
    """30 s of ``mpi4dask stress chaos`` (fixed seed), as a user runs it: 0 hung, 0 wrong, every
    run_mpi call (retries=3) answered; a computation may fail only with Dask's own clear error
    after repeated deaths."""
    from conftest import BIN

    cmd = [str(BIN / "mpi4dask"), "stress", "chaos", "--seconds", "30", "--seed", "7", "--protocols", "mpi",
           "--output", str(tmp_path)]
    rc, out, err = run_command(cmd, 260, cwd=tmp_path)
    assert (tmp_path / "chaos.json").exists(), f"rc={rc}\n--- stdout\n{out}\n--- stderr\n{err[-20000:]}"
    got = json.loads((tmp_path / "chaos.json").read_text())["jobs"][0]
    c = got["counts"]
    assert c["hung"] == 0 and c["wrong"] == 0, f"{got}\n--- stderr (the stacks of a hung call)\n{err[-20000:]}"
    assert rc == 0 and "| mpi:// |" in out, f"rc={rc}\n{out}\n{err[-5000:]}"  # the report, and no failure
    assert c["kills"] + c["scales"] >= 5, got  # the chaos happened
    assert c["run_mpi_calls"] >= 3 and c["run_mpi_right"] == c["run_mpi_calls"], got
    assert c["right"] + c["failed"] == c["calls"], got
    assert all("KilledWorker" in e for e in got["errors"]), got


# --------------------------------------------------------------------------------------------
# the transport: a worker dies half-way through joining MPI with another (tests/jobs/join_death.py)

@pytest.mark.timeout(200)
def test_a_worker_dying_while_joining_mpi_leaves_its_peer_working(tmp_path):
    got, err = run_script(tmp_path, "join_death.py", 170, "in_mpi")
    assert got["dying_rc"] == -9, got  # it died inside the join (its GO sent: A was inside MPI_Comm_accept)
    # a connection that waited for A's join slot meanwhile works, over TCP (A joins no world now)
    assert got["waiter"]["ok"] is True and got["waiter"]["links"] == ["socket"], got
    assert got["waiter"]["unsafe"] == "", got  # and the waiter was not dragged into a failed join of its own
    assert got["got1"] == got["ref"] and got["got2"] == got["ref"], got  # right answers, before and after
    assert got["first_s"] < 30, got
    assert got["a_lives"] is True, got  # the peer of the dead joiner was not ended
    assert "failed (the peer probably died half-way)" in err, err[-5000:]
    assert got["c_to_a"] == ["socket"], got  # A joins no other world: a new worker talks to it over TCP
    assert got["a_idle_cpu"] < 0.3, got  # nothing spins in it
    assert got["run_mpi"] == {"sizes": [2, 2], "values": [4e6, 4e6]}, got  # restarted, then the call ran


@pytest.mark.timeout(200)
def test_a_worker_dying_before_its_join_reaches_mpi_costs_its_peer_nothing(tmp_path):
    """It dies after A told it the port and before its GO byte (the handshake's step 6p): A's join
    thread sees the connection close and never enters MPI, so A goes on joining other workers."""
    got, err = run_script(tmp_path, "join_death.py", 170, "before_go")
    assert got["dying_rc"] == -9, got
    assert got["waiter"]["ok"] is True and got["waiter"]["links"] == ["mpi"], got  # it joined A, over MPI
    assert got["got1"] == got["ref"] and got["got2"] == got["ref"], got
    assert got["first_s"] < 30, got
    assert got["a_lives"] is True and got["a_unsafe"] == "", got
    assert "failed (the peer probably died half-way)" not in err, err[-5000:]
    assert got["c_to_a"] == ["mpi"], got  # a new worker talks to A over MPI
    assert got["a_idle_cpu"] < 0.3, got
    assert got["run_mpi"] == {"sizes": [2, 2], "values": [4e6, 4e6]}, got


@pytest.mark.timeout(200)
def test_a_pair_join_that_outlives_its_handshake_is_kept_on_both_sides_and_used(tmp_path):
    """distributed gives up a connect attempt after a fifth of its timeout; an attempt given up while its
    join thread waits inside MPI_Comm_connect (its peer's accept came late) still joins the two worlds.
    Both sides keep that pair (it was lost on the connecting side, held on the other), and later
    connections use it."""
    got, _ = run_script(tmp_path, "late_join.py", 170)
    assert got["got"] == got["ref"], got  # the fetch that retried got the right answer
    c, s = got["c"], got["s"]
    c_s, s_c = c["pairs"][s["ident"]], s["pairs"][c["ident"]]
    assert len(c_s) == 2, got  # the join given up, then the retry's own: the case did happen
    assert sorted(c_s) == sorted(s_c), got  # each pair is held by both sides
    # every process holds exactly the pairs its peers hold with it (scheduler included), each join counted once
    procs = [c, s, got["scheduler"]]
    for p in procs:
        for q in procs:
            if p is not q and (q["ident"] in p["pairs"] or p["ident"] in q["pairs"]):
                assert sorted(p["pairs"].get(q["ident"], [])) == sorted(q["pairs"].get(p["ident"], [])), got
        assert p["joins"] == sum(len(v) for v in p["pairs"].values()), got
    echo = got["echo"]  # a new connection: it reuses the first pair, the late one, and 16 MiB cross it whole
    assert echo["pair"] == c_s[0] and echo["sha_back"] == echo["sha_sent"] and echo["mpi_bytes"] >= 16 << 20, got


# --------------------------------------------------------------------------------------------
# elastic: adapt() scales up and down while computations and run_mpi calls go on


@pytest.mark.timeout(240)
def test_adaptive_cluster_scales_up_and_down_while_work_and_run_mpi_go_on(tmp_path):
    got, _ = run_script(tmp_path, "adaptive_cluster.py", 210, "mpi")
    assert got["errors"] == [] and got["right"] == got["calls"] >= 6, got  # every answer right, none lost
    assert got["phase"] == "done", got  # it scaled up, drained the naps, and scaled down to 1
    assert max(got["workers"]) >= 2 and max(got["run_mpi_sizes"]) >= 2, got  # run_mpi took new workers in
    assert got["naps_right"] is True, got
    pairs = [ls for ls in got["links"].values() if ls]
    assert all(ls == [["mpi", "pair"]] for ls in pairs), got  # whatever moved between workers moved over MPI
    # between every two workers (adapt started all but one) a block moves intact, over MPI on a joined pair
    moves = got["moves"]
    n = len({m["src"] for m in moves})
    assert n >= 2 and len(moves) == n * (n - 1), got
    for m in moves:
        assert m["intact"] is True, m
        assert m["links"] and all(t == "mpi" and r == "pair" for t, r, _ in m["links"]), m
        assert sum(n for _, _, n in m["links"]) >= 1 << 20, m


# --------------------------------------------------------------------------------------------
# blocks that no worker may run any more


@pytest.mark.timeout(120)
def test_run_mpi_over_blocks_pinned_to_a_worker_that_left_fails_clearly(tmp_path):
    """Blocks submitted with workers=[A] (strict), A restarted by its Nanny: distributed holds them as
    'no-worker' for ever; run_mpi says which block, which worker it was pinned to, and the fix,
    within seconds (before: it waited for ever)."""
    got, _ = run_script(tmp_path, "pinned_blocks.py", 100)
    assert got["before"] == [6000], got  # every block on A: A alone takes part
    after = got["after"]
    assert after is not None, got
    assert "can run on no worker of the cluster" in after["message"], after
    assert "which left the cluster" in after["message"] and "without workers=" in after["message"], after
    assert after["lost"] is False, after
    assert got["seconds"] < 30, got
