"""Run real mpiexec jobs from tests: hard timeouts, whole process group killed on expiry."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

JOBS = Path(__file__).parent / "jobs"


def mpiexec() -> str:
    here = Path(sys.executable).with_name("mpiexec")
    return str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def __str__(self):
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"


def run(args: list[str], timeout: float, env: dict | None = None, cwd=None) -> Result:
    """Run ``args`` in a new session; on timeout kill the whole group and fail loudly."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                         cwd=cwd, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(args)}\n{Result(-9, out, err)}")
    return Result(p.returncode, out, err)


def run_job(n: int, script: str, *script_args: str, timeout: float = 60, mpiexec_args=(), env=None) -> Result:
    """``mpiexec -n N python tests/jobs/SCRIPT ARGS`` with a timeout."""
    path = JOBS / script
    return run([mpiexec(), *mpiexec_args, "-n", str(n), sys.executable, str(path), *script_args], timeout, env=env)
