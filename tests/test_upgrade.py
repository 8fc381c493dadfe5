"""Upgrading from the previous release (docs/deploy.md, "Upgrading"): its database, with rows as it
wrote them, migrates forward and the portal works on them; its GPU hosts' workers, still running
while the portal host is upgraded, can go on writing to the migrated database; and the way back
(the migrations run backwards) leaves that release's rows as it knew them.

There is no release tag yet. "The previous release" is the schema a lab installed before issues 41
and 42 (main at 2e54264): the newest migration of each app then is PREVIOUS_RELEASE. When a release
is tagged, PREVIOUS_RELEASE becomes that tag's newest migrations.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.db.models.fields import NOT_PROVIDED
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from gpus.models import Server, Violation
from jobs.models import Job
from tests.migrating import Target, fresh_database, leaves, migrated_template, models_at

PREVIOUS_RELEASE = [
    ("portal", "0020_job_notices"),
    ("gpus", "0019_slurm_clusters"),
    ("jobs", "0012_job_notices"),
]


def _latest() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


class PreviousRelease:
    """Rows written with the previous release's models (its migrations' state), as its web, its
    collector and its GPU hosts' workers wrote them: on its own schema, and after the upgrade."""

    def __init__(self, apps) -> None:  # type: ignore[no-untyped-def]
        self.apps = apps
        self.now = timezone.now()

    def model(self, label: str):  # type: ignore[no-untyped-def]
        return self.apps.get_model(label)

    def lab(self) -> dict[str, int]:
        """A team with a leader and a member, a server with two cards (as its collector registered
        it), alice's booking of card 0 with a finished job on it, and a warned violation."""
        users = {
            name: self.model("auth.User").objects.create(username=name, password="!")
            for name in ("alice", "leader")
        }
        team = self.model("portal.Team").objects.create(name="Vision Lab", slug="vision-lab")
        for name, role in (("alice", "member"), ("leader", "leader")):
            self.model("portal.Membership").objects.create(user=users[name], team=team, role=role)
        server = self.server("gpu01")
        booking = self.model("gpus.Reservation").objects.create(
            owner=users["alice"], team=team, start=self.now, end=self.now + timedelta(hours=4),
            booked_end=self.now + timedelta(hours=4),
        )  # fmt: skip
        self.model("gpus.Allocation").objects.create(
            reservation=booking, gpu_id="GPU-gpu01-0", start=booking.start, end=booking.end
        )
        job = self.model("jobs.Job").objects.create(
            owner=users["alice"], team=team, reservation=booking, server=server, name="train.py",
            gpu_uuids=["GPU-gpu01-0"], script_source="print('epoch 1')\n", status="succeeded",
            started_at=self.now, finished_at=self.now, exit_code=0, worker="gpu01@gpu01",
        )  # fmt: skip
        self.log(job.pk, b"epoch 1\n")
        violation = self.violation(server.pk, user=users["alice"])
        return {"job": job.pk, "booking": booking.pk, "violation": violation.pk, "server": server.pk}

    def server(self, name: str):  # type: ignore[no-untyped-def]
        """What the previous release's collector wrote at a host's first report."""
        server = self.model("gpus.Server").objects.create(
            name=name, hostname=name, simulated=True, cpu_count=32, ram_mb=262144, last_seen=self.now
        )
        for index in range(2):
            self.model("gpus.GPU").objects.create(
                uuid=f"GPU-{name}-{index}", server=server, index=index, name="NVIDIA A100 80GB PCIe",
                memory_total_mb=81920, updated_at=self.now,
            )  # fmt: skip
        return server

    def violation(self, server_id: int, *, user: object) -> object:
        """What the previous release's GPU host watchdog wrote on a warning: the warning's time in
        action_at (gpus 0020 moves it to warned_at)."""
        return self.model("gpus.Violation").objects.create(
            kind="unbooked", pid=4242, os_user="bob", command="python steal.py", user=user,
            gpu_id=f"GPU-{self.model('gpus.Server').objects.get(pk=server_id).name}-1", server_id=server_id,
            first_seen=self.now, last_seen=self.now, action="warned", action_at=self.now,
        )  # fmt: skip

    def log(self, job_id: int, data: bytes) -> None:
        """A log chunk as the previous release's supervisor stored it, and the job's log size."""
        jobs, chunks = self.model("jobs.Job").objects.filter(pk=job_id), self.model("jobs.LogChunk").objects
        start, seq = jobs.get().log_bytes, chunks.filter(job_id=job_id).count() + 1
        chunks.create(job_id=job_id, seq=seq, start=start, size=len(data), data=data)
        jobs.update(log_bytes=start + len(data))


def _installed_then() -> list[Target]:
    """The previous release's migrations, and the other apps' (Django's, third parties') today's:
    they came with the same pinned requirements."""
    apps_then = {app for app, _ in PREVIOUS_RELEASE}
    others = [app for app in MigrationLoader(None).migrated_apps if app not in apps_then]
    return [*PREVIOUS_RELEASE, *leaves(*others)]


at_previous_release = migrated_template(_installed_then())


@pytest.fixture
def previous(at_previous_release) -> Iterator[PreviousRelease]:
    """A database of its own at the previous release's schema (tests/migrating.py: a copy of one
    migrated forwards from nothing, not the test database backwards and forwards again)."""
    with fresh_database(template=at_previous_release):
        yield PreviousRelease(models_at(PREVIOUS_RELEASE))


def _client(username: str) -> Client:
    client = Client()
    client.force_login(get_user_model().objects.get(username=username))
    return client


@pytest.mark.django_db(transaction=True)
def test_an_upgrade_from_the_previous_release_keeps_its_rows_working_for_both_releases(previous):
    rows = previous.lab()

    _latest()

    # The data migration: the warning's time, which the previous release kept in action_at.
    violation = Violation.objects.get(pk=rows["violation"])
    assert violation.warned_at == violation.action_at
    assert (violation.resolution, violation.stop_reason) == ("", "")
    alice, leader = _client("alice"), _client("leader")
    assert alice.get(reverse("dashboard")).status_code == 200
    page = alice.get(reverse("job_detail", args=[rows["job"]]))
    assert page.status_code == 200 and b"train.py" in page.content
    log = alice.get(reverse("job_log_download", args=[rows["job"]]))
    assert b"".join(log.streaming_content).endswith(b"epoch 1\n")
    booked = alice.post("/api/v1/reservations/", {"count": 1, "server": "gpu01"}, "application/json")
    assert booked.status_code == 201, booked.content  # card 1: card 0 is alice's booking of before
    assert leader.get(reverse("team_detail", args=["vision-lab"])).status_code == 200
    resolved = leader.post(reverse("violation_resolve", args=[rows["violation"]]), {"note": "bob moved off"})
    assert resolved.status_code == 302 and Violation.objects.get(pk=rows["violation"]).resolved_by is not None

    # The previous release's collector and GPU hosts' workers, still running during the upgrade
    # (docs/deploy.md: the portal host first), write what they wrote: no column they do not know
    # stops them.
    previous.server("gpu02")
    late = previous.violation(rows["server"], user=None)
    previous.log(rows["job"], b"epoch 2\n")
    previous.model("jobs.Job").objects.filter(pk=rows["job"]).update(heartbeat_at=previous.now)
    gpu02 = Server.objects.get(name="gpu02")
    assert gpu02.drain_reason == "" and not gpu02.jobs_as_root
    assert Violation.objects.get(pk=late.pk).resolution == ""
    assert Job.objects.get(pk=rows["job"]).heartbeat_at is not None

    # The way back: the migrations run backwards, and the previous release reads its rows again.
    MigrationExecutor(connection).migrate(PREVIOUS_RELEASE)
    assert previous.model("gpus.Violation").objects.filter(action="warned").count() == 2
    assert previous.model("gpus.Reservation").objects.filter(owner__username="alice").count() == 2
    assert previous.model("gpus.Server").objects.filter(name__in=["gpu01", "gpu02"]).count() == 2
    assert previous.model("jobs.LogChunk").objects.filter(job_id=rows["job"]).count() == 2


def test_columns_added_since_the_previous_release_have_a_database_default():
    """The rule that keeps the previous release's INSERTs working on the migrated database while its
    workers still run: a column it does not know is nullable or has a db_default (Django's own
    `default` never reaches the database)."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    apps_then = {app for app, _ in PREVIOUS_RELEASE}
    then = loader.project_state(
        [*PREVIOUS_RELEASE, *(node for node in loader.graph.leaf_nodes() if node[0] not in apps_then)]
    )
    now = loader.project_state()
    missing = [
        f"{app}.{model}.{name}"
        for (app, model), state in now.models.items()
        if (app, model) in then.models
        for name, field in state.fields.items()
        if name not in then.models[app, model].fields
        and not field.null
        and field.db_default is NOT_PROVIDED
        and not field.many_to_many
    ]
    assert not missing, (
        f"{', '.join(missing)}: added since the previous release, NOT NULL and without db_default; the"
        " previous release's processes, still running during an upgrade, cannot insert rows. Give each"
        " a db_default (or null=True)."
    )


@pytest.mark.django_db
def test_a_kept_sqlite_template_gone_meanwhile_is_an_error_never_an_empty_template(tmp_path):
    # Removed between the module's fixture and a test (`make clean`, or another run at other
    # migrations replacing the same targets' file): copying it must not make it an empty file,
    # which the next runs would then take as the migrated template.
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's kept templates")
    gone = tmp_path / "migrated-gone.sqlite3"
    with pytest.raises(sqlite3.OperationalError), fresh_database(template=str(gone)):
        pass
    assert not gone.exists()
