"""Issue 19, the queue: one job never stops the others, a refused start holds no cards, a host
gets no more starts than its worker runs, and what could never start is refused at submit."""

from __future__ import annotations

import logging
from datetime import timedelta

import kombu.exceptions
import pytest
from django.utils import timezone

from gpus.booking import reservation_create, reservation_release
from gpus.models import Server
from gpus.services import server_report_ingest
from jobs.host.pickup import slots_report
from jobs.leavers import left_team
from jobs.models import Job
from jobs.queue.scheduler import queue_plan, schedule_pass
from jobs.services import dispatch, jobs_reconcile
from jobs.tasks import run_job
from portal.errors import Conflict, Invalid
from portal.models import AuditEntry, Membership, Notification
from portal.timefmt import format_time
from tests.factories import MembershipFactory, TeamFactory, fresh, make_snapshot, queue_job

H = timedelta(hours=1)


# --- 1. one job never stops the pass --------------------------------------------------------------


def test_it_starts_the_others_when_one_owner_may_no_longer_book_for_the_jobs_team(alice, bob, box, sent):
    """Written before leaving a team cancelled queued jobs: the booking service says Forbidden."""
    stray = queue_job(alice)
    Job.objects.filter(pk=stray.pk).update(team=TeamFactory(slug="elsewhere"), created_at=timezone.now() - H)
    other = queue_job(bob)

    done = schedule_pass()

    assert fresh(other).status == Job.Status.QUEUED and done["started"] == 1
    stray = fresh(stray)
    assert stray.status == Job.Status.PENDING and stray.pending_reason == "quota"
    assert "not a member of team" in stray.message


def test_an_unexpected_error_skips_only_that_job_and_is_logged_once(
    alice, bob, box, sent, monkeypatch, caplog
):
    from jobs.queue import scheduler

    broken = queue_job(alice)
    Job.objects.filter(pk=broken.pk).update(created_at=timezone.now() - H)
    other = queue_job(bob)
    real = scheduler.reservation_create

    def flaky(**kwargs):
        if kwargs["user"] == alice:
            raise RuntimeError("a bug")
        return real(**kwargs)

    monkeypatch.setattr(scheduler, "reservation_create", flaky)
    memory = scheduler.PassMemory()  # one scheduler's, as its thread keeps it from pass to pass
    with caplog.at_level(logging.ERROR, logger="jobs.queue.scheduler"):
        schedule_pass(memory=memory)
        schedule_pass(memory=memory)

    assert fresh(other).status == Job.Status.QUEUED and fresh(broken).status == Job.Status.PENDING
    assert [r.getMessage() for r in caplog.records].count(
        f"Job {broken.pk} could not start; the others go on, and it is tried again"
    ) == 1


# --- 1. leaving a team ----------------------------------------------------------------------------


def test_leaving_a_team_cancels_the_members_queued_jobs_of_it_saying_why(alice, leader, team, box, sent):
    other_team = TeamFactory(slug="other")
    MembershipFactory(user=alice, team=other_team)
    mine = queue_job(alice, team=team.slug)
    kept = queue_job(alice, team="other")

    Membership.objects.get(user=alice, team=team).delete()  # e.g. a directory sync

    mine = fresh(mine)
    reason = left_team(alice, team)
    assert mine.status == Job.Status.CANCELLED and mine.message == f"Cancelled: {reason}."
    assert fresh(kept).status == Job.Status.PENDING
    from jobs.logs.store import log_stream

    assert reason in b"".join(log_stream(mine.pk)).decode()
    audit = AuditEntry.objects.get(team=team, action=AuditEntry.Action.JOB_CANCEL)
    assert audit.data["cancelled"] == [mine.pk] and reason in audit.message
    told = set(
        Notification.objects.filter(kind=Notification.Kind.JOB_STOPPED).values_list(
            "user__username", flat=True
        )
    )
    assert told == {"alice", "leader"}
    assert schedule_pass().get("started") == 1  # only the job of the team alice is still in


def test_the_reconciler_cancels_queued_jobs_of_a_member_removed_without_a_signal(alice, team, box, sent):
    job = queue_job(alice)
    Membership.objects.filter(user=alice, team=team)._raw_delete("default")  # no post_delete

    assert jobs_reconcile()["team_leavers"] == 1
    assert fresh(job).status == Job.Status.CANCELLED
    assert jobs_reconcile()["team_leavers"] == 0


# --- 4. a host's job slots ------------------------------------------------------------------------


def test_a_host_with_known_slots_gets_no_more_starts_than_it_has_free(alice, box, sent):
    server = Server.objects.get(name="box1")
    array = queue_job(alice, memory_mb=1024, array="0-9")
    slots_report("box1", slots=3, now=timezone.now())  # its worker runs 3 at a time (jobs.host.pickup)
    server.refresh_from_db()
    assert server.job_slots == 3 and server.job_slots_at is not None

    assert schedule_pass()["started"] == 3
    assert schedule_pass().get("started", 0) == 0  # the three hold every slot

    first = Job.objects.filter(array=array.array, status=Job.Status.QUEUED).order_by("pk").first()
    Job.objects.filter(pk=first.pk).update(status=Job.Status.SUCCEEDED, finished_at=timezone.now())
    assert schedule_pass()["started"] == 1  # a slot came free


def test_a_host_whose_worker_went_silent_gets_no_starts_and_its_jobs_say_why(alice, box, sent, settings):
    """Its worker reported once, then stopped (gone, or cut off from the database while Redis
    works): booking its cards would start jobs nobody claims."""
    array = queue_job(alice, memory_mb=1024, array="0-9")
    now = timezone.now()
    silent_for = 10 * settings.JOB_RECONCILE_SECONDS
    Server.objects.filter(name="box1").update(job_slots=3, job_slots_at=now - timedelta(seconds=silent_for))

    assert schedule_pass(now=now).get("started", 0) == 0
    waiting = Job.objects.filter(array=array.array)
    assert set(waiting.values_list("status", "pending_reason")) == {(Job.Status.PENDING, "resources")}
    assert set(waiting.values_list("message", flat=True)) == {
        f"Waiting: box1's worker has not reported for {silent_for} s, so no job starts there until it does"
    }
    assert all(e.estimated_start is None and not e.held for e in queue_plan(now=now))  # no holds there

    slots_report("box1", slots=3, now=now)  # it is back
    assert schedule_pass(now=now)["started"] == 3
    assert not waiting.filter(status=Job.Status.PENDING).exclude(message="").exists()  # old words go


def test_a_job_that_asked_for_an_offline_server_says_why_it_waits(alice, box, sent, settings):
    """Issue 42 item 11: it waited with the reason `resources`, "not enough free cards now", and
    no words, while the cards were free and their host was down."""
    job = queue_job(alice, server="box1")
    last = timezone.now() - timedelta(seconds=settings.SERVER_OFFLINE_AFTER_SECONDS + 60)
    Server.objects.filter(name="box1").update(last_seen=last)

    assert schedule_pass().get("started", 0) == 0
    job = fresh(job)
    assert (job.status, job.pending_reason) == (Job.Status.PENDING, "offline")
    assert job.get_pending_reason_display() == "The chosen server is offline"
    assert job.message == (
        f"Waiting: box1 is offline (its worker last reported {format_time(last)}); the job starts there"
        " once it reports again"
    )
    assert [e.estimated_start for e in queue_plan()] == [None]  # when it comes back is anyone's guess

    server_report_ingest(snapshot=make_snapshot("box1"))  # it is back
    assert schedule_pass()["started"] == 1
    assert (fresh(job).status, fresh(job).message) == (Job.Status.QUEUED, "")


def test_a_host_whose_worker_never_reported_is_planned_nothing_until_it_does(alice, box, sent):
    """Its worker has not started yet: how many jobs it runs at once is unknown, so the plan puts
    none there (rather than every queued job onto a host that may run one at a time)."""
    Server.objects.filter(name="box1").update(job_slots=None, job_slots_at=None)
    array = queue_job(alice, memory_mb=1024, array="0-9")

    assert schedule_pass().get("started", 0) == 0
    assert set(Job.objects.filter(array=array.array).values_list("message", flat=True)) == {
        "Waiting: box1's worker has not yet said how many jobs it runs at once, so no job starts there"
        " until it does"
    }

    slots_report("box1", slots=3, now=timezone.now())
    assert schedule_pass()["started"] == 3


# --- 5. a refused start holds no cards ------------------------------------------------------------


def test_a_job_refused_every_pass_does_not_keep_the_cards_from_a_job_behind_it(alice, bob, box, sent):
    """bob's 4-card job is first in line but over his weekly GPU-hours: alice's 1-card job starts
    in the same pass, on a server that would otherwise sit idle."""
    Membership.objects.filter(user=bob).update(gpu_hours_per_week=1)
    wide = queue_job(bob, gpus=4, minutes=29)  # 2 GPU-hours with its slack: within 2 weeks' limit, not 1
    Job.objects.filter(pk=wide.pk).update(created_at=timezone.now() - H)
    small = queue_job(alice)

    done = schedule_pass()

    assert fresh(small).status == Job.Status.QUEUED and done["started"] == 1
    wide = fresh(wide)
    assert (wide.status, wide.pending_reason) == (Job.Status.PENDING, "quota")
    assert "GPU-hours" in wide.message  # the booking service's words, for its owner

    Membership.objects.filter(user=bob).update(gpu_hours_per_week=None)
    schedule_pass()  # no longer refused: it waits for alice's card, and the old words go
    wide = fresh(wide)
    assert (wide.status, wide.pending_reason, wide.message) == (Job.Status.PENDING, "resources", "")


# --- 5, 6. refused at submit ----------------------------------------------------------------------


def test_more_cards_than_the_largest_server_has_are_refused_at_submit(alice, box):
    server_report_ingest(snapshot=make_snapshot("box2", gpus=2))
    with pytest.raises(Invalid) as refused:
        queue_job(alice, gpus=5)
    assert refused.value.field == "gpu_count"
    assert refused.value.message.startswith(
        "gpu_count: 5 cards asked for, but the largest server, box1, has 4."
    )
    with pytest.raises(Invalid, match="box2 has 2"):
        queue_job(alice, gpus=3, server="box2")
    assert not Job.objects.exists()


def test_more_cards_of_a_size_than_any_server_has_are_refused_at_submit(alice, box):
    server_report_ingest(snapshot=make_snapshot("big", gpus=2, memory_gb=80))
    with pytest.raises(Invalid, match="the most any server has is 2, on big") as refused:
        queue_job(alice, gpus=3, memory_mb=40 * 1024)
    assert refused.value.field == "gpu_count" and not Job.objects.exists()


@pytest.mark.parametrize(
    ("where", "limits", "kwargs", "field", "words"),
    [
        ("member", {"max_cards": 2}, {"gpus": 3}, "gpu_count", "Your quota in .* allows 2 whole card"),
        ("team", {"max_cards": 1}, {"gpus": 2}, "gpu_count", "The team quota of .* allows 1 whole card"),
        (
            "member",
            {"max_gb": 4},
            {"gpus": 2, "memory_mb": 4096},
            "memory_mb",
            r'allows 4 GiB of GPU memory at once.*"GiB at once" limit',
        ),
    ],
)
def test_a_request_above_a_member_or_team_limit_is_refused_at_submit(
    alice, team, box, where, limits, kwargs, field, words
):
    holder = (
        Membership.objects.filter(user=alice) if where == "member" else type(team).objects.filter(pk=team.pk)
    )
    holder.update(**limits)
    with pytest.raises(Invalid, match=words) as refused:
        queue_job(alice, **kwargs)
    assert refused.value.field == field and not Job.objects.exists()


# --- dispatch: a broker outage is one line --------------------------------------------------------


def test_a_broker_outage_is_one_log_line_not_a_traceback_per_job(
    alice, box, monkeypatch, caplog, django_capture_on_commit_callbacks
):
    task = run_job
    sent: list[int] = []

    def away(args, queue):
        raise kombu.exceptions.OperationalError("Error 111 connecting to redis: Connection refused.")

    monkeypatch.setattr(task, "apply_async", away)
    jobs = [queue_job(alice, memory_mb=1024) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="jobs.services"):
        with django_capture_on_commit_callbacks(execute=True):
            schedule_pass()
        assert Job.objects.filter(pk__in=[j.pk for j in jobs], dispatched_at=None).count() == 3
        monkeypatch.setattr(task, "apply_async", lambda args, queue: sent.append(args[0]))
        with django_capture_on_commit_callbacks(execute=True):
            for job in jobs:
                dispatch(fresh(job), timezone.now())
    lines = [r for r in caplog.records if r.name == "jobs.services"]
    assert len(lines) == 2 and not any(r.exc_info for r in lines)
    assert (
        "Could not send job" in lines[0].getMessage() and "sent to their hosts again" in lines[1].getMessage()
    )
    assert sorted(sent) == sorted(j.pk for j in jobs)


# --- manual bookings and the backfill shadow ------------------------------------------------------


def test_a_manual_booking_cannot_take_the_cards_a_wide_job_waits_for(alice, bob, charlie, box, sent):
    """Two cards are booked for an hour, so a 4-card job's shadow holds all four from then. A manual
    booking of the two free cards across that start would push the wide job back: it is refused,
    naming the card, the job and the hold, and one that ends by then is fine."""
    now = timezone.now()
    reservation_create(user=bob, gpus=[box[0].uuid, box[1].uuid], start=now, end=now + H)
    wide = queue_job(alice, gpus=4, minutes=120)
    schedule_pass(now=now)
    assert fresh(wide).pending_reason == "resources"

    with pytest.raises(Conflict) as refused:
        reservation_create(user=charlie, gpus=[box[2].uuid, box[3].uuid], start=now, end=now + 3 * H)
    assert refused.value.field == "gpus"
    assert box[2].uuid in refused.value.message and f"queued job {wide.pk}" in refused.value.message
    assert "end your booking by" in refused.value.message and "another card" in refused.value.message

    reservation_create(user=charlie, gpus=[box[2].uuid, box[3].uuid], start=now, end=now + H)
    (entry,) = queue_plan(now=now)
    assert entry.estimated_start == now + H


def test_the_portal_picks_around_a_wide_jobs_hold(alice, bob, charlie, box, sent):
    """Asking for N cards anywhere never picks a card the queue holds: there are none to pick."""
    now = timezone.now()
    reservation_create(user=bob, gpus=[box[0].uuid, box[1].uuid], start=now, end=now + H)
    queue_job(alice, gpus=4, minutes=120)
    schedule_pass(now=now)

    with pytest.raises(Conflict) as refused:
        reservation_create(user=charlie, count=1, server="box1", start=now, end=now + 3 * H)
    assert refused.value.field == "count"
    assert reservation_create(user=charlie, count=2, server="box1", start=now, end=now + H)


def test_the_schedulers_own_booking_for_the_held_job_still_succeeds(alice, bob, box, sent):
    """The hold binds user bookings, not the start it was kept for: when the cards free up, the
    next pass books them for the job."""
    now = timezone.now()
    blocker = reservation_create(user=bob, gpus=[box[0].uuid, box[1].uuid], start=now, end=now + H)
    wide = queue_job(alice, gpus=4, minutes=120)
    schedule_pass(now=now)
    assert fresh(wide).status == Job.Status.PENDING

    reservation_release(user=bob, reservation=blocker, now=now + timedelta(minutes=1))
    slots_report("box1", slots=64, now=now + timedelta(minutes=1))  # its worker's round meanwhile
    schedule_pass(now=now + timedelta(minutes=1))

    wide = fresh(wide)
    assert wide.status == Job.Status.QUEUED and len(wide.gpu_uuids) == 4


def test_a_hold_binds_no_one_once_its_job_is_cancelled(alice, bob, charlie, box, sent):
    now = timezone.now()
    reservation_create(user=bob, gpus=[box[0].uuid, box[1].uuid], start=now, end=now + H)
    wide = queue_job(alice, gpus=4, minutes=120)
    schedule_pass(now=now)
    Job.objects.filter(pk=wide.pk).update(status=Job.Status.CANCELLED)

    assert reservation_create(user=charlie, gpus=[box[2].uuid, box[3].uuid], start=now, end=now + 3 * H)


def test_with_redis_away_the_queue_loses_its_holds_never_a_booking(
    alice, bob, charlie, box, sent, monkeypatch, caplog
):
    import redis

    from jobs.queue import scheduler

    def away(timeout):
        raise redis.ConnectionError("Redis is away")

    now = timezone.now()
    reservation_create(user=bob, gpus=[box[0].uuid, box[1].uuid], start=now, end=now + H)
    wide = queue_job(alice, gpus=4, minutes=120)
    monkeypatch.setattr(scheduler, "client", away)
    memory = scheduler.PassMemory()  # one scheduler's, as its thread keeps it from pass to pass

    schedule_pass(now=now, memory=memory)
    schedule_pass(now=now, memory=memory)

    assert fresh(wide).pending_reason == "resources"
    assert caplog.text.count("could not store the holds") == 1  # once per outage
    assert reservation_create(user=charlie, gpus=[box[2].uuid], start=now, end=now + 3 * H)


def test_the_booking_form_shows_a_hold_beside_the_cards(client, alice, bob, charlie, box, sent):
    from django.urls import reverse

    from gpus.forms import local_input

    now = timezone.now()
    reservation_create(user=bob, gpus=[box[0].uuid, box[1].uuid], start=now, end=now + H)
    wide = queue_job(alice, gpus=4, minutes=120)
    schedule_pass(now=now)

    client.force_login(charlie)
    response = client.post(
        reverse("reservation_new"),
        {"gpus": [box[2].uuid], "start": "", "end": local_input(now + 3 * H), "note": ""},
    )
    assert response.status_code == 200
    errors = " ".join(response.context["form"].errors["gpus"])
    assert f"queued job {wide.pk}" in errors and "Pick another card" in errors


def test_the_api_answers_a_hold_with_409_on_the_cards_field(alice, bob, charlie, box, sent):
    from rest_framework.test import APIClient

    now = timezone.now()
    reservation_create(user=bob, gpus=[box[0].uuid, box[1].uuid], start=now, end=now + H)
    wide = queue_job(alice, gpus=4, minutes=120)
    schedule_pass(now=now)

    api = APIClient()
    api.force_authenticate(charlie)
    body = {"gpus": [box[3].uuid], "end": (now + 3 * H).isoformat()}
    response = api.post("/api/v1/reservations/", body, format="json")

    assert response.status_code == 409
    assert f"queued job {wide.pk}" in " ".join(response.json()["errors"]["gpus"])


def test_the_form_shows_a_refusal_beside_the_field_it_names(client, alice, box):
    from django.core.files.uploadedfile import SimpleUploadedFile
    from django.urls import reverse

    Membership.objects.filter(user=alice).update(max_gb=4)
    client.force_login(alice)
    script = SimpleUploadedFile("train.py", b"print('hi')\n")
    data = {
        "script": script,
        "gpu_count": 2,
        "memory": "4G",
        "time_limit_minutes": 20,
        "interpreter": "default",
    }
    response = client.post(reverse("job_new"), data)
    assert response.status_code == 200 and not Job.objects.exists()
    assert '"GiB at once" limit' in " ".join(response.context["form"].errors["memory"])


def test_the_api_answers_an_impossible_request_with_the_field_and_writes_nothing(alice, box):
    from django.core.files.uploadedfile import SimpleUploadedFile
    from rest_framework.test import APIClient

    api = APIClient()
    api.force_authenticate(alice)
    script = SimpleUploadedFile("train.py", b"print('hi')\n")
    response = api.post("/api/v1/jobs/", {"script": script, "gpu_count": 5}, format="multipart")
    assert response.status_code == 400 and not Job.objects.exists()
    (message,) = response.json()["errors"]["gpu_count"]
    assert message.startswith("gpu_count: 5 cards asked for, but the largest server, box1, has 4.")
