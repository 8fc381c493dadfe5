"""The booking's PyTorch memory cap, and the import hook that applies it; part of launcher.py.

Standard library only (PyTorch is the script's, passed in): the job's interpreter may be any venv.

PyTorch reads no cap from the environment that every release accepts: ``per_process_memory_fraction`` in
PYTORCH_CUDA_ALLOC_CONF came with pytorch/pytorch#161035 (2025), and the releases before it stop at the
first CUDA allocation on a key they do not know ("Unrecognized CachingAllocator option"). So the launcher
calls ``torch.cuda.set_per_process_memory_fraction`` (PyTorch 1.8+) for every visible card, queued with
``torch.cuda._lazy_call`` to run when CUDA starts, as ``torch.cuda.manual_seed`` is: importing torch starts
no CUDA, and a script may still narrow CUDA_VISIBLE_DEVICES after ``import torch``.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from _portal_launch_config import ImportHook, _err, settings_hook

SETTER = "set_per_process_memory_fraction"


def _capped(setter: Any, booked: float) -> Any:
    """The script's own ``set_per_process_memory_fraction``: never more than booked, as for TF1 sessions."""
    reported = False

    @functools.wraps(setter)
    def set_per_process_memory_fraction(fraction: Any, device: Any = None) -> Any:
        nonlocal reported
        # Anything that is no number goes through unchanged: PyTorch says what is wrong with it.
        if isinstance(fraction, int | float) and not isinstance(fraction, bool) and fraction > booked:
            if not reported:
                reported = True
                _err(f"{SETTER}({fraction:g}) asked by the script → {booked:g}, the booking's share")
            fraction = booked
        return setter(fraction, device)

    return set_per_process_memory_fraction


def apply_torch(torch: ModuleType, config: dict[str, Any]) -> str:
    """Cap PyTorch's caching allocator on every visible card from CUDA's start; return the summary.

    Also caps the script's own later calls of the setter at the booking.
    """
    version = f"PyTorch {getattr(torch, '__version__', '?')}"
    fraction = config["memory_fraction"]
    if fraction is None:
        return f"{version} · no memory cap (the card is the booking's)"
    cuda = getattr(torch, "cuda", None)
    setter = getattr(cuda, SETTER, None)
    if setter is None:
        return f"{version} · NOT APPLIED: this PyTorch has no torch.cuda.{SETTER}"

    def cap() -> None:
        # Runs inside torch.cuda's lazy init, whose caller is the script's first CUDA call: never raise there.
        try:
            count = cuda.device_count()
            for device in range(count):
                setter(fraction, device)
        except Exception as exc:
            _err(f"could not cap PyTorch's GPU memory: {type(exc).__name__}: {exc}")
            return
        _err(f"{version}: memory fraction {fraction:g} on {count} GPU{'s' if count != 1 else ''} ({SETTER})")

    capped = _capped(setter, fraction)
    for namespace in (cuda, getattr(cuda, "memory", None)):
        if getattr(namespace, SETTER, None) is setter:
            setattr(namespace, SETTER, capped)
    lazy_call = getattr(cuda, "_lazy_call", None)
    if lazy_call is None:  # a PyTorch without it (none we know of): cap now, which starts CUDA
        cap()
        return f"{version} · memory fraction {fraction:g} per GPU (applied at import)"
    lazy_call(cap)
    return f"{version} · memory fraction {fraction:g} per GPU when CUDA starts"


def torch_import_hook(config: dict[str, Any]) -> ImportHook:
    """Applies the cap right after ``import torch``, by the script or by anything it imports."""
    return settings_hook("torch", "PyTorch", apply_torch, config, "applied when PyTorch was imported")
