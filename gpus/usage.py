"""Usage accounting: GPU-hours booked, used and idle, per hour, card and booker (docs/reports.md).

Three tables, one record:

- `UsageHour`: one card's hour for one booker; no user: the card's time nobody had booked. The record.
- `UsageDay` (day × server × team × user) and `UsageTeamHour` (hour × team): sums of UsageHour,
  rebuilt with it in the same transaction, so the reports read thousands of rows, not millions.

Where the figures come from:

- booked GPU-hours and memory GB-hours: the live allocations' windows, with the quotas' fraction
  of the card (`gpus.quotas.Use`). Exact whatever the telemetry did; a release or a cancellation
  ends them where it ends the quotas' count.
- used, idle and unbooked GPU-hours and the peak memory: the telemetry, as the collector ingests
  it (`usage_observe`). Each card's report adds the time since its previous one, weighted by its
  utilization, and split between the bookings holding the card by their fraction of it; the
  fraction nobody holds goes to the row without a user. A gap longer than
  SERVER_OFFLINE_AFTER_SECONDS is not counted: nobody saw the card meanwhile.
- jobs by outcome: the jobs app answers `gpus.hooks.job_outcomes` with the jobs that finished in
  the hours being written (gpus asks, jobs answers: jobs builds on gpus). A question, not an
  event: a job's final status is a conditional UPDATE in several places, and its row is the record.

The collector's process holds the hours still moving (the current one, and the previous one for
LATE after it ends) in memory: no query per round. Every FLUSH_EVERY, and at the turn of the hour,
it writes them after the round's transaction has committed: absolute values, the held hours'
rows deleted and inserted again. Writing twice writes the same rows, and a restarted collector
reloads the hours' telemetry figures and goes on. Hours missed while no collector ran get their
bookings and jobs (at most GAP_FILL back), never invented telemetry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from functools import partial
from typing import NamedTuple

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.db.models import Max, QuerySet, Sum
from django.utils import timezone

from gpus.hooks import SESSION_ENDED, job_outcomes
from gpus.idle import card_idle
from gpus.inventory import CardState, GPUInfo
from gpus.models import GPU, Allocation, UsageDay, UsageFigures, UsageHour, UsageTeamHour
from gpus.quotas import Use

log = logging.getLogger(__name__)

HOUR = timedelta(hours=1)
FLUSH_EVERY = timedelta(minutes=1)  # also how stale the cached bookings may be
# An hour is written again this long after it ends: a job whose end was committed a moment after
# the turn of the hour still lands in the hour it ended in.
LATE = timedelta(minutes=5)
# After a restart, the hours missed get their bookings and jobs this far back at most.
GAP_FILL = timedelta(days=7)

Key = tuple[datetime, str, int | None]  # (hour, card UUID, user id or None)


def hour_of(at: datetime) -> datetime:
    """The whole UTC hour `at` falls in (UTC: every zone's hours are whole UTC hours, nearly)."""
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def portal_today(now: datetime | None = None) -> date:
    """Today in TIME_ZONE, whoever asks: the usage tables' days are the portal's, never the viewer's
    (a request's current zone is its viewer's, portal/time_zones.py)."""
    return timezone.localdate(now or timezone.now(), timezone.get_default_timezone())


def day_start(day: date) -> datetime:
    """The first moment of a day in TIME_ZONE: what UsageDay.start holds and the usage filters compare."""
    return datetime.combine(day, time.min, timezone.get_default_timezone())


def hour_of_week(hour: datetime) -> int:
    """Where an hour falls in its week in TIME_ZONE: Monday 00:00 is 0, Sunday 23:00 is 167."""
    local = hour.astimezone(timezone.get_default_timezone())
    return local.weekday() * 24 + local.hour


def hours_between(first: datetime, last: datetime) -> list[datetime]:
    """Every hour from `first` to `last`, both included."""
    return [first + n * HOUR for n in range(int((last - first) / HOUR) + 1)]


class _Share(NamedTuple):
    """A live allocation, as cached for the rounds and summed for the booked figures."""

    gpu: str
    server_id: int
    user_id: int
    team_id: int
    use: Use  # its window and fraction of the card, by the quotas' rule


class _Seen(NamedTuple):
    """What gpus.idle.card_idle reads of a card, from this round's report: the idle rule stays in
    one place, and no model instance is built per card per round."""

    updated_at: datetime
    state: str
    processes_known: bool
    utilization_pct: int | None


@dataclass
class _Cell:
    """The telemetry half of one UsageHour row."""

    server_id: int
    team_id: int | None
    used: float = 0.0
    idle: float = 0.0
    unbooked: float = 0.0
    peak_mb: int | None = None

    def saw(self, memory_mb: int | None) -> None:
        if memory_mb is not None and (self.peak_mb is None or memory_mb > self.peak_mb):
            self.peak_mb = memory_mb


class _Rows(dict[Key, UsageHour]):
    """The UsageHour rows being built for a flush, by key."""

    def at(self, key: Key, server_id: int, team_id: int | None) -> UsageHour:
        row = self.get(key)
        if row is None:
            row = self[key] = UsageHour(
                start=key[0],
                hour_of_week=hour_of_week(key[0]),
                gpu_id=key[1],
                user_id=key[2],
                server_id=server_id,
                team_id=team_id,
            )
        return row


def _count_job(row: UsageHour, status: str) -> None:
    if status == SESSION_ENDED:
        row.sessions += 1
    elif status == "succeeded":
        row.jobs_succeeded += 1
    elif status == "failed":
        row.jobs_failed += 1
    else:
        row.jobs_other += 1


class UsageRollup:
    """The collector's accumulator: `observe` each round (memory only), `flush` when it says so."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the collector's thread observes; a shutdown may flush
        self._cells: dict[Key, _Cell] = {}
        self._seen_at: dict[str, datetime] = {}  # each card's previous report
        self._shares: dict[str, list[_Share]] = {}  # live allocations by card, refreshed each flush
        self._hours: set[datetime] = set()
        self._flushed_at: datetime | None = None  # None: the table is not loaded yet
        self._pruned_on: date | None = None

    def observe(self, cards: Sequence[tuple[int, GPUInfo]], now: datetime) -> bool:
        """Add one round of (server id, card) reports; True when a flush is due."""
        with self._lock:
            if self._flushed_at is None:
                return True  # nothing is counted before the flush has loaded the table
            current = hour_of(now)
            self._hours.add(current)
            for server_id, card in cards:
                self._observe_card(server_id, card, now, current)
            return now - self._flushed_at >= FLUSH_EVERY or hour_of(self._flushed_at) != current

    def _observe_card(self, server_id: int, card: GPUInfo, now: datetime, current: datetime) -> None:
        previous = self._seen_at.get(card.uuid)
        self._seen_at[card.uuid] = now
        if (
            previous is None
            or not 0 < (now - previous).total_seconds() <= settings.SERVER_OFFLINE_AFTER_SECONDS
        ):
            return
        shares = [s for s in self._shares.get(card.uuid, ()) if s.use.start < now and s.use.end > previous]
        # NVML's utilization is the card's over the last sample period: it describes the time just
        # ended. Unknown (None) counts as unused: nothing says the card worked.
        util = (card.utilization_pct or 0) / 100
        seen = _Seen(now, card.state, card.processes is not None, card.utilization_pct)
        idle = bool(shares) and card_idle(seen, has_processes=bool(card.processes), now=now)  # type: ignore[arg-type]
        for hour, since, until in _split(previous, now, current):
            free = (until - since).total_seconds() / 3600
            for share in shares:  # each booking's own part of the interval: exact at its edges
                held = share.use.card_fraction * _overlap_hours(share.use.start, share.use.end, since, until)
                if held > 0:
                    free -= held
                    cell = self._cell((hour, card.uuid, share.user_id), server_id, share.team_id)
                    cell.used += held * util
                    cell.idle += held if idle else 0.0
                    cell.saw(card.memory_used_mb)
            if free > 1e-9 and card.state == CardState.OK:  # a lost card is no free capacity
                cell = self._cell((hour, card.uuid, None), server_id, None)
                cell.unbooked += free
                cell.used += free * util
                cell.saw(card.memory_used_mb)

    def _cell(self, key: Key, server_id: int, team_id: int | None) -> _Cell:
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = _Cell(server_id, team_id)
            self._hours.add(key[0])
        return cell

    def flush(self, now: datetime) -> None:
        """Write the held hours (absolute values) and refresh the cached bookings; load first after a
        start. One transaction; a failure leaves memory as it was, and the next round retries."""
        with self._lock, transaction.atomic():
            if self._flushed_at is None:
                self._load(now)
            self._hours.add(hour_of(now))
            hours = sorted(self._hours)
            shares = _shares_between(hours[0], now + 2 * FLUSH_EVERY)
            rows = self._rows(hours, shares, now)
            _hours_write(hours, rows)
            self._shares = {}
            reach = now - timedelta(seconds=settings.SERVER_OFFLINE_AFTER_SECONDS)  # a round's interval
            for share in shares:
                if share.use.end > reach:
                    self._shares.setdefault(share.gpu, []).append(share)
            self._flushed_at = now
            self._forget(now)
            if self._pruned_on != portal_today(now):
                usage_prune(now=now)
                self._pruned_on = portal_today(now)

    def _load(self, now: datetime) -> None:
        """Hold the hours from the last one written (GAP_FILL back at most) to now, with the telemetry
        figures already written for them: a restart goes on where the last flush left off."""
        current = hour_of(now)
        last = UsageHour.objects.filter(start__lte=current).aggregate(last=Max("start"))["last"]
        first = current if last is None else max(hour_of(last), hour_of(now - GAP_FILL))
        self._hours = set(hours_between(first, current))
        rows = UsageHour.objects.filter(start__gte=first, start__lte=current).values_list(
            "start",
            "gpu_id",
            "user_id",
            "server_id",
            "team_id",
            "gpu_hours_used",
            "idle_hours",
            "gpu_hours_unbooked",
            "peak_memory_mb",
        )
        self._cells = {
            (hour_of(start), gpu, user): _Cell(server, team, used, idle, unbooked, peak)
            for start, gpu, user, server, team, used, idle, unbooked, peak in rows
        }

    def _rows(self, hours: list[datetime], shares: list[_Share], now: datetime) -> list[UsageHour]:
        """The held hours' rows: booked from the windows, telemetry from memory, jobs from jobs."""
        held = set(hours)
        rows = _Rows()
        for share in shares:
            use = share.use
            for hour in hours_between(max(hour_of(use.start), hours[0]), hour_of(min(use.end, now))):
                overlap = _overlap_hours(use.start, use.end, hour, min(hour + HOUR, now))
                if hour in held and overlap > 0:
                    row = rows.at((hour, share.gpu, share.user_id), share.server_id, share.team_id)
                    row.gpu_hours_booked += use.card_fraction * overlap
                    row.memory_gb_hours_booked += use.mb / 1024 * overlap
        for key, cell in self._cells.items():
            if key[0] in held:
                row = rows.at(key, cell.server_id, cell.team_id)
                # Bookings are cached for up to a minute: one released early may have been credited
                # with a few rounds after its end. A booker never uses more than they booked.
                cap = row.gpu_hours_booked if key[2] is not None else float("inf")
                row.gpu_hours_used, row.idle_hours = min(cell.used, cap), min(cell.idle, cap)
                row.gpu_hours_unbooked, row.peak_memory_mb = cell.unbooked, cell.peak_mb
        servers = {s.gpu: s.server_id for s in shares} | {
            gpu: c.server_id for (_, gpu, _), c in self._cells.items()
        }
        for outcome in job_outcomes(hours[0], now):
            hour = hour_of(outcome.finished_at)
            if hour not in held:
                continue
            server_id = servers.get(outcome.gpu) or _server_of(outcome.gpu, servers)
            if server_id is not None:
                _count_job(
                    rows.at((hour, outcome.gpu, outcome.user_id), server_id, outcome.team_id), outcome.status
                )
        return _still_there(
            [row for row in rows.values() if any(getattr(row, f) for f in UsageFigures.SUMMED)]
        )

    def _forget(self, now: datetime) -> None:
        """Drop the hours that are final: ended more than LATE ago, and written just now."""
        done = {h for h in self._hours if h + HOUR + LATE <= now}
        self._hours -= done
        self._cells = {k: c for k, c in self._cells.items() if k[0] not in done}


def _still_there(rows: list[UsageHour]) -> list[UsageHour]:
    """Leave out the rows of a person or card deleted while their hour was held: one missing row
    would otherwise fail every write until the hour is done."""
    users = {row.user_id for row in rows if row.user_id is not None}
    users = set(get_user_model().objects.filter(pk__in=users).values_list("pk", flat=True))
    gpus = set(GPU.objects.filter(uuid__in={row.gpu_id for row in rows}).values_list("uuid", flat=True))
    return [row for row in rows if row.gpu_id in gpus and (row.user_id is None or row.user_id in users)]


def _split(previous: datetime, now: datetime, current: datetime) -> list[tuple[datetime, datetime, datetime]]:
    """[previous, now) as (hour, since, until) pieces. The gap is at most SERVER_OFFLINE_AFTER_SECONDS,
    so it crosses the turn of an hour at most once."""
    if previous >= current:
        return [(current, previous, now)]
    return [(current - HOUR, previous, current), (current, current, now)]


def _overlap_hours(start: datetime, end: datetime, since: datetime, until: datetime) -> float:
    return max(0.0, (min(end, until) - max(start, since)).total_seconds() / 3600)


def _shares_between(since: datetime, until: datetime) -> list[_Share]:
    """Live allocations overlapping [since, until): one query."""
    rows = Allocation.objects.live_between(since, until).values_list(
        "gpu_id",
        "gpu__server_id",
        "reservation__owner_id",
        "reservation__team_id",
        "start",
        "end",
        "memory_mb",
        "gpu__memory_total_mb",
    )
    return [
        _Share(gpu, server, owner, team, Use.of(start, end, memory_mb, total))
        for gpu, server, owner, team, start, end, memory_mb, total in rows
    ]


def _server_of(gpu: str, known: dict[str, int]) -> int | None:
    """The server of a card no held row names (a job that outlived its booking): None if it is gone."""
    server_id = GPU.objects.filter(uuid=gpu).values_list("server_id", flat=True).first()
    if server_id is not None:
        known[gpu] = server_id
    return server_id


# --- the summed tables ---------------------------------------------------------------------------


def figure_sums(prefix: str = "") -> dict[str, Sum | Max]:
    """Aggregates of every figure, named `prefix + field` (an annotation may not reuse a field's name)."""
    sums: dict[str, Sum | Max] = {f"{prefix}{name}": Sum(name) for name in UsageFigures.SUMMED}
    sums[f"{prefix}peak_memory_mb"] = Max("peak_memory_mb")
    return sums


def _summed(rows: QuerySet, keys: list[str]) -> Iterable[dict]:
    """Rows grouped by `keys`, every figure summed, as {field: value} ready for a model."""
    for group in rows.values(*keys).annotate(**figure_sums("sum_")).order_by():
        yield {
            **{key: group[key] for key in keys},
            **{name: group[f"sum_{name}"] or 0 for name in UsageFigures.SUMMED},
            "peak_memory_mb": group["sum_peak_memory_mb"],
        }


def _hours_write(hours: list[datetime], rows: list[UsageHour]) -> None:
    """The held hours' rows, and the sums that include them."""
    UsageHour.objects.filter(start__in=hours).delete()
    UsageHour.objects.bulk_create(rows, batch_size=500)
    usage_sums_rebuild(hours=hours)


def usage_sums_rebuild(*, hours: Sequence[datetime]) -> None:
    """Sum UsageTeamHour for these hours and UsageDay for their days again, from UsageHour: the
    flush after each write, and anyone who mended hour rows by hand (or seeded them: the bench)."""
    UsageTeamHour.objects.filter(start__in=hours).delete()
    UsageTeamHour.objects.bulk_create(
        (
            UsageTeamHour(**group)
            for group in _summed(
                UsageHour.objects.filter(start__in=hours), ["start", "hour_of_week", "team_id"]
            )
        ),
        batch_size=500,
    )
    for day in sorted({portal_today(h) for h in hours}):
        since, until = day_start(day), day_start(day + timedelta(days=1))
        UsageDay.objects.filter(start=since).delete()
        of_day = UsageHour.objects.filter(start__gte=since, start__lt=until)
        UsageDay.objects.bulk_create(
            UsageDay(start=since, day=day, **group)
            for group in _summed(of_day, ["server_id", "team_id", "user_id"])
        )


def usage_prune(*, now: datetime | None = None) -> int:
    """Delete the rollups older than USAGE_RETENTION_DAYS, cut at a day's start so that the day and
    hour tables end together; returns the rows deleted. The rollup runs it once a day."""
    oldest = portal_today(now) - timedelta(days=settings.USAGE_RETENTION_DAYS)
    cutoff = day_start(oldest)
    return sum(
        model.objects.filter(start__lt=cutoff).delete()[0] for model in (UsageHour, UsageDay, UsageTeamHour)
    )


# --- the collector's process ---------------------------------------------------------------------


def start_rollup() -> UsageRollup:
    """In the portal's worker, for its collector (gpus.telemetry.start_collector), which keeps it:
    one rollup for the portal. Its first flush loads the table and writes the bookings and jobs of
    the hours missed meanwhile."""
    rollup = UsageRollup()
    log.info("Usage rollup every %ss", int(FLUSH_EVERY.total_seconds()))
    try:
        rollup.flush(timezone.now())
    except Exception:  # the database may not be up yet: the next round's flush loads it
        log.exception("Usage rollup: could not load; retrying with the next round")
    return rollup


def usage_observe(*, rollup: UsageRollup | None, cards: Sequence[tuple[int, GPUInfo]], now: datetime) -> None:
    """The ingest's hook (servers_report_ingest): memory only, no query. A due flush runs once the
    round's transaction has committed, in one of its own; its failure is logged, never the round's.
    No rollup (every process but the collector's): nothing to count."""
    if rollup is not None and rollup.observe(cards, now):
        transaction.on_commit(partial(rollup.flush, now), robust=True)


def usage_flush(rollup: UsageRollup) -> None:
    """At the collector's end (the worker's shutdown): write what the last minute counted. On a
    fresh connection: the one this thread had may have died with a database restart."""
    connection.close()
    try:
        rollup.flush(timezone.now())
    except Exception:
        log.exception("Usage rollup: the last flush failed; up to a minute of figures is lost")
