"""Preemptible jobs: asking one to leave its cards (`job_preempt`), and putting it back in the
queue at its old place (`job_requeue`).

A queued job submitted `preemptible` may be asked to leave its cards at any time (its booking's
cards are wanted back: a lent booking's owner returned, docs/booking.md). Leaving is a stop like
a cancel: SIGTERM, then SIGKILL after its grace (PREEMPT_GRACE_SECONDS; LEND_GRACE_SECONDS when an
owner takes a lent card back), done by the job's supervisor (jobs/host/runner.py), which reads the
request on the job's row. Then, instead of ending, the job goes back to PENDING by the one
transition: its booking is released, its run's facts (worker, pid, start) are cleared, and
`preemptions` counts one more. Its `created_at`, and so its age and its place in the queue, are
kept: the scheduler starts it again as soon as cards are free, where it resumes from the
checkpoint it kept in PORTAL_CHECKPOINT_DIR (jobs/host/checkpoints.py). It never counts as
failed; its log says each time why it left and, when it runs again, that it came back.

A job that was booked but not yet taken by a worker (QUEUED, sent or not) is put back at once: no
process of it exists. A message already sent for it then finds it no longer queued, or queued on
another server, which a worker does not claim (jobs.host.launch.job_claim); sent to the same
server again, the first of the two messages runs it and the other finds it taken. One a worker
took already (STARTING, RUNNING) is asked to leave; its worker puts it back.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from datetime import datetime

from django.conf import settings
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from gpus.booking import PORTAL, reservation_release
from gpus.booking_ends import ended_early_of
from gpus.models import Reservation
from jobs.logs.store import log_append
from jobs.models import Job, JobArray, LoanRun
from portal.timefmt import format_time
from portal.wakeups import QUEUE_SCHEDULER, wake_on_commit

log = logging.getLogger(__name__)

PREEMPTED = "Preempted:"  # how a requeued job's message starts while it waits again
BOOKING_ENDED = "The booking ended; the job was stopped."  # a supervisor's words at its booking's end
# Where a preemption may still be asked for: the job holds (or is about to hold) cards.
ON_CARDS = Job.ON_CARDS


def preempted_words(reason: str) -> str:
    """The line a preempted job's log and message carry: why it left, and what happens next."""
    return f"{PREEMPTED} {reason.rstrip('.')}. It goes back to the queue at its old place."


def back_at_its_end(
    job_id: int,
    *,
    preemptible: bool,
    queued: bool,
    early: str,
    end: datetime,
    from_: Collection[str],
    now: datetime,
    where: Q | None = None,
) -> bool:
    """The one rule for a job whose booking is over before a worker started it: a preemptible job
    of the queue whose booking reached its end (a borrower whose loan ended while its host's worker
    was busy or away) goes back to the queue, as a running one would (`deadline_stop`); not when a
    person ended the booking early (`early`, its ended_early_words): that cancels it, running or
    not. Whether it went back (the reconciler's pass, jobs.services; a late claim, below)."""
    if not (preemptible and queued) or early:
        return False
    why = f"its booking ended at {format_time(end)}, before a worker started it"
    return job_requeue(job_id, from_=from_, message=preempted_words(why), where=where, now=now, say=True)


def requeue_unstarted(job: Job, now: datetime | None = None) -> bool:
    """A job its worker took after its booking reached its end, by `back_at_its_end`; not once a
    cancel was asked meanwhile (the caller then cancels it). Whether it went back."""
    now = now or timezone.now()
    booking = job.reservation
    if not (job.preemptible and job.queued) or now < booking.end:
        return False  # before reading who ended the booking early
    return back_at_its_end(
        job.pk,
        preemptible=True,
        queued=True,
        early=ended_early_of(booking),
        end=booking.end,
        from_=(Job.Status.STARTING,),
        now=now,
        where=Q(cancel_requested_at=None),
    )


def shut_down_words(host: str) -> str:
    """Why a preemptible job left its cards when its worker shut down: not a person's cancel, so
    it goes back to the queue like any preempted job (jobs/host/worker.py, jobs/host/runner.py)."""
    return f"the worker on {host} shut down"


def deadline_stop(job: Job, why: str) -> tuple[str, str]:
    """How a job its supervisor finds past its deadline (`why`) stops: timed out; or, a preemptible
    job of the queue whose booking ended before its time limit (a loan, cut to the end of the
    booking it borrowed), back to the queue as if preempted just before. The scheduler asks it
    to leave a little before that end (jobs.lending.loans_expire), but its pass may be late, or
    this host's clock ahead of the portal's: a timeout there would throw its checkpoint away."""
    if why == BOOKING_ENDED and job.preemptible and job.queued:
        return Job.Status.PENDING, preempted_words("its booking ended before its time limit")
    return Job.Status.TIMED_OUT, why


def job_preempt(
    *, job: Job | int, reason: str, grace_seconds: int | None = None, now: datetime | None = None
) -> bool:
    """Ask a preemptible job on cards to leave them, with `reason` (its log's and owner's words)
    and `grace_seconds` between SIGTERM and SIGKILL (default PREEMPT_GRACE_SECONDS). Whether it
    was asked (or, booked but not yet taken by a worker, put back at once); False for a job that is
    not preemptible, not on cards, or asked already (the first request stands). Safe to repeat."""
    now = now or timezone.now()
    pk = job if isinstance(job, int) else job.pk
    grace = grace_seconds or settings.PREEMPT_GRACE_SECONDS
    if job_requeue(
        pk,
        from_=(Job.Status.QUEUED,),
        message=preempted_words(reason),
        where=Q(preemptible=True),
        now=now,
        say=True,
    ):
        return True
    asked = Job.objects.filter(
        pk=pk, preemptible=True, status__in=ON_CARDS, preempt_requested_at=None, cancel_requested_at=None
    ).update(preempt_requested_at=now, preempt_reason=reason[:500], preempt_grace_seconds=grace)
    if asked:
        log.info("Job %s: preemption asked (%s), grace %s s", pk, reason, grace)
    return bool(asked)


def _loan_run_keep(job_id: int, was: dict, ended_at: datetime) -> None:
    """The run on a loan its job leaves, kept (jobs.lending_report counts it as used). It ends
    never before its last beat, nor before the end a lost run was marked with: /metrics counted
    it that far, and a lost run's late "preempted" end may name a moment before either."""
    began = was["started_at"]
    LoanRun.objects.create(
        loan_id=was["reservation_id"],
        job_id=job_id,
        started_at=began,
        ended_at=max(began, ended_at, was.get("heartbeat_at") or began, was.get("finished_at") or began),
    )


def job_requeue(
    job_id: int,
    *,
    from_: Collection[str],
    message: str,
    where: Q | None = None,
    now: datetime | None = None,
    say: bool = False,
    ended_at: datetime | None = None,
) -> bool:
    """Back to PENDING at its old place, by the one transition: its booking released with it, its
    run's facts cleared, `preemptions` counted; a run on a loan kept as a LoanRun, until
    `ended_at` (its end as its worker saw it; default `now`). `say`: the log's line is written
    here (no supervisor wrote it). Whether this call made the change."""
    now = now or timezone.now()
    fields = (
        "reservation_id",
        "array_id",
        "started_at",
        "heartbeat_at",
        "finished_at",
        "reservation__lent_from",
    )
    was = Job.objects.filter(pk=job_id).values(*fields).first() or {}
    booking, array = was.get("reservation_id"), was.get("array_id")

    def told() -> None:
        if was.get("reservation__lent_from") and was.get("started_at"):
            _loan_run_keep(job_id, was, ended_at or now)
        if booking is not None:
            _booking_give_back(booking, job_id, now)
        if array is not None:  # its array was told of it as lost: its real end is told again
            JobArray.objects.filter(pk=array, noticed_at__isnull=False).update(noticed_at=None)
        if say:
            log_append(job_id, f"[portal] {message}", now=now)
        wake_on_commit(QUEUE_SCHEDULER)

    made = Job.objects.transition(
        job_id,
        from_=from_,
        to=Job.Status.PENDING,
        where=Q(queued=True, preemptible=True) & (where or Q()),
        told=told,
        reservation=None,
        server=None,
        gpu_uuids=[],
        not_before=None,
        dispatched_at=None,
        started_at=None,
        finished_at=None,
        heartbeat_at=None,
        worker="",
        pid=None,
        pid_started=None,
        exit_code=None,
        watchdog_stop="",
        pending_reason="",
        message=message[:1000],
        preempt_requested_at=None,
        preempt_reason="",
        preempt_grace_seconds=None,
        preemptions=F("preemptions") + 1,
        # Only a job that ran goes back from a run: one sent back before it started waited all along
        # (the UPDATE reads the row's started_at as it was, before it is cleared above).
        requeued_at=Case(When(started_at__isnull=False, then=Value(now)), default=F("requeued_at")),
        # Its next run's end is an end of its own, to be told (jobs.notices): a job marked lost,
        # told so, whose worker then preempted it, must not have that end told already.
        end_noticed_at=None,
    )
    if made:
        log.info("Job %s: back in the queue at its old place (%s)", job_id, message)
    return made


def _booking_give_back(booking_id: int, job_id: int, now: datetime) -> None:
    """The preempted job's booking ends now: its cards are free for whoever wanted them back."""
    booking = Reservation.objects.get(pk=booking_id)
    if booking.status_at(now) == Reservation.Status.ACTIVE:
        reservation_release(user=PORTAL, reservation=booking, now=now, reason=f"job {job_id} was preempted")
