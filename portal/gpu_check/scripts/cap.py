"""Allocate past the booking's share with one framework, 256 MiB at a time: `cap.py torch 10240`.

Prints one `[gpu-check] {json}` line: how much was allocated before the framework refused, and
its error; then holds the memory 2 s, so that NVML's samples see the peak.
"""

import json
import os
import sys
import time

MIB = 2**20
STEP_MIB = 256


def allocator(framework):
    if framework == "torch":
        import torch

        return lambda: torch.empty(STEP_MIB * MIB, dtype=torch.uint8, device="cuda:0")
    if framework == "jax":
        import jax.numpy as jnp

        return lambda: jnp.ones((STEP_MIB * MIB,), dtype=jnp.uint8).block_until_ready()
    import tensorflow as tf

    def allocate():
        with tf.device("/GPU:0"):
            return tf.ones((STEP_MIB * MIB,), dtype=tf.uint8)

    return allocate


allocate, held, error = allocator(sys.argv[1]), [], None
try:
    while len(held) * STEP_MIB < int(sys.argv[2]):
        held.append(allocate())
except Exception as exc:  # each framework's own out-of-memory error
    error = f"{type(exc).__name__}: {exc}"[:400]
time.sleep(2)
print(
    "[gpu-check] " + json.dumps({"pid": os.getpid(), "allocated_mib": len(held) * STEP_MIB, "error": error}),
    flush=True,
)
