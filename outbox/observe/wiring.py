"""The facade's observability: Prometheus metrics and OpenTelemetry traces of an
:class:`~outbox.client.Outbox` (a mixin), each switched on only when asked for or when
the application already uses OpenTelemetry."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, cast

from outbox.errors import ConfigurationError
from outbox.observe.hooks import Instrumentation, combine

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from outbox.observe.metrics import OutboxMetrics
    from outbox.reconcile.parts import OutboxParts


class ObservabilityMethods:
    """``Outbox.metrics`` and the instrumentation its dispatchers record into."""

    _metrics: OutboxMetrics | None
    _tracing_off: bool
    _tracer_provider: Any

    def metrics(
        self, *, registry: CollectorRegistry | None = None, cache_seconds: float = 5.0
    ) -> OutboxMetrics:
        """Prometheus metrics of this outbox (needs the ``metrics`` extra).

        The first call registers them in ``registry`` (default: prometheus_client's
        global one) and every dispatcher this outbox starts afterwards records into
        them; later calls return the same object. Store-backed gauges are read at
        scrape time, at most every ``cache_seconds``.
        """
        if self._metrics is not None:
            if registry is not None and registry is not self._metrics.registry:
                raise ConfigurationError("this outbox's metrics are registered elsewhere")
            return self._metrics
        try:
            from outbox.observe.metrics import OutboxMetrics
        except ImportError as exc:
            raise ConfigurationError(
                "metrics need prometheus_client: pip install 'http-outbox[metrics]'"
            ) from exc
        try:
            parts = cast("OutboxParts", self)  # an Outbox is its own parts
            self._metrics = OutboxMetrics(parts, registry=registry, cache_seconds=cache_seconds)
        except ValueError as exc:  # duplicated time series in the registry
            raise ConfigurationError(
                f"{exc}: another outbox's metrics are in this registry; pass registry="
            ) from exc
        return self._metrics

    def _traceparent(self) -> str | None:
        """The active span's W3C trace context, stored with the operation: only when
        OpenTelemetry is in use (imported by the application) and not switched off."""
        if self._tracing_off or "opentelemetry.trace" not in sys.modules:
            return None
        from outbox.observe.tracing import current_traceparent

        return current_traceparent()

    def _instrumentation(self) -> Instrumentation:
        parts: list[Instrumentation] = []
        if self._metrics is not None:
            parts.append(self._metrics)
        if not self._tracing_off and (
            self._tracer_provider is not None or "opentelemetry.trace" in sys.modules
        ):
            from outbox.observe.tracing import Tracing, configured

            provider = configured(self._tracer_provider)
            if provider is not None:
                parts.append(Tracing(provider))
        return combine(parts)
