"""The booking's TensorFlow settings, and the import hook that applies them; part of launcher.py.

Standard library only (TensorFlow is the script's, passed in): the job's interpreter may be any venv.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

from _portal_launch_config import ImportHook, _err, _on_off, settings_hook

# Setters the script may still call after we configured the runtime, and where tf exposes them.
_MEMORY_SETTERS = (
    "set_memory_growth",
    "set_logical_device_configuration",
    "set_virtual_device_configuration",
)
_THREAD_SETTERS = {"set_intra_op_parallelism_threads": "intra_op_threads",
                   "set_inter_op_parallelism_threads": "inter_op_threads"}  # fmt: skip
_CONFIG_NAMESPACES = ("config", "config.experimental", "compat.v1.config", "compat.v1.config.experimental",
                      "compat.v2.config", "compat.v2.config.experimental")  # fmt: skip
_THREADING_NAMESPACES = ("config.threading", "compat.v1.config.threading", "compat.v2.config.threading")


def _resolve(root: Any, dotted: str) -> Any | None:
    obj = root
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part)
        except (AttributeError, ImportError):
            return None
    return obj


def _ignored(name: str, what: str) -> Any:
    def noop(*args: Any, **kwargs: Any) -> None:
        _err(f"ignored {name}(...): the portal already configured {what} for this booking")

    noop.__name__ = noop.__qualname__ = name
    noop.__doc__ = f"Replaced by the portal launcher: {what} is set by the booking."
    return noop


def _freeze_setters(tf: ModuleType, config: dict[str, Any]) -> None:
    """Turn later GPU-memory/threading setter calls into logged no-ops.

    Once the runtime is configured TF raises ("Virtual devices cannot be modified after being
    initialized", "... cannot be modified after initialization") or, for memory growth combined with our
    logical devices, refuses outright; a booking's limits must win anyway.
    """
    for dotted in _CONFIG_NAMESPACES:
        namespace = _resolve(tf, dotted)
        for name in _MEMORY_SETTERS:
            if namespace is not None and hasattr(namespace, name):
                setattr(namespace, name, _ignored(name, "GPU memory"))
    for dotted in _THREADING_NAMESPACES:
        namespace = _resolve(tf, dotted)
        for name, key in _THREAD_SETTERS.items():
            original = getattr(namespace, name, None)
            if original is None:
                continue
            # Threads the booking leaves unset stay the script's choice while TF still accepts them.
            setattr(
                namespace,
                name,
                _ignored(name, "threading") if config[key] is not None else _tolerant(original),
            )


def _tolerant(setter: Any) -> Any:
    @functools.wraps(setter)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return setter(*args, **kwargs)
        except RuntimeError as exc:  # "... cannot be modified after initialization"
            _err(f"ignored {setter.__name__}(...): {exc}")
            return None

    return call


def _merge_session_config(tf: ModuleType, booking: dict[str, Any], script_config: Any) -> Any:
    merged = tf.compat.v1.ConfigProto()
    if script_config is not None:
        merged.CopyFrom(script_config)  # a copy: the caller's object may be reused for other sessions
    gpu = merged.gpu_options
    fraction = booking["memory_fraction"]
    if fraction is not None:
        asked = gpu.per_process_gpu_memory_fraction
        gpu.per_process_gpu_memory_fraction = asked if 0 < asked < fraction else fraction
    gpu.allow_growth = booking["allow_growth"]
    if booking["intra_op_threads"] is not None:
        merged.intra_op_parallelism_threads = booking["intra_op_threads"]
    if booking["inter_op_threads"] is not None:
        merged.inter_op_parallelism_threads = booking["inter_op_threads"]
    merged.allow_soft_placement = booking["soft_placement"]
    merged.log_device_placement = booking["log_placement"] or merged.log_device_placement
    return merged


def _wrap_sessions(tf: ModuleType, booking: dict[str, Any]) -> None:
    """Merge the booking into every tf.compat.v1 Session/InteractiveSession config (TF1-style scripts)."""
    reported = False

    def wrap(init: Any) -> Any:
        # Same signature as TF's (target, graph, config), so positional and keyword calls both work.
        @functools.wraps(init)
        def __init__(self: Any, target: str = "", graph: Any = None, config: Any = None) -> None:
            nonlocal reported
            merged = _merge_session_config(tf, booking, config)
            if not reported:
                reported = True
                gpu, m = merged.gpu_options, merged
                _err(
                    "merged the booking into a tf.compat.v1.Session config: "
                    f"fraction={gpu.per_process_gpu_memory_fraction:g}, allow_growth={gpu.allow_growth}, "
                    f"intra={m.intra_op_parallelism_threads}, inter={m.inter_op_parallelism_threads}, "
                    f"soft_placement={m.allow_soft_placement}, log_placement={m.log_device_placement}"
                )
            init(self, target, graph, merged)

        __init__._portal_wrapped = True  # type: ignore[attr-defined]
        return __init__

    v1 = _resolve(tf, "compat.v1")
    # InteractiveSession derives from BaseSession, not Session: wrap both, neither calls the other's __init__.
    for name in ("Session", "InteractiveSession"):
        cls = getattr(v1, name, None) if v1 is not None else None
        if cls is not None and not getattr(cls.__init__, "_portal_wrapped", False):
            cls.__init__ = wrap(cls.__init__)


def apply_tensorflow(tf: ModuleType, config: dict[str, Any]) -> str:
    """Configure the TF runtime for the booking; return the summary for the launcher line.

    Must run before the script's first op: virtual devices and threads are fixed once the runtime starts.
    """
    problems: list[str] = []
    gpus = tf.config.list_physical_devices("GPU")
    mb = config["memory_limit_mb"]
    if mb is not None:
        set_logical = getattr(tf.config, "set_logical_device_configuration", None) or (
            tf.config.experimental.set_virtual_device_configuration
        )
        device_config = getattr(tf.config, "LogicalDeviceConfiguration", None) or (
            tf.config.experimental.VirtualDeviceConfiguration
        )
        # No set_memory_growth here: TF refuses it together with virtual devices; growth comes from
        # TF_FORCE_GPU_ALLOW_GROWTH, which the worker sets.
        for gpu in gpus:
            try:
                set_logical(gpu, [device_config(memory_limit=mb)])
            except Exception as exc:
                problems.append(f"memory_limit on {gpu.name}: {exc}")
    threading = tf.config.threading
    for key, setter in (("intra_op_threads", threading.set_intra_op_parallelism_threads),
                        ("inter_op_threads", threading.set_inter_op_parallelism_threads)):  # fmt: skip
        if config[key] is not None:
            try:
                setter(config[key])
            except Exception as exc:
                problems.append(f"{key}: {exc}")
    tf.config.set_soft_device_placement(config["soft_placement"])
    tf.debugging.set_log_device_placement(config["log_placement"])
    strategy = "MirroredStrategy off"
    if config["mirrored"]:
        # Last: creating the strategy starts the runtime.
        try:
            mirrored = tf.distribute.MirroredStrategy()
            tf.distribute.experimental_set_strategy(mirrored)
            strategy = f"MirroredStrategy on ({mirrored.num_replicas_in_sync} replicas)"
        except Exception as exc:
            problems.append(f"MirroredStrategy: {exc}")
            strategy = "MirroredStrategy FAILED"
    _freeze_setters(tf, config)
    _wrap_sessions(tf, config)
    for problem in problems:
        _err(f"could not apply {problem}")

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    threads = " / ".join(
        f"{label} {config[key] if config[key] is not None else 'default'}"
        for label, key in (("intra", "intra_op_threads"), ("inter", "inter_op_threads"))
    )
    return " · ".join(
        [
            f"TensorFlow {tf.__version__}",
            f"GPUs visible: {len(gpus)} "
            + (
                f"(CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "(CUDA_VISIBLE_DEVICES unset)"
            ),
            f"memory_limit {mb} MiB per GPU" if mb is not None else "memory_limit none",
            f"allow_growth {_on_off(config['allow_growth'])}",
            f"threads {threads}",
            f"soft placement {_on_off(config['soft_placement'])}",
            f"log placement {_on_off(config['log_placement'])}",
            strategy,
        ]
        + (["NOT APPLIED: " + "; ".join(problems)] if problems else [])
    )


def tensorflow_import_hook(config: dict[str, Any]) -> ImportHook:
    """Applies the settings right after an indirect ``import tensorflow``."""
    when = "applied when TensorFlow was imported indirectly"
    return settings_hook("tensorflow", "TensorFlow", apply_tensorflow, config, when)
