"""Children that do not outlive their parent: the `preexec_fn` used by runportal's supervisor
(portal/supervisor.py) and by the job runner (jobs/runner.py).

Linux's PR_SET_PDEATHSIG sends the child a signal when its parent dies. It has to be set in
the child between fork and exec, where a threaded parent's fork leaves only async-signal-safe
work safe: so libc is loaded here once, at import, never in the child. A parent that died
before the child set the signal would never send it; the child checks for that right after.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHANED_EXIT_CODE = 1  # the parent died before the child could ask to follow it

# dlopen(NULL): the symbols already loaded, libc's prctl among them on Linux (glibc or musl).
# None elsewhere: no parent-death signal there, and nothing else of the portal needs one.
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


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
