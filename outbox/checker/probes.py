"""Sending probes as the dispatcher would, and what they observed."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

import httpx

from outbox.canonical import Intent, canonical_args, canonical_json, canonical_json_text
from outbox.classify import REPLAY_HEADERS
from outbox.errors import ValidationError
from outbox.forms import FORM_CONTENT_TYPE, encode_form, encode_pairs
from outbox.model import LookupResult, Verdict
from outbox.wire.exchange import clean_message, exchange
from outbox.wire.lookup import lookup_status
from outbox.wire.redact import request_redactor
from outbox.wire.transport import classify_response, request_headers

if TYPE_CHECKING:
    from outbox.config import Endpoint

PROBE_PREFIX = "outbox-probe-"
#: The tenants the tenant-scoping probe sends as, unless told others.
PROBE_TENANTS = (PROBE_PREFIX + "tenant-a", PROBE_PREFIX + "tenant-b")
BODY_EVIDENCE_CHARS = 500
_MAX_BODY = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Probe:
    key: str
    request_id: str
    status: int | None
    body: bytes
    headers: httpx.Headers | None
    error: str | None
    request_id_header: str

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def result(self) -> str:
        """The body, canonical when it is JSON: what two results are compared by."""
        return canonical_json_text(self.body) or self.body.decode("utf-8", errors="replace")

    @property
    def echoed_request_id(self) -> str | None:
        if self.headers is None:
            return None
        value: str | None = self.headers.get(self.request_id_header)
        return value

    def describe(self) -> str:
        return str(self.status) if self.status is not None else f"no response ({self.error})"

    def evidence(self) -> dict[str, Any]:
        text = self.body.decode("utf-8", errors="replace")
        kept: dict[str, str] = {}
        if self.headers is not None:
            for name in (self.request_id_header, *REPLAY_HEADERS, "retry-after"):
                if name in self.headers:
                    kept[name] = clean_message(self.headers[name], 200)
        return {
            "key": self.key,
            "request_id_sent": self.request_id,
            "status": self.status,
            "body": text[:BODY_EVIDENCE_CHARS] + ("…" if len(text) > BODY_EVIDENCE_CHARS else ""),
            "headers": kept,
            "error": self.error,
        }


@dataclass(eq=False, slots=True)
class Prober:
    """Sends probes to one endpoint as one tenant, the way the dispatcher sends."""

    client: httpx.AsyncClient
    endpoint: Endpoint
    _: KW_ONLY
    method: str
    path: str
    tenant: str
    content_type: str = "application/json"

    async def send(self, key: str, body: bytes) -> Probe:
        request_id = str(uuid.uuid4())
        try:
            headers = request_headers(
                self.endpoint,
                stored_headers={"content-type": self.content_type},
                operation_id=key,
                request_id=request_id,
                tenant=self.tenant,
                has_body=True,
            )
        except Exception as exc:  # a tenant_auth that does not know a probe tenant
            error = clean_message(f"could not build the request: {type(exc).__name__}: {exc}")
            return Probe(key, request_id, None, b"", None, error, self.endpoint.request_id_header)
        ex = await exchange(
            self.client,
            self.method,
            self.path,
            headers=headers,
            content=body,
            deadline_seconds=self.endpoint.timeout,
            keep=_MAX_BODY,
            limit=_MAX_BODY,
        )
        # The one redactor attempts use: what a probe reports never quotes a credential.
        redactor = request_redactor(self.endpoint, headers, ex.request)
        if ex.error is not None or ex.body is None:
            error = (
                f"no complete response within {self.endpoint.timeout}s"
                if ex.timed_out
                else clean_message(redactor.text(f"{type(ex.error).__name__}: {ex.error}"))
            )
            return Probe(key, request_id, None, b"", None, error, self.endpoint.request_id_header)
        # The body is decoded: keep the headers without its framing (Content-Encoding
        # would have a later reading decode it again).
        read = ex.readable(redactor.bytes(ex.body.head))
        return Probe(
            key, request_id, read.status_code, read.content, read.headers, None,
            self.endpoint.request_id_header,
        )  # fmt: skip

    async def lookup(self, key: str) -> LookupResult | None:
        if self.endpoint.status_lookup is None:
            return None
        return await lookup_status(self.client, self.endpoint, key, self.tenant)


def changed_payload(body: Any) -> tuple[Any, str]:
    """The same request with one argument changed, and what was changed.

    The first number is incremented, else the first string extended, else a field is
    added: the request stays as plausible as possible, so a refusal is about the key.
    """
    if isinstance(body, dict):
        for name, value in body.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                return {**body, name: value + 1}, f"{name}: {value!r} -> {value + 1!r}"
        for name, value in body.items():
            if isinstance(value, str):
                return {**body, name: value + "-changed"}, f"{name}: {value!r} -> changed"
        return {**body, "outbox_probe_variant": "changed"}, "added field outbox_probe_variant"
    if isinstance(body, list):
        return [*body, "outbox-probe-changed"], "appended an element"
    return {"value": body, "outbox_probe_variant": "changed"}, "wrapped the body in an object"


@dataclass(frozen=True, slots=True)
class ProbeBody:
    """The probe operation's body in the form the endpoint's operations use: the bytes
    sent, their content type, and the same request with one argument changed."""

    #: ``json``, ``form`` or ``raw``.
    kind: str
    content: bytes
    content_type: str
    changed: bytes
    changed_how: str


def probe_body(
    *,
    endpoint: str,
    method: str,
    path: str,
    json_body: Any = None,
    data: Any = None,
    form_style: str = "flat",
    content: bytes | None = None,
    content_type: str | None = None,
    secret_headers: tuple[str, ...] = (),
) -> ProbeBody:
    """Encode the probe body exactly as ``enqueue`` would store it (the same validation:
    one body form, a credential in a form field refused, a content type for raw bytes);
    :class:`ValidationError` otherwise."""
    given = [n for n, v in (("json", json_body), ("data", data), ("content", content))
             if v is not None]  # fmt: skip
    if len(given) != 1:
        raise ValidationError(
            "give the probe exactly one body: a JSON body, form fields (data) or raw "
            f"content with its content type (got {given or 'none'})"
        )
    intent = Intent(
        endpoint,
        method,
        path,
        json_body,
        data=data,
        content=content,
        content_type=content_type,
        form_style=form_style,
    )
    args = canonical_args(intent, max_body_bytes=_MAX_BODY, secret_headers=secret_headers)
    if json_body is not None:
        changed, how = changed_payload(json_body)
        assert args.body_json is not None
        return ProbeBody("json", args.body_json.encode(), "application/json",
                         canonical_json(changed).encode(), how)  # fmt: skip
    assert args.body_raw is not None
    if data is not None:
        pairs, _ = encode_form(data, form_style=form_style)
        changed_pairs, how = changed_fields(pairs)
        return ProbeBody("form", args.body_raw, FORM_CONTENT_TYPE,
                         encode_pairs(changed_pairs).encode("ascii"), how)  # fmt: skip
    changed_raw, how = changed_content(args.body_raw)
    return ProbeBody("raw", args.body_raw, args.headers["content-type"], changed_raw, how)


def changed_fields(pairs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], str]:
    """Form fields with one value changed, in their order: the first number incremented
    (``amount=2000`` -> ``2001``), else the first non-empty value extended, else a field
    added."""
    for i, (name, value) in enumerate(pairs):
        if value.isascii() and value.isdigit():
            bumped = str(int(value) + 1).zfill(len(value))
            return [*pairs[:i], (name, bumped), *pairs[i + 1 :]], f"{name}: {value} -> {bumped}"
    for i, (name, value) in enumerate(pairs):
        if value:
            return (
                [*pairs[:i], (name, value + "-changed"), *pairs[i + 1 :]],
                f"{name}: {value!r} -> changed",
            )
    return [*pairs, ("outbox_probe_variant", "changed")], "added field outbox_probe_variant"


#: A number that is an element's text (``<amount>2000</amount>``), else any number.
_ELEMENT_NUMBER = re.compile(rb">\s*([0-9]+)\s*<")
_NUMBER = re.compile(rb"([0-9]+)")


def changed_content(content: bytes) -> tuple[bytes, str]:
    """Raw bytes with one argument changed: the first number that is an element's text
    incremented (an amount in an XML document; never its ``version="1.0"``), else the
    first number, else a newline appended (a receiver that normalises whitespace may
    read that as the same request)."""
    found = _ELEMENT_NUMBER.search(content) or _NUMBER.search(content)
    if found is None:
        return content + b"\n", "appended a newline (the content has no number to change)"
    old = found.group(1)
    new = str(int(old) + 1).zfill(len(old)).encode()
    at = found.start(1)
    changed = content[:at] + new + content[found.end(1) :]
    return changed, f"the number at byte {at}: {old.decode()} -> {new.decode()}"


def probe_key(fits: Callable[[str], bool] | None = None) -> str:
    """A fresh probe key that the endpoint's ``key_pattern`` accepts (``fits``): the
    recognisable ``outbox-probe-<hex>`` when it may, else a UUID (canonical, then bare
    hex) for receivers that take only UUIDs; the prefixed key if nothing fits (the
    receiver's refusals then say why)."""
    u = uuid.uuid4()
    candidates = (PROBE_PREFIX + u.hex, str(u), u.hex)
    if fits is None:
        return candidates[0]
    return next((key for key in candidates if fits(key)), candidates[0])


@dataclass
class Observed:
    first: Probe
    again: Probe
    changed: Probe
    changed_how: str
    other_key: Probe
    burst: list[Probe]
    burst_after: Probe
    retained_first: Probe
    retained_again: Probe
    delay: float
    lookups: dict[str, LookupResult | None]
    tenant_probes: tuple[Probe, Probe] | None = None
    replay_status: int | None = None

    @property
    def discriminating(self) -> bool:
        """Do results identify the effect (a new key got a different result)?"""
        return self.first.ok and self.other_key.ok and self.first.result != self.other_key.result

    def replayed(self, probe: Probe) -> bool:
        """A 2xx, or the status the endpoint declares its replays come with (and a body
        the outbox would read as a replay)."""
        if probe.ok:
            return True
        if probe.status is None or probe.status != self.replay_status:
            return False
        return reading(probe, self.replay_status) is Verdict.SUCCESS


def reading(probe: Probe, replay_status: int | None = None) -> Verdict | None:
    """How the dispatcher's default rules would read this answer."""
    if probe.status is None:
        return None
    response = httpx.Response(probe.status, headers=probe.headers, content=probe.body)
    return classify_response(
        response, probe.body, int(time.time() * 1000), replay_status=replay_status
    ).verdict


def lookup_evidence(result: LookupResult | None) -> dict[str, Any] | None:
    if result is None:
        return None
    return {
        "status": result.status.value,
        "http_status": result.http_status,
        "detail": result.detail,
        "path": result.path,
    }
