"""Notifications: the inbox entry, its mail copy, mail preferences, and the inbox's filters.

`notification_send` is what gpus and jobs call (the GPU watchdog, bookings, jobs): the entry is
always written; the mail goes after commit through `portal.mail` (the task
`portal.tasks.mail_notification`, on the portal's own queue; copies to the person's chat and
webhook channels go the same way through portal.channels), and a mail that cannot go is logged,
retried, at worst given up: never an error for the sender. docs/notifications.md says what is sent to whom.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from functools import partial

import django_filters
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from portal.changes import user_change_publish
from portal.channels import notification_channels_queue
from portal.errors import Invalid
from portal.filters import RawBooleanWidget, YesNoFilter, unknown_choice
from portal.mail import mail_queue
from portal.models import JOB_NOTIFY_EVENTS, MailPreference, Notification, Profile, job_notify_default

Mail = Notification.Mail
SUBJECT_MAX = Notification._meta.get_field("subject").max_length
# A message, never a log: the watchdog quotes command lines, which can be any length.
BODY_MAX = 10_000


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_url(url: str) -> str:
    """A path on this site: the inbox renders it as a link, so nothing else may get in."""
    if url and (not url.startswith("/") or url.startswith("//")):
        raise ValueError(f"notification url {url!r} must be a path into the portal, e.g. /jobs/12/")
    return url


@transaction.atomic
def notification_send(
    *, user: AbstractBaseUser, kind: str, subject: str, body: str, url: str = "", key: str = ""
) -> Notification:
    """Put a notification in `user`'s inbox; mail a copy once this transaction commits when they
    have an address, want `kind` by mail, and no mail with the same non-empty `key` went to them
    in the last NOTIFY_MAIL_EVERY_MINUTES (e.g. key="violation:42": one mail per violation).

    Mail trouble never reaches the caller. Two sends racing in separate transactions may both
    mail: the watchdog sends from one process, so this is not worth a lock on the user's row.
    """
    if kind not in Notification.Kind.values:
        raise ValueError(f"unknown notification kind {kind!r}: add it to Notification.Kind")
    notification = Notification.objects.create(
        user=user,
        kind=kind,
        subject=_clip(" ".join(subject.split()), SUBJECT_MAX),  # a mail header: one line
        body=_clip(body, BODY_MAX),
        url=_check_url(url),
        key=key,
        mail_status=_mail_status(user=user, kind=kind, key=key),
    )
    if notification.mail_status == Mail.QUEUED:
        transaction.on_commit(partial(mail_queue, notification.pk))
    notification_channels_queue(notification)  # the person's chat and webhook channels, after commit
    user_change_publish(user.pk)  # once committed: the user's open pages update their bell
    return notification


def _mail_status(*, user: AbstractBaseUser, kind: str, key: str) -> str:
    if not mail_preference_of(user).wants(kind):
        return Mail.NOT_WANTED
    if not user.email:
        return Mail.NO_ADDRESS
    if key and _mailed_lately(user=user, key=key):
        return Mail.REPEAT
    return Mail.QUEUED


def _mailed_lately(*, user: AbstractBaseUser, key: str) -> bool:
    """A mail with this key went to the user within the limit, or is on its way."""
    minutes = settings.NOTIFY_MAIL_EVERY_MINUTES
    if not minutes:
        return False
    since = timezone.now() - timedelta(minutes=minutes)
    went = Q(mail_status=Mail.SENT, mailed_at__gte=since)
    on_its_way = Q(mail_status__in=[Mail.QUEUED, Mail.SENDING], created_at__gte=since)
    return Notification.objects.filter(went | on_its_way, user=user, key=key).exists()


@transaction.atomic
def notifications_mark_read(*, user: AbstractBaseUser, ids: Iterable[int] | None = None) -> int:
    """Mark the user's unread notifications read: those in `ids`, or all of them. Ids of others'
    notifications are skipped, never an error that would tell they exist. Returns how many changed."""
    unread = Notification.objects.filter(user=user, read_at=None)
    if ids is not None:
        unread = unread.filter(pk__in=list(ids))
    marked = unread.update(read_at=timezone.now())
    if marked:
        user_change_publish(user.pk)  # the bell in the user's other tabs
    return marked


def unread_count(user: AbstractBaseUser) -> int:
    """The bell's number (an index holds just the unread rows)."""
    return Notification.objects.filter(user=user, read_at=None).count()


# --- mail preferences ------------------------------------------------------------------------


def mail_preference_of(user: AbstractBaseUser) -> MailPreference:
    """The user's choices; the defaults (unsaved) for someone who never chose."""
    return MailPreference.objects.filter(user=user).first() or MailPreference(user=user)


def mail_kinds_wanted(user: AbstractBaseUser) -> list[str]:
    preference = mail_preference_of(user)
    return [kind for kind in Notification.Kind.values if preference.wants(kind)]


@transaction.atomic
def mail_preference_set(*, user: AbstractBaseUser, kinds: Iterable[str]) -> MailPreference:
    """Mail the user these kinds and no others. Every kind is recorded, so a default changed
    later never overrides a choice made here."""
    wanted = set(kinds)
    if unknown := wanted - set(Notification.Kind.values):
        raise Invalid(f"Unknown kinds {', '.join(sorted(unknown))}; choose from the list.", field="kinds")
    preference, _ = MailPreference.objects.update_or_create(
        user=user, defaults={"mail": {kind: kind in wanted for kind in Notification.Kind.values}}
    )
    return preference


# --- what people are told of their jobs (jobs.notices sends it) -----------------------------


def job_notify_parse(value: object, *, field: str = "notify") -> list[str] | None:
    """A job's or a person's choice of job events, normalised: a list or comma-separated text of
    "start", "end", "fail" ("none" or an empty list: nothing). None or "" stays None: no choice
    (a job then follows its owner's preference). Anything else is refused naming `field`."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        words = [word.strip().lower() for word in value.split(",") if word.strip()]
    elif isinstance(value, list | tuple) and all(isinstance(word, str) for word in value):
        words = [word.strip().lower() for word in value]
    else:
        raise Invalid(
            f'Give {field} as a list such as ["end", "fail"], or as text such as end,fail; '
            f"the values are {', '.join(JOB_NOTIFY_EVENTS)}.",
            field=field,
        )
    words = [] if words == ["none"] else words  # "none" or ["none"], as the refusal below offers
    if unknown := [word for word in words if word not in JOB_NOTIFY_EVENTS]:
        raise Invalid(
            f"Unknown {field} value {unknown[0]!r}: give any of {', '.join(JOB_NOTIFY_EVENTS)} "
            '(e.g. "end,fail"), or "none".',
            field=field,
        )
    return [event for event in JOB_NOTIFY_EVENTS if event in words]  # in one order, once each


def job_notify_of(user: AbstractBaseUser) -> list[str]:
    """What the person asked to be told of their jobs; the defaults until they choose."""
    chosen = Profile.objects.filter(user_id=user.pk).values_list("job_notify", flat=True).first()
    return job_notify_default() if chosen is None else list(chosen)


@transaction.atomic
def job_notify_set(*, user: AbstractBaseUser, events: object) -> list[str]:
    """The person's choice of job events (see job_notify_parse); refused naming `job_notify`,
    nothing written. None (no choice) goes back to the defaults."""
    chosen = job_notify_parse(events, field="job_notify")
    chosen = job_notify_default() if chosen is None else chosen
    Profile.objects.update_or_create(user=user, defaults={"job_notify": chosen})
    return chosen


# --- the inbox's filters ---------------------------------------------------------------------


class UnreadWidget(RawBooleanWidget):
    """BooleanWidget's values (1/true, 0/false) with words for the inbox's menu; any other word is
    passed on, to be refused (YesNoFilter)."""

    def __init__(self, attrs: dict | None = None) -> None:
        super().__init__(attrs)
        self.choices = [("", "all"), ("true", "unread only"), ("false", "read only")]


class NotificationFilter(django_filters.FilterSet):
    """The inbox: /notifications/ and /api/v1/notifications/ (portal/filters.py says how pages and
    the API share a FilterSet)."""

    unread = YesNoFilter(
        field_name="read_at",
        lookup_expr="isnull",
        widget=UnreadWidget,
        label="Show",
        help_text="1 or true: only unread; 0 or false: only read.",
    )
    kind = django_filters.ChoiceFilter(
        choices=Notification.Kind.choices,
        label="Kind",
        empty_label="any kind",
        help_text="What it is about.",
        error_messages=unknown_choice("kind", Notification.Kind.values),
    )

    class Meta:
        model = Notification
        fields: list[str] = []
