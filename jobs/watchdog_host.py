"""The GPU watchdog on a GPU host: each round, judge every process on the host's cards and act.

It runs in the host's worker, on the reporter's thread: the reporter reads the cards every
WATCHDOG_INTERVAL_SECONDS (gpus/telemetry.py) and hands each snapshot here through the
`snapshot_read` signal, so the watchdog and the dashboard judge the same processes. A round
costs two queries (the bookings active on this host's cards, its running and recently ended
jobs), one more when processes of unknown OS users need their portal accounts, and writes only
when a violation starts, changes or ends.

What happens to a violation is the policy of its kind (gpus.models.WatchdogPolicy): observe
(record), warn (record and tell: the offender, the owner of the booking whose card was taken,
the offender's team leaders on repeat offences), or stop: warn at once, and once the grace
period has passed, stop the process: a running job through its own supervisor (which sends
SIGTERM to its process group and SIGKILL after JOB_KILL_GRACE_SECONDS, and records the job as
failed with the rule and the measurement), any other process by SIGTERM, then SIGKILL after the
same grace. The violation is `stopped` once NVML no longer lists the process.

Only real processes are ever signalled: the pid must still head the session the backend saw
(`gpus.procinfo.session_of`), so a recycled pid and the simulation's invented processes (which
have no session) are left alone. WATCHDOG_DRY_RUN records and notifies but never signals.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

import psutil
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from gpus.inventory import Snapshot
from gpus.models import Allocation, Server, Violation, WatchdogPolicy, format_mb
from gpus.procinfo import session_of
from jobs.models import Job
from jobs.watchdog import BookingFacts, JobFacts, Kind, Verdict, classify
from jobs.watchdog_notify import tell_about
from portal.accounts import users_by_unix_name
from portal.models import AuditEntry

log = logging.getLogger(__name__)

ZOMBIE_LOOKBACK = timedelta(hours=1)  # a job ended longer ago has no processes left worth a look
STOP_CONFIRM_SECONDS = 10  # after SIGKILL, how long NVML may still list the process
POLICY_CACHE_SECONDS = 10
USERS_CACHE_SECONDS = 30
CLOCK_SLACK_SECONDS = 2

Policy = WatchdogPolicy.Action


@dataclass
class Tracked:
    """A violation this host is watching: its row, and where its stop stands."""

    violation_id: int
    kind: str
    first_seen: datetime
    memory_mb: int | None
    session_id: int | None
    stop_started: datetime | None = None  # the stop was asked for (job) or SIGTERM was sent
    killed: bool = False  # SIGKILL sent (direct stops only)
    finished: bool = False  # stopped, failed or dry-run: nothing more to do but watch


class HostWatchdog:
    def __init__(self, server: str, *, simulated: bool) -> None:
        self.server_name = server
        self.simulated = simulated
        self.tracked: dict[tuple[str, int, str], Tracked] = {}
        self.loaded = False
        self.server_id: int | None = None
        self._policies: tuple[datetime, dict[str, tuple[str, int]]] | None = None
        self._users: tuple[datetime, dict[str, int], frozenset[str]] | None = None

    # --- the round ------------------------------------------------------------------------

    def round(self, snapshot: Snapshot, now: datetime | None = None) -> list[Verdict]:
        """Judge one snapshot of this host's cards and act; returns every verdict."""
        now = now or timezone.now()
        if self.server_id is None:
            self.server_id = Server.objects.filter(name=self.server_name).values_list("pk", flat=True).first()
            if self.server_id is None:
                return []  # not ingested yet: the cards have no rows to hang violations on
        server = self.server_id
        if not self.loaded:
            self._load_open(server)
        verdicts = self._judge(snapshot, server, now)
        policies = self.policies(now)
        seen: set[tuple[str, int, str]] = set()
        for verdict in verdicts:
            if verdict.kind is Kind.OK:
                continue
            key = (verdict.gpu_uuid, verdict.process.pid, verdict.kind)  # a StrEnum: equal to its str
            seen.add(key)
            self._watch(key, verdict, policies[verdict.kind], server, now)
        readable = {g.uuid for g in snapshot.gpus if g.processes is not None}
        self._end_gone([k for k in self.tracked if k not in seen and k[0] in readable], now)
        if seen:
            # Every open violation on a readable card was seen this round (the others just ended):
            # one UPDATE by index, whatever their number.
            Violation.objects.filter(server_id=server, ended_at=None, gpu_id__in=readable).update(
                last_seen=now
            )
        return verdicts

    def _judge(self, snapshot: Snapshot, server: int, now: datetime) -> list[Verdict]:
        sessions = {p.session_id: p.pid for g in snapshot.gpus for p in g.processes or () if p.session_id}
        # An ended job's recorded pid may head someone else's session by now: that session is
        # the job's only if one of its processes is older than the job's end.
        jobs = [j for j in _jobs_of(server, now) if j.running or _predates_end(j, sessions)]
        names = {p.username for g in snapshot.gpus for p in g.processes or ()}
        return classify(
            snapshot.gpus,
            bookings=_bookings_now(server, now),
            jobs=jobs,
            users_by_os_name=self.users(names, now),
            tolerance_mb=settings.WATCHDOG_MEMORY_TOLERANCE_MB,
        )

    def _load_open(self, server: int) -> None:
        """A restarted worker picks up the violations it was watching, rather than starting anew."""
        rows = Violation.objects.filter(server_id=server, ended_at=None).values_list(
            "pk", "gpu_id", "pid", "kind", "first_seen", "memory_mb", "session_id", "action"
        )
        for pk, gpu, pid, kind, first_seen, memory, session, action in rows:
            finished = action in (Violation.Action.STOPPED, Violation.Action.STOP_FAILED)
            self.tracked[(gpu, pid, kind)] = Tracked(pk, kind, first_seen, memory, session, finished=finished)
        self.loaded = True

    # --- one violation ----------------------------------------------------------------------

    def _watch(
        self, key: tuple[str, int, str], verdict: Verdict, policy: tuple[str, int], server: int, now: datetime
    ) -> None:
        action, grace = policy
        tracked = self.tracked.get(key)
        if tracked is None:
            tracked = self.tracked[key] = self._record(verdict, server, now)
            if action != Policy.OBSERVE:
                self._warn(tracked, verdict, _next_step(action, grace, now))
        elif (verdict.memory_mb or 0) > (tracked.memory_mb or 0):
            tracked.memory_mb = verdict.memory_mb
            Violation.objects.filter(pk=tracked.violation_id).update(memory_mb=verdict.memory_mb)
        if tracked.finished or action != Policy.STOP:
            return
        if tracked.stop_started is None and now - tracked.first_seen >= timedelta(seconds=grace):
            self._stop(tracked, verdict, now)
        elif tracked.stop_started is not None:
            self._escalate(tracked, verdict, now)

    def _record(self, verdict: Verdict, server: int, now: datetime) -> Tracked:
        process = verdict.process
        row = Violation.objects.create(
            kind=verdict.kind.value,
            gpu_id=verdict.gpu_uuid,
            server_id=server,
            pid=process.pid,
            session_id=process.session_id,
            os_user=process.username,
            command=process.command,
            user_id=verdict.user_id,
            job_id=verdict.job_id,
            reservation_id=verdict.reservation_id,
            memory_mb=verdict.memory_mb,
            booked_mb=verdict.booked_mb,
            first_seen=now,
            last_seen=now,
        )
        # The simulation's invented processes are routine there: no warning each time one shows.
        level = logging.INFO if self._silent(verdict) else logging.WARNING
        log.log(
            level,
            "GPU watchdog: %s pid %s on %s (%s)",
            verdict.kind.value,
            process.pid,
            verdict.gpu_uuid,
            row.pk,
        )
        return Tracked(row.pk, verdict.kind.value, now, verdict.memory_mb, process.session_id)

    def _warn(self, tracked: Tracked, verdict: Verdict, next_step: str) -> None:
        Violation.objects.filter(pk=tracked.violation_id).update(
            action=Violation.Action.WARNED, action_at=tracked.first_seen
        )
        if self._silent(verdict):
            return
        tell_about(_violation(tracked), event="seen", next_step=next_step)

    def _silent(self, verdict: Verdict) -> bool:
        # The simulation invents processes with made-up pids: shown, never worth a message.
        return self.simulated and verdict.process.session_id is None

    # --- stopping -------------------------------------------------------------------------------

    def _stop(self, tracked: Tracked, verdict: Verdict, now: datetime) -> None:
        tracked.stop_started = now
        if settings.WATCHDOG_DRY_RUN:
            tracked.finished = True
            self._note(tracked, "Dry run (WATCHDOG_DRY_RUN): it would have been stopped now.", now)
            if not self._silent(verdict):
                tell_about(_violation(tracked), event="dry_run")
            return
        if verdict.job_id is not None and verdict.kind in (Kind.ESCAPED, Kind.OVER_MEMORY):
            # A running job is stopped whole, by its own supervisor: the job ends failed with the
            # rule and the measurement, and its log says why.
            message = f"Stopped by the GPU watchdog: {_measured(verdict)}"
            asked = Job.objects.filter(
                pk=verdict.job_id, status__in=(Job.Status.STARTING, Job.Status.RUNNING), watchdog_stop=""
            ).update(watchdog_stop=message[:500])
            self._note(
                tracked, "Its job was asked to stop (SIGTERM, then SIGKILL after the grace period).", now
            )
            if not asked:
                log.info("Job %s already stopping or ended", verdict.job_id)
            return
        self._signal(tracked, verdict, signal.SIGTERM, now)

    def _escalate(self, tracked: Tracked, verdict: Verdict, now: datetime) -> None:
        waited = (now - tracked.stop_started).total_seconds()
        grace = settings.JOB_KILL_GRACE_SECONDS
        direct = verdict.job_id is None or verdict.kind == Kind.ZOMBIE  # no supervisor stops it
        if direct and not tracked.killed and waited >= grace:
            tracked.killed = True
            self._signal(tracked, verdict, signal.SIGKILL, now)
            return
        if waited >= grace + STOP_CONFIRM_SECONDS:
            self._fail(tracked, f"Still on the card {waited:.0f} s after the stop began.", now)

    def _signal(self, tracked: Tracked, verdict: Verdict, sig: signal.Signals, now: datetime) -> None:
        pid = verdict.process.pid
        if verdict.process.session_id is None or session_of(pid) != verdict.process.session_id:
            # Invented by the simulation, or the pid is no longer the process that was seen.
            tracked.finished = True
            self._note(
                tracked, "Not signalled: no such process on this host (or no longer the same one).", now
            )
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return  # gone already: the next round records the stop
        except PermissionError:
            self._fail(tracked, "could not stop: permission denied (the worker needs CAP_KILL or root)", now)
            return
        self._note(tracked, f"Sent {sig.name} to pid {pid}.", now)

    def _fail(self, tracked: Tracked, why: str, now: datetime) -> None:
        tracked.finished = True
        Violation.objects.filter(pk=tracked.violation_id).update(
            action=Violation.Action.STOP_FAILED, action_at=now, message=why[:500]
        )
        violation = _violation(tracked)
        _audit(violation, f"The GPU watchdog could not stop pid {violation.pid}: {why}")
        tell_about(violation, event="stop_failed")

    def _note(self, tracked: Tracked, message: str, now: datetime) -> None:
        Violation.objects.filter(pk=tracked.violation_id).update(message=message[:500], action_at=now)

    # --- the end of a violation ------------------------------------------------------------------

    def _end_gone(self, keys: Iterable[tuple[str, int, str]], now: datetime) -> None:
        """The process is no longer on the card: the stop worked, or it ended by itself."""
        for key in keys:
            tracked = self.tracked.pop(key)
            if tracked.stop_started is not None and not tracked.finished:
                with transaction.atomic():
                    Violation.objects.filter(pk=tracked.violation_id).update(
                        action=Violation.Action.STOPPED, action_at=now, stopped_at=now, ended_at=now
                    )
                    violation = _violation(tracked)
                    _audit(violation, f"The GPU watchdog stopped pid {violation.pid}: {_summary(violation)}")
                tell_about(violation, event="stopped")
            else:
                Violation.objects.filter(pk=tracked.violation_id).update(ended_at=now)

    def users(self, names: set[str], now: datetime) -> dict[str, int]:
        """The portal users behind these OS users; asked again only for a new name, or every
        USERS_CACHE_SECONDS (an admin may have set someone's Unix account)."""
        cached = self._users
        if cached is None or (now - cached[0]).total_seconds() >= USERS_CACHE_SECONDS or names - cached[2]:
            self._users = cached = (now, users_by_unix_name(names), frozenset(names))
        return cached[1]

    def policies(self, now: datetime) -> dict[str, tuple[str, int]]:
        cached = self._policies
        if cached is None or (now - cached[0]).total_seconds() >= POLICY_CACHE_SECONDS:
            self._policies = cached = (now, WatchdogPolicy.current())
        return cached[1]


# --- facts, one query each ----------------------------------------------------------------------


def _bookings_now(server: int, now: datetime) -> list[BookingFacts]:
    cards: dict[int, dict[str, int | None]] = {}
    owners: dict[int, int] = {}
    rows = Allocation.objects.filter(live=True, start__lte=now, end__gt=now, gpu__server_id=server)
    for reservation, owner, gpu, memory in rows.values_list(
        "reservation_id", "reservation__owner_id", "gpu_id", "memory_mb"
    ):
        cards.setdefault(reservation, {})[gpu] = memory
        owners[reservation] = owner
    return [BookingFacts(pk, owners[pk], held) for pk, held in cards.items()]


def _jobs_of(server: int, now: datetime) -> list[JobFacts]:
    rows = Job.objects.filter(
        Q(status__in=(Job.Status.STARTING, Job.Status.RUNNING)) | Q(finished_at__gte=now - ZOMBIE_LOOKBACK),
        server_id=server,
        pid__isnull=False,
    ).values_list("pk", "pid", "owner_id", "reservation_id", "status", "finished_at")
    return [
        JobFacts(pk, pid, owner, reservation, status in (Job.Status.STARTING, Job.Status.RUNNING), finished)
        for pk, pid, owner, reservation, status, finished in rows
    ]


def _predates_end(job: JobFacts, sessions: dict[int, int]) -> bool:
    """True when a process seen in the ended job's session was created before the job ended."""
    pid = sessions.get(job.session_id)
    if pid is None or job.finished_at is None:
        return False
    try:
        created = psutil.Process(pid).create_time()
    except psutil.Error:
        return False
    return created <= job.finished_at.timestamp() + CLOCK_SLACK_SECONDS


# --- what is written and said ------------------------------------------------------------------


def _violation(tracked: Tracked) -> Violation:
    return Violation.objects.select_related("gpu__server", "user", "reservation__owner").get(
        pk=tracked.violation_id
    )


def _next_step(action: str, grace: int, now: datetime) -> str:
    if action != Policy.STOP:
        return "The policy for this kind is to warn: nothing will be stopped."
    if settings.WATCHDOG_DRY_RUN:
        return "The watchdog runs dry (WATCHDOG_DRY_RUN): it will not stop it."
    at = timezone.localtime(now + timedelta(seconds=grace))
    return f"Unless it ends first, it will be stopped at {at:%H:%M:%S} (the policy: stop after {grace} s)."


def _measured(verdict: Verdict) -> str:
    card = verdict.gpu_uuid
    if verdict.kind == Kind.OVER_MEMORY:
        return (
            f"over_memory: job {verdict.job_id} used {format_mb(verdict.memory_mb or 0)} on {card}, "
            f"above its booked {format_mb(verdict.booked_mb or 0)} + "
            f"{settings.WATCHDOG_MEMORY_TOLERANCE_MB} MiB tolerance."
        )
    pid = verdict.process.pid
    return f"escaped: job {verdict.job_id} ran pid {pid} on {card}, which its booking does not hold."


def _summary(violation: Violation) -> str:
    memory = f", {format_mb(violation.memory_mb)}" if violation.memory_mb is not None else ""
    return f"{violation.get_kind_display()} (pid {violation.pid} of {violation.os_user or '?'}{memory})"


def _audit(violation: Violation, message: str) -> None:
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
        },
    )
