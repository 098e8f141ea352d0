"""A private single-node Slurm for tests: ``munged``, ``slurmctld`` and ``slurmd`` from Debian's packages.

:class:`Slurm` writes a ``slurm.conf`` of its own into a directory, starts the three daemons in the
foreground as child processes of the test (their own process group each), and waits until the node is
idle.  Nothing is shared with a Slurm the machine may already run: its own munge key and socket
(``AuthInfo=socket=...``), its own free ports, state and spool directories.  Clients (``srun``,
``sbatch``, ``squeue``, ``scancel`` and dask-jobqueue's calls of them) find it through ``SLURM_CONF``,
which :attr:`Slurm.env` holds; jobs inherit the submitter's environment (``--export=ALL``, Slurm's
default), so a job's Python is the test's venv.

The node claims more CPUs than the machine has (``SlurmdParameters=config_overrides``), so that several
one-core batch jobs (dask-jobqueue workers) run at once on a 2-core test machine, as they would on
several nodes.  ``MpiDefault=none``, like many sites: ``srun`` gives a PMI only with ``--mpi=pmi2``.

Typical use, through the session fixture in ``conftest.py``::

    def test_something(slurm):
        rc, out, err = slurm.run(["srun", "-n", "2", "--mpi=pmi2", "hostname"], timeout=60)

Skips (``SLURM_SKIP_REASON``) only when not root or the daemons are not installed; any other failure
to start is an error that shows the daemons' logs.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "squeue", "scancel", "sinfo", "scontrol")


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "a private Slurm needs root (slurmd starts jobs as their users)"
    missing = [c for c in (*DAEMONS, *CLIENTS) if shutil.which(c, path="/usr/sbin:/usr/bin:/sbin:/bin") is None]
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge"
    return None


SLURM_SKIP_REASON = _skip_reason()


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmError(RuntimeError):
    pass


class Slurm:
    """A running private Slurm (see the module docstring)."""

    def __init__(self, root: Path, cpus: int = 16):
        self.root = Path(root)
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"
        path = os.environ.get("PATH", "")
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), PATH=f"{path}{os.pathsep}/usr/sbin{os.pathsep}/sbin")

    # -- set up --------------------------------------------------------------------------------

    def _write_files(self) -> None:
        r = self.root
        for d in ("state", "spool", "munge", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r, 0o755)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        ctld, slurmd = _free_ports(2)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=mpi4dask-test",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={ctld}",
                    f"SlurmdPort={slurmd}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={r / 'munge' / 'munge.socket'}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SlurmdParameters=config_overrides",
                    "ReturnToService=2",
                    "SchedulerParameters=sched_interval=1",
                    "MessageTimeout=20",
                    "KillWait=5",
                    "InactiveLimit=0",
                    "MinJobAge=30",
                    # job ids of their own: MPICH names its shared memory after the PMI job id ("JOB.STEP"),
                    # and a segment left by a killed job of an earlier Slurm with the same id hangs MPI_Init
                    f"FirstJobId={random.randrange(10_000, 60_000_000)}",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=16000 State=UNKNOWN",
                    f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, cwd=self.root
        )
        out.close()

    def start(self, timeout: float = 60) -> Slurm:
        self._write_files()
        m = self.root / "munge"
        self._spawn(
            "munged",
            ["munged", "--foreground", "--force", f"--key-file={m / 'munge.key'}", f"--socket={m / 'munge.socket'}",
             f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munge.seed'}", f"--log-file={m / 'munged.log'}"],
        )
        self._wait(lambda: (m / "munge.socket").exists(), timeout, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])
        self._wait(self._node_idle, timeout, f"node {self.node} idle in sinfo")
        return self

    def _node_idle(self) -> bool:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True, timeout=20)
        return r.returncode == 0 and r.stdout.strip().startswith("idle")

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise SlurmError(f"{name} exited with {p.returncode} while waiting for {what}\n{self.logs()}")
            if cond():
                return
            time.sleep(0.2)
        raise SlurmError(f"no {what} within {timeout} s\n{self.logs()}")

    def logs(self, tail: int = 40) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if f.exists():
                lines = f.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- use -----------------------------------------------------------------------------------

    def run(self, cmd: list[str], timeout: float, env: dict | None = None, cwd=None):
        """Run a Slurm client command (``srun ...``) with this Slurm's ``SLURM_CONF``; (rc, out, err)."""
        from conftest import run_command

        return run_command(cmd, timeout, env={**{"SLURM_CONF": str(self.conf)}, **(env or {})}, cwd=cwd)

    def squeue(self) -> list[str]:
        r = subprocess.run(["squeue", "-h", "-o", "%i %T %j"], env=self.env, capture_output=True, text=True, timeout=20)
        return r.stdout.split("\n") if r.stdout.strip() else []

    def cancel_all(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=20)

    def stop(self) -> None:
        try:
            self.cancel_all()
        except Exception:  # noqa: BLE001 - daemons may already be gone
            pass
        for name in reversed(DAEMONS):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        # slurmd's step daemons (slurmstepd) and what they started outlive slurmd: every process that
        # carries this Slurm's SLURM_CONF in its environment is one of ours
        self._sweep()

    def _sweep(self) -> None:
        import psutil

        from conftest import kill_all

        mark = f"SLURM_CONF={self.conf}".encode()
        ours = []
        for p in psutil.process_iter(["pid"]):
            if p.pid == os.getpid():
                continue
            try:
                with open(f"/proc/{p.pid}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        ours.append(p)
            except OSError:
                continue
        kill_all(ours)
