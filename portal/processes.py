"""Children that do not outlive their parent, and jobs that start with no privileges: the
`preexec_fn` used by runportal's supervisor (portal/supervisor.py), and `start_job_process`,
which the job runner (jobs/host/runner.py) starts every job with.

Linux's PR_SET_PDEATHSIG sends the child a signal when its parent dies. It has to be set in
the child between fork and exec, where a threaded parent's fork leaves only async-signal-safe
work safe: so libc is loaded here once, at import, never in the child. A parent that died
before the child set the signal would never send it; the child checks for that right after.

A job must never hold the worker's privileges. A worker run with JOB_USER holds CAP_SETUID,
CAP_SETGID, CAP_KILL and CAP_CHOWN as *ambient* capabilities (deploy/gpu-portal-worker.service),
and ambient capabilities survive both a switch from one non-root user to another and exec: a
job started with `Popen(user=JOB_USER)` alone would inherit them and could setuid(0). So every
job's process (with or without JOB_USER: a worker running jobs as itself would hand its
capabilities on just the same), after any switch to JOB_USER and before exec, clears its ambient
set, empties its permitted, effective and inheritable sets (capset) and sets no_new_privs, so
that no setuid program or file capability can give anything back. It is done in that child because CPython's
_posixsubprocess calls setgroups, setregid and setreuid (Popen's extra_groups=, group=, user=)
before it calls preexec_fn, in the same fork, right before exec: nothing of the job runs before
the drop, and there is no setuid helper program to install, own and keep safe on every GPU host
(a root-owned helper would be one more privileged thing to guard). A step that fails ends the
child with PRIVILEGES_EXIT_CODE before the job's code is even loaded: a job never runs with
what it could not drop.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

# <linux/prctl.h>, <linux/capability.h>
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522  # 64-bit sets, as two 32-bit halves

ORPHANED_EXIT_CODE = 1  # the parent died before the child could ask to follow it
# A job's process could not drop the worker's privileges and did not run the job (126: found
# but not executed, as in a shell). The runner tells it from the script's own 126 by the
# launcher's line, which such a child never printed.
PRIVILEGES_EXIT_CODE = 126
# The job's account could not enter its working directory; told apart the same way.
WORKDIR_EXIT_CODE = 125

# dlopen(NULL): the symbols already loaded, libc's prctl and capset among them on Linux (glibc
# or musl). None elsewhere: no parent-death signal there, and no capabilities to drop.
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = getattr(_libc, "prctl", None)
_capset = getattr(_libc, "capset", None)


class _CapHeader(ctypes.Structure):  # struct __user_cap_header_struct
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):  # struct __user_cap_data_struct
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the one that adopts its descendants' orphans (Linux's child subreaper):
    what a child leaves behind when it dies (a job in a session of its own, under a SIGKILLed
    worker) becomes this process's own child, so it can be stopped by a pid it holds unreaped,
    never by a guess. False where the kernel cannot."""
    return _prctl is not None and _prctl(PR_SET_CHILD_SUBREAPER, 1) == 0


def die_with_parent(sig: signal.Signals, *, parent: int | None = None) -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when `parent` (by default
    the caller, the process that starts the child) dies, and exits at once if it already has.

    Call it in the parent right before Popen: it notes the parent's pid there, in the
    child it is too late to ask. Linux sends the signal when the *thread* that started the
    child ends, so start it from one that lives as long as the process (the main thread).
    """
    expected = os.getpid() if parent is None else parent

    def preexec() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != expected:  # reparented: the parent died before prctl took effect
            os._exit(ORPHANED_EXIT_CODE)

    return preexec


def job_preexec(sig: signal.Signals = signal.SIGKILL, *, cwd: Path | str | None = None) -> Callable[[], None]:
    """A `preexec_fn` for a job: `die_with_parent(sig)`, then no capabilities and no_new_privs,
    then into `cwd`.

    The working directory is entered last, as the job's own account with nothing of the
    worker's left: it is a path the job's owner chose (or the job's own folder), and a symlink
    planted there must lead only where that account may go anyway. (Popen's own `cwd=` is
    entered before the switch to the job's account, with the worker's privileges.)

    Everything the child passes to libc is built here, in the parent; the child only makes
    the calls. On a system other than Linux there are no capabilities to drop.
    """
    follow = die_with_parent(sig)
    enter = _enter(os.fsencode(cwd)) if cwd is not None else None
    if not sys.platform.startswith("linux"):

        def elsewhere() -> None:
            follow()
            if enter is not None:
                enter()

        return elsewhere
    # prctl is variadic and reads unsigned longs: pass them as such, never as C ints.
    clear_ambient = tuple(map(ctypes.c_ulong, (PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)))
    no_new_privs = tuple(map(ctypes.c_ulong, (PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)))
    header = ctypes.pointer(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0))  # pid 0: this process
    empty = (_CapData * 2)()  # zeroed: no effective, permitted or inheritable capability

    def preexec() -> None:
        follow()
        if _prctl is None or _capset is None:
            _refuse(b"finding prctl and capset in libc")
        # Ambient is the set that leaks through setreuid and exec: cleared by name, though
        # emptying the permitted set would take it along.
        if _prctl(*clear_ambient) != 0:
            _refuse(b"clearing the ambient capabilities")
        if _capset(header, empty) != 0:
            _refuse(b"dropping the capabilities")
        if _prctl(*no_new_privs) != 0:
            _refuse(b"setting no_new_privs")
        if enter is not None:
            enter()

    return preexec


def _enter(path: bytes) -> Callable[[], None]:
    def enter() -> None:
        try:
            os.chdir(path)
        except OSError as exc:
            os.write(
                2,
                b"[portal] cannot start the job: its account may not enter its working directory %s"
                b" (errno %d: %s).\n" % (path, exc.errno or 0, os.strerror(exc.errno or 0).encode()),
            )
            os._exit(WORKDIR_EXIT_CODE)

    return enter


def _refuse(step: bytes) -> NoReturn:
    """In the job's child: say on its stderr (the job's log) which step failed, and never exec."""
    os.write(
        2,
        b"[portal] cannot start the job: %s failed (errno %d); "
        b"it does not run with the worker's privileges.\n" % (step, ctypes.get_errno()),
    )
    os._exit(PRIVILEGES_EXIT_CODE)


def start_job_process(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: Path | str,
    user: int | None = None,
    group: int | None = None,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start a job's process: in a session of its own, stdout and stderr on one pipe, as `user`
    and `group` (JOB_USER's, then with no supplementary groups; None: the worker's own), always
    with no capabilities and no_new_privs (`job_preexec`), SIGKILLed when the worker dies, in
    `cwd`, entered as that account once the privileges are gone.

    It gets no descriptor of the worker's besides its stdin (/dev/null), its output pipe and those
    named in `pass_fds`, at the same numbers (a lab's listening socket, jobs.host.lab): each the
    caller's to choose, and to close on its side once the process has started.

    No Django here: the privilege test starts jobs through this very function from a bare
    Python parent.
    """
    return subprocess.Popen(
        argv,
        cwd="/",  # entered with the worker's privileges: nowhere a job could have prepared
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one pipe: stdout and stderr interleaved in order
        start_new_session=True,  # its own session and group: signalled and attributed as one
        close_fds=True,
        pass_fds=tuple(pass_fds),
        # SIGKILL if the worker dies (SIGKILL, the OOM killer): a lost job must not hold its
        # cards behind the portal's back.
        preexec_fn=job_preexec(signal.SIGKILL, cwd=cwd),
        user=user,
        group=group,
        # The worker's own groups (gpuportal: its env file) never pass to the job.
        extra_groups=[] if user is not None else None,
    )
