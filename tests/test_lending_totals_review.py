"""A review's ways for /metrics' lending counters to go down or count a run twice: a team or a
server renamed in the admin (the totals were kept by name, the loans since read by the new one),
and a run that left its loan between a settle's read of the jobs and of the LoanRuns."""

from __future__ import annotations

import pytest
from django.utils import timezone

from gpus.models import Server
from jobs.lending_report import SETTLE_AFTER, lending_settle
from portal.models import Team
from tests.test_lending_totals import H, _token, lend  # noqa: F401 - the fixture
from tests.test_prometheus_metrics import scrape


def series() -> dict[tuple[str, str, str], float]:
    families = scrape()
    return {
        (name, s.labels["team"], s.labels["server"]): s.value
        for name in ("gpu_portal_lent_gpu_seconds", "gpu_portal_lent_used_gpu_seconds")
        for s in families[name]
    }


def went_down(before: dict, after: dict) -> dict:
    return {k: (v, after[k]) for k, v in before.items() if k in after and after[k] < v}


@pytest.mark.django_db
def test_a_team_renamed_in_the_admin_never_makes_a_counter_go_down(alice, bob, box, team):
    now = timezone.now()
    lend(alice, bob, box[:1], now - SETTLE_AFTER - 4 * H)  # settled below
    lend(alice, bob, box[1:2], now - 3 * H)  # ended an hour ago: still read by the scrape
    assert lending_settle(now) == 1
    before = series()
    Team.objects.filter(pk=team.pk).update(slug="vision")  # TeamAdmin: slug is editable
    after = series()
    assert not went_down(before, after), went_down(before, after)


@pytest.mark.django_db
def test_a_server_renamed_in_the_admin_never_makes_a_counter_go_down(alice, bob, box):
    now = timezone.now()
    lend(alice, bob, box[:1], now - SETTLE_AFTER - 4 * H)
    lend(alice, bob, box[1:2], now - 3 * H)
    assert lending_settle(now) == 1
    before = series()
    Server.objects.filter(name="box1").update(name="box-one")  # ServerAdmin: name is editable
    after = series()
    assert not went_down(before, after), went_down(before, after)


@pytest.mark.django_db
def test_a_run_leaving_its_loan_while_a_settle_reads_is_not_folded_twice(alice, bob, box, monkeypatch):
    """A lost borrower's worker replays its end late (jobs.runs.job_end_record: an end as PENDING,
    from LOST, the job back to the queue, its run kept as a LoanRun) between the settle's read of
    the jobs and its read of the LoanRuns (READ COMMITTED: each statement its own snapshot). The
    run is read twice and frozen into the totals: the counter jumps and stays up."""
    from jobs import lending_report
    from jobs.models import Job, LoanRun
    from jobs.preemption import job_requeue
    from jobs.runs import UNFINISHED

    now = timezone.now()
    loan = lend(alice, bob, box[:1], now - 2 * SETTLE_AFTER)
    job = Job.objects.get(reservation=loan)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.LOST)  # marked lost; finished_at is set
    before = series()

    class Runs:  # the LoanRun read, with the replay's commit just before it
        class objects:
            @staticmethod
            def filter(*args, **kwargs):  # type: ignore[no-untyped-def]
                job_requeue(
                    job.pk, from_=UNFINISHED, message="Preempted: late replay", ended_at=job.finished_at
                )
                return LoanRun.objects.filter(*args, **kwargs)

    monkeypatch.setattr(lending_report, "LoanRun", Runs)
    assert lending_settle(now) == 1
    monkeypatch.undo()
    assert LoanRun.objects.filter(job=job).count() == 1
    after = series()
    assert after == before, (before, after)
