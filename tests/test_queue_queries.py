"""A scheduler pass reads and writes a fixed number of queries, whatever the pending jobs, the cards
and the servers: nothing is read per job, per card or per server (issue 40). bench/bench_queue.py
prints the same count at 64 servers × 8 cards and 1,000 pending jobs.

The lab is full, as a busy lab's is: every card booked by someone else, whole or in two shares
that leave less room than any job asks, so a steady pass starts nothing and, after the first,
finds every job's reason as it left it. The jobs cover what a pass reads: shares and whole cards,
an array with a limit, a job on a named server, one with a later start, a preemptible one
(lending), one in a container image; one server's worker never said how many jobs it runs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from gpus.models import GPU, Allocation, ContainerImage, Reservation, Server
from gpus.services import servers_report_ingest
from jobs.host.pickup import slots_report
from jobs.models import Job
from jobs.queue.scheduler import PassMemory, schedule_pass
from tests.factories import make_snapshot, queue_job

pytestmark = pytest.mark.django_db

# A steady pass: ended queued jobs (1), unsent due jobs (1), the pending jobs and their images' servers
# (2), the online servers (1), the slots held by jobs and by labs (2), the cards and their bookings
# (2), the arrays (1), lending: loans ending, waiting preemptible jobs, idle bookings (3), the
# stored reasons (1).
STEADY_QUERIES = 14
USAGE_QUERIES = 3  # a cold pass also reads the shares and the usage: teams, members, bookings


def _hosts(bob, team, names: list[str]) -> None:
    """Reporting hosts of 4 cards, every card booked now by bob (one in four as two 10 GiB shares);
    each worker but the last one's says it runs 8 jobs at once."""
    now = timezone.now()
    servers_report_ingest(snapshots=[make_snapshot(name, gpus=4) for name in names])
    for name in names[:-1]:
        slots_report(name, slots=8, now=now)
    start, end = now - timedelta(hours=1), now + timedelta(hours=4)
    rows = []
    for n, card in enumerate(GPU.objects.filter(server__name__in=names)):
        for memory_mb in [10 * 1024, 10 * 1024] if n % 4 == 0 else [None]:
            rows.append(
                (Reservation(owner=bob, team=team, start=start, end=end, booked_end=end), card, memory_mb)
            )
    Reservation.objects.bulk_create([booking for booking, _, _ in rows])
    Allocation.objects.bulk_create(
        Allocation(reservation=b, gpu=card, memory_mb=mb, start=start, end=end, live=True)
        for b, card, mb in rows
    )


def _jobs(alice, count: int, server: str, image: ContainerImage) -> None:
    """`count` pending jobs of alice's: the kinds a pass reads differently, then plain ones."""
    queue_job(alice, array="0-3%2")
    queue_job(alice, server=server, gpus=2)
    queue_job(alice, begin_at=timezone.now() + timedelta(hours=2))
    queue_job(alice, preemptible=True, minutes=30)
    Job.objects.filter(pk=queue_job(alice, memory_mb=6144).pk).update(image=image)
    for n in range(count - 8):
        queue_job(alice, gpus=[1, 2, 4][n % 3], minutes=[30, 60, 120][n % 3], memory_mb=[None, 6144][n % 2])


def _queries(*, cold: bool, memory: PassMemory) -> int:
    if cold:
        memory.forget_usage()
    with CaptureQueriesContext(connection) as queries:
        done = schedule_pass(memory=memory)
    assert not done.get("started"), done  # the lab is full: nothing starts
    return len(queries)


def test_a_steady_pass_takes_the_same_few_queries_however_many_jobs_and_cards(
    alice, bob, team, sent, django_assert_max_num_queries
):
    image = ContainerImage.objects.create(name="tf-2.17", reference="/srv/images/tf")
    counts = []
    for names, jobs in ((["qq0", "qq1"], 12), (["qq2", "qq3", "qq4", "qq5"], 24)):
        _hosts(bob, team, names)
        image.servers.add(*Server.objects.filter(name__in=names[:1]))
        Server.objects.filter(name__in=names[:1]).update(containers_ok=True)
        _jobs(alice, jobs, names[0], image)
        memory = PassMemory()
        schedule_pass(memory=memory)  # the first records the new jobs' reasons
        with django_assert_max_num_queries(STEADY_QUERIES):
            warm = _queries(cold=False, memory=memory)
        counts.append((warm, _queries(cold=True, memory=memory)))
    assert Job.objects.filter(status=Job.Status.PENDING).count() == 36
    # Three times the jobs, the cards and the servers: not one query more.
    assert counts == [(STEADY_QUERIES, STEADY_QUERIES + USAGE_QUERIES)] * 2
