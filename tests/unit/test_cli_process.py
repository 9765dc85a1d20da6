"""The process entry's garbage-collector pause is undone by every command that is not a
read (a dispatcher or the console runs with the collector on), and only the entry
pauses it: ``outbox.cli.main`` called in-process leaves the interpreter as it was."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
from pathlib import Path

PROBE = """
import gc, sys
from outbox import cli_support
from outbox.cli import main
if sys.argv[1] == "entry":
    cli_support.pause_gc_for_startup()
try:
    main(sys.argv[2:])
except SystemExit:
    pass
print(gc.isenabled(), cli_support.ran_read_command())
"""


def _probe(tmp_path: Path, how: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", PROBE, how, *args],
        capture_output=True, text=True, check=True, cwd=tmp_path, timeout=120,
    ).stdout.strip().splitlines()[-1]  # fmt: skip


def test_a_read_keeps_the_pause_and_a_write_command_ends_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ob.sqlite3'}"
    assert _probe(tmp_path, "entry", "--db", url, "migrate") == "True False"
    assert _probe(tmp_path, "entry", "--db", url, "status") == "False True"
    assert _probe(tmp_path, "in-process", "--db", url, "status") == "True True"


def test_in_process_a_command_leaves_a_disabled_collector_alone(tmp_path: Path) -> None:
    from outbox.cli import main

    url = f"sqlite:///{tmp_path / 'ob.sqlite3'}"
    gc.disable()
    try:
        with contextlib.suppress(SystemExit):
            main(["--db", url, "migrate"])
        assert not gc.isenabled()
    finally:
        gc.enable()
