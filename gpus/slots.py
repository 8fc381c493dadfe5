"""What gpus shows on portal's pages (portal/hooks.py), filled in GpusConfig.ready()."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.template import Context

from gpus.quota_usage import member_quotas
from portal.hooks import PROFILE_QUOTAS, slot_fill


def my_quotas(context: Context) -> Mapping[str, Any]:
    """The profile's "Teams and quotas": the viewer's quota in each of their teams, with their use
    now and this week. The page is portal's (the account, its tokens); the use is counted from
    bookings here."""
    memberships = member_quotas(context["request"].user)
    return {"memberships": memberships, "BOOKING_MAX_HOURS": settings.BOOKING_MAX_HOURS}


def slots_fill() -> None:
    slot_fill(PROFILE_QUOTAS, "gpus/_my_quotas.html", my_quotas)
