"""Small helpers the job tests share: a job's whole log, whether a process still runs, its page open."""

from __future__ import annotations

import psutil

from jobs.logs.store import LogWriter, log_stream
from tests.browser import log_in


def job_log(job_id: int) -> str:
    """The job's whole stored log, as text."""
    return b"".join(log_stream(job_id)).decode()


def alive(pid: int) -> bool:
    """A live process has `pid` (a zombie, exited and not reaped, is not alive)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def job_page_open(tab, job_id: int, username: str = "alice") -> LogWriter:  # type: ignore[no-untyped-def]
    """The job's page in a signed-in browser tab, its log holding "epoch 0"; the writer, to print more."""
    from playwright.sync_api import expect

    writer = LogWriter(job_id)
    writer.feed(b"epoch 0\n")
    writer.flush()
    log_in(tab, username)
    tab.goto(f"/jobs/{job_id}/")
    expect(tab.locator("#job-log")).to_contain_text("epoch 0", timeout=15_000)  # a fresh server
    return writer
