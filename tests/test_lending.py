"""Lending idle bookings to the queue (issue 36, phase 2): a preemptible job placed on an idle
booking's cards, and the owner taking them back (their job, `gpu exec`, their process on the card,
*Take it back*). The services and the scheduler's pass, called directly."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from gpus import idle as gpus_idle
from gpus.booking import reservation_cancel, reservation_create, reservation_extend, reservation_release
from gpus.idle import idle_check
from gpus.inventory import GPUInfo, ProcessInfo
from gpus.models import Reservation, Server
from gpus.services import servers_report_ingest
from jobs.host import runner
from jobs.host.launch import job_claim
from jobs.host.pickup import slots_report
from jobs.host.runner import job_run
from jobs.host.spool import EndRecord
from jobs.lending import lendable, lent_words, loan_take_back, loans_expire, loans_watch
from jobs.logs.store import LogWriter
from jobs.models import Job
from jobs.queue.scheduler import queue_plan, schedule_pass
from jobs.runs import job_end_record
from jobs.services import job_cancel, jobs_reconcile
from jobs.sessions.services import session_start
from jobs.submit import ScriptUpload, job_submit
from portal.models import AuditEntry, Team
from tests.factories import MembershipFactory, UserFactory, make_snapshot, queue_job
from tests.job_helpers import job_log

pytestmark = pytest.mark.django_db


@pytest.fixture
def carol(team):
    """Another member, who books the rest of the server."""
    return MembershipFactory(team=team, user=UserFactory(username="carol")).user


@pytest.fixture
def idle_booking(alice, carol, box, settings):
    """alice's booking of card 0, idle for 20 minutes (LEND_AFTER_MINUTES 15); carol holds the rest.
    The last telemetry round shows no process on box1's cards."""
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=0)])
    reservation_create(user=carol, gpus=[g.uuid for g in box[1:]], end=timezone.now() + timedelta(hours=8))
    booking = reservation_create(user=alice, gpus=[box[0].uuid], end=timezone.now() + timedelta(hours=8))
    Reservation.objects.filter(pk=booking.pk).update(idle_since=timezone.now() - timedelta(minutes=20))
    booking.refresh_from_db()
    return booking


def _lent_job(bob, sent) -> Job:
    job = queue_job(bob, minutes=60, preemptible=True)
    done = schedule_pass()
    job.refresh_from_db()
    assert done.get("lent") == 1 and job.status == Job.Status.QUEUED, (done, job.pending_reason)
    return job


def _taken(job: Job) -> Job:
    """The borrower as its host's worker took it: running there. Such a job is asked to leave (a
    job no worker took yet goes back to the queue at once)."""
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=4242, started_at=timezone.now())
    job.refresh_from_db()
    return job


def test_a_preemptible_job_runs_on_a_booking_idle_long_enough(idle_booking, bob, sent):
    ordinary = queue_job(bob, minutes=60)
    job = _lent_job(bob, sent)
    loan = job.reservation
    assert (
        loan.lent_from == idle_booking
        and loan.owner == bob
        and job.gpu_uuids == [idle_booking.allocations.get().gpu_id]
    )
    assert loan.end <= idle_booking.end
    ordinary.refresh_from_db()
    assert ordinary.status == Job.Status.PENDING  # an ordinary job never borrows
    assert job.dispatched_at is not None  # sent to its host once this commits
    assert lent_words(idle_booking).startswith("lent to the queue since ")
    assert f"job {job.pk}; it leaves as soon as you start something" in lent_words(idle_booking)
    assert not lendable(timezone.now())  # one loan per booking


@pytest.mark.parametrize(
    "why", ["not idle long enough", "the team lends nothing", "the booking ends too soon", "a job of its own"]
)
def test_nothing_is_lent_when_it_should_not_be(idle_booking, alice, bob, team, sent, why):
    if why == "not idle long enough":
        Reservation.objects.filter(pk=idle_booking.pk).update(
            idle_since=timezone.now() - timedelta(minutes=5)
        )
    elif why == "the team lends nothing":
        Team.objects.filter(pk=team.pk).update(lend_idle=False)
    elif why == "a job of its own":
        job_submit(user=alice, reservation=idle_booking, script=ScriptUpload("mine.py", b"1\n"))
    elif why == "the booking ends too soon":  # LOAN_MIN_MINUTES: less than a loan is worth
        Reservation.objects.filter(pk=idle_booking.pk).update(end=timezone.now() + timedelta(minutes=25))
    job = queue_job(bob, minutes=60, preemptible=True)
    assert "lent" not in schedule_pass()
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING


def test_a_longer_job_borrows_until_the_booking_ends_and_leaves_before_it(idle_booking, bob, sent, settings):
    settings.LEND_GRACE_SECONDS = 20
    job = queue_job(bob, minutes=60 * 9, preemptible=True)  # the booking ends in 8 hours
    assert schedule_pass().get("lent") == 1
    job.refresh_from_db()
    assert job.reservation.end == idle_booking.end  # never beyond what it borrows
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=4242, started_at=timezone.now())
    assert loans_expire(idle_booking.end - timedelta(seconds=36)) == []  # not yet
    assert loans_expire(idle_booking.end - timedelta(seconds=35)) == [job.pk]  # grace and margin
    job.refresh_from_db()
    assert job.preempt_grace_seconds == 20 and job.preempt_reason.startswith(
        f"its loan of booking {idle_booking.pk} ends at "
    )
    assert loans_expire(idle_booking.end - timedelta(seconds=30)) == []  # asked once


def _borrowing_longer(idle_booking, bob) -> Job:
    job = queue_job(bob, minutes=60 * 9, preemptible=True)  # the booking ends in 8 hours
    assert schedule_pass().get("lent") == 1
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=4242, started_at=timezone.now())
    job.refresh_from_db()
    return job


def test_a_booking_extended_while_lent_still_sends_its_borrower_away_before_the_loan_ends(
    idle_booking, alice, bob, sent
):
    """The owner may extend a lent booking (the loan is beside it, within its old end); the loan
    still ends there, so its borrower leaves before it, back to the queue, never timed out."""
    job = _borrowing_longer(idle_booking, bob)
    reservation_extend(user=alice, reservation=idle_booking, end=idle_booking.end + timedelta(hours=1))
    assert loans_expire(job.reservation.end - timedelta(seconds=36)) == []
    assert loans_expire(job.reservation.end - timedelta(seconds=35)) == [job.pk]


@pytest.mark.parametrize("how", ["released", "cancelled"])
def test_a_booking_given_up_while_lent_still_sends_its_borrower_away_before_the_loan_ends(
    idle_booking, alice, bob, leader, sent, how
):
    """The loan runs on to its end on cards nobody else booked; its borrower then leaves for the
    queue with its checkpoint, rather than time out at an end its time limit never set."""
    job = _borrowing_longer(idle_booking, bob)
    if how == "released":
        reservation_release(user=alice, reservation=idle_booking)
    else:
        reservation_cancel(user=leader, reservation=idle_booking, reason="the card is needed")
    assert loans_expire(job.reservation.end - timedelta(seconds=35)) == [job.pk]


def test_a_job_whose_loan_ends_before_the_booking_is_left_to_its_time_limit(idle_booking, bob, sent):
    job = _lent_job(bob, sent)  # 60 minutes, in a booking of 8 hours
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=4242, started_at=timezone.now())
    assert loans_expire(job.reservation.end - timedelta(seconds=5)) == []


def test_the_owners_job_on_the_booking_sends_the_borrower_away(idle_booking, alice, bob, sent, settings):
    settings.LEND_GRACE_SECONDS = 7
    job = _taken(_lent_job(bob, sent))
    job_submit(user=alice, reservation=idle_booking, script=ScriptUpload("mine.py", b"1\n"))
    job.refresh_from_db()
    assert job.preempt_requested_at is not None and job.preempt_grace_seconds == 7
    assert job.preempt_reason == f"alice started job {job.pk + 1} on it"


def _leaves(job: Job) -> None:
    """What the borrower's supervisor records once its process is gone (jobs/host/runner.py)."""
    record = EndRecord(
        status=Job.Status.PENDING,
        exit_code=-15,
        message="Preempted: x.",
        finished_at=timezone.now().isoformat(),
    )
    assert job_end_record(job.pk, LogWriter(job.pk), record)


def test_the_owners_job_starts_only_once_the_borrower_has_left(
    idle_booking, alice, bob, sent, monkeypatch, django_capture_on_commit_callbacks
):
    woken: list[str] = []
    monkeypatch.setattr("portal.wakeups.wake", woken.append)
    job = _lent_job(bob, sent)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=4242, started_at=timezone.now())
    mine = job_submit(user=alice, reservation=idle_booking, script=ScriptUpload("mine.py", b"1\n"))
    mine.refresh_from_db()
    # The borrower has its grace to leave: the owner's job is not sent to share the card with it.
    assert mine.status == Job.Status.QUEUED and mine.dispatched_at is None
    assert jobs_reconcile()["dispatched"] == 0 and "sent" not in schedule_pass()

    with django_capture_on_commit_callbacks(execute=True):
        _leaves(job)
    assert "queue" in woken  # its leaving wakes the scheduler, whose pass sends the owner's job
    assert schedule_pass()["sent"] == 1
    mine.refresh_from_db()
    assert mine.dispatched_at is not None


def test_a_borrower_whose_worker_was_lost_holds_the_owners_job_no_longer(
    idle_booking, alice, bob, sent, settings
):
    """Its worker gone, the borrower never leaves by itself: the reconciler marks it lost after
    JOB_LOST_AFTER_SECONDS, and that pass sends the owner's job. The owner's wait is bounded."""
    job = _lent_job(bob, sent)
    long_ago = timezone.now() - timedelta(seconds=settings.JOB_LOST_AFTER_SECONDS + 60)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=4242, heartbeat_at=long_ago)
    mine = job_submit(user=alice, reservation=idle_booking, script=ScriptUpload("mine.py", b"1\n"))
    assert Job.objects.get(pk=mine.pk).dispatched_at is None
    done = jobs_reconcile()
    assert done["lost"] == 1 and "sent" in schedule_pass()
    mine.refresh_from_db()
    assert mine.dispatched_at is not None


def test_a_borrower_that_cannot_be_made_to_leave_holds_the_owners_job_for_its_grace_alone(
    idle_booking, alice, bob, sent, settings
):
    """Its supervisor may not signal it (no CAP_KILL): it runs on, its row says running. The owner
    comes first: once its grace and a margin have passed, the owner's job goes all the same."""
    settings.LEND_GRACE_SECONDS = 20
    job = _lent_job(bob, sent)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=4242, started_at=timezone.now())
    mine = job_submit(user=alice, reservation=idle_booking, script=ScriptUpload("mine.py", b"1\n"))
    asked = Job.objects.get(pk=job.pk).preempt_requested_at
    assert "sent" not in schedule_pass(now=asked + timedelta(seconds=20 + 29))
    assert schedule_pass(now=asked + timedelta(seconds=20 + 31))["sent"] == 1
    mine.refresh_from_db()
    assert mine.dispatched_at is not None


@pytest.mark.parametrize("sent_yet", [True, False])
def test_the_owners_job_goes_at_once_when_no_worker_took_the_borrower_yet(
    idle_booking, alice, bob, sent, sent_yet
):
    """Sent to its host or not, a borrower no worker has taken has no process: it goes back to the
    queue at once, and its message, should it come, finds it gone (jobs.host.launch.job_claim)."""
    job = _lent_job(bob, sent)
    if not sent_yet:
        Job.objects.filter(pk=job.pk).update(dispatched_at=None)  # as after a send that failed
    mine = job_submit(user=alice, reservation=idle_booking, script=ScriptUpload("mine.py", b"1\n"))
    job.refresh_from_db()
    mine.refresh_from_db()
    assert job.status == Job.Status.PENDING and job.preemptions == 1  # put back, never started
    assert job.dispatched_at is None and job.reservation is None and not job.server_id
    assert (
        job.message
        == f"Preempted: alice started job {mine.pk} on it. It goes back to the queue at its old place."
    )
    assert mine.dispatched_at is not None
    assert job_claim(job.pk) is None  # the borrower's message, late: nothing runs


def test_a_borrower_no_worker_took_before_its_loan_ended_goes_back_to_the_queue(idle_booking, bob, sent):
    """Its host's worker was busy or away until the loan was over: the reconciler puts it back in
    the queue, as a running borrower would go at that end, never cancelled for it."""
    job = _lent_job(bob, sent)
    assert jobs_reconcile(now=job.reservation.end + timedelta(seconds=1))["expired"] == 0  # none cancelled
    job.refresh_from_db()
    expect = "Preempted: its booking ended at "
    assert job.status == Job.Status.PENDING and job.preemptions == 1 and job.message.startswith(expect)
    assert job.message.endswith("before a worker started it. It goes back to the queue at its old place.")
    assert expect in job_log(job.pk)
    assert job_claim(job.pk) is None  # its message, late


@pytest.mark.parametrize("who", ["bob", "leader"])
def test_a_preemptible_job_whose_booking_a_person_ended_before_it_started_is_cancelled(
    idle_booking, bob, leader, sent, who
):
    """Released by its owner, or cancelled by a leader: cancelled, saying who, as a running one
    is (the supervisor's rule); going back to the queue would undo what they did."""
    job = _lent_job(bob, sent)
    if who == "bob":
        reservation_release(user=bob, reservation=job.reservation)
    else:
        reservation_cancel(user=leader, reservation=job.reservation, reason="maintenance")
    assert jobs_reconcile()["expired"] == 1
    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED and job.message.startswith(f"Cancelled: {who} ")


def test_a_borrower_claimed_after_its_loan_ended_goes_back_to_the_queue(idle_booking, bob, sent):
    """Its worker took it just after the loan's end, before the reconciler came: back to the
    queue too, not started, not cancelled."""
    job = _lent_job(bob, sent)
    now = timezone.now()
    Reservation.objects.filter(pk=job.reservation_id).update(start=now - timedelta(hours=1), end=now)
    assert job_run(job.pk) == Job.Status.PENDING
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING and job.preemptions == 1 and not job.worker
    assert (
        job.message.startswith("Preempted: its booking ended at ")
        and "before a worker started it" in job.message
    )


def test_a_cancel_between_a_late_claim_and_its_check_is_kept(idle_booking, bob, sent, monkeypatch):
    """Its owner cancelled it just as its worker took it, after its loan ended: cancelled, never
    put back in the queue to be booked and sent again."""
    job = _lent_job(bob, sent)
    now = timezone.now()
    Reservation.objects.filter(pk=job.reservation_id).update(start=now - timedelta(hours=1), end=now)
    claim = runner.job_claim

    def claim_then_cancel(pk: int) -> Job | None:
        claimed = claim(pk)
        job_cancel(user=bob, job=Job.objects.get(pk=pk))
        return claimed

    monkeypatch.setattr(runner, "job_claim", claim_then_cancel)
    assert job_run(job.pk) == Job.Status.CANCELLED
    job.refresh_from_db()
    assert (job.status, job.message) == (Job.Status.CANCELLED, "Cancelled by bob.")


def test_a_card_taken_back_by_its_owners_process_is_not_lent_again(idle_booking, bob, box, sent):
    job = _lent_job(bob, sent)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=4242, started_at=timezone.now())
    owners = make_snapshot("box1", gpus=4, processes=1)  # alice's process on every card, box1's too
    servers_report_ingest(snapshots=[owners])
    job.refresh_from_db()
    assert job.preempt_requested_at is not None
    _leaves(job)
    # Her return ended the idle stretch at once; the idle round has not come.
    assert Reservation.objects.get(pk=idle_booking.pk).idle_since is None
    assert "lent" not in schedule_pass()
    job.refresh_from_db()
    assert job.status == Job.Status.PENDING


@pytest.mark.parametrize("how", ["take it back", "a brief process of hers"])
def test_a_booking_taken_back_is_not_lent_again_before_a_new_idle_stretch(
    idle_booking, alice, bob, sent, settings, how
):
    """Taken back before its borrower ran, or by a process of hers that ended before any round saw
    it: the next pass does not lend the cards again at once, only after LEND_AFTER_MINUTES of a
    new idle stretch."""
    job = _lent_job(bob, sent)
    if how == "take it back":
        owner = Client()
        owner.force_login(alice)
        owner.post(f"/reservations/{idle_booking.pk}/take-back/")
    else:
        servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=1)])
        servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=0)])  # gone again
    assert Job.objects.get(pk=job.pk).status == Job.Status.PENDING
    assert "lent" not in schedule_pass()
    assert Job.objects.get(pk=job.pk).status == Job.Status.PENDING
    assert Reservation.objects.get(pk=idle_booking.pk).idle_since is None  # a new stretch to come
    # Once the idle rounds have seen a new stretch long enough, it is lent again.
    stretch = timezone.now() - timedelta(minutes=settings.LEND_AFTER_MINUTES + 1)
    Reservation.objects.filter(pk=idle_booking.pk).update(idle_since=stretch)
    assert schedule_pass().get("lent") == 1


def test_loans_keep_an_arrays_limit_of_tasks_at_once(alice, bob, carol, box, sent):
    """An array limited to one task at a time borrows one idle booking, not one per task."""
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=0)])
    end = timezone.now() + timedelta(hours=8)
    for owner, card in ((alice, box[0]), (carol, box[1])):
        booking = reservation_create(user=owner, gpus=[card.uuid], end=end)
        Reservation.objects.filter(pk=booking.pk).update(idle_since=timezone.now() - timedelta(minutes=20))
    reservation_create(user=carol, gpus=[g.uuid for g in box[2:]], end=end)
    first = queue_job(bob, minutes=60, preemptible=True, array="0-3%1")
    preview = queue_plan(expected=True)
    assert sum(1 for e in preview if e.basis == "lending") == 1  # the Queue page shows one starting
    assert schedule_pass().get("lent") == 1
    assert Job.objects.filter(array_id=first.array_id, status__in=Job.ON_CARDS).count() == 1


def test_the_owners_gpu_exec_sends_the_borrower_away(idle_booking, alice, bob, sent):
    job = _taken(_lent_job(bob, sent))
    session_start(
        user=alice, reservation=idle_booking.pk, kind="exec", host="box1", command=["python", "x.py"]
    )
    job.refresh_from_db()
    assert job.preempt_requested_at is not None and "alice started gpu exec on it" in job.preempt_reason


def _card(uuid: str, *processes: ProcessInfo) -> GPUInfo:
    return GPUInfo(
        uuid=uuid, index=0, name="card", pci_bus_id="0", memory_total_mb=24576, memory_reserved_mb=300,
        memory_used_mb=0, utilization_pct=0, temperature_c=30, power_w=50, power_limit_w=300,
        mig_mode="disabled", processes=processes,
    )  # fmt: skip


def test_the_owners_first_process_on_the_card_sends_the_borrower_away(idle_booking, bob, sent):
    job = _taken(_lent_job(bob, sent))
    uuid = job.gpu_uuids[0]
    borrowers = ProcessInfo(pid=10, username="bob", command="python fit.py", job_id=job.pk)
    assert loans_watch([_card(uuid, borrowers)]) == []  # its own processes: nothing happens
    owners = ProcessInfo(pid=11, username="alice", command="python mine.py")
    assert loans_watch([_card(uuid, borrowers, owners)]) == [job.pk]
    job.refresh_from_db()
    assert "started using it (process 11 on its card)" in job.preempt_reason


def test_another_persons_process_on_a_lent_card_does_not_send_the_borrower_away(
    idle_booking, bob, carol, sent
):
    """Only the owner comes first: anyone else's process there is an intruder (the watchdog's),
    never a way to push a borrower off a card; a process whose account is unknown may be the
    owner's, so it still does."""
    job = _taken(_lent_job(bob, sent))
    uuid = job.gpu_uuids[0]
    borrowers = ProcessInfo(pid=10, username="bob", command="python fit.py", job_id=job.pk)
    carols = ProcessInfo(pid=12, username="carol", command="python hers.py")
    assert loans_watch([_card(uuid, borrowers, carols)]) == []
    job.refresh_from_db()
    assert job.preempt_requested_at is None
    unknown = ProcessInfo(pid=13, username="?", command="python")
    assert loans_watch([_card(uuid, borrowers, carols, unknown)]) == [job.pk]
    job.refresh_from_db()
    assert "started using it (process 13 on its card)" in job.preempt_reason


@pytest.mark.parametrize("running", [True, False])
def test_take_it_back_on_the_booking_page(idle_booking, alice, bob, sent, running):
    job = _lent_job(bob, sent)
    if running:
        job = _taken(job)
    outsider = Client()
    outsider.force_login(UserFactory(username="charlie"))
    assert outsider.post(f"/reservations/{idle_booking.pk}/take-back/").status_code == 404
    owner = Client()
    owner.force_login(alice)
    page = owner.get(f"/reservations/{idle_booking.pk}/").content.decode()
    assert "lent to the queue since" in page and "Take it back" in page
    response = owner.post(f"/reservations/{idle_booking.pk}/take-back/", follow=True)
    job.refresh_from_db()
    if running:
        assert (
            f"Taken back: job {job.pk} gets SIGTERM now and leaves within 20 s." in response.content.decode()
        )
        assert job.preempt_reason == f"alice took booking {idle_booking.pk} back"
    else:
        said = f"Taken back: job {job.pk} had not started and went back to the queue."
        assert said in response.content.decode()
        assert job.status == Job.Status.PENDING and job.message.startswith(
            f"Preempted: alice took booking {idle_booking.pk} back."
        )


def test_leaders_turn_lending_off_for_their_team(team, leader, alice):
    api = APIClient()
    api.force_authenticate(alice)
    assert api.patch(f"/api/v1/teams/{team.slug}/", {"lend_idle": False}, format="json").status_code == 403
    api.force_authenticate(leader)
    response = api.patch(f"/api/v1/teams/{team.slug}/", {"lend_idle": False}, format="json")
    assert response.status_code == 200 and response.json()["lend_idle"] is False
    assert Team.objects.get(pk=team.pk).lend_idle is False
    assert AuditEntry.objects.filter(action=AuditEntry.Action.TEAM_LEND_IDLE).count() == 1


def test_the_dashboard_card_says_when_it_was_lent_and_to_which_job(alice, bob, box, client):
    now = timezone.now()
    booking = reservation_create(
        user=alice,
        gpus=[box[0].uuid],
        start=now - 2 * timedelta(hours=1),
        end=now + timedelta(hours=1),
        now=now - 2 * timedelta(hours=1),
    )
    loan = reservation_create(
        user=bob,
        gpus=[box[0].uuid],
        start=now - timedelta(hours=1),
        end=now + timedelta(minutes=30),
        now=now - timedelta(hours=1),
        lent_from=booking,
    )
    job = queue_job(bob, preemptible=True)
    Job.objects.filter(pk=job.pk).update(
        status=Job.Status.RUNNING, reservation=loan, started_at=now - timedelta(hours=1)
    )
    words = f"lent to the queue since {timezone.localtime(loan.start):%H:%M}: job {job.pk}"
    client.force_login(alice)
    page = client.get("/dashboard/servers/").content.decode()  # the dashboard's live part
    assert f'<div class="lent">{words}</div>' in page
    assert page.count("whole card · until") == 1  # the loan is not a second holder
    api = APIClient()
    api.force_authenticate(alice)
    gpus = api.get("/api/v1/gpus/").json()  # not paginated
    (row,) = next(g for g in gpus if g["uuid"] == box[0].uuid)["booked"]
    assert row["lent"] == words and row["who"] == "you"


# --- found by a review (2026-11-30) ------------------------------------------------------------------


def test_an_owners_job_committed_between_the_read_and_the_loan_is_never_sent_beside_a_borrower(
    idle_booking, alice, bob, sent, monkeypatch
):
    """The pass read the booking as lendable; the owner's job committed before its loan did. The
    loan now checks again under the booking's lock, as the owner's start takes the same lock."""
    import jobs.lending as lending

    real, mine = lending.lendable, {}

    def read_then_the_owner_submits(now):  # type: ignore[no-untyped-def]
        found = real(now)
        mine["job"] = job_submit(user=alice, reservation=idle_booking, script=ScriptUpload("mine.py", b"1\n"))
        return found

    monkeypatch.setattr(lending, "lendable", read_then_the_owner_submits)
    borrower = queue_job(bob, minutes=60, preemptible=True)
    done = schedule_pass()
    borrower.refresh_from_db()
    assert not done.get("lent") and borrower.status == Job.Status.PENDING, done
    assert Job.objects.get(pk=mine["job"].pk).dispatched_at is not None  # the owner's, at once
    assert not Reservation.objects.filter(lent_from=idle_booking).exists()


def test_a_share_holders_own_job_under_a_service_account_does_not_push_the_borrower_off(
    alice, bob, carol, box, sent
):
    """Jobs under JOB_USER=gpujob all run as one account nobody is: the process's job names whose
    it is. carol's job on her share of the card is hers, not alice's coming back."""
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=0)])
    card, end = box[0].uuid, timezone.now() + timedelta(hours=8)
    reservation_create(user=carol, gpus=[g.uuid for g in box[1:]], end=end)
    alices = reservation_create(user=alice, gpus=[card], memory_mb=8000, end=end)
    carols = reservation_create(user=carol, gpus=[card], memory_mb=8000, end=end)
    Reservation.objects.filter(pk=alices.pk).update(idle_since=timezone.now() - timedelta(minutes=20))
    borrower = queue_job(bob, minutes=60, preemptible=True, memory_mb=8000)
    assert schedule_pass().get("lent") == 1
    borrower.refresh_from_db()
    assert borrower.reservation.lent_from_id == alices.pk
    carols_job = job_submit(user=carol, reservation=carols, script=ScriptUpload("c.py", b"1\n"))
    alices_job = Job.objects.create(owner=alice, team=alices.team, name="a.py", status=Job.Status.SUCCEEDED)

    def card_with(*processes: ProcessInfo) -> GPUInfo:
        return GPUInfo(
            uuid=card, index=0, name="card", pci_bus_id="0", memory_total_mb=24576, memory_reserved_mb=300,
            memory_used_mb=0, utilization_pct=0, temperature_c=30, power_w=50, power_limit_w=300,
            mig_mode="disabled", processes=processes,
        )  # fmt: skip

    theirs = ProcessInfo(pid=10, username="gpujob", command="python fit.py", job_id=borrower.pk)
    carols = ProcessInfo(pid=20, username="gpujob", command="python c.py", job_id=carols_job.pk)
    assert loans_watch([card_with(theirs, carols)]) == []
    # alice's own job's process under the same account is alice's: she is back.
    alices = ProcessInfo(pid=30, username="gpujob", command="python a.py", job_id=alices_job.pk)
    assert loans_watch([card_with(theirs, carols, alices)]) == [borrower.pk]


@pytest.mark.parametrize("worker", ["silent", "full", "draining"])
def test_no_loan_on_a_server_whose_worker_is_silent_full_or_draining(idle_booking, bob, sent, worker):
    """A loan is a start like any: the plan starts nothing where the worker has not said lately
    how many jobs it runs, or has none free, or on a draining server (docs/queue.md)."""
    if worker == "silent":
        Server.objects.filter(name="box1").update(job_slots_at=timezone.now() - timedelta(days=1))
    elif worker == "full":
        slots_report("box1", slots=0, now=timezone.now())
    else:
        Server.objects.filter(name="box1").update(draining=True)
    borrower = queue_job(bob, minutes=60, preemptible=True)
    done = schedule_pass()
    borrower.refresh_from_db()
    assert not done.get("lent") and borrower.status == Job.Status.PENDING, done
    assert not lendable_now_shown(borrower)
    Server.objects.filter(name="box1").update(draining=False)
    slots_report("box1", slots=2, now=timezone.now())
    assert schedule_pass().get("lent") == 1


def lendable_now_shown(job: Job) -> bool:
    """Whether the Queue page shows the job starting now on a lent booking."""
    return any(e.request.job_id == job.pk and e.basis == "lending" for e in queue_plan(expected=True))


def _lent_unused(alice, bob, carol, box, team, *, started: timedelta, counted: timedelta) -> tuple:  # type: ignore[no-untyped-def]
    """alice's booking of card 0, unused and idle since its start `started` ago (its clock last
    counted `counted` ago), in a team that releases idle bookings, lent to bob's preemptible job;
    carol holds the other cards. (booking, the borrower)."""
    Team.objects.filter(pk=team.pk).update(auto_release_idle=True)
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=0, util=0)])
    now = timezone.now()
    then = now - started
    reservation_create(user=carol, gpus=[g.uuid for g in box[1:]], end=now + timedelta(hours=8))
    booking = reservation_create(
        user=alice, gpus=[box[0].uuid], start=then, end=now + timedelta(hours=8), now=then
    )
    Reservation.objects.filter(pk=booking.pk).update(idle_since=then, idle_counted_until=now - counted)
    borrower = queue_job(bob, minutes=60, preemptible=True)
    assert schedule_pass().get("lent") == 1
    return booking, borrower


def test_an_owner_back_while_the_borrower_leaves_is_no_no_show(alice, bob, carol, box, team, sent):
    """The idle round takes a lent booking's cards for the borrower's: an owner whose process
    came in the last seconds before the no-show verdict, the borrower still in its grace, was
    judged a no-show and released under them. Their coming back is their use."""
    now = timezone.now()
    booking, borrower = _lent_unused(
        alice, bob, carol, box, team, started=timedelta(minutes=29, seconds=50), counted=timedelta(seconds=30)
    )
    Job.objects.filter(pk=borrower.pk).update(status=Job.Status.RUNNING, pid=4242, started_at=now)
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=1)])  # alice's process
    borrower.refresh_from_db()
    assert borrower.preempt_requested_at is not None
    done = idle_check(now=now + timedelta(seconds=15))  # the borrower still in its grace
    booking.refresh_from_db()
    assert (booking.no_show_at, booking.released_at, done.no_shows) == (None, None, [])
    assert booking.used_at is not None


@pytest.mark.parametrize("started_minutes_ago", [20, 40])
def test_an_idle_round_racing_a_take_back_keeps_what_the_take_back_wrote(
    alice, bob, carol, box, team, sent, monkeypatch, started_minutes_ago
):
    """*Take it back* commits between the idle round's read and its write: the round does not put
    back the idle stretch it read (the next pass lent the cards again at once), nor the owner's
    use it did not see (a booking started 40 minutes ago was judged a no-show and released)."""
    now = timezone.now()
    started = timedelta(minutes=started_minutes_ago)
    booking, job = _lent_unused(alice, bob, carol, box, team, started=started, counted=timedelta(minutes=2))
    read = gpus_idle.lent_now

    def take_back_meanwhile(bookings, at):  # type: ignore[no-untyped-def]
        found = read(bookings, at)
        loan_take_back(user=alice, booking=booking)
        return found

    monkeypatch.setattr(gpus_idle, "lent_now", take_back_meanwhile)
    done = idle_check(now=now)
    monkeypatch.undo()
    booking.refresh_from_db()
    assert booking.idle_since is None and booking.used_at is not None
    assert booking.no_show_at is None and booking.released_at is None and not done.no_shows
    assert Job.objects.get(pk=job.pk).status == Job.Status.PENDING
    assert "lent" not in schedule_pass()


def test_the_queue_page_shows_no_loan_for_the_last_slot_the_pass_starts_a_job_in(
    alice, bob, carol, box, sent
):
    """One free job slot on box1: the pass starts the ordinary job there first and lends nothing,
    so the page does not show the preemptible job starting on the idle booking as well."""
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=0)])
    slots_report("box1", slots=1, now=timezone.now())
    end = timezone.now() + timedelta(hours=8)
    reservation_create(user=carol, gpus=[box[1].uuid, box[2].uuid], end=end)
    idle = reservation_create(user=alice, gpus=[box[0].uuid], end=end)
    Reservation.objects.filter(pk=idle.pk).update(idle_since=timezone.now() - timedelta(minutes=20))
    ordinary = queue_job(bob, minutes=60)
    borrower = queue_job(bob, minutes=60, preemptible=True)
    shown = {e.request.job_id: e for e in queue_plan(expected=True)}
    assert shown[ordinary.pk].start_now and shown[borrower.pk].basis != "lending"
    assert "lent" not in schedule_pass()
    assert Job.objects.get(pk=borrower.pk).status == Job.Status.PENDING
