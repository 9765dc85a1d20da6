"""Records read from rows by field name (``outbox.base.fields.from_row``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from outbox.base.fields import from_row


@dataclass(frozen=True, slots=True)
class _Record:
    name: str
    count: int
    at_ms: int
    note: str | None = None
    derived: tuple[int, ...] = field(default=(), init=False)


def test_fields_come_from_columns_of_the_same_name_unless_given() -> None:
    row = SimpleNamespace(name="a", count=3, at=7, note="n", unused="x")
    assert from_row(_Record, row, at_ms=row.at) == _Record("a", 3, 7, "n")


def test_a_given_field_wins_over_the_column_of_its_name() -> None:
    row = SimpleNamespace(name="a", count="3", at_ms=1, note=None)
    assert from_row(_Record, row, count=int(row.count)) == _Record("a", 3, 1)


def test_a_missing_column_is_an_error_not_a_default() -> None:
    with pytest.raises(AttributeError, match="note"):
        from_row(_Record, SimpleNamespace(name="a", count=3), at_ms=1)
