"""Celery tasks: thin wrappers that take ids and call the runner or a service."""

from __future__ import annotations

import logging

from celery import shared_task

from gpus.models import Server
from jobs.host.images import images_pull_here
from jobs.host.lab import lab_run
from jobs.host.runner import job_run

log = logging.getLogger(__name__)


# No retries, no time limit, no acks_late: a training run is never repeated behind the
# user's back. The message is acked when the task starts, so however long the job runs,
# Redis' visibility_timeout can never hand it to a second worker; a message delivered
# twice anyway (a restored prefetch) finds the row already claimed and does nothing.
@shared_task(ignore_result=True, acks_late=False, max_retries=0)
def run_job(job_id: int) -> str | None:
    """Run job `job_id` on this host to its end. Re-running it for the same id is a no-op."""
    return job_run(job_id)


# As run_job: a lab is started once, never again behind its owner's back.
@shared_task(ignore_result=True, acks_late=False, max_retries=0)
def run_session(session_id: int) -> str | None:
    """Run JupyterLab session `session_id` on this host to its end (jobs.host.lab). Again: a no-op."""
    return lab_run(session_id)


# Sent to a host's queue by jobs.images.images_pull_send. No retries: the next send, or a job's
# first run in the image, pulls again.
@shared_task(ignore_result=True, acks_late=False, max_retries=0)
def pull_images(server_id: int, image_ids: list[int]) -> None:
    """Pull these images on this host (those still listed for its server) and record each
    outcome (jobs.host.images). Again: each is pulled again, quickly from the runtime's cache."""
    server = Server.objects.filter(pk=server_id).first()
    if server is None:
        log.warning("Pull of images %s: server %s is gone; nothing pulled", image_ids, server_id)
        return
    images_pull_here(server, image_ids)
