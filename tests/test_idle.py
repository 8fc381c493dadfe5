"""Idle bookings: the idle clock, the warning, the team's auto-release and who may turn it on.

The service is called with explicit times (`now=`) after telemetry ingested at the same times,
so no test waits for a clock.
"""

from __future__ import annotations

import html
from dataclasses import replace
from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus import idle, signals, telemetry
from gpus.booking import held_on, reservation_create, reservation_release
from gpus.idle import IdleChecker, idle_check, team_auto_release_set
from gpus.inventory import CardState, ProcessInfo
from gpus.models import GPU, Reservation
from gpus.services import server_report_ingest
from portal.errors import Forbidden
from portal.models import AuditEntry, Notification, Team
from tests.factories import make_snapshot

M = timedelta(minutes=1)
Kind = Notification.Kind


@pytest.fixture
def t0() -> datetime:
    """The bookings' start: this minute, so they are active on the pages too."""
    return timezone.now().replace(second=0, microsecond=0)


@pytest.fixture(autouse=True)
def no_no_shows(settings) -> None:
    """These bookings are about idle stretches; no-shows (tests/test_noshow.py) would end them."""
    settings.NO_SHOW_MINUTES = 7 * 24 * 60


@pytest.fixture
def people(alice, bob, leader, charlie, admin_user):
    return {"alice": alice, "bob": bob, "leader": leader, "charlie": charlie, "admin": admin_user}


@pytest.fixture
def cards(db, t0) -> list[GPU]:
    """box1's four cards, reporting busy at t0."""
    report(t0, busy={0, 1, 2, 3})
    return list(GPU.objects.filter(server__name="box1").order_by("index"))


def report(
    at: datetime,
    *,
    busy: set[int] = frozenset(),
    hot: set[int] = frozenset(),
    unknown: set[int] = frozenset(),
    lost: set[int] = frozenset(),
    no_util: set[int] = frozenset(),
) -> None:
    """box1 reports at `at`: every card idle (0%, no process) unless named otherwise."""
    snapshot = make_snapshot("box1", gpus=4, util=0, processes=0)
    process = ProcessInfo(pid=4242, username="someone", command="python work.py", used_memory_mb=900)
    changes: dict[str, dict[int, dict]] = {
        "busy": {i: {"processes": (process,)} for i in busy},
        "hot": {i: {"utilization_pct": 50} for i in hot},
        "unknown": {i: {"processes": None} for i in unknown},
        "lost": {i: {"state": CardState.LOST} for i in lost},
        "no_util": {i: {"utilization_pct": None} for i in no_util},
    }
    gpus = []
    for gpu in snapshot.gpus:
        fields: dict = {}
        for per_card in changes.values():
            fields.update(per_card.get(gpu.index, {}))
        gpus.append(replace(gpu, **fields))
    server_report_ingest(snapshot=replace(snapshot, gpus=tuple(gpus)), now=at)


def check(at: datetime, **telemetry_args: set[int]) -> idle.IdleRound:
    """Telemetry at `at`, then a round at `at`: what the portal's worker does each minute."""
    report(at, **telemetry_args)
    return idle_check(now=at)


def book(user, gpus: list[GPU], t0: datetime, memory_mb: int | None = None) -> Reservation:
    return reservation_create(
        user=user, gpus=[g.uuid for g in gpus], memory_mb=memory_mb, start=t0, end=t0 + 8 * 60 * M, now=t0
    )


def fresh(reservation: Reservation) -> Reservation:
    return Reservation.objects.select_related("team").get(pk=reservation.pk)


def turn_on_auto_release(team: Team, admin) -> None:
    team_auto_release_set(actor=admin, team=team, on=True)


# --- the clock -------------------------------------------------------------------------


def test_it_starts_the_idle_clock_when_every_card_is_idle_and_stops_it_on_activity(alice, cards, t0):
    booking = book(alice, cards[:2], t0)
    assert check(t0 + M).idle == [booking.pk]
    r = fresh(booking)
    assert (r.idle_since, r.idle_minutes, r.idle_warned_at) == (t0 + M, 0, None)

    check(t0 + 2 * M + timedelta(seconds=30))
    assert fresh(booking).idle_minutes == 1  # whole minutes; the half waits for the next round
    check(t0 + 3 * M)
    assert fresh(booking).idle_minutes == 2

    assert check(t0 + 4 * M, busy={1}).idle == []  # one busy card is enough
    r = fresh(booking)
    assert (r.idle_since, r.idle_minutes) == (None, 2)
    check(t0 + 5 * M)
    assert fresh(booking).idle_since == t0 + 5 * M  # a new stretch


def test_it_counts_utilization_at_the_threshold_as_use(alice, cards, t0, settings):
    booking = book(alice, cards[:1], t0)
    check(t0 + M, hot={0})
    assert fresh(booking).idle_since is None
    settings.IDLE_UTIL_PCT = 51
    check(t0 + 2 * M, hot={0})
    assert fresh(booking).idle_since == t0 + 2 * M


UNKNOWN = {
    "process list unreadable": {"unknown": {0}},
    "card lost": {"lost": {0}},
    "no utilization figure": {"no_util": {0}},
}


@pytest.mark.parametrize("state", list(UNKNOWN))
def test_it_never_counts_an_unknown_card_as_idle_and_ends_the_stretch(alice, cards, t0, state):
    booking = book(alice, cards[:2], t0)
    check(t0 + M)
    check(t0 + 2 * M)
    assert check(t0 + 3 * M, **UNKNOWN[state]).idle == []
    r = fresh(booking)
    assert (r.idle_since, r.idle_minutes) == (None, 1)  # the minute before it turned unknown is not counted
    check(t0 + 4 * M, **UNKNOWN[state])
    assert fresh(booking).idle_since is None


def test_it_never_counts_an_offline_servers_cards_as_idle(alice, cards, t0, settings):
    booking = book(alice, cards[:1], t0)
    check(t0 + M)
    stale = t0 + M + timedelta(seconds=settings.SERVER_OFFLINE_AFTER_SECONDS + 1)
    assert idle_check(now=stale).idle == []  # no report since t0 + 1 min
    assert fresh(booking).idle_since is None


def test_it_starts_again_after_rounds_it_did_not_see(alice, cards, t0):
    """The checker was down for 10 minutes: nobody knows what the cards did meanwhile."""
    booking = book(alice, cards[:1], t0)
    check(t0 + M)
    check(t0 + 2 * M)
    check(t0 + 12 * M)
    r = fresh(booking)
    assert (r.idle_since, r.idle_minutes) == (t0 + 12 * M, 1)


def test_it_adds_up_idle_minutes_over_the_bookings_life(alice, cards, t0):
    booking = book(alice, cards[:1], t0)
    for minute in range(1, 12):  # idle from 1 to 11: 10 minutes
        check(t0 + minute * M)
    check(t0 + 12 * M, busy={0})
    for minute in range(13, 19):  # idle from 13 to 18: 5 more
        check(t0 + minute * M)
    r = fresh(booking)
    assert (r.idle_since, r.idle_minutes) == (t0 + 13 * M, 15)


def test_a_shared_card_is_idle_only_with_no_process_at_all(alice, bob, cards, t0):
    """A memory share cannot tell its own work from its neighbour's: anyone's process is use."""
    mine = book(alice, cards[:1], t0, memory_mb=4096)
    theirs = book(bob, cards[:1], t0, memory_mb=4096)
    assert check(t0 + M, busy={0}).idle == []
    assert check(t0 + 2 * M).idle == [mine.pk, theirs.pk]


def test_it_closes_the_stretch_of_a_booking_that_is_no_longer_active(alice, cards, t0):
    booking = book(alice, cards[:1], t0)
    check(t0 + M)
    check(t0 + 2 * M)
    reservation_release(user=alice, reservation=booking, now=t0 + 2 * M + timedelta(seconds=10))
    check(t0 + 3 * M)
    r = fresh(booking)
    assert (r.idle_since, r.idle_warned_at, r.idle_minutes) == (None, None, 1)


def test_it_reads_every_booking_in_the_same_few_queries(alice, bob, cards, t0):
    book(alice, cards[:1], t0)
    check(t0 + M)
    report(t0 + 2 * M)
    with CaptureQueriesContext(connection) as one:
        idle_check(now=t0 + 2 * M)
    for gpu in cards[1:]:
        book(bob, [gpu], t0)
    check(t0 + 3 * M)
    report(t0 + 4 * M)
    with CaptureQueriesContext(connection) as four:
        idle_check(now=t0 + 4 * M)
    assert len(four) == len(one) <= 7, [q["sql"] for q in four]


# --- the warning -------------------------------------------------------------------------


def idle_until(minute: int, t0: datetime, start: int = 1) -> list[idle.IdleRound]:
    return [check(t0 + m * M) for m in range(start, minute + 1)]


def test_it_warns_the_owner_once_per_stretch_with_a_link_to_release(client, alice, cards, t0):
    booking = book(alice, cards[:2], t0)
    rounds = idle_until(30, t0)  # idle since minute 1: 29 minutes at minute 30
    assert not any(r.warned for r in rounds)
    assert not Notification.objects.exists()

    assert check(t0 + 31 * M).warned == [booking.pk]
    note = Notification.objects.get()
    assert (note.user, note.kind, note.key) == (alice, Kind.IDLE_BOOKING, f"idle:{booking.pk}")
    assert note.url == f"/reservations/{booking.pk}/#actions"
    assert "box1 GPU 0, 1" in note.subject
    assert "idle for 30 minutes" in note.body and "Nothing happens automatically" in note.body
    assert fresh(booking).idle_warned_at == t0 + 31 * M

    idle_until(40, t0, start=32)
    assert Notification.objects.count() == 1  # once per stretch

    check(t0 + 41 * M, busy={0})
    idle_until(72, t0, start=42)  # a new stretch from 42: 30 minutes at 72
    assert Notification.objects.filter(kind=Kind.IDLE_BOOKING).count() == 2

    # The link lands on the booking's page, where one click releases it.
    client.force_login(alice)
    page = client.get(note.url).content.decode()
    release = reverse("reservation_release", args=[booking.pk])
    assert 'id="actions"' in page and f'action="{release}"' in page
    assert client.post(release).status_code == 302
    assert fresh(booking).released_at is not None


def test_it_does_not_release_when_the_team_has_auto_release_off(alice, cards, t0):
    booking = book(alice, cards[:1], t0)
    rounds = idle_until(100, t0)
    assert not any(r.released for r in rounds)
    r = fresh(booking)
    assert r.released_at is None and r.status_at(t0 + 100 * M) == Reservation.Status.ACTIVE
    assert not Notification.objects.filter(kind=Kind.BOOKING_RELEASED).exists()
    assert not AuditEntry.objects.filter(action=AuditEntry.Action.RESERVATION_RELEASE).exists()


# --- auto-release --------------------------------------------------------------------------


def test_it_releases_an_idle_booking_after_the_delay_when_the_team_has_it_on(
    alice, bob, cards, t0, team, admin_user
):
    turn_on_auto_release(team, admin_user)
    booking = book(alice, cards[:1], t0)
    idle_until(31, t0)
    warning = Notification.objects.get(kind=Kind.IDLE_BOOKING)
    assert "releases idle bookings automatically" in warning.body
    assert timezone.localtime(t0 + 61 * M).strftime("%H:%M") in warning.body  # 30 min after it

    rounds = idle_until(60, t0, start=32)
    assert not any(r.released for r in rounds)
    assert check(t0 + 61 * M).released == [booking.pk]

    r = fresh(booking)
    assert r.released_at == r.end == t0 + 61 * M
    assert not held_on([cards[0].uuid], t0 + 61 * M, t0 + 62 * M)  # the card is free
    book(bob, cards[:1], t0 + 61 * M)
    entry = AuditEntry.objects.get(action=AuditEntry.Action.RESERVATION_RELEASE)
    assert entry.actor is None and entry.data["by"] == "portal" and entry.team == team
    assert entry.message.startswith(f"The portal released reservation {booking.pk} early")
    assert entry.message.endswith("idle for 60 minutes")
    told = Notification.objects.get(kind=Kind.BOOKING_RELEASED)
    assert told.user == alice and "idle for 60 minutes" in told.subject
    assert told.url == reverse("reservation_detail", args=[booking.pk])

    assert check(t0 + 62 * M).released == []  # nothing left to release
    assert Notification.objects.filter(kind=Kind.BOOKING_RELEASED).count() == 1


def test_it_does_not_release_a_booking_whose_cards_were_used_after_the_warning(
    alice, cards, t0, team, admin_user
):
    turn_on_auto_release(team, admin_user)
    booking = book(alice, cards[:1], t0)
    idle_until(31, t0)
    check(t0 + 50 * M, busy={0})
    rounds = idle_until(70, t0, start=51)
    assert not any(r.released for r in rounds)
    assert fresh(booking).released_at is None


def test_it_does_not_release_a_booking_its_owner_came_back_to_during_the_round(
    alice, cards, t0, team, admin_user, sent, monkeypatch
):
    """Her job on it committed after the round read the booking, before the release: the release
    finds its stretch gone (the job restarted the clock) and leaves it to her."""
    from jobs.submit import ScriptUpload, job_submit

    turn_on_auto_release(team, admin_user)
    booking = book(alice, cards[:1], t0)
    idle_until(60, t0)  # warned at 31, released at 61
    read = idle.lent_now

    def owner_back(bookings, at):  # type: ignore[no-untyped-def]
        found = read(bookings, at)
        job_submit(user=alice, reservation=booking, script=ScriptUpload("mine.py", b"1\n"), now=at)
        return found

    monkeypatch.setattr(idle, "lent_now", owner_back)
    assert check(t0 + 61 * M).released == []
    assert fresh(booking).released_at is None


def test_it_warns_again_with_the_release_time_when_a_leader_turns_auto_release_on(
    alice, cards, t0, team, leader
):
    booking = book(alice, cards[:1], t0)
    idle_until(31, t0)
    assert fresh(booking).idle_warned_at == t0 + 31 * M
    team_auto_release_set(actor=leader, team=team, on=True)
    assert fresh(booking).idle_warned_at is None
    assert check(t0 + 32 * M).warned == [booking.pk]
    assert "releases idle bookings automatically" in Notification.objects.first().body
    rounds = idle_until(61, t0, start=33)
    assert not any(r.released for r in rounds)  # 30 minutes from the new warning, not the old one
    assert check(t0 + 62 * M).released == [booking.pk]


def test_the_owner_sees_idle_minutes_on_the_booking_pages_and_in_the_api(client, alice, cards, t0):
    booking = book(alice, cards[:1], t0)
    idle_until(4, t0)
    client.force_login(alice)
    detail = client.get(reverse("reservation_detail", args=[booking.pk])).content.decode()
    assert "since" in detail.split('class="idle"', 1)[1] and "3 min idle in all" in detail
    mine = client.get(reverse("my_reservations")).content.decode()
    row = mine.split(f'data-reservation="{booking.pk}"', 1)[1].split("</tr>", 1)[0]
    assert "idle since" in row and "3 min in all" in row
    api = APIClient()
    api.force_authenticate(alice)
    body = api.get(f"/api/v1/reservations/{booking.pk}/").json()
    assert body["idle_minutes"] == 3
    assert datetime.fromisoformat(body["idle_since"].replace("Z", "+00:00")) == t0 + M


# --- the team's setting ------------------------------------------------------------------


@pytest.mark.parametrize("who", ["leader", "admin"])
def test_leaders_and_admins_turn_auto_release_on_and_it_is_audited(people, team, who):
    team_auto_release_set(actor=people[who], team=team, on=True)
    team.refresh_from_db()
    assert team.auto_release_idle
    entry = AuditEntry.objects.get()
    assert (entry.actor, entry.team, entry.action) == (people[who], team, AuditEntry.Action.TEAM_AUTO_RELEASE)
    assert entry.message == f"{who} turned on the auto-release of idle bookings in Vision Lab"
    team_auto_release_set(actor=people[who], team=team, on=True)
    assert AuditEntry.objects.count() == 1  # nothing changed, nothing written


@pytest.mark.parametrize("who", ["alice", "bob", "charlie"])
def test_nobody_else_turns_auto_release_on(people, team, who):
    with pytest.raises(Forbidden, match="Only leaders of Vision Lab and admins"):
        team_auto_release_set(actor=people[who], team=team, on=True)
    team.refresh_from_db()
    assert not team.auto_release_idle and not AuditEntry.objects.exists()


PAGE = {"alice": 403, "bob": 403, "charlie": 404, "leader": 302, "admin": 302}


@pytest.mark.parametrize(("who", "expected"), PAGE.items())
def test_the_team_page_turns_auto_release_on_for_leaders_and_admins_only(client, people, team, who, expected):
    client.force_login(people[who])
    response = client.post(reverse("team_detail", args=[team.slug]), {"auto_release_idle": "on"})
    assert response.status_code == expected
    team.refresh_from_db()
    assert team.auto_release_idle == (expected == 302)
    if expected == 302:
        assert response.url == f"{reverse('team_detail', args=[team.slug])}#idle"
        page = client.get(response.url).content.decode()
        assert "Auto-release of idle bookings is on" in page
        assert 'id="id_auto_release_idle" checked' in page


def test_the_team_page_turns_it_off_with_the_box_unticked_and_shows_who_released(
    client, alice, cards, t0, team, leader
):
    team_auto_release_set(actor=leader, team=team, on=True)
    booking = book(alice, cards[:1], t0)
    idle_until(61, t0)
    client.force_login(leader)
    page = client.get(reverse("team_detail", args=[team.slug])).content.decode()
    row = page.split("audit-log", 1)[1].split(html.escape(f"released reservation {booking.pk}"), 1)[0]
    assert "the portal" in row.rsplit("<tr", 1)[1]
    response = client.post(reverse("team_detail", args=[team.slug]), {}, follow=True)
    assert "Auto-release of idle bookings is off" in response.content.decode()
    team.refresh_from_db()
    assert not team.auto_release_idle


def test_a_switch_the_team_page_does_not_have_changes_nothing(client, team, leader):
    team_auto_release_set(actor=leader, team=team, on=True)
    client.force_login(leader)
    response = client.post(reverse("team_detail", args=[team.slug]), {"what": "lnd"}, follow=True)
    assert (
        "what=&#x27;lnd&#x27; names no switch: give release or lend. Nothing changed."
        in response.content.decode()
    )
    team.refresh_from_db()
    assert team.auto_release_idle


def test_anonymous_users_go_to_login_from_the_auto_release_form(client, team):
    response = client.post(reverse("team_detail", args=[team.slug]), {"auto_release_idle": "on"})
    assert response.status_code == 302 and response.url.startswith(reverse("login"))


API = {"alice": 403, "bob": 403, "charlie": 404, "leader": 200, "admin": 200}


@pytest.mark.parametrize(("who", "expected"), API.items())
def test_the_team_api_turns_auto_release_on_for_leaders_and_admins_only(people, team, who, expected):
    api = APIClient()
    api.force_authenticate(people[who])
    response = api.patch("/api/v1/teams/vision-lab/", {"auto_release_idle": True}, format="json")
    assert response.status_code == expected, response.content
    if expected == 200:
        assert response.json()["auto_release_idle"] is True
    if expected == 403:
        assert response.json()["detail"] == "Only leaders of Vision Lab and admins manage it."
    team.refresh_from_db()
    assert team.auto_release_idle == (expected == 200)
    assert AuditEntry.objects.exists() == (expected == 200)


def test_a_leader_cannot_slip_a_quota_into_an_auto_release_patch(people, team):
    api = APIClient()
    api.force_authenticate(people["leader"])
    data = {"auto_release_idle": True, "max_cards": 9}
    response = api.patch("/api/v1/teams/vision-lab/", data, format="json")
    assert response.status_code == 403
    assert response.json()["detail"] == "Only admins set team quotas; ask one."
    team.refresh_from_db()
    assert not team.auto_release_idle and team.max_cards is None
    assert not AuditEntry.objects.exists()


def test_the_team_api_shows_the_setting_to_members(people, team):
    api = APIClient()
    api.force_authenticate(people["bob"])
    assert api.get("/api/v1/teams/vision-lab/").json()["auto_release_idle"] is False


# --- the thread --------------------------------------------------------------------------


def test_the_checker_starts_only_in_the_portals_own_worker(monkeypatch, settings):
    started = []
    monkeypatch.setattr(idle, "start_checker", lambda: started.append("idle"))
    monkeypatch.setattr(telemetry, "start_collector", lambda: started.append("collector"))
    monkeypatch.setattr(telemetry, "start_reporter", lambda: started.append("reporter"))

    def worker_ready(*queues: str) -> None:
        consumer = SimpleNamespace(queues=[SimpleNamespace(name=q) for q in queues])
        signals._start_threads(SimpleNamespace(task_consumer=consumer))

    worker_ready(f"host.{settings.WORKER_SERVER}")
    assert started == ["reporter"]
    worker_ready(settings.CELERY_TASK_DEFAULT_QUEUE)
    assert started == ["reporter", "collector", "idle"]


def test_the_checker_runs_every_idle_check_seconds(settings):
    settings.IDLE_CHECK_SECONDS = 17
    assert IdleChecker().interval == 17
