"""Server-rendered SVG charts for the console: no script, and nothing in them but numbers
and fixed words, so they fit the Content-Security-Policy (``img-src 'self'``,
``style-src 'self'``: colours are presentation attributes, not styles) and are safe to
mark as markup. Each chart's data is a field of :class:`~outbox.reconcile.status.Figures`,
the same object every other view renders, carried in ``data-*`` attributes too so a test
can compare them with the library's figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from markupsafe import Markup, escape

from outbox.model import Operation
from outbox.reconcile.history import EndpointLatency
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


def _legend(colours: dict[str, str]) -> Markup:
    """A colour swatch and its name for each of ``colours`` (fixed names)."""
    items = "".join(
        f'<li><svg width="10" height="10"><rect width="10" height="10" fill="{c}"/></svg> '
        f"{name}</li>"
        for name, c in colours.items()
    )
    return Markup(f'<ul class="legend">{items}</ul>')  # noqa: S704 (fixed words only)


def legend() -> Markup:
    return _legend(_COLOURS)


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


def queue_chart(sizes: Sequence[int]) -> Markup:
    """The reconciliation queue's size at the end of each minute of the last hour, a
    step line over a filled area, oldest left (:func:`outbox.reconcile.history.queue_history`)."""
    peak = max(sizes, default=0)
    scale = peak or 1
    step = _WIDTH / max(1, len(sizes))
    points = [f"0,{_HEIGHT}"]
    for i, n in enumerate(sizes):
        y = _HEIGHT - round(n * (_HEIGHT - 4) / scale)
        points.append(f"{round(i * step, 1)},{y} {round((i + 1) * step, 1)},{y}")
    points.append(f"{_WIDTH},{_HEIGHT}")
    data = ",".join(str(int(n)) for n in sizes)
    now = int(sizes[-1]) if sizes else 0
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {_WIDTH} {_HEIGHT + 16}" '
        f'width="{_WIDTH}" height="{_HEIGHT + 16}" data-chart="queue-size" '
        f'data-sizes="{data}" data-now="{now}" data-peak="{peak}">',
        "<title>Reconciliation queue size at the end of each minute, last hour</title>",
        f'<polygon points="{" ".join(points)}" fill="#efe3fa" stroke="#7a3fb0" '
        'stroke-width="1.5"/>',
    ]
    for i, n in enumerate(sizes):
        parts.append(
            f'<rect x="{round(i * step, 1)}" y="0" width="{round(step, 1)}" height="{_HEIGHT}" '
            f'fill="transparent" data-minute="{i}" data-n="{int(n)}"><title>{int(n)} '
            f"unresolved</title></rect>"
        )
    parts.append(
        f'<text x="0" y="{_HEIGHT + 13}" font-size="11">-60 min (peak {peak})</text>'
        f'<text x="{_WIDTH}" y="{_HEIGHT + 13}" font-size="11" text-anchor="end">now: '
        f"{now}</text></svg>"
    )
    return Markup("".join(parts))  # noqa: S704 (numbers and fixed words only)


_LATENCY_COLOURS = {"p50": "#1f5fbf", "p95": "#f9a825", "p99": "#c62828"}


def latency_chart(latencies: Sequence[EndpointLatency]) -> Markup:
    """Each endpoint's attempt latency over the last hour: its p50, p95 and p99 as bars
    on a logarithmic scale (1 ms to the slowest), one row per endpoint with attempts.
    Endpoint names are the only words not fixed here: they are escaped."""
    rows = [e for e in latencies if e.count]
    row_h, label_w = 34, 140
    height = max(1, len(rows)) * row_h + 18
    top = max((e.max_ms for e in rows), default=1)
    span = math.log10(max(10, top))

    def w(ms: int) -> int:
        return max(2, round(math.log10(max(1, ms)) * (_WIDTH - label_w - 190) / span))

    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {_WIDTH} {height}" width="{_WIDTH}" '
        f'height="{height}" data-chart="endpoint-latency" data-endpoints="{len(rows)}">',
        "<title>Attempt latency per endpoint (p50, p95, p99), last hour</title>",
    ]
    for r, e in enumerate(rows):
        y = r * row_h
        name = escape(e.endpoint)
        parts.append(
            f'<g data-endpoint="{name}" data-count="{e.count}" data-p50="{e.p50_ms}" '
            f'data-p95="{e.p95_ms}" data-p99="{e.p99_ms}" data-max="{e.max_ms}">'
            f'<text x="0" y="{y + 16}" font-size="12">{name}</text>'
            f'<text x="0" y="{y + 29}" font-size="10" fill="#5b6573">{e.count} attempt'
            f"{'s' if e.count != 1 else ''}</text>"
        )
        for k, (label, ms) in enumerate((("p99", e.p99_ms), ("p95", e.p95_ms),
                                         ("p50", e.p50_ms))):  # fmt: skip
            parts.append(
                f'<rect x="{label_w}" y="{y + 4 + k * 8}" width="{w(ms)}" height="7" '
                f'fill="{_LATENCY_COLOURS[label]}"><title>{label} ≤ {ms} ms</title></rect>'
            )
        parts.append(
            f'<text x="{label_w + w(e.p99_ms) + 4}" y="{y + 18}" font-size="10">'
            f"p50 {e.p50_ms} · p95 {e.p95_ms} · p99 {e.p99_ms} ms</text></g>"
        )
    if not rows:
        parts.append('<text x="0" y="16" font-size="12">no attempt in the last hour</text>')
    parts.append(
        f'<text x="{label_w}" y="{height - 4}" font-size="10">1 ms</text>'
        f'<text x="{_WIDTH - 190}" y="{height - 4}" font-size="10" text-anchor="end">'
        f"{top} ms (log scale)</text></svg>"
    )
    return Markup("".join(parts))  # noqa: S704 (numbers, fixed words, escaped names)


def latency_legend() -> Markup:
    return _legend(_LATENCY_COLOURS)
