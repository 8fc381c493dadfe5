"""/metrics' lending counters run from the first loan ever made (jobs/lending_report.py): the loans a
day past their end are settled into LendingTotal by beat, hourly, and a scrape reads those few rows
and the loans since. The counters are the same whether a loan is settled or not, never go down
across a settle, and a loan whose run has not ended waits, with every loan after it."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import Reservation
from jobs import lending_report
from jobs.lending_report import SETTLE_AFTER, lending_hours, lending_settle, lending_totals
from jobs.models import Job, LendingSettle, LendingTotal
from jobs.tasks import settle_lending
from tests.factories import queue_job
from tests.test_lending_race import _both_at_once
from tests.test_prometheus_metrics import TOKEN, scrape

H = timedelta(hours=1)


@pytest.fixture(autouse=True)
def _token(settings, sent) -> None:
    settings.METRICS_TOKEN = TOKEN


def lend(owner, borrower, cards, start: datetime, *, ran: timedelta | None = timedelta(minutes=90)):  # type: ignore[no-untyped-def]
    """`owner`'s booking of `cards` from an hour before `start`, lent at `start` for 2 h to a job of
    `borrower`'s that ran `ran` of it (None: still running, its last beat at the loan's end)."""
    booking = reservation_create(
        user=owner, gpus=[g.uuid for g in cards], start=start - H, end=start + 4 * H, now=start - H
    )
    loan = reservation_create(
        user=borrower,
        gpus=[g.uuid for g in cards],
        start=start,
        end=start + 2 * H,
        now=start,
        lent_from=booking,
    )
    job = queue_job(borrower, gpus=len(cards), minutes=120, preemptible=True)
    if ran is None:
        Job.objects.filter(pk=job.pk).update(
            status=Job.Status.RUNNING, reservation=loan, started_at=start, heartbeat_at=start + 2 * H
        )
    else:
        Job.objects.filter(pk=job.pk).update(
            status=Job.Status.SUCCEEDED, reservation=loan, started_at=start, finished_at=start + ran
        )
    return loan


def counters() -> tuple[float, float]:
    families = scrape()
    lent, used = families["gpu_portal_lent_gpu_seconds"], families["gpu_portal_lent_used_gpu_seconds"]
    return sum(s.value for s in lent), sum(s.value for s in used)


@pytest.mark.django_db
def test_a_settled_loan_counts_the_same_and_is_no_longer_read(alice, bob, box):
    now = timezone.now()
    lend(alice, bob, box[:2], now - SETTLE_AFTER - 4 * H)  # ended more than a day ago
    recent = lend(alice, bob, box[2:3], now - 3 * H, ran=H)  # ended an hour ago
    before = lending_hours(until=now)
    assert before == lending_totals(now)
    assert counters() == (6 * 3600, 4 * 3600)  # 2 cards × 2 h + 1 card × 2 h; 2 × 1.5 h + 1 h

    assert lending_settle(now) == 1
    assert lending_settle(now) == 0  # again: nothing folded twice
    assert lending_totals(now) == before
    assert counters() == (6 * 3600, 4 * 3600)
    head = LendingSettle.objects.get()
    assert head.through == now - SETTLE_AFTER
    assert LendingTotal.objects.get().used_ms == 3 * 3600 * 1000

    # The settled loan is read from its total: a change to its rows no longer reaches the scrape,
    # while the loan of an hour ago is still read as it stands.
    Job.objects.filter(reservation__lent_from__isnull=False, reservation__end__lte=head.through).update(
        finished_at=now - SETTLE_AFTER - 4 * H + timedelta(minutes=30)
    )
    Job.objects.filter(reservation=recent).update(finished_at=recent.start + 2 * H)
    assert counters() == (6 * 3600, 5 * 3600)

    # A day on, the loan of an hour ago is settled too, with its figures as they stand then.
    later = now + SETTLE_AFTER
    assert lending_settle(later) == 1
    assert [(r.lent, r.used) for r in lending_totals(later)] == [(6.0, 5.0)]


@pytest.mark.django_db
def test_a_loan_whose_run_has_not_ended_waits_and_so_do_the_loans_after_it(alice, bob, box):
    now = timezone.now()
    lend(alice, bob, box[:1], now - 5 * SETTLE_AFTER)
    stuck = lend(alice, bob, box[1:2], now - 4 * SETTLE_AFTER, ran=None)  # its host went silent
    lend(alice, bob, box[2:3], now - 3 * SETTLE_AFTER)
    before = lending_totals(now)

    assert lending_settle(now) == 1  # the first only
    assert LendingSettle.objects.get().through < stuck.end
    assert lending_totals(now) == before
    assert lending_settle(now) == 0

    # Marked lost, its end written: the next settle takes it and the loan after it.
    Job.objects.filter(reservation=stuck).update(status=Job.Status.LOST, finished_at=stuck.end + H)
    after = lending_totals(now)
    assert lending_settle(now) == 2
    assert lending_totals(now) == after
    assert LendingSettle.objects.get().through == now - SETTLE_AFTER


@pytest.mark.django_db
def test_a_settle_between_a_scrapes_two_reads_counts_each_loan_once(alice, bob, box, monkeypatch):
    """The scrape reads the totals, then the loans after their `through`: a settle that commits in
    between leaves its loans in the second read, so they count once, never twice or not at all."""
    now = timezone.now()
    lend(alice, bob, box[:2], now - 2 * SETTLE_AFTER)
    expected = lending_hours(until=now)
    real_held = lending_report._held
    settled: list[int] = []

    def held_after_a_settle(until):  # type: ignore[no-untyped-def]
        if not settled:
            monkeypatch.setattr(lending_report, "_held", real_held)
            settled.append(lending_settle(now))
        return real_held(until)

    monkeypatch.setattr(lending_report, "_held", held_after_a_settle)
    assert lending_totals(now) == expected
    assert settled == [1]
    assert lending_totals(now) == expected  # and read from the totals after it


@pytest.mark.django_db(transaction=True)
def test_two_settles_at_once_fold_each_loan_once(alice, bob, box):
    """Each with its own connection (PostgreSQL in CI): LendingSettle's row makes them take turns,
    and the second finds the loans already folded."""
    now = timezone.now()
    lend(alice, bob, box[:2], now - 3 * SETTLE_AFTER)
    lend(alice, bob, box[2:3], now - 2 * SETTLE_AFTER)
    expected = lending_totals(now)
    folded: list[int] = []
    _both_at_once(*[lambda: folded.append(lending_settle(now))] * 2)
    assert sorted(folded) == [0, 2]
    assert lending_totals(now) == expected
    assert LendingSettle.objects.count() == 1


@pytest.mark.django_db
def test_beat_settles_hourly_through_the_worker_task(alice, bob, box):
    assert settings.CELERY_BEAT_SCHEDULE["settle-lending"] == {
        "task": "jobs.tasks.settle_lending",
        "schedule": 3600.0,
    }
    lend(alice, bob, box[:1], timezone.now() - 2 * SETTLE_AFTER)
    assert settle_lending.apply().get() == 1
    assert settle_lending.name == "jobs.tasks.settle_lending"
    assert Reservation.objects.filter(lent_from__isnull=False).count() == 1
