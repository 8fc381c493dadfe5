"""Each person's time zone: every time shown and typed is in it (issue 23).

Their profile's zone if they chose one; else their browser's, which a line of script in every
page keeps in the `browser_tz` cookie (`Intl.DateTimeFormat().resolvedOptions().timeZone`); else
the portal's TIME_ZONE. TimeZoneMiddleware makes it Django's current time zone for the request,
so templates' |date, forms' date-time fields and portal.timefmt all follow it, and the footer
names it. The profile's choice is put in the session at sign-in and when it changes, so a
request reads no extra row.
Background work (mails, the worker's lines) keeps the portal's TIME_ZONE, and says so.
"""

from __future__ import annotations

import zoneinfo
from functools import cache

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from portal.errors import Invalid
from portal.models import Profile
from portal.timefmt import valid_time_zone

SESSION_KEY = "time_zone"
OFFER_KEY = "time_zone_offer"  # set at a sign-in without a chosen zone; gone once answered
# Answered in this browser (any choice, "my browser's" too, or "not now"): not offered again here.
ANSWERED_COOKIE = "tz_offer_answered"
BROWSER_COOKIE = "browser_tz"


def zone_of(request: HttpRequest) -> tuple[str, str]:
    """(zone, where it came from: "profile", "browser" or "portal"). Reads nothing but the session
    (which the sign-in reads anyway: no extra query) and the cookie; the database away, or a
    session that cannot be read, is the browser's or the portal's zone, never an error."""
    chosen = ""
    if settings.SESSION_COOKIE_NAME in request.COOKIES and hasattr(request, "session"):
        try:
            chosen = request.session.get(SESSION_KEY) or ""
        except DatabaseError:
            chosen = ""
    if chosen and valid_time_zone(chosen):
        return chosen, "profile"
    browser = valid_time_zone(request.COOKIES.get(BROWSER_COOKIE, ""))
    if browser:
        return browser, "browser"
    return settings.TIME_ZONE, "portal"


def remember_on_sign_in(sender, request, user, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """user_logged_in: the profile's zone into the new session, read there from then on."""
    if request is None or not hasattr(request, "session"):
        return
    chosen = Profile.objects.filter(user_id=user.pk).values_list("time_zone", flat=True).first()
    request.session[SESSION_KEY] = chosen or ""
    # Nobody chose yet: every page of this session offers the browser's zone (or a choice) until
    # they answer (base.html; `offer_of`).
    request.session[OFFER_KEY] = not chosen


def offer_of(request: HttpRequest, zone: str, source: str) -> str | None:
    """Their browser's zone, to offer after a sign-in, while they have chosen none and it is not the
    portal's own (then there is nothing to decide); else None. Reads only the session and cookies,
    like `zone_of`."""
    if source != "browser" or zone == settings.TIME_ZONE or ANSWERED_COOKIE in request.COOKIES:
        return None
    if settings.SESSION_COOKIE_NAME not in request.COOKIES:
        return None
    try:
        offered = bool(getattr(request, "session", {}).get(OFFER_KEY))
    except DatabaseError:
        return None
    return zone if offered else None


def time_zone_offer_answered(request: HttpRequest, response: HttpResponse | None = None) -> None:
    """Any answer (a choice, or "not now") ends the offer: for this session, and with `response`
    for this browser too."""
    if hasattr(request, "session"):
        request.session.pop(OFFER_KEY, None)
    if response is not None:
        response.set_cookie(ANSWERED_COOKIE, "1", max_age=365 * 24 * 3600, samesite="Lax")


class TimeZoneMiddleware:
    """After AuthenticationMiddleware: the request runs in its person's zone."""

    def __init__(self, get_response) -> None:  # type: ignore[no-untyped-def]
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        zone, source = zone_of(request)
        request.time_zone, request.time_zone_source = zone, source  # type: ignore[attr-defined]
        request.time_zone_offer = offer_of(request, zone, source)  # type: ignore[attr-defined]
        with timezone.override(zone):
            return self.get_response(request)


@cache
def zone_choices() -> list[tuple[str, str]]:
    return [("", "My browser's")] + [
        (name, name.replace("_", " ")) for name in sorted(zoneinfo.available_timezones())
    ]


def profile_time_zone_set(
    *, user: AbstractBaseUser, time_zone: str, request: HttpRequest | None = None
) -> str:
    """The person's zone ("" for their browser's); refused, naming the field, when it is none."""
    time_zone = (time_zone or "").strip()
    if time_zone and valid_time_zone(time_zone) is None:
        raise Invalid(
            f"{time_zone[:64]!r} is no time zone; choose one from the list (e.g. Europe/Berlin), or "
            "your browser's.",
            field="time_zone",
        )
    Profile.objects.update_or_create(user=user, defaults={"time_zone": time_zone})
    if request is not None and hasattr(request, "session"):
        request.session[SESSION_KEY] = time_zone
        time_zone_offer_answered(request)
    return time_zone
