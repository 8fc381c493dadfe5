"""The REST API's own settings (the rest sit in portal/settings.py's REST_FRAMEWORK)."""

from __future__ import annotations

from portal.env import env_int

__all__ = ["API_BEAT_SCHEDULE", "IDEMPOTENCY_IN_PROGRESS_SECONDS", "IDEMPOTENCY_KEY_HOURS"]

# How long a change made under an Idempotency-Key is remembered (portal.idempotency): a client
# that sends it again later gets it done again. Pruned daily by the portal's worker.
IDEMPOTENCY_KEY_HOURS = env_int("IDEMPOTENCY_KEY_HOURS", 24, min_value=1, max_value=24 * 30)
# A key claimed this long without an answer (the portal stopped, or lost its database, while doing
# its request) is answered "unknown" instead of "still being done". Longer than any request takes:
# a Slurm cluster's check may wait 300 s.
IDEMPOTENCY_IN_PROGRESS_SECONDS = env_int(
    "IDEMPOTENCY_IN_PROGRESS_SECONDS", 600, min_value=330, max_value=3600
)
API_BEAT_SCHEDULE = {
    "prune-idempotency-keys": {"task": "portal.tasks.prune_idempotency_keys", "schedule": 24 * 3600.0},
}
