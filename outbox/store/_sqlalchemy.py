"""The one home of every use of SQLAlchemy's private surface.

``UpdateBase._returning``: the columns a statement's RETURNING clause names. The claim is
built per dialect, and whether its rows carry the state before the claim is read from the
statement itself rather than kept in step by hand. ``tests/unit/test_dependency_contracts.py``
fails loudly when a SQLAlchemy release changes it; SQLAlchemy is pinned below 2.2.
"""

from __future__ import annotations

from typing import Any


def returning_count(statement: Any) -> int:
    """How many columns ``statement`` (an INSERT, UPDATE or DELETE) returns."""
    return len(statement._returning)
