"""Every body form round-trips over real HTTP: what the receiver got is what is stored,
what ``show`` displays, and the fingerprint refuses a changed form (SQLite, PostgreSQL)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import pytest
import sqlalchemy

from outbox import Endpoint, OperationConflict, Outbox, ValidationError
from outbox.store.tables import operations
from outbox.testing.receiver import Receiver

FORM = {"amount": "2000", "currency": "eur", "metadata": {"order": "17"}, "expand": ["customer"]}
RAW = b"\x00\x01<order id='17'/>\xff"


@pytest.fixture
def rx(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "rx.sqlite3") as receiver:
        yield receiver.start()


@pytest.fixture
def ob(db_url: str, rx: Receiver) -> Iterator[Outbox]:
    box = Outbox(db_url, endpoints=[Endpoint(name="rx", base_url=rx.url)])
    yield box
    box.close()


def _show(db_url: str, op_id: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "--db", db_url, "show", op_id, "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    shown: dict[str, Any] = json.loads(done.stdout)
    return shown


def charge(ob: Outbox, data: Any, params: Any) -> Any:
    return ob.enqueue(endpoint="rx", method="POST", path="/v1/charges", data=data,
                      form_style="stripe", params=params, operation_id="f-1")  # fmt: skip


def test_form_body_round_trip(ob: Outbox, rx: Receiver, db_url: str) -> None:
    charge(ob, FORM, [("z", "1"), ("a", "x y")])
    ob.dispatch_once()
    op = ob.get("f-1")
    assert op.state.value == "succeeded"
    [effect] = rx.effects()
    assert effect.path == "/v1/charges?z=1&a=x%20y"  # the query, in the given order
    [request] = [r for r in rx.requests() if r.key == "f-1"]
    assert op.body_raw is not None
    assert effect.body.encode() == op.body_raw
    assert effect.body_sha256 == hashlib.sha256(op.body_raw).hexdigest()
    pairs = parse_qsl(effect.body)
    assert pairs == [("amount", "2000"), ("currency", "eur"), ("expand[0]", "customer"),
                     ("metadata[order]", "17")]  # fmt: skip
    view = _find_view(_show(db_url, "f-1"))
    assert view["kind"] == "form"
    assert [tuple(f) for f in view["fields"]] == pairs  # show displays what was received
    assert request.body_sha256 == effect.body_sha256
    changed = {**FORM, "amount": "2001"}
    with pytest.raises(OperationConflict):
        charge(ob, changed, [("z", "1"), ("a", "x y")])
    with pytest.raises(OperationConflict):  # the query is part of the fingerprint
        charge(ob, FORM, [("a", "x y"), ("z", "1")])
    # A mapping is encoded canonically: another dict order is the same operation.
    again = charge(ob, dict(reversed(list(FORM.items()))), [("z", "1"), ("a", "x y")])
    assert again.state.value == "succeeded"


def _find_view(shown: dict[str, Any]) -> dict[str, Any]:
    stack: list[Any] = [shown]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "body_view" in item:
                view: dict[str, Any] = item["body_view"]
                return view
            stack.extend(item.values())
    raise AssertionError(f"no body_view in {shown}")


def test_raw_body_round_trip(ob: Outbox, rx: Receiver, db_url: str) -> None:
    ob.enqueue(endpoint="rx", method="PUT", path="/orders/17", content=RAW,
               content_type="application/xml", operation_id="r-1")  # fmt: skip
    ob.dispatch_once()
    assert ob.get("r-1").state.value == "succeeded"
    [effect] = rx.effects()
    assert effect.body_sha256 == hashlib.sha256(RAW).hexdigest()  # the bytes, unchanged
    view = _find_view(_show(db_url, "r-1"))
    assert (view["kind"], view["size"], view["sha256"]) == ("raw", len(RAW), effect.body_sha256)
    assert view["hex"] == RAW.hex()
    with pytest.raises(OperationConflict):
        ob.enqueue(endpoint="rx", method="PUT", path="/orders/17", content=RAW + b" ",
                   content_type="application/xml", operation_id="r-1")  # fmt: skip
    with pytest.raises(OperationConflict):  # the content type is part of the fingerprint
        ob.enqueue(endpoint="rx", method="PUT", path="/orders/17", content=RAW,
                   content_type="text/xml", operation_id="r-1")  # fmt: skip


def test_json_body_round_trip_is_unchanged(ob: Outbox, rx: Receiver, db_url: str) -> None:
    ob.enqueue(endpoint="rx", method="POST", path="/j", json={"b": 1, "a": "é"},
               params={"v": "2"}, operation_id="j-1")  # fmt: skip
    ob.dispatch_once()
    [effect] = rx.effects()
    assert effect.path == "/j?v=2"
    view = _find_view(_show(db_url, "j-1"))
    assert view["kind"] == "json"
    assert view["text"] == effect.body == '{"a":"é","b":1}'


@pytest.mark.parametrize(
    "bad",
    [
        {"data": {"client_secret": "x"}},
        {"data": {"card": {"password": "x"}}, "form_style": "stripe"},
        {"params": {"api_key": "x"}},
        {"data": {"note": "sk_live_0123456789abcdef"}},
        {"json": {}, "data": {"a": "b"}},
        {"content": b"x"},
        {"content": b"x", "content_type": "multipart/form-data; boundary=x"},
        {"files": {"f": b"x"}},
        {"data": {"a": 1}},  # flat forms take strings only
        {"data": {"a": "x" * 2000}},  # over the body limit below
    ],
)
def test_bad_bodies_are_refused_and_nothing_is_written(
    db_url: str, rx: Receiver, bad: dict[str, Any]
) -> None:
    box = Outbox(db_url, endpoints=[Endpoint(name="rx", base_url=rx.url)], max_body_bytes=1024)
    try:
        with pytest.raises(ValidationError):
            box.enqueue(endpoint="rx", method="POST", path="/x", operation_id="bad-1", **bad)
        with box.store.engine.connect() as conn:
            assert conn.execute(sqlalchemy.select(operations.c.id)).all() == []
    finally:
        box.close()


def test_the_receiver_reads_a_form_as_fields(ob: Outbox, rx: Receiver) -> None:
    ob.enqueue(endpoint="rx", method="POST", path="/v1/customers",
               data=[("name", "Ada"), ("tag", "a"), ("tag", "b")], operation_id="c-1")  # fmt: skip
    ob.dispatch_once()
    op = ob.get("c-1")
    assert op.result is not None
    assert op.result.body["received"] == {"name": "Ada", "tag": ["a", "b"]}  # not {} or null
