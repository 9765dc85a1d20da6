"""Durations as operators type them: ``90s``, ``30m``, ``1h30m``, ``12h``, ``30d``, ``2w``."""

from __future__ import annotations

import re
from datetime import timedelta

from outbox.errors import ValidationError

_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])", re.ASCII)
_WHOLE = re.compile(r"^(?:\d+(?:\.\d+)?[wdhms])+$", re.ASCII)
_UNITS = {"w": 604_800, "d": 86_400, "h": 3_600, "m": 60, "s": 1}
#: Far beyond any retention an outbox keeps; also keeps timedelta from overflowing.
_MAX_SECONDS = 100 * 365 * 86_400

EXAMPLES = "90s, 30m, 1h30m, 12h, 30d or 2w"


def parse_duration(text: str) -> timedelta:
    """A duration: one or more ``<number><unit>`` parts, units w, d, h, m, s, largest
    first and each at most once (``1h30m``; ``2.5h`` works too). Raises
    :class:`~outbox.errors.ValidationError` for anything else."""
    compact = text.strip().lower().replace(" ", "") if isinstance(text, str) else ""
    if not _WHOLE.fullmatch(compact):
        raise ValidationError(f"duration must look like {EXAMPLES}; got {text!r}")
    parts = _PART.findall(compact)
    units = [unit for _, unit in parts]
    order = "wdhms"
    if len(set(units)) != len(units) or units != sorted(units, key=order.index):
        raise ValidationError(
            f"duration must give each unit once, largest first (like 1h30m); got {text!r}"
        )
    seconds = sum(float(number) * _UNITS[unit] for number, unit in parts)
    if seconds > _MAX_SECONDS:
        raise ValidationError(f"duration {text!r} is longer than 100 years")
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    """The shortest form :func:`parse_duration` reads back (``5400s`` -> ``1h30m``)."""
    seconds = int(value.total_seconds())
    if seconds <= 0:
        return "0s"
    out = []
    for unit in "wdhms":
        n, seconds = divmod(seconds, _UNITS[unit])
        if n:
            out.append(f"{n}{unit}")
    return "".join(out)
