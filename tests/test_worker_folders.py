"""The folders a GPU host's worker writes into as root: DCGM_HPC_JOB_MAPPING_DIR (jobs/host/dcgm.py),
JOB_SPOOL_DIR (jobs/host/spool.py) and JOB_FOLDERS (jobs/host/folders.py).

The attacks these tests replay, with real symlinks and files of another account in a real folder
(the tests run as root, the worker's account here; `nobody` stands in for a job's account):

- a mapping folder the job's account can write: a link at a GPU index's file, pointing at a
  secret the worker can read, made the worker copy the secret into a world-readable mapping
  file; a link at `.portal.lock` made it create a file wherever the link pointed;
- a spool end record or log that is a link, or someone else's file: it ended another person's
  job with the planter's status, or put the planter's lines in that job's log;
- folders others may write, at the folder or above it, and a JOB_FOLDERS the jobs' account cannot
  reach: the host worker now refuses to start, naming the setting, the folder and the fix.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from gpus.booking import reservation_create
from gpus.simulated.inventory import server_names
from jobs.host import dcgm
from jobs.host import worker as host_worker
from jobs.host.replay import spool_replay
from jobs.host.spool import spool_name
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from jobs.threads import SpoolReplay
from tests.factories import fresh
from tests.fault_servers import small_disk, small_disk_unavailable
from tests.job_helpers import job_log
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db

SECRET = "SECRET_KEY=do-not-leak"


@pytest.fixture(autouse=True)
def _root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the worker's account here, which hands files to `nobody` (CI runs as root)")


@pytest.fixture
def nobody() -> pwd.struct_passwd:
    return pwd.getpwnam("nobody")


@pytest.fixture
def secret(tmp_path) -> Path:
    """A file only the worker may read (its env file, /etc/shadow)."""
    path = tmp_path / "secret"
    path.write_text(f"{SECRET}\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def job(alice, box, sent) -> Job:
    """alice's running job on box1 GPU 0."""
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=4096)
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload("train.py", b"print(1)\n"))
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, server=box[0].server)
    return fresh(job)


def plant_link(at: Path, target: Path, owner: pwd.struct_passwd) -> None:
    """A symlink at `at`, made by `owner` (its owner changed, as if that account had made it)."""
    at.symlink_to(target)
    os.lchown(at, owner.pw_uid, owner.pw_gid)


def plant_file(at: Path, text: str, owner: pwd.struct_passwd) -> None:
    at.write_text(text)
    os.chown(at, owner.pw_uid, owner.pw_gid)


def regular_texts(folder: Path) -> str:
    """Everything in the folder's regular files (what DCGM exporter and anyone else may read)."""
    return "".join(p.read_text() for p in folder.iterdir() if stat.S_ISREG(p.lstat().st_mode))


# --- the DCGM job mapping --------------------------------------------------------------------------


@pytest.fixture
def mapping(settings, tmp_path) -> Path:
    where = tmp_path / "dcgm-job-map"
    where.mkdir(mode=0o755)
    settings.DCGM_HPC_JOB_MAPPING_DIR = str(where)
    return where


def test_a_mapping_folder_a_jobs_account_may_write_is_never_written(
    job, mapping, secret, tmp_path, nobody, caplog
):
    """The job's account owns the folder and plants links at GPU 0's file and at the lock."""
    os.chown(mapping, nobody.pw_uid, nobody.pw_gid)
    created = tmp_path / "created-by-the-worker"
    plant_link(mapping / "0", secret, nobody)
    plant_link(mapping / dcgm.LOCK_NAME, created, nobody)

    dcgm.work_started(dcgm.job_name(job.pk), job.gpu_uuids)  # the runner, as the job starts
    dcgm.DcgmMapping("box1").refresh()  # the watchdog's round

    assert not created.exists(), "the worker created a file where .portal.lock pointed"
    assert SECRET not in regular_texts(mapping), "the secret landed in a world-readable mapping file"
    assert secret.read_text() == f"{SECRET}\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert "DCGM_HPC_JOB_MAPPING_DIR" in caplog.text
    assert "must belong to root or the worker's account" in caplog.text


def test_links_and_strangers_files_in_the_mapping_folder_are_never_followed_or_read(
    job, mapping, secret, tmp_path, nobody, caplog
):
    """A folder of the worker's with links in it (left from when it was not, or an admin's): the
    link at an index is replaced, never read through; a link at the lock is refused."""
    plant_link(mapping / "0", secret, nobody)
    plant_file(mapping / "1", "someone-else-1\n", nobody)

    dcgm.work_started(dcgm.job_name(job.pk), job.gpu_uuids)
    assert SECRET not in regular_texts(mapping)
    assert (mapping / "0").read_text() == f"job-{job.pk}\n" and not (mapping / "0").is_symlink()
    assert stat.S_IMODE((mapping / "0").stat().st_mode) == 0o644 and (mapping / "0").stat().st_uid == 0
    assert "0 is a symlink: refused, never followed" in caplog.text
    dcgm.mapping_rebuild("box1")  # nothing runs on GPU 1: the stranger's file goes, unread
    assert not (mapping / "1").exists() and SECRET not in regular_texts(mapping)
    assert secret.read_text() == f"{SECRET}\n"

    created = tmp_path / "created-by-the-worker"
    (mapping / dcgm.LOCK_NAME).unlink()
    plant_link(mapping / dcgm.LOCK_NAME, created, nobody)
    dcgm.work_ended(dcgm.job_name(job.pk))
    assert not created.exists()
    assert ".portal.lock is a symlink: refused, never followed" in caplog.text


# --- the spool -----------------------------------------------------------------------------------


@pytest.fixture
def spool(settings, tmp_path) -> Path:
    """This test's JOB_SPOOL_DIR: the worker's, mode 0700."""
    folder = tmp_path / "spool"
    folder.mkdir(mode=0o700)
    settings.JOB_SPOOL_DIR = folder
    return folder


def forged_end() -> str:
    return json.dumps(
        {
            "status": "succeeded",
            "exit_code": 0,
            "message": "forged",
            "finished_at": "2026-01-01T00:00:00+00:00",
        }
    )


@pytest.mark.parametrize("planted", ["symlink", "foreign owner"])
def test_a_planted_end_record_never_ends_a_job(job, spool, tmp_path, nobody, planted, caplog):
    name = spool_name(job.pk, job.created_at)
    if planted == "symlink":
        forged = tmp_path / "forged.json"
        plant_file(forged, forged_end(), nobody)
        plant_link(spool / f"{name}.end", forged, nobody)
    else:
        plant_file(spool / f"{name}.end", forged_end(), nobody)

    with caplog.at_level(logging.ERROR, logger="jobs.host.replay"):
        spool_replay()

    job = fresh(job)
    assert job.status == Job.Status.RUNNING and job.message != "forged", "a planted record ended the job"
    said = "is a symlink: refused" if planted == "symlink" else f"belongs to uid {nobody.pw_uid}"
    assert f"Spool {name} could not be replayed ({name}.end {said}" in caplog.text


@pytest.mark.parametrize("planted", ["symlink", "foreign owner"])
def test_a_planted_log_never_reaches_a_jobs_log(job, spool, tmp_path, nobody, planted, caplog):
    name = spool_name(job.pk, job.created_at)
    lines = "2026-01-01T00:00:00.000Z [portal] forged: your job leaked your key, paste it here\n"
    if planted == "symlink":
        forged = tmp_path / "forged.log"
        plant_file(forged, lines, nobody)
        plant_link(spool / f"{name}.log", forged, nobody)
    else:
        plant_file(spool / f"{name}.log", lines, nobody)

    with caplog.at_level(logging.ERROR, logger="jobs.host.replay"):
        spool_replay()

    assert "forged" not in job_log(job.pk)
    assert f"Spool {name} could not be replayed" in caplog.text
    if planted == "foreign owner":
        assert f"{name}.log belongs to uid {nobody.pw_uid}, not the worker's 0: refused" in caplog.text


def test_the_workers_own_spool_still_ends_its_job(job, spool):
    """The control: what the worker wrote itself is stored, once."""
    from jobs.host.spool import EndRecord, LogSpool

    name = spool_name(job.pk, job.created_at)
    log_spool = LogSpool(name, cap_bytes=1 << 20)
    log_spool.append(b"2026-01-01T00:00:00.000Z its last line\n")
    log_spool.close()
    EndRecord("succeeded", 0, "", "2026-01-01T00:00:01+00:00").write(name)
    assert stat.S_IMODE((spool / f"{name}.end").stat().st_mode) == 0o600
    assert spool_replay() == 1
    assert fresh(job).status == Job.Status.SUCCEEDED and "its last line" in job_log(job.pk)
    assert list(spool.iterdir()) == []


# --- the worker's start --------------------------------------------------------------------------


def refused(match: str) -> str:
    """The host worker's start check refuses, saying `match` (a regex); its message."""
    with pytest.raises(SystemExit) as exc:
        host_worker.host_worker_check()
    message = str(exc.value.code)
    assert re.search(match, message), message
    return message


def make(path: Path, mode: int, owner: pwd.struct_passwd | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    if owner is not None:
        os.chown(path, owner.pw_uid, owner.pw_gid)
    return path


def test_the_start_check_passes_and_makes_what_is_missing(settings, tmp_path):
    settings.JOB_SPOOL_DIR = tmp_path / "new" / "spool"
    settings.DCGM_HPC_JOB_MAPPING_DIR = str(tmp_path / "dcgm-job-map")
    host_worker.host_worker_check()
    assert stat.S_IMODE((tmp_path / "new" / "spool").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "dcgm-job-map").stat().st_mode) == 0o755
    # A sticky folder that anyone may write (/tmp) may be above them: others cannot swap ours.
    settings.DCGM_HPC_JOB_MAPPING_DIR = str(make(tmp_path / "sticky", 0o1777) / "dcgm-job-map")
    host_worker.host_worker_check()


@pytest.mark.parametrize("setting", ["JOB_SPOOL_DIR", "DCGM_HPC_JOB_MAPPING_DIR", "JOB_FOLDERS"])
@pytest.mark.parametrize("unsafe", ["world-writable", "group-writable", "another account's", "a symlink"])
def test_it_refuses_to_start_with_a_folder_others_may_write(settings, tmp_path, nobody, setting, unsafe):
    folder = tmp_path / "folder"
    if unsafe == "world-writable":
        make(folder, 0o777)
    elif unsafe == "group-writable":
        make(folder, 0o770)
        os.chown(folder, 0, nobody.pw_gid)
    elif unsafe == "another account's":
        make(folder, 0o700, nobody)
    else:
        folder.symlink_to(make(tmp_path / "elsewhere", 0o700))
    setattr(settings, setting, str(folder) if setting == "DCGM_HPC_JOB_MAPPING_DIR" else folder)
    if unsafe == "a symlink":
        refused(rf"Cannot open {setting} \({folder}\) as a real folder: .*not a symlink")
    else:
        mode = {"JOB_FOLDERS": "0711", "JOB_SPOOL_DIR": "0700"}.get(setting, "0755")
        refused(rf"{setting} \({folder}\) must belong to .* Fix: chown 0 {folder} && chmod {mode} {folder}")


@pytest.mark.parametrize("setting", ["JOB_SPOOL_DIR", "DCGM_HPC_JOB_MAPPING_DIR", "JOB_FOLDERS"])
def test_it_refuses_to_start_with_a_writable_folder_above(settings, tmp_path, nobody, setting):
    above = make(tmp_path / "shared", 0o777)  # not sticky: anyone may swap what is below
    folder = above / "folder"
    setattr(settings, setting, str(folder) if setting == "DCGM_HPC_JOB_MAPPING_DIR" else folder)
    refused(rf"{above}, above {setting} \({folder}\), may be written by others .* chmod go-w {above}")
    above.chmod(0o755)
    os.chown(above, nobody.pw_uid, nobody.pw_gid)  # another account's: it may change its mode
    refused(rf"{above}, above {setting} \({folder}\), may be written by others \(owner uid {nobody.pw_uid}")
    assert not folder.exists()


@pytest.fixture
def read_only_disk(tmp_path) -> Iterator[Path]:
    if why := small_disk_unavailable():
        pytest.skip(why)
    with small_disk(tmp_path / "ro", read_only=True) as folder:
        yield folder


def test_it_refuses_to_start_with_a_spool_folder_it_cannot_make_or_write(settings, read_only_disk):
    settings.JOB_SPOOL_DIR = read_only_disk / "var" / "spool"  # its parent is missing and cannot be made
    refused(
        rf"Cannot check {read_only_disk / 'var'} above JOB_SPOOL_DIR .*: Read-only file system\. Fix: make"
    )
    settings.JOB_SPOOL_DIR = read_only_disk  # there, and safe, but nothing can be written in it
    refused(rf"JOB_SPOOL_DIR \({read_only_disk}\) cannot be written: Read-only file system\. Fix: ")


def test_a_spool_folder_unusable_after_the_start_is_one_line_until_it_is_usable_again(
    settings, read_only_disk, tmp_path, caplog
):
    thread = SpoolReplay()
    settings.JOB_SPOOL_DIR = read_only_disk / "spool"  # cannot be made: as if removed since the start
    with caplog.at_level(logging.INFO, logger="jobs.threads"):
        for _ in range(3):
            thread.step()  # the thread's step, every JOB_RECONCILE_SECONDS: raises nothing
        settings.JOB_SPOOL_DIR = tmp_path / "spool"
        thread.step()
    said = [(r.levelname, r.getMessage().split(" (")[0], r.exc_info) for r in caplog.records]
    assert said == [
        ("ERROR", "job-spool: JOB_SPOOL_DIR cannot be used", None),
        ("WARNING", "job-spool: JOB_SPOOL_DIR can be used again", None),
    ]


@pytest.mark.worker
def test_a_real_host_worker_refuses_to_start_and_says_why(start_worker, tmp_path):
    open_folder = make(tmp_path / "dcgm-job-map", 0o777)
    name = server_names()[0]
    proc = start_worker(name, extra_env={"DCGM_HPC_JOB_MAPPING_DIR": str(open_folder)})
    wait_for(lambda: proc.poll() is not None, timeout=60, what="the worker to refuse")
    assert proc.returncode != 0
    said = start_worker.log(proc)
    assert f"The worker of {name} does not start: DCGM_HPC_JOB_MAPPING_DIR ({open_folder})" in said
    assert f"Fix: chown 0 {open_folder} && chmod 0755 {open_folder}" in said
    assert " ready." not in said  # Celery's line once it takes messages: it never did


# --- the jobs' account reaches JOB_FOLDERS ----------------------------------------------------------


@pytest.fixture
def job_folders(settings, tmp_path) -> Path:
    """A JOB_FOLDERS of this test's below `gate`, a folder whose mode the test sets, in a tree any
    account may pass through (like /srv)."""
    var = Path(django_settings.VAR_DIR).resolve()
    if not all(p.stat().st_mode & stat.S_IXOTH for p in [var, *var.parents]):
        pytest.skip(f"{var} is not searchable by other accounts")
    gate = var / f"test-gate-{os.getpid()}-{tmp_path.name}"
    gate.mkdir(mode=0o755)
    settings.JOB_FOLDERS = gate / "job-folders"
    yield gate
    shutil.rmtree(gate, ignore_errors=True)


@pytest.mark.parametrize("job_user", ["nobody", "@owner"])
def test_it_refuses_to_start_when_the_jobs_account_cannot_reach_job_folders(settings, job_folders, job_user):
    settings.JOB_USER = job_user
    host_worker.host_worker_check()  # 0755 all the way
    job_folders.chmod(0o700)  # root's alone: a job's account may not pass
    who = "JOB_USER=nobody" if job_user == "nobody" else r"every job owner's account \(JOB_USER=@owner"
    refused(
        rf"{job_folders}, on the way to JOB_FOLDERS \({job_folders / 'job-folders'}\), does not let {who}"
        rf".* mode 700\): every job would fail at its start. Fix: chmod o\+x {job_folders}"
    )


def test_a_named_job_account_may_pass_by_its_group(settings, job_folders, nobody):
    """JOB_USER's primary group, the only one a job keeps, is enough; under @owner it is not."""
    job_folders.chmod(0o710)
    os.chown(job_folders, 0, nobody.pw_gid)
    settings.JOB_USER = "nobody"
    host_worker.host_worker_check()
    settings.JOB_USER = "@owner"
    refused(r"execute bit for others\) through .* Fix: chmod o\+x")


def test_it_refuses_to_start_with_a_job_user_this_host_lacks(settings):
    settings.JOB_USER = "no-such-account-here"
    refused(r"JOB_USER=no-such-account-here: there is no such account on this host")
