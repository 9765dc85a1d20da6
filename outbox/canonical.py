"""Validation and canonical form of enqueue arguments.

Everything here is pure: it raises :class:`ValidationError` before the store is touched,
so bad input writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Required, TypedDict
from urllib.parse import parse_qsl, unquote

from outbox.errors import ValidationError
from outbox.forms import (
    FORM_CONTENT_TYPE,
    append_query,
    check_content_type,
    check_secret_pairs,
    encode_form,
    encode_query,
    raise_multipart,
)

OPERATION_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,255}$")
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{0,255}$")
_ORDERING_KEY_PATTERN = re.compile(r"^[A-Za-z0-9._:/-]{1,255}$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
MAX_JSON_DEPTH = 64

#: Headers that carry credentials: never persisted; the endpoint's auth supplies them.
CREDENTIAL_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "cookie",
        "set-cookie",
        "x-api-key",
        "api-key",
        "apikey",
        "x-auth-token",
        "x-access-token",
        "x-csrf-token",
    }
)
#: Headers the dispatcher sets itself.
_RESERVED_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "idempotency-key", "x-request-id"}
)


@dataclass(frozen=True, slots=True)
class CanonicalArgs:
    """Validated arguments in the one form that is stored and compared."""

    endpoint: str
    method: str
    path: str
    headers: dict[str, str]
    body_json: str | None  #: canonical JSON text, or None for no JSON body
    args_sha256: str
    #: Claim order within the tenant (higher first): scheduling, not in the fingerprint.
    priority: int = 0
    #: A scheduled send (epoch ms), or None: scheduling, not in the fingerprint.
    not_before_ms: int | None = None
    #: This operation's business deadline after enqueue (ms), or None for the endpoint
    #: policy's ``deliver_within``: scheduling, not in the fingerprint.
    deliver_within_ms: int | None = None
    #: The exact bytes of a form (``data=``) or raw (``content=``) body, whose content
    #: type is then the stored ``content-type`` header; None for JSON or no body.
    body_raw: bytes | None = None


@dataclass(frozen=True, slots=True)
class Intent:
    """One operation for ``enqueue_many``: the same arguments as ``enqueue``."""

    endpoint: str
    method: str
    path: str
    json: Any = None
    headers: Mapping[str, str] | None = None
    operation_id: str | None = None
    tenant: str = ""
    ordering_key: str | None = None
    priority: int = 0
    not_before: datetime | None = None
    data: Any = None
    content: bytes | None = None
    content_type: str | None = None
    params: Any = None
    form_style: str = "flat"
    files: Any = None
    deliver_within: timedelta | None = None


class EnqueueArgs(TypedDict, total=False):
    """The keyword arguments of :meth:`outbox.Outbox.enqueue` (beside ``connection``),
    written once: every enqueue variant takes them (``**kw: Unpack[EnqueueArgs]``)."""

    endpoint: Required[str]
    method: Required[str]
    path: Required[str]
    json: Any
    headers: Mapping[str, str] | None
    operation_id: str | None
    tenant: str
    ordering_key: str | None
    priority: int
    not_before: datetime | None
    data: Any
    content: bytes | None
    content_type: str | None
    params: Any
    form_style: str
    files: Any
    deliver_within: timedelta | None


@dataclass(frozen=True, slots=True)
class Checked:
    """An intent as the outbox accepted it: its identity, and its arguments in the one
    form that is stored and compared."""

    operation_id: str
    tenant: str
    ordering_key: str | None
    args: CanonicalArgs


#: ``priority`` is stored in a 32-bit column.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


def check_priority(priority: object) -> int:
    if type(priority) is not int or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise ValidationError(
            f"priority must be an int from {PRIORITY_RANGE[0]} to {PRIORITY_RANGE[1]} "
            f"(higher is sent first), got {priority!r}"
        )
    return priority


def check_not_before(not_before: object) -> int | None:
    """A scheduled send as epoch milliseconds; a naive datetime is refused (its zone
    would be a guess)."""
    if not_before is None:
        return None
    if not isinstance(not_before, datetime):
        raise ValidationError(
            f"not_before must be a timezone-aware datetime, got {type(not_before).__name__}"
        )
    if not_before.tzinfo is None or not_before.utcoffset() is None:
        raise ValidationError(
            f"not_before must be timezone-aware (say datetime.now(UTC) + ...), got the naive "
            f"{not_before.isoformat()}"
        )
    return int(not_before.timestamp() * 1000)


def check_deliver_within(deliver_within: object) -> int | None:
    """A per-operation business deadline as milliseconds after enqueue; None keeps the
    endpoint policy's ``deliver_within``."""
    if deliver_within is None:
        return None
    if not isinstance(deliver_within, timedelta) or deliver_within <= timedelta(0):
        raise ValidationError(
            f"deliver_within must be a positive timedelta (or None for the endpoint "
            f"policy's), got {deliver_within!r}"
        )
    # Rounded up: a positive deadline never becomes "due at enqueue".
    return -(-deliver_within // timedelta(milliseconds=1))


def scheduled(args: CanonicalArgs, intent: Intent) -> CanonicalArgs:
    """``args`` with the intent's validated priority, scheduled time and business
    deadline."""
    priority = check_priority(intent.priority)
    not_before_ms = check_not_before(intent.not_before)
    deliver_within_ms = check_deliver_within(intent.deliver_within)
    if priority == 0 and not_before_ms is None and deliver_within_ms is None:
        return args
    return replace(
        args, priority=priority, not_before_ms=not_before_ms, deliver_within_ms=deliver_within_ms
    )


def quoted(value: object, limit: int = 100) -> str:
    """``repr(value)``, cut to ``limit`` characters of a long string: what an error
    message quotes of rejected input, so a 100 KB argument is not a 100 KB line."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    return repr(value)


def _spelled(value: object, pattern: re.Pattern[str], what: str, rule: str) -> str:
    """``value``, a string ``pattern`` matches whole; else the error that states ``rule``."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValidationError(f"{what} must be {rule}, got {quoted(value)}")
    return value


def check_operation_id(operation_id: object) -> str:
    rule = "1-255 characters of [A-Za-z0-9._:-]"
    return _spelled(operation_id, OPERATION_ID_PATTERN, "operation_id", rule)


def check_tenant(tenant: object) -> str:
    return _spelled(tenant, TENANT_PATTERN, "tenant", "0-255 characters of [A-Za-z0-9._:-]")


def check_ordering_key(ordering_key: object) -> str | None:
    if ordering_key is None:
        return None
    rule = "1-255 characters of [A-Za-z0-9._:/-]"
    return _spelled(ordering_key, _ORDERING_KEY_PATTERN, "ordering_key", rule)


def _check_method(method: object) -> str:
    if not isinstance(method, str) or method.upper() not in METHODS:
        raise ValidationError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    return method.upper()


def _encodable(text: str) -> bool:
    """``text`` has no lone surrogate: it can be encoded as UTF-8 and sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def leaves_base(path: str) -> bool:
    """``path`` has a dot segment (RFC 3986 §5.2.4): ``.`` or ``..``, also spelled
    percent-encoded (``%2e%2e``), with ``;`` parameters (``..;x``) or backslashes.
    A stored path is relative to the endpoint's base path and must stay under it;
    removing dot segments could climb out of it, so no path may have one."""
    # Decoded first: %2f and %5c (an encoded slash or backslash) separate segments too.
    decoded = unquote(path.split("?", 1)[0]).replace("\\", "/")
    return any(segment.split(";", 1)[0] in (".", "..") for segment in decoded.split("/"))


def _check_path(path: object) -> str:
    if not isinstance(path, str) or not path.startswith("/") or path.startswith("//"):
        raise ValidationError(
            "path must be relative to the endpoint's base URL and start with one '/', "
            f"got {quoted(path)}"
        )
    if len(path) > 2048:
        raise ValidationError("path is longer than 2048 characters")
    if leaves_base(path):
        raise ValidationError(
            f"path must stay under the endpoint's base path: no '.' or '..' segments "
            f"(also percent-encoded or with ';' parameters), got {quoted(path)}"
        )
    if not _encodable(path):
        raise ValidationError(
            f"path contains a lone surrogate, which cannot be sent: {quoted(path)}"
        )
    if _CONTROL.search(path) or " " in path or "#" in path or "\\" in path:
        raise ValidationError(
            f"path contains spaces, control characters, '#' or '\\': {quoted(path)}"
        )
    return path


def _check_headers(
    headers: Mapping[str, str] | None, secret_headers: Iterable[str]
) -> dict[str, str]:
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise ValidationError("headers must be a mapping of header name to value")
    secrets = CREDENTIAL_HEADERS | {h.lower() for h in secret_headers}
    out: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise ValidationError(f"invalid header name {name!r}")
        lower = name.lower()
        if lower in secrets:
            raise ValidationError(
                f"header {name!r} carries credentials and is never stored; supply it through "
                "the endpoint's auth, which is applied at send time"
            )
        if lower in _RESERVED_HEADERS:
            raise ValidationError(f"header {name!r} is set by the dispatcher and cannot be given")
        if not isinstance(value, str) or _CONTROL.search(value.replace("\t", "")):
            raise ValidationError(f"header {name!r} must be a string without control characters")
        if not value.isascii():
            # HTTP/1.1 sends header bytes; the transport encodes values as ASCII, so a
            # value like "café" could never leave: every attempt would fail to build.
            raise ValidationError(
                f"header {name!r} must be ASCII (percent-encode it, or use RFC 8187's "
                f"ext-value), got {value!r}"
            )
        out[lower] = value
    return dict(sorted(out.items()))


def _depth(value: Any, limit: int) -> None:
    # Iterative, so a hostile payload cannot exhaust the interpreter's stack.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise ValidationError(f"json body is nested deeper than {limit} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((v, depth + 1) for v in item)


def canonical_json(value: Any) -> str:
    """Sorted keys, compact separators, no NaN or Infinity."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as exc:
        raise ValidationError(f"json body is not valid JSON (NaN or Infinity?): {exc}") from exc
    except TypeError as exc:
        raise ValidationError(f"json body is not JSON-serialisable: {exc}") from exc


def canonical_json_text(text: str | bytes) -> str | None:
    """``text`` read as JSON and written back in canonical form (sorted keys, compact
    separators): how a receiver's body is stored and compared. None if it is not JSON."""
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):
        return None


def _raw_body(
    intent: Intent, headers: dict[str, str], secret_headers: Iterable[str]
) -> bytes | None:
    """The encoded bytes of a ``data=`` or ``content=`` body; its content type goes into
    ``headers`` (stored, sent and fingerprinted with them)."""
    given = [name for name, v in (("json", intent.json), ("data", intent.data),
                                    ("content", intent.content)) if v is not None]  # fmt: skip
    if len(given) > 1:
        raise ValidationError(f"give at most one body: json=, data= or content= (got {given})")
    if intent.content_type is not None and intent.content is None:
        raise ValidationError("content_type= goes with content= (json= and data= set their own)")
    declared = headers.get("content-type")
    if intent.data is not None:
        pairs, raw = encode_form(intent.data, form_style=intent.form_style)
        check_secret_pairs(pairs, "form field", secret_headers)
        if declared is not None and declared.split(";")[0].strip().lower() != FORM_CONTENT_TYPE:
            raise ValidationError(f"data= is sent as {FORM_CONTENT_TYPE}, not {declared!r}")
        headers.setdefault("content-type", FORM_CONTENT_TYPE)
        return raw
    if intent.content is None:
        return None
    if not isinstance(intent.content, bytes | bytearray | memoryview):
        raise ValidationError(f"content= must be bytes, got {type(intent.content).__name__}")
    if intent.content_type is None:
        raise ValidationError("content= needs an explicit content_type= (say 'application/xml')")
    if declared is not None:
        raise ValidationError("give the content type once: content_type=, not a header")
    headers["content-type"] = check_content_type(intent.content_type)
    return bytes(intent.content)


def canonicalize(
    *,
    endpoint: str,
    method: str,
    path: str,
    json_body: Any,
    headers: Mapping[str, str] | None,
    max_body_bytes: int,
    secret_headers: Iterable[str] = (),
) -> CanonicalArgs:
    """:func:`canonical_args` of a request with a JSON body (or none)."""
    intent = Intent(endpoint, method, path, json_body, headers)
    return canonical_args(intent, max_body_bytes=max_body_bytes, secret_headers=secret_headers)


def canonical_args(
    intent: Intent, *, max_body_bytes: int, secret_headers: Iterable[str] = ()
) -> CanonicalArgs:
    """Validate an intent's request arguments (endpoint, method, path, headers, at most
    one body form, the query) and return their canonical, comparable form."""
    if intent.files is not None:
        raise_multipart()
    checked_method = _check_method(intent.method)
    checked_path = _check_path(intent.path)
    checked_headers = _check_headers(intent.headers, secret_headers)
    if intent.params is not None:
        _, query = encode_query(intent.params)
        checked_path = append_query(checked_path, query)
    if "?" in checked_path:
        query_pairs = parse_qsl(checked_path.split("?", 1)[1], keep_blank_values=True)
        check_secret_pairs(query_pairs, "query parameter", secret_headers)
    body_raw = _raw_body(intent, checked_headers, secret_headers)
    checked_headers = dict(sorted(checked_headers.items()))
    if body_raw is not None and len(body_raw) > max_body_bytes:
        raise ValidationError(f"body is {len(body_raw)} bytes, over the limit of {max_body_bytes}")
    body_json: str | None = None
    if intent.json is not None:
        _depth(intent.json, MAX_JSON_DEPTH)
        body_json = canonical_json(intent.json)
        if not _encodable(body_json):
            raise ValidationError("json body contains a lone surrogate, which cannot be sent")
        size = len(body_json.encode("utf-8"))
        if size > max_body_bytes:
            raise ValidationError(f"json body is {size} bytes, over the limit of {max_body_bytes}")
    fields: dict[str, Any] = {
        "endpoint": intent.endpoint,
        "method": checked_method,
        "path": checked_path,
        "headers": checked_headers,
        "body": body_json,
    }
    if body_raw is not None:  # absent for JSON: the fingerprints stored before stay valid
        fields["raw_sha256"] = hashlib.sha256(body_raw).hexdigest()
    identity = canonical_json(fields)
    return CanonicalArgs(
        endpoint=intent.endpoint,
        method=checked_method,
        path=checked_path,
        headers=checked_headers,
        body_json=body_json,
        args_sha256=hashlib.sha256(identity.encode("utf-8")).hexdigest(),
        body_raw=body_raw,
    )
