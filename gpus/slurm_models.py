"""A Slurm cluster as a server of the portal (issue 37; docs/slurm.md), kept apart from
gpus/models.py for that module's length and imported there, so callers import every model from
gpus.models.

A `Server` of kind *slurm* has one `SlurmCluster`: how its worker, on a login node, reaches Slurm
(the client commands and SLURM_CONF; slurmrestd optionally), which partitions the portal shows,
and the shared folder where each job's script and output live. Its nodes, as Slurm last described
them, are `SlurmNode` rows, replaced by every telemetry round; its cards are `GPU` rows with
`node` set. Slurm stays the scheduler of record: nothing here books or places anything.
"""

from __future__ import annotations

import re

from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import models

# A partition or node name as Slurm allows it, and nothing a command line could read as an option.
SLURM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
NAME_HELP = "letters, digits, '_', '.', '-'; not starting with '-' or '.'"


def _absolute(value: str, field: str, example: str) -> None:
    if value and not value.startswith("/"):
        raise ValidationError({field: f"Give an absolute path, e.g. {example}."})


class SlurmCluster(models.Model):
    """How the portal's worker on a login node reaches one Slurm cluster."""

    server = models.OneToOneField("gpus.Server", on_delete=models.CASCADE, related_name="slurm")
    bin_dir = models.CharField(
        "Slurm commands' folder",
        max_length=255,
        blank=True,
        help_text="Where sbatch, squeue, scontrol and scancel are on the login node; empty: the PATH.",
    )
    slurm_conf = models.CharField(
        "SLURM_CONF",
        max_length=255,
        blank=True,
        help_text="The cluster's slurm.conf; empty: Slurm's default.",
    )
    rest_url = models.CharField(  # a URL, with its scheme: no form guesses one (Django 6 changes it)
        "slurmrestd URL",
        max_length=200,
        blank=True,
        validators=[URLValidator(schemes=["http", "https"])],
        help_text="Optional, e.g. https://slurm-login:6820; the commands are used where it is empty.",
    )
    jwt_key_file = models.CharField(
        "JWT key file",
        max_length=255,
        blank=True,
        help_text="The cluster's HS256 key, for slurmrestd's tokens.",
    )
    partitions = models.CharField(
        max_length=500,
        blank=True,
        help_text="Comma-separated partitions whose nodes the portal shows and submits to (the first is "
        "the default); empty: every partition, Slurm's default for jobs.",
    )
    job_root = models.CharField(
        "jobs' folder",
        max_length=255,
        help_text="A folder on the cluster's shared filesystem: each job's script and output go in "
        "<folder>/<account>/job-<id>/, readable by the login node and every compute node.",
    )
    command_timeout_seconds = models.PositiveSmallIntegerField(
        default=10, help_text="A Slurm command that takes longer marks the cluster as not answering."
    )

    class Meta:
        verbose_name = "Slurm cluster"

    def __str__(self) -> str:
        return f"Slurm cluster {self.server.name}"

    @property
    def partition_list(self) -> list[str]:
        return [p.strip() for p in self.partitions.split(",") if p.strip()]

    def clean(self) -> None:
        _absolute(self.bin_dir, "bin_dir", "/usr/bin")
        _absolute(self.slurm_conf, "slurm_conf", "/etc/slurm/slurm.conf")
        _absolute(self.jwt_key_file, "jwt_key_file", "/etc/slurm/jwt_hs256.key")
        _absolute(self.job_root, "job_root", "/shared/portal-jobs")
        if "\\" in self.job_root:  # sbatch's --output pattern drops it (jobs/host/executors/slurm.py)
            raise ValidationError(
                {"job_root": "Slurm drops a backslash from a job's output path; pick a folder without one."}
            )
        for name in self.partition_list:
            if not SLURM_NAME.match(name):
                raise ValidationError({"partitions": f"{name!r} is not a partition name ({NAME_HELP})."})
        if not 1 <= self.command_timeout_seconds <= 300:
            raise ValidationError({"command_timeout_seconds": "Give 1 to 300 seconds."})


class SlurmNode(models.Model):
    """One node of a Slurm cluster as its last telemetry round read it (`scontrol show node`)."""

    class State(models.TextChoices):
        IDLE = "idle", "Idle"
        MIXED = "mixed", "Mixed"
        ALLOCATED = "allocated", "Allocated"
        DRAINED = "drained", "Drained"
        DOWN = "down", "Down"
        OTHER = "other", "Other"

    server = models.ForeignKey("gpus.Server", on_delete=models.CASCADE, related_name="slurm_nodes")
    name = models.CharField(max_length=64)
    state = models.CharField(max_length=16, choices=State.choices)
    slurm_state = models.CharField(max_length=100, blank=True, help_text="As Slurm says it, e.g. IDLE+DRAIN.")
    reason = models.CharField(max_length=200, blank=True)
    partitions = models.CharField(max_length=200, blank=True)
    cpus = models.PositiveIntegerField(default=0)
    memory_mb = models.PositiveBigIntegerField(default=0)
    gpus = models.PositiveSmallIntegerField(default=0)
    gpus_used = models.PositiveSmallIntegerField(default=0)
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["server__name", "name"]
        constraints = [models.UniqueConstraint(fields=["server", "name"], name="slurmnode_unique_name")]

    def __str__(self) -> str:
        return f"{self.server.name}:{self.name} ({self.state})"
