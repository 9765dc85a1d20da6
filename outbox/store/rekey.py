"""Key rotation and crypto-shredding over the sealed columns (see :mod:`.sealing`).

Both walk the operations table by primary key in bounded batches, one short write
transaction each, and change a value only if it is still the one read (a dispatcher
writing a result meanwhile wins; its value is already under the current key). Rows stay
readable throughout: a rotated value opens with the current key, one not yet rotated
with the old key, which the ring still holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, or_, select, update

from outbox.model import TERMINAL_STATES, state_values
from outbox.store.sealing import (
    PREFIX,
    PREFIX_BYTES,
    REQUEST_RAW,
    SEALED_COLUMNS,
    as_text,
    is_sealed,
    parts,
    shredded,
)
from outbox.store.tables import operations

if TYPE_CHECKING:
    from outbox.store.base import Store


@dataclass
class RekeyReport:
    """What a rotation or a shred saw and did: rows and values."""

    rows_seen: int = 0
    rows_changed: int = 0
    values_changed: int = 0
    #: Sealed values by the key id that wraps them, before the run.
    by_key: dict[str, int] | None = None


def _sealed_any() -> Any:
    # A byte column (a form's or raw body) holds the same text as ASCII bytes: it starts
    # with the prefix's bytes (LIKE is a text operator; substr works on both kinds).
    n = len(PREFIX_BYTES)
    return or_(*(func.substr(operations.c[c], 1, n) == PREFIX_BYTES if c in REQUEST_RAW
                 else operations.c[c].like(PREFIX + "%") for c in SEALED_COLUMNS))  # fmt: skip


def _batches(store: Store, where: Any, batch_size: int) -> Iterator[Sequence[Any]]:
    cols = [operations.c.id, *(operations.c[c] for c in SEALED_COLUMNS)]
    last = 0
    while True:
        with store.read() as conn:
            rows = conn.execute(
                select(*cols)
                .where(operations.c.id > last, where)
                .order_by(operations.c.id)
                .limit(batch_size)
            ).all()
        if not rows:
            return
        last = rows[-1].id
        yield rows


Stored = str | bytes


def _apply(store: Store, changes: list[tuple[int, str, Stored, Stored]]) -> int:
    """Compare-and-set each (pk, column, old, new); how many took."""
    done = 0
    with store.write() as conn:
        for pk, column, old, new in changes:
            done += conn.execute(
                update(operations)
                .where(operations.c.id == pk, operations.c[column] == old)
                .values({column: new})
            ).rowcount
    return done


def _run(
    store: Store,
    where: Any,
    change: Callable[[str], str | None],
    *,
    dry_run: bool,
    batch_size: int,
    on_batch: Callable[[int], None] | None,
) -> RekeyReport:
    report = RekeyReport(by_key={})
    assert report.by_key is not None
    for rows in _batches(store, where, batch_size):
        changes: list[tuple[int, str, Stored, Stored]] = []
        for r in rows:
            report.rows_seen += 1
            mine = 0
            for column in SEALED_COLUMNS:
                value = getattr(r, column)
                if not is_sealed(value):
                    continue
                text = as_text(value)
                kid = parts(text).key_id
                report.by_key[kid] = report.by_key.get(kid, 0) + 1
                new = change(text)
                if new is not None:
                    old: Stored = text if isinstance(value, str) else bytes(value)
                    changes.append((r.id, column, old, new if isinstance(value, str)
                                    else new.encode("ascii")))  # fmt: skip
                    mine += 1
            report.rows_changed += 1 if mine else 0
        report.values_changed += len(changes) if dry_run else _apply(store, changes)
        if on_batch is not None:
            on_batch(len(rows))
    return report


def rotate(
    store: Store,
    *,
    dry_run: bool = False,
    batch_size: int = 500,
    on_batch: Callable[[int], None] | None = None,
) -> RekeyReport:
    """Re-wrap every data key not under the ring's current key (the ciphertext stays)."""
    sealer = store.sealer
    if sealer.ring is None:
        raise ValueError("key rotation needs a key ring (keys=KeyRing(...))")
    return _run(store, _sealed_any(), sealer.rewrapped, dry_run=dry_run,
                batch_size=batch_size, on_batch=on_batch)  # fmt: skip


def shred(
    store: Store,
    *,
    finished_before_ms: int,
    dry_run: bool = False,
    batch_size: int = 500,
    on_batch: Callable[[int], None] | None = None,
) -> RekeyReport:
    """Destroy the data keys of terminal operations finished before the cutoff.

    Rows, attempts and audit records stay (the trail of what was sent, when, with what
    outcome); request and result bodies and headers can never be opened again. Values
    stored in plain text (before encryption was on) are not touched: ``purge`` them.
    """
    where = (
        operations.c.state.in_(state_values(TERMINAL_STATES))
        & (operations.c.finished_at < finished_before_ms)
        & _sealed_any()
    )

    def change(value: str) -> str | None:
        return None if not parts(value).wrapped else shredded(value)

    return _run(store, where, change, dry_run=dry_run, batch_size=batch_size,
                on_batch=on_batch)  # fmt: skip
