"""The ``outbox`` command: a thin shell over the library.

Each command parses its options, makes one library call and renders the result as a
table (default) or JSON (``--json``). Every failure is one line on stderr and a
documented exit code (see :mod:`outbox.cli.support`); ``--debug`` adds the traceback.
Read commands never create or migrate a database. Heavy modules (the dispatcher, httpx,
aiohttp, Alembic, tenacity) are imported only by the commands that need them.

The package: :mod:`.root` (the ``outbox`` group and what every command shares), and the
commands in :mod:`.reading`, :mod:`.dispatching`, :mod:`.operator` and :mod:`.tools`,
each registered on the group when the group first needs it (``root.main.lazy_commands``).
"""

from outbox.cli.root import main

__all__ = ["main"]
