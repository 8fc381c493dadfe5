"""JupyterLab sessions, the worker's side (jobs.host.lab): a real JupyterLab started in the booking's
environment on the listening socket its worker made (tests/test_lab_listener.py races it), its
token and its port kept off the command line, its kernels recorded and ended by identity, and every
way a lab ends (its owner, the booking's end, idleness, its server dying, a worker restart). The
supervisor runs in this process (lab_run), as a worker's pool process runs it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import replace
from datetime import timedelta

import httpx
import psutil
import pytest
from django.db import OperationalError
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.utils import timezone
from websockets.sync.client import connect

from gpus.booking import reservation_create
from gpus.models import Reservation, Violation
from gpus.simulated.local_jobs import local_job_processes
from jobs.host import lab
from jobs.host.lab import lab_orphans_end, lab_run
from jobs.host.watchdog import HostWatchdog
from jobs.models import InteractiveSession
from jobs.sessions.services import session_end_request, session_start
from portal.models import AuditEntry, Notification
from portal.pids import started_at
from tests.factories import make_snapshot
from tests.job_helpers import alive, kill_quietly, recorded_process
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lab_session(alice, box, settings, monkeypatch):
    """Start a lab on alice's 8 GiB share of box1 GPU 0 in a thread; yields (session, outcome)."""
    settings.JOB_KILL_GRACE_SECONDS = 2
    monkeypatch.setattr(lab, "KERNEL_CHECK_SECONDS", 0.2)
    monkeypatch.setattr("jobs.sessions.services._send", lambda pk, queue: None)  # no broker: run here
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    session, _ = session_start(user=alice, reservation=booking.pk, kind="jupyterlab")
    outcome: list[str | None] = []
    thread = threading.Thread(target=lambda: outcome.append(lab_run(session.pk)), daemon=True)
    thread.start()
    wait_for(lambda: _status(session) != "starting", timeout=90, what="JupyterLab to answer")
    session.refresh_from_db()
    yield session, outcome, thread
    left = _lab_procs(session)  # while the row still names them
    InteractiveSession.objects.filter(pk=session.pk).update(end_requested_at=timezone.now())
    thread.join(timeout=30)
    kill_quietly(left)


def _status(session: InteractiveSession) -> str:
    return InteractiveSession.objects.values_list("status", flat=True).get(pk=session.pk)


def _refreshed(session: InteractiveSession) -> InteractiveSession:
    session.refresh_from_db()
    return session


def _lab_procs(session: InteractiveSession) -> list[psutil.Process]:
    """The lab's server and kernels the row records, those still running, by handle."""
    session.refresh_from_db()
    recorded = [(session.pid, session.pid_started), *session.kernels]
    return [proc for pid, started in recorded if (proc := recorded_process(pid, started))]


def _api(
    session: InteractiveSession, path: str, method: str = "GET", token: str | None = None
) -> httpx.Response:
    headers = {"Authorization": f"token {token or session.token}"} if token != "" else {}
    return httpx.request(
        method, f"http://{session.address}/sessions/{session.pk}/lab/api/{path}", headers=headers
    )


def _kernel(session: InteractiveSession) -> psutil.Process:
    """A kernel started through the server's API, once the supervisor has recorded it."""
    _api(session, "kernels", "POST")
    wait_for(lambda: _refreshed(session).kernels, timeout=60, what="the kernel to be recorded")
    kernel = recorded_process(*session.kernels[0])
    assert kernel is not None, "the kernel the lab recorded is gone"
    return kernel


def test_it_serves_the_lab_with_the_token_only_in_the_bookings_environment(lab_session, box):
    session, _, _ = lab_session
    assert session.status == "running" and session.address.startswith("127.0.0.1:")
    assert _api(session, "status").status_code == 200
    assert _api(session, "status", token="").status_code == 403  # no token: nothing
    server = psutil.Process(session.pid)
    assert session.token not in " ".join(server.cmdline())  # the command line is anyone's to read
    # Nor its port (tests/test_lab_listener.py races a lab for it).
    assert not [arg for arg in server.cmdline() if arg.startswith("--ServerApp.port")]
    assert os.getsid(session.pid) == session.pid  # a session of its own, as a job's
    kernel = _kernel(session)
    port = int(session.address.rsplit(":", 1)[1])
    # The lab's listener stays the server's: a kernel (user code) holds no copy of it.
    assert not [c for c in kernel.net_connections(kind="tcp") if c.laddr.port == port]
    env = kernel.environ()
    assert "PORTAL_LAB_LISTEN_FD" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == box[0].uuid and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert (
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) < 1
    )
    assert json.loads(env["PORTAL_LAUNCH_CONFIG"])["memory_limit_mb"] > 0
    assert env["PORTAL_SESSION_ID"] == str(session.pk)


def run_cell(session: InteractiveSession, code: str) -> str:
    """Run `code` in a new kernel of the lab over Jupyter's own websocket protocol; its output."""
    kernel = _api(session, "kernels", "POST").json()["id"]
    url = f"ws://{session.address}/sessions/{session.pk}/lab/api/kernels/{kernel}/channels"
    msg_id = uuid.uuid4().hex
    request = {
        "header": {
            "msg_id": msg_id,
            "username": "test",
            "session": uuid.uuid4().hex,
            "msg_type": "execute_request",
            "version": "5.3",
        },
        "parent_header": {},
        "metadata": {},
        "content": {
            "code": code,
            "silent": False,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": False,
        },
        "channel": "shell",
        "buffers": [],
    }
    output = []
    with connect(url, additional_headers={"Authorization": f"token {session.token}"}) as ws:
        ws.send(json.dumps(request))
        while True:
            message = json.loads(ws.recv(timeout=60))
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if message["msg_type"] == "stream":
                output.append(message["content"]["text"])
            elif message["msg_type"] == "error":
                raise AssertionError("\n".join(message["content"]["traceback"]))
            elif message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                return "".join(output)


def test_each_kernel_gets_the_launchers_caps_and_card_guard(lab_session, box):
    """The portal's kernel spec runs the launcher's hooks before the first cell: TensorFlow and
    PyTorch are capped when imported, and an old tutorial's CUDA_VISIBLE_DEVICES=0 stays on the
    booked card; nothing of it is left in the notebook's namespace."""
    session, _, _ = lab_session
    code = (
        "import os, sys\n"
        "os.environ['CUDA_VISIBLE_DEVICES'] = '0'\n"
        "print(os.environ['CUDA_VISIBLE_DEVICES'])\n"
        "print(sorted({type(h).__name__ for h in sys.meta_path}))\n"
        "print('_portal_caps' in dir())\n"
    )
    output = run_cell(session, code)
    assert '[portal] CUDA_VISIBLE_DEVICES="0" asked by the script' in output  # said, as in a job
    card, hooks, leftover = [line for line in output.splitlines() if not line.startswith("[portal]")][:3]
    assert card == box[0].uuid
    assert "ImportHook" in hooks and leftover == "False"


def test_the_watchdog_takes_the_labs_server_and_a_kernel_not_recorded_yet_for_the_lab(
    lab_session, box, settings, monkeypatch
):
    """A lab runs as the worker's own account where JOB_USER is unset (here, as in `make run`), not
    its owner's: its processes are the booking's all the same, as a job's are (its pid is the
    worker's record, not the owner's word), and so is a kernel in the seconds before the lab's
    supervisor records it (the lab's server is its ancestor). Both used to be intruders, stopped
    after the policy's grace."""
    session, _, _ = lab_session
    server = psutil.Process(session.pid)
    with monkeypatch.context() as unrecorded:
        # The supervisor finds no kernel meanwhile (it looks every tick here): the round's moment.
        unrecorded.setattr(lab, "_kernel_sessions", lambda leader: [])
        _api(session, "kernels", "POST")
        kernel = wait_for(
            lambda: next((c for c in server.children(recursive=True) if os.getsid(c.pid) == c.pid), None),
            timeout=60,
            what="the kernel",
        )
        assert isinstance(kernel, psutil.Process)
        verdicts, processes = _watchdog_round(session, box, settings)
    assert {p.pid for p in processes} == {session.pid, kernel.pid}, processes
    assert sorted((v.process.pid, v.kind.value, v.session_pk) for v in verdicts) == sorted(
        [(session.pid, "ok", session.pk), (kernel.pid, "ok", session.pk)]
    )
    assert not Violation.objects.exists()
    # Recorded since (and so ended with the lab, by identity).
    wait_for(lambda: _refreshed(session).kernels, timeout=30, what="the kernel to be recorded")


def _watchdog_round(session: InteractiveSession, box: list, settings) -> tuple[list, tuple]:  # type: ignore[no-untyped-def]
    """A worker's watchdog round on what the simulated driver shows on box1 GPU 0 now, with the
    lab's kernels not recorded yet."""
    assert _refreshed(session).kernels == []
    found = local_job_processes(settings.WORKER_SERVER, settings.PORTAL_INSTANCE_ID)
    processes = tuple(found.get(box[0].uuid, ()))
    snapshot = make_snapshot("box1", gpus=4, processes=0)
    cards = (replace(snapshot.gpus[0], processes=processes), *snapshot.gpus[1:])
    watchdog = HostWatchdog("box1", simulated=False, worker=os.getpid())
    return watchdog.round(replace(snapshot, gpus=cards), now=timezone.now()), processes


def test_a_kernels_record_that_failed_is_written_at_the_next_look(lab_session, monkeypatch):
    """The row is what the watchdog and a restarted worker know a kernel by: a write the database
    refused is tried again, not forgotten until another kernel comes."""
    session, _, _ = lab_session
    refused: list[object] = []
    update = QuerySet.update

    def once(self, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("kernels") and not refused:
            refused.append(kwargs["kernels"])
            raise OperationalError("server closed the connection unexpectedly")
        return update(self, **kwargs)

    monkeypatch.setattr(QuerySet, "update", once)
    _api(session, "kernels", "POST")
    wait_for(lambda: refused, timeout=60, what="the refused write")
    wait_for(lambda: _refreshed(session).kernels, timeout=10, what="the kernel written after all")


def test_ended_by_its_owner_it_leaves_no_server_or_kernel_behind(lab_session, alice):
    session, outcome, thread = lab_session
    kernel = _kernel(session)
    procs = _lab_procs(session)
    session_end_request(session=session, by=alice)
    thread.join(timeout=30)
    assert outcome == ["ended"]
    # A killed kernel whose server exited first is reaped by init, whenever init gets to it: a
    # zombie then (psutil's is_running() says True for one), holding nothing.
    assert len(procs) == 2 and not any(alive(proc) for proc in [*procs, kernel])
    session.refresh_from_db()
    assert session.message == "Ended from the portal." and session.kernels == []
    assert session.address == ""  # the relay stopped before its port was let go
    assert not AuditEntry.objects.filter(action=AuditEntry.Action.SESSION_STOP).exists()  # her own doing


def test_the_bookings_end_stops_it_warned_told_and_audited(lab_session, alice):
    session, outcome, thread = lab_session
    end = timezone.now() + timedelta(seconds=3)
    Reservation.objects.filter(pk=session.reservation_id).update(end=end, booked_end=end)
    thread.join(timeout=30)
    assert outcome == ["ended"]
    session.refresh_from_db()
    assert session.message.startswith("The booking ended at")
    assert Notification.objects.filter(user=alice, kind=Notification.Kind.SESSION_ENDING).count() == 1
    assert AuditEntry.objects.filter(
        action=AuditEntry.Action.SESSION_STOP, target=f"session {session.pk}"
    ).exists()
    assert session.pid and not alive(recorded_process(session.pid, session.pid_started))


def test_it_ends_after_the_idle_limit_without_kernel_activity(lab_session, monkeypatch):
    session, outcome, thread = lab_session
    monkeypatch.setattr(lab, "idle_limit_seconds", lambda: 1.0)
    thread.join(timeout=30)
    assert outcome == ["ended"]
    session.refresh_from_db()
    assert "No kernel activity for" in session.message and "an idle lab ends then" in session.message


def test_its_kernels_go_when_its_server_dies(lab_session):
    session, outcome, thread = lab_session
    kernel = _kernel(session)
    server = recorded_process(session.pid, session.pid_started)
    assert server is not None, "the lab's server is gone before the test killed it"
    server.kill()
    thread.join(timeout=30)
    assert outcome == ["ended"]
    wait_for(
        lambda: not kernel.is_running() or kernel.status() == psutil.STATUS_ZOMBIE, timeout=10, what="kernel"
    )


def test_a_restarted_worker_ends_what_its_labs_left(alice, box):
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jobs.sessions.services._send", lambda pk, queue: None)
        session, _ = session_start(user=alice, reservation=booking.pk, kind="jupyterlab")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    server = subprocess.Popen(sleeper, start_new_session=True)
    kernel = subprocess.Popen(sleeper, start_new_session=True)
    try:
        InteractiveSession.objects.filter(pk=session.pk).update(
            status="running",
            worker=lab.socket.gethostname()[:200],
            pid=server.pid,
            pid_started=started_at(server.pid),
            kernels=[[kernel.pid, started_at(kernel.pid)]],
        )
        assert lab_orphans_end(box[0].server.name) == 2
        assert server.wait(timeout=10) == -signal.SIGKILL and kernel.wait(timeout=10) == -signal.SIGKILL
        session.refresh_from_db()
        assert session.status == "ended" and "its worker restarted" in session.message
        assert Notification.objects.filter(user=alice, kind=Notification.Kind.JOB_STOPPED).exists()
    finally:
        for proc in (server, kernel):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()


def test_a_lab_is_refused_where_everyones_labs_would_share_one_account(alice, box, settings, monkeypatch):
    settings.JOB_USER = "nobody"
    monkeypatch.setattr("jobs.sessions.services._send", lambda pk, queue: None)
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    session, _ = session_start(user=alice, reservation=booking.pk, kind="jupyterlab")
    assert lab_run(session.pk) == "failed"
    session.refresh_from_db()
    assert "JOB_USER=@owner" in session.message and session.pid is None


def test_a_lab_marked_lost_while_its_supervisor_lives_is_stopped(lab_session, settings):
    """A lost run is never taken back (jobs.runs): its supervisor stops it, and says so once."""
    from jobs.services import jobs_reconcile

    session, _, thread = lab_session
    aged = Now() - timedelta(seconds=settings.SESSION_LOST_AFTER_SECONDS + 5)  # the database's clock judges

    def lost() -> int:  # its supervisor may beat between the two: then again
        InteractiveSession.objects.filter(pk=session.pk).update(beat_at=aged)
        return jobs_reconcile()["sessions_lost"]

    wait_for(lost, timeout=10, what="the lab marked lost")
    thread.join(timeout=30)
    assert not thread.is_alive()
    session.refresh_from_db()
    assert session.status == "ended" and session.message.startswith("Lost, then stopped:")
    assert session.kernels == [] and session.address == ""
    told = AuditEntry.objects.filter(target=f"session {session.pk}", message__contains="marked lost")
    assert told.count() == 1


def test_a_restarted_worker_never_ends_another_accounts_process_a_row_names(alice, box):
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jobs.sessions.services._send", lambda pk, queue: None)
        session, _ = session_start(user=alice, reservation=booking.pk, kind="jupyterlab")
    if psutil.Process().uids().real != 0:
        pytest.skip("needs root to start a process as another account")
    other = subprocess.Popen(["sleep", "60"], start_new_session=True, user=65534, group=65534)
    try:
        wait_for(lambda: started_at(other.pid), timeout=10, what="the process")
        InteractiveSession.objects.filter(pk=session.pk).update(
            status="running",
            worker=lab.socket.gethostname()[:200],
            pid=other.pid,
            pid_started=started_at(other.pid),
        )
        assert lab_orphans_end(box[0].server.name) == 0
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
