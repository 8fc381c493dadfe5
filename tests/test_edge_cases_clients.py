"""What clients other than a browser read, at its edges (a hostile review, 2026-11-30): calendar
text as RFC 5545 wants it, /metrics' lending counters that never go down, and a lab worked in
through its terminals only."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from icalendar import Calendar

from gpus.booking import reservation_cancel, reservation_create
from gpus.calendars import calendar_feed_get
from gpus.models import Reservation
from tests.test_prometheus_metrics import TOKEN, scrape, value

pytestmark = pytest.mark.django_db
H = timedelta(hours=1)


@pytest.fixture(autouse=True)
def _token(settings, sent) -> None:
    settings.METRICS_TOKEN = TOKEN


def _event(feed) -> object:
    raw = Client().get(reverse("calendar_feed", kwargs={"secret": feed.secret})).content
    (event,) = Calendar.from_ical(raw).walk("VEVENT")
    return raw, event


def test_a_note_with_a_backslash_n_reads_back_as_written(alice, box):
    """icalendar's escape turns a literal `\\N` into a line break: `D:\\Nets` arrives as `D:`, a
    new line, `ets`."""
    note = r"data on \\NAS\Nets and D:\New"
    reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192, note=note)
    _, event = _event(calendar_feed_get(user=alice))
    assert f"Note: {note}\n" in str(event["DESCRIPTION"])


def test_control_characters_of_a_note_never_reach_the_file(alice, box):
    """RFC 5545 3.3.11: TEXT holds no CONTROL character but HTAB (a note may hold any but NUL)."""
    note = "bell\x07 escape\x1b[31m form\x0cfeed\ttab"
    reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192, note=note)
    raw, event = _event(calendar_feed_get(user=alice))
    assert not any((b < 0x20 and b not in (0x09, 0x0A, 0x0D)) or b == 0x7F for b in raw), raw
    assert "tab" in str(event["DESCRIPTION"])


def test_the_lent_counter_never_goes_down_when_a_leader_cancels_a_running_loan(alice, bob, leader, box, team):
    now = timezone.now()
    booking = reservation_create(
        user=alice, gpus=[box[0].uuid], start=now - 2 * H, end=now + 4 * H, now=now - 2 * H
    )
    loan = reservation_create(
        user=bob, gpus=[box[0].uuid], start=now - H, end=now + H, now=now - H, lent_from=booking
    )
    labels = {"team": team.slug, "server": "box1"}
    before = value(scrape()["gpu_portal_lent_gpu_seconds"], "gpu_portal_lent_gpu_seconds_total", **labels)
    assert before >= 3599
    reservation_cancel(user=leader, reservation=loan, reason="needed the card")
    assert Reservation.objects.get(pk=loan.pk).cancelled_at is not None
    after = scrape()["gpu_portal_lent_gpu_seconds"]
    # A counter that drops reads as a reset: rate() and increase() count all of it again.
    assert after, "the loan's hour vanished from the counter"
    assert value(after, "gpu_portal_lent_gpu_seconds_total", **labels) >= before


def test_the_used_counter_never_goes_down_when_a_running_borrowers_end_lands_late(alice, bob, box, team):
    """A borrower's run is counted to `now` while its row says running; its end, written later
    (the worker's record replayed after the database was away, or a host clock behind the web
    server's), says it ended earlier: the counter drops, and Prometheus reads a reset."""
    from jobs.models import Job
    from tests.factories import queue_job

    now = timezone.now()
    booking = reservation_create(
        user=alice, gpus=[box[0].uuid], start=now - 2 * H, end=now + 4 * H, now=now - 2 * H
    )
    loan = reservation_create(
        user=bob, gpus=[box[0].uuid], start=now - H, end=now + H, now=now - H, lent_from=booking
    )
    job = queue_job(bob, gpus=1, minutes=120, preemptible=True)
    ended = now - timedelta(minutes=10)
    Job.objects.filter(pk=job.pk).update(
        status=Job.Status.RUNNING,
        reservation=loan,
        started_at=now - H,
        heartbeat_at=ended - timedelta(seconds=5),  # its last beat, just before its process ended
    )
    labels = {"team": team.slug, "server": "box1"}
    name = "gpu_portal_lent_used_gpu_seconds"
    before = value(scrape()[name], name + "_total", **labels)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.SUCCEEDED, finished_at=ended)
    assert value(scrape()[name], name + "_total", **labels) >= before


def test_a_lab_worked_in_through_its_terminals_is_not_idle(alice, box, settings, monkeypatch):
    """A JupyterLab whose owner works in its terminals (`python train.py` printing away, no
    kernel open) is ended as idle after SESSION_IDLE_MINUTES: only kernels are asked."""
    import time
    from types import SimpleNamespace

    from jobs.host import lab
    from jobs.sessions.services import session_start

    monkeypatch.setattr("jobs.sessions.services._send", lambda pk, queue: None)
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    session, _ = session_start(user=alice, reservation=booking.pk, kind="jupyterlab")
    supervisor = lab.LabSupervisor(session)
    supervisor.proc = SimpleNamespace(leader=SimpleNamespace(pid=1))
    supervisor.last_kernel_activity = time.time() - 2 * 3600  # started two hours ago
    just_now = timezone.now().isoformat()
    answers = {"kernels": [], "terminals": [{"name": "1", "last_activity": just_now}]}
    monkeypatch.setattr(supervisor, "_api", lambda path, token=True: answers.get(path))
    monkeypatch.setattr(lab, "_kernel_sessions", lambda leader: [])
    assert supervisor._check_kernels() is None
