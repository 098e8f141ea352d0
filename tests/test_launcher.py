"""The launcher: ``mpi4dask.launcher.initialize``, ``mpi4dask serve``, and the launchers users know.

Every job here is a real ``mpiexec`` run (3-4 ranks) in a subprocess with a hard timeout; results are
checked against numpy computed in the same job (sha256 of exact results, allclose of reductions).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import BIN, MPIEXEC, Background, run_command, run_mpiexec

pytestmark = pytest.mark.timeout(240)

# What a clean job must not print (on stdout or stderr).
NOISE = ("Traceback", "CommClosedError", "Exception", "Stream is closed")


PROTOCOLS = ["mpi", "tcp"]


def assert_quiet(*texts: str) -> None:
    for text in texts:
        for word in NOISE:
            assert word not in text, f"{word!r} printed by a job that should end quietly:\n{text}"


# Computes on the cluster, checks against numpy in the same process, prints one CHECK line.
CHECK = r'''
import hashlib
import numpy as np
import dask.array as da

def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()

def check(client, n_workers):
    client.wait_for_workers(n_workers, timeout=30)
    info = client.scheduler_info()
    rng = np.random.default_rng(20240607)
    a = rng.standard_normal((1200, 900))
    x = da.from_array(a, chunks=(300, 300))
    # elementwise + transpose + rechunk: exact, and chunks move between workers
    y = (2 * x + 1).T.rechunk((450, 400)).compute()
    exact = sha(y) == sha((2 * a + 1).T)
    # a reduction needing all-to-all traffic
    s = (x @ x.T).sum().compute()
    close = bool(np.isclose(s, (a @ a.T).sum(), rtol=1e-10))
    # data generated on the workers, gathered back whole
    z = da.arange(2_000_000, chunks=250_000).reshape(1000, 2000) * 3
    zsha = sha(z.compute()) == sha(np.arange(2_000_000).reshape(1000, 2000) * 3)
    names = sorted(str(w["name"]) for w in info["workers"].values())
    addrs = [client.scheduler.address] + list(info["workers"])
    print(f"CHECK exact={exact} close={close} gathered={zsha} workers={','.join(names)} "
          f"protocols={','.join(sorted({a.split('://')[0] for a in addrs}))}", flush=True)
'''


def assert_check(out: str, workers: str | None, protocol: str) -> None:
    """One CHECK line, all checks true, the expected worker names (None: any) and protocol."""
    lines = [line for line in out.splitlines() if line.startswith("CHECK ")]
    assert len(lines) == 1, out
    fields = dict(item.split("=", 1) for item in lines[0].split()[1:])
    assert (fields["exact"], fields["close"], fields["gathered"]) == ("True", "True", "True"), out
    assert fields["protocols"] == protocol, out
    if workers is not None:
        assert fields["workers"] == workers, out


def initialize_job(protocol: str, body: str, pre: str = "", **kwargs) -> str:
    args = ", ".join([repr(protocol)] + [f"{k}={v!r}" for k, v in kwargs.items()])
    return (
        CHECK
        + textwrap.dedent(pre)
        + f"\nfrom mpi4dask.launcher import initialize\ninitialize({args})\n"
        + textwrap.dedent(body)
    )


# --------------------------------------------------------------------------------------------
# initialize


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_initialize_computes_and_exits_quietly(protocol):
    """4 ranks: rank 1's Client() finds the job's scheduler and 2 workers, results match numpy,
    the script body runs on rank 1 only, and the job ends with status 0 and no noise."""
    script = initialize_job(
        protocol,
        """
        print("BODY", flush=True)
        from distributed import Client
        client = Client()              # no address: the job's scheduler, via dask config
        check(client, 2)
        # left open on purpose: the exit hook closes it
        """,
        memory_limit="2GiB",
    )
    t0 = time.monotonic()
    rc, out, err = run_mpiexec(4, script, timeout=120)
    elapsed = time.monotonic() - t0
    assert rc == 0, (out, err)
    assert out.count("BODY") == 1, out
    assert_check(out, "2,3", protocol)
    assert_quiet(out, err)
    assert elapsed < 60, elapsed


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_initialize_uncaught_exception_aborts_job(protocol):
    """An exception on rank 1 prints its traceback once and ends every rank, non-zero, in seconds."""
    script = initialize_job(
        protocol,
        """
        from distributed import Client
        client = Client()
        assert client.submit(sum, [1, 2, 3]).result() == 6
        print("COMPUTED", flush=True)
        raise RuntimeError("boom-from-rank-1")
        """,
    )
    t0 = time.monotonic()
    rc, out, err = run_mpiexec(3, script, timeout=90)
    elapsed = time.monotonic() - t0
    assert rc != 0, (out, err)
    assert "COMPUTED" in out
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.count("RuntimeError: boom-from-rank-1") == 1, err
    assert elapsed < 30, elapsed


def test_initialize_too_few_ranks():
    """2 ranks: every rank raises ValueError naming the size and the fix; the job fails at once."""
    script = "from mpi4dask.launcher import initialize\ninitialize('tcp')\nprint('BODY')\n"
    rc, out, err = run_mpiexec(2, script, timeout=60)
    assert rc != 0
    assert "BODY" not in out
    assert "ValueError" in err and "has 2" in err and "mpiexec -n 3" in err, err


def test_initialize_singleton_too_few_ranks(tmp_path):
    """Plain ``python script.py`` (an MPI world of 1) gets the same ValueError."""
    path = tmp_path / "job.py"
    path.write_text("from mpi4dask.launcher import initialize\ninitialize('tcp')\n")
    rc, out, err = run_command([sys.executable, str(path)], timeout=60)
    assert rc != 0
    assert "ValueError" in err and "has 1" in err and "mpiexec -n 3" in err, err


def test_initialize_bad_protocol_under_mpiexec():
    script = "from mpi4dask.launcher import initialize\ninitialize('carrier-pigeon')\nprint('BODY')\n"
    rc, out, err = run_mpiexec(3, script, timeout=60)
    assert rc != 0
    assert "BODY" not in out
    assert "ValueError" in err and "'carrier-pigeon'" in err, err


def test_initialize_argument_errors_without_mpi():
    """Argument errors are raised before MPI is touched (so also in this test process)."""
    from mpi4dask import launcher

    with pytest.raises(ValueError, match="carrier-pigeon"):
        launcher.initialize("carrier-pigeon")
    with pytest.raises(ValueError, match="inproc"):
        launcher.initialize("inproc")
    with pytest.raises(ValueError, match="Nanny"):
        launcher.initialize("tcp", worker_class="distributed.Nanny")
    assert not launcher._initialized


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_exit_hook_creates_no_thread(protocol):
    """Python >= 3.12 refuses new threads in atexit hooks (dask-mpi #87). Refuse them here too, for
    every exit hook that runs after ours is registered, and check that the job still ends cleanly."""
    script = initialize_job(
        protocol,
        """
        import atexit, sys, threading, _thread
        from distributed import Client
        client = Client()
        check(client, 1)

        def refuse(*args, **kwargs):
            print("THREAD REFUSED", file=sys.stderr, flush=True)
            raise RuntimeError("can't create new thread at interpreter shutdown")

        def forbid_threads():
            threading._start_new_thread = refuse
            _thread.start_new_thread = refuse
            threading.Thread.start = refuse

        atexit.register(forbid_threads)   # runs before the launcher's hook (atexit is LIFO)
        """,
    )
    rc, out, err = run_mpiexec(3, script, timeout=120)
    assert rc == 0, (out, err)
    assert_check(out, "2", protocol)
    assert "THREAD REFUSED" not in err, err
    assert_quiet(out, err)


# After ``client.shutdown()`` a client over mpi:// logs (at INFO, with a traceback) that its batched
# stream could not write: the mpi:// comm raises CommClosedError on write as soon as the peer's goodbye
# has arrived, where tcp:// still accepts the write.  That is the user's client, not the launcher, so
# the launcher leaves it alone (see the launcher report).
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_initialize_client_shutdown_then_script_goes_on(protocol):
    """client.shutdown() stops the cluster early; the other ranks wait for the script, then exit 0."""
    script = initialize_job(
        protocol,
        """
        import time
        from distributed import Client
        client = Client()
        check(client, 2)
        client.shutdown()
        time.sleep(1.0)
        print("AFTER-SHUTDOWN", flush=True)
        """,
    )
    rc, out, err = run_mpiexec(4, script, timeout=120)
    assert rc == 0, (out, err)
    assert_check(out, "2,3", protocol)
    assert out.count("AFTER-SHUTDOWN") == 1
    assert_quiet(out, err)


def test_initialize_exit_false_and_explicit_shutdown():
    """exit=False: rank 1 gets True, ends the cluster with shutdown(); the others then get False
    and go on with the script."""
    script = (
        CHECK
        + textwrap.dedent(
            """
            from mpi4py import MPI
            from mpi4dask.launcher import initialize, shutdown
            is_client = initialize("mpi", exit=False)
            if is_client:
                from distributed import Client
                with Client() as client:
                    check(client, 2)
                shutdown()
            print(f"AFTER rank={MPI.COMM_WORLD.Get_rank()} client={is_client}", flush=True)
            """
        )
    )
    rc, out, err = run_mpiexec(4, script, timeout=120)
    assert rc == 0, (out, err)
    assert_check(out, "2,3", "mpi")
    # (mpiexec may glue lines of different ranks together: match the markers, not lines)
    after = sorted(re.findall(r"AFTER rank=(\d+) client=(True|False)", out))
    assert after == [("0", "False"), ("1", "True"), ("2", "False"), ("3", "False")], out
    assert_quiet(out, err)


# --------------------------------------------------------------------------------------------
# mpi4dask serve


def test_serve_arguments():
    from mpi4dask import launcher

    parser = argparse.ArgumentParser()
    launcher.add_serve_arguments(parser)
    args = parser.parse_args(["--scheduler-file", "f.json"])
    assert args.func is launcher.serve_main
    assert (args.scheduler_file, args.protocol, args.nthreads, args.memory_limit) == ("f.json", "mpi", 1, "auto")
    assert (args.dashboard, args.dashboard_address, args.interface, args.local_directory) == (False, ":8787", None, None)
    args = parser.parse_args(
        ["--scheduler-file", "f", "--protocol", "tcp", "--nthreads", "2", "--memory-limit", "1e9", "--dashboard"]
    )
    assert (args.protocol, args.nthreads, args.dashboard) == ("tcp", 2, True)
    assert launcher._parse_memory_limit(args.memory_limit) == 1e9
    assert launcher._parse_memory_limit("4GiB") == "4GiB"
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --scheduler-file is required


def serve_command(*args) -> list[str]:
    """``python -m mpi4dask serve ARGS`` (the real CLI)."""
    return [sys.executable, "-m", "mpi4dask", "serve", *map(str, args)]


def wait_for_file(path: Path, job: Background, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if job.proc.poll() is not None:
            pytest.fail(f"job ended before writing {path}: {job.output()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {path} after {timeout} s: {job.output()}")
        time.sleep(0.05)


CLIENT = CHECK + textwrap.dedent(
    """
    import sys
    from distributed import Client
    client = Client(scheduler_file=sys.argv[1], timeout=60)
    n = int(sys.argv[2])
    assert len(client.scheduler_info()["workers"]) == n   # the file is written once all are registered
    check(client, n)
    client.shutdown()
    print("SHUTDOWN SENT", flush=True)
    """
)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_serve_with_external_client(protocol, tmp_path):
    """``mpiexec -n 3 mpi4dask serve``: a client outside the job (plain python) computes, calls
    shutdown(), and the job ends with status 0, quietly, removing its scheduler file."""
    sf = tmp_path / "scheduler.json"
    client_py = tmp_path / "client.py"
    client_py.write_text(CLIENT)
    cmd = [MPIEXEC, "-n", "3", *serve_command("--scheduler-file", sf, "--protocol", protocol)]
    with Background(cmd, cwd=tmp_path) as job:
        rc, out, err = run_command([sys.executable, str(client_py), str(sf), "2"], timeout=120)
        assert rc == 0, (out, err)
        assert_check(out, "1,2", protocol)
        assert "SHUTDOWN SENT" in out
        assert job.wait(60) == 0, job.output()
        assert_quiet(*job.output())
    assert not sf.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_ends_cleanly_on_signal(sig, tmp_path):
    """SIGTERM/SIGINT to mpiexec (which forwards it to every rank) ends the job with status 0, quietly."""
    sf = tmp_path / "scheduler.json"
    cmd = [MPIEXEC, "-n", "3", *serve_command("--scheduler-file", sf)]
    with Background(cmd, cwd=tmp_path) as job:
        wait_for_file(sf, job, 60)
        address = json.loads(sf.read_text())["address"]
        assert address.startswith("mpi://"), address
        t0 = time.monotonic()
        job.proc.send_signal(sig)
        assert job.wait(60) == 0, job.output()
        assert time.monotonic() - t0 < 30
        assert_quiet(*job.output())
    assert not sf.exists()


def test_serve_too_few_ranks(tmp_path):
    rc, out, err = run_command(serve_command("--scheduler-file", tmp_path / "s.json", "--protocol", "tcp"), 60)
    assert rc == 2
    assert "at least 2 MPI ranks" in err and "has 1" in err and "mpiexec -n 2" in err, err


def test_serve_bad_protocol(tmp_path):
    rc, out, err = run_command(serve_command("--scheduler-file", tmp_path / "s.json", "--protocol", "nope"), 60)
    assert rc == 2
    assert "'nope'" in err, err


# --------------------------------------------------------------------------------------------
# the launchers users know: dask's CLI in one MPMD job, and dask-mpi


DASK = str(BIN / "dask")


def _mpmd_dask_cli(tmp_path, prefix: list[str]):
    sf = tmp_path / "scheduler.json"
    client_py = tmp_path / "client.py"
    client_py.write_text(CLIENT)
    cmd = [
        MPIEXEC,
        "-n", "1", *prefix, DASK, "scheduler", "--protocol", "mpi", "--scheduler-file", sf, "--no-dashboard",
        ":",
        "-n", "2", *prefix, DASK, "worker", "--no-nanny", "--nthreads", "1", "--scheduler-file", sf,
    ]  # fmt: skip
    with Background(list(map(str, cmd)), cwd=tmp_path) as job:
        rc, out, err = run_command([sys.executable, str(client_py), str(sf), "2"], timeout=45)
        assert rc == 0, (out, err, job.output())
        assert "SHUTDOWN SENT" in out
        assert_check(out, None, "mpi")
        assert job.wait(60) == 0, job.output()


@pytest.mark.timeout(120)
def test_dask_cli_mpmd_job(tmp_path):
    """``mpiexec -n 1 dask scheduler --protocol mpi ... : -n 2 dask worker --no-nanny ...`` + a client.

    MPICH's MPI_Init waits for every rank of the job; the workers reach it only after reading the
    scheduler file, so the scheduler must not initialise MPI before it has written that file.
    """
    _mpmd_dask_cli(tmp_path, [])


def test_dask_cli_mpmd_job_mpi_initialised_first(tmp_path):
    """The same MPMD job with ``python -m mpi4py`` in front, so every rank initialises MPI at start."""
    _mpmd_dask_cli(tmp_path, [sys.executable, "-m", "mpi4py"])


def test_dask_mpi_initialize_protocol_mpi():
    """dask-mpi's own ``initialize(protocol="mpi")`` under ``mpiexec -n 4`` runs over mpi://."""
    script = CHECK + textwrap.dedent(
        """
        from mpi4py import MPI          # dask-mpi PR #100: MPI before distributed
        import dask_mpi
        dask_mpi.initialize(protocol="mpi", dashboard=False, memory_limit="2GiB")
        from distributed import Client
        with Client() as client:
            check(client, 2)
        """
    )
    rc, out, err = run_mpiexec(4, script, timeout=120)
    assert rc == 0, (out, err)
    assert_check(out, "2,3", "mpi")


# --------------------------------------------------------------------------------------------
# the example


def test_demo_example():
    demo = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
    rc, out, err = run_mpiexec(4, [sys.executable, demo], timeout=120)
    assert rc == 0, (out, err)
    assert "demo OK" in out, out
    assert_quiet(out, err)


LEAN_JOB = r'''
import json, sys
import mpi4dask
mpi4dask.initialize(lean=(sys.argv[1] == "lean"))
import dask
from distributed import Client

def settings():
    import dask
    from dask.utils import parse_timedelta
    return {k: parse_timedelta(dask.config.get(k)) for k in ("distributed.admin.tick.interval",
                                                            "distributed.worker.profile.interval")}

def worker_settings(dask_worker):
    out = settings()
    out["profile_callback_ms"] = dask_worker.periodic_callbacks["profile"].callback_time  # what it really uses
    return out

with Client() as client:
    print("LEAN " + json.dumps({"scheduler": client.run_on_scheduler(settings),
                                "workers": list(client.run(worker_settings).values())}), flush=True)
'''


@pytest.mark.parametrize("mode, env, tick, profile", [
    ("lean", {}, 1.0, 0.1),
    ("default", {}, 0.02, 0.01),
    ("lean", {"DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "50ms"}, 0.05, 0.1),  # the user's value is kept
])
def test_lean_housekeeping(mode, env, tick, profile, tmp_path):
    script = tmp_path / "lean_job.py"
    script.write_text(LEAN_JOB)
    rc, out, err = run_mpiexec(4, [sys.executable, script, mode], timeout=120, env=env)
    assert rc == 0, err[-3000:]
    [found] = re.findall(r"LEAN (\{.*\})", out)
    got = json.loads(found)
    for where in [got["scheduler"], *got["workers"]]:
        assert where["distributed.admin.tick.interval"] == pytest.approx(tick)
        assert where["distributed.worker.profile.interval"] == pytest.approx(profile)
    assert len(got["workers"]) == 2
    assert all(w["profile_callback_ms"] == pytest.approx(profile * 1000) for w in got["workers"])
