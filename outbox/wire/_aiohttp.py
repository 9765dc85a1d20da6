"""The one home of every use of aiohttp's private surface.

``ClientSession._retry_connection``: aiohttp resends a request of an idempotent method
(PUT, DELETE, ...) once, silently, when a kept-alive connection turns out closed as it is
reused. The outbox must see every break and decide itself (the receiver may have acted,
and its attempts are counted and recorded). There is no public switch, so the attribute
is set after construction; ``tests/unit/test_dependency_contracts.py`` fails loudly when
an aiohttp release renames it or stops reading it; pyproject.toml pins aiohttp to the
minor versions this was written against.
"""

from __future__ import annotations

from typing import Any


def without_silent_resend(session: Any) -> Any:
    """``session`` (an ``aiohttp.ClientSession``), set to never resend a request itself."""
    session._retry_connection = False
    return session
