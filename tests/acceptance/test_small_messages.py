"""The small messages of issue 29, each in its exact words, from the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import insert

from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from outbox.store.tables import operations

REPO = Path(__file__).resolve().parents[2]


def _outbox(*args: str, cwd: Path, code: str | None = None) -> subprocess.CompletedProcess[str]:
    prefix = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "outbox"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [*prefix, *([] if code else args)], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip


def test_a_bare_file_path_for_db_gets_the_sqlite_url_to_use(tmp_path: Path) -> None:
    done = _outbox("--db", "orders.db", "status", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == (
        f"error: --db 'orders.db' is not a database URL: did you mean "
        f"sqlite:///{tmp_path / 'orders.db'}?\n"
    )
    assert not (tmp_path / "orders.db").exists()  # nothing was created


def test_show_without_tenant_names_the_tenant_that_holds_the_id(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'o.sqlite3'}"
    engine = create_engine(url)
    upgrade(engine)
    now = int(time.time() * 1000)
    with engine.begin() as conn:
        conn.execute(insert(operations).values(
            tenant="globex", operation_id="pay-0001", endpoint="payments", method="POST",
            path="/pay", headers="{}", args_sha256="x", state="pending", created_at=now,
            updated_at=now,
        ))  # fmt: skip
    engine.dispose()
    done = _outbox("--db", url, "reconcile", "show", "pay-0001", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        "error: no operation 'pay-0001' in tenant ''; it exists in tenant 'globex' "
        "(pass --tenant globex)\n"
    )


def test_metrics_port_without_prometheus_client_is_a_usage_error(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None; "
        "from outbox.cli import main; sys.argv = ['outbox'] + sys.argv[1:]; main()"
    )
    url = f"sqlite:///{tmp_path / 'o.sqlite3'}"
    done = _outbox("--db", url, "--app", "x:y", "dispatch", "--metrics-port", "0",
                   cwd=tmp_path, code=code)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "error: --metrics-port needs prometheus_client, which is not installed: "
        "pip install 'http-outbox[metrics]'\n"
    )


def test_show_of_a_failed_operation_says_which_answer_from_which_attempt(
    tmp_path: Path,
) -> None:
    from outbox.store.tables import attempts

    url = f"sqlite:///{tmp_path / 'o.sqlite3'}"
    engine = create_engine(url)
    upgrade(engine)
    now = int(time.time() * 1000)
    with engine.begin() as conn:
        pk = conn.execute(insert(operations).values(
            tenant="", operation_id="pay-0002", endpoint="payments", method="POST",
            path="/pay", headers="{}", args_sha256="x", state="failed", created_at=now,
            updated_at=now, finished_at=now, attempts_total=2, attempts_counted=2,
            first_attempt_at=now - 60_000, result_status=422,
        )).inserted_primary_key[0]  # fmt: skip
        for number, (verdict, status) in enumerate((("retry", 503), ("failed", 422)), 1):
            conn.execute(insert(attempts).values(
                operation_pk=pk, number=number, request_id=f"req-{number}", dispatcher_id="d",
                lease_token="t", started_at=now - 60_000 + number, lease_until=now,
                finished_at=now, delivery="sent", verdict=verdict, status_code=status,
                receiver_request_id=f"rx-{number}",
            ))  # fmt: skip
    engine.dispose()
    done = _outbox("--db", url, "reconcile", "show", "pay-0002", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (
        "why: failed: the receiver refused it with 422 (receiver request rx-2), answering "
        "attempt 2 of 2\n"
    ) in done.stdout


def test_the_demo_says_when_the_database_its_commands_name_is_removed(tmp_path: Path) -> None:
    gone = _outbox("demo", cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert (
        "an operator would now run (on a database this demo removes when it exits: "
        "`outbox demo --dir DIR` keeps it):"
    ) in gone.stdout
    kept = _outbox("demo", "--dir", str(tmp_path / "kept"), cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr
    assert "\nan operator would now run:\n" in kept.stdout
    assert "--dir DIR" not in kept.stdout
    assert (tmp_path / "kept" / "outbox.sqlite3").is_file()
    makefile = (REPO / "Makefile").read_text()
    assert "$(BIN)/outbox demo --dir demo-files" in makefile  # `make demo` keeps them
