"""The queue end to end: the portal's worker runs the scheduler, a simulated host runs the job."""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db.models import Q
from rest_framework.test import APIClient

from gpus.booking import reservation_create, reservation_release
from gpus.models import GPU, Reservation
from gpus.simulated.inventory import server_names
from jobs.logs.store import log_stream
from jobs.models import Job
from tests.waiting import wait_for

pytestmark = pytest.mark.worker


@pytest.fixture
def cards(start_worker) -> list[GPU]:
    name = server_names()[0]
    start_worker(None)  # the collector, the reconciler and the scheduler
    start_worker(name)
    wait_for(lambda: GPU.objects.filter(server__name=name).count() >= 4, timeout=60, what="the cards")
    return list(GPU.objects.filter(server__name=name).order_by("index"))


def test_a_queued_job_starts_when_a_card_frees_up_runs_and_gives_it_back(cards, alice, bob):
    held = reservation_create(user=bob, gpus=[c.uuid for c in cards])
    api = APIClient()
    api.force_authenticate(alice)
    response = api.post(
        "/api/v1/jobs/",
        {
            "script": SimpleUploadedFile(
                "q.py", b"import os\nprint('index', os.environ.get('PORTAL_ARRAY_INDEX'))\n"
            ),
            "gpu_count": 1,
            "time_limit_minutes": 5,
            "array": "7",
        },
        format="multipart",
    )
    job_id = response.json()["id"]
    wait_for(lambda: Job.objects.get(pk=job_id).pending_reason == "resources", timeout=20, what="a pass")

    reservation_release(user=bob, reservation=held)  # wakes the scheduler after commit

    wait_for(lambda: Job.objects.get(pk=job_id).status == Job.Status.SUCCEEDED, timeout=60, what="the run")
    job = Job.objects.get(pk=job_id)
    assert job.reservation.owner == alice and len(job.gpu_uuids) == 1
    wait_for(
        lambda: Reservation.objects.get(pk=job.reservation_id).released_at is not None,
        timeout=20,
        what="release",
    )
    assert "index 7" in b"".join(log_stream(job_id)).decode()


def test_a_host_gets_no_more_jobs_at_once_than_its_worker_runs(cards, alice):
    """The host's worker (solo pool: one at a time) says so; an array of four small jobs then runs
    one after another, none of them waiting in Celery on a running booking."""
    from gpus.models import Server

    name = cards[0].server.name
    wait_for(lambda: Server.objects.get(name=name).job_slots == 1, timeout=30, what="the worker's slots")
    api = APIClient()
    api.force_authenticate(alice)
    response = api.post(
        "/api/v1/jobs/",
        {
            "script": SimpleUploadedFile("nap.py", b"import time\ntime.sleep(1)\n"),
            "gpu_count": 1,
            "memory_mb": 1024,
            "time_limit_minutes": 5,
            "array": "0-3",
        },
        format="multipart",
    )
    array_id = response.json()["array_id"]
    tasks = Job.objects.filter(array_id=array_id)
    held = Q(status__in=(Job.Status.STARTING, Job.Status.RUNNING)) | Q(
        status=Job.Status.QUEUED, dispatched_at__isnull=False
    )
    most = 0

    def all_done() -> bool:
        nonlocal most
        most = max(most, tasks.filter(held).count())
        return tasks.filter(status=Job.Status.SUCCEEDED).count() == 4

    wait_for(all_done, timeout=90, interval=0.05, what="the four tasks, one after another")
    assert most == 1
