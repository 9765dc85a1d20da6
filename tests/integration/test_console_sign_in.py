"""The console limits failed sign-ins per client address and logs each one.

Five wrong tokens from one address lock it out: even the right token then gets 429
with ``Retry-After``; each failure is logged (``console_sign_in_failed``) and the
lockout too (``console_sign_in_locked``), the token never. Another address of the same
console is not locked out.
"""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from outbox import Outbox
from outbox.console import create_app
from tests.integration.test_console import ALICE, BASE, creds


def test_repeated_failed_sign_ins_lock_the_address_out_and_are_logged(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with Outbox(db_url) as ob:
        app = create_app(ob, creds())
        c = TestClient(app, base_url=BASE, client=("10.0.0.1", 40000))
        wrong = ALICE[:-1] + "z"
        with caplog.at_level(logging.WARNING, logger="outbox.console"):
            for _ in range(5):
                r = c.post("/login", data={"token": wrong}, follow_redirects=False)
                assert r.status_code == 401
            r = c.post("/login", data={"token": ALICE}, follow_redirects=False)
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
        text = caplog.text
        assert text.count("console_sign_in_failed") == 5
        assert "console_sign_in_locked" in text and "console_sign_in_refused_locked" in text
        assert "10.0.0.1" in text
        assert wrong not in text and ALICE not in text
        other = TestClient(app, base_url=BASE, client=("10.0.0.2", 40000))
        r = other.post("/login", data={"token": ALICE}, follow_redirects=False)
        assert r.status_code == 303
