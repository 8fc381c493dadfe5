"""What the database could not take while it was away, stored once it answers: a job's last log
bytes and its end, from this host's spool (jobs/host/spool.py), in order and once.

The supervisor (jobs/host/runner.py) records its job's end itself when it can (jobs.runs.job_end_record);
what it could not (the database away longer than JOB_END_WAIT_SECONDS, the worker shutting down or
dying) the host's spool thread stores here (`spool_replay`).
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import DatabaseError, close_old_connections

from jobs.host.spool import EndRecord, LogSpool, spool_name, spooled_names
from jobs.logs.store import LogWriter
from jobs.models import Job
from jobs.runs import job_end_record, queued_job_ended
from portal.unreachable import outage_of

log = logging.getLogger(__name__)


def spool_replay(*, failed: set[str] | None = None) -> int:
    """This host's spools that no supervisor holds: the log bytes and ends of jobs whose worker
    could not write them (the database was away longer than JOB_END_WAIT_SECONDS, or the worker
    died), stored now, in order and once. Run by the host worker's spool thread; returns how
    many jobs were brought up to date. A database still away stops the round; any other error
    is one spool's: logged once, and the round goes on with the next. `failed`: the spools whose
    replay failed for a reason other than an outage, kept by the caller across its rounds (said
    once, not every round)."""
    failed = set() if failed is None else failed
    done = 0
    for name in spooled_names():
        try:
            spool = LogSpool.locked_by_nobody(name, cap_bytes=settings.JOB_LOG_MAX_MB * 1024 * 1024)
        except OSError as exc:
            _failed_once(failed, name, exc)
            continue
        if spool is None:
            continue  # a supervisor is writing it
        try:
            done += _replay_one(name, spool)
            failed.discard(name)
        except DatabaseError as exc:
            close_old_connections()
            if outage_of(exc) is not None:
                return done
            _failed_once(failed, name, exc)
        except Exception as exc:  # one bad spool never holds up the others
            _failed_once(failed, name, exc)
        finally:
            spool.close()
    return done


def _failed_once(failed: set[str], name: str, exc: Exception) -> None:
    if name not in failed:
        failed.add(name)
        log.error("Spool %s could not be replayed (%s); the others go on", name, exc, exc_info=exc)


def _replay_one(name: str, spool: LogSpool) -> int:
    job_id = int(name.split("-")[1])
    job = Job.objects.filter(pk=job_id).first()
    if job is None or spool_name(job_id, job.created_at) != name:
        log.warning("Spool %s belongs to no job of this database (reset since?): removed", name)
        EndRecord.remove(name)
        spool.clear()
        spool.close(remove=True)
        return 0
    writer = LogWriter(job_id, spool=spool)
    record = EndRecord.read(name)
    if record is None:  # its supervisor died: the reconciler marks the job lost; its lines stay
        writer.close()  # and its last line ends: nothing of that run comes after it
    elif job_end_record(job_id, writer, record):
        log.info("Job %s finished: %s (recorded from this host's spool)", job_id, record.status)
        queued_job_ended(job)
    EndRecord.remove(name)
    spool.close(remove=True)
    return 1
