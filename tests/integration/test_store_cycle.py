"""The dispatcher's store transactions, row by row, on a real SQLite file and a real
PostgreSQL: what a claim takes and returns, the attempt rows it begins, the fenced
outcome writes, settlements, releases and the recovery of an expired lease. Every
column of both tables is compared after each step, so a statement that wrote one
column more or less, fenced on the wrong token or returned another row would fail."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from outbox.canonical import CanonicalArgs
from outbox.model import Delivery, ErrorClass, PolicySnapshot, Reason, State, Verdict
from outbox.store import Store, store_for
from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from outbox.store.records import (
    AttemptOutcome,
    ClaimPlan,
    Release,
    Settlement,
    StoredResult,
)
from outbox.store.rows import headers_text, operation_row
from outbox.store.tables import attempts, operations

T0 = 1_700_000_000_000
LEASE = 30_000


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    engine = create_engine(db_url)
    upgrade(engine)
    yield store_for(engine)
    engine.dispose()


def _load(store: Store, n: int, *, headers: str | None = None) -> list[int]:
    rows = []
    for i in range(n):
        args = CanonicalArgs(
            endpoint="rx", method="POST", path=f"/o/{i}", headers={"x-n": str(i)},
            body_json=f'{{"n":{i}}}', args_sha256=f"{i:064d}",
        )  # fmt: skip
        rows.append(operation_row(tenant="t", operation_id=f"op-{i}", args=args,
                                  ordering_key=None, now_ms=T0 + i))  # fmt: skip
    with store.write() as conn:
        pks = store.insert_operations(conn, rows)
        if headers is not None:
            conn.execute(operations.update().where(operations.c.id == min(pks.values()))
                         .values(headers=headers))  # fmt: skip
    return sorted(pks.values())


def _ops(store: Store) -> dict[int, dict[str, Any]]:
    with store.read() as conn:
        rows = conn.execute(select(operations).order_by(operations.c.id)).all()
    return {r.id: {k: (bool(v) if isinstance(v, bool) else v) for k, v in r._mapping.items()}
            for r in rows}  # fmt: skip


def _atts(store: Store) -> list[dict[str, Any]]:
    with store.read() as conn:
        rows = conn.execute(
            select(attempts).order_by(attempts.c.operation_pk, attempts.c.number)
        ).all()
    return [{k: v for k, v in r._mapping.items() if k != "id"} for r in rows]


def _outcome(pk: int, token: str, rid: str, **kw: Any) -> AttemptOutcome:
    base: dict[str, Any] = dict(
        pk=pk, lease_token=token, request_id=rid, delivery=Delivery.SENT,
        verdict=Verdict.SUCCESS, counted=True, status_code=201, receiver_request_id="rr",
        error_class=None, error_message=None, duration_ms=7, state=State.SUCCEEDED,
        reason=None, next_attempt_at=None, maybe_delivered=True, saw_refusal=False,
    )  # fmt: skip
    base.update(kw)
    return AttemptOutcome(**base)


def test_claim_begin_record_settle_release_row_by_row(store: Store) -> None:
    pks = _load(store, 6, headers="not json")
    snap = PolicySnapshot(window_ms=1000, key_retention_ms=2000, margin_ms=3,
                          max_attempts=4, in_progress_budget=5)  # fmt: skip

    def plan(claimed: list[Any]) -> ClaimPlan:
        assert sorted(c.pk for c in claimed) == pks[:5]
        return ClaimPlan(
            send={pks[1]: "r1", pks[2]: "r2", pks[3]: "r3"},
            settlements=[
                Settlement(pk=pks[0], lease_token="A", state=State.FAILED,
                           reason=Reason.NEVER_DELIVERED, last_error="bad headers",
                           not_sent=("config", "no such endpoint", "r0", "d1")),
                Settlement(pk=pks[1], lease_token="other", state=State.FAILED, reason=None),
            ],
            releases=[Release(pks=[pks[4]], delay_ms=500, last_error="later")],
            policies={pks[2]: snap},
        )

    before = _ops(store)
    result = store.claim_and_begin(owner="d1", token="A", now_ms=T0 + 100, lease_ms=LEASE,
                                   limit=5, plan=plan)  # fmt: skip
    by_pk = {c.pk: c for c in result.claimed}
    c0 = by_pk[pks[0]]
    assert (c0.headers, c0.problem) == (
        {}, "its stored headers are not a JSON object (changed outside outbox)"
    )
    c1 = by_pk[pks[1]]
    assert c1.headers == {"x-n": "1"} and c1.problem is None and c1.body == '{"n":1}'
    assert (c1.tenant, c1.operation_id, c1.endpoint, c1.method, c1.path) == (
        "t", "op-1", "rx", "POST", "/o/1"
    )
    assert (c1.attempts_counted, c1.attempts_total, c1.maybe_delivered, c1.saw_refusal) == (
        0, 0, False, False
    )
    assert (c1.lease_until, c1.created_at, c1.first_attempt_at, c1.window_started_at) == (
        T0 + 100 + LEASE, T0 + 1, None, None
    )
    assert (c1.traceparent, c1.attempts_in_progress, c1.policy_window_ms) == (None, 0, None)
    assert result.recovered == []
    assert result.settled == {pks[0]}
    assert [(s.pk, s.request_id, s.number, s.first_attempt_at, s.window_started_at)
            for s in sorted(result.started, key=lambda s: s.pk)] == [
        (pks[1], "r1", 1, T0 + 100, T0 + 100),
        (pks[2], "r2", 1, T0 + 100, T0 + 100),
        (pks[3], "r3", 1, T0 + 100, T0 + 100),
    ]  # fmt: skip
    after = _ops(store)
    now, until = T0 + 100, T0 + 100 + LEASE
    claimed_cols = dict(state="in_flight", lease_token="A", lease_owner="d1",
                        lease_until=until, next_attempt_at=until, updated_at=now)  # fmt: skip
    began = dict(attempts_total=1, attempts_counted=1, first_attempt_at=now,
                 window_started_at=now, last_error=None)  # fmt: skip
    expected = {pk: dict(row) for pk, row in before.items()}
    for pk in pks[:5]:
        expected[pk].update(claimed_cols, version=1)
    for pk in pks[1:4]:
        expected[pk].update(began)
    expected[pks[0]].update(state="failed", reason="never_delivered", last_error="bad headers",
                            next_attempt_at=None, lease_token=None, lease_owner=None,
                            lease_until=None, finished_at=now, attempts_total=1)  # fmt: skip
    expected[pks[2]].update(policy_window_ms=1000, policy_key_retention_ms=2000,
                            policy_margin_ms=3, policy_max_attempts=4,
                            policy_in_progress_budget=5)  # fmt: skip
    expected[pks[4]].update(state="pending", last_error="later", window_started_at=now,
                            next_attempt_at=now + 500, lease_token=None, lease_owner=None,
                            lease_until=None)  # fmt: skip
    assert after == expected
    open_attempt = dict(dispatcher_id="d1", lease_token="A", started_at=now,
                        lease_until=until, finished_at=None, delivery=None, verdict=None,
                        status_code=None, receiver_request_id=None, error_class=None,
                        error_message=None, duration_ms=None)  # fmt: skip
    atts = _atts(store)
    assert [(a["operation_pk"], a["number"], a["request_id"]) for a in atts] == [
        (pks[0], 1, "r0"), (pks[1], 1, "r1"), (pks[2], 1, "r2"), (pks[3], 1, "r3"),
    ]  # fmt: skip
    assert atts[0] == dict(operation_pk=pks[0], number=1, request_id="r0", dispatcher_id="d1",
                           lease_token="A", started_at=now, lease_until=now, finished_at=now,
                           delivery="not_sent", verdict=None, counted=False,
                           status_code=None, receiver_request_id=None, error_class="config",
                           error_message="no such endpoint", duration_ms=0)  # fmt: skip
    for a in atts[1:]:
        assert {k: a[k] for k in open_attempt} == open_attempt
        assert a["counted"] in (None, True)

    # Outcomes, one of them fenced out (a stale token), plus the next claim (pks[5]),
    # in one transaction.
    res = StoredResult(status=201, headers={"b": "2", "a": "1"}, body="{}", sha256="s" * 64,
                       size=2, truncated=False)  # fmt: skip
    outs = [
        _outcome(pks[1], "A", "r1", result=res),
        _outcome(pks[2], "A", "r2", delivery=Delivery.UNKNOWN, verdict=None, counted=False,
                 status_code=None, receiver_request_id=None, error_class="timeout",
                 error_message="slow", state=State.PENDING, next_attempt_at=now + 900,
                 maybe_delivered=True, in_progress=True),
        _outcome(pks[3], "stale", "r3"),
    ]  # fmt: skip
    before = _ops(store)
    written, second = store.record_and_claim(
        outcomes=outs, owner="d2", token="B", now_ms=now + 10, lease_ms=LEASE, limit=10,
        plan=lambda claimed: ClaimPlan(send={c.pk: f"q{c.pk}" for c in claimed}),
    )  # fmt: skip
    assert written == {pks[1], pks[2]}
    assert [c.pk for c in second.claimed] == [pks[5]]  # pks[4] is due later
    assert [(s.pk, s.number) for s in second.started] == [(pks[5], 1)]
    after = _ops(store)
    expected = {pk: dict(row) for pk, row in before.items()}
    expected[pks[1]].update(state="succeeded", reason=None, next_attempt_at=None,
                            lease_token=None, lease_owner=None, lease_until=None,
                            maybe_delivered=True, saw_refusal=False, updated_at=now + 10,
                            finished_at=now + 10, result_status=201,
                            result_headers='{"a": "1", "b": "2"}', result_body="{}",
                            result_sha256="s" * 64, result_size=2,
                            result_truncated=False)  # fmt: skip
    expected[pks[2]].update(state="pending", reason=None, next_attempt_at=now + 900,
                            lease_token=None, lease_owner=None, lease_until=None,
                            maybe_delivered=True, saw_refusal=False, updated_at=now + 10,
                            attempts_counted=0, attempts_in_progress=1)  # fmt: skip
    expected[pks[5]].update(state="in_flight", lease_token="B", lease_owner="d2",
                            lease_until=now + 10 + LEASE, next_attempt_at=now + 10 + LEASE,
                            updated_at=now + 10, version=1, attempts_total=1,
                            attempts_counted=1, first_attempt_at=now + 10,
                            window_started_at=now + 10, last_error=None)  # fmt: skip
    assert after == expected
    by_rid = {a["request_id"]: a for a in _atts(store)}
    assert {k: by_rid["r1"][k] for k in ("delivery", "verdict", "counted", "status_code",
            "receiver_request_id", "error_class", "error_message", "duration_ms",
            "finished_at")} == dict(delivery="sent", verdict="success", counted=True,
            status_code=201, receiver_request_id="rr", error_class=None,
            error_message=None, duration_ms=7, finished_at=now + 10)  # fmt: skip
    assert {k: by_rid["r2"][k] for k in ("delivery", "verdict", "counted", "error_class",
            "error_message", "finished_at")} == dict(delivery="unknown", verdict=None,
            counted=False, error_class="timeout", error_message="slow",
            finished_at=now + 10)  # fmt: skip
    assert by_rid["r3"]["delivery"] is None and by_rid["r3"]["finished_at"] is None
    assert by_rid[f"q{pks[5]}"]["lease_token"] == "B"

    # The lease of pks[3] ("A", attempt r3 still open) expires: the next claim takes
    # it over, closes r3 as unknown and flags the operation as maybe delivered.
    late = until + 1
    third = store.claim_and_begin(owner="d3", token="C", now_ms=late, lease_ms=LEASE,
                                  limit=10, plan=lambda claimed: ClaimPlan())  # fmt: skip
    taken = {c.pk: c for c in third.claimed}
    assert sorted(taken) == [pks[2], pks[3], pks[4]]
    assert [taken[pk].maybe_delivered for pk in (pks[2], pks[3], pks[4])] == [
        True, True, False
    ]
    assert [(r.pk, r.request_id, r.number, r.dispatcher_id) for r in third.recovered] == [
        (pks[3], "r3", 1, "d1")
    ]
    r3 = {a["request_id"]: a for a in _atts(store)}["r3"]
    assert (r3["delivery"], r3["finished_at"], r3["error_class"]) == (
        "unknown", late, ErrorClass.LEASE_EXPIRED.value
    )
    assert r3["error_message"].startswith("the dispatcher's lease expired")
    op3 = _ops(store)[pks[3]]
    assert (op3["maybe_delivered"], op3["lease_token"], op3["version"]) == (True, "C", 2)
    # Fenced: with a stale token nothing begins, and a release changes nothing.
    assert store.begin_attempts(token="A", owner="d1", now_ms=late, lease_until=late,
                                request_ids={pks[3]: "zz"}) == []  # fmt: skip
    assert store.release(token="A", now_ms=late, pks=[pks[3]]) == 0
    assert store.release(token="C", now_ms=late, pks=[pks[3]], delay_ms=5) == 1
    op3 = _ops(store)[pks[3]]
    assert (op3["state"], op3["next_attempt_at"], op3["lease_token"]) == (
        "pending", late + 5, None
    )


def _written(row: dict[str, Any], out: AttemptOutcome, now: int) -> None:
    """What an applied outcome does to its operation's row (the contract, spelled out)."""
    row.update(state=out.state.value, reason=out.reason.value if out.reason else None,
               next_attempt_at=out.next_attempt_at, lease_token=None, lease_owner=None,
               lease_until=None, maybe_delivered=out.maybe_delivered,
               saw_refusal=out.saw_refusal, updated_at=now)  # fmt: skip
    if not out.counted:
        row["attempts_counted"] -= 1
    if out.in_progress:
        row["attempts_in_progress"] += 1
    if out.state.is_settled:
        row["finished_at"] = now
    if out.result is not None:
        r = out.result
        row.update(result_status=r.status, result_body=r.body, result_sha256=r.sha256,
                   result_size=r.size, result_truncated=r.truncated)  # fmt: skip


def _closed(att: dict[str, Any], out: AttemptOutcome, now: int) -> None:
    att.update(delivery=out.delivery.value, verdict=out.verdict.value if out.verdict else None,
               counted=out.counted, status_code=out.status_code,
               receiver_request_id=out.receiver_request_id, error_class=out.error_class,
               error_message=out.error_message, duration_ms=out.duration_ms,
               finished_at=now)  # fmt: skip


def test_outcome_batches_of_every_shape_nulls_and_stale_tokens(store: Store) -> None:
    """One batch of outcomes of several kinds (each kind written by its own statement),
    NULL and non-NULL values side by side in a column, outcomes of two claims and a
    stale one among them; then a batch of one. Every column of both tables compared."""
    pks = _load(store, 9)
    now = T0 + 100
    send = lambda claimed: ClaimPlan(send={c.pk: f"r{pks.index(c.pk)}" for c in claimed})  # noqa: E731
    # A batch of one, then the rest under another lease.
    one = store.claim_and_begin(owner="d1", token="A1", now_ms=now, lease_ms=LEASE, limit=1,
                                plan=send)  # fmt: skip
    assert [(s.pk, s.request_id, s.number) for s in one.started] == [(pks[0], "r0", 1)]
    rest = store.claim_and_begin(owner="d2", token="A", now_ms=now, lease_ms=LEASE, limit=8,
                                 plan=send)  # fmt: skip
    assert sorted(s.pk for s in rest.started) == pks[1:]
    until = now + LEASE
    atts = _atts(store)
    assert atts == [
        dict(operation_pk=pk, number=1, request_id=f"r{i}", dispatcher_id="d1" if i == 0 else "d2",
             lease_token="A1" if i == 0 else "A", started_at=now, lease_until=until,
             finished_at=None, delivery=None, verdict=None, counted=True, status_code=None,
             receiver_request_id=None, error_class=None, error_message=None, duration_ms=None)
        for i, pk in enumerate(pks)
    ]  # fmt: skip

    bare = StoredResult(status=200, headers={}, body=None, sha256=None, size=70_000,
                        truncated=True)  # fmt: skip
    full = StoredResult(status=201, headers={"b": "2", "a": "1"}, body="{}", sha256="s" * 64,
                        size=2, truncated=False)  # fmt: skip
    refused = StoredResult(status=422, headers={"x": "\u00e9\\"}, body='{"e":"\\"\\u00e9"}',
                           sha256="f" * 64, size=7, truncated=False)  # fmt: skip
    outs = [
        # Succeeded with a result: NULL body and hash beside a full result.
        _outcome(pks[0], "A1", "r0", result=bare, receiver_request_id=None),
        _outcome(pks[1], "A", "r1", result=full),
        # "Still processing": not counted, in progress, due again.
        _outcome(pks[2], "A", "r2", verdict=Verdict.IN_PROGRESS, counted=False,
                 status_code=409, state=State.PENDING, next_attempt_at=now + 900,
                 maybe_delivered=False, in_progress=True),
        # A counted retry (due again), and one with NULL error fields beside a set one.
        _outcome(pks[3], "A", "r3", verdict=Verdict.RETRY, status_code=503,
                 state=State.PENDING, next_attempt_at=now + 500, saw_refusal=True,
                 maybe_delivered=False, error_class="http_503",
                 error_message='busy: "déjà" \\ {x, y} NULL'),
        _outcome(pks[4], "A", "r4", delivery=Delivery.UNKNOWN, verdict=None, status_code=None,
                 receiver_request_id="", error_class="timeout", error_message=None,
                 state=State.UNRESOLVED, reason=Reason.OUTCOME_UNKNOWN),
        # Fenced out: the lease is "A", not "stale".
        _outcome(pks[5], "stale", "r5", state=State.FAILED),
        # Failed with the answer kept, not counted.
        _outcome(pks[6], "A", "r6", verdict=Verdict.KEY_CONFLICT, counted=False, status_code=422,
                 state=State.FAILED, reason=Reason.KEY_CONFLICT, result=refused),
        _outcome(pks[7], "A", "r7", state=State.UNRESOLVED, reason=Reason.RETRIES_EXHAUSTED,
                 verdict=Verdict.RETRY, status_code=500, saw_refusal=True),
    ]  # fmt: skip
    before, atts_before = _ops(store), _atts(store)
    written = store.record_outcomes(now_ms=now + 10, outcomes=outs)
    assert written == set(pks[:8]) - {pks[5]}
    expected = {pk: dict(row) for pk, row in before.items()}
    expected_atts = [dict(a) for a in atts_before]
    for out in outs:
        if out.pk in written:
            _written(expected[out.pk], out, now + 10)
            _closed(expected_atts[pks.index(out.pk)], out, now + 10)
    expected[pks[0]]["result_headers"] = "{}"
    expected[pks[1]]["result_headers"] = '{"a": "1", "b": "2"}'
    expected[pks[6]]["result_headers"] = headers_text(refused.headers)
    assert _ops(store) == expected
    assert _atts(store) == expected_atts

    # A batch of one, and a stale outcome alone (nothing written).
    last = _outcome(pks[8], "A", "r8", result=full, error_class="x", error_message="y")
    assert store.record_outcomes(now_ms=now + 20, outcomes=[_outcome(pks[5], "B", "r5")]) == set()
    assert _ops(store) == expected and _atts(store) == expected_atts
    assert store.record_outcomes(now_ms=now + 20, outcomes=[last]) == {pks[8]}
    _written(expected[pks[8]], last, now + 20)
    expected[pks[8]]["result_headers"] = '{"a": "1", "b": "2"}'
    _closed(expected_atts[8], last, now + 20)
    assert _ops(store) == expected
    assert _atts(store) == expected_atts


def test_an_outcome_twice_in_one_batch_is_written_row_by_row(store: Store) -> None:
    """No dispatcher writes an operation twice in one batch; if a caller does, each
    UPDATE runs row by row as it always has: the operations per kind of outcome, in the
    order of each kind's first outcome, the attempts in batch order; the first UPDATE to
    find the lease held wins (it clears the lease), the first to find the attempt open."""
    pks = _load(store, 3)
    now = T0 + 100
    store.claim_and_begin(owner="d1", token="A", now_ms=now, lease_ms=LEASE, limit=3,
                          plan=lambda claimed: ClaimPlan(send={c.pk: f"r{pks.index(c.pk)}"
                                                               for c in claimed}))  # fmt: skip
    retry = dict(state=State.PENDING, verdict=Verdict.RETRY, status_code=503,
                 maybe_delivered=False)  # fmt: skip
    other = _outcome(pks[1], "A", "r1", next_attempt_at=now + 7, **retry)
    first = _outcome(pks[0], "A", "r0")
    again = _outcome(pks[0], "A", "r0", next_attempt_at=now + 5, duration_ms=9, **retry)
    same_a = _outcome(pks[2], "A", "r2", next_attempt_at=now + 1, duration_ms=1, **retry)
    same_b = _outcome(pks[2], "A", "r2", next_attempt_at=now + 2, duration_ms=2, **retry)
    before, atts_before = _ops(store), _atts(store)
    outs = [other, first, again, same_a, same_b]
    assert store.record_outcomes(now_ms=now + 10, outcomes=outs) == set(pks)
    expected = {pk: dict(row) for pk, row in before.items()}
    # The retries' UPDATE (the kind of "other") runs first: "again" finds the lease.
    _written(expected[pks[0]], again, now + 10)
    _written(expected[pks[1]], other, now + 10)
    _written(expected[pks[2]], same_a, now + 10)
    expected_atts = [dict(a) for a in atts_before]
    _closed(expected_atts[0], first, now + 10)
    _closed(expected_atts[1], other, now + 10)
    _closed(expected_atts[2], same_a, now + 10)
    assert _ops(store) == expected
    assert _atts(store) == expected_atts
