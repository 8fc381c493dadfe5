"""The explainable queue (issue 36): every waiting job's reason and estimated start, and what the
estimate rests on (`estimate_basis`): the running jobs' typical run times (their owners' recent
runs of the script) else their time limits, bookings, and lending. The API and `gpu queue` as their
clients call them; the scheduler's passes keep planning by time limits."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import Reservation
from gpus.services import servers_report_ingest
from jobs.models import Job
from jobs.queue.rules import START_SLACK
from jobs.queue.scheduler import queue_plan, schedule_pass
from jobs.submit import ScriptUpload
from tests.factories import MembershipFactory, UserFactory, make_snapshot, queue_job
from tests.test_cli import gpu, portal  # noqa: F401 - the live server and the CLI as a user runs it

M = timedelta(minutes=1)


@pytest.fixture
def api(bob) -> APIClient:
    client = APIClient()
    client.force_authenticate(bob)
    return client


def _history(user, minutes: list[int], name: str = "train.py") -> None:
    """Finished runs of `name` by `user`, newest first, each `minutes` long."""
    end = timezone.now() - timedelta(days=1)
    for m in minutes:
        job = queue_job(user, script=ScriptUpload(name=name, content=b"print(1)\n"))
        Job.objects.filter(pk=job.pk).update(
            status=Job.Status.SUCCEEDED, started_at=end - m * M, finished_at=end, exit_code=0
        )
        end -= timedelta(hours=1)


def _running_wide_job(alice, minutes: int = 120) -> Job:
    """alice's job on all four cards, running since now."""
    job = queue_job(alice, gpus=4, minutes=minutes)
    assert schedule_pass()["started"] == 1
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, started_at=timezone.now())
    job.refresh_from_db()
    return job


def _row(api: APIClient, job: Job) -> dict:
    rows = api.get("/api/v1/queue/").json()["results"]
    return next(r for r in rows if r["job"] == job.pk)


def _at(row: dict) -> datetime:
    return datetime.fromisoformat(row["estimated_start"])


def test_the_estimate_counts_on_the_running_jobs_typical_run_time(api, alice, bob, box, sent):
    _history(alice, [20, 30, 40, 35, 25])  # typical (median): 30 minutes
    running = _running_wide_job(alice)
    waiting = queue_job(bob, gpus=2, minutes=60)
    schedule_pass()
    row = _row(api, waiting)
    assert row["reason"] == "resources" and row["estimate_basis"] == "plan"
    assert abs(_at(row) - (running.started_at + 30 * M)) < M
    # The scheduler's own plan still holds the running job's cards to its time limit.
    (entry,) = [e for e in queue_plan() if e.request.job_id == waiting.pk]
    assert entry.estimated_start == running.reservation.end


def test_the_estimate_counts_on_the_typical_run_of_the_jobs_ahead_too(alice, box, sent):
    """A wide job waiting ahead holds the cards for its typical run in the shown plan; the job
    behind still needs its whole time limit free, as the scheduler books it."""
    _history(alice, [20, 30, 40])  # typical: 30 minutes, under a time limit of 120
    running = _running_wide_job(alice, minutes=60)
    ahead = queue_job(alice, gpus=4, minutes=120)  # train.py too
    behind = queue_job(alice, gpus=4, minutes=60, script=ScriptUpload(name="mine.py", content=b"1\n"))
    schedule_pass()
    client = APIClient()
    client.force_authenticate(alice)
    row_ahead, row_behind = _row(client, ahead), _row(client, behind)
    assert abs(_at(row_ahead) - (running.started_at + 30 * M)) < M
    assert abs(_at(row_behind) - (_at(row_ahead) + 31 * M)) < M  # its typical run, and START_SLACK
    # The scheduler's own plan: the time limits.
    entries = {e.request.job_id: e for e in queue_plan()}
    assert entries[behind.pk].estimated_start == entries[ahead.pk].estimated_start + ahead_booked(ahead)


def ahead_booked(job: Job) -> timedelta:
    return timedelta(minutes=job.time_limit_minutes) + START_SLACK


def test_without_enough_history_the_time_limit_stands(api, alice, bob, box, sent):
    _history(alice, [20, 30])  # two runs: an anecdote
    _history(alice, [5, 5, 5], name="other.py")  # another script says nothing of this one
    running = _running_wide_job(alice)
    waiting = queue_job(bob, gpus=1, minutes=60)
    row = _row(api, waiting)
    assert _at(row) == running.reservation.end and row["estimate_basis"] == "plan"


def test_a_job_past_its_typical_time_ends_any_minute_now(api, alice, bob, box, sent):
    _history(alice, [10, 10, 10])
    running = _running_wide_job(alice)
    Job.objects.filter(pk=running.pk).update(started_at=timezone.now() - 50 * M)
    waiting = queue_job(bob, gpus=1, minutes=30)
    row = _row(api, waiting)
    assert timezone.now() < _at(row) <= timezone.now() + 2 * M


def test_bookings_count_in_the_estimate(api, alice, bob, box, sent):
    later = timezone.now() + timedelta(hours=3)
    reservation_create(user=alice, gpus=[g.uuid for g in box], end=later)
    waiting = queue_job(bob, gpus=1, minutes=30)
    row = _row(api, waiting)
    assert row["reason"] == "resources" and _at(row) == later and row["estimate_basis"] == "plan"


def test_a_preemptible_job_that_a_lent_booking_fits_starts_on_the_next_pass(api, alice, bob, box, sent, team):
    carol = MembershipFactory(team=team, user=UserFactory(username="carol")).user
    end = timezone.now() + timedelta(hours=8)
    reservation_create(user=carol, gpus=[g.uuid for g in box[1:]], end=end)
    idle = reservation_create(user=alice, gpus=[box[0].uuid], end=end)
    Reservation.objects.filter(pk=idle.pk).update(idle_since=timezone.now() - 20 * M)
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=0)])  # nobody on its cards
    ordinary = queue_job(bob, minutes=60)
    preemptible = queue_job(bob, minutes=60, preemptible=True)
    lent, waits = _row(api, preemptible), _row(api, ordinary)
    assert lent["estimate_basis"] == "lending" and _at(lent) <= timezone.now()
    assert waits["estimate_basis"] == "plan" and _at(waits) == end  # ordinary jobs never borrow
    assert Reservation.objects.filter(lent_from=idle).count() == 0  # the estimate books nothing


def test_a_job_asking_for_a_later_start_says_so(api, bob, box, sent):
    begin = (timezone.now() + timedelta(hours=2)).replace(microsecond=0)
    waiting = queue_job(bob, begin_at=begin)
    row = _row(api, waiting)
    assert row["reason"] == "begin_time" and _at(row) == begin and row["estimate_basis"] == "begin_time"


@pytest.mark.usefixtures("portal")
def test_gpu_queue_shows_the_reason_estimate_and_basis(alice, box, sent):
    reservation_create(user=alice, gpus=[g.uuid for g in box], end=timezone.now() + timedelta(hours=3))
    job = queue_job(alice, gpus=1, minutes=30)
    (row,) = json.loads(gpu("queue", "--json").output)
    assert (row["job"], row["reason"], row["estimate_basis"]) == (job.pk, "resources", "plan")
    assert row["estimated_start"] is not None
    table = gpu("queue")
    assert table.exit_code == 0 and "resources" in table.output and "(plan)" in table.output
