"""Training curves: the launcher's Keras callback, the worker taking its records out of the output,
the API, the CSV, the job page, and the example job end to end."""

from __future__ import annotations

import csv
import io
import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import OperationalError
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import GPU, TelemetrySample
from gpus.services import server_report_ingest
from gpus.simulated.inventory import server_names
from jobs import metrics
from jobs.logs.store import LOG_FLUSH_SECONDS, log_stream
from jobs.metrics import MAX_METRICS, PREFIX, MetricsRecorder, parse_record
from jobs.models import Job, JobMetric
from jobs.submit import ScriptUpload, job_submit
from tests.browser import log_in, page  # noqa: F401 - the fixture
from tests.conftest import OUTPUT, Clock
from tests.factories import make_snapshot
from tests.test_launcher import BOOKING, EXAMPLES, launch, launcher, write
from tests.waiting import wait_for

# --------------------------------------------------------------------------------------------------------
# The launcher's callback, in the job's own interpreter

KERAS_FIT = """
import time
import keras
import numpy as np

class Mine(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print("MINE epoch", epoch + 1, flush=True)

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.01)  # at most 100 batches a second: records must come far fewer

rng = np.random.default_rng(0)
x = rng.normal(size=(1000, 4)).astype("float32")
y = (x.sum(axis=1) > 0).astype("float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=10, decay_rate=0.5)
model.compile(optimizer=keras.optimizers.Adam(schedule), loss="binary_crossentropy", metrics=["accuracy"])
mine = [Mine()]
started = time.monotonic()
model.fit(x, y, epochs=3, batch_size=10, validation_split=0.2, verbose=2, callbacks=mine)
print("FIRST FIT SECONDS", time.monotonic() - started, flush=True)
model.fit(x, y, 50, 1, 0, mine)  # again with the same list, given positionally this time
print("CALLBACKS", len(mine), flush=True)
"""


def records_in(stdout: str) -> list[dict]:
    lines = [line for line in stdout.splitlines() if line.startswith(launcher.METRICS_PREFIX)]
    for line in lines:
        assert len(line.encode()) < launcher.MAX_RECORD_BYTES
        assert parse_record(line.encode()[len(PREFIX) :]) is not None  # what the worker stores
    return [json.loads(line[len(launcher.METRICS_PREFIX) :]) for line in lines]


def test_the_launcher_and_the_worker_agree_on_the_line() -> None:
    assert launcher.METRICS_PREFIX.encode() == PREFIX
    assert launcher.MAX_RECORD_BYTES == metrics.MAX_LINE_BYTES
    assert launcher.MAX_METRICS == MAX_METRICS


def test_it_reports_each_epoch_and_throttled_batches_of_every_fit(tmp_path: Path) -> None:
    write(tmp_path / "train.py", KERAS_FIT)

    result = launch("train.py", cwd=tmp_path, config=BOOKING)

    assert result.returncode == 0, result.stderr
    out = result.stdout
    records = records_in(out)
    epochs = [r for r in records if r["kind"] == "epoch"]
    # 800 training samples in batches of 10: 80 steps an epoch; the second fit's 1000 in 50s: 20.
    assert [(r["epoch"], r["step"]) for r in epochs] == [(1, 80), (2, 160), (3, 240), (1, 260)]
    for record in epochs[:3]:
        assert set(record) == {
            "kind", "epoch", "step", "loss", "accuracy", "val_loss", "val_accuracy", "learning_rate",
        }  # fmt: skip
        assert all(isinstance(record[name], float) for name in ("loss", "val_loss", "learning_rate"))
    assert set(epochs[3]) == {"kind", "epoch", "step", "loss", "accuracy", "learning_rate"}
    rates = [r["learning_rate"] for r in epochs]
    assert rates[0] < 0.01 and rates == sorted(rates, reverse=True)  # the schedule, read as it decays
    # The script's own callback still runs, its list is not changed, and nothing was added twice.
    assert out.count("MINE epoch") == 4 and "CALLBACKS 1" in out
    assert "Epoch 1/3" in out and "Epoch 3/3" in out  # Keras's own output as before
    # Batch records: at most one a second (the first fit took 2.4 s at least), in order.
    seconds = float(out.split("FIRST FIT SECONDS ", 1)[1].split()[0])
    first_fit = [r for r in records[: records.index(epochs[2]) + 1] if r["kind"] == "batch"]
    assert 1 <= len(first_fit) <= seconds + 1
    assert all(set(r) == {"kind", "epoch", "step", "loss", "accuracy"} for r in first_fit)
    steps = [r["step"] for r in records]
    assert steps == sorted(steps)


def test_a_script_without_keras_gets_no_records(tmp_path: Path) -> None:
    write(
        tmp_path / "job.py",
        """
        import importlib.util, json
        print("keras available:", importlib.util.find_spec("json") is not None)
        print(json.dumps({"loss": 1.0}))
        """,
    )

    result = launch("job.py", cwd=tmp_path, config=BOOKING)

    assert result.returncode == 0, result.stderr
    assert launcher.METRICS_PREFIX not in result.stdout + result.stderr
    assert '{"loss": 1.0}' in result.stdout


class Pipe:
    """The job's stdout as the reporter sees it: a real pipe, read back here."""

    def __init__(self) -> None:
        self.read_fd, self.fd = os.pipe()

    def records(self) -> list[dict]:
        os.set_blocking(self.read_fd, False)
        try:
            data = os.read(self.read_fd, 1 << 16).decode()
        except BlockingIOError:
            return []
        return [json.loads(line.split(" ", 1)[1]) for line in data.splitlines()]

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.fd)


@pytest.fixture
def pipe():
    opened = Pipe()
    yield opened
    opened.close()


def test_the_reporter_throttles_batches_by_time(pipe) -> None:
    clock = Clock()
    reporter = launcher.MetricsReporter(pipe.fd, clock=clock)
    reporter.epoch_begin(0)
    for batch, at in enumerate([0, 0.3, 0.99, 1.0, 1.5, 2.2]):
        clock.now = 1000 + at
        reporter.batch_end(batch, {"loss": 1.0 / (batch + 1)})
    assert [(r["step"], r["loss"]) for r in pipe.records()] == [(1, 1.0), (4, 0.25), (6, 1 / 6)]
    # After a long run, the gap grows: one per 1/BATCH_SPREAD of the time so far.
    clock.now = 1000 + 10 * launcher.BATCH_SPREAD
    reporter.batch_end(6, {"loss": 0.1})
    clock.now += 5
    reporter.batch_end(7, {"loss": 0.1})
    clock.now += 6
    reporter.batch_end(8, {"loss": 0.1})
    assert [r["step"] for r in pipe.records()] == [7, 9]


def test_the_reporter_writes_only_json_numbers(pipe) -> None:
    reporter = launcher.MetricsReporter(pipe.fd)
    logs = {
        "loss": float("nan"),
        "val_loss": float("inf"),
        "accuracy": 1,
        "weights": [1.0, 2.0],  # no scalar: left out
        "note": "text",
        "epoch": 99,  # the record's own key: left out
        "x" * 65: 1.0,
        **{f"m{i:02d}": i for i in range(40)},
    }

    reporter.epoch_end(4, logs, None)  # no model: no learning rate to read

    (record,) = pipe.records()
    assert record["kind"] == "epoch" and record["epoch"] == 5 and record["step"] == 0
    assert record["loss"] is None and record["val_loss"] is None and record["accuracy"] == 1.0
    assert not {"weights", "note", "x" * 65} & set(record)
    assert len(record) - 3 == launcher.MAX_METRICS  # the learning rate, last, is the 33rd: left out
    assert "learning_rate" not in record


def test_the_reporter_never_breaks_the_training(pipe, capfd) -> None:
    reporter = launcher.MetricsReporter(pipe.fd)

    reporter.epoch_end(0, "not a dict", None)  # raises inside: caught
    reporter.epoch_end(1, {"loss": 1.0}, None)

    assert reporter.off and pipe.records() == []
    assert capfd.readouterr().err.count("[portal] training curves stopped: ValueError") == 1


# --------------------------------------------------------------------------------------------------------
# The worker's side: records out of the output, into the table


@pytest.fixture
def job(alice, team, box) -> Job:
    return Job.objects.create(
        owner=alice,
        team=team,
        name="train.py",
        server=box[0].server,
        gpu_uuids=[box[0].uuid],
        status=Job.Status.RUNNING,
        started_at=timezone.now() - timedelta(minutes=5),
    )


def line(record: dict | str) -> bytes:
    body = record if isinstance(record, str) else json.dumps(record)
    return PREFIX + b" " + body.encode() + b"\n"


EPOCH = {"kind": "epoch", "epoch": 1, "step": 80, "loss": 0.5, "accuracy": 0.75, "learning_rate": 0.001}


def stored(job: Job) -> list[dict]:
    return list(JobMetric.objects.filter(job=job).values("seq", "kind", "epoch", "step", "values"))


def test_it_takes_the_records_out_of_the_log_and_stores_them(job) -> None:
    recorder = MetricsRecorder(job.pk)

    out = recorder.feed(b"Epoch 1/3\n" + line(EPOCH) + b"80/80 - 1s - loss: 0.5\n")
    recorder.flush()

    assert out == b"Epoch 1/3\n80/80 - 1s - loss: 0.5\n"
    assert stored(job) == [
        {
            "seq": 1,
            "kind": "epoch",
            "epoch": 1,
            "step": 80,
            "values": {"loss": 0.5, "accuracy": 0.75, "learning_rate": 0.001},
        }
    ]
    assert JobMetric.objects.get().at <= timezone.now()


def test_a_record_split_across_reads_or_inside_a_progress_bar_is_still_one(job) -> None:
    recorder = MetricsRecorder(job.pk)
    record = line({"kind": "batch", "epoch": 1, "step": 12, "loss": 0.7})

    # A progress bar (no newline yet), then the record in three reads, the first ending in "[port".
    out = recorder.feed(b"\n 12/80 [====") + recorder.feed(b"  ] - loss: 0.7" + record[:5])
    out += recorder.feed(record[5:30]) + recorder.feed(record[30:] + b"\n 13/80 [=====")

    assert out == b"\n 12/80 [====  ] - loss: 0.7\n 13/80 [====="  # reads on as if it had not been there
    assert len(recorder.pending) == 1 and recorder.pending[0].step == 12


def test_it_gives_back_what_was_held_and_did_not_become_a_record(job) -> None:
    clock = Clock()
    recorder = MetricsRecorder(job.pk, clock=clock)

    assert recorder.feed(b"progress [portal-m") == b"progress "
    assert recorder.release() == b""
    clock.now += LOG_FLUSH_SECONDS
    assert recorder.release() == b"[portal-m"
    assert recorder.feed(b"[portal-metrics] {not yet") == b""
    clock.now += LOG_FLUSH_SECONDS / 2
    assert recorder.feed(b", slowly") == b""  # a line that grows does not stay back longer
    assert recorder.release() == b""
    clock.now += LOG_FLUSH_SECONDS / 2
    assert recorder.release() == b"[portal-metrics] {not yet, slowly"
    assert recorder.feed(b"[portal-metrics] {at the end") == b""
    assert recorder.release(everything=True) == b"[portal-metrics] {at the end"


HOSTILE = [
    PREFIX + b" " + b"x" * 10_000 + b"\n",  # far too long
    PREFIX + b" " + json.dumps({"kind": "epoch", "loss": 1.0, "pad": "y" * 5000}).encode() + b"\n",
    line("{not json"),
    line("[1, 2, 3]"),
    line('"a string"'),
    line("[" * 2000 + "]" * 2000),  # too deep: RecursionError, not a crash
    line({"kind": "other", "loss": 1.0}),
    line({"kind": "epoch", "epoch": -1, "loss": 1.0}),
    line({"kind": "epoch", "epoch": True, "loss": 1.0}),
    line({"kind": "epoch", "step": 10**20, "loss": 1.0}),
    line({"kind": "epoch", "epoch": 1.5, "loss": 1.0}),
    line({"kind": "epoch", "epoch": 2}),  # no metric at all
    line({"kind": "epoch", "=cmd|calc": 1.0, "": 1.0, "a" * 65: 1.0, "s": "text", "b": True, "n": {"x": 1}}),
    PREFIX + b' {"kind": "epoch", "loss": 1' + b"0" * 400 + b"}\n",  # an integer beyond a float
    PREFIX + b" \xff\xfe\n",  # not UTF-8
]


@pytest.mark.parametrize("hostile", HOSTILE, ids=range(len(HOSTILE)))
def test_a_line_that_only_looks_like_a_record_stays_in_the_log(job, hostile: bytes) -> None:
    recorder = MetricsRecorder(job.pk)

    out = recorder.feed(b"before\n" + hostile + b"after\n") + recorder.release(everything=True)
    recorder.flush()

    assert out == b"before\n" + hostile + b"after\n"
    assert stored(job) == []


def test_it_keeps_what_fits_of_an_odd_record(job) -> None:
    recorder = MetricsRecorder(job.pk)
    record = (
        '{"kind": "batch", "epoch": null, "loss": NaN, "val_loss": Infinity, "big": 1e999, "ok": 2,'
        ' "seq": 5, "at": 1, "bad name": 1.0, "flag": false, '
        + ", ".join(f'"m{i:02d}": {i}' for i in range(50))
        + "}"
    )

    assert recorder.feed(line(record)) == b""
    recorder.flush()

    (row,) = stored(job)
    assert row["kind"] == "batch" and row["epoch"] is None and row["step"] is None
    values = row["values"]
    assert values["loss"] is None and values["val_loss"] is None and values["big"] is None
    assert values["ok"] == 2.0 and "seq" not in values and "bad name" not in values and "flag" not in values
    assert len(values) == MAX_METRICS


def test_it_stops_storing_at_the_cap_and_says_so_once(job, monkeypatch) -> None:
    monkeypatch.setattr(metrics, "MAX_RECORDS", 3)
    recorder = MetricsRecorder(job.pk)

    out = b"".join(recorder.feed(line(EPOCH | {"epoch": n})) for n in range(1, 6))
    notes = [recorder.full_note(), recorder.full_note()]
    recorder.flush()

    assert [row["epoch"] for row in stored(job)] == [1, 2, 3]
    assert out == line(EPOCH | {"epoch": 4}) + line(EPOCH | {"epoch": 5})  # in the log instead
    assert "3 records, the most that are kept" in notes[0] and notes[1] is None


def test_it_flushes_at_the_logs_cadence_and_keeps_records_while_the_database_is_away(
    job, monkeypatch
) -> None:
    clock = Clock()
    recorder = MetricsRecorder(job.pk, clock=clock)
    recorder.feed(line(EPOCH))
    recorder.maybe_flush()
    assert stored(job) == []  # not yet: at most every LOG_FLUSH_SECONDS

    def away(*args, **kwargs):
        raise OperationalError("the database is restarting")

    clock.now += LOG_FLUSH_SECONDS
    with monkeypatch.context() as patch:
        patch.setattr(JobMetric.objects, "bulk_create", away)
        with pytest.raises(OperationalError):
            recorder.maybe_flush()
    recorder.feed(line(EPOCH | {"epoch": 2}))
    clock.now += LOG_FLUSH_SECONDS
    recorder.maybe_flush()

    assert [row["seq"] for row in stored(job)] == [1, 2]
    assert MetricsRecorder(job.pk).seq == 2  # a restarted recorder continues the numbering


# --------------------------------------------------------------------------------------------------------
# Reading them: the API, the CSV, the page


@pytest.fixture
def recorded(job) -> Job:
    recorder = MetricsRecorder(job.pk)
    recorder.feed(
        line({"kind": "batch", "epoch": 1, "step": 40, "loss": 0.9})
        + line(EPOCH)
        + line({"kind": "epoch", "epoch": 2, "step": 160, "loss": 0.4, "val_loss": None, "val_accuracy": 0.8})
    )
    recorder.flush()
    return job


def client_for(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def test_the_api_gives_the_records_to_whoever_sees_the_job(recorded, alice, leader, admin_user) -> None:
    for user in (alice, leader, admin_user):
        response = client_for(user).get(f"/api/v1/jobs/{recorded.pk}/metrics/")
        assert response.status_code == 200, user
    body = response.json()
    assert [(r["seq"], r["kind"], r["epoch"], r["step"]) for r in body] == [
        (1, "batch", 1, 40),
        (2, "epoch", 1, 80),
        (3, "epoch", 2, 160),
    ]
    assert body[1] | {"at": None} == {
        "seq": 2, "kind": "epoch", "epoch": 1, "step": 80, "at": None,
        "loss": 0.5, "accuracy": 0.75, "learning_rate": 0.001,
    }  # fmt: skip
    assert body[2]["val_loss"] is None
    assert response["X-Job-Status"] == "running"


def test_others_get_404(recorded, bob, charlie) -> None:
    for user in (bob, charlie):  # a teammate who leads nothing, an outsider
        assert client_for(user).get(f"/api/v1/jobs/{recorded.pk}/metrics/").status_code == 404
        assert client_for(user).get(f"/jobs/{recorded.pk}/metrics.csv").status_code == 404
        assert client_for(user).get(f"/jobs/{recorded.pk}/usage.json").status_code == 404
    assert APIClient().get(f"/api/v1/jobs/{recorded.pk}/metrics/").status_code in (401, 403)


def test_since_gives_only_the_newer_records(recorded, alice) -> None:
    api = client_for(alice)

    assert [r["seq"] for r in api.get(f"/api/v1/jobs/{recorded.pk}/metrics/?since=1").json()] == [2, 3]
    assert api.get(f"/api/v1/jobs/{recorded.pk}/metrics/?since=3").json() == []
    bad = api.get(f"/api/v1/jobs/{recorded.pk}/metrics/?since=2026-01-01")
    assert bad.status_code == 400 and "since" in bad.json()["errors"]


def test_a_job_without_keras_has_no_records_and_no_curves(job, alice) -> None:
    api = client_for(alice)

    assert api.get(f"/api/v1/jobs/{job.pk}/metrics/").json() == []
    html = api.get(f"/jobs/{job.pk}/").content.decode()
    assert '<section id="job-curves"' in html and "hidden>" in html.split('<section id="job-curves"')[1][:200]
    content = b"".join(api.get(f"/jobs/{job.pk}/metrics.csv").streaming_content).decode()
    assert list(csv.reader(io.StringIO(content))) == [["seq", "kind", "epoch", "step", "at"]]


@pytest.mark.parametrize("url", ["/jobs/{pk}/metrics.csv", "/api/v1/jobs/{pk}/metrics/?format=csv"])
def test_the_csv_has_a_column_for_every_metric_name(recorded, alice, url: str) -> None:
    response = client_for(alice).get(url.format(pk=recorded.pk))

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    assert f"job-{recorded.pk}-train-metrics.csv" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert list(rows[0]) == [
        "seq", "kind", "epoch", "step", "at", "loss", "accuracy", "learning_rate", "val_loss", "val_accuracy",
    ]  # fmt: skip
    assert [(r["seq"], r["kind"], r["loss"], r["accuracy"], r["val_loss"]) for r in rows] == [
        ("1", "batch", "0.9", "", ""),
        ("2", "epoch", "0.5", "0.75", ""),
        ("3", "epoch", "0.4", "", ""),  # null: empty
    ]


def test_the_page_shows_the_curves_and_the_cards_use(recorded, alice) -> None:
    html = client_for(alice).get(f"/jobs/{recorded.pk}/").content.decode()

    assert f'data-metrics-url="/api/v1/jobs/{recorded.pk}/metrics/"' in html
    assert f'data-usage-url="/jobs/{recorded.pk}/usage.json"' in html
    assert "hidden>" not in html.split('<section id="job-curves"')[1][:200]
    assert "js/job_curves.js" in html and "chart-4.6.1.umd.min.js" in html


def test_usage_gives_the_jobs_cards_over_its_life(job, alice, box) -> None:
    TelemetrySample.objects.all().delete()  # the box's report of a moment ago
    now = timezone.now()
    for gpu, minutes, util in [
        (box[0], 10, 5),  # before the job started
        (box[0], 4, 80),
        (box[0], 1, 90),
        (box[1], 2, 70),  # not the job's card
    ]:
        TelemetrySample.objects.create(
            gpu=gpu, at=now - timedelta(minutes=minutes), utilization_pct=util, memory_used_mb=1000
        )

    body = client_for(alice).get(f"/jobs/{job.pk}/usage.json").json()

    assert body["status"] == "running" and body["started_at"]
    (card,) = body["cards"]
    assert card["uuid"] == box[0].uuid and card["label"] == "GPU 0"
    assert [p["util"] for p in card["points"]] == [80, 90]
    assert card["memory_total_mb"] == box[0].memory_total_mb


# --------------------------------------------------------------------------------------------------------
# End to end: the example job on a real worker


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_the_example_job_shows_its_curves_while_it_runs(alice, start_worker) -> None:
    name = server_names()[0]
    server_report_ingest(snapshot=make_snapshot(name, gpus=4, simulated=True))
    start_worker(name)
    booking = reservation_create(user=alice, gpus=[f"GPU-{name}-00"])
    api = client_for(alice)
    upload = SimpleUploadedFile("keras_example.py", (EXAMPLES / "keras_example.py").read_bytes())
    data = {"reservation": booking.pk, "script": upload, "args": "--epochs 30"}
    job_id = api.post("/api/v1/jobs/", data, format="multipart").json()["id"]

    def while_running() -> tuple[list[dict], str] | None:
        status = Job.objects.get(pk=job_id).status
        records = api.get(f"/api/v1/jobs/{job_id}/metrics/").json()
        return (records, status) if records else None

    first, status = wait_for(while_running, timeout=120, what="the first records")  # type: ignore[misc]
    assert status == Job.Status.RUNNING  # seen live, not only once it ended
    wait_for(lambda: Job.objects.get(pk=job_id).is_finished, timeout=120, what="the job to end")
    assert Job.objects.get(pk=job_id).status == Job.Status.SUCCEEDED

    records = api.get(f"/api/v1/jobs/{job_id}/metrics/").json()
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(1, 31))
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"} <= set(epochs[-1])
    assert any(r["seq"] == first[0]["seq"] for r in records)
    log = b"".join(log_stream(job_id)).decode()
    assert "Epoch 30/30" in log and "[portal-metrics]" not in log  # out of the log, into the table


# The records the launcher's callback writes (see MetricsReporter), an epoch every quarter second
# until the file named by its argument exists: the page's test needs no Keras of its own, and ends
# the job once it has seen what it waits for.
CURVES = """
import json, os, sys, time
def record(kind, epoch, step, **values):
    print({prefix!r}, json.dumps(dict(kind=kind, epoch=epoch, step=step, **values)), flush=True)
epoch = 0
while not os.path.exists(sys.argv[1]):
    epoch += 1
    loss = 1 / epoch
    record("batch", epoch, 10 * epoch - 5, loss=1.1 * loss)
    record("epoch", epoch, 10 * epoch, loss=loss, accuracy=1 - loss / 2, val_loss=1.2 * loss,
           val_accuracy=1 - 0.6 * loss, learning_rate=0.001 / epoch)
    time.sleep(0.25)
"""


@pytest.mark.browser
@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_the_job_page_draws_the_curves_live(page, alice, start_worker, tmp_path) -> None:  # noqa: F811
    """The page's side: records stored while the job runs are drawn as they come. Keras writing
    them is test_it_reports_each_epoch_and_throttled_batches_of_every_fit, and the example job's
    reaching the API live test_the_example_job_shows_its_curves_while_it_runs."""
    from playwright.sync_api import expect

    name = server_names()[0]
    start_worker(None, extra_env={"TELEMETRY_HISTORY_SECONDS": "1"})  # a sample a second for the chart
    start_worker(name)
    gpu = wait_for(lambda: GPU.objects.filter(server__name=name).first(), timeout=60, what="the GPUs")
    booking = reservation_create(user=alice, gpus=[gpu.uuid])  # type: ignore[union-attr]
    script = ScriptUpload(name="train.py", content=CURVES.format(prefix=launcher.METRICS_PREFIX).encode())
    release = tmp_path / "release"
    job = job_submit(user=alice, reservation=booking, script=script, args=str(release))

    log_in(page, "alice")
    page.goto(f"/jobs/{job.pk}/")
    expect(page.locator("#job-curves")).to_be_visible(timeout=90_000)
    expect(page.locator("#job-curves-status")).to_contain_text("live", timeout=15_000)  # drawn as it runs
    started = Job.objects.get(pk=job.pk).started_at
    wait_for(
        lambda: TelemetrySample.objects.filter(gpu=gpu, at__gte=started).exists(),
        timeout=30,
        what="a sample of the card from the job's life, for its usage chart",
    )
    release.touch()
    expect(page.locator("#job-curves")).to_have_attribute("data-done", "1", timeout=120_000)
    expect(page.locator("#job-usage")).to_have_attribute("data-done", "1", timeout=30_000)
    assert Job.objects.get(pk=job.pk).status == Job.Status.SUCCEEDED
    labels = page.evaluate("Chart.getChart('job-curves-chart').data.datasets.map((d) => d.label)")
    assert {"loss", "val_loss", "accuracy", "val_accuracy", "learning_rate", "loss (batches)"} <= set(labels)
    points = page.evaluate("Chart.getChart('job-curves-chart').data.datasets[0].data.length")
    assert points > 0
    assert "samples" in page.locator("#job-usage-status").inner_text()
    page.locator(".job-charts").screenshot(path=str(OUTPUT / "job-curves.png"))
