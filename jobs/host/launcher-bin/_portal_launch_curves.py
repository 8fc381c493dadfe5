"""Keras's training metrics as ``[portal-metrics] {json}`` lines, for the job's page; part of launcher.py.

Standard library only (Keras is the script's, passed in): the job's interpreter may be any venv.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from _portal_launch_config import ImportHook, _err
from _portal_launch_tf import _resolve

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
