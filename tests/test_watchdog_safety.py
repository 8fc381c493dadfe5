"""The GPU watchdog signals only the process it means, and records before it remembers (issue 19).

Real processes, as in tests/test_watchdog.py (whose fixtures and helpers this module shares): pid 0
from NVML, a pid reused in the same session, a process whose start cannot be read; database
writes that fail and are tried again next round; a booking's last seconds; the owner's own
processes over a shared booking; a restarted worker in dry-run mode.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from datetime import timedelta

import psutil
import pytest
from django.db import OperationalError
from django.db.models import QuerySet
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.inventory import ProcessInfo
from gpus.models import GPUProcess, Violation
from gpus.procinfo import describe_process, session_of
from gpus.services import servers_report_ingest
from jobs.host import watchdog as watchdog_host
from jobs.host.watchdog import HostWatchdog, ended_booking_grace
from jobs.models import Job
from portal.models import AuditEntry, Notification
from portal.pids import Sent
from tests.test_watchdog import alices_card, gone, job_on, on_card, one, policy, real, start, watchdog
from tests.waiting import wait_for

__all__ = ["alices_card", "job_on", "start", "watchdog"]  # fixtures shared with tests/test_watchdog.py


@pytest.fixture
def signals(monkeypatch) -> list[tuple[str, int, int]]:
    """Every signal any code sends, recorded instead of sent."""
    calls: list[tuple[str, int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: calls.append(("kill", pid, sig)))
    monkeypatch.setattr(signal, "pidfd_send_signal", lambda fd, sig: calls.append(("pidfd", fd, sig)))
    return calls


# --- pid 0 and our own process group ---------------------------------------------------------------


def test_getsid_of_pid_0_is_no_session():
    """getsid(0) is the caller's own session: pid 0 would pass any session check."""
    assert session_of(0) is None and session_of(1) is None
    info = describe_process(0, 100)
    assert (info.session_id, info.started) == (None, None)


def test_pid_0_with_our_own_session_is_never_signalled(watchdog, alices_card, signals):
    policy("intruder", "stop")
    ours = ProcessInfo(
        pid=0,
        username="bob",
        command="?",
        used_memory_mb=100,
        session_id=os.getsid(0),
        started=psutil.Process().create_time(),
    )
    watchdog.round(on_card(0, ours), now=timezone.now())
    assert signals == []
    assert "Not signalled" in one().message


def test_a_process_of_our_own_group_is_never_signalled(watchdog, alices_card, signals):
    policy("intruder", "stop")
    me = replace(describe_process(os.getpid(), 100), username="bob")
    watchdog.round(on_card(0, me), now=timezone.now())
    assert signals == []
    assert "Not signalled" in one().message


# --- identity: pid plus start time ---------------------------------------------------------------


def test_a_pid_reused_in_the_same_session_is_not_signalled(watchdog, alices_card, start):
    """A later command of the same login shell: same pid (here), same session, another start."""
    policy("intruder", "stop")
    proc = start()
    earlier = real(proc, user="bob")
    earlier = replace(earlier, started=earlier.started - 5)
    watchdog.round(on_card(0, earlier), now=timezone.now())
    assert not gone(proc)


def test_a_process_whose_start_cannot_be_read_is_never_signalled(watchdog, alices_card, start):
    policy("intruder", "stop", grace=10)
    proc = start()
    unknown = replace(real(proc, user="bob"), started=None)
    t0 = timezone.now()
    watchdog.round(on_card(0, unknown), now=t0)
    told = Notification.objects.filter(user__username="alice").get()
    assert "will not be stopped: its start time could not be read" in told.body
    watchdog.round(on_card(0, unknown), now=t0 + timedelta(seconds=11))
    assert not gone(proc)
    assert "start time could not be read" in one().message


def test_a_new_process_with_an_old_pid_is_a_new_violation(watchdog, alices_card, start):
    proc = start()
    seen = real(proc, user="bob")
    t0 = timezone.now()
    watchdog.round(on_card(0, replace(seen, started=seen.started - 100)), now=t0)
    watchdog.round(on_card(0, seen), now=t0 + timedelta(seconds=30))
    old, new = Violation.objects.order_by("first_seen")
    assert old.ended_at == t0 + timedelta(seconds=30)
    assert (new.first_seen, new.ended_at, new.process_started) == (
        t0 + timedelta(seconds=30),
        None,
        seen.started,
    )


def test_the_ingest_stores_each_processs_start(box):
    info = describe_process(os.getpid(), 100)
    servers_report_ingest(snapshots=[on_card(0, info)])
    assert GPUProcess.objects.get().started == info.started


# --- state changes only after the write ----------------------------------------------------------


def failing_update(monkeypatch, model: type, field: str) -> None:
    """The next UPDATE of `field` on `model` fails as if the database went away."""
    update = QuerySet.update

    def flaky(self, **kwargs):
        if self.model is model and field in kwargs:
            monkeypatch.setattr(QuerySet, "update", update)  # once
            raise OperationalError("server closed the connection unexpectedly")
        return update(self, **kwargs)

    monkeypatch.setattr(QuerySet, "update", flaky)


def test_a_job_whose_stop_could_not_be_recorded_is_asked_again(watchdog, job_on, start, monkeypatch):
    policy("over_memory", "stop")
    proc = start()
    job = job_on([0], 1024, proc.pid)
    t0 = timezone.now()
    failing_update(monkeypatch, Job, "watchdog_stop")
    with pytest.raises(OperationalError):
        watchdog.round(on_card(0, real(proc, 4096)), now=t0)
    job.refresh_from_db()
    assert job.watchdog_stop == ""

    watchdog.round(on_card(0, real(proc, 4096)), now=t0 + timedelta(seconds=2))
    job.refresh_from_db()
    assert job.watchdog_stop.startswith("Stopped by the GPU watchdog: over_memory")
    assert one().action == "warned"  # not stop_failed: the stop goes on


def test_a_stop_whose_end_could_not_be_recorded_is_recorded_next_round(
    watchdog, alices_card, start, monkeypatch
):
    policy("intruder", "stop")
    proc = start()
    t0 = timezone.now()
    watchdog.round(on_card(0, real(proc, user="bob")), now=t0)
    wait_for(lambda: gone(proc), timeout=10, what="SIGTERM")
    failing_update(monkeypatch, Violation, "stopped_at")
    with pytest.raises(OperationalError):
        watchdog.round(on_card(0), now=t0 + timedelta(seconds=2))
    assert one().ended_at is None

    watchdog.round(on_card(0), now=t0 + timedelta(seconds=4))
    violation = one()
    assert (violation.action, violation.stopped_at) == ("stopped", t0 + timedelta(seconds=4))
    assert AuditEntry.objects.filter(target=f"violation {violation.pk}", message__contains="stopped").exists()
    assert Notification.objects.filter(subject__contains="was stopped").exists()


def test_a_warning_that_could_not_be_recorded_is_given_next_round(watchdog, alices_card, start, monkeypatch):
    proc = start()
    failing_update(monkeypatch, Violation, "action")
    with pytest.raises(OperationalError):
        watchdog.round(on_card(0, real(proc, user="bob")), now=timezone.now())
    assert not Violation.objects.exists()  # the record and its warning are one

    watchdog.round(on_card(0, real(proc, user="bob")), now=timezone.now())
    assert one().action == "warned"
    assert Notification.objects.filter(user__username="alice").exists()


# --- a booking's last seconds --------------------------------------------------------------------


def test_a_job_on_its_card_just_after_its_booking_ended_has_not_escaped(watchdog, job_on, start, settings):
    settings.JOB_KILL_GRACE_SECONDS, settings.WATCHDOG_INTERVAL_SECONDS = 10, 2
    proc = start()
    job = job_on([0], None, proc.pid)
    end = timezone.now() + timedelta(seconds=1)
    job.reservation.allocations.update(end=end)  # released: the end moves to the release time

    # The cancel poll (1 s) + SIGTERM..SIGKILL (10 s) + NVML listing it after (10 s) + a round (2 s).
    assert ended_booking_grace() == timedelta(seconds=23)
    watchdog.round(on_card(0, real(proc)), now=end + timedelta(seconds=22))
    assert not Violation.objects.exists()  # its supervisor is still stopping it

    watchdog.round(on_card(0, real(proc)), now=end + timedelta(seconds=24))
    assert one().kind == "escaped"


# --- the owner's processes over a shared booking -------------------------------------------------


def test_the_owners_process_above_her_shared_booking_is_over_memory_and_stopped(alice, box, start):
    policy("over_memory", "stop")
    watchdog = HostWatchdog("box1", simulated=False)
    reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=1024)
    proc = start()
    watchdog.round(on_card(0, real(proc, 1024, user="alice")), now=timezone.now())
    assert one().kind == "owner_outside_job" and not gone(proc)

    watchdog.round(on_card(0, real(proc, 4096, user="alice")), now=timezone.now())
    violation = Violation.objects.get(kind="over_memory")
    assert (violation.memory_mb, violation.booked_mb, violation.user) == (4096, 1024, alice)
    wait_for(lambda: gone(proc), timeout=10, what="the stop")


# --- a restarted worker ----------------------------------------------------------------------------


def test_a_restarted_dry_run_announces_nothing_twice(box, alices_card, start, settings):
    settings.WATCHDOG_DRY_RUN = True
    policy("intruder", "stop")
    proc = start()
    t0 = timezone.now()
    HostWatchdog("box1", simulated=False).round(on_card(0, real(proc, user="bob")), now=t0)
    announced = Notification.objects.filter(subject__contains="dry run").count()
    assert announced == 1  # alice, whose card it is (bob has no portal account here)

    for seconds in (1, 100):  # each a restarted worker
        restarted = HostWatchdog("box1", simulated=False)
        restarted.round(on_card(0, real(proc, user="bob")), now=t0 + timedelta(seconds=seconds))
    assert Notification.objects.filter(subject__contains="dry run").count() == announced
    assert not gone(proc)


def test_a_restarted_worker_carries_a_stop_on_rather_than_beginning_it_again(
    box, alices_card, start, settings, monkeypatch
):
    settings.JOB_KILL_GRACE_SECONDS = 5
    policy("intruder", "stop")
    sent: list[signal.Signals] = []
    monkeypatch.setattr(watchdog_host, "send", lambda target, sig: sent.append(sig) or Sent.SENT)
    proc = start()
    t0 = timezone.now()
    HostWatchdog("box1", simulated=False).round(on_card(0, real(proc, user="bob")), now=t0)
    HostWatchdog("box1", simulated=False).round(
        on_card(0, real(proc, user="bob")), now=t0 + timedelta(seconds=6)
    )
    assert sent == [signal.SIGTERM, signal.SIGKILL]
