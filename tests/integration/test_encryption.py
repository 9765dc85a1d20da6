"""Encryption at rest on SQLite and PostgreSQL: no plaintext in the database's bytes,
rotation keeps rows readable, a missing or wrong key is a clear error, shredding leaves
the trail, and the dispatcher sends sealed operations over real HTTP."""

from __future__ import annotations

import html
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from outbox import Endpoint, FakeClock, OperationConflict, Outbox, RetryPolicy, State
from outbox.base.keys import KeyRing, KeyUnavailableError
from outbox.store import rekey
from outbox.store.sealing import Sealed
from outbox.store.tables import audit, operations
from outbox.testing.receiver import Receiver

PLANTED = "4111-PLANTED-CARD-9931"
PLANTED_HEADER = "planted-header-7e2c"
K1, K2, FP = b"1" * 32, b"2" * 32, b"f" * 32

MakeOutbox = Callable[..., Outbox]


def ring(**keys: bytes) -> KeyRing:
    return KeyRing(keys, current=next(iter(keys)), fingerprint_key=FP)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    def handler(conn: Any, tenant: str, method: str, path: str, body: Any) -> tuple[int, Any]:
        return 201, {"echo": body}

    with Receiver(tmp_path / "receiver.sqlite3", handler=handler) as rx:
        yield rx


@pytest.fixture
def make_ob(db_url: str, receiver: Receiver) -> Iterator[MakeOutbox]:
    made: list[Outbox] = []

    def make(keys: KeyRing | None) -> Outbox:
        ob = Outbox(
            db_url,
            endpoints=[
                Endpoint(name="rx", base_url=receiver.url, timeout=2.0,
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


def _enqueue(ob: Outbox, op_id: str, card: str = PLANTED) -> None:
    ob.enqueue(endpoint="rx", method="POST", path="/pay", json={"card": card},
               headers={"x-note": PLANTED_HEADER}, operation_id=op_id)  # fmt: skip


def _raw(ob: Outbox, op_id: str) -> Any:
    with ob.engine.connect() as conn:
        return conn.execute(select(operations).where(operations.c.operation_id == op_id)).one()


def test_dispatch_over_http_sends_plaintext_and_stores_only_ciphertext(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob(ring(k1=K1))
    _enqueue(ob, "pay-1")
    ob.dispatch_once()
    op = ob.get("pay-1")
    assert op.state is State.SUCCEEDED
    (seen,) = receiver.requests(key="pay-1")
    assert seen.outcome == "applied"  # and it echoed the plaintext it was sent:
    assert op.body == {"card": PLANTED}
    assert op.headers["x-note"] == PLANTED_HEADER
    assert op.result is not None and op.result.body["echo"] == {"card": PLANTED}
    raw = _raw(ob, "pay-1")
    for column in ("headers", "body", "result_headers", "result_body"):
        value = getattr(raw, column)
        assert value.startswith("sealed:1:k1:"), column
        assert PLANTED not in value and PLANTED_HEADER not in value
    assert receiver.effect_count(key="pay-1") == 1


def test_same_id_same_arguments_is_the_same_operation_under_an_hmac_fingerprint(
    make_ob: MakeOutbox,
) -> None:
    ob = make_ob(ring(k1=K1))
    _enqueue(ob, "pay-2")
    _enqueue(ob, "pay-2")  # the same intent: no conflict, no second row
    with pytest.raises(OperationConflict):
        _enqueue(ob, "pay-2", card="5500-OTHER")
    raw = _raw(ob, "pay-2")
    plain = make_ob(None)
    plain.enqueue(endpoint="rx", method="POST", path="/pay", json={"card": PLANTED},
                  headers={"x-note": PLANTED_HEADER}, operation_id="plain-2")  # fmt: skip
    # An HMAC, not the SHA-256 anyone could compute from guessed arguments.
    assert raw.args_sha256 != _raw(plain, "plain-2").args_sha256
    assert len(raw.args_sha256) == 64


def test_a_missing_key_says_so_and_a_wrong_key_is_a_clear_error(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    with_key = make_ob(ring(k1=K1))
    _enqueue(with_key, "pay-3")
    without = make_ob(ring(k9=b"9" * 32))
    op = without.get("pay-3")
    assert isinstance(op.body, Sealed)
    assert str(op.body) == "encrypted: key k1 not available"
    assert op.headers == {}
    # A dispatcher without the key sends nothing and puts the row back, saying why.
    without.dispatch_once()
    op = without.get("pay-3")
    assert op.state is State.PENDING and op.attempts_total == 0
    assert op.last_error == "encrypted: key k1 not available (in this dispatcher's key ring)"
    assert receiver.requests(key="pay-3") == []
    # One with the key sends it once it is due again.
    clock = with_key.clock
    assert isinstance(clock, FakeClock)
    clock.advance(61)  # past the put-back delay (at most a minute), inside the window
    with_key.dispatch_once()
    done = with_key.get("pay-3")
    assert done.state is State.SUCCEEDED
    assert receiver.effect_count(key="pay-3") == 1
    wrong = make_ob(ring(k1=b"x" * 32))
    with pytest.raises(KeyUnavailableError, match="key k1 does not unwrap"):
        wrong.get("pay-3")


def test_a_ciphertext_moved_to_another_row_fails_to_open(make_ob: MakeOutbox) -> None:
    ob = make_ob(ring(k1=K1))
    _enqueue(ob, "pay-a")
    _enqueue(ob, "pay-b", card="other")
    moved = _raw(ob, "pay-a").body
    with ob.engine.begin() as conn:
        conn.execute(
            operations.update()
            .where(operations.c.operation_id == "pay-b")
            .values(body=moved)
        )
    with pytest.raises(KeyUnavailableError, match="does not belong to this row"):
        ob.get("pay-b")


def test_rotation_rewraps_and_old_rows_stay_readable(make_ob: MakeOutbox) -> None:
    old = make_ob(ring(k1=K1))
    for i in range(7):
        _enqueue(old, f"rot-{i}")
    old.dispatch_once()
    before = _raw(old, "rot-0")
    both = make_ob(ring(k2=K2, k1=K1))
    _enqueue(both, "rot-new")
    dry = rekey.rotate(both.store, dry_run=True, batch_size=3)
    assert dry.values_changed > 0 and _raw(both, "rot-0").body == before.body
    seen: list[int] = []
    report = rekey.rotate(both.store, batch_size=3, on_batch=seen.append)
    assert report.values_changed == dry.values_changed
    assert sum(seen) == 8 and len(seen) == 3
    after = _raw(both, "rot-0")
    assert after.body.startswith("sealed:1:k2:")
    # The ciphertext stayed; only the wrapped data key changed.
    assert after.body.split(":")[-1] == before.body.split(":")[-1]
    only_new = make_ob(ring(k2=K2))
    for i in range(7):
        assert only_new.get(f"rot-{i}").body == {"card": PLANTED}
    assert rekey.rotate(both.store).values_changed == 0


def test_shredding_destroys_old_data_keys_and_keeps_the_trail(make_ob: MakeOutbox) -> None:
    ob = make_ob(ring(k1=K1))
    _enqueue(ob, "old-1")
    ob.dispatch_once()
    clock = ob.clock
    assert isinstance(clock, FakeClock)
    clock.advance(3600)
    _enqueue(ob, "live-1")
    cutoff = clock.now_ms() - 60_000
    report = rekey.shred(ob.store, finished_before_ms=cutoff)
    assert report.rows_changed == 1
    op = ob.get("old-1")
    assert op.state is State.SUCCEEDED and len(op.attempts) == 1
    assert isinstance(op.body, Sealed) and op.body.shredded
    assert op.result is not None and isinstance(op.result.body, Sealed)
    assert ob.get("live-1").body == {"card": PLANTED}
    with ob.engine.connect() as conn:
        assert conn.execute(select(audit)).all() is not None


def test_sqlite_file_and_wal_hold_no_plaintext(make_ob: MakeOutbox, db_url: str) -> None:
    if not db_url.startswith("sqlite"):
        pytest.skip("the SQLite file's bytes")
    ob = make_ob(ring(k1=K1))
    for i in range(20):
        _enqueue(ob, f"f-{i}")
    ob.dispatch_once()
    path = Path(make_url(db_url).database or "")
    wal = Path(str(path) + "-wal")
    assert wal.exists() and wal.stat().st_size > 0
    for f in (path, wal):
        data = f.read_bytes()
        assert PLANTED.encode() not in data and PLANTED_HEADER.encode() not in data
    ob.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert PLANTED.encode() not in path.read_bytes()
    # The check can fail: the same run without keys leaves the value in the file.
    plain = make_ob(None)
    _enqueue(plain, "plain-1")
    plain.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert PLANTED.encode() in path.read_bytes()


def test_pg_dump_of_the_schema_holds_no_plaintext(make_ob: MakeOutbox, db_url: str) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("pg_dump of the schema")
    ob = make_ob(ring(k1=K1))
    for i in range(5):
        _enqueue(ob, f"d-{i}")
    ob.dispatch_once()
    url = make_url(db_url)
    schema = str(url.query["options"]).split("search_path=")[1]

    def dump() -> bytes:
        return subprocess.run(
            ["pg_dump", "-h", url.host or "127.0.0.1", "-p", str(url.port or 5432),
             "-U", url.username or "postgres", "-n", schema, url.database or "test"],
            check=True, capture_output=True, timeout=60,
        ).stdout  # fmt: skip

    data = dump()
    assert b"outbox_operations" in data and b"sealed:1:k1:" in data
    assert PLANTED.encode() not in data and PLANTED_HEADER.encode() not in data
    _enqueue(make_ob(None), "plain-1")
    assert PLANTED.encode() in dump()  # the check can fail


def test_console_shows_plaintext_only_with_the_key(make_ob: MakeOutbox) -> None:
    from starlette.testclient import TestClient

    from outbox.console import Credentials, create_app

    _enqueue(make_ob(ring(k1=K1)), "pay-c")
    token = "alice-" + "a" * 20
    creds = Credentials.parse(f"alice:{token}\n", default_name="nobody", source="test")
    pages = {}
    for name, keys in (("with", ring(k1=K1)), ("without", None)):
        c = TestClient(create_app(make_ob(keys), creds), base_url="http://127.0.0.1")
        assert c.post("/login", data={"token": token}, follow_redirects=False).status_code == 303
        r = c.get("/operation", params={"tenant": "", "id": "pay-c"})
        assert r.status_code == 200
        pages[name] = html.unescape(r.text)
    assert PLANTED in pages["with"]
    assert PLANTED not in pages["without"]
    assert "encrypted: key k1 not available" in pages["without"]


def test_every_enqueue_path_seals(make_ob: MakeOutbox) -> None:
    from outbox import Intent

    ob = make_ob(ring(k1=K1))
    many = [Intent(endpoint="rx", method="POST", path="/pay", json={"card": PLANTED},
                   operation_id=f"many-{i}") for i in range(3)]  # fmt: skip
    ob.enqueue_many(many)
    with ob.engine.begin() as conn:  # the caller's own transaction
        ob.enqueue(endpoint="rx", method="POST", path="/pay", json={"card": PLANTED},
                   operation_id="joined-1", connection=conn)  # fmt: skip
        ob.enqueue_many([Intent(endpoint="rx", method="POST", path="/pay",
                                json={"card": PLANTED}, operation_id="joined-2")],
                        connection=conn)  # fmt: skip
    with ob.engine.connect() as conn:
        bodies = [r.body for r in conn.execute(select(operations.c.body))]
    assert len(bodies) == 5
    assert all(b.startswith("sealed:1:k1:") and PLANTED not in b for b in bodies)
    assert ob.get("many-1").body == {"card": PLANTED}
    assert ob.get("joined-2").body == {"card": PLANTED}


def test_rotation_without_the_old_key_stops_with_a_clear_error(make_ob: MakeOutbox) -> None:
    _enqueue(make_ob(ring(k1=K1)), "rot-x")
    new_only = make_ob(ring(k2=K2))
    before = _raw(new_only, "rot-x").body
    with pytest.raises(KeyUnavailableError, match="cannot rotate: key k1 not available"):
        rekey.rotate(new_only.store)
    assert _raw(new_only, "rot-x").body == before  # nothing written


def test_rotation_never_overwrites_a_value_written_after_it_read(make_ob: MakeOutbox) -> None:
    old = make_ob(ring(k1=K1))
    _enqueue(old, "race-1")
    both = make_ob(ring(k2=K2, k1=K1))
    stale = _raw(both, "race-1")
    rewrapped = both.store.sealer.rewrapped(stale.body)
    assert rewrapped is not None
    # Between rotation's read and its write, another writer changes the value.
    other = _raw(old, "race-1").headers
    with both.engine.begin() as conn:
        conn.execute(operations.update().where(operations.c.id == stale.id)
                     .values(body=other))  # fmt: skip
    changed = _raw(both, "race-1").body
    assert rekey._apply(both.store, [(stale.id, "body", stale.body, rewrapped)]) == 0
    assert _raw(both, "race-1").body == changed
