"""A probe's answer as the checker keeps it: decoded once, readable again."""

from __future__ import annotations

import asyncio
import gzip

import httpx

from outbox import Endpoint
from outbox.checker.probes import Probe, Prober, reading
from outbox.model import Verdict
from outbox.wire.transport import build_client


def _gzipped(request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        201,
        headers={"Content-Encoding": "gzip", "X-Request-ID": request.headers["X-Request-ID"]},
        content=gzip.compress(b'{"effect_id": 7}'),
    )


def test_a_gzipped_answer_is_kept_decoded_and_read_without_decoding_it_again() -> None:
    endpoint = Endpoint(name="rx", base_url="http://rx.example", probe_safe=True)

    async def send() -> Probe:
        async with build_client(endpoint, httpx.MockTransport(_gzipped)) as client:
            prober = Prober(client, endpoint, method="POST", path="/orders", tenant="")
            return await prober.send("outbox-probe-k1", b"{}")

    probe = asyncio.run(send())
    assert (probe.status, probe.error) == (201, None)
    assert probe.result == '{"effect_id":7}'
    assert probe.echoed_request_id == probe.request_id
    assert reading(probe) is Verdict.SUCCESS


def test_probe_keys_fit_the_endpoints_key_pattern() -> None:
    import re
    import uuid as uuid_module

    from outbox.checker.probes import PROBE_PREFIX, probe_key

    uuid_only = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    key = probe_key(lambda k: re.fullmatch(uuid_only, k) is not None)
    assert str(uuid_module.UUID(key)) == key  # a UUID for a receiver that takes only UUIDs
    assert probe_key(lambda k: re.fullmatch(r"[0-9a-f]{32}", k) is not None).isalnum()
    assert probe_key().startswith(PROBE_PREFIX)
    assert probe_key(lambda k: True).startswith(PROBE_PREFIX)


def test_changed_form_fields_and_content_stay_plausible() -> None:
    from outbox.checker.probes import changed_content, changed_fields, probe_body

    pairs = [("currency", "eur"), ("amount", "0099"), ("note", "")]
    assert changed_fields(pairs) == (
        [("currency", "eur"), ("amount", "0100"), ("note", "")],
        "amount: 0099 -> 0100",
    )
    assert changed_fields([("currency", "eur")])[0] == [("currency", "eur-changed")]
    assert changed_fields([("note", "")])[0] == [("note", ""), ("outbox_probe_variant", "changed")]
    xml = b'<?xml version="1.0"?><a><n>7</n></a>'
    assert changed_content(xml)[0] == b'<?xml version="1.0"?><a><n>8</n></a>'
    assert changed_content(b"v=19;")[0] == b"v=20;"
    assert changed_content(b"<a/>") == (
        b"<a/>\n",
        "appended a newline (the content has no number to change)",
    )
    # Encoded as enqueue encodes it: Stripe's brackets, the form content type.
    data = {"amount": "5", "metadata": {"k": "v"}}
    body = probe_body(endpoint="e", method="POST", path="/", data=data, form_style="stripe")
    assert (body.kind, body.content_type) == ("form", "application/x-www-form-urlencoded")
    assert body.content == b"amount=5&metadata%5Bk%5D=v"
    assert body.changed == b"amount=6&metadata%5Bk%5D=v"
