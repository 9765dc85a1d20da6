"""Request bodies other than JSON, and the query string: encoded once, at enqueue.

What ``enqueue`` stores is what the dispatcher sends, byte for byte, so every encoding
happens here, before anything is written, and is pure:

* ``data=``: form fields, ``application/x-www-form-urlencoded``. A *mapping* is encoded
  canonically, names sorted (the same intent rebuilt with another dict order is the same
  operation, as with JSON's sorted keys); a *sequence of (name, value) pairs* keeps the
  given order. A value is a str or a list/tuple of str (repeated ``name=v`` pairs, in
  the given order). ``form_style="stripe"`` also takes nested mappings and lists and
  writes them in Stripe's bracket convention: ``metadata[order]=17``,
  ``items[0][price]=p_1`` (lists by index, as Stripe's own libraries do); ``int``,
  ``bool`` (``true``/``false``) and ``None`` (an empty value, Stripe's "unset") are
  accepted there.
* ``content=``: raw bytes with an explicit ``content_type=`` (XML, protobuf, a signed
  payload): sent as given.
* ``params=``: the query string, a mapping or pairs, *kept in the given order* (a query
  may be signed; its order is the caller's), appended to the path.

A form field or query parameter that carries a credential (``api_key``, ``password``,
``client_secret``..., or a Stripe secret key as a value) is refused like a credential
header: the endpoint's ``auth`` supplies credentials at send time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from outbox.errors import ValidationError

FORM_CONTENT_TYPE = "application/x-www-form-urlencoded"
FORM_STYLES = ("flat", "stripe")
MAX_QUERY_CHARS = 8192
_MAX_FORM_DEPTH = 16
_CONTENT_TYPE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+/[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*;.*)?$")

#: Field or parameter names (lower-cased, ``-`` read as ``_``) that carry credentials.
CREDENTIAL_FIELDS = frozenset(
    {
        "api_key",
        "apikey",
        "access_token",
        "auth_token",
        "refresh_token",
        "id_token",
        "token",
        "password",
        "passwd",
        "secret",
        "client_secret",
        "private_key",
        "secret_key",
        "authorization",
        "x_api_key",
        "session_id",
    }
)
#: Values that are credentials whatever their field is called (Stripe's secret and
#: restricted keys).
_CREDENTIAL_VALUE = re.compile(r"^(sk|rk)_(live|test)_[A-Za-z0-9]{8,}")


def _leaf_name(name: str) -> str:
    # "card[password]" -> "password": a nested Stripe name is checked by its last part.
    base = name.rsplit("[", 1)[-1].rstrip("]") if name.endswith("]") else name
    return base.lower().replace("-", "_")


def check_secret_pairs(
    pairs: Iterable[tuple[str, str]], what: str, secret_names: Iterable[str] = ()
) -> None:
    """Refuse a pair whose name or value is a credential (``what``: "form field"...)."""
    names = CREDENTIAL_FIELDS | {n.lower().replace("-", "_") for n in secret_names}
    for name, value in pairs:
        if _leaf_name(name) in names or name.lower().replace("-", "_") in names:
            raise ValidationError(
                f"{what} {name!r} carries credentials and is never stored; supply it "
                "through the endpoint's auth, which is applied at send time"
            )
        if _CREDENTIAL_VALUE.match(value):
            raise ValidationError(
                f"{what} {name!r} holds what looks like a secret API key; credentials are "
                "never stored: supply them through the endpoint's auth"
            )


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValidationError(
            f"{where} must be a str (or a list of str), got {type(value).__name__}"
        )
    return value


def _name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValidationError(f"{what} names must be non-empty strings, got {name!r}")
    return name


def _items(value: object, what: str, *, sort: bool) -> list[tuple[str, Any]]:
    """A mapping's items (sorted by name when ``sort``) or a sequence of pairs, as given."""
    if isinstance(value, Mapping):
        items = [(_name(k, what), v) for k, v in value.items()]
        return sorted(items, key=lambda kv: kv[0]) if sort else items
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValidationError(
            f"{what}s must be a mapping or a sequence of (name, value) pairs, "
            f"got {type(value).__name__}"
        )
    out: list[tuple[str, Any]] = []
    for pair in value:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise ValidationError(f"{what}s given as a sequence must hold (name, value) pairs")
        out.append((_name(pair[0], what), pair[1]))
    return out


def flat_pairs(value: object, what: str, *, sort: bool) -> list[tuple[str, str]]:
    """``name=value`` pairs: values are str, or lists of str (repeated names)."""
    pairs: list[tuple[str, str]] = []
    for name, v in _items(value, what, sort=sort):
        if isinstance(v, list | tuple):
            pairs.extend((name, _text(item, f"{what} {name!r}")) for item in v)
        else:
            pairs.append((name, _text(v, f"{what} {name!r}")))
    return pairs


def _stripe_scalar(value: object, name: str) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return _text(value, f"form field {name!r}")


def stripe_pairs(value: object) -> list[tuple[str, str]]:
    """Nested mappings and lists in Stripe's bracket convention, mappings sorted."""
    pairs: list[tuple[str, str]] = []
    stack: list[tuple[str, Any, int]] = [
        (name, v, 1) for name, v in reversed(_items(value, "form field", sort=True))
    ]
    while stack:
        name, v, depth = stack.pop()
        if depth > _MAX_FORM_DEPTH:
            raise ValidationError(f"form body is nested deeper than {_MAX_FORM_DEPTH} levels")
        if isinstance(v, Mapping):
            children = [(f"{name}[{k}]", c) for k, c in _items(v, "form field", sort=True)]
        elif isinstance(v, list | tuple):
            children = [(f"{name}[{i}]", c) for i, c in enumerate(v)]
        else:
            pairs.append((name, _stripe_scalar(v, name)))
            continue
        stack.extend((n, c, depth + 1) for n, c in reversed(children))
    return pairs


def encode_pairs(pairs: Iterable[tuple[str, str]]) -> str:
    """``application/x-www-form-urlencoded`` (spaces as ``+``), as httpx writes ``data=``."""
    return urlencode(list(pairs))


def encode_form(data: object, *, form_style: str = "flat") -> tuple[list[tuple[str, str]], bytes]:
    """The pairs of ``data=`` and their encoded bytes."""
    if form_style not in FORM_STYLES:
        raise ValidationError(f"form_style must be one of {FORM_STYLES}, got {form_style!r}")
    pairs = (
        stripe_pairs(data) if form_style == "stripe" else flat_pairs(data, "form field", sort=True)
    )
    return pairs, encode_pairs(pairs).encode("ascii")


def encode_query(params: object) -> tuple[list[tuple[str, str]], str]:
    """The pairs of ``params=`` in the given order and the query string (``%20`` for
    spaces, as httpx writes a query)."""
    pairs = flat_pairs(params, "query parameter", sort=False)
    query = urlencode(pairs, quote_via=quote)
    if len(query) > MAX_QUERY_CHARS:
        raise ValidationError(
            f"query is {len(query)} characters, over the limit of {MAX_QUERY_CHARS}"
        )
    return pairs, query


def check_content_type(content_type: object) -> str:
    if not isinstance(content_type, str) or not _CONTENT_TYPE.fullmatch(content_type.strip()):
        raise ValidationError(
            f"content_type must be a media type such as 'application/xml', got {content_type!r}"
        )
    if re.search(r"[\x00-\x1f\x7f]", content_type):
        raise ValidationError("content_type must not contain control characters")
    if content_type.lower().startswith("multipart/"):
        raise_multipart()
    return content_type.strip()


def raise_multipart() -> None:
    raise ValidationError(
        "multipart bodies (file uploads) are not supported: an outbox stores the exact bytes "
        "it sends, and uploads belong in object storage; send a reference to the file instead"
    )


def append_query(path: str, query: str) -> str:
    if not query:
        return path
    return f"{path}&{query}" if "?" in path else f"{path}?{query}"


def body_view(content_type: str | None, body: bytes | None) -> dict[str, Any]:
    """How operators are shown a stored body, as the receiver gets it: ``kind`` "none",
    "json" (``text``), "form" (``fields``: decoded name/value pairs, in wire order) or
    "raw" (``size``, ``sha256`` and a ``hex`` head: never rendered as text or HTML)."""
    import hashlib

    if body is None:
        return {"kind": "none"}
    media = (content_type or "").split(";")[0].strip().lower()
    if media == FORM_CONTENT_TYPE:
        try:
            fields = parse_qsl(body.decode("ascii"), keep_blank_values=True, strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            fields = None
        if fields is not None:
            return {"kind": "form", "size": len(body), "fields": [list(f) for f in fields]}
    if media == "application/json" or media.endswith("+json"):
        try:
            return {"kind": "json", "size": len(body), "text": body.decode("utf-8")}
        except UnicodeDecodeError:
            pass
    return {
        "kind": "raw",
        "content_type": content_type,
        "size": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "hex": body[:64].hex(),
    }
