"""An application module for the observability tests' dispatcher subprocesses (``--app``).

Configured from the environment: the database (``OUTBOX_TEST_DB``), the receiver
(``OUTBOX_TEST_RECEIVER_URL``) and an address where nothing listens
(``OUTBOX_TEST_OFFLINE_URL``), the heartbeat period, and optionally a fixed clock
(``OUTBOX_TEST_NOW_MS``: a FakeClock, for reading ``status`` at a chosen time).
Endpoints: ``rx`` (2 attempts), ``offline`` (2 attempts, never reachable) and ``slow``
(a 3-second window, for 409 "still processing" answers).
"""

from __future__ import annotations

import os
from datetime import timedelta

from tenacity import wait_fixed

from outbox import DispatcherSettings, Endpoint, FakeClock, Outbox, RetryPolicy


def build() -> Outbox:
    receiver = os.environ.get("OUTBOX_TEST_RECEIVER_URL", "http://127.0.0.1:9")
    offline = os.environ.get("OUTBOX_TEST_OFFLINE_URL", "http://127.0.0.1:9")
    quick = RetryPolicy(max_attempts=2, window=timedelta(seconds=60), wait=wait_fixed(0.1))
    now = os.environ.get("OUTBOX_TEST_NOW_MS")
    ob = Outbox(
        os.environ["OUTBOX_TEST_DB"],
        endpoints=[
            # throttle=None: "busy" (503 forever) ends retries_exhausted, as the policy
            # alone decides; under the fleet's throttle it would wait for deliver_within.
            Endpoint(name="rx", base_url=receiver, timeout=2.0, retry=quick,
                     key_retention=timedelta(hours=1), throttle=None),
            Endpoint(name="offline", base_url=offline, timeout=2.0, retry=quick,
                     key_retention=timedelta(hours=1)),
            Endpoint(name="slow", base_url=receiver, timeout=2.0,
                     retry=RetryPolicy(max_attempts=2, window=timedelta(seconds=3),
                                       wait=wait_fixed(0.1)),
                     key_retention=timedelta(hours=1)),
        ],
        clock=FakeClock(int(now)) if now else None,
        dispatcher=DispatcherSettings(
            concurrency=8,
            lease_seconds=30.0,
            idle_poll_seconds=0.05,
            heartbeat_seconds=float(os.environ.get("OUTBOX_TEST_HEARTBEAT", "0.2")),
        ),
    )  # fmt: skip
    cache = os.environ.get("OUTBOX_TEST_METRICS_CACHE")
    if cache is not None:
        # Registered now, before the command line asks for them, with this cache period.
        ob.metrics(cache_seconds=float(cache))
    return ob


outbox = build
