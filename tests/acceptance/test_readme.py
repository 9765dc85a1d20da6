"""Every Python block in README.md and in the manual (docs/**/*.md) runs as written.

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

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The README and every page of the manual (the guides other branches add included).
SOURCES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks() -> list[tuple[str, str]]:
    """("file:line", source) of every Python block in the README and the manual."""
    found = []
    for path in SOURCES:
        text = path.read_text()
        where = path.relative_to(ROOT)
        found += [
            (f"{where}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1))
            for m in _BLOCK.finditer(text)
        ]
    return found


def is_fragment(source: str) -> bool:
    first = source.lstrip("\n").splitlines()[0] if source.strip() else ""
    return first.strip().lower().startswith("# fragment")


BLOCKS = python_blocks()


def test_the_readme_has_runnable_python_blocks() -> None:
    assert len([b for b in BLOCKS if not is_fragment(b[1])]) >= 3
    assert any(where.startswith("docs/") for where, _ in BLOCKS), "the manual's blocks run too"


@pytest.mark.parametrize(("line", "source"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_readme_block(line: str, source: str, tmp_path: Path) -> None:
    compile(source, line, "exec")  # fragments too: at least valid Python
    if is_fragment(source):
        return
    is_test = re.search(r"^def test_", source, re.MULTILINE) is not None
    stem = re.sub(r"\W", "_", line)
    script = tmp_path / (f"test_block_{stem}.py" if is_test else f"block_{stem}.py")
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
        f"{line}: the block exited {done.returncode} "
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
