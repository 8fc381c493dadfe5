"""Jobs on a Slurm cluster, the portal's side (issue 37; docs/slurm.md): where a submit goes
(`slurm_place`, one of job_submit's steps) and what a cancel does. The cluster's worker, on its
login node, submits the job to Slurm and follows it (jobs/host/slurm_runner.py).

Slurm is the scheduler of record there: a job names a GPU count, a time limit and a partition, and
Slurm picks the node and the cards. The portal books nothing for it, never plans it in its own
queue, and never places other work on the cluster's cards (`GPU.objects.portal_scheduled`). What
the portal knows of the cluster (its partitions, its nodes' GPUs) is checked at submit, each
refusal naming its field; what only Slurm knows (an account's access, a reservation's users) is
asked of Slurm before the job is written (`slurm_submit_check`): the cluster's worker, which holds
the operator credential on the login node, runs `sbatch --test-only` as the job's owner
(jobs/host/slurm_checks.py), and a refusal is Slurm's words beside the field they are about.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import redis
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Max

from gpus.models import Reservation, Server, SlurmCluster, SlurmNode
from gpus.slurm_models import NAME_HELP, SLURM_NAME
from jobs.queue.requests import membership_check
from portal.errors import Invalid, Unavailable
from portal.names import redis_key

MAX_MINUTES = 60 * 24 * 365  # what Slurm's --time takes in minutes, and then some
CHECK_MARGIN_SECONDS = 2  # a check's wait beyond the cluster's command timeout: the worker's turn
CHECKS_KEPT = 100  # waiting checks a cluster's list keeps (its worker away: they are stale anyway)
# What to do about a refusal, by the field Slurm's words are about (`refusal_field`).
FIXES = {
    "reservation": "Submit it outside the booking, or ask an admin to look at its Slurm reservation.",
    "account": "Ask an admin to give your Unix account access to this cluster in Slurm.",
    "partition": "Choose another partition.",
    "gpu_count": "Ask for fewer GPUs, or choose a partition whose nodes have them.",
    "time_limit_minutes": "Ask for less time, or leave it empty for the partition's default.",
    "server": "Ask an admin, quoting Slurm's words.",
}


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


# --- Slurm's word before the job is written ------------------------------------------------


def check_key(server: str) -> str:
    """The list of `server`'s checks, which its worker takes (jobs/host/slurm_checks.py)."""
    return redis_key("slurm-check", server)


def reply_key(token: str) -> str:
    return redis_key("slurm-check-reply", token)


def refusal_field(said: str) -> str:
    """The submit field Slurm's refusal is about: its words name it (`Access denied to requested
    reservation`, `Invalid partition name specified`, `Invalid account or account/partition
    combination specified`, `Invalid generic resource (gres) specification`)."""
    words = said.lower()
    for needle, field in (
        ("reservation", "reservation"),
        ("qos", "server"),  # a QOS's limits (`Job violates accounting/QOS policy`): an admin's
        ("account", "account"),
        ("partition", "partition"),
        ("time limit", "time_limit_minutes"),
        ("gres", "gpu_count"),
    ):
        if needle in words:
            return field
    return "server"


def slurm_submit_check(*, user: AbstractBaseUser, fields: dict[str, Any]) -> None:
    """Would the cluster's Slurm take this job (`slurm_place`'s fields) from `user`? Asked of the
    cluster's worker, which answers with `sbatch --test-only` as the user, within the cluster's
    command timeout and CHECK_MARGIN_SECONDS. Invalid (Slurm's words, beside the field they are
    about) when Slurm refuses it; Unavailable (503) naming the server when the cluster or its
    worker does not answer. Writes no row: nothing is written before Slurm said yes."""
    server: Server = fields["server"]
    wait = int(server.slurm.command_timeout_seconds + CHECK_MARGIN_SECONDS)  # whole seconds: Redis < 6
    token = secrets.token_hex(16)
    booking = fields.get("reservation")
    conn = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=wait + 5, socket_connect_timeout=5)
    with conn:
        now, _ = conn.time()  # Redis' clock, the one the worker judges the deadline by
        request = {
            "token": token,
            "user": user.pk,
            "gpus": fields["gpu_count"],
            "minutes": fields["time_limit_minutes"],
            "partition": fields["partition"],
            "booking": booking.pk if booking is not None else None,
            "until": now + wait,
        }
        key = check_key(server.name)
        pipe = conn.pipeline()
        pipe.rpush(key, json.dumps(request))
        pipe.ltrim(key, -CHECKS_KEPT, -1)
        pipe.expire(key, wait + 60)
        pipe.execute()
        got = conn.blpop([reply_key(token)], timeout=wait)
    if got is None:
        raise Unavailable(
            f"The worker of {server.name} did not answer within {wait} s, so the job was not sent: Slurm "
            "is asked before a job is taken. Try again in a while, or ask an admin whether its worker runs.",
            field="server",
        )
    answer_check(server, json.loads(got[1]))


def answer_check(server: Server, answer: dict[str, Any]) -> None:
    """The worker's answer (jobs.host.slurm_checks.slurm_submit_answer) as the submit's outcome:
    nothing for a yes, else the ServiceError it means."""
    if "unreachable" in answer:
        raise Unavailable(
            f"Slurm cluster {server.name} does not answer ({answer['unreachable']}), so the job was not "
            "sent. Try again in a while.",
            field="server",
        )
    if "refused" not in answer:
        return
    said = str(answer["refused"])
    if not answer.get("slurm"):  # the worker's own check (an account, a RootOnly partition)
        raise Invalid(f"Not sent to Slurm: {said}.", field=answer.get("field") or "server")
    field = refusal_field(said)
    raise Invalid(f"Slurm on {server.name} refused the job: {said}. {FIXES[field]}", field=field)
