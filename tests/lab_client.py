"""A client that opens a lab as a browser does (docs/sessions.md, "Two origins"), for the tests and
the benchmarks: the portal's session cookie on the portal's host name only, the hand-off's
redirects followed, and the lab's own cookie kept for the labs' host name and the lab's path.
httpx's cookie jar (the standard library's) keeps cookies per host name and path as browsers do,
so what reaches which origin is what a browser would send."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.test import Client


def signed_in(user: Any) -> str:
    """The portal's session cookie for `user`, as a browser holds it after signing in."""
    browser = Client()
    browser.force_login(user)
    return browser.cookies[settings.SESSION_COOKIE_NAME].value


def jar_domain(url: str) -> str:
    """The domain the cookie jar files a host's cookies under (a dotless name gets `.local`)."""
    host = urlsplit(url).hostname or ""
    return host if "." in host or ":" in host else f"{host}.local"


def browser(portal: str, user: Any | None = None, **options: Any) -> httpx.Client:
    """A client signed in to the portal as `user` (None: nobody), sending what a page view sends.
    `sent` on it lists (host, path, Cookie header) of every request it made, redirects included."""
    sent: list[tuple[str, str, str]] = []

    def record(request: httpx.Request) -> None:
        sent.append(
            (request.url.netloc.decode(), request.url.raw_path.decode(), request.headers.get("cookie", ""))
        )

    options = {"timeout": 10, "headers": {"Accept": "text/html"}, **options}
    http = httpx.Client(event_hooks={"request": [record]}, **options)
    http.sent = sent  # type: ignore[attr-defined]
    if user is not None:
        http.cookies.set(settings.SESSION_COOKIE_NAME, signed_in(user), domain=jar_domain(portal), path="/")
    return http


def open_lab(http: httpx.Client, portal: str, pk: int, rest: str = "") -> httpx.Response:
    """What *Open JupyterLab* does: the lab's portal address, every redirect followed."""
    return http.get(f"{portal}/sessions/{pk}/lab/{rest}", follow_redirects=True)


def grant_cookie(http: httpx.Client, pk: int) -> str:
    """Lab `pk`'s own cookie, as the hand-off left it in the jar."""
    path = f"/sessions/{pk}/lab/"
    return next(
        cookie.value for cookie in http.cookies.jar if cookie.name == "lab_grant" and cookie.path == path
    )
