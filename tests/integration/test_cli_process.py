"""The process entry's garbage-collector pause is undone by every command that is not a
read (a dispatcher or the console runs with the collector on), and only the entry
pauses it: ``outbox.cli.main`` called in-process leaves the interpreter as it was."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from pathlib import Path

from outbox.cli.process import DISPATCH_GC_THRESHOLD

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import gc, sys
from outbox.cli import process as cli_process
from outbox.cli import main
if sys.argv[1] == "entry":
    cli_process.pause_gc_for_startup()
try:
    main(sys.argv[2:])
except SystemExit:
    pass
print(gc.isenabled(), cli_process.ran_read_command())
print(gc.get_freeze_count() > 0, gc.get_threshold()[0])
"""


def _probe(tmp_path: Path, how: str, *args: str, line: int = -2) -> str:
    env = {**os.environ, "OUTBOX_TEST_DB": f"sqlite:///{tmp_path / 'ob.sqlite3'}",
           "OUTBOX_TEST_RECEIVER_URL": "http://127.0.0.1:9"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-c", PROBE, how, *args],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=120, env=env,
    ).stdout.strip().splitlines()[line]  # fmt: skip


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


def test_a_dispatcher_process_freezes_its_start_up_and_collects_less_often(
    tmp_path: Path,
) -> None:
    app = ["--app", "tests.support.dispatch_app:outbox", "dispatch", "--until-empty"]
    url = f"sqlite:///{tmp_path / 'ob.sqlite3'}"
    assert _probe(tmp_path, "entry", "--db", url, "migrate") == "True False"
    # Started by the process entry: the process is ours.
    assert _probe(tmp_path, "entry", *app, line=-1) == f"True {DISPATCH_GC_THRESHOLD}"
    # Called in-process (an application's process): its collector is left as it was.
    default = gc.get_threshold()[0]
    assert _probe(tmp_path, "in-process", *app, line=-1) == f"False {default}"
