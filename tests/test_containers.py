"""Jobs in container images (issue 34, docs/containers.md): the real runner (job_run) starts each
job in a root filesystem built here (tests/container_image.py), with fake GPU nodes, in both modes:
root-run Podman as the job's account (JOB_USER=nobody), and the job account's own rootless Podman
(a test account, made if absent). Skipped where Podman cannot run, failing on CI."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import ContainerImage
from gpus.procinfo import session_of
from jobs.host.containers import leftovers_remove, podman
from jobs.host.executors import Podman, executor_for
from jobs.host.rootless import run_dir
from jobs.host.runner import job_run
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from tests.container_image import ROOTLESS_ACCOUNT, fake_gpu_nodes, need_containers, rootfs, rootless_account
from tests.job_helpers import job_log
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SHOW = """
import json, os, sys
found = {"uid": os.getuid(), "gid": os.getgid(), "dev": sorted(os.listdir("/dev")), "python": sys.executable,
         "env": dict(os.environ), "cwd": os.getcwd()}
for name in found["dev"]:
    if name.startswith("nvidia"):
        try:
            open("/dev/" + name, "rb")
        except OSError as exc:
            found.setdefault("errors", {})[name] = exc.errno
open("written-inside", "w").write("hello")
print("FOUND " + json.dumps(found), flush=True)
"""

STREAM = """
import os, sys, time
print("first line", flush=True)
while not os.path.exists("go-on"):
    time.sleep(0.05)
print("second line", flush=True)
sys.exit(3)
"""

# Ignores SIGTERM, as does its child; a grandchild leaves the session (setsid), detached.
DEAF_TREE = """
import os, signal, subprocess, sys, time
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
child = subprocess.Popen([sys.executable, "-c", deaf])
detached = subprocess.Popen([sys.executable, "-c", deaf], start_new_session=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(0.5)
print("ready", os.getsid(detached.pid) == detached.pid, flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="session")
def _pause_process_ends() -> Iterator[None]:
    """Rootless Podman keeps a pause process per runtime folder (its user namespace): this test
    process's ends with it, and the folder goes."""
    yield
    folder = run_dir(pwd.getpwnam(ROOTLESS_ACCOUNT))
    with contextlib.suppress(OSError, ValueError, psutil.Error):
        pause = psutil.Process(int((folder / "libpod/tmp/pause.pid").read_text()))
        if pause.uids().real == pwd.getpwnam(ROOTLESS_ACCOUNT).pw_uid and "catatonit" in pause.name():
            pause.kill()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["root", "rootless"])
def account(request, settings) -> pwd.struct_passwd:
    """Each test in both modes: root-run Podman with --user (JOB_USER=nobody), and the job account's
    own rootless Podman (a test account, tests/container_image.py)."""
    settings.CONTAINER_MODE = request.param
    if request.param == "rootless":
        request.getfixturevalue("_pause_process_ends")
    found = pwd.getpwnam("nobody") if request.param == "root" else rootless_account()
    settings.JOB_USER = found.pw_name
    need_containers(found if request.param == "rootless" else None)
    return found


@pytest.fixture
def podman_of(account, settings) -> pwd.struct_passwd | None:
    """Whose Podman holds the containers: None (root's) in root mode, else the account's."""
    return account if settings.CONTAINER_MODE == "rootless" else None


@pytest.fixture
def image(db, podman_of) -> Iterator[ContainerImage]:
    yield ContainerImage.objects.create(name="pyimg", reference=str(rootfs()))
    # A test that failed half-way (its job's thread left behind) leaves no container either.
    assert leftovers_remove(podman_of) == [], "a container of this test was left behind"


@pytest.fixture
def in_image(alice, box, settings, tmp_path, image):
    """submit(source, cards) → a queued job of alice's in `image`, on fake nodes for box1's four cards."""
    settings.JOB_KILL_GRACE_SECONDS = 1
    settings.JOB_HEARTBEAT_SECONDS = 1
    settings.JOB_DRAIN_SECONDS = 1
    # Where the job's account can reach them (rootless Podman mounts them as that account).
    settings.CONTAINER_DEVICE_DIR = str(fake_gpu_nodes(Path(settings.VAR_DIR) / "dev" / tmp_path.name, 4))
    settings.CONTAINER_CDI_DIRS = [str(tmp_path / "no-cdi")]

    def submit(source: str, cards: tuple[int, ...] = (0,), env: dict | None = None) -> Job:
        booking = reservation_create(user=alice, gpus=[box[i].uuid for i in cards], memory_mb=8192)
        upload = ScriptUpload(name="job.py", content=source.encode())
        job = job_submit(user=alice, reservation=booking, script=upload, env=env)
        Job.objects.filter(pk=job.pk).update(image=image)
        job.refresh_from_db()
        return job

    return submit


def _in_thread(job_id: int) -> tuple[threading.Thread, list[str | None]]:
    outcome: list[str | None] = []
    thread = threading.Thread(target=lambda: outcome.append(job_run(job_id)), daemon=True)
    thread.start()
    return thread, outcome


def _containers(job: Job, account: pwd.struct_passwd | None) -> list[str]:
    """The job's container in `account`'s `podman ps -a` (root's: None)."""
    name = executor_for(job).container  # type: ignore[attr-defined]
    found = podman("ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.Names}}", account=account)
    return found.stdout.split()


def _mounts_of(container_id: str) -> list[str]:
    """Mounts that name the container, in any process's mount namespace (rootless Podman's are
    in its own, held by its pause process)."""
    found = []
    for mountinfo in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            found += [line for line in mountinfo.read_text().splitlines() if container_id in line]
        except OSError:
            continue  # a process gone meanwhile
    return found


def test_executor_for_picks_podman_for_work_in_an_image(in_image):
    job = in_image("print(1)")
    assert isinstance(executor_for(job), Podman)
    assert executor_for(job).container.endswith(f"-job-{job.pk}")  # type: ignore[attr-defined]


def test_it_runs_in_the_image_as_the_jobs_account_with_only_the_booked_cards(
    in_image, box, account, podman_of
):
    job = in_image(SHOW, cards=(1, 3), env={"MY_SETTING": "x=1 y"})
    assert job_run(job.pk) == Job.Status.SUCCEEDED, job_log(job.pk)
    log = job_log(job.pk)
    found = json.loads(log.split("FOUND ", 1)[1].splitlines()[0])
    assert "in image pyimg" in log.split("[portal] launcher:", 1)[1].splitlines()[0]
    assert (found["uid"], found["gid"]) == (account.pw_uid, account.pw_gid)
    nvidia = [name for name in found["dev"] if name.startswith("nvidia")]
    assert nvidia == ["nvidia-uvm", "nvidia1", "nvidia3", "nvidiactl"], found["dev"]
    assert found["errors"]["nvidia1"] == 6  # ENXIO: the node itself, no driver behind it
    uuids = f"{box[1].uuid},{box[3].uuid}"
    env = found["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == uuids
    assert (env["PORTAL_JOB_ID"], env["PORTAL_IMAGE"], env["MY_SETTING"]) == (str(job.pk), "pyimg", "x=1 y")
    assert "DATABASE_URL" not in env and "SECRET_KEY" not in env
    assert found["python"] == "/usr/bin/python3" or found["python"].startswith("/usr")
    written = Path(found["cwd"]) / "written-inside"
    assert written.read_text() == "hello" and written.stat().st_uid == account.pw_uid  # the job's folder
    assert _containers(job, podman_of) == []


def test_lines_stream_as_printed_and_the_exit_code_passes_through(in_image):
    job = in_image(STREAM)
    thread, outcome = _in_thread(job.pk)
    wait_for(lambda: "first line" in job_log(job.pk), timeout=30, what="the first line, while the job runs")
    assert "second line" not in job_log(job.pk)
    folder = next(Path(os.environ["JOB_FOLDERS"]).glob(f"job-{job.pk}"))
    (folder / "go-on").touch()
    thread.join(60)
    job.refresh_from_db()
    assert (outcome, job.status, job.exit_code) == ([Job.Status.FAILED], Job.Status.FAILED, 3)
    assert "second line" in job_log(job.pk)
    assert job.message == "Exited with code 3."


def test_the_containers_host_pids_are_attributed_to_the_job(in_image, account):
    job = in_image(DEAF_TREE)
    thread, _ = _in_thread(job.pk)
    wait_for(lambda: "ready" in job_log(job.pk), timeout=30, what="the job's tree")
    job.refresh_from_db()
    init = psutil.Process(job.pid)
    assert abs(init.create_time() - job.pid_started) < 0.05
    assert init.cmdline()[0] == "/run/podman-init" and session_of(init.pid) == init.pid  # catatonit leads
    inside = init.children(recursive=True)
    in_session = [p for p in inside if session_of(p.pid) == job.pid]
    assert len(in_session) >= 2, [p.cmdline() for p in inside]  # the launcher and its child
    assert all(p.uids().real == account.pw_uid for p in inside)
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now())
    thread.join(60)


def test_cancel_leaves_nothing_of_a_sigterm_ignoring_tree_with_a_detached_grandchild(
    in_image, alice, podman_of
):
    job = in_image(DEAF_TREE)
    thread, outcome = _in_thread(job.pk)
    wait_for(lambda: "ready True" in job_log(job.pk), timeout=30, what="the job's tree")
    job.refresh_from_db()
    tree = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
    assert any(session_of(p.pid) == p.pid for p in tree[1:]), "no detached grandchild"
    name = executor_for(job).container  # type: ignore[attr-defined]
    container_id = podman("inspect", "--format", "{{.Id}}", name, account=podman_of).stdout.strip()
    assert _mounts_of(container_id), "the running container's mounts were not found"
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
    thread.join(60)
    job.refresh_from_db()
    assert (outcome, job.message) == ([Job.Status.CANCELLED], "Cancelled by alice.")
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert _containers(job, podman_of) == []
    assert _mounts_of(container_id) == []
    assert "SIGKILL" in job_log(job.pk)


def test_a_missing_image_fails_the_job_saying_what_to_do(in_image, image, tmp_path):
    ContainerImage.objects.filter(pk=image.pk).update(reference=str(tmp_path / "gone"))
    job = in_image("print(1)")
    assert job_run(job.pk) == Job.Status.FAILED
    job.refresh_from_db()
    assert "Image pyimg" in job.message and "copies it there" in job.message
    assert "cannot start" in job_log(job.pk)


def test_the_start_overhead_is_small(in_image):
    """Submit → first line for a warm image, as `make bench` measures it (bench/bench_containers.py)."""
    job = in_image("print('hi', flush=True)")
    started = time.monotonic()
    assert job_run(job.pk) == Job.Status.SUCCEEDED
    assert time.monotonic() - started < 15


def test_a_cancelled_job_that_honours_sigterm_ends_by_it(in_image, alice, settings):
    """SIGTERM reaches the script through the container's init (catatonit), as on the host."""
    # The fixture's 1 s grace is shorter than Podman takes to pass the signal and report the end
    # on a loaded machine (CI once saw SIGKILL sent to a job already ending by SIGTERM). A job that
    # honours SIGTERM ends long before this; only a broken path waits it out.
    settings.JOB_KILL_GRACE_SECONDS = 20
    job = in_image("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    thread, outcome = _in_thread(job.pk)
    wait_for(lambda: "ready" in job_log(job.pk), timeout=30, what="the job's start")
    Job.objects.filter(pk=job.pk).update(cancel_requested_at=timezone.now(), cancelled_by=alice)
    thread.join(60)
    job.refresh_from_db()
    assert (outcome, job.exit_code) == ([Job.Status.CANCELLED], -15)
    assert "still running after the grace period" not in job_log(job.pk)
