"""`make gpu-check` end to end on a fake GPU machine (tests/gpu_check_fakes/): the real check
(`python -m portal.gpu_check`) brings up the real portal (runportal, embedded Redis, Celery
workers) on a fake NVML, runs its jobs with fake PyTorch and JAX that allocate against that
NVML's process list, and compares with a fake nvidia-smi. Every check runs but TensorFlow's,
which this machine lacks, as the GPU machines the check is for may."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import OUTPUT, ROOT
from tests.fake_nvml import FakeCard

FAKES = ROOT / "tests" / "gpu_check_fakes"
CARD = {
    "name": "NVIDIA A100-SXM4-40GB",
    "memory_total_mib": 40960,
    "reserved_mib": 512,
    "base_used_mib": 0,
    "utilization": 3,
    "temperature": 41,
    "power_mw": 61_000,
}
NVIDIA_SMI = """#!{python}
import sys
import fake_gpu
held = fake_gpu.processes()
for card in fake_gpu.cards():
    used = card["base_used_mib"] + sum(n for _, n in held.get(card["uuid"], [])) // fake_gpu.MIB
    print(", ".join(str(v) for v in (card["uuid"], card["name"], card["memory_total_mib"], used,
          card["utilization"], card["temperature"], "%.2f" % (card["power_mw"] / 1000))))
"""
# The jobs' interpreter: the venv's Python with the fake frameworks and machine. A job's
# environment keeps nothing of the worker's PYTHONPATH (docs/jobs.md), so it is set here.
INTERPRETER = """#!/bin/sh
export PYTHONPATH={pythonpath} FAKE_GPU_DIR={state}
exec {python} "$@"
"""
STATUSES = {
    "NVML inventory vs nvidia-smi": "pass",
    "attribution: a PyTorch process on its card": "pass",
    "memory cap: PyTorch job": "pass",
    "memory cap: JAX job": "pass",
    "memory cap: TensorFlow job": "skip",
    "CUDA_VISIBLE_DEVICES by UUID (1 card)": "pass",
    "watchdog: an intruder on a booked card": "pass",
    "watchdog: the owner above their share": "pass",
    "gpu exec sees only the booked card": "pass",
    "a 2-card booking's job sees those two": "pass",
}


def _machine(tmp_path: Path) -> dict[str, str]:
    """The fake machine's folder, nvidia-smi and interpreter; the check's environment."""
    state = tmp_path / "machine"
    state.mkdir()
    cards = [{**CARD, "uuid": FakeCard(index).uuid} for index in range(2)]
    (state / "cards.json").write_text(json.dumps(cards))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pythonpath = f"{FAKES}:{ROOT}"
    for name, text in (("nvidia-smi", NVIDIA_SMI), ("python", INTERPRETER)):
        (bin_dir / name).write_text(text.format(python=sys.executable, pythonpath=pythonpath, state=state))
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PORTAL_", "JOB_", "PYTEST"))}
    return {
        **env,
        "PATH": f"{bin_dir}:{env['PATH']}",
        "PYTHONPATH": pythonpath,
        "FAKE_GPU_DIR": str(state),
        "JOB_INTERPRETERS": f"default={bin_dir / 'python'}",
        "WORKER_SERVER": "fakegpu",
    }


@pytest.mark.worker
def test_it_passes_every_check_on_a_fake_gpu_machine(tmp_path):
    report_path = tmp_path / "gpu-check-report.json"
    with open(OUTPUT / "gpu-check.log", "wb") as log:
        done = subprocess.run(
            [sys.executable, "-m", "portal.gpu_check", "--report", str(report_path)],
            cwd=ROOT,
            env=_machine(tmp_path),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    report = json.loads(report_path.read_text())
    said = {check["name"]: check["status"] for check in report["checks"]}
    # The rows that went wrong, whole (what the check expected and saw), before the log's tail:
    # the log's table is too wide to survive a CI page.
    wrong = [check for check in report["checks"] if check["status"] != STATUSES.get(check["name"])]
    assert said == STATUSES, (
        json.dumps(wrong, indent=1) + "\n" + (OUTPUT / "gpu-check.log").read_text()[-3000:]
    )
    assert done.returncode == 0
    assert report["result"] == "pass" and report["counts"] == {"pass": 9, "fail": 0, "skip": 1}
    skipped = next(c for c in report["checks"] if c["status"] == "skip")
    assert skipped["seen"].startswith(
        "skipped: no TensorFlow (ImportError: no TensorFlow on this fake GPU machine"
    )


def test_the_checks_venv_sees_the_frameworks_of_a_python_that_is_itself_a_venv(tmp_path):
    """A GPU image's python3 is often a venv (/opt/torch/.venv): a venv made from it with
    --system-site-packages reaches the base interpreter's packages, not its frameworks. This
    test's own Python is such a venv, and Django one of its packages."""
    from portal.gpu_check import bootstrap

    venv = tmp_path / "venv"
    made = [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv]
    subprocess.run(made, check=True)
    python = venv / "bin" / "python"
    probe = [python, "-c", "import django; print(django.__file__)"]
    assert subprocess.run(probe, capture_output=True).returncode != 0  # what the .pth is for
    bootstrap._see_this_pythons_packages(python)
    seen = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert seen.startswith(str(Path(sys.prefix)))
