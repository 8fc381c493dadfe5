"""Every question gpus asks a higher app, in one place: who asks, who answers, and the answer when
no app does. Open this file to know what jobs tells gpus; jobs registers its answers once, in
JobsConfig.ready(), as one `Answers` (`answered_by`).

gpus never reads jobs rows (jobs builds on gpus, not the reverse), yet some of its work needs
facts only jobs has. Each question is a typed field of `Answers` whose default answers "none", so
gpus works alone (its tests, a portal without the jobs app):

- `job_sessions(sessions)`: which portal job each reported process runs for, by its session.
  Asked by the telemetry ingest (gpus.services); jobs answers with jobs.services.jobs_by_session;
  no answer: none.
- `interactive_sessions(sessions)`: the same for `gpu exec` and JupyterLab sessions ("session N"
  on the dashboard). Asked by the telemetry ingest; jobs.sessions.services.sessions_by_session; none.
- `job_outcomes(since, until)`: the jobs that finished in [since, until). Asked by the usage
  rollup (gpus.usage); jobs.selectors.jobs_finished_between; none.
- `own_jobs(viewer, job_ids)`: which of these jobs are the viewer's. Asked for a process's
  command line (gpus.selectors.CommandLines); jobs.selectors.jobs_owned_by; none, so a job's
  processes show their whole command line to admins only.
- `job_images(job_ids)`: the container image each of these jobs runs in, by name ("job 12 ·
  image tf-2.17" beside a process on the dashboard and in the API). Asked by gpus.selectors;
  jobs.selectors.job_images; none (no job shows an image).
- `work_on_booking(reservation_id)`: what a release or cancel of the booking would stop. Asked
  by the booking pages before they do (gpus.reservation_views); jobs.sessions.services.work_on; nothing.
- `queue_holds(gpu_uuids, start, end)`: the queue's holds for its waiting jobs on these cards,
  which user bookings leave free. Asked by the booking checks (gpus.conflicts.queue_holds_on);
  jobs.queue.scheduler.queue_holds; no card is held.
- `loan_words(loan_ids)`: what a lent card says of each loan (a booking lent to the queue):
  "lent to the queue since 14:02: job 812". Asked by the dashboard's cards
  (gpus.selectors.bookings_now); jobs.lending.loan_words; nothing said.
- `jobs_peak_memory(visible, since, until, filters)`: the highest memory each person's own jobs
  held (Job.peak_memory_mb) among those that ran in [since, until), for the Reports page's
  "Jobs' own peak memory" beside the cards' peak. Asked by gpus.reports;
  jobs.selectors.jobs_peak_memory; none (the page shows "–").

The other ways up are declared the same way, each in its lower app's one file: what portal asks
(template slots, the hosts `make run` starts workers for) in portal/hooks.py; the facts that travel
with a GPU process (which portal and job started it) in gpus/process_env.py; gpus' signals
(`telemetry_ingested`, `snapshot_read`) only tell, they never return an answer.

The answers live on gpus' AppConfig, not in a module global: the app registry is the one object
per process Django builds once, and a test swaps them with `answered_by` and puts them back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from django.apps import apps
from django.db.models import Q


class JobOutcome(NamedTuple):
    finished_at: datetime
    gpu: str  # the job's first card: a job counts once, however many cards it ran on
    user_id: int
    team_id: int | None
    status: str  # "succeeded" and "failed" have columns of their own; SESSION_ENDED too; other: other


SESSION_ENDED = "session"  # an interactive session's outcome (gpu exec, JupyterLab): counted apart


class Work(NamedTuple):
    """Something a release or cancel of its booking would stop: "job 12 (train.py), running".
    `waiting`: a queued job, no process yet: it never starts (nothing gets SIGTERM)."""

    label: str
    url: str
    waiting: bool = False


@dataclass(frozen=True)
class QueueHold:
    """A card the queue's plan keeps for a waiting job from its estimated start (its backfill
    shadow): user bookings must leave it free, or the job is pushed back again and again."""

    gpu_uuid: str
    start: datetime
    end: datetime
    memory_mb: int | None
    job_id: int


# {server id: {session id, ...}} → {(server id, session id): job id} for the running jobs whose
# recorded pid (a job's session leader) is one of those sessions.
JobSessions = Callable[[Mapping[int, set[int]]], Mapping[tuple[int, int], int]]
# (since, until) → the outcomes of the jobs whose final status was written in [since, until).
JobOutcomes = Callable[[datetime, datetime], Sequence[JobOutcome]]
# (viewer, job ids) → the viewer's own jobs among them.
OwnJobs = Callable[[Any, Iterable[int]], Collection[int]]
# job ids → {job id: its container image's name} for those that run in one.
JobImages = Callable[[Iterable[int]], Mapping[int, str]]
# reservation id → what runs on it now.
BookingWork = Callable[[int], Sequence[Work]]
# (card uuids, start, end) → the queue's holds on those cards that overlap [start, end).
QueueHolds = Callable[[Sequence[str], datetime, datetime], Sequence[QueueHold]]
# loan booking ids → {loan id: "lent to the queue since 14:02: job 812"}
LoanWords = Callable[[Iterable[int]], Mapping[int, str]]
# (visible: a Q on owner_id and team_id, since, until, {"team": slug, "user": username, "server":
# name} as given) → {username: the highest peak memory (MiB) of their jobs that ran in [since, until)}
JobsPeakMemory = Callable[[Q, datetime, datetime, Mapping[str, str]], Mapping[str, int]]


def _no_sessions(sessions: Mapping[int, set[int]]) -> Mapping[tuple[int, int], int]:
    return {}


def _no_outcomes(since: datetime, until: datetime) -> Sequence[JobOutcome]:
    return ()


def _no_jobs(viewer: Any, job_ids: Iterable[int]) -> Collection[int]:
    return ()


def _no_images(job_ids: Iterable[int]) -> Mapping[int, str]:
    return {}


def _no_work(reservation_id: int) -> Sequence[Work]:
    return ()


def _no_loan_words(loan_ids: Iterable[int]) -> Mapping[int, str]:
    return {}


def _no_peaks(visible: Q, since: datetime, until: datetime, filters: Mapping[str, str]) -> Mapping[str, int]:
    return {}


def _no_holds(gpu_uuids: Sequence[str], start: datetime, end: datetime) -> Sequence[QueueHold]:
    return ()


@dataclass(frozen=True)
class Answers:
    """What the app above gpus answers (the table in this module's docstring)."""

    job_sessions: JobSessions = _no_sessions
    interactive_sessions: JobSessions = _no_sessions
    job_outcomes: JobOutcomes = _no_outcomes
    own_jobs: OwnJobs = _no_jobs
    job_images: JobImages = _no_images
    work_on_booking: BookingWork = _no_work
    queue_holds: QueueHolds = _no_holds
    loan_words: LoanWords = _no_loan_words
    jobs_peak_memory: JobsPeakMemory = _no_peaks


NO_ANSWERS = Answers()


def answered_by(answers: Answers) -> Answers:
    """Called once by the jobs app (JobsConfig.ready); registering again replaces every answer.
    Returns the answers it replaced (a test puts them back)."""
    config = apps.get_app_config("gpus")
    before = answers_now()
    config.answers = answers  # type: ignore[attr-defined]
    return before


def answers_now() -> Answers:
    return getattr(apps.get_app_config("gpus"), "answers", NO_ANSWERS)


def job_sessions(sessions: Mapping[int, set[int]]) -> dict[tuple[int, int], int]:
    """{(server id, session id): job id} for the portal jobs running in these sessions."""
    return dict(answers_now().job_sessions(sessions))


def interactive_sessions(sessions: Mapping[int, set[int]]) -> dict[tuple[int, int], int]:
    """{(server id, session id): interactive session id} for the sessions' processes."""
    return dict(answers_now().interactive_sessions(sessions))


def job_outcomes(since: datetime, until: datetime) -> list[JobOutcome]:
    """The jobs that finished in [since, until), one JobOutcome each."""
    return list(answers_now().job_outcomes(since, until))


def own_jobs(viewer: Any, job_ids: Iterable[int]) -> Collection[int]:
    """The viewer's own jobs among `job_ids`."""
    return answers_now().own_jobs(viewer, job_ids)


def job_images(job_ids: Iterable[int]) -> dict[int, str]:
    """{job id: its container image's name} for those of these jobs that run in one."""
    ids = [pk for pk in job_ids if pk]
    return dict(answers_now().job_images(ids)) if ids else {}


def loan_words(loan_ids: Iterable[int]) -> dict[int, str]:
    """{loan id: what a lent card says of it}, for loans (bookings lent to the queue's jobs)."""
    ids = list(loan_ids)
    return dict(answers_now().loan_words(ids)) if ids else {}


def work_on_booking(reservation_id: int) -> list[Work]:
    """What runs on the booking now, that ending it would stop."""
    return list(answers_now().work_on_booking(reservation_id))


def queue_holds(gpu_uuids: Sequence[str], start: datetime, end: datetime) -> list[QueueHold]:
    """The queue's holds on these cards overlapping [start, end) (unsorted: gpus.conflicts sorts)."""
    return list(answers_now().queue_holds(list(gpu_uuids), start, end))


def jobs_peak_memory(
    visible: Q, since: datetime, until: datetime, filters: Mapping[str, str]
) -> dict[str, int]:
    """{username: the highest peak memory (MiB) of their visible jobs that ran in [since, until)}."""
    return dict(answers_now().jobs_peak_memory(visible, since, until, filters))
