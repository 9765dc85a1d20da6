"""Durations as operators type them."""

from __future__ import annotations

from datetime import timedelta

import pytest

from outbox.base.durations import format_duration, parse_duration
from outbox.errors import ValidationError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", timedelta(seconds=90)),
        ("30m", timedelta(minutes=30)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("12h", timedelta(hours=12)),
        ("30d", timedelta(days=30)),
        ("2w", timedelta(weeks=2)),
        ("1w2d3h4m5s", timedelta(weeks=1, days=2, hours=3, minutes=4, seconds=5)),
        ("2.5h", timedelta(hours=2, minutes=30)),
        (" 1H 30M ", timedelta(hours=1, minutes=30)),
        ("0s", timedelta(0)),
    ],
)
def test_durations_read_as_operators_write_them(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "soon", "30", "h", "-5m", "30m1h", "1h1h", "1y", "1h30", "1e3s", "nan s", "10000000w"],
)
def test_anything_else_is_a_validation_error(text: str) -> None:
    with pytest.raises(ValidationError, match="duration"):
        parse_duration(text)


def test_format_reads_back() -> None:
    for seconds in (1, 59, 90, 3600, 5400, 86_400, 1_209_600, 1_300_000):
        value = timedelta(seconds=seconds)
        assert parse_duration(format_duration(value)) == value
    assert format_duration(timedelta(minutes=90)) == "1h30m"
