"""The cluster's worker answers the web's question before a job is written (issue 37;
docs/slurm.md): would Slurm take this job from its owner?

The web cannot ask Slurm itself: `sbatch --uid` is root's, and root is the cluster's worker on its
login node (the operator credential). So the web puts the question on the cluster's list in Redis
(jobs.slurm.slurm_submit_check) and waits for the answer with a deadline; this thread takes each
question, checks what the follower checks before its sbatch (the owner's account, a RootOnly
partition: jobs/host/slurm_setup.py), then runs `sbatch --test-only` with the job's own options
as its owner (SlurmExecutor.test): Slurm checks the partition, the reservation's users and the
account's limits, and runs nothing. The answer is Slurm's words where sbatch would refuse the job
now (`REFUSED_NOW`), or that it does not answer; what may only mean "not now" is no refusal.

A question whose asker gave up (its deadline passed, by Redis' clock) is dropped unanswered.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import close_old_connections

from gpus.models import Reservation, SlurmCluster
from gpus.slurm_cli import SlurmRefused, SlurmUnreachable
from gpus.slurm_inventory import commands_for
from jobs.host.executors.base import RunSpec
from jobs.host.executors.slurm import SlurmExecutor, SlurmRequest
from jobs.host.slurm_setup import SlurmSetupError, job_account, partition_check
from jobs.slurm import check_key, reply_key
from portal.periodic import PeriodicThread

log = logging.getLogger(__name__)

# What `sbatch --test-only` says of a job that sbatch itself refuses now, whatever the cluster's
# nodes are doing (slurm_errno.c's words). Its other refusals may only mean "not now", where
# sbatch takes the job and Slurm keeps it waiting: the nodes reserved for someone else (`Requested
# node configuration is not available`, also what a GPU count no node has gets), a booking not
# started yet (`Invalid time specified`). Those go on to the real sbatch, which has the last word.
REFUSED_NOW = (
    "Invalid partition name specified",
    "No partition specified or system default partition",
    "User's group not permitted to use this partition",
    "Required partition not available (inactive or drain)",
    "Invalid account or account/partition combination specified",
    "Invalid qos specification",
    "Invalid wckey specification",
    "Job violates accounting/QOS policy",
    "Requested time limit is invalid",
    "Access denied to requested reservation",
    "Requested reservation is invalid",
    "Invalid generic resource (gres) specification",
    "Invalid feature specification",
    "Access/permission denied",
)
TAKE_SECONDS = 1  # how long one wait for a question lasts: the thread stops within it
REPLY_KEPT_SECONDS = 60  # an answer nobody took (its asker gone) expires


class SlurmSubmitChecks(PeriodicThread):
    """In the cluster's worker: the web's questions about jobs for `server`, answered one at a
    time (each is one `sbatch --test-only`, tens of milliseconds while Slurm answers)."""

    def __init__(self, server: str) -> None:
        super().__init__("slurm-checks", 2.0)  # the pause after a failed step (Redis away)
        self.server = server
        self.conn = redis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=TAKE_SECONDS + 5, socket_connect_timeout=5
        )
        self.failed = False

    def step(self) -> None:
        self.failed = True
        got = self.conn.blpop([check_key(self.server)], timeout=TAKE_SECONDS)
        if got is not None:
            question = json.loads(got[1])
            if question["until"] > self.conn.time()[0]:  # its asker still waits
                close_old_connections()
                answer = slurm_submit_answer(self.server, question)
                pipe = self.conn.pipeline()
                pipe.lpush(reply_key(question["token"]), json.dumps(answer))
                pipe.expire(reply_key(question["token"]), REPLY_KEPT_SECONDS)
                pipe.execute()
        self.failed = False

    def pause(self) -> None:
        if self.failed:  # the wait for a question is the pause otherwise
            self.stopped.wait(self.interval)

    def finish(self) -> None:
        self.conn.close()


def slurm_submit_answer(server: str, question: dict[str, Any]) -> dict[str, Any]:
    """Would Slurm on `server` take the job `question` describes (jobs.slurm.slurm_submit_check)?
    {"ok": True}; {"refused": why, "field": ...} for the worker's own refusal; {"refused":
    Slurm's words, "slurm": True}; {"unreachable": why}."""
    cluster = SlurmCluster.objects.select_related("server").get(server__name=server)
    commands = commands_for(cluster)
    user = get_user_model().objects.get(pk=question["user"])
    try:
        account = job_account(user)
        partition_check(commands, question["partition"])
    except SlurmSetupError as exc:
        return {"refused": str(exc), "field": exc.field}
    except SlurmUnreachable as exc:
        return {"unreachable": str(exc)}
    reservation = ""
    if question["booking"] is not None:  # its Slurm reservation, once the worker's pass made it
        reservation = (
            Reservation.objects.filter(pk=question["booking"])
            .values_list("slurm_reservation", flat=True)
            .first()
            or ""
        )
    root = Path(cluster.job_root)
    request = SlurmRequest(
        gpus=question["gpus"] or 0,
        minutes=question["minutes"],
        partition=question["partition"],
        output=root / "portal-check.log",  # never written: nothing runs
        reservation=reservation,
    )
    spec = RunSpec(["/bin/true"], {}, root, "portal-check", account)
    try:
        SlurmExecutor(commands, request).test(spec)
    except SlurmRefused as exc:
        if any(words in str(exc) for words in REFUSED_NOW):
            return {"refused": str(exc), "slurm": True}
        return {"ok": True, "said": str(exc)}  # perhaps only "not now": sbatch decides
    except SlurmUnreachable as exc:
        return {"unreachable": str(exc)}
    return {"ok": True}
