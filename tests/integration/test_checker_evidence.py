"""The checker never PASSes what its probes cannot observe (issue 24).

A receiver that runs the handler on every request and still answers each duplicate with
the first stored response makes one effect per probe while every answer looks like a
replay. It is served here over 127.0.0.1 by a small HTTP server that counts its effects
where they happen; without a way for the checker to count them, the effect-counting
verdicts must say "not observed", never PASS, and each verdict says what it rests on.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner

from outbox import Endpoint, Outbox
from outbox.checker import CHECKS, check_receiver
from outbox.cli import main

EFFECT_COUNTING = ("same_key_same_result", "concurrent_duplicates", "key_retained")


class ReplayingButApplying:
    """Applies every request; answers each with the first response stored for its key
    (a changed payload: 422), echoing the caller's X-Request-ID."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.effects: list[tuple[str, bytes]] = []
        self.stored: dict[str, tuple[bytes, bytes]] = {}  # key -> (payload, answer)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                key = self.headers.get("Idempotency-Key") or ""
                with owner.lock:
                    owner.effects.append((key, body))  # the handler ran: an effect
                    effect_id = len(owner.effects)
                    payload, answer = owner.stored.setdefault(
                        key, (body, json.dumps({"effect_id": effect_id}).encode())
                    )
                status = 201 if payload == body else 422
                if status == 422:
                    answer = b'{"error": "idempotency_key_reused"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.send_header("X-Request-ID", self.headers.get("X-Request-ID") or "")
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def liar() -> Iterator[ReplayingButApplying]:
    rx = ReplayingButApplying()
    yield rx
    rx.close()


def test_answers_that_look_like_replays_are_not_observed_effects(
    tmp_path: Path, liar: ReplayingButApplying
) -> None:
    endpoint = Endpoint(name="rx", base_url=liar.url, timeout=5.0, probe_safe=True)
    with Outbox(f"sqlite:///{tmp_path / 'ob.sqlite3'}", endpoints=[endpoint]) as ob:
        report = check_receiver(ob, endpoint="rx", path="/orders", json_body={"amount": 5},
                                retention_delay=0.2)  # fmt: skip
    # Every probe ran the handler: retention 2, same key 2 + changed 1, new key 1,
    # burst 8 + 1 after: fifteen requests, fifteen effects.
    assert len(liar.effects) == 15
    for name in EFFECT_COUNTING:
        v = report.verdict(name)
        assert (v.passed, v.observed, v.outcome) == (None, False, "not_observed"), v
        assert v.summary.startswith("not observed: ")
        assert "no status_lookup is configured" in v.summary
    # What the answers alone do show is still decided.
    assert report.verdict("new_key_new_operation").passed is True
    assert report.verdict("changed_payload_refused").passed is True
    assert report.verdict("replay_fresh_request_id").passed is True
    assert report.not_observed == list(EFFECT_COUNTING)
    assert not report.decided_nothing and report.exit_code == 0

    # The evidence each verdict rests on, in words and in the JSON.
    same_key = report.verdict("same_key_same_result")
    first = same_key.evidence["first"]["request_id_sent"]
    assert f"first request: request {first} got 201" in same_key.rests_on
    assert "status lookup: none configured, so effects were not counted" in same_key.rests_on
    assert any(line.startswith("compared: the two answers' bodies: equal; results identify")
               for line in same_key.rests_on)  # fmt: skip
    data = json.loads(json.dumps(report.as_dict()))
    assert data["not_observed"] == list(EFFECT_COUNTING)
    by_name = {v["name"]: v for v in data["verdicts"]}
    assert [by_name[n]["outcome"] for n in CHECKS] == [
        "not_observed", "pass", "pass", "pass", "not_observed", "not_observed",
        "could_not_tell",
    ]  # fmt: skip
    assert all(v["rests_on"] for n, v in by_name.items() if n != "tenants_kept_apart")
    text = report.lines()
    line = next(t for t in text if t.startswith("N/O   same_key_same_result "))
    assert line.split(None, 2)[2].startswith("not observed: the same result twice")
    assert any(f"rests on: first request: request {first} got 201" in line for line in text)
    assert "3 passed, 0 failed, 1 could not tell, 3 not observed (N/O)" in text[-2]


def test_cli_strict_fails_a_run_with_unobserved_properties(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, liar: ReplayingButApplying
) -> None:
    module = f"checker_evidence_app_{uuid.uuid4().hex[:8]}"
    db = f"sqlite:///{tmp_path / (module + '.sqlite3')}"
    (tmp_path / f"{module}.py").write_text(
        "from outbox import Endpoint, Outbox\n\n\n"
        "def build() -> Outbox:\n"
        f"    return Outbox({db!r}, endpoints=[Endpoint(name='rx', base_url={liar.url!r},\n"
        "        timeout=5.0, probe_safe=True)])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["check-receiver", "--app", f"{module}:build", "--endpoint", "rx", "--path",
            "/orders", "--json-body", '{"amount": 5}', "--retention-delay", "0.2"]  # fmt: skip
    env: dict[str, str | None] = {"OUTBOX_DATABASE_URL": None, "OUTBOX_APP": None}
    plain = CliRunner().invoke(main, argv, env=env, catch_exceptions=False)
    assert plain.exit_code == 0, plain.output
    assert "N/O   concurrent_duplicates" in plain.stdout
    assert "rests on: status lookup: none configured" in plain.stdout
    strict = CliRunner().invoke(main, [*argv, "--strict", "--json"], env=env,
                                catch_exceptions=False)  # fmt: skip
    assert strict.exit_code == 1
    assert json.loads(strict.stdout)["not_observed"] == list(EFFECT_COUNTING)
