"""Server-rendered SVG charts for the console: no script, and nothing in them but numbers
and fixed words, so they fit the Content-Security-Policy (``img-src 'self'``,
``style-src 'self'``: colours are presentation attributes, not styles) and are safe to
mark as markup. Each chart's data is a field of :class:`~outbox.reconcile.status.Figures`,
the same object every other view renders, carried in ``data-*`` attributes too so a test
can compare them with the library's figures.
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup

from outbox.model import Operation
from outbox.reconcile.status import CHART_OUTCOMES

_COLOURS = {"success": "#2e7d32", "retry": "#f9a825", "failed": "#c62828", "other": "#607d8b"}
_WIDTH, _HEIGHT, _BAR = 600, 120, 10


def attempts_chart(per_minute: Sequence[dict[str, int]]) -> Markup:
    """Attempts by outcome per minute over the last hour, stacked bars, oldest left."""
    busiest = max((sum(m.values()) for m in per_minute), default=0)
    peak = busiest or 1
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {_WIDTH} {_HEIGHT + 16}" '
        f'width="{_WIDTH}" height="{_HEIGHT + 16}" data-chart="attempts-per-minute" '
        f'data-total="{sum(sum(m.values()) for m in per_minute)}">',
        "<title>Attempts by outcome per minute, last hour</title>",
    ]
    for i, minute in enumerate(per_minute):
        y = _HEIGHT
        x = i * _BAR
        for outcome in CHART_OUTCOMES:
            n = int(minute.get(outcome, 0))
            if not n:
                continue
            h = max(1, round(n * _HEIGHT / peak))
            y -= h
            parts.append(
                f'<rect x="{x}" y="{y}" width="{_BAR - 1}" height="{h}" '
                f'fill="{_COLOURS[outcome]}" data-minute="{i}" data-outcome="{outcome}" '
                f'data-n="{n}"><title>{n} {outcome}</title></rect>'
            )
    parts.append(
        f'<text x="0" y="{_HEIGHT + 13}" font-size="11">-60 min</text>'
        f'<text x="{_WIDTH}" y="{_HEIGHT + 13}" font-size="11" text-anchor="end">now '
        f"(peak {busiest}/min)</text></svg>"
    )
    return Markup("".join(parts))  # noqa: S704 (numbers and fixed words only)


def legend() -> Markup:
    items = "".join(
        f'<li><svg width="10" height="10"><rect width="10" height="10" fill="{c}"/></svg> '
        f"{name}</li>"
        for name, c in _COLOURS.items()
    )
    return Markup(f'<ul class="legend">{items}</ul>')  # noqa: S704 (fixed words only)


_VERDICT_COLOURS = {"success": "#2e7d32", "retry": "#f9a825", "failed": "#c62828"}


def timeline_chart(op: Operation, now_ms: int) -> Markup:
    """An operation's attempts on a time line against its retry window's end, the last
    moment a request may be sent under its key and the receiver's key expiry (from the
    policy snapshot), so "is a requeue still safe?" can be seen. Empty when the
    operation was never attempted."""
    first = op.first_attempt_at_ms
    if first is None or not op.attempts:
        return Markup("")
    marks: list[tuple[str, int]] = [("now", now_ms)]
    policy = op.policy
    if policy is not None:
        if op.window_started_at_ms is not None:
            marks.append(("window closes", op.window_started_at_ms + policy.window_ms))
        marks.append(("last send", policy.key_usable_until_ms(first)))
        marks.append(("key expires", policy.key_expires_at_ms(first)))
    times = [first, *(a.started_at_ms for a in op.attempts), *(t for _, t in marks)]
    start, end = min(times), max(times)
    span = max(1, end - start)
    width, height, pad = 600, 70, 10

    def x(t: int) -> int:
        return pad + round((t - start) * (width - 2 * pad) / span)

    data = " ".join(f'data-{name.replace(" ", "-")}="{t}"' for name, t in marks)
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" data-chart="timeline" data-attempts="{len(op.attempts)}" {data}>',
        "<title>Attempts against the retry window and the key's expiry</title>",
        f'<line x1="{pad}" y1="30" x2="{width - pad}" y2="30" stroke="#90a4ae"/>',
    ]
    for i, (name, t) in enumerate(sorted(marks, key=lambda m: m[1])):
        colour = "#c62828" if name == "key expires" else "#455a64"
        at = x(t)
        anchor = "start" if at < 60 else "end" if at > width - 60 else "middle"
        parts.append(
            f'<line x1="{at}" y1="12" x2="{at}" y2="48" stroke="{colour}" '
            f'stroke-dasharray="3 2"/><text x="{at}" y="{59 + (i % 2) * 10}" font-size="10" '
            f'text-anchor="{anchor}">{name}</text>'
        )
    for a in op.attempts:
        verdict = a.verdict.value if a.verdict is not None else "open"
        parts.append(
            f'<circle cx="{x(a.started_at_ms)}" cy="30" r="5" '
            f'fill="{_VERDICT_COLOURS.get(verdict, "#607d8b")}" data-attempt="{a.number}" '
            f'data-started="{a.started_at_ms}"><title>attempt {a.number}: {verdict}</title>'
            "</circle>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 (numbers and fixed words only)
