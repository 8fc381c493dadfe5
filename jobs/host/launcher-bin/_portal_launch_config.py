"""The launcher's configuration, which frameworks a script uses, the import hook, and the guard on
CUDA_VISIBLE_DEVICES; part of launcher.py, which loads it.

Standard library only, as launcher.py: the job's interpreter may be any venv. launcher.py's docstring says
why this file is loaded by path and named as no user module or library is.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

CONFIG_VAR = "PORTAL_LAUNCH_CONFIG"
PREFIX = "[portal]"

TENSORFLOW, TORCH, JAX = "tensorflow", "torch", "jax"
# What importing a package means for the caps. Keras 2 (tf_keras) runs on TensorFlow only; Keras 3
# (keras) on its backend, see frameworks_used.
FRAMEWORK_ROOTS = {"tensorflow": TENSORFLOW, "tf_keras": TENSORFLOW, "torch": TORCH, "jax": JAX, "flax": JAX}
# Keras 3's backends that hold the GPU ("numpy" and "openvino" hold none); TensorFlow is its default.
KERAS_BACKENDS = {"tensorflow": TENSORFLOW, "torch": TORCH, "jax": JAX}
KERAS_BACKEND_VAR = "KERAS_BACKEND"
# What JAX reads (jobs/environment.py sets them): it is capped from the environment alone.
JAX_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")

DEFAULTS: dict[str, Any] = {
    "job_id": None,
    "session_id": None,  # `gpu exec` and JupyterLab sessions (jobs.sessions.services): no job, a session
    "memory_limit_mb": None,
    "allow_growth": True,
    "memory_fraction": None,  # of each card's total memory: TF1 sessions and PyTorch
    "intra_op_threads": None,
    "inter_op_threads": None,
    "soft_placement": True,
    "log_placement": False,
    "mirrored": False,
}
_BOOL_KEYS = ("allow_growth", "soft_placement", "log_placement", "mirrored")


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

    for key in ("job_id", "session_id"):
        if config[key] is not None and not is_int(config[key]):
            raise bad(key, "an integer")
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


def frameworks_used(source: bytes, keras_backend: str | None) -> frozenset[str]:
    """The GPU frameworks the script imports anywhere (functions included), as TENSORFLOW, TORCH, JAX.

    ``import keras`` counts as its backend's: ``keras_backend`` (KERAS_BACKEND, else keras.json: see
    configured_keras_backend), unless the script sets KERAS_BACKEND to a literal itself (as Keras's own
    examples do, before they import it); TensorFlow when neither says, as Keras 3 defaults to it. A
    backend that holds no GPU (numpy, openvino) or that Keras does not know adds nothing.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return frozenset()  # runpy reports the SyntaxError itself, with the normal traceback
    used: set[str] = set()
    keras = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            keras_backend = _set_keras_backend(node) or keras_backend
            continue
        for module in modules:
            root = module.split(".")[0]
            keras = keras or root == "keras"
            if root in FRAMEWORK_ROOTS:
                used.add(FRAMEWORK_ROOTS[root])
    if keras and (keras_backend or TENSORFLOW) in KERAS_BACKENDS:
        used.add(KERAS_BACKENDS[keras_backend or TENSORFLOW])
    return frozenset(used)


def _set_keras_backend(node: ast.AST) -> str | None:
    """The backend a script sets as a literal: ``os.environ["KERAS_BACKEND"] = "jax"``, or
    ``os.environ.setdefault("KERAS_BACKEND", "jax")``."""
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
        for target in node.targets:
            if isinstance(target, ast.Subscript) and _is_constant(target.slice, KERAS_BACKEND_VAR):
                return node.value.value if isinstance(node.value.value, str) else None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "setdefault"
        and len(node.args) == 2
        and _is_constant(node.args[0], KERAS_BACKEND_VAR)
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def _is_constant(node: ast.AST, value: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == value


def configured_keras_backend() -> str | None:
    """Keras 3's backend as it would choose it: KERAS_BACKEND, else ``backend`` in its keras.json."""
    if os.environ.get(KERAS_BACKEND_VAR):
        return os.environ[KERAS_BACKEND_VAR]
    # Where Keras 3 looks (keras/src/backend/config.py): KERAS_HOME, else ~/.keras (/tmp/.keras when
    # the home folder is not writable).
    home = os.path.expanduser("~")
    base = home if os.access(home, os.W_OK) else "/tmp"
    folder = os.environ.get("KERAS_HOME") or os.path.join(base, ".keras")
    try:
        with open(os.path.join(folder, "keras.json"), encoding="utf-8") as fh:
            backend = json.load(fh).get("backend")
    except (OSError, ValueError, AttributeError):
        return None  # none, unreadable, or no object: Keras falls back to its default as well
    return backend if isinstance(backend, str) else None


def _env_summary() -> str:
    parts = []
    for name in ("CUDA_VISIBLE_DEVICES", "TF_FORCE_GPU_ALLOW_GROWTH", *JAX_VARS):
        value = os.environ.get(name)
        parts.append(f"{name}={value}" if value is not None else f"{name} unset")
    return ", ".join(parts)


def jax_summary() -> str:
    """What JAX gets: the environment the worker set, read when JAX starts its GPU backend."""
    caps = [f"{name}={os.environ[name]}" for name in JAX_VARS if name in os.environ]
    return f"JAX: {', '.join(caps)}" if caps else "JAX: no memory cap (its default: 75 % of each card)"


def _job(config: dict[str, Any]) -> str:
    """What runs, for the launcher's lines: "job 12", "session 4", or "job ?" (no id given)."""
    if config["job_id"] is None and config["session_id"] is not None:
        return f"session {config['session_id']}"
    return f"job {config['job_id'] if config['job_id'] is not None else '?'}"


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


Applier = Callable[[ModuleType, dict[str, Any]], str]  # a framework's settings applied; says which


def settings_hook(
    module: str, framework: str, apply: Applier, config: dict[str, Any], when: str
) -> ImportHook:
    """An ImportHook that applies a framework's settings right after ``import <module>``
    (`apply` returns what it applied) and says so; it never breaks the user's import over them."""

    def then(imported: ModuleType) -> None:
        try:
            summary = apply(imported, config)
        except Exception as exc:
            _err(f"could not apply the booking's {framework} settings: {type(exc).__name__}: {exc}")
            return
        _say(f"{_job(config)} · {summary} · {when}")

    return ImportHook(module, then)


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
