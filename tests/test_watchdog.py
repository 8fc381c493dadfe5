"""The GPU watchdog on a host: every kind under every policy, against real processes.

The rules themselves are tests/test_watchdog_rules.py; here the host's round reads the
database, records violations, tells people and signals real processes (`sleep`s this test
starts), with the clock passed in rather than waited for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta

import psutil
import pytest
from django.db import IntegrityError, transaction
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.inventory import ProcessInfo, Snapshot
from gpus.models import Allocation, Reservation, Violation, WatchdogPolicy
from gpus.procinfo import describe_process
from jobs.host.watchdog import HostWatchdog, kill_grace
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal.models import AuditEntry, Membership, Notification, Profile
from tests.factories import MembershipFactory, UserFactory, make_snapshot
from tests.waiting import wait_for

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)",
]


@pytest.fixture
def start(procs):
    def start(argv=SLEEP) -> subprocess.Popen:
        proc = subprocess.Popen(argv, start_new_session=True)
        procs.append(proc)
        wait_for(lambda: "python" in " ".join(psutil.Process(proc.pid).cmdline()), timeout=10, what="exec")
        return proc

    return start


@pytest.fixture
def watchdog(box) -> HostWatchdog:
    return HostWatchdog("box1", simulated=False)


def policy(kind: str, action: str, grace: int = 0) -> None:
    WatchdogPolicy.objects.update_or_create(kind=kind, defaults={"action": action, "grace_seconds": grace})


def on_card(index: int, *processes: ProcessInfo) -> Snapshot:
    """box1's report with these processes on card `index` (and none elsewhere)."""
    snapshot = make_snapshot("box1", gpus=4, processes=0)
    cards = list(snapshot.gpus)
    cards[index] = replace(cards[index], processes=processes)
    return replace(snapshot, gpus=tuple(cards))


def real(proc: subprocess.Popen, mb: int = 2048, *, user: str | None = None) -> ProcessInfo:
    info = describe_process(proc.pid, mb)
    return replace(info, username=user) if user else info


def gone(proc: subprocess.Popen) -> bool:
    return proc.poll() is not None


def one() -> Violation:
    return Violation.objects.select_related("user", "reservation").get()


# --- intruders, and every policy ------------------------------------------------------------------


@pytest.fixture
def alices_card(alice, box):
    return reservation_create(user=alice, gpus=[box[0].uuid])


def test_an_intruder_is_warned_then_stopped_and_the_stop_confirmed(watchdog, alices_card, bob, start):
    policy("intruder", "stop", grace=60)
    proc = start()
    t0 = timezone.now()

    watchdog.round(on_card(0, real(proc, user="bob")), now=t0)
    violation = one()
    assert (violation.kind, violation.action, violation.pid, violation.os_user) == (
        "intruder",
        "warned",
        proc.pid,
        "bob",
    )
    assert violation.user == bob and violation.reservation == alices_card and violation.memory_mb == 2048
    told = set(Notification.objects.filter(kind="intruder").values_list("user__username", flat=True))
    assert told == {"alice", "bob"}  # the booking's owner and the offender
    assert not gone(proc)

    watchdog.round(on_card(0, real(proc, user="bob")), now=t0 + timedelta(seconds=30))
    assert (
        not gone(proc) and Violation.objects.count() == 1
    )  # one violation, updated, not a new one each round

    watchdog.round(on_card(0, real(proc, user="bob")), now=t0 + timedelta(seconds=61))
    wait_for(lambda: gone(proc), timeout=10, what="SIGTERM")
    assert proc.returncode == -signal.SIGTERM

    watchdog.round(on_card(0), now=t0 + timedelta(seconds=63))  # NVML no longer lists it
    violation = one()
    assert (violation.action, violation.ended_at is not None) == ("stopped", True)
    assert violation.stopped_at == t0 + timedelta(seconds=63)
    assert AuditEntry.objects.filter(action="watchdog.stop", target=f"violation {violation.pk}").exists()
    assert Notification.objects.filter(subject__contains="was stopped").count() == 2


def test_the_violation_page_says_each_step_once_with_its_own_24_hour_time(
    client, watchdog, alices_card, alice, start
):
    """ "Warned at 15:04:05; stopped at 15:05:08", never "Stopped at 3:05 p.m.; stopped at 3:05
    p.m." with the warning's time lost (issue 41)."""
    policy("intruder", "stop", grace=60)
    proc = start()
    t0 = timezone.now().replace(hour=15, minute=4, second=5, microsecond=0)  # p.m. in a 12-hour clock
    # alice's booking moved to hold t0, whenever the test runs (it starts now, made by the fixture).
    window = {"start": t0 - timedelta(hours=1), "end": t0 + timedelta(hours=1)}
    Reservation.objects.filter(pk=alices_card.pk).update(**window)
    Allocation.objects.filter(reservation=alices_card).update(**window)
    watchdog.round(on_card(0, real(proc, user="bob")), now=t0)
    watchdog.round(on_card(0, real(proc, user="bob")), now=t0 + timedelta(seconds=61))
    wait_for(lambda: gone(proc), timeout=10, what="SIGTERM")
    watchdog.round(on_card(0), now=t0 + timedelta(seconds=63))
    violation = one()
    assert (violation.action, violation.warned_at) == ("stopped", t0)
    client.force_login(alice)
    page = client.get(reverse("violation_detail", args=[violation.pk])).content.decode()
    day = t0.strftime("%a %Y-%m-%d")
    assert "Warned at <time" in page and f">{day} 15:04:05</time>; stopped at <time" in page
    assert f">{day} 15:05:08</time>" in page and page.count("topped at") == 1
    assert f"{day} 15:04:05 to {day} 15:05:08" in page  # seen from, to
    assert "p.m." not in page and "a.m." not in page


def test_a_process_that_ignores_sigterm_gets_sigkill_after_the_grace(watchdog, alices_card, start, settings):
    settings.JOB_KILL_GRACE_SECONDS = 5
    policy("intruder", "stop")
    proc = start(STUBBORN)
    t0 = timezone.now()
    wait_for(
        lambda: psutil.Process(proc.pid).status() == psutil.STATUS_SLEEPING, timeout=10, what="its handler"
    )
    for seconds in (0, 2):
        watchdog.round(on_card(0, real(proc, user="bob")), now=t0 + timedelta(seconds=seconds))
    assert not gone(proc)  # SIGTERM ignored, and the grace has not passed
    watchdog.round(on_card(0, real(proc, user="bob")), now=t0 + timedelta(seconds=6))
    wait_for(lambda: gone(proc), timeout=10, what="SIGKILL")
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("action", ["observe", "warn"])
def test_observe_and_warn_never_stop(watchdog, alices_card, start, action):
    policy("intruder", action)
    proc = start()
    t0 = timezone.now()
    for seconds in (0, 600, 6000):
        watchdog.round(on_card(0, real(proc, user="bob")), now=t0 + timedelta(seconds=seconds))
    assert not gone(proc)
    violation = one()
    assert violation.action == ("observed" if action == "observe" else "warned")
    assert Notification.objects.exists() == (action == "warn")


def test_a_dry_run_records_and_notifies_but_never_signals(watchdog, alices_card, start, settings):
    settings.WATCHDOG_DRY_RUN = True
    policy("intruder", "stop")
    proc = start()
    t0 = timezone.now()
    for seconds in (0, 1, 100):
        watchdog.round(on_card(0, real(proc, user="bob")), now=t0 + timedelta(seconds=seconds))
    assert not gone(proc)
    assert "Dry run" in one().message
    assert Notification.objects.filter(subject__contains="dry run").exists()


def test_a_stop_the_worker_may_not_send_is_recorded_and_told(watchdog, alices_card, start, monkeypatch):
    policy("intruder", "stop")
    proc = start()

    def denied(fd: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(signal, "pidfd_send_signal", denied)
    watchdog.round(on_card(0, real(proc, user="bob")), now=timezone.now())
    violation = one()
    assert violation.action == "stop_failed"
    assert "could not stop: permission denied" in violation.message
    assert AuditEntry.objects.filter(action="watchdog.stop", message__contains="could not stop").exists()
    assert Notification.objects.filter(
        subject__contains="could not be stopped", user__username="alice"
    ).exists()
    monkeypatch.undo()  # the fixture's own kill at teardown
    assert not gone(proc)


def test_an_invented_pid_equal_to_a_live_unrelated_process_is_left_alone(box, alices_card, start):
    """The simulation makes pids up: one may be a real process of someone else on this machine.
    Invented processes are scenery: never signalled, never a violation (a quiet demo, issue 23)."""
    policy("intruder", "stop")
    watchdog = HostWatchdog("box1", simulated=True)
    bystander = start()
    invented = ProcessInfo(
        pid=bystander.pid, username="carol", command="python train.py", used_memory_mb=9000
    )
    t0 = timezone.now()
    for seconds in (0, 120, 240):
        watchdog.round(on_card(0, invented), now=t0 + timedelta(seconds=seconds))
    assert not gone(bystander)
    assert not Violation.objects.exists() and not Notification.objects.exists()


def test_a_recycled_pid_is_not_signalled(watchdog, alices_card, start):
    """The process seen is not the one that now has its pid: its session differs."""
    policy("intruder", "stop")
    proc = start()
    seen = replace(real(proc, user="bob"), session_id=proc.pid + 1)
    watchdog.round(on_card(0, seen), now=timezone.now())
    assert not gone(proc)
    assert "Not signalled" in one().message


# --- unbooked and the owner's own processes ------------------------------------------------------


def test_a_process_on_a_card_nobody_booked_is_unbooked_and_warned_by_default(watchdog, bob, start):
    proc = start()
    t0 = timezone.now()
    for seconds in (0, 3600):
        watchdog.round(on_card(1, real(proc, user="bob")), now=t0 + timedelta(seconds=seconds))
    assert (one().kind, one().action) == ("unbooked", "warned")
    assert list(Notification.objects.values_list("user__username", flat=True)) == ["bob"]
    assert not gone(proc)


def test_the_owners_own_process_is_shown_never_punished(watchdog, alices_card, start):
    proc = start()
    watchdog.round(on_card(0, real(proc, user="alice")), now=timezone.now())
    assert (one().kind, one().action) == ("owner_outside_job", "observed")
    with transaction.atomic(), pytest.raises(IntegrityError):  # the database refuses the policy
        policy("owner_outside_job", "stop")


def test_os_users_map_to_people_by_their_unix_account(watchdog, alices_card, bob, start):
    Profile.objects.create(user=bob, unix_account="rsmith")
    proc = start()
    watchdog.round(on_card(0, real(proc, user="rsmith")), now=timezone.now())
    assert one().user == bob


def test_an_unknown_os_user_is_reported_by_name(watchdog, alices_card, start):
    proc = start()
    watchdog.round(on_card(0, real(proc, user="mallory")), now=timezone.now())
    violation = one()
    assert (violation.user, violation.os_user) == (None, "mallory")


# --- portal jobs: escaped, over memory, zombies ---------------------------------------------------


@pytest.fixture
def job_on(alice, box, sent):
    """job_on(card indices, memory_mb, pid): alice's running job on a booking of those cards."""

    def make(indices, memory_mb, pid, status=Job.Status.RUNNING) -> Job:
        booking = reservation_create(user=alice, gpus=[box[i].uuid for i in indices], memory_mb=memory_mb)
        job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="t.py", content=b"pass\n"))
        finished = timezone.now() if status not in Job.ACTIVE else None
        Job.objects.filter(pk=job.pk).update(
            status=status, pid=pid, started_at=timezone.now(), finished_at=finished
        )
        job.refresh_from_db()
        return job

    return make


def test_a_job_over_its_memory_is_stopped_by_its_supervisor(watchdog, job_on, start):
    policy("over_memory", "stop", grace=10)
    proc = start()
    job = job_on([0], 4096, proc.pid)
    t0 = timezone.now()
    watchdog.round(on_card(0, real(proc, 4096 + 256)), now=t0)
    assert not Violation.objects.exists()  # within the tolerance
    watchdog.round(on_card(0, real(proc, 4096 + 257)), now=t0)
    violation = one()
    assert (violation.kind, violation.job_id, violation.memory_mb, violation.booked_mb) == (
        "over_memory",
        job.pk,
        4353,
        4096,
    )
    watchdog.round(on_card(0, real(proc, 5000)), now=t0 + timedelta(seconds=11))
    job.refresh_from_db()
    assert job.watchdog_stop.startswith("Stopped by the GPU watchdog: over_memory: job")
    assert not gone(proc)  # the job's own supervisor stops it (tests/test_jobs_worker.py), not the watchdog
    assert one().memory_mb == 5000  # the most measured


def test_a_job_on_a_card_it_did_not_book_has_escaped(watchdog, job_on, bob, box, start):
    proc = start()
    job = job_on([0], None, proc.pid)
    reservation_create(user=bob, gpus=[box[2].uuid])
    watchdog.round(on_card(2, real(proc)), now=timezone.now())
    violation = one()
    assert (violation.kind, violation.job_id, violation.user.username) == ("escaped", job.pk, "alice")
    told = set(Notification.objects.values_list("user__username", flat=True))
    assert told == {"alice", "bob"}  # the job's owner, and the owner of the card it took


def test_a_process_left_by_an_ended_job_is_a_zombie_and_stopped(watchdog, job_on, start):
    proc = start()
    job_on([0], None, proc.pid, status=Job.Status.SUCCEEDED)
    policy("zombie", "stop", grace=30)
    t0 = timezone.now()
    watchdog.round(on_card(0, real(proc)), now=t0)
    assert (one().kind, one().action) == ("zombie", "warned")
    watchdog.round(on_card(0, real(proc)), now=t0 + timedelta(seconds=31))
    wait_for(lambda: gone(proc), timeout=10, what="the zombie's end")


def test_a_session_that_began_after_the_job_ended_is_no_zombie(watchdog, job_on, start):
    """A recycled session id: the process was created after its namesake job had ended."""
    proc = start()
    job = job_on([0], None, proc.pid, status=Job.Status.SUCCEEDED)
    Job.objects.filter(pk=job.pk).update(finished_at=timezone.now() - timedelta(minutes=10))
    watchdog.round(on_card(0, real(proc, user="alice")), now=timezone.now())
    assert one().kind == "owner_outside_job"  # alice's process on alice's card, not her old job's


# --- repeat offenders, restarts -------------------------------------------------------------------


def test_leaders_hear_of_repeat_offences(watchdog, alices_card, team, leader, start, settings):
    settings.WATCHDOG_REPEAT_OFFENCES = 2
    bob = MembershipFactory(team=team, user=UserFactory(username="bob")).user
    assert bob.memberships.get().role == Membership.Role.MEMBER
    for _ in range(2):
        proc = start()
        watchdog.round(on_card(0, real(proc, user="bob")), now=timezone.now())
    told = list(Notification.objects.filter(user=leader).values_list("body", flat=True))
    assert len(told) == 1 and "several violations" in told[0]


def test_a_restarted_watchdog_goes_on_with_the_open_violations(box, alices_card, start):
    proc = start()
    HostWatchdog("box1", simulated=False).round(on_card(0, real(proc, user="bob")), now=timezone.now())
    HostWatchdog("box1", simulated=False).round(on_card(0, real(proc, user="bob")), now=timezone.now())
    assert Violation.objects.count() == 1


def test_a_server_made_again_is_watched_anew_not_by_the_old_rows_ids(watchdog, alices_card, bob, start):
    """An admin deleted the server and its next report made it again: new rows, new ids. The
    watchdog judges the new cards and bookings, never by the ids it held (no booking found on
    the old server's id: "unbooked"; violations pointing at deleted rows)."""
    from gpus.models import Reservation, Server
    from gpus.services import server_report_ingest

    proc = start()
    watchdog.round(on_card(0, real(proc, user="bob")), now=timezone.now())
    assert one().kind == "intruder"
    Reservation.objects.all().delete()  # a server with bookings cannot be deleted (PROTECT)
    Server.objects.filter(name="box1").delete()
    server_report_ingest(snapshot=make_snapshot("box1", gpus=4))
    booked = Server.objects.get(name="box1").gpus.get(index=0)
    reservation_create(user=bob, gpus=[booked.uuid])
    watchdog.round(on_card(0, real(proc, user="bob")), now=timezone.now())  # bob's own card now
    # Judged on the new rows: his own process outside a job (shown, never punished), on the new card.
    assert (one().kind, one().gpu_id) == ("owner_outside_job", booked.pk)


def test_an_unreadable_process_list_ends_nothing(watchdog, alices_card, start):
    proc = start()
    watchdog.round(on_card(0, real(proc, user="bob")), now=timezone.now())
    unknown = on_card(0)
    unknown = replace(unknown, gpus=(replace(unknown.gpus[0], processes=None), *unknown.gpus[1:]))
    watchdog.round(unknown, now=timezone.now())
    assert one().ended_at is None


# --- pages and API: who sees what -----------------------------------------------------------------


@pytest.fixture
def bobs_intrusion(watchdog, alices_card, bob, start):
    """bob's process on alice's card, as a violation."""
    proc = start()
    watchdog.round(on_card(0, real(proc, user="bob")), now=timezone.now())
    return one()


@pytest.mark.parametrize(
    ("who", "sees"),
    [("bob", True), ("alice", True), ("dave", False), ("charlie", False), ("leader", True), ("admin", True)],
)
def test_violations_are_seen_by_the_offender_the_victim_leaders_and_admins(
    client, bobs_intrusion, team, charlie, leader, admin_user, who, sees
):
    """dave is a plain teammate of both: neither the offender, the victim nor a leader."""
    dave = MembershipFactory(team=team, user=UserFactory(username="dave")).user
    users = {"charlie": charlie, "leader": leader, "admin": admin_user, "dave": dave}
    user = users.get(who) or UserFactory(username=who)  # get_or_create: bob and alice exist
    client.force_login(user)
    detail = client.get(reverse("violation_detail", args=[bobs_intrusion.pk]))
    assert detail.status_code == (200 if sees else 404)
    listed = client.get(reverse("violations")).content.decode()
    assert (f'data-violation="{bobs_intrusion.pk}"' in listed) == sees
    api = APIClient()
    api.force_authenticate(user)
    assert api.get(f"/api/v1/violations/{bobs_intrusion.pk}/").status_code == (200 if sees else 404)
    rows = api.get("/api/v1/violations/").json()["results"]
    assert [r["id"] for r in rows] == ([bobs_intrusion.pk] if sees else [])


def test_anonymous_gets_nothing(client, bobs_intrusion):
    assert client.get(reverse("violations")).status_code == 302
    assert APIClient().get("/api/v1/violations/").status_code in (401, 403)


def test_the_api_has_the_documented_fields_and_filters(bobs_intrusion, admin_user):
    api = APIClient()
    api.force_authenticate(admin_user)
    (row,) = api.get("/api/v1/violations/?kind=intruder&open=true&server=box1").json()["results"]
    for field in (
        "id",
        "kind",
        "gpu",
        "server",
        "pid",
        "os_user",
        "user",
        "job",
        "memory_mb",
        "first_seen",
        "last_seen",
        "action",
        "stopped_at",
    ):
        assert field in row, field
    assert (row["gpu"], row["server"], row["user"], row["action"]) == (
        bobs_intrusion.gpu_id,
        "box1",
        "bob",
        "warned",
    )
    assert api.get("/api/v1/violations/?kind=zombie").json()["results"] == []
    bad = api.get("/api/v1/violations/?kind=nonsense")
    assert bad.status_code == 400 and "kind" in bad.json()["errors"]


def test_the_dashboard_shows_a_red_badge_on_the_card_and_the_process(client, bobs_intrusion, alice):
    from gpus.services import server_report_ingest

    server_report_ingest(snapshot=on_card(0, ProcessInfo(bobs_intrusion.pid, "bob", "python", 2048)))
    client.force_login(alice)
    html = client.get(reverse("dashboard_servers")).content.decode()
    assert 'data-violation-kind="intruder"' in html
    assert "1 violation" in html


def test_the_pid_signalled_is_never_our_own(watchdog, alices_card):
    """Belt and braces: the worker's own process on a card is judged, never killed."""
    policy("intruder", "stop")
    me = describe_process(os.getpid(), 100)
    watchdog.round(
        on_card(0, replace(me, username="bob", session_id=os.getsid(0) + 10**6)), now=timezone.now()
    )
    assert "Not signalled" in one().message


# --- every kind under every policy ----------------------------------------------------------------


@pytest.fixture
def scene(alice, bob, box, start, job_on):
    """scene(kind) → (the snapshot that shows one process of that kind, the process)."""

    def make(kind: str) -> tuple[Snapshot, subprocess.Popen]:
        proc = start()
        if kind == "unbooked":
            return on_card(3, real(proc, user="bob")), proc
        if kind in ("intruder", "owner_outside_job"):
            reservation_create(user=alice, gpus=[box[0].uuid])
            return on_card(0, real(proc, user="bob" if kind == "intruder" else "alice")), proc
        if kind == "zombie":
            job_on([0], None, proc.pid, status=Job.Status.SUCCEEDED)
            return on_card(0, real(proc)), proc
        job_on([0], 1024, proc.pid)  # escaped (to card 1) or over_memory (on its card 0)
        return (on_card(1, real(proc)) if kind == "escaped" else on_card(0, real(proc, 4096))), proc

    return make


@pytest.mark.parametrize("kind", [k for k in Violation.Kind.values if k != "owner_outside_job"])
@pytest.mark.parametrize("action", ["observe", "warn", "stop"])
def test_every_kind_under_every_policy(watchdog, scene, kind, action):
    policy(kind, action, grace=5)
    snapshot, proc = scene(kind)
    t0 = timezone.now()
    watchdog.round(snapshot, now=t0)
    violation = one()
    assert violation.kind == kind
    assert violation.action == ("observed" if action == "observe" else "warned")
    assert Notification.objects.filter(kind=kind).exists() == (action != "observe")

    watchdog.round(snapshot, now=t0 + timedelta(seconds=6))  # past the grace
    stopping_job = kind in ("escaped", "over_memory")
    if action != "stop":
        assert not gone(proc) and not Job.objects.exclude(watchdog_stop="").exists()
    elif stopping_job:
        assert Job.objects.get(pid=proc.pid).watchdog_stop.startswith(f"Stopped by the GPU watchdog: {kind}")
    else:
        wait_for(lambda: gone(proc), timeout=10, what="the stop")
        watchdog.round(replace(snapshot, gpus=tuple(replace(g, processes=()) for g in snapshot.gpus)), now=t0)
        assert one().action == "stopped"


@pytest.mark.parametrize("action", ["observe", "warn"])
def test_owner_outside_job_under_observe_and_warn(watchdog, scene, action):
    """Never stop: the database refuses that policy (test_the_owners_own_process_is_shown_never_punished)."""
    policy("owner_outside_job", action)
    snapshot, proc = scene("owner_outside_job")
    t0 = timezone.now()
    for seconds in (0, 3600):
        watchdog.round(snapshot, now=t0 + timedelta(seconds=seconds))
    assert one().action == ("observed" if action == "observe" else "warned")
    assert not gone(proc)


# --- a job's child that called setsid (review of 1ab5ded) -------------------------------------------


def _setsid_parent(child_code: str) -> list[str]:
    """A job's leader that starts `child_code` in a session of its own and prints its pid."""
    return [
        sys.executable,
        "-c",
        "import subprocess, sys, time; "
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}], start_new_session=True); "
        "print(child.pid, flush=True); time.sleep(120)",
    ]


def _job_with_setsid_child(
    procs, child_code: str = "import time; time.sleep(120)"
) -> tuple[subprocess.Popen, int]:
    leader = subprocess.Popen(_setsid_parent(child_code), start_new_session=True, stdout=subprocess.PIPE)
    procs.append(leader)
    child = int(leader.stdout.readline())
    wait_for(lambda: "time.sleep" in " ".join(psutil.Process(child).cmdline()), timeout=10, what="exec")
    return leader, child


STUBBORN_CODE = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"


def _ignores_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as status:
        ignored = next(line for line in status if line.startswith("SigIgn:")).split()[1]
    return bool(int(ignored, 16) & (1 << (signal.SIGTERM - 1)))


def _job_with_stubborn_setsid_child(procs) -> tuple[subprocess.Popen, int]:
    """As `_job_with_setsid_child`, the child ignoring SIGTERM before it is returned: else a
    round's stop can land first (under load it did, and the child died, the test's subject untried)."""
    leader, child = _job_with_setsid_child(procs, STUBBORN_CODE)
    wait_for(lambda: _ignores_sigterm(child), timeout=10, what="SIG_IGN")
    return leader, child


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_jobs_setsid_child_over_the_jobs_memory_is_signalled_itself(watchdog, job_on, procs):
    """The child is the job's (parent_session_id), so its memory makes the job over_memory, whose stop
    is the job's supervisor's: it ends the job's session, which the child left. The child, the one
    holding the memory, must get the stop itself."""
    policy("over_memory", "stop", grace=0)
    leader, child = _job_with_setsid_child(procs)
    try:
        job = job_on([0], 1024, leader.pid)
        hog = replace(describe_process(child, 4096), username="gpujob")  # a shared JOB_USER
        assert hog.parent_session_id == leader.pid
        t0 = timezone.now()
        watchdog.round(on_card(0, hog), now=t0)
        watchdog.round(on_card(0, hog), now=t0 + timedelta(seconds=1))
        job.refresh_from_db()
        assert job.watchdog_stop.startswith("Stopped by the GPU watchdog: over_memory")
        wait_for(lambda: not _alive(child), timeout=10, what="the child's SIGTERM")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_setsid_childs_job_stop_is_not_recorded_as_its_stop_while_it_runs(watchdog, job_on, procs):
    """Under a shared JOB_USER, once the job's session has ended, its setsid child (which ignores
    SIGTERM here) is adopted and judged again: an intruder. Its over_memory violation must not be
    recorded as stopped (audit: "stopped pid …") while the process still holds the card."""
    policy("over_memory", "stop", grace=0)
    policy("intruder", "warn")
    leader, child = _job_with_stubborn_setsid_child(procs)
    try:
        job = job_on([0], 1024, leader.pid)
        t0 = timezone.now()
        hog = replace(describe_process(child, 4096), username="gpujob")
        watchdog.round(on_card(0, hog), now=t0)
        watchdog.round(on_card(0, hog), now=t0 + timedelta(seconds=1))
        # The job's supervisor ends the job's session (jobs.host.executors.local): its group, its members.
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
        wait_for(lambda: psutil.Process(child).ppid() != leader.pid, timeout=10, what="adoption")
        Job.objects.filter(pk=job.pk).update(status=Job.Status.FAILED, finished_at=timezone.now())
        adopted = replace(describe_process(child, 4096), username="gpujob")
        watchdog.round(on_card(0, adopted), now=t0 + timedelta(seconds=2))
        assert _alive(child)
        over = Violation.objects.get(kind="over_memory")
        assert over.action != "stopped", "recorded as stopped while the process still runs"
        assert not AuditEntry.objects.filter(action="watchdog.stop", target=f"violation {over.pk}").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_an_ended_jobs_setsid_child_is_a_zombie_while_its_parent_line_holds(watchdog, job_on, procs):
    """The job ended, but its sweep could not end its session (the worker may not signal JOB_USER's
    processes, say): its leader still runs, holding nothing on the card, and the child it started
    with setsid holds the card. The child is still the job's by the session it left, as it was while
    the job ran: a zombie, not the owner's own process (never stopped) nor, under a shared account,
    a stranger."""
    leader, child = _job_with_setsid_child(procs)
    try:
        job = job_on([0], None, leader.pid, status=Job.Status.SUCCEEDED)
        watchdog.round(on_card(0, describe_process(child, 2048)), now=timezone.now())
        violation = one()
        assert (violation.kind, violation.job_id) == ("zombie", job.pk)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


# --- a job's setsid child: its stop recorded once, and only where due (a review, 2026-11-30) ---

# A job's leader that starts a child in a session of its own, prints its pid and reaps it.
_REAPING_PARENT = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
    "start_new_session=True); "
    "print(child.pid, flush=True); child.wait(); time.sleep(120)",
]


def test_a_setsid_childs_job_stop_is_recorded_even_when_the_child_cannot_be_signalled(
    watchdog, job_on, procs
):
    """The child is the only process of the job over its memory: its violation asks the job's
    supervisor to stop the job (which fails it with the watchdog's words), then signals the child.
    The child ended in between (or its session cannot be proven): that must not turn the job's stop
    into "Not signalled", finished: the job was stopped by the watchdog, so its violation must end
    `stopped`, with its audit entry and its notification, as a job process's does."""
    policy("over_memory", "stop", grace=0)
    leader = subprocess.Popen(_REAPING_PARENT, start_new_session=True, stdout=subprocess.PIPE)
    procs.append(leader)
    child = int(leader.stdout.readline())
    wait_for(lambda: "time.sleep" in " ".join(psutil.Process(child).cmdline()), timeout=10, what="exec")
    job = job_on([0], 1024, leader.pid)
    hog = replace(describe_process(child, 4096), username="gpujob")
    assert hog.parent_session_id == leader.pid
    os.kill(child, signal.SIGKILL)  # it ends between the snapshot and the stop
    wait_for(lambda: not psutil.pid_exists(child), timeout=10, what="the child's end, reaped")
    t0 = timezone.now()
    watchdog.round(on_card(0, hog), now=t0)
    job.refresh_from_db()
    assert job.watchdog_stop.startswith("Stopped by the GPU watchdog: over_memory")  # the job is stopped
    watchdog.round(on_card(0), now=t0 + timedelta(seconds=2))  # gone from the card
    violation = Violation.objects.get()
    assert violation.action == "stopped", (violation.action, violation.message)
    assert AuditEntry.objects.filter(action="watchdog.stop", target=f"violation {violation.pk}").exists()
    assert Notification.objects.filter(subject__contains="was stopped").exists()


def test_a_process_whose_stop_is_under_way_is_not_stopped_and_recorded_again_as_another_kind(
    watchdog, job_on, procs
):
    """The job's setsid child ignores SIGTERM; the job's session ends and the child, adopted, is
    judged again (an intruder under a shared JOB_USER). Its over_memory stop goes on (SIGKILL after
    the watchdog's grace): one process, one stop. A second violation of the same process that is
    warned, signalled and recorded `stopped` as well makes one death two stops (two audit entries,
    two "was stopped" notifications)."""
    policy("over_memory", "stop", grace=0)
    policy("intruder", "stop", grace=0)
    leader, child = _job_with_stubborn_setsid_child(procs)
    try:
        job = job_on([0], 1024, leader.pid)
        t0 = timezone.now()
        hog = replace(describe_process(child, 4096), username="gpujob")
        watchdog.round(on_card(0, hog), now=t0)
        os.killpg(leader.pid, signal.SIGKILL)  # the job's supervisor ends the job's session
        leader.wait()
        wait_for(lambda: psutil.Process(child).ppid() != leader.pid, timeout=10, what="adoption")
        Job.objects.filter(pk=job.pk).update(status=Job.Status.FAILED, finished_at=timezone.now())
        adopted = replace(describe_process(child, 4096), username="gpujob")
        for seconds in (1, 2, 12):
            watchdog.round(on_card(0, adopted), now=t0 + timedelta(seconds=seconds))
        wait_for(lambda: not _alive(child), timeout=10, what="SIGKILL")
        watchdog.round(on_card(0), now=t0 + timedelta(seconds=14))
        stops = AuditEntry.objects.filter(action="watchdog.stop").count()
        kinds = list(Violation.objects.order_by("pk").values_list("kind", "action"))
        assert stops == 1, kinds
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_process_that_ended_on_sigterm_while_nvml_still_lists_it_is_recorded_stopped(
    watchdog, alices_card, bob, start
):
    """SIGTERM ends the intruder; NVML lists it for a few seconds more (STOP_CONFIRM_SECONDS). The
    SIGKILL round finds no such process: that is the stop done, not "Not signalled" (finished, so
    its end is never recorded `stopped`, nor audited, nor told)."""
    policy("intruder", "stop", grace=0)
    proc = start()
    seen = real(proc, user="bob")
    t0 = timezone.now()
    watchdog.round(on_card(0, seen), now=t0)
    wait_for(lambda: gone(proc), timeout=10, what="SIGTERM")
    watchdog.round(on_card(0, seen), now=t0 + timedelta(seconds=kill_grace()))  # NVML's lag
    watchdog.round(on_card(0), now=t0 + timedelta(seconds=kill_grace() + 2))
    violation = Violation.objects.get()
    assert violation.action == "stopped", (violation.action, violation.message)
    assert AuditEntry.objects.filter(action="watchdog.stop", target=f"violation {violation.pk}").exists()


def test_a_setsid_child_of_a_job_that_just_ended_by_itself_is_not_signalled_for_the_job(
    watchdog, job_on, procs, monkeypatch
):
    """The round read the job as running (over its memory through its setsid child); it ended by
    itself before the stop's UPDATE (asked: 0, "already stopping or ended"). Its child is an ended
    job's process now, a zombie, whose policy here is warn: the watchdog must not signal it as the
    job's over_memory, which nobody stops any more."""
    policy("over_memory", "stop", grace=0)
    policy("zombie", "warn")
    leader, child = _job_with_setsid_child(procs)
    try:
        job = job_on([0], 1024, leader.pid)
        import jobs.host.watchdog as module

        read = module.round_facts

        def racing(*args, **kwargs):
            facts = read(*args, **kwargs)
            Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED, finished_at=timezone.now())
            return facts

        monkeypatch.setattr(module, "round_facts", racing)
        hog = replace(describe_process(child, 4096), username="gpujob")
        watchdog.round(on_card(0, hog), now=timezone.now())
        job.refresh_from_db()
        assert job.watchdog_stop == ""  # the job ended by itself
        time.sleep(0.5)
        assert _alive(child), "the ended job's child was signalled for the job's over_memory"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_worker_restarted_in_dry_run_mode_sends_no_sigkill_to_a_stop_begun_before(
    watchdog, alices_card, bob, start, settings
):
    """WATCHDOG_DRY_RUN "records and notifies but never signals". A worker restarted with it set
    (an admin turning it on mid-incident) rebuilds a stop begun before (Sent SIGTERM) and carries
    it on: SIGKILL."""
    policy("intruder", "stop", grace=0)
    proc = start(STUBBORN)
    wait_for(lambda: _ignores_sigterm(proc.pid), timeout=10, what="SIG_IGN")
    seen = real(proc, user="bob")
    t0 = timezone.now()
    watchdog.round(on_card(0, seen), now=t0)
    assert Violation.objects.get().message.startswith("Sent SIGTERM")
    settings.WATCHDOG_DRY_RUN = True
    restarted = type(watchdog)("box1", simulated=False)
    restarted.round(on_card(0, seen), now=t0 + timedelta(seconds=kill_grace()))
    time.sleep(0.5)
    assert not gone(proc), "SIGKILL sent in dry-run mode"
