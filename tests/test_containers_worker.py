"""A containerised job whose host worker is SIGKILLed (issue 34, docs/containers.md): the `podman
run` client dies with the worker, the container does not (conmon holds it). The next start of the
worker ends what it can prove the job's (kill_orphans, by the session Job.pid names: the
container's init), then removes the container with whatever still ran in it, a process that left
the job's session too, and says so. Real Celery workers, real root-run Podman."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import ContainerImage, Server
from gpus.services import server_report_ingest
from gpus.simulated.inventory import server_names
from jobs.host.containers import podman
from jobs.models import Job
from portal.models import AuditEntry
from tests.container_image import fake_gpu_nodes, need_containers, rootfs
from tests.factories import make_snapshot
from tests.job_helpers import job_log
from tests.waiting import wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

FAST_LOST = {"JOB_LOST_AFTER_SECONDS": "10", "JOB_HEARTBEAT_SECONDS": "1", "JOB_RECONCILE_SECONDS": "1"}

# Ignores SIGTERM; a grandchild leaves the job's session (setsid): no session proves it the job's.
DETACHED = b"""
import os, subprocess, sys, time
deaf = "import time; time.sleep(300)"
detached = subprocess.Popen([sys.executable, "-c", deaf], start_new_session=True)
print("ready", detached.pid, flush=True)
time.sleep(300)
"""


def _names(job: Job) -> list[str]:
    found = podman("ps", "-a", "--filter", f"label=portal.work=job-{job.pk}", "--format", "{{.Names}}")
    return found.stdout.split()


def _in_container(init_pid: int) -> list[psutil.Process]:
    """The processes in the container whose init is `init_pid` (its PID namespace's)."""
    pidns = f"/proc/{init_pid}/ns/pid"
    try:
        mine = os.readlink(pidns)
    except OSError:
        return []
    found = []
    for proc in psutil.process_iter():
        try:
            if os.readlink(f"/proc/{proc.pid}/ns/pid") == mine:
                found.append(proc)
        except OSError:
            continue
    return found


def test_a_killed_workers_container_is_ended_and_removed_when_it_starts_again(alice, start_worker, tmp_path):
    need_containers()
    name = server_names()[0]
    server_report_ingest(snapshot=make_snapshot(name, gpus=4, simulated=True))
    server = Server.objects.get(name=name)
    image = ContainerImage.objects.create(name="pyimg", reference=str(rootfs()))
    image.servers.add(server)
    env = {
        **FAST_LOST,
        "JOB_USER": "nobody",
        "JOB_KILL_GRACE_SECONDS": "1",
        "CONTAINER_DEVICE_DIR": str(fake_gpu_nodes(tmp_path / "dev", 4)),
        "CONTAINER_CDI_DIRS": str(tmp_path / "no-cdi"),
    }
    start_worker(None, extra_env=FAST_LOST)  # the portal's worker: it marks the job lost
    worker = start_worker(name, extra_env=env, containers=True)
    wait_for(lambda: Server.objects.get(pk=server.pk).containers_ok, timeout=30, what="the containers report")
    api = APIClient()
    api.force_authenticate(alice)
    booking = reservation_create(user=alice, gpus=[f"GPU-{name}-00"])
    upload = SimpleUploadedFile("job.py", DETACHED)
    answer = api.post(
        "/api/v1/jobs/", {"reservation": booking.pk, "script": upload, "image": "pyimg"}, format="multipart"
    )
    assert answer.status_code == 201, answer.json()
    job_id = answer.json()["id"]
    wait_for(lambda: "ready" in job_log(job_id), timeout=60, what="the job's first line")
    job = Job.objects.get(pk=job_id)
    inside = _in_container(job.pid)
    assert len(inside) >= 3, inside  # catatonit, the script, the detached grandchild

    worker.send_signal(signal.SIGKILL)  # the host's worker dies mid-job
    worker.wait()
    time.sleep(0.5)  # not a wait for the behaviour: the client's PDEATHSIG is immediate
    assert _names(job) and all(p.is_running() for p in inside)  # conmon kept the container
    wait_for(lambda: Job.objects.get(pk=job_id).status == Job.Status.LOST, timeout=30, what="the job lost")

    start_worker(name, extra_env=env, containers=True)  # its start ends and removes what the last one left
    wait_for(lambda: not _names(job), timeout=30, what="the container removed")
    wait_for(lambda: not any(p.is_running() for p in inside), timeout=10, what="its processes gone")
    log = job_log(job_id)
    assert f"that job {job_id} left running" in log, log
    assert AuditEntry.objects.filter(target=f"job {job_id}").exists()
