"""Per-server timeline: the next 7 days, one row per card, bookings as bars.

The selector returns plain rows (positions already in percent of the window), so the
template only places boxes; it reads three queries however many cards and bookings. The page
is gpus/timeline_views.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, time, timedelta
from typing import Any, NamedTuple

from django.urls import reverse
from django.utils import timezone

from gpus.models import GPU, Allocation, Server, format_mb
from portal.access import display_name, is_admin, team_ids_of
from portal.timefmt import format_time

DAYS = 7
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
    window = (start, end, _seconds(start, end))
    sight = _Sight.of(viewer)
    rows = _card_rows(server)
    for allocation in _allocations(server, start, end):
        row = rows[allocation.gpu_id]
        row["bars"].append(_bar(allocation, sight, window, row["bookable_mb"]))
    for row in rows.values():
        _lay_out(row["bars"])
    return list(rows.values())


class _Allocation(NamedTuple):
    gpu_id: str
    reservation_id: int
    memory_mb: int | None
    start: datetime
    end: datetime
    owner_id: int
    owner_name: str
    team_id: int
    note: str


@dataclass(frozen=True)
class _Sight:
    """What the viewer may know of others' bookings (the privacy rule)."""

    viewer: Any
    teams: set[int]
    admin: bool

    @classmethod
    def of(cls, viewer: Any) -> _Sight:
        return cls(viewer, team_ids_of(viewer), is_admin(viewer))

    def kind(self, a: _Allocation) -> str:
        return "own" if a.owner_id == self.viewer.pk else "team" if a.team_id in self.teams else "other"

    def who(self, a: _Allocation) -> str:
        return display_name(self.viewer, self.teams, a.owner_id, a.owner_name, a.team_id)

    def may_open(self, kind: str) -> bool:
        """The booking's page, and so its note: "alice's thesis" would name her."""
        return kind != "other" or self.admin


def _card_rows(server: Server) -> dict[str, dict[str, Any]]:
    """The server's cards by UUID, each a row with no bars yet."""
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
    return rows


def _allocations(server: Server, start: datetime, end: datetime) -> list[_Allocation]:
    rows = (
        Allocation.objects.live_between(start, end)
        .filter(gpu__server=server)
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
    return [_Allocation(*row) for row in rows]


def _bar(
    a: _Allocation, sight: _Sight, window: tuple[datetime, datetime, float], bookable_mb: int
) -> dict[str, Any]:
    """One booking's bar: who and what as the viewer may see them, placed in the window (the
    `_` keys are for _lay_out)."""
    start, end, span = window
    who, kind = sight.who(a), sight.kind(a)
    note = a.note if sight.may_open(kind) else ""
    memory = "whole card" if a.memory_mb is None else format_mb(a.memory_mb)
    shown_start, shown_end = max(a.start, start), min(a.end, end)
    times = f"{format_time(a.start)} – {format_time(a.end)}"
    return {
        "reservation_id": a.reservation_id,
        "who": who,
        "kind": kind,
        "whole": a.memory_mb is None,
        "memory_mb": a.memory_mb,
        "memory": memory,
        "start": format_time(a.start),
        "end": format_time(a.end),
        "note": note,
        "title": f"{who} · {memory} · {times}" + (f" · {note}" if note else ""),
        "url": reverse("reservation_detail", args=[a.reservation_id]) if sight.may_open(kind) else None,
        "clipped_start": a.start < start,
        "clipped_end": a.end > end,
        "left": _pct(shown_start, start, span),
        "width": _pct(shown_end, shown_start, span),
        "_start": a.start,
        "_end": a.end,
        "_height": GPU.card_share(a.memory_mb, bookable_mb),
        "_top": 0.0,
    }


def _lay_out(bars: list[dict[str, Any]]) -> None:
    """Stack a row's shared bars, then turn offsets and heights into percent of the row."""
    _stack([b for b in bars if not b["whole"]])
    for bar in bars:
        bar["top"] = round(100 * bar.pop("_top"), 3)
        bar["height"] = round(100 * bar.pop("_height"), 3)
        del bar["_start"], bar["_end"]


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
