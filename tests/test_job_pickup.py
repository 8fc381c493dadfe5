"""A message is a nudge, the row the record: a queued job whose Celery message was lost (Redis
killed, restarted empty, flushed) is sent again by its host once that host has a free slot, and
a job that waits behind a busy host gets no second message (jobs/host/pickup.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.services import server_report_ingest
from gpus.simulated.inventory import server_names
from jobs.host.pickup import HostPickup, stranded_jobs
from jobs.logs.store import log_stream
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from tests.factories import make_snapshot
from tests.waiting import wait_for


def _submit(alice, uuid: str, source: bytes = b"print('ran')\n") -> Job:
    booking = reservation_create(user=alice, gpus=[uuid], memory_mb=4096)
    return job_submit(user=alice, reservation=booking, script=ScriptUpload(name="j.py", content=source))


@pytest.mark.django_db
def test_only_a_host_with_a_free_slot_finds_stranded_jobs(alice, box, sent):
    waiting = _submit(alice, box[0].uuid)
    an_hour_ago = timezone.now() - timedelta(hours=1)
    Job.objects.filter(pk=waiting.pk).update(dispatched_at=an_hour_ago)
    now = timezone.now()
    assert [j.pk for j in stranded_jobs("box1", slots=1, now=now)] == [waiting.pk]
    running = _submit(alice, box[1].uuid)
    Job.objects.filter(pk=running.pk).update(status=Job.Status.RUNNING)
    assert stranded_jobs("box1", slots=1, now=now) == []  # busy: its message may still be in Redis
    assert [j.pk for j in stranded_jobs("box1", slots=2, now=now)] == [waiting.pk]


@pytest.mark.django_db(transaction=True)
def test_a_stranded_job_is_sent_again_once_after_two_rounds(alice, box, sent, settings):
    settings.JOB_RECONCILE_SECONDS = 1
    job = _submit(alice, box[0].uuid)
    assert sent == [(job.pk, "host.box1")]  # its first message, which Redis then lost
    Job.objects.filter(pk=job.pk).update(dispatched_at=timezone.now() - timedelta(minutes=5))
    pickup = HostPickup("box1", slots=1)
    pickup.step()
    assert len(sent) == 1  # seen once: a message may be on its way
    pickup.step()
    assert sent == [(job.pk, "host.box1")] * 2  # seen twice: sent again
    pickup.step()
    pickup.step()
    assert len(sent) == 2  # just sent: nothing more until that one has had its chance


@pytest.mark.worker
def test_a_job_whose_message_was_lost_runs_once_its_host_is_free(alice, start_worker, sent):
    host = server_names()[0]
    server_report_ingest(snapshot=make_snapshot(host, gpus=4, simulated=True))
    job = _submit(alice, f"GPU-{host}-00")
    assert sent == [(job.pk, f"host.{host}")]  # never reached Redis: as if Redis lost it
    start_worker(host, extra_env={"JOB_RECONCILE_SECONDS": "1"})
    wait_for(
        lambda: Job.objects.get(pk=job.pk).status == Job.Status.SUCCEEDED, timeout=60, what="the job to run"
    )
    log = b"".join(log_stream(job.pk)).decode()
    assert log.count("ran\n") == 1


@pytest.mark.django_db(transaction=True)
def test_each_round_tells_the_queue_how_many_jobs_the_worker_runs_at_once(box):
    from gpus.models import Server

    HostPickup("box1", slots=3).step()
    server = Server.objects.get(name="box1")
    assert server.job_slots == 3 and server.job_slots_at is not None
