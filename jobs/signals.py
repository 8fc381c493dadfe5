"""Worker signals for jobs: the reconciler thread, and stopping jobs when a worker stops.

The portal's own worker (the one consuming the default queue, where the telemetry
collector runs) also runs the job reconciler every JOB_RECONCILE_SECONDS: a thread like
the collector rather than a beat task, so it costs no broker message and no log lines
every few seconds, and it runs exactly while the portal's worker does (portal/periodic.py;
the worker's shutdown stops it).

A GPU host's worker that is told to stop asks its running jobs to stop first.

A user whose account goes from active to inactive on save (the admin's form, a directory sync,
`manage.py shell`) has their work stopped at once (jobs.leavers.user_work_stop); a deactivation
that bypassed save() is caught by the reconciler's next pass (jobs.leavers.leavers_stop).

Each telemetry round (gpus' collector) also reports the processes on every card: the jobs'
peak memory and utilization are recorded from it here, since jobs builds on gpus and not
the reverse.

On SIGTERM (systemctl stop) Celery's warm shutdown waits for running tasks. Each job's
supervisor sees this request within a second and stops its job the usual way (SIGTERM,
SIGKILL after JOB_KILL_GRACE_SECONDS), so the worker exits within the grace period
instead of waiting for a multi-hour run, and the job is recorded as cancelled rather
than lost.
"""

from __future__ import annotations

import logging
import os
import pwd
import signal
import socket
import time
from datetime import datetime, timedelta

import psutil
from celery.signals import worker_ready, worker_shutting_down
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection, transaction
from django.db.models import Q
from django.db.models.signals import post_save, pre_save
from django.dispatch import receiver
from django.urls import reverse
from django.utils import timezone

from gpus.inventory import GPUInfo, Snapshot
from gpus.procinfo import session_of
from gpus.services import job_sessions_resolve, telemetry_ingested
from gpus.telemetry import snapshot_read
from gpus.usage import JobOutcome, job_outcomes_resolve
from jobs.leavers import deactivated, user_work_stop
from jobs.logs import log_append
from jobs.models import Job
from jobs.pickup import HostPickup
from jobs.replay import spool_replay
from jobs.scheduler import Scheduler
from jobs.services import jobs_by_session, jobs_reconcile, jobs_usage_record
from jobs.spool import stop_flag
from jobs.watchdog_host import HostWatchdog
from portal.accounts import JOB_USER_OWNER, unix_account_name
from portal.models import AuditEntry, Notification
from portal.notifications import notification_send
from portal.outage import outage_of
from portal.periodic import PeriodicThread, start_thread
from portal.pids import ProcessId, Sent, send, session_members

log = logging.getLogger(__name__)

ORPHAN_LOOKBACK = timedelta(days=1)  # lost jobs older than this have long been killed
CLOCK_SLACK_SECONDS = 5  # boot_time() is derived from the clock, which may have been adjusted since


class JobReconciler(PeriodicThread):
    def __init__(self) -> None:
        super().__init__("job-reconciler", settings.JOB_RECONCILE_SECONDS)
        self.failing = False
        # When the database answered again after an outage, or this thread started: a portal
        # (re)started in the middle of one cannot tell, and workers get the same grace either way.
        self.back_at = time.monotonic()

    def step(self) -> None:
        close_old_connections()  # a restarted database must not kill the loop
        try:
            done = jobs_reconcile(mark_lost=self._may_mark_lost())
        except DatabaseError:
            self.failing = True
            raise
        if self.failing:
            self.failing, self.back_at = False, time.monotonic()
        if any(done.values()):
            log.info("Jobs reconciled: %s", done)

    def _may_mark_lost(self) -> bool:
        """A heartbeat missed while the database itself was away is no sign of a dead worker:
        after an outage, workers get JOB_LOST_AFTER_SECONDS to write theirs (and their jobs'
        ends, from their spools) before any job is called lost."""
        if self.failing:
            return False
        return time.monotonic() - self.back_at >= settings.JOB_LOST_AFTER_SECONDS


class SpoolReplay(PeriodicThread):
    """A GPU host's: what its supervisors could not write while the database was away."""

    def __init__(self) -> None:
        super().__init__("job-spool", settings.JOB_RECONCILE_SECONDS)

    def step(self) -> None:
        close_old_connections()
        if done := spool_replay():
            log.info("Spooled job output and ends written: %d job(s)", done)


_host_worker = False  # set when this worker consumes its GPU host's queue


@worker_ready.connect
def _on_worker_ready(sender, **kwargs) -> None:  # type: ignore[no-untyped-def]
    global _host_worker
    queues = {q.name for q in sender.task_consumer.queues}
    if settings.CELERY_TASK_DEFAULT_QUEUE in queues:
        log.info("Job reconciler every %ss", settings.JOB_RECONCILE_SECONDS)
        start_thread(JobReconciler())
        log.info("Queue scheduler every %ss, and when a card frees up", settings.QUEUE_SCHEDULE_SECONDS)
        start_thread(Scheduler())
    if f"host.{settings.WORKER_SERVER}" in queues:
        _host_worker = True
        kill_orphans(settings.WORKER_SERVER)
        start_thread(SpoolReplay())
        # The pool's size (solo: 1): jobs beyond it wait in Redis, and are no lost messages.
        start_thread(HostPickup(settings.WORKER_SERVER, getattr(sender.pool, "limit", None) or 1))
        snapshot_read.connect(_watch_cards, dispatch_uid="jobs_watchdog")
        log.info("GPU watchdog every %ss%s", settings.WATCHDOG_INTERVAL_SECONDS, _dry_run())


def kill_orphans(server: str) -> int:
    """Job processes of this server left from a previous worker (its pool process was killed
    and only the launcher died with it): no supervisor watches them now, so they go.

    Found by the job's session, named by its leader's pid *and* start (Job.pid, Job.pid_started;
    portal.pids.session_members), and of the job's account: a leaderless session whose id merely
    equals a recycled job pid is never taken for the job's. A session recorded before this boot
    cannot have survived it. A job recorded without its session's start (by an older worker) is
    not proof enough: its candidates are named in the worker's log and left alone. Each process
    ended is said in the job's log, the audit log and a notification to its owner. Called when
    the host's worker starts, before it takes a job, so no job of this host is supervised yet.
    """
    jobs = Job.objects.filter(
        Q(status__in=(Job.Status.STARTING, Job.Status.RUNNING))
        | Q(status=Job.Status.LOST, finished_at__gte=timezone.now() - ORPHAN_LOOKBACK),
        server__name=server,
        worker=socket.gethostname()[:200],
        pid__isnull=False,
        started_at__isnull=False,
    ).select_related("owner__profile")
    killed = 0
    for job in jobs:
        if (uid := _job_uid(job)) is None:
            continue
        try:
            killed += _end_orphans_of(job, uid)
        except Exception:  # one job's leftovers never stop the sweep of the others
            log.exception("Could not end what job %s left running", job.pk)
    return killed


def _end_orphans_of(job: Job, uid: int) -> int:
    if job.pid_started is None:
        _warn_unproved(job, uid, "it has no recorded session start (an older worker ran it)")
        return 0
    if job.pid_started < psutil.boot_time() - CLOCK_SLACK_SECONDS:
        return 0  # started before this boot: nothing of that session is left
    ended = []
    # The last moment the supervisor held the leader (alive, or exited and not yet reaped), so
    # the session id was surely the job's: what was made by then and still lives proves it.
    held_at = (job.heartbeat_at or job.started_at).timestamp()
    members = session_members(ProcessId(job.pid, job.pid_started), held_at=held_at)
    if not members:
        _warn_unproved(job, uid, "none of them was there while its worker still watched it")
    for member in members:
        try:
            if psutil.Process(member.pid).uids().real != uid:
                continue
        except psutil.Error:
            continue
        if send(member, signal.SIGKILL) is Sent.SENT:
            log.warning("Killed process %s left by a previous worker (job %s's session)", member.pid, job.pk)
            ended.append(member.pid)
    if ended:
        _record_orphans_ended(job, ended)
    return len(ended)


def _job_uid(job: Job) -> int | None:
    """The uid the job ran as (JOB_USER's, its owner's under @owner, else the worker's)."""
    if not settings.JOB_USER:
        return os.getuid()
    name = unix_account_name(job.owner) if settings.JOB_USER == JOB_USER_OWNER else settings.JOB_USER
    try:
        return pwd.getpwnam(name).pw_uid if name else None
    except KeyError:
        return None  # no such account here: the job never started as it


def _warn_unproved(job: Job, uid: int, why: str) -> None:
    """Processes in a session with the job's id that cannot be proved to be the job's are left
    alone, and named in the worker's log for an operator to check."""
    if candidates := [p.pid for p in psutil.process_iter(["uids"]) if _in_session(p, job.pid, uid)]:
        log.warning(
            "Job %s: process(es) %s in session %s are left alone, as they cannot be proved to be its"
            " (%s); check them by hand",
            job.pk,
            candidates,
            job.pid,
            why,
        )


def _in_session(proc: psutil.Process, sid: int, uid: int) -> bool:
    return session_of(proc.pid) == sid and proc.info["uids"] is not None and proc.info["uids"].real == uid


def _record_orphans_ended(job: Job, pids: list[int]) -> None:
    """Nothing is killed silently: the job's log, the audit log and its owner are told."""
    why = (
        f"Killed process(es) {', '.join(map(str, pids))} that job {job.pk} left running on"
        f" {socket.gethostname()} when its worker died: nothing watched them any more."
    )
    log_append(job.pk, f"[portal] {why}")
    AuditEntry.objects.create(
        actor=None,
        team_id=job.team_id,
        action=AuditEntry.Action.JOB_CANCEL,
        target=f"job {job.pk}",
        message=why,
        data={"job": job.pk, "pids": pids, "host": socket.gethostname()},
    )
    notification_send(
        user=job.owner,
        kind=Notification.Kind.JOB_STOPPED,
        subject=f"Job {job.pk}: what it left running was stopped",
        body=why,
        url=reverse("job_detail", args=[job.pk]),
        key=f"orphans:{job.pk}",
    )


_watchdog: HostWatchdog | None = None
_watchdog_database_away = False


def _watch_cards(sender: object, *, snapshot: Snapshot, **kwargs: object) -> None:
    """On a GPU host's worker, in its reporter's thread: each snapshot of its cards, judged."""
    global _watchdog, _watchdog_database_away
    close_old_connections()  # a restarted database must not kill the loop
    try:
        if _watchdog is None:
            _watchdog = HostWatchdog(snapshot.host.name, simulated=snapshot.host.simulated)
        _watchdog.round(snapshot)
    except DatabaseError as exc:
        if outage_of(exc) is None:
            raise
        if not _watchdog_database_away:  # one line an outage, not a traceback every round
            log.warning("GPU watchdog: the database is away (%s); its rounds wait for it", exc)
        _watchdog_database_away = True
        return
    if _watchdog_database_away:
        log.warning("GPU watchdog: the database answers again")
    _watchdog_database_away = False


def _dry_run() -> str:
    return " (DRY RUN: it records and notifies, never stops)" if settings.WATCHDOG_DRY_RUN else ""


@worker_shutting_down.connect
def _stop_running_jobs(**kwargs) -> None:  # type: ignore[no-untyped-def]
    """Only in a GPU host's worker: the portal's own worker runs no jobs.

    Its supervisors learn it from a flag on this host's disk (jobs.spool.stop_flag), which
    needs no database; the row says it too when the database answers. A fresh connection:
    the one this process had may have died with a database restart."""
    if not _host_worker:
        return
    flag = stop_flag(os.getpid())
    if flag is not None:
        try:
            flag.touch()
        except OSError:
            log.exception("Could not write the stop flag %s", flag)
    connection.close()
    try:
        stopping = Job.objects.filter(
            status__in=(Job.Status.STARTING, Job.Status.RUNNING),
            server__name=settings.WORKER_SERVER,
            worker=socket.gethostname()[:200],
            cancel_requested_at=None,
        ).update(
            cancel_requested_at=timezone.now(), message=f"The worker on {socket.gethostname()} shut down."
        )
    except DatabaseError:
        log.warning("Worker shutting down while the database is away: its jobs stop by the flag alone")
        return
    if stopping:
        log.warning("Worker shutting down: stopping %d running job(s)", stopping)


@receiver(job_sessions_resolve, dispatch_uid="jobs_by_session")
def _resolve_job_sessions(sender: object, *, sessions: dict[int, set[int]], **kwargs: object) -> dict:
    return jobs_by_session(sessions)


@receiver(telemetry_ingested, dispatch_uid="jobs_usage_record")
def _record_job_usage(sender: object, *, cards: list[GPUInfo], **kwargs: object) -> None:
    """Sent inside the round's transaction: a failure here costs the jobs' usage figures of this
    round only (its own savepoint rolls back), never the telemetry of every host."""
    try:
        with transaction.atomic():
            jobs_usage_record(cards=cards)
    except Exception:  # a usage figure is never worth the telemetry of every host
        log.exception("Could not record this round's job usage; telemetry goes on")


@receiver(job_outcomes_resolve, dispatch_uid="jobs_outcomes")
def _job_outcomes(sender: object, *, since: datetime, until: datetime, **kwargs: object) -> list[JobOutcome]:
    """The usage rollup asks which jobs finished in the hours it writes: read from the rows, since
    every final status is a conditional UPDATE (runner, reconciler, cancel) that sends no signal."""
    rows = Job.objects.filter(finished_at__gte=since, finished_at__lt=until, status__in=Job.FINISHED)
    return [
        JobOutcome(at, cards[0], owner, team, status)
        for at, cards, owner, team, status in rows.values_list(
            "finished_at", "gpu_uuids", "owner", "team", "status"
        )
        if cards  # a job cancelled before it held a card used none
    ]


@receiver(pre_save, sender=settings.AUTH_USER_MODEL, dispatch_uid="jobs_user_was_active")
def _note_was_active(sender, instance, raw=False, update_fields=None, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """Whether the stored user was active, for `_stop_leavers_work` (one read, and none for the
    saves that cannot change it, such as last_login's at every sign-in)."""
    if raw or instance.pk is None or (update_fields is not None and "is_active" not in update_fields):
        return
    stored = sender._default_manager.filter(pk=instance.pk).values_list("is_active", flat=True).first()
    instance._jobs_was_active = bool(stored)


@receiver(post_save, sender=settings.AUTH_USER_MODEL, dispatch_uid="jobs_user_deactivated")
def _stop_leavers_work(sender, instance, raw=False, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """Active → inactive: stop their work now, in the saving transaction (undone with it). A
    failure never undoes the deactivation itself: it is logged (its own savepoint rolled back)
    and the reconciler's next pass stops the work instead."""
    was_active = instance.__dict__.pop("_jobs_was_active", False)
    if raw or not was_active or instance.is_active:
        return
    try:
        user_work_stop(user=instance, reason=deactivated(instance))
    except Exception:
        log.exception("Could not stop the work of deactivated user %s now; the reconciler will", instance)
