"""No-shows (issue 36): a booking unused from its start for NO_SHOW_MINUTES is told to its owner
once, and released where its team releases idle bookings. The idle round, called with explicit
times after telemetry at the same times, as in tests/test_idle.py."""

from __future__ import annotations

from datetime import datetime

import pytest
from django.utils import timezone

from gpus.booking import held_on, reservation_create
from gpus.models import GPU
from jobs.models import Job
from portal.models import AuditEntry, Notification
from tests.test_idle import M, book, check, fresh, report, turn_on_auto_release

Kind = Notification.Kind


@pytest.fixture
def t0() -> datetime:
    return timezone.now().replace(second=0, microsecond=0)


@pytest.fixture
def cards(db, t0) -> list[GPU]:
    """box1's four cards, reporting busy at t0 (before any booking starts)."""
    report(t0, busy={0, 1, 2, 3})
    return list(GPU.objects.filter(server__name="box1").order_by("index"))


def rounds(first: int, last: int, t0, **telemetry):
    return [check(t0 + m * M, **telemetry) for m in range(first, last + 1)]


def test_it_tells_the_owner_once_of_a_booking_unused_from_its_start(alice, cards, t0):
    booking = book(alice, cards[:2], t0)
    assert not any(r.no_shows for r in rounds(1, 29, t0))
    assert check(t0 + 30 * M).no_shows == [booking.pk]
    note = Notification.objects.get()
    assert (note.user, note.kind, note.key) == (alice, Kind.IDLE_BOOKING, f"no-show:{booking.pk}")
    assert "not used since its start" in note.subject and "30 minutes" in note.body
    assert "stays yours" in note.body and note.url.endswith("#actions")
    r = fresh(booking)
    assert r.no_show_at == t0 + 30 * M and r.released_at is None and r.used_at is None

    rounds(31, 40, t0)
    # Once: no second notice, and the idle warning of the same stretch is not sent on top of it.
    assert Notification.objects.count() == 1


@pytest.mark.parametrize("seen", ["busy", "hot", "unknown"])
def test_a_booking_used_or_unseen_once_is_never_a_no_show(alice, cards, t0, seen):
    booking = book(alice, cards[:1], t0)
    rounds(1, 4, t0)
    check(t0 + 5 * M, **{seen: {0}})  # the owner's process; or a card the portal could not see
    assert fresh(booking).used_at == t0 + 5 * M
    assert not any(r.no_shows for r in rounds(6, 60, t0))
    assert fresh(booking).no_show_at is None
    assert not Notification.objects.filter(key__startswith="no-show").exists()


def test_it_releases_a_no_show_where_the_team_releases_idle_bookings(alice, bob, cards, t0, team, admin_user):
    turn_on_auto_release(team, admin_user)
    booking = book(alice, cards[:1], t0)
    rounds(1, 29, t0)
    done = check(t0 + 30 * M)
    assert done.no_shows == done.released == [booking.pk]
    r = fresh(booking)
    assert r.released_at == r.end == t0 + 30 * M
    assert not held_on([cards[0].uuid], t0 + 30 * M, t0 + 31 * M)
    book(bob, cards[:1], t0 + 30 * M)  # free for others
    entry = AuditEntry.objects.get(action=AuditEntry.Action.RESERVATION_RELEASE)
    assert entry.actor is None and entry.message.endswith("no-show: unused for 30 minutes from its start")
    told = Notification.objects.get(user=alice)
    assert told.kind == Kind.BOOKING_RELEASED and "not used from its start" in told.subject
    assert check(t0 + 31 * M).released == []  # released once


def test_a_borrowers_work_on_a_lent_booking_is_not_its_owners_use(alice, bob, cards, t0):
    booking = book(alice, cards[:1], t0)
    rounds(1, 16, t0)
    reservation_create(
        user=bob, gpus=[cards[0].uuid], start=t0 + 16 * M, end=t0 + 76 * M, now=t0 + 16 * M, lent_from=booking
    )
    rounds(17, 29, t0, busy={0})  # the borrower's process on the card
    assert fresh(booking).used_at is None
    assert check(t0 + 30 * M, busy={0}).no_shows == [booking.pk]


def test_loans_and_upcoming_bookings_are_never_no_shows(alice, bob, cards, t0):
    later = reservation_create(user=alice, gpus=[cards[1].uuid], start=t0 + 60 * M, end=t0 + 120 * M, now=t0)
    booking = book(alice, cards[:1], t0)
    loan = reservation_create(
        user=bob, gpus=[cards[0].uuid], start=t0 + 16 * M, end=t0 + 76 * M, now=t0 + 16 * M, lent_from=booking
    )
    seen = {pk for r in rounds(16, 45, t0) for pk in r.no_shows}
    assert seen == {booking.pk}
    assert fresh(loan).no_show_at is None and fresh(later).no_show_at is None


def test_the_setting_moves_the_verdict(alice, cards, t0, settings):
    settings.NO_SHOW_MINUTES = 10
    booking = book(alice, cards[:1], t0)
    assert not any(r.no_shows for r in rounds(1, 9, t0))
    assert check(t0 + 10 * M).no_shows == [booking.pk]
    assert timezone.localtime(booking.start).strftime("%H:%M") in Notification.objects.get().body


def test_the_owners_use_of_the_card_not_lent_of_a_partly_lent_booking_is_use(alice, bob, cards, t0):
    """Her booking of two cards, one lent to the queue: her process on the other is her use, though
    the borrower runs beside it, so the booking is no no-show (nor released as one)."""
    booking = book(alice, cards[:2], t0)
    rounds(1, 16, t0)
    reservation_create(
        user=bob, gpus=[cards[0].uuid], start=t0 + 16 * M, end=t0 + 76 * M, now=t0 + 16 * M, lent_from=booking
    )
    rounds(17, 24, t0, busy={0})  # the borrower alone
    assert fresh(booking).used_at is None
    check(t0 + 25 * M, busy={0, 1})  # and hers, on the card not lent
    assert fresh(booking).used_at == t0 + 25 * M
    assert not any(r.no_shows for r in rounds(26, 40, t0, busy={0}))


def test_a_job_sent_to_the_booking_at_its_start_is_its_owners_use(alice, cards, t0, team, admin_user, sent):
    """Submitted before the booking starts, sent at its start, and showing no process for a while
    (an image pulled, data loaded): she came, so it is no no-show, nor released under her job."""
    from jobs.services import jobs_due_dispatch
    from jobs.submit import ScriptUpload, job_submit

    turn_on_auto_release(team, admin_user)
    start = t0 + 5 * M
    booking = book(alice, cards[:1], start)
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload("mine.py", b"1\n"))
    assert jobs_due_dispatch(start) == 1  # sent once this commits
    assert Job.objects.get(pk=job.pk).dispatched_at == start
    assert not any(r.no_shows or r.released for r in rounds(5, 40, t0))
    r = fresh(booking)
    assert r.used_at == start and r.no_show_at is None and r.released_at is None
