"""What gpus asks jobs, as plain calls (issue 20): which job a process runs for and which jobs
finished are answered through gpus.hooks, filled in by JobsConfig.ready(), not by signals."""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from gpus import hooks
from gpus.booking import reservation_create
from jobs.models import Job
from jobs.queue.scheduler import queue_holds
from jobs.selectors import jobs_finished_between, jobs_owned_by
from jobs.services import jobs_by_session
from jobs.submit import ScriptUpload, job_submit

ROOT = Path(__file__).resolve().parent.parent


def test_the_jobs_app_answers_gpus_questions():
    answers = hooks.answers_now()
    assert answers.job_sessions is jobs_by_session
    assert answers.job_outcomes is jobs_finished_between
    assert answers.own_jobs is jobs_owned_by
    assert answers.queue_holds is queue_holds


def test_with_no_answer_registered_gpus_hears_none():
    before = hooks.answered_by(hooks.NO_ANSWERS)
    try:
        now = timezone.now()
        assert hooks.job_sessions({1: {100}}) == {}
        assert hooks.interactive_sessions({1: {100}}) == {}
        assert hooks.job_outcomes(now - timedelta(hours=1), now) == []
        assert hooks.own_jobs(object(), [1, 2]) == ()
        assert hooks.work_on_booking(1) == []
        assert hooks.queue_holds(["GPU-1"], now, now + timedelta(hours=1)) == []
    finally:
        hooks.answered_by(before)


def test_no_signal_of_gpus_is_sent_for_an_answer():
    """A Signal whose receivers' return values are read is a call "go to definition" cannot follow."""
    for path in (ROOT / "gpus").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.For) and isinstance(node.iter, ast.Call):
                func = node.iter.func
                assert not (isinstance(func, ast.Attribute) and func.attr == "send"), (
                    f"{path.relative_to(ROOT)}:{node.lineno} reads a signal's answers"
                )


@pytest.mark.django_db
def test_finished_jobs_are_the_rollups_outcomes(alice, box):
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=4096)
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="s.py", content=b"pass\n"))
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED, finished_at=now)
    (outcome,) = hooks.job_outcomes(now - timedelta(minutes=1), now + timedelta(minutes=1))
    assert outcome == hooks.JobOutcome(now, box[0].uuid, alice.pk, booking.team_id, Job.Status.SUCCEEDED)
    assert hooks.job_outcomes(now + timedelta(minutes=1), now + timedelta(minutes=2)) == []
