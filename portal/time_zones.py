"""Each person's time zone: every time shown and typed is in it (issue 23).

Their profile's zone if they chose one; else their browser's, which a line of script in every
page keeps in the `browser_tz` cookie (`Intl.DateTimeFormat().resolvedOptions().timeZone`); else
the portal's TIME_ZONE. TimeZoneMiddleware makes it Django's current time zone for the request,
so templates' |date, forms' date-time fields and portal.timefmt all follow it, and the footer
names it. The profile's choice is kept in the session, so a request reads no extra row.
Background work (mails, the worker's lines) keeps the portal's TIME_ZONE, and says so.
"""

from __future__ import annotations

import zoneinfo
from functools import cache

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from portal.errors import Invalid
from portal.models import Profile
from portal.timefmt import valid_time_zone

SESSION_KEY = "time_zone"
BROWSER_COOKIE = "browser_tz"


def zone_of(request: HttpRequest) -> tuple[str, str]:
    """(zone, where it came from: "profile", "browser" or "portal")."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and hasattr(request, "session"):
        chosen = request.session.get(SESSION_KEY)
        if chosen is None:
            chosen = Profile.objects.filter(user=user).values_list("time_zone", flat=True).first() or ""
            request.session[SESSION_KEY] = chosen
        if chosen and valid_time_zone(chosen):
            return chosen, "profile"
    browser = valid_time_zone(request.COOKIES.get(BROWSER_COOKIE, ""))
    if browser:
        return browser, "browser"
    return settings.TIME_ZONE, "portal"


class TimeZoneMiddleware:
    """After AuthenticationMiddleware: the request runs in its person's zone."""

    def __init__(self, get_response) -> None:  # type: ignore[no-untyped-def]
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        zone, source = zone_of(request)
        request.time_zone, request.time_zone_source = zone, source  # type: ignore[attr-defined]
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
    return time_zone
