"""httpx requests without httpx's per-request bookkeeping, where nothing needs it.

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
from dataclasses import dataclass, field

import httpx

#: Paths remembered per client; a client sending to more distinct paths starts over.
_MAX_PATHS = 4096


@dataclass
class _Prepared:
    defaults: list[tuple[str, str]]
    extensions: dict[str, object]
    urls: dict[str, httpx.URL] = field(default_factory=dict)


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
    url = prep.urls.get(path)
    if url is None:
        url = client.build_request("GET", path).url
        if len(prep.urls) >= _MAX_PATHS:
            prep.urls.clear()
        prep.urls[path] = url
    merged = {name.lower(): (name, value) for name, value in prep.defaults}
    for name, value in headers.items():
        key = name.lower()
        merged.pop(key, None)  # as httpx's Headers.update: an override moves to the end
        merged[key] = (name, value)
    return httpx.Request(
        method, url, headers=list(merged.values()), content=content,
        extensions=prep.extensions,
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
