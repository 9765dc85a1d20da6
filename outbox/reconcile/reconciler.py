"""The :class:`Reconciler`: the operator's actions, and the status-lookup probes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Unpack

from outbox.reconcile.actions import FilterArgs, OperatorActions

if TYPE_CHECKING:
    from outbox.reconcile.probe import ProbeOutcome


class Reconciler(OperatorActions):
    """The operator's view of an outbox. The CLI and the console are thin layers over it.

    The probes ask receivers over HTTP, so their module (and httpx) is imported only
    when one runs: a read command stays fast.
    """

    def probe(self, operation_id: str, *, tenant: str = "") -> ProbeOutcome:
        """Ask the receiver (the endpoint's status_lookup) and settle a definitive answer."""
        from outbox.reconcile.probe import probe

        return probe(self.outbox, operation_id, tenant=tenant)

    def probe_all(self, **filters: Unpack[FilterArgs]) -> list[ProbeOutcome]:
        """:meth:`probe` every unresolved operation (optionally filtered)."""
        from outbox.reconcile.probe import probe_all

        return probe_all(self.outbox, **filters)
