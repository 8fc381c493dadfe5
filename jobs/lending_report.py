"""What lending saved (issue 36): GPU-hours lent to the queue and GPU-hours its borrowers used, by
the lending team and server. Read by the Reports page (portal.hooks.REPORTS_LENDING) and /metrics
(jobs/prometheus/metrics.py).

*Lent*: the loans' windows (a loan is the queue's booking on a lent booking's cards, jobs/lending.py),
from their start to their end or release. *Used*: the time the borrowers' jobs ran within them,
a run that left for the queue included (kept as a LoanRun: its job's row forgets it), so the
figures, and /metrics' counters, never go down.
Both count on the side of the booking that was lent: its team is the one whose idle cards were put
to work. A memory share counts its fraction of the card, as the usage reports do.

The Reports page sums its period's loans from three reads. /metrics' counters run from the first
loan ever made: they read the totals of the loans settled a day after their end (LendingTotal,
folded in hourly by beat) and sum only the loans since, so a scrape does not grow with the years.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, Min, Q, QuerySet
from django.utils import timezone

from gpus.models import GPU, Allocation, Reservation, Server
from gpus.reports import UsageScope
from gpus.usage import day_start
from jobs.models import Job, LendingSettle, LendingTotal, LoanRun
from portal.models import Team

HOUR = 3600.0
# A loan is settled into LendingTotal this long after its end, once every run on it has ended: a
# run's end may be written late (a GPU host's spool replays what it could not write while the
# database was away; a run whose host went silent is marked lost after JOB_LOST_AFTER_SECONDS).
SETTLE_AFTER = timedelta(days=1)

Key = tuple[int, int]  # (the lending team's id, the server's id)


Sums = dict[Key, list[int]]  # → [lent ms, used ms]


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


def _held(until: datetime) -> QuerySet[Reservation]:
    """The loans begun before `until`. A loan cancelled once it ran (a leader's or an admin's
    cancel) keeps the part it held, as a release does (its end is the cancel): dropping it would
    take its hours off the counters."""
    held = Q(cancelled_at=None) | Q(cancelled_at__gt=F("start"))
    return Reservation.objects.filter(held, lent_from__isnull=False, start__lt=until)


def _lent_ms(loans: QuerySet[Reservation], since: datetime | None, until: datetime) -> Sums:
    """Milliseconds lent and used of `loans` within [since, until), by lending team and server."""
    windows = {
        pk: (start, end, team)
        for pk, start, end, team in loans.order_by().values_list("pk", "start", "end", "lent_from__team_id")
    }
    sums: Sums = defaultdict(lambda: [0, 0])
    if not windows:
        return sums
    # A subquery, not a list of every id (a first settle folds a year of loans). A loan it finds
    # that the read above did not (made in between) is left out below.
    ids = loans.values("pk")
    cards: dict[int, list[tuple[int, float]]] = defaultdict(list)
    allocations = Allocation.objects.filter(reservation_id__in=ids).order_by()
    for loan, memory, server, total, reserved in allocations.values_list(
        "reservation_id", "memory_mb", "gpu__server_id", "gpu__memory_total_mb", "gpu__memory_reserved_mb"
    ):
        bookable = GPU.bookable_mb(total, reserved)
        cards[loan].append((server, 1.0 if memory is None or not bookable else min(1.0, memory / bookable)))
    ran: dict[int, float] = defaultdict(float)
    # A run still going counts to its last beat, not to `until`: its end, written later by its
    # worker (a record replayed after an outage, a host clock behind this one), may be earlier
    # than a scrape's now, and the counter must not go down; it never ends before that beat. (No
    # beat yet: to `until`.)
    runs = {
        (job, started): (loan, max(finished, beat) if finished and beat else finished or beat)
        for job, loan, started, finished, beat in Job.objects.filter(
            reservation_id__in=ids, started_at__isnull=False
        )
        .order_by()
        .values_list("pk", "reservation_id", "started_at", "finished_at", "heartbeat_at")
    }
    # A run that left its loan between the two reads (a late end record sends its job back to the
    # queue and keeps the run as a LoanRun, in one commit) is read twice: counted once, as the job
    # row had it. A LoanRun starts when its job's run did.
    left = LoanRun.objects.filter(loan_id__in=ids).order_by()
    for job, loan, started, ended in left.values_list("job_id", "loan_id", "started_at", "ended_at"):
        runs.setdefault((job, started), (loan, ended))
    for (_, started), (loan, finished) in runs.items():  # the runs on their loans, and those that left
        if loan not in windows:
            continue
        start, end, _ = windows[loan]
        ran[loan] += _overlap(max(started, start), min(finished, end) if finished else end, since, until)
    for loan, (start, end, team) in windows.items():
        window = _overlap(start, end, since, until)
        for server, weight in cards[loan]:
            sums[(team, server)][0] += round(1000 * window * weight)
            sums[(team, server)][1] += round(1000 * min(ran[loan], window) * weight)
    return sums


def _rows(sums: Sums) -> list[LentHours]:
    """Largest lent first, each named by its team's slug and server's name as they are now, read
    once each (unique within a read, so no two series share their labels while an admin renames
    or swaps them; a rename moves a series whole). A team or server gone takes its series along."""
    if not sums:
        return []
    slugs = dict(Team.objects.filter(pk__in={team for team, _ in sums}).values_list("pk", "slug"))
    names = dict(Server.objects.filter(pk__in={server for _, server in sums}).values_list("pk", "name"))
    rows = [
        LentHours(slugs[team], names[server], round(lent / 1000 / HOUR, 3), round(used / 1000 / HOUR, 3))
        for (team, server), (lent, used) in sums.items()
        if team in slugs and server in names
    ]
    return sorted(rows, key=lambda r: (-r.lent, r.team, r.server))


def lending_hours(
    *, until: datetime, since: datetime | None = None, visible: Q | None = None
) -> list[LentHours]:
    """The figures for [since, until) (since None: from the first loan), by lending team and
    server, largest lent first. `visible`: a filter on the loans (the viewer's scope)."""
    loans = _held(until)
    if since is not None:
        loans = loans.filter(end__gt=since)
    if visible is not None:
        loans = loans.filter(visible)
    return _rows(_lent_ms(loans, since, until))


def lending_totals(now: datetime) -> list[LentHours]:
    """The figures from the first loan ever made to `now`, as lending_hours(until=now) gives them,
    read from the settled totals and the loans that ended since (/metrics' counters)."""
    # The totals first, in one statement (all of them as of one settle), then the loans after
    # their `through`: a settle that commits between the two reads still has its loans read here.
    # No totals: nothing folded yet, or only loans that held no card; either way all are read.
    settled = list(LendingTotal.objects.values_list("team_id", "server_id", "lent_ms", "used_ms", "through"))
    loans = _held(now)
    if settled:
        loans = loans.filter(end__gt=settled[0][-1])
    sums = _lent_ms(loans, None, now)
    for team, server, lent, used, _ in settled:
        sums[(team, server)][0] += lent
        sums[(team, server)][1] += used
    return _rows(sums)


def lending_settle(now: datetime) -> int:
    """Fold the loans that ended at least SETTLE_AFTER ago, and whose runs have all ended, into
    LendingTotal (beat, hourly). Returns how many. Again: folds none twice."""
    cutoff = now - SETTLE_AFTER
    with transaction.atomic():
        head, first_settle = LendingSettle.objects.select_for_update(no_key=True).get_or_create(
            pk=1, defaults={"through": cutoff}
        )
        since = None if first_settle else head.through
        due = _held(now).filter(end__lte=cutoff)
        if since is not None:
            due = due.filter(end__gt=since)
        # A loan with a run not yet ended waits, and so do the loans that ended after it: the
        # totals hold every loan up to `through`.
        waiting = Job.objects.filter(reservation__in=due, started_at__isnull=False, finished_at=None)
        first = waiting.aggregate(end=Min("reservation__end"))["end"]
        through = min(cutoff, first - timedelta(microseconds=1)) if first else cutoff
        if since is not None and through <= since:
            return 0
        due = due.filter(end__lte=through)
        count = due.count()
        for (team, server), (lent, used) in _lent_ms(due, None, now).items():
            LendingTotal.objects.get_or_create(team_id=team, server_id=server, defaults={"through": through})
            LendingTotal.objects.filter(team_id=team, server_id=server).update(
                lent_ms=F("lent_ms") + lent, used_ms=F("used_ms") + used
            )
        LendingTotal.objects.update(through=through)
        LendingSettle.objects.filter(pk=head.pk).update(through=through)
    return count


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
