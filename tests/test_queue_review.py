"""Review of the queue: weekly GPU-hours refused at submit (as the booking service counts them), a
host whose worker went silent gets no starts, and a start refused for a taken card keeps its place."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import GPU, Server
from gpus.quotas import week_start
from gpus.services import server_report_ingest
from jobs.host.pickup import slots_report
from jobs.models import Job
from jobs.queue.scheduler import queue_holds, schedule_pass
from portal.errors import Conflict, Invalid, QuotaExceeded
from portal.models import AuditEntry, Membership, Team
from tests.factories import fresh, make_snapshot, queue_job

pytestmark = pytest.mark.django_db

H = timedelta(hours=1)
M = timedelta(minutes=1)


# --- L3: weekly GPU-hours at submit ---------------------------------------------------------------


def test_a_job_needing_more_gpu_hours_than_the_weekly_limit_is_refused_at_submit(alice, team, box, sent):
    """4 cards x 10 h = 40 GPU-hours against 8 a week: no booking of it could ever be made, so it
    would wait as "quota" for ever. Refused, naming the field, the limit and the fix; nothing written."""
    Membership.objects.filter(user=alice).update(gpu_hours_per_week=8)
    with pytest.raises(Invalid) as refused:
        queue_job(alice, gpus=4, minutes=600)
    message = refused.value.message
    assert refused.value.field == "time_limit_minutes"
    assert '"GPU-hours per week" limit' in message
    assert f"Your quota in {team} allows 8 GPU-hours a week" in message
    assert "fewer cards" in message and "at most 239 minutes" in message and "ask a leader" in message
    assert not Job.objects.exists() and not AuditEntry.objects.exists()


def test_the_teams_weekly_limit_is_checked_too(alice, team, box, sent):
    Team.objects.filter(pk=team.pk).update(gpu_hours_per_week=8)
    with pytest.raises(Invalid, match=f"The team quota of {team} allows 8 GPU-hours a week") as refused:
        queue_job(alice, gpus=4, minutes=600)
    assert "ask an admin" in refused.value.message and not Job.objects.exists()


def test_an_array_is_refused_whole_when_each_task_needs_too_much(alice, box, sent):
    Membership.objects.filter(user=alice).update(gpu_hours_per_week=1)
    with pytest.raises(Invalid, match='"GPU-hours per week" limit'):
        queue_job(alice, gpus=2, minutes=120, array="0-3")
    assert not Job.objects.exists()


def test_up_to_twice_the_weekly_limit_is_accepted_because_a_booking_across_monday_holds_it(alice, box, sent):
    """4 whole cards for 29 minutes and the minute of slack: exactly 2 GPU-hours against a limit of 1.
    The booking service takes such a booking across Monday 00:00 (1 in each week), never one more
    minute: submit and booking agree."""
    Membership.objects.filter(user=alice).update(gpu_hours_per_week=1)
    accepted = queue_job(alice, gpus=4, minutes=29)
    with pytest.raises(Invalid, match="at most 29 minutes"):
        queue_job(alice, gpus=4, minutes=30)
    Job.objects.filter(pk=accepted.pk).delete()  # its start is not the point here

    # A Monday 00:00 at least a day away, so that its 16 minutes before are in the future at any
    # moment the test runs (the coming Monday is 10 minutes away on a Sunday at 23:50).
    monday = week_start(timezone.now() + timedelta(days=8))
    cards = [gpu.uuid for gpu in box]
    with pytest.raises(QuotaExceeded):  # one minute more, however it straddles the week's turn
        reservation_create(user=alice, gpus=cards, start=monday - 15 * M - M, end=monday + 15 * M)
    assert reservation_create(user=alice, gpus=cards, start=monday - 15 * M, end=monday + 15 * M)


def test_a_share_counts_its_fraction_of_the_card_as_the_quotas_do(alice, box, sent):
    """Half of a 24 GB card counts half a GPU-hour an hour (gpus.quotas.Use): 4 halves for 479
    minutes and the slack are 16 GPU-hours, exactly twice a limit of 8."""
    Membership.objects.filter(user=alice).update(gpu_hours_per_week=8)
    half = box[0].memory_total_mb // 2
    assert queue_job(alice, gpus=4, memory_mb=half, minutes=479)
    with pytest.raises(Invalid, match="at most 479 minutes") as refused:
        queue_job(alice, gpus=4, memory_mb=half, minutes=480)
    assert refused.value.field == "time_limit_minutes"


def test_a_share_is_counted_at_the_largest_cards_it_could_get(alice, box, sent):
    """On an 80 GB server the same 12 GB counts far less of a card: not refused, as a booking there
    would pass."""
    server_report_ingest(snapshot=make_snapshot("big", gpus=4, memory_gb=80))
    Membership.objects.filter(user=alice).update(gpu_hours_per_week=8)
    half = box[0].memory_total_mb // 2
    assert queue_job(alice, gpus=4, memory_mb=half, minutes=600)
    with pytest.raises(Invalid, match='"GPU-hours per week" limit'):
        queue_job(alice, gpus=4, memory_mb=half, minutes=600, server="box1")


def test_a_booking_longer_than_two_weeks_needs_only_a_weeks_worth(alice, box, sent, settings):
    """Where BOOKING_MAX_HOURS allows 20 days, a 1-card job fills at most one whole week (168
    GPU-hours) in any week, wherever it starts: fine against 200 a week, though 2 x 200 < 480."""
    settings.BOOKING_MAX_HOURS = 30 * 24
    Membership.objects.filter(user=alice).update(gpu_hours_per_week=200)
    assert queue_job(alice, minutes=20 * 24 * 60)
    start = timezone.now() + H
    assert reservation_create(user=alice, gpus=[box[1].uuid], start=start, end=start + timedelta(days=20))
    Membership.objects.filter(user=alice).update(gpu_hours_per_week=160)
    with pytest.raises(Invalid, match='"GPU-hours per week" limit'):
        queue_job(alice, minutes=20 * 24 * 60)


def test_without_a_weekly_limit_nothing_changes(alice, box, sent):
    assert queue_job(alice, gpus=4, minutes=600).status == Job.Status.PENDING
    assert GPU.objects.count() == 4


# --- L4: a silent worker ---------------------------------------------------------------------------


def test_a_silent_hosts_jobs_go_to_a_host_whose_worker_reports(alice, box, sent, settings):
    server_report_ingest(snapshot=make_snapshot("box2", gpus=4))
    now = timezone.now()
    Server.objects.filter(name="box1").update(
        job_slots=4, job_slots_at=now - timedelta(seconds=10 * settings.JOB_RECONCILE_SECONDS)
    )
    slots_report("box2", slots=2, now=now)
    array = queue_job(alice, memory_mb=1024, array="0-3")

    assert schedule_pass(now=now)["started"] == 2
    tasks = Job.objects.filter(array=array.array)
    assert set(tasks.exclude(status=Job.Status.PENDING).values_list("server__name", flat=True)) == {"box2"}
    # The two left wait for box2's slots, but would fit on box1 now: they say why that is no use.
    assert all(
        "box1's worker has not reported for" in m
        for m in tasks.filter(status=Job.Status.PENDING).values_list("message", flat=True)
    )


# --- a start refused for a card taken since the plan read it keeps its place -------------------------


def test_a_wide_job_refused_for_a_taken_card_keeps_its_shadow_for_the_rest_of_the_pass(
    alice, bob, charlie, box, sent, monkeypatch
):
    """The plan starts alice's 4-card job, but charlie books one of its cards before the scheduler
    does: Conflict. Re-planned without it, bob's long 1-card job would take a card it waits for;
    kept as waiting with its shadow (from the end of charlie's booking), only bob's short job, which
    ends before then, starts."""
    from jobs.queue import scheduler

    now = timezone.now()
    wide = queue_job(alice, gpus=4, minutes=120)
    Job.objects.filter(pk=wide.pk).update(created_at=now - 2 * H)  # first in line
    long = queue_job(bob, minutes=120)
    Job.objects.filter(pk=long.pk).update(created_at=now - H)
    short = queue_job(bob, minutes=30)
    real = scheduler._start

    def raced(entry, at):
        if entry.request.job_id == wide.pk and not raced.done:  # between the plan and its start
            raced.done = reservation_create(user=charlie, gpus=[box[0].uuid], start=now, end=now + H)
        return real(entry, at)

    raced.done = None
    monkeypatch.setattr(scheduler, "_start", raced)
    done = schedule_pass(now=now)

    wide, long, short = fresh(wide), fresh(long), fresh(short)
    assert (wide.status, wide.pending_reason) == (Job.Status.PENDING, "resources")
    assert wide.message.startswith("Waiting: ")
    assert long.status == Job.Status.PENDING and long.pending_reason == "priority"
    assert short.status == Job.Status.QUEUED
    assert done["started"] == 1 and done["pending"] == 2
    held = queue_holds([gpu.uuid for gpu in box], now, now + 3 * H)
    assert {h.job_id for h in held} == {wide.pk} and min(h.start for h in held) == now + H


def test_a_conflict_is_still_this_jobs_alone(alice, bob, box, sent, monkeypatch):
    """A job whose every start meets a Conflict waits; the others start as before."""
    from jobs.queue import scheduler

    stuck = queue_job(alice)
    Job.objects.filter(pk=stuck.pk).update(created_at=timezone.now() - H)
    other = queue_job(bob)
    real = scheduler.reservation_create

    def refuse(**kwargs):
        if kwargs["user"] == alice:
            raise Conflict("box1 GPU 0 was booked meanwhile.", field="gpus")
        return real(**kwargs)

    monkeypatch.setattr(scheduler, "reservation_create", refuse)
    schedule_pass()
    assert fresh(other).status == Job.Status.QUEUED
    assert fresh(stuck).status == Job.Status.PENDING and fresh(stuck).message.startswith(
        "Waiting: box1 GPU 0"
    )
