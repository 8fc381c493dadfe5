"""A pull's progress in bytes (issue 34; jobs/host/pulls.py): "pulling tf-2.17: 1.2 / 4.8 GB", read
from Podman's progress bars under a pseudo-terminal and said at most every PROGRESS_SECONDS. The
parser on recorded output, then a real pull of an oci-archive: file (no registry is reachable
here) into root's storage and into the test account's rootless storage. The real pulls skip where
Podman cannot run, failing on CI."""

from __future__ import annotations

import contextlib
import pwd
import re
import sys
import threading
import time
from collections.abc import Callable

import psutil
import pytest

from gpus.booking import reservation_create
from gpus.models import ContainerImage, Server
from jobs.host import launch, pulls
from jobs.host.containers import ContainerError, image_pull, local_name, podman
from jobs.host.executors.base import ImageSpec
from jobs.host.lab import lab_run
from jobs.host.launch import image_ready_for
from jobs.host.pulls import PullProgress, shown
from jobs.host.runner import job_run
from jobs.models import InteractiveSession, Job
from jobs.services import job_cancel
from jobs.sessions.services import session_end_request, session_start
from jobs.submit import ScriptUpload, job_submit
from portal.models import Profile
from tests.container_image import need_containers, oci_archive, rootless_account
from tests.test_containers import _pause_process_ends  # noqa: F401 (a fixture, used by name)
from tests.waiting import wait_for

# What Podman 4.3 drew for two layers, a cached one and a config (ANSI redraws as it sends them).
RECORDED = (
    "Getting image source signatures\r\n"
    "Copying blob c09f18b8d88f [==>----------] 5.1MiB / 68.1MiB\r\n"
    "Copying blob 0a1b2c3d4e5f [>------------] 0.0b / 1.5GiB\r\n"
    "\x1b[2A\x1b[JCopying blob c09f18b8d88f [=====>-------] 30.0MiB / 68.1MiB\r\n"
    "Copying blob 0a1b2c3d4e5f [=>-----------] 120.3MiB / 1.5GiB\r\n"
    "\x1b[2A\x1b[JCopying blob c09f18b8d88f done  \r\n"
    "Copying blob 0a1b2c3d4e5f [====>--------] 512.0MiB / 1.5GiB\r\n"
    "Copying blob 99aa88bb77cc skipped: already exists  \r\n"
    "Copying config 91a21685df [===========] 409.0b / 409.0b\r\n\x1b[1A\x1b[J"
    "Copying config 91a21685df done  \r\n"
    "Writing manifest to image destination\r\nStoring signatures\r\n"
    "91a21685dfdc1bd32747a4da6b48776a07b08776e2e9d031c18a5d1040ee676e\r\n"
)


def test_it_adds_up_the_layers_bars_wherever_the_output_is_cut():
    for cut in (1, 7, 64, len(RECORDED)):
        progress = PullProgress()
        for start in range(0, len(RECORDED), cut):
            progress.feed(RECORDED[start : start + cut])
        progress.end()
        assert progress.layers == {
            "c09f18b8d88f": (int(68.1 * 2**20), int(68.1 * 2**20)),  # done: all of it
            "0a1b2c3d4e5f": (512 * 2**20, int(1.5 * 2**30)),
            "99aa88bb77cc": (0, 0),  # cached: nothing to copy
        }
        assert shown(progress.copied, progress.total) == "0.6 / 1.7 GB"
        assert progress.lines[0] == "Getting image source signatures"
        assert progress.lines[-1] == "91a21685dfdc1bd32747a4da6b48776a07b08776e2e9d031c18a5d1040ee676e"
        assert not [line for line in progress.lines if "Copying" in line or "\x1b" in line]


def test_odd_output_neither_fails_the_pull_nor_grows_without_bound():
    progress = PullProgress()
    progress.feed("Copying blob 1a2b3c [...] ..B / 5.0MiB\r\n")  # no number: not a bar, no error
    progress.feed("x" * 1_000_000)  # a line that never ends
    assert len(progress.rest) <= pulls.LINE_MAX
    progress.feed("\r\n" + "".join(f"Podman says {n}\r\n" for n in range(10_000)))
    assert len(progress.lines) <= pulls.LINES_KEPT and progress.lines[-1] == "Podman says 9999"
    assert progress.layers == {}


def test_sizes_are_shown_in_decimal_units():
    assert shown(1_234_000_000, 4_800_000_000) == "1.2 / 4.8 GB"
    assert shown(12_300_000, 45_600_000) == "12.3 / 45.6 MB"


@pytest.mark.django_db
@pytest.mark.parametrize("mode", ["root", "rootless"])
def test_a_real_pull_says_its_progress_in_bytes_throttled(mode, settings, monkeypatch, request):
    """An oci-archive: of the tests' root filesystem (21 MB, 60 MB unpacked), pulled for real: one
    progress line with sizes at least, the last all of it, and no more than one per PROGRESS_SECONDS
    (Podman redraws its bars every 0.15 s)."""
    settings.CONTAINER_MODE = mode
    account = rootless_account() if mode == "rootless" else None
    if account is not None:
        settings.JOB_USER = account.pw_name
        request.getfixturevalue("_pause_process_ends")
    need_containers(account)
    reference = f"oci-archive:{oci_archive()}"
    _forget(reference, account)  # a pull, not a cache hit
    monkeypatch.setattr(pulls, "PROGRESS_SECONDS", 0.5)
    said: list[str] = []
    started = time.monotonic()
    image_pull(reference, said.append, account=account, name="pull-img")
    took = time.monotonic() - started
    progress = [line for line in said if re.fullmatch(r"pulling pull-img: \d+\.\d / \d+\.\d MB", line)]
    assert progress, said
    copied, total = re.findall(r"[\d.]+", progress[-1])
    assert copied == total and float(total) > 10, progress
    assert len(progress) <= 2 + took / pulls.PROGRESS_SECONDS, (took, progress)
    assert said[0].startswith(f"pulling pull-img: loading {reference}") and said[-1].startswith(
        "pulled pull-img in"
    )
    assert podman("image", "exists", "--", local_name(reference, account), account=account).returncode == 0
    _forget(reference, account)


def _forget(reference: str, account: pwd.struct_passwd | None) -> None:
    """The archive's image gone from the storage, by its id: a pull of an oci-archive: keeps the
    name the archive holds too, so removing the portal's name alone would leave its layers."""
    found = podman(
        "image", "inspect", "--format", "{{.Id}}", "--", local_name(reference, account), account=account
    )
    if found.returncode == 0:
        podman("rmi", "--force", "--", found.stdout.strip(), account=account)


def test_a_pull_keeps_the_runs_heartbeat_and_stops_with_it(monkeypatch, settings):
    """A pull of a few GB outlasts a run's lost cut-off (JOB_LOST_AFTER_SECONDS, 30 s), silent
    while a layer unpacks: the run's heartbeat goes on meanwhile, and ends with the pull."""
    settings.JOB_HEARTBEAT_SECONDS = 0.05
    beats: list[float] = []
    said: list[str] = []

    def pull(reference: str, say, account=None, name="", stop=None) -> None:  # type: ignore[no-untyped-def]
        say(f"pulling {name}: 0.0 / 4.8 GB")
        wait_for(lambda: len(beats) >= 3, timeout=10, what="beats while the pull runs")

    def beat() -> bool:  # the run still wants its image
        beats.append(1)
        return True

    monkeypatch.setattr(launch, "runtime_status", lambda: (True, "podman 4.3.1"))
    monkeypatch.setattr(launch, "image_pull", pull)
    image_ready_for(ImageSpec("tf-2.17", "registry.lab.example/tf:2.17"), None, said.append, beat)
    assert said == ["[portal] pulling tf-2.17: 0.0 / 4.8 GB"] and len(beats) >= 3
    assert not [thread for thread in threading.enumerate() if thread.name == "pull-beat"]


# A pull that forks (rootless Podman re-runs itself in the account's user namespace, a child that
# holds the terminal too), prints each process's pid, and never ends by itself.
FORKING_PULL = (
    "import os, sys, time\n{before}os.fork()\nos.write(1, b'pid %d\\n' % os.getpid())\ntime.sleep(30)\n"
)


def _pids(progress: PullProgress) -> list[int]:
    return [int(line.split()[1]) for line in progress.lines if line.startswith("pid ")]


def test_a_pull_past_its_time_is_ended_with_the_processes_it_started():
    """Killing the pull's own process alone left rootless Podman's child holding the terminal:
    the pull went on, and its run's heartbeat with it, past CONTAINER_PULL_SECONDS."""
    started = time.monotonic()
    pulled = pulls.pull_in_pty([sys.executable, "-c", FORKING_PULL.format(before="")], print, 1.0)
    assert time.monotonic() - started < 10 and pulled.code < 0
    assert len(_pids(pulled.progress)) == 2, pulled.progress.lines
    wait_for(
        lambda: not [pid for pid in _pids(pulled.progress) if _alive(pid)],
        5,
        what="the pull's processes gone",
    )


def test_a_process_that_left_the_pulls_group_does_not_hold_it_past_its_time(monkeypatch):
    monkeypatch.setattr(pulls, "DRAIN_SECONDS", 1.0)
    started = time.monotonic()
    escapes = FORKING_PULL.format(before="os.fork() and sys.exit(0)\nos.setsid()\n")  # only its child stays
    pulled = pulls.pull_in_pty([sys.executable, "-c", escapes], print, 1.0)
    try:
        assert time.monotonic() - started < 6, pulled.progress.lines
    finally:
        for pid in _pids(pulled.progress):  # the test's own grandchild, still named by its command
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if escapes in proc.cmdline():
                    proc.kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_pull_asked_to_stop_ends_at_once():
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    pulled = pulls.pull_in_pty([sys.executable, "-c", FORKING_PULL.format(before="")], print, 60, stop=stop)
    assert time.monotonic() - started < 5 and pulled.code < 0
    wait_for(
        lambda: not [pid for pid in _pids(pulled.progress) if _alive(pid)],
        5,
        what="the pull's processes gone",
    )


def _pull_until_stopped(run_ended: Callable[[], object]) -> Callable[..., None]:
    """A first pull of a few GB (it never ends by itself) during which the run is ended, as
    image_pull: stopped by its `stop`, it says so."""

    def pull(reference: str, say, account=None, name="", stop=None) -> None:  # type: ignore[no-untyped-def]
        say(f"pulling {name}: 0.0 / 4.8 GB")
        run_ended()
        wait_for(lambda: stop is not None and stop.is_set(), timeout=10, what="the pull to be stopped")
        raise ContainerError(f"Could not pull {reference}: it was stopped")

    return pull


@pytest.mark.django_db(transaction=True)
def test_a_job_cancelled_while_its_image_is_pulled_stops_the_pull_and_is_cancelled(
    alice, box, settings, monkeypatch
):
    """The pull kept the run's heartbeat whatever happened to the job: a cancel waited for the
    pull's end (CONTAINER_PULL_SECONDS, an hour), the job STARTING all along, then FAILED."""
    settings.JOB_HEARTBEAT_SECONDS = 0.05
    settings.JOB_USER = "nobody"  # a job in an image never runs as root
    image = ContainerImage.objects.create(name="tf-2.17", reference="registry.lab.example/tf:2.17")
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="job.py", content=b"print(1)"))
    Job.objects.filter(pk=job.pk).update(image=image)
    monkeypatch.setattr(launch, "runtime_status", lambda: (True, "podman 4.3.1"))
    monkeypatch.setattr(launch, "card_minors", lambda uuids, indexes: (0,))
    monkeypatch.setattr(launch, "image_pull", _pull_until_stopped(lambda: job_cancel(user=alice, job=job.pk)))
    assert job_run(job.pk) == Job.Status.CANCELLED
    job.refresh_from_db()
    assert job.message == "Cancelled by alice." and job.started_at is None, job.message


@pytest.mark.django_db(transaction=True)
def test_a_lab_ended_while_its_image_is_pulled_stops_the_pull(alice, box, settings, monkeypatch):
    settings.JOB_HEARTBEAT_SECONDS = 0.05
    settings.JOB_USER = "@owner"
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "nobody"})
    Server.objects.filter(name="box1").update(containers_ok=True)
    image = ContainerImage.objects.create(
        name="lab-img", reference="registry.lab.example/lab:1", has_jupyterlab=True
    )
    image.servers.set(Server.objects.filter(name="box1"))
    monkeypatch.setattr("jobs.sessions.services._send", lambda pk, queue: None)
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    session, _ = session_start(user=alice, reservation=booking.pk, kind="jupyterlab", image="lab-img")
    monkeypatch.setattr(launch, "runtime_status", lambda: (True, "podman 4.3.1"))
    ended = _pull_until_stopped(lambda: session_end_request(session=session, by=alice))
    monkeypatch.setattr(launch, "image_pull", ended)
    assert lab_run(session.pk) == InteractiveSession.Status.FAILED
    session.refresh_from_db()
    assert session.message == "Ended from the portal." and session.address == "", session.message
