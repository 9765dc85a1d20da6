"""Prometheus metrics, through the real thing: ``outbox dispatch --metrics-port`` runs as
a subprocess, operations go through every outcome against the test receiver, and
``/metrics`` is scraped over HTTP and parsed with prometheus_client's own parser. Every
count must equal what the outbox tables say.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from outbox import Outbox, State
from outbox.store.tables import attempts, operations
from outbox.testing.receiver import Receiver
from tests.integration._reconcile_states import closed_port_url
from tests.support import observed_app

APP = "tests.support.observed_app:outbox"
REPO = Path(__file__).resolve().parents[2]
OUTBOX = Path(sys.executable).with_name("outbox")
SETTLED = [State.SUCCEEDED.value, State.FAILED.value, State.UNRESOLVED.value]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(port: int) -> Samples:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    # A failing collector turns the scrape into wsgiref's error page: say so.
    assert response.status_code == 200, (response.status_code, response.text[:500])
    text = response.text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _by(samples: Samples, name: str, *labels: str) -> dict[tuple[str, ...], int]:
    """{label values: value} of one sample name, zero values left out."""
    out: dict[tuple[str, ...], int] = {}
    for (sample, pairs), value in samples.items():
        if sample == name and value:
            d = dict(pairs)
            out[tuple(d[k] for k in labels)] = int(value)
    return out


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def app_env(db_url: str, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {
        "OUTBOX_TEST_DB": db_url,
        "OUTBOX_TEST_RECEIVER_URL": receiver.url,
        "OUTBOX_TEST_OFFLINE_URL": closed_port_url(),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _enqueue_every_outcome(ob: Outbox, receiver: Receiver) -> None:
    rx = receiver.faults
    rx.drop_after_commit(key="lost")  # unknown, then the replay succeeds
    rx.fail_before_work(503, retry_after=None, key="busy")  # retries_exhausted
    rx.fail_after_commit(500, stored=True, key="broken")  # outcome_unknown
    rx.stuck_in_progress("stuck")  # 409s until the window closes
    # Another intent already holds the key "conflict" at the receiver: 422.
    httpx.post(f"{receiver.url}/orders", json={"other": True},
               headers={"Idempotency-Key": "conflict"}, timeout=10).raise_for_status()  # fmt: skip
    for op_id in ("ok-1", "ok-2", "lost", "busy", "broken", "conflict"):
        ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"op": op_id},
                   operation_id=op_id)  # fmt: skip
    ob.enqueue(endpoint="rx", method="GET", path="/nothing-here", operation_id="rejected")
    ob.enqueue(endpoint="offline", method="POST", path="/orders", json={}, operation_id="dark")
    ob.enqueue(endpoint="slow", method="POST", path="/orders", json={}, operation_id="stuck")


def _table_counts(ob: Outbox) -> dict[str, Any]:
    o, a = operations, attempts
    with ob.store.read() as conn:
        tried = conn.execute(
            select(o.c.endpoint, a.c.delivery, a.c.verdict, func.count())
            .select_from(a.join(o, a.c.operation_pk == o.c.id))
            .group_by(o.c.endpoint, a.c.delivery, a.c.verdict)
        ).all()
        settled = conn.execute(
            select(o.c.endpoint, o.c.state, o.c.reason, func.count())
            .where(o.c.state.in_(SETTLED))
            .group_by(o.c.endpoint, o.c.state, o.c.reason)
        ).all()
        started = conn.execute(
            select(o.c.endpoint, func.count())
            .where(o.c.first_attempt_at.is_not(None))
            .group_by(o.c.endpoint)
        ).all()
    return {
        "attempts": {(r[0], r[1], r[2] or "none"): r[3] for r in tried},
        "finished": {(r[0], r[1], r[2] or ""): r[3] for r in settled},
        "started": {(r[0],): r[1] for r in started},
    }


def test_scraped_metrics_equal_the_outbox_tables(
    app_env: dict[str, str], receiver: Receiver
) -> None:
    with observed_app.build() as ob:
        _enqueue_every_outcome(ob, receiver)
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        proc = subprocess.Popen(
            [str(OUTBOX), "--app", APP, "--log-level", "error", "dispatch",
             "--metrics-port", str(port)],
            env={**env, **app_env, "OUTBOX_TEST_METRICS_CACHE": "0", "PYTHONPATH": str(REPO)},
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            total = 9
            # Wait (bounded by the test timeout) until every operation is settled and
            # the dispatcher holds nothing: then each recorded outcome has been counted.
            while True:
                assert proc.poll() is None, proc.communicate()
                try:
                    samples = _scrape(port)
                except httpx.TransportError:
                    time.sleep(0.1)
                    continue
                except AssertionError:
                    proc.terminate()
                    raise AssertionError(proc.communicate(timeout=30)[1][-4000:]) from None
                finished = sum(_by(samples, "outbox_operations_finished_total",
                                   "endpoint", "state", "reason").values())  # fmt: skip
                idle = samples.get(("outbox_dispatcher_requests_in_flight", ())) == 0
                if finished == total and idle:
                    break
                time.sleep(0.2)

            tables = _table_counts(ob)
            states = Counter(ob.get(i).state.value for i in (
                "ok-1", "ok-2", "lost", "busy", "broken", "conflict", "rejected", "dark",
                "stuck"))  # fmt: skip
            assert states == {"succeeded": 3, "failed": 1, "unresolved": 5}
            # Every outcome the dispatcher can record was reached ...
            assert {(d, v) for _, d, v in tables["attempts"]} >= {
                ("sent", "success"), ("sent", "retry"), ("sent", "failed"),
                ("sent", "key_conflict"), ("sent", "in_progress"), ("unknown", "retry"),
                ("not_sent", "retry"),
            }  # fmt: skip
            assert {(s, r) for _, s, r in tables["finished"]} == {
                ("succeeded", ""), ("failed", ""), ("unresolved", "retries_exhausted"),
                ("unresolved", "outcome_unknown"), ("unresolved", "key_conflict"),
                ("unresolved", "never_delivered"),
            }  # fmt: skip
            # ... and the scrape says exactly what the tables say.
            assert _by(samples, "outbox_attempts_total",
                       "endpoint", "delivery", "verdict") == tables["attempts"]  # fmt: skip
            assert _by(samples, "outbox_operations_finished_total",
                       "endpoint", "state", "reason") == tables["finished"]  # fmt: skip
            assert _by(samples, "outbox_enqueue_to_first_attempt_seconds_count",
                       "endpoint") == tables["started"]  # fmt: skip
            sends: Counter[tuple[str, ...]] = Counter()
            for (endpoint, _, verdict), n in tables["attempts"].items():
                if verdict != "none":
                    sends[(endpoint,)] += n
            assert _by(samples, "outbox_attempt_duration_seconds_count", "endpoint") == sends
            settle: Counter[tuple[str, ...]] = Counter()
            for (endpoint, state, _), n in tables["finished"].items():
                settle[(endpoint, state)] += n
            assert _by(samples, "outbox_enqueue_to_settled_seconds_count",
                       "endpoint", "state") == settle  # fmt: skip
            # Store-backed gauges (cache off in this app): the reconciliation queue.
            unresolved: Counter[tuple[str, ...]] = Counter()
            for (_, state, reason), n in tables["finished"].items():
                if state == "unresolved":
                    unresolved[(reason,)] += n
            assert _by(samples, "outbox_unresolved_operations", "reason") == unresolved
            assert _by(samples, "outbox_due_operations", "endpoint") == {}
            assert _by(samples, "outbox_in_flight_operations", "endpoint") == {}
            assert _by(samples, "outbox_lease_expirations_total", "endpoint") == {}
            assert _by(samples, "outbox_fenced_writes_total", "endpoint") == {}

            base = f"http://127.0.0.1:{port}"
            assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
            assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200
            assert httpx.get(f"{base}/other", timeout=10).status_code == 404
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err


def test_health_endpoints_follow_the_loop_and_the_database(tmp_path: Path) -> None:
    """/healthz: the event loop turned recently; /readyz: the database answered recently.
    Driven in-process through the real server, with the timestamps set by the test."""
    from prometheus_client import CollectorRegistry

    from outbox.observe.metrics import serve

    with Outbox(f"sqlite:///{tmp_path / 'o.sqlite3'}") as ob:
        metrics = ob.metrics(registry=CollectorRegistry())
        server = serve(metrics)
        base = f"http://127.0.0.1:{server.port}"
        try:
            # No dispatcher running yet: neither healthy nor ready.
            assert httpx.get(f"{base}/healthz").status_code == 503
            assert httpx.get(f"{base}/readyz").status_code == 503

            class Stub:
                in_flight = 3
                db_answered_at: float | None = time.monotonic()

            stub = Stub()
            metrics._dispatchers.append(stub)  # type: ignore[arg-type]
            metrics.loop_turned_at = time.monotonic()
            assert httpx.get(f"{base}/healthz").status_code == 200
            assert httpx.get(f"{base}/readyz").status_code == 200
            assert _scrape(server.port)[("outbox_dispatcher_requests_in_flight", ())] == 3

            # A loop that stopped turning, a database that stopped answering.
            metrics.loop_turned_at = time.monotonic() - server.stall_seconds - 1
            stub.db_answered_at = time.monotonic() - server.ready_within_seconds - 1
            assert httpx.get(f"{base}/healthz").status_code == 503
            assert httpx.get(f"{base}/readyz").status_code == 503
        finally:
            server.close()


def test_a_second_registration_in_one_registry_is_a_clear_error(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from outbox import ConfigurationError

    registry = CollectorRegistry()
    with (
        Outbox(f"sqlite:///{tmp_path / 'a.sqlite3'}") as a,
        Outbox(f"sqlite:///{tmp_path / 'b.sqlite3'}") as b,
    ):
        assert a.metrics(registry=registry) is a.metrics()
        with pytest.raises(ConfigurationError, match="pass registry="):
            b.metrics(registry=registry)
        with pytest.raises(ConfigurationError, match="registered elsewhere"):
            a.metrics(registry=CollectorRegistry())


def test_without_metrics_or_tracing_nothing_of_them_is_imported(tmp_path: Path) -> None:
    """Off means absent: a dispatch imports neither prometheus_client nor opentelemetry."""
    code = (
        "import sys\n"
        "from outbox import Endpoint, Outbox\n"
        f"ob = Outbox('sqlite:///{tmp_path / 'x.sqlite3'}',\n"
        "            endpoints=[Endpoint(name='rx', base_url='http://127.0.0.1:9')])\n"
        "ob.enqueue(endpoint='rx', method='POST', path='/', json={})\n"
        "ob.dispatch_once()\n"
        "print(sorted(m for m in sys.modules\n"
        "            if m.startswith(('prometheus_client', 'opentelemetry'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]"
