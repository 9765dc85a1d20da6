"""Prometheus metrics (the ``metrics`` extra: prometheus_client).

:class:`OutboxMetrics` is the dispatcher's instrumentation that counts (attempts,
finished operations, lease expirations, fenced writes, status lookups), times (attempt
duration, enqueue to first attempt, enqueue to settled) and, at scrape time, reads the
backlog from the store: one query, at most every ``cache_seconds``, whatever the scrape
rate. Get it with ``Outbox.metrics()``; serve it with :func:`serve` (the
``outbox dispatch --metrics-port`` option) or from your own registry.

Metric names (labels in braces):

* ``outbox_attempts_total{endpoint,delivery,verdict}``: attempt outcomes recorded
  (verdict ``none``: not sent by the lease check, closed after a lease expiry, or the
  not-sent evidence of an operation no dispatcher could send)
* ``outbox_operations_finished_total{endpoint,state,reason}``: operations a dispatcher
  settled (succeeded, failed, unresolved; reason empty unless unresolved)
* ``outbox_lease_expirations_total{endpoint}``: attempts found open after their
  dispatcher's lease expired (crash, kill, pause)
* ``outbox_fenced_writes_total{endpoint}``: outcomes dropped because another
  dispatcher held the lease
* ``outbox_status_lookups_total{endpoint,answer}``
* ``outbox_attempt_duration_seconds{endpoint}`` (histogram)
* ``outbox_enqueue_to_first_attempt_seconds{endpoint}`` (histogram)
* ``outbox_enqueue_to_settled_seconds{endpoint,state}`` (histogram)
* gauges read from the store: ``outbox_due_operations{endpoint}``,
  ``outbox_oldest_due_age_seconds{endpoint}``, ``outbox_unresolved_operations{reason}``,
  ``outbox_in_flight_operations{endpoint}``,
  ``outbox_operations_near_key_expiry{endpoint}``, ``outbox_operations_key_expired{endpoint}``,
  ``outbox_unsendable_operations{endpoint}``: every registered endpoint, 0 when it has
  no live operation
* ``outbox_dispatcher_requests_in_flight``: this process's operations on the wire
* ``outbox_endpoint_circuit_state{endpoint}``: 0 closed, 1 half open, 2 open, 3 paused
  (endpoints that never failed nor were paused have no sample)
* ``outbox_endpoint_rate_limit{endpoint}``: the fleet's current rate limit in requests
  per second, the lower of the declared ``rate_limit`` and the throttle's rate (no
  sample: nothing limits the endpoint's rate)
* ``outbox_endpoint_throttled{endpoint}``: 1 while the adaptive throttle holds the
  endpoint (429/503 answers taught the fleet a rate), else 0

The last three come from the snapshot's read of ``outbox_endpoints``, the one ``outbox
status`` and the console render (``Figures.endpoint_states`` and ``Figures.limits``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from outbox.base.logs import get_logger

if TYPE_CHECKING:
    from outbox.model import Reason, State
    from outbox.observe.hooks import RunningDispatcher, Sending
    from outbox.reconcile.parts import OutboxParts
    from outbox.reconcile.status import Figures
    from outbox.store.records import AttemptOutcome, Claimed, Recovered, StartedAttempt
    from outbox.wire.transport import AttemptResult

logger = get_logger("outbox.metrics")

#: ``outbox_endpoint_circuit_state`` values (3: paused by an operator).
_CIRCUIT_VALUES = {"closed": 0.0, "half_open": 1.0, "open": 2.0}
_DELAY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
_SETTLE_BUCKETS = (*_DELAY_BUCKETS, 4 * 3600, 24 * 3600)


class _Backlog(Collector):
    """Scrape-time gauges from one cached snapshot of the operator figures
    (:func:`outbox.reconcile.status.figures`, the computation ``outbox status`` and the
    console render), without the settled counts: a scrape reads the live rows only."""

    def __init__(self, outbox: OutboxParts, cache_seconds: float, metrics: OutboxMetrics) -> None:
        self._outbox = outbox
        self._cache_seconds = cache_seconds
        self._metrics = metrics
        self._lock = threading.Lock()
        self._snapshot: Figures | None = None
        self._taken_at = -float("inf")

    def snapshot(self) -> Figures | None:
        with self._lock:
            if time.monotonic() - self._taken_at >= self._cache_seconds:
                from outbox.reconcile.status import figures

                try:
                    self._snapshot = figures(
                        self._outbox, now_ms=self._outbox.clock.now_ms(), settled=False
                    )
                except Exception as exc:
                    # Serve the previous snapshot; /readyz tells whether the database answers.
                    logger.warning("metrics_backlog_failed", error=type(exc).__name__,
                                   detail=str(exc)[:300])  # fmt: skip
                self._taken_at = time.monotonic()
            return self._snapshot

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The families without values: registration never reads the store."""
        return self._families(None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return self._families(self.snapshot())

    def _families(self, snap: Figures | None) -> Iterator[GaugeMetricFamily]:
        in_flight_now = GaugeMetricFamily(
            "outbox_dispatcher_requests_in_flight",
            "Operations (a count) this process's dispatcher holds right now.",
        )
        in_flight_now.add_metric([], float(self._metrics.process_in_flight()))
        yield in_flight_now
        families = {
            name: GaugeMetricFamily(metric, help_text, labels=["endpoint"])
            for name, (metric, help_text) in _ENDPOINT_GAUGES.items()
        }
        # Every registered endpoint, with 0s: absent() and ratios need the series.
        endpoints = dict.fromkeys(sorted(self._outbox.endpoints))
        for name, e in sorted(snap.endpoints.items()) if snap else ():
            for key, family in families.items():
                value = getattr(e, key)
                family.add_metric([name], float(value or 0))
            endpoints.pop(name, None)
        for name in endpoints:
            for family in families.values():
                family.add_metric([name], 0.0)
        yield from families.values()
        unresolved = GaugeMetricFamily(
            "outbox_unresolved_operations",
            "Operations (a count) in the reconciliation queue, by reason.",
            labels=["reason"],
        )
        for reason, n in sorted(snap.unresolved_by_reason.items()) if snap else ():
            unresolved.add_metric([reason], n)
        yield unresolved
        circuit = GaugeMetricFamily(
            "outbox_endpoint_circuit_state",
            "The endpoint's circuit, fleet-wide (a state code: 0 closed, 1 half open, 2 open, "
            "3 paused).",
            labels=["endpoint"],
        )
        for state in snap.endpoint_states if snap else ():
            value = 3.0 if state.paused else _CIRCUIT_VALUES[state.circuit.value]
            circuit.add_metric([state.name], value)
        yield circuit
        rate = GaugeMetricFamily(
            "outbox_endpoint_rate_limit",
            "The endpoint's current rate limit (requests per second), fleet-wide: the lower "
            "of its declared rate_limit and the throttle's rate.",
            labels=["endpoint"],
        )
        throttled = GaugeMetricFamily(
            "outbox_endpoint_throttled",
            "Whether the fleet's adaptive throttle holds the endpoint after 429/503 answers "
            "(a flag: 1 throttled, 0 not).",
            labels=["endpoint"],
        )
        for name, limits in snap.limits.items() if snap else ():
            if limits.rate is not None:
                rate.add_metric([name], limits.rate)
            throttled.add_metric([name], 1.0 if limits.throttled else 0.0)
        yield rate
        yield throttled


#: EndpointFigures field -> (metric name, HELP text naming the unit)
_ENDPOINT_GAUGES = {
    "due": (
        "outbox_due_operations",
        "Operations (a count) due now: pending, or in flight past their lease.",
    ),
    "oldest_due_age_seconds": (
        "outbox_oldest_due_age_seconds",
        "Seconds the longest-waiting due operation has been due (0: none due).",
    ),
    "in_flight": ("outbox_in_flight_operations", "Operations (a count) claimed by a dispatcher."),
    "near_key_expiry": (
        "outbox_operations_near_key_expiry",
        "Live operations (a count) whose key the receiver forgets within the next hour.",
    ),
    "key_expired": (
        "outbox_operations_key_expired",
        "Live operations (a count) whose key the receiver has already forgotten.",
    ),
    "unsendable": (
        "outbox_unsendable_operations",
        "Pending operations (a count) no dispatcher can send (e.g. endpoint not registered).",
    ),
}


class OutboxMetrics:
    """Prometheus metrics of one outbox: the dispatcher's instrumentation plus
    scrape-time gauges, registered in ``registry`` (default: prometheus_client's)."""

    def __init__(
        self,
        outbox: OutboxParts,
        *,
        registry: CollectorRegistry | None = None,
        cache_seconds: float = 5.0,
        created_series: bool = False,
    ) -> None:
        if not created_series:
            # prometheus_client's ``*_created`` series double every counter and histogram
            # and no alert reads them. The switch is the library's, process-wide.
            disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else REGISTRY
        r = self.registry
        self.attempts = Counter(
            "outbox_attempts",
            "Attempts (a count) whose outcome was recorded, by delivery and verdict.",
            ["endpoint", "delivery", "verdict"], registry=r,
        )  # fmt: skip
        self.finished = Counter(
            "outbox_operations_finished", "Operations (a count) a dispatcher settled.",
            ["endpoint", "state", "reason"], registry=r,
        )  # fmt: skip
        self.lease_expirations = Counter(
            "outbox_lease_expirations",
            "Attempts (a count) found open after their dispatcher's lease expired.",
            ["endpoint"], registry=r,
        )  # fmt: skip
        self.fenced = Counter(
            "outbox_fenced_writes",
            "Outcome writes (a count) dropped: another dispatcher held the lease.",
            ["endpoint"], registry=r,
        )  # fmt: skip
        self.lookups = Counter(
            "outbox_status_lookups",
            "Status lookups (a count) of unresolved operations, by answer.",
            ["endpoint", "answer"], registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "outbox_attempt_duration_seconds", "Seconds each attempt that was sent took.",
            ["endpoint"], registry=r,
        )  # fmt: skip
        self.first_delay = Histogram(
            "outbox_enqueue_to_first_attempt_seconds",
            "Seconds from enqueue to the start of the first attempt.",
            ["endpoint"], buckets=_DELAY_BUCKETS, registry=r,
        )  # fmt: skip
        self.settle_time = Histogram(
            "outbox_enqueue_to_settled_seconds",
            "Seconds from enqueue to succeeded, failed or unresolved.",
            ["endpoint", "state"], buckets=_SETTLE_BUCKETS, registry=r,
        )  # fmt: skip
        self._children: dict[tuple[Any, ...], Any] = {}
        # pk -> (endpoint, created_at) of the operations this process holds.
        self._held: dict[int, tuple[str, int | None]] = {}
        self._dispatchers: list[RunningDispatcher] = []
        #: time.monotonic() of the last turn of a running dispatcher's event loop.
        self.loop_turned_at: float | None = None
        self._ticker: asyncio.TimerHandle | None = None
        self.backlog = _Backlog(outbox, cache_seconds, self)
        r.register(self.backlog)

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: prometheus_client validates and locks
        on every ``labels`` call, a dictionary lookup does not."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # -- health --------------------------------------------------------------------

    def process_in_flight(self) -> int:
        return sum(d.in_flight for d in list(self._dispatchers))

    def db_answered_at(self) -> float | None:
        times = [d.db_answered_at for d in list(self._dispatchers) if d.db_answered_at]
        return max(times) if times else None

    def running(self) -> bool:
        return bool(self._dispatchers)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop_turned_at = time.monotonic()
        self._ticker = loop.call_later(1.0, self._tick, loop)

    # -- Instrumentation -------------------------------------------------------------

    def dispatcher_started(self, dispatcher: RunningDispatcher) -> None:
        self._dispatchers.append(dispatcher)
        if self._ticker is None:
            self._tick(asyncio.get_running_loop())

    def dispatcher_stopped(self, dispatcher: RunningDispatcher) -> None:
        if dispatcher in self._dispatchers:
            self._dispatchers.remove(dispatcher)
        if not self._dispatchers and self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
            self.loop_turned_at = None

    def claimed(
        self, claimed: Sequence[Claimed], recovered: Sequence[Recovered], started_ns: int
    ) -> Any:
        for c in claimed:
            self._held[c.pk] = (c.endpoint, c.created_at)
        for rec in recovered:
            endpoint = self._held.get(rec.pk, ("", None))[0]
            self._child(self.lease_expirations, endpoint).inc()
            self._child(self.attempts, endpoint, "unknown", "none").inc()
        return None

    def settled(
        self, pk: int, state: State, reason: Reason | None, now_ms: int, *, not_sent: bool
    ) -> None:
        if not_sent:
            endpoint = self._held.get(pk, ("", None))[0]
            self._child(self.attempts, endpoint, "not_sent", "none").inc()
        self._finish(pk, state, reason, now_ms)

    def attempts_begun(self, batch: Any, started: Sequence[StartedAttempt], now_ms: int) -> None:
        for s in started:
            if s.number == 1:
                endpoint, created = self._held.get(s.pk, ("", None))
                if created is not None:
                    seconds = max(0, now_ms - created) / 1000
                    self._child(self.first_delay, endpoint).observe(seconds)

    def attempt_started(self, batch: Any, sending: Sending) -> Any:
        return sending.endpoint.name

    def attempt_sent(self, attempt: Any, result: AttemptResult) -> None:
        if attempt is not None:
            self._child(self.duration, attempt).observe(result.duration_ms / 1000)

    def outcome(self, out: AttemptOutcome, *, applied: bool, now_ms: int) -> None:
        endpoint = self._held.get(out.pk, ("", None))[0]
        if not applied:
            self._child(self.fenced, endpoint).inc()
            self._held.pop(out.pk, None)
            return
        verdict = out.verdict.value if out.verdict is not None else "none"
        self._child(self.attempts, endpoint, out.delivery.value, verdict).inc()
        if out.state.is_settled:
            self._finish(out.pk, out.state, out.reason, now_ms)
        else:
            self._held.pop(out.pk, None)

    def _finish(self, pk: int, state: State, reason: Reason | None, now_ms: int) -> None:
        endpoint, created = self._held.pop(pk, ("", None))
        self._child(self.finished, endpoint, state.value, reason.value if reason else "").inc()
        if created is not None:
            seconds = max(0, now_ms - created) / 1000
            self._child(self.settle_time, endpoint, state.value).observe(seconds)

    def status_lookup(self, endpoint: str, answer: str) -> None:
        self._child(self.lookups, endpoint, answer).inc()


# -- serving -----------------------------------------------------------------------------


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` over HTTP, from a daemon thread.

    ``/healthz``: 200 while a dispatcher's event loop turned in the last
    ``stall_seconds``, else 503 (stuck, or not running). ``/readyz``: 200 while the
    database answered the dispatcher in the last ``ready_within_seconds``, else 503.
    """

    def __init__(
        self,
        metrics: OutboxMetrics,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        stall_seconds: float = 10.0,
        ready_within_seconds: float = 30.0,
    ) -> None:
        from socketserver import ThreadingMixIn
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

        from prometheus_client import make_wsgi_app

        class _Server(ThreadingMixIn, WSGIServer):
            daemon_threads = True

        class _Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.metrics = metrics
        self.stall_seconds = stall_seconds
        self.ready_within_seconds = ready_within_seconds
        self._metrics_app = make_wsgi_app(metrics.registry)
        self._server = make_server(host, port, self._app, _Server, handler_class=_Quiet)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="outbox-metrics", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def healthy(self) -> bool:
        turned = self.metrics.loop_turned_at
        return turned is not None and time.monotonic() - turned <= self.stall_seconds

    def ready(self) -> bool:
        answered = self.metrics.db_answered_at()
        return answered is not None and time.monotonic() - answered <= self.ready_within_seconds

    def _app(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path in ("/healthz", "/readyz"):
            ok = self.healthy() if path == "/healthz" else self.ready()
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [b"ok\n" if ok else b"unavailable\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: /metrics, /healthz, /readyz\n"]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve(metrics: OutboxMetrics, *, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Serve ``metrics`` on ``host:port`` (port 0: any free port; see ``.port``)."""
    return MetricsServer(metrics, host=host, port=port)
