"""Each job's folder is made fresh where no job can plant anything (jobs/host/folders.py).

The attack these tests replay: a job running as JOB_USER plants symlinks named after the next
job ids in a folder it can write, pointing at a folder it wants (/etc, the portal's code); the
worker, which holds CAP_CHOWN, used to make the next job's folder with mkdir(exist_ok=True),
write the upload through the link and chown its target to the job's account. The worker in
these tests is this root process, the job account the real unprivileged `nobody`, as in
production; job_run runs the real supervisor and launcher in this process.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import sys
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from gpus.booking import reservation_create
from jobs.host.folders import JobFolderError, job_folder_make
from jobs.host.runner import job_run
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal.processes import WORKDIR_EXIT_CODE
from tests.job_helpers import job_log

pytestmark = pytest.mark.django_db

PYTHON = Path("/usr/bin/python3")  # the launcher needs no more than the standard library

# Run as `nobody`: plant links at the next job ids, in the job root (writable by the job's
# account, as deploy.md says) and in JOB_FOLDERS (where it must be refused).
PLANTER = """
import os, sys
first, victim, folders = int(sys.argv[1]), sys.argv[2], sys.argv[3]
for n in range(first, first + 5):
    os.symlink(victim, f"job-{n}", target_is_directory=True)
    try:
        os.symlink(victim, os.path.join(folders, f"job-{n}"))
        print("planted in JOB_FOLDERS", flush=True)
    except PermissionError:
        print("JOB_FOLDERS: permission denied", flush=True)
print("uid", os.getuid(), "cwd", os.getcwd(), flush=True)
"""


def _searchable_by_others(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents] if p.exists())


@pytest.fixture
def as_nobody(settings, tmp_path):
    """JOB_USER=nobody with a job root that account can write; the victim is root's folder."""
    if sys.platform != "linux" or os.geteuid() != 0 or not PYTHON.exists():
        pytest.skip("needs Linux, root (to switch to nobody) and /usr/bin/python3")
    if not _searchable_by_others(Path(django_settings.JOB_FOLDERS).parent):
        pytest.skip("the folder of the jobs' folders is not searchable by other users")
    nobody = pwd.getpwnam("nobody")
    root = Path(django_settings.VAR_DIR) / f"test-job-root-{os.getpid()}-{tmp_path.name}"
    root.mkdir(mode=0o755)
    os.chown(root, nobody.pw_uid, nobody.pw_gid)
    settings.JOB_ROOTS = [root]
    settings.JOB_USER = "nobody"
    settings.JOB_INTERPRETERS = {"default": str(PYTHON)}
    victim = tmp_path / "etc"  # stands in for /etc or the portal's checkout
    victim.mkdir()
    (victim / "passwd").write_text("root:x:0:0\n")
    yield nobody, root, victim
    shutil.rmtree(root, ignore_errors=True)  # removes the links, never what they point to


def _untouched(victim: Path) -> None:
    st = victim.stat()
    assert (st.st_uid, st.st_gid) == (0, 0), "the worker handed the link's target to the job's account"
    assert sorted(p.name for p in victim.iterdir()) == ["passwd"], "the worker wrote through the link"


def test_it_never_follows_a_link_a_job_planted_at_the_next_jobs_folder(alice, box, as_nobody):
    nobody, root, victim = as_nobody
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    planter = job_submit(
        user=alice,
        reservation=booking,
        script=ScriptUpload(name="plant.py", content=PLANTER.encode()),
        workdir=str(root),
    )
    # The planter's arguments: the id of the job after it (known once it exists), its targets.
    args = [str(planter.pk + 1), str(victim), str(django_settings.JOB_FOLDERS)]
    Job.objects.filter(pk=planter.pk).update(args=args)
    assert job_run(planter.pk) == Job.Status.SUCCEEDED, job_log(planter.pk)
    log = job_log(planter.pk)
    assert f"uid {nobody.pw_uid} " in log
    assert "JOB_FOLDERS: permission denied" in log and "planted in JOB_FOLDERS" not in log
    assert (root / f"job-{planter.pk + 1}").is_symlink()

    # The next job is an upload, the one after it a script path (no upload): neither may give
    # the victim away nor write into it.
    upload = job_submit(
        user=alice,
        reservation=booking,
        script=ScriptUpload(name="train.py", content=b"import os\nprint('cwd', os.getcwd())\n"),
    )
    assert upload.pk == planter.pk + 1
    assert job_run(upload.pk) == Job.Status.SUCCEEDED, job_log(upload.pk)
    own = Path(django_settings.JOB_FOLDERS) / f"job-{upload.pk}"
    assert f"cwd {own}\n" in job_log(upload.pk)
    assert not own.is_symlink() and own.stat().st_uid == nobody.pw_uid
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
    _untouched(victim)

    (root / "train.py").write_text("import os\nprint('cwd', os.getcwd())\n")
    os.chown(root / "train.py", nobody.pw_uid, nobody.pw_gid)
    by_path = job_submit(user=alice, reservation=booking, script_path=str(root / "train.py"))
    assert by_path.pk == planter.pk + 2
    assert job_run(by_path.pk) == Job.Status.SUCCEEDED, job_log(by_path.pk)
    assert f"cwd {Path(django_settings.JOB_FOLDERS) / f'job-{by_path.pk}'}\n" in job_log(by_path.pk)
    _untouched(victim)


def test_it_enters_a_chosen_working_directory_as_the_jobs_account_only(alice, box, as_nobody):
    """A working directory only root may enter stays shut to the job: the worker no longer
    enters it with its own privileges before the job becomes its account."""
    _, root, _ = as_nobody
    private = root / "private"
    private.mkdir(mode=0o700)  # root's, inside the job root
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    job = job_submit(
        user=alice,
        reservation=booking,
        script=ScriptUpload(name="train.py", content=b"print('the job ran')\n"),
        workdir=str(private),
    )
    assert job_run(job.pk) == Job.Status.FAILED
    job.refresh_from_db()
    assert job.exit_code == WORKDIR_EXIT_CODE
    assert job.message.startswith("Did not start: its account may not enter its working directory")
    log = job_log(job.pk)
    assert f"its account may not enter its working directory {private} (errno 13" in log
    assert "the job ran" not in log


def test_it_moves_a_leftover_aside_and_never_follows_it(db, tmp_path):
    """A name taken in JOB_FOLDERS (only the worker writes there: a leftover of a database that
    was reset, or a link a job made when jobs ran as the worker's own account) is renamed,
    never reused: the folder is always one mkdir just made."""
    victim = tmp_path / "victim"
    victim.mkdir()
    folders = Path(django_settings.JOB_FOLDERS)
    folders.mkdir(mode=0o711, exist_ok=True)
    planted = folders / "job-424242"
    planted.symlink_to(victim, target_is_directory=True)
    account = pwd.getpwnam("nobody") if os.geteuid() == 0 else None
    try:
        made = job_folder_make(424242, upload=("train.py", "print(1)\n"), account=account)
        assert made.path == planted and made.moved_aside
        assert (folders / made.moved_aside).is_symlink()  # the link itself, renamed
        assert not made.path.is_symlink() and stat.S_IMODE(made.path.lstat().st_mode) == 0o700
        script = made.path / "train.py"
        assert script.read_text() == "print(1)\n" and stat.S_IMODE(script.stat().st_mode) == 0o600
        if account is not None:
            assert made.path.stat().st_uid == account.pw_uid == script.stat().st_uid
        assert list(victim.iterdir()) == [] and victim.stat().st_uid == os.geteuid()
    finally:
        for leftover in folders.glob("job-424242*"):
            if leftover.is_symlink():
                leftover.unlink()
            else:
                (leftover / "train.py").unlink(missing_ok=True)
                leftover.rmdir()


def test_it_refuses_job_folders_others_may_write(db, settings, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone could swap JOB_FOLDERS below it
    settings.JOB_FOLDERS = shared / "job-folders"
    with pytest.raises(JobFolderError, match="may be written by others"):
        job_folder_make(1, upload=None, account=None)

    writable = tmp_path / "writable"
    writable.mkdir()
    writable.chmod(0o777)
    settings.JOB_FOLDERS = writable
    with pytest.raises(JobFolderError, match=r"writable by it alone.*chmod 0711"):
        job_folder_make(1, upload=None, account=None)
    assert not (writable / "job-1").exists()


def test_it_refuses_an_upload_name_that_is_not_a_plain_file_name(db, tmp_path, settings):
    settings.JOB_FOLDERS = tmp_path / "job-folders"
    for name in ("../escape.py", "a/b.py", "..", "bad\nname.py"):
        with pytest.raises(JobFolderError, match="not a plain file name"):
            job_folder_make(7, upload=(name, "print(1)\n"), account=None)
    assert not (tmp_path / "escape.py").exists()
