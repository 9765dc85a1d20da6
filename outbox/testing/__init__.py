"""Testing kit: :class:`Receiver`, a real local HTTP receiver with idempotency receipts
and fault injection, and a pytest plugin (``outbox.testing.pytest_plugin``)."""

from outbox.testing.receiver import Receiver

__all__ = ["Receiver"]
