"""The pytest plugin as a user meets it: installed, found through its ``pytest11`` entry
point, its fixtures used from a plain test file with no conftest, in a fresh process."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

USER_TEST = """
def test_lost_response(outbox_receiver, make_outbox):
    ob = make_outbox()
    outbox_receiver.faults.drop_after_commit(times=1)
    ob.enqueue(endpoint="receiver", method="POST", path="/orders",
               json={"sku": "X"}, operation_id="order-1")
    ob.dispatch_once()                        # response lost after the commit
    ob.clock.advance(5)                       # past the backoff (FakeClock)
    ob.dispatch_once()                        # retried, replayed
    assert ob.get("order-1").state == "succeeded"
    assert outbox_receiver.effect_count(key="order-1") == 1
"""

# The same test against a user's own receiver (fixture override) and a user's own
# endpoint options: a tenant header and a predictable backoff.
USER_OVERRIDE = """
import pytest
from tenacity import wait_fixed
from outbox.testing.receiver import Receiver


def handler(conn, tenant, method, path, body):
    return 201, {"reserved": body["sku"], "tenant": tenant}


@pytest.fixture
def outbox_receiver(tmp_path):
    with Receiver(tmp_path / "mine.sqlite3", handler=handler) as rx:
        yield rx


def test_with_my_receiver(outbox_receiver, make_outbox):
    ob = make_outbox(name="inventory", wait=wait_fixed(1), tenant_header="X-Tenant")
    outbox_receiver.faults.drop_after_commit(times=1)
    ob.enqueue(endpoint="inventory", method="POST", path="/r", json={"sku": "X"},
               operation_id="r-1", tenant="acme")
    ob.dispatch_once()
    ob.clock.advance(1)
    ob.dispatch_once()
    op = ob.get("r-1", tenant="acme")
    assert op.state == "succeeded"
    assert op.result.body == {"reserved": "X", "tenant": "acme"}
    assert outbox_receiver.effect_count(key="r-1", tenant="acme") == 1
"""


def test_plugin_fixtures_run_a_users_lost_response_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TEST, test_override=USER_OVERRIDE)
    # -W error: the fixtures must close every receiver, outbox and engine they made.
    result = pytester.runpytest_subprocess("-q", "-W", "error", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
