"""A stand-in for JAX on the fake GPU machine (fake_gpu.py): XLA's BFC allocator grows up to
XLA_PYTHON_CLIENT_MEM_FRACTION of each card (0.75 unset), and past it an allocation fails with
RESOURCE_EXHAUSTED, as jaxlib's does."""

from __future__ import annotations

import os
from dataclasses import dataclass

import fake_gpu

from jax import errors

__version__ = "0.99.0+fake"

_device = fake_gpu.Device(
    errors.JaxRuntimeError, "RESOURCE_EXHAUSTED: Out of memory while trying to allocate {nbytes} bytes."
)


@dataclass
class GpuDevice:
    id: int
    platform: str = "gpu"


def _start() -> None:
    if _device.cards is None:
        _device.start(os.environ.get("CUDA_VISIBLE_DEVICES"))
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
        for index in range(len(_device.cards or [])):
            _device.cap(index, fraction)


def devices() -> list[GpuDevice]:
    _start()
    return [GpuDevice(index) for index in range(len(_device.cards or []))]


from jax import numpy  # noqa: E402  (it allocates through _device)

__all__ = ["devices", "errors", "numpy"]
