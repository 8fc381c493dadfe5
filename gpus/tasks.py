from __future__ import annotations

import logging

from celery import shared_task

from gpus.services import telemetry_prune

log = logging.getLogger(__name__)


@shared_task(ignore_result=True, soft_time_limit=120, time_limit=180)
def prune_telemetry() -> int:
    """Drop chart history past its retention. Re-running it deletes nothing more."""
    deleted = telemetry_prune()
    log.info("Pruned %d telemetry samples", deleted)
    return deleted
