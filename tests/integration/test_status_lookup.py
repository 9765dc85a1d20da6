"""Settling unresolved operations by asking the receiver, on SQLite and PostgreSQL.

Operations reach the reconciliation queue through real dispatches against a real
receiver (hung connections after commit, refusals, 5xx before work); time is a
FakeClock. The receiver's own tables are the oracle for effects.
"""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from click.testing import CliRunner, Result
from prometheus_client import CollectorRegistry
from tenacity import wait_fixed

from outbox import Endpoint, FakeClock, Outbox, Reason, RetryPolicy, State
from outbox.cli import main
from outbox.config import StatusLookup
from outbox.errors import ConfigurationError, OperatorActionRefused
from outbox.model import LookupResult, LookupStatus
from outbox.reconcile.probe import ACTOR, ProbeAction, probe, probe_all
from outbox.testing.receiver import Receiver
from outbox.wire.lookup import lookup_status
from outbox.wire.transport import build_client
from tests.security.support import EchoServer

MakeOutbox = Callable[..., Outbox]
RETENTION = timedelta(seconds=60)


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


def _endpoint(url: str, **overrides: Any) -> Endpoint:
    options: dict[str, Any] = {
        "name": "rx",
        "base_url": url,
        # Generous: a busy machine must not turn a prompt answer into a timeout; the
        # hanging cases cost 2 x timeout each.
        "timeout": 2.0,
        "retry": RetryPolicy(max_attempts=2, window=timedelta(seconds=5), wait=wait_fixed(0.5)),
        "key_retention": RETENTION,
        # These tests drive the explicit probe; the dispatcher's own lookup is tested below.
        "status_lookup": StatusLookup(on_unresolved=False),
        # A 503 must make an operation unresolved here: outside the fleet's throttle
        # (under it a 503 is bounded by deliver_within, not by max_attempts).
        "throttle": None,
    }
    options.update(overrides)
    return Endpoint(**options)


@pytest.fixture
def make_ob(db_url: str, receiver: Receiver) -> Iterator[MakeOutbox]:
    made: list[Outbox] = []

    def make(**overrides: Any) -> Outbox:
        ob = Outbox(db_url, endpoints=[_endpoint(receiver.url, **overrides)], clock=FakeClock())
        made.append(ob)
        return ob

    yield make
    for ob in made:
        ob.close()


def _clock(ob: Outbox) -> FakeClock:
    assert isinstance(ob.clock, FakeClock)
    return ob.clock


def _enqueue(ob: Outbox, op_id: str) -> None:
    ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"op": op_id},
               operation_id=op_id)  # fmt: skip


def _until_unresolved(ob: Outbox, op_id: str, rounds: int = 6) -> None:
    for _ in range(rounds):
        ob.dispatch_once()
        if ob.get(op_id).state is State.UNRESOLVED:
            return
        _clock(ob).advance(1)
    raise AssertionError(f"{op_id} is {ob.get(op_id).state}, not unresolved")


def _audit(ob: Outbox, op_id: str) -> list[Any]:
    return ob.store.audit_trail("", op_id)


def test_applied_operation_is_resolved_succeeded_with_the_receivers_result(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob()
    receiver.faults.hang_after_commit(key="op-applied", replays=True)
    _enqueue(ob, "op-applied")
    _until_unresolved(ob, "op-applied")
    op = ob.get("op-applied")
    assert op.reason is Reason.OUTCOME_UNKNOWN
    assert receiver.effect_count(key="op-applied") == 1

    outcome = probe(ob, "op-applied")
    assert outcome.action is ProbeAction.RESOLVED
    assert outcome.lookup is not None and outcome.lookup.status is LookupStatus.APPLIED
    op = ob.get("op-applied")
    assert op.state is State.SUCCEEDED
    last = _audit(ob, "op-applied")[-1]
    assert (last.actor, last.action, last.from_state, last.to_state) == (
        ACTOR,
        "resolve",
        "unresolved",
        "succeeded",
    )
    result = last.details["receiver_result"]
    assert result["status"] == 201
    assert result["body"]["key"] == "op-applied"
    assert result["body"]["received"] == {"op": "op-applied"}
    assert last.details["status_lookup"]["http_status"] == 200
    assert last.details["status_lookup"]["path"] == "/operations/op-applied"
    assert receiver.effect_count(key="op-applied") == 1
    # The lookup itself is no operation: the receiver logged it without a key.
    lookups = [r for r in receiver.requests() if r.outcome == "lookup"]
    assert [(r.method, r.path, r.key, r.status) for r in lookups] == [
        ("GET", "/operations/op-applied", None, 200)
    ]


@pytest.mark.parametrize("fault", ["refused_503", "lost_500"])
def test_not_applied_is_requeued_and_sent_again_under_the_same_key(
    make_ob: MakeOutbox, receiver: Receiver, fault: str
) -> None:
    ob = make_ob()
    status = 503 if fault == "refused_503" else 500
    receiver.faults.fail_before_work(status, retry_after=None, key="op-x")
    _enqueue(ob, "op-x")
    _until_unresolved(ob, "op-x")
    op = ob.get("op-x")
    expected = Reason.RETRIES_EXHAUSTED if status == 503 else Reason.OUTCOME_UNKNOWN
    assert op.reason is expected
    assert receiver.effect_count(key="op-x") == 0
    receiver.faults.clear()

    outcome = probe(ob, "op-x")
    assert outcome.action is ProbeAction.REQUEUED
    assert outcome.state is State.PENDING
    last = _audit(ob, "op-x")[-1]
    assert (last.actor, last.action, last.to_state) == (ACTOR, "requeue", "pending")
    assert "404" in last.note and "same operation ID" in last.note

    ob.dispatch_once()
    op = ob.get("op-x")
    assert op.state is State.SUCCEEDED
    assert receiver.effect_count(key="op-x") == 1
    sent = receiver.requests(key="op-x")
    assert len(sent) == op.attempts_total == 3
    assert len({r.request_id for r in sent}) == 3
    assert probe_all(ob) == []  # nothing left to probe


@pytest.mark.parametrize("when", ["past_retention", "inside_safety_margin"])
def test_after_key_retention_not_applied_is_left_unresolved_with_evidence(
    make_ob: MakeOutbox, receiver: Receiver, when: str
) -> None:
    ob = make_ob()
    receiver.faults.fail_before_work(503, retry_after=None, key="op-old")
    _enqueue(ob, "op-old")
    _until_unresolved(ob, "op-old")
    receiver.faults.clear()
    first = ob.get("op-old").first_attempt_at_ms
    assert first is not None
    # Inside the margin the receiver still knows the key, but the dispatcher would no
    # longer send under it: a requeue would bounce straight back to unresolved.
    after = RETENTION.total_seconds() + 1 if when == "past_retention" else 57
    _clock(ob).advance(after - (_clock(ob).now_ms() - first) / 1000)
    before = len(receiver.requests(key="op-old"))

    outcome = probe(ob, "op-old")
    assert outcome.action is ProbeAction.EVIDENCE_RECORDED
    assert "requeue explicitly" in outcome.detail
    op = ob.get("op-old")
    assert op.state is State.UNRESOLVED and op.reason is Reason.RETRIES_EXHAUSTED
    trail = _audit(ob, "op-old")
    assert len(trail) == 1
    row = trail[0]
    assert (row.actor, row.action, row.from_state, row.to_state) == (
        ACTOR,
        "lookup",
        "unresolved",
        "unresolved",
    )
    assert "never applied" in row.note and "requeue explicitly" in row.note
    assert row.details["status_lookup"]["http_status"] == 404
    assert row.details["status_lookup"]["status"] == "not_applied"
    # Probing again adds no duplicate evidence, and nothing is ever sent on its own.
    probe(ob, "op-old")
    assert len(_audit(ob, "op-old")) == 1
    _clock(ob).advance(60)
    assert ob.dispatch_once().claimed == 0
    assert len(receiver.requests(key="op-old")) == before


def test_unknown_answer_leaves_the_operation_for_the_operator(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob()
    receiver.faults.fail_before_work(503, retry_after=None, key="op-busy")
    _enqueue(ob, "op-busy")
    _until_unresolved(ob, "op-busy")
    receiver.faults.clear()
    receiver.faults.stuck_in_progress("op-busy")  # the lookup answers 409 processing

    outcome = probe(ob, "op-busy")
    assert outcome.action is ProbeAction.LEFT_FOR_OPERATOR
    assert outcome.lookup is not None and outcome.lookup.http_status == 409
    assert ob.get("op-busy").state is State.UNRESOLVED
    assert _audit(ob, "op-busy") == []


def test_probe_all_settles_each_by_its_answer(make_ob: MakeOutbox, receiver: Receiver) -> None:
    ob = make_ob()
    receiver.faults.hang_after_commit(key="all-applied", replays=True)
    receiver.faults.fail_before_work(503, retry_after=None, key="all-refused")
    for op_id in ("all-applied", "all-refused"):
        _enqueue(ob, op_id)
    _until_unresolved(ob, "all-applied")
    _until_unresolved(ob, "all-refused")
    receiver.faults.clear()

    outcomes = {o.operation_id: o for o in probe_all(ob)}
    assert outcomes["all-applied"].action is ProbeAction.RESOLVED
    assert outcomes["all-refused"].action is ProbeAction.REQUEUED
    assert ob.get("all-applied").state is State.SUCCEEDED
    ob.dispatch_once()
    assert ob.get("all-refused").state is State.SUCCEEDED
    assert receiver.effect_count(key="all-applied") == 1
    assert receiver.effect_count(key="all-refused") == 1


def test_probe_refuses_what_it_cannot_settle(
    make_ob: MakeOutbox, receiver: Receiver, db_url: str
) -> None:
    ob = make_ob()
    _enqueue(ob, "op-pending")
    with pytest.raises(OperatorActionRefused, match="not unresolved"):
        probe(ob, "op-pending")
    receiver.faults.fail_before_work(503, retry_after=None, key="op-pending")
    _until_unresolved(ob, "op-pending")
    bare = Outbox(db_url, endpoints=[_endpoint(receiver.url, status_lookup=None)],
                  clock=FakeClock())  # fmt: skip
    try:
        with pytest.raises(ConfigurationError, match="no status_lookup"):
            probe(bare, "op-pending")
        [skipped] = probe_all(bare)
        assert skipped.action is ProbeAction.SKIPPED
        assert "no status_lookup" in skipped.detail
    finally:
        bare.close()
    assert ob.get("op-pending").state is State.UNRESOLVED


# -- the lookup itself -------------------------------------------------------------------------
# (The default classifier and the route's validation are pure: tests/unit.)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends


def test_lookup_status_never_raises_and_sends_the_endpoints_headers() -> None:
    with EchoServer(lambda method, path, headers: (404, b'{"state": "unknown_key"}')) as server:
        asyncio.run(_lookup_status_checks(server))


async def _lookup_status_checks(server: EchoServer) -> None:
    def broken(response: httpx.Response) -> LookupResult:
        raise RuntimeError("bad classifier")

    endpoint = _endpoint(
        f"{server.url}/api",
        tenant_header="X-Tenant",
        headers={"X-Static": "1"},
        auth=lambda: {"Authorization": "Bearer s3cret"},
    )
    # The endpoint's own client, on the transport the dispatcher would choose.
    async with build_client(endpoint, None) as client:
        result = await lookup_status(client, endpoint, "op-1", "acme")
        assert result.status is LookupStatus.NOT_APPLIED
        assert (result.method, result.path, result.http_status) == ("GET", "/operations/op-1", 404)
        assert result.body == '{"state": "unknown_key"}'
        # What arrived at the receiver, as it read it off the socket.
        method, path, headers = server.received[-1]
        assert (method, path) == ("GET", "/api/operations/op-1")
        assert headers["x-tenant"] == "acme"
        assert headers["x-static"] == "1"
        assert headers["authorization"] == "Bearer s3cret"
        assert headers["x-request-id"] == result.request_id
        assert "idempotency-key" not in headers

        odd = _endpoint(endpoint.base_url, status_lookup=StatusLookup(classify=broken))
        result = await lookup_status(client, odd, "op-1", "")
        assert result.status is LookupStatus.UNKNOWN and "bad classifier" in (result.error or "")

        asked = len(server.received)
        none = _endpoint(endpoint.base_url, status_lookup=None)
        assert (await lookup_status(client, none, "op-1", "")).status is LookupStatus.UNKNOWN
        assert len(server.received) == asked  # nothing sent without a status_lookup

    # No receiver at all: a closed local port is an UNKNOWN with the error, not a raise.
    down = _endpoint(f"http://127.0.0.1:{_closed_port()}")
    async with build_client(down, None) as client:
        failing = await lookup_status(client, down, "op-1", "")
    assert failing.status is LookupStatus.UNKNOWN and failing.error
    assert failing.http_status is None


# -- command line ----------------------------------------------------------------------------


def _app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db_url: str, url: str) -> str:
    name = f"probe_app_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(
        "from datetime import timedelta\n"
        "from outbox import Endpoint, FakeClock, Outbox, RetryPolicy\n"
        "from outbox.config import StatusLookup\n\n\n"
        "def build() -> Outbox:\n"
        f"    endpoint = Endpoint(name='rx', base_url={url!r}, timeout=2.0,\n"
        "        retry=RetryPolicy(max_attempts=2, window=timedelta(seconds=5)),\n"
        f"        key_retention=timedelta(seconds={RETENTION.total_seconds()}),\n"
        "        status_lookup=StatusLookup(), throttle=None)\n"
        f"    return Outbox({db_url!r}, endpoints=[endpoint], clock=FakeClock())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:build"


def _cli(app: str, *args: str) -> Result:
    env: dict[str, str | None] = dict.fromkeys(("OUTBOX_DATABASE_URL", "OUTBOX_DB", "OUTBOX_APP"))
    return CliRunner().invoke(main, ["--app", app, *args], env=env, catch_exceptions=False)


def test_cli_reconcile_probe_one_and_all(
    make_ob: MakeOutbox,
    receiver: Receiver,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ob = make_ob()
    receiver.faults.hang_after_commit(key="cli-applied", replays=True)
    receiver.faults.fail_before_work(503, retry_after=None, key="cli-refused")
    for op_id in ("cli-applied", "cli-refused"):
        _enqueue(ob, op_id)
    _until_unresolved(ob, "cli-applied")
    _until_unresolved(ob, "cli-refused")
    receiver.faults.clear()
    app = _app(tmp_path, monkeypatch, db_url, receiver.url)

    result = _cli(app, "reconcile", "probe", "cli-applied")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert "resolved_succeeded" in result.stdout
    assert ob.get("cli-applied").state is State.SUCCEEDED

    result = _cli(app, "reconcile", "probe", "cli-applied")  # no longer unresolved
    assert result.exit_code == 1
    assert "not unresolved" in result.stderr

    # The filters of the bulk actions: a reason nothing has matches nothing.
    result = _cli(app, "reconcile", "probe", "--all", "--reason", "outcome_unknown", "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert json.loads(result.stdout) == []
    assert ob.get("cli-refused").state is State.UNRESOLVED

    result = _cli(app, "reconcile", "probe", "--all", "--reason", "retries_exhausted", "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    [outcome] = json.loads(result.stdout)
    assert outcome["operation_id"] == "cli-refused"
    assert outcome["action"] == "requeued"
    assert outcome["lookup"]["http_status"] == 404
    assert ob.get("cli-refused").state is State.PENDING

    assert _cli(app, "reconcile", "probe").exit_code == 2
    assert _cli(app, "reconcile", "probe", "cli-refused", "--all").exit_code == 2


def test_dispatcher_looks_up_an_operation_as_it_becomes_unresolved(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob(status_lookup=StatusLookup())
    registry = CollectorRegistry()
    ob.metrics(registry=registry)
    receiver.faults.hang_after_commit(key="auto-applied", replays=True)
    receiver.faults.fail_before_work(503, retry_after=None, key="auto-refused")
    _enqueue(ob, "auto-applied")
    _enqueue(ob, "auto-refused")
    for _ in range(8):
        ob.dispatch_once()
        _clock(ob).advance(1)
    applied = ob.get("auto-applied")
    assert applied.state is State.SUCCEEDED  # settled by the dispatcher's lookup
    last = _audit(ob, "auto-applied")[-1]
    assert (last.actor, last.action, last.to_state) == (ACTOR, "resolve", "succeeded")
    assert last.details["receiver_result"]["status"] == 201
    assert receiver.effect_count(key="auto-applied") == 1
    refused = ob.get("auto-refused")
    assert (refused.state, refused.reason) == (State.UNRESOLVED, Reason.RETRIES_EXHAUSTED)
    evidence = _audit(ob, "auto-refused")
    assert [(e.actor, e.action) for e in evidence] == [(ACTOR, "lookup")]
    assert "never applied" in evidence[0].note
    assert receiver.effect_count(key="auto-refused") == 0
    # One lookup each, counted by answer.
    answers = {
        answer: registry.get_sample_value(
            "outbox_status_lookups_total", {"endpoint": "rx", "answer": answer}
        )
        for answer in ("applied", "not_applied", "unknown")
    }
    assert answers == {"applied": 1.0, "not_applied": 1.0, "unknown": None}
