"""The ``outbox`` command: a thin shell over the library.

Each command parses its options, makes one library call and renders the result as a
table (default) or JSON (``--json``). Every failure is one line on stderr and a
documented exit code (see :mod:`outbox.cli_support`); ``--debug`` adds the traceback.
Read commands never create or migrate a database. Heavy modules (the dispatcher, httpx,
aiohttp, Alembic, tenacity) are imported only by the commands that need them.

The package: :mod:`.root` (the ``outbox`` group and what every command shares), and the
commands in :mod:`.reading`, :mod:`.dispatching`, :mod:`.operator` and :mod:`.tools`,
registered on the group as they are imported here.
"""

from outbox.cli import dispatching, operator, reading, tools
from outbox.cli.root import main

__all__ = ["dispatching", "main", "operator", "reading", "tools"]
