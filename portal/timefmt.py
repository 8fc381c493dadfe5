"""How the portal writes times and durations: one place, so every page, message and log agrees.

Times are shown in Django's current time zone: the person's own (portal.middleware.TimeZoneMiddleware:
their profile's, else their browser's), else the portal's TIME_ZONE.
"""

from __future__ import annotations

import zoneinfo
from datetime import datetime, timedelta

from django.utils import timezone

TIME_ZONE_MAX = 64


def valid_time_zone(name: str) -> str | None:
    """The IANA zone `name` names, or None for anything else (a typo, a path, a huge string)."""
    name = (name or "").strip()
    if not name or len(name) > TIME_ZONE_MAX or name.startswith(("/", ".")) or ".." in name:
        return None
    try:
        zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        return None
    return name


def format_time(at: datetime) -> str:
    """'Mon 2026-11-23 14:00 UTC': messages, refusals and the audit log."""
    return timezone.localtime(at).strftime("%a %Y-%m-%d %H:%M %Z")


def short_time(at: datetime) -> str:
    """'Mon 14:00': tables and labels where the week is context enough."""
    return timezone.localtime(at).strftime("%a %H:%M")


def format_duration(duration: timedelta | None) -> str:
    """'1 h 02 min', '3 min 07 s', '12 s'; '' for no duration (a job that has not started)."""
    if duration is None:
        return ""
    seconds = max(0, int(duration.total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"
