"""Job usage from telemetry: recorded by jobs through gpus' signals, never at telemetry's expense."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpus.booking import reservation_create
from gpus.inventory import ProcessInfo
from gpus.models import GPUProcess, Server
from gpus.services import server_report_ingest
from jobs import signals
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit
from tests.factories import make_snapshot


def _round_with(*processes: ProcessInfo, server: str = "box1"):
    snapshot = make_snapshot(server, gpus=2, util=40, processes=0)
    held = replace(snapshot.gpus[0], processes=processes)
    return replace(snapshot, gpus=(held, *snapshot.gpus[1:]))


@pytest.fixture
def running_job(alice, box, sent) -> Job:
    booking = reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="t.py", content=b"pass\n"))
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, pid=4321)
    return job


def test_it_attributes_a_process_to_the_job_whose_session_it_is_in(running_job):
    server_report_ingest(snapshot=_round_with(ProcessInfo(4400, "alice", "python", 1000, session_id=4321)))
    assert GPUProcess.objects.get().job_id == running_job.pk


def test_it_ignores_a_job_id_a_report_claims(running_job):
    """The job id is the portal's to resolve: a report (or a process) cannot name one."""
    claimed = ProcessInfo(4400, "mallory", "python", 1000, session_id=999, job_id=running_job.pk)
    server_report_ingest(snapshot=_round_with(claimed))
    assert GPUProcess.objects.get().job_id is None


def test_it_matches_sessions_only_on_the_jobs_server_and_while_it_runs(running_job):
    server_report_ingest(
        snapshot=_round_with(ProcessInfo(4400, "alice", "python", 1000, session_id=4321), server="box2")
    )
    assert GPUProcess.objects.get(gpu__server__name="box2").job_id is None
    Job.objects.filter(pk=running_job.pk).update(status=Job.Status.SUCCEEDED)
    server_report_ingest(snapshot=_round_with(ProcessInfo(4400, "alice", "python", 1000, session_id=4321)))
    assert GPUProcess.objects.get(gpu__server__name="box1").job_id is None


def test_it_keeps_the_telemetry_round_when_recording_job_usage_fails(running_job, monkeypatch, caplog):
    def broken(**kwargs):
        raise RuntimeError("usage bug")

    monkeypatch.setattr(signals, "jobs_usage_record", broken)
    server_report_ingest(snapshot=_round_with(ProcessInfo(4321, "alice", "python", 1000, session_id=4321)))
    assert Server.objects.get(name="box1").last_seen is not None
    assert GPUProcess.objects.get().job_id == running_job.pk
    assert "Could not record this round's job usage" in caplog.text


def test_it_stores_a_job_id_beyond_32_bits(running_job):
    Job.objects.filter(pk=running_job.pk).update(id=3_000_000_000)
    server_report_ingest(snapshot=_round_with(ProcessInfo(4321, "alice", "python", 1000, session_id=4321)))
    assert GPUProcess.objects.get().job_id == 3_000_000_000
