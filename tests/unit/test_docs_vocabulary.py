"""The manual's lists of the library's own words say what the code says: the body
markers and fields the classifier reads, the statuses it reads them on, and the error
classes the library writes. A word added to the code and not to the guide fails here."""

from __future__ import annotations

from pathlib import Path

from outbox import classify
from outbox.model import ErrorClass

GUIDE = Path(__file__).resolve().parents[2] / "docs/guide"


def test_the_dispatcher_guide_names_every_marker_and_field_the_classifier_reads() -> None:
    page = (GUIDE / "dispatcher.md").read_text()
    words = (
        classify.IN_PROGRESS_MARKERS
        + classify.STALE_MARKERS
        + classify.CONFLICT_MARKERS
        + classify._FIELDS
        + classify._NESTED
    )
    missing = [w for w in words if f"`{w}`" not in page]
    assert missing == []
    statuses = sorted(classify.CONFLICT_STATUSES - {classify.IN_PROGRESS_STATUS})
    row = f"| {', '.join(map(str, statuses[:-1]))} or {statuses[-1]} whose body names a conflict"
    assert row in page


def test_the_command_line_guide_names_every_error_class_the_library_writes() -> None:
    page = (GUIDE / "command-line-and-console.md").read_text()
    assert [e.value for e in ErrorClass if f"`{e.value}`" not in page] == []
