"""Logging: the library logs through :mod:`logging`; applications (and the CLI) configure.

Every event goes to a standard-library logger under ``outbox`` (``outbox.dispatch``,
``outbox.store``, ...), which carries a :class:`logging.NullHandler`: with nothing
configured, using the library prints nothing. The loggers are structlog loggers wrapped
around the stdlib ones (:func:`get_logger`), never the application's global structlog
configuration, so ``structlog.configure`` in the application changes nothing here and
nothing here changes it. A filtered-out event costs one ``isEnabledFor`` check: no event
dict is built.

A record's message is ``event key=value ...`` (values that need it JSON-quoted, so a
value can never forge a line), and ``record.outbox`` holds the event as a dict
(``{"event": ..., "operation_id": ..., ...}``) for formatters that want the fields.

:func:`configure` is the command line's set-up: JSON lines on stderr, or a console
format on a terminal.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import MutableMapping
from datetime import UTC, datetime
from typing import Any

import structlog

ROOT = "outbox"
logging.getLogger(ROOT).addHandler(logging.NullHandler())

_PLAIN = re.compile(r"^[^\s\"=\\\x00-\x1f\x7f-\x9f\u2028\u2029]+$")
# Frames between the caller and logging.Logger._log: OutboxLogger.<level>,
# OutboxLogger._emit, then BoundLoggerBase._proxy_to_logger. The record names the
# caller's file and line.
_STACKLEVEL = 4


def _value(v: Any) -> str:
    text = v if isinstance(v, str) else str(v)
    if text and _PLAIN.match(text):
        return text
    return json.dumps(text)


def render_message(event_dict: MutableMapping[str, Any]) -> str:
    """``event key=value ...``: one line whatever the values hold."""
    parts = [_value(event_dict.get("event", ""))]
    parts.extend(f"{k}={_value(v)}" for k, v in event_dict.items() if k != "event")
    return " ".join(parts)


def _to_stdlib(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    exc_info = event_dict.pop("exc_info", None)
    fields = dict(event_dict)
    return (render_message(fields),), {
        "extra": {"outbox": fields},
        "exc_info": exc_info,
        "stacklevel": _STACKLEVEL,
    }


class OutboxLogger(structlog.BoundLoggerBase):
    """A structlog bound logger over a stdlib logger that checks the level first."""

    _logger: logging.Logger

    def debug(self, event: str, **kw: Any) -> None:
        self._emit(logging.DEBUG, "debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._emit(logging.INFO, "info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit(logging.WARNING, "warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._emit(logging.ERROR, "error", event, kw)

    def exception(self, event: str, **kw: Any) -> None:
        """An error with the exception being handled (its traceback goes to the record)."""
        kw.setdefault("exc_info", True)
        self._emit(logging.ERROR, "error", event, kw)

    def _emit(self, level: int, method: str, event: str, kw: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(level):
            self._proxy_to_logger(method, event, **kw)

    def is_enabled_for(self, level: int) -> bool:
        return self._logger.isEnabledFor(level)

    def bind(self, **new_values: Any) -> OutboxLogger:
        return super().bind(**new_values)


_PROCESSORS: list[Any] = [structlog.contextvars.merge_contextvars, _to_stdlib]


def get_logger(name: str) -> OutboxLogger:
    """The library's logger ``name`` (under ``outbox``), independent of structlog's
    global configuration. Application contextvars bound with structlog are merged in."""
    return OutboxLogger(logging.getLogger(name), _PROCESSORS, {})


# -- the command line's configuration ------------------------------------------------


def _event_of(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "outbox", None)
    if isinstance(fields, dict):
        event = dict(fields)
    else:
        event = {"event": record.getMessage(), "logger": record.name}
    event["level"] = record.levelname.lower()
    event["timestamp"] = (
        datetime.fromtimestamp(record.created, UTC)
        .isoformat(timespec="microseconds")
        .replace("+00:00", "Z")
    )
    return event


class JsonFormatter(logging.Formatter):
    """One JSON object per line: the event, its fields, ``level`` and ``timestamp``.

    JSON escapes newlines and control characters, so a value can never forge a line.
    """

    def format(self, record: logging.LogRecord) -> str:
        event = _event_of(record)
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event, sort_keys=True, default=str)


class ConsoleFormatter(logging.Formatter):
    """structlog's console rendering, for a person at a terminal."""

    def __init__(self) -> None:
        super().__init__()
        self._render = structlog.dev.ConsoleRenderer(colors=False)

    def format(self, record: logging.LogRecord) -> str:
        event = _event_of(record)
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return str(self._render(None, record.levelname.lower(), event))


_installed: logging.Handler | None = None


def configure(level: str = "info", fmt: str = "auto") -> None:
    """Structured logs on stderr: JSON lines, or a console format on a terminal.

    The ``outbox`` loggers write at ``level`` and above to a handler on stderr (they
    no longer propagate to the root logger). The command line is the application, so
    structlog's global configuration is set too: an ``--app`` module's own structlog
    events come out in the same format.
    """
    global _installed  # noqa: PLW0603
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    reset()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ConsoleFormatter() if console else JsonFormatter())
    root = logging.getLogger(ROOT)
    root.addHandler(handler)
    root.setLevel(numeric)
    root.propagate = False
    _installed = handler
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=False)
        if console
        else structlog.processors.JSONRenderer(sort_keys=True)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def reset() -> None:
    """Undo :func:`configure` (tests; an embedding application)."""
    global _installed  # noqa: PLW0603
    root = logging.getLogger(ROOT)
    if _installed is not None:
        root.removeHandler(_installed)
        _installed = None
    root.setLevel(logging.NOTSET)
    root.propagate = True
