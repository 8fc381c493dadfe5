"""Celery tasks: thin wrappers that take ids and call the runner or a service."""

from __future__ import annotations

import logging
import threading

from celery import shared_task
from django.db import connection
from django.utils import timezone

from gpus.models import Server
from jobs.host.images import images_pull_here
from jobs.host.lab import lab_run
from jobs.host.runner import job_run
from jobs.lending_report import lending_settle

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
    """Pull these images on this host, in a thread of the worker's: a pull may take an hour, and
    the task would hold one of the host's job slots all that while (the queue counts a host's
    slots by its jobs and labs, so a job sent meanwhile would wait in Redis behind it). One pull
    at a time; a worker that stops ends it (the next send, or a job's first run, pulls again)."""
    pull = threading.Thread(target=_pull_in_turn, args=(server_id, image_ids), name="image-pull", daemon=True)
    pull.start()


_pulling = threading.Lock()


def _pull_in_turn(server_id: int, image_ids: list[int]) -> None:
    with _pulling:
        try:
            pull_images_now(server_id, image_ids)
        except Exception:
            log.exception("Pull of images %s on server %s failed", image_ids, server_id)
        finally:
            connection.close()  # this thread's own


def pull_images_now(server_id: int, image_ids: list[int]) -> list[tuple[str, bool, str]]:
    """Pull these images on this host (those still listed for its server) and record each
    outcome (jobs.host.images): (image, ok, detail) of each, for `images_pull --here` as well.
    Again: each is pulled again, quickly from the runtime's cache."""
    server = Server.objects.filter(pk=server_id).first()
    if server is None:
        log.warning("Pull of images %s: server %s is gone; nothing pulled", image_ids, server_id)
        return []
    return [(one.image, one.ok, one.detail) for one in images_pull_here(server, image_ids)]


@shared_task(ignore_result=True, soft_time_limit=300, time_limit=360)
def settle_lending() -> int:
    """Fold the loans a day past their end into /metrics' lending totals (jobs.lending_report; beat,
    hourly). Again: folds none twice."""
    settled = lending_settle(timezone.now())
    if settled:
        log.info("Settled %d loans into the lending totals", settled)
    return settled
