"""The locks a booking takes on rows that other rows refer to, on PostgreSQL.

Django's foreign keys there are checked when a transaction commits (DEFERRABLE INITIALLY DEFERRED),
with a FOR KEY SHARE lock on each row referred to. `SELECT … FOR UPDATE` conflicts with that lock,
`FOR NO KEY UPDATE` does not (and still conflicts with itself, so two bookings of a team with
limits still take turns). The fault suite's concurrent bookings and submits found a deadlock: a
booking held its team's row FOR UPDATE and waited for a card that a telemetry round held; the round
waited for a job's row that a commit held; and that commit waited, in its key checks, for the team's
row. One booking was answered 500."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections, transaction

from gpus.quotas import membership_locked
from portal.models import Team
from tests.factories import MembershipFactory, UserFactory

on_postgres = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="lock modes are PostgreSQL's (SQLite locks the whole file)"
)


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_bookings_lock_on_its_team_never_holds_up_a_commit_that_refers_to_the_team(alice, team):
    Team.objects.filter(pk=team.pk).update(max_cards=4)  # a team with limits: its row is locked
    team.refresh_from_db()
    held, done = threading.Event(), threading.Event()

    def booking_checking_its_quota() -> None:
        try:
            with transaction.atomic():
                membership_locked(alice, team)
                held.set()
                done.wait(20)
        finally:
            connections.close_all()

    booking = threading.Thread(target=booking_checking_its_quota)
    booking.start()
    try:
        assert held.wait(20), "the booking never locked its team"
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '5s'")
            # A new member of the team: its key is checked against the team's row at the commit.
            MembershipFactory(team=team, user=UserFactory(username="newcomer"))
    finally:
        done.set()
        booking.join(20)
    assert team.memberships.filter(user__username="newcomer").exists()
