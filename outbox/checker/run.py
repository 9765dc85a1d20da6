"""Running a receiver check: validate, probe in order, judge."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from outbox.canonical import check_tenant
from outbox.checker.probes import (
    PROBE_TENANTS,
    Observed,
    Probe,
    Prober,
    probe_body,
    probe_key,
)
from outbox.checker.report import CheckReport, cause_of
from outbox.checker.verdicts import (
    changed_payload_refused,
    concurrent_duplicates,
    key_retained,
    new_key_new_operation,
    replay_fresh_request_id,
    same_key_same_result,
    tenants_kept_apart,
)
from outbox.errors import ConfigurationError, ValidationError
from outbox.model import LookupResult
from outbox.wire.transport import build_client

if TYPE_CHECKING:
    from outbox.client import Outbox

#: The longest wait before re-sending a key (seconds): a hint, not a retention test.
MAX_RETENTION_DELAY = 3600.0

P = ParamSpec("P")
R = TypeVar("R")


class UnsafeProbeRefused(ConfigurationError):
    """The endpoint is not marked ``probe_safe`` and ``allow_unsafe`` was not given."""


async def check_receiver_async(
    outbox: Outbox,
    *,
    endpoint: str,
    path: str,
    json_body: Any = None,
    method: str = "POST",
    tenant: str = "",
    retention_delay: float = 2.0,
    concurrency: int = 8,
    allow_unsafe: bool = False,
    strict: bool = False,
    probe_tenants: tuple[str, str] = PROBE_TENANTS,
    data: Any = None,
    form_style: str = "flat",
    content: bytes | None = None,
    content_type: str | None = None,
) -> CheckReport:
    """Probe ``endpoint``'s receiver and report one verdict per idempotency property.

    Sends about ``concurrency + 7`` requests with fresh ``outbox-probe-`` keys (and a
    few status lookups when the endpoint has a ``status_lookup``); takes at least
    ``retention_delay`` seconds. The probe body is given as ``enqueue`` takes it, in the
    form the endpoint's operations use: ``json_body``, form fields ``data`` (with
    ``form_style``) or raw ``content`` with its ``content_type``; exactly one. It is
    encoded and validated as ``enqueue`` would encode it, and the changed-payload probe
    changes one argument in that form (a number first). Nothing is written to the
    outbox's database. Raises
    :class:`UnsafeProbeRefused`, before sending anything, for an endpoint not marked
    ``probe_safe`` unless ``allow_unsafe``; :class:`ConfigurationError` for an unknown
    endpoint; :class:`ValidationError` for a bad path, method or body (none or two).

    ``check_receiver`` (same parameters) runs it in an event loop of its own;
    ``check_receiver_async`` is for callers already inside one.
    """
    ep = outbox.endpoints.get(endpoint)
    if ep is None:
        raise ConfigurationError(
            f"unknown endpoint {endpoint!r}; registered: {sorted(outbox.endpoints)}"
        )
    if not ep.probe_safe and not allow_unsafe:
        raise UnsafeProbeRefused(
            f"endpoint {endpoint!r} is not marked probe_safe=True: the checker sends real "
            "operations that create real effects on the receiver. Point it at a staging or "
            "test receiver and mark that endpoint probe_safe=True, or pass "
            "--i-understand-this-sends-real-requests (library: allow_unsafe=True)."
        )
    if not path.startswith("/"):
        raise ValidationError(f"the probe path must start with '/', got {path!r}")
    if not method.isalpha():
        raise ValidationError(f"not an HTTP method: {method!r}")
    if not 0 <= retention_delay <= MAX_RETENTION_DELAY:  # NaN too: it compares false
        raise ValidationError(
            f"the retention delay must be 0 to {MAX_RETENTION_DELAY:g} seconds, "
            f"got {retention_delay!r}"
        )
    if concurrency < 2:
        raise ValidationError("concurrency must be at least 2")
    if len(probe_tenants) != 2 or probe_tenants[0] == probe_tenants[1]:
        raise ValidationError("probe_tenants must be two different tenants")
    for probe_tenant in probe_tenants:
        check_tenant(probe_tenant)
    if tenant:
        check_tenant(tenant)
    method = method.upper()
    probe = probe_body(
        endpoint=ep.name, method=method, path=path, json_body=json_body, data=data,
        form_style=form_style, content=content, content_type=content_type,
        secret_headers=outbox.secret_headers,
    )  # fmt: skip
    body, changed_body, changed_how = probe.content, probe.changed, probe.changed_how
    ct = probe.content_type

    def fits(key: str) -> bool:  # the endpoint's key_pattern, on the key as sent
        pattern = ep.key_pattern
        return pattern is None or re.fullmatch(pattern, ep.wire_key(tenant, key)) is not None

    keys = {
        "same_key": probe_key(fits),
        "new_key": probe_key(fits),
        "burst": probe_key(fits),
        "retained": probe_key(fits),
    }
    if ep.tenant_scope is not None:
        keys["tenants"] = probe_key(fits)
    factory = outbox.transport_factory
    async with build_client(ep, factory(ep) if factory else None) as client:
        p = Prober(client, ep, method=method, path=path, tenant=tenant, content_type=ct)
        # The retention probe goes first; its delay runs while the other checks do.
        retained_first = await p.send(keys["retained"], body)
        retained_sent = time.monotonic()
        first = await p.send(keys["same_key"], body)
        again = await p.send(keys["same_key"], body)
        changed_probe = await p.send(keys["same_key"], changed_body)
        other = await p.send(keys["new_key"], body)
        burst = list(
            await asyncio.gather(*(p.send(keys["burst"], body) for _ in range(concurrency)))
        )
        burst_after = await p.send(keys["burst"], body)
        tenant_probes: tuple[Probe, Probe] | None = None
        if "tenants" in keys:
            a, b = (
                Prober(client, ep, method=method, path=path, tenant=t, content_type=ct)
                for t in probe_tenants
            )
            tenant_probes = (
                await a.send(keys["tenants"], body),
                await b.send(keys["tenants"], body),
            )
        lookups: dict[str, LookupResult | None] = {}
        for name in ("same_key", "new_key", "burst"):
            lookups[name] = await p.lookup(keys[name])
        remaining = retention_delay - (time.monotonic() - retained_sent)
        if remaining > 0:
            await asyncio.sleep(remaining)
        lookups["retained"] = await p.lookup(keys["retained"])
        retained_again = await p.send(keys["retained"], body)
    observed = Observed(
        first=first,
        again=again,
        changed=changed_probe,
        changed_how=changed_how,
        other_key=other,
        burst=burst,
        burst_after=burst_after,
        retained_first=retained_first,
        retained_again=retained_again,
        delay=retention_delay,
        lookups=lookups,
        tenant_probes=tenant_probes,
        replay_status=ep.replay_status,
    )
    same_key = same_key_same_result(observed)
    verdicts = (
        same_key,
        changed_payload_refused(observed),
        new_key_new_operation(observed),
        replay_fresh_request_id(observed, same_key),
        concurrent_duplicates(observed),
        key_retained(observed, ep),
        tenants_kept_apart(observed, ep),
    )
    return CheckReport(
        endpoint=ep.name,
        base_url=ep.base_url,
        method=method,
        path=path,
        tenant=tenant,
        verdicts=verdicts,
        probe_keys=tuple(keys.values()),
        retention_delay_seconds=retention_delay,
        strict=strict,
        body_kind=probe.kind,
        content_type=ct,
        cause=cause_of(
            [
                (q.status, q.body, q.error)
                for q in (first, again, changed_probe, other, *burst, burst_after)
            ]
        ),
    )


def _blocking(fn: Callable[P, Coroutine[Any, Any, R]], name: str) -> Callable[P, R]:
    """``fn`` run to completion in an event loop of its own: same parameters, same
    documentation, its own name."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return asyncio.run(fn(*args, **kwargs))

    run.__name__ = run.__qualname__ = name
    return run


check_receiver = _blocking(check_receiver_async, "check_receiver")
