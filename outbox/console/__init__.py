"""``outbox console``: a web console for the reconciliation queue (extra ``console``).

Build the ASGI app with :func:`create_app` (for mounting or tests) or run it with
:func:`outbox.console.server.serve` (what the command does).
"""

from outbox.console.app import create_app
from outbox.console.auth import Credentials

__all__ = ["Credentials", "create_app"]
