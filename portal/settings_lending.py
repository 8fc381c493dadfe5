"""Preemptible jobs and lending idle bookings to the queue (docs/queue.md, "Preemptible jobs";
docs/booking.md, "Lending idle bookings"), read by portal/settings.py (kept apart for that
module's length)."""

from __future__ import annotations

from portal.env import env_int

__all__ = [
    "LENDING_BEAT_SCHEDULE",
    "LEND_AFTER_MINUTES",
    "LEND_GRACE_SECONDS",
    "NO_SHOW_MINUTES",
    "PREEMPT_GRACE_SECONDS",
]

# A preempted job gets SIGTERM, then SIGKILL this much later, and goes back to the queue at its old
# place. At most 100 s, as JOB_KILL_GRACE_SECONDS: systemd stops a worker after 120 s.
PREEMPT_GRACE_SECONDS = env_int("PREEMPT_GRACE_SECONDS", 60, min_value=1, max_value=100)
# A booking idle this long (gpus/idle.py's clock) may have preemptible queued jobs on its cards.
LEND_AFTER_MINUTES = env_int("LEND_AFTER_MINUTES", 15, min_value=1, max_value=7 * 24 * 60)
# A borrower leaves a lent card within this grace when the owner comes back (the owner waits for it).
LEND_GRACE_SECONDS = env_int("LEND_GRACE_SECONDS", 20, min_value=1, max_value=100)
# A booking unused from its start this long is a no-show: its owner is told.
NO_SHOW_MINUTES = env_int("NO_SHOW_MINUTES", 30, min_value=1, max_value=7 * 24 * 60)

LENDING_BEAT_SCHEDULE = {
    # /metrics' lending counters read the loans settled a day after their end as totals
    # (jobs/lending_report.py): hourly, so a scrape reads about a day of loans, never all of them.
    "settle-lending": {"task": "jobs.tasks.settle_lending", "schedule": 3600.0},
}
