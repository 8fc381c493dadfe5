"""Sending a run's id to its host's queue after commit: a job's (`jobs.services.dispatch`) and a
lab's (`jobs.sessions.services.session_start`). One shape for both, so both say an outage alike.

The message is a nudge and the row the record: a send that fails leaves the run waiting, and the
reconciler sends it again (a job: `dispatched_at` cleared, sent at its next pass; a lab: resent
once it waited LAB_RESEND_SECONDS). An outage is said once, not with a traceback every run every
tick; anything else that is not an outage keeps its traceback, that once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from celery import Task

from portal.unreachable import outage_of


class HostSender:
    """`sender(pk, queue)`: `task` with the run's id on its host's queue. `undo(pk)` after a send
    that failed (the row's mark that it was sent, taken back). One per kind and process: the broker
    is the process's, whichever thread met its outage (a request, the scheduler, the reconciler,
    a host's pickup), so the "said once" flag is too."""

    def __init__(
        self, task: Task, what: str, log: logging.Logger, undo: Callable[[int], object] | None = None
    ) -> None:
        self.task, self.what, self.log, self.undo = task, what, log, undo
        self.failing = False  # set by a send that failed, cleared by the next that works

    def __call__(self, pk: int, queue: str) -> None:
        try:
            self.task.apply_async(args=[pk], queue=queue)  # by its object: a renamed task fails at import
        except Exception as exc:
            if not self.failing:
                self.failing = True
                self.log.warning(
                    "Could not send %s %s to %s (%r); the reconciler retries, quietly till a send works",
                    self.what,
                    pk,
                    queue,
                    exc,
                    exc_info=outage_of(exc) is None,
                )
            if self.undo is not None:
                self.undo(pk)
            return
        if self.failing:
            self.failing = False
            what = self.what
            self.log.warning(
                "%ss are sent to their hosts again (%s %s to %s)", what.capitalize(), what, pk, queue
            )
