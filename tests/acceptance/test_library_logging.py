"""Used as a library, outbox logs through the standard ``logging`` module and prints
nothing unless the application configures logging.

Each test runs an application in a subprocess (a fresh interpreter: no logging set up by
pytest), against a real receiver: one attempt succeeds, one is dropped after commit
(warnings and a retry), so events of several levels are emitted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.testing.receiver import Receiver

APP = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    from tenacity import wait_fixed
    from outbox import Endpoint, FakeClock, Outbox, RetryPolicy

    SETUP

    clock = FakeClock()
    ob = Outbox(
        sys.argv[1],
        endpoints=[Endpoint(name="rx", base_url=sys.argv[2], timeout=2.0,
                            retry=RetryPolicy(max_attempts=3, window=timedelta(minutes=5),
                                              wait=wait_fixed(1)),
                            key_retention=timedelta(hours=1))],
        clock=clock,
    )
    ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"n": 1},
               operation_id="quiet-ok")
    ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"n": 2},
               operation_id="quiet-dropped")
    ob.dispatch_once()
    clock.advance(2)
    ob.dispatch_once()
    assert ob.get("quiet-ok").state.value == "succeeded"
    assert ob.get("quiet-dropped").state.value == "succeeded"
    ob.close()
    """
)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        rx.faults.drop_after_commit(times=1, key="quiet-dropped")
        yield rx


def _run(tmp_path: Path, receiver: Receiver, setup: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "app.py"
    script.write_text(APP.replace("SETUP", textwrap.dedent(setup)))
    db = f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    return subprocess.run(
        [sys.executable, str(script), db, receiver.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_with_nothing_configured_the_library_prints_nothing(
    tmp_path: Path, receiver: Receiver
) -> None:
    done = _run(tmp_path, receiver, "")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert done.stderr == ""
    # The work really happened (and so did the events that stayed quiet).
    assert receiver.effect_count() == 2
    assert len(receiver.requests(key="quiet-dropped")) == 2


def test_structlog_configured_by_the_application_does_not_capture_outbox_events(
    tmp_path: Path, receiver: Receiver
) -> None:
    """An application's own structlog set-up prints its events; ours stay in logging."""
    done = _run(
        tmp_path,
        receiver,
        """
        import structlog
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stdout))
        structlog.get_logger().info("app_event")
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "app_event" in done.stdout
    assert "attempt_started" not in done.stdout + done.stderr


def test_configured_logging_receives_the_events_with_their_fields(
    tmp_path: Path, receiver: Receiver
) -> None:
    done = _run(
        tmp_path,
        receiver,
        """
        import json, logging

        class Capture(logging.Handler):
            def emit(self, record):
                print(json.dumps({"logger": record.name, "level": record.levelname,
                                  "message": record.getMessage(),
                                  "file": record.filename,
                                  "fields": record.outbox}, default=str))

        # Other libraries (alembic, httpx) log at INFO too: keep outbox's records.
        logging.basicConfig(level=logging.INFO)
        logging.getLogger().handlers[0].addFilter(logging.Filter("outbox"))
        logging.getLogger().handlers[0].setStream(sys.stderr)
        logging.getLogger("outbox").addHandler(Capture())
        """,
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    events = {r["fields"]["event"] for r in records}
    assert {
        "dispatcher_started",
        "attempt_started",
        "attempt_finished",
        "retry_scheduled",
        "operation_succeeded",
        "dispatcher_stopped",
    } <= events
    # INFO: no DEBUG events (operations_claimed is DEBUG).
    assert "operations_claimed" not in events
    assert all(r["logger"] == "outbox.dispatch" for r in records)
    # The record points at the line that logged, not at the logging plumbing: the send
    # path of one attempt logs from dispatch/_attempt.py, the rest from dispatcher.py.
    sent_here = {"attempt_started", "attempt_finished"}
    assert all(
        r["file"] == ("_attempt.py" if r["fields"]["event"] in sent_here else "dispatcher.py")
        for r in records
    ), sorted({(r["fields"]["event"], r["file"]) for r in records})
    finished = [r for r in records if r["fields"]["event"] == "attempt_finished"]
    dropped = [r for r in finished if r["fields"]["operation_id"] == "quiet-dropped"]
    assert [r["fields"]["delivery"] for r in dropped] == ["unknown", "sent"]
    first = dropped[0]
    assert first["level"] == "INFO"
    assert first["fields"]["attempt"] == 1
    assert first["fields"]["endpoint"] == "rx"
    assert first["fields"]["tenant"] == ""
    assert first["fields"]["request_id"]
    assert first["fields"]["dispatcher_id"]
    assert first["message"].startswith("attempt_finished ")
    assert "operation_id=quiet-dropped" in first["message"]
    assert f"request_id={first['fields']['request_id']}" in first["message"]
    # Every attempt the receiver saw was logged with its request ID.
    seen = {r.request_id for r in receiver.requests()}
    logged = {r["fields"]["request_id"] for r in finished}
    assert seen == logged
    # The application's own handler (basicConfig's, on stderr) printed the same events.
    assert done.stderr.count("INFO:outbox.dispatch:attempt_finished ") == len(finished)


def test_warning_level_keeps_only_warnings(tmp_path: Path, receiver: Receiver) -> None:
    done = _run(
        tmp_path,
        receiver,
        """
        import logging
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout,
                            format="%(levelname)s %(name)s %(message)s")
        """,
    )
    assert done.returncode == 0, done.stderr
    # A dropped connection is a retry (INFO), not a warning: nothing at WARNING here.
    assert done.stdout == ""


def test_no_module_logs_through_structlogs_global_configuration() -> None:
    """Every library logger comes from ``outbox.base.logs.get_logger``: a module that took
    ``structlog.get_logger()`` would print on the application's stdout by default."""
    package = Path(__file__).resolve().parents[2] / "outbox"
    offenders = [
        str(path.relative_to(package.parent))
        for path in sorted(package.rglob("*.py"))
        if path.name != "logs.py" and "structlog.get_logger" in path.read_text()
    ]
    assert offenders == []
