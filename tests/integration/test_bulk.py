"""Bulk operator actions (outbox.reconcile.bulk) on SQLite and PostgreSQL, over operations in every
state reached for real (see ``_reconcile_states``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.errors import ValidationError
from outbox.reconcile import Reconciler
from outbox.reconcile.bulk import BulkOutcome, BulkReport, Selection, bulk, select
from outbox.testing.receiver import Receiver
from tests.integration import _reconcile_states as S


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def world(db_url: str, receiver: Receiver) -> Iterator[S.World]:
    with S.every_state_world(S.World, db_url, receiver) as w:
        yield w


def _outcomes(report: BulkReport) -> dict[str, str]:
    return {i.operation_id: i.outcome.value for i in report.items}


@pytest.mark.parametrize("action", ["resolve", "requeue"])
def test_an_operation_changed_after_the_selection_is_left_alone(
    world: S.World, action: str
) -> None:
    rec = Reconciler(world.ob)
    selected = select(rec, action, Selection())
    assert [op.operation_id for op in selected] == ["op-lost", "op-busy", "op-dark"]
    # Another operator settles op-busy between the selection (what was confirmed) and the run.
    other = world.outbox_at(world.clock.now_ms())
    try:
        other.reconcile.resolve("op-busy", tenant="acme", outcome="failed", note="bob was first")
    finally:
        other.close()
    kwargs = {"outcome": "succeeded"} if action == "resolve" else {}
    report = bulk(
        rec, action, Selection(), selected=selected, note="incident 7", operator="alice", **kwargs
    )
    assert _outcomes(report) == {
        "op-lost": "changed",
        "op-busy": "changed_by_someone_else",
        "op-dark": "changed",
    }
    assert not report.exit_ok
    # Bob's action stands, alone in op-busy's audit trail; alice's rows are one per change.
    assert [r["note"] for r in world.audit("op-busy")] == ["bob was first"]
    assert world.ob.get("op-busy", tenant="acme").state.value == "failed"
    for op_id in ("op-lost", "op-dark"):
        (row,) = world.audit(op_id)
        assert (row["actor"], row["action"], row["note"]) == ("alice", action, "incident 7")
        assert json.loads(row["details"])["bulk"] == {}


def test_a_dry_run_writes_nothing_and_foretells_the_run(world: S.World) -> None:
    rec = Reconciler(world.ob)
    selection = Selection(tenant="acme")
    before = world.rows()
    dry = bulk(rec, "cancel", selection, note="n", dry_run=True)
    assert world.rows() == before
    assert _outcomes(dry) == {"op-wait": "changed"}
    run = bulk(rec, "cancel", selection, note="n")
    assert _outcomes(run) == _outcomes(dry)
    assert world.ob.get("op-wait", tenant="acme").state.value == "cancelled"
    # Nothing left to cancel: an empty selection is an empty, successful report.
    assert bulk(rec, "cancel", selection, note="n").items == []


def test_refusals_are_counted_by_reason_and_filters_narrow_the_selection(
    world: S.World,
) -> None:
    rec = Reconciler(world.ob)
    later = world.outbox_at(world.clock.now_ms() + int(S.RETENTION.total_seconds() * 1000))
    try:
        report = bulk(Reconciler(later), "requeue", Selection(), note="n", dry_run=True)
    finally:
        later.close()
    assert report.counts == {"changed": 1, "refused": 2, "changed_by_someone_else": 0}
    assert report.refusals == {"key retention passed: needs --accept-duplicate-risk": 2}
    refused = [i for i in report.items if i.outcome is BulkOutcome.REFUSED]
    assert all("--accept-duplicate-risk requeues it anyway" in i.detail for i in refused)
    only = bulk(rec, "resolve", Selection(endpoint="offline"), note="n", outcome="failed",
                dry_run=True)  # fmt: skip
    assert [i.operation_id for i in only.items] == ["op-dark"]
    assert bulk(rec, "resolve", Selection(reason="retries_exhausted"), note="n",
                outcome="failed", dry_run=True).as_dict()["matched"] == 1  # fmt: skip


def test_bad_input_is_refused_before_anything_is_written(world: S.World) -> None:
    rec = Reconciler(world.ob)
    before = world.rows()
    with pytest.raises(ValidationError, match="note is required"):
        bulk(rec, "resolve", Selection(), note="  ", outcome="failed")
    with pytest.raises(ValidationError, match="operator name"):
        bulk(rec, "requeue", Selection(), note="n", operator="eve\x07")
    with pytest.raises(ValidationError, match="--reason selects unresolved"):
        bulk(rec, "cancel", Selection(reason="never_delivered"), note="n")
    with pytest.raises(ValidationError, match="resolve takes"):
        bulk(rec, "resolve", Selection(), note="n")
    assert world.rows() == before
