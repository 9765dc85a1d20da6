"""A record read from a row whose columns its fields are named after.

The store's reads (and the receiver kit's) turn result rows into frozen dataclasses.
Most fields are a column of the same name; :func:`from_row` copies those, so a mapping
spells out only the fields that are converted or named otherwise (``started_at_ms``
from ``started_at``, an enum from its value). Nothing here touches a database: the row
is anything with attributes (a SQLAlchemy ``Row``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    R = TypeVar("R", bound=DataclassInstance)
else:
    R = TypeVar("R")


@functools.cache
def _field_names(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def from_row(cls: type[R], row: Any, **given: Any) -> R:
    """An instance of the dataclass ``cls``: the fields in ``given`` as given, every
    other one from ``row``'s attribute of the same name (a missing one raises
    ``AttributeError``, as a misspelt ``row.name`` would)."""
    named = {name: getattr(row, name) for name in _field_names(cls) if name not in given}
    return cls(**named, **given)


__all__ = ["from_row"]
