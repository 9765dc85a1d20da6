"""``outbox show``, ``reconcile show`` and ``outbox keys`` on encrypted rows, as real
processes: the key ring comes from ``--keys module:attr``, like ``--app``."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from outbox import Endpoint, Outbox
from outbox.base.keys import KeyRing

OUTBOX = str(Path(sys.executable).with_name("outbox"))
PLANTED = "4111-PLANTED-CARD-9931"
KEYS_MODULE = """
from outbox.base.keys import KeyRing
FP = b"f" * 32
old = KeyRing({"k1": b"1" * 32}, current="k1", fingerprint_key=FP)
both = KeyRing({"k2": b"2" * 32, "k1": b"1" * 32}, current="k2", fingerprint_key=FP)
new = KeyRing({"k2": b"2" * 32}, current="k2", fingerprint_key=FP)
def made():
    return new
"""


def run(tmp: Path, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return subprocess.run([OUTBOX, *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp, env=env, stdin=subprocess.DEVNULL, check=False)  # fmt: skip


@pytest.fixture
def db(tmp_path: Path) -> str:
    (tmp_path / "ringmod.py").write_text(KEYS_MODULE)
    url = f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    ring = KeyRing({"k1": b"1" * 32}, current="k1", fingerprint_key=b"f" * 32)
    with Outbox(url, endpoints=[Endpoint(name="rx", base_url="http://127.0.0.1:9")],
                keys=ring) as ob:  # fmt: skip
        for i in range(3):
            ob.enqueue(endpoint="rx", method="POST", path="/pay", json={"card": PLANTED},
                       operation_id=f"pay-{i}")  # fmt: skip
    return url


def test_show_says_which_key_is_missing_and_decrypts_with_it(tmp_path: Path, db: str) -> None:
    blind = run(tmp_path, ["show", "pay-0", "--db", db])
    assert blind.returncode == 0, blind.stderr
    assert "body: encrypted: key k1 not available" in blind.stdout
    assert PLANTED not in blind.stdout
    seen = run(tmp_path, ["show", "pay-0", "--db", db, "--keys", "ringmod:old"])
    assert seen.returncode == 0, seen.stderr
    assert f'body: {{"card": "{PLANTED}"}}' in seen.stdout
    # Before the command, as --db and --app may be (it was "No such option").
    first = run(tmp_path, ["--keys", "ringmod:old", "--db", db, "show", "pay-0"])
    assert first.returncode == 0, first.stderr
    assert first.stdout == seen.stdout
    rec = run(tmp_path, ["reconcile", "show", "pay-0", "--db", db])
    assert "encrypted: key k1 not available" in rec.stdout + rec.stderr


def test_rotate_dry_run_then_rotate_with_progress(tmp_path: Path, db: str) -> None:
    dry = run(tmp_path, ["keys", "rotate", "--dry-run", "--db", db, "--keys", "ringmod:both"])
    assert dry.returncode == 0, dry.stderr
    assert "would change 6 values in 3 rows" in dry.stdout
    still = run(tmp_path, ["show", "pay-1", "--db", db, "--keys", "ringmod:made"])
    assert "encrypted: key k1 not available" in still.stdout  # the dry run changed nothing
    done = run(tmp_path, ["keys", "rotate", "--batch-size", "2", "--db", db,
                          "--keys", "ringmod:both"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "re-wrapped 6 values in 3 rows" in done.stdout
    assert done.stderr.splitlines() == ["rotate: 2 rows scanned", "rotate: 3 rows scanned"]
    after = run(tmp_path, ["show", "pay-1", "--db", db, "--keys", "ringmod:made"])
    assert PLANTED in after.stdout


def test_without_a_key_ring_keys_commands_are_refused(tmp_path: Path, db: str) -> None:
    r = run(tmp_path, ["keys", "rotate", "--db", db])
    assert r.returncode == 2
    assert "no key ring: name it with --keys" in r.stderr
    bad = run(tmp_path, ["keys", "rotate", "--db", db, "--keys", "ringmod:FP"])
    assert bad.returncode == 2
    assert bad.stderr.startswith(
        "error: --keys ringmod:FP: FP is a bytes, not an outbox.base.keys.KeyRing "
        "(or a function returning one)"
    )
    assert len(bad.stderr.splitlines()) == 1


def test_shred_destroys_old_data_keys_and_keeps_the_rows(tmp_path: Path, db: str) -> None:
    assert run(tmp_path, ["cancel", "pay-2", "--note", "test", "--db", db]).returncode == 0
    with sqlite3.connect(tmp_path / "outbox.sqlite3") as conn:
        conn.execute("UPDATE outbox_operations SET finished_at = 1 WHERE operation_id='pay-2'")
    r = run(tmp_path, ["keys", "shred", "--older-than", "1d", "--db", db,
                       "--keys", "ringmod:old"])  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "shredded 2 values in 1 rows" in r.stdout
    gone = run(tmp_path, ["show", "pay-2", "--db", db, "--keys", "ringmod:old"])
    assert "state: cancelled" in gone.stdout
    assert "body: encrypted: data key destroyed (key k1, shredded)" in gone.stdout
    kept = run(tmp_path, ["show", "pay-1", "--db", db, "--keys", "ringmod:old"])
    assert PLANTED in kept.stdout
    audit = run(tmp_path, ["audit", "--db", db])
    assert "pay-2" in audit.stdout
