"""How a lab's requests and websockets reach its Jupyter server and come back (jobs.sessions.lab_proxy
decides who may; this module only carries the bytes).

Each is forwarded to the session's `address` with `Authorization: token <token>`, added here: the
client's own Authorization, its `?token=` and the cookies the portal and the proxy set never
reach the Jupyter server, and the token never reaches the browser. Jupyter writes its token into
its pages (the page config): every response is scrubbed of it, as it streams, masked with as many
bytes so that Content-Length still holds, and so is every websocket message (a kernel inherits the
server's environment, so `!env` in a notebook would print it). Jupyter's own login cookie is
dropped on the way back: the browser holds no credential the Jupyter server itself would accept.

Bodies stream both ways (notebooks can be large); nothing is read whole, and nothing here touches
the database (no per-message cost on a websocket); an open websocket's grant is asked about again
every LAB_RECHECK_SECONDS through the check jobs.sessions.lab_proxy hands in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import unquote_to_bytes, urlsplit

import httpx
from django.conf import settings
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from jobs.sessions.lab_handoff import GRANT_COOKIE, STATE_COOKIE, Lab

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Per connection, never forwarded (RFC 9110 7.6.1), plus what this proxy sets itself.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te"}
    | {"trailer", "transfer-encoding", "upgrade"}
)
NOT_FORWARDED = HOP_BY_HOP | {
    "host",  # the Jupyter server's own address (it refuses foreign Hosts: DNS rebinding)
    "authorization",  # the portal's token, never the client's
    "cookie",  # forwarded without the portal's and the proxy's cookies
    "origin",  # checked by the proxy; Jupyter compares it with its own Host, which is not the lab's
    "accept-encoding",  # identity: the token must be found in the body to be scrubbed
    "expect",  # uvicorn answers a 100-continue itself; httpx would not wait for Jupyter's
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
}
WEBSOCKET_HANDSHAKE = frozenset(
    {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol"}
    | {"sec-websocket-accept", "content-length", "user-agent"}
)
# Long polls, slow kernels and large downloads are all Jupyter's to pace: only connecting is timed.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=None, pool=None)
MIN_SCRUBBED = 8  # a shorter "token" would mask ordinary bytes of pages
NOT_ANSWERING = "it may be starting or have ended"
JUPYTER_LOGIN_COOKIE = "username-"  # jupyter_server's IdentityProvider: username-<host-port>


def header(scope: Scope, name: str) -> str | None:
    """A request header's value (several joined as HTTP allows: cookies with "; ")."""
    key = name.encode()
    values = [value.decode("latin-1") for k, value in scope["headers"] if k == key]
    if not values:
        return None
    return ("; " if name == "cookie" else ", ").join(values)


async def plain(
    send: Send,
    status: int,
    text: str,
    *,
    location: str = "",
    retry: int = 0,
    cookies: tuple[str, ...] = (),
) -> None:
    """A short plain-text answer from the proxy itself."""
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"cache-control", b"no-store"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),  # a ticket in this URL goes nowhere else
    ]
    if location:
        headers.append((b"location", location.encode("latin-1")))
    if retry:
        headers.append((b"retry-after", str(retry).encode()))
    headers += [(b"set-cookie", cookie.encode("latin-1")) for cookie in cookies]
    body = f"{text}\n".encode()
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def upstream_target(scope: Scope, lab: Lab, scheme: str) -> str:
    """The Jupyter server's URL for this request: the raw path, unchanged, and the query without a
    `token` (Jupyter prefers one in the URL to the header, so a wrong one would lock the owner out)."""
    raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = scope.get("query_string", b"").decode("latin-1")
    if "token" in query:
        parts = query.split("&")
        query = "&".join(part for part in parts if unquote_to_bytes(part.split("=")[0]) != b"token")
    return f"{scheme}://{lab.address}{raw_path}{'?' + query if query else ''}"


def upstream_headers(scope: Scope, lab: Lab, *, websocket: bool = False) -> list[tuple[str, str]]:
    """The client's headers for the Jupyter server: hop-by-hop ones and the portal's and proxy's
    cookies dropped, the token and X-Forwarded-* (the labs' origin, as the browser sees it) added."""
    listed = {name.strip().lower() for name in (header(scope, "connection") or "").split(",")}
    dropped = NOT_FORWARDED | listed | (WEBSOCKET_HANDSHAKE if websocket else frozenset())
    headers = [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in scope["headers"]
        if name.decode("latin-1") not in dropped
    ]
    cookies = _cookies_for_upstream(header(scope, "cookie"))
    if cookies:
        headers.append(("cookie", cookies))
    client = scope.get("client") or ("", 0)
    chain = ", ".join(filter(None, [header(scope, "x-forwarded-for"), client[0]]))
    origin = urlsplit(settings.LAB_ORIGIN)
    headers += [
        ("authorization", f"token {lab.token}"),
        ("x-forwarded-for", chain),
        ("x-forwarded-proto", origin.scheme),
        ("x-forwarded-host", origin.netloc),
    ]
    if not websocket:
        headers.append(("accept-encoding", "identity"))
    return [(name, value) for name, value in headers if value]


def _own_cookie(name: str) -> bool:
    """The portal's and the proxy's cookies, which the Jupyter server neither gets nor may set."""
    return name in (settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME, GRANT_COOKIE, STATE_COOKIE)


def _cookies_for_upstream(cookie_header: str | None) -> str:
    """The Cookie header without the portal's and the proxy's cookies (Jupyter's own pass)."""
    if not cookie_header:
        return ""
    kept = [part.strip() for part in cookie_header.split(";") if not _own_cookie(part.split("=")[0].strip())]
    return "; ".join(part for part in kept if part)


class Scrubber:
    """Masks a secret in a stream of chunks, also across their boundaries, byte for byte (the
    length stays). Only the bytes that could begin the secret wait for the next chunk."""

    def __init__(self, secret: str) -> None:
        self.secret = secret.encode() if len(secret) >= MIN_SCRUBBED else b""
        self.mask = b"x" * len(self.secret)
        self.held = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self.secret:
            return chunk
        data = (self.held + chunk).replace(self.secret, self.mask)
        keep = self._partial(data)
        self.held = data[len(data) - keep :]
        return data[: len(data) - keep]

    def flush(self) -> bytes:
        held, self.held = self.held, b""
        return held

    def _partial(self, data: bytes) -> int:
        """The length of the longest end of `data` that begins the secret."""
        for size in range(min(len(self.secret) - 1, len(data)), 0, -1):
            if data.endswith(self.secret[:size]):
                return size
        return 0


# --- HTTP -------------------------------------------------------------------------------------------

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]
_clients = weakref.WeakKeyDictionary()


def _client() -> httpx.AsyncClient:
    """One client per event loop (a worker's): its connections to the Jupyter servers are reused."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        # No proxy from the environment (a lab is on the lab's own network); no pool limit: a
        # JupyterLab page loads many files at once and each lab is its owner's alone.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
        client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT, limits=limits, trust_env=False)
        _clients[loop] = client
    return client


async def forward_http(scope: Scope, receive: Receive, send: Send, lab: Lab) -> None:
    client = _client()
    has_body = header(scope, "content-length") not in (None, "0") or bool(header(scope, "transfer-encoding"))
    request = client.build_request(
        scope["method"],
        upstream_target(scope, lab, "http"),
        headers=upstream_headers(scope, lab),
        content=_request_body(receive) if has_body else None,
    )
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError as exc:
        log.info("Lab %s: its server is not answering (%r)", lab.pk, exc)
        await plain(send, 502, f"the JupyterLab server of session {lab.pk} is not answering; {NOT_ANSWERING}")
        return
    relay = asyncio.create_task(_relay_response(send, response, lab))
    gone = asyncio.create_task(_disconnected(receive))
    try:
        # A client that leaves stops the download at once, rather than after Jupyter's last byte.
        await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (relay, gone):
            task.cancel()
        await asyncio.gather(relay, gone, return_exceptions=True)
        await response.aclose()
    if relay.done() and not relay.cancelled() and relay.exception() is not None:
        log.warning("Lab %s: the answer broke off (%r)", lab.pk, relay.exception())


async def _request_body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise httpx.ReadError("the client left while sending its body")
        if message.get("body"):
            yield message["body"]
        if not message.get("more_body", False):
            return


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _relay_response(send: Send, response: httpx.Response, lab: Lab) -> None:
    scrubber = Scrubber(lab.token)
    headers = _answer_headers(response, lab)
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    async for chunk in response.aiter_raw():
        if piece := scrubber.feed(chunk):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": scrubber.flush(), "more_body": False})


def _answer_headers(response: httpx.Response, lab: Lab) -> list[tuple[bytes, bytes]]:
    """The Jupyter server's headers for the browser: no hop-by-hop ones, no cookie that would
    stand in for the portal's or the proxy's own, no Jupyter login cookie, no CORS grant (a lab's
    own config could let another site read it with its owner's cookie), and the token masked
    wherever it appears."""
    listed = {name.strip().lower() for name in response.headers.get("connection", "").split(",")}
    secret = lab.token.encode() if len(lab.token) >= MIN_SCRUBBED else None
    kept = []
    for name, value in response.headers.raw:
        lowered = name.lower().decode("latin-1")
        if lowered in HOP_BY_HOP or lowered in listed or lowered.startswith("access-control-"):
            continue
        if lowered == "set-cookie":
            cookie = value.split(b"=")[0].strip().decode("latin-1")
            if _own_cookie(cookie) or cookie.startswith(JUPYTER_LOGIN_COOKIE):
                continue
        if secret and secret in value:
            value = value.replace(secret, b"x" * len(secret))
        kept.append((name.lower(), value))
    return kept


# --- websockets -------------------------------------------------------------------------------------


Recheck = Callable[[], Awaitable[bool]]
REVOKED = 1008  # policy violation: the grant behind an open websocket no longer stands


async def forward_websocket(
    scope: Scope, receive: Receive, send: Send, lab: Lab, still_allowed: Recheck | None = None
) -> None:
    """Connects to the Jupyter server, then accepts the client's websocket (already checked).
    `still_allowed` is asked every LAB_RECHECK_SECONDS while it is open: a terminal or a kernel
    websocket outlives a sign-out or a password change no longer than that."""
    try:
        upstream = await connect(
            upstream_target(scope, lab, "ws"),
            additional_headers=upstream_headers(scope, lab, websocket=True),
            subprotocols=scope.get("subprotocols") or None,
            user_agent_header=header(scope, "user-agent"),
            compression=None,  # the loopback needs none; the browser's side is the server's to compress
            max_size=None,
            max_queue=None,
            proxy=None,
        )
    except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
        log.info("Lab %s: its server refused or missed a websocket (%r)", lab.pk, exc)
        await send({"type": "websocket.close", "code": 1011})
        return
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
    await _relay_websocket(receive, send, upstream, lab.token, still_allowed)


async def _relay_websocket(
    receive: Receive, send: Send, upstream: ClientConnection, token: str, still_allowed: Recheck | None = None
) -> None:
    """Frames both ways until either side closes, or the grant no longer stands; the other side
    is then closed with its code (a revoked grant: both, with REVOKED)."""
    from_client = asyncio.create_task(_client_to_upstream(receive, upstream))
    from_upstream = asyncio.create_task(_upstream_to_client(upstream, send, token))
    watch = asyncio.create_task(_revoked(still_allowed))
    try:
        await asyncio.wait({from_client, from_upstream, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (from_client, from_upstream, watch):
            task.cancel()
        await asyncio.gather(from_client, from_upstream, watch, return_exceptions=True)
        client_left = from_client.done() and not from_client.cancelled() and from_client.exception() is None
        revoked = watch.done() and not watch.cancelled() and watch.exception() is None
        await upstream.close(*((REVOKED, "the lab's sign-in ended") if revoked else ()))
        if revoked or not client_left:
            if revoked:
                code, reason = REVOKED, "Sign-in to this lab ended: open it again from the portal."
            else:
                code, reason = close_code(upstream.close_code), (upstream.close_reason or "")[:120]
            with contextlib.suppress(Exception):  # the client may be gone without saying so
                await send({"type": "websocket.close", "code": code, "reason": reason})


async def _revoked(still_allowed: Recheck | None) -> None:
    """Returns once the websocket's grant no longer stands (never without a check to ask)."""
    if still_allowed is None:
        await asyncio.Event().wait()
    while True:
        await asyncio.sleep(settings.LAB_RECHECK_SECONDS)
        if not await still_allowed():  # type: ignore[misc]
            return


async def _client_to_upstream(receive: Receive, upstream: ClientConnection) -> None:
    """Returns when the client closed (and the Jupyter server was told, with its code)."""
    while True:
        message = await receive()
        if message["type"] == "websocket.receive":
            text = message.get("text")
            await upstream.send(text if text is not None else (message.get("bytes") or b""))
        elif message["type"] == "websocket.disconnect":
            await upstream.close(close_code(message.get("code")), (message.get("reason") or "")[:120])
            return


async def _upstream_to_client(upstream: ClientConnection, send: Send, token: str) -> None:
    """Returns when the Jupyter server closed (its session ended, or it closed this socket).

    Each message is scrubbed of the token whole. Masked byte for byte, a binary message's offsets
    hold."""
    secret = token if len(token) >= MIN_SCRUBBED else None
    with contextlib.suppress(ConnectionClosed):
        async for data in upstream:
            if isinstance(data, str):
                if secret and secret in data:
                    data = data.replace(secret, "x" * len(secret))
                await send({"type": "websocket.send", "text": data})
            else:
                if secret and secret.encode() in data:
                    data = data.replace(secret.encode(), b"x" * len(secret))
                await send({"type": "websocket.send", "bytes": data})


def close_code(code: int | None) -> int:
    """A code one side closed with, as one that may be sent to the other: 1005 (none given) is a
    plain close, 1006/1015 (no close frame, TLS) an error."""
    if code is None or code == 1005:
        return 1000
    if 1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999:
        return code
    return 1011
