"""What the GPU watchdog writes and says of a violation, and what people asked of the open ones.

jobs/host/watchdog.py decides when: here are the words (the next step a warning announces, the
measurement a stopped job's log and end carry), the audit entry of a stop or a failed stop, and
the requests people made on a violation's page (gpus/violations.py: stop it now, or resolved),
read once a round while the host has open violations.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from gpus.inventory import ProcessInfo
from gpus.models import Violation, WatchdogPolicy, format_mb
from jobs.watchdog.rules import Kind, Verdict
from portal.models import AuditEntry


@dataclass(frozen=True)
class Asked:
    """What someone asked of an open violation: stop it now (`by`, `reason`), or leave it be
    (`resolved`: never stopped from then on; a stop under way goes on)."""

    by: str
    reason: str
    resolved: bool


def violation_of(pk: int) -> Violation:
    return Violation.objects.select_related("gpu__server", "user", "reservation__owner").get(pk=pk)


def announced_step(action: str, grace: int, now: datetime, process: ProcessInfo) -> str:
    if action != WatchdogPolicy.Action.STOP:
        return "The policy for this kind is to warn: nothing will be stopped."
    if settings.WATCHDOG_DRY_RUN:
        return "The watchdog runs dry (WATCHDOG_DRY_RUN): it will not stop it."
    if process.session_id is not None and process.started is None:
        return "It will not be stopped: its start time could not be read, so it cannot be proven to be it."
    at = timezone.localtime(now + timedelta(seconds=grace))
    # %Z: the worker writes in TIME_ZONE, and its reader may live in another zone (portal/time_zones.py).
    return f"Unless it ends first, it will be stopped at {at:%H:%M:%S %Z} (the policy: stop after {grace} s)."


def stop_words(verdict: Verdict, asked: Asked | None) -> str:
    """Why a job is stopped, as its log and its end say it: the rule and the measurement, and who
    asked for the stop (and why) when someone did."""
    if asked is None:
        return f"Stopped by the GPU watchdog: {measured(verdict)}"
    why = f" ({asked.reason})" if asked.reason else ""
    return f"Stopped by the GPU watchdog at {asked.by}'s request{why}: {measured(verdict)}"


def measured(verdict: Verdict) -> str:
    card = verdict.gpu_uuid
    if verdict.kind == Kind.OVER_MEMORY:
        whose = f"job {verdict.job_id}" if verdict.job_id is not None else "the owner's processes"
        return (
            f"over_memory: {whose} used {format_mb(verdict.memory_mb or 0)} on {card}, "
            f"above its booked {format_mb(verdict.booked_mb or 0)} + "
            f"{settings.WATCHDOG_MEMORY_TOLERANCE_MB} MiB tolerance."
        )
    pid = verdict.process.pid
    return f"escaped: job {verdict.job_id} ran pid {pid} on {card}, which its booking does not hold."


def summary(violation: Violation) -> str:
    memory = f", {format_mb(violation.memory_mb)}" if violation.memory_mb is not None else ""
    return f"{violation.get_kind_display()} (pid {violation.pid} of {violation.os_user or '?'}{memory})"


def audit(violation: Violation, message: str) -> None:
    """A stop or a failed stop, in the audit log; naming who asked for it, when someone did."""
    if violation.stop_requested_at is not None:
        by = violation.stop_requested_by.username if violation.stop_requested_by else "someone"
        message += f" (asked for by {by})"
    AuditEntry.objects.create(
        actor=None,
        team_id=violation.reservation.team_id if violation.reservation else None,
        action=AuditEntry.Action.WATCHDOG_STOP,
        target=f"violation {violation.pk}",
        message=message,
        data={
            "kind": violation.kind,
            "gpu": violation.gpu_id,
            "pid": violation.pid,
            "job": violation.job_id,
            "memory_mb": violation.memory_mb,
            "asked_by": violation.stop_requested_by_id,
        },
    )
