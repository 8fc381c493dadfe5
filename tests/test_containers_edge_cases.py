"""Edge cases a hostile review found (2026-11-30): a restarted worker's removal of what a killed
worker left (containers_leftovers_remove) against a Podman that fails or hangs on one container.
A fake podman: no real container here."""

from __future__ import annotations

import pytest

from jobs.host import containers
from jobs.host.worker import containers_leftovers_remove
from jobs.models import Job
from portal.models import AuditEntry
from tests.factories import MembershipFactory, TeamFactory, UserFactory
from tests.job_helpers import job_log

pytestmark = pytest.mark.django_db


def _fake_podman(tmp_path, settings, a: int, b: int, *, b_rm: str) -> None:  # type: ignore[no-untyped-def]
    podman = tmp_path / "podman"
    podman.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"ps) printf 'ctr-a\\tjob-{a}\\trunning\\nctr-b\\tjob-{b}\\trunning\\n' ;;\n"
        f'rm) case "$*" in *ctr-b*) {b_rm} ;; *) echo "$@" >> {tmp_path}/removed ;; esac ;;\n'
        "esac\n"
    )
    podman.chmod(0o755)
    settings.CONTAINER_PODMAN = str(podman)
    settings.CONTAINER_MODE = "root"


def _jobs() -> tuple[Job, Job]:
    owner = UserFactory(username="carol")
    team = TeamFactory(slug="lab")
    MembershipFactory(user=owner, team=team)
    return tuple(  # type: ignore[return-value]
        Job.objects.create(owner=owner, team=team, name="t.py", status=Job.Status.LOST) for _ in range(2)
    )


@pytest.mark.parametrize(
    "b_rm", ['echo "Error: container ctr-b is in use: cannot remove" >&2; exit 125', "sleep 5"]
)
def test_a_container_podman_could_not_remove_is_never_said_killed_and_the_others_kill_is_said(
    tmp_path, settings, monkeypatch, b_rm
):
    """ctr-a is removed (its job's processes killed with it); Podman fails, or hangs, on ctr-b,
    which still runs. ctr-a's kill is said (job log, audit, owner); ctr-b is not said killed."""
    monkeypatch.setattr(containers, "COMMAND_SECONDS", 1.0)
    job_a, job_b = _jobs()
    _fake_podman(tmp_path, settings, job_a.pk, job_b.pk, b_rm=b_rm)
    containers_leftovers_remove("box1")
    assert "Killed its container ctr-a" in job_log(job_a.pk)
    assert AuditEntry.objects.filter(data__job=job_a.pk).exists()
    assert "Killed its container ctr-b" not in job_log(job_b.pk)
