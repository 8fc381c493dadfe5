"""A run's life past its start, the same for jobs and sessions (jobs, labs, `gpu exec`): its end
recorded (`job_end_record`; a queued job's booking ends with it, `queued_job_ended`) and a lost
run (`runs_lost_mark`, `job_lost_stopped_tell`, `session_lost_stop`). Every status change is the
one transition (jobs.lifecycle); the table of states is docs/jobs.md, "States".

A lost run is treated one way, whatever it is. A run whose beats stopped for longer than its
cut-off (JOB_LOST_AFTER_SECONDS, SESSION_LOST_AFTER_SECONDS; the database's clock, portal.clock)
is marked lost by the reconciler. The row is the record: once it says lost, the run's cards may
be someone else's, so whoever finds the run still alive (a job's supervisor, a lab's, a `gpu`
command's beat) stops it and never takes it back, with the reason in its log, its owner's inbox
and the audit log, as every stop is. After a database outage the reconciler judges each kind only
once the database has answered for that kind's cut-off (jobs.threads.JobReconciler, `heard_for`),
so an outage of the portal's database is no reason to stop anyone's run. A `gpu` command beats
through the web API: a web server down longer than SESSION_LOST_AFTER_SECONDS ends its session.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.urls import reverse
from django.utils import timezone

from gpus.booking import PORTAL, reservation_locked, reservation_release
from gpus.models import Reservation, Server
from jobs.host.spool import EndRecord
from jobs.logs.store import LogWriter, log_append
from jobs.models import InteractiveSession, Job
from jobs.preemption import job_requeue, preempted_words
from portal.clock import since
from portal.models import AuditEntry, Notification
from portal.notifications import notification_send
from portal.timefmt import format_time
from portal.wakeups import QUEUE_SCHEDULER, wake_on_commit

# Where the end of a job may still be recorded: the worker's word is final even over LOST (it
# was marked while its worker was out of touch; the worker then stopped it, or saw it end).
UNFINISHED = (Job.Status.STARTING, Job.Status.RUNNING, Job.Status.LOST)
LOST = "Lost:"  # how a lost session's message starts (sessions have no status of their own for it)
LOST_STOPPED = "Lost, then stopped:"  # ... once it was found alive and stopped (`session_lost_stop`)
LOST_FOUND_ALIVE = (
    "it was marked lost while out of touch with the portal, and a lost run is never taken back"
    " (its cards may be someone else's now)"
)


def job_end_record(job_id: int, writer: LogWriter, record: EndRecord) -> bool:
    """The log's last bytes, then the job's end: recorded once, by the one transition from an
    unfinished status (the supervisor and the spool's replay can never both record it). Raises a
    DatabaseError while the database is away; returns whether this call recorded the end.

    An "end" as PENDING is a preempted job leaving its cards: it goes back to the queue
    (jobs.preemption.job_requeue), its booking released with it.

    An end as LOST is a lost job its worker found alive and stopped: told as a stop is.

    A record that names its run (`EndRecord.run`) ends that run only: a preempted job's earlier
    run, recorded again, never ends the run it is in now."""
    this_run = Q(dispatched_at=datetime.fromisoformat(record.run)) if record.run else Q()
    if record.status == Job.Status.PENDING:  # a preempted job: back to the queue, never an end
        # Only if nobody stopped it for good meanwhile: its supervisor reads the row no more once
        # it has decided (a cancel in its grace, or as its worker shut down, would be undone).
        stays = Q(cancel_requested_at=None, watchdog_stop="") & this_run
        writer.flush()
        finished = datetime.fromisoformat(record.finished_at)
        if job_requeue(job_id, from_=UNFINISHED, message=record.message, where=stays, ended_at=finished):
            return True
        record = _stopped_while_leaving(job_id, record, this_run)
        if record is None:
            return False
        writer.write_line(f"[portal] {record.message} It does not go back to the queue.")
    writer.flush()
    lost = record.status == Job.Status.LOST
    return Job.objects.transition(
        job_id,
        from_=UNFINISHED,
        to=record.status,
        where=this_run,
        told=(lambda: job_lost_stopped_tell(job_id, record.message)) if lost else None,
        exit_code=record.exit_code,
        finished_at=datetime.fromisoformat(record.finished_at),
        message=record.message,
    )


# What a run's supervisor reads of its row to say who cancelled it and why (cancelled_words).
CANCELLED_FIELDS = ("cancelled_by__username", "cancel_reason", "message")


def cancelled_words(row: Mapping[str, Any], how: str = "") -> str:
    """A cancelled run's end, from its row's CANCELLED_FIELDS: who asked and why ("Cancelled by
    leader: blocking the demo."; `how`, e.g. " (scancel)", after the name), else what the portal
    said when it asked (a leaver's work, a released booking)."""
    who = row["cancelled_by__username"]
    if not who:
        return row["message"] or "Cancelled."
    why = f": {row['cancel_reason']}" if row["cancel_reason"] else ""
    return f"Cancelled by {who}{how}{why}."


def stopped_before_start(job_id: int) -> tuple[str, str]:
    """A claimed job's stop asked for before its start (jobs/host/runner.py): a cancel (its owner,
    a leader, the owner's deactivation) means it is not started at all, rather than started and
    stopped at once; a preemption (jobs.preemption), that it goes back to the queue unstarted.
    The status to record and why; ("", "") to start it."""
    row = (
        Job.objects.filter(pk=job_id)
        .values(
            "cancel_requested_at",
            *CANCELLED_FIELDS,
            "preempt_requested_at",
            "preempt_reason",
        )
        .get()
    )
    if row["cancel_requested_at"]:
        return Job.Status.CANCELLED, cancelled_words(row)
    if row["preempt_requested_at"]:
        return Job.Status.PENDING, preempted_words(row["preempt_reason"])
    return "", ""


def _stopped_while_leaving(job_id: int, record: EndRecord, this_run: Q) -> EndRecord | None:
    """A job leaving for the queue that its owner (or a leader, an admin, the leavers' rule)
    cancelled, or the watchdog stopped, meanwhile: its end as that stop, in the supervisor's
    words (jobs/host/runner.py); None when its end is recorded already (or the job runs again)."""
    row = (
        Job.objects.filter(this_run, pk=job_id, status__in=UNFINISHED)
        .values("cancel_requested_at", "watchdog_stop", *CANCELLED_FIELDS)
        .first()
    )
    if row is None:
        return None
    if row["watchdog_stop"]:
        status, message = Job.Status.FAILED, row["watchdog_stop"]
    else:
        status, message = Job.Status.CANCELLED, cancelled_words(row)
    return EndRecord(
        status=status,
        exit_code=record.exit_code,
        message=message,
        finished_at=record.finished_at,
        run=record.run,
    )


def job_lost_stopped_tell(job_id: int, why: str) -> None:
    """A lost job found alive and stopped by its worker: the audit log and its owner are told
    (its log already says it: the supervisor wrote it as it stopped the job)."""
    job = Job.objects.select_related("owner").get(pk=job_id)
    AuditEntry.objects.create(
        actor=None,
        team_id=job.team_id,
        action=AuditEntry.Action.JOB_CANCEL,
        target=f"job {job.pk}",
        message=f"Stopped job {job.pk} ({job.name}) of {job.owner}: {why}",
        data={"job": job.pk, "worker": job.worker, "lost": True},
    )
    notification_send(
        user=job.owner,
        kind=Notification.Kind.JOB_STOPPED,
        subject=f"Job {job.pk} ({job.name}) was stopped: it had been marked lost",
        body=f"Your job {job.pk} ({job.name}) was stopped: {why}",
        url=reverse("job_detail", args=[job.pk]),
        key=f"lost:{job.pk}",
    )


def queued_job_ended(job: Job, *, now: datetime | None = None) -> None:
    """A queued job's booking ends with it: released at once, and the scheduler woken. Called by
    whoever recorded the end (the supervisor, the spool's replay) and by the scheduler's pass for
    an end recorded without it (jobs.queue.scheduler)."""
    if not job.queued or job.reservation_id is None:
        return
    now = now or timezone.now()
    with transaction.atomic():
        # Read under the booking's lock: the job's supervisor and the scheduler's pass (an end it
        # found unreleased) may both get here at once, and the second must find it released, not
        # fail the release (a supervisor's end, or a whole pass, would go with it).
        booking = reservation_locked(job.reservation_id)
        if booking.status_at(now) == Reservation.Status.ACTIVE:
            why = f"queued job {job.pk} ended"
            reservation_release(user=PORTAL, reservation=booking, now=now, reason=why)
        else:
            wake_on_commit(QUEUE_SCHEDULER)


def runs_lost_mark(*, now: datetime | None = None, heard_for: float | None = None) -> dict[str, int]:
    """The reconciler's one rule for every kind of run: those whose beats stopped longer ago than
    their cut-off are marked lost, each by the one transition with the cut-off judged again in
    its UPDATE (a beat since the read keeps the run). Safe to run twice or on two hosts at once.

    `heard_for`: seconds since the database answered the reconciler again after an outage (None:
    long enough). A kind of run is judged only once that is past its own cut-off: a beat missed
    while the database was away is no sign of a dead run, and a session's beat comes through the
    web API, less often than a job's (SESSION_BEAT_SECONDS), so it gets its own longer grace."""
    now = now or timezone.now()
    done = {"lost": 0, "sessions_lost": 0}
    if heard_for is None or heard_for >= settings.JOB_LOST_AFTER_SECONDS:
        done["lost"] = _jobs_lost_mark(now)
    if heard_for is None or heard_for >= settings.SESSION_LOST_AFTER_SECONDS:
        done["sessions_lost"] = _sessions_lost_mark(now)
    return done


def _jobs_lost_mark(now: datetime) -> int:
    # Beats are the database's time (portal.clock), so is the cut-off: `now` may be another
    # host's clock, minutes off. Never judged by equality with the value read: on SQLite, Now()
    # (milliseconds) and Django's text differ. A Slurm job runs on in Slurm while its cluster's
    # worker is away, and a restarted worker follows it again: it gets SLURM_LOST_AFTER_SECONDS.
    slurm = Q(server__kind=Server.Kind.SLURM)
    slurm_cut = max(settings.JOB_LOST_AFTER_SECONDS, settings.SLURM_LOST_AFTER_SECONDS)
    unheard = (~slurm & Q(heartbeat_at__lt=since(settings.JOB_LOST_AFTER_SECONDS))) | (
        slurm & Q(heartbeat_at__lt=since(slurm_cut))
    )
    marked = 0
    for job in Job.objects.filter(unheard, status__in=(Job.Status.STARTING, Job.Status.RUNNING)):
        if job.slurm_job_id:  # Slurm runs it on; the cards are Slurm's, never the portal's to free
            gone = f"Slurm job {job.slurm_job_id} may still run there; the portal follows it no more."
        else:
            gone = "the worker or its host died. The booking's cards are free for a new job."
        beat = format_time(job.heartbeat_at)
        message = f"Lost: no heartbeat from worker {job.worker or '?'} since {beat}; {gone}"
        # Its end too: the same clock as the beat it is judged by (finished - last beat >= the cut-off).
        if Job.objects.transition(
            job.pk, from_=job.status, to=Job.Status.LOST, where=unheard, finished_at=Now(), message=message
        ):
            log_append(job.pk, f"[portal] {message}\n", now=now)
            marked += 1
    return marked


def waiting_job_cancel(pk: int, *, by: object | None, message: str, now: datetime, reason: str = "") -> bool:
    """A job no worker has started (pending in the queue, or queued for its host) cancelled with
    `message`, by a person (`by`, who gave `reason`) or by the portal (None); whether it was still
    waiting. A job a worker took meanwhile is its worker's to stop (cancel_requested_at)."""
    return Job.objects.transition(
        pk,
        from_=(Job.Status.PENDING, Job.Status.QUEUED),
        to=Job.Status.CANCELLED,
        finished_at=now,
        cancel_requested_at=now,
        cancelled_by=by,
        cancel_reason=reason,
        pending_reason="",
        message=message,
    )


def _sessions_lost_mark(now: datetime) -> int:
    stale = since(settings.SESSION_LOST_AFTER_SECONDS)
    unheard = Q(beat_at__lt=stale) | Q(beat_at=None, created_at__lt=stale)
    marked = 0
    rows = InteractiveSession.objects.filter(unheard, status__in=InteractiveSession.ACTIVE)
    for pk, beat_at in rows.values_list("pk", "beat_at"):
        marked += InteractiveSession.objects.transition(
            pk,
            from_=InteractiveSession.ACTIVE,
            to=InteractiveSession.Status.ENDED,
            where=unheard,
            finished_at=Now(),  # the clock its beat is judged by, as a lost job's end
            message=f"{LOST} no word from its gpu command since {format_time(beat_at or now)}.",
        )
    return marked


def session_is_lost(session: InteractiveSession) -> bool:
    """Marked lost by the reconciler, and not yet found alive and stopped."""
    return session.status == InteractiveSession.Status.ENDED and session.message.startswith(LOST)


def session_lost_stop(session: InteractiveSession, told: Callable[[], None]) -> bool:
    """A lost session found alive (its `gpu` command beat, its lab's supervisor read the row): it
    is stopped, never taken back; its message says so, and `told` (the stop's inbox and audit
    entry) is written once, by whichever finds it first. Whether this call was that one."""
    lost = session.message[len(LOST) :]
    message = f"{LOST_STOPPED}{lost} Found still running and stopped: {LOST_FOUND_ALIVE}."[:500]
    return InteractiveSession.objects.transition(
        session.pk,
        from_=InteractiveSession.Status.ENDED,
        to=InteractiveSession.Status.ENDED,
        where=Q(message__startswith=LOST),
        told=told,
        message=message,
    )
