"""Job launcher: applies a booking's framework settings, then runs the user's script as ``__main__``.

The worker runs this file directly with the job's own interpreter (which may be another venv or conda env
without this project on ``sys.path``)::

    <interpreter> -u /abs/path/jobs/launcher-bin/launcher.py <script.py> [args...]

so it imports nothing from the project and only the standard library at import time. The configuration
comes as JSON in ``PORTAL_LAUNCH_CONFIG`` (see ``DEFAULTS``); a missing or invalid value exits with code 2.
Which frameworks the script uses comes from its imports (found with ``ast``) and, for Keras 3, its backend
(``frameworks_used``). Each is capped at the booking:

- TensorFlow (also Keras on its TensorFlow backend, and Keras 2): imported before the script runs when the
  script imports it, and configured with ``tf.config.*``; otherwise a ``sys.meta_path`` hook applies the
  settings if TensorFlow is imported indirectly later. Nothing imports TensorFlow for a Keras on another
  backend.
- PyTorch: a ``sys.meta_path`` hook, whoever imports torch, queues the cap to run when CUDA starts.
- JAX: by the environment alone (XLA_PYTHON_CLIENT_*, set by the worker); nothing runs in the process.

Whatever the script then sets ``CUDA_VISIBLE_DEVICES`` to, it stays on the booked cards the worker put there
(see ``CudaDevices``). When the script imports Keras, every ``fit()`` also reports its metrics for the job's
page, as ``[portal-metrics] {json}`` lines (see ``MetricsReporter``).

The launcher is this file and its own modules beside it (``SIBLINGS``): ``_portal_launch_config`` (the
configuration, which frameworks a script uses, the import hook and the CUDA_VISIBLE_DEVICES guard),
``_portal_launch_tf`` (the TensorFlow settings), ``_portal_launch_torch`` (the PyTorch cap) and
``_portal_launch_curves`` (the training curves). They too use the standard library only, and the job's
account reads them as it reads this file.

Python puts this file's folder first on ``sys.path``. That folder is not a package (its name is not even
an identifier) and holds nothing but the launcher's files, whose names no user module or library has, so
no project module can shadow the standard library's or the user's; before TensorFlow is imported and the
script runs, the script's own folder takes that first place, as with ``python script.py``. So the modules
are loaded before that swap, and by path from this file's folder, not looked up on ``sys.path``: nothing
of the user's can stand in for them, even where ``-P`` or ``PYTHONSAFEPATH`` keeps the folder off the
path. They are in ``sys.modules`` only while they load, under their own names (for their imports of one
another), so a module of the user's named like one of them is imported from the user's folder as usual.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from types import TracebackType
from typing import Any

# In import order.
SIBLINGS = ("_portal_launch_config", "_portal_launch_tf", "_portal_launch_torch", "_portal_launch_curves")


def _load_siblings() -> None:
    """Load the launcher's modules from this file's folder into ``sys.modules``; see the docstring."""
    here = os.path.dirname(os.path.realpath(__file__))
    writes = sys.dont_write_bytecode
    # Compiled at each start, as this file is: the folder stays as deployed, with no __pycache__ in it.
    sys.dont_write_bytecode = True
    try:
        for name in SIBLINGS:
            spec = importlib.util.spec_from_file_location(name, os.path.join(here, f"{name}.py"))
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # before it runs, as an import does: the next sibling imports it
            spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = writes


_load_siblings()
from _portal_launch_config import (  # noqa: E402
    CONFIG_VAR,
    CUDA_VAR,
    DEFAULTS,
    FRAMEWORK_ROOTS,
    JAX,
    KERAS_BACKENDS,
    NO_GPU,
    PREFIX,
    TENSORFLOW,
    TORCH,
    CudaDevices,
    ImportHook,
    LaunchError,
    _env_summary,
    _err,
    _job,
    _say,
    configured_keras_backend,
    frameworks_used,
    guard_cuda_devices,
    jax_summary,
    load_config,
)
from _portal_launch_curves import (  # noqa: E402
    BATCH_SECONDS,
    BATCH_SPREAD,
    KERAS_MODULES,
    MAX_METRICS,
    MAX_NAME,
    MAX_RECORD_BYTES,
    METRICS_PREFIX,
    MetricsReporter,
    add_training_curves,
    install_training_curves,
)
from _portal_launch_tf import apply_tensorflow, tensorflow_import_hook  # noqa: E402
from _portal_launch_torch import apply_torch, torch_import_hook  # noqa: E402

# Out of sys.modules again: a module of the user's named like one of them is the user's (see the docstring).
for _name in SIBLINGS:
    sys.modules.pop(_name, None)
del _name

# The public names of the launcher as one file, as before: tests and readers find them all here.
__all__ = [
    "BATCH_SECONDS",
    "BATCH_SPREAD",
    "CONFIG_VAR",
    "CUDA_VAR",
    "DEFAULTS",
    "FRAMEWORK_ROOTS",
    "JAX",
    "KERAS_BACKENDS",
    "KERAS_MODULES",
    "MAX_METRICS",
    "MAX_NAME",
    "MAX_RECORD_BYTES",
    "METRICS_PREFIX",
    "NO_GPU",
    "PREFIX",
    "SIBLINGS",
    "TENSORFLOW",
    "TORCH",
    "CudaDevices",
    "ImportHook",
    "LaunchError",
    "MetricsReporter",
    "add_training_curves",
    "apply_tensorflow",
    "apply_torch",
    "configured_keras_backend",
    "frameworks_used",
    "guard_cuda_devices",
    "install_training_curves",
    "jax_summary",
    "load_config",
    "main",
    "prepare",
    "tensorflow_import_hook",
    "torch_import_hook",
]


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


def _apply(config: dict[str, Any], used: frozenset[str]) -> str:
    """Apply the booking for the frameworks the script uses, and hook the rest; the launcher line's text."""
    parts = []
    if TENSORFLOW in used:
        try:
            import tensorflow as tf
        except ImportError:
            parts.append(
                f"TensorFlow is not installed in this interpreter ({sys.executable}): "
                f"settings via environment only ({_env_summary()})"
            )
        else:
            parts.append(apply_tensorflow(tf, config))
    elif "tensorflow" not in sys.modules:
        sys.meta_path.insert(0, tensorflow_import_hook(config))
    # Imported directly or not, torch gets its cap from its import: nothing to import for it here.
    sys.meta_path.insert(0, torch_import_hook(config))
    if TORCH in used:
        fraction = config["memory_fraction"]
        cap = f"memory fraction {fraction:g} per GPU" if fraction is not None else "no memory cap"
        parts.append(f"PyTorch: {cap}, set when torch is imported")
    if JAX in used:
        parts.append(jax_summary())
    if not used:
        return "no TensorFlow, PyTorch or JAX import in the script: " + (
            f"settings via environment only ({_env_summary()})"
        )
    return " · ".join(parts)


def main(argv: list[str]) -> int:
    if os.environ.get("PORTAL_IMAGE"):
        # In a container Podman's conmon relays stdout and stderr as two streams, which reorders
        # lines printed to each in turn; one stream keeps them as printed, as on the host, where
        # both are one pipe already.
        os.dup2(1, 2)
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

    used = frameworks_used(source, configured_keras_backend())
    install_training_curves()
    image = os.environ.get("PORTAL_IMAGE")  # set by the worker for a job in a container image
    _say(f"{job}{f' · in image {image}' if image else ''} · {_apply(config, used)}")

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
