"""A leader cancels a member's booking while her job runs, in Chromium, with a real Celery worker
running the job (issue 41): the confirm page asks for the reason and refuses an empty one before
anything stops; the job ends cancelled, naming the leader and the reason, as a release does; the
member's bell and inbox say so."""

from __future__ import annotations

import pytest

from gpus.booking import reservation_create
from gpus.models import Reservation
from gpus.services import server_report_ingest
from gpus.simulated.inventory import server_names
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from portal.models import Notification
from tests.browser import chromium, log_in, page  # noqa: F401 - the fixtures
from tests.factories import make_snapshot
from tests.isolation import OUTPUT
from tests.job_helpers import job_log
from tests.waiting import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.worker, pytest.mark.django_db(transaction=True)]
SLEEPER = b"import time\nprint('ready', flush=True)\ntime.sleep(300)\n"


def _running_job(alice, start_worker) -> Job:
    """alice's sleeping job, really running under a real worker of a simulated host."""
    name = server_names()[0]
    server_report_ingest(snapshot=make_snapshot(name, gpus=4, simulated=True))
    start_worker(name, extra_env={"JOB_KILL_GRACE_SECONDS": "2"})
    booking = reservation_create(user=alice, gpus=[f"GPU-{name}-00"])
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="train.py", content=SLEEPER))
    wait_for(
        lambda: Job.objects.get(pk=job.pk).status == Job.Status.RUNNING and "ready" in job_log(job.pk),
        timeout=90,
        what="alice's job to run",
    )
    return job


def test_a_leader_cancels_a_running_members_booking_with_a_reason_and_she_is_told(
    page,  # noqa: F811
    chromium,  # noqa: F811
    live_server,
    alice,
    leader,
    start_worker,
):
    from playwright.sync_api import expect

    job = _running_job(alice, start_worker)
    booking = job.reservation_id
    log_in(page, "leader")
    page.goto(f"/reservations/{booking}/")
    page.click("form.cancel-other button[type=submit]")  # no reason given

    # The confirm page names the job and asks for the reason, refusing the empty one beside it.
    expect(page.locator("h1")).to_contain_text(f"Cancel alice's reservation {booking}?")
    expect(page.locator(".booking-work")).to_contain_text(f"job {job.pk} (train.py), running")
    reason = page.locator("form.confirm-stop input[name=reason]")
    expect(reason).to_be_visible()
    expect(page.locator("form.confirm-stop")).to_contain_text("Give a reason: alice will see it.")
    page.click("form.confirm-stop button[type=submit]")  # still empty: refused again
    expect(page.locator("form.confirm-stop")).to_contain_text("Give a reason: alice will see it.")
    assert Reservation.objects.get(pk=booking).cancelled_at is None
    assert Job.objects.get(pk=job.pk).status == Job.Status.RUNNING  # nothing stopped
    page.screenshot(path=str(OUTPUT / "cancel-confirm.png"), full_page=True)

    reason.fill("paper deadline")
    page.click("form.confirm-stop button[type=submit]")
    expect(page.locator(".message")).to_contain_text("The booking is cancelled")
    wait_for(lambda: Job.objects.get(pk=job.pk).is_finished, timeout=60, what="the job to stop")
    ended = Job.objects.get(pk=job.pk)
    assert ended.status == Job.Status.CANCELLED, ended.message
    assert ended.message.startswith("Cancelled: leader cancelled the booking at"), ended.message
    assert ended.message.endswith("(paper deadline).")
    page.goto(f"/jobs/{job.pk}/")
    expect(page.locator("#job-status")).to_contain_text("leader cancelled the booking")
    expect(page.locator("#job-status .badge.cancelled")).to_be_visible()

    # alice's bell shows it; her inbox names who, why and what stopped.
    with chromium.tab(live_server.url) as alices:
        log_in(alices, "alice")
        expect(alices.locator("#bell [data-unread]")).to_have_text("1")
        alices.click("#bell")
        inbox = alices.locator("main")
        expect(inbox).to_contain_text(f"leader cancelled your booking {booking}: paper deadline")
        alices.screenshot(path=str(OUTPUT / "cancel-told.png"), full_page=True)
    told = Notification.objects.get(user=alice)
    assert told.kind == Notification.Kind.BOOKING_RELEASED
    assert f"job {job.pk} (train.py), running" in told.body
