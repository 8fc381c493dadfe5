"""Jobs on a Slurm cluster, the portal's side (issue 37; docs/slurm.md): where a submit goes
(`slurm_place`, one of job_submit's steps) and what a cancel does. The cluster's worker, on its
login node, submits the job to Slurm and follows it (jobs/host/slurm_runner.py).

Slurm is the scheduler of record there: a job names a GPU count, a time limit and a partition, and
Slurm picks the node and the cards. The portal books nothing for it, never plans it in its own
queue, and never places other work on the cluster's cards (`GPU.objects.portal_scheduled`). What
the portal knows of the cluster (its partitions, its nodes' GPUs) is checked at submit, each
refusal naming its field; what only Slurm knows (an account's access, a reservation's users) is
Slurm's to refuse, and its words end the job, on its page.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Max

from gpus.models import Reservation, Server, SlurmCluster, SlurmNode
from gpus.slurm_models import NAME_HELP, SLURM_NAME
from jobs.queue.requests import membership_check
from portal.errors import Invalid

MAX_MINUTES = 60 * 24 * 365  # what Slurm's --time takes in minutes, and then some


def slurm_cluster_named(name: str | None) -> Server | None:
    """The Slurm cluster `name` names, or None for a GPU host, no name, or no such server."""
    if not name:
        return None
    return Server.objects.filter(name=name, kind=Server.Kind.SLURM).select_related("slurm").first()


def slurm_booking_cluster(reservation: Reservation | int | None) -> Server | None:
    """The Slurm cluster whose whole nodes `reservation` books, or None: a job on such a booking
    is Slurm's (a GPU count in its reservation), whether or not the cluster is named too."""
    if reservation is None:
        return None
    pk = reservation if isinstance(reservation, int) else reservation.pk
    return (
        Server.objects.filter(kind=Server.Kind.SLURM, gpus__allocations__reservation_id=pk)
        .select_related("slurm")
        .first()
    )


def slurm_place(
    *,
    user: AbstractBaseUser,
    server: Server,
    gpu_count: int | None,
    time_limit_minutes: int | None,
    partition: str = "",
    team: str | None = None,
    booking: Reservation | None = None,
    array: str = "",
) -> dict[str, Any]:
    """The Job fields of a job on `server`, a Slurm cluster; Invalid naming the field otherwise.
    `booking`: a booking of whole nodes of the cluster, which Slurm holds as a reservation
    (jobs in it go with --reservation)."""
    try:
        cluster = server.slurm
    except SlurmCluster.DoesNotExist:
        raise Invalid(
            f"{server.name} is a Slurm cluster without its Slurm settings; ask an admin to add them.",
            field="server",
        ) from None
    if array:
        raise Invalid("Job arrays are not sent to Slurm clusters yet; submit each job alone.", field="array")
    if server.draining:
        raise Invalid(
            f"{server.name} is draining: it takes no new jobs. Pick another server.", field="server"
        )
    count = _check_gpus(server, gpu_count)
    minutes = _check_minutes(time_limit_minutes)
    chosen = _check_partition(cluster, partition)
    membership = membership_check(user, team)
    return {
        "server": server,
        "team": membership.team,
        "gpu_count": count,
        "time_limit_minutes": minutes,
        "partition": chosen,
        "reservation": booking,
        "gpu_uuids": [],
    }


def _check_gpus(server: Server, gpu_count: int | None) -> int:
    largest = SlurmNode.objects.filter(server=server).aggregate(most=Max("gpus"))["most"]
    if gpu_count is None or gpu_count < 0:
        raise Invalid("Say how many GPUs the job needs on its node (0 or more).", field="gpu_count")
    if largest is not None and gpu_count > largest:
        raise Invalid(
            f"No node of {server.name} has {gpu_count} GPUs (at most {largest}); ask for fewer.",
            field="gpu_count",
        )
    return gpu_count


def _check_minutes(minutes: int | None) -> int | None:
    if minutes is not None and minutes < 1:
        raise Invalid(
            "A time limit is at least 1 minute; leave it empty for the partition's default.",
            field="time_limit_minutes",
        )
    if minutes is not None and minutes > MAX_MINUTES:
        raise Invalid(
            f"A time limit is at most {MAX_MINUTES} minutes (a year); leave it empty for the partition's "
            "default.",
            field="time_limit_minutes",
        )
    return minutes


def _check_partition(cluster: SlurmCluster, partition: str) -> str:
    shown = cluster.partition_list
    if not partition:
        return shown[0] if shown else ""
    if not SLURM_NAME.match(partition):
        raise Invalid(f"{partition!r} is not a partition name ({NAME_HELP}).", field="partition")
    if shown and partition not in shown:
        raise Invalid(
            f"Partition {partition!r} is not one the portal submits to on {cluster.server.name}; "
            f"choose one of {', '.join(shown)}.",
            field="partition",
        )
    return partition
