"""The GPU watchdog's four reads of a round, as SQL (jobs/host/watchdog.py): the bookings active
on the host's cards, its running and recently ended jobs, its running sessions, and what people
asked of its open violations.

Raw SQL, because the ORM misses `make bench`'s figure (bench_watchdog, the round's CPU, goal
5 ms; 5.7 ms in the baseline, issue 40): a round runs these four every WATCHDOG_INTERVAL_SECONDS
on every host, and Django spent about 0.5 ms of CPU building and compiling each of them (filters,
joins, the models' orderings) for a statement the driver sends in 0.02-0.1 ms. Cheaper ORM routes
were measured first: `values_list` of few columns was already used; reusing a built queryset still
compiles it each time (0.3-0.4 ms a statement), and the times in the filters change every round.

The statements say what the querysets they replace said (tests/test_watchdog_sql.py holds them
equal on SQLite and PostgreSQL, the querysets kept there as the reference), with the models'
orderings where the order decides something (a process put down to one of two jobs of one
session). Table and column names come from the models; values go as parameters, adapted by the
backend as the ORM adapts them.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Model

from gpus.models import GPU, Allocation, Reservation, Violation
from jobs.models import InteractiveSession, Job
from jobs.watchdog.records import Asked
from jobs.watchdog.rules import BookingFacts, JobFacts


class SessionRow(NamedTuple):
    """A running session of the host, as recorded (jobs.host.watchdog_sessions.sessions_in judges it)."""

    pk: int
    pid: int
    owner_id: int
    reservation_id: int
    pid_started: float | None
    kernels: list[Any]
    kind: str


class Facts(NamedTuple):
    bookings: list[BookingFacts]
    jobs: list[JobFacts]  # every one the query finds: the caller drops ended ones whose pid moved on
    sessions: list[SessionRow]
    asked: dict[int, Asked]


def facts_read(
    server: int, now: datetime, *, booking_grace: timedelta, zombie_lookback: timedelta, asked: bool
) -> Facts:
    """The facts of one round on `server` at `now`: the bookings live on its cards whose start has
    come and whose end is after `now - booking_grace` (`ended` when it is at or before `now`), its
    jobs with a pid that are starting or running or finished since `now - zombie_lookback`, its
    running sessions with a pid, and (when `asked`) what was asked of its open violations."""
    sql = _statements(connection.vendor)
    at = connection.ops.adapt_datetimefield_value
    running = (Job.Status.STARTING, Job.Status.RUNNING)
    with connection.cursor() as cursor:
        cursor.execute(sql.bookings, [at(now), at(now), at(now - booking_grace), server])
        allocations = cursor.fetchall()
        cursor.execute(sql.jobs, [*running, at(now - zombie_lookback), server])
        jobs = cursor.fetchall()
        cursor.execute(sql.sessions, [server, InteractiveSession.Status.RUNNING])
        sessions = cursor.fetchall()
        asks = []
        if asked:
            cursor.execute(sql.asked, [server])
            asks = cursor.fetchall()
    from_db = InteractiveSession._meta.get_field("kernels").from_db_value
    return Facts(
        bookings=_bookings(allocations),
        jobs=[
            JobFacts(pk, pid, owner, reservation, status in running, _aware(finished))
            for pk, pid, owner, reservation, status, finished in jobs
        ],
        sessions=[
            SessionRow(pk, pid, owner, reservation, started, from_db(found, None, connection), kind)
            for pk, pid, owner, reservation, started, found, kind in sessions
        ],
        asked={pk: Asked(by or "someone", reason, bool(resolved)) for pk, by, reason, resolved in asks},
    )


def _bookings(allocations: list[tuple]) -> list[BookingFacts]:
    """One BookingFacts a booking, from its allocation rows (reservation, owner, gpu, memory, over)."""
    cards: dict[int, dict[str, int | None]] = {}
    owners: dict[int, int] = {}
    ended: dict[int, bool] = {}
    for reservation, owner, gpu, memory, over in allocations:
        cards.setdefault(reservation, {})[gpu] = memory
        owners[reservation] = owner
        ended[reservation] = bool(over)
    return [BookingFacts(pk, owners[pk], held, ended=ended[pk]) for pk, held in cards.items()]


class _Statements(NamedTuple):
    bookings: str
    jobs: str
    sessions: str
    asked: str


@functools.cache
def _statements(vendor: str) -> _Statements:
    """The four statements, made once per database vendor (its quoting) instead of every round:
    table and column names from the models."""
    q = connection.ops.quote_name

    def table(model: type[Model]) -> str:
        return q(model._meta.db_table)

    def column(model: type[Model], field: str) -> str:
        return q(model._meta.get_field(field).column)

    a, g, r, j, s, v, u = Allocation, GPU, Reservation, Job, InteractiveSession, Violation, get_user_model()
    return _Statements(
        bookings=(
            f"SELECT a.{column(a, 'reservation')}, r.{column(r, 'owner')}, a.{column(a, 'gpu')},"
            f" a.{column(a, 'memory_mb')}, a.{column(a, 'end')} <= %s"
            f" FROM {table(a)} a"
            f" INNER JOIN {table(g)} g ON a.{column(a, 'gpu')} = g.{column(g, 'uuid')}"
            f" INNER JOIN {table(r)} r ON a.{column(a, 'reservation')} = r.{column(r, 'id')}"
            f" WHERE a.{column(a, 'live')} AND a.{column(a, 'start')} <= %s AND a.{column(a, 'end')} > %s"
            f" AND g.{column(g, 'server')} = %s"
            f" ORDER BY a.{column(a, 'gpu')}"  # Allocation's ordering
        ),
        jobs=(
            f"SELECT {column(j, 'id')}, {column(j, 'pid')}, {column(j, 'owner')}, {column(j, 'reservation')},"
            f" {column(j, 'status')}, {column(j, 'finished_at')}"
            f" FROM {table(j)}"
            f" WHERE ({column(j, 'status')} IN (%s, %s) OR {column(j, 'finished_at')} >= %s)"
            f" AND {column(j, 'pid')} IS NOT NULL AND {column(j, 'server')} = %s"
            f" ORDER BY {column(j, 'created_at')} DESC, {column(j, 'id')} DESC"  # Job's ordering
        ),
        sessions=(
            f"SELECT {column(s, 'id')}, {column(s, 'pid')}, {column(s, 'owner')}, {column(s, 'reservation')},"
            f" {column(s, 'pid_started')}, {column(s, 'kernels')}, {column(s, 'kind')}"
            f" FROM {table(s)}"
            f" WHERE {column(s, 'server')} = %s AND {column(s, 'status')} = %s"
            f" AND {column(s, 'pid')} IS NOT NULL"
            f" ORDER BY {column(s, 'created_at')} DESC, {column(s, 'id')} DESC"  # InteractiveSession's
        ),
        asked=(
            f"SELECT v.{column(v, 'id')}, u.{column(u, 'username')}, v.{column(v, 'stop_reason')},"
            f" v.{column(v, 'resolved_at')} IS NOT NULL"
            f" FROM {table(v)} v"
            f" LEFT OUTER JOIN {table(u)} u ON v.{column(v, 'stop_requested_by')} = u.{column(u, 'id')}"
            f" WHERE v.{column(v, 'server')} = %s AND v.{column(v, 'ended_at')} IS NULL"
            f" AND NOT (v.{column(v, 'stop_requested_at')} IS NULL AND v.{column(v, 'resolved_at')} IS NULL)"
        ),
    )


def _aware(value: datetime | str | None) -> datetime | None:
    """A time as the ORM would give it: SQLite's driver gives a naive UTC datetime (or its text),
    PostgreSQL's an aware one (portal/postgresql/base.py)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
