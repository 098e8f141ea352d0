"""Every Python example in the docs (docs/**/*.md) and README.md runs, so the docs cannot rot.

Each fenced ```python block runs in a fresh process, in a temporary directory, as a script:

* by default as ``python example.py``;
* after a line ``<!-- run-with: mpiexec -n 4 python first.py -->`` (the line right before the fence)
  as that command: the block is written to the ``.py`` file the command names, ``mpiexec`` is this
  venv's and ``python`` this interpreter.  The page must show the same command to its readers;
* after a line ``<!-- not-run: why -->`` not at all: the reason says why (e.g. it needs a Slurm
  cluster, and which test covers it).

A block without a marker that fails, a marker with no block after it, or a ``not-run`` without a
reason fails the suite.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import MPIEXEC, run_command

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts) + [ROOT / "README.md"]
MARKER = re.compile(r"^<!--\s*(run-with|not-run):\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^\s`]*)")
EXAMPLE_TIMEOUT = 60  # seconds for one example; they use small data and take 3-6 s each


@dataclass
class Example:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    marker: str | None  # "run-with", "not-run" or None
    arg: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _parse(page: Path) -> tuple[list[Example], list[str]]:
    """The page's python blocks, and its problems (markers that precede no python block)."""
    lines = page.read_text().splitlines()
    examples, problems = [], []
    pending = None  # (kind, arg, line) of a marker waiting for its fence
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if m:
            if pending:
                problems.append(f"{page.relative_to(ROOT)}:{pending[2]}: marker not followed by a python block")
            pending = (m.group(1), m.group(2), i + 1)
            i += 1
            continue
        f = FENCE.match(lines[i])
        if f:
            fence, lang = f.group(1), f.group(2).lower()
            j = i + 1
            while j < len(lines) and not lines[j].startswith(fence):
                j += 1
            if lang in ("python", "py"):
                kind, arg = (pending[0], pending[1]) if pending else (None, "")
                examples.append(Example(page, i + 1, "\n".join(lines[i + 1 : j]) + "\n", kind, arg))
            elif pending:
                problems.append(f"{page.relative_to(ROOT)}:{pending[2]}: marker followed by a {lang or 'plain'} block")
            pending = None
            i = j + 1
            continue
        if pending and lines[i].strip():
            problems.append(f"{page.relative_to(ROOT)}:{pending[2]}: marker not right before a python block")
            pending = None
        i += 1
    if pending:
        problems.append(f"{page.relative_to(ROOT)}:{pending[2]}: marker at the end of the page")
    return examples, problems


EXAMPLES: list[Example] = []
PROBLEMS: list[str] = []
for _page in PAGES:
    _ex, _pr = _parse(_page)
    EXAMPLES += _ex
    PROBLEMS += _pr
RUNNABLE = [e for e in EXAMPLES if e.marker != "not-run"]


def _command(example: Example, tmp: Path) -> list[str]:
    if example.marker != "run-with":
        script = tmp / "example.py"
        script.write_text(example.code)
        return [sys.executable, str(script)]
    argv = shlex.split(example.arg)
    scripts = [a for a in argv if a.endswith(".py")]
    assert len(scripts) == 1, f"{example.id}: run-with must name one .py file for the block: {example.arg!r}"
    (tmp / scripts[0]).write_text(example.code)
    return [MPIEXEC if a == "mpiexec" else sys.executable if a == "python" else a for a in argv]


@pytest.mark.timeout(30)
def test_markers_are_well_formed():
    assert not PROBLEMS, PROBLEMS
    for e in EXAMPLES:
        if e.marker == "not-run":
            assert len(e.arg) >= 10, f"{e.id}: say why the block is not run (and what tests it instead)"
        if e.marker == "run-with":
            # readers see the command on the page, not only in the HTML comment
            text = e.page.read_text()
            assert text.count(e.arg) >= 2, f"{e.id}: the page must show its command {e.arg!r} to readers"
    # the docs keep runnable examples, the README among them
    assert len(RUNNABLE) >= 5, [e.id for e in RUNNABLE]
    assert any(e.page.name == "README.md" for e in RUNNABLE)


@pytest.mark.timeout(EXAMPLE_TIMEOUT + 30)
@pytest.mark.parametrize("example", RUNNABLE, ids=[e.id for e in RUNNABLE])
def test_example_runs(example, tmp_path):
    rc, out, err = run_command(_command(example, tmp_path), EXAMPLE_TIMEOUT, cwd=tmp_path)
    assert rc == 0, (f"{example.id} failed (exit status {rc})\n--- code\n{example.code}\n--- stdout\n{out}\n"
                     f"--- stderr\n{err}")


@pytest.mark.timeout(30)
def test_readme_test_command_is_the_one_ci_runs():
    """README's test command is what .ci/run calls, and its docs build step is the one this page states."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npython -m pytest\n" in readme and "\npython -m pytest\n" in ci
    assert "python -m sphinx -W --keep-going" in ci


@pytest.mark.timeout(30)
def test_reference_pages_cover_the_code():
    """The API page documents every public name; the configuration page every environment variable and
    dask configuration key that src/mpi4dask reads."""
    import mpi4dask

    api = (ROOT / "docs" / "api.md").read_text()
    for name in mpi4dask.__all__:
        if name != "__version__":
            assert re.search(rf"\.\. auto(function|exception|class):: mpi4dask\.{name}\n", api), name
    config = (ROOT / "docs" / "configuration.md").read_text()
    src = "\n".join(p.read_text() for p in (ROOT / "src" / "mpi4dask").rglob("*.py"))
    env = set(re.findall(r"""environ(?:\.get|\.setdefault|\.pop)?[(\[]\s*["']([A-Z][A-Z0-9_]+)["']""", src))
    env |= set(re.findall(r"MPI4DASK_[A-Z_]+", src))
    keys = set(re.findall(r"""dask\.config\.get\(\s*["']([\w.-]+)["']""", src))
    keys |= set(re.findall(r"""dask\.config\.set\(\s*\{\s*["']([\w.-]+)["']""", src))
    assert env and keys
    missing = sorted(n for n in env | keys if f"`{n}`" not in config)
    assert not missing, f"docs/configuration.md does not document {missing}"
