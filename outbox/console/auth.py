"""Credentials, sessions and CSRF tokens for the web console.

A credential is a token tied to an operator's name; the name is what the audit trail
records for every action taken in a session opened with that token. Tokens come from a
file (``--token-file``), the ``OUTBOX_CONSOLE_TOKEN`` environment variable, or are
generated at start and printed once. Sessions live in the console process's memory:
restarting the console logs everybody out.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from outbox.errors import ConfigurationError

TOKEN_ENV = "OUTBOX_CONSOLE_TOKEN"  # noqa: S105 (the variable's name, not a token)
MIN_TOKEN_LENGTH = 16
_TOKEN = re.compile(r"^[A-Za-z0-9._~+/=-]+$")
_NAME = re.compile(r"^[^\x00-\x1f\x7f:]{1,64}$")
SESSION_TTL_SECONDS = 8 * 3600


@dataclass(frozen=True, slots=True)
class Credential:
    name: str
    token: str


class Credentials:
    """The tokens that open a session, each tied to the operator name it records."""

    def __init__(self, entries: list[Credential], *, generated: bool = False) -> None:
        if not entries:
            raise ConfigurationError("no console credential configured")
        tokens = [e.token for e in entries]
        if len(set(tokens)) != len(tokens):
            raise ConfigurationError("two console credentials share a token")
        self.entries = entries
        #: True when the token was made up at start (printed once, valid until exit).
        self.generated = generated

    def match(self, token: str) -> str | None:
        """The operator name tied to ``token``, or None. Compares every entry in
        constant time so the answer's timing says nothing about near misses."""
        found = None
        given = token.encode()
        for entry in self.entries:
            if hmac.compare_digest(given, entry.token.encode()):
                found = entry.name
        return found

    @classmethod
    def generate(cls, name: str) -> Credentials:
        return cls([Credential(_check_name(name), secrets.token_urlsafe(32))], generated=True)

    @classmethod
    def parse(cls, text: str, *, default_name: str, source: str) -> Credentials:
        """``TOKEN`` or ``NAME:TOKEN`` per line; blank lines and ``#`` comments ignored."""
        entries = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, token = line.rpartition(":")
            if not sep:
                name, token = default_name, line
            where = f"{source} line {number}"
            if not _TOKEN.fullmatch(token) or len(token) < MIN_TOKEN_LENGTH:
                raise ConfigurationError(
                    f"{where}: a console token must be at least {MIN_TOKEN_LENGTH} characters "
                    "of [A-Za-z0-9._~+/=-]"
                )
            entries.append(Credential(_check_name(name.strip(), where), token))
        if not entries:
            raise ConfigurationError(f"{source} holds no token")
        return cls(entries)

    @classmethod
    def configured(cls, *, token_file: str | None, default_name: str) -> Credentials | None:
        """From ``token_file`` or :data:`TOKEN_ENV`; None when neither is set."""
        if token_file is not None:
            try:
                text = Path(token_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigurationError(f"cannot read --token-file {token_file}: {exc}") from exc
            return cls.parse(text, default_name=default_name, source=token_file)
        value = os.environ.get(TOKEN_ENV)
        if value:
            return cls.parse(value, default_name=default_name, source=TOKEN_ENV)
        return None


def _check_name(name: str, where: str = "operator name") -> str:
    if not _NAME.fullmatch(name) or not name.strip():
        raise ConfigurationError(
            f"{where}: an operator name must be 1-64 printable characters without ':'"
        )
    return name


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    actor: str
    csrf: str
    expires_at: float

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.csrf.encode())


class _Expires(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def expires_at(self) -> float: ...


_Item = TypeVar("_Item", bound=_Expires)


class Expiring(Generic[_Item]):
    """Items by ID, in memory, each gone once its ``expires_at`` (``ttl`` seconds after
    it was made, on ``clock``) has passed."""

    def __init__(
        self, ttl_seconds: float = SESSION_TTL_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._items: dict[str, _Item] = {}

    def _expires_at(self) -> float:
        return self._clock() + self.ttl

    def _drop_expired(self) -> None:
        """Forget every expired item; the caller holds the lock."""
        now = self._clock()
        for key in [k for k, item in self._items.items() if item.expires_at <= now]:
            del self._items[key]


class Sessions(Expiring[Session]):
    """Open sessions, in memory, each bound to an operator name and a CSRF token."""

    def create(self, actor: str) -> Session:
        session = Session(
            id=secrets.token_urlsafe(32),
            actor=actor,
            csrf=secrets.token_urlsafe(32),
            expires_at=self._expires_at(),
        )
        with self._lock:
            self._drop_expired()
            self._items[session.id] = session
        return session

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        with self._lock:
            session = self._items.get(sid)
            if session is not None and session.expires_at <= self._clock():
                del self._items[sid]
                return None
            return session

    def drop(self, sid: str | None) -> None:
        with self._lock:
            self._items.pop(sid or "", None)


class SignInLimiter:
    """Failed sign-ins per client address: after ``max_failures`` within
    ``window_seconds`` the address is locked out for ``lockout_seconds``. The point is
    not the token's strength (they are long) but an alert and a brake on guessing."""

    def __init__(
        self,
        *,
        max_failures: int = 5,
        window_seconds: float = 60.0,
        lockout_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window = window_seconds
        self.lockout = lockout_seconds
        self._clock = clock
        self._failures: dict[str, list[float]] = {}
        self._locked_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def locked_for(self, address: str) -> float:
        """Seconds ``address`` is still locked out (0: not locked)."""
        with self._lock:
            return max(0.0, self._locked_until.get(address, 0.0) - self._clock())

    def failed(self, address: str) -> bool:
        """Record a failure; True when it locks ``address`` out."""
        now = self._clock()
        with self._lock:
            recent = [t for t in self._failures.get(address, []) if now - t < self.window]
            recent.append(now)
            if len(recent) >= self.max_failures:
                self._failures.pop(address, None)
                self._locked_until[address] = now + self.lockout
                return True
            self._failures[address] = recent
            if len(self._failures) > 10_000:  # bounded memory under a spray of addresses
                self._failures.pop(next(iter(self._failures)))
            return False

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._failures.pop(address, None)
