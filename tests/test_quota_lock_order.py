"""A team's quota under concurrent changes, on PostgreSQL. Every booking locks its member's row and
then its team's, limits or none, and reads the limits from the locked row (portal.teams.team_locked);
a change of the limits locks the team's row; a change that writes members' rows too (Django
admin's team form) locks them first (portal.teams.team_locked_with_members); the team API writes
the team's bookings before its row.

Faults each test held (each fails on the code before): a booking that read its team's limits before
its turn went on with limits no longer in force, so bookings took the team past a limit set
meanwhile (a teammate's, a member added meanwhile); Django admin's team form locked the team and
then saved a member's row, the reverse of a booking, and the two deadlocked; the team API set a
quota and the auto-release at once, locking the team before its bookings, and deadlocked with a
booking's extension."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from gpus import booking, quotas
from gpus.models import Allocation, Reservation
from gpus.quotas import quota_team_set
from portal.errors import QuotaExceeded
from portal.models import Membership, Team
from portal.teams import team_member_add
from tests.factories import UserFactory
from tests.test_team_quota_nesting import _admin_team_post
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="row locks: SQLite's writers take the whole database"
    ),
]


def _waiting_on_locks() -> int:
    """How many other connections wait on a row or table lock now."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # else read once per transaction
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


class Actors:
    """Each call in a thread of its own, with its own connection: which ended in which order, what
    each returned or raised."""

    def __init__(self) -> None:
        self.threads: dict[str, threading.Thread] = {}
        self.ended: list[str] = []
        self.outcome: dict[str, object] = {}

    def start(self, name: str, call: Callable[[], object]) -> None:
        def run() -> None:
            try:
                self.outcome[name] = call()
            except Exception as exc:  # reported by the test, never lost in the thread
                self.outcome[name] = exc
            finally:
                self.ended.append(name)
                connections.close_all()

        self.threads[name] = thread = threading.Thread(target=run, name=name)
        thread.start()

    def done(self, name: str) -> bool:
        return name in self.ended

    def join(self) -> None:
        for thread in self.threads.values():
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in self.threads.values()), "an actor never ended"


def _paused_in(
    thread_name: str, real: Callable, monkeypatch, where: str, *, before: bool = False
) -> tuple[threading.Event, threading.Event]:
    """Make `where` (a module attribute) stop in thread `thread_name` at its first call, after it
    (or before it), till released: (reached, release)."""
    reached, release = threading.Event(), threading.Event()
    module, name = where.rsplit(".", 1)
    target = {"gpus.booking": booking, "gpus.quotas": quotas}[module]

    def pause() -> None:
        if threading.current_thread().name == thread_name and not reached.is_set():
            reached.set()
            assert release.wait(30), "never released"

    def paused(*args, **kwargs):  # type: ignore[no-untyped-def]
        if before:
            pause()
        found = real(*args, **kwargs)
        if not before:
            pause()
        return found

    monkeypatch.setattr(target, name, paused)
    return reached, release


def _cards(team: Team) -> int:
    return Allocation.objects.filter(reservation__team=team).count()


def test_a_teams_first_limits_set_while_a_booking_is_in_flight_hold_for_a_teammates_booking(
    alice, bob, team, box, admin_user, monkeypatch
):
    reached, release = _paused_in(
        "alice", quotas.membership_locked, monkeypatch, "gpus.booking.membership_locked"
    )
    actors = Actors()
    try:
        # alice's booking has locked her row and read the team: no limits yet.
        actors.start("alice", lambda: booking.reservation_create(user=alice, gpus=[box[0].uuid, box[1].uuid]))
        assert reached.wait(30)
        # The admin sets the team's first limit, 2 cards at once: it waits for alice's booking.
        actors.start("admin", lambda: quota_team_set(actor=admin_user, team=team, max_cards=2))
        wait_for(lambda: actors.done("admin") or _waiting_on_locks() >= 1, timeout=20, what="the admin")
        # bob books a third card meanwhile.
        actors.start("bob", lambda: booking.reservation_create(user=bob, gpus=[box[2].uuid]))
        waiting = 0 if actors.done("admin") else 1
        wait_for(
            lambda: actors.done("bob") or _waiting_on_locks() > waiting, timeout=20, what="bob's booking"
        )
    finally:
        release.set()
        actors.join()
    assert not isinstance(actors.outcome["alice"], Exception), actors.outcome
    assert not isinstance(actors.outcome["admin"], Exception), actors.outcome
    assert isinstance(actors.outcome["bob"], QuotaExceeded | Reservation), actors.outcome
    team.refresh_from_db()
    assert team.max_cards == 2
    # As if one at a time: bob's booking either came before the limit (which then came last, over
    # what the team already held, as a lowered limit may) or was judged with alice's two cards.
    assert _cards(team) <= 2 or actors.ended[-1] == "admin", (actors.ended, _cards(team))


def test_the_admins_team_form_and_a_booking_in_flight_both_go_through(
    alice, bob, team, box, admin_user, monkeypatch
):
    Team.objects.filter(pk=team.pk).update(max_cards=4)  # a team with limits: bookings lock its row
    team.refresh_from_db()
    # alice's booking stops after its member's row is locked, before the team's.
    reached, release = _paused_in(
        "alice", quotas.team_locked, monkeypatch, "gpus.quotas.team_locked", before=True
    )
    admin = Client()
    admin.force_login(admin_user)
    members = list(Membership.objects.filter(team=team).order_by("pk"))
    data = _admin_team_post(team, members, max_cards="4")
    data[f"memberships-{members.index(alice.memberships.get())}-max_cards"] = "2"  # alice's row changes
    url = reverse("admin:portal_team_change", args=[team.pk])
    actors = Actors()
    try:
        actors.start("alice", lambda: booking.reservation_create(user=alice, gpus=[box[0].uuid]))
        assert reached.wait(30)
        actors.start("admin", lambda: admin.post(url, data).status_code)
        wait_for(
            lambda: _waiting_on_locks() >= 1, timeout=20, what="the admin's form to wait for alice's row"
        )
    finally:
        release.set()
        actors.join()
    assert isinstance(actors.outcome["alice"], Reservation), actors.outcome
    assert actors.outcome["admin"] == 302, actors.outcome
    assert Membership.objects.get(user=alice, team=team).max_cards == 2


def test_a_booking_that_waited_for_a_change_of_the_limits_is_judged_by_the_new_ones(
    alice, bob, team, box, admin_user, monkeypatch
):
    """bob's booking comes while the admin sets the team's first limit, 1 card: it waits for the
    team's row and is then judged by that limit (its member query had read no limits)."""
    paused, release = _paused_in("admin", quotas.team_locked, monkeypatch, "gpus.quotas.team_locked")
    actors = Actors()
    try:
        actors.start("admin", lambda: quota_team_set(actor=admin_user, team=team, max_cards=1))
        assert paused.wait(30)  # the team's row held
        actors.start("bob", lambda: booking.reservation_create(user=bob, gpus=[box[1].uuid, box[2].uuid]))
        wait_for(lambda: _waiting_on_locks() >= 1, timeout=20, what="bob's booking to wait for the team")
    finally:
        release.set()
        actors.join()
    assert isinstance(actors.outcome["bob"], QuotaExceeded), actors.outcome
    assert f"The team quota of {team}" in str(actors.outcome["bob"])
    assert _cards(team) == 0


def test_a_member_added_while_a_teams_first_limits_are_set_cannot_take_it_past_them(
    alice, bob, team, box, admin_user, monkeypatch
):
    """carol joins while the admin sets a 1-card limit; she and bob book a card each meanwhile:
    both wait for the team's row and are judged by the limit, so one of them gets the card."""
    carol = UserFactory(username="carol")
    paused, release = _paused_in("admin", quotas.team_locked, monkeypatch, "gpus.quotas.team_locked")
    actors = Actors()
    try:
        actors.start("admin", lambda: quota_team_set(actor=admin_user, team=team, max_cards=1))
        assert paused.wait(30)
        team_member_add(actor=admin_user, team=team, username="carol", role="member")  # commits now
        actors.start("carol", lambda: booking.reservation_create(user=carol, gpus=[box[1].uuid]))
        wait_for(lambda: _waiting_on_locks() >= 1, timeout=20, what="carol's booking to wait")
        actors.start("bob", lambda: booking.reservation_create(user=bob, gpus=[box[2].uuid]))
        wait_for(lambda: _waiting_on_locks() >= 2, timeout=20, what="bob's booking to wait")
    finally:
        release.set()
        actors.join()
    assert not isinstance(actors.outcome["admin"], Exception), actors.outcome
    kinds = sorted(type(actors.outcome[who]).__name__ for who in ("bob", "carol"))
    assert kinds == ["QuotaExceeded", "Reservation"], actors.outcome
    assert _cards(team) == 1


def test_the_team_api_setting_a_quota_and_auto_release_at_once_and_an_extension_both_go_through(
    alice, team, box, admin_user, monkeypatch
):
    mine = booking.reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    Reservation.objects.filter(pk=mine.pk).update(idle_warned_at=mine.start)  # auto-release rewrites it
    # alice's extension has locked her booking's row.
    reached, release = _paused_in(
        "alice", booking.reservation_locked, monkeypatch, "gpus.booking.reservation_locked"
    )
    api = APIClient()
    api.force_authenticate(admin_user)
    actors = Actors()
    try:
        actors.start(
            "alice",
            lambda: booking.reservation_extend(
                user=alice, reservation=mine.pk, end=mine.end + timedelta(hours=1)
            ),
        )
        assert reached.wait(30)
        body = {"max_cards": 4, "auto_release_idle": True}
        actors.start(
            "admin", lambda: api.patch(f"/api/v1/teams/{team.slug}/", body, format="json").status_code
        )
        wait_for(lambda: actors.done("admin") or _waiting_on_locks() >= 1, timeout=20, what="the admin")
    finally:
        release.set()
        actors.join()
    assert isinstance(actors.outcome["alice"], Reservation), actors.outcome
    assert actors.outcome["admin"] == 200, actors.outcome
    team.refresh_from_db()
    assert team.max_cards == 4 and team.auto_release_idle
