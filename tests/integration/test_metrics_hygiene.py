"""``/metrics`` hygiene (issue 29): no ``*_created`` series, every registered endpoint
exported with 0s before it has any live operation, and HELP text that names the unit.
Rendered by prometheus_client itself from a real SQLite outbox."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from outbox import Endpoint, Outbox

ENDPOINT_GAUGES = (
    "outbox_due_operations",
    "outbox_oldest_due_age_seconds",
    "outbox_in_flight_operations",
    "outbox_operations_near_key_expiry",
    "outbox_operations_key_expired",
    "outbox_unsendable_operations",
    "outbox_endpoint_throttled",
)


def _scrape(tmp_path: Path) -> str:
    endpoints = [Endpoint(name=n, base_url="http://127.0.0.1:9") for n in ("pay", "ship")]
    with Outbox(f"sqlite:///{tmp_path / 'o.sqlite3'}", endpoints=endpoints) as ob:
        metrics = ob.metrics(registry=CollectorRegistry())
        # One observation of each instrument, so counters and histograms have series.
        metrics.attempts.labels("pay", "delivered", "success").inc()
        metrics.duration.labels("pay").observe(0.2)
        return generate_latest(metrics.registry).decode()


def test_no_created_series(tmp_path: Path) -> None:
    text = _scrape(tmp_path)
    assert "outbox_attempts_total{" in text
    assert "outbox_attempt_duration_seconds_count{" in text
    assert "_created" not in text


def test_every_registered_endpoint_is_exported_with_zeros(tmp_path: Path) -> None:
    families = {f.name: f for f in text_string_to_metric_families(_scrape(tmp_path))}
    for name in ENDPOINT_GAUGES:
        samples = {s.labels["endpoint"]: s.value for s in families[name].samples}
        assert samples == {"pay": 0.0, "ship": 0.0}, name


def test_help_text_names_the_unit(tmp_path: Path) -> None:
    families = list(text_string_to_metric_families(_scrape(tmp_path)))
    outbox = [f for f in families if f.name.startswith("outbox_")]
    assert len(outbox) >= 15
    for family in outbox:
        words = family.documentation
        unit = (
            "Seconds" if family.name.endswith("_seconds")
            else "(a state code" if family.name.endswith("_state")
            else "(requests per second)" if family.name.endswith("_rate_limit")
            else "(a flag" if family.name.endswith("_throttled")
            else "(a count)"
        )  # fmt: skip
        assert unit in words, f"{family.name}: {words!r}"


def test_the_production_guide_lists_every_metric_exported(tmp_path: Path) -> None:
    # The guide's table is the operator's list of what /metrics carries: no more, no less.
    guide = (Path(__file__).resolve().parents[2] / "docs/guide/production.md").read_text()
    listed = set(re.findall(r"^\| `(outbox_[a-z_]+)` \|", guide, flags=re.MULTILINE))
    exported = set()
    for family in text_string_to_metric_families(_scrape(tmp_path)):
        if family.name.startswith("outbox_"):
            exported.add(f"{family.name}_total" if family.type == "counter" else family.name)
    assert listed == exported
