"""The job page says where a job that is not running yet will run, or that nobody knows yet.

A job on a booking, or a queued job the scheduler booked: its booking's server, cards and share,
from the booking's start. A pending queued job: the queue's plan (the cards its estimate holds),
or one line saying it is not placed yet and why. A job that runs or has ended says none of it.
"""

from __future__ import annotations

import re
from datetime import timedelta

from django.urls import reverse
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import Server
from jobs.models import Job
from jobs.queue.scheduler import schedule_pass
from jobs.submit import ScriptUpload, job_submit
from portal.timefmt import format_time
from tests.factories import fresh, queue_job

H = timedelta(hours=1)


def runs_on(client, job: Job, *, poll: bool = False) -> str:
    """The page's "Runs on" line, in plain words; '' when the page has none."""
    url = reverse("job_detail", args=[job.pk]) + ("?part=status" if poll else "")
    html = client.get(url).content.decode()
    found = re.search(r'<dd id="job-placement">(.*?)</dd>', html, re.S)
    return " ".join(re.sub(r"<[^>]+>", "", found.group(1)).split()) if found else ""


def test_a_pending_job_shows_the_cards_the_queue_plans_for_it(client, alice, bob, box, sent):
    until = timezone.now() + 2 * H
    reservation_create(user=bob, gpus=[g.uuid for g in box[:3]], end=until)
    reservation_create(user=bob, gpus=[box[3].uuid], end=until + H)
    job = queue_job(alice, gpus=2, minutes=30)
    schedule_pass()
    client.force_login(alice)

    line = runs_on(client, job)

    assert fresh(job).status == Job.Status.PENDING
    assert line.startswith("box1 · GPU 0, GPU 1 (") and "whole cards" in line
    assert re.search(r"the queue's plan, from about \w{3} \d{4}-\d\d-\d\d \d\d:\d\d", line)
    assert "an estimate: it books the cards when it starts the job" in line
    assert runs_on(client, job, poll=True) == line  # its refresh keeps the plan's cards and time


def test_a_pending_job_the_queue_cannot_place_says_so_in_one_line(client, alice, box, sent):
    Server.objects.filter(name="box1").update(draining=True)
    job = queue_job(alice, server="box1", memory_mb=8192)
    schedule_pass()
    client.force_login(alice)

    assert runs_on(client, job) == (
        "The queue has not placed it yet: the chosen server is draining; it asked for box1."
    )
    # The live part, read again, says the same.
    assert runs_on(client, job, poll=True) == runs_on(client, job)


def test_a_job_that_asked_for_a_later_start_says_when(client, alice, box, sent):
    later = (timezone.now() + 3 * H).replace(second=0, microsecond=0)
    job = queue_job(alice, begin_at=later)
    schedule_pass()
    client.force_login(alice)

    assert runs_on(client, job) == (
        f"The queue has not placed it yet: it asked for a later start; estimated start {format_time(later)}."
    )


def test_a_job_the_scheduler_booked_shows_its_booking(client, alice, box, sent):
    job = queue_job(alice, gpus=2, memory_mb=8192)
    schedule_pass()
    job = fresh(job)
    client.force_login(alice)

    assert job.status == Job.Status.QUEUED
    assert runs_on(client, job) == (
        f"box1 · GPU 0, GPU 1 ({box[0].name}) · 8192 MiB of each card"
        f" · booked from {format_time(job.not_before)}"
    )


def test_a_job_on_a_later_booking_shows_where_and_from_when(client, alice, box, sent):
    start = (timezone.now() + 2 * H).replace(second=0, microsecond=0)
    booking = reservation_create(user=alice, gpus=[box[2].uuid], start=start, end=start + H)
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="t.py", content=b"print(1)\n"))
    client.force_login(alice)

    assert (
        runs_on(client, job)
        == f"box1 · GPU 2 ({box[2].name}) · whole card · booked from {format_time(start)}"
    )


def test_a_running_or_finished_job_shows_no_placement_and_never_says_queued(client, alice, box, sent):
    job = queue_job(alice)
    schedule_pass()
    client.force_login(alice)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, started_at=timezone.now())
    assert runs_on(client, job) == ""

    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED, finished_at=timezone.now())
    html = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    status = re.search(r'<section id="job-status".*?</section>', html, re.S).group(0)

    assert runs_on(client, job) == ""
    assert "Succeeded" in status and not re.search(r"queued|Starts|Waits", status)
    assert "released when the job ends" not in html and "(booked by the queue for this job)" in html
