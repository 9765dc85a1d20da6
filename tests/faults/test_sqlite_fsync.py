"""``NotStoredError`` means not stored, on SQLite too: a failed WAL fsync at COMMIT.

The WAL fsync of enqueue's COMMIT fails with EIO (a real ``LD_PRELOAD`` shim,
``tests/faults/fsyncshim.py``) while another process has the file open, as a
dispatcher does. SQLite reports the COMMIT failed and the row is absent; but the frames
were written, and once every process is killed, SQLite's WAL recovery at the next open
accepts them: the operation is pending and would be sent. Absent after a failed COMMIT
is therefore not proof on its own. Enqueue answers ``NotStoredError`` only once a later
write transaction has committed over those frames (``outbox.store.commit``), and
``StoreOutcomeUnknown`` when none can.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults import fsyncshim

REPO = Path(__file__).resolve().parents[2]


class World:
    def __init__(self, tmp: Path) -> None:
        self.shim = fsyncshim.build(tmp)
        self.path = tmp / "outbox.sqlite3"
        self.url = f"sqlite:///{self.path}"
        self.processes: list[subprocess.Popen[str]] = []
        self.cli("migrate")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "outbox", "--db", self.url, *args],
                              check=False, cwd=REPO, capture_output=True, text=True,
                              timeout=60)  # fmt: skip

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.fsync_app", *args],
            cwd=REPO, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.processes.append(process)
        return process

    def hold(self) -> None:
        holder = self.start("hold", str(self.path))
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"

    def enqueue(
        self, *op_ids: str, arm: Path | None = None, env: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Run the application under the shim: it enqueues a first operation, creates
        ``arm`` (default: the shim's trigger, so that one WAL fsync fails), then
        enqueues each of ``op_ids``; their answers."""
        app = self.start("enqueue", self.url, str(arm or self.shim.trigger), *op_ids,
                         env={**self.shim.environment(), **(env or {})})  # fmt: skip
        assert app.stdout is not None
        answers = []
        for line in app.stdout:
            if line.strip() == "done":
                return answers
            answers.append(json.loads(line))
        raise AssertionError(f"the application ended early (exit {app.wait(5)})")

    def kill_all(self) -> None:
        """SIGKILL every process of the test: a crash, no clean close anywhere."""
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
            process.wait(10)
            if process.stdout is not None:
                process.stdout.close()
        self.processes.clear()

    def state_after_restart(self, op_id: str) -> str | None:
        """The operation's state as the next process to open the file sees it."""
        shown = self.cli("show", op_id, "--json")
        if shown.returncode != 0:
            assert "no operation" in shown.stderr, shown.stderr
            return None
        state: str = json.loads(shown.stdout)["state"]
        return state


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    world = World(tmp_path)
    try:
        yield world
    finally:
        world.kill_all()


def test_not_stored_after_a_failed_wal_fsync_stays_not_stored_after_a_crash(
    world: World,
) -> None:
    world.hold()
    [answer] = world.enqueue("charge-1")
    assert world.shim.injected() == [f"EIO {world.path}-wal"]
    assert answer["raised"] == "NotStoredError", answer
    assert answer["found"] == []

    world.kill_all()
    # What enqueue said must still hold once SQLite's recovery has read the WAL.
    assert world.state_after_restart("charge-1") is None
    assert world.state_after_restart("warm") == "pending"


def test_enqueue_many_after_a_failed_wal_fsync(world: World) -> None:
    world.hold()
    [answer] = world.enqueue("many:charge-1,charge-2")
    assert len(world.shim.injected()) == 1
    assert answer["raised"] == "NotStoredError", answer
    assert answer["found"] == []

    world.kill_all()
    assert world.state_after_restart("charge-1") is None
    assert world.state_after_restart("charge-2") is None


def test_outcome_unknown_while_no_write_can_commit(world: World) -> None:
    """The disk keeps failing: nothing can prove the frames dead, so the answer is the
    ambiguous one, and enqueuing again with the same ID afterwards stores it once."""
    world.hold()
    [answer] = world.enqueue("charge-1", arm=world.shim.always,
                             env={"OUTBOX_TEST_COMMIT_CHECK_SECONDS": "0.5"})  # fmt: skip
    assert len(world.shim.injected()) >= 2  # the COMMIT, then the sealing write's
    assert answer["raised"] == "StoreOutcomeUnknown", answer
    assert "no later write transaction could commit" in answer["message"]
    assert "SAME operation ID" in answer["message"]

    world.kill_all()
    world.shim.always.unlink()
    world.shim.log.unlink()
    # The disk works again; the application enqueues again with the same ID.
    [again] = world.enqueue("charge-1", arm=world.path.with_name("nothing-armed"))
    assert again["raised"] is None and again["found"] == ["charge-1"]
    world.kill_all()
    assert world.state_after_restart("charge-1") == "pending"
