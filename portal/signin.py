"""Sign-in limits: django-axes' hooks (settings AXES_*, docs/security.md).

django-axes counts failed sign-ins; these say whose (the client's address behind PROXY_COUNT
proxies), what it counts them against (account and address), and what a locked-out try gets.
"""

from __future__ import annotations

import ipaddress

from axes.helpers import get_client_username, get_cool_off
from axes.models import AccessAttempt, AccessBase
from django.conf import settings
from django.db.models import Q, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from portal.api_errors import api_error_response
from portal.names import signin_name


def client_address(request: HttpRequest) -> str | None:
    """The client's address: REMOTE_ADDR, or with PROXY_COUNT proxies in front, the address the
    outermost of them saw, which is that many entries from the right of X-Forwarded-For (each
    proxy appends its own client's). Entries further left are the client's to write, so never
    trusted. A header that is too short or not an address falls back to REMOTE_ADDR."""
    remote = request.META.get("REMOTE_ADDR")
    if not settings.PROXY_COUNT:
        return remote
    forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")]
    if len(forwarded) < settings.PROXY_COUNT:
        return remote
    try:
        return str(ipaddress.ip_address(forwarded[-settings.PROXY_COUNT]))
    except ValueError:
        return remote


def signin_username(request: HttpRequest, credentials: dict | None) -> str | None:
    """The name failures are counted against: as typed, by `signin_name`."""
    if credentials:
        name = credentials.get("username")
    else:
        name = getattr(request, "data", request.POST).get("username")
    return signin_name(name) if isinstance(name, str) and name.strip() else None


def signin_lockout_parameters(request_or_attempt: HttpRequest | AccessBase, credentials: dict | None) -> list:
    """Count failures per account and per address; per address only when no username was given
    (single sign-on callbacks), or every such failure in the lab would count against one "account"."""
    if isinstance(request_or_attempt, AccessBase):
        username = request_or_attempt.username
    else:
        username = get_client_username(request_or_attempt, credentials)
    return ["username", "ip_address"] if username else ["ip_address"]


def signin_locked_out(
    request: HttpRequest, original_response: HttpResponse | None, credentials: dict | None
) -> HttpResponse:
    """429 for a locked-out sign-in: the portal's JSON error on the API, a page elsewhere."""
    username = get_client_username(request, credentials) or ""
    parts = _locked_parts(request, username)
    locked = f"{' and '.join(parts)} {'are' if len(parts) > 1 else 'is'} locked"
    seconds = int(get_cool_off(request).total_seconds())
    minutes = max(1, round(seconds / 60))
    if request.path.startswith("/api/"):
        detail = (
            f"Too many failed sign-ins: {locked} for {minutes} minutes."
            " Each try meanwhile starts the wait again; an admin can unlock it sooner."
        )
        response = api_error_response(detail, code="locked_out", status=429)
    else:
        context = {"locked": locked, "minutes": minutes, "limit": settings.AXES_FAILURE_LIMIT}
        response = render(request, "registration/locked_out.html", context, status=429)
    response["Retry-After"] = str(seconds)
    return response


def _locked_parts(request: HttpRequest, username: str) -> list[str]:
    """What is locked, in words: the account, the client's address, or both."""
    recent = AccessAttempt.objects.filter(attempt_time__gte=timezone.now() - get_cool_off(request))
    address = getattr(request, "axes_ip_address", None)
    checks = []
    if username:
        checks.append((f"the account “{username}”", Q(username=username)))
    if address:
        checks.append((f"your address {address}", Q(ip_address=address)))
    limit = settings.AXES_FAILURE_LIMIT
    return [
        label
        for label, where in checks
        if (recent.filter(where).aggregate(n=Sum("failures_since_start"))["n"] or 0) >= limit
    ] or ["sign-in"]
