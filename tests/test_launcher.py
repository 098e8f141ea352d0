"""The launcher: ``mpi4dask.launcher.initialize``, ``mpi4dask serve``, and the launchers users know.

Every job here is a real ``mpiexec`` run (3-4 ranks) in a subprocess with a hard timeout; results are
checked against numpy computed in the same job (sha256 of exact results, allclose of reductions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import BIN, MPI_FAMILY, MPIEXEC, Background, only_with, run_command, run_mpiexec

# Open MPI's launcher (prterun) exits with status 1 when it gets SIGTERM or SIGINT, whatever its ranks do
# (measured: ranks that exit 0 on SIGTERM, `mpiexec` status 1), so "the job ends with status 0" is hydra's
ends_cleanly_on_signal = only_with("mpich", "intel", why="its mpiexec exits 1 on SIGTERM/SIGINT whatever the ranks "
                                   "do (measured), so a clean end on a signal cannot be seen from its status")

pytestmark = pytest.mark.timeout(240)

# What a clean job must not print (on stdout or stderr).
NOISE = ("Traceback", "CommClosedError", "Exception", "Stream is closed")


PROTOCOLS = ["mpi", "tcp"]


def assert_quiet(*texts: str) -> None:
    for text in texts:
        for word in NOISE:
            assert word not in text, f"{word!r} printed by a job that should end quietly:\n{text}"


JOBS = Path(__file__).parent / "jobs"
# A client outside the job: computes (tests/jobs/_check.py), checks, shuts the cluster down
SERVE_CLIENT = str(JOBS / "serve_client.py")


def assert_check(out: str, workers: str | None, protocol: str) -> None:
    """One CHECK line, all checks true, the expected worker names (None: any) and protocol."""
    lines = [line for line in out.splitlines() if line.startswith("CHECK ")]
    assert len(lines) == 1, out
    fields = dict(item.split("=", 1) for item in lines[0].split()[1:])
    assert (fields["exact"], fields["close"], fields["gathered"]) == ("True", "True", "True"), out
    assert fields["protocols"] == protocol, out
    if workers is not None:
        assert fields["workers"] == workers, out


def initialize_job(protocol: str, scenario: str, *options: str) -> list[str]:
    """``python tests/jobs/launcher_initialize.py PROTOCOL SCENARIO OPTIONS``: initialize(), then the scenario."""
    return [sys.executable, str(JOBS / "launcher_initialize.py"), protocol, scenario, *options]


# --------------------------------------------------------------------------------------------
# initialize


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_initialize_computes_and_exits_quietly(protocol):
    """4 ranks: rank 1's Client() finds the job's scheduler and 2 workers, results match numpy,
    the script body runs on rank 1 only, and the job ends with status 0 and no noise."""
    script = initialize_job(protocol, "computes", "--memory-limit", "2GiB")
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
    script = initialize_job(protocol, "raises")
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


def test_initialize_names_a_bad_setting_of_the_transport_not_the_protocol():
    """A bad mpi4dask setting stops the mpi:// transport from loading; the error is the setting's own
    (it named the protocol 'mpi' unknown before, and told the user to use 'mpi')."""
    script = "from mpi4dask.launcher import initialize\ninitialize('mpi')\nprint('BODY')\n"
    rc, out, err = run_mpiexec(3, script, timeout=60, env={**os.environ, "MPI4DASK_REPLY_SPIN": "abc"})
    assert rc != 0
    assert "BODY" not in out
    assert "MPI4DASK_REPLY_SPIN='abc'" in err and "unknown protocol" not in err, err


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


# Values distributed would take and fail on later (on a worker rank, or in every task), or take
# although they make no sense; each must be refused on every rank before anything starts.
BAD_ARGUMENTS = [
    ("nthreads", 0, ValueError),
    ("nthreads", -2, ValueError),
    ("nthreads", 1.5, TypeError),
    ("nthreads", "two", TypeError),
    ("nthreads", True, TypeError),
    ("nthreads", None, TypeError),
    ("memory_limit", "lots", ValueError),
    ("memory_limit", [1], TypeError),
    ("memory_limit", -5, ValueError),
    ("memory_limit", "-1GiB", ValueError),
    ("memory_limit", -0.5, ValueError),
    ("memory_limit", 1.5, ValueError),
    ("memory_limit", float("nan"), ValueError),
    ("memory_limit", "AUTO", ValueError),
    ("memory_limit", True, TypeError),
    ("interface", 5, TypeError),
    ("interface", ["ib0"], TypeError),
]


@pytest.mark.parametrize("func", ["initialize", "serve"])
@pytest.mark.parametrize("name, value, error", BAD_ARGUMENTS, ids=[f"{n}={v!r}" for n, v, _ in BAD_ARGUMENTS])
def test_bad_argument_refused_before_mpi(func, name, value, error):
    """initialize() and serve() refuse the value up front, naming it and what to pass instead."""
    from mpi4dask import launcher

    call = getattr(launcher, func)
    args = ("scheduler.json",) if func == "serve" else ()
    with pytest.raises(error) as info:
        call(*args, **{name: value})
    message = str(info.value)
    fix = {"nthreads": "pass a whole number >= 1", "memory_limit": "pass a number of bytes (e.g. 4e9 or '4GiB')",
           "interface": "pass one such as 'ib0'"}
    assert message.startswith(f"{name}={value!r} is ") and fix[name] in message, message
    assert not launcher._initialized


@pytest.mark.parametrize("value", [None, "auto", 0, "0", 1, 0.25, "0.5", 2**30, 4e9, "4e9", "4GiB", "512 MB"])
def test_good_memory_limits_pass_unchanged(value):
    """What distributed.Worker reads sensibly passes the check unchanged (the worker parses it)."""
    from mpi4dask import launcher

    assert launcher._check_memory_limit(value) == value


# the values of the issue that reported them
JOB_BAD_ARGUMENTS = [
    ("nthreads", 0, ValueError), ("nthreads", 1.5, TypeError), ("nthreads", "two", TypeError),
    ("memory_limit", "lots", ValueError), ("memory_limit", [1], TypeError), ("memory_limit", -5, ValueError),
]  # fmt: skip


@pytest.mark.parametrize("name, value, error", JOB_BAD_ARGUMENTS, ids=[f"{n}={v!r}" for n, v, _ in JOB_BAD_ARGUMENTS])
def test_bad_argument_ends_the_job_at_once(name, value, error):
    """Under ``mpiexec -n 3`` every rank raises the same error, so the job fails in seconds."""
    script = f"from mpi4dask.launcher import initialize\ninitialize({name}={value!r})\nprint('BODY')\n"
    t0 = time.monotonic()
    rc, out, err = run_mpiexec(3, script, timeout=60)
    assert rc != 0
    assert time.monotonic() - t0 < 30
    assert "BODY" not in out
    said = err.count(f"{error.__name__}: {name}={value!r} is ")
    if MPI_FAMILY == "openmpi":
        # its launcher ends the job when the first rank exits with an error: the others may not have printed yet
        assert 1 <= said <= 3 and "prterun detected that one or more processes exited with non-zero status" in err, err
    else:
        assert said == 3, err  # once per rank


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_exit_hook_creates_no_thread(protocol):
    """Python >= 3.12 refuses new threads in atexit hooks (dask-mpi #87). Refuse them here too, for
    every exit hook that runs after ours is registered, and check that the job still ends cleanly."""
    script = initialize_job(protocol, "no_thread")
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
    script = initialize_job(protocol, "client_shutdown")
    rc, out, err = run_mpiexec(4, script, timeout=120)
    assert rc == 0, (out, err)
    assert_check(out, "2,3", protocol)
    assert out.count("AFTER-SHUTDOWN") == 1
    assert_quiet(out, err)


def test_initialize_exit_false_and_explicit_shutdown():
    """exit=False: rank 1 gets True, ends the cluster with shutdown(); the others then get False
    and go on with the script."""
    script = initialize_job("mpi", "exit_false")
    rc, out, err = run_mpiexec(4, script, timeout=120)
    assert rc == 0, (out, err)
    assert_check(out, "2,3", "mpi")
    # (mpiexec may glue lines of different ranks together: match the markers, not lines)
    after = sorted(re.findall(r"AFTER rank=(\d+) client=(True|False)", out))
    assert after == [("0", "False"), ("1", "True"), ("2", "False"), ("3", "False")], out
    assert_quiet(out, err)


# --------------------------------------------------------------------------------------------
# initialize(comm=...): Dask in part of a larger MPI program


def test_initialize_on_a_subcommunicator():
    """``mpiexec -n 5``: 4 ranks of a Split make the cluster (roles by their rank in it), the fifth
    does its own point-to-point work with the client rank meanwhile; the answer is right, exit 0."""
    rc, out, err = run_mpiexec(5, [sys.executable, JOBS / "initialize_subcomm.py"], timeout=120)
    assert rc == 0, (out, err)
    assert "OUTSIDER ok=True" in out, (out, err)
    [found] = re.findall(r"CLUSTER (\{.*\})", out)
    got = json.loads(found)
    assert (got["client"], got["scheduler"], got["workers"]) == (3, 4, [1, 2]), got
    assert got["names"] == ["2", "3"], got  # named by their rank in the communicator
    assert got["memory"] == [got["share"]] * 2, got  # "auto": the node shared by the cluster's 2 workers
    after = sorted(re.findall(r"AFTER rank=(\d+) client=(True|False)", out))
    assert after == [("1", "False"), ("2", "False"), ("3", "True"), ("4", "False")], out
    assert_quiet(out, err)



def test_a_client_left_open_ends_with_the_job_without_reconnecting():
    """A client rank that leaves its ``Client()`` open (README's example) ends the job at exit, in that
    order: the launcher's shutdown closes the Client, then the transport stops what is left.  The other way
    round, the transport shut the Client's socket first: the Client reconnected to the scheduler as the
    job ended (in every run), and with ``comm=sub`` and ranks outside the cluster the scheduler logged a
    ``CommClosedError`` traceback (3 runs of 4)."""
    rc, out, err = run_mpiexec(6, [sys.executable, JOBS / "initialize_client_left_open.py"], timeout=150)
    assert rc == 0, (out, err)
    assert sorted(re.findall(r"OUTSIDE sum=(\d+)", out)) == ["9", "9"], out
    [found] = re.findall(r"RESULT (\{.*\})", out)
    got = json.loads(found)
    assert got["sum"] == 4950 and got["run_mpi"] == [4950, 4950], got
    connects = re.findall(r"Receive client connection: (\S+)", err)
    assert connects == [got["id"]], (connects, err[-4000:])  # connected once, never again
    assert_quiet(out, err)


def test_initialize_refuses_bad_communicators():
    """A bad ``comm`` is refused on each rank with a clear error before any collective (no hang)."""
    rc, out, err = run_mpiexec(3, [sys.executable, JOBS / "initialize_bad_comms.py"], timeout=60)
    assert rc == 0, (out, err)
    by_rank = {got["rank"]: got for got in map(json.loads, re.findall(r"ERRORS (.*?) END", out))}
    assert sorted(by_rank) == [0, 1, 2], out
    for rank, size in ((0, 2), (1, 2), (2, 1)):
        got = by_rank[rank]
        assert got["string"].startswith("TypeError: comm='world' is not an MPI communicator: pass an mpi4py"), got
        assert got["null"].startswith("ValueError: comm is MPI.COMM_NULL, so this rank is not part of it"), got
        assert got["inter"].startswith("TypeError: comm=") and "is an intercommunicator" in got["inter"], got
        assert got["small"].startswith("ValueError: initialize() needs at least 3 MPI ranks"), got
        assert f"comm= has {size}: pass one of 3 ranks or more" in got["small"], got
        assert got["serve-small"].startswith("ValueError: serve() needs at least 2 MPI ranks"), got
        assert "comm= has 1: pass one of 2 ranks or more" in got["serve-small"], got
    assert by_rank[2]["undefined"] == by_rank[2]["null"]


# --------------------------------------------------------------------------------------------
# the defaults: memory_limit="auto" shares the node, no HTTP port, idle ranks sleep


def free_port() -> int:
    """A port free now and below the kernel's ephemeral range: a port that a bind to port 0 handed out
    can be handed out again (to the job's own listeners, or its MPI library's) before the test's server
    binds it (seen in CI: the dashboard asked for such a port and fell back to another)."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = range(max(1024, low - 12000), low) if low > 2048 else range(0)
    for port in random.sample(candidates, min(len(candidates), 200)):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the range: any free port
        s.bind(("", 0))
        return s.getsockname()[1]



def test_initialize_defaults_share_memory_open_no_http_port_and_idle_quietly(tmp_path):
    """``mpiexec -n 5`` with ``initialize()``'s defaults (3 workers on this node):

    * ``memory_limit="auto"``: each worker gets a third of the node's memory (their sum fits it);
    * ``dashboard=False``: no rank opens an HTTP port (only its comm's listener), none listens on
      ``dashboard_address``, and no "dashboard at" line is logged;
    * the scheduler and idle workers use little CPU (their waits on MPI sleep between tests).
    """
    import psutil
    from distributed.system import MEMORY_LIMIT

    script = JOBS / "initialize_defaults.py"
    rc, out, err = run_mpiexec(5, [sys.executable, script, f"127.0.0.1:{free_port()}"], timeout=120)
    assert rc == 0, (out, err)
    [found] = re.findall(r"DEFAULTS (\{.*\})", out)
    got = json.loads(found)
    assert got["memory"] == [MEMORY_LIMIT // 3] * 3, got
    assert sum(got["memory"]) <= psutil.virtual_memory().total
    assert got["dashboard_port"] == "refused", got
    # each rank opens its comm's listener; the scheduler also its MPI service (mpi4dask.pm), which
    # workers started outside mpiexec join MPI through
    assert got["servers"][0]["pm"] is not None, got
    for server in got["servers"]:
        own = sorted(p for p in (server["own"], server["pm"]) if p is not None)
        assert server["services"] == {} and server["opened"] == own, got
    assert "dashboard at" not in err, err
    assert all(seconds < 0.3 for seconds in got["idle_cpu_seconds"]), got  # in 2 s; a spinning rank takes > 0.8
    assert_quiet(out, err)


@ends_cleanly_on_signal
def test_serve_dashboard_true_serves_http(tmp_path):
    """``mpi4dask serve --dashboard --dashboard-address A``: the scheduler serves HTTP at A (the
    dashboard with bokeh, distributed's plain pages without) and says so in its log."""
    port = free_port()
    sf = tmp_path / "scheduler.json"
    serve = serve_command("--scheduler-file", sf, "--dashboard", "--dashboard-address", f"127.0.0.1:{port}")
    cmd = [MPIEXEC, "-n", "2", *serve]
    with Background(cmd, cwd=tmp_path) as job:
        job.wait_for_file(sf, 60)
        assert json.loads(sf.read_text())["services"] == {"dashboard": port}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
            assert reply.read() == b"ok"
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(60) == 0, job.output()
        assert re.search(rf"dashboard at: +http://[^/\s]+:{port}/", job.output()[1]), job.output()


# --------------------------------------------------------------------------------------------
# mpi4dask serve


def test_serve_arguments():
    from mpi4dask import launcher

    parser = argparse.ArgumentParser()
    launcher.add_serve_arguments(parser)
    args = parser.parse_args(["--scheduler-file", "f.json"])
    assert args.func is launcher.serve_main
    assert (args.scheduler_file, args.protocol, args.nthreads, args.memory_limit) == ("f.json", "mpi", 1, "auto")
    got = (args.dashboard, args.dashboard_address, args.interface, args.local_directory)
    assert got == (False, ":8787", None, None)
    args = parser.parse_args(
        ["--scheduler-file", "f", "--protocol", "tcp", "--nthreads", "2", "--memory-limit", "1e9", "--dashboard"]
    )
    assert (args.protocol, args.nthreads, args.dashboard, args.memory_limit) == ("tcp", 2, True, 1e9)
    for text, value in [("4GiB", "4GiB"), ("0.5", 0.5), ("none", None), ("AUTO", "auto"), ("0", 0)]:
        assert parser.parse_args(["--scheduler-file", "f", "--memory-limit", text]).memory_limit == value
    # values that are no number reach serve_main as they are, which refuses them with exit status 2
    assert parser.parse_args(["--scheduler-file", "f", "--nthreads", "two"]).nthreads == "two"
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --scheduler-file is required


@pytest.mark.parametrize(
    "option, text, shown",
    [("--nthreads", "two", "--nthreads 'two'"), ("--nthreads", "0", "--nthreads 0"),
     ("--nthreads", "1.5", "--nthreads '1.5'"), ("--memory-limit", "lots", "--memory-limit 'lots'"),
     ("--memory-limit", "-5", "--memory-limit -5")],
)  # fmt: skip
def test_serve_cli_bad_option_without_mpi(option, text, shown, capsys):
    """``mpi4dask serve`` refuses the value with exit status 2 and one line naming it (no MPI needed)."""
    from mpi4dask import cli

    assert cli.main(["serve", "--scheduler-file", "s.json", option, text]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mpi4dask serve: {shown} is "), err


def test_serve_scheduler_file_in_a_missing_directory_under_mpiexec(tmp_path):
    """Refused at once on every rank with exit status 2 and one line each (it failed on the scheduler only,
    once the workers had registered: exit 1, ~110 lines and three tracebacks)."""
    bad = tmp_path / "no" / "such" / "s.json"
    t0 = time.monotonic()
    rc, out, err = run_command([MPIEXEC, "-n", "3", *serve_command("--scheduler-file", bad)], 60)
    assert rc == 2, (out, err)
    assert time.monotonic() - t0 < 30
    ours = [line for line in err.splitlines() if line.startswith("mpi4dask serve: ")]
    assert ours and all(f"its directory {bad.parent} does not exist" in line for line in ours), err
    assert "Traceback" not in err, err


def test_serve_interface_one_host_lacks_under_mpiexec(tmp_path):
    """A network interface that one worker rank's host lacks (here the rank is given a name its host
    lacks, the others 'lo', as if it ran on another host): every rank ends at once with exit status 2 and
    one line naming the interface, the host and those it has (it was that rank's traceback and an
    MPI_Abort)."""
    sf = tmp_path / "s.json"
    rc, out, err = run_command([MPIEXEC, "-n", "2", *serve_command("--scheduler-file", sf, "--interface", "lo"), ":",
                                "-n", "1", *serve_command("--scheduler-file", sf, "--interface", "nosuch0")], 60)
    assert rc == 2, (out, err)
    ours = [line for line in err.splitlines() if line.startswith("mpi4dask serve: ")]
    assert len(ours) == 3 and len(set(ours)) == 1, err  # every rank: the one rank's problem
    assert "network interface 'nosuch0' on host" in ours[0] and "'lo'" in ours[0], err
    assert "Traceback" not in err and not sf.exists(), err


INTERFACE_JOB = """\
import sys
from mpi4dask.launcher import initialize
try:
    initialize('mpi', interface=sys.argv[1])
except ValueError as exc:
    if sys.argv[2] == 'raise':
        raise
    print(f'REFUSED {exc}', flush=True)
    initialize('mpi', interface='lo')  # corrected: the job goes on
from distributed import Client
with Client() as client:
    print('SUM', client.submit(sum, range(10)).result(), flush=True)
"""


@pytest.mark.parametrize("then", ["raise", "retry"])
def test_initialize_interface_one_host_lacks_ends_every_rank(tmp_path, then):
    """Hosts differ: one rank's host lacking the interface ends every rank's initialize() with its error,
    at once (here the worker rank 2 is given a name its host lacks, the others 'lo', as if on another
    host); a script that catches it may call initialize() again, corrected, and compute."""
    script = tmp_path / "job.py"
    script.write_text(INTERFACE_JOB)
    t0 = time.monotonic()
    rc, out, err = run_command([MPIEXEC, "-n", "2", sys.executable, script, "lo", then, ":",
                                "-n", "1", sys.executable, script, "nosuch0", then, ":",
                                "-n", "1", sys.executable, script, "lo", then], 60)
    assert time.monotonic() - t0 < 30
    if then == "raise":
        assert rc != 0 and "SUM" not in out, (out, err)
        # every rank raised the one rank's problem (counted in the text: the ranks' tracebacks interleave, a
        # rank's "ValueError", ": " and message being separate writes)
        assert err.count("network interface 'nosuch0' on host") == 4 and err.count("ValueError") >= 4, err
    else:
        assert rc == 0 and "SUM 45" in out, (out, err)
        assert out.count("REFUSED network interface 'nosuch0' on host") == 4, out  # (ranks' lines may interleave)


def test_an_empty_interface_is_the_default(tmp_path):
    """As distributed reads it (``initialize(interface=os.environ.get("IFACE", ""))`` with IFACE unset): the
    job starts on the default interface and computes."""
    script = tmp_path / "job.py"
    script.write_text(INTERFACE_JOB)
    rc, out, err = run_mpiexec(3, [sys.executable, script, "", "raise"], timeout=60)
    assert rc == 0 and "SUM 45" in out and "REFUSED" not in out, (out, err)


def serve_command(*args) -> list[str]:
    """``python -m mpi4dask serve ARGS`` (the real CLI)."""
    return [sys.executable, "-m", "mpi4dask", "serve", *map(str, args)]




@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_serve_with_external_client(protocol, tmp_path):
    """``mpiexec -n 3 mpi4dask serve``: a client outside the job (plain python) computes, calls
    shutdown(), and the job ends with status 0, quietly, removing its scheduler file."""
    sf = tmp_path / "scheduler.json"
    cmd = [MPIEXEC, "-n", "3", *serve_command("--scheduler-file", sf, "--protocol", protocol)]
    with Background(cmd, cwd=tmp_path) as job:
        rc, out, err = run_command([sys.executable, SERVE_CLIENT, str(sf), "2"], timeout=120)
        assert rc == 0, (out, err)
        assert_check(out, "1,2", protocol)
        assert "SHUTDOWN SENT" in out
        assert job.wait(60) == 0, job.output()
        assert_quiet(*job.output())
    assert not sf.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@ends_cleanly_on_signal
def test_serve_ends_cleanly_on_signal(sig, tmp_path):
    """SIGTERM/SIGINT to mpiexec (which forwards it to every rank) ends the job with status 0, quietly."""
    sf = tmp_path / "scheduler.json"
    cmd = [MPIEXEC, "-n", "3", *serve_command("--scheduler-file", sf)]
    with Background(cmd, cwd=tmp_path) as job:
        job.wait_for_file(sf, 60)
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


@pytest.mark.parametrize("option, text", [("--nthreads", "two"), ("--memory-limit", "lots")])
def test_serve_bad_option_under_mpiexec(option, text, tmp_path):
    """``mpiexec -n 3 mpi4dask serve --nthreads two``: every rank prints the same line, exit status 2."""
    sf = tmp_path / "s.json"
    t0 = time.monotonic()
    rc, out, err = run_command([MPIEXEC, "-n", "3", *serve_command("--scheduler-file", sf, option, text)], 60)
    assert rc == 2, (out, err)
    assert time.monotonic() - t0 < 30
    lines = err.splitlines()
    ours = [line for line in lines if line.startswith("mpi4dask serve: ")]
    assert ours and all(line.startswith(f"mpi4dask serve: {option} '{text}' is ") for line in ours), err
    if MPI_FAMILY == "openmpi":
        # its launcher ends the job when the first rank exits with an error (the others may not have printed
        # yet: measured 2 or 3 lines), and adds its report of that rank
        assert len(ours) <= 3 and "prterun detected that one or more processes exited with non-zero status" in err, err
    else:
        assert len(ours) == 3 and ours == lines, err
    assert not sf.exists()


# --------------------------------------------------------------------------------------------
# the launchers users know: dask's CLI in one MPMD job, and dask-mpi


DASK = str(BIN / "dask")


def _mpmd_dask_cli(tmp_path, prefix: list[str]):
    sf = tmp_path / "scheduler.json"
    cmd = [
        MPIEXEC,
        "-n", "1", *prefix, DASK, "scheduler", "--protocol", "mpi", "--scheduler-file", sf, "--no-dashboard",
        ":",
        "-n", "2", *prefix, DASK, "worker", "--no-nanny", "--nthreads", "1", "--scheduler-file", sf,
    ]  # fmt: skip
    with Background(list(map(str, cmd)), cwd=tmp_path) as job:
        # dask's scheduler writes its file as it starts: the client waits for the workers
        rc, out, err = run_command([sys.executable, SERVE_CLIENT, str(sf), "2", "--wait"], timeout=45)
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
    script = [sys.executable, JOBS / "dask_mpi_initialize.py"]
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



@pytest.mark.parametrize("mode, env, tick, profile", [
    ("lean", {}, 1.0, 0.1),
    ("default", {}, 0.02, 0.01),
    ("lean", {"DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "50ms"}, 0.05, 0.1),  # the user's value is kept
])
def test_lean_housekeeping(mode, env, tick, profile, tmp_path):
    script = JOBS / "initialize_lean.py"
    rc, out, err = run_mpiexec(4, [sys.executable, script, mode], timeout=120, env=env)
    assert rc == 0, err[-3000:]
    [found] = re.findall(r"LEAN (\{.*\})", out)
    got = json.loads(found)
    for where in [got["scheduler"], *got["workers"]]:
        assert where["distributed.admin.tick.interval"] == pytest.approx(tick)
        assert where["distributed.worker.profile.interval"] == pytest.approx(profile)
    assert len(got["workers"]) == 2
    assert all(w["profile_callback_ms"] == pytest.approx(profile * 1000) for w in got["workers"])
