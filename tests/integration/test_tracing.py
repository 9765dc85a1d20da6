"""OpenTelemetry traces through the real SDK and its in-memory exporter: the trace
context active at enqueue is stored, every attempt span links to it, and the receiver
sees the attempt span's own ``traceparent``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import select
from tenacity import wait_fixed

from outbox import Endpoint, FakeClock, Outbox, RetryPolicy
from outbox.store.tables import operations
from outbox.testing.receiver import Receiver


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exporter))
    yield p
    p.shutdown()


def _outbox(db_url: str, receiver: Receiver, **kw: object) -> Outbox:
    return Outbox(
        db_url,
        endpoints=[Endpoint(name="rx", base_url=receiver.url + "/api", timeout=2.0,
                            retry=RetryPolicy(max_attempts=3, window=timedelta(minutes=5),
                                              wait=wait_fixed(1)),
                            key_retention=timedelta(hours=1))],
        clock=FakeClock(),
        auto_migrate=True,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _stored_traceparent(ob: Outbox, operation_id: str) -> str | None:
    with ob.store.read() as conn:
        value: str | None = conn.execute(
            select(operations.c.traceparent).where(operations.c.operation_id == operation_id)
        ).scalar_one()
    return value


def _traceparent(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def test_attempt_spans_link_to_the_enqueue_and_the_receiver_joins_the_trace(
    db_url: str, receiver: Receiver, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    ob = _outbox(db_url, receiver, tracer_provider=provider)
    clock = ob.clock
    assert isinstance(clock, FakeClock)
    tracer = provider.get_tracer("shop")
    try:
        with tracer.start_as_current_span("checkout") as checkout:
            ob.enqueue(endpoint="rx", method="POST", path="/orders?debug=1", json={"n": 1},
                       operation_id="traced")  # fmt: skip
        ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"n": 2},
                   operation_id="untraced")  # fmt: skip
        enqueue_ctx = checkout.get_span_context()
        assert _stored_traceparent(ob, "traced") == _traceparent(checkout)  # type: ignore[arg-type]
        assert _stored_traceparent(ob, "untraced") is None

        receiver.faults.drop_after_commit(key="traced")  # attempt 1: unknown; 2: replayed
        ob.dispatch_once()
        clock.advance(2)
        ob.dispatch_once()
        assert ob.get("traced").state.value == "succeeded"
        rows = ob.get("traced").attempts
    finally:
        ob.close()

    spans = exporter.get_finished_spans()
    claims = {s.context.span_id: s for s in spans if s.name == "outbox.claim"}
    attempts = [s for s in spans if s.name == "outbox.attempt"]
    traced = sorted(
        (s for s in attempts if s.attributes["outbox.operation_id"] == "traced"),
        key=lambda s: s.attributes["outbox.attempt"],
    )
    untraced = [s for s in attempts if s.attributes["outbox.operation_id"] == "untraced"]
    assert len(traced) == 2 and len(untraced) == 1
    seen = receiver.requests(key="traced")
    assert len(seen) == 2
    for n, (span, row, request) in enumerate(zip(traced, rows, seen, strict=True), start=1):
        assert span.kind is SpanKind.CLIENT
        # A child of the claim batch's span ...
        assert span.parent is not None and span.parent.span_id in claims
        assert claims[span.parent.span_id].attributes["outbox.claimed"] >= 1
        # ... linked to the trace that enqueued the operation ...
        assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [
            (enqueue_ctx.trace_id, enqueue_ctx.span_id)
        ]
        # ... and the receiver saw this very span as its parent.
        assert request.traceparent == _traceparent(span)
        attrs = span.attributes
        assert attrs["outbox.request_id"] == row.request_id == request.request_id
        assert attrs["outbox.attempt"] == n
        assert attrs["http.request.method"] == "POST"
        assert attrs["url.full"] == f"{receiver.url}/api/orders"  # the query is left out
        assert attrs["server.address"] == "127.0.0.1"
        assert attrs["outbox.delivery"] == row.delivery
    first, second = traced
    assert first.attributes["outbox.verdict"] == "retry"
    assert first.attributes["error.type"]
    assert first.status.status_code is StatusCode.ERROR
    assert "http.response.status_code" not in first.attributes
    assert second.attributes["http.response.status_code"] == 201
    assert second.attributes["outbox.verdict"] == "success"
    assert second.attributes["http.request.resend_count"] == 1
    assert second.status.status_code is StatusCode.UNSET
    # An operation enqueued outside any span: its attempt has no link, still a trace.
    assert untraced[0].links == ()
    untraced_request = receiver.requests(key="untraced")[0]
    assert untraced_request.traceparent == _traceparent(untraced[0])


def test_a_no_op_provider_switches_tracing_off(
    db_url: str, receiver: Receiver, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    ob = _outbox(db_url, receiver, tracer_provider=trace.NoOpTracerProvider())
    try:
        with provider.get_tracer("shop").start_as_current_span("checkout"):
            ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="off")
        assert _stored_traceparent(ob, "off") is None
        ob.dispatch_once()
    finally:
        ob.close()
    assert [s.name for s in exporter.get_finished_spans()] == ["checkout"]
    assert receiver.requests(key="off")[0].traceparent is None


def test_without_an_sdk_nothing_is_stored_and_no_header_is_sent(
    tmp_path: Path, receiver: Receiver
) -> None:
    """The API alone (no SDK configured): spans are non-recording, nothing is stored."""
    code = f"""
from opentelemetry import trace
from outbox import Endpoint, Outbox
from sqlalchemy import text
ob = Outbox("sqlite:///{tmp_path / 'x.sqlite3'}",
            endpoints=[Endpoint(name="rx", base_url="{receiver.url}")])
with trace.get_tracer("app").start_as_current_span("checkout"):
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={{}}, operation_id="no-sdk")
ob.dispatch_once()
with ob.engine.connect() as conn:
    print(conn.execute(text("SELECT traceparent FROM outbox_operations")).scalar())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == "None"
    assert done.stderr == ""
    [request] = receiver.requests(key="no-sdk")
    assert request.outcome == "applied"
    assert request.traceparent is None


def test_metrics_and_tracing_together(
    db_url: str, receiver: Receiver, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    ob = _outbox(db_url, receiver, tracer_provider=provider)
    try:
        ob.metrics(registry=registry)
        with provider.get_tracer("shop").start_as_current_span("checkout"):
            ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="both")
        ob.dispatch_once()
    finally:
        ob.close()
    [attempt] = [s for s in exporter.get_finished_spans() if s.name == "outbox.attempt"]
    assert len(attempt.links) == 1
    assert receiver.requests(key="both")[0].traceparent == _traceparent(attempt)
    labels = {"endpoint": "rx", "delivery": "sent", "verdict": "success"}
    assert registry.get_sample_value("outbox_attempts_total", labels) == 1
    assert registry.get_sample_value(
        "outbox_attempt_duration_seconds_count", {"endpoint": "rx"}
    ) == 1
