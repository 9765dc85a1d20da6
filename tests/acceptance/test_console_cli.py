"""``outbox console`` as a command: bind checks, credentials, and the real server.

The server tests start the installed command as a subprocess on 127.0.0.1 and speak
HTTP to it (httpx), against a database whose operations reached every state through
real dispatches.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from outbox.cli import main
from outbox.console.auth import TOKEN_ENV, Credentials
from outbox.console.server import check_bind, is_loopback
from outbox.errors import ConfigurationError
from outbox.reconcile import default_operator
from outbox.testing.receiver import Receiver
from tests.acceptance._console_proc import console_process
from tests.integration import _reconcile_states as S
from tests.integration._reconcile_states import LOST, World


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    with (
        Receiver(tmp_path / "receiver.sqlite3") as rx,
        S.every_state_world(World, f"sqlite:///{tmp_path / 'outbox.sqlite3'}", rx) as w,
    ):
        yield w


def run(*args: str, env: dict[str, str | None] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env={TOKEN_ENV: None, **(env or {})})
    return result.exit_code, result.output


def test_help_names_every_option() -> None:
    code, out = run("console", "--help")
    assert code == 0
    for option in ("--host", "--port", "--allow-remote", "--token-file", "--read-only"):
        assert option in out


def test_a_non_loopback_bind_needs_allow_remote_and_a_configured_credential(
    tmp_path: Path,
) -> None:
    db = tmp_path / "o.sqlite3"
    code, out = run("--db", f"sqlite:///{db}", "console", "--host", "0.0.0.0")
    assert code == 2 and "refusing to listen on 0.0.0.0" in out and "--allow-remote" in out
    assert len(out.strip().splitlines()) == 1
    code, out = run("--db", f"sqlite:///{db}", "console", "--host", "0.0.0.0", "--allow-remote")
    assert code == 2 and "without a configured credential" in out
    assert not db.exists()  # refused before the database was opened
    # The rule itself, for every address family.
    creds = Credentials.parse("x" * 20, default_name="ops", source="t")
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        check_bind(host, allow_remote=False, credentials=None)
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.com"):
        assert not is_loopback(host)
        with pytest.raises(ConfigurationError):
            check_bind(host, allow_remote=False, credentials=creds)
        check_bind(host, allow_remote=True, credentials=creds)


def test_bad_credentials_and_missing_databases_are_one_line_usage_errors(tmp_path: Path) -> None:
    db = tmp_path / "absent.sqlite3"
    code, out = run("--db", f"sqlite:///{db}", "console")
    # A missing database is the command line's exit 3 (the database), never created.
    assert code == 3 and "no outbox database at" in out and not db.exists()
    code, out = run("--db", "not a url", "console")
    assert code == 2 and "not a database URL" in out and len(out.strip().splitlines()) == 1
    short = tmp_path / "short"
    short.write_text("alice:tooshort\n")
    code, out = run("--db", f"sqlite:///{db}", "console", "--token-file", str(short))
    assert code == 2 and "at least 16 characters" in out and len(out.strip().splitlines()) == 1
    code, out = run("--db", "sqlite:///x", "console", "--token-file", str(tmp_path / "none"))
    assert code == 2 and "cannot read --token-file" in out
    code, out = run("--db", "sqlite:///x", "console", env={TOKEN_ENV: "   "})
    assert code == 2 and "holds no token" in out


def test_credentials_parse_names_tokens_and_refuse_duplicates() -> None:
    creds = Credentials.parse(
        "# ops\n\nalice:" + "a" * 16 + "\n" + "b" * 16 + "\n", default_name="bob", source="t"
    )
    assert creds.match("a" * 16) == "alice" and creds.match("b" * 16) == "bob"
    assert creds.match("a" * 15) is None and creds.match("") is None
    with pytest.raises(ConfigurationError, match="share a token"):
        Credentials.parse("x:" + "a" * 16 + "\ny:" + "a" * 16, default_name="-", source="t")
    with pytest.raises(ConfigurationError, match="holds no token"):
        Credentials.parse("# nothing\n", default_name="-", source="t")
    generated = Credentials.generate("carol")
    assert generated.generated and len(generated.entries[0].token) >= 40


def test_the_server_prints_a_token_once_and_serves_the_queue_to_its_session(
    world: World,
) -> None:
    with console_process("--db", world.db_url) as console:
        token = console.token()
        assert sum(token in line for line in console.lines) == 1
        with httpx.Client(base_url=console.url, follow_redirects=True) as http:
            assert http.get("/queue").status_code == 401
            r = http.post("/login", data={"token": token, "next": "/queue"})
            assert r.status_code == 200 and str(r.url).endswith("/queue")
            for ref in S.UNRESOLVED:
                assert ref.operation_id in r.text
            # The console listens for loopback names only: a rebound DNS name is refused.
            assert http.get("/queue", headers={"host": "rebound.example"}).status_code == 400
            page = http.get(f"/operation?tenant={LOST.tenant}&id={LOST.operation_id}").text
            csrf = re.search(r'name="csrf" value="([^"]+)"', page)
            version = re.search(r'name="version" value="(\d+)"', page)
            assert csrf and version
            r = http.post(
                "/operation/resolve",
                data={
                    "csrf": csrf.group(1),
                    "tenant": LOST.tenant,
                    "id": LOST.operation_id,
                    "version": version.group(1),
                    "outcome": "succeeded",
                    "note": "found in the receiver's admin",
                },
            )
            assert r.status_code == 200 and "Resolved." in r.text
    [row] = world.audit(LOST.operation_id)
    assert row["note"] == "found in the receiver's admin"
    assert row["actor"] == default_operator()


def test_token_file_and_env_credentials_name_the_actor_and_read_only_changes_nothing(
    world: World, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# operators\ndana:" + "d" * 24 + "\n")
    before = world.rows()
    options = ("--token-file", str(tokens), "--read-only")
    with console_process("--db", world.db_url, options=options) as console:
        assert not any("sign-in token" in line for line in console.lines)
        assert "(read-only)" in console.lines[0]
        with httpx.Client(base_url=console.url, follow_redirects=True) as http:
            r = http.post("/login", data={"token": "d" * 24})
            assert 'signed in as <strong class="me">dana</strong>' in r.text
            page = http.get(f"/operation?tenant={LOST.tenant}&id={LOST.operation_id}").text
            assert 'action="/operation/resolve"' not in page
            csrf = re.search(r'name="csrf" value="([^"]+)"', page)
            assert csrf
            r = http.post(
                "/operation/resolve",
                data={
                    "csrf": csrf.group(1),
                    "tenant": LOST.tenant,
                    "id": LOST.operation_id,
                    "version": "0",
                    "outcome": "succeeded",
                    "note": "x",
                },
            )
            assert r.status_code == 403
    with (
        console_process(
            "--db", world.db_url, options=("--operator", "erin"), env={TOKEN_ENV: "e" * 20}
        ) as console,
        httpx.Client(base_url=console.url, follow_redirects=True) as http,
    ):
        r = http.post("/login", data={"token": "e" * 20})
        assert 'signed in as <strong class="me">erin</strong>' in r.text
    assert world.rows() == before
