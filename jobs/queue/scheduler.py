"""The queue's scheduler: a thread of the portal's worker that starts pending jobs when cards free up.

Every QUEUE_SCHEDULE_SECONDS, and at once when a booking is released or cancelled or a job ends
(portal.wakeups), one pass: gather the facts (pending jobs, the cards of the online servers and
their bookings, the teams' and members' shares and decayed usage), let `jobs.queue.rules.plan` decide,
then start what it chose. A job starts by booking its cards for [now, now + its time limit + START_SLACK)
through the booking service, so double-booking protection, quotas and the audit log all hold,
and is then dispatched like any job. When it ends, its booking is released (jobs.runs.queued_job_ended).
Each pass keeps the plan's shadows for the booking service (`queue_holds`, registered in
JobsConfig.ready), so user bookings leave a waiting wide job's cards free from its estimated start.

Safe to run twice at once: each start is a conditional UPDATE on the job (PENDING → QUEUED) in
the booking's transaction, and the booking service's row locks settle two passes racing for a
card (the loser gets a Conflict and tries again next pass).
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial

import redis
from django.conf import settings
from django.core.cache import cache
from django.db import close_old_connections, transaction
from django.db.models import Count, Q
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.hooks import QueueHold
from gpus.images import runnable_servers
from gpus.models import GPU, Allocation, Reservation, Server
from jobs.leavers import owner_active
from jobs.lending import loans_expire, loans_place
from jobs.logs.live import job_changed
from jobs.models import InteractiveSession, Job, JobArray
from jobs.queue.calendar import Calendar, Card
from jobs.queue.expected import expected_ends, expected_requests, with_lending
from jobs.queue.rules import Entry, Request, Shares, Usage, Weights, decayed_hours, plan
from jobs.runs import queued_job_ended
from jobs.services import cpu_share, default_threads, dispatch, jobs_due_dispatch
from portal.errors import Conflict, Forbidden, Invalid, QuotaExceeded, ServiceError
from portal.models import Membership, Team
from portal.names import redis_key
from portal.periodic import PeriodicThread
from portal.timefmt import format_time
from portal.unreachable import REDIS, WHAT, outage_of
from portal.wakeups import QUEUE_SCHEDULER, client, wait

log = logging.getLogger(__name__)

USAGE_CACHE_SECONDS = 60
# The plan's holds for waiting jobs, kept for the booking service (queue_holds) for a few passes.
HOLDS_PASSES = 5
HOLDS_MIN_TTL_SECONDS = 30
# Re-plans in one pass after refused starts: each drops at least one job; a few are plenty, and a
# pass must stay cheap with a thousand pending jobs.
QUEUE_REPLANS = 5
# The booking service's refusals as a job's pending reason. Forbidden: its owner may not book for
# its team (they left it; jobs.leavers cancels such jobs), so no start of it can succeed now.
REFUSAL_REASONS: dict[type[ServiceError], str] = {
    QuotaExceeded: Job.Reason.QUOTA,
    Forbidden: Job.Reason.QUOTA,
    Conflict: Job.Reason.RESOURCES,  # a manual booking took a card since the plan read them
    Invalid: Job.Reason.RESOURCES,
}
# A worker's pool size older than this many reconcile intervals means its worker has gone silent
# (stopped, or cut off from the database while Redis works): nothing starts on that host until it
# reports again. Nor on a host whose worker never reported (it has not started yet).
SLOTS_STALE_INTERVALS = 4
REFUSED = "Waiting: "  # a refused job's message starts so: the booking service's words follow


@dataclass
class PassMemory:
    """What one scheduler keeps from pass to pass: its Scheduler thread owns one, so a second
    portal, a restarted worker or a test starts from nothing. A pass given none (the Queue page,
    the API, a test) remembers nothing: it logs every failure and reads the usage afresh, but for
    the pages and the API, which share a minute's cache of it (fairshare_state)."""

    failed_before: set[int] = field(default_factory=set)  # jobs whose failure was logged with its traceback
    usage: tuple[datetime, Shares, Usage] | None = None  # the fair-share usage, and when it was read
    holds_unstored: bool = False  # the last pass could not store its holds (Redis away): said once
    # Where the holds are stored: one connection kept, not a new one (about 1.5 ms) every pass.
    redis: redis.Redis | None = None

    def forget_usage(self) -> None:
        """The bench changes bookings under the cache."""
        self.usage = None


def _holds_key() -> str:
    """One portal's holds: two portals may share a Redis, and their card uuids and job ids collide."""
    return redis_key("queue", "holds")


def queue_plan(
    *,
    now: datetime | None = None,
    leave_out: Collection[int] = (),
    not_now: Collection[int] = (),
    memory: PassMemory | None = None,
    shared_usage: bool = False,
    expected: bool = False,
) -> list[Entry]:
    """The plan as it stands: every pending job in priority order, with its factors, reason and
    estimated start (the Queue page, GET /api/v1/queue/, and each pass). `leave_out`: jobs the
    booking service refused this pass, planned without, so they hold no cards from the others.
    `not_now`: jobs refused for a card taken since the plan read them: they wait this pass but
    keep their place (their shadows). `shared_usage`: the fair-share usage from the cache the
    pages share (fairshare_state). `expected`: what the pages show (jobs/queue/expected.py): the
    running jobs end when expected, and a job the next pass would lend a booking starts then;
    never for a pass, which books by time limits."""
    now = now or timezone.now()
    requests = [r for r in _pending() if r.job_id not in leave_out]
    if not requests:
        return []
    if expected:
        requests = expected_requests(requests)
    shares, usage = fairshare_state(now, memory, shared=shared_usage)
    online = _online()
    # The calendar as far as the longest pending job reaches, and QUEUE_ESTIMATE_HORIZON_HOURS on:
    # enough to start any of them safely now, and to estimate starts within the horizon.
    longest = max(r.minutes for r in requests)
    horizon = now + timedelta(minutes=longest, hours=settings.QUEUE_ESTIMATE_HORIZON_HOURS)
    servers = [pk for pk, *_ in online]
    slots, silent = _free_slots(now, [(pk, name, n, at) for pk, _, name, n, at in online])
    draining = {pk for pk, is_draining, *_ in online if is_draining}
    ends = expected_ends(now) if expected else {}
    array_room = _array_room({r.array_id for r in requests if r.array_id})
    calendar = _calendar(now, servers, horizon, slots=slots, silent=silent, ends=ends)
    entries = plan(
        requests,
        calendar,
        shares=shares,
        usage=usage,
        weights=Weights(
            fairshare=settings.QUEUE_FAIRSHARE_WEIGHT,
            age=settings.QUEUE_AGE_WEIGHT,
            age_max=timedelta(hours=settings.QUEUE_AGE_MAX_HOURS),
        ),
        depth=settings.QUEUE_BACKFILL_DEPTH,
        draining=draining,
        array_room=array_room,
        not_now=not_now,
        offline=_offline(requests, set(servers)),
    )
    if expected:
        # The slots the plan's own starts left (the calendar counts them down), as the pass lends
        # only after its starts: the last free slot of a server is not shown lent as well.
        with_lending(entries, now, slots=_taking_work(calendar.slots, draining), arrays=array_room)
    return entries


def schedule_pass(*, now: datetime | None = None, memory: PassMemory | None = None) -> dict[str, int]:
    """One pass: start what the plan says can start now; record why the others wait.

    A start the booking service refuses (a quota, a member who left the team) is taken out and the
    rest planned again in the same pass, so a job that is refused every time never holds cards a
    job behind it could use now. One refused for a card taken since the plan read it (Conflict)
    stays in the re-plan as waiting, with its shadow, so the jobs behind it cannot take its cards
    for the rest of the pass. Each round refuses at least one more job, and at most QUEUE_REPLANS
    rounds run. `memory`: the Scheduler's, kept from pass to pass; none, a fresh one."""
    now = now or timezone.now()
    memory = memory or PassMemory()
    done: Counter[str] = Counter()
    done["released"] = _release_ended(now)
    if sent := jobs_due_dispatch(now):  # an owner's job whose borrowers just left its cards
        done["sent"] = sent
    refused: dict[int, Refusal] = {}
    for _round in range(1 + QUEUE_REPLANS):
        entries = queue_plan(
            now=now,
            leave_out=[pk for pk, r in refused.items() if not r.keeps_place],
            not_now=[pk for pk, r in refused.items() if r.keeps_place],
            memory=memory,
        )
        newly = False
        for entry in entries:
            if not entry.start_now:
                continue
            refusal = _start(entry, now)
            if refusal and refusal.error:
                _failed(entry.request.job_id, refusal.error, memory)
            done[refusal.reason if refusal else "started"] += 1
            if refusal:
                refused[entry.request.job_id] = refusal
                newly = True
        if not newly:
            break
    # What still waits and may be preempted: on an idle booking lent to the queue (jobs/lending.py),
    # where a borrower whose lent booking is about to end leaves first.
    if expiring := loans_expire(now):
        done["expired_loans"] = len(expiring)
    waiting = [e for e in entries if e.request.job_id not in refused]
    # The arrays' room read again when something is lendable: the pass's starts took theirs.
    arrays = partial(_array_room, {e.request.array_id for e in waiting if e.request.array_id})
    if lent := loans_place(waiting, now, bind=_bind_and_send, slots=partial(_slots_now, now), arrays=arrays):
        done["lent"] = lent
    _record_reasons(entries, refused)
    _store_holds(entries, memory)
    planned = {e.request.job_id for e in entries}
    done["pending"] = sum(1 for e in entries if not e.start_now) + len(refused.keys() - planned) - lent
    return dict(done)


@dataclass(frozen=True)
class Refusal:
    """Why the booking service refused a start: the job's pending reason, and its words."""

    reason: str
    message: str = ""
    keeps_place: bool = False  # a card taken since the plan read them: it keeps its shadow this pass
    error: Exception | None = None  # not a refusal but a bug or fault: logged once per job (`_failed`)


def _record_reasons(entries: list[Entry], refused: dict[int, Refusal]) -> None:
    """Each waiting job's reason; a refused one also keeps the booking service's words as its
    message, so its owner reads why, and one held up by a silent worker says so (cleared when
    neither holds any more, or when it starts: `_bind`). The rows are read once, and only the
    jobs whose row changes are written and their pages told: a steady pass writes nothing."""
    wanted: dict[int, dict[str, str]] = {}
    for entry in entries:
        if not entry.start_now and entry.reason:
            wanted[entry.request.job_id] = {"pending_reason": entry.reason}
            if entry.note and entry.request.job_id not in refused:
                wanted[entry.request.job_id]["message"] = f"{REFUSED}{entry.note}"[:1000]
    for pk, refusal in refused.items():
        wanted[pk] = {"pending_reason": refusal.reason, "message": refusal.message[:1000]}
    changes: dict[tuple[tuple[str, str], ...], list[int]] = defaultdict(list)
    stored = Job.objects.filter(status=Job.Status.PENDING).order_by()
    for pk, reason, message in stored.values_list("pk", "pending_reason", "message"):
        if (want := wanted.get(pk)) is None:
            continue
        if "message" not in want and message.startswith(REFUSED):
            want["message"] = ""  # an earlier refusal's or silence's words go
        row = {"pending_reason": reason, "message": message}
        if change := tuple((name, value) for name, value in want.items() if row[name] != value):
            changes[change].append(pk)
    changed: set[int] = set()
    for change, ids in changes.items():
        Job.objects.filter(pk__in=ids, status=Job.Status.PENDING).update(**dict(change))
        changed.update(ids)
    job_changed(changed)


def _release_ended(now: datetime) -> int:
    """Bookings of queued jobs that ended without their worker releasing them (lost, cancelled
    before a worker took them): released here."""
    released = 0
    ended = Job.objects.filter(
        queued=True,
        status__in=Job.FINISHED,
        reservation__released_at=None,
        reservation__cancelled_at=None,
        reservation__end__gt=now,
    )
    if not ended.exists():  # nearly every pass: asked without building whole rows
        return 0
    for job in ended.select_related("reservation"):
        with transaction.atomic():
            queued_job_ended(job, now=now)
        released += 1
    return released


def _start(entry: Entry, now: datetime) -> Refusal | None:
    """Book the plan's cards and dispatch the job; None when started (or nothing to do), else why
    it still waits. Every refusal is this job's alone: the pass goes on with the others."""
    r = entry.request
    try:
        with transaction.atomic():
            job = Job.objects.select_related("owner", "team").get(pk=r.job_id)
            if job.status != Job.Status.PENDING or not job.owner.is_active:
                return None  # cancelled meanwhile, another pass started it, or its owner left
            booking = reservation_create(
                user=job.owner,
                team=job.team,
                gpus=entry.start_now,
                memory_mb=job.memory_mb,
                start=now,
                end=now + r.booked,  # the window the plan checked
                note=f"Queued job {job.pk} ({job.name})",
                now=now,
                queue_start=True,  # in plan order: the holds it keeps bind others, not its own starts
            )
            _bind(job, booking, now)
            dispatch(job, now)
    except ServiceError as refusal:
        reason = REFUSAL_REASONS.get(type(refusal), Job.Reason.RESOURCES)
        log.info("Job %s could not start this pass (%s): %s", r.job_id, reason, refusal.message)
        return Refusal(reason, f"{REFUSED}{refusal.message}", keeps_place=isinstance(refusal, Conflict))
    except Exception as exc:  # a bug or a fault this job meets: skip it, never the pass
        return Refusal(Job.Reason.RESOURCES, error=exc)
    log.info("Started queued job %s on %s", r.job_id, ", ".join(entry.start_now))
    return None


def _bind_and_send(job: Job, booking: Reservation, now: datetime) -> None:
    """A job started on a booking made for it (a loan, jobs/lending.py), as `_start` starts one."""
    _bind(job, booking, now)
    dispatch(job, now)


def _failed(job_id: int, error: Exception, memory: PassMemory) -> None:
    """A start that failed unexpectedly: its traceback once per scheduler, not every pass."""
    if job_id not in memory.failed_before:
        memory.failed_before.add(job_id)
        log.error("Job %s could not start; the others go on, and it is tried again", job_id, exc_info=error)


def _bind(job: Job, booking: Reservation, now: datetime) -> None:
    """PENDING → QUEUED on its new booking, its threads defaulting to the booking's CPU share."""
    allocations = list(booking.allocations.select_related("gpu__server").order_by("gpu__index"))
    server = allocations[0].gpu.server
    intra, inter = default_threads(cpu_share(server, allocations))
    claimed = Job.objects.transition(
        job.pk,
        from_=Job.Status.PENDING,
        to=Job.Status.QUEUED,
        reservation=booking,
        server=server,
        gpu_uuids=[a.gpu_id for a in allocations],
        not_before=now,
        pending_reason="",
        message="",  # a refusal's words from an earlier pass
        intra_op_threads=job.intra_op_threads or intra,
        inter_op_threads=job.inter_op_threads or inter,
    )
    if not claimed:
        raise Conflict(f"Job {job.pk} was cancelled or started meanwhile.")
    job.refresh_from_db()


# --- the holds: the plan's shadows, which user bookings must leave free ---------------------------


def _holds_ttl() -> int:
    """A few passes: a scheduler that stopped stops holding cards soon after."""
    return max(HOLDS_MIN_TTL_SECONDS, HOLDS_PASSES * settings.QUEUE_SCHEDULE_SECONDS)


def _store_holds(entries: list[Entry], memory: PassMemory) -> None:
    """Keep this pass's shadows where the booking service reads them (`queue_holds`): each waiting
    job's cards from its estimated start for its time limit (and the start's slack, as its booking
    will last). Redis away: bookings go unguarded until it is back, never wrong."""
    holds = []
    for e in entries:
        if not e.held or e.estimated_start is None:
            continue
        end = e.estimated_start + e.request.booked
        created = e.request.submitted_at.isoformat()
        holds += [
            [
                uuid,
                e.estimated_start.isoformat(),
                end.isoformat(),
                e.request.memory_mb,
                e.request.job_id,
                created,
            ]
            for uuid in e.held
        ]
    try:
        memory.redis = memory.redis or client(5)
        memory.redis.set(_holds_key(), json.dumps(holds), ex=_holds_ttl())
    except redis.RedisError:
        if not memory.holds_unstored:  # once per outage, not every pass
            log.warning("Queue: could not store the holds for waiting jobs; bookings may take their cards")
        memory.holds_unstored = True
        return
    if memory.holds_unstored:
        log.info("Queue: the holds for waiting jobs are stored again")
    memory.holds_unstored = False


def queue_holds(gpu_uuids: Sequence[str], start: datetime, end: datetime) -> list[QueueHold]:
    """The booking service's question (gpus.hooks.queue_holds): the last pass's
    holds on these cards overlapping [start, end), of jobs that still wait. A hold whose job started,
    was cancelled or is gone binds no one, whatever the store still says."""
    try:
        raw = client(2).get(_holds_key())
    except redis.RedisError:
        log.warning(
            "Queue: could not read the holds for waiting jobs; this booking is not checked against them"
        )
        return []
    wanted = set(gpu_uuids)
    found = []
    for uuid, at, until, memory_mb, job_id, created in json.loads(raw or "[]"):
        hold = QueueHold(uuid, datetime.fromisoformat(at), datetime.fromisoformat(until), memory_mb, job_id)
        if uuid in wanted and hold.start < end and hold.end > start:
            found.append((hold, datetime.fromisoformat(created)))
    if not found:
        return []
    waiting = set(
        Job.objects.filter(pk__in={h.job_id for h, _ in found}, status=Job.Status.PENDING).values_list(
            "pk", "created_at"
        )
    )
    return [hold for hold, created in found if (hold.job_id, created) in waiting]


# --- the facts ---------------------------------------------------------------------------------------


def _pending() -> list[Request]:
    """The pending jobs as the plan takes them (plain rows: a thousand of them every pass). A
    deactivated owner's are left out: they never start, and jobs.leavers cancels them. A job in a
    container image may use only the servers that have it where containers work."""
    default = settings.QUEUE_DEFAULT_TIME_LIMIT_MINUTES
    rows = (
        Job.objects.filter(owner_active(), status=Job.Status.PENDING)
        .order_by()
        .values_list(
            "pk",
            "owner_id",
            "team_id",
            "gpu_count",
            "memory_mb",
            "request_server_id",
            "time_limit_minutes",
            "created_at",
            "nice",
            "begin_at",
            "array_id",
            "image_id",
        )
    )
    rows = list(rows)
    # A job in a container image starts only where the image is and containers work (one query).
    images = runnable_servers({row[-1] for row in rows if row[-1]})
    return [
        Request(
            pk, owner, team, count or 1, memory, server, minutes or default, created, nice, begin, array,
            servers=frozenset(images[image]) if image else None,
        )
        for pk, owner, team, count, memory, server, minutes, created, nice, begin, array, image in rows
    ]  # fmt: skip


def _offline(requests: Sequence[Request], online: set[int]) -> dict[int, str]:
    """The servers that pending jobs asked for by name and that are not online now (no report for
    SERVER_OFFLINE_AFTER_SECONDS, or none ever), with the words their jobs show: the same from
    pass to pass while the server stays away, so a job's message is written once."""
    asked = {r.server_id for r in requests if r.server_id is not None} - online
    if not asked:  # nearly every pass: no query to build
        return {}
    words = {}
    for pk, name, seen in (
        Server.objects.filter(pk__in=asked).portal_scheduled().values_list("pk", "name", "last_seen")
    ):
        last = f"last reported {format_time(seen)}" if seen else "has never reported"
        words[pk] = f"{name} is offline (its worker {last}); the job starts there once it reports again"
    return words


def _online() -> list[tuple[int, bool, str, int | None, datetime | None]]:
    """The online servers the portal schedules: (pk, draining, name, job_slots, job_slots_at)."""
    servers = Server.objects.online().portal_scheduled()
    return list(servers.values_list("pk", "draining", "name", "job_slots", "job_slots_at"))


def _slots_now(now: datetime) -> dict[int, int]:
    """The free job slots after this pass's own starts, of the servers that take new work (its
    loans')."""
    online = _online()
    slots, _silent = _free_slots(now, [(pk, name, n, at) for pk, _, name, n, at in online])
    return _taking_work(slots, {pk for pk, is_draining, *_ in online if is_draining})


def _taking_work(slots: dict[int, int], draining: set[int]) -> dict[int, int]:
    """A draining server takes no new work, loans included: the pass's and the Queue page's."""
    return {pk: n for pk, n in slots.items() if pk not in draining}


def _free_slots(
    now: datetime, servers: Sequence[tuple[int, str, int | None, datetime | None]]
) -> tuple[dict[int, int], dict[int, str]]:
    """Free job slots of each server whose worker said lately how many jobs it runs at once
    (jobs.host.pickup writes Server.job_slots): its pool size less the jobs it holds or has been sent,
    and its JupyterLab sessions (each runs in a slot of the pool, as a job does). `servers`: the
    online servers' (pk, name, job_slots, job_slots_at), as queue_plan read them.
    And the servers whose worker did not say so lately, or never (it has not started yet), with
    words that say why: the plan starts nothing there until it does, rather than planning every
    queued job onto a host that may run one at a time."""
    fresh = now - timedelta(seconds=SLOTS_STALE_INTERVALS * settings.JOB_RECONCILE_SECONDS)
    known: dict[int, int] = {}
    silent: dict[int, str] = {}
    for pk, name, slots, at in servers:
        if slots is None or at is None:
            silent[pk] = (
                f"{name}'s worker has not yet said how many jobs it runs at once, so no job starts "
                f"there until it does"
            )
        elif at >= fresh:
            known[pk] = slots
        else:
            silent[pk] = (
                f"{name}'s worker has not reported for {int((now - at).total_seconds())} s, so no job "
                f"starts there until it does"
            )
    if not known:
        return {}, silent
    held = dict(
        Job.objects.filter(
            Q(status__in=(Job.Status.STARTING, Job.Status.RUNNING))
            | Q(status=Job.Status.QUEUED, dispatched_at__isnull=False),
            server_id__in=list(known),
        )
        .values_list("server_id")
        .annotate(n=Count("pk"))
    )
    labs = Counter(
        InteractiveSession.objects.holding_slots()
        .filter(server_id__in=list(known))
        .values_list("server_id", flat=True)
    )
    return {pk: max(0, slots - held.get(pk, 0) - labs[pk]) for pk, slots in known.items()}, silent


def _calendar(
    now: datetime,
    servers: list[int],
    horizon: datetime,
    *,
    slots: dict[int, int] | None = None,
    silent: dict[int, str] | None = None,
    ends: dict[int, datetime] | None = None,
) -> Calendar:
    """The cards of the online servers that take work, and their bookings from now to `horizon`;
    `ends`: booking id → an earlier end to plan with (jobs.queue.expected.expected_ends). Read
    unordered: the Calendar orders them (the models' orderings cost a join and two sorts)."""
    cards = [
        Card(uuid, server, GPU.bookable_mb(total, reserved))
        for uuid, server, total, reserved in GPU.objects.filter(server_id__in=servers, state="ok")
        .order_by()
        .values_list("uuid", "server_id", "memory_total_mb", "memory_reserved_mb")
    ]
    busy: dict[str, list] = defaultdict(list)
    ends = ends or {}
    for uuid, start, end, memory, booking in (
        Allocation.objects.live_between(now, horizon)
        .filter(gpu__server_id__in=servers)
        .order_by()
        .values_list("gpu_id", "start", "end", "memory_mb", "reservation_id")
    ):
        busy[uuid].append((max(start, now), ends.get(booking, end), memory))
    return Calendar(cards, busy, now, horizon, slots=slots, silent=silent)


def _array_room(arrays: set[int]) -> dict[int, int]:
    """How many more tasks each array may run now (one query: the arrays and their running tasks)."""
    if not arrays:
        return {}
    on_its_way = Q(tasks__status__in=(Job.Status.QUEUED, Job.Status.STARTING, Job.Status.RUNNING))
    rows = (
        JobArray.objects.filter(pk__in=arrays)
        .annotate(running=Count("tasks", filter=on_its_way))
        .values_list("pk", "max_running", "running")
    )
    return {a: (limit - running) if limit else 1_000_000 for a, limit, running in rows}


def fairshare_state(
    now: datetime, memory: PassMemory | None = None, *, shared: bool = False
) -> tuple[Shares, Usage]:
    """The teams' and members' shares, and their decayed usage, kept for a minute: usage moves
    slowly, and neither a pass every two seconds nor every view of the Queue page need re-read
    weeks of bookings. The scheduler keeps it in its `memory`; `shared` (the pages and the API)
    keeps it in Django's cache, per process, under this portal's instance. Neither given (a
    test, a pass of its own): read afresh."""
    if memory and memory.usage is not None and (now - memory.usage[0]).total_seconds() < USAGE_CACHE_SECONDS:
        return memory.usage[1], memory.usage[2]
    key = redis_key("queue", "fairshare-usage")  # the portal's one naming of shared keys
    kept = cache.get(key) if shared else None
    if kept is not None and abs((now - kept[0]).total_seconds()) < USAGE_CACHE_SECONDS:
        return kept[1], kept[2]
    shares, usage = _fairshare_read(now)
    if memory is not None:
        memory.usage = (now, shares, usage)
    if shared:
        cache.set(key, (now, shares, usage), USAGE_CACHE_SECONDS)
    return shares, usage


def _fairshare_read(now: datetime) -> tuple[Shares, Usage]:
    shares = Shares(
        team=dict(Team.objects.values_list("pk", "shares")),
        member={(t, u): s for t, u, s in Membership.objects.values_list("team_id", "user_id", "shares")},
    )
    half_life = timedelta(days=settings.FAIRSHARE_HALF_LIFE_DAYS)
    team: dict[int, float] = defaultdict(float)
    member: dict[tuple[int, int], float] = defaultdict(float)
    rows = Allocation.objects.live_between(now - 5 * half_life, now).values_list(
        "start", "end", "memory_mb", "gpu__memory_total_mb", "reservation__team_id", "reservation__owner_id"
    )
    for start, end, memory_mb, total, team_id, owner_id in rows:
        fraction = GPU.charged_share(memory_mb, total)
        hours = decayed_hours(start, end, fraction, now, half_life)
        team[team_id] += hours
        member[(team_id, owner_id)] += hours
    return shares, Usage(team=dict(team), member=dict(member))


class Scheduler(PeriodicThread):
    def __init__(self) -> None:
        super().__init__("queue-scheduler", settings.QUEUE_SCHEDULE_SECONDS)
        self.client = client(self.interval + 10)
        self.wakeups_away = False  # Redis could not be waited on at the last pause: said once an outage
        self.memory = PassMemory()  # this thread's, from pass to pass

    def step(self) -> None:
        close_old_connections()  # a restarted database must not kill the loop
        done = schedule_pass(memory=self.memory)
        if done.get("started"):
            log.info("Queue: %s", done)

    def pause(self) -> None:
        """Until woken (a card freed up) or the interval passes. Redis away: plain intervals until
        it is back, said once an outage (without a traceback) and once when it answers again."""
        try:
            wait(self.client, QUEUE_SCHEDULER, self.interval)
        except Exception as exc:
            if outage_of(exc) is None:
                log.exception("Queue scheduler: waiting for wake-ups failed; a pass every %ss", self.interval)
            elif not self.wakeups_away:
                log.warning(
                    "Queue scheduler: %s is away (%s); no wake-ups, a pass every %ss until it is back",
                    WHAT[REDIS],
                    exc,
                    self.interval,
                )
                self.wakeups_away = True
            super().pause()
            return
        if self.wakeups_away:
            log.warning("Queue scheduler: %s answers again; wake-ups are back", WHAT[REDIS])
            self.wakeups_away = False
