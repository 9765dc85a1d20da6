"""Every Python block in README.md runs as written.

The convention, for whoever edits the README:

* Each fenced block opened with three backticks and ``python`` is run **alone**, in a
  fresh Python process (``-W error``), in an empty temporary directory, with the project
  installed. It must exit 0. Use SQLite files in the current directory and
  ``outbox.testing.Receiver`` for a receiver, so it needs nothing else.
* A block that defines ``test_…`` functions is run with pytest instead (the outbox
  pytest plugin's fixtures are available), and its tests must pass.
* A block that cannot run alone (it needs a Django project, a module of yours, a
  variable from the text around it) must say so where readers see it: its **first line
  is a comment starting with** ``# fragment`` (e.g. ``# fragment: settings.py of a
  Django project``). Fragments are only compiled, never run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks() -> list[tuple[int, str]]:
    """(line number, source) of every Python block in the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def is_fragment(source: str) -> bool:
    first = source.lstrip("\n").splitlines()[0] if source.strip() else ""
    return first.strip().lower().startswith("# fragment")


BLOCKS = python_blocks()


def test_the_readme_has_runnable_python_blocks() -> None:
    assert len([b for b in BLOCKS if not is_fragment(b[1])]) >= 3


@pytest.mark.parametrize(("line", "source"), BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block(line: int, source: str, tmp_path: Path) -> None:
    compile(source, f"README.md:{line}", "exec")  # fragments too: at least valid Python
    if is_fragment(source):
        return
    is_test = re.search(r"^def test_", source, re.MULTILINE) is not None
    script = tmp_path / (f"test_readme_{line}.py" if is_test else f"readme_{line}.py")
    script.write_text(source)
    argv = [sys.executable, "-W", "error"]
    argv += ["-m", "pytest", "-q", "-p", "no:cacheprovider", script.name] if is_test else [
        script.name
    ]
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, (
        f"README.md line {line}: the block exited {done.returncode} "
        f"(mark it '# fragment' if it cannot run alone)\n{done.stdout}\n{done.stderr}"
    )


_IMPORT = re.compile(r"^\s*from\s+(outbox[\w.]*)\s+import\s+([\w, ]+)$", re.MULTILINE)


def test_every_outbox_name_the_readme_imports_is_importable_from_there() -> None:
    """``from outbox… import X`` in any block, fragments included, and the names the
    prose says come from ``outbox``."""
    import importlib

    wanted = {("outbox", "StatusLookup"), ("outbox", "Classification")}
    for _, source in BLOCKS:
        for module, names in _IMPORT.findall(source):
            wanted |= {(module, name.strip()) for name in names.split(",") if name.strip()}
    assert ("outbox.testing", "Receiver") in wanted
    for module, name in sorted(wanted):
        assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"
