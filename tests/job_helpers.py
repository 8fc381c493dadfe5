"""Small reads the job tests share: a job's whole log, whether a process still runs."""

from __future__ import annotations

import psutil

from jobs.logs import log_stream


def job_log(job_id: int) -> str:
    """The job's whole stored log, as text."""
    return b"".join(log_stream(job_id)).decode()


def alive(pid: int) -> bool:
    """A live process has `pid` (a zombie, exited and not reaped, is not alive)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
