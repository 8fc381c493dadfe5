"""Chat and webhook channels: copies of notifications to Slack, Mattermost, Matrix, Teams, ntfy or a
plain `json://` webhook, through apprise. docs/notifications.md says what goes where.

A person's channels get the kinds of their own notifications they chose (portal.notifications
calls `notification_channels_queue` for every inbox entry); a team's channels get the team's
events (`team_channels_notify`: violations, idle bookings, quota refusals), set up by its leaders
and admins. Each message is a ChannelDelivery row sent after commit by the Celery task
`portal.tasks.channel_deliver` (here, beside the queueing, as portal.mail does; portal/tasks.py
imports it), retried with backoff, found again by beat when its message was lost.

Secrets: a channel URL is kept as a Fernet token (`url_encrypt`), shown only masked (apprise's
privacy mode, stored beside it), and never logged: apprise's own log, which may quote URLs, goes
to `_AppriseCapture` only, and what it says of a failure is kept with the URL's parts masked.
"""

from __future__ import annotations

import base64
import logging
import re
from datetime import datetime, timedelta
from functools import lru_cache, partial
from typing import TYPE_CHECKING

from celery import shared_task
from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import F, Q, QuerySet
from django.shortcuts import get_object_or_404
from django.utils import timezone

from portal.access import can_manage_team, is_admin, only_managers, teams_led_by
from portal.channel_hosts import GENERIC, destination_check, sending_to, without_redirects
from portal.errors import Errors, Forbidden, Invalid, TooSoon
from portal.mail import nudge, portal_link, stranded
from portal.models import ChannelDelivery, Notification, NotificationChannel, Team, WatchdogKind

if TYPE_CHECKING:
    import apprise

log = logging.getLogger(__name__)

Status = ChannelDelivery.Status
QUOTA_REFUSED = NotificationChannel.QUOTA_REFUSED
FIRST_RETRY_SECONDS = 30
KEEP_DAYS = 30  # finished deliveries, for an admin who asks what went where
ERROR_MAX = ChannelDelivery._meta.get_field("last_error").max_length
EXAMPLES = (
    "slack://TokenA/TokenB/TokenC/#channel, mmosts://mattermost.example.org/hook-key, "
    "ntfys://ntfy.example.org/topic, json://hooks.example.org/path"
)
UNREADABLE = (
    "This channel's URL cannot be decrypted (the portal's SECRET_KEY or CHANNEL_ENCRYPTION_KEYS "
    "changed): delete it and add it again."
)

# --- apprise's log: kept out of the portal's --------------------------------------------------
# apprise may quote a URL (at debug level its full request URL, with a webhook's key): its logger
# stays at WARNING and never reaches the portal's log. What it says of a failed send comes back
# in the send's result (`_send`), where the URL's parts are masked before it is kept or logged.
# urllib3 (under apprise's requests) logs each request's path at debug level: kept at WARNING.
for _name in ("apprise", "urllib3"):
    logging.getLogger(_name).setLevel(logging.WARNING)
logging.getLogger("apprise").propagate = False


# --- encryption ---------------------------------------------------------------------------


@lru_cache(maxsize=4)
def _fernet_for(keys: tuple[str, ...], secret_key: str) -> MultiFernet:
    if not keys:
        derived = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"gpu-lab-portal notification channels"
        ).derive(secret_key.encode())
        return MultiFernet([Fernet(base64.urlsafe_b64encode(derived))])
    fernets = []
    for number, key in enumerate(keys, start=1):
        try:
            fernets.append(Fernet(key))
        except ValueError:
            raise ImproperlyConfigured(
                f"CHANNEL_ENCRYPTION_KEYS: key {number} is not a Fernet key (32 url-safe base64-encoded "
                "bytes); make one with `python -c 'from cryptography.fernet import Fernet; "
                "print(Fernet.generate_key().decode())'`"
            ) from None
    return MultiFernet(fernets)


def _fernet() -> MultiFernet:
    return _fernet_for(tuple(settings.CHANNEL_ENCRYPTION_KEYS), settings.SECRET_KEY)


def url_encrypt(url: str) -> str:
    return _fernet().encrypt(url.encode()).decode()


def url_decrypt(token: str) -> str | None:
    """The URL in clear, or None when no key reads it (the keys changed)."""
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken:
        return None


def url_readable(token: str) -> bool:
    """Whether a key reads it, checked by its signature alone: lists never decrypt."""
    try:
        _fernet().extract_timestamp(token.encode())
    except InvalidToken:
        return False
    return True


def channel_keys_rotate() -> tuple[int, int]:
    """Encrypt every stored URL again with the first of CHANNEL_ENCRYPTION_KEYS, after a new key
    was put first: (re-encrypted, unreadable). Once it has run, the old keys can go. Run it with
    `manage.py shell -c "from portal.channels import channel_keys_rotate; print(channel_keys_rotate())"`."""
    fernet, done, unreadable = _fernet(), 0, 0
    for pk, token in NotificationChannel.objects.values_list("pk", "url_encrypted"):
        try:
            rotated = fernet.rotate(token.encode()).decode()
        except InvalidToken:
            unreadable += 1
            continue
        done += NotificationChannel.objects.filter(pk=pk, url_encrypted=token).update(url_encrypted=rotated)
    return done, unreadable


# --- checking a channel -----------------------------------------------------------------------

URL_MAX = 1000
MASKED_PATHS = {"ntfy", "ntfys"}  # besides the generic webhooks: a path that is the secret
MASKED_MAX = NotificationChannel._meta.get_field("url_masked").max_length
_PART = re.compile(r"[A-Za-z0-9_\-.~%+=]{4,}")


def url_mask(plugin: apprise.NotifyBase) -> str:
    """apprise's privacy form (passwords and tokens as `****` or `a...z`) without its options (the
    query: apprise's defaults, mostly), and a generic webhook's long path segments masked the same
    way, since such a path often is the hook's key."""
    masked = plugin.url(privacy=True).partition("?")[0]
    scheme, _, rest = masked.partition("://")
    if scheme not in GENERIC | MASKED_PATHS:
        return masked[:MASKED_MAX]
    host, slash, path = rest.partition("/")
    # A webhook's path, and an ntfy topic (whoever knows it reads and posts), are their secrets.
    segments = [s if len(s) < 4 or "..." in s else f"{s[0]}...{s[-1]}" for s in path.split("/")]
    return f"{scheme}://{host}{slash}{'/'.join(segments)}"[:MASKED_MAX]


def redact(text: str, url: str, masked: str) -> str:
    """`text` without any part of `url` that its masked form hides (the secrets)."""
    secrets = set(_PART.findall(url)) - set(_PART.findall(masked))
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "****")
    return text


def event_choices(*, team: bool) -> list[tuple[str, str]]:
    """What a channel may be sent: a person's, every kind of their notifications; a team's, the
    team's events (the watchdog's findings, idle bookings, quota refusals)."""
    if not team:
        return list(Notification.Kind.choices)
    team_kinds = {*WatchdogKind.values, Notification.Kind.IDLE_BOOKING}
    kinds = [(value, label) for value, label in Notification.Kind.choices if value in team_kinds]
    return [*kinds, (QUOTA_REFUSED, NotificationChannel.QUOTA_REFUSED_LABEL)]


def _check_url(url: str) -> apprise.NotifyBase:
    """The service's plugin. Its scheme is apprise's own (a Slack https://hooks.slack.com/...
    webhook is `slack`), so a service's native URL is allowed when its scheme is."""
    import apprise  # here, not at the top: every worker imports this module, few check a URL (70 ms)

    url = url.strip()
    if not url:
        raise Invalid(f"Give the channel's apprise URL, e.g. {EXAMPLES}.", field="url")
    if len(url) > URL_MAX:
        raise Invalid(f"The URL has {len(url)} characters; a channel's may have {URL_MAX}.", field="url")
    plugin = apprise.Apprise.instantiate(url)
    written = url.partition("://")[0].lower() if "://" in url else ""
    scheme = plugin.url(privacy=True).partition("://")[0] if plugin is not None else written
    allowed = settings.CHANNEL_SCHEMES
    if scheme and scheme not in allowed:
        raise Invalid(
            f"{scheme}:// is not allowed on this portal; use one of {', '.join(s + '://' for s in allowed)}"
            " (the portal's admin sets CHANNEL_SCHEMES).",
            field="url",
        )
    if plugin is None:
        raise Invalid(
            f"This is not a URL apprise knows, or it lacks a part its service needs; write it as "
            f"apprise's documentation says for the service, e.g. {EXAMPLES}.",
            field="url",
        )
    if problem := destination_check(plugin, scheme).problem:
        raise Invalid(problem, field="url")
    return plugin


def _check_events(events: list[str] | None, *, team: bool) -> list[str]:
    if events is None:
        return []
    if isinstance(events, str) or not all(isinstance(e, str) for e in events):
        raise Invalid("events: give a list of event kinds, or an empty list for all.", field="events")
    allowed = [value for value, _ in event_choices(team=team)]
    if unknown := sorted(set(events) - set(allowed)):
        owner = "a team channel" if team else "your own channel"
        raise Invalid(
            f"Unknown event(s) {', '.join(unknown)} for {owner}; choose from {', '.join(allowed)}, "
            "or none for all.",
            field="events",
        )
    return [value for value in allowed if value in events]  # in the list's order, once each


def _check_label(label: str) -> str:
    label = " ".join(label.split())
    limit = NotificationChannel._meta.get_field("label").max_length
    if len(label) > limit:
        raise Invalid(f"The label is {len(label)} characters; keep it to {limit}.", field="label")
    return label


# --- services -----------------------------------------------------------------------------


def channels_manageable_by(user: AbstractBaseUser) -> QuerySet[NotificationChannel]:
    """The user's own channels and those of the teams they lead; admins: every channel."""
    channels = NotificationChannel.objects.select_related("team", "user")
    if is_admin(user):
        return channels
    return channels.filter(Q(user=user) | Q(team__in=teams_led_by(user)))


def channel_for_user(user: AbstractBaseUser, pk: int) -> NotificationChannel:
    """One channel the user manages; anyone else's is a 404."""
    return get_object_or_404(channels_manageable_by(user), pk=pk)


@transaction.atomic
def channel_create(
    *,
    by: AbstractBaseUser,
    url: str,
    events: list[str] | None = None,
    label: str = "",
    team: Team | None = None,
) -> NotificationChannel:
    """A channel of `by`'s own, or of `team` (its leaders and admins only). Every bad field is
    reported at once; nothing is written then."""
    if team is not None and not can_manage_team(by, team):
        raise Forbidden(only_managers(team), field="team")
    errors = Errors()
    plugin = errors.check(_check_url, url)
    events = errors.check(_check_events, events, team=team is not None)
    label = errors.check(_check_label, label)
    errors.raise_any()
    return NotificationChannel.objects.create(
        user=None if team else by,
        team=team,
        label=label,
        url_encrypted=url_encrypt(url.strip()),
        url_masked=url_mask(plugin),
        events=events,
        created_by=by,
    )


@transaction.atomic
def channel_update(
    *, channel: NotificationChannel, events: list[str] | None = None, label: str | None = None
) -> NotificationChannel:
    """Change what a channel is sent, or its label (its URL: delete it and add the new one)."""
    errors = Errors()
    if events is not None:
        channel.events = errors.check(_check_events, events, team=channel.team_id is not None)
    if label is not None:
        channel.label = errors.check(_check_label, label)
    errors.raise_any()
    channel.save(update_fields=["events", "label"])
    return channel


def channel_delete(*, channel: NotificationChannel) -> None:
    channel.delete()  # its deliveries too: a queued one finds no row and sends nothing


def channel_test(*, channel: NotificationChannel, by: AbstractBaseUser) -> tuple[bool, str]:
    """Send a test message now and wait for the answer (at most CHANNEL_TIMEOUT_SECONDS): True,
    or False with why, its secrets masked. Recorded on the channel like any send. One test per
    channel every CHANNEL_TEST_EVERY_SECONDS (TooSoon): each holds a web worker while it waits."""
    now, every = timezone.now(), settings.CHANNEL_TEST_EVERY_SECONDS
    free = Q(last_tested_at=None) | Q(last_tested_at__lte=now - timedelta(seconds=every))
    if not NotificationChannel.objects.filter(free, pk=channel.pk).update(last_tested_at=now):
        raise TooSoon(f"This channel was tested less than {every} s ago; wait a little, then test it again.")
    owner = f"team {channel.team}" if channel.team_id else "you"
    subject = "Test from the GPU lab portal"
    body = f"{by} sent this test to check this channel works. It gets notifications for {owner}."
    ok, reason, _ = _send(channel, subject, body, "")
    _record(channel, ok, reason)
    return ok, reason


# --- queueing -------------------------------------------------------------------------------


def notification_channels_queue(notification: Notification) -> int:
    """Copy a person's new notification to each of their channels that wants its kind, after
    commit (portal.notifications.notification_send calls this inside its transaction); held back
    by its key as its mail is."""
    mine = NotificationChannel.objects.filter(user_id=notification.user_id)
    channels = _not_told_lately([c for c in mine if c.wants(notification.kind)], notification.key)
    deliveries = ChannelDelivery.objects.bulk_create(
        ChannelDelivery(
            channel=c,
            notification=notification,
            kind=notification.kind,
            subject=notification.subject,
            body=notification.body,
            url=notification.url,
            key=notification.key,
        )
        for c in channels
    )
    _queue_on_commit(deliveries)
    return len(deliveries)


@transaction.atomic
def team_channels_notify(
    *, team: Team | int, kind: str, subject: str, body: str, url: str = "", key: str = ""
) -> int:
    """Tell the channels of `team` that want `kind`; returns how many were queued. A channel that
    was sent the same non-empty `key` within NOTIFY_MAIL_EVERY_MINUTES is skipped (e.g. one
    person retrying a refused booking). Call it where the event is committed, or after a refused
    request, never inside a transaction that is rolled back."""
    if kind not in dict(event_choices(team=True)):
        raise ValueError(f"{kind!r} is not a team event: add it to portal.channels.event_choices")
    team_id = team if isinstance(team, int) else team.pk
    channels = _not_told_lately(
        [c for c in NotificationChannel.objects.filter(team_id=team_id) if c.wants(kind)], key
    )
    deliveries = ChannelDelivery.objects.bulk_create(
        ChannelDelivery(channel=c, kind=kind, subject=subject[:200], body=body, url=url, key=key[:100])
        for c in channels
    )
    _queue_on_commit(deliveries)
    return len(deliveries)


def _not_told_lately(channels: list[NotificationChannel], key: str) -> list[NotificationChannel]:
    """Those not sent (nor about to be) the same non-empty key within NOTIFY_MAIL_EVERY_MINUTES:
    the mail's rule, so a violation the watchdog sees every round is one message, not one a round."""
    if not key or not channels or not settings.NOTIFY_MAIL_EVERY_MINUTES:
        return channels
    since = timezone.now() - timedelta(minutes=settings.NOTIFY_MAIL_EVERY_MINUTES)
    recent = ChannelDelivery.objects.filter(channel__in=channels, key=key, created_at__gte=since)
    told = set(recent.exclude(status=Status.FAILED).values_list("channel_id", flat=True))
    return [c for c in channels if c.pk not in told]


def _queue_on_commit(deliveries: list[ChannelDelivery]) -> None:
    for delivery in deliveries:
        transaction.on_commit(partial(channel_queue, delivery.pk))


def channel_queue(delivery_id: int, at: datetime | None = None) -> None:
    """Hand a QUEUED delivery to the task; a broker away is left to channel_stranded_requeue."""
    if nudge(channel_deliver, delivery_id, f"channel delivery {delivery_id}"):
        ChannelDelivery.objects.filter(pk=delivery_id, status=Status.QUEUED).update(
            queued_at=at or timezone.now()
        )


def channel_deliveries_prune(*, now: datetime | None = None) -> int:
    """Drop sent and failed deliveries older than KEEP_DAYS (the channel keeps its last result)."""
    before = (now or timezone.now()) - timedelta(days=KEEP_DAYS)
    finished = ChannelDelivery.objects.filter(status__in=[Status.SENT, Status.FAILED], created_at__lt=before)
    return finished.delete()[0]


def channel_stranded_requeue(*, now: datetime | None = None) -> int:
    """Send again the QUEUED deliveries with no message out for MAIL_REQUEUE_MINUTES (beat, every
    minute), as portal.mail.mail_stranded_requeue does for mails; SENDING ones never."""
    now = now or timezone.now()
    ids = stranded(ChannelDelivery.objects.filter(status=Status.QUEUED), "queued_at", now)
    for delivery_id in ids:
        channel_queue(delivery_id, now)
    if ids:
        log.warning("%d channel deliveries had no message out (Redis restarted?): sent again", len(ids))
    # Claimed (queued_at is then the claim's time) and never finished: its worker was killed, or the
    # database went away before the outcome was written. Never sent twice: failed, saying so.
    lost = ChannelDelivery.objects.filter(
        status=Status.SENDING, queued_at__lt=now - timedelta(seconds=SENDING_LOST_SECONDS)
    ).update(status=Status.FAILED, last_error=SENDING_LOST)
    if lost:
        log.warning("%d channel deliveries were left sending by a lost worker: marked failed", lost)
    return len(ids)


SENDING_LOST_SECONDS = 600  # well past the task's time limit (180 s)
SENDING_LOST = "The worker stopped while sending it: it may or may not have arrived; not sent again."


# --- sending ----------------------------------------------------------------------------------


class ChannelTemporaryError(Exception):
    """The service did not take the message (apprise said no): the task tries again later."""


@shared_task(
    name="portal.tasks.channel_deliver",
    bind=True,
    ignore_result=True,
    soft_time_limit=150,
    time_limit=180,
)
def channel_deliver(self, delivery_id: int) -> str:  # type: ignore[no-untyped-def]
    """Send channel delivery `delivery_id`, retrying a failure with backoff up to CHANNEL_RETRIES.
    Re-running it once sent, failed for good, or claimed by another worker sends nothing."""
    last_try = self.request.retries >= settings.CHANNEL_RETRIES
    try:
        return channel_delivery_send(delivery_id=delivery_id, last_try=last_try)
    except ChannelTemporaryError as exc:
        countdown = FIRST_RETRY_SECONDS * 2**self.request.retries
        raise self.retry(exc=exc, countdown=countdown, max_retries=settings.CHANNEL_RETRIES) from exc


@shared_task(
    name="portal.tasks.requeue_stranded_channel_deliveries",
    ignore_result=True,
    soft_time_limit=120,
    time_limit=180,
)
def requeue_stranded_channel_deliveries() -> int:
    """Send again the channel deliveries whose message was lost, and drop the finished ones older
    than KEEP_DAYS. Re-running it is harmless."""
    channel_deliveries_prune()
    return channel_stranded_requeue()


def channel_delivery_send(*, delivery_id: int, last_try: bool = False) -> str:
    """Send a QUEUED delivery; returns its status afterwards. Claimed QUEUED → SENDING by a
    conditional UPDATE; a failure goes back to QUEUED and raises ChannelTemporaryError (FAILED on
    the last try, or at once when the URL cannot be decrypted). No transaction while sending."""
    queued = ChannelDelivery.objects.filter(pk=delivery_id, status=Status.QUEUED)
    # queued_at becomes the claim's time: a row left SENDING long after it was lost (stranded_requeue).
    if not queued.update(status=Status.SENDING, attempts=F("attempts") + 1, queued_at=timezone.now()):
        log.info("Channel delivery %s is not queued (already sent, or gone)", delivery_id)
        return ""
    delivery = ChannelDelivery.objects.select_related("channel").get(pk=delivery_id)
    channel = delivery.channel
    ok, reason, final = _send(channel, delivery.subject, delivery.body, delivery.url)
    _record(channel, ok, reason)
    if ok:
        return _status_set(delivery_id, Status.SENT, sent_at=timezone.now(), last_error="")
    if not final and not last_try:
        log.warning(
            "Channel delivery %s (channel %s) not sent, to be retried: %s", delivery_id, channel.pk, reason
        )
        _status_set(delivery_id, Status.QUEUED, queued_at=timezone.now(), last_error=reason)
        raise ChannelTemporaryError(reason)
    log.error("Channel delivery %s (channel %s) failed: %s", delivery_id, channel.pk, reason)
    return _status_set(delivery_id, Status.FAILED, last_error=reason)


def _status_set(delivery_id: int, status: str, **fields: object) -> str:
    ChannelDelivery.objects.filter(pk=delivery_id, status=Status.SENDING).update(status=status, **fields)
    return status


def _record(channel: NotificationChannel, ok: bool, reason: str) -> None:
    if ok:
        NotificationChannel.objects.filter(pk=channel.pk).update(last_sent_at=timezone.now(), last_error="")
    else:
        NotificationChannel.objects.filter(pk=channel.pk).update(last_error=reason[:ERROR_MAX])


def _send(channel: NotificationChannel, subject: str, body: str, path: str) -> tuple[bool, str, bool]:
    """One try through apprise: (True, "", _) or (False, why, final), the URL's secrets masked in
    `why`; `final`: trying again cannot help (the URL unreadable, or a destination refused; a host
    not found may be found later). The host is looked up once, checked, and connected to only at
    the addresses checked (portal.channel_hosts: a name cannot answer the check and the send
    differently)."""
    import apprise  # here, not at the top: every worker imports this module, few send (70 ms)

    url = url_decrypt(channel.url_encrypted)
    if url is None:
        return False, UNREADABLE, True
    plugin = apprise.Apprise.instantiate(url)
    if plugin is None:  # a scheme apprise no longer knows (it was upgraded)
        return False, f"apprise no longer understands this URL ({channel.url_masked}): add it again.", True
    destination = destination_check(plugin, plugin.url(privacy=True).partition("://")[0])
    if destination.problem:  # checked again: the name may resolve elsewhere by now
        return False, destination.problem, destination.lasting
    without_redirects(plugin)
    plugin.socket_connect_timeout = plugin.socket_read_timeout = settings.CHANNEL_TIMEOUT_SECONDS
    notifier = apprise.Apprise()
    notifier.add(plugin)
    text = f"{body}\n\n{portal_link(path)}" if path else body
    try:
        with sending_to(destination.pin):
            result = notifier.notify(title=subject, body=text, timeout=2 * settings.CHANNEL_TIMEOUT_SECONDS)
    except Exception as exc:  # a plugin's bug must not reach the sender; its words may hold the URL
        ok, said = False, [f"{type(exc).__name__}: {exc}"]
    else:
        ok = bool(result)
        said = [entry.message for entry in result.logs() if entry.level in ("WARNING", "ERROR", "CRITICAL")]
        result.close()
    if ok:
        return True, "", False
    said += destination.pin.notes if destination.pin else []  # what a connection met (refused, no answer)
    reason = " ".join(said) or "The service did not accept the message."
    return False, redact(reason, url, channel.url_masked)[:ERROR_MAX], False
