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
