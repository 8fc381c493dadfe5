"""Job usage from telemetry: recorded by jobs through gpus' signal, never at telemetry's expense."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpus.inventory import ProcessInfo
from gpus.models import GPUProcess, Server
from gpus.services import server_report_ingest
from jobs import signals
from tests.factories import make_snapshot


def _round_with_a_job_process(job_id: int):
    snapshot = make_snapshot("box1", gpus=2, util=40, processes=0)
    held = replace(snapshot.gpus[0], processes=(ProcessInfo(7, "alice", "python", 1000, job_id),))
    return replace(snapshot, gpus=(held, *snapshot.gpus[1:]))


@pytest.mark.django_db
def test_it_keeps_the_telemetry_round_when_recording_job_usage_fails(monkeypatch, caplog):
    def broken(**kwargs):
        raise RuntimeError("usage bug")

    monkeypatch.setattr(signals, "jobs_usage_record", broken)
    server_report_ingest(snapshot=_round_with_a_job_process(42))
    assert Server.objects.get(name="box1").last_seen is not None
    assert GPUProcess.objects.get().job_id == 42
    assert "Could not record this round's job usage" in caplog.text


@pytest.mark.django_db
def test_it_stores_a_job_id_beyond_32_bits():
    """PORTAL_JOB_ID comes from the process; a large one must not fail the round's insert."""
    server_report_ingest(snapshot=_round_with_a_job_process(3_000_000_000))
    assert GPUProcess.objects.get().job_id == 3_000_000_000
