"""The GPU watchdog on a GPU host: each round, judge every process on the host's cards and act.

It runs in the host's worker, on the reporter's thread: the reporter reads the cards every
WATCHDOG_INTERVAL_SECONDS (gpus/telemetry.py) and hands each snapshot here through the
`snapshot_read` signal, so the watchdog and the dashboard judge the same processes. A round
costs its server's row (the UPDATE of the last round's time, which finds it: `_server`), three
queries of facts (the bookings active on this host's cards, its running and recently ended jobs,
its running sessions), one more when processes of unknown OS users need their portal accounts,
two more while it has open violations (what people asked of them; the UPDATE of their
`last_seen`), and writes otherwise only when a violation starts, changes or ends: six statements
a steady round, however many processes (tests/test_hot_path_queries.py). The four reads are SQL
(jobs/host/watchdog_sql.py: the ORM's building of them missed bench_watchdog's figure).

Someone may ask on a violation's page (gpus/violations.py) to stop it now, whatever its policy
and grace (stopped this round, saying who asked and why), or mark it resolved (never stopped
from then on; a stop under way goes on).

What happens to a violation is the policy of its kind (gpus.models.WatchdogPolicy): observe
(record), warn (record and tell: the offender, the owner of the booking whose card was taken,
the offender's team leaders on repeat offences), or stop: warn at once, and once the grace
period has passed, stop the process: a running job through its own supervisor (which sends
SIGTERM to its process group and SIGKILL after JOB_KILL_GRACE_SECONDS, and records the job as
failed with the rule and the measurement), any other process by SIGTERM, then SIGKILL after the
watchdog's own grace (WATCHDOG_KILL_GRACE_SECONDS, `kill_grace`). The violation is `stopped` once
NVML no longer lists the process.

Whose each process is, by its session, jobs/host/watchdog_sessions.py says: a lab's kernel not
recorded yet is the lab's, and a run this host's worker has just started, whose row does not name
it yet, is judged from the round it does, never as its owner's intruder before.

Only the process that was seen is ever signalled: by pid *and* start time through a pidfd
(`portal.pids.send`), and only while the pid is still in the session the backend saw. A pid
reused by a later process (even in the same login session), a process whose start could not be
read, the simulation's invented processes (no session), pid <= 1, the worker itself and its own
process group are never signalled. WATCHDOG_DRY_RUN records and notifies but never signals.

A violation outlives a short dip: one that the process leaves for less than HOLD_ROUNDS rounds
(over its budget, within it for a round, over again) stays the same violation, with its first
sighting, its grace and no new message; a new process (another pid or start) is always a new one.
Messages are per event: the processes of one job (or one person outside jobs) of one kind on one
card are one violation row each, but one message a round, and one offence.

The in-memory state (`Tracked`) changes only after the database write that records the decision
has committed: a write that fails (the database away, a deadlock) is tried again next round, so a
stop is never lost between "decided" and "recorded". A restarted worker rebuilds that state from
the open violations' rows, stops already begun and dry runs already announced included.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from time import monotonic

from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, transaction
from django.utils import timezone

from gpus.inventory import ProcessInfo, Snapshot
from gpus.models import Server, Violation, WatchdogPolicy
from gpus.procinfo import is_process_pid, session_of
from jobs.host.dcgm import DcgmMapping
from jobs.host.runner import CANCEL_POLL_SECONDS
from jobs.host.watchdog_sessions import SessionsOnCards
from jobs.host.watchdog_sql import Facts, facts_read
from jobs.models import Job
from jobs.watchdog.notify import tell_about
from jobs.watchdog.records import Asked, announced_step, audit, stop_words, summary, violation_of
from jobs.watchdog.rules import Kind, Verdict, classify
from portal.accounts import users_by_unix_name
from portal.pids import ProcessId, Sent, send

log = logging.getLogger(__name__)

ZOMBIE_LOOKBACK = timedelta(hours=1)  # a job ended longer ago has no processes left worth a look
STOP_CONFIRM_SECONDS = 10  # after SIGKILL, how long NVML may still list the process
POLICY_CACHE_SECONDS = 10
USERS_CACHE_SECONDS = 30
# A violation whose process is within its budget again (or its verdict otherwise harmless) stays
# open this many rounds: a dip under the limit neither ends it (and its grace) nor, on the next
# crossing, opens a new one with a new message.
HOLD_ROUNDS = 3
Policy = WatchdogPolicy.Action

# How a violation's message begins once its stop has begun: what a restarted worker reads back
# (`_load_open`), so it neither announces a dry run again nor starts a stop over.
DRY_RUN_NOTE = "Dry run (WATCHDOG_DRY_RUN): it would have been stopped now."
JOB_ASKED_NOTE = "Its job was asked to stop (SIGTERM, then SIGKILL after the grace period)."
SENT_NOTE = "Sent "  # + the signal's name
NOT_SIGNALLED_NOTE = "Not signalled: "
NEEDS_CAP_KILL = "the worker needs CAP_KILL or root"

Key = tuple[str, int, float | None, str]  # card, pid, start, kind: one process of one kind
Event = tuple[str, str, tuple[str, object]]  # card, kind, the job (or the person) behind it
# Verdicts that harm nobody: a process that turns one of these is within its budget again.
HARMLESS = (Kind.OK, Kind.OWNER_OUTSIDE_JOB)


def key_of(gpu: str, pid: int, started: float | None, kind: str) -> Key:
    # Two reads of one process's create_time agree; rounding keeps a value that went through the
    # database (a float column) equal to a fresh read.
    return (gpu, pid, None if started is None else round(started, 2), str(kind))


def event_of(gpu: str, kind: str, job_id: int | None, user_id: int | None, os_user: str) -> Event:
    """What one message and one offence are about: a job's processes (or a person's outside jobs)
    of one kind on one card."""
    who: tuple[str, object] = (
        ("job", job_id)
        if job_id is not None
        else ("user", user_id)
        if user_id is not None
        else ("os", os_user)
    )
    return (gpu, str(kind), who)


def _event(verdict: Verdict) -> Event:
    p = verdict.process
    return event_of(verdict.gpu_uuid, verdict.kind, verdict.job_id, verdict.user_id, p.username)


def _process_of(key: Key) -> tuple[str, int, float | None]:
    return key[:3]


@dataclass
class Tracked:
    """A violation this host is watching: its row, and where its stop stands."""

    violation_id: int
    kind: str
    first_seen: datetime
    memory_mb: int | None
    session_id: int | None
    event: Event
    last_bad: datetime  # last seen as this kind: a hold (HOLD_ROUNDS) counts from here
    stop_started: datetime | None = None  # the stop was asked for (job) or SIGTERM was sent
    killed: bool = False  # SIGKILL sent (direct stops only)
    finished: bool = False  # stopped, failed or dry-run: nothing more to do but watch
    asked: Asked | None = None  # what someone asked of it on its page: stop it now, or resolved


class HostWatchdog:
    def __init__(
        self,
        server: str,
        *,
        simulated: bool,
        mapping: DcgmMapping | None = None,
        worker: int | None = None,
    ) -> None:
        self.server_name = server
        self.mapping = mapping or DcgmMapping(server)  # DCGM's hpc_job files: the host worker's, if given
        self.simulated = simulated
        # Whose session each process is; `worker`, the host worker's pid (whose pool processes
        # start its runs), None where the round runs outside it (a test, a bench).
        self.sessions = SessionsOnCards(worker)
        self.server_id: int | None = None
        self._round_seconds: float | None = None  # the last round's time, recorded by the next one
        self._forget()

    def _forget(self) -> None:
        """Nothing held of the server's rows: at the start, and once its row was made anew."""
        self.tracked: dict[Key, Tracked] = {}
        self.loaded = False
        self._policies: tuple[datetime, dict[str, tuple[str, int]]] | None = None
        self._users: tuple[datetime, dict[str, int], frozenset[str]] | None = None
        self._told: set[tuple[Event, str]] = set()  # this round's messages: one per event
        self._failing: set[Key] = set()  # items whose error was logged: once, not every round

    # --- the round ------------------------------------------------------------------------

    def round(self, snapshot: Snapshot, now: datetime | None = None) -> list[Verdict]:
        """Judge one snapshot of this host's cards and act; returns every verdict.

        Each violation is its own step: an error in one (its row deleted, say) is logged once and
        never stops the others. Only the database going away ends the round, to be retried."""
        began = monotonic()
        self.mapping.refresh()  # DCGM's hpc_job files, from the database (jobs/host/dcgm.py)
        now = now or timezone.now()
        server, steady = self._server()
        if server is None:
            return []  # not ingested yet: the cards have no rows to hang violations on
        if server != self.server_id:
            self._forget()
            self.server_id = server
        if not self.loaded:
            self._load_open(server)
        # What people asked of the open ones (stop now, resolved): read only while there are some.
        facts = round_facts(server, now, asked=bool(self.tracked))
        for tracked in self.tracked.values():
            tracked.asked = facts.asked.get(tracked.violation_id)
        # The simulation's invented processes (made-up pids, no session) are scenery: shown on the
        # dashboard, marked simulated, never a violation: a demo is quiet until someone causes one.
        verdicts = [v for v in self._judge(snapshot, facts, now) if not self._invented(v)]
        policies = self.policies(now)
        self._told = set()
        readable = {g.uuid for g in snapshot.gpus if g.processes is not None}
        keyed = [(key_of(v.gpu_uuid, v.process.pid, v.process.started, v.kind), v) for v in verdicts]
        held, ending = self._held_and_ending(keyed, readable, now)
        held_processes = {_process_of(k) for k in held}
        # A process whose stop is under way is that stop's until it ends (stopped, or stop_failed):
        # judged another kind meanwhile, it is not a new violation warned, stopped and recorded
        # stopped again (one death, two stops).
        stopping = {_process_of(k) for k in held if not self.tracked[k].finished}
        # Ends first: a process that follows another of the same job (or person) on the card is a
        # new event once the first has ended, and is counted and told as one.
        self._end_gone(ending, now)
        watched = [(key, v, _event(v)) for key, v in keyed if v.kind is not Kind.OK]
        pids: dict[Event, list[int]] = {}
        for _, verdict, event in watched:
            if verdict.kind not in HARMLESS:
                pids.setdefault(event, []).append(verdict.process.pid)
        seen: set[Key] = set()
        for key, verdict, event in watched:
            process = verdict.process
            if verdict.kind in HARMLESS and _process_of(key) in held_processes:
                continue  # within its budget for now, but its violation is held open: no new one
            if key not in self.tracked and _process_of(key) in stopping:
                continue  # its stop under way goes on (`_hold`): no second violation of it
            seen.add(key)
            event_pids = pids.get(event, [process.pid])
            self._step(key, self._watch, key, verdict, policies[verdict.kind], server, now, event_pids)
        for key, verdict in held.items():
            self._step(key, self._hold, key, verdict, now)
        if seen:
            # Every open violation on a readable card was seen this round (the others just ended,
            # or are held through a dip: their last_seen stays): one UPDATE by index.
            held_ids = [self.tracked[k].violation_id for k in held if k in self.tracked]
            opened = Violation.objects.filter(server_id=server, ended_at=None, gpu_id__in=readable)
            opened.exclude(pk__in=held_ids).update(last_seen=now)
        self._round_seconds = monotonic() - began
        if not steady:
            self._took(self._round_seconds)
        return verdicts

    def _server(self) -> tuple[int | None, bool]:
        """This host's server row (None before its first report), and whether it is the one of the
        last round. Looked up every round by its unique name: the row may have been deleted and
        made again. While it stays the same, the look is the UPDATE that records the last round's
        time for /metrics (jobs/prometheus/metrics.py): one statement a round, not two; the first
        round, after a lookup, records its own at its end."""
        if self.server_id is not None and self._round_seconds is not None:
            same = Server.objects.filter(pk=self.server_id, name=self.server_name)
            if same.update(watchdog_round_seconds=self._round_seconds):
                return self.server_id, True
        return Server.objects.filter(name=self.server_name).values_list("pk", flat=True).first(), False

    def _took(self, seconds: float) -> None:
        """The round's time, for /metrics (jobs/prometheus/metrics.py); never the round's failure."""
        try:
            Server.objects.filter(pk=self.server_id).update(watchdog_round_seconds=seconds)
        except DatabaseError as exc:
            log.debug("GPU watchdog: could not record its round time: %s", exc)

    def _held_and_ending(
        self, keyed: list[tuple[Key, Verdict]], readable: set[str], now: datetime
    ) -> tuple[dict[Key, Verdict], list[Key]]:
        """The tracked violations not seen as their kind this round, on readable cards: those held
        open through a dip (their process still listed, harmless for now: within HOLD_ROUNDS
        rounds, or its stop under way), with the process's verdict now; and those that end (the
        process gone, harmless for longer than the hold, or now another kind of violation)."""
        now_kind = {_process_of(key): v for key, v in keyed}
        hold = timedelta(seconds=HOLD_ROUNDS * settings.WATCHDOG_INTERVAL_SECONDS)
        held: dict[Key, Verdict] = {}
        ending: list[Key] = []
        for key, tracked in self.tracked.items():
            if key[0] not in readable:
                continue  # unknown is not empty
            verdict = now_kind.get(_process_of(key))
            if verdict is not None and verdict.kind == tracked.kind:
                continue  # seen as itself
            harmless = verdict is not None and verdict.kind in HARMLESS
            stopping = tracked.stop_started is not None and not tracked.finished
            # A stop under way goes on while its process is still listed, whatever it is judged
            # now (a job's setsid child adopted once the job's session ended is another kind):
            # it is `stopped` once gone, or `stop_failed`, never stopped while it still runs.
            if (verdict is not None and stopping) or (
                harmless and tracked.kind != Kind.OWNER_OUTSIDE_JOB and now - tracked.last_bad < hold
            ):
                held[key] = verdict
            else:
                ending.append(key)
        return held, ending

    def _hold(self, key: Key, verdict: Verdict, now: datetime) -> None:
        """A violation held through a dip: a stop under way goes on (SIGKILL, or its failure)."""
        tracked = self.tracked[key]
        if tracked.stop_started is not None and not tracked.finished:
            self._escalate(tracked, verdict._replace(kind=Kind(tracked.kind)), now)

    def _step(self, key: Key, step: Callable[..., None], *args: object) -> None:
        """Run one violation's step; its error is its own (logged once), never the round's."""
        try:
            step(*args)
        except (OperationalError, InterfaceError):
            raise  # the database away: the round is tried again whole, and the caller says so once
        except Violation.DoesNotExist:
            log.warning("GPU watchdog: violation of %s was deleted; no longer watched", key)
            self.tracked.pop(key, None)
            self._failing.discard(key)
        except Exception:
            if key not in self._failing:
                log.exception("GPU watchdog: %s failed; the other violations go on", key)
            self._failing.add(key)
        else:
            self._failing.discard(key)

    def _judge(self, snapshot: Snapshot, facts: Facts, now: datetime) -> list[Verdict]:
        owned = self.sessions.owned(snapshot.gpus, facts)
        names = {p.username for g in owned.cards for p in g.processes or ()}
        return classify(
            owned.cards,
            bookings=facts.bookings,
            jobs=owned.jobs,
            users_by_os_name=self.users(names, now),
            tolerance_mb=settings.WATCHDOG_MEMORY_TOLERANCE_MB,
            sessions=owned.sessions,
        )

    def _load_open(self, server: int) -> None:
        """A restarted worker picks up the violations it was watching, rather than starting anew:
        where each one's stop stands is read back from its row (action, message, action_at), so a
        dry run is not announced twice and a stop begun is carried on, not begun again."""
        rows = Violation.objects.filter(server_id=server, ended_at=None).values_list(
            "pk",
            "gpu_id",
            "pid",
            "process_started",
            "kind",
            "first_seen",
            "memory_mb",
            "session_id",
            "action",
            "message",
            "action_at",
            "job_id",
            "user_id",
            "os_user",
            "last_seen",
        )
        for row in rows:
            pk, gpu, pid, started, kind, first_seen, memory, session, action, message, at = row[:11]
            job, user, os_user, last_seen = row[11:]
            event = event_of(gpu, kind, job, user, os_user)
            tracked = Tracked(pk, kind, first_seen, memory, session, event, last_seen)
            _rebuild(tracked, action, message, at)
            self.tracked[key_of(gpu, pid, started, kind)] = tracked
        self.loaded = True

    # --- one violation ----------------------------------------------------------------------

    def _watch(
        self,
        key: Key,
        verdict: Verdict,
        policy: tuple[str, int],
        server: int,
        now: datetime,
        pids: Sequence[int],
    ) -> None:
        action, grace = policy
        tracked = self.tracked.get(key)
        if tracked is None:
            # Recorded and told together, and remembered only once both have committed: a failed
            # write leaves nothing half-done, and the next round records it afresh.
            with transaction.atomic():
                tracked = self._record(verdict, server, now)
                if action != Policy.OBSERVE:
                    self._warn(tracked, verdict, announced_step(action, grace, now, verdict.process), pids)
            self.tracked[key] = tracked
        else:
            tracked.last_bad = now
            self._grow(tracked, verdict)
        self._go_on(tracked, verdict, action, grace, now, pids)

    def _grow(self, tracked: Tracked, verdict: Verdict) -> None:
        """The most memory measured is the one kept."""
        if (verdict.memory_mb or 0) > (tracked.memory_mb or 0):
            Violation.objects.filter(pk=tracked.violation_id).update(memory_mb=verdict.memory_mb)
            tracked.memory_mb = verdict.memory_mb

    def _go_on(
        self, tracked: Tracked, verdict: Verdict, action: str, grace: int, now: datetime, pids: Sequence[int]
    ) -> None:
        """The stop, once the grace has passed since the violation was first seen (a dip under the
        limit restarts nothing: see HOLD_ROUNDS); at once when someone asked for it, never once
        someone marked it resolved (a stop under way goes on)."""
        if tracked.asked is not None and (tracked.asked.resolved is False or tracked.stop_started is None):
            action, grace = (Policy.OBSERVE, grace) if tracked.asked.resolved else (Policy.STOP, 0)
        if tracked.finished or action != Policy.STOP:
            return
        if tracked.stop_started is None and now - tracked.first_seen >= timedelta(seconds=grace):
            self._stop(tracked, verdict, now, pids)
        elif tracked.stop_started is not None:
            self._escalate(tracked, verdict, now)

    def _record(self, verdict: Verdict, server: int, now: datetime) -> Tracked:
        process = verdict.process
        row = Violation.objects.create(
            kind=verdict.kind.value,
            gpu_id=verdict.gpu_uuid,
            server_id=server,
            pid=process.pid,
            process_started=process.started,
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
        return Tracked(
            row.pk, verdict.kind.value, now, verdict.memory_mb, process.session_id, _event(verdict), now
        )

    def _warn(self, tracked: Tracked, verdict: Verdict, next_step: str, pids: Sequence[int]) -> None:
        Violation.objects.filter(pk=tracked.violation_id).update(
            action=Violation.Action.WARNED, action_at=tracked.first_seen, warned_at=tracked.first_seen
        )
        if self._silent(verdict):
            return
        if any(t.event == tracked.event for t in self.tracked.values()):
            return  # another process of an event already told about: the same event, no new message
        self._tell(tracked, "seen", pids, next_step)

    def _tell(self, tracked: Tracked, event: str, pids: Sequence[int] = (), next_step: str = "") -> None:
        """Tell about `tracked`'s event, once a round for all the processes of one job (or person)
        of one kind on one card: they are one event, and `pids` lists them."""
        if (tracked.event, event) in self._told:
            return
        tell_about(violation_of(tracked.violation_id), event=event, next_step=next_step, pids=pids)
        self._told.add((tracked.event, event))

    def _silent(self, verdict: Verdict) -> bool:
        # A process of no session on a simulated host (a violation recorded before invented
        # processes were left out, rebuilt at a restart): never worth a message.
        return self._invented(verdict)

    def _invented(self, verdict: Verdict) -> bool:
        return self.simulated and verdict.process.session_id is None

    # --- stopping -------------------------------------------------------------------------------

    def _stop(self, tracked: Tracked, verdict: Verdict, now: datetime, pids: Sequence[int]) -> None:
        """Begin the stop; `tracked` says it began only once the database says so."""
        if settings.WATCHDOG_DRY_RUN:
            with transaction.atomic():
                self._note(tracked, DRY_RUN_NOTE, now)
                if not self._silent(verdict):
                    self._tell(tracked, "dry_run", pids)
            tracked.stop_started, tracked.finished = now, True
            return
        if verdict.job_id is not None and verdict.kind in (Kind.ESCAPED, Kind.OVER_MEMORY):
            # A running job is stopped whole, by its own supervisor: the job ends failed with the
            # rule and the measurement, and its log says why.
            message = stop_words(verdict, tracked.asked)
            with transaction.atomic():
                asked = Job.objects.filter(
                    pk=verdict.job_id, status__in=(Job.Status.STARTING, Job.Status.RUNNING), watchdog_stop=""
                ).update(watchdog_stop=message[:500])
                self._note(tracked, JOB_ASKED_NOTE, now)
            tracked.stop_started = now
            if not asked:
                log.info("Job %s already stopping or ended", verdict.job_id)
            if verdict.left_session and (asked or _job_active(verdict.job_id)):
                # A child that left the job's session (setsid): the supervisor's stop, which ends
                # the job's session, never reaches it. It is signalled itself, as any process; not
                # once the job has ended by itself (its child is an ended job's, its own policy's),
                # and a child that cannot be proven leaves the job's stop as it stands (recorded).
                if _unprovable(verdict.process) is None:
                    self._signal(tracked, verdict, signal.SIGTERM, now)
                else:
                    log.warning(
                        "Job %s: its setsid child pid %s cannot be proven, not signalled",
                        verdict.job_id,
                        verdict.process.pid,
                    )
            return
        if self._signal(tracked, verdict, signal.SIGTERM, now):
            tracked.stop_started = now

    def _escalate(self, tracked: Tracked, verdict: Verdict, now: datetime) -> None:
        waited = (now - tracked.stop_started).total_seconds()
        # No supervisor stops it: not a job's, a zombie, or a job's child that left its session.
        direct = verdict.job_id is None or verdict.kind == Kind.ZOMBIE or verdict.left_session
        # A job's supervisor sends its SIGKILL after the job's grace; the watchdog, after its own.
        grace = kill_grace() if direct else settings.JOB_KILL_GRACE_SECONDS
        # WATCHDOG_DRY_RUN never signals, a stop begun before it was set (a restart) included: its
        # SIGKILL is not sent, and it is stopped once gone or stop_failed after the grace as any.
        if direct and not tracked.killed and waited >= grace and not settings.WATCHDOG_DRY_RUN:
            if self._signal(tracked, verdict, signal.SIGKILL, now):
                tracked.killed = True
            return
        if waited >= grace + STOP_CONFIRM_SECONDS:
            self._fail(tracked, f"Still on the card {waited:.0f} s after the stop began.", now)

    def _signal(self, tracked: Tracked, verdict: Verdict, sig: signal.Signals, now: datetime) -> bool:
        """Send `sig` to the process that was seen, and only to it; True when it was sent or the
        process is gone already (the next round records the stop)."""
        process = verdict.process
        why_not = _unprovable(process)
        if why_not is not None and _gone(process):
            return True  # the process seen has ended (NVML may list it a while): the stop is done
        if why_not is None and process.started is not None:  # _unprovable checked the start
            outcome = send(ProcessId(process.pid, process.started), sig)
            if outcome is Sent.SENT:
                self._note(tracked, f"{SENT_NOTE}{sig.name} to pid {process.pid}.", now)
                return True
            if outcome is Sent.GONE:
                return True
            if outcome is Sent.DENIED:
                self._fail(
                    tracked, "could not stop: permission denied (the worker needs CAP_KILL or root)", now
                )
                return False
            why_not = "pid <= 1, or the worker's own process or process group."
        self._note(tracked, f"{NOT_SIGNALLED_NOTE}{why_not}", now)
        tracked.finished = True
        return False

    def _fail(self, tracked: Tracked, why: str, now: datetime) -> None:
        with transaction.atomic():
            Violation.objects.filter(pk=tracked.violation_id).update(
                action=Violation.Action.STOP_FAILED, action_at=now, message=why[:500]
            )
            violation = violation_of(tracked.violation_id)
            audit(violation, f"The GPU watchdog could not stop pid {violation.pid}: {why}")
            self._tell(tracked, "stop_failed", [violation.pid])
        tracked.finished = True

    def _note(self, tracked: Tracked, message: str, now: datetime) -> None:
        Violation.objects.filter(pk=tracked.violation_id).update(message=message[:500], action_at=now)

    # --- the end of a violation ------------------------------------------------------------------

    def _end_gone(self, keys: Sequence[Key], now: datetime) -> None:
        """The process is no longer on the card (the stop worked, or it ended by itself), or it has
        been harmless longer than the hold, or it turned another kind of violation.

        Forgotten only once the end is recorded (with its audit entry and notifications, in one
        transaction): a write that fails is tried again next round, never lost."""
        stopped: dict[Event, list[int]] = {}
        for key in keys:
            stopped.setdefault(self.tracked[key].event, []).append(key[1])
        for key in keys:
            self._step(key, self._end, key, stopped[self.tracked[key].event], now)

    def _end(self, key: Key, pids: Sequence[int], now: datetime) -> None:
        tracked = self.tracked[key]
        with transaction.atomic():
            if tracked.stop_started is not None and not tracked.finished:
                Violation.objects.filter(pk=tracked.violation_id).update(
                    action=Violation.Action.STOPPED, action_at=now, stopped_at=now, ended_at=now
                )
                violation = violation_of(tracked.violation_id)
                audit(violation, f"The GPU watchdog stopped pid {violation.pid}: {summary(violation)}")
                self._tell(tracked, "stopped", pids)
            else:
                Violation.objects.filter(pk=tracked.violation_id).update(ended_at=now)
        del self.tracked[key]

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


def kill_grace() -> int:
    """Seconds between the watchdog's SIGTERM and its SIGKILL to a process it stops itself:
    WATCHDOG_KILL_GRACE_SECONDS; unset, JOB_KILL_GRACE_SECONDS, for this release only (it was the
    watchdog's grace before the watchdog had its own)."""
    return settings.WATCHDOG_KILL_GRACE_SECONDS or settings.JOB_KILL_GRACE_SECONDS


# --- facts (read by jobs/host/watchdog_sql.py) ---------------------------------------------------


def ended_booking_grace() -> timedelta:
    """How long an ended (or released) booking still holds its cards for its own jobs: the
    supervisor notices the end at its next cancel poll (CANCEL_POLL_SECONDS), sends SIGTERM and
    SIGKILL after JOB_KILL_GRACE_SECONDS, NVML may list the killed process for STOP_CONFIRM_SECONDS
    more, and the watchdog sees the card once a round."""
    return timedelta(
        seconds=CANCEL_POLL_SECONDS
        + settings.JOB_KILL_GRACE_SECONDS
        + STOP_CONFIRM_SECONDS
        + settings.WATCHDOG_INTERVAL_SECONDS
    )


def round_facts(server: int, now: datetime, *, asked: bool = False) -> Facts:
    """The facts a round judges by (jobs/host/watchdog_sql.py): bookings within
    `ended_booking_grace()` of their end, jobs ended within ZOMBIE_LOOKBACK; and, when `asked`,
    what people asked of the open violations."""
    return facts_read(
        server, now, booking_grace=ended_booking_grace(), zombie_lookback=ZOMBIE_LOOKBACK, asked=asked
    )


def _unprovable(process: ProcessInfo) -> str | None:
    """Why the process on the card cannot be proven to be the one the pid names now; None when it
    can: its pid and start time (checked again through the pidfd by portal.pids.send) and its
    session, which a later command of the same login shell would share, so it is not enough."""
    if not is_process_pid(process.pid):
        return f"pid {process.pid} is no process of its own (NVML answers 0 when its versions disagree)."
    if process.session_id is None:
        return "no such process on this host (invented by the simulation, or gone)."
    if process.started is None:
        return "its start time could not be read, so it cannot be proven to be the process seen."
    if session_of(process.pid) != process.session_id:
        return "the pid is no longer the process that was seen (another session)."
    return None


def _gone(process: ProcessInfo) -> bool:
    """The process seen (pid and start) no longer runs: its pid is free, or another process's."""
    if not is_process_pid(process.pid) or process.session_id is None or process.started is None:
        return False  # never proven to be one process: nothing says it ended
    return not ProcessId(process.pid, process.started).is_alive()


def _job_active(job_id: int | None) -> bool:
    return Job.objects.filter(pk=job_id, status__in=Job.ACTIVE).exists()


def _rebuild(tracked: Tracked, action: str, message: str, at: datetime | None) -> None:
    """Where a violation's stop stood when the worker restarted, from its row."""
    if action in (Violation.Action.STOPPED, Violation.Action.STOP_FAILED):
        tracked.finished = True
    elif message.startswith(DRY_RUN_NOTE) or message.startswith(NOT_SIGNALLED_NOTE):
        tracked.stop_started, tracked.finished = at, True
    elif message.startswith(JOB_ASKED_NOTE) or message.startswith(SENT_NOTE):
        tracked.stop_started = at
        tracked.killed = message.startswith(f"{SENT_NOTE}SIGKILL")
