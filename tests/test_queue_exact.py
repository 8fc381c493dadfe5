"""The queue, quieter and more exact: a JupyterLab session fills a slot of its host's worker as a
job does (jobs.host.pickup, jobs.queue.scheduler), and a Redis outage is one line for the scheduler, not a
traceback every pass."""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from jobs.host.pickup import slots_report, stranded_jobs
from jobs.models import InteractiveSession, Job
from jobs.queue.scheduler import Scheduler, schedule_pass
from jobs.submit import ScriptUpload, job_submit
from tests.factories import queue_job
from tests.fault_servers import ThrowawayRedis


def _lab(alice, uuid_: str, status: str = InteractiveSession.Status.RUNNING) -> InteractiveSession:
    booking = reservation_create(user=alice, gpus=[uuid_], memory_mb=4096)
    return InteractiveSession.objects.create(
        owner=alice,
        reservation=booking,
        server=booking.allocations.first().gpu.server,
        kind=InteractiveSession.Kind.JUPYTERLAB,
        status=status,
        worker="box1-host",
        command=["jupyter", "lab"],
    )


@pytest.mark.django_db
def test_a_running_lab_fills_a_slot_so_a_job_behind_it_is_not_sent_again(alice, box, sent):
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=4096)
    waiting = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="j.py", content=b"1\n"))
    Job.objects.filter(pk=waiting.pk).update(dispatched_at=timezone.now() - timedelta(hours=1))
    now = timezone.now()
    _lab(alice, box[1].uuid, status=InteractiveSession.Status.ENDED)  # over: it holds nothing
    assert [j.pk for j in stranded_jobs("box1", slots=1, now=now)] == [waiting.pk]
    _lab(alice, box[2].uuid)
    assert stranded_jobs("box1", slots=1, now=now) == []  # its one slot runs the lab
    assert [j.pk for j in stranded_jobs("box1", slots=2, now=now)] == [waiting.pk]


@pytest.mark.django_db
def test_the_scheduler_counts_a_hosts_labs_as_busy_slots(alice, box, sent):
    queue_job(alice, memory_mb=1024, array="0-9")
    _lab(alice, box[3].uuid)
    _lab(alice, box[3].uuid, status=InteractiveSession.Status.STARTING)  # its message is sent: a slot too
    slots_report("box1", slots=3, now=timezone.now())
    assert schedule_pass()["started"] == 1  # 3 slots, 2 of them the labs'


# --- a Redis outage, said once ---------------------------------------------------------------------


@pytest.fixture
def broker() -> Iterator[ThrowawayRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server on PATH (apt install redis-server)")
    server = ThrowawayRedis(tag=uuid.uuid4().hex)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.mark.faults
def test_the_scheduler_says_a_redis_outage_once_and_its_end_once(broker, settings, caplog):
    settings.REDIS_URL = broker.url
    thread = Scheduler()
    thread.interval = 0.05  # its plain pause while Redis is away: many passes within the test
    with caplog.at_level(logging.DEBUG, logger="jobs.queue.scheduler"):
        thread.pause()  # Redis answers: it waits for a wake-up (1 s)
        broker.stop()
        for _ in range(30):
            thread.pause()
        broker.start()  # the same port
        thread.pause()
        thread.pause()
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "WARNING"], said
    assert said[0][1].startswith("Queue scheduler: Redis (the task queue) is away (")
    assert said[1][1] == "Queue scheduler: Redis (the task queue) answers again; wake-ups are back"
    assert not any(r.exc_info for r in caplog.records)
