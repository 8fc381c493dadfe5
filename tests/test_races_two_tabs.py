"""Things done twice or at once (a hostile review): two tabs, a double click, a member removed
while a leader acts on them. Each test forces the racy interleaving: with threads on PostgreSQL
(each its own connection; the check slowed to widen the window), or, where the race is between a
view's read and its service's transaction, by running the other action at that moment."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from django.db import connection
from rest_framework.test import APIClient

from gpus import booking as gpus_booking
from gpus import team_api
from gpus.booking import reservation_create, reservation_release
from gpus.models import Reservation
from jobs.models import InteractiveSession, Job
from jobs.sessions import services as sessions
from jobs.sessions.services import session_start
from jobs.submit import ScriptUpload, job_submit
from portal import team_views
from portal.errors import Invalid
from portal.models import AuditEntry, Membership
from portal.teams import team_member_remove

SCRIPT = ScriptUpload("train.py", b"print('hi')\n")
on_postgres = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="threads racing need PostgreSQL's row locks (SQLite serialises)"
)


def both(*actions: Callable[[], object]) -> list[object]:
    """Run the actions in threads of their own (their own connections) at once; what each returned
    or raised, in order."""
    results: list[object] = [None] * len(actions)
    barrier = threading.Barrier(len(actions))

    def run(i: int, action: Callable[[], object]) -> None:
        try:
            connection.ensure_connection()
            barrier.wait(timeout=30)
            results[i] = action()
        except Exception as exc:
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(actions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def slowed(monkeypatch, module: object, name: str, seconds: float = 0.5) -> None:
    """`module.name` reads as before, then waits: the window between a check and its write."""
    real = getattr(module, name)

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        found = real(*args, **kwargs)
        time.sleep(seconds)
        return found

    monkeypatch.setattr(module, name, slow)


# --- two JupyterLabs on one booking (a double click on "Open JupyterLab") ------------------------


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_double_click_on_open_jupyterlab_opens_one_lab(alice, box, monkeypatch):
    monkeypatch.setattr(sessions, "_send", lambda pk, queue: None)  # no broker
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    slowed(monkeypatch, sessions, "active_lab")

    def open_lab() -> object:
        return session_start(user=alice, reservation=booking.pk, kind="jupyterlab")

    both(open_lab, open_lab)
    labs = InteractiveSession.objects.filter(reservation=booking, kind="jupyterlab", status__in=("starting",))
    assert labs.count() == 1  # one a booking (docs/sessions.md); the second click is refused


# --- a job submitted to a booking as it is released ------------------------------------------------


def _release_slowly(monkeypatch, booking: Reservation) -> Callable[[], object]:
    """The owner's release in another tab: it holds the booking's row a while before it commits."""
    slowed(monkeypatch, gpus_booking, "_end_now")
    return lambda: reservation_release(user=booking.owner, reservation=booking.pk)


def _soon(action: Callable[[], object]) -> Callable[[], object]:
    """`action` a moment later: once the release holds the booking, before it commits."""

    def later() -> object:
        time.sleep(0.2)
        return action()

    return later


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_job_submitted_as_its_booking_is_released_is_refused(alice, box, sent, monkeypatch):
    booking = reservation_create(user=alice, gpus=[box[0].uuid])
    release = _release_slowly(monkeypatch, booking)

    released, ran = both(
        release, _soon(lambda: job_submit(user=alice, reservation=booking.pk, script=SCRIPT))
    )
    assert isinstance(released, Reservation), released
    # The release came first: the job is refused, not accepted (201) and queued on a released booking.
    assert isinstance(ran, Invalid), ran
    assert not Job.objects.filter(reservation=booking).exists()


@on_postgres
@pytest.mark.django_db(transaction=True)
def test_a_terminal_session_started_as_its_booking_is_released_is_refused(alice, box, monkeypatch):
    booking = reservation_create(user=alice, gpus=[box[0].uuid])
    release = _release_slowly(monkeypatch, booking)

    def start() -> object:
        return session_start(user=alice, reservation=booking.pk, kind="exec", host="box1", command=["python"])

    released, started = both(release, _soon(start))
    assert isinstance(released, Reservation), released
    assert isinstance(started, Invalid), started
    assert not InteractiveSession.objects.filter(reservation=booking).exists()


# --- a member removed while an admin or a leader acts on them (two tabs) -------------------------


def _removed_meanwhile(monkeypatch, admin_user, module: object, name: str) -> None:
    """The view reads the membership, then another admin's tab removes it, before the service runs."""
    real = getattr(module, name)

    def read_then_removed(*args, **kwargs):  # type: ignore[no-untyped-def]
        found = real(*args, **kwargs)
        fresh = Membership.objects.filter(pk=found.pk).first()
        if fresh is not None:
            team_member_remove(actor=admin_user, membership=fresh)
        return found

    monkeypatch.setattr(module, name, read_then_removed)


@pytest.mark.django_db
def test_a_role_change_of_someone_removed_meanwhile_is_no_500(client, admin_user, team, bob, monkeypatch):
    _removed_meanwhile(monkeypatch, admin_user, team_views, "_membership")
    client.force_login(admin_user)
    response = client.post(f"/teams/{team.slug}/members/bob/role/", {"role": "leader"})
    assert response.status_code in (302, 404, 409)
    assert not Membership.objects.filter(team=team, user=bob).exists()


@pytest.mark.django_db
def test_removing_someone_twice_audits_one_removal(client, admin_user, team, bob, monkeypatch):
    _removed_meanwhile(monkeypatch, admin_user, team_views, "_membership")
    client.force_login(admin_user)
    client.post(f"/teams/{team.slug}/members/bob/remove/")
    removals = AuditEntry.objects.filter(
        action=AuditEntry.Action.TEAM_MEMBERS, message__contains="removed bob"
    )
    assert removals.count() == 1, list(removals.values_list("message", flat=True))


@pytest.mark.django_db
def test_a_member_quota_set_on_someone_removed_meanwhile_is_no_500(
    leader, admin_user, team, bob, monkeypatch
):
    real_set = team_api.quota_member_set

    def removed_first(**kwargs):  # type: ignore[no-untyped-def]
        # The API read the membership; another tab removes bob before the service locks it.
        team_member_remove(actor=admin_user, membership=Membership.objects.get(pk=kwargs["membership"].pk))
        return real_set(**kwargs)

    monkeypatch.setattr(team_api, "quota_member_set", removed_first)
    client = APIClient()
    client.force_authenticate(leader)
    response = client.patch(f"/api/v1/teams/{team.slug}/members/bob/", {"max_cards": 1}, format="json")
    assert response.status_code in (404, 409), response.content
