"""``outbox console``: a web console for the reconciliation queue (extra ``console``).

Build the ASGI app with :func:`create_app` (for mounting or tests) or run it with
:func:`outbox.console.server.serve` (what the command does).
"""

from outbox.console.auth import Credentials
from outbox.console.routes import create_app

__all__ = ["Credentials", "create_app"]
