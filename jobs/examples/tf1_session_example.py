"""Legacy TF1-style job: builds its own ConfigProto and opens tf.compat.v1.Session objects.

Under the portal launcher the booking is merged into that config; each session prints the config it
actually holds as one parseable line: SESSION_CONFIG {...json...}.
    python tf1_session_example.py [fraction ...]   # one session per fraction, default 0.9
"""

import json
import sys

import tensorflow as tf


def open_session(fraction: float) -> None:
    config = tf.compat.v1.ConfigProto()
    config.gpu_options.per_process_gpu_memory_fraction = fraction
    config.gpu_options.allow_growth = False
    config.intra_op_parallelism_threads = 16
    with tf.Graph().as_default():
        total = tf.constant([1.0, 2.0, 3.0]) * 2.0
        with tf.compat.v1.Session(config=config) as sess:
            value = sess.run(tf.reduce_sum(total))
            held = sess._config  # the ConfigProto the session was really created with
    print(
        "SESSION_CONFIG "
        + json.dumps(
            {
                "asked_fraction": fraction,
                "fraction": round(held.gpu_options.per_process_gpu_memory_fraction, 6),
                "allow_growth": held.gpu_options.allow_growth,
                "intra": held.intra_op_parallelism_threads,
                "inter": held.inter_op_parallelism_threads,
                "soft": held.allow_soft_placement,
                "log": held.log_device_placement,
                "script_fraction": round(config.gpu_options.per_process_gpu_memory_fraction, 6),
                "result": float(value),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["0.9"]:
        open_session(float(arg))
