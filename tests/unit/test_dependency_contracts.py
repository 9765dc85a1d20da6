"""What the outbox relies on inside its dependencies, checked against the installed ones.

Each private surface has one home (``outbox/wire/_httpx_fast.py``,
``outbox/wire/_aiohttp.py``, ``outbox/store/_sqlalchemy.py``). These tests fail loudly,
naming the home to revisit, when an upgrade changes what that home relies on; the
pyproject ranges pin the versions they were written against.
"""

from __future__ import annotations

import asyncio
import inspect

import aiohttp
import httpx
import sqlalchemy as sa

from outbox.store._sqlalchemy import returning_count
from outbox.wire import _aiohttp, _httpx_fast


def _source(obj: object) -> str:
    return inspect.getsource(obj)  # type: ignore[arg-type]


def test_httpx_transport_for_url_picks_the_clients_transport() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(204))
    client = httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:1")
    try:
        chosen = client._transport_for_url(httpx.URL("http://127.0.0.1:1/x"))
        assert chosen is transport, "httpx changed _transport_for_url: see wire/_httpx_fast.py"
    finally:
        asyncio.run(client.aclose())


def test_httpx_counts_downloaded_bytes_where_the_shortcut_counts_them() -> None:
    source = _source(httpx.Response.aiter_raw)
    assert "self.is_stream_consumed = True" in source, "see wire/_httpx_fast.start_raw_read"
    assert "self._num_bytes_downloaded = 0" in source, "see wire/_httpx_fast.start_raw_read"
    assert "self._num_bytes_downloaded += len(" in source, "see wire/_httpx_fast"
    response = httpx.Response(200, stream=httpx.ByteStream(b""))
    _httpx_fast.start_raw_read(response)
    _httpx_fast.count_downloaded(response, 7)
    assert response.num_bytes_downloaded == 7
    assert response.is_stream_consumed


def test_the_header_merge_is_httpxs() -> None:
    """An override moves to the end, names keep their case, Host and Content-Length are
    added as httpx adds them: the same request as ``client.build_request``."""
    client = httpx.AsyncClient(
        base_url="http://127.0.0.1:1/api", headers={"X-A": "1", "User-Agent": "ua"}
    )
    try:
        ours = _httpx_fast.build_request(
            client, "POST", "/r", headers={"x-a": "2", "X-B": "3"}, content=b"{}"
        )
        theirs = client.build_request("POST", "/r", headers={"x-a": "2", "X-B": "3"}, content=b"{}")
        assert ours.url == theirs.url
        assert ours.headers.raw == theirs.headers.raw, "httpx changed its header merge"
        assert ours.extensions == theirs.extensions
        assert ours.content == theirs.content
    finally:
        asyncio.run(client.aclose())


def test_aiohttp_reads_retry_connection() -> None:
    source = _source(aiohttp.ClientSession)
    assert "self._retry_connection" in source, "aiohttp renamed it: see wire/_aiohttp.py"
    # Read where aiohttp decides to resend (an idempotent method on a reused connection).
    assert "self._retry_connection and method in IDEMPOTENT_METHODS" in source, (
        "aiohttp changed when it reads _retry_connection: see wire/_aiohttp.py"
    )

    async def build() -> bool:
        async with aiohttp.ClientSession() as session:
            return _aiohttp.without_silent_resend(session)._retry_connection is False

    assert asyncio.run(build())


def test_sqlalchemy_returning_lists_the_columns() -> None:
    table = sa.Table("t", sa.MetaData(), sa.Column("a", sa.Integer), sa.Column("b", sa.Text))
    assert returning_count(sa.update(table).returning(table.c.a, table.c.b)) == 2
    assert returning_count(sa.update(table).returning(table.c.a)) == 1
    assert returning_count(sa.update(table)) == 0
