"""/sessions/<id>/lab/…: the portal's proxy to a JupyterLab session's server (jobs.lab runs it).

An ASGI middleware around the Django app (portal/asgi.py): a lab's HTTP requests and websockets
never reach a Django view, everything else goes to Django unchanged. For each request, and for
each websocket when it connects, it asks the database again:

- who: the portal's own session cookie, read as django.contrib.auth.get_user reads it (the
  backend's user, active, and the session's hash of the password: a sign-out or a password change
  ends it). No request object exists here, so that is rebuilt below rather than called;
- may they: only the session's owner, and only while it is a RUNNING JupyterLab session. A lab is
  its owner's processes and files: no teammate, leader or admin gets in. Everyone else gets 404
  (an anonymous page view a redirect to sign in); a websocket is closed before it is accepted and
  nothing is asked of the Jupyter server.

Then it forwards the request to the session's `address` with `Authorization: token <token>`,
added here: the client's own Authorization, its `?token=` and the portal's cookies never reach the
Jupyter server, and the token never reaches the browser. Jupyter writes its token into its pages
(the page config): every response is scrubbed of it, as it streams, masked with as many bytes so
that Content-Length still holds. A websocket's Origin must be the portal's own (or one of
CSRF_TRUSTED_ORIGINS): a token-authenticated request makes Jupyter skip its own origin and XSRF
checks, so this is the only defence against cross-site websocket hijacking (jupyter-server-proxy's
CVE-2024-28179 was a websocket that skipped the checks HTTP made). A state-changing HTTP request
with a foreign Origin is refused for the same reason.

Bodies stream both ways (notebooks can be large); nothing is read whole, and after the check
nothing here touches the database (no per-message cost on a websocket).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from importlib import import_module
from typing import Any
from urllib.parse import quote, unquote_to_bytes, urlsplit

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import (
    BACKEND_SESSION_KEY,
    HASH_SESSION_KEY,
    SESSION_KEY,
    get_user_model,
    load_backend,
)
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection
from django.http.cookie import parse_cookie
from django.http.request import split_domain_port, validate_host
from django.shortcuts import resolve_url
from django.utils.crypto import constant_time_compare
from django.utils.http import is_same_domain
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from jobs.models import InteractiveSession

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LAB_PATH = re.compile(r"^/sessions/([1-9][0-9]*)/lab(/.*)?$")  # one spelling of each id: no leading 0
RAW_LAB_PATH = re.compile(rb"^/sessions/(\d+)/lab(?:/|$)")
# Per connection, never forwarded (RFC 9110 7.6.1), plus what this proxy sets itself.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te"}
    | {"trailer", "transfer-encoding", "upgrade"}
)
NOT_FORWARDED = HOP_BY_HOP | {
    "host",  # the Jupyter server's own address (it refuses foreign Hosts: DNS rebinding)
    "authorization",  # the portal's token, never the client's
    "cookie",  # forwarded without the portal's cookies
    "origin",  # checked here; Jupyter compares it with its own Host, which is not the portal's
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
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# Long polls, slow kernels and large downloads are all Jupyter's to pace: only connecting is timed.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=None, pool=None)
REFUSED = 4403  # a websocket closed before it was accepted: the client sees an HTTP 403
MIN_SCRUBBED = 8  # a shorter "token" would mask ordinary bytes of pages
MAX_ID_DIGITS = 18  # a longer id would overflow the database's integers (a 500, not a 404)
NOT_ANSWERING = "it may be starting or have ended"


@dataclass(frozen=True)
class Lab:
    pk: int
    address: str
    token: str


@dataclass(frozen=True)
class Verdict:
    """The check's answer: the lab to forward to, or None with whether anyone was signed in."""

    lab: Lab | None
    signed_in: bool


def lab_proxy(django_app: ASGIApp) -> ASGIApp:
    """The portal's ASGI app: the lab paths here, everything else (and lifespan) Django's."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        route = lab_route(scope) if scope["type"] in ("http", "websocket") else None
        if route is None:
            await django_app(scope, receive, send)
        elif scope["type"] == "http":
            await _serve_http(scope, receive, send, route)
        else:
            await _serve_websocket(scope, receive, send, route)

    return app


def lab_route(scope: Scope) -> int | None:
    """The session id for a lab path, 0 for a path under /sessions/ that must be refused (dot
    segments, a raw path that does not spell the same session, a websocket to no lab), None for
    Django's paths.

    The path is forwarded raw (Jupyter decodes it itself), so the raw one must name the same
    session in plain digits, and no `.`/`..` segment (encoded or not) may walk out of it: nginx,
    httpx or Jupyter could each resolve one differently from the regex here."""
    path: str = scope["path"]
    if not path.startswith("/sessions/"):
        return None
    if any(segment in (".", "..") for segment in path.split("/")):
        return 0
    match = LAB_PATH.match(path)
    if match is None:  # Django's 404 over HTTP; Django cannot take a websocket at all
        return 0 if scope["type"] == "websocket" else None
    digits = match.group(1)
    raw_match = RAW_LAB_PATH.match(scope.get("raw_path") or path.encode())
    if raw_match is None or raw_match.group(1).decode() != digits or len(digits) > MAX_ID_DIGITS:
        return 0
    return int(digits)


# --- who, and may they ----------------------------------------------------------------------------


_Flights = dict[tuple[str | None, int], "asyncio.Future[Verdict]"]
_flights: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Flights]
_flights = weakref.WeakKeyDictionary()


async def check(scope: Scope, pk: int) -> Verdict | None:
    """The verdict for this request (None: the database is away), read in a thread.

    A request that comes while the same cookie's check of the same lab is under way shares it:
    a JupyterLab page asks for dozens of files at once. That read began before the request came,
    by at most one read's time (milliseconds); it never serves one that has finished."""
    if pk == 0:
        return Verdict(lab=None, signed_in=True)
    session_key = parse_cookie(header(scope, "cookie") or "").get(settings.SESSION_COOKIE_NAME)
    flights = _flights.setdefault(asyncio.get_running_loop(), {})
    key = (session_key, pk)
    flight = flights.get(key)
    if flight is None:
        flight = asyncio.ensure_future(sync_to_async(_verdict, thread_sensitive=False)(session_key, pk))
        flights[key] = flight
        flight.add_done_callback(lambda done: flights.pop(key) if flights.get(key) is done else None)
    try:
        return await asyncio.shield(flight)  # a client that leaves cancels its wait, not the others'
    except DatabaseError as exc:
        log.warning("Lab %s: the database is not answering (%s)", pk, exc)
        return None


def _verdict(session_key: str | None, pk: int) -> Verdict:
    try:
        user = session_user(session_key)
        if user is None:
            return Verdict(lab=None, signed_in=False)
        return Verdict(lab=lab_for_owner(user.pk, pk), signed_in=True)
    finally:
        connection.close()  # this thread's, opened for the check: a websocket may last for days


def session_user(session_key: str | None) -> Any | None:
    """The active user the portal's session names, as django.contrib.auth.get_user finds it
    (without a request: none exists here), or None. Read only: the session is never saved, so a
    fallback secret's hash is accepted here and rotated by the next page the portal serves."""
    if not session_key:
        return None
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    try:
        user_id = get_user_model()._meta.pk.to_python(session[SESSION_KEY])
        backend_path = session[BACKEND_SESSION_KEY]
    except (KeyError, ValidationError):
        return None
    if backend_path not in settings.AUTHENTICATION_BACKENDS:
        return None
    user = load_backend(backend_path).get_user(user_id)
    if user is None or not getattr(user, "is_active", False):
        return None
    return user if _hash_verified(session.get(HASH_SESSION_KEY), user) else None


def _hash_verified(session_hash: str | None, user: Any) -> bool:
    if not hasattr(user, "get_session_auth_hash"):
        return True  # as get_user: a user model without it has nothing to verify
    if not session_hash:
        return False
    if constant_time_compare(session_hash, user.get_session_auth_hash()):
        return True
    return any(constant_time_compare(session_hash, old) for old in user.get_session_auth_fallback_hash())


def lab_for_owner(user_id: int, pk: int) -> Lab | None:
    """The lab a user may reach: their own running JupyterLab session, with its server's address."""
    row = (
        InteractiveSession.objects.filter(
            pk=pk,
            owner_id=user_id,
            kind=InteractiveSession.Kind.JUPYTERLAB,
            status=InteractiveSession.Status.RUNNING,
        )
        .exclude(address="")
        .exclude(token="")
        .values_list("address", "token")
        .first()
    )
    return Lab(pk=pk, address=row[0], token=row[1]) if row else None


# --- the request's own facts ----------------------------------------------------------------------


def header(scope: Scope, name: str) -> str | None:
    """A request header's value (several joined as HTTP allows: cookies with "; ")."""
    key = name.encode()
    values = [value.decode("latin-1") for k, value in scope["headers"] if k == key]
    if not values:
        return None
    return ("; " if name == "cookie" else ", ").join(values)


def portal_origin(scope: Scope) -> str | None:
    """scheme://host of the portal as this request reached it (None: a Host ALLOWED_HOSTS refuses),
    found as Django's request.is_secure() and get_host() find them."""
    scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
    if settings.SECURE_PROXY_SSL_HEADER:
        name, secure_value = settings.SECURE_PROXY_SSL_HEADER
        forwarded = header(scope, name.removeprefix("HTTP_").replace("_", "-").lower())
        if forwarded is not None:
            scheme = "https" if forwarded.split(",")[0].strip() == secure_value else "http"
    host = (settings.USE_X_FORWARDED_HOST and header(scope, "x-forwarded-host")) or header(scope, "host")
    if not host:
        return None
    host = host.split(",")[-1].strip()
    allowed = settings.ALLOWED_HOSTS or ([".localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, allowed):
        return None
    return f"{scheme}://{host}"


def origin_allowed(scope: Scope, origin: str | None) -> bool:
    """Whether a browser's Origin is the portal's own, as Django's CSRF check decides it."""
    if not origin or origin == "null" or portal_origin(scope) is None:
        return False
    if origin == portal_origin(scope) or origin in settings.CSRF_TRUSTED_ORIGINS:
        return True
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return any(
        is_same_domain(parts.netloc, trusted.split("://", 1)[1][1:])
        for trusted in settings.CSRF_TRUSTED_ORIGINS
        if trusted.startswith(f"{parts.scheme}://*")
    )


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
    """The client's headers for the Jupyter server: hop-by-hop ones and the portal's own dropped,
    the token and X-Forwarded-* added."""
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
    origin = portal_origin(scope) or ""
    headers += [
        ("authorization", f"token {lab.token}"),
        ("x-forwarded-for", chain),
        ("x-forwarded-proto", origin.split("://")[0] or "http"),
        ("x-forwarded-host", origin.split("://")[-1]),
    ]
    if not websocket:
        headers.append(("accept-encoding", "identity"))
    return [(name, value) for name, value in headers if value]


def _cookies_for_upstream(cookie_header: str | None) -> str:
    """The Cookie header without the portal's session and CSRF cookies (Jupyter's own pass)."""
    if not cookie_header:
        return ""
    portal = {settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME}
    kept = [part.strip() for part in cookie_header.split(";") if part.split("=")[0].strip() not in portal]
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


async def _serve_http(scope: Scope, receive: Receive, send: Send, pk: int) -> None:
    if portal_origin(scope) is None:
        await plain(send, 400, "This host is not the portal's (ALLOWED_HOSTS).")
        return
    if scope["method"] not in SAFE_METHODS and not _same_site_or_no_origin(scope):
        await plain(send, 403, "Cross-site request refused.")
        return
    verdict = await check(scope, pk)
    if verdict is None:
        await plain(send, 503, "The portal's database is not answering; try again shortly.", retry=5)
    elif verdict.lab is not None:
        await _forward_http(scope, receive, send, verdict.lab)
    elif verdict.signed_in:
        await plain(send, 404, "No such lab.")
    elif scope["method"] == "GET" and "text/html" in (header(scope, "accept") or ""):
        await _to_login(scope, send)
    else:
        await plain(send, 401, "Sign in to the portal to use this lab.")


def _same_site_or_no_origin(scope: Scope) -> bool:
    """Browsers send Origin with every cross-site POST; a client without one is no browser."""
    origin = header(scope, "origin")
    return origin is None or origin_allowed(scope, origin)


async def _to_login(scope: Scope, send: Send) -> None:
    query = scope.get("query_string", b"").decode("latin-1")
    wanted = scope["path"] + (f"?{query}" if query else "")
    location = f"{resolve_url(settings.LOGIN_URL)}?next={quote(wanted, safe='/')}"
    await plain(send, 302, "Sign in to the portal to use this lab.", location=location)


async def plain(send: Send, status: int, text: str, *, location: str = "", retry: int = 0) -> None:
    """A short plain-text answer from the proxy itself."""
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"cache-control", b"no-store")]
    if location:
        headers.append((b"location", location.encode("latin-1")))
    if retry:
        headers.append((b"retry-after", str(retry).encode()))
    body = f"{text}\n".encode()
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _forward_http(scope: Scope, receive: Receive, send: Send, lab: Lab) -> None:
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
    stand in for the portal's own, and the token masked wherever it appears."""
    listed = {name.strip().lower() for name in response.headers.get("connection", "").split(",")}
    portal = {settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME}
    secret = lab.token.encode() if len(lab.token) >= MIN_SCRUBBED else None
    kept = []
    for name, value in response.headers.raw:
        lowered = name.lower().decode("latin-1")
        if lowered in HOP_BY_HOP or lowered in listed:
            continue
        if lowered == "set-cookie" and value.split(b"=")[0].strip().decode("latin-1") in portal:
            continue
        if secret and secret in value:
            value = value.replace(secret, b"x" * len(secret))
        kept.append((name.lower(), value))
    return kept


# --- websockets -------------------------------------------------------------------------------------


async def _serve_websocket(scope: Scope, receive: Receive, send: Send, pk: int) -> None:
    if (await receive())["type"] != "websocket.connect":
        return
    if not origin_allowed(scope, header(scope, "origin")):
        await send({"type": "websocket.close", "code": REFUSED})  # cross-site websocket hijacking
        return
    verdict = await check(scope, pk)
    if verdict is None or verdict.lab is None:
        await send({"type": "websocket.close", "code": REFUSED})
        return
    lab = verdict.lab
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
    await _relay_websocket(receive, send, upstream, lab.token)


async def _relay_websocket(receive: Receive, send: Send, upstream: ClientConnection, token: str) -> None:
    """Frames both ways until either side closes; the other side is then closed with its code."""
    from_client = asyncio.create_task(_client_to_upstream(receive, upstream))
    from_upstream = asyncio.create_task(_upstream_to_client(upstream, send, token))
    try:
        await asyncio.wait({from_client, from_upstream}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (from_client, from_upstream):
            task.cancel()
        await asyncio.gather(from_client, from_upstream, return_exceptions=True)
        client_left = from_client.done() and not from_client.cancelled() and from_client.exception() is None
        await upstream.close()
        if not client_left:
            code, reason = close_code(upstream.close_code), (upstream.close_reason or "")[:120]
            with contextlib.suppress(Exception):  # the client may be gone without saying so
                await send({"type": "websocket.close", "code": code, "reason": reason})


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

    Each message is scrubbed of the token whole: a kernel inherits the server's environment, so
    `!env` in a notebook would print it. Masked byte for byte, a binary message's offsets hold."""
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
