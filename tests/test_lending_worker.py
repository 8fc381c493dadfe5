"""Lending end to end (issue 36): real Celery workers (the portal's: collector, scheduler; a
simulated GPU host's: jobs, telemetry, watchdog), real Redis, a real TensorFlow subprocess.

alice's booking has sat idle; the scheduler lends its card to bob's preemptible Keras job. alice
starts a process on her card: the telemetry shows it, the borrower is preempted at once (its
grace LEND_GRACE_SECONDS), goes back to the queue, resumes from its checkpoint on another card and
succeeds; alice's process is never taken for an intruder."""

from __future__ import annotations

import getpass
import io
import re
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from gpus.booking import reservation_create, reservation_release
from gpus.models import GPU, Reservation, Violation
from gpus.simulated.inventory import server_names
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal.models import Profile
from tests.factories import MembershipFactory, UserFactory
from tests.isolation import SIMULATED_PROCESSES_FILE
from tests.job_helpers import job_log
from tests.test_preemption_worker import EPOCHS, SCRIPT
from tests.waiting import wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def cards(start_worker, settings) -> list[GPU]:
    settings.SIMULATED_PROCESSES_FILE = SIMULATED_PROCESSES_FILE
    name = server_names()[0]
    start_worker(None)  # the collector, the reconciler, the scheduler, the idle clock
    start_worker(name, extra_env={"LEND_GRACE_SECONDS": "5", "WATCHDOG_STOP_AFTER_SECONDS": "1"})
    wait_for(lambda: GPU.objects.filter(server__name=name).count() >= 4, timeout=60, what="the cards")
    return list(GPU.objects.filter(server__name=name).order_by("index"))


def test_the_owner_takes_a_lent_card_back_and_the_borrower_resumes_elsewhere(cards, alice, bob, team):
    # alice's processes are hers: the OS account running this test is her Unix account.
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": getpass.getuser()})
    carol = MembershipFactory(team=team, user=UserFactory(username="carol")).user
    end = timezone.now() + timedelta(hours=4)
    held = [reservation_create(user=carol, gpus=[c.uuid], end=end) for c in cards[1:]]
    booking = reservation_create(user=alice, gpus=[cards[0].uuid], end=end)
    now = timezone.now()  # idle for 20 minutes, the clock still running (gpus/idle.py)
    Reservation.objects.filter(pk=booking.pk).update(
        idle_since=now - timedelta(minutes=20), idle_counted_until=now
    )

    job = job_submit(
        user=bob,
        gpu_count=1,
        time_limit_minutes=30,
        preemptible=True,
        script=ScriptUpload("fit.py", SCRIPT),
    )
    wait_for(lambda: "finished epoch 2" in job_log(job.pk), timeout=120, what="two epochs on the lent card")
    job.refresh_from_db()
    assert job.reservation.lent_from_id == booking.pk and job.gpu_uuids == [cards[0].uuid]
    reservation_release(user=carol, reservation=held[-1])  # a card for the borrower's next run

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        back_at = time.monotonic()
        call_command(
            "simulate_gpu_process", gpu=cards[0].uuid, pid=owner.pid, memory_mb=1024, stdout=io.StringIO()
        )
        wait_for(
            lambda: Job.objects.get(pk=job.pk).preemptions == 1, timeout=60, what="the borrower to leave"
        )
        waited = time.monotonic() - back_at
        print(f"alice waited {waited:.1f} s from her process to the borrower leaving")
        wait_for(
            lambda: Job.objects.get(pk=job.pk).status == Job.Status.SUCCEEDED,
            timeout=180,
            what="its next run",
        )
        assert not Violation.objects.filter(pid=owner.pid, kind="intruder").exists()
        assert owner.poll() is None  # alice's process runs on, untouched
    finally:
        owner.kill()
        owner.wait()

    job.refresh_from_db()
    log = job_log(job.pk)
    assert waited <= 30, f"alice waited {waited:.1f} s for her card"
    assert job.gpu_uuids == [cards[3].uuid] and job.reservation.lent_from_id is None  # another card
    assert "started using it (process" in log
    back = log.index("[portal] back from the queue: this job was preempted once")
    done_before = max(int(n) for n in re.findall(r"finished epoch (\d+)", log[:back]))
    epochs = [int(n) for n in re.findall(r"Epoch (\d+)/6", log[back:])]
    assert epochs == list(range(done_before + 1, EPOCHS + 1)), log
