"""A loan and the owner's return at the same instant, each in its own thread with its own
database connection (PostgreSQL in CI): the lent booking's row lock (gpus.booking.reservation_locked)
makes them take turns, so the owner never finds a borrower left on the card. Without it, the loan
re-checked the booking, the owner's job was submitted and saw no loan yet, and the loan was made
beside it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import Reservation
from gpus.services import servers_report_ingest
from jobs import lending
from jobs.models import Job
from jobs.queue.scheduler import schedule_pass
from jobs.submit import ScriptUpload, job_submit
from tests.factories import make_snapshot, queue_job

pytestmark = pytest.mark.django_db(transaction=True)
WIDEN_SECONDS = 0.2  # between the loan's re-check and its booking: the window a lock must close


def _both_at_once(*steps: Callable[[], object]) -> None:
    barrier = threading.Barrier(len(steps))
    failed: list[BaseException] = []

    def run(step: Callable[[], object]) -> None:
        try:
            connection.ensure_connection()  # connected first, so both start together
            barrier.wait(timeout=30)
            step()
        except BaseException as error:  # said by the test, not lost in a thread
            failed.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(step,)) for step in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failed, failed
    assert not any(t.is_alive() for t in threads), "a thread did not finish"


@pytest.mark.parametrize("head_start", ["the loan", "the owner"])
def test_a_loan_and_the_owners_job_at_once_never_leave_a_borrower_beside_the_owner(
    alice, bob, leader, box, sent, monkeypatch, head_start
):
    real = lending.reservation_create
    in_window = threading.Event()

    def slowly(**kwargs):  # type: ignore[no-untyped-def]
        in_window.set()
        time.sleep(WIDEN_SECONDS)  # the lent booking re-checked and locked, the loan not yet made
        return real(**kwargs)

    monkeypatch.setattr(lending, "reservation_create", slowly)
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=0)])
    end = timezone.now() + timedelta(hours=8)
    reservation_create(user=leader, gpus=[g.uuid for g in box[1:]], end=end)  # no free card
    booking = reservation_create(user=alice, gpus=[box[0].uuid], end=end)
    Reservation.objects.filter(pk=booking.pk).update(idle_since=timezone.now() - timedelta(minutes=20))
    borrower = queue_job(bob, minutes=60, preemptible=True)

    def owner() -> None:
        if head_start == "the loan":
            # Inside the loan's window, by its signal: a fixed head start lost the race on a
            # loaded machine (the pass had not reached the loan yet), and no loan was made.
            assert in_window.wait(timeout=30), "the pass never reached the loan"
        job_submit(user=alice, reservation=booking, script=ScriptUpload("mine.py", b"1\n"))

    def loan() -> None:
        if head_start == "the owner":
            time.sleep(0.01)
        schedule_pass()

    _both_at_once(owner, loan)
    borrower.refresh_from_db()
    mine = Job.objects.get(reservation=booking)
    # Either no loan was made (the owner's job came first), or it was and the owner's start sent
    # the borrower away: back to the queue, never left queued or running on the card.
    assert borrower.status == Job.Status.PENDING, (borrower.status, borrower.message)
    assert not Reservation.objects.loans_live(timezone.now()).filter(lent_from=booking).exists()
    assert mine.status == Job.Status.QUEUED and mine.dispatched_at is not None  # sent: the card is free
    if head_start == "the loan":  # the loan was made first, and undone by the owner's start
        assert borrower.preemptions == 1 and borrower.message.startswith("Preempted: alice started job")
