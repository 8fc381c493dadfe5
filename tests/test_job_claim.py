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


@pytest.mark.django_db(transaction=True)  # the retry closes the connection, as after an outage
def test_a_claim_that_committed_but_whose_answer_was_lost_is_still_this_workers(
    alice, box, sent, monkeypatch, settings
):
    """A restart that cuts the connection between the claim's COMMIT and its answer (PostgreSQL
    stopped "immediate" in the storm test): the claim took the job, and its retry must know that,
    or the job is left STARTING with nothing running it, marked lost JOB_LOST_AFTER_SECONDS later
    ("the worker or its host died"), never run, and holding a job slot of its host until then."""
    settings.JOB_END_WAIT_SECONDS = 30
    booking = reservation_create(user=alice, gpus=[box[0].uuid])
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="a.py", content=b"print(1)\n"))
    transition, failures = Job.objects.transition, []

    def committed_answer_lost(*args, **kwargs):  # type: ignore[no-untyped-def]
        made = transition(*args, **kwargs)
        if not failures:
            failures.append(made)
            raise OperationalError("server closed the connection unexpectedly")
        return made

    monkeypatch.setattr(Job.objects, "transition", committed_answer_lost)
    monkeypatch.setattr(launch.time, "sleep", lambda seconds: None)
    claimed = launch.job_claim(job.pk)
    assert failures == [True]  # the first try's UPDATE committed
    assert claimed is not None, (
        "the worker took its own committed claim for someone else's: nobody runs the job"
    )
    assert claimed.status == Job.Status.STARTING
