"""Job launcher: applies a booking's TensorFlow settings, then runs the user's script as ``__main__``.

The worker runs this file directly with the job's own interpreter (which may be another venv or conda env
without this project on ``sys.path``)::

    <interpreter> -u /abs/path/jobs/launcher-bin/launcher.py <script.py> [args...]

so it imports nothing from the project and only the standard library at import time. TensorFlow is imported
only when the script imports it (found with ``ast``); otherwise a ``sys.meta_path`` hook applies the settings
if TensorFlow is imported indirectly later. The configuration comes as JSON in ``PORTAL_LAUNCH_CONFIG``
(see ``DEFAULTS``); a missing or invalid value exits with code 2.

Python puts this file's folder first on ``sys.path``. That folder is not a package (its name is not even
an identifier) and holds nothing but this file, so no project module can shadow the standard library's or
the user's; before TensorFlow is imported and the script runs, the script's own folder takes that first
place, as with ``python script.py``.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import runpy
import sys
from types import ModuleType, TracebackType
from typing import Any

CONFIG_VAR = "PORTAL_LAUNCH_CONFIG"
PREFIX = "[portal]"
TF_ROOTS = frozenset({"tensorflow", "keras"})

DEFAULTS: dict[str, Any] = {
    "job_id": None,
    "memory_limit_mb": None,
    "allow_growth": True,
    "memory_fraction": None,
    "intra_op_threads": None,
    "inter_op_threads": None,
    "soft_placement": True,
    "log_placement": False,
    "mirrored": False,
}
_BOOL_KEYS = ("allow_growth", "soft_placement", "log_placement", "mirrored")
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


class LaunchError(Exception):
    """A problem with how the launcher was called: reported on stderr, exit code 2."""


def _err(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


def _say(message: str) -> None:
    print(f"{PREFIX} launcher: {message}", flush=True)


# --------------------------------------------------------------------------------------------------------
# Configuration


def load_config(raw: str | None) -> dict[str, Any]:
    """Parse and check PORTAL_LAUNCH_CONFIG; missing keys take DEFAULTS."""
    if raw is None or not raw.strip():
        raise LaunchError(f"{CONFIG_VAR} is not set: the worker passes the booking's settings in it as JSON")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise LaunchError(f"{CONFIG_VAR} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise LaunchError(f"{CONFIG_VAR} must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(DEFAULTS))
    if unknown:
        _err(f"{CONFIG_VAR}: ignoring unknown keys {', '.join(unknown)}")
    config = {**DEFAULTS, **{k: v for k, v in data.items() if k in DEFAULTS}}

    def bad(key: str, wanted: str) -> LaunchError:
        return LaunchError(f"{CONFIG_VAR}: {key} must be {wanted}, got {config[key]!r}")

    # bool is an int subclass: reject it explicitly where a number is meant.
    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if config["job_id"] is not None and not is_int(config["job_id"]):
        raise bad("job_id", "an integer")
    for key in _BOOL_KEYS:
        if not isinstance(config[key], bool):
            raise bad(key, "true or false")
    mb = config["memory_limit_mb"]
    if mb is not None and not (is_int(mb) and mb > 0):
        raise bad("memory_limit_mb", "a positive integer or null")
    fraction = config["memory_fraction"]
    if fraction is not None:
        if not (isinstance(fraction, int | float) and not isinstance(fraction, bool) and 0 < fraction <= 1):
            raise bad("memory_fraction", "a number in (0, 1] or null")
        config["memory_fraction"] = float(fraction)
    for key in ("intra_op_threads", "inter_op_threads"):
        if config[key] is not None and not (is_int(config[key]) and config[key] >= 0):
            raise bad(key, "a non-negative integer or null")
    return config


def uses_tensorflow(source: bytes) -> bool:
    """True when the script imports tensorflow or keras anywhere (functions included)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False  # runpy reports the SyntaxError itself, with the normal traceback
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        if any(module.split(".")[0] in TF_ROOTS for module in modules):
            return True
    return False


def _env_summary() -> str:
    parts = []
    for name in ("CUDA_VISIBLE_DEVICES", "TF_FORCE_GPU_ALLOW_GROWTH"):
        value = os.environ.get(name)
        parts.append(f"{name}={value}" if value is not None else f"{name} unset")
    return ", ".join(parts)


def _on_off(value: bool) -> str:
    return "on" if value else "off"


# --------------------------------------------------------------------------------------------------------
# TensorFlow


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
            f"memory_limit {mb} MB per GPU" if mb is not None else "memory_limit none",
            f"allow_growth {_on_off(config['allow_growth'])}",
            f"threads {threads}",
            f"soft placement {_on_off(config['soft_placement'])}",
            f"log placement {_on_off(config['log_placement'])}",
            strategy,
        ]
        + (["NOT APPLIED: " + "; ".join(problems)] if problems else [])
    )


class TensorFlowImportHook:
    """Meta path finder: applies the settings right after an indirect ``import tensorflow`` completes."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "tensorflow":
            return None
        # Ask the finders after us directly (no importlib.util.find_spec: it would come back here).
        spec = None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_apply(module: ModuleType) -> None:
            exec_module(module)
            # Only now, not in find_spec: availability checks (importlib.util.find_spec) import nothing.
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                summary = apply_tensorflow(module, self.config)
            except Exception as exc:  # never break the user's import over our settings
                _err(f"could not apply the booking's TensorFlow settings: {type(exc).__name__}: {exc}")
                return
            _say(f"job {_job(self.config)} · {summary} · applied when TensorFlow was imported indirectly")

        # Each find_spec builds a fresh loader, so patching this one touches only this import.
        loader.exec_module = exec_then_apply
        return spec


def _job(config: dict[str, Any]) -> str:
    return str(config["job_id"]) if config["job_id"] is not None else "?"


# --------------------------------------------------------------------------------------------------------
# Running the script


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Drop the launcher's and runpy's frames so the traceback reads like ``python script.py``."""
    # runpy is frozen since 3.11: its frames are named "<frozen runpy>".
    own = {os.path.realpath(__file__), os.path.realpath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in own or os.path.realpath(tb.tb_frame.f_code.co_filename) in own
    ):
        tb = tb.tb_next
    return tb


def prepare(argv: list[str]) -> tuple[dict[str, Any], str]:
    if not argv:
        raise LaunchError("usage: launcher.py <script.py> [args...]")
    config = load_config(os.environ.get(CONFIG_VAR))
    script = argv[0]
    if not os.path.isfile(script):
        raise LaunchError(f"script not found: {script} (cwd {os.getcwd()})")
    return config, script


def _put_script_first_on_path(script: str) -> None:
    """The sys.path of `python script.py`: the script's (symlink-resolved) folder where Python put ours."""
    if sys.flags.safe_path:  # -P, -I or PYTHONSAFEPATH: Python added neither folder
        return
    here = os.path.dirname(os.path.realpath(__file__))
    folder = os.path.dirname(os.path.realpath(script))
    if sys.path and os.path.realpath(sys.path[0] or os.curdir) == here:
        sys.path[0] = folder
    else:  # started some other way (imported, -m): keep what is there
        sys.path.insert(0, folder)


def main(argv: list[str]) -> int:
    try:
        config, script = prepare(argv)
    except LaunchError as exc:
        _err(str(exc))
        return 2
    os.environ.pop(CONFIG_VAR, None)  # the script's own subprocesses must not think they are launched
    job = _job(config)
    with open(script, "rb") as fh:
        source = fh.read()
    # Before TensorFlow is imported: its import must find what `python script.py` would find
    # (a sibling module of the script shadows an installed one, for TF's imports too).
    _put_script_first_on_path(script)
    sys.argv = [script, *argv[1:]]

    env = _env_summary()
    if uses_tensorflow(source):
        try:
            import tensorflow as tf
        except ImportError:
            _say(
                f"job {job} · TensorFlow is not installed in this interpreter ({sys.executable}): "
                f"settings via environment only ({env})"
            )
        else:
            _say(f"job {job} · {apply_tensorflow(tf, config)}")
    else:
        _say(f"job {job} · no TensorFlow import in the script: settings via environment only ({env})")
        if "tensorflow" not in sys.modules:
            sys.meta_path.insert(0, TensorFlowImportHook(config))

    try:
        # The path as given, not made absolute: run_path sets sys.argv[0] to it (so __file__ is relative
        # when the worker passes a relative path, unlike `python script.py` since 3.9).
        runpy.run_path(script, run_name="__main__")
    except Exception as exc:
        # SystemExit and KeyboardInterrupt are no Exceptions: they propagate and Python handles them as usual.
        tb = _user_traceback(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the hook may read either
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
