"""The one status change of a run (a Job, an InteractiveSession): `transition`.

Every change of a run's status is one conditional UPDATE here, reached through its model's
manager (`Job.objects.transition`, `InteractiveSession.objects.transition`): the row changes only
if it still has a status in `from_` (and matches `where`), so two actors that race (a worker and
the reconciler, a cancel and a claim, a message delivered twice) can never both make it. What is
due with a change that was made comes with it, in its transaction: the audit entry and the
notification (`told`), and the published change (`published`, which the models' managers give:
a job's pages read it once it commits). A change that was not made (0 rows) says nothing at all.

The table of every state, every transition and who makes it is docs/jobs.md, "States".
tests/test_one_transition.py fails on a status UPDATE anywhere else. This module imports no model
of this app: jobs/models.py delegates to it, and the higher modules (jobs/runs.py: the end, the
lost rule, the reconciler) call the managers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from django.db import transaction
from django.db.models import Q, QuerySet

from jobs.logs.live import job_changed


def transition(
    rows: QuerySet,
    pk: int,
    *,
    from_: str | Collection[str],
    to: str,
    where: Q | None = None,
    told: Callable[[], None] | None = None,
    published: Callable[[QuerySet, int], None] | None = None,
    **fields: Any,
) -> bool:
    """`pk` from a status in `from_` to `to`, with `fields` written in the same UPDATE; whether it
    was made. `where` adds conditions judged in the UPDATE too (a stale beat, an active owner), so
    nothing read before it can go stale. Made: `told` writes what is due with it (audit entry,
    notification) and `published` tells the pages once it commits; not made: neither."""
    statuses = [from_] if isinstance(from_, str) else list(from_)
    manager = rows.model._default_manager
    with transaction.atomic():
        found = manager.filter(where or Q(), pk=pk, status__in=statuses)
        if not found.update(status=to, **fields):
            return False
        if told is not None:
            told()
        # Inside too: what it reads (the job's server) fails with the change, never after it
        # committed; the message itself goes out once the change commits.
        if published is not None:
            published(manager.all(), pk)
    return True


def job_published(jobs: QuerySet, pk: int) -> None:
    """A job's change, told once it commits: its page, its log streams and the lists of jobs
    (the server's too: the dashboard's cards show what runs on them)."""
    server = jobs.filter(pk=pk).values_list("server_id", flat=True).first()
    job_changed([pk], server=server)
