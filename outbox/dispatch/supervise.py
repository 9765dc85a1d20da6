"""``outbox dispatch --processes N``: N dispatcher processes under one supervisor.

One dispatcher is one event loop, so it uses one core. On a multi-core host the
supervisor starts N child processes (each ``outbox ... dispatch --json``, its own loop
and database connections, the same database), restarts a child that dies with a
growing backoff, and on SIGTERM or SIGINT forwards SIGTERM to every child and waits
for their graceful drain (requests on the wire finish, outcomes are recorded).

Children start with SIGTERM blocked, and ``outbox dispatch`` unblocks it once its
handler is in place: a SIGTERM forwarded to a child still starting up waits for it,
and that child stops cleanly instead of dying of the signal's default action.

Exit status: 0 when every child running at the stop exited 0; 1 when one did not; 2
when a child failed at start-up with a usage error (it would fail again). The children
share nothing but the database: claims (SKIP LOCKED on PostgreSQL, BEGIN IMMEDIATE on
SQLite) keep them apart, and a killed child's leases expire like any crashed
dispatcher's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

from outbox.base.logs import get_logger

logger = get_logger("outbox.supervise")

#: A child that lived this long resets its slot's restart backoff.
STABLE_SECONDS = 30.0
#: The first and the longest wait before restarting a child.
FIRST_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0
#: The CLI's exit status for a usage error: restarting cannot help.
EXIT_USAGE = 2


@dataclass
class _Slot:
    index: int
    process: subprocess.Popen[str] | None = None
    started: float = 0.0
    backoff: float = 0.0
    restart_at: float | None = None
    #: Exit status of the child that was running when the stop came.
    drained: int | None = None


@dataclass
class SupervisorReport:
    processes: int
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    #: The children's own summaries (``DispatchSummary.as_dict``) added up; a child
    #: that was killed reported nothing.
    totals: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.totals,
            "processes": self.processes,
            "restarts": self.restarts,
            "exit_codes": list(self.exit_codes),
        }


class Supervisor:
    """Runs ``command`` (a dispatcher that prints its JSON summary) ``n`` times over."""

    def __init__(self, command: Sequence[str], n: int, *, poll_seconds: float = 0.1) -> None:
        if n < 1:
            raise ValueError("processes must be at least 1")
        self.command = list(command)
        self.slots = [_Slot(i) for i in range(n)]
        self.report = SupervisorReport(processes=n)
        self.poll_seconds = poll_seconds
        self._stopping = False
        self._fatal: int | None = None

    # -- signals ------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._stopping = True
        self._forward()

    def _forward(self) -> None:
        for slot in self.slots:
            proc = slot.process
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    # -- children -----------------------------------------------------------------

    def _start(self, slot: _Slot) -> None:
        # The child inherits the signal mask across fork and exec: block SIGTERM here
        # for the moment of the spawn (one aimed at us meanwhile waits, then arrives).
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            slot.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        slot.started = time.monotonic()
        slot.restart_at = None
        logger.info("dispatcher_process_started", slot=slot.index, pid=slot.process.pid)

    def _reap(self, slot: _Slot) -> int | None:
        proc = slot.process
        if proc is None or proc.poll() is None:
            return None
        code = proc.returncode
        self._collect(proc.stdout)
        slot.process = None
        self.report.exit_codes.append(code)
        if self._stopping:
            slot.drained = code
        return code

    def _collect(self, stream: IO[str] | None) -> None:
        if stream is None:
            return
        text = stream.read()
        stream.close()
        try:
            summary = json.loads(text)  # the child's one JSON document (indented)
        except ValueError:
            return  # killed before it printed anything
        if isinstance(summary, dict):
            _add(self.report.totals, summary)

    def run(self) -> SupervisorReport:
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            for slot in self.slots:
                self._start(slot)
            while True:
                now = time.monotonic()
                live = 0
                for slot in self.slots:
                    code = self._reap(slot)
                    if code is not None and not self._stopping:
                        self._died(slot, code, now)
                    if slot.process is not None:
                        live += 1
                    elif (
                        not self._stopping
                        and slot.restart_at is not None
                        and now >= slot.restart_at
                    ):
                        self._start(slot)
                        self.report.restarts += 1
                        live += 1
                if self._stopping and live == 0:
                    break
                time.sleep(self.poll_seconds)
        finally:
            self._stopping = True
            self._forward()
            for slot in self.slots:
                if slot.process is not None:
                    slot.process.wait()
                    self._reap(slot)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.report

    def _died(self, slot: _Slot, code: int, now: float) -> None:
        lived = now - slot.started
        if code == EXIT_USAGE and lived < STABLE_SECONDS:
            # A configuration or usage error: every restart would fail the same way.
            logger.error(
                "dispatcher_process_failed",
                slot=slot.index,
                exit_code=code,
                detail="usage error at start-up; stopping every process",
            )
            self._fatal = code
            self._stopping = True
            self._forward()
            return
        if lived >= STABLE_SECONDS:
            slot.backoff = 0.0
        slot.backoff = min(
            slot.backoff * 2 if slot.backoff else FIRST_BACKOFF_SECONDS, MAX_BACKOFF_SECONDS
        )
        slot.restart_at = now + slot.backoff
        logger.warning(
            "dispatcher_process_exited",
            slot=slot.index,
            exit_code=code,
            lived_seconds=round(lived, 1),
            restart_in_seconds=slot.backoff,
        )

    @property
    def exit_status(self) -> int:
        if self._fatal is not None:
            return self._fatal
        drained = [s.drained for s in self.slots if s.drained is not None]
        return 0 if all(code == 0 for code in drained) else 1


def _add(totals: dict[str, Any], summary: dict[str, Any]) -> None:
    for key, value in summary.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            totals[key] = totals.get(key, 0) + value
        elif isinstance(value, dict):
            _add(totals.setdefault(key, {}), value)


def catch_sigterm_early() -> threading.Event:
    """Install a SIGTERM handler that sets the returned event, then unblock SIGTERM (a
    supervised child starts with it blocked, so an early stop is delivered now)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    return stop
