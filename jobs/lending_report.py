"""What lending saved (issue 36): GPU-hours lent to the queue and GPU-hours its borrowers used, by
the lending team and server. Read by the Reports page (portal.hooks.REPORTS_LENDING) and /metrics
(jobs/prometheus/metrics.py).

*Lent*: the loans' windows (a loan is the queue's booking on a lent booking's cards, jobs/lending.py),
from their start to their end or release. *Used*: the time the borrowers' jobs ran within them,
a run that left for the queue included (kept as a LoanRun: its job's row forgets it), so the
figures, and /metrics' counters, never go down.
Both count on the side of the booking that was lent: its team is the one whose idle cards were put
to work. A memory share counts its fraction of the card, as the usage reports do. Loans are few
beside all bookings, so the figures are summed here from three reads, not rolled up.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import F, Q
from django.utils import timezone

from gpus.models import GPU, Allocation, Reservation
from gpus.reports import UsageScope
from gpus.usage import day_start
from jobs.models import Job, LoanRun

HOUR = 3600.0


@dataclass(frozen=True)
class LentHours:
    team: str  # the lending team's slug
    server: str
    lent: float  # GPU-hours
    used: float  # GPU-hours the borrowers' jobs ran

    @property
    def used_pct(self) -> float | None:
        return round(100 * self.used / self.lent, 3) if self.lent else None


def _overlap(start: datetime, end: datetime | None, since: datetime | None, until: datetime) -> float:
    """Seconds of [start, end) within [since, until); an open end runs to `until`."""
    low = max(start, since) if since else start
    high = min(end, until) if end else until
    return max(0.0, (high - low).total_seconds())


def lending_hours(
    *, until: datetime, since: datetime | None = None, visible: Q | None = None
) -> list[LentHours]:
    """The figures for [since, until) (since None: from the first loan), by lending team and
    server, largest lent first. `visible`: a filter on the loans (the viewer's scope)."""
    # A loan cancelled once it ran (a leader's or an admin's cancel) keeps the part it held, as a
    # release does (its end is the cancel): dropping it would take its hours off the counters.
    held = Q(cancelled_at=None) | Q(cancelled_at__gt=F("start"))
    loans = Reservation.objects.filter(held, lent_from__isnull=False, start__lt=until)
    if since is not None:
        loans = loans.filter(end__gt=since)
    if visible is not None:
        loans = loans.filter(visible)
    windows = {
        pk: (start, end, team)
        for pk, start, end, team in loans.values_list("pk", "start", "end", "lent_from__team__slug")
    }
    if not windows:
        return []
    cards: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for loan, memory, server, total, reserved in Allocation.objects.filter(
        reservation_id__in=list(windows)
    ).values_list(
        "reservation_id", "memory_mb", "gpu__server__name", "gpu__memory_total_mb", "gpu__memory_reserved_mb"
    ):
        bookable = GPU.bookable_mb(total, reserved)
        cards[loan].append((server, 1.0 if memory is None or not bookable else min(1.0, memory / bookable)))
    ran: dict[int, float] = defaultdict(float)
    # A run still going counts to its last beat, not to `until`: its end, written later by its
    # worker (a record replayed after an outage, a host clock behind this one), may be earlier
    # than a scrape's now, and the counter must not go down; it never ends before that beat. (No
    # beat yet: to `until`.)
    runs = [
        (loan, started, max(finished, beat) if finished and beat else finished or beat)
        for loan, started, finished, beat in Job.objects.filter(
            reservation_id__in=list(windows), started_at__isnull=False
        ).values_list("reservation_id", "started_at", "finished_at", "heartbeat_at")
    ]
    left = LoanRun.objects.filter(loan_id__in=list(windows)).values_list("loan_id", "started_at", "ended_at")
    for loan, started, finished in [*runs, *left]:  # the runs still on their loans, and those that left
        start, end, _ = windows[loan]
        ran[loan] += _overlap(max(started, start), min(finished, end) if finished else end, since, until)
    lent: dict[tuple[str, str], float] = defaultdict(float)
    used: dict[tuple[str, str], float] = defaultdict(float)
    for loan, (start, end, team) in windows.items():
        window = _overlap(start, end, since, until)
        for server, weight in cards[loan]:
            lent[(team, server)] += window * weight / HOUR
            used[(team, server)] += min(ran[loan], window) * weight / HOUR
    rows = [
        LentHours(team, server, round(hours, 3), round(used[(team, server)], 3))
        for (team, server), hours in lent.items()
    ]
    return sorted(rows, key=lambda r: (-r.lent, r.team, r.server))


def reports_context(context: Any) -> dict[str, Any]:
    """The Reports page's lending table (portal.hooks.REPORTS_LENDING), for its period and whom
    the viewer may see, as the page's usage rows: admins every team; leaders the teams they lead;
    everyone the loans of their own bookings."""
    report = context.get("report")
    if not report:
        return {"lending": None}
    scope = UsageScope.of(context["request"].user)
    visible = None
    if not scope.everything:
        visible = Q(lent_from__team_id__in=scope.team_ids)
        if scope.user_id is not None:
            visible |= Q(lent_from__owner_id=scope.user_id)
    since = day_start(report["since"])
    until = min(day_start(report["until"] + timedelta(days=1)), timezone.now())
    rows = lending_hours(since=since, until=until, visible=visible)
    lent, used = sum(r.lent for r in rows), sum(r.used for r in rows)
    return {"lending": {"rows": rows, "lent": lent, "used": used}}
