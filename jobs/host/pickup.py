"""A GPU host finds its own work in the database: a Celery message is a nudge, the row the record.

A job is dispatched once (`jobs.services.dispatch`: a conditional UPDATE sets `dispatched_at`,
and the message goes out after commit). That message can die with Redis: killed, restarted
empty, flushed. Nothing would ever send it again, and the job would wait forever.

So each host worker checks, every JOB_RECONCILE_SECONDS, whether it has a free slot while a
queued job of its server, dispatched a while ago, still waits. Had its message been in Redis,
the free slot would have taken it within a second (prefetch is 1). A job seen so on two rounds
in a row is sent again: `dispatched_at` moves on by a conditional UPDATE (one sender wins), so a
job never has more than one message outstanding, and a job that legitimately waits behind a
busy host gets none. Should the first message turn up after all, the claim (a conditional
UPDATE on QUEUED) lets only one of the two run it.

Each round also writes the worker's pool size on its server (`Server.job_slots`, with
`job_slots_at`), so the queue's planner starts no more jobs on the host than it can run at once.
Busy slots are counted per server: one worker serves one server (the systemd unit and `make run`
start one per server; its node name is the server's), so per server is per worker.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

from django.conf import settings
from django.db import close_old_connections, transaction
from django.db.models import Q
from django.utils import timezone

from gpus.models import Server
from jobs.host.checkpoints import CHECKPOINT_SWEEP_SECONDS, checkpoints_sweep
from jobs.leavers import owner_active
from jobs.models import InteractiveSession, Job
from jobs.services import dispatch
from portal.periodic import PeriodicThread

log = logging.getLogger(__name__)

MAX_SLOTS = 32767  # Server.job_slots is a PositiveSmallIntegerField


def stranded_jobs(server: str, *, slots: int, now: datetime) -> list[Job]:
    """Queued jobs of `server` whose message should have started them by now: as many as this
    host has free slots, oldest dispatch first. None while the host is busy: its jobs and its
    JupyterLab sessions fill its slots alike."""
    busy = Job.objects.filter(
        server__name=server, status__in=(Job.Status.STARTING, Job.Status.RUNNING)
    ).count()
    busy += InteractiveSession.objects.holding_slots().filter(server__name=server).count()
    free = slots - busy
    if free <= 0:
        return []
    sent_before = now - timedelta(seconds=settings.JOB_RECONCILE_SECONDS)
    # A Slurm cluster's job without a booking has no reservation: due once its not_before is.
    in_window = Q(reservation__start__lte=now, reservation__end__gt=now, reservation__cancelled_at=None)
    waiting = Job.objects.filter(
        Q(reservation=None) | in_window,
        owner_active(),
        server__name=server,
        status=Job.Status.QUEUED,
        dispatched_at__lt=sent_before,
        not_before__lte=now,
    )
    return list(waiting.select_related("server").order_by("dispatched_at", "pk")[:free])


def redispatch(job: Job, now: datetime) -> bool:
    """Send a stranded job's message again, once: only if its `dispatched_at` is still the one
    seen (another round or host may have just done it)."""
    with transaction.atomic():
        if not Job.objects.filter(
            pk=job.pk, status=Job.Status.QUEUED, dispatched_at=job.dispatched_at
        ).update(dispatched_at=None):
            return False
        job.dispatched_at = None
        return dispatch(job, now)


def slots_report(server: str, *, slots: int, now: datetime) -> None:
    """Tell the queue how many jobs this host's worker runs at once: the scheduler plans no more
    starts here than that, less what the host holds (jobs.queue.scheduler._free_slots). Written every
    round, so a stopped worker's word goes stale and the planner stops trusting it."""
    Server.objects.filter(name=server).update(job_slots=min(slots, MAX_SLOTS), job_slots_at=now)


class HostPickup(PeriodicThread):
    """In a GPU host's worker: its queued jobs whose message was lost are sent again; and, every
    CHECKPOINT_SWEEP_SECONDS, the checkpoint folders of jobs that ended go (jobs/host/checkpoints.py)."""

    def __init__(self, server: str, slots: int) -> None:
        super().__init__("job-pickup", settings.JOB_RECONCILE_SECONDS)
        self.server, self.slots = server, max(1, slots)
        self.seen: set[int] = set()  # stranded in the last round: sent if still so in this one
        self.swept_at: float | None = None  # the last sweep of ended jobs' checkpoint folders

    def step(self) -> None:
        close_old_connections()
        now = timezone.now()
        slots_report(self.server, slots=self.slots, now=now)
        stranded = stranded_jobs(self.server, slots=self.slots, now=now)
        sent = [job.pk for job in stranded if job.pk in self.seen and redispatch(job, now)]
        if sent:
            log.warning(
                "Job(s) %s of %s were queued with a free slot here: their message was lost (Redis"
                " restarted?); sent again",
                ", ".join(map(str, sent)),
                self.server,
            )
        self.seen = {job.pk for job in stranded} - set(sent)
        if self.swept_at is None or time.monotonic() - self.swept_at >= CHECKPOINT_SWEEP_SECONDS:
            self.swept_at = time.monotonic()
            if removed := checkpoints_sweep():
                log.info("Removed %d checkpoint folder(s) of jobs that ended", removed)
