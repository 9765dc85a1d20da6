"""The test receiver's dialects; they live in :mod:`outbox.testing.receiver.dialects`."""

from outbox.testing.receiver.dialects import DIALECTS, Dialect, dialect_named, endpoint_options

__all__ = ["DIALECTS", "Dialect", "dialect_named", "endpoint_options"]
