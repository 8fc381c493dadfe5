"""The jobs app's signal receivers only; what they do lives in named modules.

- worker_init: a GPU host's worker refuses to start where it would run its jobs as root unasked
  (jobs.host.worker.jobs_account_check), where a folder it writes into as root is not safe from
  the jobs' accounts, or its jobs' account cannot reach JOB_FOLDERS
  (jobs.host.worker.host_worker_check).
- worker_ready: the portal's own worker (the one consuming the default queue, where the telemetry
  collector runs) starts the job reconciler and the queue's scheduler (jobs/threads.py,
  jobs/queue/scheduler.py); a GPU host's worker ends what a previous worker left running
  (jobs.host.worker.kill_orphans), says whether containers work there (containers_report, in a
  thread of its own) and whether its jobs run as root (jobs_as_root_record), then starts its
  spool replay, its pickup and its watchdog: one `HostWorker`, which holds what the host's
  worker keeps for its life. A Slurm cluster's worker starts its pickup, answers the web's
  questions before a job is written (jobs/host/slurm_checks.py) and follows again what its
  previous worker followed.
- worker_shutting_down: a GPU host's worker asks its running jobs to stop first
  (jobs.host.worker.running_jobs_stop); worker_shutdown: its stop flag goes once they have
  (jobs.host.worker.running_jobs_stopped). The HostWorker connects both.
- gpus' telemetry_ingested: the jobs' peak memory and utilization from each telemetry round
  (jobs.services.jobs_usage_record), since jobs builds on gpus and not the reverse; and a lent
  card's owner coming back, which sends its borrower away (jobs.lending.loans_watch).
- a user saved from active to inactive (the admin's form, a directory sync, `manage.py shell`):
  their work stops at once (jobs.leavers.user_work_stop); a deactivation that bypassed save() is
  caught by the reconciler's next pass (jobs.leavers.leavers_stop).

What gpus asks jobs (which job a process runs for, which jobs finished) is no signal: jobs
answers through gpus/hooks.py, registered in JobsConfig.ready().
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from celery.signals import worker_init, worker_ready, worker_shutdown, worker_shutting_down
from celery.worker import state as worker_state
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection, transaction
from django.db.models.signals import post_save, pre_save
from django.dispatch import receiver

from gpus.inventory import GPUInfo, Snapshot
from gpus.services import telemetry_ingested
from gpus.telemetry import snapshot_read
from jobs.host.dcgm import DcgmMapping
from jobs.host.lab import lab_orphans_end
from jobs.host.pickup import HostPickup
from jobs.host.slurm_checks import SlurmSubmitChecks
from jobs.host.slurm_runner import slurm_jobs_resume
from jobs.host.watchdog import HostWatchdog
from jobs.host.worker import (
    containers_leftovers_remove,
    containers_report,
    host_worker_check,
    jobs_as_root_record,
    kill_orphans,
    running_jobs_stop,
    running_jobs_stopped,
)
from jobs.leavers import deactivated, user_work_stop
from jobs.lending import loans_watch
from jobs.queue.scheduler import Scheduler
from jobs.services import jobs_usage_record
from jobs.threads import JobReconciler, SpoolReplay
from portal.periodic import start_thread
from portal.unreachable import WHAT, outage_of

log = logging.getLogger(__name__)


@worker_init.connect
def _on_worker_init(sender, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """Before the pool starts or a message is taken: the queues are known by then."""
    if f"host.{settings.WORKER_SERVER}" in sender.app.amqp.queues.consume_from:
        host_worker_check()


@worker_ready.connect
def _on_worker_ready(sender, **kwargs) -> None:  # type: ignore[no-untyped-def]
    queues = {q.name for q in sender.task_consumer.queues}
    if settings.CELERY_TASK_DEFAULT_QUEUE in queues:
        log.info("Job reconciler every %ss", settings.JOB_RECONCILE_SECONDS)
        start_thread(JobReconciler())
        log.info("Queue scheduler every %ss, and when a card frees up", settings.QUEUE_SCHEDULE_SECONDS)
        start_thread(Scheduler())
    if f"host.{settings.WORKER_SERVER}" in queues:
        HostWorker(settings.WORKER_SERVER).start(getattr(sender.pool, "limit", None) or 1)


class HostWorker:
    """What a GPU host's worker is, once, for its life: made at worker_ready, kept alive by the
    signal receivers it connects (strong references, not a module global), so a second worker in
    the same process, or a test, starts from nothing.

    It ends what a previous worker left running, starts its spool replay, its pickup and its
    watchdog (which judges each snapshot its telemetry reporter reads), and at the worker's
    shutdown asks its running jobs to stop, then lowers their stop flag once they have.
    """

    def __init__(self, server: str) -> None:
        self.server = server
        self.watchdog: HostWatchdog | None = None  # made at the first snapshot: it names the host
        self.mapping = DcgmMapping(server)  # DCGM's job mapping: rebuilt at start, refreshed by the watchdog
        self.database_away = False  # the watchdog's rounds wait for the database: said once
        self.as_root_recorded = False  # on its server row, once the collector has made it

    def start(self, pool_size: int) -> None:
        if settings.GPU_BACKEND == "slurm":  # a Slurm cluster's login node: Slurm owns every process
            again = "follows again the Slurm jobs its last worker followed"
            if not self.patiently(self.resume_slurm_jobs, again):
                return  # asked to stop while the database was away: nothing of this worker ran
            start_thread(HostPickup(self.server, pool_size))  # only lost messages to find again
            start_thread(SlurmSubmitChecks(self.server))  # the web's questions before it writes a job
            return
        if not self.patiently(self.sweep, "ends what its last worker left"):
            return  # asked to stop while the database was away: nothing of this worker ran
        # Off the start's path: asking the container runtime can take seconds (jobs.host.worker).
        threading.Thread(target=self.report_containers, name="containers-report", daemon=True).start()
        start_thread(SpoolReplay())
        # The pool's size (solo: 1): jobs beyond it wait in Redis, and are no lost messages.
        start_thread(HostPickup(self.server, pool_size))
        _connect(snapshot_read, self.watch_cards, "jobs_watchdog")
        _connect(worker_shutting_down, self.stop_running_jobs, "jobs_host_stop")
        _connect(worker_shutdown, self.lower_stop_flag, "jobs_host_stopped")
        log.info("GPU watchdog every %ss%s", settings.WATCHDOG_INTERVAL_SECONDS, _dry_run())

    def sweep(self) -> None:
        """What a previous worker left: its processes, containers and labs ended, DCGM's mapping
        rebuilt. Each step is safe to run again. An outage ends the sweep (it is tried again
        whole); any other error of one step is logged, and the next steps still run."""
        self.as_root_recorded = jobs_as_root_record(self.server)
        steps: list[tuple[str, Callable[[], object]]] = [
            ("end its jobs' processes", lambda: kill_orphans(self.server)),
            # after kill_orphans, before any job of this worker
            ("remove its containers", lambda: containers_leftovers_remove(self.server)),
            # nor DCGM's job mapping of what a previous worker left (jobs/host/dcgm.py)
            ("rebuild DCGM's job mapping", self.mapping.start),
            ("end its labs", lambda: lab_orphans_end(self.server)),
        ]
        for what, step in steps:
            try:
                step()
            except Exception as exc:
                if outage_of(exc) is not None:
                    raise
                log.exception("Could not %s (what the last worker of %s left); going on", what, self.server)

    def patiently(self, step: Callable[[], None], what: str) -> bool:
        """`step` (the sweep, or following a Slurm cluster's jobs again), retried every
        JOB_RECONCILE_SECONDS while the database is away (a host that boots beside a restarting
        database): worker_ready blocks, so no job is taken before it, and what starts after it
        (the pickup, spool replay, watchdog) starts late instead of never (a raising receiver is
        only logged by Celery). Any other error is logged, and the worker starts all the same.
        False: the worker was asked to stop meanwhile."""
        said = False
        while not (worker_state.should_stop is not None or worker_state.should_terminate is not None):
            try:
                step()
                if said:
                    log.warning("It answers again: %s's worker takes work now", self.server)
                return True
            except Exception as exc:
                away = outage_of(exc)
                if away is None:  # a fault of its own: what comes after still starts
                    log.exception("%s's worker could not start cleanly; starting all the same", self.server)
                    return True
                connection.close()  # a broken connection is not reused
                if not said:
                    log.warning(
                        "%s is away (%s): %s's worker %s before it takes work, and waits for it,"
                        " trying every %s s",
                        WHAT[away].capitalize(),
                        exc,
                        self.server,
                        what,
                        settings.JOB_RECONCILE_SECONDS,
                    )
                    said = True
                time.sleep(settings.JOB_RECONCILE_SECONDS)
        return False

    def resume_slurm_jobs(self) -> None:
        """Before this worker takes a message (worker_ready comes first): the jobs its previous
        worker followed, followed again (jobs.host.slurm_runner.slurm_jobs_resume). Not later: a
        job this worker claims would be followed twice. An outage raises (`patiently` waits it
        out): a job not followed again would turn lost while Slurm runs it on."""
        if ids := slurm_jobs_resume(self.server):
            log.warning("Following job(s) %s again: their Slurm jobs run on", ", ".join(map(str, ids)))

    def report_containers(self) -> None:
        """In a thread of its own, once: whether containers work on this host, on its server."""
        try:
            containers_report(self.server)
        finally:
            connection.close()  # this thread's own connection, never used again

    def watch_cards(self, sender: object, *, snapshot: Snapshot, **kwargs: object) -> None:
        """In its reporter's thread: each snapshot of its cards, judged."""
        close_old_connections()  # a restarted database must not kill the loop
        if not self.as_root_recorded:  # a new host: its row is made from its first report
            self.as_root_recorded = jobs_as_root_record(self.server)
        try:
            if self.watchdog is None:
                # This process is the worker: its pool processes start the host's runs.
                self.watchdog = HostWatchdog(
                    snapshot.host.name,
                    simulated=snapshot.host.simulated,
                    mapping=self.mapping,
                    worker=os.getpid(),
                )
            self.watchdog.round(snapshot)
        except DatabaseError as exc:
            if outage_of(exc) is None:
                raise
            if not self.database_away:  # one line an outage, not a traceback every round
                log.warning("GPU watchdog: the database is away (%s); its rounds wait for it", exc)
            self.database_away = True
            return
        if self.database_away:
            log.warning("GPU watchdog: the database answers again")
        self.database_away = False

    def stop_running_jobs(self, **kwargs: object) -> None:
        """worker_shutting_down: its running jobs asked to stop first (the portal's own worker
        runs no jobs, and makes no HostWorker)."""
        running_jobs_stop()

    def lower_stop_flag(self, **kwargs: object) -> None:
        """worker_shutdown, after the warm shutdown: every job of this worker has stopped."""
        running_jobs_stopped()


def _connect(signal: Any, receiver: Callable[..., None], uid: str) -> None:
    """This receiver in place of any earlier one of the same uid (a signal keeps the first it was
    given), held strongly: the receiver is all that keeps its HostWorker."""
    signal.disconnect(dispatch_uid=uid)
    signal.connect(receiver, weak=False, dispatch_uid=uid)


def _dry_run() -> str:
    return " (DRY RUN: it records and notifies, never stops)" if settings.WATCHDOG_DRY_RUN else ""


@receiver(telemetry_ingested, dispatch_uid="jobs_usage_record")
def _record_job_usage(sender: object, *, cards: list[GPUInfo], **kwargs: object) -> None:
    """Sent inside the round's transaction: a failure here costs the jobs' usage figures of this
    round only (its own savepoint rolls back), never the telemetry of every host."""
    if not any(p.job_id for card in cards for p in card.processes or ()):
        return  # no job's process this round: nothing to record, and no savepoint (two statements)
    try:
        with transaction.atomic():
            jobs_usage_record(cards=cards)
    except Exception:  # a usage figure is never worth the telemetry of every host
        log.exception("Could not record this round's job usage; telemetry goes on")


@receiver(telemetry_ingested, dispatch_uid="jobs_loans_watch")
def _take_lent_cards_back(sender: object, *, cards: list[GPUInfo], **kwargs: object) -> None:
    """A process on a lent card that is not its borrower's: the owner is back, the borrower leaves
    (jobs.lending.loans_watch). In its own savepoint: a failure never costs the round."""
    try:
        with transaction.atomic():
            loans_watch(cards)
    except Exception:
        log.exception("Could not check this round's lent cards; telemetry goes on")


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
