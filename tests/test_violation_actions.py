"""Acting on a violation (gpus/violations.py): "stop it now" and "mark resolved", by its owner, the
team's leaders and admins, never teammates or outsiders; the host's watchdog carrying the request
out at its next round (jobs/host/watchdog.py), and saying why in the job's log, the notifications
and the audit log. And the leaders told of their team's violations as docs/watchdog.md says."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from dataclasses import replace
from datetime import timedelta

import psutil
import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.inventory import ProcessInfo, Snapshot
from gpus.models import Violation, WatchdogPolicy
from gpus.procinfo import describe_process
from gpus.violations import violation_resolve, violation_stop
from jobs.host.runner import job_run
from jobs.host.watchdog import HostWatchdog
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal.errors import Forbidden, Invalid
from portal.models import AuditEntry, Membership, Notification
from tests.factories import MembershipFactory, UserFactory, make_snapshot
from tests.job_helpers import job_log
from tests.waiting import wait_for

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def start(procs):
    def start() -> subprocess.Popen:
        proc = subprocess.Popen(SLEEP, start_new_session=True)
        procs.append(proc)
        wait_for(lambda: "python" in " ".join(psutil.Process(proc.pid).cmdline()), timeout=10, what="exec")
        return proc

    return start


def policy(kind: str, action: str, grace: int = 0) -> None:
    WatchdogPolicy.objects.update_or_create(kind=kind, defaults={"action": action, "grace_seconds": grace})


def on_card(index: int, *processes: ProcessInfo) -> Snapshot:
    snapshot = make_snapshot("box1", gpus=4, processes=0)
    cards = list(snapshot.gpus)
    cards[index] = replace(cards[index], processes=processes)
    return replace(snapshot, gpus=tuple(cards))


def as_user(proc: subprocess.Popen, user: str, mb: int = 2048) -> ProcessInfo:
    return replace(describe_process(proc.pid, mb), username=user)


@pytest.fixture
def watchdog(box) -> HostWatchdog:
    return HostWatchdog("box1", simulated=False)


@pytest.fixture
def alices_card(alice, box):
    return reservation_create(user=alice, gpus=[box[0].uuid])


@pytest.fixture
def intrusion(watchdog, alices_card, bob, start):
    """bob's process on alice's booked card, seen once (warned; stopped after 60 s by policy)."""
    policy("intruder", "stop", grace=60)
    proc = start()
    watchdog.round(on_card(0, as_user(proc, "bob")), now=timezone.now())
    return proc, Violation.objects.get()


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


# --- who may act ------------------------------------------------------------------------------


@pytest.fixture
def people(alice, bob, leader, charlie):
    """alice owns the booking; dave caused the violation (a member of Vision Lab); bob is a
    teammate of both; charlie an outsider; the team's leader; an admin."""
    dave = MembershipFactory(team=alice.memberships.get().team, user=UserFactory(username="dave")).user
    admin = UserFactory(username="admin", is_staff=True, is_superuser=True)
    return {
        "owner": alice,
        "offender": dave,
        "teammate": bob,
        "outsider": charlie,
        "leader": leader,
        "admin": admin,
    }


@pytest.fixture
def daves_intrusion(box, alices_card, people):
    now = timezone.now()
    return Violation.objects.create(
        kind=Violation.Kind.INTRUDER, gpu=box[0], server=box[0].server, pid=4242, os_user="dave",
        user=people["offender"], reservation=alices_card, first_seen=now, last_seen=now,
        action=Violation.Action.WARNED,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("role", "stop", "resolve"),
    [
        ("owner", 302, 302),
        ("offender", 302, 403),  # may stop their own process, never call off its stop alone
        ("teammate", 404, 404),
        ("outsider", 404, 404),
        ("leader", 302, 302),
        ("admin", 302, 302),
    ],
)
def test_who_may_stop_and_resolve(people, daves_intrusion, role, stop, resolve):
    client = client_for(people[role])
    pk = daves_intrusion.pk
    answer = client.post(reverse("violation_resolve", args=[pk]), {"note": "agreed with alice"})
    assert answer.status_code == resolve
    assert (Violation.objects.get(pk=pk).resolved_at is not None) == (resolve == 302)
    Violation.objects.filter(pk=pk).update(resolved_at=None)
    answer = client.post(reverse("violation_stop", args=[pk]), {"reason": "blocking my run"})
    assert answer.status_code == stop
    assert (Violation.objects.get(pk=pk).stop_requested_at is not None) == (stop == 302)


def test_the_page_offers_what_each_may_do(people, daves_intrusion):
    url = reverse("violation_detail", args=[daves_intrusion.pk])
    page = client_for(people["offender"]).get(url).content.decode()
    assert "Stop it now" in page and "Mark resolved" not in page
    assert "The owner of the booking, a leader of the team or an admin may mark it resolved" in page
    page = client_for(people["leader"]).get(url).content.decode()
    assert "Stop it now" in page and "Mark resolved" in page


def test_resolving_needs_a_note_said_beside_the_field_and_nothing_is_written(people, daves_intrusion):
    answer = client_for(people["leader"]).post(
        reverse("violation_resolve", args=[daves_intrusion.pk]), {"note": " "}
    )
    assert answer.status_code == 200
    assert "Say how it was resolved" in answer.content.decode()
    assert Violation.objects.get().resolved_at is None
    assert not AuditEntry.objects.filter(action="violation.resolve").exists()
    assert not Notification.objects.exists()


def test_an_ended_violation_is_not_stopped_again_and_says_why(people, daves_intrusion):
    Violation.objects.filter(pk=daves_intrusion.pk).update(ended_at=timezone.now())
    with pytest.raises(Invalid, match="It has ended"):
        violation_stop(actor=people["leader"], violation=daves_intrusion)
    page = client_for(people["leader"]).get(reverse("violation_detail", args=[daves_intrusion.pk]))
    assert "It has ended" in page.content.decode() and "Stop it now</button>" not in page.content.decode()
    # resolved afterwards, for the record
    violation_resolve(actor=people["leader"], violation=daves_intrusion, note="talked to dave")
    assert Violation.objects.get().resolution == "talked to dave"


def test_the_owners_own_process_within_the_booking_is_never_stopped(people, daves_intrusion):
    Violation.objects.filter(pk=daves_intrusion.pk).update(kind=Violation.Kind.OWNER_OUTSIDE_JOB)
    daves_intrusion.refresh_from_db()
    with pytest.raises(Invalid, match="never stopped by the portal"):
        violation_stop(actor=people["admin"], violation=daves_intrusion)


def test_the_offender_alone_cannot_resolve_through_the_service_either(people, daves_intrusion):
    with pytest.raises(Forbidden, match="You caused this violation"):
        violation_resolve(actor=people["offender"], violation=daves_intrusion, note="it is fine")


def test_acting_tells_the_people_concerned_and_the_audit_log(people, daves_intrusion):
    violation_stop(actor=people["owner"], violation=daves_intrusion, reason="my deadline run")
    told = Notification.objects.filter(key=f"violation:{daves_intrusion.pk}:stop_asked")
    assert sorted(told.values_list("user__username", flat=True)) == ["dave", "leader"]  # not alice, who asked
    assert all("alice asked for it to be stopped now: my deadline run" in n.body for n in told)
    entry = AuditEntry.objects.get(action="violation.stop")
    assert entry.actor == people["owner"] and entry.team == people["owner"].memberships.get().team
    assert "my deadline run" in entry.message


# --- the watchdog carries it out ----------------------------------------------------------------


def test_stop_now_stops_an_intruder_at_the_next_round_whatever_the_grace(watchdog, intrusion, alice):
    proc, violation = intrusion
    violation_stop(actor=alice, violation=violation, reason="my run waits")
    watchdog.round(on_card(0, as_user(proc, "bob")), now=timezone.now())  # 60 s grace: not passed
    wait_for(lambda: proc.poll() is not None, timeout=10, what="SIGTERM")
    assert proc.returncode == -signal.SIGTERM
    watchdog.round(on_card(0), now=timezone.now())  # gone from the card
    violation.refresh_from_db()
    assert (violation.action, violation.ended_at is not None) == ("stopped", True)
    entry = AuditEntry.objects.get(action="watchdog.stop")
    assert "(asked for by alice)" in entry.message
    stopped = Notification.objects.get(user__username="bob", subject__contains="was stopped")
    assert "Its stop was asked for by alice on the portal: my run waits." in stopped.body


def test_a_resolved_violation_is_left_running_after_its_grace(watchdog, intrusion, leader):
    proc, violation = intrusion
    violation_resolve(actor=leader, violation=violation, note="bob borrows it, agreed with alice")
    watchdog.round(on_card(0, as_user(proc, "bob")), now=timezone.now() + timedelta(seconds=61))
    assert proc.poll() is None
    violation.refresh_from_db()
    assert violation.action == "warned" and violation.ended_at is None
    assert not AuditEntry.objects.filter(action="watchdog.stop").exists()


def test_a_stop_under_way_goes_on_once_resolved(watchdog, intrusion, leader, settings):
    settings.WATCHDOG_KILL_GRACE_SECONDS = 5
    proc, violation = intrusion
    t0 = timezone.now()
    watchdog.round(on_card(0, as_user(proc, "bob")), now=t0 + timedelta(seconds=61))  # SIGTERM by policy
    violation_resolve(actor=leader, violation=violation, note="too late")
    wait_for(lambda: proc.poll() is not None, timeout=10, what="SIGTERM")
    watchdog.round(on_card(0), now=t0 + timedelta(seconds=63))
    violation.refresh_from_db()
    assert violation.action == "stopped"


@pytest.fixture
def running_job(alice, box, settings):
    """alice's job on her 8 GiB booking of card 0, run by the real supervisor in a thread."""
    settings.JOB_KILL_GRACE_SECONDS = 1
    settings.JOB_HEARTBEAT_SECONDS = 1
    settings.JOB_DRAIN_SECONDS = 1
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    script = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"
    job = job_submit(
        user=alice, reservation=booking, script=ScriptUpload(name="train.py", content=script.encode())
    )
    outcome: list[str | None] = []
    thread = threading.Thread(target=lambda: outcome.append(job_run(job.pk)), daemon=True)
    thread.start()
    wait_for(
        lambda: Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).exclude(pid=None).exists(),
        timeout=30,
    )
    job.refresh_from_db()
    yield job, thread, outcome
    Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).update(cancel_requested_at=timezone.now())
    thread.join(timeout=30)


@pytest.mark.django_db(transaction=True)
def test_a_jobs_stop_asked_by_a_leader_says_who_and_why_in_its_log_its_end_and_the_inbox(
    box, running_job, leader
):
    job, thread, outcome = running_job
    policy("over_memory", "warn")
    watchdog = HostWatchdog("box1", simulated=False)
    over = describe_process(job.pid, 9000)  # above the 8 GiB booked + the tolerance
    watchdog.round(on_card(0, over), now=timezone.now())
    violation = Violation.objects.get(kind="over_memory", job_id=job.pk)

    violation_stop(actor=leader, violation=violation, reason="blocks the deadline run")
    watchdog.round(on_card(0, over), now=timezone.now())
    thread.join(timeout=30)

    assert outcome == [Job.Status.FAILED]
    words = "Stopped by the GPU watchdog at leader's request (blocks the deadline run): over_memory: job"
    assert words in job_log(job.pk)  # the job's log
    job.refresh_from_db()
    assert job.message.startswith(words)  # its end
    failed = Notification.objects.get(user__username="alice", kind="job_failed")
    assert "leader's request (blocks the deadline run)" in failed.body  # the owner's inbox
    asked = Notification.objects.get(user__username="alice", key=f"violation:{violation.pk}:stop_asked")
    assert "leader asked for it to be stopped now: blocks the deadline run" in asked.body
    assert AuditEntry.objects.filter(action="violation.stop", actor=leader).exists()


# --- leaders told of their team's violations, as docs/watchdog.md says -------------------------------


def test_leaders_are_told_from_the_repeat_offence_on_not_before(
    watchdog, alices_card, team, leader, start, settings
):
    """docs/watchdog.md: the offender's team leaders are told once they have had
    WATCHDOG_REPEAT_OFFENCES offences in a week; they see every one on the Violations page."""
    settings.WATCHDOG_REPEAT_OFFENCES = 3
    bob = MembershipFactory(team=team, user=UserFactory(username="bob")).user
    assert bob.memberships.get().role == Membership.Role.MEMBER
    for offence in range(1, 4):
        proc = start()
        watchdog.round(on_card(0, as_user(proc, "bob")), now=timezone.now())
        told = Notification.objects.filter(user=leader).count()
        assert told == (1 if offence == 3 else 0), f"after offence {offence}"
    page = client_for(leader).get(reverse("violations")).content.decode()
    assert page.count('data-violation="') == 3


def test_leaders_are_told_when_someone_acts_on_their_members_violation(people, daves_intrusion):
    violation_resolve(actor=people["admin"], violation=daves_intrusion, note="dave's mistake, fixed")
    told = Notification.objects.filter(key=f"violation:{daves_intrusion.pk}:resolved")
    assert sorted(told.values_list("user__username", flat=True)) == ["alice", "dave", "leader"]
