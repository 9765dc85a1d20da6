"""httpx requests without httpx's per-request bookkeeping, where nothing needs it.

The one home of every use of httpx's private surface (``AsyncClient._transport_for_url``,
``Response._num_bytes_downloaded``, the header merge of ``Headers.update`` and
``Request._prepare`` re-done here); ``tests/unit/test_dependency_contracts.py`` fails
loudly when an httpx release changes what is relied on.

The dispatcher sends through an ``httpx.AsyncClient`` (httpx stays the vocabulary:
``httpx.Auth``, event hooks, ``transport_factory``), but a profile shows httpx's own
models costing about a quarter of the event loop per request. Two shortcuts, each
producing what httpx would:

* :func:`build_request`: the URL is merged with the base URL once per (client, path)
  and kept; the client's default headers are merged with the attempt's in one pass;
  the timeout extension is computed once per client. Same method, URL, headers (names,
  order and values) and body as ``client.build_request``.
* :func:`send`: straight to the client's transport when the client has nothing to do
  around it: no ``httpx.Auth`` (neither configured nor from userinfo in the base URL),
  no event hooks, no cookies (the dispatcher's clients refuse every cookie, see
  ``transport.build_client``). Otherwise ``client.send`` as before. Redirects are never
  followed either way.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

#: Paths remembered per client; a client sending to more distinct paths starts over.
_MAX_PATHS = 4096


@dataclass
class _Prepared:
    defaults: list[tuple[str, str]]
    extensions: dict[str, object]
    #: path -> (its URL, the Host header httpx adds for it, None without a host).
    urls: dict[str, tuple[httpx.URL, tuple[str, str] | None]] = field(default_factory=dict)


_prepared: weakref.WeakKeyDictionary[httpx.AsyncClient, _Prepared] = (
    weakref.WeakKeyDictionary()
)


def _for(client: httpx.AsyncClient) -> _Prepared:
    prep = _prepared.get(client)
    if prep is None:
        encoding = client.headers.encoding
        prep = _Prepared(
            defaults=[(k.decode(encoding), v.decode(encoding)) for k, v in client.headers.raw],
            extensions={"timeout": client.timeout.as_dict()},
        )
        _prepared[client] = prep
    return prep


def build_request(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    *,
    headers: dict[str, str],
    content: bytes | None,
) -> httpx.Request:
    """``client.build_request(method, path, headers=headers, content=content)``, cheaper."""
    if client.cookies:
        return client.build_request(method, path, headers=headers, content=content)
    prep = _for(client)
    target = prep.urls.get(path)
    if target is None:
        url = client.build_request("GET", path).url
        target = (url, ("Host", url.netloc.decode("ascii")) if url.host else None)
        if len(prep.urls) >= _MAX_PATHS:
            prep.urls.clear()
        prep.urls[path] = target
    url, host = target
    merged = {name.lower(): (name, value) for name, value in prep.defaults}
    for name, value in headers.items():
        key = name.lower()
        merged.pop(key, None)  # as httpx's Headers.update: an override moves to the end
        merged[key] = (name, value)
    if not _plain(merged.values()) or not (content is None or type(content) is bytes):
        return httpx.Request(
            method, url, headers=list(merged.values()), content=content,
            extensions=prep.extensions,
        )
    # What Request(content=...) adds, computed here rather than by httpx.Headers scans:
    # Content-Length for a non-empty body unless set (Request._prepare's setdefault),
    # then, in front, Host unless set, and "Content-Length: 0" for a POST, PUT or PATCH
    # with neither Content-Length nor Transfer-Encoding.
    items = list(merged.values())
    if content and "content-length" not in merged:
        items.append(("Content-Length", str(len(content))))
        merged["content-length"] = ("", "")
    auto: list[tuple[str, str]] = []
    if host is not None and "host" not in merged:
        auto.append(host)
    if (
        "content-length" not in merged
        and "transfer-encoding" not in merged
        and method.upper() in ("POST", "PUT", "PATCH")
    ):
        auto.append(("Content-Length", "0"))
    request = httpx.Request(
        method, url, headers=auto + items if auto else items,
        stream=httpx.ByteStream(content or b""), extensions=prep.extensions,
    )  # fmt: skip
    request.read()  # as Request(content=...) does
    return request


def _plain(items: Iterable[tuple[str, str]]) -> bool:
    return all(
        type(name) is str and type(value) is str and name.isascii() and value.isascii()
        for name, value in items
    )


def _direct(client: httpx.AsyncClient, request: httpx.Request) -> bool:
    hooks = client.event_hooks
    return (
        client.auth is None
        and not request.url.userinfo
        and not hooks["request"]
        and not hooks["response"]
        and not client.cookies
        and not client.is_closed
    )


async def send(client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """``client.send(request, stream=True)``, through the transport alone when allowed."""
    if not _direct(client, request):
        return await client.send(request, stream=True)
    transport = client._transport_for_url(request.url)
    response = await transport.handle_async_request(request)
    response.request = request
    return response


def start_raw_read(response: httpx.Response) -> None:
    """What ``Response.aiter_raw`` does before reading: consumed, no byte counted yet."""
    response.is_stream_consumed = True
    response._num_bytes_downloaded = 0


def count_downloaded(response: httpx.Response, size: int) -> None:
    """What ``Response.aiter_raw`` does per chunk: ``num_bytes_downloaded`` grows."""
    response._num_bytes_downloaded += size
