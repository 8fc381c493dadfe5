"""A second review's ways for /metrics' lending series to break or go down: two teams swapping slugs
between a scrape's reads gave one label set twice (Prometheus rejects such a scrape whole), and a
lost run's late "preempted" end took back use the counter had counted."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import lending_report
from jobs.lending_report import SETTLE_AFTER, lending_settle, lending_totals
from jobs.models import Job
from portal.models import Team
from tests.test_lending_totals import H, _token, lend  # noqa: F401 - the fixture
from tests.test_lending_totals_review import series, went_down


@pytest.mark.django_db
def test_two_teams_swapping_slugs_during_a_scrape_never_give_one_label_set_twice(
    alice, bob, charlie, box, team, monkeypatch
):
    """The settled rows' names are read in one statement, the loans' in a later one: two keys
    can end with the same (team, server) labels. Prometheus rejects such a scrape whole."""
    now = timezone.now()
    lend(alice, bob, box[:1], now - SETTLE_AFTER - 4 * H)  # vision-lab, settled below
    lend(charlie, bob, box[1:2], now - 3 * H)  # charlie's team, not yet settled
    assert lending_settle(now) == 1
    other = Team.objects.exclude(pk=team.pk).get(memberships__user=charlie)
    real_held = lending_report._held
    swapped: list[bool] = []

    def held_after_a_swap(until):  # type: ignore[no-untyped-def]
        if not swapped:  # the admin renames, each its own commit, between the scrape's reads
            Team.objects.filter(pk=team.pk).update(slug="vision-old")
            Team.objects.filter(pk=other.pk).update(slug="vision-lab")
            swapped.append(True)
        return real_held(until)

    monkeypatch.setattr(lending_report, "_held", held_after_a_swap)
    labels = Counter((r.team, r.server) for r in lending_totals(now))
    assert swapped
    assert all(n == 1 for n in labels.values()), labels


@pytest.mark.django_db
def test_a_lost_run_whose_late_end_comes_back_as_preempted_never_makes_used_go_down(alice, bob, box):
    """Pre-existing (not b80d66d): marked lost, its end (finished_at) is the marking; the worker's
    late end record (preempted, earlier than the marking) turns it into a LoanRun ending then."""
    from jobs.preemption import job_requeue
    from jobs.runs import UNFINISHED

    now = timezone.now()
    start = now - 3 * H
    loan = lend(alice, bob, box[:1], start, ran=None)
    job = Job.objects.get(reservation=loan)
    Job.objects.filter(pk=job.pk).update(
        status=Job.Status.LOST,
        heartbeat_at=start + 30 * timedelta(minutes=1),
        finished_at=start + 40 * timedelta(minutes=1),
    )
    before = series()
    assert job_requeue(
        job.pk, from_=UNFINISHED, message="Preempted", ended_at=start + 35 * timedelta(minutes=1)
    )
    after = series()
    assert not went_down(before, after), went_down(before, after)
