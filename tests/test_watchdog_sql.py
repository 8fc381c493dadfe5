"""The watchdog's four reads as SQL (jobs/host/watchdog_sql.py) say what the querysets they replaced
say: those querysets are kept here as the reference, and both run on a host with every case at
its edge (a booking ending at the very moment, one ended just within the grace, a job ended just
within the look-back, a released booking, another host's rows, a session with kernels, a stop asked
by a user since deleted). Run on SQLite by `make test`, on PostgreSQL with DATABASE_URL set."""

from __future__ import annotations

from datetime import UTC, timedelta

import pytest
from django.db.models import Q
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import Allocation, Reservation, Server, Violation
from gpus.services import server_report_ingest
from jobs.host.watchdog import ZOMBIE_LOOKBACK, ended_booking_grace, round_facts
from jobs.models import InteractiveSession, Job
from jobs.watchdog.records import Asked
from jobs.watchdog.rules import BookingFacts, JobFacts
from tests.factories import UserFactory, make_snapshot

pytestmark = pytest.mark.django_db


# --- the querysets the SQL replaced (jobs/host/watchdog.py before issue 40's last pass) -----------


def orm_bookings(server: int, now):  # type: ignore[no-untyped-def]
    window = ended_booking_grace()
    cards: dict[int, dict[str, int | None]] = {}
    owners: dict[int, int] = {}
    ended: dict[int, bool] = {}
    rows = Allocation.objects.filter(live=True, start__lte=now, end__gt=now - window, gpu__server_id=server)
    for reservation, owner, gpu, memory, end in rows.values_list(
        "reservation_id", "reservation__owner_id", "gpu_id", "memory_mb", "end"
    ):
        cards.setdefault(reservation, {})[gpu] = memory
        owners[reservation] = owner
        ended[reservation] = end <= now
    return [BookingFacts(pk, owners[pk], held, ended=ended[pk]) for pk, held in cards.items()]


def orm_jobs(server: int, now):  # type: ignore[no-untyped-def]
    rows = Job.objects.filter(
        Q(status__in=(Job.Status.STARTING, Job.Status.RUNNING)) | Q(finished_at__gte=now - ZOMBIE_LOOKBACK),
        server_id=server,
        pid__isnull=False,
    ).values_list("pk", "pid", "owner_id", "reservation_id", "status", "finished_at")
    return [
        JobFacts(pk, pid, owner, reservation, status in (Job.Status.STARTING, Job.Status.RUNNING), finished)
        for pk, pid, owner, reservation, status, finished in rows
    ]


def orm_sessions(server: int) -> list[tuple]:
    return list(
        InteractiveSession.objects.filter(
            server_id=server, status=InteractiveSession.Status.RUNNING, pid__isnull=False
        ).values_list("pk", "pid", "owner_id", "reservation_id", "pid_started", "kernels", "kind")
    )


def orm_asked(server: int) -> dict[int, Asked]:
    rows = (
        Violation.objects.filter(server_id=server, ended_at=None)
        .exclude(stop_requested_at=None, resolved_at=None)
        .values_list("pk", "stop_requested_by__username", "stop_reason", "resolved_at")
    )
    return {pk: Asked(by or "someone", reason, resolved is not None) for pk, by, reason, resolved in rows}


# --- a host with every case -------------------------------------------------------------------------


@pytest.fixture
def now():  # type: ignore[no-untyped-def]
    return timezone.now().replace(microsecond=123456)


@pytest.fixture
def host(alice, bob, now) -> int:  # type: ignore[no-untyped-def]
    cards = [g.uuid for g in make_snapshot("wd1", gpus=4).gpus]
    server_report_ingest(snapshot=make_snapshot("wd1", gpus=4))
    server_report_ingest(snapshot=make_snapshot("wd2", gpus=2))
    server = Server.objects.get(name="wd1").pk
    other = Server.objects.get(name="wd2")
    grace = ended_booking_grace()

    slots = iter(range(1, 100))

    def booked(user, gpus, start, end, **fields) -> Reservation:  # type: ignore[no-untyped-def]
        """Booked in a slot of its own (no conflict), then moved where the case needs it."""
        free = now + timedelta(days=next(slots))
        booking = reservation_create(
            user=user, gpus=gpus, start=free, end=free + timedelta(hours=1), **fields
        )
        Reservation.objects.filter(pk=booking.pk).update(start=start, end=end)
        Allocation.objects.filter(reservation=booking).update(start=start, end=end)
        return booking

    hour = timedelta(hours=1)
    whole = booked(alice, cards[0:2], now - hour, now + hour)
    booked(bob, [cards[2]], now - hour, now + hour, memory_mb=4096)  # a shared card
    booked(bob, [cards[3]], now - hour, now)  # ends at this very moment: ended, still within grace
    booked(alice, [cards[3]], now - hour, now - grace + timedelta(microseconds=1))  # just within
    booked(alice, [cards[3]], now - hour, now - grace)  # just past the grace
    booked(bob, [cards[2]], now, now + hour, memory_mb=2048)  # starts at this very moment
    booked(bob, [cards[2]], now + timedelta(microseconds=1), now + hour, memory_mb=2048)  # not yet
    released = booked(alice, [cards[2]], now - hour, now + hour, memory_mb=1024)
    Allocation.objects.filter(reservation=released).update(live=False)
    elsewhere = [g.uuid for g in make_snapshot("wd2", gpus=2).gpus]
    booked(alice, elsewhere, now - hour, now + hour)

    def job(pid, status, finished=None, on=server, **fields) -> Job:  # type: ignore[no-untyped-def]
        """On a booking of its own (one active job a booking), a future one: no booking fact."""
        free = now + timedelta(days=next(slots))
        own = reservation_create(user=alice, gpus=cards[0:1], start=free, end=free + hour)
        return Job.objects.create(
            owner=alice, reservation=own, team=alice.memberships.get().team, server_id=on,
            gpu_uuids=cards[0:2], name="train.py", not_before=now - hour, pid=pid, status=status,
            finished_at=finished, **fields,
        )  # fmt: skip

    job(100, Job.Status.RUNNING, created_at=now - hour)
    job(100, Job.Status.STARTING, created_at=now - hour / 2)  # the same pid: the order decides
    job(101, Job.Status.SUCCEEDED, now - ZOMBIE_LOOKBACK)  # just within the look-back
    job(102, Job.Status.FAILED, now - ZOMBIE_LOOKBACK - timedelta(microseconds=1))
    job(103, Job.Status.FAILED, now - timedelta(minutes=5))
    job(None, Job.Status.RUNNING)  # no pid yet
    job(104, Job.Status.QUEUED)
    job(105, Job.Status.RUNNING, on=other.pk)

    def session(pid, status, **fields) -> None:  # type: ignore[no-untyped-def]
        InteractiveSession.objects.create(
            owner=alice, reservation=whole, server_id=fields.pop("on", server), gpu_uuids=cards[0:1],
            status=status, pid=pid, **{"kind": "exec", **fields},
        )  # fmt: skip

    session(200, "running", pid_started=1000.25)
    session(201, "running", pid_started=None, kind="jupyterlab", kernels=[[202, 1001.5], [203, 1002.0]])
    session(None, "running")
    session(204, "ended", pid_started=1000.0)
    session(205, "running", pid_started=1000.0, on=other.pk)

    gone = UserFactory(username="gone")

    def violation(pid, **fields) -> None:  # type: ignore[no-untyped-def]
        Violation.objects.create(
            kind=Violation.Kind.INTRUDER, gpu_id=cards[0], server_id=fields.pop("on", server), pid=pid,
            first_seen=now, last_seen=now, **fields,
        )  # fmt: skip

    violation(300)  # nothing asked
    violation(301, stop_requested_at=now, stop_requested_by=bob, stop_reason="it is my card")
    violation(302, resolved_at=now)
    violation(303, stop_requested_at=now, stop_requested_by=gone, stop_reason="")
    violation(304, stop_requested_at=now, stop_requested_by=bob, ended_at=now)  # ended
    violation(305, resolved_at=now, on=other.pk)
    gone.delete()  # SET_NULL: asked by someone
    return server


def test_it_reads_what_the_querysets_read(host, now):  # type: ignore[no-untyped-def]
    facts = round_facts(host, now, asked=True)

    assert facts.bookings == orm_bookings(host, now)
    assert facts.jobs == orm_jobs(host, now)
    assert [tuple(row) for row in facts.sessions] == orm_sessions(host)
    assert facts.asked == orm_asked(host)


def test_every_case_is_in_the_host_it_reads(host, now):  # type: ignore[no-untyped-def]
    """The comparison above is worth something only where each case is there to compare."""
    facts = round_facts(host, now, asked=True)

    assert sorted((len(b.cards), b.ended) for b in facts.bookings) == [
        (1, False),
        (1, False),
        (1, True),
        (1, True),
        (2, False),
    ]
    assert sorted((j.session_id, j.running) for j in facts.jobs) == [
        (100, True),
        (100, True),
        (101, False),
        (103, False),
    ]
    assert {j.finished_at.tzinfo for j in facts.jobs if j.finished_at} == {UTC}
    assert sorted(s.pid for s in facts.sessions) == [200, 201]
    assert [s.kernels for s in facts.sessions if s.pid == 201] == [[[202, 1001.5], [203, 1002.0]]]
    assert sorted((a.by, a.reason, a.resolved) for a in facts.asked.values()) == [
        ("bob", "it is my card", False),
        ("someone", "", False),
        ("someone", "", True),
    ]


def test_it_reads_no_asks_unless_asked(host, now, django_assert_num_queries):  # type: ignore[no-untyped-def]
    with django_assert_num_queries(3):
        facts = round_facts(host, now)

    assert facts.asked == {}
