"""The locks a booking takes on rows that other rows refer to, on PostgreSQL.

Django's foreign keys there are checked when a transaction commits (DEFERRABLE INITIALLY DEFERRED),
with a FOR KEY SHARE lock on each row referred to. `SELECT … FOR UPDATE` conflicts with that lock,
`FOR NO KEY UPDATE` does not (and still conflicts with itself, so two bookings of a team with
limits still take turns). The fault suite's concurrent bookings and submits found a deadlock: a
booking held its team's row FOR UPDATE and waited for a card that a telemetry round held; the round
waited for a job's row that a commit held; and that commit waited, in its key checks, for the team's
row. One booking was answered 500.

The same holds for every row a booking, a cancel or a log line locks and others refer to: the
cards (a telemetry round's processes, a watchdog's violations refer to them), the booking (a loan,
a job), the job (its log chunks, its metrics), and the account a first directory sign-in links.
Each test holds the lock as the service takes it and commits a row that refers to the locked one,
with a 5 s lock timeout; each fails with the old FOR UPDATE."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from gpus import booking
from gpus.models import GPUProcess, Reservation
from gpus.quotas import membership_locked
from jobs.logs.store import log_append
from jobs.models import LogChunk
from jobs.services import job_cancel
from portal.identity import external_account_link
from portal.models import Team
from tests.factories import MembershipFactory, UserFactory, queue_job

on_postgres = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="lock modes are PostgreSQL's (SQLite locks the whole file)"
)


def _committed_while_held(lock: Callable[[], object], refer: Callable[[], object]) -> None:
    """`lock()` in a transaction of another connection, held; meanwhile `refer()` here, committed
    within a 5 s lock timeout (a LockNotAvailable error otherwise)."""
    held, done, failed = threading.Event(), threading.Event(), []

    def holder() -> None:
        try:
            with transaction.atomic():
                lock()
                held.set()
                done.wait(20)
        except Exception as exc:  # reported by the test, never lost in the thread
            failed.append(exc)
        finally:
            held.set()
            connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(20) and not failed, failed
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '5s'")
            refer()  # its key is checked against the locked row at the commit
    finally:
        done.set()
        thread.join(20)
    assert not failed, failed


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_bookings_lock_on_its_team_never_holds_up_a_commit_that_refers_to_the_team(alice, team):
    Team.objects.filter(pk=team.pk).update(max_cards=4)  # a team with limits: its row is locked
    team.refresh_from_db()
    # A new member of the team.
    _committed_while_held(
        lambda: membership_locked(alice, team),
        lambda: MembershipFactory(team=team, user=UserFactory(username="newcomer")),
    )
    assert team.memberships.filter(user__username="newcomer").exists()


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_first_directory_sign_in_never_holds_up_a_commit_that_refers_to_its_user(team):
    """The sign-in locks the account it links by name, then the memberships it syncs: an admin's
    team form adding that person meanwhile committed only after it, and in the other order the two
    deadlocked."""
    person = UserFactory(username="dirname")
    person.set_unusable_password()
    person.save()
    _committed_while_held(
        lambda: external_account_link(
            source="oidc", issuer="https://idp.example", subject="sub-1", username="dirname"
        ),
        lambda: MembershipFactory(team=team, user=person),
    )
    assert team.memberships.filter(user=person).exists()


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_bookings_lock_on_its_cards_never_holds_up_a_commit_that_refers_to_them(box):
    # A telemetry round's process on the card, as the round writes it.
    card = box[0]
    _committed_while_held(
        lambda: booking._locked_gpus([card.uuid], None), lambda: GPUProcess.objects.create(gpu=card, pid=4242)
    )
    assert card.processes.filter(pid=4242).exists()


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_lock_on_a_booking_never_holds_up_a_commit_that_refers_to_it(alice, team, box):
    lent = booking.reservation_create(user=alice, gpus=[box[0].uuid])
    now = timezone.now()

    def loan() -> Reservation:  # a row referring to the booking (a loan, as jobs.lending makes it)
        end = now + timedelta(hours=1)
        return Reservation.objects.create(
            owner=alice, team=team, start=now, end=end, booked_end=end, lent_from=lent
        )

    _committed_while_held(lambda: booking.reservation_locked(lent.pk), loan)
    _committed_while_held(lambda: booking.reservation_lock(lent.pk), loan)
    assert Reservation.objects.filter(lent_from=lent).count() == 2


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_lock_on_a_job_never_holds_up_a_commit_that_refers_to_it(alice, team):
    job = queue_job(alice)
    seqs = iter([1000, 500])  # never the one the holder appends (the last stored + 1)

    def chunk() -> LogChunk:  # a row referring to the job (its worker's log, as it stores it)
        return LogChunk.objects.create(job=job, seq=next(seqs), start=0, size=1, data=b"x")

    _committed_while_held(lambda: log_append(job.pk, "[portal] a line"), chunk)
    _committed_while_held(lambda: job_cancel(user=alice, job=job.pk), chunk)
    assert job.log_chunks.filter(seq__in=[1000, 500]).count() == 2
