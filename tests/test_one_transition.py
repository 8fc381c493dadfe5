"""One status change of a run, in one place (issue 32): jobs.lifecycle.transition, reached through
Job.objects.transition and InteractiveSession.objects.transition. A status UPDATE anywhere else
fails here; and the transition itself is conditional, writes its fields, and publishes once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from django.db.models import Q

from jobs.logs import live as log_live
from jobs.models import InteractiveSession, Job
from jobs.sessions.services import session_start
from jobs.submit import ScriptUpload, job_submit
from portal.models import AuditEntry

ROOT = Path(__file__).resolve().parent.parent
APPS = ("jobs", "gpus", "portal")
LIFECYCLE = Path("jobs/lifecycle.py")
# Other rows' own status, with their own conditional claims: not a run's.
OTHER_ROWS = {Path("portal/channels.py"): "ChannelDelivery"}


def _sources() -> list[Path]:
    found = []
    for app in APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if not {"migrations", "tests"} & set(relative.parts):
                found.append(relative)
    return found


def _sets_status(call: ast.Call) -> bool:
    """`.update(status=...)`, `.update(**{"status": ...})`, `.save(update_fields=[..."status"...])`."""
    if not isinstance(call.func, ast.Attribute):
        return False
    if call.func.attr == "update":
        for keyword in call.keywords:
            if keyword.arg == "status":
                return True
            if keyword.arg is None and isinstance(keyword.value, ast.Dict):
                keys = [k.value for k in keyword.value.keys if isinstance(k, ast.Constant)]
                if "status" in keys:
                    return True
    if call.func.attr in ("save", "bulk_update"):
        fields = [k.value for k in call.keywords if k.arg == "update_fields"]
        fields += call.args[1:2] if call.func.attr == "bulk_update" else []
        for value in fields:
            listed = value.elts if isinstance(value, ast.List | ast.Tuple | ast.Set) else []
            if any(isinstance(e, ast.Constant) and e.value == "status" for e in listed):
                return True
    return False


def test_no_status_update_outside_the_lifecycle_module():
    found = []
    for path in _sources():
        if path == LIFECYCLE or path in OTHER_ROWS:
            continue
        tree = ast.parse((ROOT / path).read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _sets_status(node):
                found.append(f"{path}:{node.lineno}")
    assert not found, f"a status change outside jobs.lifecycle.transition: {found}"


def test_the_scan_sees_each_shape_it_forbids():
    for source in (
        "Job.objects.filter(pk=1).update(status='lost')",
        "rows.update(**{'status': 'lost', 'message': ''})",
        "job.save(update_fields=['status', 'message'])",
        "Job.objects.bulk_update(jobs, ['status'])",
    ):
        call = ast.parse(source).body[0].value  # type: ignore[attr-defined]
        assert _sets_status(call), source
    assert not _sets_status(ast.parse("rows.update(message='')").body[0].value)  # type: ignore[attr-defined]


def test_the_other_rows_allowed_are_still_other_rows():
    for path, model in OTHER_ROWS.items():
        assert model in (ROOT / path).read_text()


# --- the transition itself ------------------------------------------------------------------


@pytest.fixture
def published(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(log_live, "publish", lambda job_id, kind, offset, data=b"": calls.append(job_id))
    return calls


@pytest.fixture
def job(alice, booking, sent) -> Job:
    return job_submit(user=alice, reservation=booking, script=ScriptUpload(name="train.py", content=b"1\n"))


def test_it_changes_nothing_and_publishes_nothing_from_another_status(
    job, published, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        made = Job.objects.transition(job.pk, from_=Job.Status.RUNNING, to=Job.Status.LOST, message="x")
    assert made is False and callbacks == [] and published == []
    job.refresh_from_db()
    assert (job.status, job.message) == (Job.Status.QUEUED, "")


def test_it_writes_the_fields_and_publishes_once_after_commit(
    job, published, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        made = Job.objects.transition(
            job.pk, from_=(Job.Status.PENDING, Job.Status.QUEUED), to=Job.Status.CANCELLED, message="gone"
        )
        assert made is True and published == []  # not before the commit
    for callback in callbacks:
        callback()
    assert published == [job.pk]
    job.refresh_from_db()
    assert (job.status, job.message) == (Job.Status.CANCELLED, "gone")


def test_its_where_is_judged_in_the_update(job, published):
    assert not Job.objects.transition(
        job.pk, from_=Job.Status.QUEUED, to=Job.Status.CANCELLED, where=Q(name="another.py")
    )
    assert Job.objects.get(pk=job.pk).status == Job.Status.QUEUED


def test_what_is_told_comes_only_with_a_change_made(job, published):
    def told() -> None:
        AuditEntry.objects.create(action=AuditEntry.Action.JOB_CANCEL, target=f"job {job.pk}", message="m")

    assert Job.objects.transition(job.pk, from_=Job.Status.QUEUED, to=Job.Status.CANCELLED, told=told)
    assert not Job.objects.transition(job.pk, from_=Job.Status.QUEUED, to=Job.Status.CANCELLED, told=told)
    assert AuditEntry.objects.filter(target=f"job {job.pk}").count() == 1


def test_a_session_changes_once(alice, booking):
    session, _ = session_start(user=alice, reservation=booking.pk, kind="exec", host="box1", command=["x"])
    running = {"from_": InteractiveSession.Status.STARTING, "to": InteractiveSession.Status.RUNNING}
    assert InteractiveSession.objects.transition(session.pk, **running, pid=4242)
    assert not InteractiveSession.objects.transition(session.pk, **running, pid=1)
    assert InteractiveSession.objects.get(pk=session.pk).pid == 4242
