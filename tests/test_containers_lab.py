"""JupyterLab in a container image (issue 34; jobs/host/lab_image.py): the real supervisor (lab_run)
opens a lab in a root filesystem with JupyterLab built here (tests/container_image.lab_rootfs), on
fake GPU nodes, as its owner's account: root-run Podman with --user, and the account's own rootless
Podman. The lab answers at its host address through the socket the worker made (no port published,
no network in the container), its kernels run in the container with only the booked card, and
its end leaves no process and no container. Skipped where Podman cannot run, failing on CI."""

from __future__ import annotations

import os
import pwd
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import ContainerImage, Server
from jobs.host import lab
from jobs.host.containers import image_pull, leftovers_remove, local_name, podman
from jobs.host.lab import lab_orphans_end, lab_run
from jobs.models import InteractiveSession
from jobs.sessions.services import session_start
from portal.models import Profile
from portal.names import instance_label
from tests.container_image import fake_gpu_nodes, lab_rootfs, need_containers, rootfs, rootless_account
from tests.job_helpers import alive, kill_quietly, recorded_process
from tests.test_containers import _pause_process_ends  # noqa: F401 (a fixture, used by name)
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["root", "rootless"])
def mode(request, settings, alice) -> tuple[str, pwd.struct_passwd]:
    """Each test in both modes, alice's labs as the rootless tier's test account (JOB_USER=@owner:
    a lab runs as its owner's account)."""
    settings.CONTAINER_MODE = request.param
    account = rootless_account()
    if request.param == "rootless":
        request.getfixturevalue("_pause_process_ends")
    settings.JOB_USER = "@owner"
    need_containers(account if request.param == "rootless" else None)
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": account.pw_name})
    return request.param, account


@pytest.fixture
def said_while_starting() -> list[str]:
    """The session's message as the start said a line of a pull (lab_in_image)."""
    return []


@pytest.fixture
def lab_in_image(
    mode, alice, box, settings, tmp_path, monkeypatch, said_while_starting
) -> Iterator[InteractiveSession]:
    """alice's lab in the JupyterLab image on box1 GPU 1 (of four fake nodes), run in a thread;
    ended and its container checked gone at the end. Its start says a pull's line first, which
    the session's page shows while it starts (a folder image needs no pull in root mode)."""
    settings.JOB_KILL_GRACE_SECONDS = 2
    settings.CONTAINER_DEVICE_DIR = str(fake_gpu_nodes(Path(settings.VAR_DIR) / "dev" / tmp_path.name, 4))
    settings.CONTAINER_CDI_DIRS = [str(tmp_path / "no-cdi")]
    monkeypatch.setattr(lab, "KERNEL_CHECK_SECONDS", 0.2)
    monkeypatch.setattr("jobs.sessions.services._send", lambda pk, queue: None)  # no broker: run here
    Server.objects.filter(name="box1").update(containers_ok=True)
    image = ContainerImage.objects.create(name="lab-img", reference=str(lab_rootfs()), has_jupyterlab=True)
    image.servers.set(Server.objects.filter(name="box1"))
    booking = reservation_create(user=alice, gpus=[box[1].uuid], memory_mb=8192)
    session, _ = session_start(user=alice, reservation=booking.pk, kind="jupyterlab", image="lab-img")
    ready = lab.lab_image_ready

    def pulled_first(image, account, say, beat):  # type: ignore[no-untyped-def]
        say("pulling lab-img: 1.0 / 2.0 MB")
        said_while_starting.append(InteractiveSession.objects.get(pk=session.pk).message)
        ready(image, account, say, beat)

    monkeypatch.setattr(lab, "lab_image_ready", pulled_first)
    thread = threading.Thread(target=lambda: lab_run(session.pk), daemon=True)
    thread.start()
    wait_for(lambda: _refreshed(session).status != "starting", timeout=90, what="JupyterLab to answer")
    yield session
    left = _recorded(session)
    InteractiveSession.objects.filter(pk=session.pk).update(end_requested_at=timezone.now())
    thread.join(timeout=60)
    kill_quietly(left)
    assert leftovers_remove(_podman_of(mode)) == [], "a container of this test was left behind"


def _podman_of(mode: tuple[str, pwd.struct_passwd]) -> pwd.struct_passwd | None:
    return mode[1] if mode[0] == "rootless" else None


def _refreshed(session: InteractiveSession) -> InteractiveSession:
    session.refresh_from_db()
    return session


def _recorded(session: InteractiveSession) -> list[psutil.Process]:
    session.refresh_from_db()
    recorded = [(session.pid, session.pid_started), *session.kernels]
    return [proc for pid, started in recorded if (proc := recorded_process(pid, started))]


def _api(session: InteractiveSession, path: str, method: str = "GET", token: bool = True) -> httpx.Response:
    headers = {"Authorization": f"token {session.token}"} if token else {}
    url = f"http://{session.address}/sessions/{session.pk}/lab/api/{path}"
    return httpx.request(method, url, headers=headers, timeout=30)


def _containers(session: InteractiveSession, mode: tuple[str, pwd.struct_passwd]) -> list[str]:
    name = f"portal-{instance_label()}-session-{session.pk}"
    found = podman("ps", "-a", "--filter", f"name={name}", "--format", "{{.Names}}", account=_podman_of(mode))
    return found.stdout.split()


def test_a_lab_in_an_image_runs_in_its_container_with_the_booked_card_alone(
    lab_in_image, mode, box, said_while_starting
):
    session = lab_in_image
    assert session.status == "running", session.message
    assert said_while_starting == ["pulling lab-img: 1.0 / 2.0 MB"] and session.message == ""
    assert session.address.startswith("127.0.0.1:") and _containers(session, mode)
    assert _api(session, "status").status_code == 200  # the worker's socket, from the host
    assert _api(session, "status", token=False).status_code == 403
    init = psutil.Process(session.pid)  # the container's init, by its host pid
    assert init.uids().real == mode[1].pw_uid
    with open(f"/proc/{init.pid}/ns/net") as inside, open("/proc/self/ns/net") as here:
        assert os.fstat(inside.fileno()).st_ino != os.fstat(here.fileno()).st_ino  # no host network

    _api(session, "kernels", "POST").raise_for_status()
    wait_for(lambda: _refreshed(session).kernels, timeout=60, what="the kernel to be recorded")
    kernel = recorded_process(*session.kernels[0])
    assert kernel is not None and kernel.uids().real == mode[1].pw_uid
    env = kernel.environ()
    assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == box[1].uuid
    assert env["PORTAL_IMAGE"] == "lab-img" and env["PORTAL_SESSION_ID"] == str(session.pk)
    assert "PORTAL_LAB_LISTEN_FD" not in env and "JUPYTER_TOKEN" in env
    assert kernel.exe().startswith(f"/proc/{kernel.pid}/root/") or "python" in kernel.exe()
    devices = sorted(os.listdir(f"/proc/{kernel.pid}/root/dev"))
    assert "nvidia1" in devices and not {"nvidia0", "nvidia2", "nvidia3"} & set(devices), devices
    port = int(session.address.rsplit(":", 1)[1])
    assert not [c for c in kernel.net_connections(kind="tcp") if c.laddr.port == port]  # user code: no copy


def test_ending_a_lab_in_an_image_leaves_no_process_and_no_container(lab_in_image, mode):
    session = lab_in_image
    _api(session, "kernels", "POST").raise_for_status()
    wait_for(lambda: _refreshed(session).kernels, timeout=60, what="the kernel to be recorded")
    left = _recorded(session)
    assert len(left) == 2
    address = session.address
    InteractiveSession.objects.filter(pk=session.pk).update(end_requested_at=timezone.now())
    wait_for(lambda: _refreshed(session).status == "ended", timeout=60, what="the lab to end")
    assert session.message == "Ended from the portal." and not session.kernels
    assert not [proc for proc in left if alive(proc)]
    assert _containers(session, mode) == []
    with pytest.raises(httpx.ConnectError):  # nothing listens there now
        httpx.get(f"http://{address}/sessions/{session.pk}/lab/api/status", timeout=5)


@pytest.mark.usefixtures("_pause_process_ends")
def test_a_restarted_worker_removes_a_lab_container_its_owners_rootless_podman_kept(
    alice, box, settings, monkeypatch
):
    """Under rootless Podman (labs: JOB_USER=@owner) no worker's start sweeps an owner's Podman
    (containers_leftovers_remove sweeps root's, or JOB_USER's): a lab container its dead worker
    left stayed in `podman ps -a`, with whatever the lab wrote in the image."""
    settings.CONTAINER_MODE, settings.JOB_USER = "rootless", "@owner"
    account = rootless_account()
    need_containers(account)
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": account.pw_name})
    monkeypatch.setattr("jobs.sessions.services._send", lambda pk, queue: None)
    Server.objects.filter(name="box1").update(containers_ok=True)
    image = ContainerImage.objects.create(name="lab-img", reference=str(rootfs()), has_jupyterlab=True)
    image.servers.set(Server.objects.filter(name="box1"))
    booking = reservation_create(user=alice, gpus=[box[1].uuid], memory_mb=8192)
    session, _ = session_start(user=alice, reservation=booking.pk, kind="jupyterlab", image="lab-img")
    image_pull(image.reference, lambda line: None, account=account)
    left = f"portal-{instance_label()}-session-{session.pk}"  # as its dead worker named it
    made = podman(
        "create", "--name", left, "--", local_name(image.reference, account), "true", account=account
    )
    assert made.returncode == 0, made.stderr
    InteractiveSession.objects.filter(pk=session.pk).update(
        status="running", worker=lab.socket.gethostname()[:200]
    )
    try:
        lab_orphans_end("box1")
        assert _containers(session, ("rootless", account)) == []
    finally:
        podman("rm", "--force", "--ignore", "--", left, account=account)
