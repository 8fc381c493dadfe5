# ruff: noqa: F811 - the fixture py, imported from tests.test_bad_input
"""Edge cases a hostile review found (2026-11-30): a form field given twice for env and args, the
CSRF token of a session's form post, Take it back between two loans and while a loan is being
made, and a claim whose first try commits after its retry's UPDATE."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.models import Reservation
from gpus.services import servers_report_ingest
from jobs.models import Job
from jobs.queue.scheduler import schedule_pass
from tests.factories import MembershipFactory, UserFactory, make_snapshot, queue_job
from tests.test_bad_input import api, py  # noqa: F401

pytestmark = pytest.mark.django_db


# --- PassThroughField joins every repeated form field with "," -------------------------------------


def test_env_given_twice_in_a_form_is_two_variables_not_one_with_a_comma(alice, box, py):
    """curl -F env=A=1 -F env=B=2: the commit's "a field given twice counts as both" joins the
    values with ',' for env and args too: one variable A="1,B=2", silently."""
    response = api(alice).post(
        "/api/v1/jobs/",
        f"script_path={py}&gpu_count=1&env=A%3D1&env=B%3D2",
        content_type="application/x-www-form-urlencoded",
    )
    assert response.status_code == 201, response.content
    assert Job.objects.get().env == {"A": "1", "B": "2"}


def test_args_given_twice_in_a_form_are_two_arguments(alice, box, py):
    """curl -F args=--lr -F args=0.1: two arguments, not the one argument "--lr,0.1"."""
    response = api(alice).post(
        "/api/v1/jobs/",
        f"script_path={py}&gpu_count=1&args=--lr&args=0.1",
        content_type="application/x-www-form-urlencoded",
    )
    assert response.status_code == 201, response.content
    assert Job.objects.get().args == ["--lr", "0.1"]


# --- Take it back with nothing lent now ------------------------------------------------------------


@pytest.fixture
def idle_booking(alice, box, team):
    """alice's booking of card 0, idle for 20 minutes (lendable); bob's card-hungry job waits."""
    carol = MembershipFactory(team=team, user=UserFactory(username="carol")).user
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=0)])
    reservation_create(user=carol, gpus=[g.uuid for g in box[1:]], end=timezone.now() + timedelta(hours=8))
    booking = reservation_create(user=alice, gpus=[box[0].uuid], end=timezone.now() + timedelta(hours=8))
    Reservation.objects.filter(pk=booking.pk).update(idle_since=timezone.now() - timedelta(minutes=20))
    return booking


def test_take_it_back_between_two_loans_keeps_the_next_borrower_off(idle_booking, alice, bob, sent):
    """The borrower just ended (its loan released), alice's page still offers *Take it back*, she
    clicks it: "Nothing of the queue's runs on this booking now" — and the next scheduler pass,
    two seconds later, lends her cards to the next preemptible job. Before 3df50e1 the idle clock
    restarted (gpus.idle.idle_clock_restart's docstring names exactly this re-lend)."""
    owner = Client()
    owner.force_login(alice)
    owner.post(f"/reservations/{idle_booking.pk}/take-back/")
    job = queue_job(bob, minutes=60, preemptible=True)
    schedule_pass()
    job.refresh_from_db()
    assert job.reservation is None or job.reservation.lent_from_id != idle_booking.pk, (
        "alice took her booking back, and the queue was lent it again at once"
    )


# --- the browsable API's own form ------------------------------------------------------------------


def test_the_browsable_apis_html_form_post_is_not_refused_for_its_csrf_token(alice, box, py):
    """DRF's browsable API (the default renderers) posts its HTML form with the hidden
    csrfmiddlewaretoken; the unknown-field refusal names it: 400 for a form the portal serves."""
    browser = Client(enforce_csrf_checks=False)
    browser.force_login(alice)
    page = browser.get("/api/v1/jobs/", HTTP_ACCEPT="text/html")
    assert page.status_code == 200 and b"csrfmiddlewaretoken" in page.content
    response = browser.post(
        "/api/v1/jobs/",
        {"csrfmiddlewaretoken": "x" * 64, "script_path": py, "gpu_count": "1"},
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 201, response.content[:300]


@pytest.mark.django_db(transaction=True)
def test_take_it_back_while_a_loan_is_being_made_sends_the_borrower_away(
    alice, bob, leader, box, sent, monkeypatch
):
    """The scheduler's loan holds the lent booking's lock (its re-check done, the loan not yet
    committed) as alice clicks *Take it back*: 3df50e1's "nothing lent?" read comes before the
    lock, sees no loan, and returns; the loan commits and the borrower runs on the cards she just
    took back (before, loans_take_back waited for the lock and preempted it)."""
    import threading
    import time

    from django.db import connection

    from jobs import lending

    real = lending.reservation_create

    def slowly(**kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.3)  # the lent booking re-checked and locked, the loan not yet made
        return real(**kwargs)

    monkeypatch.setattr(lending, "reservation_create", slowly)
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=4, processes=0)])
    end = timezone.now() + timedelta(hours=8)
    reservation_create(user=leader, gpus=[g.uuid for g in box[1:]], end=end)
    booking = reservation_create(user=alice, gpus=[box[0].uuid], end=end)
    Reservation.objects.filter(pk=booking.pk).update(idle_since=timezone.now() - timedelta(minutes=20))
    borrower = queue_job(bob, minutes=60, preemptible=True)
    failed: list[BaseException] = []

    def run(step) -> None:  # type: ignore[no-untyped-def]
        try:
            step()
        except BaseException as error:
            failed.append(error)
        finally:
            connection.close()

    def take_back() -> None:
        time.sleep(0.15)  # inside the loan's window
        lending.loan_take_back(user=alice, booking=Reservation.objects.get(pk=booking.pk))

    threads = [threading.Thread(target=run, args=(s,)) for s in (schedule_pass, take_back)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failed, failed
    borrower.refresh_from_db()
    live = Reservation.objects.loans_live(timezone.now()).filter(lent_from=booking)
    assert not (
        live.exists() and borrower.preempt_requested_at is None and borrower.status != Job.Status.PENDING
    ), "alice took her booking back while the loan was being made; the borrower stays on her card"


@pytest.mark.django_db(transaction=True)  # the retry closes the connection, as after an outage
def test_a_claim_whose_first_try_commits_after_the_retrys_update_is_still_this_workers(
    alice, box, sent, monkeypatch, settings
):
    """The first try gets no answer (its COMMIT waits, e.g. for a synchronous standby, the row
    locked); the retry's token check finds the row still queued, its UPDATE waits on the lock and
    then finds 0 rows: the first try's commit went through with this claim's token, and the job is
    left STARTING, run by nobody, until called lost."""
    from django.db import OperationalError

    from jobs.host import launch
    from jobs.submit import ScriptUpload, job_submit

    settings.JOB_END_WAIT_SECONDS = 30
    booking = reservation_create(user=alice, gpus=[box[0].uuid])
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="a.py", content=b"print(1)\n"))
    transition, calls = Job.objects.transition, []

    def late(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("the database did not answer within 31 s")
        # The first try's COMMIT lands as the retry's UPDATE waits on the row's lock.
        Job.objects.filter(pk=job.pk).update(status=Job.Status.STARTING, claim_token=kwargs["claim_token"])
        return transition(*args, **kwargs)

    monkeypatch.setattr(Job.objects, "transition", late)
    monkeypatch.setattr(launch.time, "sleep", lambda seconds: None)
    claimed = launch.job_claim(job.pk)
    assert claimed is not None and claimed.status == Job.Status.STARTING
