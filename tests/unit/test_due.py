"""What "due" and "blocked" mean, defined once (outbox.store.statements), and SQLite's
claim text agreeing with the expression PostgreSQL's claim runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, insert, select, text

from outbox.model import State
from outbox.store.sqlite import claim_sql
from outbox.store.statements import blocks, claimable_ids
from outbox.store.tables import metadata, operations

NOW = 1_000_000

#: (operation ID, tenant, ordering key, state, next_attempt_at), in insertion (id) order.
ROWS: list[tuple[str, str, str | None, State, int | None]] = [
    ("free-due", "t", None, State.PENDING, NOW - 5),
    ("free-later", "t", None, State.PENDING, NOW + 5),
    ("lease-expired", "t", None, State.IN_FLIGHT, NOW),  # a lease ending now is over
    ("lease-held", "t", None, State.IN_FLIGHT, NOW + 1),
    ("unresolved", "t", None, State.UNRESOLVED, NOW - 9),
    ("succeeded", "t", None, State.SUCCEEDED, NOW - 9),
    ("k1-first", "t", "k1", State.PENDING, NOW - 1),
    ("k1-second", "t", "k1", State.PENDING, NOW - 7),  # held back by k1-first
    ("k1-other-tenant", "u", "k1", State.PENDING, NOW - 2),  # another tenant's k1
    ("k2-stuck", "t", "k2", State.UNRESOLVED, None),
    ("k2-next", "t", "k2", State.PENDING, NOW - 3),  # held back by an unresolved one
    ("k3-done", "t", "k3", State.FAILED, None),
    ("k3-next", "t", "k3", State.PENDING, NOW - 4),  # a finished one holds nothing back
    ("k4-flying", "t", "k4", State.IN_FLIGHT, NOW + 50),
    ("k4-next", "t", "k4", State.PENDING, NOW - 6),  # held back by one in flight
]
#: Due and not held back, oldest next_attempt_at first.
CLAIMABLE = ["free-due", "k3-next", "k1-other-tenant", "k1-first", "lease-expired"]


@pytest.fixture
def engine(tmp_path: Path) -> Any:
    engine = create_engine(f"sqlite:///{tmp_path / 'due.db'}")
    metadata.create_all(engine)
    with engine.begin() as conn:
        for operation_id, tenant, key, state, next_at in ROWS:
            conn.execute(
                insert(operations).values(
                    tenant=tenant,
                    operation_id=operation_id,
                    endpoint="rx",
                    method="POST",
                    path="/ops",
                    headers="{}",
                    args_sha256="0" * 64,
                    ordering_key=key,
                    state=state.value,
                    next_attempt_at=next_at,
                    created_at=0,
                    updated_at=0,
                )
            )
    yield engine
    engine.dispose()


def _names(conn: Any, ids: list[int]) -> list[str]:
    by_id = dict(conn.execute(select(operations.c.id, operations.c.operation_id)).all())
    return [by_id[i] for i in ids]


@pytest.mark.parametrize("limit", [2, 100])
def test_sqlites_claim_text_takes_what_the_shared_expression_takes(engine: Any, limit: int) -> None:
    with engine.connect() as conn:
        from_text = conn.execute(text(claim_sql()), {"now_ms": NOW, "limit": limit})
        from_expression = conn.execute(claimable_ids(NOW, limit))
        taken = _names(conn, [r[0] for r in from_text])
        assert taken == _names(conn, [r[0] for r in from_expression])
    assert taken == CLAIMABLE[:limit]


def test_sqlites_claim_is_pinned_to_the_partial_due_index(engine: Any) -> None:
    assert "INDEXED BY ix_outbox_operations_due" in claim_sql()
    with engine.connect() as conn:
        plan = " ".join(
            str(row[-1])
            for row in conn.execute(
                text("EXPLAIN QUERY PLAN " + claim_sql()), {"now_ms": NOW, "limit": 10}
            )
        )
    assert "ix_outbox_operations_due" in plan


def test_the_operation_held_back_names_what_holds_it(engine: Any) -> None:
    """The claim's "blocked" and the status read's predecessor are one rule."""
    with engine.connect() as conn:
        rows = {r.operation_id: r for r in conn.execute(select(operations))}
        for name in ("k1-second", "k2-next", "k4-next", "k1-first", "k3-next", "free-due"):
            op = rows[name]
            holding = (
                conn.execute(
                    select(operations.c.operation_id).where(
                        blocks(operations, tenant=op.tenant, ordering_key=op.ordering_key, pk=op.id)
                    )
                )
                .scalars()
                .all()
            )
            expected = {
                "k1-second": ["k1-first"],
                "k2-next": ["k2-stuck"],
                "k4-next": ["k4-flying"],
            }
            assert holding == expected.get(name, []), name


def test_the_fair_claim_takes_exactly_the_claimable_rows(engine: Any) -> None:
    """The fair claim (store.fairness) changes the order, never what is claimable."""
    from outbox.store.fairness import fair_claim_sql

    with engine.connect() as conn:
        rows = conn.execute(
            text(fair_claim_sql("sqlite")),
            {
                "now_ms": NOW,
                "limit": 100,
                "cursor": "",
                "caps": "{}",
                "steady_ms": 2**62,
                "gone": "[]",
            },
        )
        taken = _names(conn, [r[0] for r in rows])
    assert sorted(taken) == sorted(CLAIMABLE)
