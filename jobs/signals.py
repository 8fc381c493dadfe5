"""A GPU host's worker that is told to stop asks its running jobs to stop first.

On SIGTERM (systemctl stop) Celery's warm shutdown waits for running tasks. Each job's
supervisor sees this request within a second and stops its job the usual way (SIGTERM,
SIGKILL after JOB_KILL_GRACE_SECONDS), so the worker exits within the grace period
instead of waiting for a multi-hour run, and the job is recorded as cancelled rather
than lost.
"""

from __future__ import annotations

import logging
import socket

from celery.signals import worker_shutting_down
from django.conf import settings
from django.utils import timezone

log = logging.getLogger(__name__)


@worker_shutting_down.connect
def _stop_running_jobs(**kwargs) -> None:  # type: ignore[no-untyped-def]
    from jobs.models import Job

    stopping = Job.objects.filter(
        status__in=(Job.Status.STARTING, Job.Status.RUNNING),
        server__name=settings.WORKER_SERVER,
        worker=socket.gethostname()[:200],
        cancel_requested_at=None,
    ).update(cancel_requested_at=timezone.now(), message=f"The worker on {socket.gethostname()} shut down.")
    if stopping:
        log.warning("Worker shutting down: stopping %d running job(s)", stopping)
