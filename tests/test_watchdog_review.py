"""The watchdog's review findings: violations through a dip, events rather than processes, a
deleted row, an ended job's session, and a booking's last seconds (jobs/host/watchdog.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from django.contrib.admin.sites import site
from django.test import RequestFactory
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.inventory import ProcessInfo
from gpus.models import Violation
from jobs.host.runner import CANCEL_POLL_SECONDS
from jobs.host.watchdog import STOP_CONFIRM_SECONDS, HostWatchdog, ended_booking_grace
from jobs.models import Job
from jobs.watchdog.notify import offences
from portal.models import Notification
from tests.factories import make_snapshot
from tests.test_watchdog import gone, job_on, on_card, policy, real, start, watchdog
from tests.waiting import wait_for

__all__ = ["job_on", "start", "watchdog"]  # fixtures, used by name

pytestmark = pytest.mark.django_db


@pytest.fixture
def shared_card(alice, bob, box):
    """Card 0 shared: alice booked 2 GiB of it, bob 8 GiB."""
    reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=2048)
    reservation_create(user=bob, gpus=[box[0].uuid], memory_mb=8192)


# --- H5: a dip under the limit neither ends the violation nor restarts its grace ----------------


def test_over_memory_that_dips_under_for_one_round_is_still_stopped(
    watchdog, shared_card, bob, start, settings
):
    """alice's notebook sits at 8 GiB where she booked 2 GiB, and dips under for one round every
    30 s: one violation, its grace counted from its first sighting, bob told once."""
    settings.WATCHDOG_INTERVAL_SECONDS = 2  # the hold: 3 rounds, 6 s
    policy("over_memory", "stop", grace=30)
    proc = start()
    t0 = timezone.now()
    for second in range(0, 300, 5):
        mb = 1024 if second % 30 == 25 else 8192  # over 25 s, under 5 s
        watchdog.round(on_card(0, real(proc, mb, user="alice")), now=t0 + timedelta(seconds=second))
        if Violation.objects.filter(message__startswith="Sent SIGTERM").exists():
            break
    wait_for(lambda: gone(proc), timeout=10, what="SIGTERM")
    violation = Violation.objects.get(kind="over_memory")
    assert violation.first_seen == t0 and violation.action_at == t0 + timedelta(seconds=30)
    assert not Violation.objects.filter(kind="owner_outside_job").exists()  # held, not replaced
    assert Notification.objects.filter(user=bob, kind="over_memory").count() == 1


def test_a_violation_ends_once_within_budget_longer_than_the_hold(
    watchdog, shared_card, bob, start, settings
):
    settings.WATCHDOG_INTERVAL_SECONDS = 2
    policy("over_memory", "warn")
    proc = start()
    t0 = timezone.now()
    plan = [(0, 8192), (2, 1024), (4, 1024), (6, 1024), (8, 8192)]  # under 6 s: the hold is over
    for second, mb in plan:
        watchdog.round(on_card(0, real(proc, mb, user="alice")), now=t0 + timedelta(seconds=second))
        if second == 4:
            assert Violation.objects.get().ended_at is None  # held through the dip
            assert Violation.objects.get().last_seen == t0  # last seen over its budget
    first, second = Violation.objects.order_by("first_seen", "pk").filter(kind="over_memory")
    assert first.ended_at == t0 + timedelta(seconds=6) and second.first_seen == t0 + timedelta(seconds=8)
    # Within budget past the hold, the notebook was alice's business again: shown, then ended.
    assert Violation.objects.get(kind="owner_outside_job").ended_at == t0 + timedelta(seconds=8)
    assert Notification.objects.filter(user=bob, kind="over_memory").count() == 2


def test_a_new_process_is_a_new_violation_even_within_the_hold(watchdog, shared_card, start, settings):
    settings.WATCHDOG_INTERVAL_SECONDS = 2
    policy("over_memory", "warn")
    proc = start()
    t0 = timezone.now()
    seen = real(proc, 8192, user="alice")
    watchdog.round(on_card(0, seen), now=t0)
    later = replace(seen, started=(seen.started or 0) + 60)  # the same pid, another process
    watchdog.round(on_card(0, later), now=t0 + timedelta(seconds=2))
    first, second = Violation.objects.order_by("first_seen")
    assert first.ended_at == t0 + timedelta(seconds=2) and second.first_seen == t0 + timedelta(seconds=2)


def test_a_stop_under_way_goes_on_through_a_dip(watchdog, shared_card, start, settings):
    from tests.test_watchdog import STUBBORN

    settings.WATCHDOG_INTERVAL_SECONDS, settings.JOB_KILL_GRACE_SECONDS = 2, 5
    policy("over_memory", "stop")
    proc = start(STUBBORN)
    t0 = timezone.now()
    watchdog.round(on_card(0, real(proc, 8192, user="alice")), now=t0)  # SIGTERM, ignored
    for second in (4, 8):  # within budget now, longer than the hold: the stop goes on
        watchdog.round(on_card(0, real(proc, 1024, user="alice")), now=t0 + timedelta(seconds=second))
    wait_for(lambda: gone(proc), timeout=10, what="SIGKILL")
    assert Violation.objects.get().ended_at is None  # ended once NVML no longer lists it


# --- M2: one event, one offence and one message ---------------------------------------------------


def three_processes(session: int, mb: int = 3000) -> list[ProcessInfo]:
    return [
        ProcessInfo(
            pid=session + i,
            username="alice",
            command="python",
            used_memory_mb=mb,
            session_id=session,
            started=1.0,
        )
        for i in range(3)
    ]


def test_one_job_over_memory_with_three_processes_is_one_offence(alice, team, leader, job_on, watchdog):
    """A job with three processes on its shared card (a model, two data loaders): a violation row
    for each, but one message and one offence, so nobody is a repeat offender on a first event."""
    policy("over_memory", "warn")
    job = job_on([0], 4096, 999_999)  # the session of the job's processes; nothing is signalled (warn)
    watchdog.round(on_card(0, *three_processes(999_999)), now=timezone.now())
    assert Violation.objects.filter(kind="over_memory", job_id=job.pk).count() == 3
    told = Notification.objects.filter(user=alice, kind="over_memory")
    assert told.count() == 1
    assert "and 2 more of the same: pid 1000000, 1000001" in told.get().body
    assert offences(alice.pk, since=timezone.now() - timedelta(days=7)) == 1
    assert not Notification.objects.filter(user=leader).exists()


def test_a_process_that_joins_an_event_already_told_is_not_told_again(alice, job_on, watchdog):
    policy("over_memory", "warn")
    job_on([0], 4096, 999_999)
    first, *rest = three_processes(999_999, mb=6000)
    t0 = timezone.now()
    watchdog.round(on_card(0, first), now=t0)
    watchdog.round(on_card(0, first, *rest), now=t0 + timedelta(seconds=2))
    assert Violation.objects.count() == 3
    assert Notification.objects.filter(user=alice, kind="over_memory").count() == 1
    assert offences(alice.pk, since=t0 - timedelta(days=1)) == 1


def test_one_rounds_stop_of_one_job_is_one_message(alice, job_on, watchdog, settings):
    settings.WATCHDOG_DRY_RUN = True
    policy("over_memory", "stop", grace=5)
    job_on([0], 4096, 999_999)
    t0 = timezone.now()
    for second in (0, 6):
        watchdog.round(on_card(0, *three_processes(999_999)), now=t0 + timedelta(seconds=second))
    assert Violation.objects.filter(message__startswith="Dry run").count() == 3
    assert Notification.objects.filter(user=alice, subject__contains="dry run").count() == 1


def test_offences_in_turn_are_counted_each(alice, bob, box, start, watchdog):
    """Two intrusions one after the other are two events (tests/test_watchdog.py has the leader's
    side); two at once by the same person on the same card are one."""
    reservation_create(user=alice, gpus=[box[0].uuid])
    t0 = timezone.now()
    a, b, c = start(), start(), start()
    watchdog.round(on_card(0, real(a, user="bob"), real(b, user="bob")), now=t0)
    watchdog.round(on_card(0, real(c, user="bob")), now=t0 + timedelta(seconds=2))
    assert Violation.objects.filter(user=bob).count() == 3
    assert offences(bob.pk, since=t0 - timedelta(days=1)) == 2


# --- M4: a deleted violation breaks nothing; open ones cannot be deleted ------------------------


def test_a_deleted_open_violation_breaks_no_later_round(alice, box, start, settings):
    """Under a dry run, the deleted row's stop found no row (DoesNotExist) every round, and nothing
    after it in the round was judged."""
    settings.WATCHDOG_DRY_RUN = True
    policy("intruder", "stop", grace=10)
    watchdog = HostWatchdog("box1", simulated=False)
    reservation_create(user=alice, gpus=[box[0].uuid, box[1].uuid])
    first, second = start(), start()
    t0 = timezone.now()
    watchdog.round(on_card(0, real(first, user="bob")), now=t0)
    Violation.objects.all().delete()  # deleted behind the watchdog's back (the admin no longer can)

    snapshot = make_snapshot("box1", gpus=4, processes=0)
    cards = list(snapshot.gpus)
    cards[0] = replace(cards[0], processes=(real(first, user="bob"),))
    cards[1] = replace(cards[1], processes=(real(second, user="bob"),))
    for seconds in (11, 13, 15):
        watchdog.round(replace(snapshot, gpus=tuple(cards)), now=t0 + timedelta(seconds=seconds))
    assert Violation.objects.filter(pid=second.pid).exists()
    assert Violation.objects.filter(pid=first.pid).exists()  # its key dropped: recorded afresh


def test_the_admin_deletes_only_ended_violations(alice, box, start, watchdog, admin_user):
    reservation_create(user=alice, gpus=[box[0].uuid])
    proc, other = start(), start()
    t0 = timezone.now()
    watchdog.round(on_card(0, real(proc, user="bob"), real(other, user="bob")), now=t0)
    watchdog.round(on_card(0, real(other, user="bob")), now=t0 + timedelta(seconds=2))
    ended, open_ = Violation.objects.get(pid=proc.pid), Violation.objects.get(pid=other.pid)
    request = RequestFactory().post("/")
    request.user = admin_user
    admin = site.get_model_admin(Violation)
    assert admin.has_delete_permission(request, ended) and not admin.has_delete_permission(request, open_)
    admin.delete_queryset(request, Violation.objects.all())
    assert list(Violation.objects.all()) == [open_]


# --- L2: an ended job's session, whatever else is in it ------------------------------------------


def test_a_zombie_is_found_whatever_else_its_session_has_on_the_cards(box, job_on, watchdog):
    """The session's oldest process decides: one younger than the job's end beside the real
    leftover no longer hides the job (and makes the leftover alice's own, never stopped)."""
    policy("zombie", "stop", grace=0)
    job = job_on([0], None, 888_888, status=Job.Status.FAILED)
    end = job.finished_at.timestamp()
    new = ProcessInfo(
        pid=888_891,
        username="alice",
        command="python",
        used_memory_mb=10,
        session_id=888_888,
        started=end + 100,
    )
    old = replace(new, pid=888_890, used_memory_mb=9000, started=end - 100)
    verdicts = watchdog.round(on_card(0, new, old), now=timezone.now())
    assert {v.process.pid: v.kind.value for v in verdicts}[888_890] == "zombie"


# --- L5: a booking's last seconds ----------------------------------------------------------------


def test_an_ended_booking_holds_its_cards_for_the_whole_stop(settings):
    settings.JOB_KILL_GRACE_SECONDS, settings.WATCHDOG_INTERVAL_SECONDS = 7, 3
    assert ended_booking_grace() == timedelta(seconds=CANCEL_POLL_SECONDS + 7 + STOP_CONFIRM_SECONDS + 3)
