"""The status lookup's pure parts: the default classifier and the lookup route.

Sending a lookup over HTTP is tested in ``tests/integration/test_status_lookup.py``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from outbox.config import StatusLookup, default_classify
from outbox.errors import ConfigurationError
from outbox.model import LookupStatus


def _response(status: int, body: Any) -> httpx.Response:
    return httpx.Response(status, content=json.dumps(body).encode())


def test_default_classifier_reads_the_receivers_route() -> None:
    applied = default_classify(
        _response(200, {"state": "applied", "response": {"status": 201, "body": {"id": 1}}})
    )
    assert applied.status is LookupStatus.APPLIED
    assert applied.result == {"status": 201, "body": {"id": 1}}
    assert default_classify(_response(404, {"state": "unknown_key"})).status is (
        LookupStatus.NOT_APPLIED
    )
    for response in (
        _response(409, {"state": "processing"}),
        _response(500, {}),
        _response(401, {}),
        _response(200, {"state": "weird"}),
        httpx.Response(200, content=b"not json"),
        _response(200, {"state": "applied", "response": {"status": 500, "body": {}}}),
    ):
        assert default_classify(response).status is LookupStatus.UNKNOWN


def test_status_lookup_validates_its_path() -> None:
    assert StatusLookup().target("a:b.c", "t/1") == "/operations/a%3Ab.c"
    assert StatusLookup(path="/t/{tenant}/ops/{operation_id}").target("k", "t/1") == (
        "/t/t%2F1/ops/k"
    )
    for bad in ("operations/{operation_id}", "/operations", "/ops/{operation_id}/{other}"):
        with pytest.raises(ConfigurationError):
            StatusLookup(path=bad)
