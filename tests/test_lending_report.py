"""What lending saved (issue 36): GPU-hours lent to the queue and used by its borrowers, by the
lending team and server, on the Reports page (who sees what) and at /metrics, read back with
prometheus_client's own parser as Prometheus reads it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import GPU
from jobs.lending_report import lending_hours
from jobs.models import Job
from tests.factories import queue_job
from tests.test_prometheus_metrics import TOKEN, scrape, value

pytestmark = pytest.mark.django_db
H = timedelta(hours=1)


@pytest.fixture(autouse=True)
def _token(settings, sent) -> None:
    settings.METRICS_TOKEN = TOKEN


@pytest.fixture
def loan(alice, bob, box):
    """alice's booking of cards 0 and 1 from 4 h ago, lent 3 h ago to bob's job for 2 h (two whole
    cards: 4 GPU-hours lent), which ran 1.5 h of it (3 GPU-hours used)."""
    now = timezone.now()
    t0 = now - 4 * H
    booking = reservation_create(
        user=alice, gpus=[g.uuid for g in box[:2]], start=t0, end=now + 4 * H, now=t0
    )
    lent_at = now - 3 * H
    loan = reservation_create(
        user=bob,
        gpus=[g.uuid for g in box[:2]],
        start=lent_at,
        end=lent_at + 2 * H,
        now=lent_at,
        lent_from=booking,
    )
    job = queue_job(bob, gpus=2, minutes=120, preemptible=True)
    Job.objects.filter(pk=job.pk).update(
        status=Job.Status.SUCCEEDED, reservation=loan, started_at=lent_at, finished_at=lent_at + 1.5 * H
    )
    return loan


def test_it_sums_lent_and_used_gpu_hours_by_lending_team_and_server(loan, team):
    (row,) = lending_hours(until=timezone.now())
    assert (row.team, row.server, row.lent, row.used, row.used_pct) == (team.slug, "box1", 4.0, 3.0, 75)
    # Within a period: the last 2.5 hours hold 1.5 h of the loan and 1 h of the job's run.
    (part,) = lending_hours(since=timezone.now() - 2.5 * H, until=timezone.now())
    assert (round(part.lent, 2), round(part.used, 2)) == (3.0, 2.0)
    assert lending_hours(since=timezone.now() - H, until=timezone.now()) == []


def test_a_share_counts_its_fraction_of_the_card(alice, bob, box):
    now = timezone.now()
    booking = reservation_create(
        user=alice, gpus=[box[0].uuid], start=now - 2 * H, end=now + H, now=now - 2 * H
    )
    half = GPU.bookable_mb(box[0].memory_total_mb, box[0].memory_reserved_mb) // 2
    reservation_create(
        user=bob, gpus=[box[0].uuid], memory_mb=half, start=now - H, end=now, now=now - H, lent_from=booking
    )
    (row,) = lending_hours(until=now)
    assert round(row.lent, 2) == 0.5 and row.used == 0


def test_prometheus_reads_them_as_counters_by_team_and_server(loan, team):
    families = scrape()
    labels = {"team": team.slug, "server": "box1"}
    assert (
        value(families["gpu_portal_lent_gpu_seconds"], "gpu_portal_lent_gpu_seconds_total", **labels)
        == 4 * 3600
    )
    used = families["gpu_portal_lent_used_gpu_seconds"]
    assert value(used, "gpu_portal_lent_used_gpu_seconds_total", **labels) == 3 * 3600


def test_nothing_lent_is_no_sample(box):
    families = scrape()
    assert families["gpu_portal_lent_gpu_seconds"] == []


@pytest.mark.parametrize(
    ("who", "sees"), [("alice", True), ("leader", True), ("admin", True), ("charlie", False)]
)
def test_the_reports_page_shows_them_to_whom_the_booking_is_visible(
    loan, alice, leader, charlie, admin_user, who, sees
):
    client = Client()
    client.force_login({"alice": alice, "leader": leader, "admin": admin_user, "charlie": charlie}[who])
    # From the loan's day: on a month's first hours it began last month, before the default period.
    since = timezone.localdate(timezone.now() - 4 * H)
    page = client.get("/reports/", {"since": since.isoformat()}).content.decode()
    assert 'id="lending"' in page
    if sees:
        assert 'data-server="box1"' in page and "4 GPU-hours, of which the borrowers used 3." in page
    else:
        assert "Nothing was lent to the queue in this period." in page


def test_a_borrowers_run_still_counts_as_used_once_it_went_back_to_the_queue(alice, bob, box):
    """Preempted, its job's row forgets the run (back to pending, no booking, no start): the loan's
    use is kept, so the Reports figure and /metrics' counter never go down."""
    from jobs.host.spool import EndRecord
    from jobs.logs.store import LogWriter
    from jobs.preemption import job_preempt
    from jobs.runs import job_end_record

    now = timezone.now()
    booking = reservation_create(
        user=alice, gpus=[g.uuid for g in box[:2]], start=now - 4 * H, end=now + 4 * H, now=now - 4 * H
    )
    loan = reservation_create(
        user=bob, gpus=[g.uuid for g in box[:2]], start=now - H, end=now + H, now=now - H, lent_from=booking
    )
    job = queue_job(bob, gpus=2, minutes=120, preemptible=True)
    Job.objects.filter(pk=job.pk).update(
        status=Job.Status.RUNNING, reservation=loan, started_at=now - H, pid=4242
    )
    assert round(lending_hours(until=now)[0].used, 2) == 2.0
    metric = ("gpu_portal_lent_used_gpu_seconds", "gpu_portal_lent_used_gpu_seconds_total")
    before = value(scrape()[metric[0]], metric[1])
    assert job_preempt(job=job.pk, reason="its owner came back", grace_seconds=20, now=now)
    left = EndRecord(
        status=Job.Status.PENDING, exit_code=-15, message="Preempted: x.", finished_at=now.isoformat()
    )
    assert job_end_record(job.pk, LogWriter(job.pk), left)
    assert Job.objects.get(pk=job.pk).status == Job.Status.PENDING
    (row,) = lending_hours(until=timezone.now())
    assert round(row.used, 2) == 2.0  # its hour on two cards, kept
    assert value(scrape()[metric[0]], metric[1]) >= before
