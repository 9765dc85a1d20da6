"""The ``outbox`` command's process: ``python -m outbox`` and the installed script.

A read command (``status``, ``show``, ``reconcile list|show``, ``audit``) is a process
that lives a few hundred milliseconds, most of them importing SQLAlchemy and our own
modules. Two things that cost it time buy it nothing:

* the cyclic garbage collector, which runs again and again while the imports build
  thousands of classes and functions that all stay alive until exit (reference counting
  still frees everything else); it is switched off for the start-up and switched back on
  by every command that is not a read (``outbox.cli.support.command``), so a dispatcher
  or the console runs with it; ``dispatch`` then freezes what start-up built and
  collects the youngest generation less often (``cli_process.settle_gc_for_dispatch``);
* the interpreter's teardown of every module at exit. Once a read command has returned,
  closed its database connection (the click context's close) and its output is flushed,
  the process ends with ``os._exit``. Anything else (``dispatch``, ``console``,
  ``migrate``…) exits the ordinary way, with its ``atexit`` handlers.

Only this entry point does either: ``outbox.cli.main`` called in-process (tests, an
application embedding the command) keeps the interpreter's defaults.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def main() -> NoReturn:
    from outbox.cli import process as cli_process

    cli_process.pause_gc_for_startup()
    from outbox.cli import main as command

    try:
        command()
    except SystemExit as exc:
        code = exc.code
    else:  # pragma: no cover - click's standalone mode always exits
        code = 0
    if not cli_process.ran_read_command():
        sys.exit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except OSError:
            # The reader left (`outbox reconcile list | head`) or the file cannot take
            # more: nothing more can be said on that stream.
            if status == 0:
                status = 1
    os._exit(status)


if __name__ == "__main__":
    main()
