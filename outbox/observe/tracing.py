"""OpenTelemetry traces (the ``otel`` extra: opentelemetry-api; the application brings
and configures the SDK).

* At enqueue, the W3C ``traceparent`` of the active span is stored with the operation.
* A dispatcher opens one ``outbox.claim`` span per claimed batch and, as its children,
  one ``outbox.attempt`` span (kind CLIENT) per request sent. Each attempt span links
  to the enqueue-time trace context, carries the HTTP semantic-convention attributes
  and ``outbox.*`` ones, and its own ``traceparent`` goes out with the request, so the
  receiver's trace joins it.

Tracing is on when a tracer provider other than the API's no-op one is configured:
``Outbox(tracer_provider=...)`` or the global one (``trace.set_tracer_provider``) as
the dispatcher starts. Without the API installed or without an SDK, nothing is stored
and no hook runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from outbox.base.version import __version__
from outbox.observe.hooks import Instrumentation, Sending

if TYPE_CHECKING:
    from outbox.store.records import Claimed, Recovered, StartedAttempt
    from outbox.wire.transport import AttemptResult

#: W3C Trace Context only, whatever the application's global propagators: the column
#: and the header are ``traceparent``.
_W3C = TraceContextTextMapPropagator()
_TRACE_HEADERS = ("traceparent", "tracestate")


def configured(provider: Any = None) -> trace.TracerProvider | None:
    """The tracer provider to use, or None when tracing is off (no SDK configured)."""
    chosen = provider if provider is not None else trace.get_tracer_provider()
    if isinstance(chosen, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return chosen


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the active span, if there is a valid one."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    value = carrier.get("traceparent")
    return value if value is not None and len(value) <= 55 else None


def _link(traceparent: str | None) -> list[Link]:
    if not traceparent:
        return []
    ctx = trace.get_current_span(_W3C.extract({"traceparent": traceparent})).get_span_context()
    return [Link(ctx)] if ctx.is_valid else []


class Tracing(Instrumentation):
    """The dispatcher's instrumentation that makes spans (see the module docstring)."""

    def __init__(self, provider: trace.TracerProvider) -> None:
        self.tracer = provider.get_tracer("outbox", __version__)

    def claimed(
        self, claimed: Sequence[Claimed], recovered: Sequence[Recovered], started_ns: int
    ) -> Any:
        # A root span: the dispatcher's loop has no trace of its own to continue.
        return self.tracer.start_span(
            "outbox.claim",
            context=Context(),
            kind=SpanKind.INTERNAL,
            start_time=started_ns,
            attributes={
                "outbox.claimed": len(claimed),
                "outbox.lease_expirations": len(recovered),
            },
        )

    def attempts_begun(self, batch: Any, started: Sequence[StartedAttempt], now_ms: int) -> None:
        if batch is not None:
            batch.set_attribute("outbox.attempts", len(started))
            batch.end()

    def attempt_started(self, batch: Any, sending: Sending) -> Any:
        # The attempt row is committed and the request about to leave: a tracing
        # failure must not stop it (it would leave the attempt open, "maybe sent").
        try:
            return self._start(batch, sending)
        except Exception:
            return None

    def _start(self, batch: Any, sending: Sending) -> Any:
        claimed, endpoint, started = sending.claimed, sending.endpoint, sending.started
        headers = sending.headers
        base = urlsplit(endpoint.base_url)
        path = claimed.path.split("?", 1)[0]  # the query may carry values: left out
        attributes: dict[str, Any] = {
            "http.request.method": claimed.method,
            # Never the userinfo (Endpoint refuses it; a span must not carry it anyway).
            "url.full": f"{base.scheme}://{base.netloc.rpartition('@')[2]}"
            f"{base.path.rstrip('/')}{path}",
            "server.address": base.hostname or "",
            "server.port": base.port or (443 if base.scheme == "https" else 80),
            "outbox.operation_id": claimed.operation_id,
            "outbox.tenant": claimed.tenant,
            "outbox.endpoint": endpoint.name,
            "outbox.request_id": started.request_id,
            "outbox.attempt": started.number,
        }
        if started.number > 1:
            attributes["http.request.resend_count"] = started.number - 1
        parent = trace.set_span_in_context(batch) if batch is not None else Context()
        span = self.tracer.start_span(
            "outbox.attempt",
            context=parent,
            kind=SpanKind.CLIENT,
            links=_link(claimed.traceparent),
            attributes=attributes,
        )
        for name in [k for k in headers if k.lower() in _TRACE_HEADERS]:
            del headers[name]
        _W3C.inject(headers, context=trace.set_span_in_context(span))
        return span

    def attempt_sent(self, attempt: Any, result: AttemptResult) -> None:
        if attempt is None:
            return
        span = attempt
        cls = result.classification
        span.set_attribute("outbox.delivery", cls.delivery.value)
        span.set_attribute("outbox.verdict", cls.verdict.value)
        if result.status_code is not None:
            span.set_attribute("http.response.status_code", result.status_code)
        failed = result.status_code is None or result.status_code >= 400
        if failed:
            span.set_attribute("error.type", result.error_class or str(result.status_code))
            span.set_status(Status(StatusCode.ERROR, result.error_class))
        span.end()
