"""Job launcher: applies a booking's TensorFlow settings, then runs the user's script as ``__main__``.

The worker runs this file directly with the job's own interpreter (which may be another venv or conda env
without this project on ``sys.path``)::

    <interpreter> -u /abs/path/jobs/launcher-bin/launcher.py <script.py> [args...]

so it imports nothing from the project and only the standard library at import time. TensorFlow is imported
only when the script imports it (found with ``ast``); otherwise a ``sys.meta_path`` hook applies the settings
if TensorFlow is imported indirectly later. The configuration comes as JSON in ``PORTAL_LAUNCH_CONFIG``
(see ``DEFAULTS``); a missing or invalid value exits with code 2. Whatever the script then sets
``CUDA_VISIBLE_DEVICES`` to, it stays on the booked cards the worker put there (see ``CudaDevices``).
When the script imports Keras, every ``fit()`` also reports its metrics for the job's page, as
``[portal-metrics] {json}`` lines (see ``MetricsReporter``).

Python puts this file's folder first on ``sys.path``. That folder is not a package (its name is not even
an identifier) and holds nothing but this file, so no project module can shadow the standard library's or
the user's; before TensorFlow is imported and the script runs, the script's own folder takes that first
place, as with ``python script.py``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import math
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable
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
# The booked cards

CUDA_VAR = "CUDA_VISIBLE_DEVICES"
_CUDA_KEY = os.fsencode(CUDA_VAR)  # how os.environ and os.environb both hold it (POSIX)
NO_GPU = "-1"


class CudaDevices:
    """Keeps CUDA_VISIBLE_DEVICES on the booked cards, whatever the script sets it to.

    The worker sets it to the booked cards' UUIDs, in booking order. Old tutorials set it to the host's
    indices at the top of the script (``os.environ["CUDA_VISIBLE_DEVICES"] = "2"``), which would put the
    job on somebody else's card. Here an index counts the booked cards, a name must be a booked card's,
    anything else is dropped, and unsetting the variable (every card of the host) gives the booking back.
    """

    def __init__(self, booked: list[str]) -> None:
        self.booked = booked
        self._reported: set[str | None] = set()

    def resolve(self, asked: str | None) -> str:
        """The value for what the script asked; None: it unset the variable.

        A value it returns maps to itself: os.environ's assignment maps, then calls os.putenv, which maps
        again.
        """
        if asked is None:
            return ",".join(self.booked)
        cards = (self._booked_card(entry.strip()) for entry in asked.split(","))
        kept = ",".join(dict.fromkeys(card for card in cards if card is not None))
        # No card left means no GPU, as "-1" and "" say; an empty value stays empty in the script's eyes.
        return kept or ("" if not asked.strip() else NO_GPU)

    def _booked_card(self, entry: str) -> str | None:
        if entry in self.booked:
            return entry
        try:
            index = int(entry)
        except ValueError:
            # CUDA also takes a unique prefix of a UUID. A MIG device's id does not say its card: dropped.
            named = [card for card in self.booked if entry and card.startswith(entry)]
            return named[0] if len(named) == 1 else None
        return self.booked[index] if 0 <= index < len(self.booked) else None

    def assign(self, asked: str | None) -> str:
        """resolve(), with a [portal] line in the job's log for each distinct value the script asks for."""
        got = self.resolve(asked)
        if asked not in self._reported:
            self._reported.add(asked)
            _err(self._describe(asked, got))
        return got

    def _describe(self, asked: str | None, got: str) -> str:
        indices = [str(self.booked.index(card)) for card in got.split(",") if card in self.booked]
        what = f"booked card{'s' if len(indices) > 1 else ''} {', '.join(indices)}" if indices else "no GPU"
        if asked is None:
            return (
                f'{CUDA_VAR} unset by the script → "{got}" ({what}); '
                "unset, it would mean every card of the host"
            )
        count = f"{len(self.booked)} booked card{'s' if len(self.booked) != 1 else ''}"
        return (
            f'{CUDA_VAR}="{asked}" asked by the script → "{got}" ({what}); '
            f"indices count the {count} only, other cards are dropped"
        )


def _names_cuda(name: Any) -> bool:
    try:
        return os.fsencode(name) == _CUDA_KEY
    except TypeError:
        return False  # the real call reports the wrong type


def _guarded_environ(devices: CudaDevices) -> type:
    class GuardedEnviron(os._Environ):
        """os.environ (and os.environb, which shares its data) with CUDA_VISIBLE_DEVICES on the booking."""

        def __setitem__(self, key: Any, value: Any) -> None:
            if self.encodekey(key) == _CUDA_KEY:
                value = self.decodevalue(os.fsencode(devices.assign(os.fsdecode(self.encodevalue(value)))))
            super().__setitem__(key, value)

        def __delitem__(self, key: Any) -> None:
            if self.encodekey(key) != _CUDA_KEY:
                super().__delitem__(key)
                return
            # pop() comes here too. The variable stays: unset, it would mean every card of the host.
            super().__setitem__(key, self.decodevalue(os.fsencode(devices.assign(None))))

        def clear(self) -> None:
            # MutableMapping.clear() pops until the mapping is empty, and this one never is.
            for key in list(self):
                del self[key]

    return GuardedEnviron


def guard_cuda_devices() -> None:
    """Route every change the script makes to CUDA_VISIBLE_DEVICES through CudaDevices, before it runs.

    os.environ (item assignment, update, setdefault, del, pop, clear) and os.putenv / os.unsetenv: the
    value is mapped on its way into the process environment, so what frameworks read with getenv() when
    CUDA starts (PyTorch, JAX) and what child processes inherit is the booking too, not only os.environ.
    """
    booked = os.environ.get(CUDA_VAR)
    if booked is None:  # not started by a worker: no booking to keep
        return
    devices = CudaDevices([card.strip() for card in booked.split(",") if card.strip()])
    real_putenv, real_unsetenv = os.putenv, os.unsetenv

    @functools.wraps(real_putenv)
    def putenv(name: Any, value: Any) -> None:
        if _names_cuda(name):
            asked = os.fsdecode(value)
            # os.environ calls this with the value it has just mapped: that goes through without a line.
            value = asked if devices.resolve(asked) == asked else devices.assign(asked)
        real_putenv(name, value)

    @functools.wraps(real_unsetenv)
    def unsetenv(name: Any) -> None:
        if _names_cuda(name):
            real_putenv(name, devices.assign(None))
        else:
            real_unsetenv(name)

    guarded = _guarded_environ(devices)
    os.environ.__class__ = guarded
    if os.supports_bytes_environ:
        os.environb.__class__ = guarded
    # os._Environ calls these module globals, so they map os.environ's changes as well.
    os.putenv, os.unsetenv = putenv, unsetenv


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
            f"memory_limit {mb} MiB per GPU" if mb is not None else "memory_limit none",
            f"allow_growth {_on_off(config['allow_growth'])}",
            f"threads {threads}",
            f"soft placement {_on_off(config['soft_placement'])}",
            f"log placement {_on_off(config['log_placement'])}",
            strategy,
        ]
        + (["NOT APPLIED: " + "; ".join(problems)] if problems else [])
    )


class ImportHook:
    """Meta path finder: calls ``then(module)`` right after ``import <name>`` completes, once."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
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

        def exec_then(module: ModuleType) -> None:
            exec_module(module)
            # Only now, not in find_spec: availability checks (importlib.util.find_spec) import nothing.
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self.then(module)

        # Each find_spec builds a fresh loader, so patching this one touches only this import.
        loader.exec_module = exec_then
        return spec


def tensorflow_import_hook(config: dict[str, Any]) -> ImportHook:
    """Applies the settings right after an indirect ``import tensorflow``."""

    def apply(tf: ModuleType) -> None:
        try:
            summary = apply_tensorflow(tf, config)
        except Exception as exc:  # never break the user's import over our settings
            _err(f"could not apply the booking's TensorFlow settings: {type(exc).__name__}: {exc}")
            return
        _say(f"job {_job(config)} · {summary} · applied when TensorFlow was imported indirectly")

    return ImportHook("tensorflow", apply)


def _job(config: dict[str, Any]) -> str:
    return str(config["job_id"]) if config["job_id"] is not None else "?"


# --------------------------------------------------------------------------------------------------------
# Training curves

METRICS_PREFIX = "[portal-metrics]"  # jobs/metrics.py looks for the same
KERAS_MODULES = ("keras", "tf_keras")  # Keras 3, and Keras 2 where TF_USE_LEGACY_KERAS brings it back
BATCH_SECONDS = 1.0  # at most one batch record a second ...
# ... and at most one batch record per 1/BATCH_SPREAD of the training time so far: a 3-day run still has
# batch records from start to end, about BATCH_SPREAD · (1 + ln(T / 83 min)) of them (25,000).
BATCH_SPREAD = 5000
MAX_METRICS = 32  # per record; jobs/metrics.py stores no more
MAX_NAME = 64
# PIPE_BUF: one os.write() of at most this much to a pipe is atomic, so a record is never torn apart by
# output that another thread of the job writes at the same moment.
MAX_RECORD_BYTES = 4096
_RESERVED = frozenset({"kind", "epoch", "step", "seq", "at"})  # the record's own keys, never metrics


def _number(value: Any) -> float | None:
    """A metric as a JSON-safe number: NaN and ±inf (a diverged loss) become null; ValueError/TypeError
    for what is no scalar (a tensor of many values), which is left out."""
    number = float(value)  # Python and numpy numbers, scalar tensors and Keras variables all convert
    return number if math.isfinite(number) else None


def _learning_rate(model: Any) -> float | None:
    """The optimizer's current learning rate: a variable, a tensor, or a schedule Keras 2 leaves uncalled."""
    try:
        optimizer = model.optimizer
        value = optimizer.learning_rate
        if callable(value) and not hasattr(value, "dtype"):
            value = value(optimizer.iterations)
        return _number(value)
    except Exception:  # no optimizer, a custom one, a schedule that wants more: no learning rate
        return None


def _reporting(method: Callable[..., None]) -> Callable[..., None]:
    """Never raise into the user's training: the first failure turns the records off, with a line."""

    @functools.wraps(method)
    def call(self: MetricsReporter, *args: Any) -> None:
        if self.off:
            return
        try:
            method(self, *args)
        except Exception as exc:
            self.off = True
            _err(f"training curves stopped: {type(exc).__name__}: {exc}")

    return call


class MetricsReporter:
    """Writes Keras's training metrics as ``[portal-metrics] {json}`` lines: the job's training curves.

    An epoch record holds the epoch's logs (loss, the compiled metrics, their ``val_*``) and the learning
    rate; a batch record the running logs of the epoch, at most one a BATCH_SECONDS. ``epoch`` counts
    from 1, as "Epoch 3/10" in the log; ``step`` counts training batches over every fit() of the
    process, so the records of a second fit() follow the first's on one axis.

    The worker reads the job's stdout and stderr as one pipe, takes these lines out of the log and stores
    them (jobs/metrics.py). They go to a duplicate of the job's stdout made before the script ran, one
    os.write each: a script that redirects sys.stdout or fd 1 still has its curves, and no record waits
    in a buffer. One instance per process; Keras may call it from a thread of its own (batch ends).
    """

    def __init__(self, fd: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.fd = fd
        self.clock = clock
        self.lock = threading.Lock()
        self.off = False
        self.epoch: int | None = None
        self.steps_done = 0  # batches of the finished epochs, of every fit() so far
        self.epoch_steps = 0  # batches into the current epoch
        self.first_batch_at: float | None = None
        self.last_batch_at: float | None = None

    @_reporting
    def epoch_begin(self, epoch: int) -> None:
        with self.lock:
            self.epoch = int(epoch) + 1
            self.epoch_steps = 0

    @_reporting
    def batch_end(self, batch: int, logs: dict[str, Any] | None) -> None:
        with self.lock:
            # Keras passes the last batch of the call (steps_per_execution runs several at once); the
            # calls may come from its thread pool, so not necessarily in order.
            self.epoch_steps = max(self.epoch_steps, int(batch) + 1)
            now = self.clock()
            if self.first_batch_at is None:
                self.first_batch_at = now
            gap = max(BATCH_SECONDS, (now - self.first_batch_at) / BATCH_SPREAD)
            if self.last_batch_at is not None and now - self.last_batch_at < gap:
                return
            self.last_batch_at = now
            self._write("batch", self.steps_done + self.epoch_steps, logs)

    @_reporting
    def epoch_end(self, epoch: int, logs: dict[str, Any] | None, model: Any) -> None:
        with self.lock:
            self.epoch = int(epoch) + 1
            self.steps_done += self.epoch_steps
            self.epoch_steps = 0
            values = dict(logs or {})
            # A LearningRateScheduler or ReduceLROnPlateau already put the epoch's rate there.
            if "learning_rate" not in values:
                values["learning_rate"] = _learning_rate(model)
            self._write("epoch", self.steps_done, values)

    def _write(self, kind: str, step: int, logs: dict[str, Any] | None) -> None:
        record: dict[str, Any] = {"kind": kind, "epoch": self.epoch, "step": step}
        metrics = 0
        for name, value in (logs or {}).items():
            if metrics == MAX_METRICS:
                break
            if not isinstance(name, str) or name in _RESERVED or not 0 < len(name) <= MAX_NAME:
                continue
            try:
                record[name] = _number(value)
            except (TypeError, ValueError):
                continue
            metrics += 1
        line = f"{METRICS_PREFIX} {json.dumps(record, separators=(',', ':'), allow_nan=False)}\n".encode()
        if len(line) <= MAX_RECORD_BYTES:
            os.write(self.fd, line)


def _curves_callback(base: type, reporter: MetricsReporter) -> type:
    """A subclass of this Keras's Callback that hands every event to the reporter."""

    class PortalTrainingCurves(base):  # type: ignore[misc,valid-type]
        """Added to each fit() by the portal's launcher: reports the metrics for the job's page."""

        # Thread-safe: Keras may go on dispatching batch ends to its thread pool, as without us.
        async_safe = True

        def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            reporter.epoch_begin(epoch)

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            reporter.batch_end(batch, logs)

        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            reporter.epoch_end(epoch, logs, self.model)

    return PortalTrainingCurves


def _fit_with_curves(fit: Callable[..., Any], callback: type) -> Callable[..., Any]:
    """``Model.fit`` that appends one ``callback`` to the script's callbacks.

    The script's list itself is never changed (a list reused for a second fit() gets one callback again,
    not two), and a callbacks argument that is no list (a CallbackList) is left as it is.
    """
    signature = inspect.signature(fit)  # follows __wrapped__: Keras's traceback filter wraps fit

    @functools.wraps(fit)
    def fit_with_curves(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return fit(self, *args, **kwargs)  # a wrong call: Keras says what is wrong, as usual
        theirs = bound.arguments.get("callbacks")
        if theirs is None or isinstance(theirs, list | tuple):
            theirs = list(theirs or ())
            if not any(isinstance(each, callback) for each in theirs):
                theirs.append(callback())
            bound.arguments["callbacks"] = theirs
        return fit(*bound.args, **bound.kwargs)

    fit_with_curves._portal_wrapped = True  # type: ignore[attr-defined]
    return fit_with_curves


def add_training_curves(keras: ModuleType, reporter: MetricsReporter) -> None:
    """Wrap the public ``Model.fit`` of a Keras that has just been imported.

    On the public class (Keras 3: ``keras.Model``, over the backend trainer's fit), so that Sequential,
    functional models and the script's own subclasses inherit it; a subclass that overrides fit()
    comes through it with its super().fit().
    """
    model = getattr(keras, "Model", None)
    base = _resolve(keras, "callbacks.Callback")
    fit = getattr(model, "fit", None)
    if base is None or fit is None or getattr(fit, "_portal_wrapped", False):
        return
    if "callbacks" not in inspect.signature(fit).parameters:
        return
    model.fit = _fit_with_curves(fit, _curves_callback(base, reporter))  # type: ignore[union-attr]


def install_training_curves() -> None:
    """Report the metrics of every Keras fit(): now for a Keras already imported, else when it is.

    Before TensorFlow is imported: TensorFlow's own import imports Keras.
    """
    try:
        fd = os.dup(1)  # not inherited by the script's subprocesses
    except OSError:
        return  # no stdout: nowhere to report to
    reporter = MetricsReporter(fd)

    def add(keras: ModuleType) -> None:
        try:
            add_training_curves(keras, reporter)
        except Exception as exc:  # never break the user's import over the curves
            _err(f"no training curves: {type(exc).__name__}: {exc}")

    for name in KERAS_MODULES:
        if name in sys.modules:
            add(sys.modules[name])
        else:
            sys.meta_path.insert(0, ImportHook(name, add))


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
    guard_cuda_devices()
    job = _job(config)
    with open(script, "rb") as fh:
        source = fh.read()
    # Before TensorFlow is imported: its import must find what `python script.py` would find
    # (a sibling module of the script shadows an installed one, for TF's imports too).
    _put_script_first_on_path(script)
    sys.argv = [script, *argv[1:]]

    env = _env_summary()
    install_training_curves()
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
            sys.meta_path.insert(0, tensorflow_import_hook(config))

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
