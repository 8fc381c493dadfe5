"""Small Keras 3 example job: binary classification on synthetic data, a few seconds on a CPU.

Run it through the portal (the launcher applies the booking's GPU settings first) or directly:
    python keras_example.py --epochs 3
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
    # verbose=2: one line per epoch, readable in a log file (no progress bar redraws).
    model.fit(x, y, epochs=args.epochs, batch_size=64, validation_split=0.2, verbose=2)
    _, accuracy = model.evaluate(x, y, verbose=0)
    print(f"done: accuracy={accuracy:.2f}", flush=True)


if __name__ == "__main__":
    main()
