"""Job services: cancel, dispatch, the reconciler and usage. Submission is jobs/submit.py.

A refusal is a ServiceError naming the field and the fix. Dispatch happens after commit
(`transaction.on_commit`), so a worker never sees an id whose row is not there yet.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import partial

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone

from gpus.booking_ends import ENDED_EARLY_FIELDS, ended_early_words, not_started_words
from gpus.inventory import GPUInfo
from gpus.models import GPU, Allocation, Server
from gpus.noshow import reservation_mark_used
from jobs.leavers import WAITING, leavers_stop, owner_active, team_leavers_stop
from jobs.logs.live import job_changed
from jobs.logs.store import log_append
from jobs.models import Job
from jobs.preemption import back_at_its_end
from jobs.runs import runs_lost_mark, waiting_job_cancel
from jobs.sending import HostSender
from jobs.sessions.services import labs_resend
from jobs.tasks import run_job
from portal.access import can_manage, owner_reason_check
from portal.errors import Conflict, Forbidden, Invalid, ServiceError
from portal.models import AuditEntry, Notification
from portal.notifications import notification_send
from portal.timefmt import format_time

log = logging.getLogger(__name__)


def cpu_share(server: Server, allocations: Sequence[Allocation]) -> int:
    """This booking's share of the host's CPUs: its fraction of the server's cards (memory
    quotas count their fraction of the card)."""
    cards = server.gpus.count() or 1
    fraction = sum(GPU.card_share(a.memory_mb, a.gpu.memory_bookable_mb) for a in allocations)
    return max(1, int(server.cpu_count * fraction / cards)) if server.cpu_count else 1


def default_threads(share: int) -> tuple[int, int]:
    """Intra-op threads = the CPU share; inter-op a couple, for independent ops."""
    return share, (2 if share >= 4 else 1)


def dispatch(job: Job, now: datetime) -> bool:
    """Send the job id to its host's queue once this transaction commits; once per job
    (a conditional UPDATE, so two reconcilers racing send it once), and never for a job whose
    owner's account was deactivated (jobs.leavers cancels it, saying why). A job on a lent
    booking waits until its borrowers have left the cards (`JobQuerySet.borrowers_gone`): the
    scheduler's pass woken by their leaving sends it then (`jobs_due_dispatch`)."""
    due = Job.objects.filter(owner_active(), pk=job.pk, status=Job.Status.QUEUED, dispatched_at=None)
    if not due.borrowers_gone(now).update(dispatched_at=now):
        return False
    job.dispatched_at = now
    # Its owner's use of the booking (gpus/noshow.py), though no process shows on the cards yet (an
    # image pulled, data loaded, a job sent at a booking's start): never a no-show under it.
    if job.reservation_id is not None:  # a Slurm cluster's job has none
        reservation_mark_used(job.reservation_id, now)
    queue = job.server.queue
    transaction.on_commit(partial(send, job.pk, queue))
    return True


def _undispatch(job_id: int) -> None:
    Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).update(dispatched_at=None)


send = HostSender(run_job, "job", log, undo=_undispatch)


ONLY_MANAGERS_CANCEL = "Only the job's owner, leaders of its team and admins can cancel it."
ENDED, ASKED = "ended", "asked"  # how _cancel_one cancelled a job: it never started, or asked its worker


def job_cancel_reason_check(*, user: AbstractBaseUser, job: Job, reason: object) -> str:
    """The cancel's reason, normalised: asked by the cancel and by the job page's confirm step
    before anything stops. Someone else's job needs one: its owner sees it (the rule of a
    booking's cancel too: portal.access.owner_reason_check)."""
    return owner_reason_check(user=user, obj=job, reason=reason, refused=ONLY_MANAGERS_CANCEL)


@transaction.atomic
def job_cancel(
    *,
    user: AbstractBaseUser,
    job: Job | int,
    whole_array: bool = False,
    reason: object = "",
    now: datetime | None = None,
) -> Job:
    """Cancel a job: a pending or queued one at once; a running one is stopped by its worker
    (SIGTERM to its process group, SIGKILL after JOB_KILL_GRACE_SECONDS). With `whole_array`, every
    task of the job's array that has not finished. Someone else's job (a leader's, an admin's
    cancel) needs a `reason`: its end says who and why, its owner is told, the audit log records
    it. A job already being cancelled is a Conflict naming who asked; nothing is written again."""
    now = now or timezone.now()
    pk = job if isinstance(job, int) else job.pk
    job = Job.objects.select_for_update(of=("self",), no_key=True).get(pk=pk)
    if whole_array:
        tasks = _array_tasks(job)
    else:
        _check_cancellable(user, job)
        if job.cancel_requested_at:
            raise _nothing_to_cancel(job)
        tasks = [job]
    reason = job_cancel_reason_check(user=user, job=job, reason=reason)
    # The running tasks' stop requests first: a waiting task's cancel locks the array's row
    # (jobs.notices), and a running task ending now holds its own row while it waits for
    # that lock; asking it to stop after would be a deadlock on PostgreSQL.
    done = {}
    for task in sorted(tasks, key=lambda task: task.status in WAITING):
        if how := _cancel_one(user, task, now, reason):
            done[task] = how
    job.refresh_from_db()
    if tasks and not done:
        raise _nothing_to_cancel(job)
    _others_cancel_told(user, job, done, reason, now)
    return job


def _array_tasks(job: Job) -> list[Job]:
    """Every unfinished task of the job's array, the job itself among them."""
    if job.array_id is None:
        raise Invalid(f"Job {job.pk} is not part of an array; cancel it alone.", field="whole_array")
    tasks = list(Job.objects.filter(array_id=job.array_id, status__in=Job.ACTIVE).exclude(pk=job.pk))
    return tasks + ([] if job.is_finished else [job])


def _check_cancellable(user: AbstractBaseUser, job: Job) -> None:
    if not can_manage(user, job):
        raise Forbidden(ONLY_MANAGERS_CANCEL)
    if job.is_finished:
        raise Invalid(
            f"Job {job.pk} is already {job.get_status_display().lower()}; there is nothing to cancel."
        )


def _nothing_to_cancel(job: Job) -> ServiceError:
    """A cancel that changed nothing: someone asked already (or, for an array, every task has
    finished or is being stopped). Told and audited once, by the first."""
    job = Job.objects.select_related("cancelled_by").get(pk=job.pk)
    if job.array_id is not None and job.is_finished:
        return Conflict(f"Every task of job array {job.array_id} has finished or is being cancelled already.")
    if job.is_finished:
        return Invalid(
            f"Job {job.pk} is already {job.get_status_display().lower()}; there is nothing to cancel."
        )
    who = job.cancelled_by or "the portal"
    at = format_time(job.cancel_requested_at) if job.cancel_requested_at else "a moment ago"
    return Conflict(f"Job {job.pk} is already being cancelled by {who} (asked at {at}); nothing more to do.")


def _others_cancel_told(
    user: AbstractBaseUser, job: Job, done: Mapping[Job, str], reason: str, now: datetime
) -> None:
    """Someone else's job cancelled (a leader's, an admin's): its owner is told who stopped what
    and why, once for a whole array, and the audit log records it. Only what this cancel changed:
    a second cancel of a job being stopped tells nothing. An owner's own cancel tells nobody."""
    if job.owner_id == user.pk or not done:
        return
    first = job if job in done else min(done, key=lambda task: task.pk)  # the one named, else the first
    what = (
        f"job {first.pk} ({first.name})"
        if len(done) == 1
        else f"{len(done)} tasks of job array {job.array_id} ({job.name})"
    )
    AuditEntry.objects.create(
        actor=user,
        team_id=job.team_id,
        action=AuditEntry.Action.JOB_CANCEL,
        target=f"job {first.pk}",
        message=f"{user} cancelled {what} of {job.owner}: {reason}",
        data={"jobs": [task.pk for task in done], "reason": reason},
    )
    notification_send(
        user=job.owner,
        kind=Notification.Kind.JOB_STOPPED,
        subject=f"{user} cancelled your {what}: {reason}",
        body=(
            f"{user} cancelled your {what} at {format_time(now)}.\nWhy: {reason}\n\n"
            f"{_how_it_ends(done, user)}"
        ),
        url=reverse("job_detail", args=[first.pk]),
        key=f"cancelled-job:{first.pk}",
    )


def _how_it_ends(done: Mapping[Job, str], user: AbstractBaseUser) -> str:
    """What happens to what was cancelled: a waiting job never started, a running one is stopped."""
    stop = f"gets SIGTERM, then SIGKILL after {settings.JOB_KILL_GRACE_SECONDS} s"
    ends = f"ends cancelled, saying {user} cancelled it and why."
    ways = set(done.values())
    if ways == {ENDED}:
        return f"It never started: it {ends}" if len(done) == 1 else f"None had started: each {ends}"
    if ways == {ASKED}:
        return f"It {stop}, and {ends}" if len(done) == 1 else f"Each {stop}, and {ends}"
    return f"A running task {stop}; a waiting one never starts. Each {ends}"


def _cancel_one(user: AbstractBaseUser, job: Job, now: datetime, reason: str) -> str:
    """Cancel one job (pk and status as locked); how: ENDED, ASKED, or "" when it changed nothing
    (a cancel asked already, or it ended meanwhile)."""
    pk = job.pk
    _check_cancellable(user, job)
    # A pending or queued job is cancelled here; a running one (or one a worker claimed a moment
    # ago: SQLite takes no row lock) is stopped by its worker, which watches for this request.
    message = f"Cancelled by {user} before it started{f': {reason}' if reason else ''}."
    if job.status in WAITING and waiting_job_cancel(pk, by=user, message=message, now=now, reason=reason):
        log_append(pk, f"[portal] {message}", now=now)  # no worker has it: the log is free to write
        return ENDED
    # No status change: the request its worker acts on (jobs.host.runner), shown on the job's page.
    asked = Job.objects.filter(pk=pk, status__in=Job.ACTIVE, cancel_requested_at=None).update(
        cancel_requested_at=now, cancelled_by=user, cancel_reason=reason
    )
    if not asked:
        return ""
    job_changed([pk], server=job.server_id)
    return ASKED


def jobs_reconcile(
    *, now: datetime | None = None, mark_lost: bool = True, heard_for: float | None = None
) -> dict[str, int]:
    """The periodic pass (the portal worker's reconciler thread, jobs.threads.JobReconciler): stop
    deactivated users' work, start due jobs (of active owners only) and labs whose message was
    lost, mark lost runs (jobs and sessions, by one rule: jobs.runs), drop jobs whose booking is
    gone. `mark_lost` False: nothing is called lost (the database itself was away just now);
    `heard_for`: how long it has answered since (jobs.runs.runs_lost_mark: each kind's grace).

    Safe to run twice or on two hosts at once: every change is the one conditional transition.
    """
    now = now or timezone.now()
    done = {"leavers": leavers_stop(now=now), "team_leavers": team_leavers_stop(now=now)}
    done |= {"dispatched": 0, "lost": 0, "expired": 0, "sessions_lost": 0}
    done["dispatched"] = jobs_due_dispatch(now)
    labs_resend(now=now)
    if mark_lost:
        done |= runs_lost_mark(now=now, heard_for=heard_for)
    done["expired"] = _expired_cancel(now)
    return done


def jobs_due_dispatch(now: datetime) -> int:
    """Send every queued job that is due and not sent yet (its booking started, its borrowers
    gone); how many were sent. The reconciler's, for a message that never went out; and each
    scheduler pass's, so that an owner's job waiting on a lent booking starts as soon as the
    borrower's leaving wakes the scheduler, not a reconcile interval later."""
    unsent = Job.objects.filter(status=Job.Status.QUEUED, dispatched_at=None, not_before__lte=now)
    if not unsent.exists():  # nearly every pass: one plain read, not the borrowers' subquery
        return 0
    sent = 0
    for job in unsent.filter(owner_active()).borrowers_gone(now).select_related("server"):
        with transaction.atomic():
            sent += dispatch(job, now)
    return sent


def _expired_cancel(now: datetime) -> int:
    """Queued jobs whose booking ended or was cancelled before a worker took them: cancelled,
    saying who ended the booking early and why, by the one rule (gpus.booking_ends). A preemptible
    job of the queue whose booking reached its end (a borrower whose loan ended while its host's
    worker was busy or away) goes back to the queue instead, as a running one would. How many
    were cancelled."""
    over = Q(reservation__end__lte=now) | Q(reservation__cancelled_at__isnull=False)
    fields = (
        "pk",
        "queued",
        "preemptible",
        "reservation__end",
        *(f"reservation__{field}" for field in ENDED_EARLY_FIELDS),
    )
    expired = 0
    for row in Job.objects.filter(over, status=Job.Status.QUEUED).values(*fields):
        early = ended_early_words(row, "reservation__")
        end = row["reservation__end"]
        if back_at_its_end(
            row["pk"],
            preemptible=row["preemptible"],
            queued=row["queued"],
            early=early,
            end=end,
            from_=(Job.Status.QUEUED,),
            now=now,
        ):
            continue
        message = not_started_words(early, end)
        if Job.objects.transition(
            row["pk"], from_=Job.Status.QUEUED, to=Job.Status.CANCELLED, finished_at=now, message=message
        ):
            log_append(row["pk"], f"[portal] {message}", now=now)  # no worker has it
            expired += 1
    return expired


def jobs_by_session(sessions: Mapping[int, Iterable[int]]) -> dict[tuple[int, int], int]:
    """{(server id, session id): job id} for the jobs running in those sessions on those servers.

    A job runs in a session of its own (start_new_session), so its session id is the pid the
    worker recorded: readable for any process without privileges, and not the job's to forge.
    Only running jobs count: a recorded pid of a job that has ended may belong to anyone now.
    """
    wanted = {(server, sid) for server, sids in sessions.items() for sid in sids}
    rows = Job.objects.filter(
        status__in=(Job.Status.STARTING, Job.Status.RUNNING),
        server_id__in=list(sessions),
        pid__in=sorted({sid for _, sid in wanted}),
    ).values_list("server_id", "pid", "pk")
    return {(server, pid): pk for server, pid, pk in rows if (server, pid) in wanted}


def jobs_usage_record(*, cards: Sequence[GPUInfo]) -> int:
    """Peak GPU memory (summed over the job's cards) and mean utilization of running jobs, from one
    telemetry round; returns the jobs updated. The collector calls it through
    `gpus.services.telemetry_ingested`, inside the round's transaction.

    A process counts for a job only on a card that job booked: a job's process that runs on a
    card it did not book is not its usage (the watchdog deals with it). Utilization is the
    card's: NVML reports it per card; on a whole-card booking that is the job's own, on a
    shared card an upper bound."""
    claimed = {p.job_id for card in cards for p in card.processes or () if p.job_id}
    if not claimed:
        return 0
    changed = []
    for job in Job.objects.filter(pk__in=claimed, status=Job.Status.RUNNING).only(
        "gpu_uuids", "peak_memory_mb", "utilization_sum", "utilization_samples"
    ):
        own = [
            c for c in cards if c.uuid in job.gpu_uuids and any(p.job_id == job.pk for p in c.processes or ())
        ]
        if not own:
            continue
        memory = sum(p.used_memory_mb or 0 for c in own for p in c.processes or () if p.job_id == job.pk)
        job.peak_memory_mb = max(job.peak_memory_mb or 0, memory)
        utils = [c.utilization_pct for c in own if c.utilization_pct is not None]
        if utils:
            job.utilization_sum += sum(utils) / len(utils)
            job.utilization_samples += 1
        changed.append(job)
    Job.objects.bulk_update(changed, ["peak_memory_mb", "utilization_sum", "utilization_samples"])
    return len(changed)
