"""Every example runs as a user would run it: a fresh process from the repository root.

Each example starts its own receiver, prints what happened, and exits 0 only if its own
checks held, so the exit status is the assertion; the output is shown when it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import POSTGRES_URL, require_postgres

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_example(
    name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> str:
    completed = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / name), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
        check=False,
    )
    output = completed.stdout.decode(errors="replace")
    assert completed.returncode == 0, f"{name} exited {completed.returncode}:\n{output}"
    assert "FAILED" not in output, output
    return output


def test_orders_sqlalchemy_enqueues_in_the_callers_transaction() -> None:
    output = run_example("orders_sqlalchemy.py")
    assert "[ok] no intent for the rolled-back order 18" in output
    assert "[ok] one reservation at the inventory store" in output


def test_async_caller_uses_run_sync_and_the_async_dispatcher() -> None:
    output = run_example("async_caller.py")
    assert "[ok] one reservation per order at the inventory store" in output


def test_versioned_settings_replays_history_and_refuses_a_stale_version() -> None:
    output = run_example("versioned_settings.py")
    assert "[ok] the retry got edit-42's own historical result" in output
    assert "[ok] edit-44 (stale version, new key) recorded failed" in output


def test_postgres_two_dispatcher_processes_share_one_outbox() -> None:
    require_postgres()
    output = run_example(
        "postgres_two_dispatchers.py", env={"OUTBOX_EXAMPLE_POSTGRES_URL": POSTGRES_URL}
    )
    assert "[ok] 100 requests at the receiver: none sent twice" in output
    assert "[ok] both dispatchers exited 0 after SIGTERM" in output


def test_fastapi_orders_over_http_on_sqlite() -> None:
    output = run_example("fastapi_orders.py", timeout=120)
    assert "[ok] order rows 1-3 only: the refused one rolled back" in output
    assert "[ok] one reservation per order at the inventory service" in output
    assert "[ok] SIGTERM: the lifespan drained the dispatcher and the server exited" in output


def test_fastapi_orders_over_http_on_postgres() -> None:
    require_postgres()
    output = run_example(
        "fastapi_orders.py",
        "--postgres",
        env={"OUTBOX_EXAMPLE_POSTGRES_URL": POSTGRES_URL},
        timeout=120,
    )
    assert "[ok] order rows 1-3 only: the refused one rolled back" in output
    assert "[ok] one reservation per order at the inventory service" in output


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_is_listed_in_the_readme(name: str) -> None:
    assert name in (EXAMPLES / "README.md").read_text()
