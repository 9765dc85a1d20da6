"""Deprecated alias: moved to :mod:`outbox.observe.metrics`; removed in the next release."""

import warnings

from outbox.observe.metrics import MetricsServer, OutboxMetrics, serve

__all__ = ["MetricsServer", "OutboxMetrics", "serve"]

warnings.warn(
    "outbox.metrics moved to outbox.observe.metrics; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
