"""``mpi4dask bench``: every benchmark end to end through the CLI (tiny sizes), argument errors,
failure reporting.

No test asserts anything about timings: benchmark numbers depend on the machine and its load.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from importlib.metadata import version

import pytest

from mpi4dask import cli
from mpi4dask._jobs import BIN, kill_all
from mpi4dask.bench import comm, common, jobutil, report

# The end-to-end run finishes in ~10-20 s on 2 idle cores; the CLI's own --timeout fires before
# the subprocess timeout, so a hang is reported by the command itself.
CLI_TIMEOUT = 240
SUBPROCESS_TIMEOUT = CLI_TIMEOUT + 60


def run_cli(*args: str, timeout: float = SUBPROCESS_TIMEOUT, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpi4dask", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def tables(stdout: str) -> list[list[list[str]]]:
    """The markdown tables of a report, in order: each a list of rows (header, separator, body)."""
    found, rows = [], None
    for line in stdout.splitlines():
        if line.startswith("|"):
            if rows is None:
                rows = []
                found.append(rows)
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        else:
            rows = None
    return found


def table_rows(stdout: str) -> list[list[str]]:
    """The rows of a report's first table."""
    return tables(stdout)[0]


def check_run_cpu(runs: list[dict], cores: int, busy: tuple[str, ...], slack: float = 0.0) -> None:
    """Every run's record holds the CPU seconds every process of the job used over it, by part: the scheduler,
    the client and the workers did some work, and so did the ``busy`` parts of the workers (their threads are
    read in whole clock ticks, 10 ms: a part of a short run may read 0), and all of it fits in the run's time on
    the cores (plus ``slack`` seconds)."""
    for r in runs:
        cpu = r["cpu"]
        assert list(cpu) == list(jobutil.CPU_PARTS), cpu
        assert cpu["scheduler"] > 0 and cpu["client"] > 0, cpu
        assert cpu["worker tasks"] + cpu["worker loops"] + cpu["worker other"] > 0, cpu
        assert all(cpu[k] > 0 for k in busy), cpu
        assert cpu["worker tasks"] >= 0 and cpu["worker other"] >= 0, cpu
        assert sum(cpu.values()) <= 1.1 * r["seconds"] * cores + slack, (cpu, r["seconds"])


def check_cpu_table(table: list[list[str]], lead: int, runs_of) -> None:
    """A report's CPU table: after ``lead`` cells and the protocol, the run's seconds, CPU seconds, cores busy
    and one column per part, each the median over the timed runs that ``runs_of(row) -> (runs, job)`` finds."""
    assert table[0][lead:] == ["protocol", "s", "CPU s", "cores busy"] + [
        f"{part} CPU s" for part in jobutil.CPU_PARTS], table
    for row in table[2:]:
        runs, job = runs_of(row)
        total = statistics.median(sum(r["cpu"].values()) for r in runs)
        busy = statistics.median(sum(r["cpu"].values()) / (r["seconds"] * job["cpu_count"]) for r in runs)
        assert row[lead + 1] == common.fmt_s(statistics.median(r["seconds"] for r in runs)), (row, runs)
        assert row[lead + 2] == common.fmt_s(total) and row[lead + 3] == f"{busy:.0%}", (row, runs)
        for k, part in enumerate(jobutil.CPU_PARTS):
            assert row[lead + 4 + k] == common.fmt_s(statistics.median(r["cpu"][part] for r in runs)), (row, runs)


#: The steps of ``bench comm --sizes 1,256K``, in the order the job starts them: size by size, each size's
#: transports taking turns.  256 KiB: the smallest frame that goes over MPI (``MPI_MIN_FRAME``).
COMM_STEPS = ["raw MPI 1 B", "tcp:// 1 B", "mpi:// 1 B", "raw MPI 256 KiB", "tcp:// 256 KiB", "mpi:// 256 KiB"]


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 30)
def test_bench_comm_end_to_end(tmp_path):
    """One run measures raw MPI, mpi:// and tcp:// and reports them in stdout, JSON and PNG."""
    out = tmp_path / "results"
    proc = run_cli(
        "bench", "comm", "--sizes", "1,256K", "--iterations", "5", "--output", str(out),
        "--timeout", str(CLI_TIMEOUT), cwd=tmp_path,
    )
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report

    # Header line: the machine and the versions.
    cores = os.cpu_count()
    first = proc.stdout.splitlines()[0]
    assert f"2 processes shared {cores} cores" in first, report
    assert f"{cores} cores (os.cpu_count())" in first, report
    assert "MPICH" in first or "Open MPI" in first or "MPI" in first, report
    assert f"distributed {version('distributed')}" in first, report
    assert f"mpi4py {version('mpi4py')}" in first, report

    # The table: every column, one row per size, every cell filled.
    rows = table_rows(proc.stdout)
    header, sep, body = rows[0], rows[1], rows[2:]
    assert header == [
        "size",
        "raw MPI us (min)", "raw MPI GB/s",
        "mpi:// us (min)", "mpi:// GB/s",
        "tcp:// us (min)", "tcp:// GB/s",
        "mpi/tcp speedup (= tcp/mpi us = mpi/tcp GB/s)",
        "mpi:// % of raw", "tcp:// % of raw",
        "mpi:// bytes over MPI",
        "rounds raw/mpi/tcp",
    ], report
    assert all(set(c) <= set("-:") for c in sep)
    assert [r[0] for r in body] == ["1 B", "256 KiB"], report
    for r in body:
        assert len(r) == len(header), report
        assert all(c and c != "-" for c in r), report
        assert r[-1] == "5/5/5", report  # --iterations 5 for every transport
        assert r[7].endswith("x") and float(r[7][:-1]) > 0, report
        assert r[8].endswith("%") and r[9].endswith("%"), report
    # what MPI carried of mpi://'s bytes: nothing of 1-byte messages (all on the socket), nearly all at 256 KiB
    # (under an MPI whose copy needs both ends' calls, on the socket instead while every core is taken)
    from mpi4dask._mpi import sends_need_progress

    library = json.loads((out / "comm.json").read_text())["machine"]["mpi_library"]
    assert body[0][10] == "0%", report
    assert body[1][10].endswith("%") and (int(body[1][10][:-1]) >= 90 or sends_need_progress(library)), report

    # Progress went to stderr, the table alone to stdout: not a terminal, so one plain line per size
    # and transport, numbered, with the time elapsed, and no bar.
    assert "payload verified" in proc.stderr
    assert "[bench comm]" not in proc.stdout
    steps = re.findall(r"^\[bench comm\] \((\d)/6, \d+ s elapsed\) (.*)$", proc.stderr, re.MULTILINE)
    assert steps == [(str(i + 1), what) for i, what in enumerate(COMM_STEPS)], report
    assert "\r" not in proc.stderr and "[#" not in proc.stderr, report

    # JSON: sane positive numbers for every transport and size.
    data = json.loads((out / "comm.json").read_text())
    assert data["benchmark"] == "comm"
    assert data["machine"]["cpu_count"] == cores
    assert data["machine"]["processes"] == 2
    assert data["machine"]["mpi_thread_level"] == "multiple"
    assert sorted(data["config"]["transports"]) == ["mpi", "raw", "tcp"]
    recs = {(r["transport"], r["size"]): r for r in data["records"]}
    assert set(recs) == {(t, s) for t in ("raw", "mpi", "tcp") for s in (1, 256 << 10)}
    for (t, s), r in recs.items():
        assert r["iterations"] == 5 and r["warmup"] >= 1
        assert r["verified"] is True
        keys = ("one_way_median_us", "one_way_min_us", "one_way_mean_us", "throughput_GBps", "peak_throughput_GBps")
        for key in keys:
            assert math.isfinite(r[key]) and r[key] > 0, (t, s, key, r)
        assert r["one_way_min_us"] <= r["one_way_median_us"] <= 60e6, r
        assert math.isclose(r["throughput_GBps"], s / (r["one_way_median_us"] * 1e-6) / 1e9, rel_tol=1e-9)

    # the transports took turns within each size: 5 timed rounds in the 4 slices of the default (2+1+1+1), and
    # each transport's k-th slice after every transport's (k-1)-th and before every transport's (k+1)-th
    assert data["config"]["slices"] == 4
    for size in (1, 256 << 10):
        starts = {t: recs[(t, size)]["slice_starts_s"] for t in ("raw", "mpi", "tcp")}
        assert all(recs[(t, size)]["slices"] == 4 and len(starts[t]) == 4 for t in starts), recs
        for k in range(1, 4):
            assert max(v[k - 1] for v in starts.values()) < min(v[k] for v in starts.values()), starts

    # Peak RSS of both ranks at every point, and the memory line for the largest one.
    for r in recs.values():
        assert len(r["peak_rss_bytes"]) == 2 and all(b > 10 << 20 for b in r["peak_rss_bytes"]), r
    assert data["config"]["peak_rss_method"] in ("vmhwm", "ru_maxrss")
    memory = [line for line in proc.stdout.splitlines() if line.startswith("**Memory:**")]
    assert len(memory) == 1 and "256 KiB point" in memory[0], report
    assert "raw MPI" in memory[0] and "mpi://" in memory[0] and "tcp://" in memory[0] and "mpi/tcp" in memory[0]

    # The plot and the markdown copy of the table.
    png = (out / "comm.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (out / "comm.md").read_text().strip() == proc.stdout.strip()


@pytest.mark.timeout(CLI_TIMEOUT)
def test_progress_is_a_bar_on_a_terminal(tmp_path):
    """With stderr a terminal, the progress is one bar redrawn in place (carriage return, erase line) through
    every size and transport; the report still goes to stdout alone."""
    import pty
    import threading

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "mpi4dask", "bench", "comm", "--sizes", "1,256K", "--iterations",
                             "5", "--timeout", str(CLI_TIMEOUT - 30)], stdout=subprocess.PIPE, stderr=slave,
                            stdin=subprocess.DEVNULL, cwd=tmp_path, env={**os.environ, "COLUMNS": "200"})
    os.close(slave)
    chunks: list[bytes] = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=CLI_TIMEOUT - 10)
    finally:
        proc.kill()
    reader.join(10)
    os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, err
    assert out.decode().startswith("**mpi4dask bench comm** on "), out
    bars = re.findall(r"\r\x1b\[K\[bench comm\] \[([#-]{20})\] (\d)/6 \d+:\d\d ([^\r\n]*)", err)
    # each step drawn, in order (and drawn again below each line printed above it)
    assert [(int(i), what) for _, i, what in dict.fromkeys(bars)] == list(enumerate(COMM_STEPS, 1)), err
    assert [bar.count("#") for bar, _, _ in bars] == sorted(bar.count("#") for bar, _, _ in bars), err
    assert err.endswith("\r\x1b[K") or not err.rstrip("\n").endswith(bars[-1][2]), err  # no bar left behind
    assert "(1/6, " not in err, err  # no plain step lines on a terminal
    assert "payload verified" in err, err  # the job's other lines still show, above the bar


@pytest.mark.parametrize("bad", ["12Q", "1.5K", "0", "2G", "-3", "K"])
def test_bad_size_is_rejected_with_its_value(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "comm", "--sizes", f"1,{bad},64K"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "--sizes" in err and repr(bad) in err, err


def test_bad_size_through_the_command():
    proc = run_cli("bench", "comm", "--sizes", "1,64X", timeout=60)
    assert proc.returncode != 0
    assert "'64X'" in proc.stderr and "invalid size" in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("bad", ["1,,64K", ",", ""])
def test_malformed_size_list_is_rejected(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "comm", "--sizes", bad])
    assert exc.value.code != 0
    assert repr(bad) in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, named",
    [
        (["--protocols", "mpi,udp"], "'udp'"),
        (["--iterations", "0"], "'0'"),
        (["--iterations", "many"], "'many'"),
        (["--timeout", "-5"], "'-5'"),
        (["--target-time", "soon"], "'soon'"),
        (["--raw-buffers", "0"], "'0'"),
    ],
)
def test_other_bad_arguments(args, named, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "comm", *args])
    assert exc.value.code != 0
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("argv, usage", [(["bench", "comm", "--nosuch"], "mpi4dask bench comm"),
                                         (["stress", "soak", "--nosuch"], "mpi4dask stress soak"),
                                         (["serve", "--scheduler-file", "s.json", "--nosuch"], "mpi4dask serve")])
def test_an_unknown_option_is_reported_with_its_commands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"usage: {usage}" in err and "unrecognized arguments: --nosuch" in err, err


def _cmdline(p) -> list[str]:
    import psutil

    try:
        return p.cmdline()
    except psutil.Error:  # gone meanwhile
        return []


@pytest.mark.timeout(120)
def test_sigterm_ends_the_benchmark_and_its_job(tmp_path):
    """``timeout`` or a batch system ends ``mpi4dask bench`` with SIGTERM: its MPI job (started in a session of
    its own) must end with it, as on Ctrl-C; it ran on, orphaned, and its workers with it."""
    import time

    import psutil

    proc = subprocess.Popen([str(BIN / "mpi4dask"), "bench", "comm", "--sizes", "1M", "--target-time", "60",
                             "--protocols", "mpi"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        tree = []
        while time.monotonic() < deadline:  # until the job's ranks run
            tree = psutil.Process(proc.pid).children(recursive=True)
            if sum("comm_job" in " ".join(_cmdline(p)) for p in tree) >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the benchmark's job did not start within 60 s")
        time.sleep(1)
        proc.terminate()
        assert proc.wait(30) == 128 + 15
        gone, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, [" ".join(_cmdline(p)) for p in alive]
    finally:
        proc.kill()
        proc.wait()
        kill_all(tree)  # what a failure left running


def test_bench_needs_a_benchmark(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench"])
    assert exc.value.code != 0
    assert "BENCHMARK" in capsys.readouterr().err


def test_parse_sizes():
    assert common.parse_sizes("1,1K,64K,1M,8M,64M") == [1, 1024, 65536, 1 << 20, 8 << 20, 64 << 20]
    assert common.parse_sizes("64kib, 1 ,2m,1g,1K,16B") == [1, 16, 1024, 65536, 2 << 20, 1 << 30]
    assert [common.format_size(s) for s in (1, 1000, 1024, 65536, 3 << 20, 1 << 30)] == [
        "1 B", "1000 B", "1 KiB", "64 KiB", "3 MiB", "1 GiB",
    ]


def test_protocol_choice_narrows_the_table():
    """Only tcp:// requested: no mpi:// columns and no mpi-vs-tcp ratio (computed from given numbers)."""
    result = {
        "machine": {"cpu_count": 2, "processes": 2, "mpi_library": "MPICH Version: 5.0.2",
                    "distributed": "x", "mpi4py": "y"},
        "config": {"transports": ["raw", "tcp"]},
        "records": [
            {"transport": "raw", "size": 1024, "iterations": 7, "one_way_median_us": 50.0,
             "one_way_min_us": 40.0, "throughput_GBps": 1024 / 50e-6 / 1e9},
            {"transport": "tcp", "size": 1024, "iterations": 6, "one_way_median_us": 200.0,
             "one_way_min_us": 150.0, "throughput_GBps": 1024 / 200e-6 / 1e9},
        ],
    }
    rows = table_rows(comm.render_comm_table(result))
    assert rows[0] == ["size", "raw MPI us (min)", "raw MPI GB/s", "tcp:// us (min)", "tcp:// GB/s",
                       "tcp:// % of raw", "rounds raw/tcp"]
    assert rows[2] == ["1 KiB", "50.0 (40.0)", "0.0205", "200 (150)", "0.00512", "25.0%", "7/6"]


def test_ratio_columns_with_both_protocols():
    recs = []
    for t, us in (("raw", 10.0), ("mpi", 40.0), ("tcp", 100.0)):
        recs.append({"transport": t, "size": 1 << 20, "iterations": 5, "one_way_median_us": us,
                     "one_way_min_us": us, "throughput_GBps": (1 << 20) / (us * 1e-6) / 1e9})
    result = {"machine": {"cpu_count": 2}, "config": {"transports": ["raw", "tcp", "mpi"]}, "records": recs}
    rows = table_rows(comm.render_comm_table(result))
    assert rows[2][7:] == ["2.50x", "25.0%", "10.0%", "5/5/5"]


def test_missing_mpiexec_is_reported():
    proc = run_cli("bench", "comm", "--sizes", "1", "--mpiexec", "/nonexistent/bin/mpiexec", timeout=60)
    assert proc.returncode == 1
    assert "/nonexistent/bin/mpiexec" in proc.stderr and "not an executable" in proc.stderr, proc.stderr


def _fake_mpiexec(tmp_path, body: str) -> str:
    path = tmp_path / "fake-mpiexec"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_wrong_world_size_is_reported(tmp_path):
    """A launcher that does not match mpi4py's MPI starts singletons: the job says so and fails."""
    fake = _fake_mpiexec(tmp_path, 'shift 2\nexec "$@"')  # drop "-n 2", run one singleton
    proc = run_cli("bench", "comm", "--sizes", "1", "--mpiexec", fake, "--timeout", "60", timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "needs exactly 2 MPI ranks" in proc.stderr, proc.stderr
    assert "failed with exit status" in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_job_that_hangs_is_stopped_at_the_timeout(tmp_path):
    fake = _fake_mpiexec(tmp_path, "exec sleep 120")
    proc = run_cli("bench", "comm", "--sizes", "1", "--mpiexec", fake, "--timeout", "1", timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "did not finish within --timeout 1 s" in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_a_job_stopped_at_its_bound_prints_where_each_python_process_waited(tmp_path):
    """At the time bound, every Python process of a job (two mpiexec ranks, and a process one of them
    started) prints its threads' stacks before the tree is killed: a hung test or bench says where it hung."""
    import psutil

    from mpi4dask import _jobs

    script = tmp_path / "hangs.py"
    script.write_text(
        "import multiprocessing, sys, time\n"
        "def child_waits_here(started):\n"
        "    started.set()\n"
        "    time.sleep(1000)\n"
        "def rank_waits_here():\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(1000)\n"
        "if __name__ == '__main__':\n"
        "    from mpi4py import MPI\n"
        "    if MPI.COMM_WORLD.Get_rank() == 0:\n"
        "        ctx = multiprocessing.get_context('spawn')\n"
        "        started = ctx.Event()\n"
        "        ctx.Process(target=child_waits_here, args=(started,)).start()\n"
        "        started.wait()\n"
        "    rank_waits_here()\n"
    )
    # core files allowed where the hard limit lets us (this machine writes them into the process's
    # directory): the dump must not leave any
    job = f"ulimit -c unlimited 2>/dev/null; exec {_jobs.default_mpiexec()} -n 2 {sys.executable} {script}"
    done = _jobs.run(["bash", "-c", job], 10, cwd=tmp_path)
    assert done.timed_out, (done.returncode, done.stdout, done.stderr)
    assert done.stdout.count("ready") == 2, done.stdout
    assert done.stderr.count("in rank_waits_here") == 2, done.stderr  # both ranks' main threads ...
    assert done.stderr.count("in child_waits_here") == 1, done.stderr  # ... and the child one started
    assert not [f.name for f in tmp_path.iterdir() if f.name.startswith("core")], list(tmp_path.iterdir())
    leftover = [p for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or ())]
    assert not leftover, leftover  # the whole tree is gone


def test_a_background_job_given_up_on_prints_where_it_waited(tmp_path):
    """The tests' background jobs (conftest.Background, e.g. ``mpi4dask serve``) end as ``_jobs.run`` does
    at its bound: a test that gives up on one shows where its Python processes waited."""
    from conftest import Background

    script = tmp_path / "waits.py"
    script.write_text(
        "import pathlib, sys, time\n"
        "def serves_here():\n"
        "    pathlib.Path(sys.argv[1]).touch()\n"
        "    time.sleep(1000)\n"
        "serves_here()\n"
    )
    with Background([sys.executable, str(script), str(tmp_path / "up")], cwd=tmp_path) as job:
        job.wait_for_file(tmp_path / "up", 60)
        with pytest.raises(pytest.fail.Exception) as failed:
            job.wait(1)
        assert job.proc.returncode is not None  # ended, not left running
    assert "timed out after 1 s" in str(failed.value), failed.value
    assert "in serves_here" in str(failed.value), failed.value


class FakeComm:
    """Stands in for a Dask comm: echoes what was written, optionally damaged."""

    def __init__(self, damage=None):
        self.damage = damage  # callable(round_no, array) -> array
        self.writes = 0
        self.pending = []

    async def write(self, msg):
        self.writes += 1
        x = msg["x"].data.copy()  # a Serialize wrapper around the sent array
        if self.damage is not None:
            x = self.damage(self.writes, x)
        self.pending.append({"x": x})

    async def read(self):
        return self.pending.pop(0)


def test_raw_mpi_echo_into_buffers_in_turn(tmp_path):
    """``--raw-buffers 2``: raw MPI's echo receives into two buffers in turn; the report names it in raw MPI's
    columns and the ratio's, says why in its note, and every round is still verified."""
    out = tmp_path / "results"
    proc = run_cli("bench", "comm", "--sizes", "64K,1M", "--iterations", "6", "--protocols", "mpi", "--raw-buffers",
                   "2", "--output", str(out), "--timeout", str(CLI_TIMEOUT), cwd=tmp_path)
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report
    header = table_rows(proc.stdout)[0]
    assert header[1:3] == ["raw MPI (2 echo buffers) us (min)", "raw MPI (2 echo buffers) GB/s"], report
    assert "mpi:// % of raw (2 echo buffers)" in header, report
    assert "its echo receiving into 2 buffers in turn" in proc.stdout, report
    data = json.loads((out / "comm.json").read_text())
    assert data["config"]["raw_buffers"] == 2
    assert all(r["verified"] and r["iterations"] == 6 for r in data["records"]), data["records"]


class _EchoWorld:
    """What raw MPI's echo (``comm_job._RawEcho``) calls: ``Recv`` hands it ``messages`` payloads (each written into
    the buffer it receives into), then the driver's stop; every ``Send`` is recorded."""

    ANY_TAG = -1

    def __init__(self, messages: int):
        from mpi4dask.bench.comm_job import _TAG_DATA, _TAG_STOP

        self.left, self.data, self.stop = messages, _TAG_DATA, _TAG_STOP
        self.received, self.sent = [], []

    def Status(self):
        world = self

        class Status:
            tag = None

            def Get_tag(self):
                return self.tag

        world.status = Status()
        return world.status

    def Recv(self, buf, source, tag, status):
        self.status.tag = self.data if self.left else self.stop
        if self.left:
            buf[:] = self.left % 256
            self.left -= 1
            self.received.append(buf)

    def Send(self, buf, dest, tag):
        self.sent.append((buf, int(buf[0])))


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_raw_mpi_echo_receives_into_its_buffers_in_turn(buffers):
    """``--raw-buffers N``: the echo's messages go into N distinct buffers, one after the other, each echoed
    from the buffer it came into; a new size gets new buffers."""
    from mpi4dask.bench.comm_job import _RawEcho

    world = _EchoWorld(7)
    echo = _RawEcho(world, world, buffers)
    echo.run(4096)
    assert len(world.received) == 7
    assert len({id(b) for b in world.received}) == buffers
    assert all(world.received[i] is world.received[i % buffers] for i in range(7))
    assert [(id(b), v) for b, v in world.sent] == [(id(b), (7 - i) % 256) for i, b in enumerate(world.received)]
    first = world.received[0]
    world.left = 2
    echo.run(8192)
    assert all(b.nbytes == 8192 and b is not first for b in world.received[7:])


def test_timed_rounds_are_planned_from_the_fastest_warm_up_round():
    """A point's first round pays for fresh receive buffers (tens of ms at 64 MiB): planned from the median of
    its warm-up rounds, mpi://'s 64 MiB point got a tenth of raw MPI's rounds."""
    from mpi4dask.bench.comm_job import MIN_ITERATIONS, _timed_rounds

    assert _timed_rounds([0.070, 0.060, 0.008], None, 1.0) == 125
    assert _timed_rounds([2.0, 3.0], None, 1.0) == MIN_ITERATIONS
    assert _timed_rounds([0.070], 7, 1.0) == 7


def test_every_transport_of_a_size_sends_the_same_array():
    """One payload per size for every transport (where a large array lies moves MPI's copy from it by 10-30%);
    the last size's is let go when the next size starts, and drawn again the same (seeded)."""
    import numpy as np

    from mpi4dask.bench.comm_job import _payload

    a = _payload(1 << 20, 1)
    assert _payload(1 << 20, 1) is a
    b = _payload(2 << 20, 1)
    assert b is not a and b.buf.nbytes == 2 << 20
    again = _payload(1 << 20, 1)
    assert again is not a and np.array_equal(again.buf, a.buf)


def _drive(comm, size, iterations=5):
    import asyncio

    from mpi4dask.bench import comm_job

    return asyncio.run(comm_job._drive(comm, "fake", [size], iterations, 2, 0.01, 1))


@pytest.mark.parametrize("size", [1, 100, 65536])
def test_integrity_checks_pass_a_faithful_echo(size):
    (rec,) = _drive(FakeComm(), size)
    assert rec["verified"] and rec["iterations"] == 5 and rec["warmup"] == 2


def _flip_middle(rnd, x):
    x[len(x) // 2] ^= 0xFF
    return x


def _stale_after_first():
    """From the fourth write on, echo the first payload again (a stale buffer)."""
    state = {}

    def damage(rnd, x):
        if rnd == 1:
            state["first"] = x.copy()
        return state["first"] if rnd > 3 else x

    return damage


def _truncate(rnd, x):
    return x[:-1]


def _corrupt_last_round_middle(rnd, x):
    # Only the final verification round (1 + 2 warm-up + 5 timed + 1) is damaged, and only in the
    # middle, where the per-round stamp does not look: the full comparison must catch it.
    if rnd == 9:
        x[len(x) // 2] ^= 1
    return x


@pytest.mark.parametrize("damage", [_flip_middle, _stale_after_first(), _truncate, _corrupt_last_round_middle])
def test_integrity_checks_catch_damaged_echoes(damage):
    from mpi4dask.bench.comm_job import BenchmarkError

    with pytest.raises(BenchmarkError, match="echoed payload"):
        _drive(FakeComm(damage), 65536)


# ------------------------------------------------------------------------------------------------
# transpose-sum, merge, set-index, idle, all (and stress soak): end to end with tiny sizes (structure and checks only)
# ------------------------------------------------------------------------------------------------

APP_CLI_TIMEOUT = 120  # per MPI job (--timeout); each job takes ~3-6 s on 2 idle cores


def _ok_run(proc, name, group="bench"):
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert proc.stdout.startswith(f"**mpi4dask {group} {name}** on "), report
    assert f"{os.cpu_count()} cores (os.cpu_count())" in proc.stdout.splitlines()[0], report
    assert f"[bench {name}]" in proc.stderr and f"[bench {name}]" not in proc.stdout, report
    return report


def _outputs(out, name, stdout):
    data = json.loads((out / f"{name}.json").read_text())
    assert (out / f"{name}.md").read_text().strip() == stdout.strip()
    png = (out / f"{name}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5_000
    return data


@pytest.mark.timeout(300)
def test_bench_transpose_sum_end_to_end(tmp_path):
    out = tmp_path / "ts"
    proc = run_cli("bench", "transpose-sum", "--n", "800", "--chunk", "200", "--workers", "1,2", "--runs", "2",
                   "--output", str(out), "--timeout", str(APP_CLI_TIMEOUT), timeout=280, cwd=tmp_path)
    report = _ok_run(proc, "transpose-sum")
    cores = os.cpu_count()
    assert f"W workers + scheduler + client = W+2 processes shared {cores} cores" in proc.stdout, report
    rows = table_rows(proc.stdout)
    header, body = rows[0], rows[2:]
    assert header == ["workers", "processes on cores", "mpi:// s", "tcp:// s", "mpi/tcp time",
                      "mpi:// MB moved/run", "mpi:// transfer GB/s", "tcp:// MB moved/run", "tcp:// transfer GB/s",
                      "result"], report
    assert [r[:2] for r in body] == [["1", f"3 on {cores}"], ["2", f"4 on {cores}"]], report
    for r in body:
        assert r[4].endswith("x") and float(r[4][:-1]) > 0, report
        assert r[-1] == "ok (6 runs checked)", report  # (1 warm-up + 2 timed) x 2 protocols
    assert body[0][5] == "0" and body[0][7] == "0", report  # one worker: nothing moves between workers

    data = _outputs(out, "transpose-sum", proc.stdout)
    assert len(data["jobs"]) == 4
    for job in data["jobs"]:
        assert job["processes"] == job["workers"] + 2 and job["nthreads"] == 1
        assert job["check"]["ok"] is True
        runs = job["variants"][0]["runs"]
        assert [r["timed"] for r in runs] == [False, True, True]
        assert all(r["ok"] and math.isclose(r["value"], job["check"]["reference"], rel_tol=1e-9) for r in runs)
        moved = [r["transfers"]["incoming_bytes"] for r in runs]
        if job["workers"] == 2:
            assert all(m > 0 for m in moved), job  # blocks and their transposes on different workers
            assert job["setup"]["blocks_per_worker"] == [8, 8]  # the seeded, balanced placement
    by = {(s["workers"], s["protocol"]): s for s in data["summary"]}
    assert set(by) == {(w, p) for w in (1, 2) for p in ("mpi", "tcp")}
    assert all(s["seconds"]["n"] == 2 and 0 < s["seconds"]["min"] <= s["seconds"]["median"] for s in by.values())


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_rounds_alternate_the_protocols_and_pool_their_runs(tmp_path):
    """--rounds 2: the protocols' jobs take turns (tcp, mpi, mpi, tcp), each job checked; the medians pool
    the timed runs of both rounds, and the report shows the ratio of each round."""
    out = tmp_path / "ts"
    proc = run_cli("bench", "transpose-sum", "--n", "800", "--chunk", "200", "--workers", "1", "--runs", "2",
                   "--rounds", "2", "--output", str(out), "--timeout", str(APP_CLI_TIMEOUT), timeout=280, cwd=tmp_path)
    report = _ok_run(proc, "transpose-sum")
    assert "2 x 2 timed runs (2 rounds of jobs, the protocols taking turns" in proc.stdout, report
    rows = table_rows(proc.stdout)
    header, body = rows[0], rows[2:]
    assert header[:6] == ["workers", "processes on cores", "mpi:// s", "tcp:// s", "mpi/tcp time",
                          "mpi/tcp by round"], report
    assert len(body) == 1 and body[0][-1] == "ok (12 runs checked)", report  # (1 + 2) x 2 rounds x 2 protocols
    by_round = [float(x) for x in body[0][5].split(", ")]
    assert len(by_round) == 2 and all(x > 0 for x in by_round), report

    data = _outputs(out, "transpose-sum", proc.stdout)
    assert [(j["round"], j["protocol"]) for j in data["jobs"]] == [(0, "tcp"), (0, "mpi"), (1, "mpi"), (1, "tcp")]
    for s in data["summary"]:
        runs = [r for j in data["jobs"] if j["protocol"] == s["protocol"] for r in j["variants"][0]["runs"]]
        assert all(r["ok"] for r in runs) and len(runs) == 6
        timed = [r["seconds"] for r in runs if r["timed"]]
        assert s["seconds"]["n"] == 4 and s["seconds"]["median"] == statistics.median(timed), s
        per_round = [statistics.median(timed[:2]), statistics.median(timed[2:])]
        assert s["round_medians"] == per_round, s
    mpi, tcp = (next(s for s in data["summary"] if s["protocol"] == p) for p in ("mpi", "tcp"))
    assert by_round == [round(a / b, 2) for a, b in zip(mpi["round_medians"], tcp["round_medians"])], report


def test_a_round_without_timed_runs_is_shown_as_missing_not_paired_with_another():
    runs = [{"timed": True, "round": 0, "seconds": 2.0}, {"timed": False, "round": 1, "seconds": 9.0},
            {"timed": True, "round": 2, "seconds": 3.0}, {"timed": True, "round": 2, "seconds": 5.0}]
    assert common.round_medians(runs) == [2.0, None, 4.0]
    other = {"round_medians": [1.0, 2.0, 8.0]}
    assert common.round_ratios({"round_medians": [2.0, None, 4.0]}, other) == "2.00, -, 0.50"
    assert common.round_ratios({"round_medians": [2.0]}, other) == "2.00, -, -"


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_bench_merge_end_to_end(tmp_path):
    out = tmp_path / "merge"
    proc = run_cli("bench", "merge", "--rows", "20000", "--workers", "2", "--runs", "1", "--output", str(out),
                   "--timeout", str(APP_CLI_TIMEOUT), timeout=280, cwd=tmp_path)
    report = _ok_run(proc, "merge")
    rows = table_rows(proc.stdout)
    assert rows[0][:6] == ["shuffle", "workers", "processes on cores", "mpi:// s", "tcp:// s", "mpi/tcp time"], report
    assert [r[:2] for r in rows[2:]] == [["tasks", "2"], ["p2p", "2"]], report
    assert all(r[-1] == "ok (4 runs checked)" for r in rows[2:]), report
    assert rows[3][6:10] == ["n/a"] * 4, report  # p2p moves its data outside the transfer logs

    data = _outputs(out, "merge", proc.stdout)
    assert len(data["jobs"]) == 2 and {j["protocol"] for j in data["jobs"]} == {"mpi", "tcp"}
    for job in data["jobs"]:
        ref = job["check"]["reference"]
        assert 15_000 < ref["rows"] < 25_000 and job["check"]["ok"]
        assert [v["variant"] for v in job["variants"]] == ["tasks", "p2p"]
        for v in job["variants"]:
            assert len(v["runs"]) == 2 and all(r["ok"] and r["value"] == ref for r in v["runs"]), v
            check_run_cpu(v["runs"], job["cpu_count"], busy=("worker tasks", "worker loops"))

    # the second table: where each run's CPU time went, a row per shuffle and protocol
    cpu_table = tables(proc.stdout)[1]
    assert cpu_table[0][:2] == ["shuffle", "workers"], report
    assert [r[:3] for r in cpu_table[2:]] == [["tasks", "2", "mpi://"], ["tasks", "2", "tcp://"],
                                              ["p2p", "2", "mpi://"], ["p2p", "2", "tcp://"]], report

    def runs_of(row):
        job = next(j for j in data["jobs"] if common.label(j["protocol"]) == row[2])
        return [r for r in next(v for v in job["variants"] if v["variant"] == row[0])["runs"] if r["timed"]], job

    check_cpu_table(cpu_table, 2, runs_of)
    assert "`cores busy` = CPU s / (s x cores)" in proc.stdout, report


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_bench_set_index_end_to_end(tmp_path):
    """set_index by a random key over mpi:// and tcp://, both shuffle methods: every partition checked."""
    out = tmp_path / "set-index"
    proc = run_cli("bench", "set-index", "--rows", "20000", "--partitions", "4", "--workers", "2", "--runs", "1",
                   "--warmup", "0", "--output", str(out), "--timeout", str(APP_CLI_TIMEOUT), timeout=180, cwd=tmp_path)
    report = _ok_run(proc, "set-index")
    cores = os.cpu_count()
    rows = table_rows(proc.stdout)
    assert rows[0] == ["shuffle", "workers", "processes on cores", "mpi:// s", "tcp:// s", "mpi/tcp time",
                       "mpi:// MB moved/run", "mpi:// transfer GB/s", "tcp:// MB moved/run", "tcp:// transfer GB/s",
                       "result"], report
    assert [r[:3] for r in rows[2:]] == [["tasks", "2", f"4 on {cores}"], ["p2p", "2", f"4 on {cores}"]], report
    for r in rows[2:]:
        assert r[5].endswith("x") and float(r[5][:-1]) > 0, report
        assert r[-1] == "ok (2 runs checked)", report  # (0 warm-up + 1 timed) x 2 protocols
    assert rows[3][6:10] == ["n/a"] * 4, report  # p2p moves its data outside the transfer logs
    assert "`df.set_index(\"key\", divisions=D, shuffle_method=S)`" in proc.stdout, report
    assert "Every run's result is checked: each partition sorted" in proc.stdout, report

    data = _outputs(out, "set-index", proc.stdout)
    assert len(data["jobs"]) == 2 and {j["protocol"] for j in data["jobs"]} == {"mpi", "tcp"}
    divisions = data["jobs"][0]["check"]["divisions"]
    assert len(divisions) == 5 and divisions == sorted(set(divisions)), divisions
    for job in data["jobs"]:
        ref = job["check"]["reference"]
        assert job["check"]["ok"] and job["check"]["divisions"] == divisions  # the same shuffle for both protocols
        assert ref["totals"]["rows"] == 20_000 and ref["totals"]["sum_id"] == sum(range(20_000))
        assert [p["rows"] for p in ref["partitions"]] == [4999, 4999, 5001, 5001]  # exact quantiles: even parts
        assert all(p["sorted"] == 1 for p in ref["partitions"])
        assert [v["variant"] for v in job["variants"]] == ["tasks", "p2p"]
        for v in job["variants"]:
            (run,) = v["runs"]
            assert run["timed"] and run["ok"] and run["seconds"] > 0, run
            assert run["value"] == ref, run
            if v["variant"] == "tasks":
                assert run["transfers"]["incoming_bytes"] > 0, run  # about half the rows change worker
    by = {(s["variant"], s["protocol"]): s for s in data["summary"]}
    assert set(by) == {(v, p) for v in ("tasks", "p2p") for p in ("mpi", "tcp")}
    assert all(s["ok"] and s["seconds"]["n"] == 1 and s["seconds"]["min"] > 0 for s in by.values())


def test_set_index_checks_catch_wrong_partitions():
    """The pure checks of the set-index job: pandas' per-partition summaries of a correct result pass the
    order check; an unsorted partition, overlapping or misplaced ranges and a row with a changed value
    are caught."""
    import numpy as np
    import pandas as pd

    from mpi4dask.bench import apps_job as aj

    rows = [250, 250, 250, 250]
    pdf = pd.concat([aj._set_index_part(i, rows, 7) for i in range(4)], ignore_index=True)
    divisions = aj._set_index_divisions(pdf["key"].to_numpy(), 4)
    assert len(divisions) == 5 and divisions[0] == pdf["key"].min() and divisions[-1] == pdf["key"].max()
    ref = aj._set_index_reference(pdf, divisions)
    assert sum(p["rows"] for p in ref) == 1000 and aj._set_index_order(ref, divisions) == ""
    assert aj._set_index_divisions(np.array([3, 3, 3, 9]), 3) == [3, 9]  # repeated quantiles collapse

    unsorted = [dict(p) for p in ref]
    unsorted[1]["sorted"] = 0
    assert "partition 1 is not sorted by key" in aj._set_index_order(unsorted, divisions)
    overlap = [dict(p) for p in ref]
    overlap[2]["min_key"] = overlap[1]["max_key"]
    problem = aj._set_index_order(overlap, divisions)
    assert "partition 2 holds keys" in problem and "not after partition 1's last key" in problem, problem
    swapped = [dict(p) for p in ref]
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert "outside its division range" in aj._set_index_order(swapped, divisions)

    # A partition's summary sees a changed float or a key moved to another row.
    part = pdf[pdf["key"] < divisions[1]].set_index("key").sort_index()
    good = aj._set_index_summary(part).iloc[0].to_dict()
    assert good == ref[0]
    changed = part.copy()
    changed.iloc[0, changed.columns.get_loc("v")] += 1e-12
    assert aj._set_index_summary(changed).iloc[0]["checksum"] != good["checksum"]
    moved = part.copy()
    moved["id"] = np.roll(moved["id"].to_numpy(), 1)  # same ids, same keys, paired differently
    bad = aj._set_index_summary(moved).iloc[0].to_dict()
    assert bad["sum_id"] == good["sum_id"] and bad["sum_key"] == good["sum_key"] and bad != good


def test_set_index_rejects_a_bogus_shuffle(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "set-index", "--shuffle", "tasks,bogus"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "--shuffle" in err and "'bogus'" in err and "choose from tasks, p2p" in err, err


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_bench_soak_end_to_end(tmp_path):
    out = tmp_path / "soak"
    proc = run_cli("stress", "soak", "--messages", "50", "--max-size", "1M", "--connections", "3", "--output",
                   str(out), "--timeout", str(APP_CLI_TIMEOUT), timeout=180, cwd=tmp_path)
    report = _ok_run(proc, "soak", "stress")
    assert "deprecated" not in proc.stderr, report
    rows = table_rows(proc.stdout)
    assert rows[0] == ["protocol", "run", "messages", "GB", "seconds", "messages/s", "GB/s", "peak RSS MiB (ranks)",
                       "RSS 2 s after, MiB", "corrupted", "lost", "duplicated", "out of order", "integrity"], report
    assert [r[0] for r in rows[2:]] == ["mpi://", "tcp://"], report
    for r in rows[2:]:
        assert r[2] == "300" and r[9:] == ["0", "0", "0", "0", "ok"], report
        assert all(int(v) > 0 for v in r[7].split(" / ") + r[8].split(" / ")), report
    assert "every message arrived once, in order, intact" in proc.stdout, report
    data = _outputs(out, "soak", proc.stdout)
    assert data["ok"] is True and data["job_failed"] is None
    assert {r["protocol"] for r in data["records"]} == {"mpi", "tcp"}
    for r in data["records"]:
        assert r["received_ok"] == r["messages"] == 300 and r["bytes"] > 0 and r["GBps"] > 0
        assert len(r["peak_rss"]) == 2 and all(p >= b > 0 for p, b in zip(r["peak_rss"], r["rss_before"])), r


@pytest.mark.timeout(200)
def test_bench_idle_end_to_end(tmp_path):
    out = tmp_path / "idle"
    proc = run_cli("bench", "idle", "--seconds", "1", "--settle", "0.5", "--no-memory", "--output", str(out),
                   "--timeout", str(APP_CLI_TIMEOUT), timeout=180, cwd=tmp_path)
    report = _ok_run(proc, "idle")
    rows = table_rows(proc.stdout)
    assert rows[0] == ["protocol", "4 ranks total, % of one core", "scheduler (rank 0)", "client (rank 1)",
                       "worker (rank 2)", "worker (rank 3)", "launcher (mpiexec + hydra proxy)"], report
    assert [r[0] for r in rows[2:]] == ["mpi://", "tcp://"], report
    assert "mpi/tcp idle CPU" in proc.stdout or "against tcp://" in proc.stdout, report
    data = _outputs(out, "idle", proc.stdout)
    for job in data["jobs"]:
        (run,) = job["runs"]
        per = run["percent_of_one_core"]
        ranks = ["scheduler (rank 0)", "client (rank 1)", "worker (rank 2)", "worker (rank 3)"]
        assert all(per[k] is not None and 0 <= per[k] <= 100 * os.cpu_count() for k in ranks), per
        assert math.isclose(run["ranks_total_percent"], sum(per[k] for k in ranks))
        assert len({job["pids"][k]["pid"] for k in ranks}) == 4


@pytest.mark.timeout(120)
def test_bench_tasks_end_to_end(tmp_path):
    """Real Dask work over mpi:// and tcp:// in one run: both protocols timed for every piece of work,
    every result checked, the load recorded."""
    out = tmp_path / "tasks"
    proc = run_cli("bench", "tasks", "--workers", "1", "--repeat", "1", "--map-tasks", "100", "--sum-size", "1000",
                   "--sum-chunk", "250", "--gather-mb", "8", "--output", str(out), "--timeout", "60", timeout=100,
                   cwd=tmp_path)
    report = _ok_run(proc, "tasks")
    cores = os.cpu_count()
    rows = table_rows(proc.stdout)
    assert rows[0] == ["work", "workers", "processes on cores", "mpi:// s", "tcp:// s", "mpi/tcp time", "mpi:// rate",
                       "tcp:// rate", "result"], report
    assert [r[:3] for r in rows[2:]] == [["map 100 tasks", "1", f"3 on {cores}"],
                                         ["sum 1000x1000 (8 MB)", "1", f"3 on {cores}"],
                                         ["gather 1024x1024 (8 MiB)", "1", f"3 on {cores}"]], report
    for r in rows[2:]:
        assert r[5].endswith("x") and float(r[5][:-1]) > 0, report
        assert r[-1] == "ok (4 runs checked)", report  # (1 warm-up + 1 timed) x 2 protocols
    assert "No background load (`--load 0`)" in proc.stdout and "load average" in proc.stdout, report

    data = _outputs(out, "tasks", proc.stdout)
    assert data["config"]["load"] == 0 and data["config"]["protocols"] == ["mpi", "tcp"]
    by = {(s["work"], s["protocol"]): s for s in data["summary"]}
    assert set(by) == {(w, p) for w in ("map", "sum", "gather") for p in ("mpi", "tcp")}
    for s in by.values():
        assert s["workers"] == 1 and s["processes"] == 3 and s["ok"] is True, s
        assert s["seconds"]["n"] == 1 and 0 < s["seconds"]["min"] <= s["seconds"]["median"] < 60, s
    assert len(data["jobs"]) == 2 and {j["protocol"] for j in data["jobs"]} == {"mpi", "tcp"}
    for job in data["jobs"]:
        assert job["processes"] == 3 and job["nthreads"] == 1 and "error" not in job
        assert len(job["loadavg"]["before"]) == 3 and len(job["loadavg"]["after"]) == 3
        works = {w["work"]: w for w in job["works"]}
        for w in works.values():
            assert [r["timed"] for r in w["runs"]] == [False, True], w
            assert all(r["ok"] is True and r["error"] is None for r in w["runs"]), w
        assert all(r["value"] == 100 for r in works["map"]["runs"])
        ref = works["sum"]["reference"]
        assert 0.45e6 < ref < 0.55e6  # the sum of 10^6 uniform(0, 1) numbers
        assert all(math.isclose(r["value"], ref, rel_tol=1e-9) for r in works["sum"]["runs"])
        assert works["gather"]["blocks"] == 64
        assert all(math.isclose(r["value"], works["gather"]["expected_sum"], rel_tol=1e-9)
                   for r in works["gather"]["runs"])
        # runs of 0.02-0.3 s: a thread's part may take less than a clock tick, and the snapshots' own round trips
        # (just outside the timed seconds) and the ticks' rounding may add up to more than 10% of a run
        for w in works.values():
            check_run_cpu(w["runs"], job["cpu_count"], busy=(), slack=0.05)

    # the second table: where each run's CPU time went, a row per work and protocol
    cpu_table = tables(proc.stdout)[1]
    assert cpu_table[0][:2] == ["work", "workers"], report
    assert [r[:3] for r in cpu_table[2:]] == [[w, "1", p] for w in ("map 100 tasks", "sum 1000x1000 (8 MB)",
                                                                     "gather 1024x1024 (8 MiB)")
                                              for p in ("mpi://", "tcp://")], report

    def runs_of(row):
        job = next(j for j in data["jobs"] if common.label(j["protocol"]) == row[2])
        work = next(w for w in job["works"] if w["label"] == row[0])
        return [r for r in work["runs"] if r["timed"]], job

    check_cpu_table(cpu_table, 2, runs_of)
    assert "`cores busy` = CPU s / (s x cores)" in proc.stdout, report


def test_load_processes_run_and_are_stopped_even_on_failure(tmp_path):
    """--load N starts N busy processes for the measurement and kills them when it ends, here by a timeout."""
    import psutil

    fake = _fake_mpiexec(tmp_path, "exec sleep 120")
    proc = run_cli("bench", "comm", "--sizes", "1", "--mpiexec", fake, "--timeout", "2", "--load", "2", timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "did not finish within --timeout 2 s" in proc.stderr, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if "background load: 2 busy process(es) (pids " in x)
    pids = [int(p) for p in line.split("(pids ")[1].split(")")[0].split(", ")]
    assert len(pids) == 2
    for pid in pids:
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert not alive or "getppid" not in " ".join(psutil.Process(pid).cmdline()), pid


def test_load_is_stated_in_the_report(tmp_path):
    out = tmp_path / "comm"
    proc = run_cli("bench", "comm", "--sizes", "1", "--iterations", "5", "--protocols", "tcp", "--load", "1",
                   "--output", str(out), "--timeout", str(APP_CLI_TIMEOUT), timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Background load: 1 busy process (pure-Python loops, `--load 1`)" in proc.stdout, proc.stdout
    assert json.loads((out / "comm.json").read_text())["config"]["load"] == 1


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_bench_all_end_to_end(tmp_path):
    """Every benchmark at tiny sizes in one command: one report (the tasks table first), every part's files."""
    out = tmp_path / "all"
    proc = run_cli(
        "bench", "all", "--sizes", "1,64K", "--runs", "1", "--workers", "1", "--n", "400", "--chunk", "200",
        "--rows", "4000", "--partitions", "4", "--idle-seconds", "0.5", "--map-tasks", "50", "--sum-size", "400",
        "--sum-chunk", "200", "--gather-mb", "2", "--move-sizes", "1M", "--moves", "2",
        "--form-workers", "2", "--output", str(out), "--timeout", str(APP_CLI_TIMEOUT), timeout=400, cwd=tmp_path,
    )
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert proc.stdout.startswith("# mpi4dask bench all"), report
    sections = ("## tasks", "## Summary: mpi:// against tcp://", "## comm", "## transpose-sum", "## merge",
                "## set-index", "## idle", "## pair", "## form")
    for section in (*sections, "**Memory:**"):
        assert section in proc.stdout, (section, report)
    assert [proc.stdout.index(s) for s in sections] == sorted(proc.stdout.index(s) for s in sections), report
    assert table_rows(proc.stdout)[0][0] == "work", report  # the tasks table comes first
    assert "FAILED" not in proc.stdout and "## soak" not in proc.stdout, report  # soak: mpi4dask stress
    targets = proc.stdout.split("## Against the targets")[1].split("## comm")[0]  # (after the summary)
    assert [r[0] for r in table_rows(targets)[2:]] == ["no workload slower than tcp://, 1 worker(s)"], report
    summary = proc.stdout.split("## Summary: mpi:// against tcp://")[1].split("## comm")[0]
    measures = [r[0] + " / " + r[1] for r in table_rows(summary)[2:]]
    for want in ("tasks: map 50 tasks, 1 worker(s) / s (median)",
                 "tasks: gather 512x512 (2 MiB), 1 worker(s) / s (median)",
                 "comm 1 B / one-way us (median)", "comm 64 KiB / peak RSS, both ranks (MiB)",
                 "transpose-sum, 1 worker(s) / s (median)", "merge (tasks), 1 worker(s) / s (median)",
                 "merge (p2p), 1 worker(s) / s (median)", "set-index (tasks), 1 worker(s) / s (median)",
                 "set-index (p2p), 1 worker(s) / s (median)",
                 "idle, 4 processes / % of one core", "pair (LocalCluster workers) 64 KiB / one-way us (median)",
                 "outsider to worker (socket) 64 KiB / one-way us (median)",
                 "fresh move between LocalCluster workers 1 MiB / transfer ms (median)"):
        assert want in measures, (want, measures)
    data = json.loads((out / "report.json").read_text())
    assert data["ok"] is True and data["failed"] == []
    assert list(data["parts"]) == ["tasks", "comm", "transpose-sum", "merge", "set-index", "idle", "pair", "form"]
    assert (out / "report.md").read_text().strip() == proc.stdout.strip()
    for f in ("tasks", "comm", "transpose-sum", "merge", "set-index", "idle"):
        assert (out / f"{f}.json").exists() and (out / f"{f}.png").exists(), f
    comm = json.loads((out / "comm.json").read_text())  # comm's own files (idle's memory job writes none)
    assert comm["config"]["sizes"] == [1, 65536] and comm["config"]["alone"] is False, comm["config"]
    assert data["parts"]["idle"]["memory"]["config"]["alone"] is True  # idle measures memory transport by transport
    for f in ("pair", "form"):  # tables only
        assert (out / f"{f}.json").exists() and (out / f"{f}.md").exists(), f
    assert (out / "apps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _app_summary(app, variant, workers, protocol, seconds, transfer_mb=None, gbps=None):
    return {"app": app, "variant": variant, "workers": workers, "protocol": protocol, "seconds": {"median": seconds},
            "transfer_bytes_per_run": None if transfer_mb is None else transfer_mb * 1e6, "transfer_GBps": gbps}


def test_bench_all_checks_each_target_it_measured():
    """``bench all``'s targets, computed from what its parts measured: the quiet ping-pong's share of raw MPI,
    the time ratios per worker count, the data-moving ones at 2 workers, the transfer rate summed over the
    workloads whose transfers both protocols logged (bytes over the sum of each one's bytes / rate)."""
    us = {("raw", 8 << 20): 400.0, ("mpi", 8 << 20): 480.0, ("tcp", 8 << 20): 1900.0,
          ("raw", 64 << 20): 3600.0, ("mpi", 64 << 20): 3900.0, ("tcp", 64 << 20): 16000.0}
    gather = "gather 8192x8192 (512 MiB)"
    parts = {
        "tasks": {"summary": [
            {"work": "map", "label": "map 1000 tasks", "workers": 2, "protocol": "mpi", "seconds": {"median": 1.0}},
            {"work": "map", "label": "map 1000 tasks", "workers": 2, "protocol": "tcp", "seconds": {"median": 1.1}},
            {"work": "gather", "label": gather, "workers": 2, "protocol": "mpi", "seconds": {"median": 0.4}},
            {"work": "gather", "label": gather, "workers": 2, "protocol": "tcp", "seconds": {"median": 1.0}},
            # a measurement with a wrong result counts for nothing
            {"work": "sum", "label": "sum", "workers": 2, "protocol": "mpi", "seconds": {"median": 9.0}, "ok": False},
            {"work": "sum", "label": "sum", "workers": 2, "protocol": "tcp", "seconds": {"median": 1.0}},
        ]},
        "comm": {"config": {"load": 0}, "records": [
            {"transport": t, "size": z, "one_way_median_us": v} for (t, z), v in us.items()]},
        "transpose-sum": {"summary": [_app_summary("transpose-sum", "transpose-sum", 2, "mpi", 0.7, 100, 1.0),
                                      _app_summary("transpose-sum", "transpose-sum", 2, "tcp", 1.0, 100, 0.5)]},
        "merge": {"summary": [_app_summary("merge", "tasks", 2, "mpi", 1.002, 300, 0.3),
                              _app_summary("merge", "tasks", 2, "tcp", 1.0, 300, 0.3),
                              _app_summary("merge", "p2p", 2, "mpi", 0.5, None, None),
                              _app_summary("merge", "p2p", 2, "tcp", 1.0, None, None),
                              _app_summary("merge", "tasks", 6, "mpi", 0.9, 10, 0.1),
                              _app_summary("merge", "tasks", 6, "tcp", 1.0, 10, None)]},  # tcp's not logged
        "set-index": {"error": "the job failed"},  # a part that failed adds nothing
    }
    rows = {r[0]: r[1:] for r in report.target_rows({"parts": parts})}
    assert rows == {
        "ping-pong 8 MiB: mpi:// at >= 80% of raw MPI's speed": [
            "83.33% (one way: mpi:// 480 us, raw MPI 400 us)", "yes"],
        "ping-pong 64 MiB: mpi:// at >= 95% of raw MPI's speed": [
            "92.31% (one way: mpi:// 3900 us, raw MPI 3600 us)", "**no**"],
        # 0.2% slower: shown with three decimals, so that the verdict and its number agree
        "no workload slower than tcp://, 2 worker(s)": ["slowest: merge (tasks) 1.002x", "**no**"],
        "no workload slower than tcp://, 6 worker(s)": ["slowest: merge (tasks) 0.900x", "yes"],
        "data-moving work at <= 0.8x tcp://'s time, 2 workers": [
            f"{gather} 0.400x, merge (p2p) 0.500x, merge (tasks) 1.002x, transpose-sum 0.700x", "**no**"],
        # 400 MB in 100/1.0 + 300/0.3 = 1100 ms over mpi://, 100/0.5 + 300/0.3 = 1200 ms over tcp://; at 6
        # workers tcp:// logged no transfer, so there is no row
        "transfer rate >= 2x tcp:// (transpose-sum, merge (tasks)), 2 worker(s)": [
            "1.091x (0.364 against 0.333 GB/s)", "**no**"],
    }
    # with --load, the real-work rows say so; a loaded ping-pong is checked only with 2 busy processes or more,
    # for its speedup at every size, never for its share of raw MPI
    parts["comm"]["config"]["load"] = 1
    rows = [r[0] for r in report.target_rows({"parts": parts, "config": {"load": 1}})]
    assert not [r for r in rows if r.startswith("ping-pong")], rows
    assert "no workload slower than tcp://, 2 worker(s), `--load 1`" in rows, rows
    parts["comm"]["config"]["load"] = 2
    rows = {r[0]: r[1:] for r in report.target_rows({"parts": {"comm": parts["comm"]}})}
    assert rows == {"ping-pong with `--load 2`: mpi:// >= 2x tcp:// at every size": [
        "lowest 3.958x (8 MiB); 8 MiB 3.96x, 64 MiB 4.10x", "yes"]}


# ------------------------------------------------------------------------------------------------
# Arguments and failure reporting of the new benchmarks (no MPI job, or a fake one)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, named",
    [
        (["transpose-sum", "--workers", "0,2"], "'0,2'"),
        (["transpose-sum", "--workers", "two"], "'two'"),
        (["merge", "--shuffle", "tasks,hash"], "'hash'"),
        (["merge", "--runs", "0"], "'0'"),
        (["set-index", "--partitions", "0"], "'0'"),
        (["set-index", "--rows", "many"], "'many'"),
        (["idle", "--seconds", "-1"], "'-1'"),
        (["all", "--skip", "comm,nope"], "'nope'"),
        (["tasks", "--workers", "1,x"], "'1,x'"),
        (["tasks", "--gather-mb", "0"], "'0'"),
        (["tasks", "--protocols", "mpi,udp"], "'udp'"),
        (["comm", "--load", "-1"], "'-1'"),
        (["pair", "--sizes", "1,3X"], "'3X'"),
        (["form", "--workers", "1,4"], "'1,4'"),
        (["form", "--protocol", "udp"], "'udp'"),
        (["stress", "soak", "--max-size", "3X"], "'3X'"),
        (["stress", "soak", "--protocols", "mpi,udp"], "'udp'"),
        (["stress", "chaos", "--seconds", "0"], "'0'"),
        (["stress", "chaos", "--scaling", "grow"], "'grow'"),
        (["bench", "chaos", "--seconds", "0"], "'0'"),  # the deprecated alias takes the same arguments
    ],
)
def test_new_benchmarks_reject_bad_arguments(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv if argv[0] in ("stress", "bench") else ["bench", *argv])
    assert exc.value.code != 0
    assert named in capsys.readouterr().err


@pytest.mark.skipif(common.ucx_available(), reason="distributed_ucxx is installed here")
def test_ucx_is_skipped_with_a_note_when_unavailable():
    proc = run_cli("stress", "soak", "--protocols", "ucx", timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "ucx skipped: distributed_ucxx is not importable" in proc.stderr, proc.stderr
    assert "no protocol left to measure" in proc.stderr, proc.stderr


def test_wrong_result_fails_the_app_benchmark(tmp_path):
    """A job that reports a wrong result (and fails) makes the command fail, naming the result."""
    fake = _fake_mpiexec(
        tmp_path,
        'while [ $# -gt 0 ]; do if [ "$1" = --result ]; then out="$2"; fi; shift; done\n'
        'echo \'{"error": "wrong result in 1 run(s): (x + x.T).sum() = 1.0, NumPy reference 2.0"}\' > "$out"\n'
        "exit 7",
    )
    proc = run_cli("bench", "transpose-sum", "--mpiexec", fake, "--timeout", "30", timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "wrong result in 1 run(s)" in proc.stderr and "exit status 7" in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_chaos_with_a_hung_or_wrong_call_fails():
    """The chaos report shows a hung call, and it fails the command; a run without one does not."""
    from mpi4dask.bench import chaos

    def job(protocol, **bad):
        counts = {"calls": 10, "right": 10, "failed": 0, "wrong": 0, "hung": 0, "kills": 3, "scales": 2,
                  "compute_calls": 5, "compute_right": 5, "run_mpi_calls": 5, "run_mpi_right": 5, **bad}
        return {"protocol": protocol, "counts": counts, "errors": [], "elapsed_s": 30.0,
                "call_seconds": {"compute": [0.1], "run_mpi": [0.05]}, "workers_seen": [2, 4], "loadavg": {}}

    ok = {"machine": {"cpu_count": 2}, "notes": [], "commands": [], "jobs": [job("tcp"), job("mpi")],
          "config": {"seed": 1, "scaling": "scale", "call_timeout": 90.0, "load": 0}}
    assert chaos.chaos_failure(ok) is None
    hung = {**ok, "jobs": [job("tcp"), job("mpi", hung=1, right=9, run_mpi_right=4)]}
    assert chaos.chaos_failure(hung) == "mpi://: 1 hung, 0 wrong, 1 run_mpi calls not answered"
    report = chaos.render_chaos(hung)
    assert "| mpi:// | 30 | 10 | 3 | 2 | 2-4 | 9 | 0 | 0 | 1 | 4/5 |" in report, report


def test_soak_with_integrity_problems_fails(tmp_path):
    """A soak job that counted a lost message exits 1 and its counts reach the table."""
    rec = {"protocol": "mpi", "run": 0, "connections": 1, "messages": 10, "bytes": 100, "received_ok": 9,
           "elapsed_s": 1.0, "messages_per_s": 10.0, "GBps": 1e-7, "corrupted": 0, "lost": 1, "duplicated": 0,
           "out_of_order": 0, "ok": False, "details": ["conn 0 dir 1: lost: 1 seq(s) never arrived, first [3]"],
           "streams": []}
    body = json.dumps({"records": [rec], "machine": {}, "config": {"runs": 1}})
    fake = _fake_mpiexec(
        tmp_path,
        'while [ $# -gt 0 ]; do if [ "$1" = --result ]; then out="$2"; fi; shift; done\n'
        f"cat > \"$out\" <<'EOF'\n{body}\nEOF\nexit 1",
    )
    proc = run_cli("bench", "soak", "--protocols", "mpi", "--mpiexec", fake, "--timeout", "30", timeout=60)
    assert proc.returncode == 1, proc.stderr
    # the deprecated alias still runs it, after a one-line notice
    assert proc.stderr.startswith("mpi4dask bench soak is deprecated: use mpi4dask stress soak\n"), proc.stderr
    assert "INTEGRITY FAILURE" in proc.stderr and "INTEGRITY FAILURE" in proc.stdout, (proc.stdout, proc.stderr)
    rows = table_rows(proc.stdout)
    assert rows[2][9:] == ["0", "1", "0", "0", "**FAILED**"], proc.stdout
    assert "never arrived" in proc.stdout


# ------------------------------------------------------------------------------------------------
# pair and form: MPI in clusters that mpiexec did not start (LocalCluster)
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_bench_pair_end_to_end(tmp_path):
    """The ping-pong between two LocalCluster workers joined as an MPI pair, against one mpiexec job's ranks
    and a tcp:// LocalCluster: every cell filled, every payload verified, the pair checked to be a pair."""
    out = tmp_path / "pair"
    proc = run_cli("bench", "pair", "--sizes", "1,256K", "--iterations", "5", "--move-sizes", "1M,8M", "--moves", "2",
                   "--output", str(out), "--timeout", str(APP_CLI_TIMEOUT), timeout=280, cwd=tmp_path)
    report = _ok_run(proc, "pair")
    ping, moves = proc.stdout.split("**Target**")
    rows = table_rows(ping)
    header, body = rows[0], rows[2:]
    assert header == ["size",
                      "mpi:// pair (LocalCluster workers) us (min)", "mpi:// pair (LocalCluster workers) GB/s",
                      "mpi:// ranks of one mpiexec job us (min)", "mpi:// ranks of one mpiexec job GB/s",
                      "tcp:// (LocalCluster workers) us (min)", "tcp:// (LocalCluster workers) GB/s",
                      "mpi:// outsider to worker (socket) us (min)", "mpi:// outsider to worker (socket) GB/s",
                      "tcp:// outsider to worker us (min)", "tcp:// outsider to worker GB/s",
                      "pair / one-job time", "pair / tcp speedup", "outsider / tcp outsider speedup",
                      "rounds pair/job/tcp/outsider/tcp outsider"], report
    assert [r[0] for r in body] == ["1 B", "256 KiB"], report
    for r in body:
        assert all(cell and cell != "-" for cell in r), report
        assert all(x.endswith("x") for x in r[11:14]) and r[14] == "5/5/5/5/5", report
    assert "**Target** (the pair within 10% of one job's ranks" in proc.stdout, report
    assert "transport `mpi`, mpi_route `pair`" in proc.stdout and "3 processes shared the" in proc.stdout, report
    assert "over mpi:// its connection is transport `socket`" in proc.stdout, report
    assert "At the start the 1-minute load average was" in proc.stdout, report

    data = json.loads((out / "pair.json").read_text())
    assert (out / "pair.md").read_text().strip() == proc.stdout.strip()
    recs = {(r["setup"], r["transport"], r["size"]): r for r in data["records"]}
    want = {(s, t, n) for s, t in (("pair", "mpi"), ("one-job", "mpi"), ("pair", "tcp"), ("outsider", "mpi"),
                                   ("outsider", "tcp")) for n in (1, 256 << 10)}
    assert want <= set(recs), sorted(recs)
    for key in want:
        r = recs[key]
        assert r["verified"] is True and r["iterations"] == 5, (key, r)
        assert math.isfinite(r["one_way_median_us"]) and r["one_way_median_us"] > 0, (key, r)
    mpi = data["jobs"]["mpi"]
    assert mpi["connection"]["transport"] == "mpi" and mpi["connection"]["mpi_route"] == "pair", mpi
    assert mpi["connection"]["mpi_bytes_sent"] >= (256 << 10) * 5, mpi  # the 256 KiB frames went over MPI
    worlds = list(mpi["worlds"].values())
    assert len(worlds) == 2 and all(w["size"] == 1 and w["dynamic"] for w in worlds), worlds
    assert worlds[0]["ident"] != worlds[1]["ident"] and mpi["driver"]["pid"] != mpi["echo"]["pid"]
    assert data["jobs"]["tcp"]["connection"] is None
    # a process outside the cluster shares no MPI world with the worker: every frame on the socket
    outsider = mpi["outsider"]["connection"]
    assert outsider["transport"] == "socket" and outsider["mpi_bytes_sent"] == 0, outsider
    assert outsider["socket_bytes_sent"] >= (256 << 10) * 5, outsider
    assert data["jobs"]["tcp"]["outsider"]["connection"] is None
    assert data["target_met"] in (True, False) and data["one_job"]["benchmark"] == "comm"
    # fresh payloads moved between the workers as Dask moves a dependency, each checked on both
    rows = table_rows(moves)
    assert rows[0] == ["size", "mpi:// transfer ms (max)", "mpi:// GB/s", "mpi:// fetching task ms (max)",
                       "tcp:// transfer ms (max)", "tcp:// GB/s", "tcp:// fetching task ms (max)",
                       "tcp / mpi transfer time"], report
    assert [r[0] for r in rows[2:]] == ["1 MiB", "8 MiB"] and all(r[7].endswith("x") for r in rows[2:]), report
    assert "One untimed move each way came first" in moves, report
    for p in ("mpi", "tcp"):
        done = data["jobs"][p]["moves"]
        assert [(m["size"], m["checked"]) for m in done] == [(1 << 20, True)] * 2 + [(8 << 20, True)] * 2, done
        a, b = data["jobs"][p]["driver"]["address"], data["jobs"][p]["echo"]["address"]
        assert [m["src"] for m in done] == [a, b, a, b], done
        assert all(0 < m["transfer_s"] < m["wall_s"] for m in done), done


@pytest.mark.timeout(300)
def test_bench_form_end_to_end(tmp_path):
    """run_mpi on a LocalCluster: MPI init, first call, warm calls, scale-up; every answer checked."""
    out = tmp_path / "form"
    proc = run_cli("bench", "form", "--workers", "2", "--repeat", "2", "--output", str(out),
                   "--timeout", str(APP_CLI_TIMEOUT), timeout=280, cwd=tmp_path)
    report = _ok_run(proc, "form")
    rows = table_rows(proc.stdout)
    assert rows[0] == ["N", "protocol", "processes on cores", "MPI init (s)", "first call (s)",
                       "warm call (ms, median of 2)", "of which allreduce (ms)", "after scale-up to N+1 (s)",
                       "new worker's MPI init (s)", "result"], report
    assert [r[:3] for r in rows[2:]] == [["2", "tcp://", f"3 → 4 on {os.cpu_count()}"]], report
    assert rows[2][-1] == "ok (4 calls checked)", report
    times = [float(cell.split()[0]) for cell in rows[2][3:9]]
    assert all(t > 0 for i, t in enumerate(times) if i != 3) and times[3] >= 0, report  # an allreduce may print 0.0 ms

    data = json.loads((out / "form.json").read_text())
    assert (out / "form.md").read_text().strip() == proc.stdout.strip()
    (job,) = data["jobs"]
    assert job["workers"] == 2 and job["protocol"] == "tcp" and job["workers_holding_chunks"] >= 1
    assert job["reference"] == sum(range(2 * 1000))
    calls = [job["first_call"], *job["warm_calls"], job["scale_up"]["first_call"]]
    assert [c["ranks"] for c in calls] == [2, 2, 2, 3]
    assert all(c["ok"] and c["value"] == job["reference"] and 0 < c["allreduce_s"] < c["seconds"] for c in calls)
    assert job["formed_after_warm"] == [1, 1] and job["formed_after_scale_up"] == [1, 2, 2]
    assert data["summary"][0]["warm_call_s"]["n"] == 2


def test_pair_report_states_the_target():
    """The pair / one-job ratio and the target line, from given numbers."""
    from mpi4dask.bench import anycluster

    def rec(setup, transport, size, us):
        return {"setup": setup, "transport": transport, "size": size, "iterations": 5, "one_way_median_us": us,
                "one_way_min_us": us, "throughput_GBps": size / (us * 1e-6) / 1e9}

    result = {
        "machine": {"cpu_count": 2, "loadavg_1min_before": 1.5, "cpu_busy_fraction_before": 0.25},
        "config": {"protocols": ["mpi", "tcp"], "moves": 3},
        "records": [rec("pair", "mpi", 1, 105.0), rec("one-job", "mpi", 1, 100.0), rec("pair", "tcp", 1, 210.0),
                    rec("pair", "mpi", 1 << 20, 600.0), rec("one-job", "mpi", 1 << 20, 400.0),
                    rec("pair", "tcp", 1 << 20, 1200.0), rec("outsider", "mpi", 1 << 20, 800.0),
                    rec("outsider", "tcp", 1 << 20, 1000.0)],
        "target_ratio": 1.10,
        "one_job": {},
        "jobs": {"mpi": {"connection": {"transport": "mpi", "mpi_route": "pair", "mpi_bytes_sent": 1 << 20},
                         "worlds": {"a": {}, "b": {}},
                         "moves": [{"size": 1 << 27, "transfer_s": t, "wall_s": t + 0.1} for t in (0.05, 0.4, 0.07)]},
                 "tcp": {"connection": None,
                         "moves": [{"size": 1 << 27, "transfer_s": t, "wall_s": t + 0.1} for t in (0.1, 0.2, 0.3)]}},
    }
    text = anycluster.render_pair(result)
    ping, moves = text.split("**Target**")
    rows = table_rows(ping)
    assert [r[11:14] for r in rows[2:]] == [["1.05x", "2.00x", "-"], ["1.50x", "2.00x", "1.25x"]]
    # moves: medians (max), GB/s from the median, tcp's median over mpi's
    assert table_rows(moves)[2:] == [["128 MiB", "70.0 (400.0)", "1.92", "170.0 (500.0)", "200.0 (300.0)", "0.671",
                                      "300.0 (400.0)", "2.86x"]]
    assert "per size, 3 payloads of random bytes" in moves
    summary = anycluster.pair_summary_rows(result)
    assert summary[-1] == ["fresh move between LocalCluster workers 128 MiB", "transfer ms (median)", "70.0", "200.0",
                           "2.86x speedup"]
    assert "**missed** at 1 of 2 sizes: 1 MiB (1.50x)." in text
    assert "load average was 1.50 on 2 cores (25% busy" in text
