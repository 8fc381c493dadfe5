"""A process's identity, and signals sent only to the process that was meant.

A pid alone names whichever process has it now: pids are reused (within minutes on a busy host,
from 1 again after a reboot), NVML has been seen to answer pid 0 and pids shuffled between
processes when its process-struct versions disagree with the driver, and to `kill(2)` the pids
0 and -1 mean "my whole process group" and "everything I may signal". So every place that
decides to signal (the job runner, the orphan sweep, the GPU watchdog) names its target by
pid *and* start time (`ProcessId`), and signals through this module, which:

- refuses pid <= 1, the caller's own pid and any process of the caller's own process group
  (a worker must never stop itself, nor, through PR_SET_PDEATHSIG, every job it runs);
- opens a pidfd first and checks the start time after: once the pidfd is open it names that one
  process for good, so a check that passes then cannot be overtaken by pid reuse before the
  signal is sent (`pidfd_send_signal`, Linux 5.1+; where pidfds are missing the check and
  `kill` follow each other, the best a pid allows).

The start time is psutil's `create_time` (seconds since the epoch, from the boot time and the
process's start in clock ticks): the same number every time it is read for one process, and a
different one for a later process with the same pid.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

# Two reads of one process's create_time agree exactly; a clock adjustment between the two
# reads can move the boot time psutil derives it from by a little. Processes with the same pid
# start at least a clock tick (10 ms) apart and, in practice, far more.
START_SLACK_SECONDS = 0.05


class Sent(StrEnum):
    SENT = "sent"
    GONE = "gone"  # no such process, or no longer the one meant (its pid was reused)
    DENIED = "denied"  # the caller may not signal it (no CAP_KILL, another user's process)
    REFUSED = "refused"  # pid <= 1, the caller itself or its own process group: never signalled


@dataclass(frozen=True)
class ProcessId:
    """One process, for good: its pid and when it started."""

    pid: int
    started: float

    def is_alive(self) -> bool:
        started = started_at(self.pid)
        return started is not None and same_start(started, self.started)


def same_start(a: float, b: float) -> bool:
    return abs(a - b) <= START_SLACK_SECONDS


def started_at(pid: int) -> float | None:
    """When live process `pid` started; None for no such process (or a pid that is no process)."""
    if pid <= 0:
        return None
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OverflowError, ValueError):
        return None


def identify(pid: int) -> ProcessId | None:
    """The process that has `pid` now; None when there is none."""
    started = started_at(pid)
    return None if started is None else ProcessId(pid, started)


def is_own(pid: int) -> bool:
    """pid <= 1, this process, or a member of this process's group: never a target."""
    if pid <= 1 or pid == os.getpid():
        return True
    try:
        return os.getpgid(pid) == os.getpgrp()
    except (ProcessLookupError, PermissionError, OverflowError, ValueError):
        return False  # gone, or not ours to look at: not our group either way


def send(target: ProcessId, sig: signal.Signals) -> Sent:
    """Send `sig` to `target`, and only to it."""
    if is_own(target.pid):
        log.error("Refused to send %s to pid %s: pid <= 1, or this process's own group", sig.name, target.pid)
        return Sent.REFUSED
    try:
        fd = os.pidfd_open(target.pid)
    except ProcessLookupError:
        return Sent.GONE
    except OSError as exc:
        # No pidfds here (ENOSYS, EPERM, EINVAL), or none to be had now (EMFILE, ENFILE, ENOMEM
        # on a host under pressure): check, then kill. A signal not sent would leave the job
        # running unwatched, which is worse than the narrow race of a bare pid.
        if exc.errno not in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
            log.warning("No pidfd for pid %s (%s): checking, then signalling by pid", target.pid, exc)
        return _send_by_pid(target, sig)
    try:
        if not target.is_alive():
            return Sent.GONE  # the pidfd names whoever has the pid now, and that is another
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        return Sent.GONE
    except PermissionError:
        return Sent.DENIED
    finally:
        os.close(fd)
    return Sent.SENT


def _send_by_pid(target: ProcessId, sig: signal.Signals) -> Sent:
    if not target.is_alive():
        return Sent.GONE
    try:
        os.kill(target.pid, sig)
    except ProcessLookupError:
        return Sent.GONE
    except PermissionError:
        return Sent.DENIED
    return Sent.SENT


def session_members(
    leader: ProcessId, *, held_at: float | None = None, held: bool = False
) -> list[ProcessId]:
    """Every live process in the session `leader` started (its session id is the leader's pid),
    leader included if alive, whatever process groups they made inside it.

    The leader may be gone: its session id lives on in what it left. A process counts only if it
    started no earlier than the leader did, so a later session that reuses the leader's pid
    (after the job's processes all ended and the pid came round again) is never taken for it.
    Zombies are left out: they hold nothing and cannot be signalled.

    Linux never hands out a pid that still names a session, so while any process of the session
    lives its id cannot be another session's; a live process with the leader's pid and another
    start time proves the whole session is gone. A caller that may have reaped the leader itself
    should ask before it does (`os.waitid(..., WNOWAIT)`): until then the pid stays the
    leader's.

    With the leader gone, its id could in principle have come round to a later session whose
    own leader is gone too. `held_at`, a moment the caller knows the pid was still the leader's
    (the job's last heartbeat: its supervisor held the leader, unreaped), settles it: a member
    created by then is of the leader's session, and while it lives the id cannot have been
    reused, so the whole session is the leader's. With no such member, nothing is proved and
    nothing is returned.

    `held`: the caller is the leader's parent and has not reaped it, so its pid, and the session
    id, can be no one else's: every process of that session id is of this session, whatever the
    start times say (the leader's own start may be unreadable: /proc mounted hidepid=2)."""
    members: list[ProcessId] = []
    leader_alive = False
    for proc in psutil.process_iter(["pid", "create_time", "status"]):
        pid, created = proc.info["pid"], proc.info["create_time"]
        if pid <= 1 or created is None or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if not held and created < leader.started - START_SLACK_SECONDS:
            continue  # older than the session: another session with a recycled id
        try:
            if os.getsid(pid) != leader.pid:
                continue
        except (ProcessLookupError, PermissionError):
            continue
        if held:
            members.append(ProcessId(pid, created))
            continue
        if pid == leader.pid:
            if not same_start(created, leader.started):
                return []  # the leader's pid, reused by a later session leader: ours is gone
            leader_alive = True
        members.append(ProcessId(pid, created))
    early = held_at is not None and any(m.started <= held_at - START_SLACK_SECONDS for m in members)
    if not (leader_alive or held_at is None or early):
        return []  # nothing alive from while the id was surely the leader's
    return members


def groups_of(members: list[ProcessId]) -> set[int]:
    """The process groups of `members`, each read from a member whose identity is checked right
    after: a group with a live member of a session is of that session (a process joins groups of
    its own session only), so signalling it reaches that session alone. A group seen through no
    live member (its leader and members gone) is left out: its id may have come round again."""
    groups: set[int] = set()
    for member in members:
        try:
            pgid = os.getpgid(member.pid)
        except (ProcessLookupError, PermissionError):
            continue
        if pgid > 1 and pgid != os.getpgrp() and member.is_alive():
            groups.add(pgid)
    return groups


def session_groups(sid: int, *, probes: int = 3) -> set[int]:
    """The process groups that have a live member in session `sid` now, for a caller that holds
    the session's leader unreaped (so `sid` is that session's alone). Read by syscalls alone
    (getsid, getpgid: no /proc file per process), over every listed pid and, `probes` times,
    over the pids just handed out and next to be (around /proc/sys/kernel/ns_last_pid): a
    process that lives for a fork and no longer is seldom in a listing, but often there. A pgid
    counts only if its process is of `sid` both before and after it is read."""
    candidates: list[int] = []
    for _ in range(probes):
        try:
            last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
        except (OSError, ValueError):
            break
        candidates += range(max(2, last - 8), last + 32)
    with contextlib.suppress(OSError):
        candidates += [int(name) for name in os.listdir("/proc") if name.isdigit()]
    groups: set[int] = set()
    own = os.getpgrp()
    for pid in candidates:
        if pid <= 1:
            continue
        try:
            if os.getsid(pid) != sid:
                continue
            pgid = os.getpgid(pid)
            if os.getsid(pid) != sid:
                continue
        except OSError:
            continue
        if pgid > 1 and pgid != own:
            groups.add(pgid)
    return groups


def send_group(pgid: int, sig: signal.Signals) -> Sent:
    """`sig` to process group `pgid` at once (the kernel's group signal is atomic against fork).
    Only for a group the caller has proved: its unreaped child's, or one of `groups_of`."""
    if pgid <= 1 or pgid == os.getpgrp():
        log.error(
            "Refused to send %s to process group %s: pid <= 1, or this process's own group", sig.name, pgid
        )
        return Sent.REFUSED
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return Sent.GONE
    except PermissionError:
        return Sent.DENIED
    return Sent.SENT


def send_session(leader: ProcessId, sig: signal.Signals) -> tuple[int, int]:
    """Send `sig` to every process of the leader's session: (sent, denied)."""
    sent = denied = 0
    for member in session_members(leader):
        outcome = send(member, sig)
        sent += outcome is Sent.SENT
        denied += outcome is Sent.DENIED
    return sent, denied
