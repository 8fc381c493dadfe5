"""Worker signals for jobs: the reconciler thread, and stopping jobs when a worker stops.

The portal's own worker (the one consuming the default queue, where the telemetry
collector runs) also runs the job reconciler every JOB_RECONCILE_SECONDS: a thread like
the collector rather than a beat task, so it costs no broker message and no log lines
every few seconds, and it runs exactly while the portal's worker does (portal/periodic.py;
the worker's shutdown stops it).

A GPU host's worker that is told to stop asks its running jobs to stop first.

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
import socket
from datetime import datetime, timedelta

import psutil
from celery.signals import worker_ready, worker_shutting_down
from django.conf import settings
from django.db import close_old_connections, transaction
from django.db.models import Q
from django.dispatch import receiver
from django.utils import timezone

from gpus.inventory import GPUInfo, Snapshot
from gpus.procinfo import session_of
from gpus.services import job_sessions_resolve, telemetry_ingested
from gpus.telemetry import snapshot_read
from gpus.usage import JobOutcome, job_outcomes_resolve
from jobs.models import Job
from jobs.scheduler import Scheduler
from jobs.services import jobs_by_session, jobs_reconcile, jobs_usage_record
from jobs.watchdog_host import HostWatchdog
from portal.accounts import JOB_USER_OWNER, unix_account_name
from portal.periodic import PeriodicThread, start_thread

log = logging.getLogger(__name__)

ORPHAN_LOOKBACK = timedelta(days=1)  # lost jobs older than this have long been killed
CLOCK_SLACK_SECONDS = 5  # the job's recorded start trails its process's creation by a moment


class JobReconciler(PeriodicThread):
    def __init__(self) -> None:
        super().__init__("job-reconciler", settings.JOB_RECONCILE_SECONDS)

    def step(self) -> None:
        close_old_connections()  # a restarted database must not kill the loop
        done = jobs_reconcile()
        if any(done.values()):
            log.info("Jobs reconciled: %s", done)


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
        snapshot_read.connect(_watch_cards, dispatch_uid="jobs_watchdog")
        log.info("GPU watchdog every %ss%s", settings.WATCHDOG_INTERVAL_SECONDS, _dry_run())


def kill_orphans(server: str) -> int:
    """Job processes of this server left from a previous worker (its pool process was killed
    and only the launcher died with it): no supervisor watches them now, so they go.

    Found by session, as the telemetry attributes them (gpus.procinfo): a process of the jobs'
    account whose session id is the recorded pid of a job this host was running, and which
    started after that job. No other user's environment is read, and nothing the job controls
    decides what is killed. Called when the host's worker starts, before it takes a job, so no
    job of this host is supervised yet.
    """
    jobs = Job.objects.filter(
        Q(status__in=(Job.Status.STARTING, Job.Status.RUNNING))
        | Q(status=Job.Status.LOST, finished_at__gte=timezone.now() - ORPHAN_LOOKBACK),
        server__name=server,
        worker=socket.gethostname()[:200],
        pid__isnull=False,
        started_at__isnull=False,
    ).select_related("owner__profile")
    started = {job.pid: (job.started_at, uid) for job in jobs if (uid := _job_uid(job)) is not None}
    if not started:
        return 0
    killed = 0
    for proc in psutil.process_iter(["pid", "uids", "create_time"]):
        if _orphan_of(proc, started) is None:
            continue
        try:
            log.warning(
                "Killing process %s left by a previous worker (job session %s)",
                proc.pid,
                session_of(proc.pid),
            )
            proc.kill()
            killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed


def _job_uid(job: Job) -> int | None:
    """The uid the job ran as (JOB_USER's, its owner's under @owner, else the worker's)."""
    if not settings.JOB_USER:
        return os.getuid()
    name = unix_account_name(job.owner) if settings.JOB_USER == JOB_USER_OWNER else settings.JOB_USER
    try:
        return pwd.getpwnam(name).pw_uid if name else None
    except KeyError:
        return None  # no such account here: the job never started as it


def _orphan_of(proc: psutil.Process, started: dict[int, tuple[datetime, int]]) -> int | None:
    """The session (a job's recorded pid) `proc` was left in, or None when it is no job's."""
    sid = session_of(proc.pid)
    job_start, uid = started.get(sid, (None, None)) if sid is not None else (None, None)
    if job_start is None or proc.info["uids"] is None or proc.info["uids"].real != uid:
        return None
    # A recycled pid heads a session that began after the job did: its leader, if alive, was
    # created later, and so was everything in it.
    if proc.info["create_time"] < job_start.timestamp() - CLOCK_SLACK_SECONDS:
        return None
    leader = proc if proc.pid == sid else None
    try:
        leader = leader or psutil.Process(sid)
        if leader.create_time() > job_start.timestamp() + CLOCK_SLACK_SECONDS:
            return None
    except psutil.NoSuchProcess:
        pass  # the launcher died with the old worker: the usual orphan
    except psutil.Error:
        return None
    return sid


_watchdog: HostWatchdog | None = None


def _watch_cards(sender: object, *, snapshot: Snapshot, **kwargs: object) -> None:
    """On a GPU host's worker, in its reporter's thread: each snapshot of its cards, judged."""
    global _watchdog
    close_old_connections()  # a restarted database must not kill the loop
    if _watchdog is None:
        _watchdog = HostWatchdog(snapshot.host.name, simulated=snapshot.host.simulated)
    _watchdog.round(snapshot)


def _dry_run() -> str:
    return " (DRY RUN: it records and notifies, never stops)" if settings.WATCHDOG_DRY_RUN else ""


@worker_shutting_down.connect
def _stop_running_jobs(**kwargs) -> None:  # type: ignore[no-untyped-def]
    """Only in a GPU host's worker: the portal's own worker runs no jobs."""
    if not _host_worker:
        return
    stopping = Job.objects.filter(
        status__in=(Job.Status.STARTING, Job.Status.RUNNING),
        server__name=settings.WORKER_SERVER,
        worker=socket.gethostname()[:200],
        cancel_requested_at=None,
    ).update(cancel_requested_at=timezone.now(), message=f"The worker on {socket.gethostname()} shut down.")
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
