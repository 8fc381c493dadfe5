"""Celery tasks of the portal's own queue: thin wrappers that take ids and call a service."""

from __future__ import annotations

from celery import shared_task

from portal.notifications import MailTemporaryError, mail_stranded_requeue, notification_mail
from portal.services import signin_failures_prune

# 30 s, 1, 2, 4 min: a relay restarting or a greylisting server (4xx for a few minutes) is
# waited out; after that the mail is marked failed and the inbox keeps the notification.
MAIL_RETRIES = 4
MAIL_FIRST_RETRY_SECONDS = 30


# The time limits sit above EMAIL_TIMEOUT (at most 60 s), which bounds each SMTP step.
@shared_task(bind=True, ignore_result=True, max_retries=MAIL_RETRIES, soft_time_limit=150, time_limit=180)
def mail_notification(self, notification_id: int) -> str:  # type: ignore[no-untyped-def]
    """Mail notification `notification_id`, retrying temporary SMTP errors with backoff.
    Re-running it once the mail went, or failed for good, sends nothing."""
    last_try = self.request.retries >= self.max_retries
    try:
        return notification_mail(notification_id=notification_id, last_try=last_try)
    except MailTemporaryError as exc:
        raise self.retry(exc=exc, countdown=MAIL_FIRST_RETRY_SECONDS * 2**self.request.retries) from exc


@shared_task(ignore_result=True, soft_time_limit=120, time_limit=180)
def prune_signin_failures() -> int:
    """Drop failed sign-in records older than LOGIN_FAILURE_LOG_DAYS. Re-running it deletes nothing more."""
    return signin_failures_prune()


@shared_task(ignore_result=True, soft_time_limit=120, time_limit=180)
def requeue_stranded_mail() -> int:
    """Send again the mails whose message was lost (beat, every minute). Re-running it sends none
    that already have a message out."""
    return mail_stranded_requeue()
