"""A scheduler pass reads and writes a fixed number of queries, whatever the pending jobs, the cards
and the servers: nothing is read per job, per card or per server (issue 40). bench/bench_queue.py
prints the same count at 64 servers × 8 cards and 1,000 pending jobs.

The cluster is full, as a busy lab's is: every card booked by someone else, whole or in two shares
that leave less room than any job asks, so a steady pass starts nothing and, after the first,
finds every job's reason as it left it. The jobs cover what a pass reads: shares and whole cards,
arrays with a limit, a job on a named server, one with a later start, a preemptible one (lending),
one in a container image; one server's worker is silent."""

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
from tests.factories import MembershipFactory, UserFactory, make_snapshot, queue_job

pytestmark = pytest.mark.django_db

# A steady pass: release ended (1), due dispatches (1), pending jobs and their images (2), online
# servers (1), slots held by jobs and labs (2), cards and bookings (2), arrays (1), lending: loans
# ending and waiting preemptible jobs and idle bookings (3), the stored reasons (1).
STEADY_QUERIES = 14
USAGE_QUERIES = 3  # a cold pass also reads the shares and the usage: teams, members, bookings


def _full_lab(team, servers: int, jobs: int) -> None:
    """`servers` reporting hosts of 4 cards, all booked now by bob (one card in four as two 10 GiB
    shares), the last one's worker silent; `jobs` pending jobs of alice's of mixed shapes."""
    now = timezone.now()
    names = [f"qq{s}" for s in range(servers)]
    servers_report_ingest(snapshots=[make_snapshot(name, gpus=4) for name in names])
    for name in names[:-1]:
        slots_report(name, slots=8, now=now)
    bob = MembershipFactory(team=team, user=UserFactory(username="bob")).user
    rows = []
    for n, card in enumerate(GPU.objects.order_by("server__name", "index")):
        for memory_mb in [10 * 1024, 10 * 1024] if n % 4 == 0 else [None]:
            booking = Reservation(
                owner=bob, team=team, start=now - timedelta(hours=1), end=now + timedelta(hours=4)
            )
            booking.booked_end = booking.end
            rows.append((booking, card, memory_mb))
    Reservation.objects.bulk_create([booking for booking, _, _ in rows])
    Allocation.objects.bulk_create(
        Allocation(reservation=b, gpu=card, memory_mb=mb, start=b.start, end=b.end, live=True)
        for b, card, mb in rows
    )
    alice = MembershipFactory(team=team, user=UserFactory(username="alice")).user
    image = ContainerImage.objects.create(name="tf-2.17", reference="/srv/images/tf")
    image.servers.set(Server.objects.filter(name__in=names[:2]))
    Server.objects.filter(name__in=names[:2]).update(containers_ok=True)
    queue_job(alice, array="0-3%2")
    queue_job(alice, server=names[0], gpus=2)
    queue_job(alice, begin_at=now + timedelta(hours=2))
    queue_job(alice, preemptible=True, minutes=30)
    last = queue_job(alice, memory_mb=6 * 1024)
    Job.objects.filter(pk=last.pk).update(image=image)
    for n in range(jobs - 8):
        queue_job(
            alice, gpus=[1, 2, 4][n % 3], minutes=[30, 60, 120][n % 3], memory_mb=[None, 6 * 1024][n % 2]
        )


def _queries(*, cold: bool, memory: PassMemory) -> int:
    if cold:
        memory.forget_usage()
    with CaptureQueriesContext(connection) as queries:
        done = schedule_pass(memory=memory)
    assert not done.get("started"), done  # the lab is full: nothing starts
    return len(queries)


@pytest.mark.parametrize("servers, jobs", [(2, 12), (6, 36)], ids=["small", "three-times"])
def test_a_steady_pass_takes_the_same_few_queries_however_many_jobs_and_cards(
    team, servers, jobs, sent, django_assert_max_num_queries
):
    _full_lab(team, servers, jobs)
    memory = PassMemory()
    schedule_pass(memory=memory)  # the first records every job's reason
    with django_assert_max_num_queries(STEADY_QUERIES):
        schedule_pass(memory=memory)
    assert _queries(cold=False, memory=memory) == STEADY_QUERIES
    assert _queries(cold=True, memory=memory) == STEADY_QUERIES + USAGE_QUERIES
    assert Job.objects.filter(status=Job.Status.PENDING).count() == jobs
