"""The launcher's memory caps per framework, run as the worker runs it (see tests/test_launcher.py).

Neither PyTorch nor JAX is installed here. A stub `torch` on PYTHONPATH has just enough of `torch.cuda`
(device_count, _lazy_call, init, set_per_process_memory_fraction) and records every call of the setter,
so the tests see what the launcher asks of PyTorch, and when. No TensorFlow is imported by any test here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from jobs.host.launch import LAUNCHER
from tests.test_launcher import BOOKING, _job_env, env_only_line, launcher, portal_lines, write

BOOKED = "GPU-test-00,GPU-test-01,GPU-test-02"
SHARE = {**BOOKING, "memory_fraction": 0.3125}  # 7.5 GB of a 24 GB card
JAX_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3125"}
STUB_TORCH = {
    "__init__.py": """
        __version__ = "0.0-stub"
        from torch import cuda
        """,
    "cuda.py": '''
        """CUDA starts at init(), as at a script's first CUDA call, and runs what _lazy_call queued."""
        import json, os

        _queued = []
        _started = False


        def device_count():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
            return 0 if visible in ("", "-1") else len(visible.split(","))


        def _lazy_call(callable):
            if _started:
                callable()
            else:
                _queued.append(callable)


        def init():
            global _started
            _started = True
            for callable in _queued:
                callable()


        def set_per_process_memory_fraction(fraction, device=None):
            with open(os.environ["TORCH_STUB_LOG"], "a") as fh:
                fh.write(json.dumps([fraction, device]) + "\\n")
        ''',
}
# The script's view at its end, printed as its last line.
SEEN = """
import json as _json, sys as _sys
print("RESULT " + _json.dumps({name: name in _sys.modules for name in ("tensorflow", "torch", "keras")}))
"""


def run(
    tmp_path: Path,
    source: str,
    *,
    booking: dict[str, Any] = SHARE,
    env: dict[str, str] | None = None,
    helpers: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], dict[str, bool], list[list[Any]]]:
    """Launch `source` on a booking of three cards with the stub torch importable; return the result, what
    the script had imported at its end, and the stub's set_per_process_memory_fraction calls."""
    stubs, work = tmp_path / "stubs", tmp_path / "work"
    (stubs / "torch").mkdir(parents=True)
    work.mkdir()
    for name, text in STUB_TORCH.items():
        write(stubs / "torch" / name, text)
    for name, text in (helpers or {}).items():
        write(work / name, text)
    write(work / "job.py", textwrap.dedent(source) + SEEN)
    calls = tmp_path / "torch-calls.jsonl"
    result = subprocess.run(
        [sys.executable, "-u", str(LAUNCHER), "job.py"],
        cwd=work,
        env={
            **_job_env(BOOKED),
            launcher.CONFIG_VAR: json.dumps(booking),
            "PYTHONPATH": str(stubs),
            "TORCH_STUB_LOG": str(calls),
            "KERAS_HOME": str(tmp_path / "keras-home"),  # no keras.json of this machine's decides
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.split("RESULT ", 1)[1])
    logged = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return result, seen, logged


def test_it_caps_pytorch_on_every_booked_card_once_cuda_starts(tmp_path: Path) -> None:
    result, seen, calls = run(
        tmp_path,
        """
        import os
        import torch
        assert not os.path.exists(os.environ["TORCH_STUB_LOG"])  # importing torch starts no CUDA
        torch.cuda.init()
        torch.cuda.set_per_process_memory_fraction(0.9, 1)  # more than booked: capped
        torch.cuda.set_per_process_memory_fraction(0.1, 2)  # less: the script's choice
        torch.cuda.set_per_process_memory_fraction(0.95)  # said once
        """,
    )

    assert calls == [[0.3125, 0], [0.3125, 1], [0.3125, 2], [0.3125, 1], [0.1, 2], [0.3125, None]]
    assert seen == {"tensorflow": False, "torch": True, "keras": False}
    assert portal_lines(result.stdout) == [
        "[portal] launcher: job 12 · PyTorch: memory fraction 0.3125 per GPU, set when torch is imported",
        "[portal] launcher: job 12 · PyTorch 0.0-stub · memory fraction 0.3125 per GPU when CUDA starts · "
        "applied when PyTorch was imported",
    ]
    assert (
        "[portal] PyTorch 0.0-stub: memory fraction 0.3125 on 3 GPUs (set_per_process_memory_fraction)"
        in (result.stderr.splitlines())
    )
    assert result.stderr.count("asked by the script") == 1
    assert (
        "[portal] set_per_process_memory_fraction(0.9) asked by the script → 0.3125, the booking's share"
        in result.stderr
    )


def test_it_caps_pytorch_imported_indirectly_on_the_cards_the_script_kept(tmp_path: Path) -> None:
    """A library imports torch, and the script narrows CUDA_VISIBLE_DEVICES after that import: the cap
    comes from torch's import all the same, and covers the one card CUDA then starts on."""
    result, seen, calls = run(
        tmp_path,
        """
        import os
        import helper
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"
        helper.torch.cuda.init()
        """,
        helpers={"helper.py": "import torch\n"},
    )

    assert calls == [[0.3125, 0]]
    assert seen["torch"] and not seen["tensorflow"]
    first, applied = portal_lines(result.stdout)
    assert first == env_only_line(BOOKED)
    assert applied.endswith(
        "PyTorch 0.0-stub · memory fraction 0.3125 per GPU when CUDA starts · "
        "applied when PyTorch was imported"
    )
    assert "memory fraction 0.3125 on 1 GPU (set_per_process_memory_fraction)" in result.stderr


def test_it_leaves_pytorch_uncapped_on_cards_taken_whole(tmp_path: Path) -> None:
    result, _, calls = run(
        tmp_path,
        """
        import torch
        torch.cuda.init()
        torch.cuda.set_per_process_memory_fraction(0.9, 0)  # the card is the booking's: the script's choice
        """,
        booking=BOOKING,
    )

    assert calls == [[0.9, 0]]
    assert (
        portal_lines(result.stdout)[0]
        == "[portal] launcher: job 12 · PyTorch: no memory cap, set when torch is imported"
    )
    assert "asked by the script" not in result.stderr


def test_it_imports_no_framework_for_a_script_that_uses_none(tmp_path: Path) -> None:
    result, seen, calls = run(tmp_path, "import json, os\n", env=JAX_ENV)

    assert seen == {"tensorflow": False, "torch": False, "keras": False}
    assert calls == []
    assert portal_lines(result.stdout) == [
        "[portal] launcher: job 12 · no TensorFlow, PyTorch or JAX import in the script: settings via "
        f"environment only (CUDA_VISIBLE_DEVICES={BOOKED}, TF_FORCE_GPU_ALLOW_GROWTH unset, "
        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.3125, XLA_PYTHON_CLIENT_PREALLOCATE=false)"
    ]


JAX_LINE = "JAX: XLA_PYTHON_CLIENT_MEM_FRACTION=0.3125, XLA_PYTHON_CLIENT_PREALLOCATE=false"
TORCH_LINE = "PyTorch: memory fraction 0.3125 per GPU, set when torch is imported"


@pytest.mark.parametrize(
    ("chosen_by", "backend", "line"),
    [
        ("env", "jax", JAX_LINE),
        ("env", "torch", TORCH_LINE),
        ("keras.json", "jax", JAX_LINE),
        ("script", "jax", JAX_LINE),
    ],
)
def test_it_never_imports_tensorflow_for_keras_on_another_backend(
    tmp_path: Path, chosen_by: str, backend: str, line: str
) -> None:
    """Keras 3 on JAX or PyTorch gets that framework's cap, and TensorFlow is never imported for it (Keras
    itself is not called here: it would need the real JAX or PyTorch)."""
    env = dict(JAX_ENV)
    source = "def train():\n    import keras\n"
    (tmp_path / "keras-home").mkdir()
    if chosen_by == "env":
        env["KERAS_BACKEND"] = backend
    elif chosen_by == "keras.json":
        write(tmp_path / "keras-home" / "keras.json", json.dumps({"backend": backend}))
    else:
        env["KERAS_BACKEND"] = "tensorflow"  # the script's own choice wins, as in Python
        source = f'import os\nos.environ["KERAS_BACKEND"] = "{backend}"\n{source}'

    result, seen, _ = run(tmp_path, source, env=env)

    assert seen == {"tensorflow": False, "torch": False, "keras": False}
    assert portal_lines(result.stdout) == [f"[portal] launcher: job 12 · {line}"]


def test_it_says_what_it_applied_for_each_framework_a_script_uses(tmp_path: Path) -> None:
    result, seen, _ = run(tmp_path, "def later():\n    import torch, jax\n", env=JAX_ENV)

    assert not seen["torch"]
    assert portal_lines(result.stdout) == [f"[portal] launcher: job 12 · {TORCH_LINE} · {JAX_LINE}"]


def test_it_says_when_jax_gets_no_cap(tmp_path: Path) -> None:
    result, _, _ = run(tmp_path, "def later():\n    import jax\n", booking=BOOKING)

    assert portal_lines(result.stdout) == [
        "[portal] launcher: job 12 · JAX: no memory cap (its default: 75 % of each card)"
    ]


# --- apply_torch in this process, on objects with PyTorch's names -----------------------------------


def _torch(**cuda: Any) -> SimpleNamespace:
    return SimpleNamespace(__version__="9.9", cuda=SimpleNamespace(**cuda))


def test_it_caps_at_once_a_pytorch_that_cannot_queue_for_cudas_start() -> None:
    calls: list[tuple[float, int | None]] = []
    torch = _torch(
        device_count=lambda: 2, set_per_process_memory_fraction=lambda f, d=None: calls.append((f, d))
    )

    summary = launcher.apply_torch(torch, {**launcher.DEFAULTS, "memory_fraction": 0.25})

    assert summary == "PyTorch 9.9 · memory fraction 0.25 per GPU (applied at import)"
    assert calls == [(0.25, 0), (0.25, 1)]


def test_a_failing_cap_never_raises_into_the_scripts_first_cuda_call(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_driver() -> int:
        raise RuntimeError("Found no NVIDIA driver on your system")

    queued: list[Any] = []
    torch = _torch(device_count=no_driver, set_per_process_memory_fraction=print, _lazy_call=queued.append)
    launcher.apply_torch(torch, {**launcher.DEFAULTS, "memory_fraction": 0.25})

    (cap,) = queued
    cap()  # as torch.cuda's lazy init runs it

    assert (
        "[portal] could not cap PyTorch's GPU memory: RuntimeError: Found no NVIDIA driver"
        in capsys.readouterr().err
    )


def test_it_says_so_when_pytorch_has_no_setter() -> None:
    summary = launcher.apply_torch(_torch(), {**launcher.DEFAULTS, "memory_fraction": 0.25})
    assert (
        summary == "PyTorch 9.9 · NOT APPLIED: this PyTorch has no torch.cuda.set_per_process_memory_fraction"
    )
