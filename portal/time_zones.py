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
from typing import NamedTuple
from urllib.parse import unquote

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from portal.errors import Invalid
from portal.models import Profile
from portal.timefmt import valid_time_zone

SESSION_KEY = "time_zone"
SESSION_USER = "_auth_user_id"  # django.contrib.auth's: who is signed in, without reading the user
OFFER_KEY = "time_zone_offer"  # set at a sign-in without a chosen zone; gone once answered
# Answered in this browser (any choice, "my browser's" too, or "not now"): not offered again here.
ANSWERED_COOKIE = "tz_offer_answered"
YEAR = 365 * 24 * 3600
BROWSER_COOKIE = "browser_tz"


class _SessionFacts(NamedTuple):
    chosen: str  # the profile's zone, put there at sign-in ("" for none)
    offered: bool  # a sign-in without a chosen zone: offer the browser's
    user_id: str


def _session_facts(request: HttpRequest) -> _SessionFacts | None:
    """What the session says, read once per request (the sign-in reads it anyway: no extra query);
    None without a session, or when it cannot be read (the database away): never an error."""
    if settings.SESSION_COOKIE_NAME not in request.COOKIES or not hasattr(request, "session"):
        return None
    try:
        session = request.session
        return _SessionFacts(
            session.get(SESSION_KEY) or "", bool(session.get(OFFER_KEY)), str(session.get(SESSION_USER) or "")
        )
    except DatabaseError:
        return None


def zone_of(request: HttpRequest, facts: _SessionFacts | None = None) -> tuple[str, str]:
    """(zone, where it came from: "profile", "browser" or "portal"), from the session's `facts`
    and the browser's cookie."""
    chosen = facts.chosen if facts is not None else ""
    if chosen and valid_time_zone(chosen):
        return chosen, "profile"
    browser = browser_zone(request)
    if browser:
        return browser, "browser"
    return settings.TIME_ZONE, "portal"


def browser_zone(request: HttpRequest) -> str | None:
    """The IANA zone the browser's cookie names, or None. portal.js writes it with
    encodeURIComponent (`Europe%2FBerlin`) and Django hands cookie values over undecoded, so it is
    decoded here, the one place that reads it; a raw name (curl's `-b browser_tz=Asia/Tokyo`)
    decodes to itself. Anything that is not a zone once decoded (a path, a typo) is refused."""
    return valid_time_zone(unquote(request.COOKIES.get(BROWSER_COOKIE, "")[:256]))


def remember_on_sign_in(sender, request, user, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """user_logged_in: the profile's zone into the new session, read there from then on."""
    if request is None or not hasattr(request, "session"):
        return
    chosen = Profile.objects.filter(user_id=user.pk).values_list("time_zone", flat=True).first()
    request.session[SESSION_KEY] = chosen or ""
    # Nobody chose yet: every page of this session offers the browser's zone (or a choice) until
    # they answer (base.html; `offer_of`).
    request.session[OFFER_KEY] = not chosen


def offer_of(request: HttpRequest, zone: str, source: str, facts: _SessionFacts | None) -> str | None:
    """Their browser's zone, to offer after a sign-in, while they have chosen none, have not
    answered in this browser, and it is not the portal's own (then there is nothing to decide);
    else None."""
    if facts is None or not facts.offered or source != "browser" or same_zone(zone, settings.TIME_ZONE):
        return None
    if zone not in zone_names():  # only a zone the profile's form offers too
        return None
    answered = request.get_signed_cookie(ANSWERED_COOKIE, default="", salt=ANSWERED_COOKIE)
    return None if answered and answered == facts.user_id else zone


# The names of UTC: a browser saying Etc/UTC to a portal in UTC has nothing to decide.
UTC_NAMES = frozenset(
    {"UTC", "Etc/UTC", "Etc/UCT", "UCT", "Etc/Universal", "Universal", "Etc/Zulu", "Zulu", "GMT", "Etc/GMT"}
    | {"Etc/GMT0", "GMT0", "Etc/GMT+0", "Etc/GMT-0", "GMT+0", "GMT-0", "Etc/Greenwich", "Greenwich"}
)


def same_zone(one: str, other: str) -> bool:
    return one == other or (one in UTC_NAMES and other in UTC_NAMES)


def time_zone_offer_answered(request: HttpRequest, response: HttpResponse | None = None) -> None:
    """Any answer (a choice, or "not now") ends the offer: for this session, and with `response`
    for this person in this browser (a signed cookie naming them: someone else signing in on a
    shared computer is still asked)."""
    if hasattr(request, "session"):
        request.session.pop(OFFER_KEY, None)
    if response is not None and request.user.is_authenticated:
        response.set_signed_cookie(
            ANSWERED_COOKIE,
            str(request.user.pk),
            salt=ANSWERED_COOKIE,
            max_age=365 * 24 * 3600,
            samesite="Lax",
        )


class TimeZoneMiddleware:
    """After AuthenticationMiddleware: the request runs in its person's zone."""

    def __init__(self, get_response) -> None:  # type: ignore[no-untyped-def]
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        facts = _session_facts(request)
        zone, source = zone_of(request, facts)
        request.time_zone, request.time_zone_source = zone, source  # type: ignore[attr-defined]
        request.time_zone_offer = offer_of(request, zone, source, facts)  # type: ignore[attr-defined]
        with timezone.override(zone):
            return self.get_response(request)


@cache
def zone_names() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())


@cache
def zone_choices() -> list[tuple[str, str]]:
    return [("", "My browser's")] + [(name, name.replace("_", " ")) for name in sorted(zone_names())]


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
