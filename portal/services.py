"""Accounts and teams: API tokens, sign-in unlocks and the demo data. Quota limits are set in
gpus/quotas.py."""

from __future__ import annotations

from datetime import datetime, timedelta

from axes.handlers.proxy import AxesProxyHandler
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from portal.access import is_admin
from portal.errors import Forbidden, Invalid
from portal.models import ApiToken, AuditEntry, Membership, Team
from portal.names import signin_name
from portal.timefmt import format_time

User = get_user_model()

# last_used_at is written at most this often per token, not on every request.
API_TOKEN_USE_RESOLUTION = timedelta(minutes=1)


@transaction.atomic
def api_token_create(
    *, user: AbstractBaseUser, name: str, expires_at: datetime | None
) -> tuple[ApiToken, str]:
    """A new token for `user` and its key, which is never stored and cannot be shown again."""
    name = name.strip()
    if not name:
        raise Invalid("Give the token a name, e.g. 'laptop' or 'training scripts'.", field="name")
    if len(name) > ApiToken._meta.get_field("name").max_length:
        raise Invalid("The name is too long: at most 100 characters.", field="name")
    _check_expiry(expires_at)
    key = ApiToken.new_key()
    token = ApiToken.objects.create(
        user=user,
        name=name,
        prefix=key[: ApiToken.PREFIX_LENGTH],
        key_hash=ApiToken.hash_key(key),
        expires_at=expires_at,
    )
    # format_time, as every audit line: the expiry's own zone (UTC, or the API caller's) unnamed misleads.
    until = f"until {format_time(expires_at)}" if expires_at else "with no expiry"
    _audit(user, token, AuditEntry.Action.API_TOKEN_CREATE, f"{user} created API token {token}, {until}")
    return token, key


def _check_expiry(expires_at: datetime | None) -> None:
    now = timezone.now()
    if expires_at is not None and expires_at <= now:
        raise Invalid("The expiry must be in the future.", field="expires_at")
    max_days = settings.API_TOKEN_MAX_DAYS
    # A minute's slack: "max days from now" is computed a moment before this check.
    if max_days and (expires_at is None or expires_at > now + timedelta(days=max_days, minutes=1)):
        raise Invalid(f"A token may last at most {max_days} days on this portal.", field="expires_at")


@transaction.atomic
def api_token_revoke(*, token: ApiToken, by: AbstractBaseUser) -> bool:
    """Revoke for good (its owner or an admin). False: it was revoked already; nothing changed."""
    if by.pk != token.user_id and not is_admin(by):
        raise Forbidden("Only its owner or an admin can revoke an API token.")
    now = timezone.now()
    if not ApiToken.objects.filter(pk=token.pk, revoked_at=None).update(revoked_at=now):
        return False
    token.revoked_at = now
    _audit(by, token, AuditEntry.Action.API_TOKEN_REVOKE, f"{by} revoked API token {token}")
    return True


def api_token_mark_used(*, token: ApiToken, now: datetime) -> None:
    """Record a use, to the minute: most requests find it recent and write nothing. No transaction
    of its own: the one UPDATE is atomic, and a transaction would take SQLite's write lock on
    every API request (IMMEDIATE mode)."""
    if token.last_used_at is not None and token.last_used_at > now - API_TOKEN_USE_RESOLUTION:
        return
    stale = Q(last_used_at=None) | Q(last_used_at__lte=now - API_TOKEN_USE_RESOLUTION)
    ApiToken.objects.filter(stale, pk=token.pk).update(last_used_at=now)
    token.last_used_at = now


def _audit(actor: AbstractBaseUser, token: ApiToken, action: str, message: str) -> None:
    AuditEntry.objects.create(
        actor=actor,
        action=action,
        target=f"api token {token.pk}",
        message=message,
        data={"user": token.user.get_username(), "name": token.name, "prefix": token.prefix},
    )


@transaction.atomic
def signin_unlock(*, user: AbstractBaseUser, by: AbstractBaseUser) -> int:
    """Clear the failed sign-ins counted against `user`'s account (django-axes), so the next try
    is checked at once. A locked client address is unlocked in the admin's Access attempts.
    Returns how many attempt records were cleared."""
    username = user.get_username()
    cleared = AxesProxyHandler.reset_attempts(username=signin_name(username))
    AuditEntry.objects.create(
        actor=by,
        action=AuditEntry.Action.SIGNIN_UNLOCK,
        target=f"user {username}",
        message=f"{by} unlocked sign-in for {username}",
        data={"cleared": cleared},
    )
    return cleared


def signin_failures_prune() -> int:
    """Forget failed sign-ins older than LOGIN_FAILURE_LOG_DAYS (django-axes' failure log, kept for
    the record; the locks themselves live in AccessAttempt and expire by themselves)."""
    return AxesProxyHandler.reset_failure_logs(age_days=settings.LOGIN_FAILURE_LOG_DAYS)


def demo_data_seed(*, password: str) -> bool:
    """Create the demo team and users on an empty database; a no-op when any user exists."""
    if User.objects.exists():
        return False
    User.objects.create_superuser("admin", "admin@example.org", password)
    # Demo quotas, so the limits can be tried: the team may hold 8 cards / 256 GB at once and
    # 400 GPU-hours a week; bob, a student, at most 2 cards and 24 h per booking.
    team = Team.objects.create(
        name="Vision Lab", slug="vision-lab", max_cards=8, max_gb=256, gpu_hours_per_week=400
    )
    for username, role, limits in (
        ("leader", Membership.Role.LEADER, {}),
        ("alice", Membership.Role.MEMBER, {}),
        ("bob", Membership.Role.MEMBER, {"max_cards": 2, "max_booking_hours": 24}),
    ):
        user = User.objects.create_user(username, f"{username}@example.org", password)
        Membership.objects.create(team=team, user=user, role=role, **limits)
    return True
