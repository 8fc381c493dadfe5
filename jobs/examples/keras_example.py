"""Small Keras 3 example job: binary classification on synthetic data, a few seconds on a CPU.

Run it through the portal (the launcher applies the booking's GPU settings first) or directly:
    python keras_example.py --epochs 3

Submitted preemptible (`gpu run --preemptible`), it may be stopped at any time and started again
later, on other cards: the portal then sets PORTAL_CHECKPOINT_DIR, a folder kept across its runs,
and keras.callbacks.BackupAndRestore keeps the training's state there after every epoch, so a
run that comes back resumes at the epoch after the last one it finished. The stop comes as SIGTERM
(SIGKILL only after the grace): it is taken between batches, never in the middle of writing a
checkpoint, so the one the next run resumes from is whole.
"""

import argparse
import os
import signal

import keras
import numpy as np
import tensorflow as tf


class StopBetweenBatches(keras.callbacks.Callback):
    """SIGTERM (the portal preempting or cancelling the job) noted, and acted on before the next
    batch: Python's default would end the process wherever it is, in the middle of writing the
    checkpoint too, and the next run would find it cut short."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = False
        signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.asked = True

    def _stop_if_asked(self) -> None:
        if self.asked:
            print("SIGTERM: stopping before the next batch; the last checkpoint is whole", flush=True)
            raise SystemExit(128 + signal.SIGTERM)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._stop_if_asked()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._stop_if_asked()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    print("CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", ""), flush=True)
    print(f"visible GPUs: {tf.config.list_physical_devices('GPU')}", flush=True)
    print(f"keras {keras.__version__}", flush=True)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 20)).astype("float32")
    weights = rng.normal(size=(20,))
    y = (x @ weights > 0).astype("float32")

    model = keras.Sequential(
        [
            keras.Input(shape=(20,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    callbacks = []
    if checkpoints := os.environ.get("PORTAL_CHECKPOINT_DIR"):
        # Preemptible: the model, the optimizer and the epoch reached, saved after every epoch and
        # restored by fit() when the job runs again (deleted once the training completes). The
        # previous checkpoint is kept beside it (double_checkpoint), should a SIGKILL still cut
        # a write short.
        callbacks.append(StopBetweenBatches())
        callbacks.append(keras.callbacks.BackupAndRestore(checkpoints, double_checkpoint=True))
    # verbose=2: one line per epoch, readable in a log file (no progress bar redraws).
    model.fit(x, y, epochs=args.epochs, batch_size=64, validation_split=0.2, verbose=2, callbacks=callbacks)
    _, accuracy = model.evaluate(x, y, verbose=0)
    print(f"done: accuracy={accuracy:.2f}", flush=True)


if __name__ == "__main__":
    main()
