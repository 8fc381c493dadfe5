"""A preemptible Keras job end to end (issue 36): real Celery workers (the portal's, with the
scheduler; a simulated GPU host's), real Redis, a real TensorFlow subprocess on the CPU. It
checkpoints after every epoch, is preempted mid-run, goes back to the queue, runs again and
resumes from its checkpoint, and succeeds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from gpus.models import GPU, Reservation
from gpus.simulated.inventory import server_names
from jobs.models import Job
from jobs.preemption import job_preempt
from tests.job_helpers import job_log
from tests.waiting import wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]

EPOCHS = 6
EXAMPLE = Path(__file__).resolve().parent.parent / "jobs" / "examples" / "keras_example.py"


def _examples(name: str) -> str:
    """The example's own code for `name` (read, not imported: that would start TensorFlow here)."""
    source = EXAMPLE.read_text()
    node = next(node for node in ast.parse(source).body if getattr(node, "name", "") == name)
    return ast.get_source_segment(source, node) or ""


# A tiny fit with a checkpoint after every epoch and the example's way of taking SIGTERM between
# batches (jobs/examples/keras_example.py). Without the example's stop, a SIGTERM in the middle of
# a checkpoint's write left it cut short, or came between the checkpoint and the "finished" line,
# and the resumed run differed. Its first run waits after its second epoch until the SIGTERM
# comes (the resumed run starts at the third), so the preemption lands mid-run however loaded the
# machine is (a fixed pause after each epoch only made that likely, and cost 9 s a run).
SCRIPT = f"""
import os, signal, time
import keras, numpy as np

print("preemptible:", os.environ.get("PORTAL_PREEMPTIBLE"), flush=True)

{_examples("StopBetweenBatches")}

class HoldAfterEpochTwo(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"finished epoch {{epoch + 1}}", flush=True)
        deadline = time.monotonic() + 120
        while epoch == 1 and not stop.asked and time.monotonic() < deadline:
            time.sleep(0.05)

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x.sum(axis=1) > 0).astype("float32")
model = keras.Sequential([keras.Input(shape=(8,)), keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer="adam", loss="binary_crossentropy")
backup = keras.callbacks.BackupAndRestore(os.environ["PORTAL_CHECKPOINT_DIR"], double_checkpoint=True)
stop = StopBetweenBatches()
callbacks = [stop, backup, HoldAfterEpochTwo()]
model.fit(x, y, epochs={EPOCHS}, batch_size=64, verbose=2, callbacks=callbacks)
print("done", flush=True)
""".encode()


@pytest.fixture
def cards(start_worker) -> list[GPU]:
    name = server_names()[0]
    start_worker(None)  # the collector, the reconciler and the scheduler
    start_worker(name, extra_env={"PREEMPT_GRACE_SECONDS": "5"})
    wait_for(lambda: GPU.objects.filter(server__name=name).count() >= 4, timeout=60, what="the cards")
    return list(GPU.objects.filter(server__name=name).order_by("index"))


def test_a_preempted_keras_job_goes_back_to_the_queue_and_resumes_from_its_checkpoint(cards, alice):
    api = APIClient()
    api.force_authenticate(alice)
    response = api.post(
        "/api/v1/jobs/",
        {
            "script": SimpleUploadedFile("fit.py", SCRIPT),
            "gpu_count": 1,
            "time_limit_minutes": 10,
            "preemptible": "true",
        },
        format="multipart",
    )
    assert response.status_code == 201, response.json()
    job_id = response.json()["id"]
    wait_for(lambda: "finished epoch 2" in job_log(job_id), timeout=120, what="two epochs")
    first = Job.objects.get(pk=job_id)
    assert first.status == Job.Status.RUNNING and first.env_applied["PORTAL_PREEMPTIBLE"] == "1"

    assert job_preempt(job=job_id, reason="its cards are wanted back")

    wait_for(lambda: Job.objects.get(pk=job_id).preemptions == 1, timeout=60, what="the job to leave")
    assert Reservation.objects.get(pk=first.reservation_id).released_at is not None
    wait_for(
        lambda: Job.objects.get(pk=job_id).status == Job.Status.SUCCEEDED, timeout=180, what="its second run"
    )

    job = Job.objects.get(pk=job_id)
    log = job_log(job_id)
    assert job.preemptions == 1 and job.exit_code == 0 and job.message == "", log
    assert job.reservation_id != first.reservation_id  # a booking of its own for its second run
    left = log.index("[portal] Preempted: its cards are wanted back.")
    back = log.index("[portal] back from the queue: this job was preempted once")
    assert left < back < log.index("done")
    assert "SIGTERM: stopping before the next batch" in log[left:back], log  # the example's stop, taken
    epochs = [int(n) for n in re.findall(r"Epoch (\d+)/6", log[back:])]
    done_before = max(int(n) for n in re.findall(r"finished epoch (\d+)", log[:back]))  # its first run
    # It resumed after the last epoch it checkpointed, and ran each remaining epoch once.
    assert epochs == list(range(done_before + 1, EPOCHS + 1)), log
    assert log.count("Epoch 1/6") == 1
