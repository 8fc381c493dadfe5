"""DCGM exporter's job mapping (jobs/host/dcgm.py): one file per GPU index in DCGM_HPC_JOB_MAPPING_DIR
naming the portal jobs and sessions on it, in a real folder, written by the real runner, the real
watchdog round and the worker's start."""

from __future__ import annotations

import os
import runpy
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import GPU
from gpus.simulated.inventory import server_names
from jobs.host import dcgm
from jobs.host.runner import job_run
from jobs.host.watchdog import HostWatchdog
from jobs.host.worker import kill_orphans
from jobs.models import InteractiveSession, Job
from jobs.services import job_cancel
from jobs.sessions.services import session_start
from jobs.submit import ScriptUpload, job_submit
from portal.env import ImproperlyConfiguredEnv
from tests.factories import fresh, make_snapshot
from tests.job_helpers import job_log
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db

SETTINGS = Path(__file__).resolve().parent.parent / "portal" / "settings.py"

# The job prints what DCGM exporter would read while it runs.
LISTER = """
import os, sys
folder = sys.argv[1]
for name in sorted(os.listdir(folder)):
    print("file", name, repr(open(os.path.join(folder, name)).read()))
"""


@pytest.fixture
def folder(settings, tmp_path) -> Path:
    where = tmp_path / "dcgm-job-map"
    settings.DCGM_HPC_JOB_MAPPING_DIR = str(where)
    return where


def files(folder: Path) -> dict[str, str]:
    """What DCGM exporter reads: the files named by an integer, and their text."""
    return {p.name: p.read_text() for p in folder.iterdir() if p.name.isdigit()}


def running(job: Job, **fields: object) -> Job:
    fields.setdefault("heartbeat_at", timezone.now())
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, **fields)
    job.refresh_from_db()
    return job


def submit(user, booking, source: str = "print(1)\n", **fields: object) -> Job:  # type: ignore[no-untyped-def]
    return job_submit(
        user=user, reservation=booking, script=ScriptUpload("job.py", source.encode()), **fields
    )


@pytest.mark.django_db(transaction=True)
def test_a_jobs_cards_name_it_while_it_runs_and_not_after(alice, box, folder, sent, settings):
    settings.JOB_DRAIN_SECONDS = 1
    booking = reservation_create(user=alice, gpus=[box[1].uuid, box[3].uuid], memory_mb=8192)
    job = submit(alice, booking, LISTER, args=[str(folder)])
    assert job_run(job.pk) == Job.Status.SUCCEEDED, job_log(job.pk)
    log = job_log(job.pk)
    assert f"file 1 'job-{job.pk}\\n'" in log
    assert f"file 3 'job-{job.pk}\\n'" in log
    assert "file 0 " not in log and "file 2 " not in log
    assert files(folder) == {}  # gone with the job
    assert sorted(os.listdir(folder)) == [dcgm.LOCK_NAME]  # no temporary file left behind


@pytest.mark.django_db(transaction=True)
def test_the_cards_are_named_before_the_process_starts_and_not_after_a_failed_start(
    alice, box, folder, sent, monkeypatch
):
    from jobs.host.executors.local import LocalProcess

    seen = []

    def start_refused(self, spec):  # type: ignore[no-untyped-def]
        seen.append(files(folder))  # what DCGM would read as the process starts
        raise OSError(8, "Exec format error")

    monkeypatch.setattr(LocalProcess, "start", start_refused)
    job = submit(alice, reservation_create(user=alice, gpus=[box[2].uuid], memory_mb=4096))
    assert job_run(job.pk) == Job.Status.FAILED
    assert seen == [{"2": f"job-{job.pk}\n"}] and files(folder) == {}


def test_two_jobs_on_one_shared_card_are_two_lines(alice, bob, box, folder, sent):
    first = submit(alice, reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=4096))
    second = submit(bob, reservation_create(user=bob, gpus=[box[0].uuid, box[1].uuid], memory_mb=4096))
    dcgm.work_started(dcgm.job_name(second.pk), second.gpu_uuids)
    dcgm.work_started(dcgm.job_name(first.pk), first.gpu_uuids)
    assert files(folder) == {"0": f"job-{first.pk}\njob-{second.pk}\n", "1": f"job-{second.pk}\n"}
    dcgm.work_ended(dcgm.job_name(first.pk))
    assert files(folder) == {"0": f"job-{second.pk}\n", "1": f"job-{second.pk}\n"}
    # The database says the same once both run: a rebuild changes nothing.
    for job in (first, second):
        running(job, server=box[0].server)
    dcgm.work_ended(dcgm.job_name(second.pk))
    assert dcgm.mapping_rebuild("box1") == {
        0: {f"job-{first.pk}", f"job-{second.pk}"},
        1: {f"job-{second.pk}"},
    }
    assert files(folder) == {"0": f"job-{first.pk}\njob-{second.pk}\n", "1": f"job-{second.pk}\n"}


def test_the_workers_start_rebuilds_the_folder_from_the_database(alice, box, folder, sent):
    """A worker killed in the middle of jobs left their files; the next one's start clears them,
    leaves out its jobs still marked running, and keeps a `gpu exec` that runs on."""
    folder.mkdir()
    (folder / "0").write_text("job-999\n")
    (folder / "7").write_text("job-1000\nsession-4\n")
    (folder / "README").write_text("not DCGM's: left alone\n")
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=4096)
    dead = running(
        submit(alice, booking), server=box[0].server, heartbeat_at=timezone.now() - timedelta(seconds=5)
    )
    exec_booking = reservation_create(user=alice, gpus=[box[2].uuid], memory_mb=4096)
    session, _env = session_start(
        user=alice, reservation=exec_booking.pk, kind="exec", host="box1", command=["python", "train.py"]
    )
    mapping = dcgm.DcgmMapping("box1")
    kill_orphans("box1")  # the worker's start (jobs/signals.py, HostWorker.start)
    mapping.start()
    assert files(folder) == {"2": f"session-{session.pk}\n"}
    assert (folder / "README").exists()
    since = mapping.worker_started_at
    assert dcgm.mapping_from_database("box1", worker_started_at=since) == {2: {f"session-{session.pk}"}}
    Job.objects.filter(pk=dead.pk).update(heartbeat_at=timezone.now())  # a job of this worker beats
    assert dcgm.mapping_from_database("box1", worker_started_at=since)[0] == {f"job-{dead.pk}"}


def test_the_watchdog_round_finds_a_gpu_exec_started_in_a_terminal(alice, box, folder):
    """`gpu exec` runs in the user's terminal, not under the worker: its row is how it is found."""
    booking = reservation_create(user=alice, gpus=[box[1].uuid], memory_mb=4096)
    session, _env = session_start(
        user=alice, reservation=booking.pk, kind="exec", host="box1", command=["python", "train.py"]
    )
    watchdog = HostWatchdog("box1", simulated=False)
    watchdog.round(make_snapshot("box1", gpus=4, processes=0))
    assert files(folder) == {"1": f"session-{session.pk}\n"}
    InteractiveSession.objects.filter(pk=session.pk).update(status=InteractiveSession.Status.ENDED)
    watchdog.round(make_snapshot("box1", gpus=4, processes=0))
    assert files(folder) == {"1": f"session-{session.pk}\n"}  # within REFRESH_SECONDS: not read again
    watchdog.mapping.refreshed_at = float("-inf")  # REFRESH_SECONDS later
    watchdog.round(make_snapshot("box1", gpus=4, processes=0))
    assert files(folder) == {}


def test_it_writes_nothing_when_off(settings, tmp_path, alice, box, sent):
    settings.DCGM_HPC_JOB_MAPPING_DIR = ""
    job = submit(alice, reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=4096))
    dcgm.work_started(dcgm.job_name(job.pk), job.gpu_uuids)
    dcgm.work_ended(dcgm.job_name(job.pk))
    assert dcgm.mapping_rebuild("box1") == {}
    assert list(tmp_path.iterdir()) == []


def test_a_folder_it_cannot_write_never_fails_the_job(folder, alice, box, sent, caplog):
    folder.write_text("a file where the folder should be")
    job = submit(alice, reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=4096))
    dcgm.work_started(dcgm.job_name(job.pk), job.gpu_uuids)
    dcgm.work_ended(dcgm.job_name(job.pk))
    dcgm.DcgmMapping("box1").refresh()
    assert "DCGM job mapping: could not" in caplog.text


def test_the_settings_refuse_a_relative_folder(monkeypatch):
    monkeypatch.setenv("DCGM_HPC_JOB_MAPPING_DIR", "dcgm-job-map")
    with pytest.raises(ImproperlyConfiguredEnv, match="='dcgm-job-map' must be an absolute path"):
        runpy.run_path(str(SETTINGS))


@pytest.mark.worker
def test_a_real_host_worker_clears_what_it_left_and_names_its_job(start_worker, tmp_path, alice):
    """The host's worker as deployed: started with DCGM_HPC_JOB_MAPPING_DIR, it clears a killed
    worker's file at once, names the job it runs on its card, and removes it when it ends."""
    where = tmp_path / "dcgm-job-map"
    where.mkdir()
    (where / "3").write_text("job-999\n")
    name = server_names()[0]
    start_worker(None)  # the collector: the host's cards get their rows
    start_worker(name, extra_env={"DCGM_HPC_JOB_MAPPING_DIR": str(where), "JOB_KILL_GRACE_SECONDS": "1"})
    wait_for(lambda: not (where / "3").exists(), timeout=60, what="the stale file to go")
    wait_for(lambda: GPU.objects.filter(server__name=name).count() >= 2, timeout=60, what="the cards")
    card = GPU.objects.get(server__name=name, index=1)
    booking = reservation_create(user=alice, gpus=[card.uuid], memory_mb=2048)
    job = submit(alice, booking, "import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    wait_for(lambda: files(where).get("1") == f"job-{job.pk}\n", timeout=60, what="the job's line")
    job_cancel(user=alice, job=job.pk)
    wait_for(lambda: fresh(job).status == Job.Status.CANCELLED, timeout=30, what="the cancel")
    assert files(where) == {}
