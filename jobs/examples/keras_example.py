"""Small Keras 3 example job: binary classification on synthetic data, a few seconds on a CPU.

Run it through the portal (the launcher applies the booking's GPU settings first) or directly:
    python keras_example.py --epochs 3

Submitted preemptible (`gpu run --preemptible`), it may be stopped at any time and started again
later, on other cards: the portal then sets PORTAL_CHECKPOINT_DIR, a folder kept across its runs,
and keras.callbacks.BackupAndRestore keeps the training's state there after every epoch, so a
run that comes back resumes at the epoch after the last one it finished.
"""

import argparse
import os

import keras
import numpy as np
import tensorflow as tf


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
        # restored by fit() when the job runs again (deleted once the training completes).
        callbacks.append(keras.callbacks.BackupAndRestore(checkpoints))
    # verbose=2: one line per epoch, readable in a log file (no progress bar redraws).
    model.fit(x, y, epochs=args.epochs, batch_size=64, validation_split=0.2, verbose=2, callbacks=callbacks)
    _, accuracy = model.evaluate(x, y, verbose=0)
    print(f"done: accuracy={accuracy:.2f}", flush=True)


if __name__ == "__main__":
    main()
