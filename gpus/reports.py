"""Reads for the usage reports (the Reports page, its CSV export, /api/v1/usage/): the rollups that
gpus/usage.py writes, summed; never the telemetry itself.

Who sees what (`UsageScope`): everyone their own rows; leaders their teams' rows (former members'
included); admins every row, the unbooked time too. Each read goes to the smallest table that can
answer it: UsageDay for totals, series and groups; UsageTeamHour for the heatmap of whole teams or
the lab; UsageHour only for a card's figures and for the hours of one person or one server.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Model, Q, QuerySet, Sum
from django.utils import timezone

from gpus.filters import UsageFilter
from gpus.hooks import jobs_peak_memory
from gpus.models import Allocation, Reservation, UsageDay, UsageFigures, UsageHour, UsageTeamHour
from gpus.quota_usage import gpu_hours_booked_this_week
from gpus.quotas import this_week
from gpus.usage import day_start, figure_sums, portal_today
from portal.access import is_admin, roles_of
from portal.models import Membership

UNBOOKED = "(unbooked)"  # the label of the rows without a user or team: the time nobody booked
TOP_USERS = 8  # the stacked chart's own colours; everyone else is "others"
# The people's colours: more than TOP_USERS, so two whose names hash alike always find a free one.
PALETTE = (
    "#2563eb", "#0d9488", "#d97706", "#7c3aed", "#db2777", "#16a34a",
    "#0891b2", "#ca8a04", "#dc2626", "#4f46e5", "#65a30d", "#c026d3",
)  # fmt: skip
OTHERS_COLOUR = "#94a3b8"  # "others", never a person's
IDLE_BOOKINGS_SHOWN = 10
FLOATS = ("gpu_hours_booked", "gpu_hours_used", "gpu_hours_unbooked", "idle_hours", "memory_gb_hours_booked")
JOBS = ("jobs_succeeded", "jobs_failed", "jobs_other")
COLUMNS = ("key", "label", *FLOATS, "peak_memory_mb", "jobs", *JOBS, "sessions", "utilization_pct")


@dataclass(frozen=True)
class UsageScope:
    """The usage rows a person may read. `user_id` is set when their own rows are not all inside
    teams they lead: a plain member, or a leader who is a plain member of another team."""

    everything: bool
    team_ids: frozenset[int]
    user_id: int | None

    @classmethod
    def of(cls, user: AbstractBaseUser) -> UsageScope:
        if is_admin(user):
            return cls(True, frozenset(), None)
        roles = roles_of(user)
        led = frozenset(team for team, role in roles.items() if role == Membership.Role.LEADER)
        return cls(False, led, None if roles and len(led) == len(roles) else user.pk)

    def q(self, user_field: str = "user_id", team_field: str = "team_id") -> Q:
        """The visible rows of a table whose booker and team are `user_field` and `team_field`."""
        if self.everything:
            return Q()
        visible = Q(**{f"{team_field}__in": self.team_ids})
        return visible | Q(**{user_field: self.user_id}) if self.user_id is not None else visible

    def rows(self, model: type[Model]) -> QuerySet:
        return model.objects.filter(self.q())  # type: ignore[attr-defined]

    @property
    def whole_teams(self) -> bool:
        """Everything visible is whole teams (or the lab): the team-level table can answer."""
        return self.user_id is None


# --- grouped rows: the API, the CSV and the page's table ---------------------------------------


def usage_queryset(scope: UsageScope, group_by: str) -> QuerySet:
    """The table a grouping reads: a card's figures exist only by the hour."""
    return scope.rows(UsageHour if group_by == "gpu" else UsageDay)


_GROUP_FIELDS = {
    "user": ("user__username",),
    "team": ("team__slug", "team__name"),
    "server": ("server__name",),
    "gpu": ("gpu_id", "server__name", "gpu__index"),
}


def usage_rows(rows: QuerySet, group_by: str) -> list[dict[str, Any]]:
    """One dict per group with every figure (COLUMNS): users, teams, servers and cards by name
    (the unbooked time last), days, weeks and months in order."""
    if group_by in ("day", "week", "month"):
        return _by_period(rows, group_by)
    return [_row(key, label, figures) for key, label, figures in _groups(rows, group_by)]


def _groups(rows: QuerySet, group_by: str) -> list[tuple[Any, str, dict[str, Any]]]:
    """(key, label, the figures as summed: unrounded) per user, team, server or card, by name."""
    fields = _GROUP_FIELDS[group_by]
    groups = rows.values(*fields).annotate(**figure_sums("sum_")).order_by()
    found = [(group[fields[0]], _label(group_by, group, fields), _figures(group)) for group in groups]
    return sorted(found, key=lambda found: (found[0] is None, str(found[1])))


def _label(group_by: str, group: dict[str, Any], fields: tuple[str, ...]) -> str:
    if group[fields[0]] is None:
        return UNBOOKED
    if group_by == "team":
        return group["team__name"]
    if group_by == "gpu":
        return f"{group['server__name']} GPU {group['gpu__index']}"
    return group[fields[0]]


def _figures(group: dict[str, Any]) -> dict[str, Any]:
    """A group's figures from its figure_sums("sum_") annotations."""
    figures = {name: group[f"sum_{name}"] or 0 for name in UsageFigures.SUMMED}
    figures["peak_memory_mb"] = group["sum_peak_memory_mb"]
    return figures


def _add(total: dict[str, Any], figures: dict[str, Any]) -> None:
    for name in UsageFigures.SUMMED:
        total[name] = total.get(name, 0) + figures[name]
    peaks = [p for p in (total.get("peak_memory_mb"), figures["peak_memory_mb"]) if p is not None]
    total["peak_memory_mb"] = max(peaks) if peaks else None


def _row(key: Any, label: str, figures: dict[str, Any]) -> dict[str, Any]:
    """The figures rounded to three decimals (the page prints them by portal.figures' rule), with
    the derived ones (jobs, utilization: UsageFigures's), from the unrounded sums."""
    row: dict[str, Any] = {"key": key, "label": label}
    row.update({name: round(figures.get(name, 0), 3) for name in FLOATS})
    row["peak_memory_mb"] = figures.get("peak_memory_mb")
    row.update({name: figures.get(name, 0) for name in JOBS})
    row["jobs"] = sum(row[name] for name in JOBS)
    row["sessions"] = figures.get("sessions", 0)
    row["utilization_pct"] = UsageFigures.utilization_pct(
        *(figures.get(name, 0) for name in ("gpu_hours_used", "gpu_hours_booked", "gpu_hours_unbooked"))
    )
    return row


def bucket_of(day: date, size: str) -> date:
    """The first day of the day's week (Monday) or month; a day is its own."""
    if size == "week":
        return day - timedelta(days=day.weekday())
    return day.replace(day=1) if size == "month" else day


def _by_period(rows: QuerySet, size: str) -> list[dict[str, Any]]:
    totals: dict[date, dict[str, Any]] = defaultdict(dict)
    for group in rows.values("day").annotate(**figure_sums("sum_")).order_by():
        _add(totals[bucket_of(group["day"], size)], _figures(group))
    keys = {day: day.isoformat()[:7] if size == "month" else day.isoformat() for day in totals}
    return [_row(keys[day], _period_label(day, size), totals[day]) for day in sorted(totals)]


def _period_label(day: date, size: str) -> str:
    return {"day": f"{day:%a %Y-%m-%d}", "week": f"week of {day:%Y-%m-%d}", "month": f"{day:%B %Y}"}[size]


# --- the page --------------------------------------------------------------------------------------


def period_of(filters: UsageFilter, today: date) -> tuple[date | None, date]:
    """The period asked for: (since, until), days inclusive; None since: from the first row."""
    data = filters.form.cleaned_data
    return data.get("since"), data.get("until") or today


def usage_report(filters: UsageFilter, scope: UsageScope) -> dict[str, Any]:
    """Everything the Reports page draws, for a valid `filters`: four reads of the rollups (five with
    a table grouped other than by user), one of the bookings, one of the allocations (this week)
    and the jobs' answer (their own peak memory), however long the period. Days are TIME_ZONE's."""
    since, until = period_of(filters, portal_today())
    days = filters.filter_queryset(scope.rows(UsageDay))
    users = _groups(days, "user")
    by_user = [_row(key, label, figures) for key, label, figures in users]
    # The series read only what they draw: a year is ~20,000 (day, user) groups for an admin.
    series = list(
        days.values("day", "user__username")
        .annotate(booked=Sum("gpu_hours_booked"), used=Sum("gpu_hours_used"), idle=Sum("idle_hours"))
        .order_by()
    )
    first = since or min((group["day"] for group in series), default=until)
    group_by = filters.grouping
    totals = _totals(users)
    idle = idle_bookings(filters, scope, first, until)
    peaks = _jobs_peaks(filters, scope, first, until)
    totals["booked"]["jobs_peak_memory_mb"] = max(peaks.values(), default=None)
    table = (
        by_user
        if group_by == "user"
        else usage_rows(filters.filter_queryset(usage_queryset(scope, group_by)), group_by)
    )
    if group_by == "user":
        for row in table:
            row["jobs_peak_memory_mb"] = peaks.get(row["key"])
    charts = _charts(series, first, until)
    charts["heatmap"] = usage_heatmap(filters, scope)
    charts["jobs"] = {name.removeprefix("jobs_"): totals["booked"][name] for name in JOBS}
    charts["idle"] = [{"label": _booking_label(r), "hours": round(r.idle_minutes / 60, 3)} for r in idle]
    return {
        "since": first,
        "until": until,
        "bucket": charts["bucket"],
        "group_by": group_by,
        "time_zone": settings.TIME_ZONE,
        "totals": totals,
        "week": week_booked(filters, scope),
        "table": table,
        "charts": charts,
        "idle_bookings": idle,
    }


def _charts(series: list[dict[str, Any]], first: date, until: date) -> dict[str, Any]:
    """The charts over time (by day up to two months, by week up to a year and a bit, then by
    month), with every axis's title: its unit."""
    size = "day" if (until - first).days <= 62 else "week" if (until - first).days <= 400 else "month"
    buckets = sorted({bucket_of(first + timedelta(days=n), size) for n in range((until - first).days + 1)})
    bucket = {group["day"]: bucket_of(group["day"], size) for group in series}
    period = {"day": "Day", "week": "Week (Monday to Sunday)", "month": "Month"}[size]
    zone = settings.TIME_ZONE
    return {
        "bucket": size,
        "labels": [_period_label(b, size) for b in buckets],
        "users": _stacked_by_user(series, bucket, buckets),
        "booked_used": _booked_used(series, bucket, buckets),
        "axes": {
            "users": {"x": f"{period} ({zone})", "y": "GPU-hours booked"},
            "booked_used": {"x": f"{period} ({zone})", "y": "GPU-hours"},
            "heatmap": {"x": f"Hour of the day ({zone})", "y": "Day of the week", "v": "Utilization (%)"},
            "idle": {"x": "Idle hours (h)", "y": "Booking"},
        },
    }


def _totals(groups: list[tuple[Any, str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The bookers' figures, and the unbooked time's (admins alone see it), from the unrounded
    groups by user: rounding each person's first would drift the sum."""
    booked: dict[str, Any] = {}
    for key, _, figures in groups:
        if key is not None:
            _add(booked, figures)
    unbooked = next((figures for key, _, figures in groups if key is None), {})
    return {"booked": _row(None, "booked", booked), "unbooked": _row(None, UNBOOKED, unbooked)}


def week_booked(filters: UsageFilter, scope: UsageScope, now: datetime | None = None) -> dict[str, Any]:
    """This week's booked GPU-hours as the team page and the weekly quota count them, for the
    bookings the viewer sees with the page's team, user and server: the one selector
    (gpus.quota_usage.gpu_hours_booked_this_week), the whole week in TIME_ZONE, later this week included."""
    now = now or timezone.now()
    fields = {
        "team": "reservation__team__slug",
        "user": "reservation__owner__username",
        "server": "gpu__server__name",
    }
    rows = Allocation.objects.filter(
        scope.q(user_field="reservation__owner_id", team_field="reservation__team_id"),
        **{fields[name]: value for name, value in _page_filters(filters).items()},
    )
    week, following = this_week(now)
    zone = timezone.get_default_timezone()
    return {
        "first": timezone.localdate(week, zone),
        "last": timezone.localdate(following, zone) - timedelta(days=1),
        "booked": gpu_hours_booked_this_week(rows, now),
    }


def _page_filters(filters: UsageFilter) -> dict[str, str]:
    """The page's team, user and server, those given: for the reads beside the rollups."""
    data = filters.form.cleaned_data
    return {name: data[name] for name in ("team", "user", "server") if data.get(name)}


def _jobs_peaks(filters: UsageFilter, scope: UsageScope, first: date, until: date) -> dict[str, int]:
    """{username: the highest own peak memory of their jobs that ran in the period}, from the jobs
    app (gpus.hooks.jobs_peak_memory), with the page's team, user and server."""
    end = min(day_start(until + timedelta(days=1)), timezone.now())
    return jobs_peak_memory(scope.q(user_field="owner_id"), day_start(first), end, _page_filters(filters))


def user_colours(usernames: Iterable[str]) -> dict[str, str]:
    """Each person's colour on the charts: their name's hash into PALETTE, so the same on every load
    and every period. Where two names on one chart hash alike, the later one alphabetically takes
    the next free colour: a chart never shows two people in one colour."""
    colours: dict[str, str] = {}
    for name in sorted(usernames):
        index = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % len(PALETTE)
        while PALETTE[index] in colours.values():
            index = (index + 1) % len(PALETTE)
        colours[name] = PALETTE[index]
    return colours


def _stacked_by_user(
    series: list[dict[str, Any]], bucket: dict[date, date], buckets: list[date]
) -> list[dict[str, Any]]:
    """Booked GPU-hours per bucket for each of the TOP_USERS biggest bookers, then the others, each
    with the person's own colour (user_colours)."""
    per_user: dict[str, dict[date, float]] = defaultdict(lambda: defaultdict(float))
    for group in series:
        if group["user__username"] is not None:
            per_user[group["user__username"]][bucket[group["day"]]] += group["booked"] or 0
    ranked = sorted(per_user, key=lambda name: -sum(per_user[name].values()))
    colours = user_colours(ranked[:TOP_USERS])
    lines = [(name, per_user[name], colours[name]) for name in ranked[:TOP_USERS]]
    if len(ranked) > TOP_USERS:
        others: dict[date, float] = defaultdict(float)
        for name in ranked[TOP_USERS:]:
            for day, hours in per_user[name].items():
                others[day] += hours
        lines.append(("others", others, OTHERS_COLOUR))
    return [
        {"label": name, "colour": colour, "data": [round(hours.get(b, 0), 3) for b in buckets]}
        for name, hours, colour in lines
    ]


def _booked_used(
    series: list[dict[str, Any]], bucket: dict[date, date], buckets: list[date]
) -> dict[str, list[float]]:
    """The bookers' booked, used and idle GPU-hours per bucket."""
    sums: dict[str, dict[date, float]] = {name: defaultdict(float) for name in ("booked", "used", "idle")}
    for group in series:
        if group["user__username"] is not None:
            for name, per_bucket in sums.items():
                per_bucket[bucket[group["day"]]] += group[name] or 0
    return {name: [round(per_bucket.get(b, 0), 3) for b in buckets] for name, per_bucket in sums.items()}


def usage_heatmap(filters: UsageFilter, scope: UsageScope) -> list[dict[str, Any]]:
    """Utilization by hour of the week ({x: hour, y: weekday (0 Monday), v: % or None}): used GPU-hours
    over the card time covered, booked and (for admins) unbooked, in TIME_ZONE."""
    data = filters.form.cleaned_data
    team_level = scope.whole_teams and not data.get("user") and not data.get("server")
    rows = filters.filter_queryset(scope.rows(UsageTeamHour if team_level else UsageHour))
    cells = {
        group["hour_of_week"]: UsageFigures.utilization_pct(
            group["used"] or 0, group["booked"] or 0, group["unbooked"] or 0
        )
        for group in rows.values("hour_of_week")
        .annotate(
            used=Sum("gpu_hours_used"), booked=Sum("gpu_hours_booked"), unbooked=Sum("gpu_hours_unbooked")
        )
        .order_by()
    }
    return [{"x": h, "y": d, "v": cells.get(d * 24 + h)} for d in range(7) for h in range(24)]


def idle_bookings(filters: UsageFilter, scope: UsageScope, since: date, until: date) -> list[Reservation]:
    """The visible bookings of the period with the most idle time (Reservation.idle_minutes, the idle
    checker's count over each booking's life), with the same team, user and server filters."""
    data = filters.form.cleaned_data
    bookings = Reservation.objects.filter(
        scope.q(user_field="owner_id"),
        idle_minutes__gt=0,
        start__lt=day_start(until + timedelta(days=1)),
        end__gt=day_start(since),
    )
    if data.get("team"):
        bookings = bookings.filter(team__slug=data["team"])
    if data.get("user"):
        bookings = bookings.filter(owner__username=data["user"])
    if data.get("server"):
        on_server = Reservation.objects.filter(allocations__gpu__server__name=data["server"])
        bookings = bookings.filter(pk__in=on_server.values("pk"))
    return list(
        bookings.select_related("owner", "team")
        .prefetch_related("allocations__gpu__server")
        .order_by("-idle_minutes", "-id")[:IDLE_BOOKINGS_SHOWN]
    )


def _booking_label(reservation: Reservation) -> str:
    return f"#{reservation.pk} {reservation.owner.username}: {reservation.summary}"
