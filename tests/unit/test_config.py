"""Endpoint and RetryPolicy refuse inconsistent configuration at construction."""

from __future__ import annotations

import dataclasses
import math
from datetime import timedelta

import pytest

from outbox import ConfigurationError, Endpoint, RetryPolicy
from outbox.model import PolicySnapshot

BASE = "https://inventory.example"


def test_defaults_are_valid() -> None:
    endpoint = Endpoint(name="inventory", base_url=BASE)
    assert endpoint.retry.max_attempts >= 1
    assert endpoint.retry.window + endpoint.margin <= endpoint.key_retention
    assert endpoint.origin == BASE


def test_window_plus_margin_may_reach_key_retention_exactly() -> None:
    endpoint = Endpoint(
        name="inventory",
        base_url=BASE,
        retry=RetryPolicy(window=timedelta(hours=23, minutes=55)),
        key_retention=timedelta(hours=24),  # default margin: min(5 min, retention / 10)
    )
    assert endpoint.margin == timedelta(minutes=5)


@pytest.mark.parametrize(
    ("window", "retention", "margin"),
    [
        (timedelta(hours=23, minutes=55, seconds=1), timedelta(hours=24), None),
        (timedelta(hours=24), timedelta(hours=24), None),
        (timedelta(hours=2), timedelta(hours=1), None),
        (timedelta(minutes=50), timedelta(hours=1), timedelta(minutes=11)),
    ],
)
def test_window_plus_margin_past_key_retention_is_refused(
    window: timedelta, retention: timedelta, margin: timedelta | None
) -> None:
    with pytest.raises(ConfigurationError, match="key_retention"):
        Endpoint(
            name="inventory",
            base_url=BASE,
            retry=RetryPolicy(window=window),
            key_retention=retention,
            key_retention_margin=margin,
        )


@pytest.mark.parametrize(
    "base_url",
    [
        "",
        "inventory.example",
        "/relative",
        "ftp://inventory.example",
        "file:///etc/passwd",
        "javascript:alert(1)",
        "https://",
        "https://inventory.example/?q=1",
        "https://inventory.example/#frag",
    ],
)
def test_bad_base_url_is_refused(base_url: str) -> None:
    with pytest.raises(ConfigurationError, match="base_url"):
        Endpoint(name="inventory", base_url=base_url)


@pytest.mark.parametrize("name", ["", "a b", "a/b", "é", "x" * 65, "inv;drop"])
def test_bad_name_is_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="name"):
        Endpoint(name=name, base_url=BASE)


def test_name_with_trailing_newline_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="name"):
        Endpoint(name="inventory\n", base_url=BASE)


@pytest.mark.parametrize("timeout", [0, 0.0, -1.0])
def test_non_positive_timeout_is_refused(timeout: float) -> None:
    with pytest.raises(ConfigurationError, match="timeout"):
        Endpoint(name="inventory", base_url=BASE, timeout=timeout)


def test_nan_timeout_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="timeout"):
        Endpoint(name="inventory", base_url=BASE, timeout=math.nan)


@pytest.mark.parametrize("max_attempts", [0, -1])
def test_max_attempts_below_one_is_refused(max_attempts: int) -> None:
    with pytest.raises(ConfigurationError, match="max_attempts"):
        RetryPolicy(max_attempts=max_attempts)


def test_one_attempt_is_allowed() -> None:
    assert RetryPolicy(max_attempts=1).max_attempts == 1


@pytest.mark.parametrize("window", [timedelta(0), timedelta(seconds=-1)])
def test_non_positive_window_is_refused(window: timedelta) -> None:
    with pytest.raises(ConfigurationError, match="window"):
        RetryPolicy(window=window)


def test_non_positive_key_retention_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="key_retention"):
        Endpoint(name="inventory", base_url=BASE, key_retention=timedelta(0))


def test_configuration_objects_are_frozen() -> None:
    endpoint = Endpoint(name="inventory", base_url=BASE)
    with pytest.raises(AttributeError):
        endpoint.base_url = "https://evil.example"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Endpoint("inventory", BASE)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"key_retention": timedelta(hours=2), "key_retention_margin": timedelta(minutes=1)},
        {"key_retention": timedelta(minutes=70), "retry": RetryPolicy(window=timedelta(hours=1))},
        {"retry": RetryPolicy(window=timedelta(seconds=5), max_attempts=3)},
    ],
)
def test_policy_figures_are_computed_once_and_follow_replace(fields: dict[str, object]) -> None:
    endpoint = Endpoint(name="rx", base_url="http://127.0.0.1:9", **fields)  # type: ignore[arg-type]
    for _ in range(2):  # the second time from the cached figures
        snap = endpoint.policy_snapshot()
        assert snap == PolicySnapshot(
            window_ms=endpoint.retry.window_ms,
            key_retention_ms=int(endpoint.key_retention.total_seconds() * 1000),
            margin_ms=int(endpoint.margin.total_seconds() * 1000),
            max_attempts=endpoint.retry.max_attempts,
            in_progress_budget=endpoint.retry.in_progress_budget,
        )
        for window_start, first in [(0, 0), (10**12, 10**12 - 5_000_000), (7, 10**12)]:
            assert endpoint.deadline_ms(
                window_started_at_ms=window_start, first_attempt_at_ms=first
            ) == min(window_start + snap.window_ms, snap.key_usable_until_ms(first))
    shorter = dataclasses.replace(endpoint, key_retention=timedelta(hours=3),
                                  key_retention_margin=timedelta(minutes=2),
                                  retry=RetryPolicy(window=timedelta(minutes=30)))
    assert shorter.policy_snapshot().margin_ms == 120_000
    assert shorter.policy_snapshot().window_ms == 1_800_000
    assert shorter.deadline_ms(window_started_at_ms=0, first_attempt_at_ms=0) == 1_800_000
