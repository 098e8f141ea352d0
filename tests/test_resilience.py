"""Workers die, the MPI work goes on (clusters whose MPI Dask formed itself: no hydra to end them).

Each scenario is a fresh script with its own LocalCluster of worker processes (Nannies), run the way
a user runs it; it prints one ``RESULT <json>`` line that the assertions check.  Workers are killed
with SIGKILL, from outside (the transport) or by the MPI function itself on one rank (run_mpi).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run_command


def run_script(tmp_path: Path, text: str, timeout: float, *args) -> tuple[dict, str]:
    path = tmp_path / "scenario.py"
    path.write_text(text)
    rc, out, err = run_command([sys.executable, str(path), *map(str, args)], timeout, cwd=tmp_path)
    found = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and len(found) == 1, f"rc={rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    for word in ("Abort", "Fatal error"):
        assert word not in out + err, err
    return json.loads(found[0]), err


# --------------------------------------------------------------------------------------------
# run_mpi: a participant dies in the MPI phase

RUN_MPI_DEATH = r"""
import json, os, signal, sys, time
import numpy as np, dask.array as da
from distributed import Client, LocalCluster
import mpi4dask

def fn(comm, parts, mark):
    local = sum(float(np.asarray(b).sum()) for b in parts.values())
    if comm.Get_rank() == 1 and not os.path.exists(mark):
        time.sleep(0.5)  # the other ranks wait in the allreduce by now
        with open(mark, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    return comm.Get_size(), comm.allreduce(local)

if __name__ == "__main__":
    with LocalCluster(protocol=sys.argv[1], n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        names = sorted(w["name"] for w in client.scheduler_info()["workers"].values())
        x = da.random.default_rng(0).random((3000, 3000), chunks=(1000, 1000)).persist()
        ref = float(np.asarray(x).sum())
        out = {}
        t0 = time.monotonic()
        try:
            mpi4dask.run_mpi(fn, x, mark="first", workers=names)
            out["first"] = None
        except mpi4dask.MPIJobError as e:
            out["first"] = {"lost": e.lost, "rank": e.rank, "worker": e.worker, "message": str(e),
                            "kill_to_error": time.time() - float(open("first").read()),
                            "call": time.monotonic() - t0}
        client.wait_for_workers(3, timeout=60)
        r = mpi4dask.run_mpi(fn, x, mark="first", workers=names)  # no death this time
        out["next"] = {"sizes": [s for s, _ in r], "right": all(abs(v - ref) <= 1e-9 * ref for _, v in r)}
        t0 = time.monotonic()
        r = mpi4dask.run_mpi(fn, x, mark="second", workers=names, retries=1)  # dies once, runs again
        out["retried"] = {"sizes": [s for s, _ in r], "right": all(abs(v - ref) <= 1e-9 * ref for _, v in r),
                          "kill_to_answer": time.time() - float(open("second").read())}
        client.wait_for_workers(3, timeout=60)
        r = mpi4dask.run_mpi(fn, x, mark="second", workers=names)
        out["after"] = {"sizes": [s for s, _ in r], "right": all(abs(v - ref) <= 1e-9 * ref for _, v in r)}
    print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("protocol", ["mpi", "tcp"])
def test_run_mpi_participant_dies_in_the_mpi_phase(protocol, tmp_path):
    got, _ = run_script(tmp_path, RUN_MPI_DEATH, 120, protocol)
    first = got["first"]
    assert first is not None, "the call whose rank 1 died returned"
    assert first["lost"] is True and first["rank"] == 1, first
    assert first["worker"] in first["message"] and "died or left" in first["message"], first
    assert first["kill_to_error"] < 5.0, first  # the bound; measured ~0.5 s
    assert "were ended, their Nannies start new workers" in first["message"], first  # blocked ranks released
    assert got["next"] == {"sizes": [3, 3, 3], "right": True}, got  # the cluster serves the next call
    assert got["retried"]["sizes"] == [3, 3, 3] and got["retried"]["right"] is True, got
    assert got["retried"]["kill_to_answer"] < 30, got
    assert got["after"] == {"sizes": [3, 3, 3], "right": True}, got


# --------------------------------------------------------------------------------------------
# the transport: a worker dies during a computation over mpi://

TRANSPORT_DEATH = r"""
import json, os, signal, threading, time
import numpy as np, dask.array as da
from distributed import Client, LocalCluster
import mpi4dask

def peers():
    return [c["peer"] for c in mpi4dask.connections()]

def cpu():
    return time.process_time()

if __name__ == "__main__":
    with LocalCluster(protocol="mpi", n_workers=3, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        A, B, C = sorted(client.scheduler_info()["workers"])
        rng = da.random.default_rng(42)
        x = rng.random((8000, 8000), chunks=(1000, 1000)).persist()
        a = np.asarray(x)
        ref = float((a + a.T).sum())
        pid_b = client.run(os.getpid, workers=[B])[B]
        before = client.run(peers, workers=[A, C])
        timer = threading.Timer(0.15, os.kill, (pid_b, signal.SIGKILL))
        killed_at = time.monotonic() + 0.15
        timer.start()
        t0 = time.monotonic()
        got = float((x + x.T).sum().compute())
        compute_s = time.monotonic() - t0
        # how long until no survivor lists a connection to the dead worker any more
        while True:
            left = {w: [p for p in ps if p == B] for w, ps in client.run(peers, workers=[A, C]).items()}
            if not any(left.values()) or time.monotonic() - killed_at > 20:
                break
            time.sleep(0.05)
        closed_after = time.monotonic() - killed_at
        time.sleep(1.0)
        survivors = [A, C]
        c0 = client.run(cpu, workers=survivors)
        time.sleep(2.0)
        c1 = client.run(cpu, workers=survivors)
        out = {"right": abs(got - ref) <= 1e-9 * abs(ref), "got": got, "ref": ref,
               "had_b": {w: B in ps for w, ps in before.items()}, "left": left, "closed_after": closed_after,
               "idle_cpu": [c1[w] - c0[w] for w in survivors],
               "workers_now": len(client.scheduler_info()["workers"]), "compute_s": compute_s}
    print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.timeout(150)
def test_worker_killed_during_a_computation_over_mpi(tmp_path):
    got, _ = run_script(tmp_path, TRANSPORT_DEATH, 120)
    assert got["right"] is True, got  # Dask recomputed what was lost, over mpi://
    assert got["compute_s"] > 0.15, got  # the kill came during the computation
    assert not any(got["left"].values()), got  # the survivors' connections to it are closed ...
    assert got["closed_after"] < 5.0, got  # ... within 5 s of the kill
    assert all(s < 0.3 for s in got["idle_cpu"]), got  # in 2 s: nobody spins on the dead peer


# --------------------------------------------------------------------------------------------
# under mpiexec nothing survives a rank's death: the job ends, and says which rank died

KILL_RANK_CLIENT = r"""
import json, os, signal, sys, time
from distributed import Client
with Client(scheduler_file=sys.argv[1], timeout=60) as client:
    client.wait_for_workers(3, timeout=60)
    pids = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
    pid = client.run(os.getpid, workers=[pids[2]])[pids[2]]
    print("RESULT " + json.dumps({"pid": pid}), flush=True)
"""


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
        got, _ = run_script(tmp_path, KILL_RANK_CLIENT, 60, sched)
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
    job = Path(__file__).parent / "jobs" / "join_death.py"
    got, err = run_script(tmp_path, job.read_text(), 170)
    assert got["dying_rc"] == -9, got  # it died inside the join, as injected
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


# --------------------------------------------------------------------------------------------
# elastic: adapt() scales up and down while computations and run_mpi calls go on

ADAPT = r"""
import json, sys, time
import numpy as np, dask.array as da
from distributed import Client, LocalCluster
import mpi4dask

def total(comm, parts):
    return comm.Get_size(), comm.allreduce(sum(float(np.asarray(b).sum()) for b in parts.values()))

def nap(i):
    time.sleep(0.5)  # known durations, no CPU: adapt's estimate does not depend on the machine's load
    return i

def links():
    return sorted({(c["transport"], c["mpi_route"]) for c in mpi4dask.connections()
                   if c["mpi_bytes_received"] + c["mpi_bytes_sent"] > 0})

if __name__ == "__main__":
    with LocalCluster(protocol=sys.argv[1], n_workers=1, threads_per_worker=2, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        cluster.adapt(minimum=1, maximum=3, interval="200ms", wait_count=5, target_duration="2s")
        load = client.map(nap, range(200), pure=False)  # 100 s of naps: adapt wants 3 workers
        out = {"calls": 0, "right": 0, "workers": [], "run_mpi_sizes": [], "errors": []}
        phase, t0, i = "up", time.monotonic(), 0
        while time.monotonic() - t0 < 150:
            i += 1
            x = da.random.default_rng(i).random((1200, 1200), chunks=(300, 300))
            a = np.asarray(x.compute(scheduler="sync"))
            try:
                y = (x + x.T).persist()
                got = float(y.sum().compute())
                out["calls"] += 1
                out["right"] += abs(got - float((a + a.T).sum())) <= 1e-9 * abs(got)
                r = mpi4dask.run_mpi(total, y, retries=3, timeout=60)
                out["calls"] += 1
                out["right"] += all(abs(v - got) <= 1e-9 * abs(got) for _, v in r)
                out["run_mpi_sizes"].append(r[0][0])
                del y
            except Exception as e:  # counted: the test fails on any
                out["errors"].append(f"{type(e).__name__}: {e}"[:300])
            n = len(client.scheduler_info()["workers"])
            out["workers"].append(n)
            if phase == "up" and n >= 2 and max(out["run_mpi_sizes"], default=0) >= 2:
                out["links"] = client.run(links)  # the workers adapt added moved bytes over MPI
                out["up_after"] = time.monotonic() - t0
                phase = "drain"
            if phase == "drain" and all(f.done() for f in load):
                out["naps_right"] = client.gather(load) == list(range(200))
                del load
                phase, down_from = "down", time.monotonic()
            if phase == "down" and n == 1:
                out["down_after"] = time.monotonic() - down_from
                phase = "done"
                break
            if phase == "down":
                # the load falls: calls go on, 1 s apart.  (Under back-to-back calls adapt picks a
                # different idle worker to retire every interval and takes 40-90 s to settle, as
                # much over tcp:// as over mpi://, measured.)
                time.sleep(1.0)
        out["phase"] = phase
        out["iterations"] = i
    print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.timeout(240)
def test_adaptive_cluster_scales_up_and_down_while_work_and_run_mpi_go_on(tmp_path):
    got, _ = run_script(tmp_path, ADAPT, 210, "mpi")
    assert got["errors"] == [] and got["right"] == got["calls"] >= 6, got  # every answer right, none lost
    assert got["phase"] == "done", got  # it scaled up, drained the naps, and scaled down to 1
    assert max(got["workers"]) >= 2 and max(got["run_mpi_sizes"]) >= 2, got  # run_mpi took new workers in
    assert got["naps_right"] is True, got
    pairs = [ls for ls in got["links"].values() if ls]
    assert pairs and all(ls == [["mpi", "pair"]] for ls in pairs), got  # new workers moved bytes over MPI


# --------------------------------------------------------------------------------------------
# blocks that no worker may run any more


@pytest.mark.timeout(120)
def test_run_mpi_over_blocks_pinned_to_a_worker_that_left_fails_clearly(tmp_path):
    """Blocks submitted with workers=[A] (strict), A restarted by its Nanny: distributed holds them as
    'no-worker' for ever; run_mpi says which block, which worker it was pinned to, and the fix,
    within seconds (before: it waited for ever)."""
    script = Path(__file__).parent / "jobs" / "pinned_blocks.py"
    got, _ = run_script(tmp_path, script.read_text(), 100)
    assert got["before"] == [6000], got  # every block on A: A alone takes part
    after = got["after"]
    assert after is not None, got
    assert "can run on no worker of the cluster" in after["message"], after
    assert "which left the cluster" in after["message"] and "without workers=" in after["message"], after
    assert after["lost"] is False, after
    assert got["seconds"] < 30, got
