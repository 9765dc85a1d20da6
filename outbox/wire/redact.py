"""Keep credentials a receiver echoes back out of the stored evidence.

Receivers echo request headers (debug endpoints, error pages, "your request was ..."
bodies, a request-ID header set to whatever came in). Every header value the dispatcher
sent that is not known to be public (the idempotency key, the request ID, the tenant,
the persisted headers, the transport's own) is treated as a secret: credentials from
``Endpoint.auth`` (a callable or an ``httpx.Auth``), the endpoint's static headers, and
anything named in ``Outbox(secret_headers=...)``.

A secret is found in any mix of its literal bytes and JSON escapes (``\\/``, ``\\"``,
``\\uXXXX`` in either case), and in the decoded forms of ``Basic`` credentials.
"""

from __future__ import annotations

import base64
import binascii
import functools
import html
import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import quote, quote_plus

from outbox.canonical import CREDENTIAL_HEADERS

if TYPE_CHECKING:
    import httpx

    from outbox.config import Endpoint

REDACTED = "[REDACTED]"
#: Header values shorter than this are not treated as secrets unless named as secrets
#: (redacting "1" or "json" everywhere would destroy the evidence).
_MIN_UNNAMED = 8
_MIN_NAMED = 4
#: Headers whose values the dispatcher sets and which are not secret.
_TRANSPORT_HEADERS = frozenset(
    {
        "host",
        "accept",
        "accept-encoding",
        "connection",
        "user-agent",
        "content-length",
        "content-type",
        "transfer-encoding",
        "traceparent",
        "tracestate",
    }
)


def _char_pattern(c: str) -> bytes:
    forms = [re.escape(c.encode("utf-8"))]
    code = ord(c)
    if code < 0x10000:
        hex4 = f"{code:04x}"
        forms.append(b"\\\\u" + b"".join(b"[%s%s]" % (h.encode(), h.upper().encode())
                                         if h.isalpha() else h.encode() for h in hex4))  # fmt: skip
    if c in "/\"\\":
        forms.append(re.escape(b"\\" + c.encode()))
    return b"(?:" + b"|".join(forms) + b")"


def _json_twice(s: str) -> str:
    return json.dumps(json.dumps(s))[3:-3]


#: The spellings a receiver produces by echoing a secret through a URL, a form, an HTML
#: page, a JSON-in-JSON field or a base64 header dump. ONE rule: every spelling of every
#: secret is a literal, each of its characters also matched in its JSON escapes.
SPELLINGS: dict[str, Callable[[str], str]] = {
    "literal": lambda s: s,
    "percent-encoded": lambda s: quote(s, safe=""),
    "percent-encoded, lower-case hex": lambda s: re.sub(
        r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(s, safe="")
    ),
    "form-encoded": lambda s: quote_plus(s, safe=""),
    "HTML entities": lambda s: html.escape(s, quote=True),
    "JSON escaped twice": _json_twice,
    "base64": lambda s: base64.b64encode(s.encode("utf-8")).decode("ascii"),
}


@functools.lru_cache(maxsize=256)
def _compiled(given: tuple[str, ...]) -> tuple[int, re.Pattern[bytes] | None]:
    """The pattern for ``given`` secrets, cached: an endpoint sends the same
    credentials attempt after attempt, and compiling is most of the cost."""
    unique = sorted({f(s) for s in given for f in SPELLINGS.values()}, key=len, reverse=True)
    longest = max((len(s) for s in unique), default=0)
    if not unique:
        return longest, None
    return longest, re.compile(b"|".join(b"".join(_char_pattern(c) for c in s) for s in unique))


class Redactor:
    """Replaces the given secrets, in every spelling of :data:`SPELLINGS` and any
    JSON-escaped form of it, with ``[REDACTED]``."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.longest, self._pattern = _compiled(tuple(sorted({s for s in secrets if s})))

    def __bool__(self) -> bool:
        return self._pattern is not None

    def bytes(self, data: bytes, *, cut_off: bool = False) -> bytes:
        """``data`` with every secret replaced. ``cut_off``: ``data`` is a prefix of
        something longer, so a secret may begin at its end: drop that tail too."""
        if self._pattern is None:
            return data
        data = self._pattern.sub(REDACTED.encode(), data)
        if cut_off:
            # The longest spelling of a secret is 6 bytes (a \\uXXXX escape) per character.
            tail = 6 * self.longest
            data = data[:-tail] if len(data) > tail else b""
        return data

    def text(self, value: str) -> str:
        if self._pattern is None:
            return value
        return self.bytes(value.encode("utf-8", "surrogatepass")).decode("utf-8", "replace")


def secrets_sent(
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
    *,
    public: Iterable[str] = (),
    secret_names: Iterable[str] = (),
) -> list[str]:
    """The values among ``headers`` (as sent) that must never be stored."""
    public_names = {n.lower() for n in public} | _TRANSPORT_HEADERS
    named = {n.lower() for n in secret_names} | CREDENTIAL_HEADERS
    items = headers.items() if isinstance(headers, Mapping) else headers
    found: list[str] = []
    for name, value in items:
        lowered = name.lower()
        if lowered in public_names and lowered not in named:
            continue
        minimum = _MIN_NAMED if lowered in named else _MIN_UNNAMED
        scheme, _, rest = value.partition(" ")
        for candidate in (value, rest):
            if len(candidate) >= minimum:
                found.append(candidate)
        if scheme.lower() == "basic" and rest:
            try:
                decoded = base64.b64decode(rest, validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                continue
            password = decoded.partition(":")[2]
            found.extend(v for v in (decoded, password) if len(v) >= _MIN_NAMED)
    return found


def request_redactor(
    endpoint: Endpoint,
    headers: Mapping[str, str],
    sent: httpx.Request | None = None,
    *,
    public: Iterable[str] = (),
    secret_names: Iterable[str] = (),
) -> Redactor:
    """The one redactor for everything one exchange stores or shows: its body, its
    headers and its error text (a parser error quotes the raw bytes it choked on).
    ``headers``: those handed to the exchange; ``sent``: the request that went out,
    when known (an ``httpx.Auth`` may have added credentials of its own making)."""
    items = list(headers.items())
    if sent is not None:
        items.extend(sent.headers.multi_items())
    identity = [endpoint.idempotency_header, endpoint.request_id_header]
    if endpoint.tenant_header:
        identity.append(endpoint.tenant_header)
    return Redactor(
        secrets_sent(items, public=[*public, *identity], secret_names=secret_names)
    )
