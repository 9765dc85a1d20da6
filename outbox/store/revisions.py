"""The schema revisions this code knows: read without a database or Alembic, so the
engine can refuse a file migrated by a newer outbox before SQLite opens (and converts) it."""

from __future__ import annotations

from pathlib import Path

from outbox.errors import SchemaError

VERSION_TABLE = "outbox_alembic_version"
#: The newest revision this code expects.
HEAD = "0009"


def migrations_dir() -> Path:
    """The migrations bundled with the installed package, or the source checkout's."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "migrations", package.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise SchemaError(f"the outbox migrations are missing (looked beside {package})")


def known_revisions() -> frozenset[str]:
    """The revisions bundled with this version of outbox (``NNNN_name.py``)."""
    versions = migrations_dir() / "versions"
    return frozenset(p.name.split("_", 1)[0] for p in versions.glob("[0-9]*_*.py"))


def check_known(revision: str | None, where: str) -> None:
    """Refuse a database migrated by a newer outbox (never touch it)."""
    if revision is not None and revision not in known_revisions():
        raise SchemaError(
            f"the outbox schema in {where} is at revision {revision}, which this version "
            f"of outbox does not know (its newest is {HEAD}): it was migrated by a newer "
            "outbox. Run that version; nothing was changed."
        )
