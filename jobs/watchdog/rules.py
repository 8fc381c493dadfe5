"""The GPU watchdog's rules: which kind each GPU process on a host is, from facts alone.

A pure function, like `jobs.environment.job_environment`: no database, no NVML, no clock.
The host's watchdog loop gathers the facts once per round (its cards' processes from the
backend; the bookings active on its cards and its running and recently ended jobs, in one
query each) and calls `classify`; what to do about each kind is the policy's business.

Every GPU process falls into exactly one kind (the first rule that matches):

| kind                | what it is                                                          |
|---------------------|---------------------------------------------------------------------|
| `zombie`            | in the session of a job that has already ended, still on a card    |
| `escaped`           | a running job's process on a card its booking does not hold (a     |
|                     | booking that ended or was released moments ago still holds it for  |
|                     | its own jobs: see `BookingFacts.ended`)                             |
| `over_memory`       | a job on a shared card above its booked MiB + the tolerance; or     |
|                     | the booking owner's processes outside jobs, when all the owner's    |
|                     | processes on a shared card together exceed what the owner booked   |
| `ok`                | a running job's process on its booked cards, within its memory     |
| `owner_outside_job` | not the portal's, on a booked card, run by that booking's owner,   |
|                     | within what the owner booked there                                  |
| `intruder`          | not the portal's, on a card someone else has booked now            |
| `unbooked`          | not the portal's, on a card nobody has booked now                  |

Jobs are found by session (see gpus.procinfo): the session id of a job's processes is the pid
the worker recorded. Memory on a shared card is the job's: the sum of its processes there,
because a job may run several (data loaders, a second model) and its booking covers them all.
Every CUDA context a job opens on a card (one per process, ~300-500 MiB) is in that sum, and
stays inside the booking: the card's bookable memory leaves headroom for one context per card,
not one per process, so an allowance per extra context would promise neighbours memory that is
not there. The launcher's cap keeps one context's headroom (jobs.environment.booked_memory); a
job that opens more processes on a shared card must fit them in what it booked.

Jobs and `gpu exec` sessions are found by the session a process is in, else by the session it
left (a child that called setsid, while its parent line holds: `_whose`), its own first.

The booking owner's own processes outside their jobs (a notebook, or what a job left behind in a
session of its own once the job's processes were gone) are the owner's business only while the
owner stays within the booking: on a shared card the watchdog adds up *all* the owner's
processes there (inside and outside jobs) against the owner's booked MiB there. Within it they are
`owner_outside_job`, never stopped; above it the ones outside jobs are `over_memory`, which the
policy may stop.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import NamedTuple

from gpus.inventory import GPUInfo, ProcessInfo
from gpus.models import Violation


class Kind(StrEnum):
    """A verdict: OK, or one of the watchdog's kinds (gpus' Violation.Kind, the one list)."""

    OK = "ok"
    ESCAPED = Violation.Kind.ESCAPED.value
    OVER_MEMORY = Violation.Kind.OVER_MEMORY.value
    INTRUDER = Violation.Kind.INTRUDER.value
    OWNER_OUTSIDE_JOB = Violation.Kind.OWNER_OUTSIDE_JOB.value
    UNBOOKED = Violation.Kind.UNBOOKED.value
    ZOMBIE = Violation.Kind.ZOMBIE.value


@dataclass(frozen=True)
class BookingFacts:
    """A booking active now on some of this host's cards."""

    reservation_id: int
    owner_id: int
    cards: Mapping[str, int | None]  # card UUID → booked MiB (None: the whole card)
    # Ended or released within jobs.host.watchdog.ended_booking_grace() (the supervisor's cancel
    # poll + JOB_KILL_GRACE_SECONDS + NVML's lag after SIGKILL + one watchdog round): its jobs are
    # being stopped by their supervisors and may still be on its cards for those seconds, which
    # is no escape. It covers its own jobs only; for anyone else the card is free.
    ended: bool = False


@dataclass(frozen=True)
class JobFacts:
    """A job of this host that is running, or ended recently (its processes should be gone)."""

    job_id: int
    session_id: int  # the pid the worker recorded: the job's session
    owner_id: int
    reservation_id: int
    running: bool
    finished_at: datetime | None = None


@dataclass(frozen=True)
class SessionFacts:
    """A running `gpu exec` or `gpu shell` of this host (jobs.sessions.services): its command runs in a
    session of its own, whose leader's pid `gpu` recorded. Its processes are the booking's, as a
    job's are, but only those run by the booking's owner: the pid is the owner's word, so it can
    never cover anyone else's process."""

    session_pk: int
    session_id: int  # the pid `gpu` recorded: the command's session
    owner_id: int
    reservation_id: int
    # A JupyterLab's: its pid was recorded by the host's worker, which started it, not by its
    # owner, so every process of it is the booking's, whatever account runs it: the owner's
    # (JOB_USER=@owner), or the worker's own where JOB_USER is unset (development, `make run`).
    lab: bool = False


class Verdict(NamedTuple):
    """A NamedTuple, not a frozen dataclass: one is made for every process on the host's cards
    each round (512 in bench_watchdog), and a frozen dataclass costs several times as much to
    make (issue 40). Changed only through `_replace`."""

    gpu_uuid: str
    process: ProcessInfo
    kind: Kind
    memory_mb: int | None  # what the rule measured: the job's sum on a shared card, else the process's
    job_id: int | None = None
    user_id: int | None = None  # the portal user behind the process, where known
    reservation_id: int | None = None  # the booking concerned: the job's, or the one whose card was taken
    booked_mb: int | None = None  # over_memory and ok on a shared card: the job's booked MiB there
    session_pk: int | None = None  # a `gpu exec`/`gpu shell` session's process (SessionFacts)
    # A job's process found by the session it left (setsid: `_whose`): the job's supervisor, which
    # signals the job's session, never reaches it, so a stop signals it itself as well.
    left_session: bool = False


def classify(
    cards: Iterable[GPUInfo],
    *,
    bookings: Sequence[BookingFacts],
    jobs: Sequence[JobFacts],
    users_by_os_name: Mapping[str, int],
    tolerance_mb: int,
    sessions: Sequence[SessionFacts] = (),
) -> list[Verdict]:
    """One verdict per process on every card whose process list could be read."""
    by_session = {j.session_id: j for j in jobs}
    interactive: dict[int, list[SessionFacts]] = defaultdict(list)
    for facts in sessions:  # a pid is its owner's word: two owners may name one, each for themselves
        interactive[facts.session_id].append(facts)
    booking_of = {b.reservation_id: b for b in bookings}
    on_card: dict[str, list[BookingFacts]] = defaultdict(list)
    for booking in bookings:
        if booking.ended:
            continue  # holds the card for its own jobs' last seconds, not against anyone else
        for uuid in booking.cards:
            on_card[uuid].append(booking)
    verdicts = []
    for card in cards:
        if card.processes is None:
            continue  # unknown is not empty, but there is nothing to judge
        whose = [
            _whose(card, p, by_session, interactive, booking_of, users_by_os_name) for p in card.processes
        ]
        job_memory: dict[int, int] = defaultdict(int)
        for process, (job, _) in zip(card.processes, whose, strict=True):
            if job is not None:
                job_memory[job.job_id] += process.used_memory_mb or 0
        here = []
        for process, (job, booked) in zip(card.processes, whose, strict=True):
            if job is not None:
                here.append(_job_verdict(card, process, job, booking_of, job_memory, tolerance_mb))
            else:
                here.append(booked or _foreign_verdict(card, process, on_card[card.uuid], users_by_os_name))
        verdicts.extend(_owners_within_booking(here, on_card[card.uuid], tolerance_mb))
    return verdicts


def _whose(
    card: GPUInfo,
    process: ProcessInfo,
    by_session: Mapping[int, JobFacts],
    interactive: Mapping[int, list[SessionFacts]],
    booking_of: Mapping[int, BookingFacts],
    users_by_os_name: Mapping[str, int],
) -> tuple[JobFacts | None, Verdict | None]:
    """The job, or the `gpu exec`/lab session's verdict, of the process's own session; else of the
    session it left (a child that called setsid: its parent's line, gpus.procinfo.parent_session_of).
    Its own session comes first: a `gpu exec` a job started is that session's, not the job's. A
    session's claim counts only where it holds (`_session_verdict`: its owner's process, on its
    booking's card), so a claim on someone else's session never takes a process from its job."""
    for session in (process.session_id, process.parent_session_id):
        if not session:
            continue
        job = by_session.get(session)
        if job is not None:
            return job, None
        for claim in interactive.get(session, ()):
            if (booked := _session_verdict(card, process, claim, booking_of, users_by_os_name)) is not None:
                return None, booked
    return None, None


def _job_verdict(
    card: GPUInfo,
    process: ProcessInfo,
    job: JobFacts,
    booking_of: Mapping[int, BookingFacts],
    job_memory: Mapping[int, int],
    tolerance_mb: int,
) -> Verdict:
    left = process.session_id != job.session_id

    def verdict(kind: Kind, memory_mb: int | None, booked_mb: int | None = None) -> Verdict:
        return Verdict(
            card.uuid,
            process,
            kind,
            memory_mb,
            job.job_id,
            job.owner_id,
            job.reservation_id,
            booked_mb,
            left_session=left,
        )

    if not job.running:
        return verdict(Kind.ZOMBIE, process.used_memory_mb)
    booking = booking_of.get(job.reservation_id)
    if booking is None or card.uuid not in booking.cards:
        return verdict(Kind.ESCAPED, process.used_memory_mb)
    booked = booking.cards[card.uuid]
    used = job_memory[job.job_id]
    if booked is not None and used > booked + tolerance_mb:
        return verdict(Kind.OVER_MEMORY, used, booked)
    return verdict(Kind.OK, used if booked is not None else process.used_memory_mb, booked)


def _session_verdict(
    card: GPUInfo,
    process: ProcessInfo,
    session: SessionFacts | None,
    booking_of: Mapping[int, BookingFacts],
    users_by_os_name: Mapping[str, int],
) -> Verdict | None:
    """`ok` for a session's process of its owner's on one of its booking's cards (within the grace
    after the booking's end too: `gpu` is stopping it); None, judged as any other process, for the
    rest. Its memory is held to the booking with the owner's others (`_owners_within_booking`)."""
    if session is None or (not session.lab and users_by_os_name.get(process.username) != session.owner_id):
        return None
    booking = booking_of.get(session.reservation_id)
    if booking is None or card.uuid not in booking.cards:
        return None
    return Verdict(
        card.uuid,
        process,
        Kind.OK,
        process.used_memory_mb,
        None,
        session.owner_id,
        session.reservation_id,
        booking.cards[card.uuid],
        session_pk=session.session_pk,
    )


def _foreign_verdict(
    card: GPUInfo, process: ProcessInfo, here: Sequence[BookingFacts], users_by_os_name: Mapping[str, int]
) -> Verdict:
    user_id = users_by_os_name.get(process.username)
    if not here:
        return Verdict(card.uuid, process, Kind.UNBOOKED, process.used_memory_mb, user_id=user_id)
    own = next((b for b in here if user_id is not None and b.owner_id == user_id), None)
    if own is not None:
        return Verdict(
            card.uuid,
            process,
            Kind.OWNER_OUTSIDE_JOB,
            process.used_memory_mb,
            None,
            user_id,
            own.reservation_id,
        )
    return Verdict(
        card.uuid, process, Kind.INTRUDER, process.used_memory_mb, None, user_id, here[0].reservation_id
    )


def _owners_within_booking(
    verdicts: list[Verdict], here: Sequence[BookingFacts], tolerance_mb: int
) -> list[Verdict]:
    """One card's verdicts, with each booking owner's processes outside jobs held to what the owner
    booked on this shared card: all the owner's processes there (their jobs' and the rest) are
    summed, and above the booked MiB + tolerance the ones outside jobs are `over_memory`."""
    result = list(verdicts)
    owners = {v.user_id for v in verdicts if _outside_jobs(v)}
    for owner in owners:
        booked_by_owner = [b for b in here if b.owner_id == owner]
        shares = [b.cards[verdicts[0].gpu_uuid] for b in booked_by_owner]
        if not shares or None in shares:
            continue  # the owner holds the whole card: no memory rule
        booked = sum(s for s in shares if s is not None)
        theirs = {b.reservation_id for b in booked_by_owner}
        used = sum(
            v.process.used_memory_mb or 0
            for v in verdicts
            if v.user_id == owner
            and (_outside_jobs(v) or (v.job_id is not None and v.reservation_id in theirs))
        )
        if used <= booked + tolerance_mb:
            continue
        for i, v in enumerate(result):
            if _outside_jobs(v) and v.user_id == owner:
                result[i] = v._replace(kind=Kind.OVER_MEMORY, memory_mb=used, booked_mb=booked)
    return result


def _outside_jobs(verdict: Verdict) -> bool:
    """The owner's processes on their booking that no job runs: their own, and their sessions'."""
    return verdict.kind is Kind.OWNER_OUTSIDE_JOB or (
        verdict.kind is Kind.OK and verdict.session_pk is not None
    )
