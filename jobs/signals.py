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
import socket

import psutil
from celery.signals import worker_ready, worker_shutting_down
from django.conf import settings
from django.db import close_old_connections, transaction
from django.dispatch import receiver
from django.utils import timezone

from gpus.inventory import GPUInfo
from gpus.services import telemetry_ingested
from jobs.models import Job
from jobs.services import jobs_reconcile, jobs_usage_record
from portal.periodic import PeriodicThread, start_thread

log = logging.getLogger(__name__)


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
    if f"host.{settings.WORKER_SERVER}" in queues:
        _host_worker = True
        kill_orphans(settings.WORKER_SERVER)


def kill_orphans(server: str) -> int:
    """Job processes of this server left from a previous worker (its pool process was killed
    and only the launcher died with it): no supervisor watches them now, so they go."""
    killed = 0
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("PORTAL_SERVER") != server or "PORTAL_JOB_ID" not in env:
                continue
            log.warning("Killing orphaned job %s process %s", env["PORTAL_JOB_ID"], proc.pid)
            proc.kill()
            killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return killed


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


@receiver(telemetry_ingested, dispatch_uid="jobs_usage_record")
def _record_job_usage(sender: object, *, cards: list[GPUInfo], **kwargs: object) -> None:
    """Sent inside the round's transaction: a failure here costs the jobs' usage figures of this
    round only (its own savepoint rolls back), never the telemetry of every host."""
    try:
        with transaction.atomic():
            jobs_usage_record(cards=cards)
    except Exception:  # a usage figure is never worth the telemetry of every host
        log.exception("Could not record this round's job usage; telemetry goes on")
