"""Formatting for the console's templates: times, ages, capped pretty JSON, masked headers.

Everything here returns plain strings; the templates escape them (autoescape is on and
no template marks anything safe).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape

from outbox.base.durations import format_duration
from outbox.canonical import CREDENTIAL_HEADERS
from outbox.model import ms_to_datetime

#: Pretty JSON longer than this is cut on the operation page (the size is shown).
JSON_DISPLAY_LIMIT = 64 * 1024
MASK = "•••••• (masked)"
HERE = Path(__file__).parent


def when(ms: int | None) -> str:
    value = ms_to_datetime(ms)
    if value is None:
        return ""
    return value.strftime("%Y-%m-%d %H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def age(seconds: float | None) -> str:
    """``3d 4h``, ``2h 5m``, ``4m 10s``, ``12s``."""
    if seconds is None:
        return "-"
    s = int(max(0.0, seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {s}s"
    return f"{s}s"


@dataclass(frozen=True)
class PrettyJson:
    text: str
    size: int
    truncated: bool


def pretty_json(value: Any, limit: int = JSON_DISPLAY_LIMIT) -> PrettyJson:
    if type(value).__name__ == "Sealed":  # encrypted, and no key here: say which
        return PrettyJson(str(value), 0, False)
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
    size = len(text.encode())
    if len(text) <= limit:
        return PrettyJson(text, size, False)
    return PrettyJson(text[:limit], size, True)


def masked(headers: Mapping[str, str] | None, secret_names: Iterable[str]) -> dict[str, str]:
    """Headers with every credential-bearing value replaced. The store never keeps the
    credential headers the library knows of, but evidence and older rows are shown with
    the same rule, whatever put them there."""
    secrets = CREDENTIAL_HEADERS | {n.lower() for n in secret_names}
    return {
        name: MASK if name.lower() in secrets else str(value)
        for name, value in sorted((headers or {}).items())
    }


def environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(enabled_extensions=("html",), default=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = when
    env.filters["age"] = age
    env.filters["duration"] = format_duration
    from outbox.console.charts import (
        attempts_chart,
        latency_chart,
        latency_legend,
        legend,
        queue_chart,
        timeline_chart,
    )

    env.globals["attempts_chart"] = attempts_chart
    env.globals["chart_legend"] = legend
    env.globals["timeline_chart"] = timeline_chart
    env.globals["queue_chart"] = queue_chart
    env.globals["latency_chart"] = latency_chart
    env.globals["latency_legend"] = latency_legend
    return env
