"""A job's end as its worker keeps it, until the database has it: written to this host's spool
first (jobs/host/spool.py), then stored by the one rule for a run's end (jobs.runs.job_end_record),
tried again every END_RETRY_SECONDS while the database is away, for JOB_END_WAIT_SECONDS at most.
What is still not stored then (or when the worker shuts down, which waits for no database) is
left in the spool: the host's spool thread stores it once the database is back
(jobs/host/replay.py). Nothing of it is ever lost; without a spool, the reconciler marks the job
lost and the worker's log says how it ended.

The supervisor (jobs/host/runner.py) decides what the end is; this module only keeps it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from django.conf import settings
from django.db import DatabaseError, close_old_connections

from jobs.host.spool import EndRecord, LogSpool
from jobs.logs.store import LogWriter
from jobs.runs import job_end_record

log = logging.getLogger(__name__)

END_RETRY_SECONDS = 2.0
RETRY_TICK_SECONDS = 0.1  # how soon a retry's wait notices the worker's shutdown


def job_end_keep(
    job_id: int,
    record: EndRecord,
    *,
    writer: LogWriter,
    spool: LogSpool | None,
    stopping: Callable[[], bool],
    skips_database: Callable[[], bool],
) -> bool:
    """The job's end, after its log's last bytes: spooled, then stored; whether it is stored now
    (its spool then emptied and removed). False: it waits in the spool for the replay, or, with no
    spool to keep it, is given up. `stopping` says the worker shuts down; `skips_database` that it
    does and the database does not answer (the supervisor's rule): the end goes straight to the
    spool then."""
    spooled = spool is not None and _spool(job_id, record, spool)
    if not _store(job_id, record, writer, stopping=stopping, skips_database=skips_database):
        _left(job_id, record, spool if spooled else None, no_spool=spool is None)
        return False
    if spool is not None:
        EndRecord.remove(spool.name)
        spool.close(remove=True)
    return True


def _spool(job_id: int, record: EndRecord, spool: LogSpool) -> bool:
    try:
        record.write(spool.name)
    except OSError as exc:  # a full disk: no traceback, the end waits for the database instead
        log.error("Job %s: could not spool its end (%s); the database is its only record", job_id, exc)
        return False
    return True


def _store(
    job_id: int,
    record: EndRecord,
    writer: LogWriter,
    *,
    stopping: Callable[[], bool],
    skips_database: Callable[[], bool],
) -> bool:
    """Try the end every END_RETRY_SECONDS until it is stored (True), or until the worker shuts
    down (it waits for no database) or JOB_END_WAIT_SECONDS pass (False)."""
    deadline = time.monotonic() + settings.JOB_END_WAIT_SECONDS
    while True:
        if stopping() and skips_database():
            return False  # straight to the spool: a shutdown waits for no database
        try:
            recorded = job_end_record(job_id, writer, record)
        except DatabaseError:
            close_old_connections()
            if stopping() or time.monotonic() >= deadline:
                return False
            log.warning("Job %s: could not record its end; retrying in %s s", job_id, END_RETRY_SECONDS)
            retry_at = time.monotonic() + END_RETRY_SECONDS
            while time.monotonic() < retry_at and not stopping():
                time.sleep(RETRY_TICK_SECONDS)
            continue
        if recorded:  # once: the replay (or the reconciler's LOST line) never logs it again
            log.info("Job %s finished: %s %s", job_id, record.status, record.message)
        else:
            log.info("Job %s: its end (%s) was recorded already", job_id, record.status)
        return True


def _left(job_id: int, record: EndRecord, spool: LogSpool | None, *, no_spool: bool) -> None:
    """The end not stored in time: left to the spool's replay (its lock let go), or said lost."""
    if spool is not None:
        log.error(
            "Job %s ended %s while the database was away; this host's spool records it once the"
            " database is back",
            job_id,
            record.status,
        )
        spool.close()  # unlocked: spool_replay takes it from here
        return
    log.error(
        "Job %s ended %s (%s) while the database was away, and %s: its end is not recorded;"
        " the reconciler marks it lost",
        job_id,
        record.status,
        record.message,
        "this host has no spool to keep it" if no_spool else "this host's spool could not keep it",
    )
