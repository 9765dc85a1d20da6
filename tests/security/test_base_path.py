"""A stored path stays under the endpoint's base path.

Refused at enqueue (nothing written) and again at send (a row tampered with in the
database): ``..`` and ``.`` segments, percent-encoded (``%2e%2e``, any case), with
``;`` parameters, or with backslashes; against base URLs with a path and without one.
The receiver is a raw socket that records every request line: it must see none.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import text
from tenacity import wait_fixed

from outbox import Delivery, Endpoint, Outbox, RetryPolicy, ValidationError
from outbox.model import ErrorClass
from tests.security.test_malformed_echo import reflecting_receiver

ESCAPES = [
    "/../../admin/delete-all",
    "/%2e%2e/%2e%2e/admin",
    "/%2E%2e/admin",
    "/..;x/admin",
    "/a/./b",
    "/a/..%5c..%5cadmin",
    "/ok/%2e%2e",
]


def _ok(tok: bytes) -> bytes:
    return b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}"


def _endpoint(url: str) -> Endpoint:
    return Endpoint(
        name="rx", base_url=url, timeout=5.0,
        retry=RetryPolicy(max_attempts=1, window=timedelta(minutes=5), wait=wait_fixed(0)),
        key_retention=timedelta(hours=1),
    )  # fmt: skip


@pytest.mark.parametrize("base_path", ["", "/api/v1"], ids=["no-base-path", "base-path"])
@pytest.mark.parametrize("path", ESCAPES)
def test_paths_leaving_the_base_path_are_refused_at_enqueue(
    path: str, base_path: str, db_url: str
) -> None:
    with reflecting_receiver(_ok) as (url, requests), Outbox(
        db_url, endpoints=[_endpoint(url + base_path)]
    ) as ob:
        with pytest.raises(ValidationError, match="base path"):
            ob.enqueue(endpoint="rx", method="POST", path=path, json={}, operation_id="esc")
        assert ob.find("esc") is None
    assert requests == []


@pytest.mark.parametrize("base_path", ["", "/api/v1"], ids=["no-base-path", "base-path"])
@pytest.mark.parametrize("path", ["/../../admin/delete-all", "/%2e%2e/admin", "/..;x/admin"])
def test_a_tampered_path_is_refused_at_send(path: str, base_path: str, db_url: str) -> None:
    with reflecting_receiver(_ok) as (url, requests), Outbox(
        db_url, endpoints=[_endpoint(url + base_path)]
    ) as ob:
        ob.enqueue(endpoint="rx", method="POST", path="/fine", json={}, operation_id="tamp")
        with ob.engine.begin() as conn:
            conn.execute(text("UPDATE outbox_operations SET path = :p"), {"p": path})
        ob.dispatch_once()
        (attempt,) = ob.get("tamp").attempts
        assert attempt.delivery is Delivery.NOT_SENT
        assert attempt.error_class == ErrorClass.UNSAFE_PATH.value
    assert requests == []


@pytest.mark.parametrize("base_path", ["", "/api/v1"], ids=["no-base-path", "base-path"])
def test_a_path_under_the_base_path_is_sent_there(base_path: str, db_url: str) -> None:
    with reflecting_receiver(_ok) as (url, requests), Outbox(
        db_url, endpoints=[_endpoint(url + base_path)]
    ) as ob:
        ob.enqueue(endpoint="rx", method="POST", path="/a..b/.x/c", json={}, operation_id="ok")
        ob.dispatch_once()
    assert [r.split(b" ")[1] for r in requests] == [f"{base_path}/a..b/.x/c".encode()]
