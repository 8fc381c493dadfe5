"""Slurm clusters as servers (docs/slurm.md), read by portal/settings.py (kept apart for that
module's length)."""

from __future__ import annotations

from portal.env import env_int

__all__ = ["SLURM_LOST_AFTER_SECONDS"]

# How long a Slurm job is followed without news: its cluster not answering, Slurm naming a state
# the portal does not know, or (the reconciler's cut-off for Slurm jobs) its cluster's worker
# silent. Slurm runs the job on meanwhile, and a worker restarted within it follows the job again;
# past it the job ends lost, saying what Slurm last said and when.
SLURM_LOST_AFTER_SECONDS = env_int("SLURM_LOST_AFTER_SECONDS", 600, min_value=10, max_value=7 * 24 * 3600)
