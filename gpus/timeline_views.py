"""A server's page: its week of bookings (the rows and the axis are gpus/timeline.py's) and, for
admins, draining it or putting it back in service (gpus/servers.py)."""

from __future__ import annotations

from datetime import datetime, time, timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from gpus.forms import ServerDrainForm
from gpus.models import Server
from gpus.servers import DRAIN_MEANS, REASON_MAX, bookings_held, server_drain_set
from gpus.timeline import DAYS, server_timeline_rows, timeline_axis
from portal.access import is_admin
from portal.errors import ServiceError

MAX_PAGE_DAYS = 10 * 365


def _window_start(request: HttpRequest, now: datetime) -> datetime:
    """`?start=YYYY-MM-DD` (local midnight), else now floored to the hour."""
    text = request.GET.get("start", "")
    if text:
        try:
            day = datetime.strptime(text, "%Y-%m-%d").date()
        except ValueError:
            messages.error(
                request, f"Could not read the start date {text!r}; use YYYY-MM-DD. Showing from now."
            )
        else:
            # Bounded so paging can never step past the calendar's end.
            if abs((day - timezone.localdate(now)).days) <= MAX_PAGE_DAYS:
                return timezone.make_aware(datetime.combine(day, time.min))
            messages.error(
                request, f"Pick a start within {MAX_PAGE_DAYS // 365} years of today. Showing from now."
            )
    return timezone.localtime(now).replace(minute=0, second=0, microsecond=0)


@require_GET
@login_required
def server_timeline(request: HttpRequest, name: str) -> HttpResponse:
    server = get_object_or_404(Server, name=name)
    now = timezone.now()
    start = _window_start(request, now)
    day = timezone.localtime(start).date()
    page = reverse("server_timeline", args=[server.name])
    context = {
        "server": server,
        "rows": server_timeline_rows(server, request.user, start=start),
        "axis": timeline_axis(start, now),
        "prev_url": f"{page}?start={day - timedelta(days=DAYS):%Y-%m-%d}",
        "next_url": f"{page}?start={day + timedelta(days=DAYS):%Y-%m-%d}",
        "this_url": page if "start" in request.GET else None,
        "reserve_url": f"{reverse('reservation_new')}?server={server.name}",
        "drain": (
            {"means": DRAIN_MEANS, "held": bookings_held(server), "reason_max": REASON_MAX}
            if is_admin(request.user)
            else None
        ),
    }
    return render(request, "gpus/timeline.html", context)


@require_POST
@login_required
def server_drain(request: HttpRequest, name: str) -> HttpResponse:
    """Admins: `draining=on` drains the server (with `reason`), anything else puts it back."""
    server = get_object_or_404(Server, name=name)
    form = ServerDrainForm(request.POST)
    if not form.is_valid():  # e.g. a NUL in the reason: nothing is written
        said = " ".join(m for ms in form.errors.values() for m in ms)
        messages.error(request, f"{server} was not changed: {said}")
        return redirect("server_timeline", name=server.name)
    draining = form.cleaned_data["draining"]
    try:
        changed = server_drain_set(actor=request.user, server=server, **form.cleaned_data)
    except ServiceError as error:
        if error.status == 403:
            raise PermissionDenied(error.message) from None
        messages.error(request, f"{server} was not changed: {error.message}")
        return redirect("server_timeline", name=server.name)
    state = "draining" if draining else "in service"
    if not changed:
        messages.info(request, f"{server} was {state} already: nothing changed.")
    elif draining:
        messages.success(request, f"{server} is draining: {DRAIN_MEANS} It is in the audit log.")
    else:
        messages.success(request, f"{server} is back in service: it takes bookings and jobs again.")
    return redirect("server_timeline", name=server.name)
