"""Interactive sessions on a booking (jobs.sessions.services, /api/v1/sessions/): what `gpu exec` and
`gpu shell` ask the portal, the refusals that write nothing, the beat and the stop it answers,
the lost session, and how the watchdog counts the command's processes as the booking's."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta

import psutil
import pytest
from django.db.models.functions import Now
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.inventory import GPUInfo, ProcessInfo
from gpus.models import Reservation, Server
from gpus.services import server_report_ingest
from jobs.host import watchdog_sessions
from jobs.host.watchdog import round_facts
from jobs.host.watchdog_sessions import sessions_in
from jobs.models import InteractiveSession
from jobs.services import jobs_reconcile
from jobs.sessions.services import host_matches
from jobs.watchdog.rules import BookingFacts, JobFacts, Kind, SessionFacts, classify
from portal.models import AuditEntry, Notification
from tests.factories import make_snapshot

pytestmark = pytest.mark.django_db


def api(user) -> APIClient:  # type: ignore[no-untyped-def]
    client = APIClient()
    client.force_authenticate(user)
    return client


def _sessions_of(server: int, sessions: dict[int, float]) -> list[SessionFacts]:
    """What the watchdog's round makes of the host's running sessions, given its processes."""
    return sessions_in(round_facts(server, timezone.now()).sessions, sessions)


def beat_ago(pk: int, seconds: int) -> None:
    """The session's last beat `seconds` ago by the database's clock, which judges it."""
    InteractiveSession.objects.filter(pk=pk).update(beat_at=Now() - timedelta(seconds=seconds))


def start(user, **body):  # type: ignore[no-untyped-def]
    body = {"kind": "exec", "host": "box1", "command": ["python", "train.py"], **body}
    return api(user).post("/api/v1/sessions/", body, format="json")


def test_it_answers_the_bookings_environment_by_card_uuid(alice, booking, box, settings):
    answer = start(alice, reservation=booking.pk)
    assert answer.status_code == 201, answer.json()
    body = answer.json()
    env = body["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == box[0].uuid
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["PORTAL_RESERVATION_ID"] == str(booking.pk)
    assert env["PORTAL_SESSION_ID"] == str(body["id"])
    # A shared card: JAX grows within the share, TF limits to it and grows (jobs.environment).
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert 0 < float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) < 1
    config = json.loads(env["PORTAL_LAUNCH_CONFIG"])
    assert config["allow_growth"] is True
    assert config["memory_limit_mb"] == booking.allocations.get().memory_mb - settings.GPU_CONTEXT_HEADROOM_MB
    assert (body["status"], body["kind"], body["server"], body["command"]) == (
        "starting",
        "exec",
        "box1",
        ["python", "train.py"],
    )
    assert body["beat_seconds"] == settings.SESSION_BEAT_SECONDS and body["launcher"] is True
    assert body["ends_at"].startswith(booking.end.strftime("%Y-%m-%dT%H:%M"))


def test_without_a_booking_it_takes_the_callers_one_booking_on_that_host(alice, booking):
    answer = start(alice)
    assert answer.status_code == 201 and answer.json()["reservation"] == booking.pk


def test_a_whole_card_caps_nothing_but_grows(alice, box):
    whole = reservation_create(user=alice, gpus=[box[1].uuid])
    env = start(alice, reservation=whole.pk).json()["env"]
    config = json.loads(env["PORTAL_LAUNCH_CONFIG"])
    assert config["memory_limit_mb"] is None and config["allow_growth"] is True


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"host": "box2"}, "host", "not on box2: run the command on box1"),
        ({"host": ""}, "host", ""),
        ({"kind": "notebook"}, "kind", ""),
        ({"command": []}, "command", "Give the command"),
        ({"command": "python train.py"}, "command", ""),
        ({"reservation": 999999}, "reservation", "no booking 999999 of yours"),
    ],
)
def test_bad_input_names_the_field_and_writes_nothing(alice, booking, body, field, words):
    answer = start(alice, **{"reservation": booking.pk, **body})
    assert answer.status_code == 400, answer.json()
    assert field in answer.json()["errors"]
    assert words in json.dumps(answer.json())
    assert not InteractiveSession.objects.exists()


def test_it_refuses_outside_the_bookings_window(alice, box):
    later = timezone.now() + timedelta(hours=2)
    upcoming = reservation_create(user=alice, gpus=[box[0].uuid], start=later, end=later + timedelta(hours=1))
    answer = start(alice, reservation=upcoming.pk)
    assert answer.status_code == 400
    assert "is upcoming (it starts at" in answer.json()["detail"]
    assert "within a booking's window only" in answer.json()["detail"]
    assert not InteractiveSession.objects.exists()


def test_it_refuses_an_ended_booking(alice, booking):
    Reservation.objects.filter(pk=booking.pk).update(released_at=timezone.now(), end=timezone.now())
    answer = start(alice, reservation=booking.pk)
    assert answer.status_code == 400 and "released" in answer.json()["detail"]


def test_it_refuses_someone_elses_booking(alice, bob, booking):
    answer = start(bob, reservation=booking.pk)  # a teammate sees it, but it is not his
    assert answer.status_code == 403 and "someone else's" in answer.json()["detail"]
    assert not InteractiveSession.objects.exists()


def test_it_asks_which_when_the_caller_has_several_bookings_on_the_host(alice, booking, box):
    other = reservation_create(user=alice, gpus=[box[1].uuid], memory_mb=4096)
    answer = start(alice)
    assert answer.status_code == 400
    assert (
        f"#{booking.pk}, #{other.pk}" in answer.json()["detail"]
        and "--reservation" in answer.json()["detail"]
    )


def test_it_says_when_the_caller_has_no_booking_on_the_host(alice, box):
    answer = start(alice)
    assert answer.status_code == 400 and "no booking active now on box1" in answer.json()["detail"]


def test_a_booking_elsewhere_is_named_with_how_to_run_there(alice, box):
    """A simulated server has no machine to log in to: GPU_SERVER is the way (issue 38); a real
    one may be this machine under another name."""
    server_report_ingest(snapshot=make_snapshot("sim-rtx-4x24", gpus=4, simulated=True))
    sim = reservation_create(user=alice, gpus=["GPU-sim-rtx-4x24-00"], memory_mb=8192)
    detail = start(alice, host="vm").json()["detail"]
    assert f"your booking {sim.pk} is on sim-rtx-4x24" in detail
    assert "simulated" in detail and "`GPU_SERVER=sim-rtx-4x24 gpu exec …`" in detail
    detail = start(alice, host="vm", kind="shell", reservation=sim.pk).json()["detail"]
    assert (
        f"Booking {sim.pk} is on sim-rtx-4x24 (sim-rtx-4x24.lab), not on vm" in detail
        and "GPU_SERVER=sim-rtx-4x24 gpu shell`" in detail
    )
    real = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    detail = start(alice, host="vm", reservation=real.pk).json()["detail"]
    assert "run the command on box1, or, where this machine is box1 under another name," in detail
    assert "`GPU_SERVER=box1 gpu exec …`" in detail


def test_the_host_is_the_servers_name_or_hostname_in_any_form(box):
    server = Server.objects.get(name="box1")
    server.hostname = "gpu-box1.lab.example.org"
    assert host_matches(server, "box1") and host_matches(server, "BOX1.lab.example.org")
    assert host_matches(server, "gpu-box1") and host_matches(server, "gpu-box1.lab.example.org")
    assert not host_matches(server, "box2") and not host_matches(server, "")


def test_the_command_runs_beats_and_finishes(alice, booking):
    client = api(alice)
    pk = start(alice, reservation=booking.pk).json()["id"]
    assert client.patch(f"/api/v1/sessions/{pk}/", {"pid": 4242, "pid_started": 1.5e9}, format="json").json()[
        "status"
    ] == ("running")
    assert client.patch(f"/api/v1/sessions/{pk}/", {"pid": 4343}, format="json").status_code == 400  # once
    beat = client.post(f"/api/v1/sessions/{pk}/beat/").json()
    assert beat["end_requested"] is False and beat["status"] == "running"
    done = client.post(f"/api/v1/sessions/{pk}/finish/", {"exit_code": 3}, format="json").json()
    assert (done["status"], done["exit_code"], done["message"]) == ("ended", 3, "")
    assert not AuditEntry.objects.filter(action=AuditEntry.Action.SESSION_STOP).exists()  # it ended itself


def test_a_pid_of_one_or_less_is_refused(alice, booking):
    pk = start(alice, reservation=booking.pk).json()["id"]
    answer = api(alice).patch(f"/api/v1/sessions/{pk}/", {"pid": 1}, format="json")
    assert answer.status_code == 400 and "pid" in answer.json()["errors"]


def test_ended_from_the_portal_the_next_beat_says_stop(alice, leader, booking):
    pk = start(alice, reservation=booking.pk).json()["id"]
    api(alice).patch(f"/api/v1/sessions/{pk}/", {"pid": 4242}, format="json")
    assert api(leader).delete(f"/api/v1/sessions/{pk}/").status_code == 200
    beat = api(alice).post(f"/api/v1/sessions/{pk}/beat/").json()
    assert beat["end_requested"] is True and "ended from the portal" in beat["message"]


def test_a_stop_by_gpu_is_told_and_audited(alice, booking):
    pk = start(alice, reservation=booking.pk).json()["id"]
    api(alice).patch(f"/api/v1/sessions/{pk}/", {"pid": 4242}, format="json")
    why = "the booking ended at 14:00"
    api(alice).post(f"/api/v1/sessions/{pk}/finish/", {"exit_code": 143, "message": why}, format="json")
    entry = AuditEntry.objects.get(action=AuditEntry.Action.SESSION_STOP)
    assert why in entry.message and entry.target == f"session {pk}"
    assert Notification.objects.filter(
        user=alice, kind=Notification.Kind.JOB_STOPPED, body__contains=why
    ).exists()


def test_the_first_beat_near_the_end_warns_once_in_the_inbox(alice, booking, settings):
    end = timezone.now() + timedelta(minutes=settings.SESSION_WARN_MINUTES - 1)
    Reservation.objects.filter(pk=booking.pk).update(end=end, booked_end=end)
    pk = start(alice, reservation=booking.pk).json()["id"]
    api(alice).post(f"/api/v1/sessions/{pk}/beat/")
    warned = Notification.objects.filter(user=alice, kind=Notification.Kind.SESSION_ENDING)
    assert warned.count() == 1 and "stops then" in warned.get().subject


def test_a_session_whose_beats_stopped_is_ended_as_lost(alice, booking, settings):
    pk = start(alice, reservation=booking.pk).json()["id"]
    lost_after = settings.SESSION_LOST_AFTER_SECONDS
    beat_ago(pk, lost_after - 1)  # beats and their cut-off: the database's clock (portal.clock)
    assert jobs_reconcile()["sessions_lost"] == 0
    beat_ago(pk, lost_after + 1)
    assert jobs_reconcile()["sessions_lost"] == 1
    session = InteractiveSession.objects.get(pk=pk)
    assert session.status == "ended" and session.message.startswith("Lost: no word from its gpu command")


def test_sessions_are_listed_for_the_owner_and_leaders_only(alice, bob, leader, charlie, booking):
    start(alice, reservation=booking.pk)
    assert api(alice).get("/api/v1/sessions/?mine=1").json()["count"] == 1
    assert api(leader).get(f"/api/v1/sessions/?reservation={booking.pk}").json()["count"] == 1
    assert api(bob).get("/api/v1/sessions/").json()["count"] == 0
    assert api(charlie).get("/api/v1/sessions/").json()["count"] == 0


# --- the watchdog: a session's processes are the booking's ------------------------------------

A, B = "GPU-a", "GPU-b"
ALICE, BOB = 1, 2
BOOKINGS = [BookingFacts(reservation_id=50, owner_id=ALICE, cards={A: None, B: 8192})]
SESSION = SessionFacts(session_pk=9, session_id=500, owner_id=ALICE, reservation_id=50)
USERS = {"alice": ALICE, "bob": BOB}


def card(uuid: str, *processes: ProcessInfo) -> GPUInfo:
    return GPUInfo(uuid=uuid, index=0, name="card", pci_bus_id="", memory_total_mb=24576, processes=processes)


def proc(pid: int, *, session: int, user: str = "alice", mb: int = 1000) -> ProcessInfo:
    return ProcessInfo(pid=pid, username=user, command="python", used_memory_mb=mb, session_id=session)


def judge(*cards: GPUInfo, jobs=(), bookings=BOOKINGS):  # type: ignore[no-untyped-def]
    return classify(
        cards, bookings=bookings, jobs=jobs, users_by_os_name=USERS, tolerance_mb=256, sessions=[SESSION]
    )


def test_a_sessions_process_on_its_booked_card_is_the_bookings():
    (verdict,) = judge(card(B, proc(501, session=500, mb=4000)))
    assert (verdict.kind, verdict.session_pk, verdict.reservation_id) == (Kind.OK, 9, 50)


def test_a_sessions_processes_count_with_the_owners_others_against_the_share():
    job = JobFacts(job_id=7, session_id=100, owner_id=ALICE, reservation_id=50, running=True)
    in_job, in_session = judge(
        card(B, proc(100, session=100, mb=5000), proc(501, session=500, mb=4000)), jobs=[job]
    )
    assert in_job.kind == Kind.OK
    assert (in_session.kind, in_session.memory_mb, in_session.booked_mb) == (Kind.OVER_MEMORY, 9000, 8192)


def test_someone_elses_process_in_that_session_is_not_the_bookings():
    """The session's pid is the owner's word: it covers the owner's processes only."""
    (verdict,) = judge(card(B, proc(501, session=500, user="bob")))
    assert verdict.kind == Kind.INTRUDER and verdict.session_pk is None


def test_a_labs_processes_are_the_bookings_whatever_account_runs_them():
    """A lab's pid is the worker's record, not its owner's word: its processes, run as the worker's
    own account where JOB_USER is unset, are the booking's all the same, held to the share with
    the owner's others; on a card the booking does not hold they are judged as any."""
    lab = SessionFacts(session_pk=9, session_id=600, owner_id=ALICE, reservation_id=50, lab=True)

    def judge_lab(*cards: GPUInfo):  # type: ignore[no-untyped-def]
        return classify(
            cards, bookings=BOOKINGS, jobs=(), users_by_os_name=USERS, tolerance_mb=256, sessions=[lab]
        )

    (verdict,) = judge_lab(card(B, proc(601, session=600, user="portal", mb=4000)))
    assert (verdict.kind, verdict.session_pk, verdict.user_id) == (Kind.OK, 9, ALICE)
    kernel, notebook = judge_lab(
        card(B, proc(601, session=600, user="portal", mb=5000), proc(7, session=7, mb=4000))
    )
    assert kernel.kind == Kind.OVER_MEMORY and notebook.kind == Kind.OVER_MEMORY  # 9000 MiB > 8192
    (elsewhere,) = judge_lab(card("GPU-c", proc(601, session=600, user="portal")))
    assert elsewhere.kind == Kind.UNBOOKED


def test_a_sessions_process_on_a_card_its_booking_does_not_hold_is_judged_as_any():
    (verdict,) = judge(card("GPU-c", proc(501, session=500)))
    assert verdict.kind == Kind.UNBOOKED


def test_a_recorded_pid_that_now_heads_an_older_session_is_not_the_commands(alice, booking, monkeypatch):
    # Its leader has ended (no process has the pid): its session's processes are the proof.
    monkeypatch.setattr(watchdog_sessions, "started_at", lambda pid: None)
    pk = start(alice, reservation=booking.pk).json()["id"]
    api(alice).patch(f"/api/v1/sessions/{pk}/", {"pid": 4242, "pid_started": 2000.0}, format="json")
    server = booking.allocations.get().gpu.server_id
    assert [s.session_pk for s in _sessions_of(server, {4242: 2000.5})] == [pk]
    assert _sessions_of(server, {4242: 1000.0}) == []  # its processes predate the command


def test_the_booking_page_lists_its_sessions_to_those_who_may_see_them(client, alice, bob, leader, booking):
    pk = start(alice, reservation=booking.pk, command=["python", "notebook_cells.py"]).json()["id"]
    for user, sees in ((alice, True), (leader, True), (bob, False)):
        client.force_login(user)
        page = client.get(f"/reservations/{booking.pk}/").content.decode()
        assert ("notebook_cells.py" in page) is sees, user
    client.force_login(alice)
    page = client.get(f"/reservations/{booking.pk}/").content.decode()
    assert f"gpu exec --reservation {booking.pk} -- python train.py" in page and f">{pk}</a></td>" in page


# --- JupyterLab: the portal's side (the worker's is tests/test_lab.py, the proxy's test_lab_proxy.py)


def test_open_jupyterlab_starts_a_lab_on_the_bookings_host_and_waits_for_it(
    client, alice, booking, monkeypatch, django_capture_on_commit_callbacks
):
    sends: list[tuple[int, str]] = []
    monkeypatch.setattr("jobs.sessions.services._send", lambda pk, queue: sends.append((pk, queue)))
    client.force_login(alice)
    with django_capture_on_commit_callbacks(execute=True):
        answer = client.post("/sessions/new/", {"reservation": booking.pk})
    session = InteractiveSession.objects.get()
    assert answer.status_code == 302 and answer["Location"] == f"/sessions/{session.pk}/?go=1"
    assert (session.kind, session.status, len(session.token)) == ("jupyterlab", "starting", 43)
    assert sends == [(session.pk, "host.box1")]
    page = client.get(answer["Location"]).content.decode()
    assert "is starting JupyterLab" in page and session.token not in page
    InteractiveSession.objects.filter(pk=session.pk).update(status="running", address="127.0.0.1:9")
    poll = client.get(f"/sessions/{session.pk}/?part=status&go=1")
    assert poll.status_code == 204 and poll["HX-Redirect"] == f"/sessions/{session.pk}/lab/"
    body = api(alice).get(f"/api/v1/sessions/{session.pk}/").json()
    assert body["url"] == f"/sessions/{session.pk}/lab/" and "token" not in json.dumps(body)


def test_the_api_starts_a_lab_too_and_a_lost_message_is_sent_again(alice, booking, monkeypatch):
    sends: list[tuple[int, str]] = []
    monkeypatch.setattr("jobs.sessions.services._send", lambda pk, queue: sends.append((pk, queue)))
    answer = api(alice).post(
        "/api/v1/sessions/", {"reservation": booking.pk, "kind": "jupyterlab"}, format="json"
    )
    assert answer.status_code == 201 and answer.json()["status"] == "starting"
    later = timezone.now() + timedelta(seconds=31)
    jobs_reconcile(now=later)
    assert sends[-1] == (answer.json()["id"], "host.box1")


def test_a_teammate_cannot_open_a_lab_on_someone_elses_booking(client, bob, booking):
    client.force_login(bob)
    answer = client.post("/sessions/new/", {"reservation": booking.pk}, follow=True)
    assert (
        "runs on your own bookings only" in answer.content.decode()
        and not InteractiveSession.objects.exists()
    )


def test_a_lost_gpu_command_that_beats_again_is_stopped_and_told_once(alice, booking, settings):
    """A lost run is never taken back (jobs.runs): its cards may be someone else's by now. Its
    next beat tells `gpu` to stop it; the stop is said once in the inbox and the audit log."""
    pk = start(alice, reservation=booking.pk).json()["id"]
    api(alice).patch(f"/api/v1/sessions/{pk}/", {"pid": 4242}, format="json")
    beat_ago(pk, settings.SESSION_LOST_AFTER_SECONDS + 1)
    jobs_reconcile()["sessions_lost"]
    assert InteractiveSession.objects.get(pk=pk).status == "ended"
    for _ in range(2):
        beat = api(alice).post(f"/api/v1/sessions/{pk}/beat/").json()
        assert (beat["status"], beat["end_requested"]) == ("ended", True)
    assert "marked lost" in beat["message"]
    assert AuditEntry.objects.filter(target=f"session {pk}", message__contains="marked lost").count() == 1
    assert Notification.objects.filter(user=alice, kind=Notification.Kind.JOB_STOPPED).count() == 1


def test_the_dashboard_names_a_sessions_process(client, alice, booking, box):
    from dataclasses import replace as with_

    from gpus.inventory import ProcessInfo as Process
    from gpus.services import server_report_ingest
    from tests.factories import make_snapshot

    pk = start(alice, reservation=booking.pk).json()["id"]
    api(alice).patch(f"/api/v1/sessions/{pk}/", {"pid": 4242}, format="json")
    snapshot = make_snapshot("box1", gpus=4)
    seen = Process(
        pid=4250, username="alice", command="python notebook.py", used_memory_mb=900, session_id=4242
    )
    cards = (with_(snapshot.gpus[0], processes=(seen,)), *snapshot.gpus[1:])
    server_report_ingest(snapshot=with_(snapshot, gpus=cards))
    client.force_login(alice)
    assert f'href="/sessions/{pk}/">session {pk}</a>' in client.get("/dashboard/servers/").content.decode()
    shown = api(alice).get(f"/api/v1/gpus/{box[0].uuid}/").json()["processes"][0]
    assert shown["interactive_session"] == pk and shown["job"] == f"session {pk}"


def test_my_jobs_lists_my_sessions(client, alice, booking):
    pk = start(alice, reservation=booking.pk, command=["python", "explore.py"]).json()["id"]
    client.force_login(alice)
    page = client.get("/jobs/").content.decode()
    assert "My sessions" in page and "python explore.py" in page and f'href="/sessions/{pk}/"' in page


def test_the_warning_says_whether_extend_can_help(alice, bob, booking, box, settings):
    end = timezone.now() + timedelta(minutes=settings.SESSION_WARN_MINUTES - 1)
    Reservation.objects.filter(pk=booking.pk).update(end=end, booked_end=end)
    booking.allocations.update(end=end)
    pk = start(alice, reservation=booking.pk).json()["id"]
    api(alice).post(f"/api/v1/sessions/{pk}/beat/")
    assert "Extend the booking on its page" in Notification.objects.get(kind="session_ending").body
    Notification.objects.all().delete()
    reservation_create(user=bob, gpus=[box[0].uuid], memory_mb=20000, start=end, end=end + timedelta(hours=1))
    other = start(alice, reservation=booking.pk).json()["id"]
    api(alice).post(f"/api/v1/sessions/{other}/beat/")
    assert "cannot be extended" in Notification.objects.get(kind="session_ending").body


# --- release and cancel ask first when something runs on the booking (issue 23) ---------------


def test_release_asks_first_naming_what_it_would_stop(client, alice, booking, sent):
    from jobs.submit import ScriptUpload, job_submit

    job = job_submit(
        user=alice, reservation=booking, script=ScriptUpload(name="train.py", content=b"print(1)\n")
    )
    pk = start(alice, reservation=booking.pk).json()["id"]
    client.force_login(alice)
    asked = client.post(f"/reservations/{booking.pk}/release/")
    page = asked.content.decode()
    assert asked.status_code == 200 and f"job {job.pk} (train.py), queued" in page
    assert f"gpu exec session {pk}, starting" in page and 'name="confirm" value="1"' in page
    assert Reservation.objects.get(pk=booking.pk).released_at is None  # nothing done yet
    done = client.post(f"/reservations/{booking.pk}/release/", {"confirm": "1"})
    assert done.status_code == 302
    released = Reservation.objects.get(pk=booking.pk)
    assert released.released_at is not None and released.released_by == alice


def test_the_booking_page_lists_its_jobs_to_the_owner(client, alice, bob, booking, sent):
    from jobs.submit import ScriptUpload, job_submit

    job = job_submit(
        user=alice, reservation=booking, script=ScriptUpload(name="nightly.py", content=b"print(1)\n")
    )
    for user, sees in ((alice, True), (bob, False)):
        client.force_login(user)
        page = client.get(f"/reservations/{booking.pk}/").content.decode()
        assert (f'href="/jobs/{job.pk}/"' in page) is sees


# --- found by review: a lab is its worker's to drive; bounds; one lab a booking ------------------


def _lab(user, booking, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr("jobs.sessions.services._send", lambda pk, queue: None)
    return api(user).post(
        "/api/v1/sessions/", {"reservation": booking.pk, "kind": "jupyterlab"}, format="json"
    )


def test_a_labs_pid_beat_and_end_are_its_workers_alone(alice, booking, monkeypatch):
    pk = _lab(alice, booking, monkeypatch).json()["id"]
    client = api(alice)
    for answer in (
        client.patch(f"/api/v1/sessions/{pk}/", {"pid": 4242}, format="json"),
        client.post(f"/api/v1/sessions/{pk}/beat/"),
        client.post(f"/api/v1/sessions/{pk}/finish/", {"exit_code": 0}, format="json"),
    ):
        assert answer.status_code == 400 and "kind" in answer.json()["errors"], answer.json()
    session = InteractiveSession.objects.get(pk=pk)
    assert (session.status, session.pid) == ("starting", None)


def test_one_lab_a_booking_and_the_button_opens_the_one_there_is(client, alice, booking, monkeypatch):
    first = _lab(alice, booking, monkeypatch).json()["id"]
    again = _lab(alice, booking, monkeypatch)
    assert again.status_code == 400 and f"already has JupyterLab session {first}" in again.json()["detail"]
    client.force_login(alice)
    answer = client.post("/sessions/new/", {"reservation": booking.pk})
    assert answer["Location"] == f"/sessions/{first}/?go=1" and InteractiveSession.objects.count() == 1


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("", {"pid": 2**70}, "pid"),
        ("", {"pid": 2**31}, "pid"),
        ("", {"pid": 4242, "pid_started": 1e300}, "pid_started"),
        ("finish/", {"exit_code": 2**70}, "exit_code"),
    ],
)
def test_numbers_out_of_range_are_refused_by_name(alice, booking, path, body, field):
    pk = start(alice, reservation=booking.pk).json()["id"]
    client = api(alice)
    answer = (
        client.patch(f"/api/v1/sessions/{pk}/", body, format="json")
        if not path
        else client.post(f"/api/v1/sessions/{pk}/{path}", body, format="json")
    )
    assert answer.status_code == 400 and field in answer.json()["errors"]


def test_odd_numbers_in_lists_and_forms_are_refused_not_500(client, alice, booking):
    assert api(alice).get("/api/v1/sessions/?reservation=99999999999999999999999").status_code == 400
    assert api(alice).get("/api/v1/jobs/?array=99999999999999999999999").status_code == 400
    client.force_login(alice)
    for raw in ("²", "٣", "9" * 30):
        assert client.post("/sessions/new/", {"reservation": raw}).status_code == 302, raw
    assert not InteractiveSession.objects.exists()


def test_someone_elses_claim_on_a_pid_takes_nothing_from_its_owner():
    bobs = SessionFacts(session_pk=3, session_id=500, owner_id=BOB, reservation_id=51)
    bob_booking = BookingFacts(reservation_id=51, owner_id=BOB, cards={"GPU-c": None})
    (verdict,) = classify(
        [card(B, proc(501, session=500, mb=1000))],
        bookings=[*BOOKINGS, bob_booking],
        jobs=[],
        users_by_os_name=USERS,
        tolerance_mb=256,
        sessions=[bobs, SESSION],
    )
    assert (verdict.kind, verdict.session_pk) == (Kind.OK, SESSION.session_pk)


def test_a_recorded_pid_now_another_live_process_is_not_the_commands(alice, booking):
    """The command ended and its pid went to a younger process that leads a session of its own
    (a stranger's, its processes all younger than the command's start): it is not the command's."""
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        real = psutil.Process(stranger.pid).create_time()
        server = booking.allocations.get().gpu.server_id
        on_card = {stranger.pid: real + 1}
        for recorded, counted in ((real - 3600, False), (real, True)):  # an hour before; itself
            pk = start(alice, reservation=booking.pk).json()["id"]
            body = {"pid": stranger.pid, "pid_started": recorded}
            assert api(alice).patch(f"/api/v1/sessions/{pk}/", body, format="json").status_code == 200
            assert [s.session_pk for s in _sessions_of(server, on_card)] == ([pk] if counted else [])
            InteractiveSession.objects.filter(pk=pk).update(status=InteractiveSession.Status.ENDED)
    finally:
        stranger.kill()
        stranger.wait()


def test_a_gpu_that_beats_on_past_its_bookings_end_is_told_to_stop_and_then_ended(alice, booking, settings):
    """An old or changed `gpu` that ignores the end: before, its beats kept the session running for
    ever. Past the end each beat says stop; past the grace and a beat's cut-off, the portal ends
    the session on its row, and tells its owner and the audit log."""
    client = api(alice)
    pk = start(alice, reservation=booking.pk).json()["id"]
    client.patch(f"/api/v1/sessions/{pk}/", {"pid": 4242}, format="json")
    just_over = timezone.now() - timedelta(seconds=5)
    Reservation.objects.filter(pk=booking.pk).update(
        start=just_over - timedelta(hours=1), end=just_over, booked_end=just_over
    )
    beat = client.post(f"/api/v1/sessions/{pk}/beat/").json()
    assert (beat["end_requested"], beat["status"]) == (True, "running")
    assert beat["message"].startswith("its booking ended at ")
    long_over = timezone.now() - timedelta(
        seconds=settings.JOB_KILL_GRACE_SECONDS + settings.SESSION_LOST_AFTER_SECONDS + 5
    )
    Reservation.objects.filter(pk=booking.pk).update(
        start=long_over - timedelta(hours=1), end=long_over, booked_end=long_over
    )
    beat = client.post(f"/api/v1/sessions/{pk}/beat/").json()
    assert (beat["end_requested"], beat["status"]) == (True, "ended")
    assert "its booking ended at" in beat["message"] and "had not ended it" in beat["message"]
    audited = AuditEntry.objects.filter(action=AuditEntry.Action.SESSION_STOP, target=f"session {pk}")
    assert audited.count() == 1
    assert Notification.objects.filter(user=alice, kind=Notification.Kind.JOB_STOPPED).count() == 1
    client.post(f"/api/v1/sessions/{pk}/beat/")  # told once
    assert Notification.objects.filter(user=alice, kind=Notification.Kind.JOB_STOPPED).count() == 1


def test_a_gpu_that_ignores_an_end_asked_on_the_portal_is_ended_after_the_grace(
    alice, leader, booking, settings
):
    """Before, only the booking's end counted: a session ended on the portal whose `gpu` beat on
    stayed running for the rest of the booking, hours maybe."""
    pk = start(alice, reservation=booking.pk).json()["id"]
    api(alice).patch(f"/api/v1/sessions/{pk}/", {"pid": 4242}, format="json")
    assert api(leader).delete(f"/api/v1/sessions/{pk}/").status_code == 200
    assert api(alice).post(f"/api/v1/sessions/{pk}/beat/").json()["status"] == "running"  # within its grace
    long_ago = timezone.now() - timedelta(
        seconds=settings.JOB_KILL_GRACE_SECONDS + settings.SESSION_LOST_AFTER_SECONDS + 5
    )
    InteractiveSession.objects.filter(pk=pk).update(end_requested_at=long_ago)
    beat = api(alice).post(f"/api/v1/sessions/{pk}/beat/").json()
    assert (beat["end_requested"], beat["status"]) == (True, "ended")
    session = InteractiveSession.objects.get(pk=pk)
    assert (
        session.message.startswith("Ended: it was ended from the portal at ")
        and "had not ended it" in session.message
    )
