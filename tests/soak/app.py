"""The application the soak's dispatcher subprocesses run: ``--app tests.soak.app:outbox``.

Several endpoints share one receiver (each under its own path prefix, so the receiver's
single request log and effect table is the oracle for all of them). Everything is read
from one JSON environment variable, so the parent process, the producer and every
dispatcher build exactly the same configuration.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tenacity import wait_random_exponential

from outbox import DispatcherSettings, Endpoint, Outbox, RetryPolicy

CONFIG_ENV = "OUTBOX_SOAK_CONFIG"


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    name: str
    #: Path prefix on the shared receiver (part of the endpoint's base URL).
    prefix: str
    timeout: float
    max_attempts: int
    #: The endpoint's retry window as a fraction of the soak's window.
    window_factor: float
    #: (method, path template, has body) the producer picks from.
    routes: tuple[tuple[str, str, bool], ...]


ENDPOINTS: tuple[EndpointSpec, ...] = (
    EndpointSpec(
        "inventory",
        "/inventory",
        timeout=1.0,
        max_attempts=6,
        window_factor=1.0,
        routes=(("POST", "/reservations", True), ("PUT", "/reservations/{n}", True)),
    ),
    EndpointSpec(
        "payments",
        "/payments",
        timeout=1.5,
        max_attempts=4,
        window_factor=0.75,
        routes=(("POST", "/charges", True), ("PATCH", "/charges/{n}", True)),
    ),
    EndpointSpec(
        "mail",
        "/mail",
        timeout=0.8,
        max_attempts=8,
        window_factor=1.0,
        # DELETE without a body; GET is not an operation for the receiver: 404, failed.
        routes=(("POST", "/messages", True), ("DELETE", "/drafts/{n}", False)),
    ),
)
SPECS = {spec.name: spec for spec in ENDPOINTS}


def window_seconds(config: dict[str, Any], spec: EndpointSpec) -> float:
    return float(config["window_seconds"]) * spec.window_factor


def retention_seconds(config: dict[str, Any]) -> float:
    """One key retention for every endpoint; the receiver forgets keys after it."""
    return float(config["window_seconds"]) + float(config.get("retention_slack_seconds", 6.0))


def endpoints(config: dict[str, Any]) -> list[Endpoint]:
    secret = str(config["secret"])

    def auth() -> dict[str, str]:
        return {"Authorization": f"Bearer {secret}"}

    base = str(config["receiver_url"]).rstrip("/")
    return [
        Endpoint(
            name=spec.name,
            base_url=base + spec.prefix,
            timeout=spec.timeout,
            retry=RetryPolicy(
                max_attempts=spec.max_attempts,
                window=timedelta(seconds=window_seconds(config, spec)),
                wait=wait_random_exponential(
                    multiplier=0.1, max=float(config.get("backoff_max_seconds", 1.0))
                ),
            ),
            key_retention=timedelta(seconds=retention_seconds(config)),
            tenant_header="X-Tenant",
            auth=auth,
        )
        for spec in ENDPOINTS
    ]


def build(config: dict[str, Any] | None = None) -> Outbox:
    if config is None:
        config = json.loads(os.environ[CONFIG_ENV])
    return Outbox(
        config["db"],
        endpoints=endpoints(config),
        dispatcher=DispatcherSettings(
            concurrency=int(config.get("concurrency", 16)),
            batch_size=int(config.get("batch_size", 32)),
            lease_seconds=float(config["lease_seconds"]),
            lease_margin_seconds=float(config.get("lease_margin_seconds", 0.25)),
            idle_poll_seconds=0.05,
        ),
    )


outbox = build
