"""Reads of jobs: who may see which. The lists' filters are jobs.filters (pages and API)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Max, Q
from django.http import Http404
from django.utils import timezone

from gpus.hooks import SESSION_ENDED, JobOutcome
from gpus.models import GPU, Allocation
from jobs.models import InteractiveSession, Job
from jobs.queue.rules import Entry
from portal.access import display_name, is_admin, team_ids_of


def jobs_owned_by(viewer: AbstractBaseUser, job_ids: Iterable[int]) -> Collection[int]:
    """The viewer's own jobs among `job_ids` (gpus asks, to show a job's processes in full)."""
    return set(Job.objects.filter(owner_id=viewer.pk, pk__in=list(job_ids)).values_list("pk", flat=True))


def job_images(job_ids: Iterable[int]) -> dict[int, str]:
    """{job id: its container image's name} for those of `job_ids` in one (gpus asks, to label a
    job's processes: gpus.hooks.job_images)."""
    rows = Job.objects.filter(pk__in=list(job_ids), image__isnull=False).values_list("pk", "image__name")
    return dict(rows)


def jobs_finished_between(since: datetime, until: datetime) -> list[JobOutcome]:
    """The jobs whose final status was written in [since, until) (gpus' usage rollup asks, through
    gpus.hooks.job_outcomes): read from the rows, since every final status is a conditional
    UPDATE (runner, reconciler, cancel) that sends no signal."""
    rows = Job.objects.filter(finished_at__gte=since, finished_at__lt=until, status__in=Job.FINISHED)
    jobs = [
        JobOutcome(at, cards[0], owner, team, status)
        for at, cards, owner, team, status in rows.values_list(
            "finished_at", "gpu_uuids", "owner", "team", "status"
        )
        if cards  # a job cancelled before it held a card used none
    ]
    # Interactive sessions count as jobs do, in a column of their own (gpus.hooks.SESSION_ENDED).
    ended = InteractiveSession.objects.filter(
        finished_at__gte=since, finished_at__lt=until, status=InteractiveSession.Status.ENDED
    ).values_list("finished_at", "gpu_uuids", "owner", "reservation__team")
    return jobs + [
        JobOutcome(at, cards[0], owner, team, SESSION_ENDED) for at, cards, owner, team in ended if cards
    ]


def jobs_peak_memory(
    visible: Q, since: datetime, until: datetime, filters: Mapping[str, str]
) -> dict[str, int]:
    """gpus.hooks.jobs_peak_memory: {username: the highest Job.peak_memory_mb} of the `visible` jobs
    that ran in [since, until), with the usage filters' team, user and server. A job's peak is what
    its own processes held, summed over its cards (jobs.services.jobs_usage_record): never another
    person's memory on a shared card, nor the driver's."""
    jobs = Job.objects.filter(visible, started_at__lt=until, peak_memory_mb__isnull=False).filter(
        Q(finished_at__isnull=True) | Q(finished_at__gte=since)
    )
    fields = {"team": "team__slug", "user": "owner__username", "server": "server__name"}
    jobs = jobs.filter(**{fields[name]: value for name, value in filters.items() if name in fields})
    peaks = jobs.values("owner__username").annotate(peak=Max("peak_memory_mb")).order_by()
    return {row["owner__username"]: row["peak"] for row in peaks}


def get_job_for_user(user: AbstractBaseUser, pk: int) -> Job:
    """The job if the user may see it; 404 otherwise (outsiders never learn it exists)."""
    job = (
        Job.objects.restrict(user)
        .select_related("owner", "team", "server", "reservation")
        .filter(pk=pk)
        .first()
    )
    if job is None:
        raise Http404("No such job.")
    return job


def queue_rows(viewer: AbstractBaseUser, entries: Sequence[Entry]) -> list[dict[str, Any]]:
    """The plan's entries as rows for the Queue page and GET /api/v1/queue/, in priority order.

    Everyone sees the whole queue (where they stand needs it); the job's name and owner only
    as the booking privacy rule allows (teammates and admins by name, others "another user")."""
    jobs = {
        row["pk"]: row
        for row in Job.objects.filter(pk__in=[e.request.job_id for e in entries]).values(
            "pk",
            "name",
            "owner_id",
            "owner__username",
            "team_id",
            "team__slug",
            "request_server__name",
            "array_index",
            "preemptible",
        )
    }
    teams = team_ids_of(viewer)
    rows = []
    for entry in entries:
        job, r = jobs.get(entry.request.job_id), entry.request
        if job is None:
            continue  # started or cancelled since the plan was made
        visible = job["owner_id"] == viewer.pk or job["team_id"] in teams or is_admin(viewer)
        rows.append(
            {
                "job": r.job_id,
                "name": job["name"] if visible else "",
                "owner": display_name(viewer, teams, job["owner_id"], job["owner__username"], job["team_id"]),
                "team": job["team__slug"] if visible else "",
                "gpu_count": r.gpu_count,
                "memory_mb": r.memory_mb,
                "server": job["request_server__name"] or "",
                "time_limit_minutes": r.minutes,
                "preemptible": job["preemptible"],
                "priority": entry.priority,
                "factors": {"fairshare": entry.fairshare, "age": entry.age, "nice": r.nice},
                "reason": entry.reason or ("starting" if entry.start_now else ""),
                "estimated_start": entry.estimated_start,
                "estimate_basis": entry.basis if entry.estimated_start else "",
                "submitted_at": r.submitted_at,
                "array_id": r.array_id,
                "array_index": job["array_index"],
                "mine": job["owner_id"] == viewer.pk,
            }
        )
    return rows


@dataclass(frozen=True)
class Placement:
    """Where a job that is not running yet will run, as far as anyone knows now.

    `booked`: its booking names the cards (a job on a booking, or a queued job the scheduler
    booked); otherwise they are the queue's plan (`planned`: its estimate, which may change).
    With no cards, `waits` says why in words: the job page's one line "not placed yet"."""

    server: str = ""
    cards: tuple[tuple[int, str], ...] = ()  # (index, model), in index order
    memory_mb: int | None = None  # per card; None: whole cards
    start: datetime | None = None
    booked: bool = False
    waits: str = ""  # a clause: "not enough free cards now"
    note: str = ""  # the queue's words beyond its reason (a silent worker where it would fit)

    @property
    def planned(self) -> bool:
        return bool(self.cards) and not self.booked

    @property
    def models(self) -> str:
        """The cards' models, each once: a mixed server's cards may differ."""
        return ", ".join(dict.fromkeys(model for _, model in self.cards))


NOT_YET_RUNNING = (Job.Status.PENDING, Job.Status.QUEUED, Job.Status.STARTING)


def job_placement(job: Job, entry: Entry | None) -> Placement | None:
    """Where `job` will run (None once it runs or has ended): its booking's cards, else the
    queue's plan for it (`entry`, from jobs.queue.scheduler.queue_plan; None: the plan was not read,
    and the stored reason stands in)."""
    if job.status not in NOT_YET_RUNNING:
        return None
    if job.gpu_uuids:
        allocations = Allocation.objects.filter(reservation_id=job.reservation_id, gpu_id__in=job.gpu_uuids)
        # One share for every card of a booking; None (whole cards) when any card is whole.
        shares = list(allocations.values_list("memory_mb", flat=True))
        memory = None if None in shares else max(shares, default=None)
        return _placement(job.gpu_uuids, memory, job.not_before, booked=True)
    planned = (entry.start_now or entry.held) if entry is not None else []
    if entry is not None and planned:
        start = timezone.now() if entry.start_now else entry.estimated_start  # held: estimated
        return _placement(planned, job.memory_mb, start, booked=False)
    server = job.request_server.name if job.request_server_id else ""
    reason = entry.reason if entry is not None else job.pending_reason
    label = str(Job.Reason(reason).label) if reason in Job.Reason.values else ""
    waits = label[:1].lower() + label[1:] if label else "it waits for the scheduler's next pass"
    return Placement(
        server=server,
        memory_mb=job.memory_mb,
        start=entry.estimated_start if entry is not None else None,
        waits=waits,
        note=entry.note if entry is not None else "",
    )


def _placement(
    uuids: Sequence[str], memory_mb: int | None, start: datetime | None, *, booked: bool
) -> Placement:
    gpus = GPU.objects.filter(uuid__in=list(uuids)).select_related("server").order_by("server__name", "index")
    cards = tuple((g.index, g.name) for g in gpus)
    server = ", ".join(dict.fromkeys(g.server.name for g in gpus))
    return Placement(server=server, cards=cards, memory_mb=memory_mb, start=start, booked=booked)
