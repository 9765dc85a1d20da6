"""The receiver conformance checker against the real test receiver, correct and flawed.

Every check runs over 127.0.0.1 against ``outbox.testing.Receiver``; the flawed modes
each break one property, and the checker must name exactly that one. Effects are
counted in the receiver's own SQLite file, never from responses.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner, Result

from outbox import Endpoint, Outbox
from outbox.checker import (
    CHECKS,
    NOTICE,
    PROBE_PREFIX,
    CheckReport,
    UnsafeProbeRefused,
    changed_payload,
    check_receiver,
)
from outbox.cli import main
from outbox.config import StatusLookup
from outbox.errors import ConfigurationError, ValidationError
from outbox.testing.receiver import Receiver

BODY = {"sku": "TEST-BOLT", "quantity": 2}
DELAY = 1.5


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def _outbox(tmp_path: Path, rx: Receiver, **endpoint: Any) -> Outbox:
    endpoint.setdefault("probe_safe", True)
    if "tenant_scope" not in endpoint:
        endpoint.setdefault("tenant_header", "X-Tenant")
    return Outbox(
        f"sqlite:///{tmp_path / f'outbox-{uuid.uuid4().hex[:8]}.sqlite3'}",
        endpoints=[Endpoint(name="rx", base_url=rx.url, timeout=5.0, **endpoint)],
    )


def _check(tmp_path: Path, rx: Receiver, strict: bool = False, **endpoint: Any) -> CheckReport:
    with _outbox(tmp_path, rx, **endpoint) as ob:
        return check_receiver(
            ob, endpoint="rx", path="/orders", json_body=BODY, retention_delay=DELAY,
            strict=strict,
        )  # fmt: skip


def _failed(report: CheckReport) -> set[str]:
    return {v.name for v in report.verdicts if v.passed is False}


@pytest.mark.parametrize("lookup", [True, False], ids=["status_lookup", "no_lookup"])
def test_a_correct_receiver_passes_every_check(tmp_path: Path, lookup: bool) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as rx:
        report = _check(tmp_path, rx, status_lookup=StatusLookup() if lookup else None)
        assert [v.name for v in report.verdicts] == list(CHECKS)
        # Without a status lookup the checker cannot count effects: what rests on
        # counting them is "not observed", never PASS (issue 24).
        unseen = set() if lookup else {
            "same_key_same_result", "concurrent_duplicates", "key_retained"}  # fmt: skip
        assert {v.name for v in report.verdicts if not v.observed} == unseen, report.lines()
        assert all(v.passed is True for v in report.verdicts if v.name not in unseen)
        assert report.ok and report.exit_code == 0
        # One effect per probe key (and tenant), however often it was sent: the
        # receiver's own count.
        assert len(report.probe_keys) == 5
        assert all(k.startswith(PROBE_PREFIX) for k in report.probe_keys)
        for key in report.probe_keys[:-1]:
            assert rx.effect_count(key=key) == 1
        tenants_key = report.probe_keys[-1]
        assert sorted(e.tenant for e in rx.effects(key=tenants_key)) == [
            "outbox-probe-tenant-a", "outbox-probe-tenant-b"]  # fmt: skip
        same_key = report.verdict("same_key_same_result")
        if lookup:
            assert "status lookup holds one applied operation" in same_key.summary
        else:
            assert same_key.summary.startswith("not observed: the same result twice")
        changed = report.verdict("changed_payload_refused")
        assert "422" in changed.summary
        assert changed.evidence["changed"]["status"] == 422
        assert changed.evidence["outbox_classifies_as"] == "key_conflict"
        # Evidence carries what was sent and what came back.
        replay = report.verdict("replay_fresh_request_id").evidence
        assert replay["replay_echoed"] == replay["replay_sent"] != replay["first_sent"]
        burst = report.verdict("concurrent_duplicates").evidence
        assert burst["requests"] == 8 and burst["distinct_results"] == 1
        lines = report.lines()
        rests_on = sum(len(v.rests_on) for v in report.verdicts)
        assert len(lines) == len(CHECKS) + rests_on + 3
        assert lines[-1] == f"NOTE: {NOTICE}"
        assert "proves nothing about production" in NOTICE
        assert json.loads(json.dumps(report.as_dict()))["ok"] is True


@pytest.mark.parametrize(
    ("flaw", "ttl", "failing"),
    [
        (
            "ignores_key",
            None,
            {
                "same_key_same_result",
                "changed_payload_refused",
                "concurrent_duplicates",
                "key_retained",
            },
        ),
        ("caches_request_id", None, {"replay_fresh_request_id"}),
        ("accepts_changed_payload", None, {"changed_payload_refused"}),
        ("forgets_keys_after", 0.75, {"key_retained"}),
    ],
)
@pytest.mark.parametrize("lookup", [True, False], ids=["status_lookup", "no_lookup"])
def test_each_flawed_receiver_fails_exactly_its_check(
    tmp_path: Path, flaw: Any, ttl: float | None, failing: set[str], lookup: bool
) -> None:
    with Receiver(tmp_path / "rx.sqlite3", flaw=flaw, key_ttl_seconds=ttl) as rx:
        report = _check(tmp_path, rx, status_lookup=StatusLookup() if lookup else None)
    assert _failed(report) == failing, report.lines()
    assert report.exit_code == 1
    for name in failing:
        assert report.verdict(name).summary
    text = "\n".join(report.lines())
    for name in failing:
        assert f"FAIL  {name}" in text


def test_flaw_summaries_say_what_is_wrong(tmp_path: Path) -> None:
    with Receiver(tmp_path / "a.sqlite3", flaw="ignores_key") as rx:
        report = _check(tmp_path, rx)
    assert "applied as a new operation" in report.verdict("same_key_same_result").summary
    assert report.verdict("replay_fresh_request_id").passed is None  # nothing was replayed
    burst = report.verdict("concurrent_duplicates")
    assert "duplicates were applied" in burst.summary
    assert burst.evidence["distinct_results"] == 8

    with Receiver(tmp_path / "b.sqlite3", flaw="caches_request_id") as rx:
        report = _check(tmp_path, rx)
    verdict = report.verdict("replay_fresh_request_id")
    assert "ORIGINAL" in verdict.summary
    assert verdict.evidence["replay_echoed"] == verdict.evidence["first_sent"]

    with Receiver(tmp_path / "c.sqlite3", flaw="accepts_changed_payload") as rx:
        report = _check(tmp_path, rx)
    verdict = report.verdict("changed_payload_refused")
    assert "silently dropped" in verdict.summary
    assert verdict.evidence["changed"]["status"] == 201
    assert verdict.evidence["change"] == "quantity: 2 -> 3"

    with Receiver(tmp_path / "d.sqlite3", flaw="forgets_keys_after", key_ttl_seconds=0.75) as rx:
        report = _check(tmp_path, rx, status_lookup=StatusLookup())
        key = report.probe_keys[-1]
        assert rx.effect_count(key=key) == 2  # the oracle agrees: applied twice
    verdict = report.verdict("key_retained")
    assert "forgot the key" in verdict.summary
    assert verdict.evidence["status_lookup_before_resend"]["status"] == "not_applied"


def test_results_that_do_not_identify_effects_are_reported_as_undecided(
    tmp_path: Path,
) -> None:
    def handler(conn: Any, tenant: str, method: str, path: str, body: Any) -> tuple[int, Any]:
        return 200, {"ok": True}  # every operation answers the same

    with Receiver(tmp_path / "rx.sqlite3", handler=handler) as rx:
        report = _check(tmp_path, rx)
        undecided = set(report.undecided)
        assert {"same_key_same_result", "new_key_new_operation"} <= undecided
        assert "results do not identify effects" in report.verdict("same_key_same_result").summary
        assert report.failed == []
        assert report.exit_code == 0  # nothing failed; the lines say what is unknown
        # With a status lookup the same receiver can be judged, but for its tenants: the
        # lookup cannot tell one tenant's record from the other's.
        report = _check(tmp_path, rx, status_lookup=StatusLookup())
        assert report.undecided == ["tenants_kept_apart"], report.lines()
        assert report.failed == []


def test_an_ignoring_receiver_with_equal_results_is_caught_by_the_lookup(
    tmp_path: Path,
) -> None:
    def handler(conn: Any, tenant: str, method: str, path: str, body: Any) -> tuple[int, Any]:
        return 200, {"ok": True}

    with Receiver(tmp_path / "rx.sqlite3", handler=handler, flaw="ignores_key") as rx:
        report = _check(tmp_path, rx, status_lookup=StatusLookup())
    assert report.verdict("same_key_same_result").passed is False
    assert "no record of the key" in report.verdict("same_key_same_result").summary
    assert report.verdict("concurrent_duplicates").passed is False


def test_refuses_an_endpoint_not_marked_probe_safe_and_sends_nothing(tmp_path: Path) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as rx, _outbox(tmp_path, rx, probe_safe=False) as ob:
        with pytest.raises(UnsafeProbeRefused, match="probe_safe=True"):
            check_receiver(ob, endpoint="rx", path="/orders", json_body=BODY)
        assert rx.requests() == []
        assert rx.effect_count() == 0
        assert ob.store.state_counts() == {}
        # Explicit consent runs it.
        report = check_receiver(
            ob, endpoint="rx", path="/orders", json_body=BODY, retention_delay=0,
            allow_unsafe=True,
        )  # fmt: skip
        assert report.ok
        assert rx.requests()


def test_bad_arguments_are_refused_before_sending(tmp_path: Path) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as rx, _outbox(tmp_path, rx) as ob:
        with pytest.raises(ConfigurationError, match="unknown endpoint"):
            check_receiver(ob, endpoint="nope", path="/orders", json_body=BODY)
        with pytest.raises(ValidationError):
            check_receiver(ob, endpoint="rx", path="orders", json_body=BODY)
        with pytest.raises(ValidationError):
            check_receiver(ob, endpoint="rx", path="/orders", json_body={"x": float("nan")})
        # A delay that is not a number of seconds, or one that would wait forever.
        for delay in (float("nan"), float("inf"), -1.0, 3601.0):
            with pytest.raises(ValidationError, match="retention delay"):
                check_receiver(
                    ob, endpoint="rx", path="/orders", json_body=BODY, retention_delay=delay
                )
        with pytest.raises(ValidationError, match="tenant must be"):
            check_receiver(ob, endpoint="rx", path="/orders", json_body=BODY, tenant="a\x1b")
        assert rx.requests() == []


def test_a_rejected_probe_says_the_arguments_need_fixing(tmp_path: Path) -> None:
    def handler(conn: Any, tenant: str, method: str, path: str, body: Any) -> tuple[int, Any]:
        from outbox.testing.receiver import Refuse

        raise Refuse(400, {"error": "unknown sku"})

    with Receiver(tmp_path / "rx.sqlite3", handler=handler) as rx:
        report = _check(tmp_path, rx)
    summary = report.verdict("same_key_same_result").summary
    assert report.verdict("same_key_same_result").passed is None
    assert "fix --path" in summary


def test_changed_payload_keeps_the_request_plausible() -> None:
    assert changed_payload({"sku": "A", "quantity": 2}) == (
        {"sku": "A", "quantity": 3},
        "quantity: 2 -> 3",
    )
    assert changed_payload({"sku": "A", "gift": True})[0] == {"sku": "A-changed", "gift": True}
    assert changed_payload({})[0] == {"outbox_probe_variant": "changed"}
    assert changed_payload([1])[0] == [1, "outbox-probe-changed"]
    assert changed_payload(None)[0] == {"value": None, "outbox_probe_variant": "changed"}


# -- command line ----------------------------------------------------------------------------


def _app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rx: Receiver, *, safe: bool) -> str:
    name = f"checker_app_{uuid.uuid4().hex[:10]}"
    db = f"sqlite:///{tmp_path / (name + '.sqlite3')}"
    (tmp_path / f"{name}.py").write_text(
        "from outbox import Endpoint, Outbox\n"
        "from outbox.config import StatusLookup\n\n\n"
        "def build() -> Outbox:\n"
        f"    return Outbox({db!r}, endpoints=[Endpoint(name='rx', base_url={rx.url!r},\n"
        f"        timeout=5.0, probe_safe={safe!r}, status_lookup=StatusLookup(),\n"
        f"        tenant_header='X-Tenant')])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:build"


def _cli(*args: str) -> Result:
    env: dict[str, str | None] = {"OUTBOX_DATABASE_URL": None, "OUTBOX_APP": None}
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def _probe_args(app: str, *extra: str) -> list[str]:
    return [
        "check-receiver", "--app", app, "--endpoint", "rx", "--path", "/orders",
        "--json-body", json.dumps(BODY), "--retention-delay", "0.5", *extra,
    ]  # fmt: skip


def test_cli_check_receiver_passes_a_correct_receiver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as rx:
        app = _app(tmp_path, monkeypatch, rx, safe=True)
        result = _cli(*_probe_args(app))
        assert result.exit_code == 0, (result.stdout, result.stderr)
        lines = result.stdout.splitlines()
        for name in CHECKS:
            assert any(line.startswith(f"PASS  {name}") for line in lines), result.stdout
        assert "proves nothing about production" in result.stdout

        result = _cli(*_probe_args(app, "--json"))
        assert result.exit_code == 0
        data = json.loads(result.stdout)
        assert data["ok"] is True and data["failed"] == []
        assert [v["name"] for v in data["verdicts"]] == list(CHECKS)
        assert {"status", "body", "headers"} <= set(data["verdicts"][0]["evidence"]["first"])
        assert "proves nothing about production" in data["notice"]


def test_cli_check_receiver_exits_1_naming_the_flaw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Receiver(tmp_path / "rx.sqlite3", flaw="accepts_changed_payload") as rx:
        app = _app(tmp_path, monkeypatch, rx, safe=True)
        result = _cli(*_probe_args(app))
    assert result.exit_code == 1, (result.stdout, result.stderr)
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1
    assert fails[0].startswith("FAIL  changed_payload_refused")


def test_cli_check_receiver_refuses_an_unsafe_endpoint_without_consent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as rx:
        app = _app(tmp_path, monkeypatch, rx, safe=False)
        result = _cli(*_probe_args(app))
        assert result.exit_code == 2
        assert "probe_safe=True" in result.stderr
        assert "--i-understand-this-sends-real-requests" in result.stderr
        assert rx.requests() == []
        result = _cli(*_probe_args(app, "--i-understand-this-sends-real-requests"))
        assert result.exit_code == 0, (result.stdout, result.stderr)
        assert rx.requests()


def test_cli_check_receiver_usage_errors_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as rx:
        app = _app(tmp_path, monkeypatch, rx, safe=True)
        bad_json = _probe_args(app)
        bad_json[bad_json.index("--json-body") + 1] = "{not json"
        assert _cli(*bad_json).exit_code == 2
        unknown = _probe_args(app)
        unknown[unknown.index("--endpoint") + 1] = "nope"
        result = _cli(*unknown)
        assert result.exit_code == 2
        assert "unknown endpoint" in result.stderr
        no_app = ["check-receiver", "--endpoint", "rx", "--path", "/x", "--json-body", "{}"]
        assert _cli(*no_app).exit_code == 2
        assert rx.requests() == []


# -- receivers as they really answer ---------------------------------------------------------


def test_tenant_scoping_is_probed_as_declared(tmp_path: Path) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as rx:
        # The receiver scopes by X-Tenant; the endpoint declares another header, which
        # the receiver ignores: both tenants land in one namespace.
        wrong = _check(tmp_path, rx, tenant_header="X-Customer")
        verdict = wrong.verdict("tenants_kept_apart")
        assert verdict.passed is False, wrong.lines()
        assert "one effect for two intents" in verdict.summary
        assert wrong.failed == ["tenants_kept_apart"]
        # The tenant in the key: two keys on the wire, two effects.
        prefixed = _check(tmp_path, rx, tenant_scope="key_prefix")
        assert prefixed.verdict("tenants_kept_apart").passed is True, prefixed.lines()
        key = prefixed.probe_keys[-1]
        assert rx.effect_count(key=f"outbox-probe-tenant-a/{key}") == 1
        assert rx.effect_count(key=f"outbox-probe-tenant-b/{key}") == 1
        # No scope declared: said plainly, and --strict turns it into a failure.
        unscoped = _check(tmp_path, rx, tenant_scope=None, tenant_header=None)
        verdict = unscoped.verdict("tenants_kept_apart")
        assert verdict.passed is None and "declares no tenant scope" in verdict.summary
        assert len(unscoped.probe_keys) == 4  # no tenant probe was sent
        assert unscoped.exit_code == 0
        strict = _check(tmp_path, rx, strict=True, tenant_scope=None, tenant_header=None,
                        status_lookup=StatusLookup())  # fmt: skip
        assert strict.exit_code == 1 and strict.undecided == ["tenants_kept_apart"]


def test_a_replay_answered_409_fails_same_key_same_result(tmp_path: Path) -> None:
    with Receiver(tmp_path / "rx.sqlite3", dialect="replay-409") as rx:
        report = _check(tmp_path, rx)
        verdict = report.verdict("same_key_same_result")
        assert verdict.passed is False, report.lines()
        assert "can never settle" in verdict.summary and "replay_status=409" in verdict.summary
        # Declared, the 409 carrying the stored result is a replay.
        declared = _check(tmp_path, rx, replay_status=409, status_lookup=StatusLookup())
        assert all(v.passed is True for v in declared.verdicts), declared.lines()


@pytest.mark.parametrize("dialect", ["ietf", "article", "stripe-like", "detail"])
def test_each_dialects_changed_payload_answer_is_a_recognised_conflict(
    tmp_path: Path, dialect: str
) -> None:
    with Receiver(tmp_path / "rx.sqlite3", dialect=dialect) as rx:
        report = _check(tmp_path, rx)
    verdict = report.verdict("changed_payload_refused")
    assert verdict.passed is True, report.lines()
    assert verdict.evidence["outbox_classifies_as"] == "key_conflict"


@pytest.mark.parametrize(
    ("status", "body", "reading"),
    [(400, {"error": "bad_request"}, "failed"), (409, {"error": "nope"}, "in_progress")],
)
def test_a_refusal_the_outbox_would_not_read_as_key_conflict_is_not_a_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: int, body: Any, reading: str
) -> None:
    from outbox.testing import dialects

    odd = dialects.Dialect("odd", 409, {"error": "busy"}, status, body)
    monkeypatch.setitem(dialects.DIALECTS, "odd", odd)
    with Receiver(tmp_path / "rx.sqlite3", dialect="odd") as rx:
        report = _check(tmp_path, rx)
    verdict = report.verdict("changed_payload_refused")
    assert verdict.passed is False, report.lines()
    assert verdict.evidence["outbox_classifies_as"] == reading
    assert "not as key_conflict" in verdict.summary or "never key_conflict" in verdict.summary


def test_cli_strict_exits_1_on_an_undecided_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def handler(conn: Any, tenant: str, method: str, path: str, body: Any) -> tuple[int, Any]:
        return 200, {"ok": True}  # results do not identify effects: undecided verdicts

    with Receiver(tmp_path / "rx.sqlite3", handler=handler) as rx:
        name = f"checker_app_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(
            "from outbox import Endpoint, Outbox\n\n\n"
            "def build() -> Outbox:\n"
            f"    return Outbox('sqlite:///{tmp_path / name}.sqlite3', endpoints=[Endpoint(\n"
            f"        name='rx', base_url={rx.url!r}, timeout=5.0, probe_safe=True)])\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        lenient = _cli(*_probe_args(f"{name}:build"))
        assert lenient.exit_code == 0, lenient.stdout
        assert "could not tell" in lenient.stdout
        strict = _cli(*_probe_args(f"{name}:build", "--strict"))
        assert strict.exit_code == 1, strict.stdout
