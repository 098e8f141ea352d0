"""``mpi4dask bench comm``: end to end through the CLI, argument errors, failure reporting.

No test asserts anything about timings: benchmark numbers depend on the machine and its load.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from mpi4dask import benchmarks, cli

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


def table_rows(stdout: str) -> list[list[str]]:
    rows = []
    for line in stdout.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.timeout(SUBPROCESS_TIMEOUT + 30)
def test_bench_comm_end_to_end(tmp_path):
    """One run measures raw MPI, mpi:// and tcp:// and reports them in stdout, JSON and PNG."""
    out = tmp_path / "results"
    proc = run_cli(
        "bench", "comm", "--sizes", "1,64K", "--iterations", "5", "--output", str(out),
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
        "rounds raw/mpi/tcp",
    ], report
    assert all(set(c) <= set("-:") for c in sep)
    assert [r[0] for r in body] == ["1 B", "64 KiB"], report
    for r in body:
        assert len(r) == len(header), report
        assert all(c and c != "-" for c in r), report
        assert r[-1] == "5/5/5", report  # --iterations 5 for every transport
        assert r[7].endswith("x") and float(r[7][:-1]) > 0, report
        assert r[8].endswith("%") and r[9].endswith("%"), report

    # Progress went to stderr, the table alone to stdout.
    assert "payload verified" in proc.stderr
    assert "[bench comm]" not in proc.stdout

    # JSON: sane positive numbers for every transport and size.
    data = json.loads((out / "comm.json").read_text())
    assert data["benchmark"] == "comm"
    assert data["machine"]["cpu_count"] == cores
    assert data["machine"]["processes"] == 2
    assert data["machine"]["mpi_thread_level"] == "multiple"
    assert sorted(data["config"]["transports"]) == ["mpi", "raw", "tcp"]
    recs = {(r["transport"], r["size"]): r for r in data["records"]}
    assert set(recs) == {(t, s) for t in ("raw", "mpi", "tcp") for s in (1, 65536)}
    for (t, s), r in recs.items():
        assert r["iterations"] == 5 and r["warmup"] >= 1
        assert r["verified"] is True
        for key in ("one_way_median_us", "one_way_min_us", "one_way_mean_us", "throughput_GBps", "peak_throughput_GBps"):
            assert math.isfinite(r[key]) and r[key] > 0, (t, s, key, r)
        assert r["one_way_min_us"] <= r["one_way_median_us"] <= 60e6, r
        assert math.isclose(r["throughput_GBps"], s / (r["one_way_median_us"] * 1e-6) / 1e9, rel_tol=1e-9)

    # The plot and the markdown copy of the table.
    png = (out / "comm.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (out / "comm.md").read_text().strip() == proc.stdout.strip()


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
    ],
)
def test_other_bad_arguments(args, named, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "comm", *args])
    assert exc.value.code != 0
    assert named in capsys.readouterr().err


def test_bench_needs_a_benchmark(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench"])
    assert exc.value.code != 0
    assert "BENCHMARK" in capsys.readouterr().err


def test_parse_sizes():
    assert benchmarks.parse_sizes("1,1K,64K,1M,8M,64M") == [1, 1024, 65536, 1 << 20, 8 << 20, 64 << 20]
    assert benchmarks.parse_sizes("64kib, 1 ,2m,1g,1K,16B") == [1, 16, 1024, 65536, 2 << 20, 1 << 30]
    assert [benchmarks.format_size(s) for s in (1, 1000, 1024, 65536, 3 << 20, 1 << 30)] == [
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
    rows = table_rows(benchmarks.render_comm_table(result))
    assert rows[0] == ["size", "raw MPI us (min)", "raw MPI GB/s", "tcp:// us (min)", "tcp:// GB/s",
                       "tcp:// % of raw", "rounds raw/tcp"]
    assert rows[2] == ["1 KiB", "50.0 (40.0)", "0.0205", "200 (150)", "0.00512", "25.0%", "7/6"]


def test_ratio_columns_with_both_protocols():
    recs = []
    for t, us in (("raw", 10.0), ("mpi", 40.0), ("tcp", 100.0)):
        recs.append({"transport": t, "size": 1 << 20, "iterations": 5, "one_way_median_us": us,
                     "one_way_min_us": us, "throughput_GBps": (1 << 20) / (us * 1e-6) / 1e9})
    result = {"machine": {"cpu_count": 2}, "config": {"transports": ["raw", "tcp", "mpi"]}, "records": recs}
    rows = table_rows(benchmarks.render_comm_table(result))
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


def _drive(comm, size, iterations=5):
    import asyncio

    from mpi4dask import _bench_job

    return asyncio.run(_bench_job._drive(comm, "fake", [size], iterations, 2, 0.01, 1))


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
    from mpi4dask._bench_job import BenchmarkError

    with pytest.raises(BenchmarkError, match="echoed payload"):
        _drive(FakeComm(damage), 65536)
