"""The queue: jobs without a booking, the scheduler's passes, fair share and backfill."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import Reservation, Server
from jobs.models import Job
from jobs.queue.calendar import Calendar, Card
from jobs.queue.rules import Request, Shares, Usage, Weights, decayed_hours, parse_array, plan
from jobs.queue.scheduler import fairshare_state, queue_plan, schedule_pass
from jobs.runs import queued_job_ended
from jobs.services import job_cancel
from portal.errors import Invalid, QuotaExceeded
from portal.models import Membership
from tests.factories import MembershipFactory, TeamFactory, UserFactory, queue_job

H = timedelta(hours=1)
M = timedelta(minutes=1)


def reason(job: Job) -> str:
    job.refresh_from_db()
    return job.pending_reason


# --- submitting -----------------------------------------------------------------------------------


def test_a_queued_job_waits_pending_then_starts_on_a_booking_of_its_own(
    alice, box, sent, django_capture_on_commit_callbacks
):
    job = queue_job(alice, gpus=2, minutes=30)
    assert (job.status, job.reservation, job.server, job.queued) == ("pending", None, None, True)

    with django_capture_on_commit_callbacks(execute=True):
        done = schedule_pass()

    job.refresh_from_db()
    assert done["started"] == 1 and job.status == Job.Status.QUEUED
    booking = job.reservation
    assert booking.owner == alice and len(job.gpu_uuids) == 2 and job.server.name == "box1"
    assert booking.end - booking.start == timedelta(minutes=31)  # the limit, plus a minute to start
    assert "Queued job" in booking.note
    assert sent == [(job.pk, "host.box1")]
    assert job.intra_op_threads  # the booking's CPU share, now that it is known


def test_its_booking_is_released_when_it_ends(alice, box, sent):
    job = queue_job(alice)
    schedule_pass()
    job.refresh_from_db()
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED, finished_at=timezone.now())
    job.refresh_from_db()
    queued_job_ended(job)
    assert Reservation.objects.get(pk=job.reservation_id).released_at is not None


def test_its_end_released_meanwhile_by_the_other_path_is_no_error(alice, box, sent, monkeypatch):
    """The supervisor and the scheduler's pass may both release an ended job's booking at once
    (seen in the fault suite's storm): the second finds it released under the lock, not a stale
    read, and fails nothing (a pass, or the supervisor's run, would go with it)."""
    job = queue_job(alice)
    schedule_pass()
    job.refresh_from_db()
    stale = Reservation.objects.get(pk=job.reservation_id)  # read as active, a moment before
    queued_job_ended(job)  # the other path
    monkeypatch.setattr(Reservation.objects, "get", lambda **kwargs: stale)
    queued_job_ended(job)
    assert Reservation.objects.filter(pk=job.reservation_id).values_list("released_at", flat=True)[0]


def test_a_lost_queued_job_has_its_booking_released_by_the_next_pass(alice, box, sent):
    job = queue_job(alice)
    schedule_pass()
    Job.objects.filter(pk=job.pk).update(status=Job.Status.LOST, finished_at=timezone.now())
    assert schedule_pass()["released"] == 1
    job.refresh_from_db()
    assert job.reservation.released_at is not None


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"gpus": 0}, "gpu_count", "1 to 64 cards"),
        ({"minutes": 0}, "time_limit_minutes", "time limit is at least 1 minute"),
        ({"server": "nope"}, "server", "no server 'nope'"),
        ({"memory_mb": 200}, "memory_mb", "headroom"),
        ({"memory_mb": 10**6}, "memory_mb", "more than any card"),
        ({"array": "9-2"}, "array", "must not be below"),
        ({"array": "0-99%0"}, "array", "at least %1"),
        ({"nice": -1}, "nice", "only lower"),
    ],
)
def test_bad_requests_name_the_field_and_write_nothing(alice, box, kwargs, field, words):
    with pytest.raises(Invalid, match=words) as refused:
        queue_job(alice, **kwargs)
    assert refused.value.field == field
    assert not Job.objects.exists()


def test_a_member_of_several_teams_says_which(alice, box):
    MembershipFactory(user=alice, team=TeamFactory(slug="other"))
    with pytest.raises(Invalid, match="several teams") as refused:
        queue_job(alice)
    assert refused.value.field == "team"
    assert queue_job(alice, team="other").team.slug == "other"


# --- reasons --------------------------------------------------------------------------------------


def test_it_waits_for_resources_when_the_cards_are_booked(alice, bob, box, sent):
    reservation_create(user=bob, gpus=[g.uuid for g in box], end=timezone.now() + 2 * H)
    job = queue_job(alice)
    schedule_pass()
    assert reason(job) == "resources"
    (entry,) = queue_plan()
    assert entry.estimated_start is not None and entry.estimated_start > timezone.now() + H


def test_it_waits_for_its_begin_time_and_for_a_draining_server(alice, box, sent):
    later = queue_job(alice, begin_at=timezone.now() + H)
    Server.objects.filter(name="box1").update(draining=True)
    there = queue_job(alice, server="box1")
    schedule_pass()
    assert (reason(later), reason(there)) == ("begin_time", "draining")


def test_it_waits_for_its_quota(alice, box, sent, team):
    Membership.objects.filter(user=alice).update(max_cards=1)
    first, second = queue_job(alice), queue_job(alice)
    schedule_pass()
    first.refresh_from_db()
    assert first.status == Job.Status.QUEUED and reason(second) == "quota"


def test_an_array_runs_at_most_its_limit_at_once_and_is_cancelled_whole(alice, box, sent):
    first = queue_job(alice, array="0-9%2")
    tasks = Job.objects.filter(array=first.array).order_by("array_index")
    assert [t.array_index for t in tasks] == list(range(10)) and first.array.max_running == 2
    schedule_pass()
    assert Job.objects.filter(array=first.array, status=Job.Status.QUEUED).count() == 2
    assert {reason(t) for t in tasks.filter(status=Job.Status.PENDING)} == {"array_limit"}

    job_cancel(user=alice, job=first, whole_array=True)
    assert not Job.objects.filter(array=first.array, status=Job.Status.PENDING).exists()


def test_the_array_index_reaches_the_job(alice, box, sent):
    from jobs.environment import BookedCard, job_environment

    queue_job(alice, array="3-4")
    schedule_pass()
    task = Job.objects.get(array_index=4)
    card = task.reservation.allocations.select_related("gpu").first()
    built = job_environment(
        task,
        BookedCard.of(card),
        inherited={},
        interpreter="/usr/bin/python3",
        venv=None,
        server="box1",
        instance="portal-a",
        headroom_mb=512,
    )
    assert built.env["PORTAL_ARRAY_INDEX"] == "4"


# --- backfill -------------------------------------------------------------------------------------


def test_short_jobs_backfill_in_front_of_a_wide_job_without_delaying_it(alice, bob, box, sent):
    """Two cards are booked for an hour; a job for all four waits for them. A 30-minute job fits
    in the gap and starts; a 2-hour one would hold a card past the wide job's start, so it waits."""
    now = timezone.now()
    reservation_create(user=bob, gpus=[box[0].uuid, box[1].uuid], start=now, end=now + H)
    wide = queue_job(alice, gpus=4, minutes=120)
    short = queue_job(bob, gpus=1, minutes=30)
    long = queue_job(bob, gpus=1, minutes=120)
    Job.objects.filter(pk=wide.pk).update(created_at=now - H)  # older: higher priority

    schedule_pass(now=now)

    short.refresh_from_db()
    assert short.status == Job.Status.QUEUED  # backfilled
    assert (reason(wide), reason(long)) == ("resources", "priority")
    plan_now = {e.request.job_id: e for e in queue_plan(now=now)}
    assert plan_now[wide.pk].estimated_start == now + H  # not delayed by the backfill


# --- fair share -----------------------------------------------------------------------------------


def test_a_team_that_used_a_lot_recently_sorts_below_one_that_did_not(box, sent):
    heavy_team, light_team = TeamFactory(slug="heavy"), TeamFactory(slug="light")
    heavy = MembershipFactory(team=heavy_team, user=UserFactory(username="hana")).user
    light = MembershipFactory(team=light_team, user=UserFactory(username="lee")).user
    now = timezone.now()
    past = reservation_create(user=heavy, gpus=[g.uuid for g in box], start=now, end=now + 4 * H)
    Reservation.objects.filter(pk=past.pk).update(start=now - 2 * 24 * H, end=now - 24 * H)
    past.allocations.update(start=now - 2 * 24 * H, end=now - 24 * H)
    heavy_job = queue_job(heavy)
    light_job = queue_job(light)
    Job.objects.filter(pk=heavy_job.pk).update(created_at=now - H)  # older, yet second

    order = [e.request.job_id for e in queue_plan(now=now)]

    assert order == [light_job.pk, heavy_job.pk]


def test_the_pages_share_a_minutes_fair_share_usage_and_a_pass_of_its_own_reads_it_afresh(alice, box):
    now = timezone.now()
    before = fairshare_state(now, shared=True)[1]
    used = reservation_create(user=alice, gpus=[box[0].uuid], start=now, end=now + H)
    used.allocations.update(start=now - 2 * H, end=now - H / 2)  # an hour and a half, just ended
    assert fairshare_state(now + H / 120, shared=True)[1] == before  # the pages: half a minute old
    team = alice.memberships.get().team_id
    assert fairshare_state(now + H / 120)[1].team[team] > 0  # a pass of its own
    assert fairshare_state(now + 2 * H / 60, shared=True)[1].team[team] > 0  # a minute on: read again


def test_decayed_usage_halves_every_half_life():
    now = timezone.now()
    week = timedelta(days=7)
    fresh = decayed_hours(now - H, now, 1.0, now, week)
    old = decayed_hours(now - week - H, now - week, 1.0, now, week)
    assert fresh == pytest.approx(1.0, rel=1e-2) and old == pytest.approx(0.5, rel=1e-2)


def test_two_teams_with_equal_shares_get_near_equal_gpu_hours():
    """A long simulated queue on 8 cards: team A submits all its work first (older, so the age
    factor favours it), team B a little later; fair share evens it out."""
    start = timezone.now()
    cards = [Card(f"GPU-{i}", 1, 24_000) for i in range(8)]
    weights = Weights(fairshare=10_000, age=1_000, age_max=timedelta(days=7))
    shares = Shares(team={1: 1, 2: 1}, member={(1, 10): 1, (2, 20): 1})
    jobs = [Request(i, 10, 1, 1, None, None, 60, start - H, 0) for i in range(400)]
    jobs += [Request(1000 + i, 20, 2, 1, None, None, 60, start, 0) for i in range(400)]
    history: list[tuple] = []  # (start, end, team)
    hours = {1: 0.0, 2: 0.0}
    for step in range(48):  # a day in half-hour steps
        now = start + step * 30 * M
        usage = {1: 0.0, 2: 0.0}
        for s, e, team, _uuid in history:
            usage[team] += decayed_hours(s, e, 1.0, now, timedelta(days=7))
        busy: dict[str, list] = {}
        for s, e, _team, uuid in (h for h in history if h[1] > now):
            busy.setdefault(uuid, []).append((s, e, None))
        entries = plan(
            jobs,
            Calendar(cards, busy, now),
            shares=shares,
            usage=Usage(team=usage, member={(1, 10): usage[1], (2, 20): usage[2]}),
            weights=weights,
            depth=10,
            draining=set(),
            array_room={},
        )
        started = {e.request.job_id: e for e in entries if e.start_now}
        for entry in started.values():
            team = entry.request.team_id
            history.append((now, now + H, team, entry.start_now[0]))
            hours[team] += 1
        jobs = [j for j in jobs if j.job_id not in started]
    assert sum(hours.values()) >= 8 * 23  # the cards stayed busy
    assert abs(hours[1] - hours[2]) / sum(hours.values()) < 0.1


def test_parse_array():
    assert parse_array("0-3%2") == ([0, 1, 2, 3], 2)
    assert parse_array("5") == ([5], None)
    with pytest.raises(Invalid, match="at most 50 characters"):
        parse_array("0-" + "0" * 60 + "9")  # JobArray.spec could not keep it


def test_a_time_limit_must_leave_room_for_the_bookings_slack_and_the_members_limit(alice, box, settings):
    settings.BOOKING_MAX_HOURS = 2
    with pytest.raises(Invalid, match="time limit of at most 119 minutes"):
        queue_job(alice, minutes=120)  # its booking would be 121 minutes: it could never start
    alice.memberships.update(max_booking_hours=1)
    with pytest.raises(QuotaExceeded, match="time limit of at most 59 minutes") as refused:
        queue_job(alice, minutes=60)
    assert refused.value.field == "time_limit_minutes"


def test_a_booking_and_a_queued_job_too_long_for_the_member_are_refused_alike(alice, box, t0):
    """One rule (gpus.quotas.quota_check): one exception, one wording, beside the field to change."""
    alice.memberships.update(max_booking_hours=1)
    with pytest.raises(QuotaExceeded) as booked:
        reservation_create(user=alice, gpus=[box[0].uuid], start=t0, end=t0 + 2 * H)
    with pytest.raises(QuotaExceeded) as queued:
        queue_job(alice, minutes=120)
    assert (booked.value.field, queued.value.field) == ("end", "time_limit_minutes")
    for refusal in (booked.value, queued.value):
        assert refusal.message.startswith(f"Your quota in {alice.memberships.get().team} allows bookings of")
        assert refusal.message.endswith(
            f"or ask a leader of {alice.memberships.get().team} to raise your "
            '"longest booking (hours)" limit.'
        )


def test_the_portals_longest_booking_is_one_wording_for_bookings_and_the_queue(alice, box, t0, settings):
    settings.BOOKING_MAX_HOURS = 1
    with pytest.raises(Invalid) as booked:
        reservation_create(user=alice, gpus=[box[0].uuid], start=t0, end=t0 + 2 * H)
    with pytest.raises(Invalid) as queued:
        queue_job(alice, minutes=120)
    assert (booked.value.field, queued.value.field) == ("end", "time_limit_minutes")
    for refusal in (booked.value, queued.value):
        assert refusal.code == "invalid"  # the portal's own limit, no member's quota
        assert refusal.message.startswith("The portal allows bookings of at most 1 h; this ")


# --- the API -------------------------------------------------------------------------------------


@pytest.fixture
def api(alice) -> APIClient:
    client = APIClient()
    client.force_authenticate(alice)
    return client


def test_the_api_queues_a_job_and_shows_the_queue(api, alice, bob, box, sent):
    reservation_create(user=bob, gpus=[g.uuid for g in box], end=timezone.now() + H)
    response = api.post(
        "/api/v1/jobs/",
        {"script_path": "", "gpu_count": 2, "time_limit_minutes": 15, "array": "0-1", "script": _upload()},
        format="multipart",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["status"], body["queued"], body["gpu_count"], body["array_index"]) == ("pending", True, 2, 0)
    schedule_pass()
    rows = api.get("/api/v1/queue/").json()["results"]
    assert [r["job"] for r in rows] == [body["id"], body["id"] + 1]
    first = rows[0]
    assert first["reason"] == "resources" and first["estimated_start"] is not None
    assert set(first["factors"]) == {"fairshare", "age", "nice"}
    tasks = api.get(f"/api/v1/jobs/?array={body['array_id']}").json()["results"]
    assert len(tasks) == 2
    cancelled = api.post(f"/api/v1/jobs/{body['id']}/cancel/", {"whole_array": True}, format="json")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert api.get("/api/v1/queue/").json()["results"] == []


def test_the_queue_hides_outsiders_names(api, charlie, box, sent):
    queue_job(charlie)
    (row,) = api.get("/api/v1/queue/").json()["results"]
    assert (row["owner"], row["name"], row["team"]) == ("another user", "", "")


def _upload():
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile("train.py", b"print('hi')\n")


# --- pages ----------------------------------------------------------------------------------------


def test_the_form_queues_a_job_without_a_booking(client, alice, box, sent):
    from django.urls import reverse

    client.force_login(alice)
    response = client.post(
        reverse("job_new"),
        {
            "script": _upload(),
            "gpu_count": 2,
            "memory": "4G",
            "time_limit_minutes": 20,
            "interpreter": "default",
        },
    )
    job = Job.objects.get()
    assert response.status_code == 302 and response.url == reverse("job_detail", args=[job.pk])
    assert (job.status, job.gpu_count, job.memory_mb, job.time_limit_minutes) == ("pending", 2, 4096, 20)


def test_the_queue_page_and_a_pending_jobs_page_say_why_it_waits(client, alice, bob, box, sent):
    from django.urls import reverse

    reservation_create(user=bob, gpus=[g.uuid for g in box], end=timezone.now() + H)
    job = queue_job(alice, gpus=4)
    other = queue_job(alice, gpus=4, preemptible=True)
    schedule_pass()
    client.force_login(alice)
    page = client.get(reverse("queue")).content.decode()
    assert f'data-job="{job.pk}"' in page and "resources" in page
    rows = {row.split('"')[0]: row for row in page.split('data-job="')[1:]}
    assert "preemptible</span>" in rows[str(other.pk)] and "preemptible</span>" not in rows[str(job.pk)]
    detail = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert "Not enough free cards now" in detail and "estimated start" in detail
