"""A stored string cannot drive the next operator's terminal.

Notes with ESC/CSI/OSC sequences are refused at input (nothing written). Strings that
are already stored (an older row, a tampered row, a receiver's answer) are shown with
every control character spelled out: ``outbox show`` on a real terminal-bound stdout
carries no ESC (0x1B), CSI (0x9B) or OSC (0x9D) from the data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import insert, update

from outbox import Endpoint, Outbox, State, ValidationError
from outbox.store.tables import attempts, audit, operations
from tests.faults.support import ROOT

CLEAR = "\x1b[2J\x1b[H"  # clear the screen, cursor home
TITLE = "\x1b]0;pwned\x07"  # OSC: set the window title
C1_CSI = "\x9b2J"  # the one-byte CSI


@pytest.mark.parametrize("note", [f"ok {CLEAR}", f"{TITLE} done", f"x{C1_CSI}", "a\rb"])
def test_notes_with_terminal_controls_are_refused_and_nothing_is_written(
    note: str, tmp_path: Path
) -> None:
    with Outbox(f"sqlite:///{tmp_path / 'ob.sqlite3'}",
                endpoints=[Endpoint(name="rx", base_url="http://127.0.0.1:9")]) as ob:  # fmt: skip
        ob.enqueue(endpoint="rx", method="POST", path="/x", json={}, operation_id="op")
        with pytest.raises(ValidationError, match="control character"):
            ob.reconcile.cancel("op", note=note)
        assert ob.get("op").state is State.PENDING
        assert ob.reconcile.show("op").audit == []
        # Tabs and newlines are fine.
        ob.reconcile.cancel("op", note="checked:\n\tnot sent anywhere")
        assert ob.get("op").state is State.CANCELLED


def test_stored_control_sequences_are_neutralised_on_display(tmp_path: Path) -> None:
    db = tmp_path / "ob.sqlite3"
    with Outbox(f"sqlite:///{db}",
                endpoints=[Endpoint(name="rx", base_url="http://127.0.0.1:9")]) as ob:  # fmt: skip
        op = ob.enqueue(endpoint="rx", method="POST", path="/x", json={"t": TITLE},
                        operation_id="op")  # fmt: skip
        with ob.engine.begin() as conn:  # rows written before notes were checked, or tampered
            conn.execute(update(operations).where(operations.c.id == op.pk).values(
                state="unresolved", reason="outcome_unknown", result_status=200,
                result_body=json.dumps(CLEAR + C1_CSI), result_headers="{}",
                result_sha256=None, result_size=10, result_truncated=False))  # fmt: skip
            conn.execute(insert(audit).values(
                tenant="", operation_id="op", actor=f"mallory{TITLE}", action="note",
                from_state="unresolved", to_state="unresolved", note=f"look {CLEAR} here",
                details=None, at=0))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    shown = subprocess.run([sys.executable, "-m", "outbox.cli", "--db", f"sqlite:///{db}",
                            "show", "op"], cwd=tmp_path, capture_output=True, timeout=60,
                           env={**env, "PYTHONPATH": str(ROOT)}, check=False)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert b"look" in out and b"mallory" in out  # the strings are shown ...
    assert b"\\x1b[2J" in out  # ... spelled out
    for byte in (b"\x1b", "\x9b".encode(), "\x9d".encode(), b"\x07"):
        assert byte not in out, byte


def test_stored_strings_are_never_read_as_rich_markup(tmp_path: Path) -> None:
    """A receiver's request ID (or any stored string in a table cell) that looks like
    rich markup or emoji codes prints as written: it cannot restyle the table, plant a
    link or turn ":warning:" into a picture."""
    db = tmp_path / "ob.sqlite3"
    planted = "[link=http://evil.example]support[/link] [red]OK[/red] :warning: :+1:"
    with Outbox(f"sqlite:///{db}",
                endpoints=[Endpoint(name="rx", base_url="http://127.0.0.1:9")]) as ob:  # fmt: skip
        op = ob.enqueue(endpoint="rx", method="POST", path="/x", json={}, operation_id="op")
        with ob.engine.begin() as conn:
            conn.execute(insert(attempts).values(
                operation_pk=op.pk, number=1, request_id="r-1", dispatcher_id="d",
                lease_token="t", started_at=1, lease_until=2, finished_at=2,
                delivery="sent", verdict="failed", status_code=400,
                receiver_request_id=planted, duration_ms=1))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    shown = subprocess.run([sys.executable, "-m", "outbox.cli", "--db", f"sqlite:///{db}",
                            "show", "op"], cwd=tmp_path, capture_output=True, timeout=60,
                           env={**env, "PYTHONPATH": str(ROOT), "COLUMNS": "400"},
                           check=False)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert planted.encode() in shown.stdout
