"""Whose each process on a host's cards is, by its session: what the GPU watchdog's round
(jobs/host/watchdog.py) judges, before the rules (jobs/watchdog/rules.py) say what it is.

A process belongs to a job or an interactive session by its session id, the pid of the session's
leader that the row recorded (jobs and labs: their supervisor; `gpu exec`: its owner). Some
sessions no row names yet, and are still not strangers:

- *a lab's kernel or terminal* not recorded yet: the lab records them only every
  KERNEL_CHECK_SECONDS (jobs.host.lab). It is the lab's from its first round, found by the lab's
  server among its ancestors (`lab_of`), as the lab itself finds them;
- *a run the worker has just started* (a job, a lab; not in a container, whose processes are
  conmon's): its supervisor records the session's pid right after the start, and a round in
  between would take the owner's own job for an intruder. Such a session is known by its
  leader's parent, which no process can choose: the worker itself, or one of its pool processes,
  which share its session (`run_started`). It is left out of the round, as NVML leaves out a
  process that has not opened its context yet, for RUN_RECORD_SECONDS after its start at most.
  Only the worker's rounds know that (`worker`); a round anywhere else judges every process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from time import time

import psutil

from gpus.inventory import GPUInfo, ProcessInfo
from gpus.procinfo import is_process_pid, session_of
from jobs.host.watchdog_sql import Facts, SessionRow
from jobs.models import InteractiveSession
from jobs.watchdog.rules import JobFacts, SessionFacts
from portal.pids import same_start, started_at

log = logging.getLogger(__name__)

CLOCK_SLACK_SECONDS = 2
# How long after its start a run of the worker's that no row names yet is left out of the rounds.
# Its supervisor records its pid at once and tries again every CANCEL_POLL_SECONDS; a process still
# unnamed later (its row marked lost meanwhile, say) is judged as any, so nothing the worker
# started goes unwatched for longer.
RUN_RECORD_SECONDS = 30
# How far up from a kernel's session leader its lab's server may be (`lab_of`): a kernel is the
# server's child, a terminal's shell its grandchild, what they start in sessions of their own
# a level or two below.
LAB_DEPTH = 8


@dataclass(frozen=True)
class Owned:
    """What a round judges: the cards (without the runs not recorded yet), and the jobs and
    sessions their processes may belong to."""

    cards: tuple[GPUInfo, ...]
    jobs: list[JobFacts]
    sessions: list[SessionFacts]


class SessionsOnCards:
    """One host watchdog's view of the sessions on its cards, round after round."""

    def __init__(self, worker: int | None) -> None:
        self.worker = worker  # the host worker's pid; None where the round runs outside it
        # Sessions found to be neither a lab's nor a run, with their oldest process's start: each
        # is looked at once, not every round (a session's id is not reused while any of its
        # processes lives, and a later session of the same id has a later start).
        self._others: dict[int, float] = {}

    def owned(self, cards: tuple[GPUInfo, ...], facts: Facts) -> Owned:
        sessions = _oldest_starts(cards)
        # An ended job's recorded pid may head someone else's session by now: that session is
        # the job's only if one of its processes is older than the job's end.
        jobs = [j for j in facts.jobs if j.running or _predates_end(j, sessions)]
        known = sessions_in(facts.sessions, sessions)
        labs = {row.pid: row for row in facts.sessions if row.kind == InteractiveSession.Kind.JUPYTERLAB}
        named = {j.session_id for j in jobs} | {s.session_id for s in known}
        starting, kernels = self._unnamed(sessions, named, labs)
        if starting:
            cards = tuple(_without_sessions(card, starting) for card in cards)
        return Owned(cards, jobs, known + kernels)

    def _unnamed(
        self, sessions: dict[int, float], named: set[int], labs: dict[int, SessionRow]
    ) -> tuple[set[int], list[SessionFacts]]:
        """Of the sessions no row names: the runs starting (left out), and the labs' kernels not
        recorded yet (the lab's, as recorded ones are)."""
        starting: set[int] = set()
        kernels: list[SessionFacts] = []
        others: dict[int, float] = {}
        for session, oldest in sessions.items():
            if session in named:
                continue
            if self._others.get(session) == oldest:
                others[session] = oldest
                continue
            if (lab := lab_of(session, labs)) is not None:
                kernels.append(SessionFacts(lab.pk, session, lab.owner_id, lab.reservation_id, lab=True))
                continue
            started = None if self.worker is None else run_started(session, self.worker)
            if started is None:
                # Neither, for good: a process's ancestors never change but by its adoption, and
                # a lab's server is never an older process's ancestor.
                others[session] = oldest
            elif time() - started < RUN_RECORD_SECONDS:
                starting.add(session)
                log.debug("GPU watchdog: session %s is a run of this worker not recorded yet", session)
            # else: a run past its time, judged as any (two reads of /proc a round, rare: its
            # row should have named it by then).
        self._others = others
        return starting, kernels


def _oldest_starts(cards: tuple[GPUInfo, ...]) -> dict[int, float]:
    """Each session on the cards → its oldest process start seen there; a session a process there
    left (setsid: `parent_session_id`) counts with that process's start. Its parent line is proven
    by start times (gpus.procinfo.parent_session_of), so no process older than the session's own
    processes names it: an ended job's session is still told from a later one of its pid."""
    sessions: dict[int, float] = {}
    for process in (p for g in cards for p in g.processes or ()):
        if process.started is None:
            continue
        for session in {process.session_id, process.parent_session_id} - {None, 0}:
            oldest = sessions.get(session)
            sessions[session] = process.started if oldest is None else min(oldest, process.started)
    return sessions


def sessions_in(rows: Sequence[SessionRow], sessions: dict[int, float]) -> list[SessionFacts]:
    """The running sessions of this host (`rows`, from facts_read): `gpu exec`/`gpu shell`, and
    labs with the kernels they recorded. A recorded pid is the command's only while it can be:
    its process, if it still runs, started when recorded, and its session has no process older
    than that start. Otherwise the pid was taken by another process since (a younger leader, or
    an older session's): it stays out, and its processes are judged as any."""
    facts = []
    for pk, pid, owner, reservation, started, kernels, kind in rows:
        lab = kind == InteractiveSession.Kind.JUPYTERLAB
        # A lab's kernels lead sessions of their own (jobs.host.lab records them): each is the lab's.
        for leader, leader_started in [(pid, started), *((int(k), s) for k, s in kernels)]:
            if leader_started is None or _still_recorded(leader, leader_started, sessions):
                facts.append(SessionFacts(pk, leader, owner, reservation, lab=lab))
    return facts


def _still_recorded(leader: int, recorded: float, sessions: dict[int, float]) -> bool:
    # The leader itself where it runs; where it has ended, its session's processes (they keep
    # its id from being given to another process while any of them lives).
    live = started_at(leader)
    if live is not None and not same_start(live, recorded):
        return False
    return sessions.get(leader, recorded) >= recorded - CLOCK_SLACK_SECONDS


def lab_of(leader: int, labs: dict[int, SessionRow]) -> SessionRow | None:
    """The running lab (of `labs`, by its server's pid) whose server session leader `leader`
    descends from: a kernel or a terminal it started, each in a session of its own, as the lab's
    supervisor finds and records them (jobs.host.lab._kernel_sessions); None for any other. The
    server is proven by its recorded start, and each process up the line started no earlier than
    its parent: a parent that died and whose pid went to a younger process breaks the line, so
    a stranger's process never passes for a kernel."""
    if not labs or not is_process_pid(leader):
        return None
    try:
        child = psutil.Process(leader)
        for _ in range(LAB_DEPTH):
            parent = psutil.Process(child.ppid())
            if not is_process_pid(parent.pid) or parent.create_time() > child.create_time():
                return None
            row = labs.get(parent.pid)
            if row is not None:
                proven = row.pid_started is None or same_start(parent.create_time(), row.pid_started)
                return row if proven else None
            child = parent
    except psutil.Error:
        return None
    return None


def run_started(leader: int, worker: int) -> float | None:
    """When session leader `leader` started, if the process `worker` started it, itself (a solo
    pool) or through one of its pool processes (prefork: each job's supervisor runs in one);
    None otherwise. A parent cannot be chosen or claimed, unlike an environment or a command
    line. A pool process is the worker's child *in the worker's session*: a run's leader never
    is (it has a session of its own), so a process a solo worker's job starts in a session of
    its own never passes for a run. The leader's parent is read again after the pool process:
    a parent that died in between had its children adopted elsewhere before its pid could be
    given to a new pool process, so a stranger's parent never passes for one."""
    if not is_process_pid(leader) or leader == worker:
        return None
    try:
        process = psutil.Process(leader)
        parent = process.ppid()
        if parent != worker:
            if not is_process_pid(parent) or psutil.Process(parent).ppid() != worker:
                return None
            if session_of(parent) != session_of(worker) or process.ppid() != parent:
                return None
        return process.create_time()
    except psutil.Error:
        return None


def _without_sessions(card: GPUInfo, sessions: set[int]) -> GPUInfo:
    """The card as the round judges it: without the processes of these sessions, nor those that
    left one of them (a child that called setsid: rules._whose would take it for the run's)."""

    def of_them(p: ProcessInfo) -> bool:
        return p.session_id in sessions or (p.parent_session_id or 0) in sessions

    if not card.processes or not any(map(of_them, card.processes)):
        return card
    return replace(card, processes=tuple(p for p in card.processes if not of_them(p)))


def _predates_end(job: JobFacts, sessions: dict[int, float]) -> bool:
    """True when any process seen in the ended job's session (its oldest) was created before the
    job ended; a younger one beside it changes nothing."""
    oldest = sessions.get(job.session_id)
    if oldest is None or job.finished_at is None:
        return False  # no start that could be read proves nothing: no zombie
    return oldest <= job.finished_at.timestamp() + CLOCK_SLACK_SECONDS
