"""The operator's library API (``Reconciler``) on SQLite and PostgreSQL.

Every operation is brought to its state by a real receiver and real dispatches (see
``_reconcile_states``); refusals are checked against the raw tables, before and after.
"""

from __future__ import annotations

import getpass
import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from outbox import (
    ConcurrentModification,
    Delivery,
    OperationNotFound,
    OperatorActionRefused,
    Outbox,
    Reason,
    State,
    ValidationError,
)
from outbox.reconcile import Reconciler
from outbox.store.tables import operations
from outbox.testing.receiver import Receiver
from tests.integration import _reconcile_states as S
from tests.integration._reconcile_states import (
    ATTEMPT_KEYS,
    AUDIT_KEYS,
    BAD,
    BUSY,
    CANCELLED,
    DARK,
    EVERY,
    LOST,
    OK,
    OPERATION_KEYS,
    REPORT_KEYS,
    RETENTION,
    STATUS_KEYS,
    STUCK,
    UNRESOLVED,
    WAIT,
    Ref,
)

DAY = 86_400.0


class World(S.World):
    @property
    def rec(self) -> Reconciler:
        return self.ob.reconcile

    def other_operator(self) -> Outbox:
        """A second Outbox on the same database, as another operator's process has."""
        return S.make_outbox(self.db_url, self.receiver.url, self.offline_url, self.clock)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def make_world(db_url: str, receiver: Receiver) -> Iterator[Callable[..., World]]:
    with ExitStack() as stack:

        def make(*, in_flight: bool = True, build: bool = True) -> World:
            return stack.enter_context(
                S.every_state_world(World, db_url, receiver, in_flight=in_flight, build=build)
            )

        yield make


@pytest.fixture
def world(make_world: Callable[..., World]) -> World:
    return make_world()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def shared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    """One world per database for the tests that only read (they must not change it)."""
    directory = tmp_path_factory.mktemp(f"reconcile-{request.param}")
    with (
        S.database(request.param, directory) as url,
        Receiver(directory / "receiver.sqlite3") as rx,
        S.every_state_world(World, url, rx) as w,
    ):
        yield w


def _get(w: World, ref: Ref) -> Any:
    return w.ob.get(ref.operation_id, tenant=ref.tenant)


# -- reads ------------------------------------------------------------------------------


def test_status_counts_every_state_backlog_ages_and_attempts(shared: World) -> None:
    world = shared
    report = world.rec.status()
    assert report.counts == {
        "pending": 1,
        "in_flight": 1,
        "succeeded": 1,
        "failed": 1,
        "cancelled": 1,
        "unresolved": 3,
    }
    # Every reason is present, 0 when none waits for it (the same keys in every view).
    assert {k: v for k, v in report.unresolved_by_reason.items() if v} == {
        "outcome_unknown": 1,
        "retries_exhausted": 1,
        "never_delivered": 1,
    }
    assert set(report.unresolved_by_reason) == {r.value for r in Reason}
    # ok, bad, busy, lost, dark in the first batch; busy and dark again; stuck's open one.
    assert report.attempts_last_hour == 8
    assert report.oldest_pending_age_seconds == 0.0
    assert report.keys_near_expiry == 0
    assert report.problems == []
    data = report.as_dict()
    assert set(data) == STATUS_KEYS
    assert data["reconciliation_backlog"] == 3
    assert data["ok"] is True

    now = world.clock.now_ms()
    with world.outbox_at(now + 90_000) as ob:
        assert ob.reconcile.status().oldest_pending_age_seconds == 90.0

    # An hour later: attempts age out of the last hour, and every live operation that
    # was attempted is within an hour of its key's expiry (retention is two hours).
    with world.outbox_at(now + 3_690_000) as ob:
        rec = ob.reconcile
        later = rec.status(max_unresolved=2, max_pending_age=timedelta(hours=1))
        assert later.attempts_last_hour == 0
        assert later.keys_near_expiry == 4  # busy, lost, dark, stuck; wait was never sent
        assert later.oldest_pending_age_seconds == 3690.0
        assert len(later.problems) == 2
        assert "3 unresolved operations (threshold 2)" in later.problems[0]
        assert "oldest pending operation is 3690s old" in later.problems[1]
        assert later.as_dict()["ok"] is False

        fine = rec.status(max_unresolved=3, max_pending_age=timedelta(hours=2), max_near_expiry=4)
        assert fine.problems == []
        near = rec.status(max_near_expiry=3)
        assert near.problems and "4 live operations" in near.problems[0]


def test_list_is_the_unresolved_queue_oldest_first_filtered_and_paged(shared: World) -> None:
    world = shared

    def ids(ops: list[Any]) -> list[str]:
        return [o.operation_id for o in ops]

    # lost went unresolved in the first batch; busy and dark 120 s later (id order).
    assert ids(world.rec.unresolved()) == ["op-lost", "op-busy", "op-dark"]
    assert all(o.state is State.UNRESOLVED for o in world.rec.unresolved())
    assert ids(world.rec.unresolved(tenant="acme")) == ["op-busy"]
    assert ids(world.rec.unresolved(tenant="")) == ["op-dark"]
    assert ids(world.rec.unresolved(tenant="nobody")) == []
    assert ids(world.rec.unresolved(endpoint="fragile")) == ["op-lost"]
    assert ids(world.rec.unresolved(endpoint="inventory")) == ["op-busy"]
    assert ids(world.rec.unresolved(reason="never_delivered")) == ["op-dark"]
    assert ids(world.rec.unresolved(reason=Reason.RETRIES_EXHAUSTED)) == ["op-busy"]
    assert ids(world.rec.unresolved(tenant="acme", reason="outcome_unknown")) == []
    assert ids(world.rec.unresolved(limit=1)) == ["op-lost"]
    assert ids(world.rec.unresolved(limit=1, offset=1)) == ["op-busy"]
    assert ids(world.rec.unresolved(limit=2, offset=2)) == ["op-dark"]
    assert ids(world.rec.unresolved(offset=3)) == []
    assert ids(world.rec.unresolved(older_than=timedelta(seconds=60))) == ["op-lost"]
    with pytest.raises(ValidationError):
        world.rec.unresolved(limit=0)
    with pytest.raises(ValidationError):
        world.rec.unresolved(offset=-1)
    with pytest.raises(ValueError, match="not_a_reason"):
        world.rec.unresolved(reason="not_a_reason")
    with pytest.raises(TypeError, match="tenat"):
        world.rec.unresolved(tenat="acme")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="tenat"):
        world.rec.count(tenat="acme")  # type: ignore[call-arg]


def test_show_tells_the_story_of_each_unresolved_operation(shared: World) -> None:
    world = shared
    for ref in UNRESOLVED:
        report = world.rec.show(ref.operation_id, tenant=ref.tenant)
        op = report.operation
        data = report.as_dict()
        assert set(data) == REPORT_KEYS
        assert set(data["requeue_risk"]) == {
            "key_expires_at",
            "key_retention_passed",
            "note",
            "policy_source",
        }
        assert all(set(a) == ATTEMPT_KEYS for a in data["attempts"])
        assert data["state"] == "unresolved" and data["reason"] == ref.reason
        # Each attempt carries its own request ID; the operation ID never changes.
        request_ids = [a.request_id for a in op.attempts]
        assert len(set(request_ids)) == len(request_ids) == op.attempts_total
        assert [a["request_id"] for a in data["attempts"]] == request_ids
        seen = world.receiver.requests(key=ref.operation_id, tenant=ref.tenant)
        if ref is DARK:
            assert seen == []  # nothing ever left this machine
        else:
            assert [r.request_id for r in seen] == request_ids
        # The key is still remembered: requeue is the safe path.
        risk = report.requeue_risk
        assert risk.key_retention_passed is False
        assert op.first_attempt_at_ms is not None
        assert risk.key_expires_at_ms == op.first_attempt_at_ms + int(
            RETENTION.total_seconds() * 1000
        )
        if ref is DARK:
            assert "no attempt ever left this machine" in risk.note
        else:
            assert "still remembers the key" in risk.note
        assert report.audit == []

    lost = world.rec.show(LOST.operation_id, tenant=LOST.tenant)
    assert "may have reached the receiver" in lost.explanation
    assert "connection closed after the request was sent" in lost.explanation
    assert "resolve or requeue" in lost.explanation
    assert lost.operation.attempts[0].delivery is Delivery.UNKNOWN
    assert world.receiver.effect_count(key=LOST.operation_id, tenant=LOST.tenant) == 1

    busy = world.rec.show(BUSY.operation_id, tenant=BUSY.tenant)
    assert "refusal before work (503)" in busy.explanation
    assert "2 attempts" in busy.explanation
    assert [a["description"] for a in busy.as_dict()["attempts"]] == [
        "attempt 1: the receiver refused it with 503 before doing any work",
        "attempt 2: the receiver refused it with 503 before doing any work",
    ]

    dark = world.rec.show(DARK.operation_id, tenant=DARK.tenant)
    assert dark.explanation == "no attempt ever left this machine (last error: ConnectError)"
    assert all("never left this machine" in a["description"] for a in dark.as_dict()["attempts"])


def test_show_other_states_and_missing_operations(shared: World) -> None:
    world = shared
    ok = world.rec.show(OK.operation_id, tenant=OK.tenant).as_dict()
    assert ok["state"] == "succeeded" and ok["explanation"] == "succeeded"
    assert ok["result"]["status"] == 201
    assert ok["attempts"][0]["description"] == "attempt 1 succeeded with 201"
    bad = world.rec.show(BAD.operation_id, tenant=BAD.tenant).as_dict()
    assert bad["state"] == "failed" and bad["attempts"][0]["status"] == 400
    stuck = world.rec.show(STUCK.operation_id, tenant=STUCK.tenant).as_dict()
    assert stuck["attempts"][0]["delivery"] is None
    assert "open" in stuck["attempts"][0]["description"]
    wait = world.rec.show(WAIT.operation_id, tenant=WAIT.tenant)
    assert wait.operation.attempts == () and wait.blocked_by is None
    assert wait.requeue_risk.key_retention_passed is False  # never sent
    cancelled = world.rec.show(CANCELLED.operation_id, tenant=CANCELLED.tenant).as_dict()
    assert [(a["action"], a["from_state"], a["to_state"]) for a in cancelled["audit"]] == [
        ("cancel", "pending", "cancelled")
    ]
    assert set(cancelled["audit"][0]) == AUDIT_KEYS
    assert cancelled["audit"][0]["actor"] == getpass.getuser()

    with pytest.raises(OperationNotFound):
        world.rec.show("op-nope")
    with pytest.raises(OperationNotFound):  # operation IDs are scoped by tenant
        world.rec.show(LOST.operation_id, tenant="acme")
    with pytest.raises(ValidationError):
        world.rec.show("not an id!")


def test_show_names_the_operation_an_ordering_key_waits_for(
    make_world: Callable[..., World],
) -> None:
    w = make_world(build=False)
    first = Ref("", "first", "offline", "pending")
    second = Ref("", "second", "offline", "pending")
    S.enqueue(w.ob, first, ordering_key="cart-7")
    S.enqueue(w.ob, second, ordering_key="cart-7")
    w.ob.dispatch_once()  # first is refused a connection and waits for a retry
    assert w.rec.show("first").blocked_by is None
    assert w.rec.show("second").blocked_by == "first"
    assert w.rec.show("second").as_dict()["blocked_by"] == "first"


# -- resolve ----------------------------------------------------------------------------


def test_resolve_settles_unresolved_and_writes_the_audit_trail(world: World) -> None:
    before = _get(world, LOST)
    op = world.rec.resolve(
        LOST.operation_id,
        tenant=LOST.tenant,
        outcome="succeeded",
        note="receiver shows reservation R-17",
        operator="alice",
    )
    assert op.state is State.SUCCEEDED
    assert op.version == before.version + 1
    assert op.attempts == before.attempts  # the evidence stays
    (row,) = S.audit_rows(world.ob.engine, LOST.operation_id)
    assert row["tenant"] == "globex"
    assert row["actor"] == "alice"
    assert row["action"] == "resolve"
    assert (row["from_state"], row["to_state"]) == ("unresolved", "succeeded")
    assert row["note"] == "receiver shows reservation R-17"
    assert '"reason": "outcome_unknown"' in row["details"]
    assert row["at"] == world.clock.now_ms()
    trail = world.rec.show(LOST.operation_id, tenant=LOST.tenant).audit
    assert [(r.actor, r.action, r.to_state) for r in trail] == [("alice", "resolve", "succeeded")]

    # The operator defaults to the OS user.
    failed = world.rec.resolve(
        BUSY.operation_id, tenant=BUSY.tenant, outcome=State.FAILED, note="never applied"
    )
    assert failed.state is State.FAILED
    assert S.audit_rows(world.ob.engine, BUSY.operation_id)[0]["actor"] == getpass.getuser()
    assert world.rec.status().counts["unresolved"] == 1
    # A resolved operation is terminal: the dispatcher never sends it.
    world.clock.advance(60)
    world.ob.dispatch_once()
    assert len(world.receiver.requests(key=LOST.operation_id, tenant=LOST.tenant)) == 1
    assert _get(world, LOST).state is State.SUCCEEDED


def test_refused_actions_change_nothing(shared: World) -> None:
    world = shared
    """Wrong state, bad input, unknown operation: refused, and not one row differs."""
    rec = world.rec
    cases: list[tuple[str, type[Exception], str, Callable[[], Any]]] = []
    for ref in EVERY:
        if ref.state != "unresolved":
            cases.append(
                (
                    f"resolve {ref.state}",
                    OperatorActionRefused,
                    "not unresolved",
                    lambda r=ref: rec.resolve(
                        r.operation_id, tenant=r.tenant, outcome="failed", note="n"
                    ),
                )
            )
            cases.append(
                (
                    f"requeue {ref.state}",
                    OperatorActionRefused,
                    "not unresolved",
                    lambda r=ref: rec.requeue(r.operation_id, tenant=r.tenant, note="n"),
                )
            )
        if ref.state != "pending":
            cases.append(
                (
                    f"cancel {ref.state}",
                    OperatorActionRefused,
                    "only pending operations",
                    lambda r=ref: rec.cancel(r.operation_id, tenant=r.tenant, note="n"),
                )
            )
    cases += [
        (
            "resolve as pending",
            ValidationError,
            "succeeded or",
            lambda: rec.resolve("op-lost", tenant="globex", outcome="pending", note="n"),
        ),
        (
            "resolve with a blank note",
            ValidationError,
            "note is required",
            lambda: rec.resolve("op-lost", tenant="globex", outcome="failed", note="  "),
        ),
        (
            "requeue with a huge note",
            ValidationError,
            "longer than",
            lambda: rec.requeue("op-lost", tenant="globex", note="x" * 2001),
        ),
        (
            "resolve with a control character in the operator",
            ValidationError,
            "operator name",
            lambda: rec.resolve(
                "op-lost", tenant="globex", outcome="failed", note="n", operator="eve\nroot"
            ),
        ),
        (
            "cancel without a note",
            ValidationError,
            "note is required",
            lambda: rec.cancel(WAIT.operation_id, tenant=WAIT.tenant, note=""),
        ),
        (
            "resolve in the wrong tenant",
            OperationNotFound,
            "no operation",
            lambda: rec.resolve("op-lost", tenant="acme", outcome="failed", note="n"),
        ),
        (
            "requeue an unknown operation",
            OperationNotFound,
            "no operation",
            lambda: rec.requeue("op-nope", note="n"),
        ),
        (
            "purge with a non-positive age",
            ValidationError,
            "positive",
            lambda: rec.purge(older_than=timedelta(0)),
        ),
    ]
    for name, error, message, action in cases:
        before = world.rows()
        with pytest.raises(error, match=message):
            action()
        assert world.rows() == before, f"{name} changed the tables"
    assert len(S.audit_rows(world.ob.engine)) == 1  # only the fixture's cancel


def test_cancel_only_what_never_reached_the_receiver(make_world: Callable[..., World]) -> None:
    w = make_world(build=False)
    w.receiver.faults.fail_before_work(503, key="reached", retry_after=None, times=1)
    S.enqueue(w.ob, Ref("", "reached", "inventory", "pending"))
    S.enqueue(w.ob, Ref("", "unreachable", "offline", "pending"))
    w.ob.dispatch_once()
    reached, unreachable = w.ob.get("reached"), w.ob.get("unreachable")
    assert reached.state is State.PENDING and reached.attempts[0].delivery is Delivery.SENT
    assert unreachable.state is State.PENDING
    assert unreachable.attempts[0].delivery is Delivery.NOT_SENT

    before = w.rows()
    with pytest.raises(OperatorActionRefused, match="may have reached the receiver"):
        w.rec.cancel("reached", note="changed my mind")
    assert w.rows() == before

    op = w.rec.cancel("unreachable", note="host decommissioned", operator="bob")
    assert op.state is State.CANCELLED
    (row,) = S.audit_rows(w.ob.engine, "unreachable")
    assert (row["actor"], row["action"], row["from_state"], row["to_state"]) == (
        "bob",
        "cancel",
        "pending",
        "cancelled",
    )
    w.clock.advance(S.PAST_BACKOFF_SECONDS)
    w.ob.dispatch_once()
    assert w.ob.get("unreachable").attempts_total == 1  # never tried again
    assert w.ob.get("reached").state is State.SUCCEEDED


# -- requeue ----------------------------------------------------------------------------


def test_requeue_sends_the_same_operation_id_with_a_new_request_id_and_replays(
    world: World,
) -> None:
    before = _get(world, LOST)
    op = world.rec.requeue(
        LOST.operation_id, tenant=LOST.tenant, note="receiver unsure", operator="carol"
    )
    assert op.state is State.PENDING
    assert op.reason is None
    assert op.attempts_counted == 0 and op.attempts_total == 1
    assert op.first_attempt_at_ms == before.first_attempt_at_ms  # same key life
    assert op.next_attempt_at_ms is not None
    assert op.next_attempt_at_ms <= world.clock.now_ms()
    (row,) = S.audit_rows(world.ob.engine, LOST.operation_id)
    assert (row["actor"], row["action"], row["from_state"], row["to_state"]) == (
        "carol",
        "requeue",
        "unresolved",
        "pending",
    )
    assert '"accept_duplicate_risk": false' in row["details"]

    world.ob.dispatch_once()
    op = _get(world, LOST)
    assert op.state is State.SUCCEEDED
    first, second = op.attempts
    assert first.request_id != second.request_id
    seen = world.receiver.requests(key=LOST.operation_id, tenant=LOST.tenant)
    assert [r.request_id for r in seen] == [first.request_id, second.request_id]
    assert [r.outcome for r in seen] == ["fault:drop_after_commit", "replayed"]
    assert {r.key for r in seen} == {LOST.operation_id}
    # The oracle: one effect, however many sends.
    assert world.receiver.effect_count(key=LOST.operation_id, tenant=LOST.tenant) == 1
    assert op.result is not None and op.result.headers.get("idempotent-replayed") == "true"


def test_requeue_after_key_retention_needs_accept_duplicate_risk(world: World) -> None:
    world.clock.advance(RETENTION.total_seconds() + 1)
    report = world.rec.show(LOST.operation_id, tenant=LOST.tenant)
    assert report.requeue_risk.key_retention_passed is True
    assert "applied twice" in report.requeue_risk.note

    before = world.rows()
    with pytest.raises(OperatorActionRefused, match="--accept-duplicate-risk"):
        world.rec.requeue(LOST.operation_id, tenant=LOST.tenant, note="try again")
    assert world.rows() == before

    op = world.rec.requeue(
        LOST.operation_id,
        tenant=LOST.tenant,
        note="receiver confirmed it has no record",
        accept_duplicate_risk=True,
    )
    assert op.state is State.PENDING
    assert op.first_attempt_at_ms is None  # a new key life starts with the next attempt
    (row,) = S.audit_rows(world.ob.engine, LOST.operation_id)
    assert '"accept_duplicate_risk": true' in row["details"]
    world.ob.dispatch_once()
    op = _get(world, LOST)
    assert op.state is State.SUCCEEDED
    assert op.first_attempt_at_ms == op.attempts[-1].started_at_ms
    # This receiver never forgets keys, so even this resend replayed.
    assert world.receiver.effect_count(key=LOST.operation_id, tenant=LOST.tenant) == 1


def test_requeue_is_decided_from_the_policy_snapshot_without_the_application(
    world: World, db_url: str
) -> None:
    endpoint = world.ob.endpoints["fragile"]
    lost = _get(world, LOST)
    assert lost.policy == endpoint.policy_snapshot()  # stored at enqueue
    assert lost.first_attempt_at_ms is not None
    with Outbox(db_url, clock=world.clock) as bare:  # no endpoints registered
        report = bare.reconcile.show(LOST.operation_id, tenant=LOST.tenant)
        assert report.requeue_risk.policy_source == "snapshot"
        assert report.requeue_risk.key_retention_passed is False
        assert report.requeue_risk.key_expires_at_ms == lost.first_attempt_at_ms + int(
            RETENTION.total_seconds() * 1000
        )
        # Past retention less the margin, by the snapshot alone: refused, nothing written.
        world.clock.advance((RETENTION - endpoint.margin).total_seconds())
        before = world.rows()
        with pytest.raises(OperatorActionRefused) as refused:
            bare.reconcile.requeue(LOST.operation_id, tenant=LOST.tenant, note="n")
        message = str(refused.value)
        assert "key retention has passed" in message
        assert "restarts the key's life" in message
        assert "second effect" in message
        assert world.rows() == before
        op = bare.reconcile.requeue(
            LOST.operation_id, tenant=LOST.tenant, note="n", accept_duplicate_risk=True
        )
        assert op.state is State.PENDING
        assert op.first_attempt_at_ms is None  # the key's life starts again
        (row,) = world.audit(LOST.operation_id)
        assert json.loads(row["details"])["policy_source"] == "snapshot"


def test_rows_without_a_snapshot_are_unknown_until_a_dispatcher_claims_them(
    world: World, db_url: str
) -> None:
    # Rows enqueued before policy snapshots existed: the columns are NULL.
    with world.ob.engine.begin() as conn:
        conn.execute(
            operations.update().values(
                policy_window_ms=None,
                policy_key_retention_ms=None,
                policy_margin_ms=None,
                policy_max_attempts=None,
                policy_in_progress_budget=None,
            )
        )
    with Outbox(db_url, clock=world.clock) as bare:
        report = bare.reconcile.show(LOST.operation_id, tenant=LOST.tenant)
        assert report.requeue_risk.policy_source == "unknown"
        assert report.requeue_risk.key_retention_passed is None
        assert "policy of 'op-lost' is unknown" in report.requeue_risk.note
        before = world.rows()
        with pytest.raises(OperatorActionRefused, match="--accept-duplicate-risk requeues it"):
            bare.reconcile.requeue(LOST.operation_id, tenant=LOST.tenant, note="n")
        assert world.rows() == before
    # The application knows the endpoint: its policy stands in for the missing snapshot.
    assert world.rec.show(LOST.operation_id, tenant=LOST.tenant).requeue_risk.policy_source == (
        "endpoint"
    )
    # A dispatcher claiming an old row fills its snapshot in; the others stay unknown.
    assert _get(world, WAIT).policy is None
    world.ob.dispatch_once()
    assert _get(world, WAIT).policy == world.ob.endpoints["inventory"].policy_snapshot()
    assert _get(world, LOST).policy is None


def test_requeue_inside_the_retention_margin_is_not_silently_ineffective(
    world: World,
) -> None:
    lost = _get(world, LOST)
    assert lost.first_attempt_at_ms is not None
    endpoint = world.ob.endpoints["fragile"]
    # Past retention - margin, before retention: the key is nearly forgotten.
    target = lost.first_attempt_at_ms + int(
        (RETENTION - endpoint.margin / 2).total_seconds() * 1000
    )
    world.clock.advance((target - world.clock.now_ms()) / 1000)
    try:
        world.rec.requeue(LOST.operation_id, tenant=LOST.tenant, note="once more")
    except OperatorActionRefused:
        return  # refusing (asking for --accept-duplicate-risk) is a correct answer
    world.ob.dispatch_once()
    # Accepted: then it must actually be sent again.
    assert len(world.receiver.requests(key=LOST.operation_id, tenant=LOST.tenant)) == 2


# -- two operators at once ----------------------------------------------------------------


def _race(
    w: World,
    monkeypatch: pytest.MonkeyPatch,
    actions: list[Callable[[Reconciler], Any]],
) -> list[Any]:
    """Run each action in its own thread on its own Outbox, all reading before any writes."""
    barrier = threading.Barrier(len(actions))
    local = threading.local()
    original = Reconciler._load

    def load_then_wait(self: Reconciler, operation_id: str, tenant: str) -> Any:
        op = original(self, operation_id, tenant)
        if not getattr(local, "waited", False):
            local.waited = True
            barrier.wait(timeout=10)  # everyone has read the same version
        return op

    monkeypatch.setattr(Reconciler, "_load", load_then_wait)
    outboxes = [w.other_operator() for _ in actions]
    results: list[Any] = [None] * len(actions)

    def run(i: int) -> None:
        try:
            results[i] = actions[i](outboxes[i].reconcile)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(actions))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in threads)
    finally:
        monkeypatch.undo()
        for ob in outboxes:
            ob.close()
    return results


def test_two_operators_acting_at_once_exactly_one_wins(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both read the same version, then both write: one wins, the other changes nothing."""
    for ref in (BUSY, DARK):
        results = _race(
            world,
            monkeypatch,
            [
                lambda rec, r=ref, who=who, outcome=outcome: rec.resolve(
                    r.operation_id, tenant=r.tenant, outcome=outcome, note="n", operator=who
                )
                for who, outcome in (("alice", "succeeded"), ("bob", "failed"))
            ],
        )
        wins = [r for r in results if not isinstance(r, Exception)]
        losses = [r for r in results if isinstance(r, Exception)]
        assert len(wins) == 1 and len(losses) == 1, results
        assert isinstance(losses[0], ConcurrentModification), losses
        assert "nothing was written" in str(losses[0])
        rows = S.audit_rows(world.ob.engine, ref.operation_id)
        assert [r["action"] for r in rows] == ["resolve"]
        winner = wins[0]
        assert rows[0]["to_state"] == winner.state.value
        assert rows[0]["actor"] == ("alice" if winner.state is State.SUCCEEDED else "bob")
        assert _get(world, ref).state is winner.state

    # Resolve against requeue, and cancel against cancel.
    for ref, actions in (
        (
            LOST,
            [
                lambda rec: rec.resolve("op-lost", tenant="globex", outcome="failed", note="n"),
                lambda rec: rec.requeue("op-lost", tenant="globex", note="n"),
            ],
        ),
        (
            WAIT,
            [
                lambda rec: rec.cancel("op-wait", tenant="acme", note="n", operator="alice"),
                lambda rec: rec.cancel("op-wait", tenant="acme", note="n", operator="bob"),
            ],
        ),
    ):
        results = _race(world, monkeypatch, actions)
        errors = [r for r in results if isinstance(r, Exception)]
        assert len(errors) == 1 and isinstance(errors[0], ConcurrentModification), results
        rows = S.audit_rows(world.ob.engine, ref.operation_id)
        assert len(rows) == 1
        assert _get(world, ref).state.value == rows[0]["to_state"]


# -- purge ------------------------------------------------------------------------------


def test_purge_removes_old_terminal_operations_only(world: World) -> None:
    engine = world.ob.engine
    old_terminal = [OK.operation_id, BAD.operation_id, CANCELLED.operation_id]
    assert S.attempt_count(engine, old_terminal) == 2  # ok and bad were sent once each

    world.clock.advance(31 * DAY)
    # Recently terminal: resolved and cancelled a moment ago, so they stay.
    world.rec.resolve(DARK.operation_id, tenant=DARK.tenant, outcome="failed", note="gone")
    fresh = Ref("", "op-fresh", "inventory", "pending")
    S.enqueue(world.ob, fresh)
    world.rec.cancel(fresh.operation_id, note="duplicate order")
    counts_before = S.state_counts(engine)
    kept = [r.operation_id for r in (BUSY, LOST, DARK, STUCK, WAIT, fresh)]
    kept_rows_before = [r for r in world.rows()["outbox_operations"] if r[2] in kept]
    kept_attempts_before = S.attempt_count(engine, kept)

    removed = world.rec.purge(older_than=timedelta(days=30), operator="ops-bot")

    assert removed == {"succeeded": 1, "failed": 1, "cancelled": 1}
    counts_after = S.state_counts(engine)
    assert counts_before == {
        "succeeded": 1,
        "failed": 2,
        "cancelled": 2,
        "unresolved": 2,
        "in_flight": 1,
        "pending": 1,
    }
    assert counts_after == {
        "failed": 1,
        "cancelled": 1,
        "unresolved": 2,
        "in_flight": 1,
        "pending": 1,
    }
    for ref in (OK, BAD, CANCELLED):
        with pytest.raises(OperationNotFound):
            _get(world, ref)
    assert S.attempt_count(engine, old_terminal) == 0
    assert S.orphan_attempts(engine) == 0
    assert [r for r in world.rows()["outbox_operations"] if r[2] in kept] == kept_rows_before
    assert S.attempt_count(engine, kept) == kept_attempts_before
    # The audit trail outlives the purge, and records it.
    audit = S.audit_rows(engine)
    assert [r["action"] for r in audit] == ["cancel", "resolve", "cancel", "purge"]
    assert audit[-1]["actor"] == "ops-bot"
    assert audit[-1]["operation_id"] == "*"

    # Nothing left that old: a second purge removes nothing and records nothing.
    assert world.rec.purge(older_than=timedelta(days=30)) == {}
    assert len(S.audit_rows(engine)) == 4
    # Even "everything older than a second" never touches the live or unresolved ones.
    world.clock.advance(5)
    world.rec.purge(older_than=timedelta(seconds=1))
    assert S.state_counts(engine) == {"unresolved": 2, "in_flight": 1, "pending": 1}


def test_the_documented_show_fields_are_the_reports_fields() -> None:
    """The guide's "JSON shapes (stable)" list is the report's keys, no more, no fewer."""
    guide = Path(__file__).resolve().parents[2] / "docs/guide/command-line-and-console.md"
    text = " ".join(guide.read_text().split())
    listed = text.split("give the operation's fields (", 1)[1].split(")", 1)[0]
    assert set(re.findall(r"`(\w+)`", listed)) == OPERATION_KEYS
