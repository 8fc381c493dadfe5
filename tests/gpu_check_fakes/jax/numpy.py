"""jax.numpy on the fake GPU machine: arrays on the first visible card."""

from __future__ import annotations

from typing import Any

import jax

uint8 = "uint8"


class Array:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def block_until_ready(self) -> Array:
        return self


def ones(shape: Any, dtype: Any = None) -> Array:
    nbytes = 1
    for size in shape if isinstance(shape, tuple) else (shape,):
        nbytes *= int(size)
    jax._start()
    jax._device.allocate(0, nbytes)
    return Array(nbytes)
