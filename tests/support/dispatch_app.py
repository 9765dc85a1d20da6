"""An application module for dispatcher subprocesses in tests (``--app``).

Configured from the environment so one module serves every test: the database, the
receiver's URL, and the timing knobs.
"""

from __future__ import annotations

import os
from datetime import timedelta

from tenacity import wait_random_exponential

from outbox import DispatcherSettings, Endpoint, Outbox, RetryPolicy


def _float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def build() -> Outbox:
    endpoint = Endpoint(
        name="receiver",
        base_url=os.environ["OUTBOX_TEST_RECEIVER_URL"],
        timeout=_float("OUTBOX_TEST_TIMEOUT", 2.0),
        retry=RetryPolicy(
            max_attempts=int(os.environ.get("OUTBOX_TEST_MAX_ATTEMPTS", "5")),
            window=timedelta(seconds=_float("OUTBOX_TEST_WINDOW", 60.0)),
            wait=wait_random_exponential(multiplier=0.1, max=0.5),
        ),
        key_retention=timedelta(hours=1),
        tenant_header="X-Tenant",
    )
    return Outbox(
        os.environ["OUTBOX_TEST_DB"],
        endpoints=[endpoint],
        dispatcher=DispatcherSettings(
            concurrency=int(os.environ.get("OUTBOX_TEST_CONCURRENCY", "16")),
            lease_seconds=_float("OUTBOX_TEST_LEASE", 30.0),
            lease_margin_seconds=_float("OUTBOX_TEST_LEASE_MARGIN", 0.25),
            idle_poll_seconds=0.05,
            stop_timeout_seconds=_float("OUTBOX_TEST_STOP_TIMEOUT", 30.0),
        ),
    )


outbox = build
