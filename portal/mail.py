"""The mail copy of a notification: queued after commit, sent by a Celery task on the portal's
queue, sent again by beat when its message was lost, given up on after a few tries.

The tasks live here, beside the queueing that sends them, so that this module and
portal.notifications never import each other: notifications queues through `mail_queue`, and
nothing here needs the inbox. They keep their `portal.tasks.*` names (beat's schedule and any
message already waiting in Redis use them); portal/tasks.py imports them for autodiscovery.
docs/notifications.md says what is sent to whom.
"""

from __future__ import annotations

import logging
import smtplib
from datetime import datetime, timedelta
from typing import Any

from celery import shared_task
from django.conf import settings
from django.core.mail import EmailMessage
from django.db.models import Q, QuerySet
from django.urls import reverse
from django.utils import timezone

from portal.models import Notification

log = logging.getLogger(__name__)

Mail = Notification.Mail

# 30 s, 1, 2, 4 min: a relay restarting or a greylisting server (4xx for a few minutes) is
# waited out; after that the mail is marked failed and the inbox keeps the notification.
MAIL_RETRIES = 4
MAIL_FIRST_RETRY_SECONDS = 30


class MailTemporaryError(Exception):
    """The SMTP server could not take the mail now (unreachable, timed out, a 4xx answer): the
    task tries again later."""


# The time limits sit above EMAIL_TIMEOUT (at most 60 s), which bounds each SMTP step.
@shared_task(
    name="portal.tasks.mail_notification",
    bind=True,
    ignore_result=True,
    max_retries=MAIL_RETRIES,
    soft_time_limit=150,
    time_limit=180,
)
def mail_notification(self, notification_id: int) -> str:  # type: ignore[no-untyped-def]
    """Mail notification `notification_id`, retrying temporary SMTP errors with backoff.
    Re-running it once the mail went, or failed for good, sends nothing."""
    last_try = self.request.retries >= self.max_retries
    try:
        return notification_mail(notification_id=notification_id, last_try=last_try)
    except MailTemporaryError as exc:
        raise self.retry(exc=exc, countdown=MAIL_FIRST_RETRY_SECONDS * 2**self.request.retries) from exc


@shared_task(
    name="portal.tasks.requeue_stranded_mail", ignore_result=True, soft_time_limit=120, time_limit=180
)
def requeue_stranded_mail() -> int:
    """Send again the mails whose message was lost (beat, every minute). Re-running it sends none
    that already have a message out."""
    return mail_stranded_requeue()


def nudge(task: Any, row_id: int, what: str) -> bool:
    """Send `task` the id of a QUEUED row (the row is the record, the message a nudge); False when
    the broker is away. Never raised into whoever committed (the watchdog's round, a booking): the
    row stays QUEUED with no message out, and its stranded requeue sends it once Redis is back."""
    try:
        task.apply_async(args=[row_id])
    except Exception:
        log.warning("Could not queue %s; sent once Redis is back", what)
        return False
    return True


def mail_queue(notification_id: int, at: datetime | None = None) -> None:
    """Hand a QUEUED mail to the task (notification_send calls this after commit)."""
    if nudge(mail_notification, notification_id, f"the mail of notification {notification_id}"):
        Notification.objects.filter(pk=notification_id, mail_status=Mail.QUEUED).update(
            mail_queued_at=at or timezone.now()
        )


def stranded(queued: QuerySet, stamp: str, now: datetime) -> list[int]:
    """The ids of `queued` rows with no message out for MAIL_REQUEUE_MINUTES (`stamp`: when their
    last went) or none ever (30 s after they were made), the oldest 1,000: a mail's, a channel
    delivery's."""
    since = now - timedelta(minutes=settings.MAIL_REQUEUE_MINUTES)
    lost = queued.filter(
        Q(**{f"{stamp}__lt": since}) | Q(**{stamp: None}, created_at__lt=now - timedelta(seconds=30))
    )
    return list(lost.order_by("pk").values_list("pk", flat=True)[:1000])


def mail_stranded_requeue(*, now: datetime | None = None) -> int:
    """Send again the messages of QUEUED mails that have had none out for MAIL_REQUEUE_MINUTES:
    lost with Redis (killed, restarted empty) or never sent (Redis was away). Run by beat every
    minute. A message is a nudge: the claim (QUEUED → SENDING) lets only one of two copies mail,
    and SENDING ones are never sent again (a worker lost mid-send may have sent it)."""
    now = now or timezone.now()
    ids = stranded(Notification.objects.filter(mail_status=Mail.QUEUED), "mail_queued_at", now)
    for notification_id in ids:
        mail_queue(notification_id, now)
    if ids:
        log.warning("Mail of %d notification(s) had no message out (Redis restarted?): sent again", len(ids))
    return len(ids)


def notification_mail(*, notification_id: int, last_try: bool = False) -> str:
    """Mail a QUEUED notification to its person; returns its mail status afterwards.

    Claimed with a conditional UPDATE (QUEUED → SENDING), so a re-run or a second delivery of the
    task sends nothing. A temporary SMTP error puts it back to QUEUED and raises
    MailTemporaryError for the task to retry (FAILED instead on the last try); a permanent one
    (a 5xx answer: unknown recipient, wrong password) marks it FAILED at once. Both are logged.
    No transaction: the SMTP conversation holds no database lock.
    """
    queued = Notification.objects.filter(pk=notification_id, mail_status=Mail.QUEUED)
    if not queued.update(mail_status=Mail.SENDING):
        log.info("Notification %s is not queued for mail (already sent, or gone)", notification_id)
        return ""
    notification = Notification.objects.select_related("user").get(pk=notification_id)
    if not notification.user.email:  # removed since the notification was sent
        return _mail_status_set(notification_id, Mail.NO_ADDRESS)
    try:
        _message(notification).send()
    except OSError as exc:  # smtplib.SMTPException included
        if _is_temporary(exc) and not last_try:
            log.warning("Mail of notification %s not sent yet, to be retried: %s", notification_id, exc)
            _mail_status_set(
                notification_id, Mail.QUEUED, mail_queued_at=timezone.now()
            )  # the retry's message
            raise MailTemporaryError(f"{type(exc).__name__}: {exc}") from exc
        log.error("Could not mail notification %s to %s: %s", notification_id, notification.user.email, exc)
        return _mail_status_set(notification_id, Mail.FAILED)
    return _mail_status_set(notification_id, Mail.SENT, mailed_at=timezone.now())


def _mail_status_set(notification_id: int, status: str, **fields: object) -> str:
    sending = Notification.objects.filter(pk=notification_id, mail_status=Mail.SENDING)
    sending.update(mail_status=status, **fields)
    return status


def _is_temporary(exc: OSError) -> bool:
    """No answer (refused, timed out, dropped) and 4xx answers may pass later; 5xx ones will not."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        return all(code < 500 for code, _ in exc.recipients.values())
    if isinstance(exc, smtplib.SMTPResponseException):
        return exc.smtp_code < 500
    return True


def portal_link(path: str) -> str:
    """A path on this site as an absolute URL, for mails (PORTAL_URL)."""
    return settings.PORTAL_URL + path


def _message(notification: Notification) -> EmailMessage:
    parts = [notification.body]
    if notification.url:
        parts.append(portal_link(notification.url))
    parts.append(
        "-- \n"
        f"Every notification is in your inbox: {portal_link(reverse('notifications'))}\n"
        f"Choose which come by mail on your profile: {portal_link(reverse('profile'))}#mail"
    )
    return EmailMessage(
        subject=settings.EMAIL_SUBJECT_PREFIX + notification.subject,
        body="\n\n".join(parts),
        to=[notification.user.email],
    )
