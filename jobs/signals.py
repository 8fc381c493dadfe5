"""The jobs app's signal receivers only; what they do lives in named modules.

- worker_init: a GPU host's worker refuses to start where a folder it writes into as root is
  not safe from the jobs' accounts, or its jobs' account cannot reach JOB_FOLDERS
  (jobs.host_worker.host_worker_check).
- worker_ready: the portal's own worker (the one consuming the default queue, where the telemetry
  collector runs) starts the job reconciler and the queue's scheduler (jobs/threads.py,
  jobs/scheduler.py); a GPU host's worker ends what a previous worker left running
  (jobs.host_worker.kill_orphans), then starts its spool replay, its pickup and its watchdog.
- worker_shutting_down: a GPU host's worker asks its running jobs to stop first
  (jobs.host_worker.running_jobs_stop); worker_shutdown: its stop flag goes once they have
  (jobs.host_worker.running_jobs_stopped).
- gpus' telemetry_ingested: the jobs' peak memory and utilization from each telemetry round
  (jobs.services.jobs_usage_record), since jobs builds on gpus and not the reverse.
- a user saved from active to inactive (the admin's form, a directory sync, `manage.py shell`):
  their work stops at once (jobs.leavers.user_work_stop); a deactivation that bypassed save() is
  caught by the reconciler's next pass (jobs.leavers.leavers_stop).

What gpus asks jobs (which job a process runs for, which jobs finished) is no signal: jobs
answers through gpus.hooks, registered in JobsConfig.ready().
"""

from __future__ import annotations

import logging

from celery.signals import worker_init, worker_ready, worker_shutdown, worker_shutting_down
from django.conf import settings
from django.db import DatabaseError, close_old_connections, transaction
from django.db.models.signals import post_save, pre_save
from django.dispatch import receiver

from gpus.inventory import GPUInfo, Snapshot
from gpus.services import telemetry_ingested
from gpus.telemetry import snapshot_read
from jobs.host_worker import host_worker_check, kill_orphans, running_jobs_stop, running_jobs_stopped
from jobs.lab import lab_orphans_end
from jobs.leavers import deactivated, user_work_stop
from jobs.pickup import HostPickup
from jobs.scheduler import Scheduler
from jobs.services import jobs_usage_record
from jobs.threads import JobReconciler, SpoolReplay
from jobs.watchdog_host import HostWatchdog
from portal.outage import outage_of
from portal.periodic import start_thread

log = logging.getLogger(__name__)

_host_worker = False  # set when this worker consumes its GPU host's queue


@worker_init.connect
def _on_worker_init(sender, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """Before the pool starts or a message is taken: the queues are known by then."""
    if f"host.{settings.WORKER_SERVER}" in sender.app.amqp.queues.consume_from:
        host_worker_check()


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
        lab_orphans_end(settings.WORKER_SERVER)
        start_thread(SpoolReplay())
        # The pool's size (solo: 1): jobs beyond it wait in Redis, and are no lost messages.
        start_thread(HostPickup(settings.WORKER_SERVER, getattr(sender.pool, "limit", None) or 1))
        snapshot_read.connect(_watch_cards, dispatch_uid="jobs_watchdog")
        log.info("GPU watchdog every %ss%s", settings.WATCHDOG_INTERVAL_SECONDS, _dry_run())


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
    """Only in a GPU host's worker: the portal's own worker runs no jobs."""
    if _host_worker:
        running_jobs_stop()


@worker_shutdown.connect
def _lower_stop_flag(**kwargs) -> None:  # type: ignore[no-untyped-def]
    """After the warm shutdown: every job of this worker has stopped, its flag goes."""
    if _host_worker:
        running_jobs_stopped()


@receiver(telemetry_ingested, dispatch_uid="jobs_usage_record")
def _record_job_usage(sender: object, *, cards: list[GPUInfo], **kwargs: object) -> None:
    """Sent inside the round's transaction: a failure here costs the jobs' usage figures of this
    round only (its own savepoint rolls back), never the telemetry of every host."""
    try:
        with transaction.atomic():
            jobs_usage_record(cards=cards)
    except Exception:  # a usage figure is never worth the telemetry of every host
        log.exception("Could not record this round's job usage; telemetry goes on")


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
