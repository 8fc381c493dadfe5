"""Reads for the usage reports (the Reports page, its CSV export, /api/v1/usage/): the rollups that
gpus/usage.py writes, summed; never the telemetry itself.

Who sees what (`UsageScope`): everyone their own rows; leaders their teams' rows (former members'
included); admins every row, the unbooked time too. Each read goes to the smallest table that can
answer it: UsageDay for totals, series and groups; UsageTeamHour for the heatmap of whole teams or
the lab; UsageHour only for a card's figures and for the hours of one person or one server.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Model, Q, QuerySet, Sum
from django.utils import timezone

from gpus.filters import UsageFilter
from gpus.models import Reservation, UsageDay, UsageFigures, UsageHour, UsageTeamHour
from gpus.usage import day_start, figure_sums
from portal.access import is_admin, roles_of
from portal.models import Membership

UNBOOKED = "(unbooked)"  # the label of the rows without a user or team: the time nobody booked
TOP_USERS = 8  # the stacked chart's own colours; everyone else is "others"
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

    def q(self, user_field: str = "user_id") -> Q:
        if self.everything:
            return Q()
        visible = Q(team_id__in=self.team_ids)
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
    fields = _GROUP_FIELDS[group_by]
    groups = rows.values(*fields).annotate(**figure_sums("sum_")).order_by()
    found = [_row(group[fields[0]], _label(group_by, group, fields), _figures(group)) for group in groups]
    return sorted(found, key=lambda row: (row["key"] is None, str(row["label"])))


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
    """The figures rounded for people, with the derived ones (jobs, utilization: UsageFigures's)."""
    row: dict[str, Any] = {"key": key, "label": label}
    row.update({name: round(figures.get(name, 0), 3) for name in FLOATS})
    row["peak_memory_mb"] = figures.get("peak_memory_mb")
    row.update({name: figures.get(name, 0) for name in JOBS})
    row["jobs"] = sum(row[name] for name in JOBS)
    row["sessions"] = figures.get("sessions", 0)
    row["utilization_pct"] = UsageFigures.utilization_pct(
        row["gpu_hours_used"], row["gpu_hours_booked"], row["gpu_hours_unbooked"]
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
    a table grouped other than by user) and one of the bookings, however long the period."""
    since, until = period_of(filters, timezone.localdate())
    days = filters.filter_queryset(scope.rows(UsageDay))
    by_user = usage_rows(days, "user")
    # The series read only what they draw: a year is ~20,000 (day, user) groups for an admin.
    series = list(
        days.values("day", "user__username")
        .annotate(booked=Sum("gpu_hours_booked"), used=Sum("gpu_hours_used"), idle=Sum("idle_hours"))
        .order_by()
    )
    first = since or min((group["day"] for group in series), default=until)
    size = "day" if (until - first).days <= 62 else "week" if (until - first).days <= 400 else "month"
    buckets = sorted({bucket_of(first + timedelta(days=n), size) for n in range((until - first).days + 1)})
    bucket = {group["day"]: bucket_of(group["day"], size) for group in series}
    group_by = filters.grouping
    totals = _totals(by_user)
    idle = idle_bookings(filters, scope, first, until)
    return {
        "since": first,
        "until": until,
        "bucket": size,
        "totals": totals,
        "table": by_user
        if group_by == "user"
        else usage_rows(filters.filter_queryset(usage_queryset(scope, group_by)), group_by),
        "charts": {
            "labels": [_period_label(b, size) for b in buckets],
            "users": _stacked_by_user(series, bucket, buckets),
            "booked_used": _booked_used(series, bucket, buckets),
            "heatmap": usage_heatmap(filters, scope),
            "jobs": {name.removeprefix("jobs_"): totals["booked"][name] for name in JOBS},
            "idle": [{"label": _booking_label(r), "hours": round(r.idle_minutes / 60, 1)} for r in idle],
        },
        "idle_bookings": idle,
    }


def _totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The bookers' figures, and the unbooked time's (admins alone see it), from the rows by user."""
    booked: dict[str, Any] = {}
    for row in rows:
        if row["key"] is not None:
            _add(booked, row)
    unbooked = next((row for row in rows if row["key"] is None), {})
    return {"booked": _row(None, "booked", booked), "unbooked": _row(None, UNBOOKED, unbooked)}


def _stacked_by_user(
    series: list[dict[str, Any]], bucket: dict[date, date], buckets: list[date]
) -> list[dict[str, Any]]:
    """Booked GPU-hours per bucket for each of the TOP_USERS biggest bookers, then the others."""
    per_user: dict[str, dict[date, float]] = defaultdict(lambda: defaultdict(float))
    for group in series:
        if group["user__username"] is not None:
            per_user[group["user__username"]][bucket[group["day"]]] += group["booked"] or 0
    ranked = sorted(per_user, key=lambda name: -sum(per_user[name].values()))
    lines = [(name, per_user[name]) for name in ranked[:TOP_USERS]]
    if len(ranked) > TOP_USERS:
        others: dict[date, float] = defaultdict(float)
        for name in ranked[TOP_USERS:]:
            for day, hours in per_user[name].items():
                others[day] += hours
        lines.append(("others", others))
    return [{"label": name, "data": [round(hours.get(b, 0), 2) for b in buckets]} for name, hours in lines]


def _booked_used(
    series: list[dict[str, Any]], bucket: dict[date, date], buckets: list[date]
) -> dict[str, list[float]]:
    """The bookers' booked, used and idle GPU-hours per bucket."""
    sums: dict[str, dict[date, float]] = {name: defaultdict(float) for name in ("booked", "used", "idle")}
    for group in series:
        if group["user__username"] is not None:
            for name, per_bucket in sums.items():
                per_bucket[bucket[group["day"]]] += group[name] or 0
    return {name: [round(per_bucket.get(b, 0), 2) for b in buckets] for name, per_bucket in sums.items()}


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
