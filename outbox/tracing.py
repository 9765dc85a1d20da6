"""Deprecated alias: moved to :mod:`outbox.observe.tracing`; removed in the next release."""

import warnings

from outbox.observe.tracing import Tracing, configured, current_traceparent

__all__ = ["Tracing", "configured", "current_traceparent"]

warnings.warn(
    "outbox.tracing moved to outbox.observe.tracing; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
