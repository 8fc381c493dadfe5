"""torch.cuda on the fake GPU machine (see torch/__init__.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import fake_gpu


class OutOfMemoryError(RuntimeError):
    pass


_device = fake_gpu.Device(
    OutOfMemoryError,
    "CUDA out of memory. Tried to allocate {mib:.2f} MiB. Of the allowed {limit} bytes,"
    " {held} are allocated.",
)
_queued: list[Callable[[], None]] = []


def _lazy_call(fn: Callable[[], None]) -> None:
    if _device.cards is None:
        _queued.append(fn)
    else:
        fn()


def init() -> None:
    if _device.cards is None:
        _device.start(os.environ.get("CUDA_VISIBLE_DEVICES"))
        while _queued:
            _queued.pop(0)()


def device_count() -> int:
    # As PyTorch's: it starts no CUDA, and reads CUDA_VISIBLE_DEVICES until CUDA has started.
    if _device.cards is not None:
        return len(_device.cards)
    return len(fake_gpu.visible(os.environ.get("CUDA_VISIBLE_DEVICES")))


def is_available() -> bool:
    return device_count() > 0


def set_per_process_memory_fraction(fraction: float, device: int | None = None) -> None:
    init()
    _device.cap(device or 0, fraction)


@dataclass
class _Properties:
    name: str
    total_memory: int
    uuid: str  # PyTorch's prints without the "GPU-" of nvidia-smi


def get_device_properties(index: int) -> _Properties:
    init()
    assert _device.cards is not None
    card = _device.cards[index]
    return _Properties(
        card["name"], card["memory_total_mib"] * fake_gpu.MIB, card["uuid"].removeprefix("GPU-")
    )


def allocate(index: int, nbytes: int) -> None:
    init()
    _device.allocate(index, nbytes)


def synchronize() -> None:
    init()
