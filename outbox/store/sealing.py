"""Encryption at rest at the row boundary: values sealed on write, opened on read.

Envelope encryption: each written row (an enqueue's request columns, a dispatcher's
result columns) gets a fresh 256-bit data key; its values are AES-GCM encrypted under
it, and the data key is stored wrapped by the application's current key-encryption key
(:class:`outbox.base.keys.KeyRing`). A sealed value is text, self-contained, in the same
column the plain value would have::

    sealed:1:<key id>:<wrapped data key, base64>:<nonce + ciphertext, base64>

so every body column, present or future, is sealed by adding it to :data:`REQUEST` or
:data:`RESULT`; plain values (rows written before encryption was turned on) read as
before, since canonical JSON never starts with ``s``. The byte column of a form or raw
body (:data:`REQUEST_RAW`) holds the same text as ASCII bytes; there a value counts as
sealed only if it has that exact shape (:func:`looks_sealed`), and enqueue refuses a
raw body of that shape, so a plain body is never mistaken for a sealed one. The
associated data binds a ciphertext to its row and column: request columns to
``(tenant, operation_id)``, result columns to the row's primary key (written after the
row exists). A value swapped into another row or column fails to open.

Rotation re-wraps the data key only (the ciphertext stays); shredding drops the wrapped
data key (``sealed:1:<key id>::<ciphertext>``), after which nothing can open the value.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass
from typing import Any

from outbox.base.keys import KeyRing, KeyUnavailableError, _aesgcm

PREFIX = "sealed:1:"
PREFIX_BYTES = PREFIX.encode("ascii")
#: The columns sealed when an operation is written, and when its result is.
REQUEST = ("headers", "body")
#: Byte columns sealed with the request (a ``data=`` form's or ``content=`` body).
REQUEST_RAW = ("body_raw",)
RESULT = ("result_headers", "result_body")
SEALED_COLUMNS = REQUEST + REQUEST_RAW + RESULT

_B64 = rb"[A-Za-z0-9+/]*={0,2}"
_SEALED_BYTES = re.compile(rb"sealed:1:[^:\s]+:" + _B64 + rb":" + _B64)


@dataclass(frozen=True)
class Sealed:
    """A value that could not be opened here: which key, and why, for people to read."""

    key_id: str
    shredded: bool = False

    def __str__(self) -> str:
        if self.shredded:
            return f"encrypted: data key destroyed (key {self.key_id}, shredded)"
        return f"encrypted: key {self.key_id} not available"


@dataclass(frozen=True)
class Parts:
    key_id: str
    wrapped: bytes
    payload: bytes


def looks_sealed(raw: bytes) -> bool:
    """Whether bytes have the exact shape of a sealed value (the whole of them)."""
    return raw.startswith(PREFIX_BYTES) and _SEALED_BYTES.fullmatch(raw) is not None


def is_sealed(value: object) -> bool:
    """A sealed text column's value, or a sealed byte column's (see :func:`looks_sealed`)."""
    if isinstance(value, str):
        return value.startswith(PREFIX)
    if isinstance(value, bytes | memoryview):
        return looks_sealed(bytes(value))
    return False


def as_text(value: str | bytes | memoryview) -> str:
    """A sealed value as text, from either kind of column."""
    return value if isinstance(value, str) else bytes(value).decode("ascii")


def parts(value: str) -> Parts:
    key_id, wrapped, payload = value[len(PREFIX) :].split(":")
    return Parts(key_id, base64.b64decode(wrapped), base64.b64decode(payload))


def _text(p: Parts) -> str:
    w = base64.b64encode(p.wrapped).decode()
    return f"{PREFIX}{p.key_id}:{w}:{base64.b64encode(p.payload).decode()}"


def request_aad(tenant: str, operation_id: str, column: str) -> bytes:
    return b"\x00".join((b"op", tenant.encode(), operation_id.encode(), column.encode()))


def result_aad(pk: int, column: str) -> bytes:
    return b"\x00".join((b"pk", str(pk).encode(), column.encode()))


class Sealer:
    """Seals and opens values under a :class:`KeyRing`; ``Sealer(None)`` only opens
    plain values (and says which key a sealed one needs)."""

    def __init__(self, ring: KeyRing | None) -> None:
        self.ring = ring
        # The last data key unwrapped: a row's values share one, so reading a row
        # unwraps (asks the ring) once per part, not once per column.
        self._last: tuple[str, bytes, bytes] | None = None

    def _data_key(self, p: Parts) -> bytes | None:
        if self.ring is None:
            return None
        last = self._last
        if last is not None and last[0] == p.key_id and last[1] == p.wrapped:
            return last[2]
        data_key = self.ring.unwrap(p.key_id, p.wrapped)
        if data_key is not None:
            self._last = (p.key_id, p.wrapped, data_key)
        return data_key

    @property
    def on(self) -> bool:
        return self.ring is not None

    # -- writing ------------------------------------------------------------------

    def _seal(self, values: dict[str, Any], aad: dict[str, bytes]) -> dict[str, Any]:
        if self.ring is None:
            return values
        data_key = os.urandom(32)
        key_id, wrapped = self.ring.wrap(data_key)
        aes = _aesgcm(data_key)
        out = dict(values)
        for column, extra in aad.items():
            plain = values.get(column)
            if plain is None:
                continue
            data = bytes(plain) if isinstance(plain, bytes | memoryview) else plain.encode()
            nonce = os.urandom(12)
            text = _text(Parts(key_id, wrapped, nonce + aes.encrypt(nonce, data, extra)))
            out[column] = text.encode("ascii") if column in REQUEST_RAW else text
        return out

    def seal_request(self, row: dict[str, Any]) -> dict[str, Any]:
        """A new operation row with its request columns (text and bytes) sealed, all
        under one data key (unchanged when off)."""
        t, o = row["tenant"], row["operation_id"]
        columns = [c for c in REQUEST + REQUEST_RAW if c in row]
        return self._seal(row, {c: request_aad(t, o, c) for c in columns})

    def seal_result(self, pk: int, values: dict[str, Any]) -> dict[str, Any]:
        """Result columns (``result_headers``/``result_body`` keys) of row ``pk``, sealed."""
        return self._seal(values, {c: result_aad(pk, c) for c in RESULT if c in values})

    # -- reading ------------------------------------------------------------------

    def open(self, value: str | None, aad: bytes) -> str | Sealed | None:
        """The plain text of a stored value, or :class:`Sealed` when no key opens it.

        A ciphertext that fails its tag (swapped between rows, tampered) raises
        :class:`KeyUnavailableError`: that is corruption, not a missing key.
        """
        if value is None or not is_sealed(value):
            return value
        plain = self._decrypt(value, aad)
        return plain if isinstance(plain, Sealed) else plain.decode("utf-8")

    def open_raw(self, value: bytes | memoryview | None, aad: bytes) -> bytes | Sealed | None:
        """:meth:`open` for a byte column: the plain bytes, or :class:`Sealed`."""
        if value is None:
            return None
        if not is_sealed(value):
            return bytes(value)
        return self._decrypt(as_text(value), aad)

    def _decrypt(self, value: str, aad: bytes) -> bytes | Sealed:
        p = parts(value)
        if not p.wrapped:
            return Sealed(p.key_id, shredded=True)
        data_key = self._data_key(p)
        if data_key is None:
            return Sealed(p.key_id)
        from cryptography.exceptions import InvalidTag

        try:
            plain = _aesgcm(data_key).decrypt(p.payload[:12], p.payload[12:], aad)
        except InvalidTag as exc:
            raise KeyUnavailableError(
                "encrypted value does not belong to this row and column (moved or altered)",
                key_id=p.key_id,
            ) from exc
        return bytes(plain)

    def open_request(self, r: Any, column: str) -> str | Sealed | None:
        return self.open(getattr(r, column), request_aad(r.tenant, r.operation_id, column))

    def open_request_raw(self, r: Any) -> bytes | Sealed | None:
        """A row's form or raw body (``body_raw``), opened."""
        return self.open_raw(r.body_raw, request_aad(r.tenant, r.operation_id, "body_raw"))

    def open_result(self, r: Any, column: str) -> str | Sealed | None:
        return self.open(getattr(r, column), result_aad(r.id, column))

    def for_sending(
        self,
        tenant: str,
        operation_id: str,
        headers: str,
        body: str | None,
        body_raw: bytes | memoryview | None = None,
    ) -> tuple[str | None, str | None, bytes | None, str | None]:
        """A claimed row's request headers and body as text, its raw body as bytes, and
        None; or, when this process cannot open them, none and the reason (the
        dispatcher will not send)."""
        raw = bytes(body_raw) if body_raw is not None else None
        if not (is_sealed(headers) or is_sealed(body) or is_sealed(raw)):
            return headers, body, raw, None
        try:
            opened = [self.open(v, request_aad(tenant, operation_id, c))
                      for c, v in (("headers", headers), ("body", body))]  # fmt: skip
            opened_raw = self.open_raw(raw, request_aad(tenant, operation_id, "body_raw"))
        except KeyUnavailableError as exc:
            return None, None, None, f"{exc} (in this dispatcher)"
        missing = [v for v in (*opened, opened_raw) if isinstance(v, Sealed)]
        if missing:
            return None, None, None, f"{missing[0]} (in this dispatcher's key ring)"
        h, b = (v for v in opened if not isinstance(v, Sealed))
        return h, b, opened_raw if not isinstance(opened_raw, Sealed) else None, None

    # -- rotation and shredding ---------------------------------------------------

    def rewrapped(self, value: str) -> str | None:
        """``value`` with its data key wrapped under the current key; None: no change."""
        assert self.ring is not None
        p = parts(value)
        if not p.wrapped or p.key_id == self.ring.current:
            return None
        data_key = self.ring.unwrap(p.key_id, p.wrapped)
        if data_key is None:
            raise KeyUnavailableError(
                f"cannot rotate: key {p.key_id} not available (keep old keys in the ring "
                "until rotation is done)",
                key_id=p.key_id,
            )
        key_id, wrapped = self.ring.wrap(data_key)
        return _text(Parts(key_id, wrapped, p.payload))


def shredded(value: str) -> str:
    """``value`` without its wrapped data key: the ciphertext stays, unreadable for good."""
    p = parts(value)
    return _text(Parts(p.key_id, b"", p.payload))


#: Opens plain values only: what reads use when the store has no key ring.
PLAIN = Sealer(None)
