"""The shop's remote APIs: the outbox endpoints (settings.OUTBOX['ENDPOINTS'])."""

from __future__ import annotations

import os
from datetime import timedelta

from tenacity import wait_fixed

from outbox import Endpoint, RetryPolicy


def endpoints() -> list[Endpoint]:
    return [
        Endpoint(
            name="inventory",
            base_url=os.environ.get("SHOP_INVENTORY_URL", "http://127.0.0.1:9"),
            timeout=5.0,
            retry=RetryPolicy(max_attempts=3, window=timedelta(seconds=60), wait=wait_fixed(0.1)),
            key_retention=timedelta(hours=1),
        )
    ]
