"""What the process entry (``outbox.__main__``) and the commands tell each other: the
garbage collector paused for the start-up, tuned for a dispatcher, and whether a read
command ran (the entry may then end the process without the interpreter's teardown).

It imports nothing but ``gc``: the entry imports it first, before click and the rest.
"""

from __future__ import annotations

import gc


class _Process:
    """What the process entry (``outbox.__main__``) and the commands tell each other."""

    #: The entry switched the garbage collector off for the start-up; any command that
    #: is not a read switches it back on.
    gc_paused = False
    #: This process started in the process entry (it is ours, not an application's).
    entry = False
    #: A read command (``command(..., reads=True)``) has started: the entry may end the
    #: process without the interpreter's teardown.
    read_command = False


PROCESS = _Process()


def pause_gc_for_startup() -> None:
    """Called by the process entry alone (see ``outbox.__main__``)."""
    gc.disable()
    PROCESS.gc_paused = True
    PROCESS.entry = True


#: A dispatcher process collects its youngest generation every this many allocations
#: (CPython's default is 700).
DISPATCH_GC_THRESHOLD = 10_000


def settle_gc_for_dispatch() -> None:
    """Called by ``outbox dispatch`` once its application is loaded, before it runs.

    What start-up built (modules, the engine, the tables, the endpoints) lives as long
    as the process: frozen, full collections no longer walk it. The event loop
    allocates ~90 container objects per operation, most of them freed within that
    operation: collecting the youngest generation every 10,000 allocations instead of
    700 cuts the collector's share of a busy dispatcher's CPU several times
    (DESIGN-NOTES.md, *Per-operation budget*). Only in this process of ours: a
    dispatcher embedded in an application, and ``outbox.cli.main`` called in-process,
    leave the process's collector alone."""
    if not PROCESS.entry:
        return
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], DISPATCH_GC_THRESHOLD), *threshold[1:])


def ran_read_command() -> bool:
    """Whether this process ran a read command (see ``outbox.__main__``)."""
    return PROCESS.read_command
