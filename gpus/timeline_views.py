"""The per-server timeline page (the rows and the axis are gpus/timeline.py's)."""

from __future__ import annotations

from datetime import datetime, time, timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET

from gpus.models import Server
from gpus.timeline import DAYS, server_timeline_rows, timeline_axis

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
    }
    return render(request, "gpus/timeline.html", context)
