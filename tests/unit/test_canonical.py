"""Validation and the canonical form of enqueue arguments (pure, no database)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from datetime import timedelta
from typing import Any

import pytest

from outbox import ValidationError
from outbox.canonical import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    CanonicalArgs,
    EnqueueArgs,
    Intent,
    canonical_json,
    canonicalize,
    check_deliver_within,
    check_operation_id,
    check_ordering_key,
    check_tenant,
)


def canon(**overrides: Any) -> CanonicalArgs:
    args: dict[str, Any] = {
        "endpoint": "inventory",
        "method": "POST",
        "path": "/reservations",
        "json_body": {"sku": "TEST-BOLT", "quantity": 2},
        "headers": None,
        "max_body_bytes": DEFAULT_MAX_BODY_BYTES,
    }
    args.update(overrides)
    return canonicalize(**args)


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth - 1):
        value = [value]
    return value


# -- canonical JSON ---------------------------------------------------------------


def test_canonical_json_sorts_keys_and_is_compact() -> None:
    assert canonical_json({"b": [1, {"d": 2, "c": None}], "a": "x"}) == (
        '{"a":"x","b":[1,{"c":null,"d":2}]}'
    )


def test_canonical_json_keeps_unicode_as_is() -> None:
    assert canonical_json({"name": "Zoë ✓"}) == '{"name":"Zoë ✓"}'


def test_equal_arguments_have_equal_identity_whatever_the_spelling() -> None:
    a = canon(
        json_body={"sku": "TEST-BOLT", "quantity": 2},
        method="post",
        headers={"X-Trace": "t1", "Accept": "application/json"},
    )
    b = canon(
        json_body={"quantity": 2, "sku": "TEST-BOLT"},
        method="POST",
        headers={"accept": "application/json", "x-trace": "t1"},
    )
    assert a == b
    assert a.method == "POST"
    assert list(a.headers) == ["accept", "x-trace"]
    assert a.body_json == '{"quantity":2,"sku":"TEST-BOLT"}'
    assert len(a.args_sha256) == 64


@pytest.mark.parametrize(
    "change",
    [
        {"endpoint": "billing"},
        {"method": "PUT"},
        {"path": "/reservations/"},
        {"json_body": {"sku": "TEST-BOLT", "quantity": 3}},
        {"json_body": {"sku": "TEST-BOLT", "quantity": 2.0}},
        {"json_body": None},
        {"json_body": {}},
        {"headers": {"X-Trace": "t1"}},
    ],
)
def test_any_argument_change_changes_the_identity(change: dict[str, Any]) -> None:
    assert canon(**change).args_sha256 != canon().args_sha256


def test_no_body_and_empty_object_differ() -> None:
    assert canon(json_body=None).body_json is None
    assert canon(json_body={}).body_json == "{}"


# -- identifiers ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["a", "order-17-reserve", "A.b:c_d-9", "x" * 255])
def test_valid_operation_ids(value: str) -> None:
    assert check_operation_id(value) == value


BAD_IDS = [
    "",
    "x" * 256,
    "has space",
    "a/b",
    "line\nbreak",
    "trailing-newline\n",
    "\nleading",
    "tab\t",
    "naïve",
    "\uff21\uff22\uff23",  # fullwidth "ABC"
    "x'; DROP TABLE outbox_operations;--",
    None,
    17,
]


@pytest.mark.parametrize("value", BAD_IDS)
def test_invalid_operation_ids(value: Any) -> None:
    with pytest.raises(ValidationError, match=r"operation_id must be 1-255 characters"):
        check_operation_id(value)


def test_tenant_may_be_empty() -> None:
    assert check_tenant("") == ""
    assert check_tenant("acme") == "acme"


@pytest.mark.parametrize("value", ["ac me", "acme/x", "acme\n", "ü", "x" * 256, None])
def test_invalid_tenants(value: Any) -> None:
    with pytest.raises(ValidationError, match="tenant"):
        check_tenant(value)


@pytest.mark.parametrize("value", ["", "k\n", "k k", "k" * 256])
def test_invalid_ordering_keys(value: str) -> None:
    with pytest.raises(ValidationError, match="ordering_key"):
        check_ordering_key(value)


def test_ordering_key_may_be_absent_or_contain_slashes() -> None:
    assert check_ordering_key(None) is None
    assert check_ordering_key("customer/17") == "customer/17"


# -- method, path, headers --------------------------------------------------------


@pytest.mark.parametrize("method", ["", "CONNECT", "TRACE", "FETCH", "GET ", "POST\r\n", None])
def test_bad_methods(method: Any) -> None:
    with pytest.raises(ValidationError, match="method"):
        canon(method=method)


@pytest.mark.parametrize(
    "path",
    [
        "",
        "reservations",
        "https://evil.example/x",
        "http:/x",
        "//evil.example/x",
        "/a\r\nHost: evil",
        "/a\x00",
        "/a b",
        "/a#frag",
        "/a\\b",
        "/" + "a" * 2048,
        None,
    ],
)
def test_bad_paths(path: Any) -> None:
    with pytest.raises(ValidationError, match="path"):
        canon(path=path)


def test_path_may_carry_a_query() -> None:
    assert canon(path="/items?page=2&sort=asc").path == "/items?page=2&sort=asc"


@pytest.mark.parametrize(
    "name",
    ["Authorization", "authorization", "Cookie", "Proxy-Authorization", "X-Api-Key", "Set-Cookie"],
)
def test_credential_headers_are_refused(name: str) -> None:
    with pytest.raises(ValidationError, match="credentials"):
        canon(headers={name: "secret"})


def test_configured_secret_headers_are_refused_case_insensitively() -> None:
    assert canon(headers={"X-Shop-Token": "t"}).headers == {"x-shop-token": "t"}
    with pytest.raises(ValidationError, match="credentials"):
        canon(headers={"x-shop-token": "t"}, secret_headers=["X-Shop-Token"])


@pytest.mark.parametrize("name", ["Host", "Content-Length", "Idempotency-Key", "X-Request-ID"])
def test_headers_the_dispatcher_sets_are_refused(name: str) -> None:
    with pytest.raises(ValidationError, match="set by the dispatcher"):
        canon(headers={name: "x"})


@pytest.mark.parametrize("value", ["a\r\nX-Evil: 1", "a\nb", "a\rb", "a\x00", 5])
def test_header_values_with_control_characters_are_refused(value: Any) -> None:
    with pytest.raises(ValidationError, match="control characters"):
        canon(headers={"X-Trace": value})


@pytest.mark.parametrize("name", ["", "X Trace", "X-Trace\n", "X:Trace", "é"])
def test_bad_header_names_are_refused(name: str) -> None:
    with pytest.raises(ValidationError, match="header name"):
        canon(headers={name: "v"})


def test_headers_must_be_a_mapping() -> None:
    with pytest.raises(ValidationError, match="mapping"):
        canon(headers=[("X-Trace", "t")])


# -- bodies -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"x": math.nan},
        {"x": [1, {"y": math.inf}]},
        [-math.inf],
        math.nan,
    ],
)
def test_nan_and_infinity_are_refused_anywhere(body: Any) -> None:
    with pytest.raises(ValidationError, match="NaN or Infinity"):
        canon(json_body=body)


@pytest.mark.parametrize("body", [{1, 2}, {"x": object()}, {"when": b"bytes"}, object()])
def test_non_json_bodies_are_refused(body: Any) -> None:
    with pytest.raises(ValidationError, match="not JSON-serialisable"):
        canon(json_body=body)


def test_body_size_limit_is_inclusive() -> None:
    body = "x" * 98  # '"' + 98 + '"' = 100 bytes of canonical JSON
    assert len(canon(json_body=body, max_body_bytes=100).body_json or "") == 100
    with pytest.raises(ValidationError, match="over the limit of 99"):
        canon(json_body=body, max_body_bytes=99)


def test_body_size_counts_utf8_bytes() -> None:
    with pytest.raises(ValidationError, match="over the limit"):
        canon(json_body="é" * 50, max_body_bytes=100)  # 102 bytes, 52 characters


def test_default_body_limit_is_one_mebibyte() -> None:
    assert DEFAULT_MAX_BODY_BYTES == 1024 * 1024
    canon(json_body="x" * (DEFAULT_MAX_BODY_BYTES - 2))
    with pytest.raises(ValidationError, match="over the limit"):
        canon(json_body="x" * (DEFAULT_MAX_BODY_BYTES - 1))


def test_nesting_depth_limit() -> None:
    canon(json_body=nested(MAX_JSON_DEPTH))
    with pytest.raises(ValidationError, match="nested deeper"):
        canon(json_body=nested(MAX_JSON_DEPTH + 1))


def test_very_deep_nesting_is_refused_without_recursion_error() -> None:
    with pytest.raises(ValidationError, match="nested deeper"):
        canon(json_body=nested(100_000))


def test_stored_body_round_trips() -> None:
    body = {"sku": "TEST-BOLT", "tags": ["a", "b"], "price": 1.5, "ok": True, "none": None}
    assert json.loads(canon(json_body=body).body_json or "") == body


def test_every_enqueue_surface_takes_the_same_arguments() -> None:
    # Outbox.enqueue builds its Intent by position; the other surfaces take EnqueueArgs.
    # An argument added to one of them and not the others would be silently dropped.
    from outbox import Outbox

    enqueue = [p for p in inspect.signature(Outbox.enqueue).parameters if p != "self"]
    enqueue.remove("connection")
    assert [f.name for f in dataclasses.fields(Intent)] == enqueue
    assert EnqueueArgs.__required_keys__ | EnqueueArgs.__optional_keys__ == set(enqueue)


@pytest.mark.parametrize(
    ("given", "ms"),
    [(None, None), (timedelta(seconds=2), 2000), (timedelta(microseconds=1), 1)],
    ids=["none", "seconds", "rounded-up"],
)
def test_deliver_within_is_milliseconds_after_enqueue(
    given: timedelta | None, ms: int | None
) -> None:
    assert check_deliver_within(given) == ms


@pytest.mark.parametrize("bad", [timedelta(0), timedelta(seconds=-1), 60, 1.5, "PT1H", True])
def test_deliver_within_must_be_a_positive_timedelta(bad: object) -> None:
    with pytest.raises(ValidationError, match="deliver_within must be a positive timedelta"):
        check_deliver_within(bad)
