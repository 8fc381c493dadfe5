"""A stand-in for PyTorch on the fake GPU machine (fake_gpu.py): what the launcher and the
check's scripts call, allocating against the fake NVML's process list.

`torch.cuda` starts lazily, as PyTorch's does: at the first call that needs the devices, with
CUDA_VISIBLE_DEVICES as it is then, running what `_lazy_call` queued first (the launcher's cap).
"""

from __future__ import annotations

from typing import Any

from torch import cuda

__version__ = "2.99.0+fake"
uint8 = "uint8"


class Tensor:
    def __init__(self, nbytes: int, device: str) -> None:
        self.nbytes, self.device = nbytes, device


def empty(size: int, dtype: Any = None, device: str | None = None) -> Tensor:
    device = device or "cpu"
    if device.startswith("cuda"):
        cuda.allocate(int(device.partition(":")[2] or 0), int(size))
    return Tensor(int(size), device)


__all__ = ["Tensor", "cuda", "empty", "uint8"]
