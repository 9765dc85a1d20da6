"""The fair claim: round robin across tenants, each tenant's own rows by priority.

A claim visits up to ``limit`` tenants that have due work, starting after the tenant
its store served last (``cursor``) and wrapping around: a recursive skip scan over
``ix_outbox_operations_fair``, one index probe per tenant. From each visited tenant
that has a row to claim now it takes its next claimable rows in the tenant's own order
(priority, highest first, then due time), through the same index: the whole batch for
one or two such tenants, else twice its even share. The batch is then dealt in rounds: every
visited tenant's first row, then every tenant's second, and so on (``ROW_NUMBER()``
over the few candidate rows, never over the backlog). A backlog of one tenant thus
costs another at most one round of a batch, however long it is.

Ordering keys need nothing more: an ordering key has at most one claimable row at a
time, so a key with a long chain holds one place in its tenant's order, not the queue.

The same SQL text serves both databases, with each one's spelling of "the next rows of
this tenant": a ``LATERAL`` join on PostgreSQL (locked with ``FOR UPDATE SKIP LOCKED``
in the outer select), a correlated ``IN (... LIMIT)`` on SQLite (which has no
``LATERAL``; the claim runs under the database's single write lock).

Operations of an endpoint the fleet has blocked (its circuit open or half open, or
paused: ``outbox_endpoints.blocked``) are not claimable here.

The per-tenant in-flight limit (``Endpoint.tenant_max_in_flight``) arrives as a JSON
object ``{endpoint: limit}`` in the parameter ``caps``: a tenant's rows of a capped
endpoint are taken only while its in-flight rows there (counted through
``ix_outbox_operations_tenant_in_flight``) leave room, and within one claim no more
than that room.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import BigInteger, String, Text, bindparam

from outbox.model import BLOCKING_STATES, DUE_STATES
from outbox.store.statements import sql_list

_T = "outbox_operations"
_DUE = f"state IN ({sql_list(DUE_STATES)})"


def _cap(dialect: str, alias: str) -> str:
    """The in-flight limit of ``alias``'s endpoint, or NULL."""
    if dialect == "postgresql":
        return f"(CAST(:caps AS jsonb) ->> {alias}.endpoint)::int"
    return f"(SELECT CAST(value AS INTEGER) FROM json_each(:caps) WHERE key = {alias}.endpoint)"


def fair_claim_sql(dialect: str) -> str:
    """The ids to claim, with ``was`` (the state before), ``rn`` (the round) and ``pos``
    (the tenant's place in the rotation); parameters ``now_ms``, ``limit``, ``cursor``,
    ``caps``, ``steady_ms`` (and on SQLite ``gone``). PostgreSQL's locks its rows
    (``FOR UPDATE SKIP LOCKED``)."""
    pg = dialect == "postgresql"
    ix = "" if pg else " INDEXED BY ix_outbox_operations_fair"
    fx = "" if pg else " INDEXED BY ix_outbox_operations_tenant_in_flight"
    # "ORDER BY tenant, priority DESC": only the due index gives that order, so the walk
    # cannot wander into the unique (tenant, operation_id) index, which holds every
    # finished row too (PostgreSQL chose it at a backlog of due rows only).
    first = (
        f"SELECT tenant FROM {_T}{ix} WHERE {_DUE} AND tenant > {{after}} "
        f"ORDER BY tenant, priority DESC LIMIT 1"
    )
    wrap = f"SELECT tenant FROM {_T}{ix} WHERE {_DUE} ORDER BY tenant, priority DESC LIMIT 1"
    blocked = (
        f"SELECT 1 FROM {_T} AS e WHERE e.tenant = o.tenant AND e.ordering_key = o.ordering_key"
        f" AND e.id < o.id AND e.state IN ({sql_list(BLOCKING_STATES)})"
    )
    # The endpoint's circuit is open or half open, or an operator paused it
    # (store.endpoints): nothing of it is claimed here; its probe has a claim of its own.
    endpoint_blocked = (
        "SELECT 1 FROM outbox_endpoints AS b WHERE b.name = o.endpoint AND b.blocked = 1"
    )
    cap = _cap(dialect, "o")
    # An expired lease is taken over only if it is no longer than the claiming clock
    # has run without a step (``steady_ms``; outbox.clock.SystemClock, DESIGN-NOTES
    # "Leases that survive a clock step"). A lease's length is its end minus the claim
    # that wrote it (``updated_at``).
    # On SQLite also a lease whose holder is known to have exited on this host (``gone``,
    # a JSON array of dispatcher ids: outbox.store.liveness.gone_holders).
    gone = "" if pg else " OR o.lease_owner IN (SELECT value FROM json_each(:gone))"
    held = (
        "(o.state <> 'in_flight' "
        f"OR COALESCE(o.lease_until - o.updated_at, 0) <= :steady_ms{gone})"
    )
    in_flight = (
        f"(SELECT count(*) FROM {_T} AS f{fx} WHERE f.state = 'in_flight' "
        f"AND f.tenant = o.tenant AND f.endpoint = o.endpoint AND f.lease_until > :now_ms)"
    )
    # Counted only where the endpoint has a limit (CASE is evaluated lazily).
    room = f"CASE WHEN {cap} IS NULL THEN NULL ELSE {cap} - {in_flight} END"
    claimable = (
        f"FROM {_T} AS o{ix} WHERE o.tenant = ring.tenant AND o.{_DUE} "
        f"AND o.next_attempt_at <= :now_ms AND {held} "
        f"AND (o.ordering_key IS NULL OR NOT EXISTS ({blocked})) "
        f"AND NOT EXISTS ({endpoint_blocked}) "
        f"AND ({cap} IS NULL OR {in_flight} < {cap})"
    )
    rows_of_tenant = (
        f"{claimable} ORDER BY o.priority DESC, o.next_attempt_at, o.id "
        "LIMIT (SELECT k FROM share)"
    )
    if pg:
        # The candidates are locked as they are read (SKIP LOCKED in the lookup): a
        # claim running at the same time as another takes the tenant's next rows, not
        # the same candidates, all skipped by the final lock, and an empty batch while
        # work is due. The few candidates not dealt stay locked until the claim commits.
        candidates = (
            f"SELECT ring.pos, c.id, c.tenant, c.endpoint, c.priority, c.next_attempt_at, "
            f"c.cap, c.room FROM live AS ring CROSS JOIN LATERAL (SELECT o.id, o.tenant, "
            f"o.endpoint, o.priority, o.next_attempt_at, {cap} AS cap, {room} AS room "
            f"{rows_of_tenant} FOR UPDATE OF o SKIP LOCKED) AS c"
        )
    else:
        candidates = (
            f"SELECT ring.pos, o.id, o.tenant, o.endpoint, o.priority, o.next_attempt_at, "
            f"{cap} AS cap, {room} AS room "
            f"FROM live AS ring JOIN {_T} AS o ON o.id IN (SELECT o.id {rows_of_tenant})"
        )
    rotation = (
        "WITH RECURSIVE walk(tenant, start, n) AS ("
        f"SELECT x.t, x.t, 1 FROM (SELECT COALESCE(({first.format(after=':cursor')}), "
        f"({wrap})) AS t) AS x WHERE x.t IS NOT NULL "
        "UNION ALL "
        f"SELECT COALESCE(({first.format(after='walk.tenant')}), ({wrap})), walk.start, "
        "walk.n + 1 FROM walk WHERE walk.n < :limit AND (walk.n = 1 OR walk.tenant <> walk.start)"
        "), "
        "ring AS (SELECT tenant, min(n) AS pos FROM walk GROUP BY tenant), "
        # The visited tenants with a row to claim now (one probe each): a tenant whose
        # rows are all in flight or scheduled later takes no share.
        f"live AS (SELECT ring.tenant, ring.pos FROM ring WHERE EXISTS (SELECT 1 {claimable})), "
        # Each tenant's share of candidates: twice its even share of the batch (room
        # for a tenant with fewer rows to be made up by the others), the whole batch
        # for one or two tenants: candidates stay near 2 x limit, not limit x tenants.
        "share AS (SELECT CASE WHEN count(*) <= 2 THEN :limit "
        "ELSE (2 * :limit + count(*) - 1) / count(*) END AS k FROM live), "
        f"cand AS ({candidates}), "
        "ranked AS (SELECT id, pos, ROW_NUMBER() OVER (PARTITION BY tenant "
        "ORDER BY priority DESC, next_attempt_at, id) AS rn, CASE WHEN cap IS NULL THEN 1 "
        "WHEN ROW_NUMBER() OVER (PARTITION BY tenant, endpoint ORDER BY priority DESC, "
        "next_attempt_at, id) <= room THEN 1 ELSE 0 END AS fits FROM cand) "
    )
    if pg:
        return (
            rotation
            + f"SELECT o.id, o.state AS was, r.rn, r.pos FROM ranked AS r JOIN {_T} AS o "
            f"ON o.id = r.id WHERE r.fits = 1 AND o.{_DUE} AND o.next_attempt_at <= :now_ms "
            "ORDER BY r.rn, r.pos LIMIT :limit FOR UPDATE OF o SKIP LOCKED"
        )
    return rotation + "SELECT id FROM ranked WHERE fits = 1 ORDER BY rn, pos LIMIT :limit"


def fair_params() -> tuple[Any, Any, Any]:
    """The fair claim's parameters beside ``now_ms`` and ``limit``."""
    return (bindparam("cursor", type_=String), bindparam("caps", type_=Text),
            bindparam("steady_ms", type_=BigInteger))  # fmt: skip


def next_cursor(
    tenants: Sequence[str], places: Sequence[tuple[int, int]] | None, cursor: str
) -> str:
    """The tenant the next claim starts after: the one served last in this claim's
    order (round, then place in the rotation). ``places`` are the rows' (round,
    position) where the database returned them (PostgreSQL, whose collation may not be
    Python's); otherwise they follow from the rows' tenants and SQLite's byte order,
    which is Python's."""
    if not tenants:
        return cursor
    if places is not None:
        return max(zip(places, tenants, strict=True))[1]
    counts: dict[str, int] = {}
    for t in tenants:
        counts[t] = counts.get(t, 0) + 1
    most = max(counts.values())
    return max((t for t, c in counts.items() if c == most), key=lambda t: (t <= cursor, t))


def caps_json(caps: Mapping[str, int]) -> str:
    """``{endpoint: limit}`` as the claim's ``caps`` parameter."""
    return json.dumps(dict(caps), sort_keys=True)


__all__ = ["caps_json", "fair_claim_sql", "next_cursor"]
