"""The host's claim of a sent job (jobs.host.launch.job_claim) while the database is away: the
message was acked when the task started, so a claim that failed left the job queued and taken for
sent, never sent again (tests/test_faults.py's storm found one queued job 60 s after a restart)."""

from __future__ import annotations

import pytest
from django.db import OperationalError

from gpus.booking import reservation_create
from jobs.host import launch
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit


@pytest.mark.django_db(transaction=True)  # the retry closes the connection, as after an outage
def test_a_claim_while_the_database_is_away_is_tried_again_and_taken(alice, box, sent, monkeypatch, settings):
    settings.JOB_END_WAIT_SECONDS = 30
    booking = reservation_create(user=alice, gpus=[box[0].uuid])
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="a.py", content=b"print(1)\n"))
    assert Job.objects.get(pk=job.pk).status == Job.Status.QUEUED
    transition, failures = Job.objects.transition, []

    def away_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not failures:
            failures.append(1)
            raise OperationalError("server closed the connection unexpectedly")
        return transition(*args, **kwargs)

    monkeypatch.setattr(Job.objects, "transition", away_once)
    monkeypatch.setattr(launch.time, "sleep", lambda seconds: None)  # the retry's 2 s
    claimed = launch.job_claim(job.pk)
    assert failures == [1] and claimed is not None and claimed.status == Job.Status.STARTING


@pytest.mark.django_db
def test_a_worker_claims_only_a_job_of_its_own_server(alice, box, sent, settings):
    """A message that reached another server's worker late (its job was put back in the queue
    and sent elsewhere meanwhile, jobs.preemption) runs nothing there: the job stays queued for
    the server its row names."""
    booking = reservation_create(user=alice, gpus=[box[0].uuid])
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="a.py", content=b"print(1)\n"))
    settings.WORKER_SERVER = "box2"
    assert launch.job_claim(job.pk) is None
    assert Job.objects.get(pk=job.pk).status == Job.Status.QUEUED
    settings.WORKER_SERVER = "box1"
    assert launch.job_claim(job.pk).status == Job.Status.STARTING
