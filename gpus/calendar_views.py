"""Calendar pages: the feed itself (`/calendar/<secret>.ics`, for calendar apps: no sign-in, no
session, no CSRF), "Make a new link" (a POST from the profile, the team page or a GPU page), and
the "Calendar" panel those pages show (templates/gpus/_calendar.html). The rules are in
gpus/calendars.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseNotAllowed,
    HttpResponseNotFound,
    HttpResponseNotModified,
)
from django.shortcuts import redirect
from django.template import Context
from django.urls import reverse
from django.utils.http import http_date, parse_etags, parse_http_date_safe
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from gpus.calendars import (
    calendar_feed_for_secret,
    calendar_feed_get,
    calendar_feed_renew,
    calendar_feed_serve,
    calendar_feed_url,
    calendar_ics,
    calendar_scope_from,
)
from gpus.models import CalendarFeed, Server
from portal.errors import ServiceError
from portal.http import is_local_path
from portal.models import Team


@csrf_exempt  # calendar apps have no CSRF cookie: any method but GET/HEAD gets a quiet 405
def calendar_feed(request: HttpRequest, secret: str) -> HttpResponse:
    """The feed, or 404 for an unknown, replaced or no longer permitted secret (never 403)."""
    if request.method not in ("GET", "HEAD"):
        return HttpResponseNotAllowed(["GET", "HEAD"])
    feed = calendar_feed_for_secret(secret)
    if feed is None:
        # Django logs it with the path, the secret cut short there (portal/log_filters.py).
        return HttpResponseNotFound("No such calendar.", content_type="text/plain")
    served = calendar_feed_serve(feed=feed)
    if _not_modified(request, served.etag, int(served.changed_at.timestamp())):
        response = HttpResponseNotModified()
    else:
        response = HttpResponse(calendar_ics(served), content_type="text/calendar; charset=utf-8")
        response["Content-Disposition"] = 'inline; filename="gpu-bookings.ics"'
    response["ETag"] = served.etag
    response["Last-Modified"] = http_date(served.changed_at.timestamp())
    # Private: the address is a secret. no-cache: revalidate (ETag) on every fetch.
    response["Cache-Control"] = "private, no-cache"
    response["X-Robots-Tag"] = "noindex, nofollow"
    return response


def _not_modified(request: HttpRequest, etag: str, changed: int) -> bool:
    """RFC 9110 13.2.2: If-None-Match decides where sent, else If-Modified-Since."""
    if_none_match = request.headers.get("If-None-Match")
    if if_none_match is not None:
        tags = parse_etags(if_none_match)
        return "*" in tags or etag.removeprefix("W/") in {t.removeprefix("W/") for t in tags}
    since = parse_http_date_safe(request.headers.get("If-Modified-Since") or "")
    return since is not None and changed <= since


@require_POST
@login_required
def calendar_renew(request: HttpRequest) -> HttpResponse:
    """A new secret for one of the user's feeds (own; `team`: a team they lead; `server`: admins)."""
    back = request.POST.get("next") or ""
    if not is_local_path(back, request):
        back = reverse("profile")
    try:
        team, server = calendar_scope_from(request.user, request.POST)
        calendar_feed_renew(user=request.user, team=team, server=server)
    except ServiceError as error:
        messages.error(request, error.message)
        return redirect(back + "#calendar")
    messages.success(
        request, "Made a new calendar link; the old one no longer works. Give your app the new one."
    )
    return redirect(back + "#calendar")


def calendar_panel(
    request: HttpRequest, *, team: Team | None = None, server: Server | None = None
) -> dict[str, Any]:
    """What templates/gpus/_calendar.html shows for one of the viewer's feeds (made on first ask)."""
    feed: CalendarFeed = calendar_feed_get(user=request.user, team=team, server=server)
    url = calendar_feed_url(feed)
    if team is not None:
        heading, title = "Team calendar", f"The bookings of {team.name}, each naming who booked"
    elif server is not None:
        heading, title = f"Calendar of {server.name}", f"Every booking of {server.name}'s cards"
    else:
        heading, title = "Calendar", "Your bookings"
    return {
        "heading": heading,
        "title": title,
        "url": url,
        "webcal": "webcal://" + url.split("://", 1)[1],
        "feed": feed,
        "team": team.slug if team else "",
        "server": server.name if server else "",
        "next": request.get_full_path(),
    }


def profile_calendar(context: Context) -> Mapping[str, Any]:
    """The profile's "Calendar" (portal's slot PROFILE_CALENDAR): the viewer's own feed."""
    return {"calendar": calendar_panel(context["request"])}
