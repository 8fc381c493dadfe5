"""Jobs end to end: a real Celery worker process, real Redis, real subprocesses (TF on the CPU)."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import GPU, Allocation, GPUProcess, Reservation
from gpus.services import server_report_ingest
from gpus.simulated.inventory import server_names
from jobs.host.launch import LAUNCHER
from jobs.host.runner import job_run
from jobs.models import Job
from jobs.tasks import run_job
from portal.models import Profile
from tests.conftest import OUTPUT
from tests.factories import make_snapshot
from tests.job_helpers import alive, job_log, job_process, recorded_process
from tests.waiting import wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]
EXAMPLE = Path(__file__).resolve().parent.parent / "jobs" / "examples" / "keras_example.py"
FINAL = {s.value for s in Job.FINISHED}


@pytest.fixture
def host(start_worker) -> str:
    """A simulated GPU host's worker (queue host.<name>), its cards known to the portal."""
    name = server_names()[0]
    server_report_ingest(snapshot=make_snapshot(name, gpus=4, simulated=True))
    start_worker(name, extra_env={"JOB_KILL_GRACE_SECONDS": "2"})
    return name


@pytest.fixture
def api(alice) -> APIClient:
    client = APIClient()
    client.force_authenticate(alice)
    return client


def _book(alice, host: str, card: int = 0, **kwargs):
    return reservation_create(user=alice, gpus=[f"GPU-{host}-{card:02d}"], **kwargs)


def _submit(api: APIClient, booking, source: bytes, name: str = "job.py", **data) -> int:
    upload = SimpleUploadedFile(name, source)
    response = api.post(
        "/api/v1/jobs/", {"reservation": booking.pk, "script": upload, **data}, format="multipart"
    )
    assert response.status_code == 201, response.json()
    return response.json()["id"]


def _finished(job_id: int, timeout: float = 120) -> Job:
    wait_for(
        lambda: Job.objects.get(pk=job_id).status in FINAL, timeout=timeout, what=f"job {job_id} to finish"
    )
    return Job.objects.get(pk=job_id)


def test_it_runs_the_example_keras_job_on_the_booked_cards(api, alice, host):
    booking = reservation_create(user=alice, gpus=[f"GPU-{host}-01", f"GPU-{host}-02"])
    job_id = _submit(api, booking, EXAMPLE.read_bytes(), "keras_example.py", args="--epochs 2")
    job = _finished(job_id)
    log = job_log(job_id)
    assert job.status == Job.Status.SUCCEEDED, log
    assert job.exit_code == 0 and job.started_at and job.finished_at
    assert f"CUDA_VISIBLE_DEVICES=GPU-{host}-01,GPU-{host}-02" in log  # what the subprocess saw
    assert "[portal] launcher:" in log and "TensorFlow 2." in log
    assert "Epoch 1/2" in log and "Epoch 2/2" in log
    assert job.launcher_line.startswith("[portal] launcher:")
    assert job.env_applied["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert job.env_applied["TF_FORCE_GPU_ALLOW_GROWTH"] == "false"
    assert "DATABASE_URL" not in log and "SECRET_KEY" not in log
    lines = log.splitlines()
    assert all(line[:4].isdigit() and line[23:25] == "Z " for line in lines)  # every line timestamped


def test_it_records_a_failing_script_with_its_exit_code_and_traceback(api, alice, host):
    source = b"import sys\nprint('about to fail', flush=True)\nraise ValueError('bad hyperparameter')\n"
    job = _finished(_submit(api, _book(alice, host), source))
    assert job.status == Job.Status.FAILED and job.exit_code == 1
    log = job_log(job.pk)
    assert "about to fail" in log and "Traceback" in log and "ValueError: bad hyperparameter" in log
    assert log.index("about to fail") < log.index("Traceback")  # stdout and stderr in order


SLEEPER = b"""
import signal, sys, time
def on_term(*_):
    print("got SIGTERM, ignoring it", flush=True)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def _gone(job: Job) -> bool:
    """The job's process no longer runs (by its recorded start: its pid may be another's by now)."""
    assert job.pid and job.pid_started is not None, "the job's row names no process"
    return not alive(recorded_process(job.pid, job.pid_started))


def _wait_running(job_id: int) -> Job:
    wait_for(lambda: "ready" in job_log(job_id), timeout=60, what="the script's first line")
    return Job.objects.get(pk=job_id)


def test_it_cancels_a_running_job_sigterm_then_sigkill(api, alice, host):
    job_id = _submit(api, _book(alice, host), SLEEPER)
    job = _wait_running(job_id)
    assert job.status == Job.Status.RUNNING and psutil.pid_exists(job.pid)
    requested = time.monotonic()
    assert api.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 200
    job = _finished(job_id, timeout=30)
    assert job.status == Job.Status.CANCELLED and "alice" in job.message
    assert 2 <= time.monotonic() - requested < 10  # the 2 s grace, then SIGKILL
    log = job_log(job_id)
    assert "got SIGTERM" in log and "SIGKILL" in log
    assert _gone(job)


def test_it_stops_a_job_at_its_time_limit(api, alice, host):
    job_id = _submit(api, _book(alice, host), SLEEPER, time_limit_minutes=1)
    _wait_running(job_id)
    # Rather than wait out the minute, the record says the job started 57 s ago: the supervisor
    # reads the start from its row, so the limit falls due in 3 s.
    Job.objects.filter(pk=job_id).update(started_at=timezone.now() - timedelta(seconds=57))
    job = _finished(job_id, timeout=30)
    assert job.status == Job.Status.TIMED_OUT and "Time limit of 1 min" in job.message
    # Not before the minute, then the 2 s grace for a script that ignores SIGTERM.
    assert 62 <= job.duration.total_seconds() < 70
    assert "[portal] Time limit of 1 min reached" in job_log(job_id)


def test_it_stops_a_job_when_its_booking_ends(api, alice, host):
    booking = _book(alice, host)
    job_id = _submit(api, booking, SLEEPER)
    _wait_running(job_id)
    # Rather than a booking of a few seconds, which a slowly starting worker could find over already,
    # the running booking's end comes near.
    end = timezone.now() + timedelta(seconds=2)
    Reservation.objects.filter(pk=booking.pk).update(end=end, booked_end=end)
    Allocation.objects.filter(reservation=booking).update(end=end)
    job = _finished(job_id, timeout=30)
    assert job.status == Job.Status.TIMED_OUT and "booking ended" in job.message
    assert end <= job.finished_at < end + timedelta(seconds=10)


def test_it_never_starts_a_second_run_for_a_redelivered_message(api, alice, host, start_worker):
    source = b"import os\nprint('run of job', os.environ['PORTAL_JOB_ID'], flush=True)\n"
    job_id = _submit(api, _book(alice, host), source)
    run_job.apply_async(args=[job_id], queue=f"host.{host}")  # the same message, delivered again
    job = _finished(job_id)
    assert job.status == Job.Status.SUCCEEDED
    assert job_run(job_id) is None  # and once more, in this process: a no-op
    wait_for(
        lambda: f"Job {job_id} is not queued" in start_worker.log(host),
        timeout=30,
        what=f"the worker to drop the duplicate (see {OUTPUT})",
    )
    assert job_log(job_id).count("run of job") == 1
    assert Job.objects.get(pk=job_id).log_bytes == job.log_bytes


# Shorter than the defaults (30 s, 5 s, 5 s), as a lab may set them; in both workers, which check them.
FAST_LOST = {"JOB_LOST_AFTER_SECONDS": "10", "JOB_HEARTBEAT_SECONDS": "1", "JOB_RECONCILE_SECONDS": "1"}


def test_it_marks_a_job_lost_when_its_worker_is_killed(api, alice, start_worker):
    name = server_names()[0]
    server_report_ingest(snapshot=make_snapshot(name, gpus=4, simulated=True))
    start_worker(None, extra_env=FAST_LOST)  # the portal's worker runs the reconciler
    worker = start_worker(name, extra_env=FAST_LOST)
    booking = _book(alice, name)
    job_id = _submit(api, booking, SLEEPER)
    job = _wait_running(job_id)
    worker.send_signal(signal.SIGKILL)  # the host's worker dies mid-job
    worker.wait()
    killed_at = time.monotonic()
    job = _finished(job_id, timeout=40)
    assert job.status == Job.Status.LOST and "no heartbeat" in job.message
    # Lost once its last heartbeat is 10 s old, not before; and soon after, with a reconcile every second.
    assert (job.finished_at - job.heartbeat_at).total_seconds() >= 10
    assert time.monotonic() - killed_at < 20
    # The job's process died with its worker (PDEATHSIG): nothing holds the cards.
    wait_for(lambda: _gone(job), timeout=5, what="the job process to be gone")
    # and the booking takes a new job.
    response = api.post(
        "/api/v1/jobs/",
        {"reservation": booking.pk, "script": SimpleUploadedFile("again.py", b"print(1)")},
        format="multipart",
    )
    assert response.status_code == 201


def test_it_merges_the_booking_into_a_legacy_tf1_session_config(api, alice, host):
    """A TF1-style script asks for 90 % of the card; its 8 GiB booking on a 24 GiB card wins, less
    the CUDA context's headroom, so the session and its context fit inside the booking."""
    script = EXAMPLE.parent / "tf1_session_example.py"
    booking = _book(alice, host, memory_mb=8192)
    job_id = _submit(api, booking, script.read_bytes(), script.name, intra_op_threads=3)
    job = _finished(job_id)
    log = job_log(job_id)
    assert job.status == Job.Status.SUCCEEDED, log
    received = json.loads(log.split("SESSION_CONFIG ", 1)[1].splitlines()[0])
    headroom = settings.GPU_CONTEXT_HEADROOM_MB
    assert received["fraction"] == pytest.approx((8192 - headroom) / (24 * 1024), abs=1e-6)  # not 0.9
    assert received["allow_growth"] is False  # "limit to my booking"
    assert received["intra"] == 3 and received["soft"] is True
    assert "merged the booking into a tf.compat.v1.Session config" in log


def test_it_records_the_jobs_memory_from_telemetry_and_shows_it_on_its_card(
    api, alice, start_worker, tmp_path
):
    """With the simulated inventory a job runs on the CPU; the simulated reporter shows it on its
    booked card (resident memory as "GPU memory"), through the same path as NVML's processes."""
    name = server_names()[0]
    start_worker(None)  # the collector
    start_worker(name)
    wait_for(lambda: GPU.objects.filter(server__name=name).count() >= 4, timeout=60, what="the cards")
    card = GPU.objects.filter(server__name=name).order_by("index").first()
    booking = reservation_create(user=alice, gpus=[card.uuid])
    # The job holds its memory until the test has seen it on its card, however slow the round.
    source = (
        b"import os, sys, time\n"
        b"held = bytearray(300 * 1024 * 1024)\n"
        b"print('ready', flush=True)\n"
        b"while not os.path.exists(sys.argv[1]):\n"
        b"    time.sleep(0.1)\n"
    )
    # This test's own file: job folders are named by id, and ids start again in every test database.
    release = tmp_path / "release"
    job_id = _submit(api, booking, source, args=str(release))
    _wait_running(job_id)
    process = wait_for(
        lambda: GPUProcess.objects.filter(gpu=card, job_id=job_id, used_memory_mb__gte=300).first(),
        timeout=20,
        what="the job and its memory on its card",
    )
    assert process.job_label == f"job {job_id}"
    release.touch()
    job = _finished(job_id, timeout=30)
    assert job.status == Job.Status.SUCCEEDED
    assert job.peak_memory_mb >= 300 and job.mean_utilization_pct is not None


def test_it_ends_a_job_whose_background_child_keeps_its_output_open(api, alice, host):
    """The script returns but leaves a child holding stdout (a server started in the background):
    the job is over when its main process is, and the child goes with it."""
    source = (
        b"import subprocess\n"
        b"child = subprocess.Popen(['sleep', '300'])\n"
        b"print('child', child.pid, flush=True)\n"
    )
    job_id = _submit(api, _book(alice, host), source)
    job = _finished(job_id, timeout=30)
    assert job.status == Job.Status.SUCCEEDED and job.duration.total_seconds() < 10
    child = job_process(int(job_log(job_id).split("child ", 1)[1].split()[0]), job_id)
    wait_for(lambda: not alive(child), timeout=5, what="the background child to be killed")


def _readable_by_others(path: Path) -> bool:
    """Every folder on the way is searchable and the file readable by any user."""
    return all(p.stat().st_mode & 0o001 for p in path.parents) and bool(path.stat().st_mode & 0o004)


@pytest.mark.parametrize("job_user", ["nobody", "@owner"])
def test_it_runs_jobs_as_job_user_who_cannot_read_the_workers_secrets(
    api, alice, start_worker, tmp_path, job_user
):
    """JOB_USER names the account, or is @owner: then alice's job runs as her Unix account."""
    import pwd

    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})

    launcher = LAUNCHER
    python = Path("/usr/bin/python3")  # the launcher needs no more than the standard library
    if os.geteuid() != 0 or not python.exists() or not _readable_by_others(launcher):
        pytest.skip("needs root, /usr/bin/python3 and a checkout other users can read")
    if not all(p.stat().st_mode & 0o001 for p in settings.JOB_FOLDERS.parents):
        pytest.skip("the folder of the jobs' folders is not searchable by other users")
    secret = tmp_path / "env"
    secret.write_text("SECRET_KEY=do-not-leak")
    secret.chmod(0o600)
    name = server_names()[0]
    server_report_ingest(snapshot=make_snapshot(name, gpus=4, simulated=True))
    start_worker(name, extra_env={"JOB_USER": job_user, "JOB_INTERPRETERS": f"default={python}"})
    source = (
        b"import os\n"
        b"print('uid', os.getuid(), 'home', os.environ['HOME'], flush=True)\n"
        b"try:\n"
        b"    open(" + repr(str(secret)).encode() + b").read()\n"
        b"except PermissionError:\n"
        b"    print('secret: permission denied', flush=True)\n"
        b"open('output.txt', 'w').write('the job folder is mine')\n"
    )
    job = _finished(_submit(api, _book(alice, name), source))
    log = job_log(job.pk)
    assert job.status == Job.Status.SUCCEEDED, log
    assert f"uid {pwd.getpwnam('nobody').pw_uid} " in log
    assert "secret: permission denied" in log and "do-not-leak" not in log
