"""What a read command imports: never the dispatcher's stack, never the migrations.

Start-up time is mostly imports, and timing is not a test on a shared machine (the
figures live in ``benchmarks/cli_startup.py``). So this pins *which modules* a fresh
process has loaded after running ``outbox status`` / ``show`` / ``reconcile list|show``:
not httpx, aiohttp, anyio, tenacity, Alembic (no migration on read), structlog (no
logging on read), nor the dispatcher, the transport or the status lookup.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outbox import Endpoint, Outbox

REPO = Path(__file__).resolve().parents[2]

#: Module prefixes a read command must not import.
NOT_ON_READ = (
    "httpx",
    "aiohttp",
    "anyio",
    "tenacity",
    "alembic",
    "structlog",
    "outbox.dispatch.dispatcher",
    "outbox.wire.transport",
    "outbox.wire.lookup",
    "outbox.reconcile.probe",
    "outbox.checker",
    "outbox.dispatch.policy",
    "outbox.reconcile.bulk",
)

#: ... and, on SQLite, not SQLAlchemy's PostgreSQL dialect either (the schema's partial
#: indexes get their PostgreSQL options only once that dialect is in use).
NOT_ON_SQLITE_READ = ("sqlalchemy.dialects.postgresql",)

_PROBE = """
import json, sys
from outbox.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""

READS = [
    ["status"],
    ["status", "--check", "--max-unresolved", "5", "--no-dispatcher-check"],
    ["show", "op-1"],
    ["reconcile", "list"],
    ["reconcile", "show", "op-1", "--json"],
]


def _loaded_after(args: list[str]) -> tuple[object, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    report = json.loads(result.stderr.strip().splitlines()[-1])
    return report["code"], report["modules"]


@pytest.mark.parametrize("args", READS, ids=" ".join)
def test_read_commands_import_neither_the_dispatcher_nor_the_migrations(
    db_url: str, args: list[str]
) -> None:
    endpoint = Endpoint(name="api", base_url="http://127.0.0.1:9")
    with Outbox(db_url, endpoints=[endpoint]) as ob:
        ob.enqueue(endpoint="api", method="POST", path="/x", json={}, operation_id="op-1")
    code, modules = _loaded_after([*args, "--db", db_url])
    assert code == 0
    assert "outbox.reconcile" in modules  # it did run the command
    forbidden = NOT_ON_READ + (NOT_ON_SQLITE_READ if db_url.startswith("sqlite") else ())
    loaded = sorted(m for m in modules if m.startswith(forbidden))
    assert loaded == [], f"outbox {' '.join(args)} imported {loaded}"


def test_the_probe_sees_what_a_dispatching_command_imports(sqlite_url: str) -> None:
    # The same probe on a command that does need the stack: the assertion above can fail.
    code, modules = _loaded_after(["--db", sqlite_url, "migrate"])
    assert code == 0
    assert "alembic" in modules


def _entry(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
        **kw,  # type: ignore[arg-type]
    )


def test_the_process_entry_ends_a_read_with_its_output_and_exit_code(
    tmp_path: Path, db_url: str
) -> None:
    """``python -m outbox`` (the installed script's entry) ends a read command without the
    interpreter's teardown: the output must still be all there, the exit code kept."""
    with Outbox(db_url, endpoints=[Endpoint(name="api", base_url="http://127.0.0.1:9")]) as ob:
        for n in range(30):
            ob.enqueue(endpoint="api", method="POST", path="/x", json={}, operation_id=f"op-{n}")
    shown = _entry(["--db", db_url, "show", "op-7", "--json"])
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["operation_id"] == "op-7"
    listed = _entry(["--db", db_url, "status", "--json"])
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["counts"]["pending"] == 30
    missing = _entry(["--db", f"sqlite:///{tmp_path / 'nope.sqlite3'}", "status"])
    assert missing.returncode == 3
    assert missing.stdout == "" and len(missing.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "nope.sqlite3").exists()
    usage = _entry(["--db", db_url, "show"])
    assert usage.returncode == 2


def test_the_installed_script_is_the_process_entry() -> None:
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="outbox")
    assert script.value == "outbox.__main__:main"
