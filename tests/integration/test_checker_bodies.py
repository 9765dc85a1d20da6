"""check-receiver probes a form or raw API in the body form it reads (issue 24).

Against the real test receiver over 127.0.0.1: its Stripe-shaped dialect reads forms; the
bytes the probes carried are read back from the receiver's own store (effects, request
log), never from the answers.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner, Result

from outbox import Endpoint, Outbox
from outbox.checker import check_receiver
from outbox.cli import main
from outbox.config import StatusLookup
from outbox.errors import ValidationError
from outbox.testing.receiver import Receiver

CHARGE = {"amount": "2000", "currency": "eur", "metadata": {"order": "17"}}
CHARGE_FORM = b"amount=2000&currency=eur&metadata%5Border%5D=17"
XML = b'<?xml version="1.0"?><charge><amount>2000</amount><currency>eur</currency></charge>'
DECIDED = (
    "same_key_same_result",
    "changed_payload_refused",
    "new_key_new_operation",
    "replay_fresh_request_id",
    "concurrent_duplicates",
    "key_retained",
)


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def stripe(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "stripe.sqlite3", dialect="stripe-like") as rx:
        yield rx


def _outbox(tmp_path: Path, rx: Receiver) -> Outbox:
    endpoint = Endpoint(
        name="stripe", base_url=rx.url, timeout=5.0, probe_safe=True,
        status_lookup=StatusLookup(),
    )  # fmt: skip
    return Outbox(
        f"sqlite:///{tmp_path / f'outbox-{uuid.uuid4().hex[:8]}.sqlite3'}", endpoints=[endpoint]
    )


def _sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def test_a_form_api_is_probed_with_form_fields(tmp_path: Path, stripe: Receiver) -> None:
    with _outbox(tmp_path, stripe) as ob:
        report = check_receiver(
            ob, endpoint="stripe", path="/v1/charges", data=CHARGE, form_style="stripe",
            retention_delay=0.3,
        )  # fmt: skip
    assert (report.body_kind, report.content_type) == ("form", "application/x-www-form-urlencoded")
    for name in DECIDED:
        assert report.verdict(name).passed is True, report.verdict(name)
    changed = report.verdict("changed_payload_refused")
    assert changed.evidence["change"] == "amount: 2000 -> 2001"
    assert changed.evidence["changed"]["status"] == 400  # Stripe's idempotency_error
    # What the receiver got: the form bytes, read as fields, one effect per probe key.
    effects = stripe.effects()
    assert {e.body for e in effects} == {CHARGE_FORM.decode()}
    assert {e.body_sha256 for e in effects} == {_sha(CHARGE_FORM)}
    conflict = [r for r in stripe.requests() if r.outcome == "conflict"]
    assert [r.body_sha256 for r in conflict] == [_sha(CHARGE_FORM.replace(b"2000", b"2001"))]
    assert "form body (application/x-www-form-urlencoded)" in report.lines()[0]


def test_a_raw_api_is_probed_with_its_bytes_and_content_type(
    tmp_path: Path, stripe: Receiver
) -> None:
    with _outbox(tmp_path, stripe) as ob:
        report = check_receiver(
            ob, endpoint="stripe", path="/v1/charges", content=XML,
            content_type="application/xml", retention_delay=0.3,
        )  # fmt: skip
    assert (report.body_kind, report.content_type) == ("raw", "application/xml")
    assert report.verdict("changed_payload_refused").passed is True
    assert report.verdict("changed_payload_refused").evidence["change"].endswith("2000 -> 2001")
    assert {e.body for e in stripe.effects()} == {XML.decode()}


def test_a_probe_body_is_validated_as_enqueue_would_and_nothing_is_sent(
    tmp_path: Path, stripe: Receiver
) -> None:
    bad: list[dict[str, Any]] = [
        {},
        {"json_body": {"a": 1}, "data": {"a": "1"}},
        {"content": XML},  # no content type
        {"data": {"amount": "1", "api_key": "sk_test_abcdefghijkl"}},  # a credential
        {"data": {"amount": "1"}, "form_style": "nested"},
    ]
    with _outbox(tmp_path, stripe) as ob:
        for kwargs in bad:
            with pytest.raises(ValidationError):
                check_receiver(ob, endpoint="stripe", path="/v1/charges", **kwargs)
    assert stripe.requests() == []


def _app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rx: Receiver) -> str:
    module = f"checker_bodies_app_{uuid.uuid4().hex[:8]}"
    db = f"sqlite:///{tmp_path / (module + '.sqlite3')}"
    (tmp_path / f"{module}.py").write_text(
        "from outbox import Endpoint, Outbox\n\n\n"
        "def build() -> Outbox:\n"
        f"    return Outbox({db!r}, endpoints=[Endpoint(name='stripe',\n"
        f"        base_url={rx.url!r}, timeout=5.0, probe_safe=True)])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{module}:build"


def _cli(app: str, *args: str) -> Result:
    env: dict[str, str | None] = {"OUTBOX_DATABASE_URL": None, "OUTBOX_APP": None}
    argv = ["check-receiver", "--app", app, "--endpoint", "stripe", "--path", "/v1/charges",
            "--retention-delay", "0.3", *args]  # fmt: skip
    return CliRunner().invoke(main, argv, env=env, catch_exceptions=False)


def test_cli_form_body_and_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stripe: Receiver
) -> None:
    app = _app(tmp_path, monkeypatch, stripe)
    # name=value pairs, in the given order.
    result = _cli(app, "--form-body", "currency=eur&amount=2000", "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    data = json.loads(result.stdout)
    assert data["body_kind"] == "form"
    assert {e.body for e in stripe.effects()} == {"currency=eur&amount=2000"}
    # A JSON object in Stripe's bracket convention.
    result = _cli(app, "--form-body", json.dumps(CHARGE), "--form-style", "stripe")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert "form body (application/x-www-form-urlencoded)" in result.stdout
    assert CHARGE_FORM.decode() in {e.body for e in stripe.effects()}
    # Raw bytes from a file.
    (tmp_path / "charge.xml").write_bytes(XML)
    result = _cli(app, "--content", f"@{tmp_path / 'charge.xml'}",
                  "--content-type", "application/xml", "--json")  # fmt: skip
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert json.loads(result.stdout)["content_type"] == "application/xml"
    assert XML.decode() in {e.body for e in stripe.effects()}


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--json-body", "{}", "--form-body", "a=1"),
        ("--content", "<x/>"),
        ("--content-type", "application/xml", "--form-body", "a=1"),
        ("--form-body", "a=1&&"),
        ("--form-body", "[1, 2]"),
        ("--content", "@/nonexistent/charge.xml", "--content-type", "application/xml"),
        ("--form-body", "amount=1&password=hunter2"),
    ],
)
def test_cli_probe_body_usage_errors_exit_2_and_send_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stripe: Receiver, args: tuple[str, ...]
) -> None:
    result = _cli(_app(tmp_path, monkeypatch, stripe), *args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert stripe.requests() == []
