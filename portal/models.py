"""Teams, their members, the quotas leaders and admins set, and the audit log.

Quota limits are nullable: NULL means "no limit at this level". A member's limits sit
inside the team's (checked when a leader sets them), and a booking must pass both.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import models
from django.utils import timezone

from portal.restrict import CHANGE, VIEW, check_action, is_admin


class QuotaFields(models.Model):
    """Limits shared by team and member quotas. NULL = unlimited."""

    # The verbose names are the portal's own labels (the team page, the booking form's limits):
    # Django's admin and every message that names a limit say them the same way.
    max_cards = models.PositiveIntegerField(
        "cards at once", null=True, blank=True, help_text="Whole cards held at any one time. Empty: no limit."
    )
    max_gb = models.PositiveIntegerField(
        "GiB at once",
        null=True,
        blank=True,
        help_text="GPU memory held at any one time, in GiB (a whole card counts its full memory).",
    )
    gpu_hours_per_week = models.PositiveIntegerField(
        "GPU-hours per week",
        null=True,
        blank=True,
        help_text="GPU-hours per calendar week (Monday to Sunday); a shared booking counts its "
        "fraction of the card.",
    )
    shares = models.PositiveIntegerField(
        "fair-share shares",
        default=1,
        help_text="Fair share of the queue: a team's against the other teams', a member's against "
        "their teammates'. Equal by default.",
    )

    class Meta:
        abstract = True


# The limits a member's quota must hold inside the team's (the longest booking and shares are the
# member's alone).
NESTED_LIMITS = ("max_cards", "max_gb", "gpu_hours_per_week")


def members_above_team(
    team: Mapping[str, int | None], members: Iterable[tuple[str, Mapping[str, int | None]]]
) -> dict[str, str]:
    """A member's quota fits inside the team's: by limit, the members whose own value is above the
    team's, in one message naming them, their figures and what to do; empty when all fit. The one
    rule for the team page, the API (gpus.quotas) and Django's admin (portal/admin.py)."""
    members = list(members)
    problems = {}
    for field in NESTED_LIMITS:
        limit = team.get(field)
        if limit is None:
            continue
        above = [(name, v) for name, limits in members if (v := limits.get(field)) is not None and v > limit]
        if not above:
            continue
        figures = [f"{name}'s {value}" for name, value in above]
        named = figures[0] if len(figures) == 1 else f"{', '.join(figures[:-1])} and {figures[-1]}"
        whose, verb = (f"{above[0][0]}'s quota", "is") if len(above) == 1 else ("their quotas", "are")
        highest = max(v for _, v in above)
        problems[field] = (
            f"{named} {Team._meta.get_field(field).verbose_name} {verb} above the team's {limit}: a "
            f"member's quota must fit inside the team's. Lower {whose} to at most {limit} first (on the "
            f"team page), or set the team's to at least {highest}."
        )
    return problems


class TeamQuerySet(models.QuerySet):
    def led_by(self, user: AbstractBaseUser | None) -> TeamQuerySet:
        """The teams the user leads (none for no user; an admin leads only the teams they lead)."""
        return self.filter(memberships__user=user, memberships__role=Membership.Role.LEADER)

    def restrict(self, user: AbstractBaseUser, action: str = VIEW) -> TeamQuerySet:
        """ "view": the teams the user belongs to (members and leaders); "change" (its quotas, its
        members, its channels): the teams they lead. Admins: every team. Outsiders never learn
        the rest exist."""
        check_action(action)
        if is_admin(user):
            return self
        if action == CHANGE:
            return self.led_by(user)
        return self.filter(pk__in=Membership.objects.filter(user=user).values("team_id"))


class Team(QuotaFields):
    """A lab group. Admins set its quota; its leaders set each member's within it."""

    name = models.CharField(max_length=100, unique=True)
    slug = models.SlugField(max_length=100, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, through="Membership", related_name="teams")
    auto_release_idle = models.BooleanField(
        "release idle bookings automatically",
        default=False,
        help_text="Release an idle booking IDLE_RELEASE_MINUTES after its owner was warned. Set by leaders.",
    )
    lend_idle = models.BooleanField(
        "lend idle bookings to the queue",
        default=True,
        help_text="Lend a booking idle for LEND_AFTER_MINUTES to preemptible queued jobs, which leave as "
        "soon as its owner starts something. Set by leaders.",
    )

    objects = TeamQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(QuotaFields):
    class Role(models.TextChoices):
        MEMBER = "member", "Member"
        LEADER = "leader", "Leader"

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    max_booking_hours = models.PositiveIntegerField(
        "longest booking (hours)",
        null=True,
        blank=True,
        help_text="Longest single booking, in hours. Empty: the portal's limit (BOOKING_MAX_HOURS).",
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="membership_unique_team_user")]
        ordering = ["team", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"

    @property
    def is_leader(self) -> bool:
        return self.role == self.Role.LEADER


# What a person (Profile.job_notify) or one job (jobs' Job.notify) asks to be told of its jobs:
# "start" (a queued job started), "end" (it succeeded), "fail" (it failed, timed out or was lost).
JOB_NOTIFY_EVENTS = ("start", "end", "fail")


def job_notify_default() -> list[str]:
    """Failures, and successes of long jobs (JOB_END_NOTIFY_MIN_MINUTES); starts are off."""
    return ["end", "fail"]


class Profile(models.Model):
    """What the portal knows of a person beyond Django's user: their Unix account on the GPU hosts.

    The GPU watchdog maps a process's OS user to a portal user by this account, else by the
    portal username (portal.accounts.users_by_unix_name), and jobs run as it (JOB_USER=@owner).
    Admins set it (in the admin), or a directory trusted for it does at each sign-in. A directory
    not trusted for it only claims one (unix_account_claim), which counts for nothing until an
    admin confirms it (portal.identity.unix_account_claim_confirm; docs/identity.md)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, primary_key=True, related_name="profile"
    )
    unix_account = models.CharField(
        max_length=32,
        unique=True,
        null=True,
        blank=True,
        help_text="Their login name on the GPU hosts, when it is not their portal username.",
    )
    time_zone = models.CharField(
        max_length=64,
        blank=True,
        help_text="Where every time is shown and typed for them (an IANA name); empty: their browser's.",
    )
    unix_account_claim = models.CharField(
        max_length=32,
        null=True,
        blank=True,
        help_text="The Unix account their directory claims for them, from a source not trusted for "
        "it: used by nothing until an admin confirms it (action “Confirm claimed Unix account”).",
    )
    job_notify = models.JSONField(
        default=job_notify_default,
        blank=True,
        help_text='What to be told of their jobs, of "start", "end" (successes of jobs longer than '
        'JOB_END_NOTIFY_MIN_MINUTES) and "fail"; a job\'s own choice wins.',
    )

    def __str__(self) -> str:
        return f"profile of {self.user}"


class AuditEntry(models.Model):
    """Who did what, when: every booking action and quota change. Never edited."""

    class Action(models.TextChoices):
        RESERVATION_CREATE = "reservation.create", "Booked"
        RESERVATION_CANCEL = "reservation.cancel", "Cancelled"
        RESERVATION_RELEASE = "reservation.release", "Released early"
        RESERVATION_EXTEND = "reservation.extend", "Extended"
        QUOTA_TEAM = "quota.team", "Team quota changed"
        QUOTA_MEMBER = "quota.member", "Member quota changed"
        TEAM_AUTO_RELEASE = "team.auto_release", "Auto-release of idle bookings changed"
        TEAM_LEND_IDLE = "team.lend_idle", "Lending of idle bookings changed"
        WATCHDOG_STOP = "watchdog.stop", "GPU watchdog stopped a process"
        API_TOKEN_CREATE = "api_token.create", "API token created"
        API_TOKEN_REVOKE = "api_token.revoke", "API token revoked"
        SIGNIN_UNLOCK = "signin.unlock", "Sign-in unlocked"
        IDENTITY_SYNC = "identity.sync", "Set from the lab's directory"
        JOB_CANCEL = "job.cancel", "Jobs cancelled"
        SESSION_STOP = "session.stop", "Interactive session stopped"
        JOB_LOST = "job.lost", "Job lost: followed no more"
        TEAM_CREATE = "team.create", "Team created"
        TEAM_MEMBERS = "team.members", "Team members changed"
        SERVER_DRAIN = "server.drain", "Server drained or back in service"
        VIOLATION_STOP = "violation.stop", "Violation: stop asked for"
        VIOLATION_RESOLVE = "violation.resolve", "Violation marked resolved"

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    team = models.ForeignKey(Team, null=True, on_delete=models.SET_NULL, related_name="audit_entries")
    action = models.CharField(max_length=32, choices=Action.choices)
    target = models.CharField(max_length=200, help_text="What was acted on, e.g. 'reservation 12'.")
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["team", "-at"], name="audit_team_at")]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M} {self.actor}: {self.message}"


class WatchdogKind(models.TextChoices):
    """What the GPU watchdog finds on a card, one label each (docs/watchdog.md). The one list:
    gpus' Violation.Kind is this, jobs.watchdog.rules's verdicts and Notification.Kind take their values
    and labels from it. Here, in the lowest app, because notifications name them too."""

    ESCAPED = "escaped", "Escaped: a job's process on a card its booking does not hold"
    OVER_MEMORY = "over_memory", "Over memory: a job above its booked memory on a shared card"
    INTRUDER = "intruder", "Intruder: a process the portal did not start, on someone else's booking"
    OWNER_OUTSIDE_JOB = "owner_outside_job", "Owner outside a job: the booking's owner, not in a job"
    UNBOOKED = "unbooked", "Unbooked: a process the portal did not start, on a card nobody booked"
    ZOMBIE = "zombie", "Zombie: a process of a job that has ended, still holding memory"


class Notification(models.Model):
    """One message to one person, always in their inbox (/notifications/); a copy goes by mail
    when they want its kind by mail (MailPreference) and no mail with the same `key` went to
    them lately. Written by portal.notifications.notification_send; only read_at and the mail
    fields change afterwards. docs/notifications.md says what is sent to whom."""

    class Kind(models.TextChoices):
        """Every kind, in one place: the watchdog's findings on a card (WatchdogKind's, with its
        labels), then what happened to a booking or a job. A new kind is mailed by default unless
        listed in MAIL_OFF_BY_DEFAULT."""

        INTRUDER = WatchdogKind.INTRUDER.value, WatchdogKind.INTRUDER.label
        OVER_MEMORY = WatchdogKind.OVER_MEMORY.value, WatchdogKind.OVER_MEMORY.label
        ESCAPED = WatchdogKind.ESCAPED.value, WatchdogKind.ESCAPED.label
        ZOMBIE = WatchdogKind.ZOMBIE.value, WatchdogKind.ZOMBIE.label
        UNBOOKED = WatchdogKind.UNBOOKED.value, WatchdogKind.UNBOOKED.label
        OWNER_OUTSIDE_JOB = WatchdogKind.OWNER_OUTSIDE_JOB.value, WatchdogKind.OWNER_OUTSIDE_JOB.label
        IDLE_BOOKING = "idle_booking", "Idle booking: a booked card is not used"
        BOOKING_RELEASED = "booking_released", "Booking released: a booking was ended early for you"
        JOB_STOPPED = "job_stopped", "Job stopped: a job was stopped for you"
        SESSION_ENDING = "session_ending", "Session ending: a booking under your gpu exec ends soon"
        JOB_STARTED = "job_started", "Job started: a queued job of yours started after waiting"
        JOB_SUCCEEDED = "job_succeeded", "Job succeeded: a job of yours ended well"
        JOB_FAILED = "job_failed", "Job failed: a job of yours failed, timed out or was lost"

    # A process on a card nobody booked harms no one yet: inbox only, unless the person asks.
    MAIL_OFF_BY_DEFAULT = frozenset({Kind.UNBOOKED})

    class Mail(models.TextChoices):
        """What became of the mail copy. Set at creation to one of the first four; then
        QUEUED → SENDING (the task claims it) → SENT or FAILED, or back to QUEUED to retry a
        temporary SMTP error. A worker lost while SENDING leaves it there (never sent twice)."""

        NOT_WANTED = "not_wanted", "Not wanted (mail preferences)"
        NO_ADDRESS = "no_address", "No email address"
        REPEAT = "repeat", "Same key mailed recently"
        QUEUED = "queued", "Queued"
        SENDING = "sending", "Sending"
        SENT = "sent", "Sent"
        FAILED = "failed", "Failed"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notifications")
    kind = models.CharField(max_length=32, choices=Kind.choices)
    subject = models.CharField(max_length=200)
    body = models.TextField()
    url = models.CharField(max_length=500, blank=True, help_text="A path into the portal, e.g. /jobs/12/.")
    key = models.CharField(
        max_length=100,
        blank=True,
        help_text="Chosen by the sender, e.g. 'violation:42': at most one mail per key and person "
        "every NOTIFY_MAIL_EVERY_MINUTES. Empty: never held back.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    read_at = models.DateTimeField(null=True, blank=True)
    mail_status = models.CharField(max_length=12, choices=Mail.choices)
    mailed_at = models.DateTimeField(null=True, blank=True)
    # When its last Celery message went out: a QUEUED mail with none for MAIL_REQUEUE_MINUTES lost
    # its message (Redis restarted) and is sent again (portal.mail.mail_stranded_requeue).
    mail_queued_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["user", "-created_at"], name="notification_user_created"),
            # The bell's count on every page: only the unread rows are in it.
            models.Index(fields=["user"], condition=models.Q(read_at=None), name="notification_unread"),
            models.Index(fields=["user", "key", "created_at"], name="notification_user_key"),
        ]

    def __str__(self) -> str:
        return f"{self.user}: {self.subject}"


class MailPreference(models.Model):
    """Which kinds of notification a person wants by mail too (their inbox gets every kind).

    No row, or a kind missing from `mail`: that kind's default, so a kind added later starts at
    its default for everyone, not off for whoever once saved the form."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, primary_key=True, related_name="mail_preference"
    )
    mail = models.JSONField(default=dict, blank=True, help_text="{kind: true or false}")

    def __str__(self) -> str:
        return f"mail preferences of {self.user}"

    def wants(self, kind: str) -> bool:
        return bool(self.mail.get(kind, kind not in Notification.MAIL_OFF_BY_DEFAULT))


class ApiToken(models.Model):
    """A key for the API (`Authorization: Token <key>`), of which only a hash is kept: a database
    dump hands out no working token. The key is shown once, when made (portal.tokens).

    Active → revoked (revoked_at set, for good) or expired (expires_at passed); neither comes back."""

    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        EXPIRED = "expired", "Expired"
        REVOKED = "revoked", "Revoked"

    PREFIX_LENGTH = 8

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, help_text="What it is for, e.g. 'gpu CLI on laptop'.")
    prefix = models.CharField(
        max_length=PREFIX_LENGTH,
        db_index=True,
        help_text="The key's first characters: shown, and used to find it.",
    )
    # SHA-256, not a slow password hash: the key is 160 random bits, so there is nothing to guess
    # by brute force, and a fast hash costs nothing on every API request.
    key_hash = models.CharField(max_length=64, unique=True)
    # A default, not auto_now_add, so the migration keeps the dates of the tokens it hashes.
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Empty: until revoked.")
    last_used_at = models.DateTimeField(null=True, blank=True, help_text="To the minute.")
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"“{self.name}” ({self.prefix}…)"

    @staticmethod
    def new_key() -> str:
        """160 random bits in hex, like the keys of DRF's authtoken before it, so a key can still
        be double-clicked whole and pasted anywhere."""
        return secrets.token_hex(20)

    @staticmethod
    def hash_key(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    @property
    def ends_at(self) -> datetime | None:
        """When it stops working: its expiry, or earlier where API_TOKEN_MAX_DAYS says so, which
        also ends the tokens made before there was a maximum (the ones hashed from before 0008)."""
        if not settings.API_TOKEN_MAX_DAYS:
            return self.expires_at
        latest = self.created_at + timedelta(days=settings.API_TOKEN_MAX_DAYS)
        return min(self.expires_at, latest) if self.expires_at else latest

    def status(self, now: datetime | None = None) -> ApiToken.Status:
        if self.revoked_at is not None:
            return self.Status.REVOKED
        ends_at = self.ends_at
        if ends_at is not None and ends_at <= (now or timezone.now()):
            return self.Status.EXPIRED
        return self.Status.ACTIVE


class ExternalAccount(models.Model):
    """A person at the lab's directory, bound to the portal user they sign in as.

    Directory sign-ins find their user by (source, issuer, subject), never by a name the person
    or the provider's users can change: an OIDC provider's `sub`, an LDAP entry's DN. Made by
    portal.identity.external_account_link on a first sign-in, or by an admin by hand to link an
    account the rules refuse to link on their own (docs/identity.md)."""

    class Source(models.TextChoices):
        LDAP = "ldap", "LDAP"
        OIDC = "oidc", "Single sign-on"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="external_accounts"
    )
    source = models.CharField(max_length=8, choices=Source.choices)
    issuer = models.CharField(max_length=500, help_text="The OIDC issuer, or the LDAP server URI.")
    subject = models.CharField(max_length=500, help_text="The OIDC subject (sub), or the LDAP entry's DN.")
    created_at = models.DateTimeField(auto_now_add=True)
    last_login_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["source", "issuer", "subject"], name="external_account_source_issuer_subject"
            )
        ]

    def __str__(self) -> str:
        return f"{self.get_source_display()} {self.subject} at {self.issuer} → {self.user}"


class NotificationChannel(models.Model):
    """A chat room or webhook that gets a copy of notifications, through apprise (portal.channels):
    a person's own (their events) or a team's (the team's events: violations, idle bookings, quota
    refusals), never both (a database check). The URL holds its service's secret: it is stored
    encrypted (url_encrypted, Fernet) beside a masked form (url_masked) that lists show, so a list
    never decrypts and nothing shows or logs the URL in clear. docs/notifications.md."""

    # Only team channels get it: a refused booking is told to its person in the answer itself.
    QUOTA_REFUSED = "quota_refused"
    QUOTA_REFUSED_LABEL = "Quota refusal: a booking was refused by a quota of the team"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="notification_channels",
    )
    team = models.ForeignKey(
        Team, null=True, blank=True, on_delete=models.CASCADE, related_name="notification_channels"
    )
    label = models.CharField(max_length=100, blank=True, help_text="What it is, e.g. '#gpu-alerts on Slack'.")
    url_encrypted = models.TextField(help_text="The apprise URL, a Fernet token (portal.channels).")
    url_masked = models.CharField(max_length=1000, help_text="The URL with its secrets masked, for lists.")
    events = models.JSONField(default=list, blank=True, help_text="Event kinds sent; empty: all the owner's.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_sent_at = models.DateTimeField(null=True, blank=True)
    # "Send a test" claims it by a conditional UPDATE: one test per CHANNEL_TEST_EVERY_SECONDS, since
    # each holds a web worker until the service answers (portal.channels.channel_test).
    last_tested_at = models.DateTimeField(null=True, blank=True)
    # What the service answered last time it failed (its secrets masked); empty after a success.
    last_error = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(user__isnull=False, team__isnull=True)
                | models.Q(user__isnull=True, team__isnull=False),
                name="notification_channel_one_owner",
            )
        ]

    def __str__(self) -> str:
        return self.label or self.url_masked

    def wants(self, kind: str) -> bool:
        return not self.events or kind in self.events


class ChannelDelivery(models.Model):
    """One message to one channel (a notification's copy, or a team event). The row is the record:
    the Celery message (portal.tasks.channel_deliver) only carries its id.

    QUEUED → SENDING (claimed by a conditional UPDATE) → SENT or FAILED, or back to QUEUED to retry
    a failure with backoff up to CHANNEL_RETRIES. A worker lost while SENDING leaves it there (never
    sent twice); a QUEUED one whose message was lost is sent again by beat
    (portal.channels.channel_stranded_requeue)."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        SENDING = "sending", "Sending"
        SENT = "sent", "Sent"
        FAILED = "failed", "Failed"

    channel = models.ForeignKey(NotificationChannel, on_delete=models.CASCADE, related_name="deliveries")
    notification = models.ForeignKey(
        Notification, null=True, blank=True, on_delete=models.CASCADE, related_name="channel_deliveries"
    )
    kind = models.CharField(max_length=32)
    subject = models.CharField(max_length=200)
    body = models.TextField()
    url = models.CharField(max_length=500, blank=True)
    key = models.CharField(max_length=100, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    attempts = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    queued_at = models.DateTimeField(
        null=True, blank=True, help_text="When its last Celery message went out."
    )
    sent_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "channel deliveries"
        constraints = [
            models.UniqueConstraint(
                fields=["channel", "notification"],
                condition=models.Q(notification__isnull=False),
                name="channel_delivery_once_per_notification",
            )
        ]
        indexes = [
            models.Index(fields=["channel", "key", "created_at"], name="channel_delivery_key"),
            models.Index(fields=["status", "queued_at"], name="channel_delivery_status"),
        ]

    def __str__(self) -> str:
        return f"{self.channel}: {self.subject} ({self.status})"


class IdempotentRequest(models.Model):
    """A change the API made under its client's `Idempotency-Key` (portal.idempotency): sent again
    with the same key, the request gets this answer again instead of being done twice. Claimed
    (answer_status 0) before the change, its answer kept after."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, help_text="SHA-256 of the method, the path and the body.")
    method = models.CharField(max_length=10)
    path = models.CharField(max_length=500)
    answer_status = models.PositiveSmallIntegerField(
        default=0, help_text="The answer's status; 0 while it runs."
    )
    content_type = models.CharField(max_length=200, blank=True)
    content = models.BinaryField(blank=True, default=b"", help_text="The answer's body, as first sent.")
    unknown = models.BooleanField(
        default=False, help_text="A 5xx after the request wrote: whether its change was made is not known."
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "key"], name="idempotent_request_unique_key")]

    def __str__(self) -> str:
        return f"{self.method} {self.path} under key {self.key!r}"
