"""Right-sizing: what finished jobs used of what they booked, per card (docs/rightsizing.md).

Reads only, for two readers: the size hint (the job form, the booking form, `gpu run` and
GET /api/v1/jobs/size-hint/), and the leaders' report of the bookings and people whose jobs use
little of what they book. Both measure a job the same way (`_runs`), from what telemetry kept on
its row (`Job.peak_memory_mb`, the utilization sums) and what its booking holds (its allocations).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet
from django.utils import timezone

from gpus.models import GPU, Allocation, Reservation, format_mb
from jobs.models import Job
from portal.models import Team

HINT_RUNS = 10  # the hint reads the user's last runs of the script
HINT_MIN_RUNS = 3  # fewer is an anecdote, not a size
HINT_MARGIN_PCT = 20  # telemetry samples every few seconds: a short spike between samples is missed
ALREADY_RIGHT = 0.9  # a suggestion this close to what they book is not worth a word
FREQUENT_SCRIPT_JOBS = 50  # the booking form's default script: the most frequent of these
REPORT_PEAK_BELOW = 0.5  # the report: peak below half of the booking per card…
REPORT_UTILIZATION_BELOW_PCT = 20.0  # …and mean utilization below this
REPORT_PERIODS = (7, 30, 90)  # days
REPORT_DEFAULT_DAYS = 30


@dataclass(frozen=True)
class Run:
    """One finished job's use of its booking, per card."""

    owner_id: int
    reservation_id: int
    peak_mb: int
    booked_mb: int
    utilization_sum: float
    utilization_samples: int


def peak_per_card(peak_mb: int, cards: int, mirrored: bool) -> int:
    """The job's peak on one card. Telemetry keeps the peak of its processes' memory summed over its
    cards. MirroredStrategy replicates the model over them, so the sum splits evenly; otherwise
    TensorFlow uses the first card only (docs/jobs.md), so the whole sum may sit on one card: an even
    split would suggest a size on which the next run runs out of memory."""
    if mirrored and cards > 1:
        return -(-peak_mb // cards)
    return peak_mb


def script_name(script: str) -> str:
    """A job's name is its script's file name: 'src/train.py' and 'C:\\code\\train.py' → 'train.py'."""
    return re.split(r"[\\/]", script.strip())[-1]


def _measured(jobs: QuerySet[Job]) -> QuerySet[Job]:
    """Finished jobs that ran on a booking and whose processes telemetry saw. Failed, cancelled and
    lost runs count too: their peak is real, and a run that died of running out of memory peaked at
    its booking, which keeps a hint from suggesting less."""
    return jobs.filter(status__in=Job.FINISHED, peak_memory_mb__isnull=False, reservation__isnull=False)


def _booked_per_card(reservation_ids: set[int]) -> dict[int, int]:
    """MiB booked per card, by booking: the memory share, or a whole card's bookable memory."""
    sizes: dict[int, list[int]] = {}
    rows = Allocation.objects.filter(reservation_id__in=reservation_ids).values_list(
        "reservation_id", "memory_mb", "gpu__memory_total_mb", "gpu__memory_reserved_mb"
    )
    for reservation_id, memory_mb, total_mb, reserved_mb in rows:
        booked = memory_mb if memory_mb is not None else GPU.bookable_mb(total_mb, reserved_mb)
        sizes.setdefault(reservation_id, []).append(booked)
    # A booking's cards sit on one server and are alike in practice; the mean covers the rest.
    return {reservation_id: round(sum(s) / len(s)) for reservation_id, s in sizes.items()}


def _runs(jobs: QuerySet[Job]) -> list[Run]:
    """Measured jobs (`_measured`, sliced or not) as runs, in their order."""
    rows = list(
        jobs.values(
            "owner_id",
            "reservation_id",
            "gpu_uuids",
            "mirrored",
            "peak_memory_mb",
            "utilization_sum",
            "utilization_samples",
        )
    )
    booked = _booked_per_card({row["reservation_id"] for row in rows})
    return [
        Run(
            owner_id=row["owner_id"],
            reservation_id=row["reservation_id"],
            peak_mb=peak_per_card(row["peak_memory_mb"], len(row["gpu_uuids"]), row["mirrored"]),
            booked_mb=booked[row["reservation_id"]],
            utilization_sum=row["utilization_sum"],
            utilization_samples=row["utilization_samples"],
        )
        for row in rows
    ]


# --- the hint -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeHint:
    """What to book per card for a script, from the user's recent runs of it (MiB)."""

    script: str
    runs: int
    peak_mb: int  # the highest per-card peak of those runs
    booked_mb: int  # what the latest of them booked per card: what the user books now
    suggested_mb: int

    @property
    def text(self) -> str:
        return (
            f"Your last {self.runs} runs of {self.script} peaked at {format_mb(self.peak_mb)} of "
            f"{format_mb(self.booked_mb)} booked per card; {format_mb(self.suggested_mb)} would do."
        )

    @property
    def memory_input(self) -> str:
        """The suggestion as the forms' memory field reads it: '12G', or MiB when not whole GiB."""
        gib, rest = divmod(self.suggested_mb, 1024)
        return f"{gib}G" if not rest else f"{self.suggested_mb}M"


def suggest(
    script: str, runs: list[tuple[int, int]], *, largest_card_mb: int, headroom_mb: int
) -> SizeHint | None:
    """From (peak per card, booked per card) of runs, newest first: the highest peak, plus the CUDA
    context headroom (a job's TensorFlow gets its booking less the headroom, docs/jobs.md), plus
    HINT_MARGIN_PCT, rounded up to a whole GiB and capped at the largest card. None with fewer than
    HINT_MIN_RUNS runs, or when the runs already book about that much."""
    if len(runs) < HINT_MIN_RUNS:
        return None
    peak = max(p for p, _ in runs)
    booked = runs[0][1]
    needed = -(-(peak + headroom_mb) * (100 + HINT_MARGIN_PCT) // 100)
    suggested = min(-(-needed // 1024) * 1024, largest_card_mb)
    if suggested >= ALREADY_RIGHT * booked:
        return None
    return SizeHint(script=script, runs=len(runs), peak_mb=peak, booked_mb=booked, suggested_mb=suggested)


def frequent_script(user: AbstractBaseUser) -> str | None:
    """The script the user ran most among their recent measured jobs (the newest on a tie)."""
    jobs = _measured(Job.objects.filter(owner=user)).order_by("-created_at", "-id")
    names = Counter(jobs.values_list("name", flat=True)[:FREQUENT_SCRIPT_JOBS])
    return names.most_common(1)[0][0] if names else None


def largest_card_mb() -> int:
    rows = GPU.objects.values_list("memory_total_mb", "memory_reserved_mb")
    return max((GPU.bookable_mb(total, reserved) for total, reserved in rows), default=0)


def size_hint_for(user: AbstractBaseUser, script: str | None) -> SizeHint | None:
    """The hint for `script` (a name or a path) from the user's own runs of it; without one (None or
    empty), for their most frequent recent script. None when there is nothing to suggest."""
    name = script_name(script) if script else frequent_script(user)
    if not name:
        return None
    jobs = _measured(Job.objects.filter(owner=user, name=name)).order_by("-created_at", "-id")
    runs = _runs(jobs[:HINT_RUNS])
    return suggest(
        name,
        [(run.peak_mb, run.booked_mb) for run in runs],
        largest_card_mb=largest_card_mb(),
        headroom_mb=settings.GPU_CONTEXT_HEADROOM_MB,
    )


# --- the leaders' report --------------------------------------------------------------------------


@dataclass
class Use:
    """Measured jobs' use of their bookings, gathered for one booking or one person."""

    jobs: int = 0
    bookings: set[int] = field(default_factory=set)
    # The run that used the largest share of its booking per card: its share, peak and booking.
    peak_share: float = 0.0
    peak_mb: int = 0
    booked_mb: int = 0
    utilization_sum: float = 0.0
    utilization_samples: int = 0

    def add(self, run: Run) -> None:
        self.jobs += 1
        self.bookings.add(run.reservation_id)
        share = run.peak_mb / run.booked_mb if run.booked_mb else 1.0
        if share >= self.peak_share:
            self.peak_share, self.peak_mb, self.booked_mb = share, run.peak_mb, run.booked_mb
        self.utilization_sum += run.utilization_sum
        self.utilization_samples += run.utilization_samples

    @property
    def peak_label(self) -> str:
        return format_mb(self.peak_mb)

    @property
    def booked_label(self) -> str:
        return format_mb(self.booked_mb)

    @property
    def peak_pct(self) -> float:
        return round(100 * self.peak_share, 1)

    @property
    def mean_utilization_pct(self) -> float | None:
        """Over every sample of the jobs, as Job.mean_utilization_pct is over one job's."""
        if not self.utilization_samples:
            return None
        return round(self.utilization_sum / self.utilization_samples, 1)

    @property
    def oversized(self) -> bool:
        """Below both thresholds; without utilization samples nothing is known, so nothing is said."""
        utilization = self.mean_utilization_pct
        return (
            self.peak_share < REPORT_PEAK_BELOW
            and utilization is not None
            and utilization < REPORT_UTILIZATION_BELOW_PCT
        )


def report_days(raw: str | None) -> int:
    """The report's ?days=: one of REPORT_PERIODS; anything else gets the default."""
    return int(raw) if raw in {str(days) for days in REPORT_PERIODS} else REPORT_DEFAULT_DAYS


def oversized_report(team: Team, since: datetime) -> dict[str, list[tuple[Any, Use]]]:
    """The team's bookings and people whose jobs finished since `since` stayed below
    REPORT_PEAK_BELOW of their booking per card and REPORT_UTILIZATION_BELOW_PCT mean utilization;
    lowest peak share first. Only jobs tell what a booking used: bookings without one are left to
    the idle checker (docs/booking.md)."""
    by_booking: dict[int, Use] = {}
    by_owner: dict[int, Use] = {}
    for run in _runs(_measured(Job.objects.filter(team=team, finished_at__gte=since))):
        by_booking.setdefault(run.reservation_id, Use()).add(run)
        by_owner.setdefault(run.owner_id, Use()).add(run)
    bookings = Reservation.objects.filter(pk__in=[pk for pk, use in by_booking.items() if use.oversized])
    bookings = bookings.select_related("owner").prefetch_related("allocations__gpu__server")
    owners = get_user_model().objects.filter(pk__in=[pk for pk, use in by_owner.items() if use.oversized])
    return {
        "bookings": sorted(((b, by_booking[b.pk]) for b in bookings), key=lambda row: row[1].peak_share),
        "people": sorted(((u, by_owner[u.pk]) for u in owners), key=lambda row: row[1].peak_share),
    }


# --- the typical duration -------------------------------------------------------------------------

TYPICAL_RUNS = 10  # the newest runs a typical duration is taken from
TYPICAL_DAYS = 90  # and no older than this: the read stays bounded, and old habits are forgotten


def typical_minutes(pairs: set[tuple[int, str]]) -> dict[tuple[int, str], int]:
    """The typical run time, in whole minutes (at least 1), of each (owner id, script name) from the
    owner's newest TYPICAL_RUNS succeeded runs of it in TYPICAL_DAYS: their median, with at least
    HINT_MIN_RUNS of them (fewer is an anecdote); pairs without enough runs are left out. Only
    runs that succeeded: one that failed or was cancelled early says nothing of how long the work
    takes."""
    if not pairs:
        return {}
    runs: dict[tuple[int, str], list[float]] = {}
    rows = (
        Job.objects.filter(
            status=Job.Status.SUCCEEDED,
            owner_id__in={o for o, _ in pairs},
            name__in={n for _, n in pairs},
            started_at__isnull=False,
            finished_at__gte=timezone.now() - timedelta(days=TYPICAL_DAYS),
        )
        .order_by("-finished_at", "-id")
        .values_list("owner_id", "name", "started_at", "finished_at")
    )
    for owner, name, started, finished in rows.iterator():
        found = runs.setdefault((owner, name), [])
        if (owner, name) in pairs and len(found) < TYPICAL_RUNS:
            found.append((finished - started).total_seconds() / 60)
    typical = {}
    for pair, minutes in runs.items():
        if len(minutes) >= HINT_MIN_RUNS:
            minutes.sort()
            typical[pair] = max(1, round(minutes[len(minutes) // 2]))
    return typical
