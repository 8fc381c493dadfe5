"""Celery tasks of the portal's own queue: thin wrappers that take ids and call a service.

The mail tasks sit in portal/mail.py beside the queueing that sends them (so portal.mail and
portal.notifications need not import each other), and the chat and webhook ones in
portal/channels.py for the same reason; they are imported here for autodiscovery and keep their
names here.
"""

from __future__ import annotations

from celery import shared_task

from portal.channels import channel_deliver, requeue_stranded_channel_deliveries
from portal.idempotency import idempotency_keys_prune
from portal.mail import MAIL_RETRIES, mail_notification, requeue_stranded_mail
from portal.services import signin_failures_prune

__all__ = [
    "MAIL_RETRIES",
    "channel_deliver",
    "mail_notification",
    "prune_idempotency_keys",
    "prune_signin_failures",
    "requeue_stranded_channel_deliveries",
    "requeue_stranded_mail",
]


@shared_task(ignore_result=True, soft_time_limit=120, time_limit=180)
def prune_signin_failures() -> int:
    """Drop failed sign-in records older than LOGIN_FAILURE_LOG_DAYS. Re-running it deletes nothing more."""
    return signin_failures_prune()


@shared_task(ignore_result=True, soft_time_limit=120, time_limit=180)
def prune_idempotency_keys() -> int:
    """Forget the Idempotency-Keys older than IDEMPOTENCY_KEY_HOURS. Re-running it deletes nothing more."""
    return idempotency_keys_prune()
