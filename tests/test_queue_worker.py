"""The queue end to end: the portal's worker runs the scheduler, a simulated host runs the job."""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from gpus.booking import reservation_create, reservation_release
from gpus.models import GPU, Reservation
from gpus.simulated import server_names
from jobs.logs import log_stream
from jobs.models import Job
from tests.conftest import wait_for

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
