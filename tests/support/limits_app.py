"""The application of the ``outbox dispatch`` processes of tests/integration/
test_rate_limits.py (``--app tests.support.limits_app:outbox``), configured from the
environment: the database, the receiver, the declared limits."""

from __future__ import annotations

import os
from datetime import timedelta

from outbox import DispatcherSettings, Endpoint, Outbox, RetryPolicy


def build() -> Outbox:
    rate = os.environ.get("OUTBOX_TEST_RATE_LIMIT")
    in_flight = os.environ.get("OUTBOX_TEST_MAX_IN_FLIGHT")
    endpoint = Endpoint(
        name="rx",
        base_url=os.environ["OUTBOX_TEST_RECEIVER_URL"],
        timeout=5.0,
        retry=RetryPolicy(max_attempts=3, window=timedelta(seconds=30)),
        key_retention=timedelta(hours=1),
        rate_limit=float(rate) if rate else None,
        max_in_flight=int(in_flight) if in_flight else None,
    )
    return Outbox(
        os.environ["OUTBOX_TEST_DB"],
        endpoints=[endpoint],
        dispatcher=DispatcherSettings(concurrency=16, idle_poll_seconds=0.05),
    )


outbox = build
