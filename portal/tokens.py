"""API tokens: `Authorization: Token <key>`, checked against the SHA-256 hash that is all the
database keeps (portal.models.ApiToken), and the profile's form for a new one.

A key is 40 hex characters; its first 8 (`prefix`) find the row, and the hash of the whole key
is compared in constant time. Expired and revoked tokens get a 401 that says so, and what to do.
"""

from __future__ import annotations

import hmac
from datetime import datetime, timedelta

from django import forms
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.utils import timezone
from rest_framework import authentication, exceptions

from portal.forms import ServiceErrorsMixin
from portal.models import ApiToken
from portal.services import api_token_mark_used

# Without a maximum (API_TOKEN_MAX_DAYS=0), the longest expiry a form or the API accepts.
EXPIRY_DAYS_CEILING = 10 * 365


class TokenAuthentication(authentication.TokenAuthentication):
    """DRF's header parsing (`Token <key>`, the same header as before hashing, so `gpu` and
    scripts keep working), with the key looked up by its hash."""

    def authenticate_credentials(self, key: str) -> tuple[AbstractBaseUser, ApiToken]:
        token = api_token_find(key)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        now = timezone.now()
        status = token.status(now)
        if status == ApiToken.Status.REVOKED:
            raise exceptions.AuthenticationFailed(
                f"This API token ({token.prefix}…) was revoked on {token.revoked_at:%Y-%m-%d}: "
                "create a new one on your profile page, or run `gpu login` again."
            )
        if status == ApiToken.Status.EXPIRED:
            raise exceptions.AuthenticationFailed(
                f"This API token ({token.prefix}…) expired on {token.ends_at:%Y-%m-%d}: "
                "create a new one on your profile page, or run `gpu login` again."
            )
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        api_token_mark_used(token=token, now=now)
        return token.user, token


def api_token_find(key: str) -> ApiToken | None:
    """The token whose key this is, whatever its state; None for no token at all."""
    digest = ApiToken.hash_key(key)
    candidates = ApiToken.objects.filter(prefix=key[: ApiToken.PREFIX_LENGTH]).select_related("user")
    for token in candidates:
        # Constant time, so the answer's timing tells nothing about how much of a hash matched.
        if hmac.compare_digest(token.key_hash, digest):
            return token
    return None


def api_token_expiry(days: int | None, *, now: datetime | None = None) -> datetime | None:
    """When a token asked to last `days` (None: the portal's default) expires; None: never."""
    days = days or settings.API_TOKEN_DEFAULT_DAYS
    return (now or timezone.now()) + timedelta(days=days) if days else None


def expiry_days_max() -> int:
    return settings.API_TOKEN_MAX_DAYS or EXPIRY_DAYS_CEILING


def expiry_days_help() -> str:
    default = settings.API_TOKEN_DEFAULT_DAYS
    default_text = f"{default} days" if default else "never expires"
    if settings.API_TOKEN_MAX_DAYS:
        return f"1 to {settings.API_TOKEN_MAX_DAYS}. Empty: {default_text}."
    return f"Empty: {default_text}."


class ApiTokenForm(ServiceErrorsMixin, forms.Form):
    """The profile's "new token" form. It lives here, beside the authentication it belongs with;
    api_token_create checks the same rules for the API."""

    service_fields = {"expires_at": "expires_in_days"}

    name = forms.CharField(
        max_length=100,
        label="Name",
        help_text="What it is for, e.g. 'laptop' or 'training scripts'.",
        error_messages={
            "required": "Name: give the token a name, e.g. 'laptop'.",
            "max_length": "Name: at most %(limit_value)d characters.",
        },
    )

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        # Built here, not on the class: its limit is a setting, read when the form is made.
        self.fields["expires_in_days"] = forms.IntegerField(
            required=False,
            label="Expires in (days)",
            min_value=1,
            max_value=expiry_days_max(),
            help_text=expiry_days_help(),
            error_messages={
                "invalid": "Expires in (days): enter a whole number of days, or leave it empty.",
                "min_value": "Expires in (days): at least 1 day.",
                "max_value": "Expires in (days): at most %(limit_value)s days on this portal.",
            },
        )
