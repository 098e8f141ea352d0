"""What mpi4dask relies on in its dependencies, pinned as tests (issue #17): a new release that changes one
of these fails here, by name, before it fails a user.  pyproject.toml states the ranges CI has tested."""

from __future__ import annotations

import pickle
import subprocess
import sys
import traceback
import types
from pathlib import Path

import pytest


def _by_value_function():
    """A function of a module cloudpickle cannot import on the other side, as a script's ``__main__``."""
    module = types.ModuleType("not_importable_here")
    source = "def fail_here(x):\n    y = x + 1\n    raise ValueError(y)\n"
    exec(compile(source, "/the/users/script.py", "exec"), module.__dict__)
    return module.fail_here


def test_cloudpickle_keeps_names_and_line_numbers_of_code_sent_by_value():
    """mpi4dask._sources maps a worker's frame to the client's code by function name and line number
    (cloudpickle 3.1.3 renames the file of such code ``<dynamic-code>``; the name and lines must stay)."""
    import cloudpickle

    fn = _by_value_function()
    copy = pickle.loads(cloudpickle.dumps(fn))
    assert copy is not fn
    assert copy.__code__.co_name == fn.__code__.co_name == "fail_here"
    assert list(copy.__code__.co_lines()) == list(fn.__code__.co_lines())
    try:
        copy(1)
    except ValueError as e:
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        assert tb.tb_lineno == 3 and tb.tb_frame.f_code.co_name == "fail_here"


def test_distributed_hands_the_client_worker_frames_with_names_and_lines():
    """``Future.traceback()`` frames carry the function name and line number mpi4dask maps back."""
    from distributed import Client, LocalCluster

    from mpi4dask import _sources

    fn = _by_value_function()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        future = client.submit(fn, 1)
        with pytest.raises(ValueError):
            future.result(timeout=60)
        tb = future.traceback()
    frames = [(f.name, f.lineno) for f in traceback.extract_tb(tb)]
    assert ("fail_here", 3) in frames, frames
    assert _sources.code_objects(fn) == [fn.__code__]


def test_distributed_scheduler_listener_is_found_and_serves_mpi():
    """The mpi:// listener finds the Scheduler that creates it among its callers (distributed's
    ``Server.listen`` -> ``listen`` -> backend) and installs the cluster's MPI service there."""
    job = Path(__file__).parent / "jobs" / "scheduler_mpi_service.py"
    out = subprocess.run([sys.executable, str(job)], capture_output=True, text=True, timeout=90)
    assert "SERVICE True" in out.stdout, out.stdout + out.stderr


def test_mpi4py_imports_without_initialising_mpi():
    """mpi4dask imports mpi4py.MPI with ``rc.initialize = False`` and starts MPI on a thread of its own
    (MPI_Init under mpiexec waits for every rank, holding the GIL if mpi4py did it at import)."""
    code = ("import mpi4py; mpi4py.rc.initialize = False\nfrom mpi4py import MPI\n"
            "print('INIT', MPI.Is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "INIT False" in out.stdout, out.stdout + out.stderr


def test_the_mpi_library_starts_a_world_of_one_through_our_pmi_responder():
    """The MPI library speaks PMI-1 to the file descriptor in ``PMI_FD`` (mpi4dask.pm's responder), so a
    process no launcher started gets a world that can join others, not an MPICH singleton."""
    code = ("from mpi4dask import _mpi\nw = _mpi.start().result(60)\n"
            "print('WORLD', w.size, bool(w.served), w.dynamic)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert "WORLD 1 True True" in out.stdout, out.stdout + out.stderr
