"""What gpus asks the jobs app: plain functions that jobs registers in its AppConfig.ready().

gpus never reads jobs rows (jobs builds on gpus, not the reverse), yet two of its writes need
facts only jobs has. Each question is one typed function here with an answer for when no app
registered one, so gpus works alone (its tests, a portal without the jobs app):

- `job_sessions(sessions)`: which portal job each reported process belongs to, by its session
  (the telemetry ingest, gpus.services); no answer: none.
- `job_outcomes(since, until)`: the jobs that finished in [since, until) (the usage rollup,
  gpus.usage); no answer: none.
- `own_jobs(viewer, job_ids)`: which of these jobs are the viewer's (a process's command line,
  gpus.selectors.CommandLines); no answer: none, so a job's processes show their whole command
  line to admins only.

- `interactive_sessions(sessions)`: the same for the interactive sessions (`gpu exec`, a
  JupyterLab's kernels), for the dashboard's "session N"; no answer: none.

- `work_on_booking(reservation_id)`: what runs on a booking now (its jobs, its sessions), which a
  release or a cancel would stop: the booking pages ask before they do; no answer: nothing.

Registering again replaces the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple


class JobOutcome(NamedTuple):
    finished_at: datetime
    gpu: str  # the job's first card: a job counts once, however many cards it ran on
    user_id: int
    team_id: int | None
    status: str  # "succeeded" and "failed" have columns of their own; SESSION_ENDED too; other: other


SESSION_ENDED = "session"  # an interactive session's outcome (gpu exec, JupyterLab): counted apart


# {server id: {session id, ...}} → {(server id, session id): job id} for the running jobs whose
# recorded pid (a job's session leader) is one of those sessions.
JobSessions = Callable[[Mapping[int, set[int]]], Mapping[tuple[int, int], int]]
# (since, until) → the outcomes of the jobs whose final status was written in [since, until).
JobOutcomes = Callable[[datetime, datetime], Sequence[JobOutcome]]
# (viewer, job ids) → the viewer's own jobs among them.
OwnJobs = Callable[[Any, Iterable[int]], Collection[int]]


def _no_sessions(sessions: Mapping[int, set[int]]) -> Mapping[tuple[int, int], int]:
    return {}


def _no_outcomes(since: datetime, until: datetime) -> Sequence[JobOutcome]:
    return ()


def _no_jobs(viewer: Any, job_ids: Iterable[int]) -> Collection[int]:
    return ()


_job_sessions: JobSessions = _no_sessions
_interactive_sessions: JobSessions = _no_sessions
_job_outcomes: JobOutcomes = _no_outcomes
_own_jobs: OwnJobs = _no_jobs


def job_sessions_answered_by(answer: JobSessions) -> None:
    """Called once by the jobs app (JobsConfig.ready)."""
    global _job_sessions
    _job_sessions = answer


def interactive_sessions_answered_by(answer: JobSessions) -> None:
    """Called once by the jobs app (JobsConfig.ready)."""
    global _interactive_sessions
    _interactive_sessions = answer


def interactive_sessions(sessions: Mapping[int, set[int]]) -> dict[tuple[int, int], int]:
    """{(server id, session id): interactive session id} for the sessions' processes."""
    return dict(_interactive_sessions(sessions))


class Work(NamedTuple):
    """Something a release or cancel of its booking would stop: "job 12 (train.py), running"."""

    label: str
    url: str


BookingWork = Callable[[int], Sequence[Work]]


def _no_work(reservation_id: int) -> Sequence[Work]:
    return ()


_work_on_booking: BookingWork = _no_work


def work_on_booking_answered_by(answer: BookingWork) -> None:
    """Called once by the jobs app (JobsConfig.ready)."""
    global _work_on_booking
    _work_on_booking = answer


def work_on_booking(reservation_id: int) -> list[Work]:
    """What runs on the booking now, that ending it would stop."""
    return list(_work_on_booking(reservation_id))


def job_outcomes_answered_by(answer: JobOutcomes) -> None:
    """Called once by the jobs app (JobsConfig.ready)."""
    global _job_outcomes
    _job_outcomes = answer


def own_jobs_answered_by(answer: OwnJobs) -> None:
    """Called once by the jobs app (JobsConfig.ready)."""
    global _own_jobs
    _own_jobs = answer


def job_sessions(sessions: Mapping[int, set[int]]) -> dict[tuple[int, int], int]:
    """{(server id, session id): job id} for the portal jobs running in these sessions."""
    return dict(_job_sessions(sessions))


def job_outcomes(since: datetime, until: datetime) -> list[JobOutcome]:
    """The jobs that finished in [since, until), one JobOutcome each."""
    return list(_job_outcomes(since, until))


def own_jobs(viewer: Any, job_ids: Iterable[int]) -> Collection[int]:
    """The viewer's own jobs among `job_ids`."""
    return _own_jobs(viewer, job_ids)
