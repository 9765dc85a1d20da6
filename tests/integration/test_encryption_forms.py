"""Encryption at rest of form (``data=``) and raw (``content=``) bodies, on SQLite and
PostgreSQL: the ``body_raw`` column holds only ciphertext, the receiver gets the exact
plaintext bytes over real HTTP, and rotation and shredding cover the column."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import pytest
from sqlalchemy import func, select

from outbox import Endpoint, FakeClock, Outbox, RetryPolicy, State, ValidationError
from outbox.base.keys import KeyRing
from outbox.store import rekey
from outbox.store.sealing import Sealed
from outbox.store.tables import operations
from outbox.testing.receiver import Receiver

PLANTED = "4111-PLANTED-FORM-7731"
FORM = {"card": PLANTED, "amount": "1200", "metadata": {"order": "17"}}
RAW = b"\x00\x01<card>" + PLANTED.encode() + b"</card>\xff"
K1, K2, FP = b"1" * 32, b"2" * 32, b"f" * 32

MakeOutbox = Callable[..., Outbox]


def ring(**keys: bytes) -> KeyRing:
    return KeyRing(keys, current=next(iter(keys)), fingerprint_key=FP)


@pytest.fixture
def rx(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "rx.sqlite3") as receiver:
        yield receiver.start()


@pytest.fixture
def make_ob(db_url: str, rx: Receiver) -> Iterator[MakeOutbox]:
    made: list[Outbox] = []

    def make(keys: KeyRing | None) -> Outbox:
        ob = Outbox(
            db_url,
            endpoints=[
                Endpoint(name="rx", base_url=rx.url, timeout=2.0,
                         retry=RetryPolicy(max_attempts=3, window=timedelta(hours=1)),
                         key_retention=timedelta(hours=2))
            ],
            clock=FakeClock(),
            keys=keys,
        )  # fmt: skip
        made.append(ob)
        return ob

    yield make
    for ob in made:
        ob.close()


def _form(ob: Outbox, op_id: str) -> None:
    ob.enqueue(endpoint="rx", method="POST", path="/v1/charges", data=FORM,
               form_style="stripe", operation_id=op_id)  # fmt: skip


def _content(ob: Outbox, op_id: str, raw: bytes = RAW) -> None:
    ob.enqueue(endpoint="rx", method="POST", path="/orders", content=raw,
               content_type="application/xml", operation_id=op_id)  # fmt: skip


def _row(ob: Outbox, op_id: str) -> Any:
    with ob.engine.connect() as conn:
        return conn.execute(select(operations).where(operations.c.operation_id == op_id)).one()


def _count(ob: Outbox) -> int:
    with ob.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(operations)).scalar_one())


def test_a_form_is_stored_sealed_and_the_receiver_gets_the_plaintext(
    make_ob: MakeOutbox, rx: Receiver
) -> None:
    ob = make_ob(ring(k1=K1))
    _form(ob, "form-1")
    stored = _row(ob, "form-1")
    raw = bytes(stored.body_raw)
    assert raw.startswith(b"sealed:1:k1:") and PLANTED.encode() not in raw
    assert stored.body is None
    assert stored.headers.startswith("sealed:1:k1:")  # its content-type goes with them
    ob.dispatch_once()
    op = ob.get("form-1")
    assert op.state is State.SUCCEEDED
    [effect] = rx.effects(key="form-1")
    assert ("card", PLANTED) in parse_qsl(effect.body)
    assert op.body_raw == effect.body.encode()  # opened: the bytes that were sent
    assert op.content_type == "application/x-www-form-urlencoded"
    assert effect.body_sha256 == hashlib.sha256(op.body_raw).hexdigest()
    assert bytes(_row(ob, "form-1").body_raw) == raw  # sending changed nothing stored


def test_a_raw_body_is_sealed_and_sent_byte_for_byte(make_ob: MakeOutbox, rx: Receiver) -> None:
    ob = make_ob(ring(k1=K1))
    _content(ob, "raw-1")
    raw = bytes(_row(ob, "raw-1").body_raw)
    assert raw.startswith(b"sealed:1:k1:") and PLANTED.encode() not in raw
    ob.dispatch_once()
    [request] = rx.requests(key="raw-1")
    assert request.body_sha256 == hashlib.sha256(RAW).hexdigest()
    op = ob.get("raw-1")
    assert op.state is State.SUCCEEDED and op.body_raw == RAW
    assert op.content_type == "application/xml"


def test_without_the_key_a_sealed_form_says_so_and_is_not_sent(
    make_ob: MakeOutbox, rx: Receiver, db_url: str
) -> None:
    _form(make_ob(ring(k1=K1)), "form-2")
    blind = make_ob(ring(k9=b"9" * 32))
    op = blind.get("form-2")
    assert isinstance(op.body, Sealed) and op.body_raw is None
    assert str(op.body) == "encrypted: key k1 not available"
    blind.dispatch_once()
    op = blind.get("form-2")
    assert op.state is State.PENDING and op.attempts_total == 0
    assert op.last_error == "encrypted: key k1 not available (in this dispatcher's key ring)"
    assert rx.requests(key="form-2") == []
    shown = subprocess.run(
        [sys.executable, "-m", "outbox", "--db", db_url, "show", "form-2", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert PLANTED not in shown.stdout
    data = json.loads(shown.stdout)
    assert data["body"] == "encrypted: key k1 not available"
    assert data["body_view"] == {"kind": "encrypted", "note": "encrypted: key k1 not available"}


def test_rotation_rewraps_form_bodies_and_they_stay_readable(make_ob: MakeOutbox) -> None:
    old = make_ob(ring(k1=K1))
    _form(old, "rot-f")
    _content(old, "rot-c")
    before = bytes(_row(old, "rot-f").body_raw)
    both = make_ob(ring(k2=K2, k1=K1))
    dry = rekey.rotate(both.store, dry_run=True)
    assert dry.values_changed == 4 and dry.by_key == {"k1": 4}  # headers + body_raw, twice
    assert bytes(_row(both, "rot-f").body_raw) == before
    assert rekey.rotate(both.store, batch_size=1).values_changed == 4
    after = bytes(_row(both, "rot-f").body_raw)
    assert after.startswith(b"sealed:1:k2:")
    assert after.split(b":")[-1] == before.split(b":")[-1]  # the ciphertext stayed
    new_only = make_ob(ring(k2=K2))
    assert new_only.get("rot-c").body_raw == RAW
    assert ("card", PLANTED) in parse_qsl((new_only.get("rot-f").body_raw or b"").decode())
    assert rekey.rotate(both.store).values_changed == 0


def test_shredding_destroys_a_form_bodys_data_key(make_ob: MakeOutbox) -> None:
    ob = make_ob(ring(k1=K1))
    _form(ob, "old-f")
    ob.dispatch_once()
    clock = ob.clock
    assert isinstance(clock, FakeClock)
    clock.advance(3600)
    _form(ob, "live-f")
    report = rekey.shred(ob.store, finished_before_ms=clock.now_ms() - 60_000)
    assert report.rows_changed == 1
    op = ob.get("old-f")
    assert op.state is State.SUCCEEDED and len(op.attempts) == 1
    assert isinstance(op.body, Sealed) and op.body.shredded and op.body_raw is None
    raw = bytes(_row(ob, "old-f").body_raw)
    assert raw.startswith(b"sealed:1:k1::")  # no wrapped data key left
    assert ob.get("live-f").body_raw is not None


def test_a_raw_body_shaped_like_a_sealed_value_is_refused_and_nothing_written(
    make_ob: MakeOutbox, rx: Receiver
) -> None:
    ob = make_ob(ring(k1=K1))
    _content(ob, "shape-0")
    sealed = bytes(_row(ob, "shape-0").body_raw)
    for keys in (None, ring(k1=K1)):
        box = make_ob(keys)
        with pytest.raises(ValidationError, match="exact shape of an outbox-encrypted value"):
            _content(box, "shape-1", raw=sealed)
    assert _count(ob) == 1
    # A body that only starts like one is an ordinary body, stored and sent as it is.
    plain = make_ob(None)
    almost = b"sealed:1:not a sealed value"
    _content(plain, "shape-2", raw=almost)
    assert bytes(_row(plain, "shape-2").body_raw) == almost
    plain.dispatch_once()
    [request] = rx.requests(key="shape-2")
    assert request.body_sha256 == hashlib.sha256(almost).hexdigest()


def test_console_shows_a_sealed_forms_fields_only_with_the_key(make_ob: MakeOutbox) -> None:
    import html

    from starlette.testclient import TestClient

    from outbox.console import Credentials, create_app

    _form(make_ob(ring(k1=K1)), "form-c")
    token = "alice-" + "a" * 20
    creds = Credentials.parse(f"alice:{token}\n", default_name="nobody", source="test")
    pages = {}
    for name, keys in (("with", ring(k1=K1)), ("without", None)):
        c = TestClient(create_app(make_ob(keys), creds), base_url="http://127.0.0.1")
        assert c.post("/login", data={"token": token}, follow_redirects=False).status_code == 303
        r = c.get("/operation", params={"tenant": "", "id": "form-c"})
        assert r.status_code == 200
        pages[name] = html.unescape(r.text)
    assert PLANTED in pages["with"] and "metadata[order]" in pages["with"]
    assert PLANTED not in pages["without"]
    assert "encrypted: key k1 not available" in pages["without"]


KEYS_MODULE = """
from outbox.base.keys import KeyRing
FP = b"f" * 32
old = KeyRing({"k1": b"1" * 32}, current="k1", fingerprint_key=FP)
both = KeyRing({"k2": b"2" * 32, "k1": b"1" * 32}, current="k2", fingerprint_key=FP)
new = KeyRing({"k2": b"2" * 32}, current="k2", fingerprint_key=FP)
"""


def test_outbox_keys_rotate_and_shred_cover_form_bodies(
    make_ob: MakeOutbox, db_url: str, tmp_path: Path
) -> None:
    ob = make_ob(ring(k1=K1))
    _form(ob, "cli-f")
    _content(ob, "cli-c")
    (tmp_path / "ringmod.py").write_text(KEYS_MODULE)

    def outbox(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "outbox", "--db", db_url, *args],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              check=False)  # fmt: skip

    rotated = outbox("keys", "rotate", "--keys", "ringmod:both", "--json")
    assert rotated.returncode == 0, rotated.stderr
    assert json.loads(rotated.stdout)["values_changed"] == 4  # headers and body_raw, twice
    assert bytes(_row(ob, "cli-f").body_raw).startswith(b"sealed:1:k2:")
    shown = outbox("show", "cli-c", "--keys", "ringmod:new", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["body_view"]["sha256"] == hashlib.sha256(RAW).hexdigest()
    assert outbox("cancel", "cli-c", "--note", "test").returncode == 0
    with ob.engine.begin() as conn:
        conn.execute(operations.update().where(operations.c.operation_id == "cli-c")
                     .values(finished_at=1))  # fmt: skip
    shred = outbox("keys", "shred", "--older-than", "1d", "--keys", "ringmod:new", "--json")
    assert shred.returncode == 0, shred.stderr
    assert json.loads(shred.stdout)["values_changed"] == 2
    assert bytes(_row(ob, "cli-c").body_raw).startswith(b"sealed:1:k2::")
    gone = outbox("show", "cli-c", "--keys", "ringmod:new")
    assert "encrypted: data key destroyed (key k2, shredded)" in gone.stdout
    assert PLANTED not in gone.stdout
    assert ("card", PLANTED) in parse_qsl((make_ob(ring(k2=K2)).get("cli-f").body_raw
                                          or b"").decode())  # fmt: skip


def test_the_sqlite_file_holds_no_plaintext_form(make_ob: MakeOutbox, db_url: str) -> None:
    import sqlite3

    from sqlalchemy.engine import make_url

    if not db_url.startswith("sqlite"):
        pytest.skip("the SQLite file's bytes")
    ob = make_ob(ring(k1=K1))
    for i in range(5):
        _form(ob, f"file-f-{i}")
        _content(ob, f"file-c-{i}")
    ob.dispatch_once()
    path = Path(make_url(db_url).database or "")
    for f in (path, Path(str(path) + "-wal")):
        assert PLANTED.encode() not in f.read_bytes(), f.name
    ob.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert PLANTED.encode() not in path.read_bytes()
    plain = make_ob(None)  # the check can fail: without keys the form is there
    _form(plain, "plain-f")
    plain.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert PLANTED.encode() in path.read_bytes()


def test_every_enqueue_path_seals_forms(make_ob: MakeOutbox) -> None:
    from outbox import Intent

    ob = make_ob(ring(k1=K1))
    ob.enqueue_many([Intent(endpoint="rx", method="POST", path="/f", data=FORM,
                            form_style="stripe", operation_id=f"many-{i}")
                     for i in range(2)])  # fmt: skip
    with ob.engine.begin() as conn:  # the caller's own transaction
        ob.enqueue(endpoint="rx", method="POST", path="/f", data=FORM, form_style="stripe",
                   operation_id="joined-1", connection=conn)  # fmt: skip
        ob.enqueue_many([Intent(endpoint="rx", method="POST", path="/f", content=RAW,
                                content_type="application/xml", operation_id="joined-2")],
                        connection=conn)  # fmt: skip
    with ob.engine.connect() as conn:
        raws = [bytes(r.body_raw) for r in conn.execute(select(operations.c.body_raw))]
    assert len(raws) == 4
    assert all(r.startswith(b"sealed:1:k1:") and PLANTED.encode() not in r for r in raws)
    assert ob.get("joined-2").body_raw == RAW
    assert ("card", PLANTED) in parse_qsl((ob.get("many-1").body_raw or b"").decode())
