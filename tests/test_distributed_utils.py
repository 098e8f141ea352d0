"""Users test their Dask code with distributed's own utilities (``gen_test``, ``gen_cluster``); over mpi:// they
must pass as over tcp://: no leaked thread, no comm left open, no warning (issue #17).  Each test of
``jobs/dask_user_tests.py`` runs first in a process of its own, as a user's first test does, so MPI starts
inside it; warnings are errors, as in distributed's own CI."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import run_command, served_worlds, slow_served_transport

TESTS = Path(__file__).parent / "jobs" / "dask_user_tests.py"


@pytest.mark.parametrize("name", [
    "test_listener_starts_whatever_the_connect_timeout",  # MPI_Init is not bounded by the connect timeout
    "test_dropped_comms_are_closed",  # comms dropped without close() are collected at once, as tcp's
    "test_cluster_on_mpi",  # gen_cluster: the thread that served MPI_Init ends with it
    # this process joins its workers' MPI worlds: each join's thread ends with it
    pytest.param("test_nanny_cluster_on_mpi", marks=[served_worlds, slow_served_transport]),
    "test_a_feed_ends_when_its_reader_closes",  # a writer that never reads learns that its peer closed
])
def test_distributed_test_utilities_pass_on_mpi(name, tmp_path):
    rc, out, err = run_command(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error", "-q", f"{TESTS}::{name}"],
        timeout=120, cwd=tmp_path,
    )
    assert rc == 0 and "1 passed" in out, f"rc {rc}\n{out[-4000:]}\n{err[-3000:]}"
