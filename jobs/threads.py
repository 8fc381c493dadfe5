"""The jobs app's periodic threads started from jobs/signals.py that are not beside their rules:
the portal worker's job reconciler and a GPU host's spool replay (portal/periodic.py runs them;
the worker's shutdown stops them). The queue's scheduler (jobs/queue/scheduler.py) and a host's
pickup (jobs/host/pickup.py) live beside what they run.

The reconciler is a thread like the collector rather than a beat task, so it costs no broker
message and no log lines every few seconds, and it runs exactly while the portal's worker does.
"""

from __future__ import annotations

import logging
import time

from django.conf import settings
from django.db import DatabaseError, close_old_connections

from jobs.host.replay import spool_replay
from jobs.services import jobs_reconcile
from portal.periodic import PeriodicThread

log = logging.getLogger(__name__)


class JobReconciler(PeriodicThread):
    """The portal's worker's: jobs.services.jobs_reconcile every JOB_RECONCILE_SECONDS."""

    def __init__(self) -> None:
        super().__init__("job-reconciler", settings.JOB_RECONCILE_SECONDS)
        self.failing = False
        # When the database answered again after an outage, or this thread started: a portal
        # (re)started in the middle of one cannot tell, and workers get the same grace either way.
        self.back_at = time.monotonic()

    def step(self) -> None:
        close_old_connections()  # a restarted database must not kill the loop
        try:
            done = jobs_reconcile(mark_lost=not self.failing, heard_for=self.heard_for())
        except DatabaseError:
            self.failing = True
            raise
        if self.failing:
            self.failing, self.back_at = False, time.monotonic()
        if any(done.values()):
            log.info("Jobs reconciled: %s", done)

    def heard_for(self) -> float:
        """Seconds the database has answered since its last outage (or since this thread started:
        a portal restarted mid-outage cannot tell). A beat missed while the database itself was
        away is no sign of a dead run: each kind of run is judged only once this passes its own
        cut-off, so workers write their beats (and jobs' ends, from their spools) first
        (jobs.runs.runs_lost_mark)."""
        return time.monotonic() - self.back_at


class SpoolReplay(PeriodicThread):
    """A GPU host's: what its supervisors could not write while the database was away."""

    def __init__(self) -> None:
        super().__init__("job-spool", settings.JOB_RECONCILE_SECONDS)
        self.folder_failed = False  # JOB_SPOOL_DIR unusable at the last step: said once, not every step
        self.failed: set[str] = set()  # spools whose replay failed (not an outage): said once each

    def step(self) -> None:
        close_old_connections()
        try:
            done = spool_replay(failed=self.failed)
        except OSError as exc:  # the folder itself (removed, remounted read-only since the start check)
            if not self.folder_failed:
                log.error(
                    "%s: JOB_SPOOL_DIR cannot be used (%s); what jobs spool is kept in memory only"
                    " until it can",
                    self.name,
                    exc,
                )
            self.folder_failed = True
            return
        if self.folder_failed:
            log.warning("%s: JOB_SPOOL_DIR can be used again", self.name)
            self.folder_failed = False
        if done:
            log.info("Spooled job output and ends written: %d job(s)", done)
