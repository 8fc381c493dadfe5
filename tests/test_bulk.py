"""gpus/bulk.py, the telemetry round's raw SQL: COPY on PostgreSQL, executemany on SQLite. Run on
both (`make test` on SQLite; CI, or DATABASE_URL=postgres://..., on PostgreSQL)."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext

from gpus.bulk import rows_insert, rows_update
from gpus.models import GPU, GPUProcess, Server
from gpus.services import server_report_ingest
from portal.clock import db_now
from tests.factories import make_snapshot

pytestmark = pytest.mark.django_db

AWKWARD = ["plain", "", 'a "quoted" \\ back\\slash', "tab\tand\nnewline", "ünïcødé ☃", "NULL", "{x,y}"]


def test_it_inserts_rows_as_they_are():
    server_report_ingest(snapshot=make_snapshot("box1", gpus=1, processes=0))
    rows = [
        ("GPU-box1-00", 100 + n, text, text * 2, None if n % 2 else n * 10, None, 1.5 + n, None, n or None)
        for n, text in enumerate(AWKWARD)
    ]
    fields = ["gpu", "pid", "username", "command", "used_memory_mb", "session_id", "started", "job_id"]
    rows_insert(GPUProcess, [*fields, "interactive_id"], rows)
    stored = GPUProcess.objects.order_by("pid").values_list(*[f if f != "gpu" else "gpu_id" for f in fields])
    assert list(stored) == [row[:-1] for row in rows]
    assert list(GPUProcess.objects.order_by("pid").values_list("interactive_id", flat=True)) == [
        row[-1] for row in rows
    ]


def test_it_updates_rows_by_their_key_and_sets_the_database_clock():
    server_report_ingest(snapshot=make_snapshot("box1", gpus=3))
    Server.objects.update(last_seen=None)
    before = db_now()
    rows_update(
        GPU,
        ["memory_used_mb", "utilization_pct", "power_w", "slurm_job"],
        "uuid",
        [
            (7, None, 12.25, AWKWARD[2], "GPU-box1-00"),
            (0, 99, None, AWKWARD[3], "GPU-box1-02"),
            (1, 2, 3.0, "no such card", "GPU-nowhere"),  # matches nothing: changes nothing
        ],
    )
    rows_update(Server, ["hostname"], "name", [("box1.new", "box1")], now_fields=["last_seen"])
    rows = GPU.objects.values_list("uuid", "memory_used_mb", "utilization_pct", "power_w", "slurm_job")
    figures = {uuid: rest for uuid, *rest in rows}
    assert figures == {
        "GPU-box1-00": [7, None, 12.25, AWKWARD[2]],
        "GPU-box1-01": [1001, 10, 70.5, ""],  # not named: as the report left it
        "GPU-box1-02": [0, 99, None, AWKWARD[3]],
    }
    server = Server.objects.get(name="box1")
    assert server.hostname == "box1.new" and server.last_seen >= before
    assert not GPU.objects.filter(uuid="GPU-nowhere").exists()


def test_it_updates_twice_in_one_transaction_without_the_first_rows():
    """The staging table of an update (PostgreSQL) is emptied before each use, not only at commit:
    a second update in the same transaction (a test's, a caller's) must not see the first's rows."""
    server_report_ingest(snapshot=make_snapshot("box1", gpus=2))
    with transaction.atomic():
        rows_update(GPU, ["utilization_pct"], "uuid", [(11, "GPU-box1-00"), (12, "GPU-box1-01")])
        rows_update(GPU, ["utilization_pct"], "uuid", [(21, "GPU-box1-00")])
    assert dict(GPU.objects.values_list("uuid", "utilization_pct")) == {"GPU-box1-00": 21, "GPU-box1-01": 12}


def test_it_sends_nothing_for_no_rows():
    with CaptureQueriesContext(connection) as queries:
        rows_insert(GPUProcess, ["gpu", "pid"], [])
        rows_update(GPU, ["utilization_pct"], "uuid", [])
    assert len(queries) == 0


def test_its_errors_are_djangos_and_are_counted_as_queries():
    """A COPY's error is Django's IntegrityError (the collector catches DatabaseError), and a COPY
    shows in the query log like any statement (the tests' and the bench's query counts)."""
    server_report_ingest(snapshot=make_snapshot("box1", gpus=1, processes=0))
    with CaptureQueriesContext(connection) as queries:
        rows_insert(
            GPUProcess, ["gpu", "pid", "username", "command"], [("GPU-box1-00", 5, "alice", "python")]
        )
    assert len(queries) == 1 and "gpus_gpuprocess" in queries.captured_queries[0]["sql"]
    with pytest.raises(IntegrityError), transaction.atomic():
        rows_insert(GPUProcess, ["gpu", "pid", "username", "command"], [("GPU-box1-00", 6, None, "python")])
    assert GPUProcess.objects.count() == 1
