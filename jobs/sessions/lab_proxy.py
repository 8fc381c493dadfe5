"""JupyterLab sessions on an origin of their own (LAB_ORIGIN), in front of the portal.

An ASGI middleware around the Django app (portal/asgi.py) that routes by the request's host name:

- LAB_ORIGIN's host name (on any port: cookies do not tell ports apart) serves labs and nothing
  else: `/sessions/<id>/lab/…` over HTTP and websockets, checked here and forwarded by
  jobs.sessions.lab_relay, and `/sessions/<id>/lab-auth/`, where a ticket from the portal is redeemed for
  the lab's own cookie (jobs.sessions.lab_handoff says the whole hand-off). Any other path is a 404 from
  here: no Django page, API or static file is reachable there. The portal's session cookie is
  never read there, and the Jupyter server never sees it.
- every other host name is the portal's, and Django's, except `/sessions/<id>/lab/…`: that no
  longer proxies. For the signed-in owner of a running lab it starts the hand-off (a redirect to
  the same path on LAB_ORIGIN); others get what they always got: a non-owner 404, an anonymous
  page view the sign-in page, an anonymous API call 401, a websocket a refusal.

A lab page's script therefore runs on an origin where the portal's cookies are never sent nor
readable, and nothing the portal's session guards answers; the lab's cookie is scoped to
`/sessions/<id>/lab/` on LAB_ORIGIN and means nothing to the portal.

For each lab request, and each websocket when it connects and every LAB_RECHECK_SECONDS while it
is open, the database is asked again: the grant behind the cookie, the portal session it came
from (signing out or a password change ends it), the user (active), and the lab (the user's own,
RUNNING, its supervisor beating). Only the session's owner gets in: a lab
is its owner's processes and files, so no teammate, leader or admin does. A websocket is refused
before it is accepted and nothing is asked of the Jupyter server.

A websocket's Origin must be LAB_ORIGIN, and so must a state-changing request's when it has one:
a token-authenticated request makes Jupyter skip its own origin and XSRF checks, so this is the only
defence against cross-site websocket hijacking (jupyter-server-proxy's CVE-2024-28179 was a
websocket that skipped the checks HTTP made) and cross-site posts. The portal's origin is as
foreign to a lab as any other.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import weakref
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, connection
from django.http.cookie import parse_cookie
from django.http.request import split_domain_port, validate_host
from django.shortcuts import resolve_url
from django.urls import reverse

from jobs.sessions.lab_handoff import (
    GRANT_COOKIE,
    SECRET,
    STATE_COOKIE,
    STATE_SECONDS,
    Lab,
    lab_for_owner,
    lab_grant_check,
    lab_next,
    lab_ticket_redeem,
    session_user,
)
from jobs.sessions.lab_relay import Receive, Scope, Send, forward_http, forward_websocket, header, plain

log = logging.getLogger(__name__)

ASGIApp = Any

LAB_PATH = re.compile(r"^/sessions/([1-9][0-9]*)/lab(/.*)?$")  # one spelling of each id: no leading 0
RAW_LAB_PATH = re.compile(rb"^/sessions/(\d+)/lab(?:/|$)")
AUTH_PATH = re.compile(rb"^/sessions/([1-9][0-9]{0,17})/lab-auth/$")  # raw and decoded alike
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
REFUSED = 4403  # a websocket closed before it was accepted: the client sees an HTTP 403
MAX_ID_DIGITS = 18  # a longer id would overflow the database's integers (a 500, not a 404)


@dataclass(frozen=True)
class Verdict:
    """The check's answer: the lab to serve, or None with whether anyone was recognised (on the
    portal: signed in; on the labs' origin: a grant that still stands)."""

    lab: Lab | None
    signed_in: bool


def lab_proxy(django_app: ASGIApp) -> ASGIApp:
    """The portal's ASGI app: LAB_ORIGIN's host here alone, the portal's lab paths here, everything
    else (and lifespan) Django's."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await django_app(scope, receive, send)
        elif on_lab_host(scope):
            await _serve_lab_origin(scope, receive, send)
        elif (pk := lab_route(scope)) is None:
            await django_app(scope, receive, send)
        elif scope["type"] == "http":
            await _serve_portal_path(scope, send, pk)
        else:  # a lab's websocket lives on LAB_ORIGIN only
            await _refuse_websocket(receive, send)

    return app


def lab_route(scope: Scope) -> int | None:
    """The session id for a lab path, 0 for a path under /sessions/ that must be refused (dot
    segments, a raw path that does not spell the same session, a websocket to no lab), None for
    other paths.

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


def _auth_route(scope: Scope) -> int | None:
    """The session id of a ticket's redemption path, spelled alike raw and decoded."""
    raw = scope.get("raw_path") or scope["path"].encode()
    match = AUTH_PATH.match(raw)
    return int(match.group(1)) if match and raw.decode("latin-1") == scope["path"] else None


# --- where the request came ------------------------------------------------------------------------


def _host(scope: Scope) -> str | None:
    """The Host as Django's request.get_host() reads it (X-Forwarded-Host where trusted)."""
    host = (settings.USE_X_FORWARDED_HOST and header(scope, "x-forwarded-host")) or header(scope, "host")
    return host.split(",")[-1].strip() if host else None


def on_lab_host(scope: Scope) -> bool:
    """Whether the request came to LAB_ORIGIN's host name, on whatever port."""
    host = _host(scope)
    lab_domain, _ = split_domain_port(urlsplit(settings.LAB_ORIGIN).netloc)
    return bool(host) and split_domain_port(host)[0] == lab_domain


def portal_origin(scope: Scope) -> str | None:
    """scheme://host of the portal as this request reached it (None: a Host ALLOWED_HOSTS refuses),
    found as Django's request.is_secure() and get_host() find them."""
    scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
    if settings.SECURE_PROXY_SSL_HEADER:
        name, secure_value = settings.SECURE_PROXY_SSL_HEADER
        forwarded = header(scope, name.removeprefix("HTTP_").replace("_", "-").lower())
        if forwarded is not None:
            scheme = "https" if forwarded.split(",")[0].strip() == secure_value else "http"
    host = _host(scope)
    if not host:
        return None
    allowed = settings.ALLOWED_HOSTS or ([".localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, allowed):
        return None
    return f"{scheme}://{host}"


def _raw_target(scope: Scope) -> str:
    """The request's path and query exactly as the client sent them."""
    raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = scope.get("query_string", b"").decode("latin-1")
    return raw_path + (f"?{query}" if query else "")


# --- who, and may they ----------------------------------------------------------------------------


_Flights = dict[tuple[bool, str | None, int], "asyncio.Future[Verdict]"]
_flights: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Flights]
_flights = weakref.WeakKeyDictionary()


async def check(scope: Scope, pk: int, *, lab_origin: bool) -> Verdict | None:
    """The verdict for this request (None: the database is away), read in a thread: on the labs'
    origin from the grant cookie alone, on the portal's from the portal's session cookie.

    A request that comes while the same cookie's check of the same lab is under way shares it:
    a JupyterLab page asks for dozens of files at once. That read began before the request came,
    by at most one read's time (milliseconds); it never serves one that has finished."""
    if pk == 0:
        return Verdict(lab=None, signed_in=True)
    cookies = parse_cookie(header(scope, "cookie") or "")
    credential = cookies.get(GRANT_COOKIE if lab_origin else settings.SESSION_COOKIE_NAME)
    read = _grant_verdict if lab_origin else _portal_verdict
    flights = _flights.setdefault(asyncio.get_running_loop(), {})
    key = (lab_origin, credential, pk)
    flight = flights.get(key)
    if flight is None:
        flight = asyncio.ensure_future(sync_to_async(read, thread_sensitive=False)(credential, pk))
        flights[key] = flight
        flight.add_done_callback(lambda done: flights.pop(key) if flights.get(key) is done else None)
    try:
        return await asyncio.shield(flight)  # a client that leaves cancels its wait, not the others'
    except DatabaseError as exc:
        log.warning("Lab %s: the database is not answering (%s)", pk, exc)
        return None


def _portal_verdict(session_key: str | None, pk: int) -> Verdict:
    try:
        user = session_user(session_key)
        if user is None:
            return Verdict(lab=None, signed_in=False)
        return Verdict(lab=lab_for_owner(user.pk, pk), signed_in=True)
    finally:
        connection.close()  # this thread's, opened for the check


def _grant_verdict(secret: str | None, pk: int) -> Verdict:
    try:
        standing, lab = lab_grant_check(secret, pk)
        return Verdict(lab=lab, signed_in=standing)
    finally:
        connection.close()  # this thread's, opened for the check: a websocket may last for days


# --- the portal's origin --------------------------------------------------------------------------


async def _serve_portal_path(scope: Scope, send: Send, pk: int) -> None:
    """`/sessions/<id>/lab/…` on the portal: the owner is sent to the labs' origin."""
    if portal_origin(scope) is None:
        await plain(send, 400, "This host is not the portal's (ALLOWED_HOSTS).")
        return
    verdict = await check(scope, pk, lab_origin=False)
    if verdict is None:
        await plain(send, 503, "The portal's database is not answering; try again shortly.", retry=5)
    elif verdict.lab is not None and scope["method"] in ("GET", "HEAD"):
        await plain(send, 302, "JupyterLab is served from its own address.", location=_on_lab_origin(scope))
    elif verdict.lab is not None:
        await plain(send, 405, f"JupyterLab is served from {settings.LAB_ORIGIN}; open it there.")
    elif verdict.signed_in:
        await plain(send, 404, "No such lab.")
    elif scope["method"] == "GET" and "text/html" in (header(scope, "accept") or ""):
        await _to_login(scope, send)
    else:
        await plain(send, 401, "Sign in to the portal to use this lab.")


def _on_lab_origin(scope: Scope) -> str:
    """The same path and query on LAB_ORIGIN, raw: the labs' side checks the path again."""
    return settings.LAB_ORIGIN + _raw_target(scope)


async def _to_login(scope: Scope, send: Send) -> None:
    query = scope.get("query_string", b"").decode("latin-1")
    wanted = scope["path"] + (f"?{query}" if query else "")
    location = f"{resolve_url(settings.LOGIN_URL)}?next={quote(wanted, safe='/')}"
    await plain(send, 302, "Sign in to the portal to use this lab.", location=location)


async def _refuse_websocket(receive: Receive, send: Send) -> None:
    if (await receive())["type"] == "websocket.connect":
        await send({"type": "websocket.close", "code": REFUSED})


# --- the labs' origin ---------------------------------------------------------------------------


async def _serve_lab_origin(scope: Scope, receive: Receive, send: Send) -> None:
    pk = lab_route(scope)
    if pk is not None:
        if scope["type"] == "http":
            await _serve_lab_http(scope, receive, send, pk)
        else:
            await _serve_lab_websocket(scope, receive, send, pk)
    elif scope["type"] == "http" and (auth := _auth_route(scope)) is not None:
        await _redeem(scope, send, auth)
    elif scope["type"] == "http":
        portal = settings.PORTAL_URL
        await plain(send, 404, f"Only JupyterLab sessions are served here; the portal is {portal}/")
    else:
        await _refuse_websocket(receive, send)


async def _serve_lab_http(scope: Scope, receive: Receive, send: Send, pk: int) -> None:
    if scope["method"] not in SAFE_METHODS and header(scope, "origin") not in (None, settings.LAB_ORIGIN):
        await plain(send, 403, "Cross-site request refused.")  # browsers send Origin with every such one
        return
    verdict = await check(scope, pk, lab_origin=True)
    if verdict is None:
        await plain(send, 503, "The portal's database is not answering; try again shortly.", retry=5)
    elif verdict.lab is not None:
        await forward_http(scope, receive, send, verdict.lab)
    elif verdict.signed_in:
        await plain(send, 404, "No such lab.")
    elif scope["method"] == "GET" and "text/html" in (header(scope, "accept") or ""):
        await _hand_off_start(scope, send, pk)
    else:
        await plain(send, 401, f"Open this lab from the portal to use it: {_session_page(pk)}")


async def _serve_lab_websocket(scope: Scope, receive: Receive, send: Send, pk: int) -> None:
    if (await receive())["type"] != "websocket.connect":
        return
    if header(scope, "origin") != settings.LAB_ORIGIN:
        await send({"type": "websocket.close", "code": REFUSED})  # cross-site websocket hijacking
        return
    verdict = await check(scope, pk, lab_origin=True)
    if verdict is None or verdict.lab is None:
        await send({"type": "websocket.close", "code": REFUSED})
        return
    lab = verdict.lab

    async def still_allowed() -> bool:
        """The grant still opens this lab at this address (the database away: it stands)."""
        again = await check(scope, pk, lab_origin=True)
        return again is None or (again.lab is not None and again.lab.address == lab.address)

    await forward_websocket(scope, receive, send, lab, still_allowed)


async def _hand_off_start(scope: Scope, send: Send, pk: int) -> None:
    """A page view with no grant: to the portal for a ticket, with this browser's state (kept for
    STATE_SECONDS, and the same one again if two tabs start at once)."""
    state = parse_cookie(header(scope, "cookie") or "").get(STATE_COOKIE, "")
    if not SECRET.match(state):
        state = secrets.token_urlsafe(32)
    query = urlencode({"state": state, "next": lab_next(pk, _raw_target(scope))})
    location = f"{settings.PORTAL_URL}{reverse('lab_ticket', args=[pk])}?{query}"
    cookie = _cookie(STATE_COOKIE, state, f"/sessions/{pk}/", max_age=STATE_SECONDS)
    await plain(send, 302, "Signing in through the portal.", location=location, cookies=(cookie,))


async def _redeem(scope: Scope, send: Send, pk: int) -> None:
    """`/sessions/<id>/lab-auth/?ticket=…&next=…`: the portal's ticket for the lab's own cookie."""
    if scope["method"] not in ("GET", "HEAD"):
        await plain(send, 405, "Method not allowed.")
        return
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    ticket, wanted = query.get("ticket", [""])[0], query.get("next", [""])[0]
    state = parse_cookie(header(scope, "cookie") or "").get(STATE_COOKIE)
    try:
        secret = await sync_to_async(_redeem_ticket, thread_sensitive=False)(pk, ticket, state)
    except DatabaseError as exc:
        log.warning("Lab %s: the database is not answering (%s)", pk, exc)
        await plain(send, 503, "The portal's database is not answering; try again shortly.", retry=5)
        return
    if secret is None:
        log.info("Lab %s: a ticket was refused (used, expired, or not this browser's)", pk)
        await plain(send, 403, _ticket_refused(pk))
        return
    cookies = (
        _cookie(GRANT_COOKIE, secret, f"/sessions/{pk}/lab/"),
        _cookie(STATE_COOKIE, "", f"/sessions/{pk}/", max_age=0),
    )
    await plain(send, 302, "Signed in to the lab.", location=lab_next(pk, wanted), cookies=cookies)


def _redeem_ticket(pk: int, ticket: str, state: str | None) -> str | None:
    try:
        return lab_ticket_redeem(pk=pk, ticket=ticket, state=state)
    finally:
        connection.close()


def _ticket_refused(pk: int) -> str:
    return (
        f"This link into JupyterLab session {pk} no longer works: it has been used, has expired, or"
        f" was not made for this browser (each link works once, within {settings.LAB_TICKET_SECONDS}"
        f" seconds, in the browser that asked for it).\n\nOpen the lab again from the portal:"
        f" {_session_page(pk)}"
    )


def _session_page(pk: int) -> str:
    return f"{settings.PORTAL_URL}{reverse('session_detail', args=[pk])}"


def _cookie(name: str, value: str, path: str, *, max_age: int | None = None) -> str:
    """A cookie of the labs' origin: host-only, for `path`, out of script's reach, not sent with
    other sites' subrequests, and Secure on https."""
    parts = [f"{name}={value}", f"Path={path}", "HttpOnly", "SameSite=Lax"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    if settings.LAB_ORIGIN.startswith("https://"):
        parts.append("Secure")
    return "; ".join(parts)
