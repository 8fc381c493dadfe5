"""The simulated lab week's engine (bench/bench_lab_week.py): a simulated clock and inventory, and
hosts whose jobs' runs are simulated, around the portal's real services.

Time is the simulation's: `django.utils.timezone.now` reads its clock, which jumps from event to
event (nothing sleeps). What the portal decides comes from its own code, called as its threads
and tasks call it: the collector's telemetry round (`servers_report_ingest`, whose signal runs the
lending watch), the idle round (`idle_check`: idle clocks, no-shows, auto-release), the
scheduler's pass (`schedule_pass`: the plan, lending), the reconciler (`jobs_reconcile`), the
booking and job services people use (`reservation_create`, `job_submit`, `job_cancel`), the
Queue page's plan (`queue_plan(expected=True)`) and the watchdog's rules (`classify`). Only what
happens on a host is simulated: a dispatched job's message reaches its worker, which claims it
(`job_claim`), marks it running, reads its row every poll (a preemption, a cancel, its booking's
end) and records its end (`job_end_record`, `queued_job_ended`), as jobs/host/runner.py does; its
processes show in the next telemetry round.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from bench.lab_week_habits import Plan, PlannedBooking, PlannedJob, Stretch

SECOND = timedelta(seconds=1)


@dataclass
class Run:
    """One run of a job on its cards, as a host saw it."""

    job_id: int
    kind: str  # "owner" (a job on its owner's booking), "borrower" (on a loan), "queue"
    cards: list[str]
    server: int
    pid: int
    lender: int | None  # the lent booking, for a borrower
    booking: int
    claimed: datetime
    start: datetime | None = None  # its process on the cards
    end: datetime | None = None
    work_before: float = 0.0  # seconds of work it resumed from (a checkpoint)
    stopping: bool = False  # its supervisor has decided to stop it
    status: str = ""


@dataclass
class Record:
    """What the week did, for the report (bench/bench_lab_week.py)."""

    runs: list[Run] = field(default_factory=list)
    bookings: dict[int, PlannedBooking] = field(default_factory=dict)  # booking id → its plan
    refused_bookings: int = 0
    returns: list[tuple[int, Stretch]] = field(default_factory=list)  # (booking, stretch) the owner came back
    returns_released: int = 0  # the booking had been released (idle, no-show) when its owner came back
    owner_job_runs: dict[int, list[Run]] = field(default_factory=lambda: defaultdict(list))
    submitted: dict[int, tuple[PlannedJob, datetime]] = field(default_factory=dict)  # queue job id → plan
    preemptions: list[float] = field(default_factory=list)  # seconds of work lost, each
    samples: list[tuple[int, datetime, datetime]] = field(default_factory=list)  # (job, when, estimate)
    watchdog: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    end: datetime | None = None


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class Week:
    """One simulated week on a fresh lab (the caller's database, flushed)."""

    def __init__(self, params: dict[str, Any], plan: Plan, week_start: datetime, *, lending: bool) -> None:
        self.p, self.plan, self.lending = params, plan, lending
        self.start = week_start
        self.end = week_start + timedelta(days=params["days"])
        self.clock = Clock(week_start)
        self.rng = random.Random(params["seed"] + 1)
        self.queue: list[tuple[datetime, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.rec = Record()
        self.sent: list[tuple[int, str]] = []  # (job, the queue its message went to)
        self.woken = False
        self.stops_due = False  # a step that may have asked a job to stop (a take-back, a release)
        self.passes_due: set[datetime] = set()  # the passes already set for later
        self.telemetry_at: datetime | None = None
        self.ingested_at = week_start - timedelta(days=1)
        self.passed_at = week_start - timedelta(days=1)
        self.runs: dict[int, Run] = {}  # job id → its live run
        self.shells: dict[str, dict[int, Any]] = defaultdict(dict)  # card → pid → ProcessInfo
        self.pids = itertools.count(10_000)
        self.work: dict[int, tuple[float, int]] = {}  # job → (checkpointed seconds, server)
        self.users: list[Any] = []
        self.cards: list[tuple[str, int]] = []
        self.names: dict[int, str] = {}
        self.job_owner: dict[int, str] = {}  # job id → its owner's account name

    # --- the event loop ------------------------------------------------------------------

    def at(self, when: datetime, step: Callable[[], None]) -> None:
        heapq.heappush(self.queue, (when, next(self.seq), step))

    def run(self) -> Record:
        self._setup()
        while self.queue:
            when, _, step = heapq.heappop(self.queue)
            if when >= self.end:
                break
            self.clock.now = max(self.clock.now, when)
            step()
            self._after()
        self.rec.end = self.end
        for run in self.runs.values():  # still running at the week's end
            run.end = self.end
        return self.rec

    def _after(self) -> None:
        """What the step set off: messages to hosts, a woken scheduler, stops asked of jobs."""
        now = self.clock.now
        p = self.p["host"]
        for pk, queue in self.sent:
            at = now + timedelta(seconds=p["claim_seconds"])
            self.at(at, lambda pk=pk, queue=queue: self._claim(pk, queue.removeprefix("host.")))
        self.sent.clear()
        if self.woken:
            self.woken = False
            self._pass_soon(now + timedelta(seconds=p["wake_seconds"]))
        if self.stops_due:
            self.stops_due = False
            self._stops()

    def _pass_soon(self, when: datetime) -> None:
        """A pass at `when`, unless one is due within the 2 s before it (QUEUE_SCHEDULE_SECONDS)."""
        if any(when - 2 * SECOND <= at <= when for at in self.passes_due):
            return
        self.passes_due.add(when)
        self.at(when, self._pass)

    # --- the lab and the plan ------------------------------------------------------------

    def _setup(self) -> None:
        from django.conf import settings

        from bench.common import lab
        from portal.models import Team

        lab_p, portal_p = self.p["lab"], self.p["portal"]
        settings.LEND_AFTER_MINUTES = portal_p["lend_after_minutes"]
        settings.LEND_GRACE_SECONDS = portal_p["lend_grace_seconds"]
        settings.NO_SHOW_MINUTES = portal_p["no_show_minutes"]
        settings.IDLE_CHECK_SECONDS = portal_p["idle_check_seconds"]
        settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # 20 people, fast
        self.users, self.cards = lab(
            servers=lab_p["servers"],
            gpus=lab_p["cards_per_server"],
            users=lab_p["people"],
            teams=lab_p["teams"],
        )
        self.names = {u.pk: u.username for u in self.users}
        teams = list(Team.objects.order_by("pk"))
        for i, team in enumerate(teams):
            team.lend_idle = self.lending
            team.auto_release_idle = i < lab_p["auto_release_teams"]
            team.save(update_fields=["lend_idle", "auto_release_idle"])
        for booking in self.plan.bookings:
            self.at(booking.booked_at, lambda b=booking: self._book(b))
        for job in self.plan.jobs:
            self.at(job.submit, lambda j=job: self._submit(j))
        tick = timedelta(seconds=portal_p["idle_check_seconds"])
        for i in range(int((self.end - self.start) / tick) + 1):
            self.at(self.start + i * tick, self._tick)
        every = timedelta(minutes=self.p["report"]["estimate_every_minutes"])
        for i in range(1, int((self.end - self.start) / every) + 1):
            self.at(self.start + i * every + SECOND, self._estimates)

    def _book(self, planned: PlannedBooking) -> None:
        from gpus.booking import reservation_create
        from portal.errors import ServiceError

        user = self.users[planned.person]
        try:
            booking = reservation_create(
                user=user, count=planned.cards, start=planned.start, end=planned.end, note="lab week"
            )
        except ServiceError:
            self.rec.refused_bookings += 1
            return
        self.rec.bookings[booking.pk] = planned
        for stretch in planned.stretches:
            self.at(stretch.start, lambda s=stretch, b=booking.pk: self._come_back(b, s))
        self._pass_soon(planned.end + SECOND)  # its cards free at its end: the next 2 s pass sees it

    def _submit(self, planned: PlannedJob) -> None:
        from jobs.submit import ScriptUpload, job_submit

        job = job_submit(
            user=self.users[planned.person],
            reservation=None,
            gpu_count=planned.cards,
            time_limit_minutes=planned.limit,
            preemptible=planned.preemptible,
            script=ScriptUpload(name=planned.script, content=b"print('training')\n"),
        )
        self.rec.submitted[job.pk] = (planned, self.clock.now)
        self.rec.calls["job_submit"] += 1

    # --- the owner at work ---------------------------------------------------------------

    def _come_back(self, booking_id: int, stretch: Stretch) -> None:
        from gpus.models import Allocation, Reservation
        from jobs.submit import ScriptUpload, job_submit
        from portal.errors import ServiceError

        now = self.clock.now
        self.stops_due = True
        booking = Reservation.objects.get(pk=booking_id)
        if booking.status_at(now) != Reservation.Status.ACTIVE:
            self.rec.returns_released += 1
            return
        self.rec.returns.append((booking_id, stretch))
        planned = self.rec.bookings[booking_id]
        user = self.users[planned.person]
        if stretch.by_job:
            try:
                job = job_submit(
                    user=user, reservation=booking, script=ScriptUpload(name="mine.py", content=b"print(1)\n")
                )
            except ServiceError:
                stretch.by_job = False  # a job of theirs still on it: they use a shell instead
            else:
                self.rec.calls["owner_job"] += 1
                self.at(stretch.end, lambda: self._owner_job_done(job.pk, user))
                return
        cards = list(Allocation.objects.filter(reservation_id=booking_id).values_list("gpu_id", flat=True))
        pids = []
        for uuid in cards:
            pid = next(self.pids)
            self.shells[uuid][pid] = self._process(pid, user.username, "python notebook.py", session=None)
            pids.append((uuid, pid))
        self._telemetry_soon()
        self.at(stretch.end, lambda: self._shell_done(pids))

    def _shell_done(self, pids: list[tuple[str, int]]) -> None:
        for uuid, pid in pids:
            self.shells[uuid].pop(pid, None)
        self._telemetry_soon()

    def _owner_job_done(self, job_id: int, user: Any) -> None:
        from jobs.models import Job
        from jobs.services import job_cancel

        self.stops_due = True
        run = self.runs.get(job_id)
        if run is not None and run.start is not None and not run.stopping:
            self._end(run, Job.Status.SUCCEEDED, "")
        elif Job.objects.filter(pk=job_id, status__in=Job.ACTIVE).exists():
            job_cancel(user=user, job=job_id)  # never started in the stretch: they gave up

    # --- the portal's periodic work -------------------------------------------------------

    def _tick(self) -> None:
        """The idle round (with a telemetry round just before it, as the collector keeps cards
        fresh), the reconciler, and a pass unless one ran within the last half hour. The real
        scheduler passes every 2 s, but between its wake-ups (a job queued or ended, a booking
        released) only time moves, and the two passes that time calls for are set apart: a
        booking's end (`_book`) and an idle booking becoming lendable (`_lend_due`)."""
        from gpus.idle import idle_check
        from jobs.services import jobs_reconcile

        now = self.clock.now
        self.stops_due = True  # an idle or no-show release ends its jobs' bookings
        self._ingest(judge=False)  # the same processes as the last round the rules judged
        done = idle_check()
        jobs_reconcile(mark_lost=False)
        self.rec.calls["idle_check"] += 1
        if now - self.passed_at >= timedelta(minutes=30):
            self._pass()
        self._lend_due(done.idle)

    def _lend_due(self, idle: list[int]) -> None:
        """A pass when a booking that just went idle becomes lendable (LEND_AFTER_MINUTES on):
        the real scheduler's next 2 s pass would see it."""
        from django.conf import settings

        from gpus.models import Reservation

        now = self.clock.now
        after = timedelta(minutes=settings.LEND_AFTER_MINUTES)
        for since in Reservation.objects.filter(pk__in=idle).values_list("idle_since", flat=True):
            if since is not None and now < since + after <= now + timedelta(
                seconds=self.p["portal"]["idle_check_seconds"]
            ):
                self._pass_soon(since + after + SECOND)

    def _pass(self) -> None:
        from jobs.queue.scheduler import schedule_pass

        now = self.clock.now
        self.passes_due.discard(now)
        if now - self.ingested_at > timedelta(seconds=10):
            self._ingest(judge=False)  # the collector's rounds keep the servers online
        self._slots()
        schedule_pass(memory=self.memory)
        self.passed_at = now
        self.rec.calls["schedule_pass"] += 1

    def _slots(self) -> None:
        """Each host's worker says how many jobs it runs at once (jobs.host.pickup, every
        JOB_RECONCILE_SECONDS): one per card here."""
        from jobs.host.pickup import slots_report

        for s in range(self.p["lab"]["servers"]):
            slots_report(f"bench{s:02d}", slots=self.p["lab"]["cards_per_server"], now=self.clock.now)

    def _estimates(self) -> None:
        from jobs.queue.scheduler import queue_plan

        now = self.clock.now
        self._slots()
        for entry in queue_plan(expected=True, shared_usage=False):
            if not entry.start_now and entry.estimated_start is not None:
                self.rec.samples.append((entry.request.job_id, now, entry.estimated_start))

    def _telemetry_soon(self) -> None:
        """The next telemetry round (every TELEMETRY_INTERVAL_SECONDS) shows what changed."""
        now = self.clock.now
        if self.telemetry_at is not None and self.telemetry_at >= now:
            return
        every = self.p["host"]["telemetry_seconds"]
        self.telemetry_at = now + timedelta(seconds=every - (now.timestamp() % every))
        self.at(self.telemetry_at, self._ingest)

    def _ingest(self, *, judge: bool = True) -> None:
        from gpus.services import servers_report_ingest

        snapshots = self._snapshots()
        servers_report_ingest(snapshots=snapshots)  # its signal runs the lent cards' watch
        self.stops_due = True
        self.ingested_at = self.clock.now
        self.rec.calls["telemetry"] += 1
        if judge:
            self._judge(snapshots)

    def _snapshots(self) -> list[Any]:
        from tests.factories import make_snapshot

        lab_p = self.p["lab"]
        on_card: dict[str, list[Any]] = defaultdict(list)
        for run in self.runs.values():
            if run.start is not None:
                for uuid in run.cards:
                    on_card[uuid].append(
                        self._process(run.pid, self._owner_name(run), "python train.py", session=run.pid)
                    )
        snapshots = []
        for s in range(lab_p["servers"]):
            snap = make_snapshot(f"bench{s:02d}", gpus=lab_p["cards_per_server"], util=0, processes=0)
            gpus = []
            for g in snap.gpus:
                procs = (*on_card.get(g.uuid, ()), *self.shells.get(g.uuid, {}).values())
                gpus.append(replace(g, processes=tuple(procs), utilization_pct=85 if procs else 0))
            snapshots.append(replace(snap, gpus=tuple(gpus)))
        return snapshots

    def _owner_name(self, run: Run) -> str:
        return self.job_owner[run.job_id]

    @staticmethod
    def _process(pid: int, user: str, command: str, *, session: int | None) -> Any:
        from gpus.inventory import ProcessInfo

        return ProcessInfo(
            pid=pid,
            username=user,
            command=command,
            used_memory_mb=2000,
            session_id=session or pid,
            started=1.0,
        )

    def _judge(self, snapshots: list[Any]) -> None:
        """The watchdog's rules over the round: the owner's and the borrowers' processes must
        never be intruders, nor a borrower's escaped."""
        from django.conf import settings

        from gpus.models import Server
        from jobs.host.watchdog import round_facts
        from jobs.watchdog.rules import classify

        now = self.clock.now
        users = {u.username: u.pk for u in self.users}
        servers = dict(Server.objects.values_list("name", "pk"))
        for snap in snapshots:
            if not any(g.processes for g in snap.gpus):
                continue
            server = servers[snap.host.name]
            facts = round_facts(server, now)
            for verdict in classify(
                snap.gpus,
                bookings=facts.bookings,
                jobs=facts.jobs,
                users_by_os_name=users,
                tolerance_mb=settings.WATCHDOG_MEMORY_TOLERANCE_MB,
            ):
                self.rec.watchdog[str(verdict.kind)] += 1

    # --- the hosts ----------------------------------------------------------------------

    def _claim(self, job_id: int, server: str) -> None:
        """The job's message reaches `server`'s worker: claimed, then its process starts; a
        borrower whose loan ended meanwhile goes back to the queue (jobs.host.runner.job_run)."""
        from django.conf import settings

        from jobs.host.launch import job_claim
        from jobs.models import Job
        from jobs.preemption import requeue_unstarted

        settings.WORKER_SERVER = server  # this process plays every host's worker in turn
        job = job_claim(job_id)
        if job is None:
            return
        now = self.clock.now
        if job.reservation.status_at(now) != job.reservation.Status.ACTIVE:
            if requeue_unstarted(job, now):
                return
            Job.objects.transition(
                job_id,
                from_=Job.Status.STARTING,
                to=Job.Status.CANCELLED,
                finished_at=now,
                message="Cancelled.",
            )
            return
        kind = "borrower" if job.reservation.lent_from_id else "queue" if job.queued else "owner"
        run = Run(
            job_id, kind, list(job.gpu_uuids), job.server_id, next(self.pids),
            job.reservation.lent_from_id, job.reservation_id, now,
        )  # fmt: skip
        self.job_owner[job_id] = self.names[job.owner_id]
        self.runs[job_id] = run
        if kind == "borrower":  # the pass that sees its loan end with the lent booking (loans_expire)
            grace = timedelta(seconds=self.p["portal"]["lend_grace_seconds"])
            self._pass_soon(job.reservation.end - grace - 12 * SECOND)
        self.at(now + timedelta(seconds=self.p["host"]["start_seconds"]), lambda: self._start_process(run))

    def _start_process(self, run: Run) -> None:
        """As the supervisor does: a stop asked since the claim means it never starts."""
        from jobs.models import Job
        from jobs.runs import stopped_before_start

        if self.runs.get(run.job_id) is not run or run.stopping:
            return
        status, why = stopped_before_start(run.job_id)
        if status:
            self._end(run, status, why)
            return
        now = self.clock.now
        Job.objects.transition(
            run.job_id,
            from_=Job.Status.STARTING,
            to=Job.Status.RUNNING,
            pid=run.pid,
            pid_started=1.0,
            started_at=now,
        )
        run.start = now
        self.rec.runs.append(run)
        # Its processes show in the next round the idle round takes (a start changes no decision
        # of the portal's sooner: the booking is busy by its job already); an end is told at
        # once (`_end`), so that the cards it leaves look free to lending.
        if run.kind == "owner":
            self.rec.owner_job_runs[run.job_id].append(run)
            self._telemetry_soon()  # the watchdog's rules judge the owner beside a borrower, if any
            return
        planned, _ = self.rec.submitted[run.job_id]
        done, server = self.work.get(run.job_id, (0.0, run.server))
        shared = self.p["queue"]["shared_job_folders"]
        run.work_before = done if (shared or server == run.server) else 0.0
        left = planned.minutes * 60 - run.work_before
        self.at(now + timedelta(seconds=left), lambda: self._finish(run))

    def _finish(self, run: Run) -> None:
        from jobs.models import Job

        if self.runs.get(run.job_id) is run and not run.stopping:
            self._end(run, Job.Status.SUCCEEDED, "")

    def _stops(self) -> None:
        """Each live run's supervisor reads its row every poll: a preemption, a cancel, its
        booking released or ended stop it (SIGTERM, then SIGKILL after its grace)."""
        from jobs.models import Job

        live = [pk for pk, run in self.runs.items() if not run.stopping]
        if not live:
            return
        now = self.clock.now
        rows = Job.objects.filter(pk__in=live).values_list(
            "pk", "preempt_requested_at", "preempt_reason", "preempt_grace_seconds", "cancel_requested_at",
            "reservation__released_at", "reservation__cancelled_at", "reservation__end",
        )  # fmt: skip
        q, host = self.p["queue"], self.p["host"]
        for pk, preempt, reason, grace, cancel, released, cancelled, end in rows:
            run = self.runs[pk]
            seen = now + timedelta(seconds=self.rng.uniform(0, host["poll_seconds"]))
            if preempt is not None:
                from jobs.preemption import preempted_words

                term = (
                    grace
                    if self.rng.random() < q["ignores_term_share"]
                    else min(grace, self.rng.uniform(*q["term_seconds"]))
                )
                status, why, after = Job.Status.PENDING, preempted_words(reason), term
            elif cancel is not None:
                status, why, after = Job.Status.CANCELLED, "Cancelled.", 1.0
            elif released is not None or cancelled is not None or end <= now:
                status, why, after = Job.Status.CANCELLED, "The booking ended.", 1.0
            else:
                continue
            run.stopping = True
            self.at(seen + timedelta(seconds=after), lambda r=run, s=status, w=why: self._end(r, s, w))

    def _end(self, run: Run, status: str, why: str) -> None:
        """The job's end as its supervisor records it; a preempted one goes back to the queue."""
        from jobs.host.spool import EndRecord
        from jobs.models import Job
        from jobs.runs import job_end_record, queued_job_ended

        if self.runs.get(run.job_id) is not run:
            return
        now = self.clock.now
        del self.runs[run.job_id]
        run.end, run.status = now, status
        if run.start is not None and run.kind != "owner":
            self._count_work(run, status, now)
        record = EndRecord(status=status, exit_code=0 if status == Job.Status.SUCCEEDED else None,
                           message=why, finished_at=now.isoformat())  # fmt: skip
        job_end_record(run.job_id, _NoLog(), record)
        queued_job_ended(Job.objects.get(pk=run.job_id), now=now)
        self._telemetry_soon()

    def _count_work(self, run: Run, status: str, now: datetime) -> None:
        """A preempted run keeps what it checkpointed; the rest of its work is lost."""
        from jobs.models import Job

        assert run.start is not None
        progress = run.work_before + (now - run.start).total_seconds()
        if status != Job.Status.PENDING:
            return
        every = self.p["queue"]["checkpoint_minutes"] * 60
        kept = (progress // every) * every
        self.work[run.job_id] = (kept, run.server)
        self.rec.preemptions.append(progress - kept)

    def attach(self) -> list[Callable[[], None]]:
        """The seams: the clock, the hosts' messages, the scheduler's wake-ups and the store of its
        holds; what undoes them."""
        import django.utils.timezone as tz

        import jobs.queue.scheduler
        import jobs.services
        import portal.wakeups

        holds = _HoldsStore()
        self.memory = jobs.queue.scheduler.PassMemory(redis=holds)  # type: ignore[arg-type]
        saved = (tz.now, jobs.services.send, portal.wakeups.wake, jobs.queue.scheduler.client)
        tz.now = self.clock  # type: ignore[assignment]
        jobs.services.send = lambda pk, queue: self.sent.append((pk, queue))  # type: ignore[assignment]
        portal.wakeups.wake = lambda name: setattr(self, "woken", True)  # type: ignore[assignment]
        jobs.queue.scheduler.client = lambda timeout: holds  # type: ignore[assignment]

        def undo() -> None:
            tz.now, jobs.services.send, portal.wakeups.wake, jobs.queue.scheduler.client = saved  # type: ignore[assignment]

        return [undo]


class _HoldsStore:
    """The scheduler's holds for waiting jobs (jobs.queue.scheduler: `_store_holds` writes them,
    the booking service reads them through `queue_holds`), kept in the week's own memory rather
    than in Redis. In Redis they made the week depend on where it ran: without a Redis (the bench
    alone) no booking was ever checked against them; with one (`make bench`) they expired on the
    real clock (30 s, hours of the simulated week) and the two weeks, running at once under one
    key, read each other's. Here the last pass's holds stand until the next pass, as they do in a
    lab whose scheduler passes every 2 s (between the week's passes only time moves)."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str, ex: int | None = None) -> None:
        self.values[key] = value

    def get(self, key: str) -> str | None:
        return self.values.get(key)


def now_le(a: datetime, b: datetime) -> bool:
    return a <= b


class _NoLog:
    """The simulated run writes no output: its log has nothing to flush."""

    def flush(self) -> None:
        return None
