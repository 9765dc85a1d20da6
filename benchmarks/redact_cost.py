"""Cost of the one redaction rule per attempt: building a Redactor from the headers
sent (every spelling of every secret) and running it over a response head.

    .venv/bin/python benchmarks/redact_cost.py
"""

from __future__ import annotations

import timeit

from outbox.wire.redact import Redactor, secrets_sent

HEADERS = {
    "authorization": "Bearer tok/PLANTED.f6e7d8c9b0a1b2c3d4e5",
    "x-api-key": "key/PLANTED+a1b2c3d4e5",
    "idempotency-key": "op-1",
    "x-request-id": "c024497b-7e91-4b3a-8058-adcc369c65a0",
    "content-type": "application/json",
}
BODY = (b'{"id": "op-1", "status": "created", "items": [' + b'{"n": 1, "v": "abc"}, ' * 180
        + b"{}]}")  # fmt: skip


def per_attempt() -> bytes:
    redactor = Redactor(secrets_sent(HEADERS, public=["idempotency-key", "x-request-id"]))
    return redactor.bytes(BODY)


def main() -> None:
    n = 2000
    seconds = min(timeit.repeat(per_attempt, number=n, repeat=5)) / n
    print(f"redaction per attempt ({len(BODY)} byte body, 2 secrets): {seconds * 1e6:.1f} us")


if __name__ == "__main__":
    main()
