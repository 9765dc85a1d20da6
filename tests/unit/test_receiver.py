"""The test receiver, over real HTTP; effects are asserted from its own SQLite tables."""

from __future__ import annotations

import inspect
import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox.testing.receiver import (
    Faults,
    RandomFaults,
    Receiver,
    Refuse,
    RemoteReceiver,
    SpawnOptions,
    Target,
)
from outbox.testing.receiver.remote import spawn_argv


@pytest.fixture
def rx() -> Iterator[Receiver]:
    with Receiver() as receiver:
        yield receiver


@pytest.fixture
def client(rx: Receiver) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=rx.url, timeout=5.0) as c:
        yield c


def post(
    client: httpx.Client,
    key: str | None,
    body: Any,
    *,
    rid: str | None = None,
    tenant: str | None = None,
    path: str = "/orders",
) -> httpx.Response:
    headers = {}
    if key is not None:
        headers["Idempotency-Key"] = key
    if rid is not None:
        headers["X-Request-ID"] = rid
    if tenant is not None:
        headers["X-Tenant"] = tenant
    return client.post(path, json=body, headers=headers)


# ------------------------------------------------------------------ receipts


def test_new_key_applies_one_effect(rx: Receiver, client: httpx.Client) -> None:
    r = post(client, "k1", {"operation_id": "op-1", "amount": 5}, rid="req-1", tenant="t1")
    assert r.status_code == 201
    assert r.headers["X-Request-ID"] == "req-1"
    assert "Idempotent-Replayed" not in r.headers
    effects = rx.effects()
    assert len(effects) == 1
    e = effects[0]
    assert r.json() == {
        "effect_id": e.id,
        "tenant": "t1",
        "key": "k1",
        "received": {"operation_id": "op-1", "amount": 5},
    }
    assert (e.tenant, e.key, e.method, e.path) == ("t1", "k1", "POST", "/orders")
    assert json.loads(e.body) == {"operation_id": "op-1", "amount": 5}
    assert e.client_operation_id == "op-1"
    assert e.request_id == "req-1"
    [log] = rx.requests()
    assert (log.outcome, log.status, log.key, log.request_id) == ("applied", 201, "k1", "req-1")
    assert log.body_sha256 == e.body_sha256
    assert abs(log.arrived_at_ms - time.time() * 1000) < 60_000


def test_replay_returns_stored_response_with_current_request_id(
    rx: Receiver, client: httpx.Client
) -> None:
    first = post(client, "k1", {"a": 1, "b": 2}, rid="req-1")
    # Same canonical payload: key order and whitespace do not matter.
    again = client.post(
        "/orders",
        content=b'{ "b": 2,  "a": 1 }',
        headers={"Idempotency-Key": "k1", "X-Request-ID": "req-2"},
    )
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["X-Request-ID"] == "req-2"
    assert again.headers["Idempotent-Replayed"] == "true"
    assert rx.effect_count() == 1
    assert [q.outcome for q in rx.requests(key="k1")] == ["applied", "replayed"]
    assert [q.request_id for q in rx.requests(key="k1")] == ["req-1", "req-2"]


def test_key_reused_with_another_payload_is_422_and_keeps_first(
    rx: Receiver, client: httpx.Client
) -> None:
    first = post(client, "k1", {"a": 1})
    for other in (
        post(client, "k1", {"a": 2}, rid="req-x"),
        post(client, "k1", {"a": 1}, path="/elsewhere"),
        client.put("/orders", json={"a": 1}, headers={"Idempotency-Key": "k1"}),
    ):
        assert other.status_code == 422
        assert other.json()["error"] == "idempotency_key_reused"
    assert rx.effect_count() == 1
    assert post(client, "k1", {"a": 1}).content == first.content
    assert [q.outcome for q in rx.requests()] == [
        "applied",
        "conflict",
        "conflict",
        "conflict",
        "replayed",
    ]


def test_tenants_scope_keys(rx: Receiver, client: httpx.Client) -> None:
    assert post(client, "same", {"a": 1}, tenant="t1").status_code == 201
    assert post(client, "same", {"a": 1}, tenant="t2").status_code == 201
    assert post(client, "same", {"a": 1}).status_code == 201  # no header: tenant ""
    assert rx.effect_count(key="same") == 3
    assert [e.tenant for e in rx.effects(key="same")] == ["t1", "t2", ""]
    assert rx.effect_count(tenant="t1") == 1


def test_custom_tenant_header() -> None:
    with Receiver(tenant_header="X-Account") as rx, httpx.Client(base_url=rx.url) as c:
        c.post("/x", json={}, headers={"Idempotency-Key": "k", "X-Account": "acme"})
        assert [e.tenant for e in rx.effects()] == ["acme"]


def test_missing_key_is_400_without_effect(rx: Receiver, client: httpx.Client) -> None:
    r = post(client, None, {"a": 1}, rid="req-1")
    assert r.status_code == 400
    assert r.json() == {"error": "missing_idempotency_key"}
    assert r.headers["X-Request-ID"] == "req-1"
    assert rx.effect_count() == 0
    assert [(q.outcome, q.status) for q in rx.requests()] == [("missing_key", 400)]


def test_non_json_body_is_hashed_raw(rx: Receiver, client: httpx.Client) -> None:
    headers = {"Idempotency-Key": "raw", "Content-Type": "text/plain"}
    assert client.post("/raw", content=b"hello", headers=headers).status_code == 201
    assert client.post("/raw", content=b"hello", headers=headers).status_code == 201
    assert client.post("/raw", content=b"hello ", headers=headers).status_code == 422
    [e] = rx.effects()
    assert (e.body, e.client_operation_id) == ("hello", None)


def test_status_lookup_route(rx: Receiver, client: httpx.Client) -> None:
    r = client.get("/operations/k1", headers={"X-Tenant": "t1"})
    assert (r.status_code, r.json()) == (404, {"state": "unknown_key"})
    created = post(client, "k1", {"a": 1}, tenant="t1")
    r = client.get("/operations/k1", headers={"X-Tenant": "t1", "X-Request-ID": "look"})
    assert r.status_code == 200
    assert r.headers["X-Request-ID"] == "look"
    assert r.json() == {"state": "applied", "response": {"status": 201, "body": created.json()}}
    assert client.get("/operations/k1").status_code == 404  # other tenant
    rx.faults.stuck_in_progress("k2")
    assert client.get("/operations/k2").json() == {"state": "processing"}
    assert rx.effect_count() == 1
    assert [q.outcome for q in rx.requests()].count("lookup") == 4


def test_concurrent_identical_requests_make_one_effect(rx: Receiver) -> None:
    barrier = threading.Barrier(20)
    statuses: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=rx.url, timeout=10.0) as c:
            barrier.wait()
            statuses.append(post(c, "hot", {"a": 1}).status_code)

    threads = [threading.Thread(target=send) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(statuses) == 20
    assert set(statuses) <= {201, 409}
    assert rx.effect_count(key="hot") == 1
    outcomes = [q.outcome for q in rx.requests(key="hot")]
    assert outcomes.count("applied") == 1
    assert set(outcomes) <= {"applied", "replayed", "in_progress"}


def test_admin_routes_are_not_logged(rx: Receiver, client: httpx.Client) -> None:
    assert client.get("/__receiver/health").json()["ok"] is True
    spec = {"kind": "fail_before_work", "status": 429, "retry_after": None, "times": 1}
    assert client.post("/__receiver/faults", json=spec).status_code == 200
    assert client.get("/__receiver/faults").json()["faults"][0]["status"] == 429
    bad = client.post("/__receiver/faults", json={"kind": "explode"})
    assert (bad.status_code, bad.json()["error"]) == (400, "invalid_fault")
    assert client.post("/__receiver/faults/clear").status_code == 200
    assert client.get("/__receiver/faults").json() == {"faults": []}
    assert rx.requests() == []
    assert rx.effect_count() == 0


# ------------------------------------------------------------------ faults


def test_drop_after_commit_then_retry_replays(rx: Receiver, client: httpx.Client) -> None:
    rx.faults.drop_after_commit(times=1)
    with pytest.raises(httpx.TransportError):
        post(client, "k1", {"a": 1}, rid="attempt-1")
    assert rx.effect_count(key="k1") == 1  # committed although the client saw nothing
    retry = post(client, "k1", {"a": 1}, rid="attempt-2")
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.headers["X-Request-ID"] == "attempt-2"
    assert rx.effect_count(key="k1") == 1
    log = rx.requests(key="k1")
    assert [(q.outcome, q.status) for q in log] == [
        ("fault:drop_after_commit", None),
        ("replayed", 201),
    ]


def test_drop_after_commit_narrowed_and_random(rx: Receiver, client: httpx.Client) -> None:
    rx.faults.drop_after_commit(key="target")
    assert post(client, "other", {}).status_code == 201
    with pytest.raises(httpx.TransportError):
        post(client, "target", {})
    rx.faults.drop_after_commit(probability=0.5, seed=7)
    dropped = 0
    for i in range(20):
        try:
            post(client, f"r{i}", {"i": i})
        except httpx.TransportError:
            dropped += 1
    assert 0 < dropped < 20
    assert rx.effect_count() == 22
    assert sum(q.outcome == "fault:drop_after_commit" for q in rx.requests()) == dropped + 1


def test_a_misspelt_fault_keyword_is_refused_and_adds_no_rule(
    rx: Receiver, client: httpx.Client
) -> None:
    with pytest.raises(TypeError, match=r"drop_after_commit.*keys"):
        rx.faults.drop_after_commit(keys="target")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"hang_after_commit.*paths"):
        rx.faults.hang_after_commit(paths="/x")  # type: ignore[call-arg]
    assert client.get("/__receiver/faults").json()["faults"] == []
    rx.faults.drop_after_commit(key="target")  # the same call spelt right adds one
    assert [f["key"] for f in client.get("/__receiver/faults").json()["faults"]] == ["target"]


def test_every_fault_rule_takes_the_one_targeting_list() -> None:
    """The keyword options a rule's targeting takes are :class:`Target`'s, for every
    kind but the key-only ``stuck_in_progress`` and the global ``rate_limit``."""
    kinds = ("drop_after_commit", "fail_before_work", "fail_after_commit",
             "delay_after_commit", "hang_after_commit")  # fmt: skip
    for kind in kinds:
        params = inspect.signature(getattr(Faults, kind)).parameters
        assert params["target"].kind is inspect.Parameter.VAR_KEYWORD, kind
        assert "times" in params, kind
    assert set(Target.__optional_keys__) == {"probability", "seed", "key", "path"}


def test_fail_before_work_makes_no_effect(rx: Receiver, client: httpx.Client) -> None:
    rx.faults.fail_before_work(503, retry_after="2", times=2)
    for _ in range(2):
        r = post(client, "k1", {"a": 1}, rid="r")
        assert r.status_code == 503
        assert r.headers["Retry-After"] == "2"
        assert r.headers["X-Request-ID"] == "r"
        assert rx.effect_count() == 0
        assert rx.receipts() == []
    assert post(client, "k1", {"a": 1}).status_code == 201
    assert [q.outcome for q in rx.requests()] == [
        "fault:fail_before_work",
        "fault:fail_before_work",
        "applied",
    ]
    rx.faults.fail_before_work(429, retry_after=None)  # times=None: always
    for key in ("k1", "k2", "k3"):
        r = post(client, key, {"a": 1})
        assert r.status_code == 429
        assert "Retry-After" not in r.headers
    assert rx.effect_count() == 1


def test_fail_after_commit_unstored_then_replays_success(
    rx: Receiver, client: httpx.Client
) -> None:
    rx.faults.fail_after_commit(500)
    assert post(client, "k1", {"a": 1}).status_code == 500
    assert rx.effect_count() == 1
    again = post(client, "k1", {"a": 1})
    assert (again.status_code, again.headers["Idempotent-Replayed"]) == (201, "true")
    assert rx.effect_count() == 1


def test_fail_after_commit_stored_replays_500_forever(rx: Receiver, client: httpx.Client) -> None:
    rx.faults.fail_after_commit(500, stored=True)
    first = post(client, "k1", {"a": 1})
    assert first.status_code == 500
    for i in range(3):
        again = post(client, "k1", {"a": 1}, rid=f"r{i}")
        assert again.status_code == 500
        assert again.content == first.content
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.headers["X-Request-ID"] == f"r{i}"
    assert rx.effect_count() == 1
    assert rx.requests()[0].outcome == "fault:fail_after_commit_stored"


def test_delay_after_commit(rx: Receiver, client: httpx.Client) -> None:
    rx.faults.delay_after_commit(0.3, key="slow")
    t0 = time.monotonic()
    assert post(client, "slow", {}).status_code == 201
    assert time.monotonic() - t0 >= 0.3
    rx.faults.delay_after_commit(2.0)
    with pytest.raises(httpx.ReadTimeout):
        client.post("/orders", json={}, headers={"Idempotency-Key": "late"}, timeout=0.2)
    assert rx.effect_count(key="late") == 1  # the client timed out after the commit


def test_hang_after_commit_until_stop(rx: Receiver, client: httpx.Client) -> None:
    rx.faults.hang_after_commit(key="h")
    with pytest.raises(httpx.ReadTimeout):
        client.post("/orders", json={}, headers={"Idempotency-Key": "h"}, timeout=0.3)
    assert rx.effect_count(key="h") == 1
    assert [(q.outcome, q.status) for q in rx.requests(key="h")] == [
        ("fault:hang_after_commit", None)
    ]
    assert post(client, "other", {}).status_code == 201  # other keys are answered
    t0 = time.monotonic()
    rx.stop()  # releases the held socket promptly
    assert time.monotonic() - t0 < 3


def test_stuck_in_progress_is_409_forever(rx: Receiver, client: httpx.Client) -> None:
    rx.faults.stuck_in_progress("k1", tenant="t1")
    for _ in range(3):
        r = post(client, "k1", {"a": 1}, tenant="t1")
        assert (r.status_code, r.json()) == (409, {"error": "idempotency_key_in_use"})
    assert post(client, "k1", {"a": 1}, tenant="t2").status_code == 201
    rx.stop()
    rx.start()  # stuck survives a restart
    assert post(client, "k1", {"a": 1}, tenant="t1").status_code == 409
    assert rx.effect_count(tenant="t1") == 0
    rx.faults.clear()
    assert post(client, "k1", {"a": 1}, tenant="t1").status_code == 201
    assert rx.effect_count(tenant="t1") == 1


def test_key_ttl_forgets_receipts() -> None:
    with Receiver(key_ttl_seconds=0.3) as rx, httpx.Client(base_url=rx.url) as c:
        assert post(c, "k", {"a": 1}).status_code == 201
        assert post(c, "k", {"a": 1}).headers["Idempotent-Replayed"] == "true"
        time.sleep(0.35)
        late = post(c, "k", {"a": 1})
        assert late.status_code == 201
        assert "Idempotent-Replayed" not in late.headers
        assert rx.effect_count(key="k") == 2  # a resend after the window shows up


def test_restart_keeps_receipts_and_port(tmp_path: Path) -> None:
    db = tmp_path / "rx.db"
    with Receiver(db) as rx:
        url = rx.url
        with httpx.Client(base_url=url) as c:
            first = post(c, "k", {"a": 1})
        rx.stop()
        with pytest.raises(httpx.ConnectError), httpx.Client(base_url=url) as c:
            post(c, "k", {"a": 1})
        rx.start()
        assert rx.url == url
        with httpx.Client(base_url=url) as c:
            again = post(c, "k", {"a": 1})
        assert again.content == first.content
        assert again.headers["Idempotent-Replayed"] == "true"
    assert db.exists()  # a caller-provided file is kept
    with Receiver(db) as rx2, httpx.Client(base_url=rx2.url) as c:
        assert post(c, "k", {"a": 1}).headers["Idempotent-Replayed"] == "true"
        assert rx2.effect_count() == 1


def test_temporary_db_is_deleted_on_close() -> None:
    rx = Receiver()
    with rx:
        path = rx.db_path
        assert path.exists()
    assert not path.exists()


def test_handler_and_refuse() -> None:
    def handler(
        conn: sqlite3.Connection, tenant: str, method: str, path: str, body: Any
    ) -> tuple[int, Any]:
        conn.execute("CREATE TABLE IF NOT EXISTS settings (tenant TEXT, value INTEGER)")
        conn.execute("INSERT INTO settings VALUES (?, ?)", (tenant, body["value"]))
        if body["value"] < 0:
            raise Refuse(409, {"error": "version_conflict"})
        return 200, {"saved": body["value"]}

    with Receiver(handler=handler) as rx, httpx.Client(base_url=rx.url) as c:
        refused = post(c, "k", {"value": -1})
        assert (refused.status_code, refused.json()) == (409, {"error": "version_conflict"})
        assert rx.effect_count() == 0
        assert rx.receipts() == []  # the key may be retried, even with another payload
        ok = post(c, "k", {"value": 3})
        assert (ok.status_code, ok.json()) == (200, {"saved": 3})
        assert post(c, "k", {"value": 3}).headers["Idempotent-Replayed"] == "true"
        assert rx.effect_count() == 1
        with sqlite3.connect(rx.db_path) as conn:
            assert conn.execute("SELECT tenant, value FROM settings").fetchall() == [("", 3)]
        conn.close()
        assert [q.outcome for q in rx.requests()] == ["refused", "applied", "replayed"]


def test_random_faults_in_process() -> None:
    faults = RandomFaults(seed=3, p_stuck=1.0)
    with Receiver(random_faults=faults) as rx, httpx.Client(base_url=rx.url) as c:
        assert post(c, "k", {}).status_code == 409
        assert post(c, "k", {}).status_code == 409
        assert rx.effect_count() == 0
        assert [r.stuck for r in rx.receipts()] == [True]


# ------------------------------------------------------------------ its own process


def test_cli_prints_url_and_stops_on_sigterm(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox.testing.receiver", "--db", str(tmp_path / "rx.db")],
        stdout=subprocess.PIPE,
        cwd=root,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("listening http://127.0.0.1:")
        url = line.split()[1]
        with httpx.Client(base_url=url) as c:
            assert post(c, "k", {"a": 1}).status_code == 201
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert RemoteReceiver("http://unused", tmp_path / "rx.db").effect_count(key="k") == 1


def test_spawned_receiver_with_faults_over_admin_routes(tmp_path: Path) -> None:
    with Receiver.spawn(tmp_path / "rx.db", key_ttl_seconds=60) as remote:
        assert remote.health()
        with httpx.Client(base_url=remote.url, timeout=5.0) as c:
            remote.faults.drop_after_commit(key="d")
            with pytest.raises(httpx.TransportError):
                post(c, "d", {"a": 1})
            assert remote.effect_count(key="d") == 1
            assert post(c, "d", {"a": 1}).headers["Idempotent-Replayed"] == "true"

            remote.faults.fail_before_work(503, retry_after="7", times=1)
            r = post(c, "f", {})
            assert (r.status_code, r.headers["Retry-After"]) == (503, "7")
            remote.faults.stuck_in_progress("s")
            assert post(c, "s", {}).status_code == 409
            remote.faults.clear()
            assert post(c, "s", {}).status_code == 201
            assert remote.effect_count() == 2
            with pytest.raises(ValueError, match="invalid_fault"):
                remote.faults.delay_after_commit(-1)

        # Restart the process: same file, same port, receipts kept.
        url = remote.url
        remote.stop()
        remote.start()
        assert remote.url == url
        with httpx.Client(base_url=remote.url) as c:
            assert post(c, "d", {"a": 1}).headers["Idempotent-Replayed"] == "true"
        assert [q.outcome for q in remote.requests(key="d")] == [
            "fault:drop_after_commit",
            "replayed",
            "replayed",
        ]


def test_spawned_receiver_random_faults_from_flags() -> None:
    faults = RandomFaults(seed=1, p_fail_before_work=1.0, retry_after="3")
    with Receiver.spawn(random_faults=faults) as remote, httpx.Client(base_url=remote.url) as c:
        r = post(c, "k", {})
        assert (r.status_code, r.headers["Retry-After"]) == (503, "3")
        remote.faults.clear()  # clears the start-up random faults too
        assert post(c, "k", {}).status_code == 201
        assert remote.effect_count() == 1


def test_spawn_takes_every_receiver_option_but_the_handler() -> None:
    # One list crosses the process boundary: an option Receiver gains and spawn does not
    # forward would be silently dropped in the child.
    params = inspect.signature(Receiver.__init__).parameters
    forwarded = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} - {"handler"}
    assert forwarded == set(SpawnOptions.__optional_keys__)


def test_spawned_receiver_takes_a_flaw_and_a_tenant_header(tmp_path: Path) -> None:
    with (
        Receiver.spawn(tmp_path / "rx.db", flaw="ignores_key", tenant_header="X-Org") as remote,
        httpx.Client(base_url=remote.url, timeout=5.0) as c,
    ):
        for _ in range(2):
            r = c.post("/orders", json={"a": 1}, headers={"Idempotency-Key": "k", "X-Org": "acme"})
            assert r.status_code == 201
    # The flaw reached the child: one key, two effects, both under the header's tenant.
    assert remote.effect_count(key="k", tenant="acme") == 2


def test_spawn_refuses_bad_options_before_or_as_the_child_starts(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unexpected options: bogus"):
        Receiver.spawn(tmp_path / "rx.db", bogus=1)  # type: ignore[call-arg]
    assert not (tmp_path / "rx.db").exists()  # nothing was started or created
    # As the in-process Receiver refuses them, before a child is started.
    for bad, says in [
        ({"dialect": "nope"}, "dialect must be one of"),
        ({"flaw": "bogus"}, "flaw must be one of"),
        ({"synchronous": "SOMETIMES"}, "synchronous must be one of"),
        ({"flaw": "forgets_keys_after"}, "needs key_ttl_seconds"),
    ]:
        with pytest.raises(ValueError, match=says):
            Receiver(tmp_path / "in.db", **bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=says):
            Receiver.spawn(tmp_path / "rx.db", **bad)  # type: ignore[arg-type]
    assert not (tmp_path / "rx.db").exists()


def test_the_command_leaves_receivers_defaults_to_the_receiver(tmp_path: Path) -> None:
    # Only what spawn was given crosses as a flag; left out, Receiver's default holds.
    assert spawn_argv({}) == []
    assert spawn_argv({"tenant_header": "-Org", "key_ttl_seconds": 1.5, "port": 80}) == [
        "--tenant-header=-Org",
        "--key-ttl-seconds=1.5",
    ]
