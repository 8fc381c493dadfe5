"""The GPU watchdog end to end, as a newcomer meets it under `make run`: real workers for a
simulated host, a real process declared on a booked card (manage.py simulate_gpu_process), the
violation recorded, told and stopped; a real job over its memory stopped by its supervisor."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import GPU, Violation
from gpus.simulated.inventory import server_names
from jobs.logs.store import log_stream
from jobs.models import Job
from portal.models import Notification
from tests.isolation import SIMULATED_PROCESSES_FILE
from tests.waiting import wait_for

pytestmark = pytest.mark.worker

SLEEPER = b"import time\nprint('ready', flush=True)\ntime.sleep(120)\n"


@pytest.fixture
def declarations(settings):
    """The file the test's host worker reads: this test process's own (tests/isolation.py),
    emptied before each worker test (tests/celery_workers.py)."""
    settings.SIMULATED_PROCESSES_FILE = SIMULATED_PROCESSES_FILE
    return SIMULATED_PROCESSES_FILE


@pytest.fixture
def cards(start_worker, declarations) -> list[GPU]:
    name = server_names()[0]
    start_worker(None)  # the collector
    start_worker(name, extra_env={"WATCHDOG_STOP_AFTER_SECONDS": "1", "JOB_KILL_GRACE_SECONDS": "1"})
    wait_for(lambda: GPU.objects.filter(server__name=name).count() >= 4, timeout=60, what="the cards")
    return list(GPU.objects.filter(server__name=name).order_by("index"))


def _declare(card: GPU, pid: int, memory_mb: int) -> None:
    call_command("simulate_gpu_process", gpu=card.uuid, pid=pid, memory_mb=memory_mb, stdout=io.StringIO())


def test_an_intruder_on_a_booked_card_is_flagged_told_and_stopped(cards, alice):
    reservation_create(user=alice, gpus=[cards[0].uuid])
    intruder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
    )
    try:
        _declare(cards[0], intruder.pid, 2048)
        violation = wait_for(
            lambda: Violation.objects.filter(pid=intruder.pid, kind="intruder").first(),
            timeout=20,
            what="the flag",
        )
        assert violation.gpu_id == cards[0].uuid and violation.memory_mb == 2048
        # Recorded first, then told: the row may show a moment before the notification.
        wait_for(
            lambda: Notification.objects.filter(user=alice, kind="intruder").exists(),
            timeout=10,
            what="alice to be told",
        )
        assert intruder.wait(timeout=30) < 0  # stopped after its 1 s grace
        wait_for(
            lambda: Violation.objects.get(pk=violation.pk).action == "stopped",
            timeout=20,
            what="NVML confirms",
        )
    finally:
        intruder.kill()
        intruder.wait()


def test_a_job_over_its_memory_is_stopped_and_fails_with_the_reason(cards, alice):
    api = APIClient()
    api.force_authenticate(alice)
    booking = reservation_create(user=alice, gpus=[cards[1].uuid], memory_mb=1024)
    response = api.post(
        "/api/v1/jobs/",
        {"reservation": booking.pk, "script": SimpleUploadedFile("hog.py", SLEEPER)},
        format="multipart",
    )
    job_id = response.json()["id"]
    wait_for(lambda: b"ready" in b"".join(log_stream(job_id)), timeout=60, what="the job's first line")
    job = Job.objects.get(pk=job_id)
    _declare(cards[1], job.pid, 4096)  # as if it allocated 4 GiB on its 1 GiB share

    wait_for(lambda: Job.objects.get(pk=job_id).status == Job.Status.FAILED, timeout=30, what="the stop")
    job = Job.objects.get(pk=job_id)
    assert job.message.startswith("Stopped by the GPU watchdog: over_memory")
    assert "4 GiB" in job.message and "1 GiB" in job.message
    log = b"".join(log_stream(job_id)).decode()
    assert "Stopped by the GPU watchdog" in log  # the job's log says why
    violation = Violation.objects.get(kind="over_memory", job_id=job_id)
    wait_for(lambda: Violation.objects.get(pk=violation.pk).action == "stopped", timeout=20, what="the end")
