"""Per-server timeline: the next 7 days, one row per card, bookings as bars.

The selector returns plain rows (positions already in percent of the window), so the
template only places boxes; it reads three queries however many cards and bookings.
"""

from __future__ import annotations

from datetime import datetime, time, timedelta
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET

from gpus.models import GPU, Allocation, Server, format_mb
from portal.access import display_name, is_admin, team_ids_of
from portal.timefmt import format_time

DAYS = 7
MAX_PAGE_DAYS = 10 * 365
# Shared bars whose edges meet within this (a fraction of the row) count as touching, not overlapping.
EPSILON = 1e-9


def window_end(start: datetime, days: int = DAYS) -> datetime:
    """`days` calendar days after `start` in the local time zone (a DST week is 167 or 169 h)."""
    local = timezone.localtime(start)
    return timezone.make_aware(
        datetime.combine(local.date() + timedelta(days=days), local.time().replace(tzinfo=None))
    )


def _seconds(start: datetime, end: datetime) -> float:
    # Timestamps, not `end - start`: Python subtracts two datetimes in the same zone by wall
    # clock, which makes a DST week 168 h instead of 167 or 169.
    return end.timestamp() - start.timestamp()


def _pct(at: datetime, start: datetime, span: float) -> float:
    return round(100 * _seconds(start, at) / span, 3)


def _stack(bars: list[dict[str, Any]]) -> None:
    """Give shared bars a vertical offset (fraction of the row) by first fit, in start order.

    Each bar goes at the lowest offset where it overlaps no bar already placed that
    overlaps it in time. Bookings never exceed the card, but first fit can still run out
    of room (fragmentation); such a bar is clamped to the bottom edge of the row.
    """
    placed: list[dict[str, Any]] = []
    for bar in bars:
        height = bar["_height"]
        beside = [p for p in placed if p["_start"] < bar["_end"] and bar["_start"] < p["_end"]]
        candidates = sorted({0.0, *(p["_top"] + p["_height"] for p in beside)})
        free = [
            c
            for c in candidates
            if not any(
                c < p["_top"] + p["_height"] - EPSILON and p["_top"] < c + height - EPSILON for p in beside
            )
        ]
        fitting = [c for c in free if c + height <= 1 + EPSILON]
        bar["_top"] = fitting[0] if fitting else max(0.0, 1 - height)
        placed.append(bar)


def server_timeline_rows(
    server: Server, viewer: Any, *, start: datetime, days: int = DAYS
) -> list[dict[str, Any]]:
    """One row per card of `server` (by index) with its live bookings in [start, start + days).

    Bars are clipped to the window; `left`/`width` are percent of the window, `top`/`height`
    percent of the row (whole cards fill it; memory bookings stack by their share of the
    card's bookable memory). Owners are named as portal.access.display_name allows, and a
    bar links to its booking, and shows its note, only where the viewer may open it (own, team's,
    admin).
    Three queries: the viewer's teams, the cards, the allocations.
    """
    end = window_end(start, days)
    span = _seconds(start, end)
    viewer_teams = team_ids_of(viewer)
    admin = is_admin(viewer)
    reserve_url = reverse("reservation_new")

    rows: dict[str, dict[str, Any]] = {}
    for uuid, index, name, total, reserved in (
        GPU.objects.filter(server=server)
        .order_by("index")
        .values_list("uuid", "index", "name", "memory_total_mb", "memory_reserved_mb")
    ):
        bookable = GPU.bookable_mb(total, reserved)
        rows[uuid] = {
            "uuid": uuid,
            "index": index,
            "name": name,
            "bookable_mb": bookable,
            "bookable": format_mb(bookable),
            "reserve_url": f"{reserve_url}?server={server.name}&gpu={uuid}",
            "bars": [],
        }

    allocations = (
        Allocation.objects.filter(live=True, gpu__server=server, end__gt=start, start__lt=end)
        .order_by("start", "reservation_id")
        .values_list(
            "gpu_id",
            "reservation_id",
            "memory_mb",
            "start",
            "end",
            "reservation__owner_id",
            "reservation__owner__username",
            "reservation__team_id",
            "reservation__note",
        )
    )
    for gpu_id, pk, memory_mb, a_start, a_end, owner_id, owner_name, team_id, note in allocations:
        row = rows[gpu_id]
        who = display_name(viewer, viewer_teams, owner_id, owner_name, team_id)
        kind = "own" if owner_id == viewer.pk else "team" if team_id in viewer_teams else "other"
        if kind == "other" and not admin:
            note = ""  # the note is the booking's, as its page is: "alice's thesis" would name her
        memory = "whole card" if memory_mb is None else format_mb(memory_mb)
        shown_start, shown_end = max(a_start, start), min(a_end, end)
        if memory_mb is None or not row["bookable_mb"]:
            height = 1.0
        else:
            height = min(1.0, memory_mb / row["bookable_mb"])
        times = f"{format_time(a_start)} – {format_time(a_end)}"
        title = f"{who} · {memory} · {times}" + (f" · {note}" if note else "")
        row["bars"].append(
            {
                "reservation_id": pk,
                "who": who,
                "kind": kind,
                "whole": memory_mb is None,
                "memory_mb": memory_mb,
                "memory": memory,
                "start": format_time(a_start),
                "end": format_time(a_end),
                "note": note,
                "title": title,
                "url": reverse("reservation_detail", args=[pk]) if kind != "other" or admin else None,
                "clipped_start": a_start < start,
                "clipped_end": a_end > end,
                "left": _pct(shown_start, start, span),
                "width": _pct(shown_end, shown_start, span),
                "_start": a_start,
                "_end": a_end,
                "_height": height,
                "_top": 0.0,
            }
        )

    for row in rows.values():
        _stack([b for b in row["bars"] if not b["whole"]])
        for bar in row["bars"]:
            bar["top"] = round(100 * bar.pop("_top"), 3)
            bar["height"] = round(100 * bar.pop("_height"), 3)
            del bar["_start"], bar["_end"]
    return list(rows.values())


def timeline_axis(start: datetime, now: datetime, days: int = DAYS) -> dict[str, Any]:
    """Day columns (local dates) and the 'now' marker for the window starting at `start`."""
    end = window_end(start, days)
    span = _seconds(start, end)
    local = timezone.localtime(start)
    columns = []
    for i in range(days):
        day_start = window_end(start, i)
        day_end = window_end(start, i + 1)
        day = local.date() + timedelta(days=i)
        columns.append(
            {
                "date": day,
                "label": f"{day:%a} {day.day} {day:%b}",
                "from": f"from {local:%H:%M}" if local.time() != time.min else "",
                "left": _pct(day_start, start, span),
                "width": _pct(day_end, day_start, span),
                "weekend": day.weekday() >= 5,
                "today": day == timezone.localdate(now),
            }
        )
    return {
        "start": start,
        "end": end,
        "columns": columns,
        "now_left": _pct(now, start, span) if start <= now < end else None,
        "time_zone": timezone.get_current_timezone_name(),
        "label": f"{format_time(start)} – {format_time(end)}",
    }


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
