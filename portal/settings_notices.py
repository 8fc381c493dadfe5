"""Job notices (docs/notifications.md, "Jobs"), read by portal/settings.py (kept apart for that
module's length)."""

from __future__ import annotations

from portal.env import env_int

__all__ = ["JOB_END_NOTIFY_MIN_MINUTES"]

# A success is told by default only for a job that ran at least this long: nobody wants a message
# for a two-minute test they watched end. Failures are told whatever their length; a job that asks
# for `end` itself is told whatever its length too.
JOB_END_NOTIFY_MIN_MINUTES = env_int("JOB_END_NOTIFY_MIN_MINUTES", 10, min_value=0, max_value=7 * 24 * 60)
